"""The class against the handbook's NumPy reference: same table, same lookups."""

import numpy as np
import pytest
from helpers import INDEX_DTYPES
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import cposembed
from cposembed import LearnedPositionEmbedding
from cposembed.reference import LearnedPositionEmbedding as Reference


@pytest.mark.parametrize("seed", [0, 1, 42, 12345])
@pytest.mark.parametrize("shape", [(1, 1), (128, 64), (7, 3), (300, 17)])
def test_table_float64_is_bitwise_the_reference(seed, shape):
    ours = LearnedPositionEmbedding(*shape, seed=seed, dtype=np.float64)
    ref = Reference(*shape, seed=seed)
    assert ours.embeddings.dtype == np.float64
    assert ours.embeddings.tobytes() == ref.embeddings.tobytes()
    assert (ours.max_seq_len, ours.embed_dim) == (ref.max_seq_len, ref.embed_dim)


def test_table_float32_is_the_reference_cast():
    ours = LearnedPositionEmbedding(128, 64, seed=42)
    ref = Reference(128, 64, seed=42)
    assert ours.embeddings.dtype == np.float32
    np.testing.assert_array_equal(ours.embeddings, ref.embeddings.astype(np.float32))
    assert ours.embeddings.flags.c_contiguous and ours.embeddings.flags.writeable


def test_handbook_numbers():
    pe = LearnedPositionEmbedding(128, 64, seed=42)
    row0 = np.round(pe(0)[:5], 3)
    assert str(row0) == "[ 0.062 -0.017  0.081  0.19  -0.029]"


def test_integer_seed_leaves_global_rng_alone():
    np.random.seed(99)
    before = np.random.get_state()[1].copy()
    LearnedPositionEmbedding(16, 8, seed=3)
    assert np.array_equal(np.random.get_state()[1], before)
    # ...and the reference's stream follows from the global state as before.
    expected = np.random.RandomState(99).randn(2)
    assert np.array_equal(np.random.randn(2), expected)


def test_seed_none_draws_from_the_global_rng_like_the_reference():
    np.random.seed(2024)
    ours = LearnedPositionEmbedding(32, 8, seed=None, dtype=np.float64)
    after_ours = np.random.randn(3)
    np.random.seed(2024)
    ref = Reference(32, 8, seed=None)
    after_ref = np.random.randn(3)
    assert ours.embeddings.tobytes() == ref.embeddings.tobytes()
    assert np.array_equal(after_ours, after_ref)


def test_unseeded_tables_differ():
    a = LearnedPositionEmbedding(8, 4)
    b = LearnedPositionEmbedding(8, 4)
    assert not np.array_equal(a.embeddings, b.embeddings)


@pytest.fixture(scope="module")
def pair():
    return (
        LearnedPositionEmbedding(50, 6, seed=5, dtype=np.float64),
        Reference(50, 6, seed=5),
    )


def _same(ours, ref):
    ours_arr, ref_arr = np.asarray(ours), np.asarray(ref)
    assert ours_arr.shape == ref_arr.shape
    assert ours_arr.dtype == ref_arr.dtype
    assert ours_arr.tobytes() == ref_arr.tobytes()


@pytest.mark.parametrize(
    "positions",
    [
        0,
        49,
        -1,
        -50,
        7,
        np.int64(3),
        np.uint8(4),
        np.array(5),
        np.array(-50),
        [],
        [[]],
        [0],
        [1, 1, 1],
        [[1, 2], [3, -4]],
        list(range(50)),
        np.arange(50)[::-1],
        np.arange(10).reshape(2, 5),
        np.zeros((0, 3), dtype=np.int32),
        np.zeros((2, 0), dtype=np.uint16),
    ],
    ids=repr,
)
def test_integer_positions_equal_reference(pair, positions):
    ours, ref = pair
    _same(ours(positions), ref(positions))


@pytest.mark.parametrize(
    "positions",
    [
        slice(None),
        slice(2, 9),
        slice(None, None, -3),
        slice(45, 100),
        Ellipsis,
        None,
        np.arange(50) % 3 == 0,
        [True] * 25 + [False] * 25,
        np.zeros(50, bool),
        (slice(None), 0),
        (slice(2, 5), slice(1, 3)),
        (3, 2),
        (Ellipsis, 1),
        (np.array([1, 2]), np.array([0, 5])),
        (None, 3),
        ([1, 2],),
        np.True_,
    ],
    ids=repr,
)
def test_other_numpy_indices_equal_reference(pair, positions):
    ours, ref = pair
    expected = ref(positions)
    got = ours(positions)
    _same(got, expected)
    if isinstance(got, np.ndarray):
        assert not np.shares_memory(got, ours.embeddings)


def test_scalar_returns_a_copy():
    pe = LearnedPositionEmbedding(10, 4, seed=0)
    row = pe(3)
    assert row.shape == (4,)
    row[:] = 123.0
    assert not np.any(pe.embeddings[3] == 123.0)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    n_rows=st.integers(1, 40),
    d=st.integers(1, 20),
    dtype=st.sampled_from([np.float32, np.float64]),
    index_dtype=st.sampled_from(INDEX_DTYPES),
)
def test_lookup_property(data, n_rows, d, dtype, index_dtype):
    pe = LearnedPositionEmbedding(n_rows, d, seed=1, dtype=dtype)
    info = np.iinfo(index_dtype)
    lo = max(-n_rows, int(info.min))
    hi = min(n_rows - 1, int(info.max))
    positions = data.draw(
        hnp.arrays(
            index_dtype,
            hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
            elements=st.integers(lo, hi),
        )
    )
    expected = pe.embeddings[positions]
    got = pe(positions)
    assert got.shape == positions.shape + (d,)
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_lookup_large_any_threads(threads):
    n_rows, d = 300, 257
    table = Reference(n_rows, d, seed=9).embeddings
    positions = np.random.RandomState(0).randint(-n_rows, n_rows, size=(40, 33))
    got = cposembed.lookup(table, positions, num_threads=threads)
    assert got.tobytes() == table[positions].tobytes()
