"""Every kernel path of cposembed._core against NumPy / np.add.at.

The size rules are changed with ``_core.set_tuning`` so that small data
reaches every path: streaming (non-temporal) vs ordinary stores on aligned,
offset and odd-length rows, in place and not; the scatter-add's plans
(distinct rows, the scan under the default and smaller scan budgets, the
sort) on 1-4 threads, bitwise, with positions repeating over leading axes; the
SGD row update. Then both sides of the serial and streaming thresholds at their real
sizes, the tiny-call paths of the class, the reusable output blocks, and the
benchmark's machine-limit probes.
"""

from __future__ import annotations

import gc
import platform

import numpy as np
import pytest
from helpers import INDEX_DTYPES, assert_clean_exit, bits, reference_scatter, run_python, tuned
from hypothesis import given, settings
from hypothesis import strategies as st

import cposembed
from cposembed import _blocks, _core, _marks, _membench

FLOATS = [np.float32, np.float64]


THREADS = [1, 2, 3, 4]


ROW_LENGTHS = [1, 3, 4, 7, 16, 33, 130]


PLANS = [_core.PLAN_AUTO, _core.PLAN_DISTINCT, _core.PLAN_SCAN, _core.PLAN_SORT]


NEVER = 1 << 60  # a size no output reaches: streaming stores off


SERIAL = _core.SERIAL_THRESHOLD


STREAM = _core.STREAM_THRESHOLD_BYTES


OPENMP = _core.openmp_enabled()


# Scan budgets: the default, then smaller ones down to less than a row, under
# which the auto plan weighs the scan against the sort (how often the rows
# beyond the budget's worth of the most hit are hit again).
SCAN_BLOCKS = [None, 8192, 4096, 64, 8]


def _same_bits(got, expect):
    assert got.shape == expect.shape and got.dtype == expect.dtype
    assert np.array_equal(bits(got), bits(expect))


def _team(threads):
    """Threads a call with num_threads=threads and enough work runs on."""
    return min(threads, 4 * _core.cpu_limit()) if OPENMP else 1


def _unaligned(shape, dtype, byte_offset):
    """A C-contiguous array whose data starts `byte_offset` bytes past a 64-byte boundary."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(n + 64 + byte_offset, np.uint8)
    start = (-raw.ctypes.data) % 64 + byte_offset
    return raw[start : start + n].view(dtype).reshape(shape)


def _positions(rng, n_rows, size, index_dtype):
    lo = 0 if np.dtype(index_dtype).kind == "u" else -n_rows
    return rng.integers(lo, n_rows, size=size).astype(index_dtype)


@pytest.fixture
def tuning():
    """_core.set_tuning, with the previous size rules restored afterwards."""
    old = _core.set_tuning()
    yield _core.set_tuning
    _core.set_tuning(**old)


def test_set_tuning_returns_and_restores_the_rules():
    old = _core.set_tuning()
    assert old == _core.set_tuning()  # no arguments: nothing changes
    try:
        prev = _core.set_tuning(
            serial_below=0, stream_bytes=0, scan_block_bytes=64, chunk_elems=3, adapt=False
        )
        assert prev == old
        now = {
            "serial_below": 0,
            "stream_bytes": 0,
            "scan_block_bytes": 64,
            "chunk_elems": 3,
            "adapt": False,
        }
        assert _core.set_tuning() == now
    finally:
        _core.set_tuning(**old)
    assert old["serial_below"] == SERIAL and old["stream_bytes"] == STREAM
    assert old["chunk_elems"] == 65536 and old["adapt"] is True
    assert _core.set_tuning() == old


# ------------------------------------------------------ streaming vs plain
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("d", ROW_LENGTHS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
def test_lookup_every_store_path(tuning, dtype, d, stream, threads):
    tuning(serial_below=0, stream_bytes=0 if stream else NEVER)
    rng = np.random.default_rng(d)
    table = rng.standard_normal((50, d)).astype(dtype)
    for index_dtype in INDEX_DTYPES:
        pos = _positions(rng, 50, 77, index_dtype)
        expect = np.take(table, pos.astype(np.int64), axis=0)
        # Row starts at every 16-byte phase (element-aligned offsets).
        for off_elems in range(4):
            out = _unaligned((77, d), dtype, off_elems * np.dtype(dtype).itemsize)
            out[...] = -1
            assert _core.lookup(table, pos, out, threads) is out
            assert _core.last_team() == _team(threads)
            _same_bits(out, expect)
        _same_bits(_core.lookup(table, pos, None, threads), expect)  # a fresh output


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("stream", [False, True])
def test_lookup_into_misaligned_bytes(tuning, dtype, stream):
    # Not even aligned to the element size: the entry declines (nothing
    # written) and the function computes aside, then copies in.
    tuning(serial_below=0, stream_bytes=0 if stream else NEVER)
    table = np.random.default_rng(0).standard_normal((9, 21)).astype(dtype)
    pos = np.array([3, 0, -1, 8, 3], np.int64)
    out = _unaligned((5, 21), dtype, 1)
    out[...] = 5
    assert not out.flags.aligned
    assert _core.lookup(table, pos, out, 2) is None
    assert np.all(out == 5)
    assert cposembed.lookup(table, pos, out=out, num_threads=2) is out
    _same_bits(out, table[pos])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("d", sorted(set(ROW_LENGTHS) | {5, 8, 31, 64}))
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_add_every_store_path(tuning, dtype, d, stream, in_place, threads):
    tuning(serial_below=0, stream_bytes=0 if stream else NEVER)
    rng = np.random.default_rng(d)
    table = rng.standard_normal((40, d)).astype(dtype)
    m = 13
    itemsize = np.dtype(dtype).itemsize
    for index_dtype in (np.int8, np.uint16, np.int64):
        pos = _positions(rng, 40, m, index_dtype)
        tok = rng.standard_normal((3, m, d)).astype(dtype)
        # positions (m,) for (3, m) rows: one period, repeated over the batch
        for positions, offset, rows in ((pos, 0, pos), (None, 27, np.arange(27, 40))):
            expect = tok + table[rows]
            for off_elems in (0, 1, 3):
                t = _unaligned(tok.shape, dtype, off_elems * itemsize)
                t[...] = tok
                out = t if in_place else _unaligned(tok.shape, dtype, off_elems * itemsize)
                assert _core.add(t, table, positions, offset, out, threads) is out
                assert _core.last_team() == _team(threads)
                _same_bits(out, expect)
                if not in_place:
                    _same_bits(t, tok)


@pytest.mark.parametrize("threshold", [0, NEVER])
@pytest.mark.parametrize("threads", [1, 2])
def test_functions_on_both_sides_of_the_stream_rule(tuning, threshold, threads):
    tuning(stream_bytes=threshold)
    rng = np.random.default_rng(1)
    table = rng.standard_normal((300, 70)).astype(np.float32)
    pos = rng.integers(0, 300, size=(6, 200))
    tok = rng.standard_normal((6, 200, 70)).astype(np.float32)
    _same_bits(cposembed.lookup(table, pos, num_threads=threads), table[pos])
    expect = tok + table[:200]
    _same_bits(cposembed.add_positions(tok, table, num_threads=threads), expect)
    cposembed.add_positions(tok, table, out=tok, num_threads=threads)
    _same_bits(tok, expect)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("extra_rows", [-1, 0, 1])
def test_both_sides_of_the_real_stream_threshold(dtype, extra_rows):
    d = 256
    row_bytes = d * np.dtype(dtype).itemsize
    n = STREAM // row_bytes + extra_rows
    rng = np.random.default_rng(2)
    table = rng.standard_normal((64, d)).astype(dtype)
    pos = rng.integers(-64, 64, size=n)
    out = np.empty((n, d), dtype)
    assert _core.lookup(table, pos, out, 2) is out
    _same_bits(out, table[pos])
    tok = np.ones((n, d), dtype)
    assert _core.add(tok, table, pos, 0, out, 2) is out
    _same_bits(out, tok + table[pos])


def test_streaming_flag_reports_the_build():
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert _core.streaming_stores_available()


# ------------------------------------------------------------ scatter-add
def _scatter_all_paths(grad0, g, positions, offset=0):
    """Every (plan, threads, scan budget) result of the entry on copies of grad0."""
    results = {}
    with tuned(serial_below=0):
        for threads in THREADS:
            for plan in PLANS:
                for block in SCAN_BLOCKS:
                    grad = grad0.copy()
                    with tuned(scan_block_bytes=block):
                        got = _core.scatter_add(grad, g, positions, offset, threads, None, -1, plan)
                    assert got is grad
                    assert 1 <= _core.last_team() <= threads
                    results[(threads, plan.name, block)] = grad
    return results


def _scatter_positions(kind, rng, L, m):
    if kind == "arange":
        return np.arange(m)
    if kind == "offset_arange":
        return np.arange(m) + 9
    if kind == "permutation":
        return rng.permutation(L)[:m]
    if kind == "random":
        return rng.integers(0, L, size=m)
    if kind == "zipf":  # token ids: a few rows hit often, many once
        return rng.permutation(L)[np.minimum(rng.zipf(1.3, size=m) - 1, L - 1)]
    if kind == "negative":
        return rng.integers(-L, L, size=m)
    return np.full(m, 5)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "kind", ["arange", "offset_arange", "permutation", "random", "zipf", "negative", "one_row"]
)
@pytest.mark.parametrize("nb", [1, 3])
@pytest.mark.parametrize("form", ["period", "tiled", "leading_ones"])
def test_scatter_every_plan_bitwise_np_add_at(dtype, kind, nb, form):
    rng = np.random.default_rng(7)
    L, d, m = 64, 37, 48
    pos = _scatter_positions(kind, rng, L, m)
    g = rng.standard_normal((nb, m, d)).astype(dtype)
    grad0 = rng.standard_normal((L, d)).astype(dtype)
    expect = reference_scatter(grad0, g, np.broadcast_to(pos, (nb, m)))
    if form == "leading_ones":  # (1, nb, m) positions for (1, nb, m) rows
        g = g[None]
    for index_dtype in (np.int8, np.int16, np.int32, np.int64):
        if form == "period":  # (m,) positions for (nb, m) rows
            positions = pos.astype(index_dtype)
        elif form == "tiled":  # explicit (nb, m) positions, each row the same
            positions = np.tile(pos, (nb, 1)).astype(index_dtype)
        else:
            positions = np.tile(pos, (1, nb, 1)).astype(index_dtype)
        for key, got in _scatter_all_paths(grad0, g, positions).items():
            assert np.array_equal(bits(got), bits(expect)), (index_dtype, key)


@pytest.mark.parametrize("dtype", FLOATS)
def test_scatter_default_positions_every_plan(dtype):
    rng = np.random.default_rng(8)
    L, d, B, T = 40, 19, 4, 25
    g = rng.standard_normal((B, T, d)).astype(dtype)
    grad0 = rng.standard_normal((L, d)).astype(dtype)
    for offset in (0, 7, L - T):
        expect = reference_scatter(grad0, g, np.arange(offset, offset + T))
        for key, got in _scatter_all_paths(grad0, g, None, offset).items():
            assert np.array_equal(bits(got), bits(expect)), (offset, key)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("positions", ["none", "random"])
def test_scatter_functional_threads_bitwise_above_threshold(dtype, positions):
    # Large enough to run threaded (above SERIAL_THRESHOLD), with many
    # repeats per row so that a changed summation order would show.
    rng = np.random.default_rng(3)
    L, d, B, T = 200, 64, 8, 160
    assert B * T * d > SERIAL
    g = rng.standard_normal((B, T, d)).astype(dtype)
    pos = None if positions == "none" else rng.integers(-L, L, size=(B, T))
    expect = reference_scatter(np.zeros((L, d), dtype), g, np.arange(T) if pos is None else pos)
    for threads in THREADS:
        got = cposembed.scatter_add(np.zeros((L, d), dtype), g, pos, num_threads=threads)
        assert np.array_equal(bits(got), bits(expect)), threads


@pytest.mark.parametrize("block", [None, 8])
def test_scatter_auto_plan_for_small_and_huge_scan_budgets(block):
    # With a tiny scan budget the auto plan is the sort; the bits stay
    # np.add.at's either way, above the real serial threshold too.
    rng = np.random.default_rng(4)
    L, d, n = 40, 24, 12000
    assert n * d >= 4 * SERIAL  # each of 4 threads gets SERIAL elements
    pos = rng.integers(0, L, size=n)
    g = rng.standard_normal((n, d)).astype(np.float32)
    expect = reference_scatter(np.zeros((L, d), np.float32), g, pos)
    with tuned(scan_block_bytes=block):
        for threads in (1, 2, 4):
            grad = np.zeros((L, d), np.float32)
            assert _core.scatter_add(grad, g, pos, 0, threads) is grad
            assert _core.last_team() == _team(threads)
            _same_bits(grad, expect)


@settings(max_examples=40)
@given(
    L=st.integers(1, 30),
    d=st.integers(1, 40),
    m=st.integers(1, 40),
    nb=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(FLOATS),
    tiled=st.booleans(),
)
def test_scatter_paths_property(L, d, m, nb, seed, dtype, tiled):
    rng = np.random.default_rng(seed)
    pos = rng.integers(-L, L, size=m).astype(np.int64)
    g = rng.standard_normal((nb, m, d)).astype(dtype)
    grad0 = rng.standard_normal((L, d)).astype(dtype)
    expect = reference_scatter(grad0, g, np.broadcast_to(pos, (nb, m)))
    positions = np.tile(pos, (nb, 1)) if tiled else pos
    for key, got in _scatter_all_paths(grad0, g, positions).items():
        assert np.array_equal(bits(got), bits(expect)), key


@pytest.mark.parametrize("shape", [(4, 2), (2, 3, 2), (6, 2)])
@pytest.mark.parametrize("differ_at", [None, "second", "middle", "last"])
def test_scatter_explicit_repeated_positions_take_one_period(tuning, shape, differ_at):
    """(B, T) positions equal in every sequence are one period of T: the work
    is split over at most T table rows. A difference anywhere after the first
    sequence must not be taken for a period (the bits would show it)."""
    tuning(serial_below=0)
    rng = np.random.default_rng(5)
    L, d = 60, 12
    T = shape[-1]
    pos = np.broadcast_to(rng.permutation(L)[:T], shape).copy()
    flat = pos.reshape(-1)
    if differ_at is not None:
        where = {"second": T, "middle": flat.size // 2, "last": flat.size - 1}[differ_at]
        flat[where] = (flat[where] + 1) % L
    g = rng.standard_normal(shape + (d,)).astype(np.float32)
    expect = reference_scatter(np.zeros((L, d), np.float32), g, pos)
    for threads in THREADS:
        grad = np.zeros((L, d), np.float32)
        assert _core.scatter_add(grad, g, pos, 0, threads) is grad
        _same_bits(grad, expect)
        period = T if differ_at is None else flat.size
        assert _core.last_team() == min(_team(threads), period), (threads, period)
        got = cposembed.scatter_add(np.zeros((L, d), np.float32), g, pos, num_threads=threads)
        _same_bits(got, expect)


def test_forced_distinct_plan_with_repeated_rows_falls_back(tuning):
    tuning(serial_below=0)
    rng = np.random.default_rng(6)
    pos = np.array([3, 1, 3, 3, 0, 1])
    g = rng.standard_normal((2, 6, 5)).astype(np.float32)
    expect = reference_scatter(np.zeros((4, 5), np.float32), g, np.broadcast_to(pos, (2, 6)))
    for threads in THREADS:
        grad = np.zeros((4, 5), np.float32)
        _core.scatter_add(grad, g, pos, 0, threads, None, -1, _core.PLAN_DISTINCT)
        _same_bits(grad, expect)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("threads", THREADS)
def test_scatter_marks_touched_rows_and_skips_one(tuning, dtype, threads):
    tuning(serial_below=0)
    rng = np.random.default_rng(threads)
    L, d = 20, 9
    pos = rng.integers(-L, L, size=(3, 15))
    g = rng.standard_normal((3, 15, d)).astype(dtype)
    skip = int(pos[0, 0]) % L
    for plan in PLANS:
        grad = rng.standard_normal((L, d)).astype(dtype)
        expect = reference_scatter(grad, g, pos)
        expect[skip] = 0
        touched = _marks.RowMarks(L, np.arange(L) == L - 1)  # marks accumulate
        assert _core.scatter_add(grad, g, pos, 0, threads, touched, skip, plan) is grad
        _same_bits(grad, expect)
        want = np.zeros(L, bool)
        want[pos.reshape(-1) % L] = True
        want[L - 1] = True
        want[skip] = False
        _same_bits(touched.mask, want)
        assert sorted(touched.rows()) == list(np.flatnonzero(want))


# ---------------------------------------------------------------- sgd_step
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("touched_kind", ["all", "some", "sparse", "none_marked"])
@pytest.mark.parametrize("skip_row", [-1, 0, 7])
def test_sgd_step_is_numpys_update_on_touched_rows(tuning, dtype, threads, touched_kind, skip_row):
    tuning(serial_below=0)
    rng = np.random.default_rng(threads * 10 + skip_row)
    L, d = 30, 13
    table = rng.standard_normal((L, d)).astype(dtype)
    grad = rng.standard_normal((L, d)).astype(dtype)
    mask = {
        "all": None,
        "some": rng.random(L) < 0.4,
        "sparse": np.isin(np.arange(L), [0, 7, 17, L - 1]),
        "none_marked": np.zeros(L, bool),
    }[touched_kind]
    touched = None if mask is None else _marks.RowMarks(L, mask)
    for lr in (0.1, -3.7, 1e-3, 0.0):
        expect = table.copy()
        rows = np.arange(L) if mask is None else np.flatnonzero(mask)
        rows = rows[rows != skip_row]
        expect[rows] -= lr * grad[rows]  # NumPy: lr rounded to the table's dtype once
        assert _core.sgd_step(table, grad, touched, lr, skip_row, threads) is True
        _same_bits(table, expect)
        assert _core.last_team() == (min(_team(threads), rows.size) if rows.size > 1 else 1)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("factor", [0.5, 4])
def test_sgd_step_both_sides_of_serial_threshold(dtype, factor):
    d = 128
    L = int(SERIAL * factor) // d
    rng = np.random.default_rng(1)
    table = rng.standard_normal((L, d)).astype(dtype)
    grad = rng.standard_normal((L, d)).astype(dtype)
    expect = table - dtype(0.05) * grad
    assert _core.sgd_step(table, grad, None, 0.05, -1, 2) is True
    _same_bits(table, expect)
    assert _core.last_team() == (1 if factor < 1 else _team(2))


# ------------------------------------------------------------ thresholds
@pytest.mark.parametrize("factor", [0.5, 4])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_lookup_add_scatter_both_sides_of_serial_threshold(factor, threads):
    d = 64
    n = int(SERIAL * factor) // d
    rng = np.random.default_rng(0)
    table = rng.standard_normal((500, d)).astype(np.float32)
    pos = rng.integers(-500, 500, size=n)
    team = 1 if factor < 1 else _team(threads)
    out = np.empty((n, d), np.float32)
    assert cposembed.lookup(table, pos, out=out, num_threads=threads) is out
    assert _core.last_team() == team
    _same_bits(out, table[pos])
    tok = rng.standard_normal((n, d)).astype(np.float32)
    _same_bits(cposembed.add_positions(tok, table, pos, num_threads=threads), tok + table[pos])
    assert _core.last_team() == team
    grad = cposembed.scatter_add(np.zeros_like(table), tok, pos, num_threads=threads)
    assert _core.last_team() == team
    _same_bits(grad, reference_scatter(np.zeros_like(table), tok, pos))


@pytest.mark.parametrize("delta", [-64, 0, 64])
def test_tiny_calls_both_sides_of_the_serial_threshold(delta):
    d = 64
    n = (SERIAL + delta) // d
    pe = cposembed.LearnedPositionEmbedding(300, d, seed=1)
    pos = np.random.default_rng(2).integers(-300, 300, size=n)
    expect = pe.embeddings[pos]
    for got in (pe(pos), pe(list(pos)), pe(pos.tolist()), cposembed.lookup(pe.embeddings, pos)):
        _same_bits(got, expect)
        assert not np.shares_memory(got, pe.embeddings)


# ------------------------------------------------------- tiny fast paths
def test_scalar_fast_path_copies_and_wraps():
    pe = cposembed.LearnedPositionEmbedding(10, 4, seed=0)
    row = pe(3)
    assert row.shape == (4,) and np.array_equal(row, pe.embeddings[3])
    row[:] = 0
    assert pe.embeddings[3].all()  # a copy, not a view: the row is not zeroed
    assert np.array_equal(pe(-1), pe.embeddings[9])
    assert np.array_equal(pe(-10), pe.embeddings[0])
    for t in (np.int8, np.uint8, np.int64, np.uint64):
        assert np.array_equal(pe(t(3)), pe.embeddings[3])


@pytest.mark.parametrize(
    "bad", [10, -11, 2**70, [10], [0, -11], np.array([3, 10]), np.uint64(2**64 - 1)]
)
def test_fast_paths_give_the_full_paths_errors(bad):
    pe = cposembed.LearnedPositionEmbedding(10, 4, seed=0)
    with pytest.raises(IndexError, match="out of range"):
        pe(bad)
    with pytest.raises(IndexError, match="out of range"):
        cposembed.lookup(pe.embeddings, bad)


def test_fast_paths_keep_numpy_semantics_of_odd_indices():
    pe = cposembed.LearnedPositionEmbedding(10, 4, seed=0)
    table = pe.embeddings
    mask = [True, False] * 5
    assert np.array_equal(pe(mask), table[np.array(mask)])  # bool list = mask
    assert np.array_equal(pe(np.uint8(3)), table[3])
    assert np.array_equal(pe(np.array([1, 2], np.uint64)), table[[1, 2]])
    assert np.array_equal(pe([[1, 2], [3, 4]]), table[[[1, 2], [3, 4]]])
    assert pe([]).shape == (0, 4)
    with pytest.raises(IndexError):
        pe([1.5])
    # A bool is not the integer 1 but NumPy's scalar mask (not the int path).
    assert np.array_equal(pe(True), table[True])
    with pytest.raises((IndexError, ValueError)):  # ragged: as NumPy (ValueError)
        pe([[1, 2], [3]])


@pytest.mark.parametrize("tok_dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 3, 8), (5, 8), (4, 1, 8)])
@pytest.mark.parametrize("offset", [0, 7])
def test_add_to_decode_steps_match_numpy(tok_dtype, shape, offset):
    pe = cposembed.LearnedPositionEmbedding(12, 8, seed=3)
    tok = np.random.default_rng(0).standard_normal(shape).astype(tok_dtype)
    T = shape[-2]
    if offset + T > 12:
        offset = 12 - T
    expect = tok + pe.embeddings[offset : offset + T]
    got = pe.add_to(tok, offset=offset)
    assert got.dtype == expect.dtype and np.array_equal(got, expect)
    assert not np.shares_memory(got, tok)


def test_add_to_decode_step_errors_are_the_full_paths():
    pe = cposembed.LearnedPositionEmbedding(12, 8, seed=3)
    tok = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(IndexError, match="out of range"):
        pe.add_to(tok, offset=12)
    with pytest.raises(ValueError, match="non-negative"):
        pe.add_to(tok, offset=-1)
    with pytest.raises(ValueError, match=r"\(\.\.\., 8\)"):
        pe.add_to(np.zeros((1, 1, 7), np.float32), offset=0)
    with pytest.raises(TypeError):
        pe.add_to(tok, offset=True)
    # Integer tokens are not the entry's but give NumPy's result.
    ti = np.ones((1, 2, 8), np.int64)
    assert np.array_equal(pe.add_to(ti, offset=3), ti + pe.embeddings[3:5])


def test_add_to_both_sides_of_the_serial_threshold():
    d = 64
    pe = cposembed.LearnedPositionEmbedding(4096, d, seed=0)
    for n_tok in (SERIAL // d - 1, SERIAL // d, SERIAL // d + 1):
        tok = np.random.default_rng(0).standard_normal((1, n_tok, d)).astype(np.float32)
        _same_bits(pe.add_to(tok, offset=5), tok + pe.embeddings[5 : 5 + n_tok])


# ------------------------------------------------------- reusable outputs
@pytest.fixture
def pool_on():
    """Reuse on (whatever the environment says) and an empty pool (earlier tests
    may have filled its places), the previous state restored after."""
    _, _, limit, enabled = _blocks.pool_info()
    gc.collect()  # earlier tests' cyclic garbage returns its blocks now, not mid-test
    _blocks.clear_pool()
    _blocks.set_pool(True)
    yield
    _blocks.set_pool(enabled, limit)


def test_large_outputs_reuse_blocks_and_views_stay_valid(pool_on):
    n_rows, d = 64, 256
    table = np.random.default_rng(0).standard_normal((n_rows, d)).astype(np.float32)
    n = _blocks.POOL_MIN_BYTES // (d * 4) + 1
    pos_a = np.zeros(n, np.int64)
    pos_b = np.ones(n, np.int64)
    a = cposembed.lookup(table, pos_a)
    assert isinstance(a.base, _blocks._Block)
    assert a.flags.writeable and a.flags.c_contiguous and a.flags.aligned
    _same_bits(a, table[pos_a])
    view = a[-1]
    del a
    gc.collect()
    # The block is still in use through the view: a new output must not share it.
    b = cposembed.lookup(table, pos_b)
    assert not np.shares_memory(view, b)
    assert np.array_equal(view, table[0]) and np.array_equal(b, table[pos_b])
    del view, b
    gc.collect()
    assert _blocks.pool_info()[0] >= 1
    blk = _blocks.block(n * d * 4)
    assert blk.reused
    del blk
    c = cposembed.add_positions(np.zeros((n, d), np.float32), table, np.full(n, 2))
    assert isinstance(c.base, _blocks._Block) and c.base.reused
    assert np.array_equal(c, np.broadcast_to(table[2], (n, d)))


def test_entry_outputs_below_the_pool_size_are_plain_numpy(pool_on):
    table = np.ones((8, 256), np.float32)
    n_small = _blocks.POOL_MIN_BYTES // (256 * 4) - 1
    for got in (
        _core.lookup(table, np.zeros(n_small, np.int64), None, None),
        _core.add(
            np.ones((n_small, 256), np.float32), table, np.zeros(n_small, np.int64), 0, None, 1
        ),
        _core.lookup(table, 3, None, None),
    ):
        assert got.base is None and got.flags.owndata
    got = _core.lookup(table, np.zeros(n_small + 1, np.int64), None, None)
    assert isinstance(got.base, _blocks._Block)


@pytest.mark.parametrize("pool", [True, False])
def test_scratch_of_large_calls_comes_back_to_the_pool(pool_on, pool):
    """The positions' buffer and the scatter-add's scratch are kept for the next
    call of the same size (or freed, with the pool off); results are unchanged."""
    _blocks.set_pool(pool)
    rng = np.random.default_rng(4)
    L, d = 2048, 4
    g = rng.standard_normal((16, 1024, d)).astype(np.float32)
    pos = rng.integers(-L, L, size=(16, 1024))
    want = reference_scatter(np.zeros((L, d), np.float32), g, pos)
    kept = []
    for _ in range(4):
        for plan in (_core.PLAN_SCAN, _core.PLAN_SORT):
            grad = np.zeros((L, d), np.float32)
            assert _core.scatter_add(grad, g, pos, 0, 2, None, -1, plan) is grad
            _same_bits(grad, want)
        kept.append(_blocks.pool_info()[:2])
    assert kept[0][0] == (2 if pool else 0) and len(set(kept)) == 1, kept


def test_pool_can_be_switched_off_limited_and_cleared(pool_on):
    _blocks.set_pool(False)
    assert _blocks.pool_info()[0] == 0 and not _blocks.pool_info()[3]
    blk = _blocks.block(1 << 20)
    del blk
    assert _blocks.pool_info()[0] == 0
    assert not _blocks.block(1 << 20).reused
    _blocks.set_pool(True, limit_bytes=1 << 19)  # smaller than the block: not kept
    blk = _blocks.block(1 << 20)
    del blk
    assert _blocks.pool_info()[:3] == (0, 0, 1 << 19)
    _blocks.set_pool(True, limit_bytes=1 << 30)
    blk = _blocks.block(1 << 20)
    del blk
    assert _blocks.pool_info()[0] >= 1
    _blocks.clear_pool()
    assert _blocks.pool_info()[:2] == (0, 0)
    with pytest.raises(ValueError, match="positive"):
        _blocks.block(0)


def test_a_full_pool_keeps_the_larger_blocks(pool_on):
    """A freed block takes the places of smaller kept blocks, smallest first,
    and is not kept where only larger ones would make room: after smaller
    sizes filled every place, the size a loop asks for step after step is
    still reused (a training loop's outputs after other work), while the
    call's scratch cannot push it out; the byte limit is kept the same way."""
    mib = 1 << 20
    others = [_blocks.block(k * mib) for k in range(1, 9)]  # 8 sizes: every place
    del others
    assert _blocks.pool_info()[:2] == (8, 36 * mib)
    step = _blocks.block(50 * mib)
    assert not step.reused
    del step
    assert _blocks.pool_info()[:2] == (8, 85 * mib)  # in place of 1 MiB, the smallest
    for _ in range(3):
        step = _blocks.block(50 * mib)
        assert step.reused
        scratch = _blocks.block(mib // 2)  # a new small size: freed, not kept
        del scratch
        del step
        assert _blocks.pool_info()[:2] == (8, 85 * mib)
    _blocks.set_pool(True, limit_bytes=60 * mib)
    blk = _blocks.block(20 * mib)
    del blk  # room only if the 50 MiB block went: freed, and nothing else is
    assert _blocks.pool_info()[:2] == (8, 85 * mib)
    blk = _blocks.block(61 * mib)
    del blk  # over the limit: freed
    assert _blocks.pool_info()[:2] == (8, 85 * mib)
    big = _blocks.block(40 * mib)  # the 50 MiB block, within 2 x
    assert big.reused and _blocks.pool_info()[:2] == (7, 35 * mib)
    del big  # 35 + 50 MiB is over the limit: 2-7 MiB make room, smallest first
    assert _blocks.pool_info()[:2] == (2, 58 * mib)


def test_fresh_zeroed_tables_and_small_blocks_are_not_kept(pool_on):
    """A gradient or optimizer state (_blocks.zeros: fresh memory) goes back to the
    OS when freed, and so does a block under 64 KiB; a block of 64 KiB or more
    is kept."""
    z = _blocks.zeros((1024, 1024), np.float32)  # 4 MiB: the allocator's
    z[::97] = 1.0
    assert z.shape == (1024, 1024) and z.flags.writeable and z.sum() == 11 * 1024
    del z
    gc.collect()
    assert _blocks.pool_info()[0] == 0
    small = _blocks.zeros((8, 8), np.float64)  # below the allocator's size: np.zeros
    assert small.base is None and not small.any()
    blk = _blocks.block(256)  # 256 bytes: released
    del blk
    assert _blocks.pool_info()[0] == 0
    blk = _blocks.block((64 << 10) - 1)  # just under 64 KiB: released
    del blk
    assert _blocks.pool_info()[0] == 0
    blk = _blocks.block(256 << 10)  # 256 KiB: kept
    del blk
    assert _blocks.pool_info()[:2] == (1, 256 << 10)


def test_reuse_can_be_turned_off_by_environment():
    code = (
        "import numpy as np, cposembed\n"
        "from cposembed import _blocks\n"
        "t = np.ones((2048, 768), np.float32)\n"
        "for _ in range(3):\n"
        "    r = cposembed.lookup(t, np.zeros((8, 1024), np.int64)); del r\n"
        "print(_blocks.pool_info()[0], _blocks.pool_info()[3])\n"
    )
    # Kept when on: the output's block and the positions' 64 KiB scratch.
    for value, expected in (("0", "0 False"), ("1", "2 True"), (" 0 ", "0 False")):
        res = run_python(["-c", code], env={"CPOSEMBED_REUSE_OUTPUTS": value}, check=True)
        assert res.stdout.split() == expected.split(), value


# ------------------------------------------------------- limit probes
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 15, 16, 1000, 4099])
@pytest.mark.parametrize("stream", [False, True])
def test_membench_probes(threads, n, stream):
    src = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    dst = _unaligned((n,), np.float32, 4)
    with tuned(serial_below=1):  # small work on `threads` threads too
        _membench.fill(dst, threads, stream)
        assert np.all(dst == 1.0)
        _membench.copy(dst, src, threads, stream)
        assert np.array_equal(dst, src)
        assert _membench.read_sum(src, threads) == pytest.approx(
            float(src.sum(dtype=np.float64)), rel=1e-4, abs=1e-3
        )


def test_membench_copy_refuses_a_src_of_another_length():
    # A shorter src was read past its end (a segfault for a large dst).
    code = (
        "import numpy as np\n"
        "from cposembed import _membench\n"
        "dst = np.zeros(1 << 24, np.float32)\n"
        "for src in (np.ones(16, np.float32), np.ones((1 << 24) + 1, np.float32)):\n"
        "    try:\n"
        "        _membench.copy(dst, src, 1)\n"
        "    except ValueError as exc:\n"
        "        print(exc)\n"
        "assert not dst.any()\n"
    )
    proc = run_python(["-c", code])
    assert_clean_exit(proc)
    assert proc.stdout.splitlines() == [
        f"src must have dst's length {1 << 24}; got length 16",
        f"src must have dst's length {1 << 24}; got length {(1 << 24) + 1}",
    ]


@pytest.mark.parametrize("probe", ["fill", "copy", "read_sum"])
@pytest.mark.parametrize("n_threads", [0, -1, None, True, 2.0, "2"])
def test_membench_probes_refuse_what_num_threads_refuses(probe, n_threads):
    buf = np.zeros(1 << 17, np.float32)
    args = {"fill": (buf,), "copy": (buf, buf.copy()), "read_sum": (buf,)}[probe]
    with pytest.raises(
        ValueError, match=f"n_threads must be a positive integer; got {n_threads!r}"
    ):
        getattr(_membench, probe)(*args, n_threads)


def test_membench_probes_cap_the_thread_count_as_num_threads_does():
    # Handed to OpenMP unchecked, a million threads end the process.
    code = (
        "import numpy as np\n"
        "from cposembed import _membench\n"
        "src = np.ones(1 << 20, np.float32); dst = np.zeros_like(src)\n"
        "_membench.fill(dst, 10**6); _membench.copy(dst, src, 10**6)\n"
        "print(_membench.read_sum(dst, 10**30))\n"
    )
    proc = run_python(["-c", code], timeout=60)
    assert_clean_exit(proc)
    assert float(proc.stdout) == 1 << 20
