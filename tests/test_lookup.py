"""lookup and the class's call: against NumPy, every index form, ``out=`` layouts and
overlaps, and the C entry's plain case."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    FLOAT_TYPES,
    INDEX_DTYPES,
    _rows_for,
    _sizes,
    _table,
    make_out,
    tuned,
)
from hypothesis import assume, event, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from plain import (
    FLOATS,
    INT_DTYPES,
    INT_TYPES,
    PLAIN_THREADS,
    THREADS,
    Snapshot,
    _declined,
    _disjoint,
    _entry_case,
    _expected_team,
    _fresh,
    _is_int,
    _mark_team,
    _pick,
    _plain,
    _plain_table,
    _Pos,
    _rng,
    _rows,
    _same_bits,
    _Sub,
    _threads_ok,
    positions_of,
)
from strategies import (
    CLEAR_ERRORS,
    SIZED_INT_DTYPES,
    _bits,
    index_arrays,
    layout,
    numpy_or_error,
    same_bits,
    tables,
)

import cposembed
from cposembed import LearnedPositionEmbedding, _core
from cposembed.reference import LearnedPositionEmbedding as Reference


@st.composite
def any_positions(draw, n_rows, plain=False):
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    odd = st.sampled_from([None, slice(0, 2), Ellipsis, (1, 0), "1", 1.0, True, np.True_])
    if not plain and draw(st.integers(0, 9)) == 9:
        return draw(odd)
    return draw(positions_of(shape, n_rows, plain))


# ------------------------------------------------------------------ lookup
@given(data=st.data())
def test_lookup_entry_accepts_exactly_the_plain_case(data):
    plain, L, d, dtype, _, table = _entry_case(data, max_rows=12, max_dim=9)
    positions = data.draw(any_positions(L, plain), label="positions")
    rows = _rows(positions, L)
    try:
        pos_shape = rows.shape if rows is not None else np.shape(positions)
    except ValueError:
        pos_shape = (1,)
    out_shape = tuple(pos_shape) + (d,)
    out_kind = _pick(
        data.draw,
        ["none", "plain"],
        ["dtype", "shape", "strided", "readonly", "subclass", "unaligned", "swapped", "on_table"]
        + ["list"],
        plain=plain,
    )
    out = None
    if out_kind == "plain":
        out = make_out("plain", out_shape, dtype, fill=-7)
    elif out_kind == "dtype":
        out = make_out("wrong_dtype", out_shape, dtype)
    elif out_kind == "shape":
        out = np.zeros(out_shape[:-1] + (d + 1,), dtype)
    elif out_kind == "strided":
        out = np.zeros(out_shape[:-1] + (2 * d + 2,), dtype)[..., ::2][..., :d]
        if out.flags.c_contiguous:
            out = None
    elif out_kind == "readonly":
        out = make_out("read_only", out_shape, dtype)
    elif out_kind == "subclass":
        out = make_out("subclass", out_shape, dtype)
    elif out_kind == "unaligned":
        out = make_out("misaligned", out_shape, dtype)
    elif out_kind == "swapped":
        out = make_out("byteswapped", out_shape, dtype)
    elif out_kind == "on_table" and _plain_table(table) and table.size and 0 < np.prod(out_shape):
        # out's bytes overlap the table's: rebuild both in one buffer.
        size = int(np.prod(out_shape))
        buf = np.zeros(table.size + size, dtype)
        start = data.draw(st.integers(0, table.size - 1))
        view = buf[: table.size].reshape(table.shape)
        view[...] = table
        table = view
        out = buf[start : start + size].reshape(out_shape)
    elif out_kind == "list":
        out = np.zeros(out_shape, dtype).tolist()
    num_threads = data.draw(PLAIN_THREADS if plain else THREADS, label="num_threads")
    serial_below = data.draw(st.sampled_from([None, 0]))
    scalar_path = _is_int(positions) and out is None and num_threads is None

    accept = (
        _plain_table(table)
        and rows is not None
        and _threads_ok(num_threads)
        and (
            out is None
            or (
                _plain(out, table.dtype)
                and out.flags.writeable
                and out.shape == rows.shape + (d,)
                and _disjoint(out, table)
            )
        )
    )
    event("accepted" if accept else "declined")
    snap = Snapshot(table, positions, out)
    with tuned(serial_below=serial_below):
        team = 0
        if accept:
            n = rows.size
            team = _expected_team(num_threads, n * d, n)
            _mark_team(avoid=team)
        result = _core.lookup(table, positions, out, num_threads)
        if not accept:
            _declined(result, snap)
            return
        assert result is not None, "the entry declined a plain call"
        snap.unchanged(but=(out,))
        _same_bits(result, table[rows])
        if out is not None:
            assert result is out
        else:
            _fresh(result, table, positions)
        if not scalar_path:  # see test_last_team_after_the_single_row_path
            assert _core.last_team() == team


@pytest.mark.parametrize("dtype", FLOATS)
def test_lookup_entry_reads_every_integer_kind(dtype):
    L = 12
    table = _rng(0).standard_normal((L, 5)).astype(dtype)
    cases = [
        *(t(v) for t in INT_TYPES for v in (0, 11, -12) if np.iinfo(t).min <= v),
        *(np.array([[3, 0], [11, 1]], t) for t in INT_TYPES),
        [np.int8(-1), 3, np.uint64(11), np.longlong(-12), np.intc(0)],
        [[1, np.uint16(2)], [np.int16(-3), 4]],
        np.array(7),
        np.array(-L, np.int8),
        [],
        [[], []],
        np.zeros((0, 3), np.uint64),
        np.array([5, 1, 2], np.uint64)[::-1],
        np.arange(24, dtype=np.int16).reshape(4, 6)[:, ::-2] % L,
    ]
    for pos in cases:
        got = _core.lookup(table, pos, None, None)
        assert got is not None, repr(pos)
        _same_bits(got, table[np.asarray(pos, dtype=np.int64)])
        _fresh(got, table)


@pytest.mark.parametrize("dtype", FLOATS)
def test_lookup_entry_edges_of_the_range(dtype):
    L = 12
    table = _rng(0).standard_normal((L, 3)).astype(dtype)
    for good in (-L, L - 1, 0, -1):
        for t in [int, *INT_TYPES]:
            if t is not int and not np.iinfo(t).min <= good:
                continue
            for pos in (t(good), [t(good)], np.array([good], t) if t is not int else [good]):
                _same_bits(_core.lookup(table, pos, None, 1), table[np.asarray(pos, np.int64)])
    for bad in (L, -L - 1, 2**31, 2**63 - 1, -(2**63), 2**63, 2**64 - 1, 2**70, -(2**70)):
        kinds = [bad, [0, bad], [[bad]]]
        kinds += [t(bad) for t in INT_TYPES if np.iinfo(t).min <= bad <= np.iinfo(t).max]
        kinds += [
            np.array([1, bad], t) for t in INT_TYPES if np.iinfo(t).min <= bad <= np.iinfo(t).max
        ]
        for pos in kinds:
            snap = Snapshot(table, pos)
            _declined(_core.lookup(table, pos, None, None), snap)
            out = np.full(np.shape(pos) + (3,), 9, dtype)
            snap = Snapshot(table, pos, out)
            _declined(_core.lookup(table, pos, out, 2), snap)
            with pytest.raises(IndexError, match="out of range"):
                cposembed.lookup(table, pos, out=out)
            assert np.all(out == 9)


ODD_LISTS = [
    [True],
    [True, False],
    [0, True],
    [0, np.True_],
    [[0], [True]],
    [1.0],
    [np.float32(1)],
    [1, 2**70],
    [2**63],
    [np.uint64(2**64 - 1)],
    [[1, 2], [3]],
    [[1], 2],
    [1, [2]],
    [(1, 2)],
    [[[0]], [0]],
    [None],
    ["1"],
    [_Pos.THREE],
    [np.array(1)],
    [np.timedelta64(1)],
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("pos", ODD_LISTS, ids=repr)
def test_lookup_entry_declines_odd_lists_and_the_function_agrees_with_numpy(dtype, pos):
    table = _rng(0).standard_normal((12, 5)).astype(dtype)
    snap = Snapshot(table)
    _declined(_core.lookup(table, pos, None, None), snap)
    items = np.asarray(pos, dtype=object).reshape(-1)  # lists, if ragged
    if all(_is_int(x) for x in items) and any(not -12 <= int(x) < 12 for x in items):
        # Integers beyond the table (NumPy would wrap a uint64 into -1).
        with pytest.raises(IndexError, match="out of range"):
            cposembed.lookup(table, pos)
        return
    try:
        expect = table[pos]
    except (IndexError, TypeError, ValueError) as exc:
        with pytest.raises((type(exc), IndexError, ValueError)):
            cposembed.lookup(table, pos)
    else:
        _same_bits(cposembed.lookup(table, pos), expect)


ODD_POSITIONS = [
    True,
    False,
    np.True_,
    _Pos.THREE,
    3.0,
    None,
    slice(0, 2),
    Ellipsis,
    (1, 2),
    (1,),
    "1",
    np.array([True, False] * 6),
    np.array([1.0, 2.0]),
    np.array(["1"]),
    np.array([1, 2], dtype=object),
    np.array([1, 2], dtype="m8[s]"),
    np.array([1, 2], ">i4"),
    np.array([1, 2], "<i4").view(_Sub),
    np.ma.masked_array([1, 2]),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("pos", ODD_POSITIONS, ids=repr)
def test_lookup_entry_declines_other_indices_and_the_class_agrees_with_numpy(dtype, pos):
    table = _rng(0).standard_normal((12, 5)).astype(dtype)
    snap = Snapshot(table, pos)
    _declined(_core.lookup(table, pos, None, None), snap)
    pe = cposembed.LearnedPositionEmbedding.from_pretrained(table, dtype=dtype)
    if isinstance(pos, np.ma.MaskedArray):
        with pytest.raises(TypeError, match="masked"):
            pe(pos)
        return
    try:
        expect = table[pos]
    except (IndexError, TypeError, ValueError) as exc:
        with pytest.raises(type(exc)):
            pe(pos)
    else:
        _same_bits(np.asarray(pe(pos)), np.asarray(expect))


def test_lookup_entry_dimension_limits():
    # Results take one more axis: 31 position axes at most (NumPy 1.x's 32).
    table = _rng(0).standard_normal((3, 2)).astype(np.float32)
    assert _core.lookup(table, np.zeros((1,) * 31, np.int64), None, None).shape == (1,) * 31 + (2,)
    assert _core.lookup(table, np.zeros((1,) * 32, np.int64), None, None) is None
    deep: list = [2]
    for _ in range(30):
        deep = [deep]
    assert _core.lookup(table, deep, None, None).shape == (1,) * 31 + (2,)
    assert _core.lookup(table, [deep], None, None) is None
    # ...and the function serves deeper ones with NumPy's indexing (NumPy 2
    # allows 64 axes, NumPy 1.x 32).
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        got = cposembed.lookup(table, np.ones((1,) * 40, np.int64))
        _same_bits(got, table[np.ones((1,) * 40, np.int64)])


@pytest.mark.parametrize("idt", [np.int16, np.int32, np.int64, np.uint32, np.uint64])
def test_lookup_entry_reads_unaligned_positions(idt):
    pos = np.array([3, 0, 11, 7, 1, 2], idt)
    raw = np.frombuffer(b"\0" + pos.tobytes(), idt, offset=1)
    assert not raw.flags.aligned
    table = _rng(0).standard_normal((12, 4))
    _same_bits(_core.lookup(table, raw, None, None), table[pos])
    _same_bits(
        _core.lookup(table, raw.reshape(2, 3)[:, ::-2], None, 1), table[pos.reshape(2, 3)[:, ::-2]]
    )


def test_lookup_entry_uint64_beyond_int64():
    table = np.ones((12, 2), np.float32)
    for pos in (
        np.array([2**63, 1], np.uint64),
        np.array([2**64 - 1], np.uint64),
        np.uint64(2**63),
    ):
        assert _core.lookup(table, pos, None, None) is None
        with pytest.raises(IndexError, match="out of range"):
            cposembed.LearnedPositionEmbedding.from_pretrained(table)(pos)


def test_lookup_out_of_range_raises_ours_and_writes_nothing():
    table = np.ones((8, 4), np.float32)
    out = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(IndexError, match="position 8 is out of range"):
        cposembed.lookup(table, np.array([[0, 1, 2], [3, 4, 8]]), out=out)
    assert not out.any()


@pytest.mark.parametrize("dtype", FLOATS)
@given(
    pos=st.integers(-14, 13)
    | st.lists(st.integers(-14, 13), max_size=6)
    | hnp.arrays(
        st.sampled_from(INT_DTYPES),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
        elements=st.integers(0, 14),
    )
)
def test_class_equals_reference(dtype, pos):
    L, D = 12, 5
    pe = cposembed.LearnedPositionEmbedding(L, D, seed=3, dtype=dtype)
    ref = Reference(L, D, seed=3)
    try:
        expect = ref(pos)
    except IndexError:
        with pytest.raises(IndexError, match="out of range"):
            pe(pos)
        return
    got = pe(pos)
    _fresh(got, pe.embeddings)
    _same_bits(got, np.asarray(expect).astype(dtype))
    got[...] = 7  # a copy: the table is untouched
    assert np.array_equal(pe.embeddings, ref.embeddings.astype(dtype))


# ---------------------------------------------------------------- lookup
@pytest.mark.parametrize("dtype", FLOAT_TYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("which", [0, 1])
def test_lookup_every_index_dtype_both_sides_of_threshold(dtype, index_dtype, which):
    d = 96
    n = _rows_for(_sizes()[which], d)
    n_rows = min(200, int(np.iinfo(index_dtype).max) + 1)
    table = _table(n_rows, d, dtype)
    rng = np.random.RandomState(1)
    lo = -n_rows if np.iinfo(index_dtype).min < 0 else 0
    positions = rng.randint(lo, n_rows, size=n).astype(index_dtype)
    for threads in (1, 2, 3):
        got = cposembed.lookup(table, positions, num_threads=threads)
        assert got.tobytes() == table[positions].tobytes()


def test_lookup_out_and_layouts():
    table = _table(64, 8, np.float32)
    positions = np.arange(64)[::-2]
    out = np.full((32, 8), np.nan, np.float32)
    res = cposembed.lookup(table, positions, out=out)
    assert res is out
    np.testing.assert_array_equal(out, table[positions])
    # Fortran-ordered table, non-contiguous out.
    f_table = np.asfortranarray(table)
    big = np.zeros((32, 16), np.float32)
    res = cposembed.lookup(f_table, positions, out=big[:, ::2])
    np.testing.assert_array_equal(big[:, ::2], table[positions])
    assert np.all(big[:, 1::2] == 0)


def test_lookup_out_overlapping_table_matches_numpy():
    table = _table(10, 4, np.float64)
    positions = np.array([9, 8, 7, 6, 5])
    expected = table[positions].copy()
    cposembed.lookup(table, positions, out=table[:5])
    np.testing.assert_array_equal(table[:5], expected)


def test_lookup_read_only_inputs():
    table = _table(10, 4, np.float32)
    table.flags.writeable = False
    positions = np.array([1, 2, 3])
    positions.flags.writeable = False
    np.testing.assert_array_equal(cposembed.lookup(table, positions), table[positions])


@st.composite
def index_like(draw, n_rows: int):
    """Anything a pipeline might pass as positions."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.integers(-n_rows - 2, n_rows + 1))
    if kind == 1:
        return draw(st.sampled_from([np.int8, np.uint16, np.int64, np.uint64, np.intp]))(
            draw(st.integers(0, max(n_rows - 1, 0)))
        )
    if kind == 2:
        return draw(st.lists(st.integers(-n_rows, max(n_rows - 1, 0)), max_size=5))
    if kind == 3:
        return draw(
            st.sampled_from(
                [
                    1.0,
                    0.5,
                    np.float32(1),
                    "1",
                    b"0",
                    None,
                    True,
                    False,
                    [1.0, 2.0],
                    [[0], [1, 2]],
                    [],
                    [[]],
                    2**70,
                    -(2**70),
                    [2**64],
                    object(),
                ]
            )
        )
    if kind == 4:
        stop = draw(st.integers(-n_rows - 1, n_rows + 1))
        return slice(None, stop, draw(st.sampled_from([None, 1, 2, -1])))
    return draw(index_arrays(n_rows))


# --- properties ---------------------------------------------------------------
@given(table=tables(min_rows=0) | tables(), data=st.data())
def test_lookup_any_index_matches_numpy(table, data):
    positions = data.draw(index_like(table.shape[0]), label="positions")
    before = _bits(table)
    want, ref_exc = numpy_or_error(lambda: table[positions])
    if ref_exc is not None:
        with pytest.raises(CLEAR_ERRORS):
            cposembed.lookup(table, positions)
    else:
        got = cposembed.lookup(table, positions)
        assert same_bits(got, want)
        assert not np.shares_memory(got, table)
    assert _bits(table) == before


@given(table=tables(), data=st.data())
def test_class_call_any_index_matches_reference(table, data):
    """The drop-in class on the same hostile positions, against the reference."""
    assume(table.shape[1] > 0)
    pe = LearnedPositionEmbedding.from_pretrained(table, dtype=table.dtype)
    positions = data.draw(index_like(table.shape[0]), label="positions")
    want, ref_exc = numpy_or_error(lambda: table[positions])
    if ref_exc is not None:
        with pytest.raises(CLEAR_ERRORS):
            pe(positions)
    else:
        assert same_bits(pe(positions), want)
    assert _bits(pe.embeddings) == _bits(table)


@given(table=tables(), data=st.data())
def test_lookup_out_any_layout_or_overlap(table, data):
    L, d = table.shape
    pos = data.draw(index_arrays(L, dtypes=st.sampled_from(SIZED_INT_DTYPES)), label="positions")
    assume(pos.size == 0 or (pos.astype(np.int64).min() >= -L and pos.astype(np.int64).max() < L))
    shape = pos.shape + (d,)
    mode = data.draw(st.sampled_from(["fresh", "fortran", "reversed", "strided", "table"]))
    work = table.copy()
    if mode == "table":
        # out overlapping the table itself (when the sizes allow): NumPy's
        # semantics are "read all of table[pos], then write".
        size = int(np.prod(shape))
        assume(0 < size <= work.size)
        out = work.reshape(-1)[work.size - size :].reshape(shape)
    else:
        out = data.draw(layout(np.full(shape, 7, dtype=table.dtype)))
        assume(out.flags.writeable)
    want = table[pos]
    got = cposembed.lookup(work, pos, out=out)
    assert got is out
    assert same_bits(out, want)
