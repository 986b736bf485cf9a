"""Hypothesis strategies for hostile input (any dtype, layout, index form) and
the comparisons against NumPy that the property tests of every operation share."""

from __future__ import annotations

import ml_dtypes
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
def layout(draw, arr: np.ndarray, writable: bool = False) -> np.ndarray:
    """The same values (or a reversed copy of them) in some memory layout
    (``writable``: only the layouts that can be written)."""
    hows = ["c", "fortran", "reversed", "strided", "unaligned"]
    if not writable:
        hows += ["readonly", "broadcast"]
    how = draw(st.sampled_from(hows))
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


# --- the four float dtypes of the tables (float16, bfloat16, float32, float64) --
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


TABLE_DTYPES = [np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64)]


# Values that bite in one of the four: signed zeros, infinities, NaNs, the
# smallest subnormals and largest finites of each, the values whose sums or
# conversions are rounding ties (2048 + 1 in float16, 256 + 1 in bfloat16,
# 2**24 + 1 in float32; 1 + 2**-8 + 2**-30 rounds to bfloat16 differently in
# one rounding and through float32), and values that overflow a half dtype.
EDGE_FLOATS = [
    np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 0.5, 1 / 3, 0.1,
    2048.0, 2049.0, 4097.0, 256.0, 257.0, 2.0**24, 2.0**24 + 1,
    1 + 2.0**-8, 1 + 2.0**-8 + 2.0**-30, 1 + 2.0**-11, 1 + 2.0**-11 + 2.0**-40, 1 + 2.0**-24,
    65504.0, -65504.0, 65519.0, 65520.0, 2.0**-24, 2.0**-25, 2.0**-14, 6.0e-5,
    2.0**-133, 2.0**-126, 1e-45, 3.3895313892515355e38, 3.4028234663852886e38, 1e308, 5e-324,
]  # fmt: skip


# How an edge_values array mixes its kinds of element: (edge values, small
# integers, half-integers, normal floats, any bit pattern) weights.
EDGE_MIXES = {
    "mixed": (3, 3, 2, 2, 2),
    "ties": (1, 6, 3, 0, 0),
    "edges": (1, 0, 0, 0, 0),
    "bits": (0, 0, 0, 0, 1),
    "normal": (0, 0, 0, 1, 0),
}


@st.composite
def edge_values(draw, shape, dtype) -> np.ndarray:
    """A C-contiguous array of ``dtype`` (one of TABLE_DTYPES): each element an
    edge value, a small integer or half-integer (whose sums tie), a normal float,
    or any bit pattern of the dtype (NaN payloads, signalling NaNs, subnormals),
    in one of EDGE_MIXES, from a drawn seed (fast for any size)."""
    dt = np.dtype(dtype)
    size = int(np.prod(shape))
    mix = draw(st.sampled_from(sorted(EDGE_MIXES)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    note(f"edge_values {dt.name} {shape}: {mix}")
    weights = np.array(EDGE_MIXES[mix], dtype=np.float64)
    kind = rng.choice(len(weights), size=size, p=weights / weights.sum())
    floats = np.select(
        [kind == 0, kind == 1, kind == 2],
        [
            np.array(EDGE_FLOATS)[rng.integers(0, len(EDGE_FLOATS), size)],
            rng.integers(-4100, 4101, size).astype(np.float64),
            rng.integers(-600, 601, size) / 2,
        ],
        rng.standard_normal(size) * 10.0 ** rng.integers(-3, 6, size),
    )
    with np.errstate(all="ignore"):
        arr = floats.astype(dt)
    n_bits = 8 * dt.itemsize
    patterns = rng.integers(0, 2**n_bits, size, dtype=np.uint64 if n_bits == 64 else np.int64)
    bits = arr.view(f"u{dt.itemsize}")
    bits[kind == 4] = patterns[kind == 4].astype(bits.dtype)
    return arr.reshape(shape)
