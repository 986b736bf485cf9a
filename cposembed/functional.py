"""The functional kernels: lookup, add_positions, scatter_add.

Each function validates everything first (``_validation``), then picks the
threads (``_threads``), then calls one Cython kernel on C-contiguous buffers.
Inputs in any other layout or dtype are converted first; outputs that the
kernel cannot write directly (non-contiguous, or overlapping an input) are
computed into a scratch buffer and copied in at the end. Either way nothing
is written before every check has passed.

The plain, common cases skip this Python layer: tiny lookups and, with
``out=`` (or in place, or a scatter-add), large calls on C-contiguous native
arrays are checked and run in C by ``_fastcall``, which hands everything else
back to the full path here (its checks, its error messages).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import _alloc, _fastcall, _kernels, _threads
from . import _validation as v

__all__ = ["lookup", "add_positions", "scatter_add"]

# Outputs at least this large are written with streaming (non-temporal)
# stores: far beyond what the caches keep, so reading each line in before
# overwriting it (what an ordinary store does) would only double the memory
# traffic. Below it, ordinary stores leave the result in cache for the next op.
STREAM_THRESHOLD_BYTES = 1 << 23


def _stream(nbytes: int) -> bool:
    return nbytes >= STREAM_THRESHOLD_BYTES


# Tiny lookups (up to _fastcall.SMALL_TAKE_ELEMENTS output elements of plain
# integer positions) are served by _fastcall.take_small in C: for them the
# fixed cost of validating and entering the kernel (typed-memoryview
# acquisition, fused-type dispatch: several microseconds) exceeds the copy.
_take_small = _fastcall.take_small


def _fast_threads(num_threads: Any) -> int:
    """Threads asked for, for _fastcall's large-call entries; 0: take the full path.

    Only None or a plain positive int: any other num_threads is checked (and
    its error worded) by the full path, after the other arguments, as always.
    """
    if num_threads is None or (type(num_threads) is int and num_threads >= 1):
        n = _threads.requested_threads(num_threads)
        _threads.note_parallel(n)  # before any parallel region (may run serially)
        return n
    return 0


def _run_threads(num_threads: int | None, work: int, chunks: int) -> int:
    n = _threads.effective_num_threads(num_threads, work, chunks)
    _threads.note_parallel(n)
    return n


# Fresh outputs at least this large come from cposembed._alloc's reusable
# blocks: a new mmap'ed array pays a page fault and a kernel zeroing per page,
# more than the lookup that fills it; a block freed by a previous call's
# result is handed out again instead (at most 4 blocks, 1 GiB, are kept).
# CPOSEMBED_REUSE_OUTPUTS=0 turns the reuse off (nothing is kept after the
# last result is freed), for processes that must give memory back at once.
POOL_MIN_BYTES = 1 << 22
if os.environ.get("CPOSEMBED_REUSE_OUTPUTS", "").strip() == "0":
    _alloc.set_pool(False)


def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``np.empty(shape, dtype)``, from the reusable blocks when it is large."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < POOL_MIN_BYTES:
        return np.empty(shape, dtype=dtype)
    block: Any = _alloc.block(nbytes)  # a writable buffer (C-level protocol)
    return np.frombuffer(block, dtype=dtype).reshape(shape)


def _writable_target(
    out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype, *reads: np.ndarray
) -> np.ndarray:
    """Where the kernel writes: ``out`` itself when it safely can, else scratch."""
    if out is None:
        return empty(shape, dtype)
    if out.flags.c_contiguous and not any(v.overlaps(out, r) for r in reads):
        return out
    return empty(shape, dtype)


def _finish(target: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return target
    if target is not out:
        np.copyto(out, target)
    return out


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
    """
    if out is None:
        if num_threads is None:
            # None unless a plain valid tiny case (the checks below word the errors).
            result = _take_small(table, positions)
            if result is not None:
                return result
    else:
        n = _fast_threads(num_threads)
        if n and _fastcall.lookup_into(
            table, positions, out, n, _threads.SERIAL_THRESHOLD, STREAM_THRESHOLD_BYTES
        ):
            return out  # the plain case, checked and run in C
    table = v.as_table(table)
    n_rows, d = table.shape
    pos = v.as_positions(positions, n_rows)
    if pos.flat is None:
        return _lookup_numpy(table, positions, out)
    assert pos.shape is not None  # set whenever flat is
    shape = pos.shape + (d,)
    if out is not None:
        v.check_out(out, shape, table.dtype)
    n = pos.flat.size
    threads = _run_threads(num_threads, n * d, n)
    target = _writable_target(out, shape, table.dtype, table)
    _kernels.lookup_rows(table, pos.flat, target.reshape(n, d), threads, _stream(target.nbytes))
    return _finish(target, out)


def _lookup_numpy(table: np.ndarray, positions: Any, out: np.ndarray | None) -> Any:
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
    positions: Any, offset: Any, lead: tuple[int, ...], n_rows: int, what: str
) -> tuple[np.ndarray, tuple[int, ...]]:
    """Positions for rows laid out as ``lead``: ``(flat, core)`` as in broadcast_positions."""
    offset = v.as_offset(offset)
    if positions is None:
        if not lead:
            raise ValueError(
                f"{what} must have shape (..., T, d) when positions is None; got a 1-D array"
            )
        n_tokens = lead[-1]
        return v.default_positions(offset, n_tokens, n_rows), (n_tokens,)
    if offset:
        raise ValueError(
            f"offset={offset} only applies with positions=None; "
            "add it to the explicit positions instead"
        )
    pos = v.as_positions(positions, n_rows)
    return v.broadcast_positions(pos, lead, f"{what}.shape[:-1]")


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
    positions : array_like of int, optional
        Must broadcast to ``tokens.shape[:-1]``. ``None`` means
        ``offset + arange(T)`` for every sequence.
    offset : int, default 0
        Tokens already seen (incremental decoding); only with ``positions=None``.
    out : ndarray, optional
        Destination of ``tokens``' shape and the result dtype; may be
        ``tokens`` itself for an in-place add.
    num_threads : int, optional
        Threads for this call.

    Returns
    -------
    ndarray
    """
    if out is not None and positions is None:
        n = _fast_threads(num_threads)
        if n and _fastcall.add_into(
            tokens, table, offset, out, n, _threads.SERIAL_THRESHOLD, STREAM_THRESHOLD_BYTES
        ):
            return out  # the plain case, checked and run in C
    table = v.as_table(table)
    n_rows, d = table.shape
    tok = v.as_rows(tokens, d, "token_embeddings")
    lead = tok.shape[:-1]
    flat, core = _row_positions(positions, offset, lead, n_rows, "token_embeddings")
    dtype = np.result_type(tok.dtype, table.dtype)
    if out is not None:
        v.check_out(out, tok.shape, dtype)
    n = tok.size // d if d else int(np.prod(lead))

    if dtype != table.dtype:
        # e.g. float64 tokens + float32 table: NumPy's own promotion decides.
        rows = table[flat.reshape(core)]
        return np.add(tok, rows, out=out)

    tok_c = np.ascontiguousarray(tok, dtype=dtype)
    threads = _run_threads(num_threads, n * d, n)
    if (
        out is not None
        and out.flags.c_contiguous
        and _same_buffer(out, tok_c)
        and not v.overlaps(out, table)
    ):
        target = out  # in place: each element reads only itself first
    else:
        target = _writable_target(out, tok.shape, dtype, tok_c, table)
    if n:
        # In place the lines are read anyway, so ordinary stores cost nothing
        # extra; there the token rows are prefetched with a non-temporal hint.
        in_place = target is tok_c
        stream = not in_place and _stream(target.nbytes)
        _kernels.add_rows(
            tok_c.reshape(n, d), table, flat, target.reshape(n, d), threads, stream, in_place
        )
    return _finish(target, out)


def _shortest_period(flat: np.ndarray, lead: tuple[int, ...]) -> np.ndarray:
    """``flat[:T]`` when explicit ``(..., T)`` positions repeat every sequence.

    Training code often passes ``arange(T)`` expanded to ``(B, T)``; seen as
    one period the kernel can take its distinct-positions path (a blocked
    sum over the batch). Same contributions, same order: same bits.
    """
    if len(lead) < 2 or flat.size != int(np.prod(lead)) or flat.size == lead[-1]:
        return flat
    # One pass in C that stops at the first difference (the same test as
    # _fastcall.scatter_into's).
    if _kernels.repeats_every(flat, lead[-1]):
        return np.ascontiguousarray(flat[: lead[-1]])
    return flat


def _same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.shape == b.shape
        and a.strides == b.strides
    )


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
    """
    n = _fast_threads(num_threads)
    if n and _fastcall.scatter_into(
        grad_table, grad_output, positions, offset, n, _threads.SERIAL_THRESHOLD
    ):
        return grad_table  # the plain case, checked and run in C
    scatter_add_rows_of(grad_table, grad_output, positions, offset, num_threads)
    return grad_table


def scatter_add_rows_of(
    grad_table: np.ndarray,
    grad_output: Any,
    positions: Any,
    offset: int,
    num_threads: int | None,
) -> np.ndarray:
    """:func:`scatter_add`, returning the validated positions it used.

    Every row that received a contribution is in the returned integer array
    (values in ``[-L, L)``), so callers that track touched rows need not
    validate ``positions`` a second time.
    """
    if not isinstance(grad_table, np.ndarray):
        raise TypeError(f"grad_table must be a numpy.ndarray; got {v.describe(grad_table)}")
    native = v.native_dtype(grad_table.dtype)
    if native not in v.FLOAT_DTYPES:
        raise TypeError(f"grad_table must have dtype float32 or float64; got {grad_table.dtype}")
    if grad_table.ndim != 2:
        raise ValueError(f"grad_table must be 2-D (L, d); got shape {grad_table.shape}")
    if not grad_table.flags.writeable:
        raise ValueError("grad_table is read-only; pass a writable array")
    n_rows, d = grad_table.shape
    g = v.as_rows(grad_output, d, "grad_output")
    lead = g.shape[:-1]
    flat, _ = _row_positions(positions, offset, lead, n_rows, "grad_output")
    n = int(np.prod(lead))
    if n == 0 or d == 0 or flat.size == 0:
        return flat
    flat = _shortest_period(flat, lead)
    g_c = np.ascontiguousarray(g, dtype=native).reshape(n, d)
    if v.overlaps(g_c, grad_table):
        g_c = g_c.copy()
    threads = _run_threads(num_threads, n * d, min(n_rows, flat.size))
    row_start = np.empty(n_rows + 1, dtype=np.int64)
    order = np.empty(flat.size, dtype=np.int64)
    if grad_table.flags.c_contiguous and grad_table.dtype.isnative:
        _kernels.scatter_add_rows(grad_table, g_c, flat, row_start, order, threads)
    else:
        work = np.ascontiguousarray(grad_table, dtype=native)
        _kernels.scatter_add_rows(work, g_c, flat, row_start, order, threads)
        np.copyto(grad_table, work)
    return flat
