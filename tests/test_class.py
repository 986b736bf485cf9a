"""The class's fused operations, gradient state, construction and pickling."""

import pickle
import weakref

import numpy as np
import pytest
from helpers import FLOAT_TABLE_DTYPES, reference_scatter

from cposembed import LearnedPositionEmbedding
from cposembed.reference import LearnedPositionEmbedding as Reference


@pytest.fixture
def pe():
    return LearnedPositionEmbedding(32, 8, seed=1)


def test_call_out(pe):
    out = np.empty((2, 3, 8), np.float32)
    positions = np.array([[0, 1, 2], [-1, -2, -3]])
    assert pe(positions, out=out) is out
    np.testing.assert_array_equal(out, pe.embeddings[positions])


def test_instances_are_open_and_subclasses_may_override_the_call(pe):
    """The call is written in C and the state lives in slots; the class still
    behaves as a plain Python class would."""
    pe.note = "mine"  # other attributes
    assert weakref.ref(pe)() is pe
    assert pe.note == "mine" and "note" in vars(pe)

    class Scaled(LearnedPositionEmbedding):
        def __call__(self, positions, *, out=None):
            return 2 * super().__call__(positions, out=out)

    sub = Scaled(32, 8, seed=1)
    np.testing.assert_array_equal(sub([3, 4]), 2 * pe.embeddings[[3, 4]])
    np.testing.assert_array_equal(sub(np.array([3]).astype(">i8")), 2 * pe.embeddings[[3]])
    bare = LearnedPositionEmbedding.__new__(LearnedPositionEmbedding)  # no table yet
    with pytest.raises(AttributeError, match="_embeddings"):
        bare(0)


def test_add_to_matches_numpy_and_decoding_offsets(pe):
    tok = np.random.RandomState(0).randn(4, 10, 8).astype(np.float32)
    np.testing.assert_array_equal(pe.add_to(tok), tok + pe.embeddings[:10])
    # Incremental decoding: one token at a time, offset = tokens already seen.
    for i in range(10):
        step = pe.add_to(tok[:, i : i + 1], offset=i)
        np.testing.assert_array_equal(step, tok[:, i : i + 1] + pe.embeddings[i])
    positions = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    np.testing.assert_array_equal(pe.add_to(tok, positions), tok + pe.embeddings[positions])


def test_add_to_in_place(pe):
    tok = np.random.RandomState(1).randn(2, 5, 8).astype(np.float32)
    expected = tok + pe.embeddings[:5]
    assert pe.add_to(tok, out=tok) is tok
    np.testing.assert_array_equal(tok, expected)


def test_backward_accumulates_like_np_add_at():
    pe = LearnedPositionEmbedding(16, 4, seed=2, dtype=np.float64)
    assert pe.grad is None
    rng = np.random.RandomState(3)
    g1 = rng.randn(3, 6, 4)
    g2 = rng.randn(5, 4)
    positions2 = np.array([0, 0, 15, -1, 7])
    pe.backward(g1)
    grad = pe.backward(g2, positions2)
    assert grad is pe.grad
    expected = reference_scatter(np.zeros((16, 4)), g1, np.arange(6))
    expected = reference_scatter(expected, g2, positions2)
    assert pe.grad.tobytes() == expected.tobytes()
    pe.zero_grad()
    assert pe.grad is not None and not pe.grad.any()
    pe.backward(g1[:, :2], offset=4)
    assert pe.grad.tobytes() == reference_scatter(np.zeros((16, 4)), g1[:, :2], [4, 5]).tobytes()


def test_backward_of_call_is_the_gradient_of_a_linear_loss():
    # loss = sum(w * pe(positions)) has d loss / d P = scatter of w.
    pe = LearnedPositionEmbedding(6, 3, seed=4, dtype=np.float64)
    positions = np.array([[1, 2], [2, 5]])
    w = np.random.RandomState(5).randn(2, 2, 3)
    pe.backward(w, positions)
    eps = 1e-6
    numeric = np.zeros((6, 3))
    for r in range(6):
        for c in range(3):
            pe.embeddings[r, c] += eps
            up = np.sum(w * pe(positions))
            pe.embeddings[r, c] -= 2 * eps
            down = np.sum(w * pe(positions))
            pe.embeddings[r, c] += eps
            numeric[r, c] = (up - down) / (2 * eps)
    np.testing.assert_allclose(pe.grad, numeric, atol=1e-8)


def test_embeddings_is_live_and_settable(pe):
    pe.embeddings[3] = 7.0
    assert np.all(pe(3) == 7.0)
    new = np.ones((32, 8))
    pe.embeddings = new
    assert pe.embeddings.dtype == np.float32 and np.all(pe(0) == 1.0)
    with pytest.raises(ValueError, match=r"\(32, 8\)"):
        pe.embeddings = np.ones((31, 8))


def test_from_pretrained_copies_into_dtype():
    wpe = np.random.RandomState(6).randn(20, 5)
    pe = LearnedPositionEmbedding.from_pretrained(wpe)
    assert pe.embeddings.dtype == np.float32
    assert (pe.max_seq_len, pe.embed_dim) == (20, 5)
    np.testing.assert_array_equal(pe.embeddings, wpe.astype(np.float32))
    wpe[0] = 0
    assert pe.embeddings[0].any()
    pe64 = LearnedPositionEmbedding.from_pretrained(np.asfortranarray(wpe), dtype=np.float64)
    assert pe64.embeddings.flags.c_contiguous
    assert pe64.embeddings.tobytes() == np.ascontiguousarray(wpe).tobytes()


@pytest.mark.parametrize("dtype", FLOAT_TABLE_DTYPES)
def test_pickle_round_trip_keeps_grad(dtype):
    pe = LearnedPositionEmbedding(10, 4, seed=7, dtype=dtype)
    pe.backward(np.ones((2, 3, 4)))
    clone = pickle.loads(pickle.dumps(pe))
    assert clone.embeddings.tobytes() == pe.embeddings.tobytes()
    assert clone.grad.tobytes() == pe.grad.tobytes()
    assert clone.dtype == dtype and clone.grad.dtype == pe.grad.dtype
    np.testing.assert_array_equal(clone([1, 2]), pe([1, 2]))


def test_reference_attributes_are_ints_and_repr():
    pe = LearnedPositionEmbedding(np.int64(12), 4)
    ref = Reference(12, 4, seed=0)
    assert type(pe.max_seq_len) is int and pe.max_seq_len == ref.max_seq_len
    assert "max_seq_len=12" in repr(pe) and "float32" in repr(pe)
