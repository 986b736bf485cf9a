"""The tests' own oracle of what the C entries accept ("plain"), independent of
the package's checks, and the inputs and snapshots the entry tests share."""

from __future__ import annotations

import enum

import numpy as np
from helpers import _Sub, make_out
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cposembed import _core

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


HUGE = 2**62  # a large offset, near the int64 maximum


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


def _disjoint(a, b):
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
    elif not _core.openmp_enabled():
        n = 1
    else:
        n = min(int(num_threads), 4 * CPUS)
    if n <= 1 or work < serial_below:
        return 1
    if chunks < n:
        n = chunks if chunks > 1 else 1
    if n > 1 and serial_below > 0:
        n = min(n, work // serial_below)
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
        return make_out("misaligned", like=a)
    if kind == "readonly":
        a.flags.writeable = False
    if kind == "list":
        return a.tolist()
    return a


def _table_variant(draw, base, plain=False):
    """`base` as a table argument: plain (mostly) or in a form to be declined
    (float16 is no such form: half tables are plain, tests/test_half_*.py)."""
    rare = ["swapped", "fortran", "strided", "subclass", "int", "1d", "3d"]
    kind = _pick(draw, ["plain"], rare + ["unaligned", "list", "readonly"], plain=plain)
    if kind == "fortran":
        return np.asfortranarray(base)
    if kind == "1d":
        return base.reshape(-1)
    if kind == "3d":
        return base[None]
    return _array_form(base, kind)


def _entry_case(data, max_rows=10, max_dim=7):
    """The start of an entry's contract test: ``(plain, L, d, dtype, rng, table)``,
    the table ``(L, d)`` of a drawn float dtype in a form the entries take
    exactly when ``plain`` is drawn True."""
    plain = data.draw(st.booleans(), label="plain")
    L = data.draw(st.integers(1, max_rows), label="L")
    d = data.draw(st.integers(0, max_dim), label="d")
    dtype = data.draw(st.sampled_from(FLOATS))
    rng = _rng(L * 10 + d)
    table = _table_variant(data.draw, rng.standard_normal((L, d)).astype(dtype), plain)
    return plain, L, d, dtype, rng, table


def _rng(seed):
    return np.random.default_rng(seed)


def _pick(draw, common, rare, p_rare=0.25, *, plain=False):
    """One of `common`, or (with probability about p_rare, never if `plain`)
    one of `rare`; shrinks towards common[0]."""
    if plain or draw(st.integers(0, 99)) < 100 * (1 - p_rare):
        return draw(st.sampled_from(common))
    return draw(st.sampled_from(rare))


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
    # More axes than the rows have (leading 1s): see
    # test_dispatch.py::test_entries_decline_positions_with_more_axes_than_the_rows.
    assume(len(shape) <= len(lead) or not _period_ok(shape, lead))
    positions = data.draw(positions_of(shape, n_rows, plain), label="positions")
    offset = _pick(data.draw, [0, np.int64(0)], [1, False, 0.0], 0.1, plain=plain)
    return lead, positions, offset


def _default_rows(lead, offset, n_rows):
    """offset + arange(T) if the entry must take it, else None."""
    if not lead or not _is_int(offset):
        return None
    T, start = lead[-1], int(offset)
    if T == 0:  # no row is read: any non-negative offset
        return np.arange(0) if start >= 0 else None
    return np.arange(start, start + T) if 0 <= start <= n_rows - T else None


def _explicit_rows(positions, offset, lead, n_rows):
    if not (_is_int(offset) and int(offset) == 0):
        return None
    rows = _rows(positions, n_rows)
    if rows is None or not _period_ok(rows.shape, lead):
        return None
    return rows


# ------------------------------------------------------------ scatter-add
def _scatter_expect(grad, g, rows, touched, skip_row):
    grad = grad.copy()
    idx = np.broadcast_to(rows, g.shape[:-1])
    np.add.at(grad, idx, g)
    # touched: None or a RowMarks (its mask is what the call must leave)
    marks = None if touched is None else np.array(touched.mask)
    if marks is not None and idx.size:
        marks[idx.reshape(-1) % grad.shape[0]] = True
    if skip_row >= 0:
        grad[skip_row] = 0
        if marks is not None:
            marks[skip_row] = False
    return grad, marks
