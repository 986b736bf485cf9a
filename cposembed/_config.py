"""Build and runtime configuration: ``openmp_enabled()`` and ``show_config()``."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from typing import Any

import numpy as np

from . import _core, _threads
from ._version import __version__


def openmp_enabled() -> bool:
    """True if the kernels were compiled with OpenMP (False: serial build)."""
    return bool(_core.openmp_enabled())


def _openmp_runtime() -> str:
    """Path of the OpenMP runtime library loaded for the extension."""
    if not openmp_enabled():
        return "none (serial build)"
    with contextlib.suppress(ImportError):
        from threadpoolctl import threadpool_info

        libs = [i for i in threadpool_info() if i.get("user_api") == "openmp"]
        if libs:
            return ", ".join(
                " ".join(filter(None, (i.get("prefix"), i.get("version"), f"({i['filepath']})")))
                for i in libs
            )
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            if any(n in line for n in ("libgomp", "libomp", "libiomp")):
                return line.split()[-1]
    return "unknown"


def _num_threads_source() -> str:
    """Which rule of get_num_threads() gives the default thread count."""
    if not openmp_enabled():
        return "serial build"
    if _core.user_threads():
        return "set_num_threads()"
    problem = _threads.env_num_threads_error()
    if problem:
        return f"omp_get_max_threads() ({problem}; ignored)"
    if _core.env_threads() > 0:
        return "CPOSEMBED_NUM_THREADS"
    return "omp_get_max_threads()"


def _threads_summary() -> str:
    """The kernels' OpenMP threads (src_c/_parallel.pxi): the bound, refusals."""
    info = _core.thread_info()
    if not info["room"]:
        return "no helper threads (every call runs on its caller)"
    text = f"at most {info['room']} OpenMP helper threads for all callers ({info['reserved']} reserved)"
    if info["serial_child"]:
        text += "; a forked child of a process with threads: every call on its caller"
    if info["refused"]:
        text += "; the OS refused a thread (no more are reserved)"
    if info["alone_sites"]:
        text += (
            f"; one thread now faster for {info['alone_sites']} kinds of call (the CPUs are busy)"
        )
    return text


def config() -> dict[str, Any]:
    """The facts ``show_config()`` prints, as a dict."""
    build: dict[str, Any] = {}
    with contextlib.suppress(ImportError):
        from ._build_info import BUILD_INFO as build  # written by setup.py at build time
    return {
        "cposembed": __version__,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": platform.platform(),
        "openmp_enabled": openmp_enabled(),
        "openmp_runtime": _openmp_runtime(),
        "num_threads": int(_core.default_threads()),
        "num_threads_from": _num_threads_source(),
        "omp_get_max_threads": _core.omp_max_threads(),
        "cpus_available": _threads.cpu_limit(),
        "threads": _threads_summary(),
        "serial_threshold_elements": _core.SERIAL_THRESHOLD,
        "stream_threshold_bytes": _core.STREAM_THRESHOLD_BYTES,
        "env": {
            k: os.environ[k]
            for k in ("CPOSEMBED_NUM_THREADS", "OMP_NUM_THREADS")
            if k in os.environ
        },
        "compiler": build.get("compiler", "unknown"),
        "compiler_version": build.get("compiler_version") or "unknown",
        "compile_args": build.get("compile_args", []),
        "link_args": build.get("link_args", []),
        "cython": build.get("cython_version", "unknown"),
        "build_switches": build.get("switches", {}),
    }


def show_config() -> None:
    """Print the version, OpenMP runtime, thread defaults and compiler flags.

    The same facts as :func:`config`, one per line; ``python -m cposembed
    info`` prints this. Include it in bug reports.
    """
    for key, value in config().items():
        if isinstance(value, list):
            value = " ".join(value) or "(none)"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "(none set)"
        print(f"{key:>26}: {value}")
