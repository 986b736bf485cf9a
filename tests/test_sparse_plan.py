"""The sparse plan (a table far larger than the call: its touched rows summed in a
compact copy), RowMarks and distinct_rows: bitwise ``np.add.at`` on both sides of
the 4x threshold, the marks the calls leave, and distinct_rows against
``np.unique``."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from helpers import FLOAT_TABLE_DTYPES, tuned
from hypothesis import given, settings
from hypothesis import strategies as st
from plain import _same_bits

import cposembed
from cposembed import _core, _marks

PLANS = [_core.PLAN_AUTO, _core.PLAN_DISTINCT, _core.PLAN_SCAN, _core.PLAN_SORT]
# The sparse plan's rule (src_c/_marks.pxi): more than this many rows per position.
ROWS_PER_POSITION = 4


def table_of(n_rows, d, dtype, seed):
    """A table whose every row is non-zero and distinct, cheap for millions of rows."""
    base = np.random.default_rng(seed).standard_normal(d)
    rows = np.arange(n_rows, dtype=np.float64)[:, None] * 1e-3 + base
    return rows.astype(dtype)


def add_at(grad, rows, g, skip_row=-1):
    """np.add.at into a copy of grad (rows broadcast to g's rows), skip_row zeroed."""
    want = grad.copy()
    np.add.at(want, np.broadcast_to(rows, g.shape[:-1]), g)
    if skip_row >= 0:
        want[skip_row] = 0
    return want


def first_seen(rows, n_rows, old=(), skip_row=-1):
    """The rows a RowMarks lists after a call marks `rows` (wrapped) on top of
    `old`: the old ones, then each new row at its first appearance, skip_row
    left out; an old skip_row is then unmarked (the last listed row takes its
    place, RowMarks.unmark)."""
    out = list(old)
    seen = set(out)
    for r in np.asarray(rows).reshape(-1).tolist():
        r %= n_rows
        if r not in seen and r != skip_row:
            seen.add(r)
            out.append(r)
    if skip_row in out:
        out[out.index(skip_row)] = out[-1]
        out.pop()
    return out


def same_bits_but_nan(got, want):
    """Bitwise equal where `want` is a number; NaN where it is NaN (which NaN an
    add of two NaNs gives, NumPy's loops and a kernel may choose differently)."""
    nan = np.isnan(want.astype(np.float64))
    _same_bits(np.isnan(got.astype(np.float64)), nan)
    _same_bits(got[~nan], want[~nan])


def assert_marks(marks, listed, n_rows):
    assert list(marks.rows()) == listed
    mask = np.zeros(n_rows, bool)
    mask[listed] = True
    _same_bits(marks.mask, mask)
    assert len(marks) == len(listed)


def marks_with(n_rows, rows):
    """A RowMarks of n_rows on which `rows` were marked, in order (by a scatter-add)."""
    marks = _marks.RowMarks(n_rows)
    if len(rows):
        grad = np.zeros((n_rows, 1), np.float32)
        _core.scatter_add(grad, np.zeros((len(rows), 1)), np.array(rows), 0, None, marks)
    return marks


@pytest.fixture(params=["serial", "parallel"])
def sides(request):
    """The serial side (the default thresholds) or the parallel one (every
    call on the team, small chunks, no back-off)."""
    if request.param == "serial":
        yield None
        return
    with tuned(serial_below=0, chunk_elems=64, adapt=False):
        yield 0


# -- scatter_add ------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_scatter_entry_on_both_sides_of_the_threshold_is_np_add_at(data):
    """Every plan forced, every dtype pair, with repeats and negatives, positions
    None / 1-D / (B, T), at L = 4 m (the dense plan) and just above (sparse)."""
    T = data.draw(st.integers(1, 40), label="T")
    B = data.draw(st.integers(1, 4), label="B")
    form = data.draw(st.sampled_from(["none", "flat", "batch", "period"]), label="form")
    m = {"none": T, "flat": T, "batch": B * T, "period": T}[form]
    side = data.draw(st.sampled_from([-1, 0, 1, 7, 1000]), label="side")
    L = max(T, ROWS_PER_POSITION * m + side)
    d = data.draw(st.integers(1, 9), label="d")
    tdt = data.draw(st.sampled_from(FLOAT_TABLE_DTYPES), label="table")
    sdt = data.draw(st.sampled_from(FLOAT_TABLE_DTYPES), label="grad_output")
    plan = data.draw(st.sampled_from(PLANS), label="plan")
    threads = data.draw(st.integers(1, 4), label="threads")
    serial_below = data.draw(st.sampled_from([None, 0]), label="serial_below")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    pool = rng.integers(-L, L, size=max(1, m // 3))  # repeats
    offset = 0
    if form == "none":
        positions = None
        offset = int(rng.integers(0, L - T + 1))
        rows = np.arange(offset, offset + T)
        g = rng.standard_normal((B, T, d))
    elif form == "flat":
        rows = positions = rng.choice(pool, T)
        g = rng.standard_normal((T, d))
    elif form == "batch":
        rows = positions = rng.choice(pool, (B, T))
        g = rng.standard_normal((B, T, d))
    else:  # one period for every sequence
        rows = positions = rng.choice(pool, T)
        g = rng.standard_normal((B, T, d))
    g = g.astype(sdt)
    skip_row = data.draw(st.sampled_from([-1, 0, int(rows.reshape(-1)[0]) % L, L - 1]))
    grad = table_of(L, d, tdt, 1)
    # Rows marked before the call: kept, listed first.
    before = [int(r) for r in rng.integers(0, L, 3)]
    marks = marks_with(L, before)
    old = first_seen(before, L)
    want = add_at(grad, rows, g, skip_row)
    with tuned(serial_below=serial_below, chunk_elems=64, adapt=False):
        got = _core.scatter_add(grad, g, positions, offset, threads, marks, skip_row, plan)
    assert got is grad
    _same_bits(grad, want)
    assert_marks(marks, first_seen(rows, L, old, skip_row), L)


@pytest.mark.parametrize("n_rows", [10_000, 1_000_000])
@pytest.mark.parametrize("m", [1, 7, 300])
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_scatter_entry_into_a_huge_table_every_plan(n_rows, m, plan, sides):
    rng = np.random.default_rng(m)
    d = 8
    grad = table_of(n_rows, d, np.float32, 2)
    pos = rng.integers(-n_rows, n_rows, size=(m + 1) // 2)
    positions = np.concatenate([pos, pos[::-1]])[:m] if m > 1 else pos
    positions[-1] = -1  # the last row, by a negative position
    g = rng.standard_normal((m, d)).astype(np.float32)
    want = add_at(grad, positions, g)
    marks = _marks.RowMarks(n_rows)
    for threads in (1, 2, 3, 4):
        got = grad.copy()
        marks.clear()
        assert _core.scatter_add(got, g, positions, 0, threads, marks, -1, plan) is got
        _same_bits(got, want)
        assert_marks(marks, first_seen(positions, n_rows), n_rows)


@pytest.mark.parametrize("tdt", FLOAT_TABLE_DTYPES, ids=str)
@pytest.mark.parametrize("sdt", FLOAT_TABLE_DTYPES, ids=str)
def test_scatter_add_into_a_huge_table_every_dtype_pair(tdt, sdt, sides):
    n_rows, d = 200_000, 5
    rng = np.random.default_rng(3)
    grad = table_of(n_rows, d, tdt, 4)
    cases = [
        (rng.integers(-n_rows, n_rows, (3, 50)), 0),  # (B, T), repeats below
        (None, n_rows - 64),  # arange(T) + offset, the last rows
        (np.array([5, -5, 5, 5, n_rows - 5]), 0),  # one row four times
    ]
    cases[0][0][2] = cases[0][0][0]
    for positions, offset in cases:
        lead = (3, 64) if positions is None else np.shape(positions)
        g = rng.standard_normal(lead + (d,)).astype(sdt)
        rows = offset + np.arange(64) if positions is None else positions
        want = add_at(grad, rows, g)
        for threads in (1, 2, 4):
            got = grad.copy()
            assert (
                cposembed.scatter_add(got, g, positions, offset=offset, num_threads=threads) is got
            )
            _same_bits(got, want)


@pytest.mark.parametrize("sdt", FLOAT_TABLE_DTYPES, ids=str)
def test_scatter_add_special_values_into_a_huge_table(sdt):
    # -0.0 into a zero row stays -0.0 only if no 0 is added first: np.add.at adds
    # into the row as it is. NaN, inf, subnormals travel as NumPy adds them.
    n_rows, d = 100_000, 6
    vals = np.array([-0.0, np.inf, -np.inf, np.nan, 1e-40, -5e-324]).astype(sdt)
    g = np.tile(vals, (4, 1))
    g[1] = -g[1]
    positions = np.array([7, 7, 99_999, -3])
    for tdt in FLOAT_TABLE_DTYPES:
        grad = np.zeros((n_rows, d), tdt)
        grad[99_999] = -0.0
        with np.errstate(all="ignore"):
            want = add_at(grad, positions, g)
        with np.errstate(all="ignore"):
            assert cposembed.scatter_add(grad, g, positions) is grad
        same_bits_but_nan(grad, want)
        assert np.signbit(grad[99_999, 0]) == np.signbit(want[99_999, 0])


@pytest.mark.parametrize("skip_row", [0, 4, 9_999])
def test_scatter_entry_sparse_skip_row_is_zeroed_and_unmarked(skip_row):
    n_rows, d = 10_000, 3
    grad = table_of(n_rows, d, np.float32, 5)
    grad[skip_row] = 0
    positions = np.array([skip_row, 4, skip_row, 17, -1, 4])
    g = np.arange(positions.size * d, dtype=np.float32).reshape(-1, d) + 1
    marks = _marks.RowMarks(n_rows)
    assert _core.scatter_add(grad.copy(), g, positions, 0, None, marks, skip_row) is not None
    got = grad.copy()
    marks = _marks.RowMarks(n_rows)
    _core.scatter_add(got, g, positions, 0, None, marks, skip_row)
    _same_bits(got, add_at(grad, positions, g, skip_row))
    assert not got[skip_row].any()
    assert_marks(marks, first_seen(positions, n_rows, skip_row=skip_row), n_rows)


def test_class_backward_into_a_huge_table_marks_and_zeroes_its_rows(sides):
    n_rows, d = 1_000_000, 4
    pe = cposembed.LearnedPositionEmbedding.from_pretrained(
        np.zeros((n_rows, d), np.float32), padding_idx=3
    )
    rng = np.random.default_rng(6)
    positions = rng.integers(-n_rows, n_rows, (2, 30))
    positions[0, :3] = [3, 3, 8]
    g = rng.standard_normal((2, 30, d)).astype(np.float32)
    grad = pe.backward(g, positions)
    want = add_at(np.zeros((n_rows, d), np.float32), positions, g, 3)
    _same_bits(grad, want)
    state = pe._grad
    assert_marks(state.touched, first_seen(positions, n_rows, skip_row=3), n_rows)
    pe.zero_grad()
    assert pe.grad is grad and not grad.any()
    assert len(state.touched) == 0 and not state.touched.mask.any()


# -- embed_backward -----------------------------------------------------------------
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_embed_backward_entry_on_both_sides_of_the_threshold_is_np_add_at(data):
    B = data.draw(st.integers(1, 4), label="B")
    T = data.draw(st.integers(1, 30), label="T")
    N = B * T
    pos_form = data.draw(st.sampled_from(["none", "period", "full"]), label="positions")
    m = N if pos_form == "full" else T
    V = max(1, ROWS_PER_POSITION * N + data.draw(st.sampled_from([-1, 0, 1, 500])))
    L = max(T, ROWS_PER_POSITION * m + data.draw(st.sampled_from([-1, 0, 1, 500])))
    d = data.draw(st.integers(1, 7), label="d")
    tdt = data.draw(st.sampled_from(FLOAT_TABLE_DTYPES), label="table")
    sdt = data.draw(st.sampled_from(FLOAT_TABLE_DTYPES), label="grad_output")
    threads = data.draw(st.integers(1, 4), label="threads")
    serial_below = data.draw(st.sampled_from([None, 0]), label="serial_below")
    skip = data.draw(st.booleans(), label="skip")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    ids = rng.choice(rng.integers(-V, V, max(1, N // 3)), (B, T))
    offset = 0
    if pos_form == "none":
        positions = None
        offset = int(rng.integers(0, L - T + 1))
        rows = offset + np.arange(T)
    elif pos_form == "period":
        rows = positions = rng.integers(-L, L, T)
    else:
        rows = positions = rng.integers(-L, L, (B, T))
    skip_row = int(ids[0, 0]) % V if skip else -1
    g = rng.standard_normal((B, T, d)).astype(sdt)
    gt, gp = table_of(V, d, tdt, 7), table_of(L, d, tdt, 8)
    want_t, want_p = add_at(gt, ids, g, skip_row), add_at(gp, rows, g)
    tm, pm = _marks.RowMarks(V), _marks.RowMarks(L)
    with tuned(serial_below=serial_below, chunk_elems=64, adapt=False):
        done = _core.embed_backward(gt, gp, g, ids, positions, offset, threads, tm, pm, skip_row)
    assert done is True
    _same_bits(gt, want_t)
    _same_bits(gp, want_p)
    assert_marks(tm, first_seen(ids, V, skip_row=skip_row), V)
    assert_marks(pm, first_seen(rows, L), L)


@pytest.mark.parametrize("sdt", FLOAT_TABLE_DTYPES, ids=str)
@pytest.mark.parametrize("tdt", FLOAT_TABLE_DTYPES, ids=str)
def test_embed_backward_into_huge_tables_every_dtype_pair(tdt, sdt, sides):
    V, L, d = 300_000, 20_000, 4
    rng = np.random.default_rng(9)
    ids = rng.integers(-V, V, (4, 60))
    ids[1, :5] = ids[0, 0]  # a token many times
    positions = rng.integers(-L, L, (4, 60))
    g = rng.standard_normal((4, 60, d)).astype(sdt)
    gt0, gp0 = table_of(V, d, tdt, 10), table_of(L, d, tdt, 11)
    for pos, offset, rows in [(positions, 0, positions), (None, 100, 100 + np.arange(60))]:
        want_t, want_p = add_at(gt0, ids, g), add_at(gp0, rows, g)
        for threads in (1, 2, 4):
            gt, gp = gt0.copy(), gp0.copy()
            cposembed.embed_backward(gt, gp, g, ids, pos, offset=offset, num_threads=threads)
            _same_bits(gt, want_t)
            _same_bits(gp, want_p)


def test_layer_backward_into_a_huge_vocabulary_marks_and_zeroes_its_rows(sides):
    V, L, d = 2_000_000, 64, 4
    m = cposembed.TokenPositionEmbedding.from_pretrained(
        np.zeros((V, d), np.float32), np.zeros((L, d), np.float32), padding_idx=0
    )
    rng = np.random.default_rng(12)
    ids = rng.integers(0, V, (3, 40))
    ids[0, :4] = [0, 0, 17, 17]
    g = rng.standard_normal((3, 40, d)).astype(np.float32)
    m.backward(g, ids)
    _same_bits(m.token_grad, add_at(np.zeros((V, d), np.float32), ids, g, 0))
    _same_bits(m.position_grad, add_at(np.zeros((L, d), np.float32), np.arange(40), g))
    tokens = m._tokens._grad
    assert_marks(tokens.touched, first_seen(ids, V, skip_row=0), V)
    m.zero_grad()
    assert not m.token_grad.any() and len(tokens.touched) == 0


# -- RowMarks -----------------------------------------------------------------------
def test_rowmarks_list_rows_in_marking_order_without_repeats():
    marks = marks_with(10, [7, 2, 7, 9, 2, -1])
    assert list(marks.rows()) == [7, 2, 9]
    assert marks.rows().dtype == np.int64
    _core.scatter_add(np.zeros((10, 1)), np.zeros((3, 1)), [0, 9, 5], 0, None, marks)
    assert list(marks.rows()) == [7, 2, 9, 0, 5]
    assert len(marks) == 5 and marks.n_rows == 10
    assert marks.rows() is not marks.rows()  # a new array each time


def test_rowmarks_mark_all_unmark_clear():
    marks = marks_with(6, [4, 1])
    marks.mark_all()
    assert list(marks.rows()) == [4, 1, 0, 2, 3, 5]
    assert marks.mask.all()
    marks.mark_all()  # nothing new
    assert len(marks) == 6
    marks.unmark(1)
    assert sorted(marks.rows()) == [0, 2, 3, 4, 5] and not marks.mask[1]
    marks.unmark(1)  # an unmarked row: nothing happens
    assert len(marks) == 5
    for bad in (6, -1, 100):
        with pytest.raises(IndexError, match="out of bounds"):
            marks.unmark(bad)
    assert len(marks) == 5
    marks.clear()
    assert len(marks) == 0 and not marks.mask.any() and marks.rows().size == 0
    marks.unmark(3)
    empty = _marks.RowMarks(0)
    empty.mark_all()
    empty.clear()
    assert len(empty) == 0 and empty.mask.shape == (0,)


@pytest.mark.parametrize("dtype", FLOAT_TABLE_DTYPES, ids=str)
def test_rowmarks_zero_rows(dtype):
    n_rows, d = 50, 3
    full = table_of(n_rows, d, dtype, 13)
    # Few marked: only those rows zeroed.
    grad = full.copy()
    marks = marks_with(n_rows, [3, 40, 3])
    marks.zero_rows(grad)
    want = full.copy()
    want[[3, 40]] = 0
    _same_bits(grad, want)
    assert len(marks) == 0 and not marks.mask.any()
    # Most marked: the whole array (every row, marked or not).
    grad = full.copy()
    marks = marks_with(n_rows, list(range(25)))
    marks.zero_rows(grad)
    _same_bits(grad, np.zeros_like(full))
    assert len(marks) == 0
    # One short of half: the marked rows only.
    grad = full.copy()
    marks = marks_with(n_rows, list(range(24)))
    marks.zero_rows(grad)
    want = full.copy()
    want[:24] = 0
    _same_bits(grad, want)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((9, 3), np.float32),  # other rows
        np.zeros((10, 3), object),  # references, not numbers
        np.zeros((10, 3), np.float32)[:, ::2],  # not contiguous
        np.zeros(10, np.float32),  # 1-D
        np.zeros((10, 3), np.float32).tolist(),
        np.zeros((10, 3), np.float32).T.copy().T,
        None,
    ],
    ids=["rows", "object", "strided", "1d", "list", "fortran", "none"],
)
def test_rowmarks_zero_rows_refuses_a_bad_grad_and_keeps_its_marks(bad):
    marks = marks_with(10, [1, 2])
    with pytest.raises(ValueError, match="grad must be"):
        marks.zero_rows(bad)
    assert list(marks.rows()) == [1, 2]
    ro = np.ones((10, 3), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        marks.zero_rows(ro)
    assert ro.all() and len(marks) == 2


def test_rowmarks_pickle_and_the_mask_argument():
    marks = marks_with(8, [5, 0, 6])
    copy = pickle.loads(pickle.dumps(marks))
    assert type(copy) is _marks.RowMarks and copy.n_rows == 8
    _same_bits(copy.mask, marks.mask)
    assert sorted(copy.rows()) == [0, 5, 6]
    copy.unmark(0)  # independent of the original
    assert marks.mask[0]
    given_mask = np.array([0, 1, 0, 0, 1, 0, 0, 0], bool)
    made = _marks.RowMarks(8, given_mask)
    assert list(made.rows()) == [1, 4]
    assert made.mask is not given_mask
    given_mask[0] = True
    assert not made.mask[0]
    for wrong in (np.zeros(7, bool), np.zeros((8, 1), bool), np.zeros((2, 4), bool)):
        with pytest.raises(ValueError, match=r"mask must have shape \(8,\)"):
            _marks.RowMarks(8, wrong)
    with pytest.raises(ValueError, match="n_rows"):
        _marks.RowMarks(-1)


def test_rowmarks_mask_is_read_only():
    marks = marks_with(4, [2])
    with pytest.raises(ValueError):
        marks.mask[0] = True
    with pytest.raises(ValueError):
        marks.mask.flags.writeable = True
    with pytest.raises(AttributeError):
        marks.mask = np.ones(4, bool)
    assert list(marks.rows()) == [2] and marks.mask.sum() == 1


# -- distinct_rows ------------------------------------------------------------------
def check_distinct(rows, n_rows):
    found = _core.distinct_rows(rows, n_rows)
    assert found is not None
    uniq, slots, first = found
    flat = rows.reshape(-1)
    values, index, inverse = np.unique(flat, return_index=True, return_inverse=True)
    order = np.argsort(index, kind="stable")  # order of first appearance
    _same_bits(uniq, values[order])
    _same_bits(first, index[order].astype(np.int64))
    assert slots.shape == rows.shape and slots.dtype == np.int64
    _same_bits(np.asarray(uniq[slots]), rows)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    _same_bits(slots.reshape(-1), rank[inverse.reshape(-1)].astype(np.int64))


@settings(max_examples=200, deadline=None)
@given(
    n_rows=st.sampled_from([1, 2, 5, 40, 1000, 10**6, 2**40]),
    data=st.data(),
)
def test_distinct_rows_is_np_unique_in_order_of_first_appearance(n_rows, data):
    shape = tuple(data.draw(st.lists(st.integers(0, 6), min_size=0, max_size=3), label="shape"))
    size = int(np.prod(shape))
    hi = min(n_rows - 1, data.draw(st.sampled_from([3, 50, 2**62])))
    values = data.draw(st.lists(st.integers(0, hi), min_size=size, max_size=size))
    check_distinct(np.array(values, np.int64).reshape(shape), n_rows)


@pytest.mark.parametrize("n_rows", [100, 401, 4000, 5_000_000])
def test_distinct_rows_hash_and_direct_map(n_rows):
    # 100 rows: n_rows <= 4 m, the direct map; 5,000,000: the hash table, which
    # also sees collisions (many rows hashing near each other).
    rng = np.random.default_rng(14)
    for m in (1, 100, 1000):
        check_distinct(rng.integers(0, n_rows, m), n_rows)
    check_distinct(np.arange(0, n_rows, max(1, n_rows // 300))[::-1].copy(), n_rows)
    check_distinct(np.full((3, 4), n_rows - 1, np.int64), n_rows)
    check_distinct(np.zeros(0, np.int64), n_rows)


def test_distinct_rows_declines():
    good = np.array([1, 2, 1], np.int64)
    assert _core.distinct_rows(good, 3) is not None
    for rows, n_rows in [
        (np.array([1, 3]), 3),  # out of range
        (np.array([-1, 0]), 3),  # negatives are not wrapped
        (np.array([0], np.int64), 0),
        (good, -1),
        (good.astype(np.int32), 3),
        (good.astype(np.uint64), 3),
        (good.astype(np.float64), 3),
        (np.repeat(good, 2)[::2], 3),  # not contiguous
        (good.astype(">i8"), 3),  # byte-swapped
        (good.view(type("Sub", (np.ndarray,), {})), 3),
        ([1, 2, 1], 3),
        (np.zeros(25, np.uint8)[1:].view(np.int64), 3),  # unaligned
    ]:
        assert _core.distinct_rows(rows, n_rows) is None, (rows, n_rows)
