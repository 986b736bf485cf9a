"""The whole input layer: embed / embed_backward against NumPy and np.add.at, and
TokenPositionEmbedding (forward, backward, learning, saving, pickle)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from helpers import INDEX_DTYPES, bits
from hypothesis import given
from hypothesis import strategies as st

import cposembed
from cposembed import LearnedPositionEmbedding, TokenPositionEmbedding, _core

FLOATS = [np.float32, np.float64]


@pytest.fixture(params=["serial", "threaded"])
def threaded(request):
    """Both sides of the serial threshold: 'threaded' lets tiny calls use threads."""
    old = _core.set_tuning(serial_below=0 if request.param == "threaded" else None)
    yield request.param
    _core.set_tuning(**old)


def _zipf_ids(rng, vocab, shape, exponent=1.2):
    p = 1.0 / np.arange(1, vocab + 1) ** exponent
    return rng.permutation(vocab)[rng.choice(vocab, size=shape, p=p / p.sum())]


def _expected_backward(gt, gp, g, ids, rows):
    et, ep = gt.copy(), gp.copy()
    np.add.at(et, ids, g.astype(et.dtype))
    np.add.at(ep, np.broadcast_to(rows, ids.shape), g.astype(ep.dtype))
    return et, ep


@st.composite
def layer_case(draw):
    vocab = draw(st.integers(1, 40))
    n_pos = draw(st.integers(1, 12))
    d = draw(st.integers(0, 9))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=1, max_size=3)))
    seed = draw(st.integers(0, 2**32 - 1))
    dtype = draw(st.sampled_from(FLOATS))
    id_dtype = draw(st.sampled_from(INDEX_DTYPES))
    rng = np.random.default_rng(seed)
    lo = 0 if np.dtype(id_dtype).kind == "u" else -vocab
    hi = min(vocab, np.iinfo(id_dtype).max + 1)
    ids = rng.integers(max(lo, np.iinfo(id_dtype).min), hi, size=shape).astype(id_dtype)
    T = shape[-1]
    mode = draw(
        st.sampled_from(
            ["none", "offset", "explicit", "row"] if T <= n_pos else ["explicit", "row"]
        )
    )
    if mode == "none":
        positions, offset, rows = None, 0, np.arange(T)
    elif mode == "offset":
        offset = draw(st.integers(0, n_pos - T))
        positions, rows = None, np.arange(offset, offset + T)
    elif mode == "explicit":
        positions = rng.integers(-n_pos, n_pos, size=shape)
        offset, rows = 0, positions
    else:  # one row of positions broadcast over the leading axes
        positions = rng.integers(-n_pos, n_pos, size=(T,))
        offset, rows = 0, positions
    wte = rng.standard_normal((vocab, d)).astype(dtype)
    wpe = rng.standard_normal((n_pos, d)).astype(dtype)
    g = rng.standard_normal(shape + (d,)).astype(dtype)
    return wte, wpe, ids, positions, offset, rows, g


@given(case=layer_case(), threads=st.sampled_from([None, 1, 2, 3, 4]))
def test_embed_matches_numpy_bitwise(case, threads):
    wte, wpe, ids, positions, offset, rows, _ = case
    want = wte[ids] + wpe[rows]
    got = cposembed.embed(ids, wte, wpe, positions, offset=offset, num_threads=threads)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(bits(got), bits(want))
    out = np.full_like(want, np.nan)
    assert cposembed.embed(ids, wte, wpe, positions, offset=offset, out=out) is out
    assert np.array_equal(bits(out), bits(want))


@given(case=layer_case(), threads=st.sampled_from([None, 1, 2, 3, 4]))
def test_embed_backward_is_np_add_at_on_each_table(case, threads):
    wte, wpe, ids, positions, offset, rows, g = case
    rng = np.random.default_rng(1)
    gt = rng.standard_normal(wte.shape).astype(wte.dtype)
    gp = rng.standard_normal(wpe.shape).astype(wpe.dtype)
    et, ep = _expected_backward(gt, gp, g, ids, rows)
    cposembed.embed_backward(gt, gp, g, ids, positions, offset=offset, num_threads=threads)
    assert np.array_equal(bits(gt), bits(et))
    assert np.array_equal(bits(gp), bits(ep))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("positions", ["none", "random"])
def test_zipf_backward_every_thread_count(threaded, dtype, threads, positions):
    """Realistic ids: a few tokens take most contributions; same bits for 1-4 threads."""
    rng = np.random.default_rng(5)
    V, L, d, B, T = 3000, 64, 24, 8, 64
    ids = _zipf_ids(rng, V, (B, T))
    assert np.bincount(ids.ravel()).max() > B * T // 20  # a heavy hitter
    pos = None if positions == "none" else rng.integers(0, L, (B, T))
    rows = np.arange(T) if pos is None else pos
    g = rng.standard_normal((B, T, d)).astype(dtype)
    gt = np.zeros((V, d), dtype)
    gp = np.zeros((L, d), dtype)
    et, ep = _expected_backward(gt, gp, g, ids, rows)
    cposembed.embed_backward(gt, gp, g, ids, pos, num_threads=threads)
    assert np.array_equal(bits(gt), bits(et)) and np.array_equal(bits(gp), bits(ep))
    wte = rng.standard_normal((V, d)).astype(dtype)
    wpe = rng.standard_normal((L, d)).astype(dtype)
    assert np.array_equal(
        cposembed.embed(ids, wte, wpe, pos, num_threads=threads), wte[ids] + wpe[rows]
    )


def test_embed_backward_either_table_may_be_none():
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 10, (3, 4))
    g = rng.standard_normal((3, 4, 5))
    gt = np.zeros((10, 5))
    gp = np.zeros((6, 5))
    et, ep = _expected_backward(gt, gp, g, ids, np.arange(4))
    cposembed.embed_backward(gt, None, g, ids)
    assert np.array_equal(gt, et)
    cposembed.embed_backward(None, gp, g, ids)
    assert np.array_equal(gp, ep)
    cposembed.embed_backward(None, None, g, ids)  # nothing to do


def test_mixed_dtypes_promote_as_numpy():
    rng = np.random.default_rng(3)
    wte = rng.standard_normal((10, 4)).astype(np.float32)
    wpe = rng.standard_normal((6, 4))
    ids = rng.integers(0, 10, (2, 3))
    got = cposembed.embed(ids, wte, wpe)
    want = wte[ids] + wpe[:3]
    assert got.dtype == np.float64 and np.array_equal(got, want)
    gt = np.zeros((10, 4), np.float32)
    gp = np.zeros((6, 4))
    g = rng.standard_normal((2, 3, 4))
    et, ep = _expected_backward(gt, gp, g, ids, np.arange(3))
    cposembed.embed_backward(gt, gp, g, ids)
    assert np.array_equal(gt, et) and np.array_equal(gp, ep)


def test_tied_tables_accumulate_tokens_then_positions():
    rng = np.random.default_rng(4)
    G = np.zeros((10, 3))
    ids = rng.integers(0, 10, (2, 5))
    g = rng.standard_normal((2, 5, 3))
    want = G.copy()
    np.add.at(want, ids, g)
    np.add.at(want[:6], np.broadcast_to(np.arange(5), (2, 5)), g)
    cposembed.embed_backward(G, G[:6], g, ids)
    assert np.array_equal(G, want)


@pytest.mark.parametrize(
    "token_dtype, position_dtype, source",
    [(t, p, s) for t in FLOATS for p in FLOATS for s in ("token table", "position table")]
    + [(t, t, "tied tables") for t in FLOATS],
)
def test_embed_backward_reads_a_grad_output_that_overlaps_a_table_before_writing(
    token_dtype, position_dtype, source
):
    # Both gradients are np.add.at with a copy of grad_output, whatever the dtypes.
    rng = np.random.default_rng(8)
    if source == "tied tables":
        gt = rng.standard_normal((10, 3)).astype(token_dtype)
        gp = gt[:6]
    else:
        gt = rng.standard_normal((10, 3)).astype(token_dtype)
        gp = rng.standard_normal((6, 3)).astype(position_dtype)
    g = (gp if source == "position table" else gt)[:4][None]  # (1, 4, 3), a view
    ids = np.array([[1, 0, 1, 2]])  # rows 0-2 of the token table: g's own memory
    g_given = g.copy()
    et, ep = gt.copy(), gp.copy()
    if source == "tied tables":
        np.add.at(et, ids, g_given)
        np.add.at(et[:6], np.arange(4)[None], g_given)
    else:
        et, ep = _expected_backward(et, ep, g_given, ids, np.arange(4))
    cposembed.embed_backward(gt, gp, g, ids)
    if source == "tied tables":
        assert bits(gt).tobytes() == bits(et).tobytes()
    else:
        assert bits(gt).tobytes() == bits(et).tobytes(), "token gradient"
        assert bits(gp).tobytes() == bits(ep).tobytes(), "position gradient"


def test_layouts_and_index_forms():
    rng = np.random.default_rng(6)
    wte = np.asfortranarray(rng.standard_normal((12, 5)))
    wpe = rng.standard_normal((8, 5)).astype(">f8")
    ids_list = [[1, -1, 3], [np.int16(4), 5, 0]]
    ids = np.array(ids_list)
    want = wte[ids] + wpe.astype("<f8")[:3]
    assert np.array_equal(cposembed.embed(ids_list, wte, wpe), want)
    assert np.array_equal(cposembed.embed(ids[:, ::-1][:, ::-1], wte, wpe), want)
    out = np.zeros((3, 2, 5)).transpose(1, 0, 2)
    cposembed.embed(ids, wte, wpe, out=out)
    assert np.array_equal(out, want)
    assert np.array_equal(cposembed.embed(np.int64(3), wte, wpe, positions=2), wte[3] + wpe[2])


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda w, wp, g, p, o: cposembed.embed([[12]], w, wp), IndexError, "token id 12"),
        (lambda w, wp, g, p, o: cposembed.embed([[-13]], w, wp), IndexError, "token id -13"),
        (lambda w, wp, g, p, o: cposembed.embed([[0] * 9], w, wp), IndexError, "position 8"),
        (lambda w, wp, g, p, o: cposembed.embed([[0]], w, wp, [[9]]), IndexError, "position 9"),
        (lambda w, wp, g, p, o: cposembed.embed([[0.5]], w, wp), IndexError, "token_ids"),
        (lambda w, wp, g, p, o: cposembed.embed([[0]], w, wp[:, :3]), ValueError, "embed_dim"),
        (lambda w, wp, g, p, o: cposembed.embed([[0]], w, wp, offset=-1), ValueError, "offset"),
        (lambda w, wp, g, p, o: cposembed.embed([[0]], w, wp, [0], offset=1), ValueError, "offset"),
        (
            lambda w, wp, g, p, o: cposembed.embed([[0, 1]], w, wp, [0, 1, 2]),
            ValueError,
            "broadcast",
        ),
        (lambda w, wp, g, p, o: cposembed.embed(3, w, wp), ValueError, "positions"),
        (lambda w, wp, g, p, o: cposembed.embed([[0]], w, wp, out=o), ValueError, "shape"),
        (
            lambda w, wp, g, p, o: cposembed.embed([[0]], w, wp, num_threads=0),
            ValueError,
            "num_thr",
        ),
        (
            lambda w, wp, g, p, o: cposembed.embed_backward(g, p, np.ones((1, 2, 4)), [[0, 12]]),
            IndexError,
            "token id 12",
        ),
        (
            lambda w, wp, g, p, o: cposembed.embed_backward(
                g, p, np.ones((1, 2, 4)), [[0, 0]], [[0, 8]]
            ),
            IndexError,
            "position 8",
        ),
        (
            lambda w, wp, g, p, o: cposembed.embed_backward(g, p, np.ones((1, 3, 4)), [[0, 0]]),
            ValueError,
            "grad_output",
        ),
        (
            lambda w, wp, g, p, o: cposembed.embed_backward(g, p, np.ones((1, 2, 3)), [[0, 0]]),
            ValueError,
            "grad_output",
        ),
        (
            lambda w, wp, g, p, o: cposembed.embed_backward(
                g, p[:, :3], np.ones((1, 2, 4)), [[0, 0]]
            ),
            ValueError,
            "embed_dim",
        ),
        (
            lambda w, wp, g, p, o: cposembed.embed_backward(
                g.astype(int), p, np.ones((1, 2, 4)), [[0]]
            ),
            TypeError,
            "float32 or float64",
        ),
        (
            lambda w, wp, g, p, o: cposembed.embed_backward(
                g, [[0.0] * 4], np.ones((1, 1, 4)), [[0]]
            ),
            TypeError,
            "ndarray",
        ),
    ],
)
def test_errors_write_nothing(call, exc, match):
    wte = np.ones((12, 4), np.float32)
    wpe = np.ones((8, 4), np.float32)
    g = np.zeros((12, 4), np.float32)
    p = np.zeros((8, 4), np.float32)
    o = np.zeros((2, 1, 4), np.float32)
    with pytest.raises(exc, match=match):
        call(wte, wpe, g, p, o)
    assert not g.any() and not p.any() and not o.any()


def test_backward_errors_leave_both_tables_untouched():
    g = np.zeros((12, 4), np.float32)
    p = np.zeros((8, 4), np.float32)
    for ids, pos in [([[0, 12]], None), ([[0, 0]], [[0, 8]]), ([[1, 2]], [[1, -9]])]:
        with pytest.raises(IndexError):
            cposembed.embed_backward(g, p, np.ones((1, 2, 4), np.float32), ids, pos)
        assert not g.any() and not p.any()


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


def test_positions_with_more_axes_than_the_ids_are_refused():
    """NumPy's result would have the extra axes; the contract says positions
    broadcast to token_ids.shape, so this is a ValueError, whatever the dtypes."""
    wte = np.ones((10, 2), np.float32)
    wpe = np.ones((8, 2), np.float32)
    ids = np.zeros(3, np.int64)
    pos = np.zeros((1, 1, 3), np.int64)
    assert _core.embed(ids, wte, wpe, pos, 0, None, None) is None
    for table in (wpe, wpe.astype(np.float64)):
        with pytest.raises(ValueError, match="broadcast"):
            cposembed.embed(ids, wte, table, pos)
    g = np.zeros((3, 2), np.float32)
    gt, gp = np.zeros_like(wte), np.zeros_like(wpe)
    assert _core.embed_backward(gt, gp, g, ids, pos, 0, None) is None
    with pytest.raises(ValueError, match="broadcast"):
        cposembed.embed_backward(gt, gp, g, ids, pos)
