"""The input layer's functions, embed / embed_backward, against NumPy and np.add.at."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from helpers import (
    INDEX_DTYPES,
    _deep,
    add_at,
    assert_same,
    bits,
    needs_numpy2,
    run_json,
)
from hypothesis import given
from hypothesis import strategies as st

import cposembed
from cposembed import TokenPositionEmbedding, _core, embed
from cposembed import embed_backward as backward

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
    np.add.at(et, ids, g)
    np.add.at(ep, np.broadcast_to(rows, ids.shape), g)
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


# Each call gets the arrays of test_errors_write_nothing: a.w, a.wp (the
# tables), a.g, a.p (the gradients), a.o (an out) and a.go (a grad_output).
@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda a: embed([[12]], a.w, a.wp), IndexError, "token id 12"),
        (lambda a: embed([[-13]], a.w, a.wp), IndexError, "token id -13"),
        (lambda a: embed([[0] * 9], a.w, a.wp), IndexError, "position 8"),
        (lambda a: embed([[0]], a.w, a.wp, [[9]]), IndexError, "position 9"),
        (lambda a: embed([[0.5]], a.w, a.wp), IndexError, "token_ids"),
        (lambda a: embed([[0]], a.w, a.wp[:, :3]), ValueError, "embed_dim"),
        (lambda a: embed([[0]], a.w, a.wp, offset=-1), ValueError, "offset"),
        (lambda a: embed([[0]], a.w, a.wp, [0], offset=1), ValueError, "offset"),
        (lambda a: embed([[0, 1]], a.w, a.wp, [0, 1, 2]), ValueError, "broadcast"),
        (lambda a: embed(3, a.w, a.wp), ValueError, "positions"),
        (lambda a: embed([[0]], a.w, a.wp, out=a.o), ValueError, "shape"),
        (lambda a: embed([[0]], a.w, a.wp, num_threads=0), ValueError, "num_thr"),
        (lambda a: backward(a.g, a.p, a.go, [[0, 12]]), IndexError, "token id 12"),
        (lambda a: backward(a.g, a.p, a.go, [[0, 0]], [[0, 8]]), IndexError, "position 8"),
        (lambda a: backward(a.g, a.p, np.ones((1, 3, 4)), [[0, 0]]), ValueError, "grad_output"),
        (lambda a: backward(a.g, a.p, a.go[..., :3], [[0, 0]]), ValueError, "grad_output"),
        (lambda a: backward(a.g, a.p[:, :3], a.go, [[0, 0]]), ValueError, "embed_dim"),
        (lambda a: backward(a.g.astype(int), a.p, a.go, [[0]]), TypeError, "float32 or float64"),
        (lambda a: backward(a.g, [[0.0] * 4], a.go[:, :1], [[0]]), TypeError, "ndarray"),
    ],
)
def test_errors_write_nothing(call, exc, match):
    a = SimpleNamespace(
        w=np.ones((12, 4), np.float32),
        wp=np.ones((8, 4), np.float32),
        g=np.zeros((12, 4), np.float32),
        p=np.zeros((8, 4), np.float32),
        o=np.zeros((2, 1, 4), np.float32),
        go=np.ones((1, 2, 4)),
    )
    with pytest.raises(exc, match=match):
        call(a)
    assert not a.g.any() and not a.p.any() and not a.o.any()


def test_backward_errors_leave_both_tables_untouched():
    g = np.zeros((12, 4), np.float32)
    p = np.zeros((8, 4), np.float32)
    for ids, pos in [([[0, 12]], None), ([[0, 0]], [[0, 8]]), ([[1, 2]], [[1, -9]])]:
        with pytest.raises(IndexError):
            cposembed.embed_backward(g, p, np.ones((1, 2, 4), np.float32), ids, pos)
        assert not g.any() and not p.any()


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


DTYPES = (np.float32, np.float64)


# Large enough that the kernels release the GIL and may run on several threads.
BIG = (64, 512)


@needs_numpy2
@pytest.mark.parametrize("nd", [32, 33])
@pytest.mark.parametrize("tables", ["both", "tokens", "positions", "class"])
def test_embed_backward_with_ids_of_32_or_more_axes(nd, tables):
    rng = np.random.RandomState(2)
    V, L, d = 7, 5, 3
    ids = np.array([6, 0, -7]).reshape(_deep(nd, 3))
    g = rng.randn(*ids.shape, d).astype(np.float32)
    pos = np.broadcast_to(np.arange(3), ids.shape)
    exp_t = np.zeros((V, d), np.float32)
    exp_p = np.zeros((L, d), np.float32)
    add_at(exp_t, ids, g)
    add_at(exp_p, pos, g)
    if tables == "class":
        m = TokenPositionEmbedding(V, L, d, seed=0)
        got_t, got_p = m.backward(g, ids)
        assert_same(got_t, exp_t)
        assert_same(got_p, exp_p)
        return
    got_t = None if tables == "positions" else np.zeros((V, d), np.float32)
    got_p = None if tables == "tokens" else np.zeros((L, d), np.float32)
    cposembed.embed_backward(got_t, got_p, g, ids)
    if got_t is not None:
        assert_same(got_t, exp_t)
    if got_p is not None:
        assert_same(got_p, exp_p)


def test_embed_backward_without_a_token_table_takes_an_empty_list_of_ids():
    gp = np.zeros((5, 3), np.float32)
    # The same call with a token table is fine:
    cposembed.embed_backward(np.zeros((4, 3), np.float32), gp, np.zeros((0, 3)), [])
    cposembed.embed_backward(None, gp, np.zeros((0, 3)), [])
    assert not gp.any()


@pytest.mark.parametrize("via", ["embed", "embed_backward"])
def test_embed_broadcast_error_names_the_shape_it_means(via):
    table = np.zeros((5, 3), np.float32)
    grad = np.zeros((5, 3), np.float32)
    with pytest.raises(ValueError) as info:
        if via == "embed":
            cposembed.embed([[1, 2, 3]], table, table, [0, 1])
        else:
            cposembed.embed_backward(grad, grad, np.ones((1, 3, 3)), [[1, 2, 3]], [0, 1])
    assert not grad.any()
    assert "shape[:-1]" not in str(info.value), str(info.value)
    assert "(1, 3)" in str(info.value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3), BIG])
def test_tied_and_overlapping_gradient_tables_are_sequential_add_at(dtype, shape):
    """Tied gradient tables in embed_backward: tokens first, then positions, as
    two np.add.at calls on the same memory (bitwise)."""
    rng = np.random.RandomState(4)
    B, T = shape
    V = L = T + 2
    d = 4
    ids = rng.randint(-V, V, shape)
    g = rng.randn(B, T, d).astype(dtype)
    pos = np.broadcast_to(np.arange(T), shape)
    same = rng.randn(V, d).astype(dtype)
    expect = same.copy()
    np.add.at(expect, ids, g)
    np.add.at(expect, pos, g)
    cposembed.embed_backward(same, same, g, ids)
    assert_same(same, expect)
    buf = rng.randn(V + 3, d).astype(dtype)
    expect = buf.copy()
    np.add.at(expect[:V], ids, g)
    np.add.at(expect[3 : 3 + L], pos, g)
    cposembed.embed_backward(buf[:V], buf[3 : 3 + L], g, ids)
    assert_same(buf, expect)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("target", ["token_table", "position_table", "ids", "positions"])
def test_embed_out_over_what_it_reads(dtype, target):
    """An ``out`` that overlaps either table, the ids or the positions (large
    enough to release the GIL): NumPy's result, as if computed aside."""
    rng = np.random.RandomState(5)
    B, T = BIG
    d = 4
    V, L = 11, T + 3
    n = B * T
    ids = rng.randint(-V, V, (B, T))
    pos = rng.randint(-L, L, (B, T))
    item = np.dtype(dtype).itemsize
    if target in ("token_table", "position_table"):
        rows = V if target == "token_table" else L
        buf = rng.randn(rows + n, d).astype(dtype)
        table, out = buf[:rows], buf[3 : 3 + n].reshape(B, T, d)
        wte, wpe = (table, rng.randn(L, d).astype(dtype))
        if target == "position_table":
            wte, wpe = rng.randn(V, d).astype(dtype), table
        expect = wte[ids] + wpe[pos]
        cposembed.embed(ids, wte, wpe, pos, out=out)
        assert_same(out, expect)
        return
    wte = rng.randn(V, d).astype(dtype)
    wpe = rng.randn(L, d).astype(dtype)
    raw = np.zeros(n * d * item, np.uint8)
    out = raw.view(dtype).reshape(B, T, d)
    inside = raw[: n * 8].view(np.int64).reshape(B, T)
    if target == "ids":
        inside[:] = ids
        expect = wte[ids] + wpe[pos]
        cposembed.embed(inside, wte, wpe, pos, out=out)
    else:
        inside[:] = pos
        expect = wte[ids] + wpe[pos]
        cposembed.embed(ids, wte, wpe, inside, out=out)
    assert_same(out, expect)


@pytest.mark.parametrize("order", "<>")
@pytest.mark.parametrize(
    "idtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
)
def test_token_ids_at_the_edges_in_every_integer_dtype(idtype, order):
    """-V, V-1 work; V, -V-1, int64 min/max, uint64 max raise IndexError naming
    the id, with ``out`` untouched."""
    V, L, d = 7, 5, 3
    rng = np.random.RandomState(6)
    wte = rng.randn(V, d).astype(np.float32)
    wpe = rng.randn(L, d).astype(np.float32)
    info = np.iinfo(idtype)
    dt = np.dtype(idtype).newbyteorder(order)
    for value in (-V, V - 1, V, -V - 1, info.min, info.max):
        if not info.min <= value <= info.max:
            continue
        ids = np.array([[value, 1]], dtype=dt)
        out = np.full((1, 2, d), 7, np.float32)
        if -V <= value < V:
            cposembed.embed(ids, wte, wpe, out=out)
            assert_same(out, wte[ids.astype(np.int64)] + wpe[:2])
        else:
            with pytest.raises(IndexError, match=str(int(value))):
                cposembed.embed(ids, wte, wpe, out=out)
            assert (out == 7).all()


@pytest.mark.parametrize(
    "scalar", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.intp]
)
def test_lists_of_numpy_integer_scalars(scalar):
    V, d = 7, 3
    wte = np.arange(V * d, dtype=np.float32).reshape(V, d)
    ids = [[scalar(6), scalar(0)], [scalar(1), scalar(2)]]
    assert_same(cposembed.embed(ids, wte, wte), wte[np.array(ids)] + wte[:2])
    assert_same(cposembed.lookup(wte, ids), wte[np.array(ids)])
    with pytest.raises(IndexError, match="7"):
        cposembed.embed([[scalar(7)]], wte, wte)


@pytest.mark.parametrize("L,d", [(0, 3), (5, 0), (0, 0)])
def test_empty_tables_and_empty_positions_match_numpy(L, d):
    t = np.ones((L, d), np.float32)
    for pos in ([], np.zeros((0, 2), np.int64), np.zeros((2, 0), np.int64)):
        shape = np.shape(pos)
        tok = np.ones(shape + (d,), np.float32)
        assert_same(cposembed.lookup(t, pos), t[pos])
        assert_same(cposembed.add_positions(tok, t, pos), tok + t[pos])
        assert_same(cposembed.embed(pos, t, t, pos), t[pos] + t[pos])
        g_t, g_p = np.zeros_like(t), np.zeros_like(t)
        cposembed.embed_backward(g_t, g_p, tok, pos, pos)
        assert not g_t.any() and not g_p.any()
    if L == 0:
        with pytest.raises(IndexError):
            cposembed.lookup(t, 0)


def test_huge_broadcast_ids_never_crash():
    """Stride-0 token ids of 2**40 and 2**58 elements: MemoryError/ValueError, no crash."""
    result = run_json(
        """
        import json
        import numpy as np
        import cposembed
        from numpy.lib.stride_tricks import as_strided
        t = np.zeros((8, 4), np.float32)
        out = {}
        for n in (2**40, 2**58):
            ids = as_strided(np.zeros(1, np.int64), (n,), (0,))
            ids2 = as_strided(np.zeros(1, np.int64), (n, 1), (0, 0))
            g = as_strided(np.zeros(4, np.float32), (n, 1, 4), (0, 0, 4))
            calls = {
                "embed": lambda: cposembed.embed(ids, t, t, 0),
                "embed_none": lambda: cposembed.embed(ids2, t, t),
                "embed_backward": lambda: cposembed.embed_backward(
                    np.zeros_like(t), np.zeros_like(t), g, ids2),
                "class_backward": lambda: cposembed.TokenPositionEmbedding(8, 8, 4).backward(
                    g, ids2),
            }
            for name, fn in calls.items():
                try:
                    fn()
                    out[f"{name}/{n}"] = "ok"
                except Exception as exc:
                    out[f"{name}/{n}"] = type(exc).__name__
        print(json.dumps(out))
        """
    )
    for name, outcome in result.items():
        assert outcome in ("MemoryError", "ValueError"), (name, outcome)
