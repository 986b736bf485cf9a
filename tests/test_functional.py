"""lookup / add_positions / scatter_add against NumPy, on both sides of the serial threshold."""

import numpy as np
import pytest
from helpers import INDEX_DTYPES, reference_scatter
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import cposembed
from cposembed import _threads

FLOATS = [np.float32, np.float64]


def _table(n_rows, d, dtype, seed=0):
    return np.random.RandomState(seed).randn(n_rows, d).astype(dtype)


def _rows_for(elements, d):
    """Number of rows giving about `elements` output elements."""
    return max(1, elements // d)


# Sizes just below and well above the serial threshold (read at run time, so
# the tests follow any retuning of the threshold).
def _sizes():
    t = _threads.SERIAL_THRESHOLD
    return [t // 4, 4 * t]


# ---------------------------------------------------------------- lookup


@pytest.mark.parametrize("dtype", FLOATS)
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


# ---------------------------------------------------------------- add


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("offset", [0, 5])
def test_add_default_positions(dtype, which, offset):
    d = 64
    n_rows = 300
    T = 50
    B = max(1, _rows_for(_sizes()[which], d) // T)
    table = _table(n_rows, d, dtype)
    tok = _table(B * T, d, dtype, seed=2).reshape(B, T, d)
    expected = tok + table[offset + np.arange(T)]
    for threads in (1, 2, 4):
        got = cposembed.add_positions(tok, table, offset=offset, num_threads=threads)
        assert got.dtype == expected.dtype
        assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize(
    "tok_shape, pos_shape",
    [
        ((4, 6, 8), (6,)),
        ((4, 6, 8), (4, 6)),
        ((4, 6, 8), (1, 6)),
        ((4, 6, 8), (4, 1)),
        ((4, 6, 8), ()),
        ((6, 8), (6,)),
        ((2, 3, 6, 8), (3, 6)),
        ((2, 3, 6, 8), (2, 1, 6)),
        ((8,), ()),
        ((0, 6, 8), (6,)),
    ],
)
def test_add_explicit_positions_broadcast(tok_shape, pos_shape):
    table = _table(20, 8, np.float32)
    rng = np.random.RandomState(3)
    tok = rng.randn(*tok_shape).astype(np.float32)
    positions = rng.randint(-20, 20, size=pos_shape)
    expected = tok + table[positions]
    got = cposembed.add_positions(tok, table, positions)
    assert got.shape == expected.shape
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize(
    "tok_dtype", [np.float16, np.float32, np.float64, np.int8, np.int32, np.uint16, np.bool_]
)
@pytest.mark.parametrize("table_dtype", FLOATS)
def test_add_result_dtype_follows_numpy(tok_dtype, table_dtype):
    table = _table(10, 4, table_dtype)
    tok = (np.random.RandomState(4).randn(2, 5, 4) * 3).astype(tok_dtype)
    expected = tok + table[np.arange(5)]
    got = cposembed.add_positions(tok, table)
    assert got.dtype == expected.dtype
    assert got.tobytes() == expected.tobytes()


def test_add_in_place_and_layouts():
    table = _table(16, 8, np.float32)
    tok = _table(32, 8, np.float32, seed=5).reshape(2, 16, 8)
    expected = tok + table[np.arange(16)]
    res = cposembed.add_positions(tok, table, out=tok)
    assert res is tok
    assert tok.tobytes() == expected.tobytes()
    # Non-contiguous and Fortran tokens, non-contiguous out.
    base = _table(64, 8, np.float32, seed=6).reshape(2, 32, 8)
    view = base[:, ::2]
    expected = view + table[np.arange(16)]
    np.testing.assert_array_equal(cposembed.add_positions(view, table), expected)
    np.testing.assert_array_equal(cposembed.add_positions(np.asfortranarray(view), table), expected)
    cposembed.add_positions(view, table, out=view)
    np.testing.assert_array_equal(view, expected)


def test_add_out_partially_overlapping_tokens_matches_numpy():
    table = _table(8, 4, np.float64)
    buf = _table(10, 4, np.float64, seed=7)
    tok = buf[:8]
    expected = tok + table[np.arange(8)]
    cposembed.add_positions(tok[None], table, out=buf[2:10][None])
    np.testing.assert_array_equal(buf[2:10], expected)


def test_add_tokens_are_the_table():
    # add_to(table, out=table): each row reads rows the call also writes.
    table = _table(8, 4, np.float64)
    positions = np.array([7, 6, 5, 4, 3, 2, 1, 0])
    expected = table + table[positions]
    cposembed.add_positions(table, table, positions, out=table)
    np.testing.assert_array_equal(table, expected)


def test_add_zero_tokens_checks_nothing():
    table = _table(8, 4, np.float32)
    tok = np.zeros((3, 0, 4), np.float32)
    assert cposembed.add_positions(tok, table, offset=100).shape == (3, 0, 4)


# ---------------------------------------------------------------- scatter_add


@pytest.mark.parametrize("dtype", FLOATS)
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


def test_scatter_add_converts_and_handles_layouts():
    rng = np.random.RandomState(11)
    g64 = rng.randn(2, 5, 4)
    positions = np.array([0, 1, 1, 3, 0])
    grad = np.zeros((4, 4), np.float32)
    cposembed.scatter_add(grad, g64, positions)
    expected = reference_scatter(np.zeros((4, 4), np.float32), g64.astype(np.float32), positions)
    assert grad.tobytes() == expected.tobytes()
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
    dtype=st.sampled_from(FLOATS),
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
