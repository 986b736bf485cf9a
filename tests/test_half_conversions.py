"""The kernels' conversions between the half formats and float32/float64
(src_c/_half.h), scalar and SSE2, against NumPy and ml_dtypes.

Each conversion is reached through an operation whose result is NumPy's by
definition: ``np.add.at`` into a zero table converts the source to the
table's dtype after one add of 0 (which only turns -0.0 into +0.0 and quiets
NaNs, in both), and ``a + b`` of two half arrays converts both to float32
and the sum back. Rows of 8 or more elements take the SSE2 blocks, rows of
fewer than 8 the scalar loops: both are checked, and the blocks in every
variant the CPU has (SSE2, F16C, AVX2).
``CPOSEMBED_EXHAUSTIVE=1`` runs every float32 bit pattern instead of a
sample (about ten minutes).
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

import cposembed
from cposembed import _core

# NaN, inf and overflow are among the values on purpose.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(autouse=True, params=_core.isas())
def half_isa(request):
    # Every variant of the half-precision primitives this CPU has.
    assert _core.set_isa(request.param) == request.param
    yield
    _core.set_isa(_core.ISAS[-1])


HALVES = [np.dtype(np.float16), BF16]
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(UINT[a.dtype.itemsize])


def every_half(dtype):
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)


def scatter_into_zeros(table_dtype, g, d, add_at=True):
    """np.add.at(zeros, rows, g) by cposembed with rows of d elements, and by
    NumPy (or, with add_at=False, NumPy's same arithmetic without np.add.at's
    per-row loop: 0 + g in g's dtype, cast to the table's)."""
    g = g.reshape(-1, d)
    rows = np.arange(g.shape[0])
    got = np.zeros(g.shape, table_dtype)
    cposembed.scatter_add(got, g, rows, num_threads=1)
    if add_at:
        want = np.zeros(g.shape, table_dtype)
        np.add.at(want, rows, g)
    else:
        want = (np.zeros_like(g) + g).astype(table_dtype)
    return got, want


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("wide", [np.float32, np.float64])
@pytest.mark.parametrize("d", [4096, 7], ids=["sse2", "scalar"])
def test_every_half_widens_exactly(dtype, wide, d):
    h = every_half(dtype)[: (1 << 16) // d * d]
    got, want = scatter_into_zeros(wide, h, d)
    assert np.array_equal(bits(got), bits(want))


def float32_sample(n, seed):
    """n random float32 bit patterns, plus every exponent's patterns around the
    float16 and bfloat16 rounding points (ties, just above, just below)."""
    rng = np.random.default_rng(seed)
    random = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    exps = np.arange(256, dtype=np.uint32) << 23
    marks = []
    for shift in (13, 16):  # float16 and bfloat16 drop 13 and 16 significand bits
        half = np.uint32(1 << (shift - 1))
        for base in (0, 1 << shift, 3 << shift, 0x7FFFFF & ~((1 << shift) - 1)):
            for delta in (-1, 0, 1):
                marks.append((np.uint32(base) + half + np.uint32(delta % (1 << 32))) & 0x7FFFFF)
    marks = np.array(marks, np.uint32)
    edges = (exps[:, None] | marks[None, :]).ravel()
    # float16's subnormal and overflow boundaries, at every rounding step
    sub = np.arange(0x33000000 - 64, 0x38800000 + 64, 4093, dtype=np.uint32)
    top = np.arange(0x477FE000 - 4096, 0x47800000 + 4096, dtype=np.uint32)
    out = np.concatenate([random, edges, sub, top])
    return np.concatenate([out, out | np.uint32(0x80000000)])


def float32_patterns():
    if os.environ.get("CPOSEMBED_EXHAUSTIVE"):
        for start in range(0, 1 << 32, 1 << 24):
            yield np.arange(start, start + (1 << 24), dtype=np.uint64).astype(np.uint32)
    else:
        yield float32_sample(1 << 18, 0)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("d", [4096, 7], ids=["sse2", "scalar"])
def test_float32_rounds_to_the_half_formats_as_numpy(dtype, d):
    exhaustive = bool(os.environ.get("CPOSEMBED_EXHAUSTIVE"))
    for chunk in float32_patterns():
        g = chunk[: chunk.size // d * d].view(np.float32)
        got, want = scatter_into_zeros(dtype, g, d, add_at=not exhaustive)
        assert np.array_equal(bits(got), bits(want))


def float64_sample(n, seed):
    """Doubles across the half formats' range, and halfway between neighbouring
    half values (plus and minus a few ulps of float64 and of float32)."""
    rng = np.random.default_rng(seed)
    rand = rng.integers(0, 1 << 63, n, dtype=np.uint64) | (
        rng.integers(0, 2, n, dtype=np.uint64) << 63
    )
    scale = np.ldexp(rng.standard_normal(n), rng.integers(-30, 20, n))
    out = [rand.view(np.float64), scale, [np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0]]
    for dtype in HALVES:
        h = every_half(dtype).astype(np.float64)
        h = h[np.isfinite(h)]
        h = np.sort(h)
        mid = (h[:-1] + h[1:]) / 2
        for ulps in (0, 1, -1, 1 << 29, -(1 << 29)):
            out.append((mid.view(np.int64) + ulps).view(np.float64))
    return np.concatenate([np.asarray(x, np.float64) for x in out])


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("d", [512, 7], ids=["rows", "short rows"])
def test_float64_rounds_to_the_half_formats_as_numpy_and_ml_dtypes(dtype, d):
    x = float64_sample(1 << 16, 1)
    x = x[: x.size // d * d]
    got, want = scatter_into_zeros(dtype, x, d)
    assert np.array_equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("d", [4096, 7], ids=["sse2", "scalar"])
def test_half_plus_half_is_numpy_for_every_left_operand(dtype, d):
    a = every_half(dtype)
    rng = np.random.default_rng(2)
    for b_bits in rng.integers(0, 1 << 16, 6).tolist() + [0x0001, 0x8000, 0x7C00, 0x3C00]:
        b = np.full_like(a, np.array([b_bits], np.uint16).view(dtype)[0])
        tokens = a[: a.size // d * d].reshape(-1, 1, d)
        table = b[:d].reshape(1, d)
        got = cposembed.add_positions(tokens, table, num_threads=1)
        assert got.dtype == dtype
        assert np.array_equal(bits(got), bits(tokens + table))


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_a_half_table_rounds_after_each_add(dtype):
    # float16: 2048 + 1 is a tie, and rounds back to 2048 every time.
    t = np.full((1, 9), 2048.0, dtype)
    g = np.ones((100, 9), np.float32)
    cposembed.scatter_add(t, g, np.zeros(100, np.int64))
    want = np.full((1, 9), 2048.0, dtype)
    np.add.at(want, np.zeros(100, np.intp), g)
    assert np.array_equal(bits(t), bits(want))
    if dtype == np.float16:
        assert (t == 2048).all()
