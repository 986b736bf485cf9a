"""Build script: Cython extensions with OpenMP when the compiler has it.

Build switches (environment variables read at build time):

``CPOSEMBED_DISABLE_OPENMP=1``
    build serial extensions even if the compiler supports OpenMP.
``CPOSEMBED_NATIVE=1``
    add ``-march=native`` (a local build tuned to this CPU; not portable).
``CPOSEMBED_DEBUG=1``
    turn Cython's bounds and wraparound checks back on and keep debug info.
``CPOSEMBED_SANITIZE=address,undefined``
    build with the given ``-fsanitize=`` list (see ``tools/sanitize.sh``).

The OpenMP decision follows scikit-learn's ``_build_utils/openmp_helpers.py``:
compile, link *and run* a tiny ``#pragma omp parallel`` program with the
compiler that will build the extension; if any step fails, warn and build
serially. A serial build is a working build (``cposembed.openmp_enabled()``
is then False), never a failed one.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _cython_version():
    import Cython

    return Cython.__version__


def _env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


DEBUG = _env_flag("CPOSEMBED_DEBUG")
SANITIZE = os.environ.get("CPOSEMBED_SANITIZE", "").strip()

# All Cython directives live here, not in the .pyx files.
COMPILER_DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": not DEBUG,
    "nonecheck": False,
    "embedsignature": True,
    # No `__test__` doctest dict and no pickling helpers for cdef classes
    # (they own raw pointers): nothing in the modules that a stub must list.
    "autotestdict": False,
    "auto_pickle": False,
}

OPENMP_PROBE = textwrap.dedent(
    """\
    #include <omp.h>
    #include <stdio.h>
    int main(void) {
        int n = 0;
        #pragma omp parallel reduction(+:n)
        n += 1;
        printf("%d\\n", n);
        return n > 0 ? 0 : 1;
    }
    """
)


def _openmp_flags(compiler):
    """(compile_args, link_args) that enable OpenMP for this compiler."""
    ctype = getattr(compiler, "compiler_type", "unix")
    if ctype == "msvc":
        return ["/openmp"], []
    if sys.platform == "darwin":
        # Apple clang needs the preprocessor route and Homebrew/conda libomp.
        return ["-Xpreprocessor", "-fopenmp"], ["-lomp"]
    return ["-fopenmp"], ["-fopenmp"]


def _probe_openmp(compiler, compile_args, link_args):
    """True if a tiny OpenMP program compiles, links and runs."""
    tmp = tempfile.mkdtemp(prefix="cposembed-omp-")
    cwd = os.getcwd()
    try:
        os.chdir(tmp)
        with open("probe.c", "w") as f:
            f.write(OPENMP_PROBE)
        objects = compiler.compile(["probe.c"], extra_postargs=compile_args)
        exe = "probe" + (".exe" if sys.platform == "win32" else "")
        compiler.link_executable(objects, "probe", extra_postargs=link_args)
        out = subprocess.run([os.path.join(tmp, exe)], capture_output=True, text=True, timeout=60)
        return out.returncode == 0 and int(out.stdout.strip() or 0) >= 1
    except Exception:  # any compile/link/run failure means "no OpenMP"
        return False
    finally:
        os.chdir(cwd)
        shutil.rmtree(tmp, ignore_errors=True)


def _compiler_version(compiler):
    """First line of ``<cc> --version`` (for show_config), or ""."""
    exe = (getattr(compiler, "compiler_so", None) or [None])[0]
    if not exe:
        return ""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (out.stdout.splitlines() or [""])[0].strip()


BUILD_SWITCHES = (
    "CPOSEMBED_DISABLE_OPENMP",
    "CPOSEMBED_NATIVE",
    "CPOSEMBED_DEBUG",
    "CPOSEMBED_SANITIZE",
)


class BuildExtOpenMP(build_ext):
    """build_ext that adds OpenMP and optimisation flags after probing."""

    def build_extensions(self):
        compile_args, link_args = [], []
        msvc = getattr(self.compiler, "compiler_type", "") == "msvc"

        if _env_flag("CPOSEMBED_DISABLE_OPENMP"):
            print("cposembed: CPOSEMBED_DISABLE_OPENMP is set: building serially")
            use_openmp = False
        else:
            omp_c, omp_l = _openmp_flags(self.compiler)
            use_openmp = _probe_openmp(self.compiler, omp_c, omp_l)
            if use_openmp:
                compile_args += omp_c
                link_args += omp_l
            else:
                warnings.warn(
                    "cposembed: this compiler cannot build and run an OpenMP "
                    "program; building a serial extension (everything works, "
                    "on one thread). Install an OpenMP runtime (e.g. libgomp, "
                    "libomp) and rebuild for multithreading.",
                    stacklevel=1,
                )

        if msvc:
            compile_args += ["/O2"]
        else:
            # -O3 for the vectorised row loops; never -ffast-math: the kernels
            # must add in exactly the reference's order and precision.
            # -ffp-contract=off: no fused multiply-add, so `a - lr * g` rounds
            # twice, exactly as NumPy's separate multiply and subtract do.
            compile_args += ["-O3", "-fno-math-errno", "-ffp-contract=off"]
            compile_args += ["-g", "-O1"] if DEBUG else ["-g0"]
            if _env_flag("CPOSEMBED_NATIVE"):
                compile_args += ["-march=native"]
            if SANITIZE:
                san = [f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer"]
                compile_args += san
                link_args += san
            if not DEBUG and not SANITIZE and sys.platform.startswith("linux"):
                link_args += ["-s"]  # no debug symbols in the shipped .so

        build_info = {
            "openmp": use_openmp,
            "compile_args": compile_args,
            "link_args": link_args,
            "compiler": " ".join(getattr(self.compiler, "compiler_so", []) or [])
            or getattr(self.compiler, "compiler_type", "unknown"),
            "cython_directives": COMPILER_DIRECTIVES,
            "compiler_version": _compiler_version(self.compiler),
            "cython_version": _cython_version(),
            "switches": {k: os.environ[k] for k in BUILD_SWITCHES if os.environ.get(k)},
        }
        for ext in self.extensions:
            ext.extra_compile_args = list(ext.extra_compile_args) + compile_args
            ext.extra_link_args = list(ext.extra_link_args) + link_args
        self._write_build_info(build_info)
        super().build_extensions()

    def run(self):
        # setuptools clears `inplace` while building (it builds in build_lib,
        # then copies to the source tree); remember it for _write_build_info.
        self._to_source = bool(self.inplace)
        super().run()

    def _write_build_info(self, info):
        """Record the flags so ``show_config()`` can report them.

        Always in build_lib (what a wheel ships); also in the source tree for
        in-place and editable builds, which import cposembed/ from there. If
        they differ from the last build's in build_lib, rebuild every
        extension: setuptools only compares timestamps there, so toggling e.g.
        CPOSEMBED_DISABLE_OPENMP would otherwise reuse the old objects.
        """
        text = f"# Generated by setup.py at build time.\nBUILD_INFO = {info!r}\n"
        paths = [os.path.join(self.build_lib, "cposembed", "_build_info.py")]
        if getattr(self, "_to_source", False):
            paths.append(os.path.join("cposembed", "_build_info.py"))
        try:
            with open(paths[0]) as f:
                self.force = self.force or f.read() != text
        except OSError:
            self.force = True
        for path in paths:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)


def _directives_changed():
    """True if the Cython directives differ from the last cythonize run here.

    cythonize only compares timestamps, so a build with CPOSEMBED_DEBUG
    toggled would otherwise keep the .c files generated with the old checks.
    """
    stamp = os.path.join("build", "cython-directives.txt")
    text = repr(sorted(COMPILER_DIRECTIVES.items()))
    try:
        with open(stamp) as f:
            if f.read() == text:
                return False
    except OSError:
        pass
    os.makedirs(os.path.dirname(stamp), exist_ok=True)
    with open(stamp, "w") as f:
        f.write(text)
    return True


# Sources generated from templates (Cython's Tempita, as scikit-learn's and
# pandas' `.tp` / `.in` files): one body for every element type.
TEMPLATES = ["src_c/_rows.h.tp"]


def _generate_templates():
    """Write each template's expansion beside it (only when it changed, so that
    an unchanged build stays up to date)."""
    from Cython import Tempita

    for template in TEMPLATES:
        target = template[: -len(".tp")]
        with open(template) as f:
            text = Tempita.sub(f.read())
        try:
            with open(target) as f:
                if f.read() == text:
                    continue
        except OSError:
            pass
        with open(target, "w") as f:
            f.write(text)


_generate_templates()

EXTENSIONS = [
    # The one checked C entry per operation and the kernels behind them, on
    # NumPy's C API: built against NumPy 2.x headers, it runs on NumPy >= 1.24
    # (NPY_TARGET_VERSION).
    Extension(
        "cposembed._core",
        ["src_c/_core.pyx"],
        include_dirs=["src_c", numpy.get_include()],
        depends=[
            "src_c/_stream.h",
            "src_c/_half.h",
            "src_c/_rows.h.tp",
            "src_c/_rows.h",
            "src_c/_openmp.pxd",
            "src_c/_kernels.pxi",
            "src_c/cposembed/_blocks.pxd",
            "src_c/_index.pxi",
            "src_c/_parallel.pxi",
            "src_c/_threads.h",
            "src_c/cposembed/_marks.pxd",
            "src_c/_contract.pxi",
        ],
        define_macros=[
            ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
            ("NPY_TARGET_VERSION", "NPY_1_24_API_VERSION"),
        ],
    ),
    # The one allocator (src_c/_blocks.h, included here only): large outputs,
    # the entries' scratch, zeroed tables; cimported by _core through
    # src_c/cposembed/_blocks.pxd.
    Extension(
        "cposembed._blocks",
        ["src_c/cposembed/_blocks.pyx"],
        include_dirs=["src_c", numpy.get_include()],
        depends=["src_c/_blocks.h"],
        define_macros=[
            ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
            ("NPY_TARGET_VERSION", "NPY_1_24_API_VERSION"),
        ],
    ),
    # The rows a call touches (RowMarks, RowSlots, the distinct rows of a
    # call), cimported by _core through src_c/cposembed/_marks.pxd.
    Extension(
        "cposembed._marks",
        ["src_c/cposembed/_marks.pyx"],
        include_dirs=[numpy.get_include()],
        define_macros=[
            ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
            ("NPY_TARGET_VERSION", "NPY_1_24_API_VERSION"),
        ],
    ),
    # Machine-limit probes (streaming fill/copy, read-only sum) for the bench.
    Extension(
        "cposembed._membench",
        ["src_c/_membench.pyx"],
        include_dirs=["src_c"],
        depends=["src_c/_stream.h", "src_c/_openmp.pxd"],
    ),
]

setup(
    ext_modules=cythonize(
        EXTENSIONS,
        compiler_directives=COMPILER_DIRECTIVES,
        include_path=["src_c"],
        force=_directives_changed(),
    ),
    cmdclass={"build_ext": BuildExtOpenMP},
)
