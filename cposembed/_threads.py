"""How many OpenMP threads a kernel call uses.

The rules follow scikit-learn's ``_openmp_effective_n_threads``: an explicit
request wins, then the package setting, then ``CPOSEMBED_NUM_THREADS``, then
OpenMP's own default (``omp_get_max_threads()``, which honours
``OMP_NUM_THREADS`` and threadpoolctl's ``threadpool_limits``), and the
result never exceeds the CPUs this process may run on.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Any

from . import _kernels

# Below this many output elements a call runs on one thread: waking an OpenMP
# team costs a few microseconds, about what copying this much memory takes.
SERIAL_THRESHOLD = 1 << 16

_OPENMP = _kernels.openmp_enabled()

_lock = threading.Lock()
_user_num_threads: int | None = None

# GNU libgomp is not fork-safe: a child forked by a thread that has led a
# parallel region (ours, or any other library's on the same libgomp) hangs in
# its first parallel region, waiting for pool threads that did not survive the
# fork. Before each fork we release the forking thread's pool with OpenMP 5's
# omp_pause_resource_all (libgomp frees exactly that thread's pool), so the
# child starts a fresh one and keeps its threads. Where that is unavailable we
# fall back to running serially in a child whose parent used our threads.
_went_parallel = False
_in_forked_child = False
_pool_released = False
_OMP_PAUSE_HARD = 2


def _find_omp_pause() -> Any:
    """libgomp's omp_pause_resource_all, or None (other runtime, or too old)."""
    if not _kernels.openmp_enabled() or not sys.platform.startswith("linux"):
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
    global _in_forked_child, _cpus
    if _went_parallel and not _pool_released:
        _in_forked_child = True
    _cpus = _cpu_limit()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def _cpu_limit() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# The CPUs this process may run on, read once (and again in a forked
# child): a system call on every kernel call is not worth it for a limit
# that practically never changes while a process runs.
_cpus = _cpu_limit()


def _check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be a positive integer; got {value!r}")
    n = int(value.__index__())
    if n < 1:
        raise ValueError(f"{name} must be a positive integer; got {n}")
    return n


def _env_num_threads() -> int | None:
    raw = os.environ.get("CPOSEMBED_NUM_THREADS", "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"CPOSEMBED_NUM_THREADS must be a positive integer; got {raw!r}") from None
    if n < 1:
        raise ValueError(f"CPOSEMBED_NUM_THREADS must be a positive integer; got {raw!r}")
    return n


def get_num_threads() -> int:
    """Number of threads the kernels use by default.

    ``set_num_threads(n)`` if it was called, else ``CPOSEMBED_NUM_THREADS``,
    else ``omp_get_max_threads()``; capped by the CPUs available to this
    process. Always 1 in a build without OpenMP.
    """
    if not _OPENMP:
        return 1
    n = _user_num_threads
    if n is None:
        # CPOSEMBED_NUM_THREADS, else omp_get_max_threads(), in one C call;
        # -1: a value only Python parses (or rejects with our message).
        n = _kernels.default_num_threads()
        if n < 0:
            n = _env_num_threads() or _kernels.omp_max_threads()
    return max(1, min(n, _cpus))


def set_num_threads(n: int | None) -> None:
    """Set the default thread count for all kernels; ``None`` restores the default."""
    global _user_num_threads
    value = None if n is None else _check_positive_int(n, "num_threads")
    with _lock:
        _user_num_threads = value


def requested_threads(num_threads: int | None) -> int:
    """The threads a call asks for, before the rules for its size.

    Validates ``num_threads`` (a per-call override). 1 in a serial build and
    in a child forked after the parent used threads.
    """
    if num_threads is not None:
        # An explicit request is honoured as given (oversubscription is the
        # caller's choice); only the default is capped by the CPU count.
        n = _check_positive_int(num_threads, "num_threads")
        if not _OPENMP:
            n = 1
    else:
        n = get_num_threads()
    return 1 if _in_forked_child else n


def effective_num_threads(num_threads: int | None, work: int, chunks: int) -> int:
    """Threads for one call doing ``work`` element operations in ``chunks`` pieces.

    :func:`requested_threads`, then small work runs on one thread, and no
    more threads than chunks. (``_fastcall``'s large-call entries apply the
    same two rules in C.)
    """
    n = requested_threads(num_threads)
    if n <= 1 or work < SERIAL_THRESHOLD:
        return 1
    return min(n, max(1, chunks))


def note_parallel(n_threads: int) -> None:
    """Record that a parallel region is about to run (for the fork guard)."""
    global _went_parallel
    if n_threads > 1:
        _went_parallel = True
