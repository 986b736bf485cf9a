"""Hostile input, property-based: whatever arrives, the answer is NumPy's or a
clear exception, never a crash and never a partial write.

Strategies cover every NumPy dtype kind (bool, signed and unsigned integers of
every size, float16/32/64, longdouble, complex, object, unicode and byte
strings, datetime64, timedelta64, void) in both byte orders, shapes including
0-size and 0-d, memory layouts (C, Fortran, reversed/negative strides, strided
views, read-only, broadcast zero-stride views) and ``out`` arrays that alias or
partially overlap an input. Floats include NaN, +-Inf, -0.0 and subnormals,
which must pass through bit for bit.

The reference is NumPy itself: ``table[positions]``, ``tokens + table[pos]``
and ``np.add.at``. Overlapping ``out`` follows NumPy's ufunc rule: the result
is as if every input had been copied first.

Profiles: ``ci`` (default, fast) and ``slow`` (>= 5,000 examples per property):
``CPOSEMBED_HYPOTHESIS_PROFILE=slow python -m pytest tests/test_hostile.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, note
from hypothesis import strategies as st

import cposembed
from cposembed import LearnedPositionEmbedding

CLEAR_ERRORS = (IndexError, TypeError, ValueError)

INT_DTYPES = [
    np.dtype(t) for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
]
FLOAT_DTYPES = [np.dtype(t) for t in ("float16", "float32", "float64", "longdouble")]
OTHER_DTYPES = [
    np.dtype(t) for t in ("complex64", "complex128", "O", "U3", "S3", "M8[s]", "m8[ms]", "V4")
]
ALL_DTYPES = [np.dtype(bool)] + INT_DTYPES + FLOAT_DTYPES + OTHER_DTYPES
SWAPPABLE = [dt for dt in INT_DTYPES + FLOAT_DTYPES + OTHER_DTYPES[:2] if dt.itemsize > 1]

SPECIAL_FLOATS = [np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 5e-324, 1e-45, 1e308, -3.4e38]


# --- strategies -------------------------------------------------------------


@st.composite
def any_dtype(draw) -> np.dtype:
    dt = draw(st.sampled_from(ALL_DTYPES))
    if dt in SWAPPABLE and draw(st.booleans()):
        dt = dt.newbyteorder()
    return dt


def _cast(values: np.ndarray, dt: np.dtype) -> np.ndarray:
    """``values`` (int64) turned into an array of ``dt`` the way a pipeline might."""
    kind = dt.kind
    if kind == "b":
        return (values % 2).astype(dt)
    if kind in "iu":
        info = np.iinfo(dt)
        return np.clip(values, max(info.min, -(2**62)), min(info.max, 2**62)).astype(dt)
    if kind in "fc":
        return values.astype(dt)
    if kind == "O":
        return values.astype(object)
    if kind in "US":
        return values.astype(dt)
    if kind in "Mm":
        return values.astype(dt)
    return np.zeros(values.shape, dtype=dt)  # void


@st.composite
def layout(draw, arr: np.ndarray) -> np.ndarray:
    """The same values (or a reversed copy of them) in some memory layout."""
    how = draw(
        st.sampled_from(
            ["c", "fortran", "reversed", "strided", "readonly", "broadcast", "unaligned"]
        )
    )
    note(f"layout {how}")
    if how == "fortran":
        return np.asfortranarray(arr)
    if how == "reversed" and arr.ndim:
        return arr[::-1]
    if how == "strided" and arr.ndim:
        axis = draw(st.integers(0, arr.ndim - 1))
        return np.repeat(arr, 2, axis=axis)[(slice(None),) * axis + (slice(None, None, 2),)]
    if how == "readonly":
        out = arr.copy()
        out.setflags(write=False)
        return out
    if how == "broadcast" and arr.ndim and arr.shape[0] >= 1:
        # A zero-stride view: every row is the first.
        return np.broadcast_to(arr[:1], arr.shape)
    if how == "unaligned" and arr.dtype.kind not in "OV" and arr.size:
        raw = np.zeros(arr.nbytes + 1, dtype=np.uint8)[1:]
        out = raw.view(arr.dtype).reshape(arr.shape)
        out[...] = arr
        return out
    return np.ascontiguousarray(arr)


@st.composite
def index_arrays(draw, n_rows: int, shape=None, dtypes=None) -> np.ndarray:
    if shape is None:
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    dt = draw(dtypes if dtypes is not None else any_dtype())
    size = int(np.prod(shape))
    lo = -n_rows - 2 if draw(st.integers(0, 9)) == 0 else -n_rows
    hi = n_rows + 1 if draw(st.integers(0, 9)) == 0 else max(n_rows - 1, 0)
    values = np.array(
        draw(st.lists(st.integers(lo, hi), min_size=size, max_size=size)), dtype=np.int64
    ).reshape(shape)
    arr = _cast(values, dt)
    return draw(layout(arr))


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


@st.composite
def float_values(draw, shape, dtype) -> np.ndarray:
    size = int(np.prod(shape))
    vals = draw(
        st.lists(
            st.one_of(st.floats(-1e6, 1e6, width=32), st.sampled_from(SPECIAL_FLOATS)),
            min_size=size,
            max_size=size,
        )
    )
    with np.errstate(over="ignore"):
        return np.array(vals, dtype=np.float64).reshape(shape).astype(dtype)


@st.composite
def tables(draw, min_rows=1):
    L = draw(st.integers(min_rows, 6))
    d = draw(st.integers(0, 5))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    return draw(float_values((L, d), dtype))


@st.composite
def row_arrays(draw, lead, d):
    """A (*lead, d) array of any dtype, values including NaN/Inf, any layout."""
    dt = draw(any_dtype())
    shape = tuple(lead) + (d,)
    if dt.kind in "fc":
        arr = draw(float_values(shape, dt))
    else:
        size = int(np.prod(shape))
        vals = np.array(
            draw(st.lists(st.integers(-300, 300), min_size=size, max_size=size)), dtype=np.int64
        ).reshape(shape)
        arr = _cast(vals, dt)
    return draw(layout(arr))


# --- helpers ----------------------------------------------------------------


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def same_bits(got, want) -> bool:
    """Same shape, dtype and bytes (NaN payloads and -0.0 included)."""
    got, want = np.asarray(got), np.asarray(want)
    return got.shape == want.shape and got.dtype == want.dtype and _bits(got) == _bits(want)


def same_values(got, want) -> bool:
    """Bitwise equal except that any NaN matches any NaN: when both operands of
    an addition are NaN, IEEE 754 leaves the sign/payload of the result open
    (and compilers may swap the operands), so only NaN-ness is promised."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.dtype.kind == "f" and got.dtype.itemsize > 8:
        # longdouble: 80-bit values in 16 bytes; the padding bytes are garbage.
        return bool(
            np.array_equal(got, want, equal_nan=True)
            and np.array_equal(np.signbit(got), np.signbit(want))
        )
    if got.dtype.kind in "fc":
        gn, wn = np.isnan(got), np.isnan(want)
        if not np.array_equal(gn, wn):
            return False
        got, want = np.where(gn, 0, got).astype(got.dtype), np.where(wn, 0, want).astype(want.dtype)
    return _bits(got) == _bits(want)


def numpy_or_error(fn):
    try:
        with np.errstate(all="ignore"):
            return fn(), None
    except Exception as exc:  # noqa: BLE001 - any NumPy error is a valid reference outcome
        return None, exc


def broadcast_positions_ok(pos_shape, lead) -> bool:
    try:
        return np.broadcast_shapes(pos_shape, lead) == tuple(lead)
    except ValueError:
        return False


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
    pos = data.draw(index_arrays(L, dtypes=st.sampled_from(INT_DTYPES)), label="positions")
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


@given(table=tables(), data=st.data())
def test_add_positions_any_tokens_matches_numpy(table, data):
    L, d = table.shape
    lead = tuple(data.draw(st.lists(st.integers(0, 4), min_size=0, max_size=3), label="lead"))
    tokens = data.draw(row_arrays(lead, d), label="tokens")
    explicit = data.draw(st.booleans())
    tok_before, table_before = _bits(tokens), _bits(table)
    if explicit:
        pshape = tuple(data.draw(st.lists(st.integers(0, 4), max_size=3), label="pshape"))
        if data.draw(st.booleans()) and lead:
            pshape = lead[len(lead) - data.draw(st.integers(0, len(lead))) :]
        positions = data.draw(index_arrays(L, shape=pshape), label="positions")
        offset = 0

        def reference():
            result = tokens + table[positions]
            if result.shape != tokens.shape:  # positions must broadcast to tokens
                raise ValueError("does not broadcast")
            return result
    else:
        positions = None
        offset = data.draw(st.integers(0, L + 1), label="offset")

        def reference():
            if not lead:
                raise ValueError("1-D tokens")
            T = lead[-1]
            if T and offset + T > L:
                raise IndexError("out of range")
            return tokens + table[offset : offset + T]

    want, ref_exc = numpy_or_error(reference)
    real = tokens.dtype.kind in "biuf"
    if ref_exc is None and real:
        got = cposembed.add_positions(tokens, table, positions, offset=offset)
        assert same_values(got, want), (got, want)
    else:
        with pytest.raises(CLEAR_ERRORS):
            cposembed.add_positions(tokens, table, positions, offset=offset)
    assert _bits(tokens) == tok_before and _bits(table) == table_before


@given(table=tables(), data=st.data())
def test_add_positions_out_alias_and_overlap(table, data):
    """``out`` is tokens itself, a partial overlap of tokens, or the table: the
    result is NumPy's copy-inputs-first result, or a clear error with nothing written."""
    L, d = table.shape
    B = data.draw(st.integers(1, 3))
    T = data.draw(st.integers(1, L))
    base = data.draw(float_values((B * T + 2, d), table.dtype))
    shift = data.draw(st.integers(0, 2))
    tokens = base[: B * T].reshape(B, T, d)
    mode = data.draw(st.sampled_from(["inplace", "shifted", "reversed", "table", "fresh-strided"]))
    note(f"mode {mode}, shift {shift}")
    work_table = table.copy()
    if mode == "inplace":
        out = tokens
    elif mode == "shifted":
        out = base[shift : shift + B * T].reshape(B, T, d)
    elif mode == "reversed":
        out = tokens[::-1]
    elif mode == "table":
        assume(B * T * d <= work_table.size and d > 0)
        out = work_table.reshape(-1)[: B * T * d].reshape(B, T, d)
    else:
        out = np.zeros((B, T, 2 * d), dtype=table.dtype)[..., ::2]
    positions = data.draw(
        st.one_of(st.none(), index_arrays(L, shape=(T,), dtypes=st.sampled_from(INT_DTYPES)))
    )
    if positions is not None:
        assume(
            positions.size == 0
            or (positions.astype(np.int64).min() >= -L and positions.astype(np.int64).max() < L)
        )
    pos = np.arange(T) if positions is None else positions
    with np.errstate(all="ignore"):
        want = tokens.copy() + work_table.copy()[pos]  # inputs copied first, as NumPy does
    out_before = _bits(out)
    try:
        got = cposembed.add_positions(tokens, work_table, positions, out=out)
    except CLEAR_ERRORS:
        assert _bits(out) == out_before
        return
    assert got is out
    assert same_values(out, want)


@given(data=st.data())
def test_scatter_add_any_grad_output_matches_add_at(data):
    L = data.draw(st.integers(1, 6))
    d = data.draw(st.integers(0, 5))
    gdtype = data.draw(st.sampled_from([np.float32, np.float64]))
    grad0 = data.draw(float_values((L, d), gdtype))
    grad = data.draw(st.sampled_from(["c", "fortran", "strided"]))
    if grad == "fortran":
        grad = np.asfortranarray(grad0.copy())
    elif grad == "strided":
        grad = np.repeat(grad0, 2, axis=0)[::2]
    else:
        grad = grad0.copy()
    lead = tuple(data.draw(st.lists(st.integers(0, 4), max_size=3), label="lead"))
    g = data.draw(row_arrays(lead, d), label="grad_output")
    if data.draw(st.booleans()):
        pshape = tuple(data.draw(st.lists(st.integers(0, 4), max_size=2)))
        if data.draw(st.booleans()) and lead:
            pshape = lead[len(lead) - data.draw(st.integers(0, len(lead))) :]
        positions = data.draw(index_arrays(L, shape=pshape), label="positions")
    else:
        positions = None
    g_before = _bits(g)

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

    want, ref_exc = numpy_or_error(reference)
    if ref_exc is None:
        got = cposembed.scatter_add(grad, g, positions)
        assert got is grad
        assert same_values(grad, want)
    else:
        with pytest.raises(CLEAR_ERRORS):
            cposembed.scatter_add(grad, g, positions)
        assert same_bits(grad, grad0)
    assert _bits(g) == g_before


@given(data=st.data())
def test_scatter_add_grad_output_overlapping_grad(data):
    """grad_output that is a view of grad_table itself: inputs read first."""
    L = data.draw(st.integers(2, 6))
    d = data.draw(st.integers(1, 4))
    grad = data.draw(float_values((L, d), np.float64))
    lo = data.draw(st.integers(0, L - 1))
    hi = data.draw(st.integers(lo, L))
    g = grad[lo:hi] if data.draw(st.booleans()) else grad[lo:hi][::-1]
    positions = data.draw(index_arrays(L, shape=(hi - lo,), dtypes=st.sampled_from(INT_DTYPES)))
    assume(
        positions.size == 0
        or (positions.astype(np.int64).min() >= -L and positions.astype(np.int64).max() < L)
    )
    want = grad.copy()
    with np.errstate(all="ignore"):  # Inf + -Inf: NumPy warns, the kernel need not
        np.add.at(want, positions, g.copy())
        cposembed.scatter_add(grad, g, positions)
    assert same_values(grad, want)


@given(table=tables(), data=st.data())
def test_nan_inf_pass_through_unchanged(table, data):
    """Special values travel bit for bit through lookup and the table side of add."""
    L, d = table.shape
    assume(d > 0)
    table = table.copy()
    flat = table.reshape(-1)
    flat[data.draw(st.integers(0, flat.size - 1))] = data.draw(
        st.sampled_from([np.nan, np.inf, -np.inf, -0.0])
    )
    # A NaN with a payload, as a model checkpoint might carry one.
    bits = np.array([0x7FF8DEADBEEF0001], dtype=np.uint64).view(np.float64)
    flat[0] = bits[0].astype(table.dtype) if table.dtype == np.float64 else np.float32(np.nan)
    pos = np.arange(-L, L)
    assert same_bits(cposembed.lookup(table, pos), table[pos])
    zeros = np.zeros((2, L, d), dtype=table.dtype)
    assert same_values(cposembed.add_positions(zeros, table), zeros + table)
    grad = np.zeros_like(table)
    cposembed.scatter_add(grad, table[None], None)
    want = np.zeros_like(table)
    np.add.at(want, np.arange(L), table)
    assert same_values(grad, want)


# --- huge shapes: a clear error, never a crash or an attempt to touch memory ---

HUGE = [
    (2**40,),  # 1 Ti positions of int8 (a zero-stride view)
    (2**31, 2**31),  # B*T overflows int32 and B*T*d overflows int64
    (2**62,),  # B*T*d overflows int64 for any d > 1
    (3, 2**61),
]


@pytest.mark.parametrize("shape", HUGE)
def test_huge_shapes_raise_clear_errors(shape):
    table = np.zeros((4, 8), dtype=np.float32)
    pos = np.broadcast_to(np.int8(0), shape)
    big_rows = (
        np.broadcast_to(np.int8(1), shape + (8,))
        if np.prod(shape, dtype=object) * 8 < 2**63
        else None
    )
    with pytest.raises((ValueError, MemoryError, IndexError)):
        cposembed.lookup(table, pos)
    grad = np.zeros_like(table)
    if big_rows is not None:
        with pytest.raises((ValueError, MemoryError)):
            cposembed.add_positions(big_rows, table, pos)
        with pytest.raises((ValueError, MemoryError)):
            cposembed.scatter_add(grad, big_rows, pos)
        with pytest.raises((ValueError, MemoryError, IndexError)):
            cposembed.add_positions(big_rows, table)
    assert not grad.any()


def test_huge_table_view_raises_clear_error():
    table = np.broadcast_to(np.float32(0), (4, 2**45))
    with pytest.raises((ValueError, MemoryError)):
        cposembed.lookup(table, [0])


@pytest.mark.parametrize("bad", [-5, 4, -(2**63), 2**63 - 1, 2**63, 2**64, 2**100, -(2**100)])
def test_extreme_position_values(bad):
    """Out-of-range values of any magnitude: IndexError naming the value and range."""
    table = np.zeros((4, 2), dtype=np.float32)
    match = f"position {bad} is out of range.*-4 <= position < 4"
    for positions in (bad, [0, bad], [[0], [bad]]):
        with pytest.raises(IndexError, match=match):
            cposembed.lookup(table, positions)
        with pytest.raises(IndexError, match=match):
            cposembed.scatter_add(np.zeros_like(table), np.ones((2, 2)), [bad, 0])
    if -(2**63) <= bad < 2**64:
        arr = np.array([0, bad], dtype=np.uint64 if bad >= 2**63 else np.int64)
        with pytest.raises(IndexError, match=match):
            cposembed.lookup(table, arr)
        with pytest.raises(IndexError, match=match):
            cposembed.scatter_add(np.zeros_like(table), np.ones((2, 2)), arr)


@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<f8", ">f8"])
def test_table_and_grad_in_either_byte_order(dtype):
    """A big-endian checkpoint is still float32/float64: same values as NumPy."""
    rng = np.random.RandomState(0)
    table = rng.randn(6, 3).astype(dtype)
    pos = np.array([[0, 5, -1], [2, 2, -6]])
    tok = rng.randn(2, 3, 3).astype(np.dtype(dtype).newbyteorder("="))
    assert np.array_equal(cposembed.lookup(table, pos), table[pos])
    assert np.array_equal(cposembed.add_positions(tok, table, pos), tok + table[pos])
    grad = np.zeros((6, 3), dtype=dtype)
    g = rng.randn(2, 3, 3)
    assert cposembed.scatter_add(grad, g, pos) is grad
    want = np.zeros((6, 3), dtype=dtype)
    np.add.at(want, pos, g.astype(dtype))
    assert grad.dtype == np.dtype(dtype) and np.array_equal(grad, want)
