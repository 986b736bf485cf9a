"""TokenPositionEmbedding: initial draw, training, saving, pickling, checked state."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from helpers import (
    assert_same,
)

from cposembed import LearnedPositionEmbedding, TokenPositionEmbedding


# --- the class -------------------------------------------------------------
def test_initial_draw_is_documented_and_reproducible():
    m = TokenPositionEmbedding(50, 16, 8, seed=3, dtype=np.float64)
    rng = np.random.RandomState(3)
    wpe = rng.randn(16, 8) * (1.0 / np.sqrt(8))
    wte = rng.randn(50, 8) * (1.0 / np.sqrt(8))
    assert np.array_equal(m.position_embeddings, wpe)
    assert np.array_equal(m.token_embeddings, wte)
    pe = LearnedPositionEmbedding(16, 8, seed=3, dtype=np.float64)
    assert np.array_equal(m.position_embeddings, pe.embeddings)
    m32 = TokenPositionEmbedding(50, 16, 8, seed=3)
    assert np.array_equal(m32.token_embeddings, wte.astype(np.float32))
    state = np.random.get_state()
    TokenPositionEmbedding(5, 4, 2, seed=1)
    assert np.array_equal(np.random.get_state()[1], state[1])  # the global RNG is untouched


def test_training_matches_a_numpy_implementation():
    rng = np.random.default_rng(7)
    m = TokenPositionEmbedding(30, 10, 6, seed=0, dtype=np.float64, padding_idx=0)
    wte, wpe = m.token_embeddings.copy(), m.position_embeddings.copy()
    assert not wte[0].any()
    for _step in range(3):
        ids = rng.integers(0, 30, (4, 10))
        ids[:, :2] = 0  # padding
        x = m(ids)
        assert np.array_equal(x, wte[ids] + wpe[:10])
        g = rng.standard_normal(x.shape)
        m.zero_grad()
        gt, gp = m.backward(g, ids)
        et, ep = np.zeros_like(wte), np.zeros_like(wpe)
        np.add.at(et, ids, g)
        np.add.at(ep, np.broadcast_to(np.arange(10), ids.shape), g)
        et[0] = 0
        assert np.array_equal(gt, et) and np.array_equal(gp, ep)
        assert gt is m.token_grad and gp is m.position_grad
        m.sgd_step(0.1)
        wte -= 0.1 * et
        wpe -= 0.1 * ep
        assert np.array_equal(m.token_embeddings, wte)
        assert np.array_equal(m.position_embeddings, wpe)
    assert not m.token_embeddings[0].any()


def test_from_pretrained_save_load_and_pickle(tmp_path):
    rng = np.random.default_rng(8)
    wte = rng.standard_normal((20, 4))
    wpe = rng.standard_normal((7, 4)).astype(">f4")
    m = TokenPositionEmbedding.from_pretrained(wte, wpe, padding_idx=-1)
    assert m.padding_idx == 19 and m.dtype == np.float32
    assert np.array_equal(m.token_embeddings, wte.astype(np.float32))
    m.backward(np.ones((1, 2, 4)), [[3, 19]])
    path = tmp_path / "layer.bin"
    m.save(path)
    back = TokenPositionEmbedding.load(path)
    assert np.array_equal(back.token_embeddings, m.token_embeddings)
    assert np.array_equal(back.position_embeddings, m.position_embeddings)
    assert back.padding_idx == 19 and back.token_grad is None
    again = pickle.loads(pickle.dumps(m))
    assert np.array_equal(again.token_grad, m.token_grad)
    assert np.array_equal(again.position_grad, m.position_grad)
    again.sgd_step(1.0)
    m.sgd_step(1.0)
    assert np.array_equal(again.token_embeddings, m.token_embeddings)
    with pytest.raises(ValueError, match="embed_dim"):
        TokenPositionEmbedding.from_pretrained(wte, wpe[:, :3])


def test_load_refuses_other_files(tmp_path):
    pe = LearnedPositionEmbedding(4, 2, seed=0)
    pe.save(tmp_path / "pe.npz")
    with pytest.raises(ValueError, match="pe.npz"):
        TokenPositionEmbedding.load(tmp_path / "pe.npz")
    m = TokenPositionEmbedding(5, 4, 2, seed=0)
    m.save(tmp_path / "m.npz")
    data = (tmp_path / "m.npz").read_bytes()
    for cut in range(0, len(data), max(1, len(data) // 40)):
        (tmp_path / "cut.npz").write_bytes(data[:cut])
        with pytest.raises(ValueError, match="cut.npz"):
            TokenPositionEmbedding.load(tmp_path / "cut.npz")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s.update(version=2),
        lambda s: s.update(extra=1),
        lambda s: s["tokens"].update(embeddings=np.zeros((3, 3))),
        lambda s: s["positions"].update(padding_idx=1),
        lambda s: s["tokens"].update(touched=np.ones(99, bool)),
        lambda s: s["positions"].update(embeddings=np.zeros((4, 2), np.float64)),
    ],
)
def test_setstate_validates_everything(mutate):
    m = TokenPositionEmbedding(5, 4, 2, seed=0)
    m.backward(np.ones((1, 2, 2), np.float32), [[1, 2]])
    state = m.__getstate__()
    state = {**state, "tokens": dict(state["tokens"]), "positions": dict(state["positions"])}
    mutate(state)
    fresh = TokenPositionEmbedding.__new__(TokenPositionEmbedding)
    with pytest.raises(ValueError):
        fresh.__setstate__(state)


def test_user_assigned_grads_are_checked_before_anything_moves():
    m = TokenPositionEmbedding(5, 4, 2, seed=0)
    wte = m.token_embeddings.copy()
    m.position_grad = np.zeros((9, 2), np.float32)
    with pytest.raises(ValueError, match="shape"):
        m.backward(np.ones((1, 2, 2), np.float32), [[1, 2]])
    assert m.token_grad is None
    m.token_grad = np.ones((5, 2), np.float32)
    with pytest.raises(ValueError, match="shape"):
        m.sgd_step(0.1)
    assert np.array_equal(m.token_embeddings, wte)


def _sub_state(table):
    return {"version": 1, "embeddings": table, "grad": None, "touched": None, "padding_idx": None}


def test_token_position_state_takes_a_numpy_integer_version():
    t = np.zeros((4, 2), np.float32)
    m = TokenPositionEmbedding.__new__(TokenPositionEmbedding)
    m.__setstate__({"version": np.int64(1), "tokens": _sub_state(t), "positions": _sub_state(t)})
    assert m.vocab_size == 4
    with pytest.raises(ValueError) as info:
        m.__setstate__(
            {"version": np.int64(9), "tokens": _sub_state(t), "positions": _sub_state(t)}
        )
    assert "np." not in str(info.value)


def test_crafted_pickles_sharing_arrays_behave_like_numpy():
    """A pickle whose grad *is* its table (pickle keeps the identity): backward and
    sgd_step follow NumPy's semantics for that aliasing, no crash."""
    table = np.random.RandomState(7).randn(6, 3).astype(np.float32)
    state = pickle.loads(
        pickle.dumps(
            {
                "version": 1,
                "embeddings": table,
                "grad": table,
                "touched": np.ones(6, bool),
                "padding_idx": None,
            }
        )
    )
    pe = LearnedPositionEmbedding.__new__(LearnedPositionEmbedding)
    pe.__setstate__(state)
    before = pe.embeddings.copy()
    pe.sgd_step(0.5)
    assert_same(pe.embeddings, before - np.float32(0.5) * before)
    # A TokenPositionEmbedding whose two tables are one array.
    shared = {"version": 1, "embeddings": table, "grad": None, "touched": None}
    shared["padding_idx"] = None
    m = TokenPositionEmbedding.__new__(TokenPositionEmbedding)
    m.__setstate__(
        pickle.loads(pickle.dumps({"version": 1, "tokens": shared, "positions": dict(shared)}))
    )
    ids = np.array([[5, 0, 2]])
    assert_same(m(ids), m.token_embeddings[ids] + m.position_embeddings[:3])
