"""cposembed._fastcall: tiny lookups and decode steps in C, on NumPy's C API.

``take_small`` / ``add_row_small`` return either None ("not a plain valid tiny
case: take the full path") or exactly what NumPy computes, in a fresh array;
they never raise for bad input and never write to their inputs. The class and
``lookup`` must route tiny calls through them and still equal the reference.
"""

from __future__ import annotations

import enum

import numpy as np
import pytest
from helpers import INDEX_DTYPES
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import cposembed
from cposembed import _fastcall, embedding, functional
from cposembed.reference import LearnedPositionEmbedding as Reference

L, D = 12, 5
TABLE_DTYPES = [np.float32, np.float64]
# Positions just beyond the table on both sides, to hit every range check.
LO, HI = -L - 3, L + 3


def _table(dtype, n_rows=L, d=D, seed=0):
    return np.random.default_rng(seed).standard_normal((n_rows, d)).astype(dtype)


def _fresh(got, table):
    assert type(got) is np.ndarray
    assert got.dtype == table.dtype
    assert got.flags.owndata and got.flags.writeable and got.flags.c_contiguous
    assert not np.shares_memory(got, table)


def _same_bits(got, expect):
    expect = np.asarray(expect)
    assert got.shape == expect.shape and got.dtype == expect.dtype
    assert np.asarray(got).tobytes() == expect.tobytes()


def _in_range(values, n_rows=L):
    flat = [int(x) for x in np.asarray(values, dtype=object).reshape(-1)]
    return all(-n_rows <= x < n_rows for x in flat)


def _check_take(table, positions, *, served):
    """take_small is None, or bitwise table[positions] in a fresh array.

    ``served``: True if this case must be served (so a wiring that always
    returns None fails), False if it must be None, None if either is fine.
    """
    before = table.tobytes()
    pos_before = positions.tobytes() if isinstance(positions, np.ndarray) else None
    got = _fastcall.take_small(table, positions)
    assert table.tobytes() == before
    if pos_before is not None:
        assert positions.tobytes() == pos_before
    if served is not None:
        assert (got is not None) == served, (positions, got)
    if got is not None:
        _fresh(got, table)
        if isinstance(positions, list):
            expect = table[np.asarray(positions, dtype=np.int64)]
        else:
            expect = table[positions]
        _same_bits(got, expect)
    return got


# ------------------------------------------------------------------ take_small


@pytest.mark.parametrize("tdt", TABLE_DTYPES)
@given(p=st.integers(LO, HI) | st.integers(-(2**70), 2**70))
def test_take_python_int(tdt, p):
    table = _table(tdt)
    _check_take(table, p, served=-L <= p < L)


@pytest.mark.parametrize("tdt", TABLE_DTYPES)
@pytest.mark.parametrize("idt", INDEX_DTYPES)
@given(data=st.data())
def test_take_integer_arrays(tdt, idt, data):
    info = np.iinfo(idt)
    lo, hi = max(LO, int(info.min)), min(HI, int(info.max))
    shape = data.draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    pos = data.draw(hnp.arrays(idt, shape, elements=st.integers(lo, hi)))
    layout = data.draw(st.sampled_from(["c", "reversed", "strided", "transposed", "swapped"]))
    if layout == "reversed" and pos.ndim:
        pos = pos[..., ::-1]
    elif layout == "strided" and pos.ndim:
        pos = np.repeat(pos, 2, axis=0)[::2]
    elif layout == "transposed":
        pos = pos.T
    elif layout == "swapped" and pos.dtype.itemsize > 1:
        pos = pos.astype(pos.dtype.newbyteorder())
    table = _table(tdt)
    plain = pos.dtype.isnative and _in_range(pos)
    _check_take(table, pos, served=plain)


@pytest.mark.parametrize("tdt", TABLE_DTYPES)
@given(
    pos=st.lists(st.integers(LO, HI), max_size=8)
    | st.integers(0, 3).flatmap(
        lambda n: st.lists(st.lists(st.integers(LO, HI), min_size=n, max_size=n), max_size=4)
    )
)
def test_take_lists_of_ints(tdt, pos):
    table = _table(tdt)
    _check_take(table, pos, served=_in_range(pos))


ODD_LISTS = [
    [True],
    [True, False],
    [0, True],
    [[0], [True]],
    [np.int64(1)],
    [1.0],
    [1, 2**70],
    [2**63],
    [[1, 2], [3]],
    [[1], 2],
    [1, [2]],
    [(1, 2)],
    [[[0]], [0]],
    [None],
    ["1"],
]


@pytest.mark.parametrize("tdt", TABLE_DTYPES)
@pytest.mark.parametrize("pos", ODD_LISTS, ids=repr)
def test_take_odd_lists_are_left_to_the_full_path(tdt, pos):
    _check_take(_table(tdt), pos, served=False)


class _Sub(np.ndarray):
    pass


class _Pos(enum.IntEnum):
    THREE = 3


ODD_POSITIONS = [
    True,
    False,
    np.True_,
    np.int64(3),
    np.uint8(3),
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
    np.ma.masked_array([1, 2]),
]


@pytest.mark.parametrize("tdt", TABLE_DTYPES)
@pytest.mark.parametrize("pos", ODD_POSITIONS, ids=repr)
def test_take_odd_positions_are_left_to_the_full_path(tdt, pos):
    table = _table(tdt)
    _check_take(table, pos, served=False)
    # ...where the class and the reference agree, bools (masks) included.
    pe = cposembed.LearnedPositionEmbedding.from_pretrained(table, dtype=tdt)
    try:
        expect = table[pos]
    except (IndexError, TypeError, ValueError) as exc:
        with pytest.raises(type(exc)):
            pe(pos)
    else:
        _same_bits(pe(pos), np.asarray(expect))


@pytest.mark.parametrize(
    "table",
    [
        _table(np.float32)[:, ::2],  # not C-contiguous
        _table(np.float64).T.copy().T,
        _table(np.float32).astype(">f4"),
        _table(np.float16),
        _table(np.int64),
        _table(np.float32)[0],  # 1-D
        _table(np.float32)[None],  # 3-D
        _table(np.float32).tolist(),
        _table(np.float32).view(_Sub),
        np.frombuffer(b"\0" + _table(np.float64).tobytes(), np.float64, offset=1).reshape(L, D),
    ],
    ids=lambda t: f"{type(t).__name__}",
)
def test_take_only_serves_plain_tables(table):
    assert _fastcall.take_small(table, 1) is None
    assert _fastcall.take_small(table, [1, 2]) is None
    assert _fastcall.take_small(table, np.array([1, 2])) is None
    assert _fastcall.add_row_small(np.zeros((1, 1, D), np.float32), table, 0) is None
    if (
        isinstance(table, np.ndarray)
        and table.ndim == 2
        and table.dtype.newbyteorder("=") in (np.float32, np.float64)
        and table.flags.aligned
    ):
        got = cposembed.lookup(table, [1, -2])
        assert np.array_equal(got, np.asarray(table)[[1, -2]])


@pytest.mark.parametrize("tdt", TABLE_DTYPES)
def test_take_size_limit_and_dims(tdt):
    d = 64
    table = _table(tdt, 300, d)
    n = _fastcall.SMALL_TAKE_ELEMENTS // d
    _check_take(table, np.zeros(n, np.int64), served=True)
    _check_take(table, np.zeros(n + 1, np.int64), served=False)
    _check_take(table, [0] * n, served=True)
    _check_take(table, [0] * (n + 1), served=False)
    _check_take(table, [[0] * n, [0]], served=False)  # too large before it is ragged
    # Results need one more axis: at most 32 in all (NumPy 1.x's limit).
    _check_take(table, np.zeros((1,) * 31, np.int64), served=True)
    _check_take(table, np.zeros((1,) * 32, np.int64), served=False)
    deep: list = [0]
    for _ in range(30):
        deep = [deep]
    _check_take(table, deep, served=True)  # 31 levels
    _check_take(table, [deep], served=False)


def test_take_table_edge_sizes():
    empty_rows = np.zeros((0, 3), np.float32)
    _check_take(empty_rows, [], served=True)
    _check_take(empty_rows, 0, served=False)
    _check_take(empty_rows, np.zeros(0, np.int8), served=True)
    no_cols = np.zeros((4, 0), np.float64)
    _check_take(no_cols, [1, -4], served=True)
    _check_take(no_cols, 4, served=False)


@pytest.mark.parametrize("idt", [np.int16, np.int32, np.int64, np.uint32, np.uint64])
def test_take_unaligned_positions(idt):
    pos = np.array([3, 0, 11, 7, 1, 2], idt)
    raw = np.frombuffer(b"\0" + pos.tobytes(), idt, offset=1)
    assert not raw.flags.aligned
    table = _table(np.float64)
    _check_take(table, raw, served=True)
    _check_take(table, raw.reshape(2, 3)[:, ::2], served=True)


def test_take_uint64_beyond_int64():
    table = _table(np.float32)
    _check_take(table, np.array([2**63, 1], np.uint64), served=False)
    _check_take(table, np.array([2**64 - 1], np.uint64), served=False)
    with pytest.raises(IndexError, match="out of range"):
        cposembed.LearnedPositionEmbedding.from_pretrained(table)(np.array([2**63], np.uint64))


# ------------------------------------------------------------------ add_row_small


def _check_add(tok, table, offset, *, served):
    before = (table.tobytes(), tok.tobytes() if isinstance(tok, np.ndarray) else None)
    got = _fastcall.add_row_small(tok, table, offset)
    assert (table.tobytes(), tok.tobytes() if isinstance(tok, np.ndarray) else None) == before
    assert (got is not None) == served, (getattr(tok, "shape", tok), offset, got)
    if got is not None:
        _fresh(got, table)
        assert not np.shares_memory(got, tok)
        n_tok = tok.shape[-2]
        expect = tok + table[offset : offset + n_tok]
        assert got.shape == expect.shape and got.dtype == expect.dtype
        assert np.array_equal(got, expect, equal_nan=True)
        nan = np.isnan(expect)
        _same_bits(got[~nan], expect[~nan])  # NaN payloads may differ by operand order
    return got


@pytest.mark.parametrize("tdt", TABLE_DTYPES)
@given(data=st.data())
def test_add_row_small(tdt, data):
    shape = data.draw(hnp.array_shapes(min_dims=2, max_dims=4, min_side=0, max_side=4))
    shape = shape[:-1] + (D,)
    tok = data.draw(hnp.arrays(tdt, shape, elements=st.floats(width=np.dtype(tdt).itemsize * 8)))
    offset = data.draw(st.integers(-3, L + 3))
    table = _table(tdt)
    table[0, 0] = -0.0
    table[1, :] = [np.inf, -np.inf, np.nan, 0.0, 1e-300 if tdt == np.float64 else 1e-30]
    served = 0 <= offset and offset + shape[-2] <= L
    _check_add(tok, table, offset, served=served)
    pe = cposembed.LearnedPositionEmbedding.from_pretrained(table, dtype=tdt)
    if served:
        got = pe.add_to(tok, offset=offset)
        assert np.array_equal(got, tok + table[offset : offset + shape[-2]], equal_nan=True)


@pytest.mark.parametrize("tdt", TABLE_DTYPES)
def test_add_row_small_leaves_the_rest_to_the_full_path(tdt):
    table = _table(tdt)
    other = np.float64 if tdt == np.float32 else np.float32
    tok = np.ones((2, 3, D), tdt)
    _check_add(tok, table, 0, served=True)
    _check_add(tok, table, L - 3, served=True)
    for bad_tok in [
        tok.astype(other),  # NumPy promotes: the full path's job
        tok.astype(np.float16),
        tok.astype(np.int64),
        tok.astype(tok.dtype.newbyteorder()),
        np.ones((2, 3, D + 1), tdt),
        np.ones((D,), tdt),  # 1-D
        np.ones((2, 6, D), tdt)[:, ::2],  # not C-contiguous
        np.ones((1, 1, D), tdt).view(np.recarray),  # a subclass
        tok.tolist(),
    ]:
        _check_add(bad_tok, table, 0, served=False)
    for bad_offset in [-1, L - 2, L, 2**70, -(2**70), True, np.int64(0), 0.0, None]:
        _check_add(tok, table, bad_offset, served=False)
    big = np.ones((1, _fastcall.SMALL_ADD_ELEMENTS // D + 1, D), tdt)
    _check_add(big, _table(tdt, big.shape[1]), 0, served=False)
    fits = np.ones((1, _fastcall.SMALL_ADD_ELEMENTS // D, D), tdt)
    _check_add(fits, _table(tdt, fits.shape[1]), 0, served=True)
    # Empty token arrays: NumPy's empty result, offset up to L for T = 0.
    _check_add(np.ones((1, 0, D), tdt), table, L, served=True)
    _check_add(np.ones((0, 2, D), tdt), table, 3, served=True)
    unaligned = np.frombuffer(b"\0" + tok.tobytes(), tdt, offset=1).reshape(tok.shape)
    _check_add(unaligned, table, 0, served=False)


# ------------------------------------------------------------------ the class


@pytest.mark.parametrize("tdt", TABLE_DTYPES)
@given(
    pos=st.integers(LO, HI)
    | st.lists(st.integers(LO, HI), max_size=6)
    | hnp.arrays(
        st.sampled_from(INDEX_DTYPES),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
        elements=st.integers(0, HI),
    )
)
def test_class_equals_reference(tdt, pos):
    pe = cposembed.LearnedPositionEmbedding(L, D, seed=3, dtype=tdt)
    ref = Reference(L, D, seed=3)
    try:
        expect = ref(pos)
    except IndexError:
        with pytest.raises(IndexError, match="out of range"):
            pe(pos)
        return
    got = pe(pos)
    _fresh(got, pe.embeddings)
    _same_bits(got, np.asarray(expect).astype(tdt))
    got[...] = 7  # a copy: the table is untouched
    assert np.array_equal(pe.embeddings, ref.embeddings.astype(tdt))


def test_class_uses_the_fast_paths(monkeypatch):
    """Tiny calls never reach the full path (which is broken here on purpose)."""

    def broken(*args, **kwargs):
        raise AssertionError("full path taken")

    monkeypatch.setattr(embedding, "lookup", broken)
    monkeypatch.setattr(embedding, "add_positions", broken)
    pe = cposembed.LearnedPositionEmbedding(128, 64, seed=0)
    table = pe.embeddings
    assert np.array_equal(pe(5), table[5])
    assert np.array_equal(pe(-1), table[-1])
    assert np.array_equal(pe([0]), table[[0]])
    assert np.array_equal(pe(np.arange(10)), table[:10])
    a4 = np.random.default_rng(1).integers(0, 128, size=(4, 128))
    assert np.array_equal(pe(a4), table[a4])
    tok = np.ones((1, 1, 64), np.float32)
    assert np.array_equal(pe.add_to(tok, offset=77), tok + table[77])
    # ...and anything else does reach it.
    for other in (lambda: pe(128), lambda: pe(True), lambda: pe(5, out=np.empty(64, np.float32))):
        with pytest.raises(AssertionError, match="full path"):
            other()
    # Other small float tokens: NumPy's promoting add, not the full path either.
    tok64 = tok.astype(np.float64)
    got = pe.add_to(tok64, offset=3)
    assert got.dtype == np.float64 and np.array_equal(got, tok64 + table[3])
    for other in (
        lambda: pe.add_to(tok.astype(np.int64), offset=0),
        lambda: pe.add_to(tok, offset=128),
        lambda: pe.add_to(tok, [[0]]),
    ):
        with pytest.raises(AssertionError, match="full path"):
            other()


def test_lookup_uses_the_fast_path(monkeypatch):
    def broken(*args, **kwargs):
        raise AssertionError("full path taken")

    monkeypatch.setattr(functional.v, "as_positions", broken)
    table = _table(np.float32)
    assert np.array_equal(cposembed.lookup(table, [3, -1]), table[[3, -1]])
    with pytest.raises(AssertionError, match="full path"):
        cposembed.lookup(table, [3, -1], num_threads=1)
