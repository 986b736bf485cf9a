"""Thread settings; the rules live in C (``src_c/_parallel.pxi``, ``src_c/_threads.h``),
this module words the errors."""

from __future__ import annotations

import os
import warnings
from typing import Any

from . import _core
from ._validation import check_int

SERIAL_THRESHOLD: int = _core.SERIAL_THRESHOLD

_OPENMP = _core.openmp_enabled()


def cpu_limit() -> int:
    """The CPUs this process may run on, as the thread rules read them."""
    return int(_core.cpu_limit())


def env_num_threads_error() -> str | None:
    """What is wrong with ``CPOSEMBED_NUM_THREADS`` as the C side parsed it, or None."""
    if _core.env_threads() >= 0:
        return None
    raw = os.environ.get("CPOSEMBED_NUM_THREADS", "")
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
    value = check_num_threads(n)
    # Capped when a call runs; here only kept within a C int.
    _core.user_threads(0 if value is None else min(value, 1 << 30))


def check_num_threads(num_threads: Any) -> int | None:
    """A call's ``num_threads`` as None or a positive int."""
    if num_threads is None:
        return None
    return check_int(num_threads, "num_threads", min_value=1)


def effective_num_threads(num_threads: int | None, work: int, chunks: int) -> int:
    """Threads one call doing ``work`` element operations in ``chunks`` pieces runs on."""
    return int(_core.team(check_num_threads(num_threads), work, chunks))
