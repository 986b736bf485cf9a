"""Thread settings: ``get_num_threads``, ``set_num_threads``, and the fork guard.

The rules themselves (defaults, caps, serial threshold) live in C, in
``src_c/_team.pxi``, where every entry applies them; this module sets what
only Python knows (the CPUs this process may run on, a forked child's
state) and words the errors for what the C side declines.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from typing import Any

from . import _core
from ._validation import check_int

SERIAL_THRESHOLD: int = _core.SERIAL_THRESHOLD

_OPENMP = _core.openmp_enabled()


def _cpu_limit() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# The CPUs this process may run on, read once (and again in a forked child):
# a system call on every kernel call is not worth it for a limit that
# practically never changes while a process runs.
_core.set_cpu_limit(_cpu_limit())

# GNU libgomp is not fork-safe: a child forked by a thread that has led a
# parallel region (ours, or any other library's on the same libgomp) hangs in
# its first parallel region, waiting for pool threads that did not survive the
# fork. Before each fork we release the forking thread's pool with OpenMP 5's
# omp_pause_resource_all (libgomp frees exactly that thread's pool), so the
# child starts a fresh one and keeps its threads. Where that is unavailable
# the child runs serially if the parent used our threads.
_OMP_PAUSE_HARD = 2
_pool_released = False


def _find_omp_pause() -> Any:
    """libgomp's omp_pause_resource_all, or None (other runtime, or too old)."""
    if not _OPENMP or not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
        for path in sorted(paths):
            fn = ctypes.CDLL(path).omp_pause_resource_all
            fn.argtypes = [ctypes.c_int]
            fn.restype = ctypes.c_int
            return fn
    except (OSError, AttributeError):
        pass
    return None


_omp_pause = _find_omp_pause()


def _release_openmp_pool() -> bool:
    """Free the calling thread's libgomp pool; True if the child can use threads."""
    return _omp_pause is not None and _omp_pause(_OMP_PAUSE_HARD) == 0


def _before_fork() -> None:
    global _pool_released
    _pool_released = _release_openmp_pool()


def _after_fork_in_child() -> None:
    if _core.went_parallel() and not _pool_released:
        _core.set_serial_child(True)
    _core.set_cpu_limit(_cpu_limit())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


_ASCII_SPACE = " \t\n\v\f\r"


def env_num_threads_error() -> str | None:
    """What is wrong with ``CPOSEMBED_NUM_THREADS``, or None if it is unset or valid."""
    raw = os.environ.get("CPOSEMBED_NUM_THREADS", "")
    digits = raw.strip(_ASCII_SPACE)  # what the C side skips, no other white space
    if not digits:
        return None
    if digits.isascii() and digits.isdigit() and int(digits) >= 1:
        return None
    return f"CPOSEMBED_NUM_THREADS must be a positive integer; got {raw!r}"


def get_num_threads() -> int:
    """Number of threads the kernels use by default.

    ``set_num_threads(n)`` if it was called, else ``CPOSEMBED_NUM_THREADS``,
    else ``omp_get_max_threads()``; capped by the CPUs available to this
    process. Always 1 in a build without OpenMP. An invalid
    ``CPOSEMBED_NUM_THREADS`` (not a positive integer) is ignored, with a
    ``RuntimeWarning`` here and a line in :func:`cposembed.show_config`.
    """
    problem = env_num_threads_error()
    if problem and _OPENMP:
        warnings.warn(f"{problem}; ignored", RuntimeWarning, stacklevel=2)
    return int(_core.default_threads())


def set_num_threads(n: int | None) -> None:
    """Set the default thread count for all kernels; ``None`` restores the default.

    Parameters
    ----------
    n : int or None
        A positive integer. Values above the CPUs this process may run on
        are capped when a call runs.
    """
    value = None if n is None else check_int(n, "num_threads", min_value=1)
    # Capped when a call runs; here only kept within a C int.
    _core.set_user_threads(0 if value is None else min(value, 1 << 30))


def check_num_threads(num_threads: Any) -> int | None:
    """A call's ``num_threads`` as None or a positive int (worded errors)."""
    if num_threads is None:
        return None
    return check_int(num_threads, "num_threads", min_value=1)


def effective_num_threads(num_threads: int | None, work: int, chunks: int) -> int:
    """Threads one call doing ``work`` element operations in ``chunks`` pieces runs on.

    The rules every entry applies: ``num_threads`` (or the default), capped
    (an explicit request at four times the CPUs), one thread for small work,
    and no more threads than chunks.
    """
    return int(_core.team(check_num_threads(num_threads), work, chunks))
