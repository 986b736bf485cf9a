"""Check the documentation: every code block runs, every public name is documented.

    python tools/check_docs.py            # all checks, from the repository root
    python tools/check_docs.py --strict   # CI: optional modules (torch, matplotlib) must be there
    python tools/check_docs.py README.md  # only the code blocks of these files

What it runs, each in a fresh namespace and a fresh temporary folder:

- every fenced ```python / ```pycon block of README.md and docs/**/*.md, and every
  ``.. code-block:: python`` of docs/**/*.rst: a block with ``>>>`` prompts runs as
  a doctest (its output must match), any other runs as a script (it must not raise);
- the ``$ python ...`` commands of ```console blocks, whose output must match what
  the block shows (``...`` stands for anything, as in doctests);
- the ``>>>`` examples of the public API's docstrings (the API reference's source);
- every examples/*.py, as its own process.

Blocks in other languages (bash, text, toml, MyST directives) are not run;
a fence without a language is an error, so nothing meant to run can slip through
unlabelled. Besides, it checks that the README's Quick start is the one .ci/run
runs, that the README stays within 200 lines, that every public name is in the
README's "API at a glance", that docs/api.rst has an autodoc entry for every public
name (``cposembed.__all__``, ``cposembed.plot.__all__``, the classes' members, and
``cposembed.torch.__all__`` when torch is importable), that no code line of docs/
is longer than 88 characters (the HTML column), and that the README's performance
table is what tools/perf_table.py makes of docs/readme_perf.json.

The package must be importable (an install, or ``python setup.py build_ext
--inplace`` in a checkout: the repository root goes first on ``sys.path``). Ends
with the line "N passed, N failed" and exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import contextlib
import doctest
import importlib.util
import inspect
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_LANGUAGES = {"python", "py", "pycon"}
# ```console blocks: "$ python ..." lines run, and the output shown must match
# (``...`` stands for anything, as in doctests). Other commands are not run.
CONSOLE = "console"
# Imported by some blocks and examples, not required by the package.
OPTIONAL_MODULES = ("torch", "matplotlib", "threadpoolctl", "transformers")
README_MAX_LINES = 200
# Code lines beyond this are cut off in the narrow column of the HTML pages.
CODE_LINE_MAX = 88
EXAMPLE_TIMEOUT_S = 300
QUICKSTART_BEGIN = "# --- Quick start (keep identical to README.md) ---"
QUICKSTART_END = "# --- end Quick start ---"


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the block's first code line
    language: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


# -- finding blocks ------------------------------------------------------------

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def markdown_blocks(path: Path) -> Iterator[Block]:
    """Fenced code blocks of a Markdown file, indentation (lists) removed."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        info = m["info"].strip()
        language = info.split()[0] if info else ""
        start = i + 1
        i += 1
        body: list[str] = []
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if (
                close
                and close["fence"].startswith(fence[0] * len(fence))
                and not close["info"].strip()
            ):
                break
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        else:
            raise SystemExit(f"{path}:{start}: code fence never closed")
        i += 1
        yield Block(path, start + 1, language, "\n".join(body) + "\n")


_RST_DIRECTIVE = re.compile(r"^(?P<indent>\s*)\.\. (code-block|code|sourcecode)::\s*(?P<lang>\S*)")


def rst_blocks(path: Path) -> Iterator[Block]:
    """``.. code-block:: LANG`` blocks of a reStructuredText file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        m = _RST_DIRECTIVE.match(line)
        if not m:
            continue
        base = len(m["indent"])
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or lines[j].lstrip().startswith(":")):
            j += 1  # blank lines and directive options
        body: list[str] = []
        first = j
        while j < len(lines) and (
            not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > base
        ):
            body.append(lines[j])
            j += 1
        text = "\n".join(body).rstrip() + "\n"
        width = min((len(b) - len(b.lstrip()) for b in body if b.strip()), default=0)
        code = "\n".join(b[width:] for b in text.splitlines()) + "\n"
        yield Block(path, first + 1, m["lang"], code)


def doc_files() -> list[Path]:
    docs = ROOT / "docs"
    files = [ROOT / "README.md"]
    files += sorted(p for p in docs.rglob("*.md") if "_build" not in p.parts)
    files += sorted(p for p in docs.rglob("*.rst") if "_build" not in p.parts)
    return files


def blocks_of(path: Path) -> list[Block]:
    return list(rst_blocks(path) if path.suffix == ".rst" else markdown_blocks(path))


# -- running -------------------------------------------------------------------


class Missing(Exception):
    """An optional module that a block or example needs is not installed."""


@contextlib.contextmanager
def in_temp_dir() -> Iterator[Path]:
    old = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="cposembed-docs-") as tmp:
        os.chdir(tmp)
        try:
            yield Path(tmp)
        finally:
            os.chdir(old)


_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def run_doctest(text: str, globs: dict, name: str, filename: str, lineno: int) -> str | None:
    """Run ``>>>`` examples; the failure report, or None when they pass."""
    test = doctest.DocTestParser().get_doctest(text, globs, name, filename, lineno)
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=_FLAGS)
    runner.run(test, out=report.write, clear_globs=True)
    return report.getvalue() if runner.failures else None


def _missing_optional(exc: BaseException) -> str | None:
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        root = exc.name.split(".")[0]
        if root in OPTIONAL_MODULES:
            return root
    return None


def run_block(block: Block) -> None:
    """Run one block in a fresh namespace; raise on failure, Missing if skipped."""
    globs: dict = {"__name__": "__main__"}
    with in_temp_dir():
        if re.search(r"^\s*>>> ", block.code, re.M):
            for module in OPTIONAL_MODULES:
                if re.search(rf"^\s*>>> (import|from) {module}\b", block.code, re.M):
                    if importlib.util.find_spec(module) is None:
                        raise Missing(module)
            failure = run_doctest(block.code, globs, block.where, str(block.path), block.line - 1)
            if failure:
                raise AssertionError(failure)
            return
        code = compile(block.code, block.where, "exec")
        try:
            exec(code, globs)
        except ModuleNotFoundError as exc:
            module = _missing_optional(exc)
            if module:
                raise Missing(module) from exc
            raise


def _child_env() -> dict[str, str]:
    """The environment of a command or example: this checkout's package first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("MPLBACKEND", "Agg")
    return env


def run_console(block: Block) -> None:
    """Run the ``$ python ...`` commands of a console block; compare their output."""
    commands: list[tuple[str, list[str]]] = []
    for line in block.code.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line)
    checker = doctest.OutputChecker()
    with in_temp_dir():
        for command, shown in commands:
            argv = shlex.split(command)
            if argv[0] != "python":
                continue
            proc = subprocess.run(
                [sys.executable, *argv[1:]],
                capture_output=True,
                text=True,
                env=_child_env(),
                timeout=EXAMPLE_TIMEOUT_S,
            )
            if proc.returncode != 0:
                raise AssertionError(f"$ {command}: exit code {proc.returncode}\n{proc.stderr}")
            want = "\n".join(shown).strip() + "\n"
            if want.strip() and not checker.check_output(want, proc.stdout, _FLAGS):
                if importlib.util.find_spec("matplotlib") is None:
                    raise Missing("matplotlib")  # the commands that draw print more with it
                raise AssertionError(
                    f"$ {command}: output differs\n--- shown\n{want}--- got\n{proc.stdout}"
                )


def public_api() -> dict[str, object]:
    """Every public name, qualified, with its object."""
    import cposembed
    import cposembed.plot

    names: dict[str, object] = {}
    for name in cposembed.__all__:
        if name in ("plot", "__version__"):
            continue
        names[f"cposembed.{name}"] = getattr(cposembed, name)
    for cls in (cposembed.LearnedPositionEmbedding, cposembed.TokenPositionEmbedding):
        for name in dir(cls):
            if not name.startswith("_") or name == "__call__":
                names[f"cposembed.{cls.__name__}.{name}"] = getattr(cls, name)
    for name in cposembed.plot.__all__:
        names[f"cposembed.plot.{name}"] = getattr(cposembed.plot, name)
    return names


def docstring_examples() -> list[tuple[str, object]]:
    """(qualified name, object) of public objects whose docstrings have ``>>>``."""
    return [
        (qualname, obj)
        for qualname, obj in public_api().items()
        if ">>>" in (getattr(obj, "__doc__", None) or "") and not isinstance(obj, property)
    ]


def run_docstring(qualname: str, obj: object) -> None:
    """The docstring's examples, with its module's globals (as ``pytest --doctest-modules``)."""
    import numpy as np

    module = inspect.getmodule(obj)
    globs = {"np": np, **(vars(module) if module else {})}
    with in_temp_dir():
        failure = run_doctest(obj.__doc__ or "", globs, qualname, qualname, 0)
    if failure:
        raise AssertionError(failure)


def run_example(path: Path) -> str:
    """Run examples/NAME.py as its own process; its output.

    An example whose optional module is missing prints "skipped: ..." and exits 0.
    """
    with in_temp_dir():
        proc = subprocess.run(
            [sys.executable, str(path)],
            capture_output=True,
            text=True,
            env=_child_env(),
            timeout=EXAMPLE_TIMEOUT_S,
        )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"exit code {proc.returncode}\n{output}")
    skip = re.search(r"^skipped: .*?needs (\w+)", output, re.M)
    if skip:
        raise Missing(skip.group(1))
    return output


# -- structure checks ------------------------------------------------------------


def readme_section(title: str) -> str:
    """The text of the README's ``## title`` section."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if not m:
        raise AssertionError(f'README.md has no "## {title}" section')
    return m.group(1)


def readme_quickstart() -> list[str]:
    """The commands of the README's Quick start: its one ```bash block."""
    section = readme_section("Quick start")
    bash = re.findall(r"^```bash\n(.*?)^```", section, re.M | re.S)
    if len(bash) != 1:
        raise AssertionError(f"README.md's Quick start has {len(bash)} ```bash blocks; keep one")
    return [line.strip() for line in bash[0].splitlines() if line.strip()]


def ci_quickstart() -> list[str]:
    """The commands between the Quick start markers of .ci/run."""
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    m = re.search(rf"{re.escape(QUICKSTART_BEGIN)}\n(.*?){re.escape(QUICKSTART_END)}", text, re.S)
    if not m:
        raise AssertionError(".ci/run has no Quick start markers")
    return [line.strip() for line in m.group(1).splitlines() if line.strip()]


def check_quickstart() -> None:
    readme, ci = readme_quickstart(), ci_quickstart()
    if readme != ci:
        raise AssertionError(f"README.md Quick start {readme} != .ci/run quickstart() {ci}")


def check_readme_length() -> None:
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    if n > README_MAX_LINES:
        raise AssertionError(f"README.md has {n} lines; keep it within {README_MAX_LINES}")


def _mentions(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text) is not None


def undocumented(text: str) -> list[str]:
    """Public names (their last component) that ``text`` does not mention.

    ``__call__`` counts as mentioned by a call of an instance, ``pe(...)``.
    """
    missing = []
    for qualname in public_api():
        name = qualname.rsplit(".", 1)[1]
        # __call__ counts as mentioned by a call of an instance: pe(...), m(...)
        instance = "m(" if "TokenPositionEmbedding." in qualname else "pe("
        if not _mentions(text, name) and not (name == "__call__" and instance in text):
            missing.append(qualname)
    return missing


def check_api_at_a_glance() -> None:
    missing = undocumented(readme_section("The API at a glance"))
    if missing:
        raise AssertionError(f'missing from the README\'s "The API at a glance": {missing}')


_AUTODOC = re.compile(
    r"^(?P<indent>[ \t]*)\.\. (?P<kind>currentmodule|module|auto\w+)::\s*(?P<name>[\w.]+)", re.M
)


def autodoc_entries(text: str) -> set[str]:
    """Qualified names that reStructuredText ``text`` has autodoc entries for.

    ``.. currentmodule::`` sets the module; an indented ``automethod`` or
    ``autoproperty`` belongs to the ``autoclass`` above it.
    """
    module = ""
    cls = ""
    names: set[str] = set()
    for m in _AUTODOC.finditer(text):
        kind, name = m["kind"], m["name"]
        if kind in ("currentmodule", "module"):
            module, cls = name, ""
            continue
        qualname = name if name.startswith(module + ".") or not module else f"{module}.{name}"
        if m["indent"] and cls:
            qualname = f"{cls}.{name}"
        elif kind == "autoclass":
            cls = qualname
        names.add(qualname)
    return names


def torch_api() -> dict[str, object]:
    """``cposembed.torch.__all__``, qualified, or nothing when torch cannot be imported."""
    try:
        import cposembed.torch as ct
    except ImportError:
        return {}
    return {f"cposembed.torch.{name}": getattr(ct, name) for name in ct.__all__}


def missing_from_reference(text: str, names: dict[str, object]) -> list[str]:
    """Public names without an autodoc entry in ``text`` (docs/api.rst).

    A class member may instead be described in its class's docstring (``grad``,
    set in ``__init__``).
    """
    documented = autodoc_entries(text)
    missing = []
    for qualname in names:
        if qualname in documented:
            continue
        owner, name = qualname.rsplit(".", 1)
        cls = names.get(owner)
        if owner in documented and isinstance(cls, type) and _mentions(cls.__doc__ or "", name):
            continue
        missing.append(qualname)
    return missing


def check_api_reference() -> None:
    text = (ROOT / "docs" / "api.rst").read_text(encoding="utf-8")
    names = {**public_api(), **torch_api()}
    missing = missing_from_reference(text, names)
    if missing:
        raise AssertionError(f"no autodoc entry in docs/api.rst for: {missing}")


def long_code_lines(files: list[Path] | None = None) -> list[str]:
    """``path:line: N characters`` for every code line of docs/ beyond CODE_LINE_MAX."""
    files = files if files is not None else [p for p in doc_files() if p.parent != ROOT]
    found = []
    for path in files:
        for block in blocks_of(path):
            for i, line in enumerate(block.code.splitlines()):
                if len(line) > CODE_LINE_MAX:
                    found.append(f"{block.path.name}:{block.line + i}: {len(line)} characters")
    return found


def check_code_line_length() -> None:
    found = long_code_lines()
    if found:
        raise AssertionError(
            f"code lines longer than {CODE_LINE_MAX} characters (wrap them): {found}"
        )


def check_performance_table() -> None:
    spec = importlib.util.spec_from_file_location("perf_table", ROOT / "tools" / "perf_table.py")
    assert spec is not None and spec.loader is not None
    perf_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perf_table)
    perf_table.check()


STRUCTURE_CHECKS = {
    "README Quick start == .ci/run quickstart()": check_quickstart,
    f"README within {README_MAX_LINES} lines": check_readme_length,
    "README API at a glance names every public name": check_api_at_a_glance,
    "docs/api.rst has an autodoc entry for every public name": check_api_reference,
    f"code lines of docs/ within {CODE_LINE_MAX} characters": check_code_line_length,
    "README performance table == tools/perf_table.py --check": check_performance_table,
}


# -- main ----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="only the code blocks of these files")
    parser.add_argument(
        "--strict", action="store_true", help="a missing optional module fails (CI)"
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("MPLBACKEND", "Agg")
    import cposembed

    print(f"cposembed {cposembed.__version__} from {cposembed.__file__}")

    passed = failed = skipped = 0

    def record(what: str, fn: Callable[..., object], *fn_args: object) -> object:
        """Run one check, print its line; its result, or None if it failed or skipped."""
        nonlocal passed, failed, skipped
        t0 = time.perf_counter()
        try:
            result = fn(*fn_args)
        except Missing as exc:
            if args.strict:
                failed += 1
                print(f"FAIL {what}: needs {exc.args[0]}, which is not installed")
            else:
                skipped += 1
                print(f"skip {what} (needs {exc.args[0]})")
            return None
        except Exception as exc:
            failed += 1
            print(f"FAIL {what}")
            detail = exc.args[0] if isinstance(exc, AssertionError) and exc.args else None
            print(detail if isinstance(detail, str) else traceback.format_exc(), end="\n\n")
            return None
        passed += 1
        print(f"ok   {what} ({time.perf_counter() - t0:.2f} s)")
        return result

    files = [p.resolve() for p in args.files] or doc_files()
    for path in files:
        for block in blocks_of(path):
            if block.language in RUN_LANGUAGES:
                record(f"{block.where} ({block.language})", run_block, block)
            elif block.language == CONSOLE and re.search(r"^\$ python ", block.code, re.M):
                record(f"{block.where} ({block.language})", run_console, block)
            elif not block.language:
                failed += 1
                print(
                    f"FAIL {block.where}: fence without a language (python, pycon, bash, text...)"
                )

    if not args.files:
        for qualname, obj in docstring_examples():
            record(f"docstring of {qualname}", run_docstring, qualname, obj)
        for example in sorted((ROOT / "examples").glob("*.py")):
            output = record(f"examples/{example.name}", run_example, example)
            for line in str(output or "").splitlines()[-2:]:
                print(f"       | {line}")
        for what, check in STRUCTURE_CHECKS.items():
            record(what, check)

    print()
    tail = f", {skipped} skipped" if skipped else ""
    print(f"{passed} passed, {failed} failed{tail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
