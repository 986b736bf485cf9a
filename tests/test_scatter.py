"""scatter_add (and backward's accumulation): bitwise ``np.add.at``, every layout,
overlaps, and the C entry's plain case."""

from __future__ import annotations

import numpy as np
import plain as cases
import pytest
import strategies as sts
from helpers import (
    FLOAT_TYPES,
    INDEX_DTYPES,
    _deep,
    _rows_for,
    _sizes,
    _table,
    add_at,
    assert_same,
    needs_numpy2,
    reference_scatter,
    tuned,
)
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import cposembed
from cposembed import LearnedPositionEmbedding, _core, _marks

PLANS = [_core.PLAN_AUTO, _core.PLAN_DISTINCT, _core.PLAN_SCAN, _core.PLAN_SORT]


@given(data=st.data())
def test_scatter_entry_accepts_exactly_the_plain_case(data):
    plain, L, d, dtype, rng, grad = cases._entry_case(data)
    lead, positions, offset = cases._lead_and_positions(data, L, plain)
    g = rng.standard_normal(lead + (d,)).astype(dtype)
    g_kind = cases._pick(
        data.draw,
        ["plain"],
        ["dtype", "swapped", "strided", "subclass", "list", "wrong_d", "readonly", "on_grad"]
        + ["unaligned"],
        plain=plain,
    )
    if g_kind == "wrong_d":
        g = np.ones(lead + (d + 1,), dtype)
    elif g_kind == "on_grad" and cases._plain_table(grad) and grad.size and g.size:
        buf = rng.standard_normal(grad.size + g.size).astype(dtype)
        grad = buf[: grad.size].reshape(grad.shape)
        start = data.draw(st.integers(0, grad.size - 1))
        g = buf[start : start + g.size].reshape(g.shape)
    else:
        g = cases._array_form(g, g_kind)  # read only is fine for g
    touched_kind = cases._pick(
        data.draw,
        ["none", "plain"],
        ["length", "mask", "other"],
        plain=plain,
    )
    touched = None
    if touched_kind == "plain":
        touched = _marks.RowMarks(L, rng.random(L) < 0.3)
    elif touched_kind == "length":
        touched = _marks.RowMarks(L + 1)
    elif touched_kind == "mask":
        touched = np.zeros(L, bool)  # a bare mask, not RowMarks
    elif touched_kind == "other":
        touched = [False] * L
    skip_row = cases._pick(data.draw, [-1, 0, L - 1], [-2, L], 0.1, plain=plain)
    plan = cases._pick(
        data.draw, PLANS, [4, 2**31 - 1], 0.1, plain=plain
    )  # negative: see test_scatter_entry_declines_negative_plans
    num_threads = data.draw(cases.PLAIN_THREADS if plain else cases.THREADS, label="num_threads")
    serial_below = data.draw(st.sampled_from([None, 0]))
    scan_block = data.draw(st.sampled_from([None, 8, 64]))

    grad_ok = cases._plain_table(grad) and grad.flags.writeable
    if not grad_ok:
        rows = None
    elif positions is None:
        rows = cases._default_rows(lead, offset, L)
    else:
        rows = cases._explicit_rows(positions, offset, lead, L)
    accept = (
        rows is not None
        and cases._plain(g)
        and g.dtype in cases.FLOATS  # any dtype with kernels
        and g.ndim >= 1
        and g.shape[-1] == d
        and cases._disjoint(g, grad)
        and (touched is None or (isinstance(touched, _marks.RowMarks) and touched.n_rows == L))
        and -1 <= skip_row < L
        and 0 <= plan <= 3
        and cases._threads_ok(num_threads)
    )
    expect = marks = None
    if accept:
        expect, marks = cases._scatter_expect(grad, g, rows, touched, skip_row)
    event("accepted" if accept else "declined")
    marks_before = touched.mask.copy() if isinstance(touched, _marks.RowMarks) else None
    snap = cases.Snapshot(grad, g, positions, touched)
    with tuned(serial_below=serial_below, scan_block_bytes=scan_block):
        result = _core.scatter_add(grad, g, positions, offset, num_threads, touched, skip_row, plan)
        if not accept and marks_before is not None:
            assert np.array_equal(touched.mask, marks_before)
        if not accept:
            cases._declined(result, snap)
            return
        assert result is grad, "the entry declined a plain call"
        team = _core.last_team()
        # Threads: at most one per table row; the work is the whole gradient.
        n = int(np.prod(lead))
        period = rows.size if rows.ndim < len(lead) else (lead[-1] if lead else 1)
        candidates = {
            cases._expected_team(num_threads, n * d, min(L, m)) for m in (rows.size, period, 1)
        }
        assert team in candidates, (team, candidates)
    snap.unchanged(but=(grad, touched))
    assert np.array_equal(grad, expect, equal_nan=True)
    cases._same_bits(grad[~np.isnan(expect)], expect[~np.isnan(expect)])
    if touched is not None:
        cases._same_bits(touched.mask, marks)
        assert sorted(touched.rows()) == list(np.flatnonzero(marks))


@pytest.mark.parametrize("dtype", cases.FLOATS)
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
@given(data=st.data())
def test_scatter_entry_is_bitwise_np_add_at(dtype, plan, data):
    """Every plan, every thread count, every kind of positions: np.add.at's bits."""
    B = data.draw(st.integers(1, 5))
    T = data.draw(st.integers(1, 12))
    L = data.draw(st.integers(12, 40))
    d = data.draw(st.integers(1, 40))
    kind = data.draw(
        st.sampled_from(["none", "random", "repeating", "arange_rows", "one_row", "period"])
    )
    index = data.draw(st.sampled_from(cases.INT_DTYPES))
    threads = data.draw(st.integers(1, 4))
    serial_below = data.draw(st.sampled_from([0, None]))
    scan_block = data.draw(st.sampled_from([None, 8, 64, 4096]))
    rng = cases._rng(data.draw(st.integers(0, 2**16)))
    g = rng.standard_normal((B, T, d)).astype(dtype)
    grad0 = rng.standard_normal((L, d)).astype(dtype)
    lo = 0 if index.kind == "u" else -L
    offset = 0
    if kind == "none":
        positions = None
        offset = int(rng.integers(0, L - T + 1))
        pos = np.arange(offset, offset + T)
    elif kind == "random":
        pos = positions = rng.integers(lo, L, size=(B, T)).astype(index)
    elif kind == "repeating":
        pos = positions = np.tile(rng.integers(lo, L, size=T), (B, 1)).astype(index)
        if data.draw(st.booleans()):  # one difference anywhere after the first period
            flat = positions.reshape(-1)
            flat[data.draw(st.integers(min(T, flat.size - 1), flat.size - 1))] = rng.integers(0, L)
    elif kind == "arange_rows":
        pos = positions = np.tile(np.arange(T), (B, 1)).astype(index)
    elif kind == "one_row":
        pos = positions = np.full((B, T), 3, index)
    else:
        pos = positions = rng.integers(lo, L, size=T).astype(index)
    expect, _ = cases._scatter_expect(grad0, g, pos, None, -1)
    grad = grad0.copy()
    with tuned(serial_below=serial_below, scan_block_bytes=scan_block):
        assert _core.scatter_add(grad, g, positions, offset, threads, None, -1, plan) is grad
        assert 1 <= _core.last_team() <= threads
        if serial_below is None:
            assert _core.last_team() == 1
    cases._same_bits(grad, expect)


def test_scatter_entry_declines_negative_plans():
    grad = np.zeros((3, 2), np.float32)
    g = np.ones((2, 2), np.float32)
    assert _core.scatter_add(grad, g, [0, 1], 0, None, None, -1, 4) is None
    assert _core.scatter_add(grad, g, [0, 1], 0, None, None, -1, -1) is None
    assert not grad.any()


# ---------------------------------------------------------------- scatter_add
@pytest.mark.parametrize("dtype", FLOAT_TYPES)
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("kind", ["arange", "random", "few", "one"])
def test_scatter_add_bitwise_np_add_at_any_threads(dtype, which, kind):
    d = 48
    n_rows = 257
    T = 64
    B = max(1, _rows_for(_sizes()[which], d) // T)
    rng = np.random.RandomState(8)
    g = rng.randn(B, T, d).astype(dtype)
    grad0 = rng.randn(n_rows, d).astype(dtype)
    if kind == "arange":
        positions = None
        idx = np.arange(T)
    elif kind == "random":
        idx = positions = rng.randint(-n_rows, n_rows, size=(B, T))
    elif kind == "few":
        idx = positions = rng.randint(0, 3, size=(B, T))
    else:
        idx = positions = np.full((B, T), -1)
    expected = reference_scatter(grad0, g, idx)
    results = []
    for threads in (1, 2, 3, 4):
        grad = grad0.copy()
        res = cposembed.scatter_add(grad, g, positions, num_threads=threads)
        assert res is grad
        results.append(grad.tobytes())
    assert all(r == expected.tobytes() for r in results)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_scatter_add_index_dtypes(index_dtype):
    n_rows, d = 100, 5
    rng = np.random.RandomState(9)
    positions = rng.randint(0, n_rows, size=(7, 11)).astype(index_dtype)
    g = rng.randn(7, 11, d).astype(np.float32)
    grad = np.zeros((n_rows, d), np.float32)
    cposembed.scatter_add(grad, g, positions)
    assert grad.tobytes() == reference_scatter(np.zeros_like(grad), g, positions).tobytes()


def test_scatter_add_offset_and_broadcast_positions():
    rng = np.random.RandomState(10)
    g = rng.randn(3, 4, 6)
    grad = np.zeros((10, 6))
    cposembed.scatter_add(grad, g, offset=5)
    expected = reference_scatter(np.zeros((10, 6)), g, 5 + np.arange(4))
    assert grad.tobytes() == expected.tobytes()
    grad = np.zeros((10, 6))
    positions = np.array([[1], [2], [1]])
    cposembed.scatter_add(grad, g, positions)
    assert grad.tobytes() == reference_scatter(np.zeros((10, 6)), g, positions).tobytes()


def test_scatter_add_mixes_dtypes_as_add_at_and_handles_layouts():
    rng = np.random.RandomState(11)
    g64 = rng.randn(2, 5, 4)
    positions = np.array([0, 1, 1, 3, 0])
    grad = np.zeros((4, 4), np.float32)
    cposembed.scatter_add(grad, g64, positions)
    # Each add in float64, rounded to float32 (not g64 rounded first).
    expected = np.zeros((4, 4), np.float32)
    np.add.at(expected, np.broadcast_to(positions, (2, 5)), g64)
    assert grad.tobytes() == expected.tobytes()
    first_rounded = reference_scatter(
        np.zeros((4, 4), np.float32), g64.astype(np.float32), positions
    )
    assert grad.tobytes() != first_rounded.tobytes()  # the data shows the difference
    # Fortran-ordered gradient table and non-contiguous grad_output.
    grad_f = np.asfortranarray(np.ones((4, 4)))
    g_view = rng.randn(2, 10, 4)[:, ::2]
    cposembed.scatter_add(grad_f, g_view, positions)
    np.testing.assert_array_equal(grad_f, reference_scatter(np.ones((4, 4)), g_view, positions))


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    n_rows=st.integers(1, 30),
    d=st.integers(1, 12),
    dtype=st.sampled_from(FLOAT_TYPES),
    index_dtype=st.sampled_from([np.int8, np.int32, np.int64, np.uint16, np.uint64]),
    threads=st.integers(1, 4),
)
def test_scatter_and_add_property(data, n_rows, d, dtype, index_dtype, threads):
    lead = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=7))
    lo = -n_rows if np.iinfo(index_dtype).min < 0 else 0
    hi = min(n_rows - 1, int(np.iinfo(index_dtype).max))
    positions = data.draw(hnp.arrays(index_dtype, lead, elements=st.integers(max(lo, -128), hi)))
    table = _table(n_rows, d, dtype, seed=12)
    g = data.draw(hnp.arrays(dtype, lead + (d,), elements=st.floats(-1e3, 1e3, width=32)))
    grad = np.zeros_like(table)
    cposembed.scatter_add(grad, g, positions, num_threads=threads)
    assert grad.tobytes() == reference_scatter(np.zeros_like(table), g, positions).tobytes()
    added = cposembed.add_positions(g, table, positions, num_threads=threads)
    assert added.tobytes() == (g + table[positions]).tobytes()


def broadcast_positions_ok(pos_shape, lead) -> bool:
    try:
        return np.broadcast_shapes(pos_shape, lead) == tuple(lead)
    except ValueError:
        return False


@given(data=st.data())
def test_scatter_add_any_grad_output_matches_add_at(data):
    L = data.draw(st.integers(1, 6))
    d = data.draw(st.integers(0, 5))
    gdtype = data.draw(st.sampled_from([np.float32, np.float64]))
    grad0 = data.draw(sts.float_values((L, d), gdtype))
    grad = data.draw(st.sampled_from(["c", "fortran", "strided"]))
    if grad == "fortran":
        grad = np.asfortranarray(grad0.copy())
    elif grad == "strided":
        grad = np.repeat(grad0, 2, axis=0)[::2]
    else:
        grad = grad0.copy()
    lead = tuple(data.draw(st.lists(st.integers(0, 4), max_size=3), label="lead"))
    g = data.draw(sts.row_arrays(lead, d), label="grad_output")
    if data.draw(st.booleans()):
        pshape = tuple(data.draw(st.lists(st.integers(0, 4), max_size=2)))
        if data.draw(st.booleans()) and lead:
            pshape = lead[len(lead) - data.draw(st.integers(0, len(lead))) :]
        positions = data.draw(sts.index_arrays(L, shape=pshape), label="positions")
    else:
        positions = None
    g_before = sts._bits(g)

    def reference():
        if g.dtype.kind not in "biuf":
            raise TypeError("not real")
        if positions is None:
            if not lead:
                raise ValueError("1-D")
            T = lead[-1]
            if T > L:
                raise IndexError("range")
            pos = np.arange(T)
        else:
            pos = np.arange(L)[positions]  # the rows NumPy's indexing selects, in its shape
            if not broadcast_positions_ok(pos.shape, lead):
                raise ValueError("broadcast")
        want = grad0.copy()
        np.add.at(want, np.broadcast_to(pos, lead), g.astype(gdtype))
        return want

    want, ref_exc = sts.numpy_or_error(reference)
    if ref_exc is None:
        got = cposembed.scatter_add(grad, g, positions)
        assert got is grad
        assert sts.same_values(grad, want)
    else:
        with pytest.raises(sts.CLEAR_ERRORS):
            cposembed.scatter_add(grad, g, positions)
        assert sts.same_bits(grad, grad0)
    assert sts._bits(g) == g_before


@given(data=st.data())
def test_scatter_add_grad_output_overlapping_grad(data):
    """grad_output that is a view of grad_table itself: inputs read first."""
    L = data.draw(st.integers(2, 6))
    d = data.draw(st.integers(1, 4))
    grad = data.draw(sts.float_values((L, d), np.float64))
    lo = data.draw(st.integers(0, L - 1))
    hi = data.draw(st.integers(lo, L))
    g = grad[lo:hi] if data.draw(st.booleans()) else grad[lo:hi][::-1]
    positions = data.draw(
        sts.index_arrays(L, shape=(hi - lo,), dtypes=st.sampled_from(sts.SIZED_INT_DTYPES))
    )
    assume(
        positions.size == 0
        or (positions.astype(np.int64).min() >= -L and positions.astype(np.int64).max() < L)
    )
    want = grad.copy()
    with np.errstate(all="ignore"):  # Inf + -Inf: NumPy warns, the kernel need not
        np.add.at(want, positions, g.copy())
        cposembed.scatter_add(grad, g, positions)
    assert sts.same_values(grad, want)


@needs_numpy2
@pytest.mark.parametrize("nd", [32, 33])
@pytest.mark.parametrize("via", ["function", "class"])
def test_scatter_add_with_positions_of_32_or_more_axes(nd, via):
    rng = np.random.RandomState(1)
    pos = np.array([4, 0, -1]).reshape(_deep(nd, 3))
    g = rng.randn(*pos.shape, 3).astype(np.float32)
    expect = np.zeros((5, 3), np.float32)
    add_at(expect, pos, g)
    if via == "function":
        got = np.zeros((5, 3), np.float32)
        cposembed.scatter_add(got, g, pos)
    else:
        pe = LearnedPositionEmbedding(5, 3, seed=0)
        got = pe.backward(g, pos)
    assert_same(got, expect)
