"""Hypothesis strategies for hostile input (any dtype, layout, index form) and
the comparisons against NumPy that the property tests of every operation share."""

from __future__ import annotations

import numpy as np
from helpers import make_out
from hypothesis import note
from hypothesis import strategies as st

CLEAR_ERRORS = (IndexError, TypeError, ValueError)


SIZED_INT_DTYPES = [
    np.dtype(t) for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
]


FLOAT_DTYPES = [np.dtype(t) for t in ("float16", "float32", "float64", "longdouble")]


OTHER_DTYPES = [
    np.dtype(t) for t in ("complex64", "complex128", "O", "U3", "S3", "M8[s]", "m8[ms]", "V4")
]


ALL_DTYPES = [np.dtype(bool)] + SIZED_INT_DTYPES + FLOAT_DTYPES + OTHER_DTYPES


SWAPPABLE = [dt for dt in SIZED_INT_DTYPES + FLOAT_DTYPES + OTHER_DTYPES[:2] if dt.itemsize > 1]


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
        return make_out("read_only", like=arr)
    if how == "broadcast" and arr.ndim and arr.shape[0] >= 1:
        # A zero-stride view: every row is the first.
        return np.broadcast_to(arr[:1], arr.shape)
    if how == "unaligned" and arr.dtype.kind not in "OV" and arr.size:
        return make_out("misaligned", like=arr)
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
