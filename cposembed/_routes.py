"""The normalising routes: one per operation, for arguments its C entry refused.

Each normalises the arguments (or raises the worded error, :mod:`._validation`) and
calls the same entry again; an ``out`` the entry cannot write is computed aside and
copied in, as NumPy does. docs/architecture.md draws the route of a call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _core, _marks, _threads
from . import _validation as v

# Positions of more axes (NumPy 2 allows 64) are served by NumPy's indexing in
# lookups and flattened for the other operations.
MAX_POSITION_DIMS = _core.MAX_POSITION_DIMS


def _accepted(result: Any) -> Any:
    # Normalised arguments are what the entries take: None here is a bug.
    if result is None:
        raise RuntimeError("cposembed internal error: a C entry refused checked arguments")
    return result


def _into(out: Any, entry: Any, *args: Any, num_threads: int | None) -> Any:
    """``entry(*args, out, num_threads)`` with checked arguments; an ``out`` the
    entry refuses (another layout, or over what the call reads) is copied into."""
    if out is None:
        return _accepted(entry(*args, None, num_threads))
    if entry(*args, _base(out), num_threads) is None:
        np.copyto(out, _accepted(entry(*args, None, num_threads)))
    return out


def _base(arr: np.ndarray) -> np.ndarray:
    """``arr`` as an exact ndarray over the same memory (subclasses viewed as ndarray)."""
    return arr if type(arr) is np.ndarray else arr.view(np.ndarray)


def _same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.shape == b.shape
        and a.strides == b.strides
    )


# -- one table: lookup, add, scatter_add --------------------------------------


def lookup(table: Any, positions: Any, *, out: Any, num_threads: Any) -> Any:
    """:func:`cposembed.lookup` for arguments its C entry refused."""
    t = v.as_table(table)
    n_rows, d = t.shape
    nt = _threads.check_num_threads(num_threads)
    pos = v.as_positions(positions, n_rows)
    if pos is None or pos.ndim > MAX_POSITION_DIMS:
        return _lookup_numpy(t, positions, out)
    if out is not None:
        v.check_out(out, pos.shape + (d,), t.dtype)
    return _into(out, _core.lookup, t, pos, num_threads=nt)


def _lookup_numpy(table: np.ndarray, positions: Any, out: Any) -> Any:
    # Indices into the embedding axis too, served by NumPy as the reference does.
    result = table[positions]
    if isinstance(result, np.ndarray) and np.shares_memory(result, table):
        result = result.copy()
    if out is None:
        return result
    v.check_out(out, np.shape(result), table.dtype)
    np.copyto(out, result)
    return out


def check_offset(offset: Any, with_positions: bool, n_tokens: int, n_rows: int) -> int:
    """``offset`` as a Python int if it keeps the entries' ``_core.offset_rule`` for
    ``n_tokens`` rows of a table of ``n_rows`` positions, else the worded error."""
    if isinstance(offset, np.ndarray) and offset.ndim != 0:
        raise v.NotAnIntegerError(
            f"offset must be a single non-negative integer; got {v.describe(offset)} "
            "(for per-row positions pass positions=, e.g. from positions_from_mask)"
        )
    off = v.check_int(offset, "offset", expected="a non-negative integer")
    rule = _core.offset_rule(off, with_positions, n_tokens, n_rows)
    if rule == _core.OFFSET_NEGATIVE:
        raise ValueError(f"offset must be a non-negative integer; got {off}")
    if rule == _core.OFFSET_WITH_POSITIONS:
        raise ValueError(
            f"offset={off} only applies with positions=None; "
            "add it to the explicit positions instead"
        )
    if rule == _core.OFFSET_PAST_END:
        raise IndexError(
            f"position {off + n_tokens - 1} (offset {off} + {n_tokens} tokens) is "
            f"out of range for a table of {n_rows} positions "
            f"(expected 0 <= position < {n_rows})"
        )
    return off


def full_positions(pos: np.ndarray | None, offset: int, lead: tuple[int, ...]) -> np.ndarray:
    """``pos``, or for ``None`` the rows ``offset + arange(T)`` (``T = lead[-1]``), which
    broadcast to ``lead``: a caller's gather of them stays ``(T, d)``."""
    if pos is not None:
        return pos
    return np.arange(offset, offset + lead[-1], dtype=np.int64)


def row_positions(
    positions: Any,
    offset: Any,
    lead: tuple[int, ...],
    n_rows: int,
    what: str,
    lead_name: str | None = None,
) -> tuple[np.ndarray | None, int]:
    """``(positions, offset)`` for rows laid out as ``lead`` (``what.shape[:-1]``, or
    ``lead_name``), as the C entries take them."""
    if positions is None and not lead:
        check_offset(offset, False, 0, n_rows)
        raise ValueError(
            f"{what} must have shape (..., T, d) when positions is None; got a 1-D array"
        )
    n_tokens = lead[-1] if positions is None else 0
    off = check_offset(offset, positions is not None, n_tokens, n_rows)
    if positions is None:
        return None, off if n_tokens else 0
    pos = v.as_positions(positions, n_rows)
    if pos is None:
        raise IndexError(
            "positions must select rows of the table (integers, integer arrays, "
            "boolean masks or slices); an index into the embedding axis only works "
            "with lookup"
        )
    return v.broadcast_positions(pos, lead, lead_name or f"{what}.shape[:-1]"), 0


def add(tokens: Any, table: Any, positions: Any, *, offset: Any, out: Any, num_threads: Any) -> Any:
    """:func:`cposembed.add_positions` for arguments its C entry refused."""
    t = v.as_table(table)
    n_rows, d = t.shape
    tok = v.as_rows(tokens, d, "token_embeddings")
    v.check_not_mixed_halves(tok.dtype, "token_embeddings", t.dtype, "table")
    nt = _threads.check_num_threads(num_threads)
    pos, off = row_positions(positions, offset, tok.shape[:-1], n_rows, "token_embeddings")
    dtype = np.result_type(tok.dtype, t.dtype)
    if out is not None:
        v.check_out(out, tok.shape, dtype)
    if dtype != t.dtype:  # float64 tokens + float32 table, say: NumPy promotes
        return np.add(tok, t[full_positions(pos, off, tok.shape[:-1])], out=out)
    tok_c = v.canonical_copy(tok, dtype)
    rows, pos, off = _shallow(tok_c, pos, off, n_rows)
    if out is None:
        return _accepted(_core.add(rows, t, pos, off, None, nt)).reshape(tok.shape)
    o = _base(out)
    if _same_buffer(o, tok_c):
        # In place (the tokens may be a read-only view of out): out serves as both.
        o_rows = o.reshape(rows.shape)
        done = _core.add(o_rows, t, pos, off, o_rows, nt)
    else:
        # The entry writes `out` if it can; a C-contiguous one in the rows' shape.
        target = o.reshape(rows.shape) if o.flags.c_contiguous else o
        done = None
        if target.shape == rows.shape:
            done = _core.add(rows, t, pos, off, target, nt)
    if done is None:
        np.copyto(out, _accepted(_core.add(rows, t, pos, off, None, nt)).reshape(tok.shape))
    return out


def _shallow(
    rows: np.ndarray, pos: np.ndarray | None, offset: int, n_rows: int
) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Rows ``(..., d)`` and positions of more than ``MAX_POSITION_DIMS`` axes seen as
    ``(N, d)`` and ``(N,)``; the caller reshapes a result."""
    lead = rows.shape[:-1]
    if len(lead) <= MAX_POSITION_DIMS and (pos is None or pos.ndim <= MAX_POSITION_DIMS):
        return rows, pos, offset
    flat = np.ascontiguousarray(np.broadcast_to(full_positions(pos, offset, lead), lead))
    flat = flat.reshape(-1)
    return rows.reshape(-1, rows.shape[-1]), flat, 0


def grad_output_dtype(grad_output: np.dtype, table: np.dtype) -> np.dtype:
    """The dtype a gradient enters the scatter-add entries in: its own (native) if a
    table dtype (the entries add as ``np.add.at`` does), else the table's."""
    native = v.native_dtype(grad_output)
    return native if v.is_float(native) else table


def scatter_add(
    grad_table: Any,
    grad_output: Any,
    positions: Any,
    *,
    offset: Any,
    num_threads: Any,
    touched: _marks.RowMarks | None = None,
    skip_row: int = -1,
) -> None:
    """:func:`cposembed.scatter_add` that also marks the rows it adds to in
    ``touched`` (a :class:`~cposembed._marks.RowMarks` of L rows, or None) and gives
    row ``skip_row`` (padding; -1: none) no gradient. It calls the entry first."""
    args = (grad_table, grad_output, positions, offset, num_threads, touched, skip_row)
    if _core.scatter_add(*args) is not None:
        return
    v.as_grad_table(grad_table, "grad_table")
    native = v.native_dtype(grad_table.dtype)
    n_rows, d = grad_table.shape
    g = v.as_rows(grad_output, d, "grad_output")
    nt = _threads.check_num_threads(num_threads)
    pos, off = row_positions(positions, offset, g.shape[:-1], n_rows, "grad_output")
    g_c = v.canonical_copy(g, grad_output_dtype(g.dtype, native))
    if v.overlaps(g_c, grad_table):
        g_c = g_c.copy()
    g_c, pos, off = _shallow(g_c, pos, off, n_rows)
    base = _base(grad_table)
    work = v.canonical_copy(base, native)
    _accepted(_core.scatter_add(work, g_c, pos, off, nt, touched, skip_row))
    if work is not base:
        np.copyto(grad_table, work)


# -- the input layer: embed, embed_backward -----------------------------------


def _same_dim(a: np.ndarray, b: np.ndarray, names: str) -> None:
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{names} must share embed_dim; got {a.shape[1]} and {b.shape[1]}")


def checked_ids(token_ids: Any, vocab_size: int) -> np.ndarray:
    """Token ids as an owned int64 array, checked in ``[-V, V)`` and wrapped."""
    ids = v.as_positions(token_ids, vocab_size, "token id")
    if ids is None:
        raise IndexError(
            "token_ids must be integers or integer arrays (or boolean masks or slices "
            f"of the vocabulary); got {v.describe(token_ids)}"
        )
    return ids


def id_positions(
    ids: np.ndarray, positions: Any, offset: Any, n_rows: int
) -> tuple[np.ndarray | None, int]:
    """:func:`row_positions` for the tokens ``ids`` (positions broadcast to ``ids.shape``)."""
    if positions is None and ids.ndim == 0:
        check_offset(offset, False, 0, n_rows)
        raise ValueError(
            "token_ids must have shape (..., T) when positions is None; got a single id "
            "(pass positions=, e.g. the token's position)"
        )
    return row_positions(positions, offset, ids.shape, n_rows, "token_ids", "token_ids.shape")


def id_rows(grad_output: Any, ids: np.ndarray, d: int) -> np.ndarray:
    """``grad_output`` checked to have shape ``ids.shape + (d,)``."""
    g = v.as_rows(grad_output, d, "grad_output")
    if g.shape[:-1] != ids.shape:
        raise ValueError(
            f"grad_output must have shape token_ids.shape + (d,) = {ids.shape + (d,)}; "
            f"got {g.shape}"
        )
    return g


def embed(
    token_ids: Any,
    token_table: Any,
    position_table: Any,
    positions: Any,
    *,
    offset: Any,
    out: Any,
    num_threads: Any,
) -> Any:
    """:func:`cposembed.embed` for arguments its C entry refused."""
    tt = v.as_table(token_table, "token_table")
    pt = v.as_table(position_table, "position_table")
    _same_dim(tt, pt, "token_table and position_table")
    v.check_not_mixed_halves(tt.dtype, "token_table", pt.dtype, "position_table")
    nt = _threads.check_num_threads(num_threads)
    ids = checked_ids(token_ids, tt.shape[0])
    pos, off = id_positions(ids, positions, offset, pt.shape[0])
    dtype = np.result_type(tt.dtype, pt.dtype)
    shape = ids.shape + (tt.shape[1],)
    if out is not None:
        v.check_out(out, shape, dtype)
    if tt.dtype != pt.dtype or ids.ndim > MAX_POSITION_DIMS:  # NumPy promotes
        return np.add(tt[ids], pt[full_positions(pos, off, ids.shape)], out=out)
    return _into(out, _core.embed, ids, tt, pt, pos, off, num_threads=nt)


def _backward_ids(token_ids: Any, gt: np.ndarray | None) -> np.ndarray:
    """embed_backward's token ids: checked against the token table, or (no token
    table) integers that give the shape only."""
    if gt is not None:
        return checked_ids(token_ids, gt.shape[0])
    ids = np.asarray(token_ids)
    if ids.size == 0 and ids.dtype.kind == "f":
        ids = ids.astype(np.int64)  # NumPy reads [] as an empty index
    if ids.dtype.kind not in "iu":
        raise IndexError(f"token_ids must be integers; got {v.describe(token_ids)}")
    return ids


def embed_backward(
    grad_token_table: Any,
    grad_position_table: Any,
    grad_output: Any,
    token_ids: Any,
    positions: Any,
    *,
    offset: Any,
    num_threads: Any,
    token_touched: _marks.RowMarks | None = None,
    position_touched: _marks.RowMarks | None = None,
    token_skip_row: int = -1,
) -> None:
    """:func:`cposembed.embed_backward` with the touched rows and the row to skip, as
    :func:`scatter_add`. It calls the entry first when both tables are given."""
    if grad_token_table is not None and grad_position_table is not None:
        args = (grad_token_table, grad_position_table, grad_output, token_ids, positions)
        marks = (token_touched, position_touched, token_skip_row)
        if _core.embed_backward(*args, offset, num_threads, *marks) is not None:
            return
    gt, gp = (
        None if t is None else v.as_grad_table(t, name)
        for t, name in [
            (grad_token_table, "grad_token_table"),
            (grad_position_table, "grad_position_table"),
        ]
    )
    tables = [x for x in (gt, gp) if x is not None]
    if gt is not None and gp is not None:
        _same_dim(gt, gp, "grad_token_table and grad_position_table")
    nt = _threads.check_num_threads(num_threads)
    ids = _backward_ids(token_ids, gt)
    if not tables:
        check_offset(offset, False, 0, 0)
        return
    g = id_rows(grad_output, ids, tables[0].shape[1])
    if gp is not None:
        pos, off = id_positions(ids, positions, offset, gp.shape[0])
    else:
        pos, off = None, check_offset(offset, False, 0, 0)  # no position table to index
    # Both gradients come from grad_output as given (np.add.at on copies), so one
    # that shares memory with a table is copied before the first write.
    if any(v.overlaps(g, table) for table in tables):
        g = g.copy()
    # One scatter-add per table, tokens first (np.add.at's order on tied tables).
    if gt is not None:
        scatter_add(
            gt, g, ids, offset=0, num_threads=nt, touched=token_touched, skip_row=token_skip_row
        )
    if gp is not None:
        rows = full_positions(pos, off, ids.shape)
        scatter_add(gp, g, rows, offset=0, num_threads=nt, touched=position_touched)
