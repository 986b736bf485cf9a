"""The functional API of one table: lookup, add_positions, scatter_add.

Each operation has one route to its kernel. The function calls the
operation's C entry (``cposembed._core``) with the arguments as given; the
entry checks them and runs the kernel, or declines (returns None, nothing
written). For what it declines, the arguments are normalised here (any
layout, dtype or byte order, lists, NumPy's other index forms, positions
that broadcast) or the worded error is raised (``_validation``), and the
same entry is called again. Outputs the kernel cannot write directly (an
``out`` in another layout, or one sharing memory with an input) are
computed into a scratch array and copied in at the end, as NumPy does.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import _core, _threads
from . import _validation as v

__all__ = ["lookup", "add_positions", "scatter_add"]

# Fresh outputs of at least _core.POOL_MIN_BYTES come from reusable blocks:
# a new mmap'ed array pays a page fault and a kernel zeroing per page, more
# than the lookup that fills it; a block freed by a previous call's result is
# handed out again instead (at most 8 blocks, 1 GiB, are kept; the calls'
# scratch of 64 KiB or more is kept there too). CPOSEMBED_REUSE_OUTPUTS=0
# turns the reuse off (nothing is kept after the last result or call is
# done), for processes that must give memory back at once.
if os.environ.get("CPOSEMBED_REUSE_OUTPUTS", "").strip() == "0":
    _core.set_pool(False)

# The C entries take positions of up to this many axes (the most NumPy 1.x
# allows with one more for the rows). Deeper ones (NumPy 2 allows 64) are
# served by NumPy's indexing in lookups, flattened for the other operations.
_MAX_POSITION_DIMS = 31


def _accepted(result: Any) -> Any:
    # Normalised arguments are exactly what the entries take.
    if result is None:
        raise RuntimeError("cposembed internal error: a C entry declined checked arguments")
    return result


def _base(arr: np.ndarray) -> np.ndarray:
    """``arr`` as an exact ndarray over the same memory (subclasses viewed as ndarray)."""
    return arr if type(arr) is np.ndarray else arr.view(np.ndarray)


def _same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.shape == b.shape
        and a.strides == b.strides
    )


def lookup(
    table: Any, positions: Any, *, out: np.ndarray | None = None, num_threads: int | None = None
) -> np.ndarray:
    """Gather rows of a position table: ``table[positions]``.

    Parameters
    ----------
    table : array_like of shape (L, d), float32 or float64
        The position embedding table.
    positions : int, array_like of int, or any NumPy index
        Row indices, ``-L <= p < L`` (negatives wrap). Boolean masks and
        slices work as in NumPy.
    out : ndarray, optional
        Destination of shape ``positions.shape + (d,)`` and the table's dtype.
        It may share memory with ``positions`` (they are read first) or with
        the table (the result is computed aside, then copied in).
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
        result = lookup_normalised(table, positions, out, num_threads)
    return result


def lookup_normalised(table: Any, positions: Any, out: Any, num_threads: Any) -> Any:
    """:func:`lookup` for what its C entry declined: normalise or word the error,
    then the same entry again."""
    t = v.as_table(table)
    n_rows, d = t.shape
    nt = _threads.check_num_threads(num_threads)
    pos = v.as_positions(positions, n_rows)
    if pos is None or pos.ndim > _MAX_POSITION_DIMS:
        return _lookup_numpy(t, positions, out)
    if out is None:
        return _accepted(_core.lookup(t, pos, None, nt))
    v.check_out(out, pos.shape + (d,), t.dtype)
    # The entry writes `out` itself if it can (it declines another layout or
    # an `out` over the table); else the result is computed aside, as NumPy does.
    if _core.lookup(t, pos, _base(out), nt) is None:
        np.copyto(out, _accepted(_core.lookup(t, pos, None, nt)))
    return out


def _lookup_numpy(table: np.ndarray, positions: Any, out: Any) -> Any:
    # Indices that also reach into the embedding axis (e.g. ``(slice(None), 0)``)
    # are served by NumPy itself, as the reference does.
    result = table[positions]
    if isinstance(result, np.ndarray) and np.shares_memory(result, table):
        result = result.copy()
    if out is None:
        return result
    v.check_out(out, np.shape(result), table.dtype)
    np.copyto(out, result)
    return out


def _row_positions(
    positions: Any,
    offset: Any,
    lead: tuple[int, ...],
    n_rows: int,
    what: str,
    lead_name: str | None = None,
) -> tuple[np.ndarray | None, int]:
    """``(positions, offset)`` for rows laid out as ``lead`` (``what.shape[:-1]``, or
    ``lead_name``), as the C entries take them."""
    off = v.as_offset(offset)
    if positions is None:
        if not lead:
            raise ValueError(
                f"{what} must have shape (..., T, d) when positions is None; got a 1-D array"
            )
        v.check_default_positions(off, lead[-1], n_rows)
        return None, off if lead[-1] else 0
    if off:
        raise ValueError(
            f"offset={off} only applies with positions=None; "
            "add it to the explicit positions instead"
        )
    pos = v.as_positions(positions, n_rows)
    if pos is None:
        raise IndexError(
            "positions must select rows of the table (integers, integer arrays, "
            "boolean masks or slices); an index into the embedding axis only works "
            "with lookup"
        )
    return v.broadcast_positions(pos, lead, lead_name or f"{what}.shape[:-1]"), 0


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
        Token embeddings (any real dtype; the result dtype is NumPy's
        ``result_type(tokens, table)``).
    table : array_like of shape (L, d), float32 or float64
        The position embedding table.
    positions : array_like of int, optional
        Must broadcast to ``tokens.shape[:-1]``. ``None`` means
        ``offset + arange(T)`` for every sequence.
    offset : int, default 0
        Tokens already seen (incremental decoding); one integer for the whole
        call, only with ``positions=None``. For per-row offsets pass explicit
        positions (see :func:`cposembed.positions_from_mask`).
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
        result = _add_normalised(tokens, table, positions, offset, out, num_threads)
    return result


def _add_normalised(
    tokens: Any, table: Any, positions: Any, offset: Any, out: Any, num_threads: Any
) -> Any:
    t = v.as_table(table)
    n_rows, d = t.shape
    tok = v.as_rows(tokens, d, "token_embeddings")
    nt = _threads.check_num_threads(num_threads)
    pos, off = _row_positions(positions, offset, tok.shape[:-1], n_rows, "token_embeddings")
    dtype = np.result_type(tok.dtype, t.dtype)
    if out is not None:
        v.check_out(out, tok.shape, dtype)
    if dtype != t.dtype:
        # e.g. float64 tokens + float32 table: NumPy's own promotion decides.
        rows = t[v.default_positions(off, tok.shape[-2])] if pos is None else t[pos]
        return np.add(tok, rows, out=out)
    tok_c = v.plain_copy(tok, dtype)
    rows, pos, off = _shallow(tok_c, pos, off)
    if out is None:
        return _accepted(_core.add(rows, t, pos, off, None, nt)).reshape(tok.shape)
    o = _base(out)
    if _same_buffer(o, tok_c):
        # In place (the tokens may be a read-only view of out's memory):
        # out's own writable view serves as both.
        o_rows = o.reshape(rows.shape)
        done = _core.add(o_rows, t, pos, off, o_rows, nt)
    else:
        # The entry writes `out` itself if it can (it declines another layout,
        # or an `out` over the table or the tokens).
        target = o if o.shape == rows.shape else _rows_view(o, rows.shape)
        done = None if target is None else _core.add(rows, t, pos, off, target, nt)
    if done is None:
        np.copyto(out, _accepted(_core.add(rows, t, pos, off, None, nt)).reshape(tok.shape))
    return out


def _rows_view(arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """``arr`` reshaped to ``shape`` as a view of its memory, or None (a reshape
    that would copy)."""
    if not arr.flags.c_contiguous:
        return None
    return arr.reshape(shape)


def _shallow(
    rows: np.ndarray, pos: np.ndarray | None, offset: int
) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Rows ``(..., d)`` and their positions as the C entries take them: at most
    31 position axes. Deeper ones (NumPy 2 allows 64 axes) are broadcast and
    flattened, with the rows seen as ``(N, d)``; the caller reshapes a result."""
    lead = rows.shape[:-1]
    if len(lead) <= _MAX_POSITION_DIMS and (pos is None or pos.ndim <= _MAX_POSITION_DIMS):
        return rows, pos, offset
    full = v.default_positions(offset, lead[-1]) if pos is None else pos
    flat = np.ascontiguousarray(np.broadcast_to(full, lead)).reshape(-1)
    return rows.reshape(-1, rows.shape[-1]), flat, 0


def scatter_add(
    grad_table: np.ndarray,
    grad_output: Any,
    positions: Any = None,
    *,
    offset: int = 0,
    num_threads: int | None = None,
) -> np.ndarray:
    """Accumulate ``grad_table[positions[i]] += grad_output[i]`` in place.

    The gradient of :func:`add_positions` and :func:`lookup` with respect
    to the table. Repeated positions accumulate (like ``np.add.at``, and in
    the same order). The result is bitwise the same for any thread count.

    Parameters
    ----------
    grad_table : ndarray of shape (L, d), float32 or float64, writable
        Accumulated into in place.
    grad_output : array_like of shape (..., d)
        Converted to ``grad_table``'s dtype.
    positions : array_like of int, optional
        Must broadcast to ``grad_output.shape[:-1]``; ``None`` means
        ``offset + arange(T)`` for every sequence.
    offset : int, default 0
        Only with ``positions=None``.
    num_threads : int, optional
        Threads for this call.

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
    scatter_add_marking(grad_table, grad_output, positions, offset, num_threads, None, -1)
    return grad_table


def scatter_add_marking(
    grad_table: Any,
    grad_output: Any,
    positions: Any,
    offset: Any,
    num_threads: Any,
    touched: np.ndarray | None,
    skip_row: int,
) -> None:
    """:func:`scatter_add` that also marks the rows it touched and skips one.

    ``touched``: a C-contiguous bool array of length L (or None) whose rows
    that received a contribution are set True; ``skip_row``: a row that gets
    no gradient (zeroed after the sum; ``padding_idx``), or -1.
    """
    done = _core.scatter_add(
        grad_table, grad_output, positions, offset, num_threads, touched, skip_row
    )
    if done is None:
        _scatter_normalised(
            grad_table, grad_output, positions, offset, num_threads, touched, skip_row
        )


def _scatter_normalised(
    grad_table: Any,
    grad_output: Any,
    positions: Any,
    offset: Any,
    num_threads: Any,
    touched: np.ndarray | None,
    skip_row: int,
) -> None:
    v.as_grad_table(grad_table, "grad_table")
    native = v.native_dtype(grad_table.dtype)
    n_rows, d = grad_table.shape
    g = v.as_rows(grad_output, d, "grad_output")
    nt = _threads.check_num_threads(num_threads)
    pos, off = _row_positions(positions, offset, g.shape[:-1], n_rows, "grad_output")
    g_c = v.plain_copy(g, native)
    if v.overlaps(g_c, grad_table):
        g_c = g_c.copy()
    g_c, pos, off = _shallow(g_c, pos, off)
    base = _base(grad_table)
    work = v.plain_copy(base, native)
    _accepted(_core.scatter_add(work, g_c, pos, off, nt, touched, skip_row))
    if work is not base:
        np.copyto(grad_table, work)
