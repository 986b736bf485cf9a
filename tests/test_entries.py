"""cposembed._core's checked entries: lookup, add, scatter_add, sgd_step.

Each operation reaches its kernel through one C entry that takes the caller's
objects as they are and either runs the kernel and returns the result, or
declines: returns None with nothing written. The public functions normalise
what was declined (or raise the worded error) and call the same entry again.

These tests hold every entry to that contract: an oracle written here from
the documented rules says which arguments must be accepted and which
declined (so an entry that always declines fails, and so does one that takes
what it should not), accepted calls must give NumPy's bits and run on the
threads of the documented rule, declined calls must leave every array as it
was. Then memory safety (outputs may share memory with the positions, which
are read first, but not with what a call reads; absurd broadcast positions
never crash), and the public functions' route (one entry call for a plain
call; two, the second accepted, for a normalised one).
"""

from __future__ import annotations

import enum
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import tuned
from hypothesis import assume, event, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import cposembed
from cposembed import _core, _routes
from cposembed.reference import LearnedPositionEmbedding as Reference

FLOATS = [np.dtype(np.float32), np.dtype(np.float64)]
# Every NumPy integer scalar type: int64 and longlong are distinct types (and
# type numbers) on Linux, as are int32 and intc on some platforms.
INT_TYPES = sorted(
    {np.dtype(c).type for c in np.typecodes["AllInteger"]},
    key=lambda t: (np.dtype(t).itemsize, np.dtype(t).char),
)
_INT_TYPE_SET = frozenset(INT_TYPES)
INT_DTYPES = [np.dtype(t) for t in INT_TYPES]
CPUS = _core.cpu_limit()
HUGE = 2**62  # the largest offset an empty (T == 0) call takes


class _Sub(np.ndarray):
    pass


class _Pos(enum.IntEnum):
    THREE = 3


# ------------------------------------------------------------------ the oracle


def _is_int(x):
    """What the entries read as an integer: a Python int (not bool) or an exact
    NumPy integer scalar (not np.bool_, not a subclass such as an IntEnum)."""
    return type(x) is int or type(x) in _INT_TYPE_SET


def _plain(a, dtype=None):
    """An exact ndarray, C-contiguous, aligned, native byte order (of `dtype`)."""
    return (
        type(a) is np.ndarray
        and a.flags.c_contiguous
        and a.flags.aligned
        and a.dtype.isnative
        and (dtype is None or a.dtype == dtype)
    )


def _plain_table(t):
    return _plain(t) and t.ndim == 2 and t.dtype in FLOATS


def _apart(a, b):
    return not np.may_share_memory(a, b)


def _threads_ok(n):
    return n is None or (_is_int(n) and int(n) >= 1)


def _rows(p, n_rows):
    """The int64 positions an entry must read from `p`, or None: it must decline."""
    if _is_int(p):
        return np.array(int(p)) if -n_rows <= int(p) < n_rows else None
    if type(p) is np.ndarray:
        if p.dtype.kind not in "iu" or not p.dtype.isnative or p.ndim > 31:
            return None
        if p.size and (int(p.max()) >= n_rows or int(p.min()) < -n_rows):
            return None
        return p.astype(np.int64)
    if type(p) is not list:
        return None
    shape: list[int] = []
    obj = p
    while type(obj) is list:
        shape.append(len(obj))
        if not obj:
            break
        obj = obj[0]
    if len(shape) > 31:
        return None
    leaves: list[int] = []

    def walk(lst, depth):
        if type(lst) is not list or len(lst) != shape[depth]:
            return False
        for item in lst:
            if depth + 1 < len(shape):
                if not walk(item, depth + 1):
                    return False
            elif _is_int(item) and -n_rows <= int(item) < n_rows:
                leaves.append(int(item))
            else:
                return False
        return True

    if not walk(p, 0):
        return None
    return np.array(leaves, np.int64).reshape(shape)


def _core_shape(shape):
    """A positions shape without its leading 1s."""
    shape = tuple(shape)
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


def _period_ok(rows_shape, lead):
    """Positions of `rows_shape` for rows laid out as `lead`, as the entries
    take them: without leading 1s, the trailing axes of `lead`."""
    core = _core_shape(rows_shape)
    return len(core) <= len(lead) and core == tuple(lead[len(lead) - len(core) :])


def _expected_team(num_threads, work, chunks):
    """The documented thread rule (src_c/_team.pxi), written out again."""
    serial_below = _core.set_tuning()["serial_below"]
    if num_threads is None:
        n = 1 if work < serial_below else _core.default_threads()
    elif not _core.openmp_enabled() or _core.serial_child():
        n = 1
    else:
        n = min(int(num_threads), 4 * CPUS)
    if n <= 1 or work < serial_below:
        return 1
    if chunks < n:
        return chunks if chunks > 1 else 1
    return n


def _mark_team(avoid):
    """Set last_team() to a value other than `avoid` (so a call that does not
    report its team is caught)."""
    old = _core.set_tuning(serial_below=0)
    try:
        _core.team(2 if avoid != 2 else 3, 1 << 20, 1 << 20)
    finally:
        _core.set_tuning(**old)


class Snapshot:
    """Copies of every array argument, to prove later that nothing was written."""

    def __init__(self, *args):
        self.items = [(a, a.copy()) for a in args if isinstance(a, np.ndarray)]

    def unchanged(self, *, but=()):
        for a, before in self.items:
            if any(a is b for b in but):
                continue
            assert a.tobytes() == before.tobytes(), "an argument was written"


def _same_bits(got, expect):
    expect = np.asarray(expect)
    assert type(got) is np.ndarray or isinstance(got, np.ndarray)
    assert got.shape == expect.shape and got.dtype == expect.dtype, (got.shape, expect.shape)
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(expect).tobytes()


def _fresh(got, *inputs):
    assert type(got) is np.ndarray
    assert got.flags.c_contiguous and got.flags.writeable and got.flags.aligned
    for a in inputs:
        if isinstance(a, np.ndarray):
            assert not np.shares_memory(got, a)


def _declined(result, snap):
    assert result is None, "the entry took arguments it must decline"
    snap.unchanged()


# ----------------------------------------------------------- argument strategies


def _values(dtype, n_rows, plain=False):
    """Positions for a table of n_rows: mostly valid, sometimes at or beyond the
    edges (never if `plain`)."""
    info = np.iinfo(dtype)
    edges = [-n_rows, -n_rows - 1, n_rows - 1, n_rows, 0, -1, 2**63 - 1, 2**64 - 1, -(2**63)]
    if plain:
        edges = [-n_rows, n_rows - 1]
    edges = [e for e in edges if info.min <= e <= info.max]
    lo, hi = max(int(info.min), -n_rows), min(int(info.max), n_rows - 1)
    inside = st.integers(lo, hi)
    return st.one_of(inside, inside, inside, inside, inside, st.sampled_from(edges))


@st.composite
def int_scalars(draw, n_rows, plain=False):
    """A Python int or a NumPy integer scalar of any width."""
    kind = draw(st.sampled_from([int, *INT_TYPES]))
    if kind is int:
        if plain:
            return draw(_values(np.int64, n_rows, plain))
        extra = st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, -(2**63) - 1, 2**70])
        return draw(st.one_of(_values(np.int64, n_rows), extra))
    return kind(draw(_values(kind, n_rows, plain)))


ODD_LEAVES = [True, False, np.True_, 1.0, np.float64(1), None, "1", (1,), _Pos.THREE, np.array(1)]


def _nest(leaves, shape):
    if not shape:
        return leaves[0]
    if len(shape) == 1:
        return list(leaves)
    step = len(leaves) // shape[0] if shape[0] else 0
    return [_nest(leaves[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


@st.composite
def positions_of(draw, shape, n_rows, plain=False):
    """Positions with the logical shape `shape`, in every form a caller may pass."""
    shape = tuple(shape)
    kind = draw(st.sampled_from(["array", "list"] + (["scalar"] if not shape else [])))
    size = int(np.prod(shape))
    if kind == "scalar":
        return draw(int_scalars(n_rows, plain))
    if kind == "list":
        leaves = draw(st.lists(int_scalars(n_rows, plain), min_size=size, max_size=size))
        if not shape:
            return leaves[0]
        nested = _nest(leaves, shape)
        spoil = _pick(draw, [None], ["leaf", "ragged", "tuple"], 0.2, plain=plain)
        if spoil == "leaf" and size:
            flat = list(leaves)
            flat[draw(st.integers(0, size - 1))] = draw(st.sampled_from(ODD_LEAVES))
            nested = _nest(flat, shape)
        elif spoil == "ragged" and size and len(shape) >= 2 and shape[0] >= 2:
            nested[-1] = nested[-1][:-1]
        elif spoil == "tuple":
            nested = tuple(nested)
        return nested
    dtype = draw(st.sampled_from(INT_DTYPES))
    arr = draw(hnp.arrays(dtype, shape, elements=_values(dtype, n_rows, plain)))
    layout = _pick(
        draw,
        ["c", "reversed", "strided", "transposed", "broadcast", "unaligned", "readonly"],
        ["swapped", "subclass", "bool", "float", "timedelta"],
        0.2,
        plain=plain,
    )
    if layout == "reversed" and arr.ndim:
        flip = (slice(None, None, -1),) * arr.ndim  # negative strides on every axis
        arr = np.ascontiguousarray(arr[flip])[flip]
    elif layout == "strided" and arr.ndim:
        arr = np.repeat(arr, 3, axis=-1)[..., ::3]
    elif layout == "transposed" and arr.ndim >= 2:
        arr = np.ascontiguousarray(arr.T).T
    elif layout == "broadcast" and arr.ndim and arr.size:
        arr = np.broadcast_to(arr[..., :1], arr.shape)
    elif layout == "unaligned":
        raw = np.zeros(arr.nbytes + 1, np.uint8)[1:]
        arr = raw.view(arr.dtype).reshape(arr.shape) if arr.size else arr
        arr[...] = draw(hnp.arrays(dtype, shape, elements=_values(dtype, n_rows, plain)))
    elif layout == "readonly":
        arr.flags.writeable = False
    elif layout == "swapped" and dtype.itemsize > 1:
        arr = arr.astype(dtype.newbyteorder())
    elif layout == "subclass":
        arr = arr.view(_Sub)
    elif layout == "bool":
        arr = arr.astype(bool)
    elif layout == "float":
        arr = arr.astype(np.float64)
    elif layout == "timedelta":
        arr = (arr % max(n_rows, 1)).astype("m8[s]")
    return arr


@st.composite
def any_positions(draw, n_rows, plain=False):
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    odd = st.sampled_from([None, slice(0, 2), Ellipsis, (1, 0), "1", 1.0, True, np.True_])
    if not plain and draw(st.integers(0, 9)) == 9:
        return draw(odd)
    return draw(positions_of(shape, n_rows, plain))


PLAIN_THREADS = st.none() | st.integers(1, 5) | st.sampled_from([np.int64(2), np.uint8(3), 2**70])
THREADS = st.integers(0, 9).flatmap(
    lambda k: (
        st.none()
        if k < 4
        else st.integers(1, 5)
        if k < 8
        else st.sampled_from([np.int64(2), np.uint8(3), 2**70, 0, -1, True, 2.0, -(2**70), "2"])
    )
)


def _array_form(a, kind):
    """Array `a` in the form `kind` names, or `a` itself for any other kind.

    The forms an array argument can take besides plain: another float dtype,
    float16, int, byte-swapped, strided along the last axis, a subclass,
    unaligned, read only, a list. Which of them an entry must decline
    depends on the argument (a read-only input is fine, a read-only output
    or gradient table is not)."""
    if kind == "dtype":
        return a.astype(np.float64 if a.dtype == np.float32 else np.float32)
    if kind == "float16":
        return a.astype(np.float16)
    if kind == "int":
        return a.astype(np.int64)
    if kind == "swapped":
        return a.astype(a.dtype.newbyteorder())
    if kind == "strided":
        return np.repeat(a, 2, axis=-1)[..., ::2]
    if kind == "subclass":
        return a.view(_Sub)
    if kind == "unaligned" and a.size:
        raw = np.zeros(a.nbytes + 1, np.uint8)[1:]
        out = raw.view(a.dtype).reshape(a.shape)
        out[...] = a
        return out
    if kind == "readonly":
        a.flags.writeable = False
    if kind == "list":
        return a.tolist()
    return a


def _table_variant(draw, base, plain=False):
    """`base` as a table argument: plain (mostly) or in a form to be declined."""
    rare = ["swapped", "fortran", "strided", "subclass", "float16", "int", "1d", "3d"]
    kind = _pick(draw, ["plain"], rare + ["unaligned", "list", "readonly"], plain=plain)
    if kind == "fortran":
        return np.asfortranarray(base)
    if kind == "1d":
        return base.reshape(-1)
    if kind == "3d":
        return base[None]
    return _array_form(base, kind)


def _rng(seed):
    return np.random.default_rng(seed)


def _pick(draw, common, rare, p_rare=0.25, *, plain=False):
    """One of `common`, or (with probability about p_rare, never if `plain`)
    one of `rare`; shrinks towards common[0]."""
    if plain or draw(st.integers(0, 99)) < 100 * (1 - p_rare):
        return draw(st.sampled_from(common))
    return draw(st.sampled_from(rare))


# ------------------------------------------------------------------ lookup


@given(data=st.data())
def test_lookup_entry_accepts_exactly_the_plain_case(data):
    plain = data.draw(st.booleans(), label="plain")
    L = data.draw(st.integers(1, 12), label="L")
    d = data.draw(st.integers(0, 9), label="d")
    dtype = data.draw(st.sampled_from(FLOATS))
    table = _table_variant(data.draw, _rng(L * d).standard_normal((L, d)).astype(dtype), plain)
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
        out = np.full(out_shape, -7, dtype)
    elif out_kind == "dtype":
        out = np.zeros(out_shape, np.float64 if dtype == np.float32 else np.float32)
    elif out_kind == "shape":
        out = np.zeros(out_shape[:-1] + (d + 1,), dtype)
    elif out_kind == "strided":
        out = np.zeros(out_shape[:-1] + (2 * d + 2,), dtype)[..., ::2][..., :d]
        if out.flags.c_contiguous:
            out = None
    elif out_kind == "readonly":
        out = np.zeros(out_shape, dtype)
        out.flags.writeable = False
    elif out_kind == "subclass":
        out = np.zeros(out_shape, dtype).view(_Sub)
    elif out_kind == "unaligned":
        raw = np.zeros(int(np.prod(out_shape)) * dtype.itemsize + 1, np.uint8)[1:]
        out = raw.view(dtype).reshape(out_shape)
    elif out_kind == "swapped":
        out = np.zeros(out_shape, dtype.newbyteorder())
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
                and _apart(out, table)
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


@pytest.mark.parametrize(
    "table",
    [
        np.ones((12, 5), np.float32)[:, ::2],
        np.asfortranarray(np.ones((12, 5))),
        np.ones((12, 5), ">f4"),
        np.ones((12, 5), np.float16),
        np.ones((12, 5), np.int64),
        np.ones((12, 5), np.float32)[0],
        np.ones((12, 5), np.float32)[None],
        np.ones((12, 5), np.float32).tolist(),
        np.ones((12, 5), np.float32).view(_Sub),
        np.frombuffer(bytearray(1 + 12 * 5 * 8), np.float64, offset=1).reshape(12, 5),
        np.ma.masked_array(np.ones((12, 5), np.float32)),
    ],
    ids=lambda t: f"{type(t).__name__}",
)
def test_entries_take_only_plain_tables(table):
    tok = np.ones((1, 2, 5), np.float32)
    for call in (
        lambda: _core.lookup(table, 1, None, None),
        lambda: _core.lookup(table, [1, 2], None, 1),
        lambda: _core.add(tok, table, None, 0, None, None),
        lambda: _core.scatter_add(table, tok, None, 0, None),
        lambda: _core.sgd_step(table, np.ones((12, 5), np.float32), None, 0.5, -1),
    ):
        snap = Snapshot(table, tok)
        _declined(call(), snap)
    # ...and the functions serve every float table all the same (a byte-misaligned
    # one: see test_misaligned_inputs_through_the_public_functions).
    if (
        type(table) is not np.ma.MaskedArray
        and np.ndim(table) == 2
        and np.asarray(table).dtype.kind == "f"
        and np.asarray(table).dtype.itemsize >= 4
        and np.asarray(table).flags.aligned
    ):
        expect = np.asarray(table)[[1, -2]]
        got = cposembed.lookup(table, [1, -2])
        assert np.array_equal(got, expect) and got.dtype == expect.dtype.newbyteorder("=")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "kind",
    [
        "plain",
        "dtype",
        "float16",
        "int",
        "swapped",
        "strided",
        "subclass",
        "unaligned",
        "readonly",
        "list",
    ],
)
def test_contract_checkers_agree_with_the_oracle(dtype, kind):
    # _core.is_plain / _core.apart are what the Python layer asks; this file's
    # own _plain / _apart stay the independent statement of the rule.
    a = _array_form(np.arange(24, dtype=dtype).reshape(4, 6), kind)
    writable = isinstance(a, np.ndarray) and a.flags.writeable
    assert _core.is_plain(a, dtype) == _plain(a, dtype)
    assert _core.is_plain(a, dtype, writable=True) == (_plain(a, dtype) and writable)
    flat = np.zeros(10, dtype)
    for x, y in [(flat[:5], flat[5:]), (flat[:6], flat[5:]), (flat[:0], flat), (flat, flat)]:
        assert _core.apart(x, y) == _apart(x, y)
    # Not C-contiguous, or not an exact ndarray: "may meet".
    assert not _core.apart(flat[::2], flat[1::2]) and not _core.apart(flat.view(_Sub), flat[:0])


def test_entries_at_the_table_edge_sizes():
    empty_rows = np.zeros((0, 3), np.float32)
    _same_bits(_core.lookup(empty_rows, [], None, None), np.zeros((0, 3), np.float32))
    _same_bits(
        _core.lookup(empty_rows, np.zeros(0, np.int8), None, 2), np.zeros((0, 3), np.float32)
    )
    assert _core.lookup(empty_rows, 0, None, None) is None
    assert _core.lookup(empty_rows, [-1], None, None) is None
    no_cols = np.zeros((4, 0), np.float64)
    _same_bits(_core.lookup(no_cols, [1, -4], None, None), np.zeros((2, 0)))
    assert _core.lookup(no_cols, 4, None, None) is None
    tok = np.zeros((2, 3, 0))
    _same_bits(_core.add(tok, no_cols, None, 1, None, None), tok)
    grad = np.zeros((4, 0))
    assert _core.scatter_add(grad, tok, [0, 3, -4], 0, None) is grad
    assert _core.sgd_step(no_cols, grad, None, 1.0, -1) is True


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


def test_bad_num_threads_is_declined_then_worded():
    table = np.ones((8, 4), np.float32)
    out = np.zeros((2, 4), np.float32)
    tok = np.ones((1, 2, 4), np.float32)
    for bad in (0, -2, True, 2.0, "2", -(2**70), np.bool_(True)):
        snap = Snapshot(table, out, tok)
        _declined(_core.lookup(table, np.array([0, 1]), out, bad), snap)
        _declined(_core.add(tok, table, None, 0, None, bad), snap)
        _declined(_core.scatter_add(out, tok, None, 0, bad), snap)
        _declined(_core.sgd_step(table, out.repeat(4, 0), None, 1.0, -1, bad), snap)
        with pytest.raises((TypeError, ValueError), match="num_threads"):
            cposembed.lookup(table, np.array([0, 1]), out=out, num_threads=bad)
        with pytest.raises((TypeError, ValueError), match="num_threads"):
            cposembed.add_positions(tok, table, num_threads=bad)
        with pytest.raises((TypeError, ValueError), match="num_threads"):
            cposembed.scatter_add(out, tok, num_threads=bad)
        snap.unchanged()


def test_explicit_num_threads_is_capped_at_four_times_the_cpus():
    cap = 4 * CPUS if _core.openmp_enabled() else 1
    work = 1 << 30
    for asked, team in ((1, 1), (cap, cap), (cap + 1, cap), (2**31, cap), (2**70, cap)):
        assert _core.team(asked, work, work) == team
        assert _core.team(np.uint64(asked) if asked < 2**64 else asked, work, work) == team
    assert _core.team(None, 10, 10) == 1  # small work: one thread
    assert _core.team(2, work, 1) == 1  # one chunk: one thread
    for bad in (0, -1, True, 2.0, "3", -(2**70)):
        assert _core.team(bad, work, work) == 0
    table = np.ones((64, 1024), np.float32)
    with tuned(serial_below=0):
        _core.lookup(table, np.arange(64), None, 2**40)
        assert _core.last_team() == min(cap, 64)


# -------------------------------------------------------------------- add


def _lead_and_positions(data, n_rows, plain=False):
    """A lead shape (..., T) for rows and positions for it (None or explicit),
    with the expected int64 positions (None: the entry must decline) and offset."""
    lead = data.draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4), label="lead")
    if data.draw(st.booleans()):
        rare = [HUGE, HUGE + 1, 2**70, -1, n_rows + 1, True, 1.0, None, np.int64(1), np.uint8(0)]
        offset = _pick(data.draw, list(range(n_rows + 1)), rare, 0.2, plain=plain)
        return lead, None, offset
    shape_kind = _pick(
        data.draw, ["full", "suffix", "ones"], ["broadcast", "other"], 0.2, plain=plain
    )
    if shape_kind == "full":
        shape = lead
    elif shape_kind == "suffix":
        shape = lead[data.draw(st.integers(0, len(lead))) :]
    elif shape_kind == "ones":
        suffix = lead[data.draw(st.integers(0, len(lead))) :]
        shape = (1,) * data.draw(st.integers(0, len(lead) - len(suffix))) + suffix
    elif shape_kind == "broadcast" and lead:
        shape = list(lead)
        shape[data.draw(st.integers(0, len(lead) - 1))] = 1
        shape = tuple(shape)
    else:
        shape = data.draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    # More axes than the rows have (leading 1s): see test_entries_decline_positions_with_more_axes.
    assume(len(shape) <= len(lead) or not _period_ok(shape, lead))
    positions = data.draw(positions_of(shape, n_rows, plain), label="positions")
    offset = _pick(data.draw, [0, np.int64(0)], [1, False, 0.0], 0.1, plain=plain)
    return lead, positions, offset


def _default_rows(lead, offset, n_rows):
    """offset + arange(T) if the entry must take it, else None."""
    if not lead or not _is_int(offset):
        return None
    T = lead[-1]
    hi = n_rows - T if T else HUGE
    return np.arange(int(offset), int(offset) + T) if 0 <= int(offset) <= hi else None


def _explicit_rows(positions, offset, lead, n_rows):
    if not (_is_int(offset) and int(offset) == 0):
        return None
    rows = _rows(positions, n_rows)
    if rows is None or not _period_ok(rows.shape, lead):
        return None
    return rows


@given(data=st.data())
def test_add_entry_accepts_exactly_the_plain_case(data):
    plain = data.draw(st.booleans(), label="plain")
    L = data.draw(st.integers(1, 10), label="L")
    d = data.draw(st.integers(0, 7), label="d")
    dtype = data.draw(st.sampled_from(FLOATS))
    rng = _rng(L * 10 + d)
    table = _table_variant(data.draw, rng.standard_normal((L, d)).astype(dtype), plain)
    lead, positions, offset = _lead_and_positions(data, L, plain)
    tok = rng.standard_normal(lead + (d,)).astype(dtype)
    tok_kind = _pick(
        data.draw,
        ["plain"],
        ["dtype", "float16", "int", "swapped", "strided", "subclass", "unaligned", "readonly"]
        + ["list", "wrong_d", "on_table"],
        plain=plain,
    )
    if tok_kind == "wrong_d":
        tok = np.ones(lead + (d + 1,), dtype)
    elif tok_kind == "on_table" and _plain_table(table) and tok.size:
        # Tokens that are the table's own memory: read only, so that is fine...
        buf = np.zeros(table.size + tok.size, dtype)
        buf[...] = rng.standard_normal(buf.size)
        table = buf[: table.size].reshape(table.shape)
        tok = buf[data.draw(st.integers(0, table.size)) :][: tok.size].reshape(tok.shape)
    else:
        tok = _array_form(tok, tok_kind)
    out_kind = _pick(
        data.draw,
        ["none", "plain", "tokens"],
        ["dtype", "shape", "readonly", "strided", "subclass", "on_tokens", "on_table"],
        plain=plain,
    )
    shape = np.shape(tok)
    out = None
    if out_kind == "plain":
        out = np.full(shape, -3, dtype)
    elif out_kind == "tokens":
        out = tok
    elif out_kind == "dtype":
        out = np.zeros(shape, np.float64 if dtype == np.float32 else np.float32)
    elif out_kind == "shape":
        out = np.zeros(shape + (1,), dtype)
    elif out_kind == "readonly":
        out = np.zeros(shape, dtype)
        out.flags.writeable = False
    elif out_kind == "strided" and len(shape) >= 1:
        out = np.zeros(shape[:-1] + (2 * shape[-1],), dtype)[..., ::2]
    elif out_kind == "subclass":
        out = np.zeros(shape, dtype).view(_Sub)
    elif out_kind in ("on_tokens", "on_table") and _plain(tok, dtype) and tok.size:
        # ...but no output may share memory with what the call reads.
        host = tok if out_kind == "on_tokens" else table
        if isinstance(host, np.ndarray) and host.size and _plain(host):
            buf = np.zeros(host.size + tok.size, dtype)
            view = buf[: host.size].reshape(host.shape)
            view[...] = host
            if out_kind == "on_tokens":
                tok = view
            else:
                table = view
            start = data.draw(st.integers(0, host.size - 1))
            out = buf[start : start + tok.size].reshape(tok.shape)
    num_threads = data.draw(PLAIN_THREADS if plain else THREADS, label="num_threads")
    serial_below = data.draw(st.sampled_from([None, 0]))

    if positions is None:
        rows = _default_rows(lead, offset, L) if _plain_table(table) else None
    else:
        rows = _explicit_rows(positions, offset, lead, L) if _plain_table(table) else None
    in_place = out is tok
    accept = (
        rows is not None
        and _plain(tok, table.dtype)
        and tok.ndim >= 1
        and tok.shape[-1] == d
        and _threads_ok(num_threads)
        and (
            out is None
            or (in_place and tok.flags.writeable and _apart(tok, table))
            or (
                not in_place
                and _plain(out, table.dtype)
                and out.flags.writeable
                and out.shape == tok.shape
                and _apart(out, table)
                and _apart(out, tok)
            )
        )
    )
    expect = None
    if accept:
        expect = tok + table[rows]
    event("accepted" if accept else "declined")
    snap = Snapshot(table, tok, positions, out)
    with tuned(serial_below=serial_below):
        team = 0
        if accept:
            n = int(np.prod(lead))
            team = _expected_team(num_threads, n * d, n)
            _mark_team(avoid=team)
        result = _core.add(tok, table, positions, offset, out, num_threads)
        if not accept:
            _declined(result, snap)
            return
        assert result is not None, "the entry declined a plain call"
        assert _core.last_team() == team
    snap.unchanged(but=(out,))
    _same_bits(result, expect)
    if out is None:
        _fresh(result, table, tok)
    else:
        assert result is out


@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data())
def test_add_entry_special_values_and_decode_steps(dtype, data):
    L, D = 12, 5
    table = _rng(0).standard_normal((L, D)).astype(dtype)
    table[0, 0] = -0.0
    table[1, :] = [np.inf, -np.inf, np.nan, 0.0, np.finfo(dtype).tiny / 4]
    shapes = [(1, 1, D), (2, 3, D), (5, D), (4, 1, D), (1, 0, D), (0, 2, D), (2, 1, 1, D)]
    shapes.append(data.draw(hnp.array_shapes(min_dims=2, max_dims=4, max_side=4))[:-1] + (D,))
    for shape in shapes:
        floats = st.floats(width=dtype.itemsize * 8)
        tok = data.draw(hnp.arrays(dtype, shape, elements=floats))
        T = shape[-2]
        for offset in (0, 1, L - T, HUGE if T == 0 else L - T):
            with np.errstate(invalid="ignore", over="ignore"):  # inf - inf
                expect = tok + table[offset : offset + T]
            got = _core.add(tok, table, None, offset, None, None)
            assert got.dtype == expect.dtype and got.shape == expect.shape
            assert np.array_equal(got, expect, equal_nan=True)
            nan = np.isnan(expect)
            _same_bits(got[~nan], expect[~nan])  # NaN payloads may differ by operand order
            _fresh(got, tok, table)
            if T and offset + T <= L:  # the class's decode step: the same entry
                pe = cposembed.LearnedPositionEmbedding.from_pretrained(table, dtype=dtype)
                assert np.array_equal(pe.add_to(tok, offset=offset), expect, equal_nan=True)
        bad = (-1, HUGE + 1, 2**70, -(2**70), True, 0.0, None, np.float64(0), np.bool_(False))
        for bad_offset in bad + ((L - T + 1,) if T else ()):
            snap = Snapshot(tok, table)
            _declined(_core.add(tok, table, None, bad_offset, None, None), snap)


@pytest.mark.parametrize("dtype", FLOATS)
def test_add_in_place_through_the_entry(dtype):
    rng = _rng(3)
    table = rng.standard_normal((64, 32)).astype(dtype)
    tok = rng.standard_normal((8, 40, 32)).astype(dtype)
    expect = tok + table[5:45]
    got = cposembed.add_positions(tok, table, offset=5, out=tok)
    assert got is tok
    _same_bits(tok, expect)
    tok = rng.standard_normal((8, 40, 32)).astype(dtype)
    pos = rng.integers(-64, 64, size=40).astype(np.int16)
    expect = tok + table[pos]
    assert _core.add(tok, table, pos, 0, tok, 2) is tok
    _same_bits(tok, expect)


# ------------------------------------------------------------ scatter-add


def _scatter_expect(grad, g, rows, touched, skip_row):
    grad = grad.copy()
    idx = np.broadcast_to(rows, g.shape[:-1])
    np.add.at(grad, idx, g)
    marks = None if touched is None else touched.copy()
    if marks is not None and idx.size:
        marks[idx.reshape(-1) % grad.shape[0]] = True
    if skip_row >= 0:
        grad[skip_row] = 0
        if marks is not None:
            marks[skip_row] = False
    return grad, marks


PLANS = [_core.PLAN_AUTO, _core.PLAN_DISTINCT, _core.PLAN_SCAN, _core.PLAN_SORT]


@given(data=st.data())
def test_scatter_entry_accepts_exactly_the_plain_case(data):
    plain = data.draw(st.booleans(), label="plain")
    L = data.draw(st.integers(1, 10), label="L")
    d = data.draw(st.integers(0, 7), label="d")
    dtype = data.draw(st.sampled_from(FLOATS))
    rng = _rng(L * 10 + d)
    grad = _table_variant(data.draw, rng.standard_normal((L, d)).astype(dtype), plain)
    lead, positions, offset = _lead_and_positions(data, L, plain)
    g = rng.standard_normal(lead + (d,)).astype(dtype)
    g_kind = _pick(
        data.draw,
        ["plain"],
        ["dtype", "swapped", "strided", "subclass", "list", "wrong_d", "readonly", "on_grad"]
        + ["unaligned"],
        plain=plain,
    )
    if g_kind == "wrong_d":
        g = np.ones(lead + (d + 1,), dtype)
    elif g_kind == "on_grad" and _plain_table(grad) and grad.size and g.size:
        buf = rng.standard_normal(grad.size + g.size).astype(dtype)
        grad = buf[: grad.size].reshape(grad.shape)
        start = data.draw(st.integers(0, grad.size - 1))
        g = buf[start : start + g.size].reshape(g.shape)
    else:
        g = _array_form(g, g_kind)  # read only is fine for g
    touched_kind = _pick(
        data.draw,
        ["none", "plain"],
        ["length", "int8", "strided", "readonly", "on_grad", "2d"],
        plain=plain,
    )
    touched = None
    if touched_kind == "plain":
        touched = rng.random(L) < 0.3
    elif touched_kind == "length":
        touched = np.zeros(L + 1, bool)
    elif touched_kind == "int8":
        touched = np.zeros(L, np.int8)
    elif touched_kind == "strided":
        touched = np.zeros(2 * L, bool)[::2]
    elif touched_kind == "readonly":
        touched = np.zeros(L, bool)
        touched.flags.writeable = False
    elif touched_kind == "on_grad" and _plain_table(grad) and grad.nbytes >= L:
        touched = grad.reshape(-1).view(np.uint8)[:L].view(bool)
    elif touched_kind == "2d":
        touched = np.zeros((L, 1), bool)
    skip_row = _pick(data.draw, [-1, 0, L - 1], [-2, L], 0.1, plain=plain)
    plan = _pick(
        data.draw, PLANS, [4, 2**31 - 1], 0.1, plain=plain
    )  # negative: see test_scatter_entry_declines_negative_plans
    num_threads = data.draw(PLAIN_THREADS if plain else THREADS, label="num_threads")
    serial_below = data.draw(st.sampled_from([None, 0]))
    scan_block = data.draw(st.sampled_from([None, 8, 64]))

    grad_ok = _plain_table(grad) and grad.flags.writeable
    if not grad_ok:
        rows = None
    elif positions is None:
        rows = _default_rows(lead, offset, L)
    else:
        rows = _explicit_rows(positions, offset, lead, L)
    accept = (
        rows is not None
        and _plain(g, grad.dtype)
        and g.ndim >= 1
        and g.shape[-1] == d
        and _apart(g, grad)
        and (
            touched is None
            or (
                _plain(touched, np.bool_)
                and touched.ndim == 1
                and touched.shape == (L,)
                and touched.flags.writeable
                and _apart(touched, grad)
            )
        )
        and -1 <= skip_row < L
        and 0 <= plan <= 3
        and _threads_ok(num_threads)
    )
    expect = marks = None
    if accept:
        expect, marks = _scatter_expect(grad, g, rows, touched, skip_row)
    event("accepted" if accept else "declined")
    snap = Snapshot(grad, g, positions, touched)
    with tuned(serial_below=serial_below, scan_block_bytes=scan_block):
        result = _core.scatter_add(grad, g, positions, offset, num_threads, touched, skip_row, plan)
        if not accept:
            _declined(result, snap)
            return
        assert result is grad, "the entry declined a plain call"
        team = _core.last_team()
        # Threads: at most one per table row; the work is the whole gradient.
        n = int(np.prod(lead))
        period = rows.size if rows.ndim < len(lead) else (lead[-1] if lead else 1)
        candidates = {_expected_team(num_threads, n * d, min(L, m)) for m in (rows.size, period, 1)}
        assert team in candidates, (team, candidates)
    snap.unchanged(but=(grad, touched))
    assert np.array_equal(grad, expect, equal_nan=True)
    _same_bits(grad[~np.isnan(expect)], expect[~np.isnan(expect)])
    if touched is not None:
        _same_bits(touched, marks)


@pytest.mark.parametrize("dtype", FLOATS)
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
    index = data.draw(st.sampled_from(INT_DTYPES))
    threads = data.draw(st.integers(1, 4))
    serial_below = data.draw(st.sampled_from([0, None]))
    scan_block = data.draw(st.sampled_from([None, 8, 64, 4096]))
    rng = _rng(data.draw(st.integers(0, 2**16)))
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
    expect, _ = _scatter_expect(grad0, g, pos, None, -1)
    grad = grad0.copy()
    with tuned(serial_below=serial_below, scan_block_bytes=scan_block):
        assert _core.scatter_add(grad, g, positions, offset, threads, None, -1, plan) is grad
        assert 1 <= _core.last_team() <= threads
        if serial_below is None:
            assert _core.last_team() == 1
    _same_bits(grad, expect)


# ---------------------------------------------------------------- sgd_step


@given(data=st.data())
def test_sgd_entry_accepts_exactly_the_plain_case(data):
    plain = data.draw(st.booleans(), label="plain")
    L = data.draw(st.integers(1, 10), label="L")
    d = data.draw(st.integers(0, 7), label="d")
    dtype = data.draw(st.sampled_from(FLOATS))
    rng = _rng(L * 10 + d)
    table = _table_variant(data.draw, rng.standard_normal((L, d)).astype(dtype), plain)
    grad = rng.standard_normal((L, d)).astype(dtype)
    grad_kind = _pick(
        data.draw,
        ["plain"],
        ["dtype", "shape", "strided", "subclass", "on_table", "readonly", "swapped", "list"],
        plain=plain,
    )
    if grad_kind == "shape":
        grad = np.ones((L, d + 1), dtype)
    elif grad_kind == "on_table" and _plain_table(table) and table.size:
        grad = table[...]
    else:
        grad = _array_form(grad, grad_kind)  # read only is fine: the step reads it
    touched_kind = _pick(
        data.draw, ["none", "plain"], ["length", "int8", "strided", "readonly"], plain=plain
    )
    touched = None
    if touched_kind in ("plain", "readonly"):
        touched = rng.random(L) < 0.5
        touched.flags.writeable = touched_kind == "plain"
    elif touched_kind == "length":
        touched = np.ones(L + 1, bool)
    elif touched_kind == "int8":
        touched = np.ones(L, np.int8)
    elif touched_kind == "strided":
        touched = np.ones(2 * L, bool)[::2]
    lr = data.draw(st.floats(-10, 10, allow_nan=False), label="lr")
    skip_row = _pick(data.draw, [-1, 0, L - 1], [-2, L], 0.1, plain=plain)
    num_threads = data.draw(PLAIN_THREADS if plain else THREADS, label="num_threads")
    serial_below = data.draw(st.sampled_from([None, 0]))

    accept = (
        _plain_table(table)
        and table.flags.writeable
        and _plain(grad, table.dtype)
        and grad.shape == table.shape
        and _apart(grad, table)
        and (touched is None or (_plain(touched, np.bool_) and touched.shape == (L,)))
        and -1 <= skip_row < L
        and _threads_ok(num_threads)
    )
    expect = None
    if accept:
        rows = np.flatnonzero(touched) if touched is not None else np.arange(L)
        rows = rows[rows != skip_row]
        expect = table.copy()
        step = dtype.type(lr)
        expect[rows] = expect[rows] - step * grad[rows]
    event("accepted" if accept else "declined")
    snap = Snapshot(table, grad, touched)
    with tuned(serial_below=serial_below):
        result = _core.sgd_step(table, grad, touched, lr, skip_row, num_threads)
        if not accept:
            _declined(result, snap)
            return
        assert result is True
        n = rows.size
        assert _core.last_team() == _expected_team(num_threads, n * d, n)
    snap.unchanged(but=(table,))
    _same_bits(table, expect)


# ------------------------------------------------------------- memory safety


@given(data=st.data())
def test_outputs_may_share_memory_with_the_positions(data):
    """Positions are read into the call's own buffer before anything is written:
    an output over the positions' bytes gets NumPy's result on the positions as
    they were (any layout of either)."""
    op = data.draw(st.sampled_from(["lookup", "add", "scatter"]))
    dtype = data.draw(st.sampled_from(FLOATS))
    index = data.draw(st.sampled_from(INT_DTYPES))
    L = data.draw(st.integers(1, 20))
    d = data.draw(st.integers(1, 6))
    n = data.draw(st.integers(1, 12))
    step = data.draw(st.sampled_from([1, 2, -1, -3]))
    threads = data.draw(st.integers(1, 4))
    rng = _rng(L * 100 + n)
    table = rng.standard_normal((L, d)).astype(dtype)
    out_rows = L if op == "scatter" else n
    out_bytes = out_rows * d * dtype.itemsize
    pos_span = n * abs(step) * index.itemsize
    raw = np.zeros(out_bytes + pos_span + 64, np.uint8)
    out_at = data.draw(st.integers(0, 8)) * dtype.itemsize
    out = raw[out_at : out_at + out_bytes].view(dtype).reshape(out_rows, d)
    # The positions start anywhere inside the output (any byte offset).
    pos_at = data.draw(st.integers(out_at, out_at + out_bytes - 1))
    stride = step * index.itemsize
    first = pos_at if step > 0 else pos_at + (n - 1) * abs(stride)
    positions = np.ndarray((n,), index, buffer=raw, offset=first, strides=(stride,))
    lo = 0 if index.kind == "u" else -L
    values = rng.integers(lo, L, size=n).astype(index)
    positions[...] = values
    assert np.shares_memory(positions, out)
    before = positions.copy()
    if op == "lookup":
        expect = table[before]
        result = _core.lookup(table, positions, out, threads)
    elif op == "add":
        tok = rng.standard_normal((n, d)).astype(dtype)
        expect = tok + table[before]
        result = _core.add(tok, table, positions, 0, out, threads)
    else:
        g = rng.standard_normal((n, d)).astype(dtype)
        expect, _ = _scatter_expect(out, g, before, None, -1)
        result = _core.scatter_add(out, g, positions, 0, threads)
    assert result is out
    assert np.array_equal(out, expect, equal_nan=True)
    _same_bits(out[~np.isnan(expect)], expect[~np.isnan(expect)])


@pytest.mark.parametrize("dtype", FLOATS)
def test_positions_inside_a_public_output_of_another_layout(dtype):
    # The function's own route (out not plain: computed aside, then copied).
    table = _rng(0).standard_normal((12, 4)).astype(dtype)
    raw = np.zeros((8, 4, 2), dtype)
    out = raw[..., 0]  # strided: declined by the entry
    pos = raw.reshape(-1).view(np.int32 if dtype == np.float32 else np.int64)[:16:2]
    pos[...] = [3, -1, 0, 11, 5, 5, -12, 2]
    before = pos.copy()
    assert cposembed.lookup(table, pos, out=out) is out
    _same_bits(out, table[before])


@pytest.mark.parametrize("dtype", FLOATS)
def test_outputs_over_what_a_call_reads_are_declined_and_served_as_numpy(dtype):
    """An output sharing memory with the table, the tokens or the gradient is
    declined by the entry; the function gives NumPy's result (computed on the
    inputs as they were) all the same."""
    rng = _rng(2)
    L, d, n = 10, 6, 8
    table0 = rng.standard_normal((L, d)).astype(dtype)
    pos = rng.integers(-L, L, size=n)
    tok0 = rng.standard_normal((n, d)).astype(dtype)
    for start in (0, 1, 7, L * d - 1, L * d - n * d + 3):
        start = max(0, min(start, L * d - 1))
        # lookup: out over the table
        buf = np.zeros(L * d + n * d, dtype)
        table = buf[: L * d].reshape(L, d)
        table[...] = table0
        out = buf[start : start + n * d].reshape(n, d)
        snap = Snapshot(table, out)
        _declined(_core.lookup(table, pos, out, None), snap)
        assert cposembed.lookup(table, pos, out=out) is out
        _same_bits(out, table0[pos])
        # add: out over the table
        table[...] = table0
        snap = Snapshot(table, out, tok0)
        _declined(_core.add(tok0, table, pos, 0, out, None), snap)
        _declined(_core.add(tok0, table, None, 0, out, 2), snap)
        assert cposembed.add_positions(tok0, table, pos, out=out) is out
        _same_bits(out, tok0 + table0[pos])
        # add in place on tokens that are the table's memory
        table[...] = table0
        if start + n * d <= L * d:
            snap = Snapshot(table, out)
            _declined(_core.add(out, table, pos, 0, out, None), snap)
            tok_before = out.copy()
            cposembed.add_positions(out, table, pos, out=out)
            _same_bits(out, tok_before + table0[pos])
    for shift in (1, d, n * d - 1):
        # add: out over the tokens (not the tokens themselves)
        buf = np.zeros(2 * n * d, dtype)
        tok = buf[: n * d].reshape(n, d)
        tok[...] = tok0
        out = buf[shift : shift + n * d].reshape(n, d)
        snap = Snapshot(tok, out, table0)
        _declined(_core.add(tok, table0, pos, 0, out, None), snap)
        assert cposembed.add_positions(tok, table0, pos, out=out) is out
        _same_bits(out, tok0 + table0[pos])
        # scatter: gradient over the table being accumulated into
        buf = rng.standard_normal(L * d + n * d).astype(dtype)
        grad = buf[: L * d].reshape(L, d)
        g = buf[shift : shift + n * d].reshape(n, d)
        expect, _ = _scatter_expect(grad, g.copy(), pos, None, -1)
        snap = Snapshot(grad, g)
        _declined(_core.scatter_add(grad, g, pos, 0, None), snap)
        assert cposembed.scatter_add(grad, g, pos) is grad
        _same_bits(grad, expect)


_HUGE_SCRIPT = textwrap.dedent(
    """
    import json, numpy as np, cposembed
    from cposembed import _core
    table = np.ones((10, 2), np.float32)
    results = {}
    for shape in [(2**62,), (3, 2**61), (2**58,), (1, 2**62)]:
        for dtype in (np.int8, np.uint8):
            pos = np.broadcast_to(np.zeros((), dtype), shape)
            calls = {
                "core.lookup": lambda: _core.lookup(table, pos, None, None),
                "core.lookup(1)": lambda: _core.lookup(table, pos, None, 1),
                "core.add": lambda: _core.add(np.ones((1, 2), np.float32), table, pos, 0, None, None),
                "core.scatter": lambda: _core.scatter_add(np.zeros((10, 2), np.float32),
                                                          np.ones((1, 2), np.float32), pos, 0, None),
                "lookup": lambda: cposembed.lookup(table, pos),
                "add": lambda: cposembed.add_positions(np.ones((1, 2), np.float32), table, pos),
                "scatter": lambda: cposembed.scatter_add(np.zeros((10, 2), np.float32),
                                                         np.ones((1, 2), np.float32), pos),
                "class": lambda: cposembed.LearnedPositionEmbedding(10, 2, seed=0)(pos),
            }
            for name, call in calls.items():
                try:
                    r = call()
                    outcome = "None" if r is None else "returned"
                except (MemoryError, ValueError) as exc:
                    outcome = type(exc).__name__
                results[f"{name} {shape} {np.dtype(dtype)}"] = outcome
    print(json.dumps(results))
    """
)


def test_huge_broadcast_positions_never_crash():
    """Stride-0 positions of 2**62 elements: MemoryError (no buffer for them can be
    had) or ValueError, from the entries and the public functions alike (a crash
    would kill only the child, and fail here)."""
    res = subprocess.run(
        [sys.executable, "-c", _HUGE_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    results = json.loads(res.stdout)
    assert len(results) == 4 * 2 * 8
    for name, outcome in results.items():
        assert outcome in ("MemoryError", "ValueError"), (name, outcome)


# --------------------------------------------------------- the public route


@pytest.fixture
def entry_calls(monkeypatch):
    """Spies on the four entries: for each, whether each call was accepted."""
    calls: dict[str, list[bool]] = {}
    for name in ("lookup", "add", "scatter_add", "sgd_step"):
        real = getattr(_core, name)
        log = calls.setdefault(name, [])

        def spy(*args, _real=real, _log=log, **kwargs):
            result = _real(*args, **kwargs)
            _log.append(result is not None)
            return result

        monkeypatch.setattr(_core, name, spy)

    def take():
        got = {k: list(v) for k, v in calls.items() if v}
        for v in calls.values():
            v.clear()
        return got

    return take


ONCE = [True]
TWICE = [False, True]
# An `out` the entry cannot write (another layout, or over an input): declined
# as given, declined again when offered after normalising, then the result is
# computed aside and copied in.
ASIDE = [False, False, True]


@pytest.mark.parametrize("dtype", FLOATS)
def test_public_functions_call_each_entry_once_or_twice(entry_calls, dtype):
    rng = _rng(5)
    L, d, B, T = 64, 8, 3, 10
    table = rng.standard_normal((L, d)).astype(dtype)
    pos = rng.integers(-L, L, size=(B, T))
    tok = rng.standard_normal((B, T, d)).astype(dtype)
    other = np.float32 if dtype == np.float64 else np.float64

    def check(call, expect_calls, expect_value):
        got = call()
        assert entry_calls() == expect_calls, call
        if isinstance(expect_value, np.ndarray):
            _same_bits(got, expect_value)

    # lookup: plain forms once; the rest normalised, then accepted
    check(lambda: cposembed.lookup(table, pos), {"lookup": ONCE}, table[pos])
    check(lambda: cposembed.lookup(table, pos.tolist()), {"lookup": ONCE}, table[pos])
    check(lambda: cposembed.lookup(table, 3), {"lookup": ONCE}, table[3])
    check(
        lambda: cposembed.lookup(table, pos.astype(np.uint16) % L), {"lookup": ONCE}, table[pos % L]
    )
    check(lambda: cposembed.lookup(table, pos.T, num_threads=2), {"lookup": ONCE}, table[pos.T])
    out = np.empty((B, T, d), dtype)
    check(lambda: cposembed.lookup(table, pos, out=out), {"lookup": ONCE}, table[pos])
    check(lambda: cposembed.lookup(table, pos.astype(">i8")), {"lookup": TWICE}, table[pos])
    check(lambda: cposembed.lookup(np.asfortranarray(table), pos), {"lookup": TWICE}, table[pos])
    check(lambda: cposembed.lookup(table.astype(other), pos), {"lookup": ONCE}, None)
    with pytest.raises(TypeError):
        cposembed.lookup(table.astype(np.float16), pos)
    assert entry_calls() == {"lookup": [False]}
    check(lambda: cposembed.lookup(table, [True, False] * 32), {"lookup": TWICE}, table[::2])
    check(lambda: cposembed.lookup(table, slice(2, 5)), {"lookup": TWICE}, table[2:5])
    check(lambda: cposembed.lookup(table, np.int64(-1)), {"lookup": ONCE}, table[-1])
    fortran_out = np.empty((T, B, d), dtype, order="F").transpose(1, 0, 2)
    check(lambda: cposembed.lookup(table, pos, out=fortran_out), {"lookup": ASIDE}, table[pos])
    on_table = np.zeros(L * d + 8, dtype)
    t_view = on_table[: L * d].reshape(L, d)
    t_view[...] = table
    check(
        lambda: cposembed.lookup(t_view, pos[0], out=on_table[8 : 8 + T * d].reshape(T, d)),
        {"lookup": ASIDE},
        table[pos[0]],
    )
    check(lambda: cposembed.lookup(table, (slice(None), 0)), {"lookup": [False]}, table[:, 0])
    with pytest.raises(IndexError):
        cposembed.lookup(table, [L])
    assert entry_calls() == {"lookup": [False]}
    with pytest.raises(ValueError):
        cposembed.lookup(table, pos, num_threads=0)
    assert entry_calls() == {"lookup": [False]}

    # add
    check(lambda: cposembed.add_positions(tok, table), {"add": ONCE}, tok + table[:T])
    check(
        lambda: cposembed.add_positions(tok, table, offset=4), {"add": ONCE}, tok + table[4 : 4 + T]
    )
    check(lambda: cposembed.add_positions(tok, table, pos), {"add": ONCE}, tok + table[pos])
    check(lambda: cposembed.add_positions(tok, table, pos[0]), {"add": ONCE}, tok + table[pos[0]])
    check(
        lambda: cposembed.add_positions(tok, table, pos[:, :1]),
        {"add": TWICE},
        tok + table[pos[:, :1]],
    )
    check(
        lambda: cposembed.add_positions(tok[:, ::-1], table),
        {"add": TWICE},
        tok[:, ::-1] + table[:T],
    )
    swapped = tok.astype(tok.dtype.newbyteorder())
    check(lambda: cposembed.add_positions(swapped, table), {"add": TWICE}, tok + table[:T])
    # float32 table, float64 tokens: NumPy's promoting add; the other way round
    # the tokens are converted to the table's dtype.
    promote = {"add": [False]} if dtype == np.float32 else {"add": TWICE}
    check(
        lambda: cposembed.add_positions(tok.astype(other), table),
        promote,
        tok.astype(other) + table[:T],
    )
    tok_copy = tok.copy()
    check(
        lambda: cposembed.add_positions(tok_copy, table, out=tok_copy),
        {"add": ONCE},
        tok + table[:T],
    )
    buf = np.zeros(tok.size + d, dtype)
    t_in = buf[: tok.size].reshape(tok.shape)
    t_in[...] = tok
    check(
        lambda: cposembed.add_positions(t_in, table, out=buf[d:].reshape(tok.shape)),
        {"add": ASIDE},
        tok + table[:T],
    )
    with pytest.raises(IndexError):
        cposembed.add_positions(tok, table, offset=L - T + 1)
    assert entry_calls() == {"add": [False]}

    # scatter_add
    def added(g, p):
        want = np.zeros((L, d), dtype)
        np.add.at(want, p, np.asarray(g, dtype))
        return want

    fortran = np.zeros((L, d), dtype, order="F")
    for call, calls, expect in [
        (lambda: cposembed.scatter_add(np.zeros((L, d), dtype), tok, pos), ONCE, added(tok, pos)),
        (
            lambda: cposembed.scatter_add(np.zeros((L, d), dtype), tok, pos.tolist()),
            ONCE,
            added(tok, pos),
        ),
        (
            lambda: cposembed.scatter_add(np.zeros((L, d), dtype), tok),
            ONCE,
            added(tok, np.broadcast_to(np.arange(T), (B, T))),
        ),
        (
            lambda: cposembed.scatter_add(np.zeros((L, d), dtype), tok.astype(other), pos),
            TWICE,
            added(tok.astype(other), pos),
        ),
        (lambda: cposembed.scatter_add(fortran, tok, pos), TWICE, added(tok, pos)),
        (
            lambda: cposembed.scatter_add(np.zeros((L, d), dtype), tok[:, ::-1], pos[:, ::-1]),
            TWICE,
            added(tok[:, ::-1], pos[:, ::-1]),
        ),
        (
            lambda: cposembed.scatter_add(np.zeros((L, d), dtype), tok, pos[:, :1]),
            TWICE,
            added(tok, np.broadcast_to(pos[:, :1], (B, T))),
        ),
    ]:
        check(call, {"scatter_add": calls}, expect)

    # the class: lookup, backward and sgd_step
    pe = cposembed.LearnedPositionEmbedding.from_pretrained(table, dtype=dtype)
    # (pe(...) enters the lookup entry from C, unseen by the spy; what it
    # declines is normalised and offered again through cposembed._core.lookup.)
    check(lambda: pe(pos), {}, table[pos])
    check(lambda: pe(pos.astype(">i4")), {"lookup": ONCE}, table[pos])
    pe.backward(tok, pos)
    pe.sgd_step(0.5)
    assert entry_calls() == {"scatter_add": ONCE, "sgd_step": ONCE}
    _same_bits(pe.embeddings, table - dtype.type(0.5) * added(tok, pos))
    pe.grad = pe.grad.astype(other)  # another dtype: NumPy's arithmetic, same rule
    expect = pe.embeddings.copy()
    expect -= 0.25 * pe.grad
    pe.sgd_step(0.25)
    assert entry_calls() == {"sgd_step": [False]}
    _same_bits(pe.embeddings, expect)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("threads", [None, 1, 2, 3])
def test_plain_calls_above_the_serial_threshold_take_one_entry_call(entry_calls, dtype, threads):
    rng = _rng(5)
    L, d, B, T = 256, 48, 8, 200
    assert B * T * d > _core.SERIAL_THRESHOLD
    table = rng.standard_normal((L, d)).astype(dtype)
    pos = rng.integers(-L, L, size=(B, T))
    out = np.empty((B, T, d), dtype)
    assert cposembed.lookup(table, pos, out=out, num_threads=threads) is out
    _same_bits(out, table[pos])
    tok = rng.standard_normal((B, T, d)).astype(dtype)
    got = cposembed.add_positions(tok, table, offset=3, out=out, num_threads=threads)
    assert got is out
    _same_bits(out, tok + table[3 : 3 + T])
    for positions in (None, pos, np.tile(np.arange(T), (B, 1))):
        grad = np.zeros((L, d), dtype)
        rows = np.arange(T) if positions is None else positions
        want, _ = _scatter_expect(grad, tok, rows, None, -1)
        cposembed.scatter_add(grad, tok, positions, num_threads=threads)
        _same_bits(grad, want)
    assert entry_calls() == {"lookup": ONCE, "add": ONCE, "scatter_add": ONCE * 3}


def test_class_calls_go_straight_to_the_lookup_entry(monkeypatch):
    """Tiny calls never reach the normalising route (broken here on purpose)."""

    def broken(*args, **kwargs):
        raise AssertionError("normalised")

    monkeypatch.setattr(_routes, "lookup", broken)
    pe = cposembed.LearnedPositionEmbedding(128, 64, seed=0)
    table = pe.embeddings
    a4 = _rng(1).integers(0, 128, size=(4, 128))
    for pos in (5, -1, np.int16(7), [0], [[1, np.int8(-2)]], np.arange(10), a4, np.array(3)):
        _same_bits(pe(pos), table[np.asarray(pos, np.int64)])
    out = np.empty(64, np.float32)
    assert pe(5, out=out) is out and np.array_equal(out, table[5])
    for other in (
        lambda: pe(128),
        lambda: pe(True),
        lambda: pe([1.0]),
        lambda: pe(5, out=np.empty(64)),
    ):
        with pytest.raises(AssertionError, match="normalised"):
            other()


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


# ----------------------------------------------- regressions found by these tests


def test_entries_decline_positions_with_more_axes_than_the_rows():
    table = np.arange(20, dtype=np.float32).reshape(10, 2)
    tok = np.zeros((3, 2), np.float32)
    pos = np.zeros((1, 1, 3), np.int64)
    with pytest.raises(ValueError, match="broadcast"):
        cposembed.add_positions(tok.astype(np.float64), table, pos)
    assert _core.add(tok, table, pos, 0, None, None) is None
    assert _core.scatter_add(np.zeros((10, 2), np.float32), tok, pos, 0, None) is None
    with pytest.raises(ValueError, match="broadcast"):
        cposembed.add_positions(tok, table, pos)


def test_empty_arrays_inside_the_table_give_numpys_result():
    t = np.ones((4, 3), np.float32)
    empty = t[1:][:0]  # shape (0, 3), data pointer 12 bytes into the table
    assert cposembed.lookup(t, [], out=empty) is empty
    cposembed.add_positions(empty, t, np.zeros(0, int), out=empty)
    cposembed.add_positions(np.zeros((0, 3), np.float32), t, np.zeros(0, int), out=empty)
    cposembed.scatter_add(t, empty, np.zeros(0, int))
    cposembed.scatter_add(t, empty.reshape(1, 0, 3))
    assert np.all(t == 1)


@pytest.mark.parametrize(
    "which", ["lookup-table", "add-table", "add-tokens", "scatter-grad_output", "scatter-grad"]
)
def test_misaligned_inputs_through_the_public_functions(which):
    def misaligned(a):
        raw = np.zeros(a.nbytes + 1, np.uint8)[1:]
        out = raw.view(a.dtype).reshape(a.shape)
        out[...] = a
        return out

    table = _rng(0).standard_normal((12, 5))
    tok = _rng(1).standard_normal((2, 3, 5))
    if which == "lookup-table":
        _same_bits(cposembed.lookup(misaligned(table), [1, -2]), table[[1, -2]])
    elif which == "add-table":
        _same_bits(cposembed.add_positions(tok, misaligned(table)), tok + table[:3])
    elif which == "add-tokens":
        _same_bits(cposembed.add_positions(misaligned(tok), table), tok + table[:3])
    elif which == "scatter-grad_output":
        got = cposembed.scatter_add(np.zeros((12, 5)), misaligned(tok))
        _same_bits(got, _scatter_expect(np.zeros((12, 5)), tok, np.arange(3), None, -1)[0])
    else:
        grad = misaligned(np.zeros((12, 5)))
        cposembed.scatter_add(grad, tok)
        _same_bits(grad, _scatter_expect(np.zeros((12, 5)), tok, np.arange(3), None, -1)[0])


def test_last_team_after_the_single_row_path():
    table = np.ones((100, 8), np.float32)
    with tuned(serial_below=0):
        _core.lookup(table, np.arange(50), None, 2)
    assert _core.last_team() == min(2, 4 * CPUS) or not _core.openmp_enabled()
    _core.lookup(table, 3, None, None)
    assert _core.last_team() == 1


def test_scatter_entry_declines_negative_plans():
    grad = np.zeros((3, 2), np.float32)
    g = np.ones((2, 2), np.float32)
    assert _core.scatter_add(grad, g, [0, 1], 0, None, None, -1, 4) is None
    assert _core.scatter_add(grad, g, [0, 1], 0, None, None, -1, -1) is None
    assert not grad.any()
