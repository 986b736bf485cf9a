"""The functional API of one table: lookup, add_positions, scatter_add (routes:
docs/architecture.md)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import _blocks, _core, _routes

__all__ = ["lookup", "add_positions", "scatter_add"]

# CPOSEMBED_REUSE_OUTPUTS=0: no freed output or scratch block is kept for reuse.
if os.environ.get("CPOSEMBED_REUSE_OUTPUTS", "").strip() == "0":
    _blocks.set_pool(False)


def lookup(
    table: Any, positions: Any, *, out: np.ndarray | None = None, num_threads: int | None = None
) -> np.ndarray:
    """Gather rows of a position table: ``table[positions]``.

    Parameters
    ----------
    table : array_like of shape (L, d), float16, bfloat16, float32 or float64
        The position embedding table.
    positions : int, array_like of int, or any NumPy index
        Row indices, ``-L <= p < L`` (negatives wrap), masks and slices.
    out : ndarray, optional
        Destination of shape ``positions.shape + (d,)`` and the table's dtype;
        it may share memory with the inputs.
    num_threads : int, optional
        Threads for this call (default: :func:`cposembed.get_num_threads`).

    Returns
    -------
    ndarray
        ``out`` if given, else a new array. Never a view of ``table``.

    Raises
    ------
    IndexError
        A position outside ``[-L, L)``, or an index NumPy rejects.
    TypeError, ValueError
        Wrong table dtype or shape, or an ``out`` that does not fit.

    Examples
    --------
    >>> import numpy as np
    >>> import cposembed
    >>> table = np.arange(12, dtype=np.float32).reshape(4, 3)
    >>> cposembed.lookup(table, [0, -1])
    array([[ 0.,  1.,  2.],
           [ 9., 10., 11.]], dtype=float32)
    """
    result = _core.lookup(table, positions, out, num_threads)
    if result is None:
        result = _routes.lookup(table, positions, out=out, num_threads=num_threads)
    return result


def add_positions(
    tokens: Any,
    table: Any,
    positions: Any = None,
    *,
    offset: int = 0,
    out: np.ndarray | None = None,
    num_threads: int | None = None,
) -> np.ndarray:
    """Fused ``tokens + table[positions]``.

    Parameters
    ----------
    tokens : array_like of shape (..., T, d)
        Token embeddings of any real dtype; the result is NumPy's ``tokens +
        table[positions]`` (float16 with bfloat16 is a ``TypeError``).
    table : array_like of shape (L, d)
        As in :func:`lookup`.
    positions : array_like of int, optional
        Must broadcast to ``tokens.shape[:-1]``. ``None`` means
        ``offset + arange(T)`` for every sequence.
    offset : int, default 0
        Tokens already seen (incremental decoding), only with ``positions=None``;
        per-row offsets: see :func:`cposembed.positions_from_mask`.
    out : ndarray, optional
        Destination of ``tokens``' shape and the result dtype; may be
        ``tokens`` itself for an in-place add.
    num_threads : int, optional
        Threads for this call.

    Returns
    -------
    ndarray
        ``out`` if given, else a new array.

    Raises
    ------
    IndexError
        A position outside ``[-L, L)``, or ``offset + T > L``.
    TypeError, ValueError
        Wrong dtypes or shapes, positions that do not broadcast, a negative
        or non-integer ``offset``, or an ``out`` that does not fit.

    Examples
    --------
    >>> import numpy as np
    >>> import cposembed
    >>> table = np.arange(8, dtype=np.float32).reshape(4, 2)
    >>> tokens = np.ones((1, 2, 2), dtype=np.float32)
    >>> cposembed.add_positions(tokens, table, offset=1)
    array([[[3., 4.],
            [5., 6.]]], dtype=float32)
    """
    result = _core.add(tokens, table, positions, offset, out, num_threads)
    if result is None:
        result = _routes.add(
            tokens, table, positions, offset=offset, out=out, num_threads=num_threads
        )
    return result


def scatter_add(
    grad_table: np.ndarray,
    grad_output: Any,
    positions: Any = None,
    *,
    offset: int = 0,
    num_threads: int | None = None,
) -> np.ndarray:
    """Accumulate ``grad_table[positions[i]] += grad_output[i]`` in place.

    The table gradient of :func:`add_positions` and :func:`lookup`: bitwise
    ``np.add.at(grad_table, positions, grad_output)``, for any thread count.

    Parameters
    ----------
    grad_table : ndarray of shape (L, d), writable
        Of dtype float16, bfloat16, float32 or float64; accumulated into in place.
    grad_output : array_like of shape (..., d)
        Float16, bfloat16, float32 or float64 is added as ``np.add.at`` adds
        it; another real dtype is converted to ``grad_table``'s first.
    positions, offset, num_threads : as in :func:`add_positions`
        The forward call's, with ``grad_output`` in place of ``tokens``.

    Returns
    -------
    ndarray
        ``grad_table``.

    Raises
    ------
    IndexError
        A position outside ``[-L, L)``.
    TypeError, ValueError
        A ``grad_table`` that is not a writable 2-D float array, or
        ``grad_output`` or positions of the wrong shape or kind.

    Examples
    --------
    >>> import numpy as np
    >>> import cposembed
    >>> grad = np.zeros((3, 2), dtype=np.float32)
    >>> cposembed.scatter_add(grad, np.ones((3, 2), dtype=np.float32), [0, 2, 0])
    array([[2., 2.],
           [0., 0.],
           [1., 1.]], dtype=float32)
    """
    _routes.scatter_add(grad_table, grad_output, positions, offset=offset, num_threads=num_threads)
    return grad_table
