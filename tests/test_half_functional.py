"""float16 and bfloat16 in the functional operations (lookup, add_positions,
scatter_add, embed, embed_backward): bitwise NumPy's answer (with ml_dtypes) at
every pair of the four float dtypes, on both sides of the serial threshold, on
1-4 threads; the issue's facts; every bit pattern of the half dtypes; nothing
written on error."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from half_oracle import (
    PAIRS,
    assert_bitwise,
    no_common_type,
    numpy_add,
    numpy_add_at,
    pair_id,
    uint_bits,
    unchanged,
)
from helpers import _sizes, tuned
from hypothesis import given, note
from hypothesis import strategies as st
from strategies import BFLOAT16, TABLE_DTYPES, edge_values

import cposembed
from cposembed import _threads

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
HALVES = [F16, BFLOAT16]
HALF_IDS = ["float16", "bfloat16"]
DTYPE_IDS = [dt.name for dt in TABLE_DTYPES]
PAIR_IDS = [pair_id(p) for p in PAIRS]
THREADS = st.sampled_from([None, 1, 2, 3, 4])
# serial_below: the default rule (tiny calls on one thread), or threads for any size.
SIDES = st.sampled_from([None, 0])
INDEX_DTYPES = st.sampled_from([np.int64, np.int32, np.int16, np.intp])


# ------------------------------------------------------------------ strategies
@st.composite
def positions_for(draw, n_rows: int, lead: tuple[int, ...]):
    """(positions, offset, rows): the call's arguments and the rows they mean.
    Default positions (an offset), explicit positions of the leading shape (with
    duplicates and negatives), or one row of them broadcast, sometimes as a list."""
    T = lead[-1] if lead else 0
    modes = ["explicit", "row"]
    if lead and T <= n_rows:
        modes += ["default"]
    mode = draw(st.sampled_from(modes))
    note(f"positions {mode}")
    if mode == "default":
        offset = draw(st.integers(0, n_rows - T))
        return None, offset, np.arange(offset, offset + T)
    shape = lead if mode == "explicit" else lead[-1:]
    size = int(np.prod(shape))
    values = draw(st.lists(st.integers(-n_rows, n_rows - 1), min_size=size, max_size=size))
    rows = np.array(values, dtype=np.int64).reshape(shape)
    positions = rows.astype(draw(INDEX_DTYPES))
    if size and draw(st.integers(0, 4)) == 0:
        positions = positions.tolist()
    return positions, 0, rows


def _lead(draw, max_dims: int = 3) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(0, 4), min_size=1, max_size=max_dims)))


def _fresh_out(draw, shape, dtype) -> np.ndarray:
    """An ``out=`` array filled with any bits (so that a skipped element shows)."""
    return draw(edge_values(shape, dtype))


# ----------------------------------------------------------------------- lookup
@pytest.mark.parametrize("dtype", TABLE_DTYPES, ids=DTYPE_IDS)
@given(data=st.data(), threads=THREADS, side=SIDES)
def test_lookup_is_the_table_indexed_bitwise(dtype, data, threads, side):
    L = data.draw(st.integers(1, 8), label="L")
    d = data.draw(st.integers(0, 6), label="d")
    table = data.draw(edge_values((L, d), dtype), label="table")
    lead = _lead(data.draw)
    positions, _, rows = data.draw(positions_for(L, lead))
    if positions is None:
        positions = rows
    want = table[rows]
    table_kept = unchanged(table)
    with tuned(serial_below=side):
        assert_bitwise(cposembed.lookup(table, positions, num_threads=threads), want)
        out = _fresh_out(data.draw, want.shape, dtype)
        assert cposembed.lookup(table, positions, out=out, num_threads=threads) is out
    assert_bitwise(out, want)
    table_kept()


# ------------------------------------------------------------------------- add
@pytest.mark.parametrize("tok_dtype,table_dtype", PAIRS, ids=PAIR_IDS)
@given(data=st.data(), threads=THREADS, side=SIDES)
def test_add_positions_is_numpy_bitwise(tok_dtype, table_dtype, data, threads, side):
    """``tokens + table[positions]`` in NumPy's result dtype, each element rounded
    once; float16 with bfloat16 a TypeError; out= fresh or the tokens themselves."""
    L = data.draw(st.integers(1, 8), label="L")
    d = data.draw(st.integers(0, 6), label="d")
    table = data.draw(edge_values((L, d), table_dtype), label="table")
    lead = _lead(data.draw)
    tokens = data.draw(edge_values(lead + (d,), tok_dtype), label="tokens")
    positions, offset, rows = data.draw(positions_for(L, lead))
    out_kind = data.draw(st.sampled_from(["none", "fresh", "tokens"]))
    note(f"out {out_kind}")
    refused = no_common_type(tok_dtype, table_dtype)
    if not refused:
        want, nan_pairs = numpy_add(tokens, table, rows)
        # out=tokens takes only a result of the tokens' dtype (out is never cast).
        refused = out_kind == "tokens" and want.dtype != tokens.dtype
    if out_kind == "fresh":
        out_dtype = tok_dtype if refused else want.dtype
        out = _fresh_out(data.draw, lead + (d,), out_dtype)
    else:
        out = tokens if out_kind == "tokens" else None
    kept = unchanged(tokens, table, out)
    inputs_kept = unchanged(table) if out is tokens else unchanged(tokens, table)
    with tuned(serial_below=side):
        if refused:
            with pytest.raises(TypeError):
                cposembed.add_positions(
                    tokens, table, positions, offset=offset, out=out, num_threads=threads
                )
            kept()
            return
        got = cposembed.add_positions(
            tokens, table, positions, offset=offset, out=out, num_threads=threads
        )
    if out is not None:
        assert got is out
    assert_bitwise(got, want, nan_pairs)
    inputs_kept()


# ------------------------------------------------------------------ scatter_add
@pytest.mark.parametrize("grad_dtype,g_dtype", PAIRS, ids=PAIR_IDS)
@given(data=st.data(), threads=THREADS, side=SIDES)
def test_scatter_add_is_np_add_at_bitwise(grad_dtype, g_dtype, data, threads, side):
    """grad_output of any of the four dtypes into a table of any of the four:
    ``np.add.at``'s bits (computed in float64 if either is float64, else in float32,
    rounded after each add); float16 with bfloat16 that or a TypeError."""
    L = data.draw(st.integers(1, 6), label="L")
    d = data.draw(st.integers(0, 5), label="d")
    grad = data.draw(edge_values((L, d), grad_dtype), label="grad")
    lead = _lead(data.draw)
    g = data.draw(edge_values(lead + (d,), g_dtype), label="grad_output")
    positions, offset, rows = data.draw(positions_for(L, lead))
    want, nan_pairs = numpy_add_at(grad, rows, g)
    grad_kept, g_kept = unchanged(grad), unchanged(g)
    with tuned(serial_below=side):
        try:
            result = cposembed.scatter_add(grad, g, positions, offset=offset, num_threads=threads)
        except TypeError:
            assert no_common_type(grad_dtype, g_dtype), "refused a pair NumPy adds"
            grad_kept()
            return
    assert result is grad
    assert_bitwise(grad, want, nan_pairs)
    g_kept()


# ------------------------------------------------------------------------ embed
@st.composite
def layer_arrays(draw, wte_dtype, wpe_dtype):
    vocab = draw(st.integers(1, 8), label="vocab")
    n_pos = draw(st.integers(1, 6), label="n_pos")
    d = draw(st.integers(0, 5), label="d")
    lead = _lead(draw, max_dims=2)
    size = int(np.prod(lead))
    ids = np.array(
        draw(st.lists(st.integers(-vocab, vocab - 1), min_size=size, max_size=size)), np.int64
    ).reshape(lead)
    positions, offset, rows = draw(positions_for(n_pos, lead))
    wte = draw(edge_values((vocab, d), wte_dtype), label="wte")
    wpe = draw(edge_values((n_pos, d), wpe_dtype), label="wpe")
    return wte, wpe, ids, positions, offset, rows


@pytest.mark.parametrize("wte_dtype,wpe_dtype", PAIRS, ids=PAIR_IDS)
@given(data=st.data(), threads=THREADS, side=SIDES)
def test_embed_is_numpy_bitwise(wte_dtype, wpe_dtype, data, threads, side):
    """``wte[ids] + wpe[positions]``: NumPy's dtype and bits; float16 with bfloat16
    a TypeError with ``out`` untouched."""
    wte, wpe, ids, positions, offset, rows = data.draw(layer_arrays(wte_dtype, wpe_dtype))
    refused = no_common_type(wte_dtype, wpe_dtype)
    shape = ids.shape + (wte.shape[1],)
    if not refused:
        want, nan_pairs = numpy_add(wte[ids], wpe, np.broadcast_to(rows, ids.shape))
    use_out = data.draw(st.booleans(), label="out")
    out = _fresh_out(data.draw, shape, F32 if refused else want.dtype) if use_out else None
    kept = unchanged(wte, wpe, out)
    tables_kept = unchanged(wte, wpe)
    with tuned(serial_below=side):
        if refused:
            with pytest.raises(TypeError):
                cposembed.embed(
                    ids, wte, wpe, positions, offset=offset, out=out, num_threads=threads
                )
            kept()
            return
        got = cposembed.embed(ids, wte, wpe, positions, offset=offset, out=out, num_threads=threads)
    if out is not None:
        assert got is out
    assert_bitwise(got, want, nan_pairs)
    tables_kept()


@pytest.mark.parametrize("table_dtype,g_dtype", PAIRS, ids=PAIR_IDS)
@given(data=st.data(), threads=THREADS, side=SIDES)
def test_embed_backward_is_np_add_at_on_each_table(table_dtype, g_dtype, data, threads, side):
    """Each gradient table gets ``np.add.at``'s bits of grad_output as is (any
    dtype); the position table's dtype is the token table's or any other; a
    table may be None."""
    gp_dtype = data.draw(st.sampled_from([table_dtype, *TABLE_DTYPES]), label="gp dtype")
    gt, gp, ids, positions, offset, rows = data.draw(layer_arrays(table_dtype, gp_dtype))
    g = data.draw(edge_values(ids.shape + (gt.shape[1],), g_dtype), label="grad_output")
    which = data.draw(st.sampled_from(["both", "tokens", "positions"]))
    gt_arg = None if which == "positions" else gt
    gp_arg = None if which == "tokens" else gp
    want_t, nan_t = numpy_add_at(gt, ids, g)
    want_p, nan_p = numpy_add_at(gp, np.broadcast_to(rows, ids.shape), g)
    kept = unchanged(gt, gp)
    g_kept = unchanged(g)
    with tuned(serial_below=side):
        try:
            cposembed.embed_backward(
                gt_arg, gp_arg, g, ids, positions, offset=offset, num_threads=threads
            )
        except TypeError:
            dtypes = [a.dtype for a in (gt_arg, gp_arg) if a is not None]
            assert no_common_type(g_dtype, *dtypes), "refused dtypes NumPy adds"
            kept()
            return
    if gt_arg is not None:
        assert_bitwise(gt, want_t, nan_t)
    if gp_arg is not None:
        assert_bitwise(gp, want_p, nan_p)
    g_kept()
