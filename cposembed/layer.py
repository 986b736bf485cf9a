"""The whole input layer: embed and embed_backward (token + position tables).

The same route as :mod:`cposembed.functional`: each function calls its C
entry (``_core.embed``, ``_core.embed_backward``) with the arguments as
given and, for what it declines, normalises them (or raises the worded
error) and calls the same entry again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _core, _threads
from . import _validation as v
from .functional import (
    _MAX_POSITION_DIMS,
    _accepted,
    _base,
    _row_positions,
    scatter_add_marking,
)

__all__ = ["embed", "embed_backward"]


def embed(
    token_ids: Any,
    token_table: Any,
    position_table: Any,
    positions: Any = None,
    *,
    offset: int = 0,
    out: np.ndarray | None = None,
    num_threads: int | None = None,
) -> np.ndarray:
    """The input layer in one pass: ``token_table[token_ids] + position_table[positions]``.

    Each output row is written once: the token row is gathered (from a
    vocabulary table far larger than the caches) and its position row added
    in the same pass.

    Parameters
    ----------
    token_ids : int, array_like of int
        Shape ``(..., T)``; ``-V <= id < V`` (negatives wrap).
    token_table : array_like of shape (V, d), float32 or float64
        Token embeddings (GPT-2's ``wte``).
    position_table : array_like of shape (L, d), float32 or float64
        Position embeddings (GPT-2's ``wpe``); same ``d``.
    positions : array_like of int, optional
        Must broadcast to ``token_ids.shape``. ``None`` means
        ``offset + arange(T)`` for every sequence.
    offset : int, default 0
        Tokens already seen (incremental decoding); only with ``positions=None``.
    out : ndarray, optional
        Destination of shape ``token_ids.shape + (d,)`` and the result dtype.
    num_threads : int, optional
        Threads for this call.

    Returns
    -------
    ndarray
        What NumPy's ``token_table[token_ids] + position_table[positions]``
        returns (dtype and values): ``out`` if given, else a new array.

    Raises
    ------
    IndexError
        A token id outside ``[-V, V)`` or a position outside ``[-L, L)``.
    TypeError, ValueError
        Tables that are not 2-D float arrays of one ``embed_dim``, positions
        that do not broadcast, or an ``out`` that does not fit.

    Examples
    --------
    >>> import numpy as np
    >>> import cposembed
    >>> wte = np.arange(6, dtype=np.float32).reshape(3, 2)
    >>> wpe = np.full((4, 2), 10, dtype=np.float32)
    >>> cposembed.embed([[2, 0]], wte, wpe)
    array([[[14., 15.],
            [10., 11.]]], dtype=float32)
    """
    result = _core.embed(
        token_ids, token_table, position_table, positions, offset, out, num_threads
    )
    if result is None:
        result = _embed_normalised(
            token_ids, token_table, position_table, positions, offset, out, num_threads
        )
    return result


def _tables_pair(token_table: Any, position_table: Any) -> tuple[np.ndarray, np.ndarray]:
    tt = v.as_table(token_table, "token_table")
    pt = v.as_table(position_table, "position_table")
    if tt.shape[1] != pt.shape[1]:
        raise ValueError(
            f"token_table and position_table must share embed_dim; got {tt.shape[1]} "
            f"and {pt.shape[1]}"
        )
    return tt, pt


def _ids(token_ids: Any, vocab_size: int) -> np.ndarray:
    ids = v.as_positions(token_ids, vocab_size, "token id")
    if ids is None:
        raise IndexError(
            "token_ids must be integers or integer arrays (or boolean masks or slices "
            f"of the vocabulary); got {v.describe(token_ids)}"
        )
    return ids


def _id_positions(
    ids: np.ndarray, positions: Any, offset: Any, n_rows: int
) -> tuple[np.ndarray | None, int]:
    if positions is None and ids.ndim == 0:
        v.as_offset(offset)
        raise ValueError(
            "token_ids must have shape (..., T) when positions is None; got a single id "
            "(pass positions=, e.g. the token's position)"
        )
    return _row_positions(positions, offset, ids.shape, n_rows, "token_ids", "token_ids.shape")


def _embed_normalised(
    token_ids: Any,
    token_table: Any,
    position_table: Any,
    positions: Any,
    offset: Any,
    out: Any,
    num_threads: Any,
) -> Any:
    tt, pt = _tables_pair(token_table, position_table)
    nt = _threads.check_num_threads(num_threads)
    ids = _ids(token_ids, tt.shape[0])
    pos, off = _id_positions(ids, positions, offset, pt.shape[0])
    dtype = np.result_type(tt.dtype, pt.dtype)
    shape = ids.shape + (tt.shape[1],)
    if out is not None:
        v.check_out(out, shape, dtype)
    if tt.dtype != pt.dtype or ids.ndim > _MAX_POSITION_DIMS:
        # Mixed dtypes: NumPy's own promotion decides.
        rows = pt[v.default_positions(off, ids.shape[-1])] if pos is None else pt[pos]
        return np.add(tt[ids], rows, out=out)
    if out is None:
        return _accepted(_core.embed(ids, tt, pt, pos, off, None, nt))
    # The entry writes `out` itself if it can (it declines another layout or
    # an `out` over either table); else the result is computed aside.
    if _core.embed(ids, tt, pt, pos, off, _base(out), nt) is None:
        np.copyto(out, _accepted(_core.embed(ids, tt, pt, pos, off, None, nt)))
    return out


def embed_backward(
    grad_token_table: np.ndarray | None,
    grad_position_table: np.ndarray | None,
    grad_output: Any,
    token_ids: Any,
    positions: Any = None,
    *,
    offset: int = 0,
    num_threads: int | None = None,
) -> None:
    """The gradient of :func:`embed`: both tables from one read of ``grad_output``.

    ``np.add.at(grad_token_table, token_ids, grad_output)`` and
    ``np.add.at(grad_position_table, positions, grad_output)``, bitwise, for
    any thread count: each table row sums its contributions in input order,
    on one thread. The threads split the rows by contributions, not by row
    count, so a token that appears thousands of times in a batch does not
    leave the other threads idle.

    Parameters
    ----------
    grad_token_table : ndarray of shape (V, d), float32 or float64, writable, or None
        Accumulated into in place; ``None`` skips the token table.
    grad_position_table : ndarray of shape (L, d), float32 or float64, writable, or None
        Accumulated into in place; ``None`` skips the position table.
    grad_output : array_like of shape token_ids.shape + (d,)
        Gradient of the loss with respect to :func:`embed`'s output;
        converted to each table's dtype.
    token_ids : int, array_like of int
        The token ids of the forward call.
    positions : array_like of int, optional
        The positions of the forward call; ``None`` means ``offset + arange(T)``.
    offset : int, default 0
        Only with ``positions=None``.
    num_threads : int, optional
        Threads for this call.

    Raises
    ------
    IndexError
        A token id or position out of range.
    TypeError, ValueError
        Tables that are not writable 2-D float arrays of one ``embed_dim``, or
        a ``grad_output`` whose shape is not ``token_ids.shape + (d,)``.
        Nothing is written when an error is raised.

    Examples
    --------
    >>> import numpy as np
    >>> import cposembed
    >>> g_wte = np.zeros((3, 2)); g_wpe = np.zeros((4, 2))
    >>> cposembed.embed_backward(g_wte, g_wpe, np.ones((1, 3, 2)), [[2, 0, 2]])
    >>> g_wte[:, 0], g_wpe[:, 0]
    (array([1., 0., 2.]), array([1., 1., 1., 0.]))
    """
    embed_backward_marking(
        grad_token_table,
        grad_position_table,
        grad_output,
        token_ids,
        positions,
        offset,
        num_threads,
        None,
        None,
        -1,
    )


def embed_backward_marking(
    grad_token_table: Any,
    grad_position_table: Any,
    grad_output: Any,
    token_ids: Any,
    positions: Any,
    offset: Any,
    num_threads: Any,
    token_touched: np.ndarray | None,
    position_touched: np.ndarray | None,
    token_skip_row: int,
) -> None:
    """:func:`embed_backward` that also marks the rows it touched (bool arrays of
    length V and L, or None) and gives token row ``token_skip_row`` (padding) no
    gradient (-1: none)."""
    if grad_token_table is not None and grad_position_table is not None:
        done = _core.embed_backward(
            grad_token_table,
            grad_position_table,
            grad_output,
            token_ids,
            positions,
            offset,
            num_threads,
            token_touched,
            position_touched,
            token_skip_row,
        )
        if done is not None:
            return
    _embed_backward_normalised(
        grad_token_table,
        grad_position_table,
        grad_output,
        token_ids,
        positions,
        offset,
        num_threads,
        token_touched,
        position_touched,
        token_skip_row,
    )


def _embed_backward_normalised(
    grad_token_table: Any,
    grad_position_table: Any,
    grad_output: Any,
    token_ids: Any,
    positions: Any,
    offset: Any,
    num_threads: Any,
    token_touched: np.ndarray | None,
    position_touched: np.ndarray | None,
    token_skip_row: int,
) -> None:
    gt = None if grad_token_table is None else v.as_grad_table(grad_token_table, "grad_token_table")
    gp = (
        None
        if grad_position_table is None
        else v.as_grad_table(grad_position_table, "grad_position_table")
    )
    tables = [x for x in (gt, gp) if x is not None]
    if len(tables) == 2 and gt.shape[1] != gp.shape[1]:  # type: ignore[union-attr]
        raise ValueError(
            f"grad_token_table and grad_position_table must share embed_dim; got "
            f"{gt.shape[1]} and {gp.shape[1]}"  # type: ignore[union-attr]
        )
    nt = _threads.check_num_threads(num_threads)
    if gt is not None:
        ids = _ids(token_ids, gt.shape[0])
    else:  # no token table: the ids give the shape only
        ids = np.asarray(token_ids)
        if ids.size == 0 and ids.dtype.kind == "f":
            ids = ids.astype(np.int64)  # NumPy reads [] as an empty index
        if ids.dtype.kind not in "iu":
            raise IndexError(f"token_ids must be integers; got {v.describe(token_ids)}")
    if not tables:
        v.as_offset(offset)
        return
    d = tables[0].shape[1]
    g = v.as_rows(grad_output, d, "grad_output")
    if g.shape[:-1] != ids.shape:
        raise ValueError(
            f"grad_output must have shape token_ids.shape + (d,) = {ids.shape + (d,)}; "
            f"got {g.shape}"
        )
    if gp is not None:
        pos, off = _id_positions(ids, positions, offset, gp.shape[0])
    else:
        pos, off = None, v.as_offset(offset)  # checked; no position table to index
    # Both gradients come from grad_output as given, as np.add.at on copies
    # gives them: one that shares memory with a table is copied before the
    # first write. (The ids and positions are arrays this call owns.)
    if any(v.overlaps(g, table) for table in tables):
        g = g.copy()
    same = (
        gt is not None
        and gp is not None
        and gt.dtype == gp.dtype
        and not v.overlaps(gt, gp)
        and ids.ndim <= _MAX_POSITION_DIMS
    )
    if not same:
        # One table, or two that differ in dtype or share memory: one
        # scatter-add each, tokens first (np.add.at's order on tied tables).
        if gt is not None:
            scatter_add_marking(gt, g, ids, 0, nt, token_touched, token_skip_row)
        if gp is not None:
            rows = (
                np.broadcast_to(v.default_positions(off, ids.shape[-1]), ids.shape)
                if (pos is None)
                else pos
            )
            scatter_add_marking(gp, g, rows, 0, nt, position_touched, -1)
        return
    assert gt is not None and gp is not None
    native = v.native_dtype(gt.dtype)
    g_c = v.plain_copy(g, native)
    works = []
    for table in (gt, gp):
        works.append(v.plain_copy(_base(table), native))
    _accepted(
        _core.embed_backward(
            works[0],
            works[1],
            g_c,
            ids,
            pos,
            off,
            nt,
            token_touched,
            position_touched,
            token_skip_row,
        )
    )
    for table, work in zip((gt, gp), works):
        if work is not _base(table):
            np.copyto(table, work)
