"""The classes on float16 and bfloat16 tables: the seed's draw, lookups and adds,
float32 master gradients, sgd_step's bits, the optimizers, save/load and pickle.

Every expected value is computed here with NumPy and ml_dtypes (``astype``,
``np.add.at``, float32 arithmetic), never with the package's own output.
"""

from __future__ import annotations

import io
import pickle
import zipfile

import ml_dtypes
import numpy as np
import pytest
from helpers import HALF_DTYPES, same_bits, tuned

import cposembed
from cposembed import SGD, Adam, AdamW, LearnedPositionEmbedding, TokenPositionEmbedding
from cposembed.reference import LearnedPositionEmbedding as Reference

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.float32


def half_ids(dtype):
    return "bfloat16" if np.dtype(dtype) == BF16 else "float16"


half = pytest.mark.parametrize("dtype", HALF_DTYPES, ids=half_ids)


def sgd_rows(table, grad, lr):
    """A half table's SGD rule: T(float32(row) - float32(lr) * grad), by NumPy."""
    return (table.astype(F32) - F32(lr) * grad.astype(F32)).astype(table.dtype)


# -- the dtype argument ------------------------------------------------------------
@pytest.mark.parametrize(
    "given, want",
    [
        (np.float16, F16),
        (F16, F16),
        ("float16", F16),
        ("f2", F16),
        ("half", F16),
        (ml_dtypes.bfloat16, BF16),
        (BF16, BF16),
        ("bfloat16", BF16),
    ],
)
def test_dtype_argument_takes_half_dtypes_in_every_spelling(given, want):
    assert LearnedPositionEmbedding(4, 3, seed=0, dtype=given).dtype == want
    assert TokenPositionEmbedding(5, 4, 3, seed=0, dtype=given).dtype == want
    assert LearnedPositionEmbedding.from_pretrained(np.ones((2, 3)), dtype=given).dtype == want


@pytest.mark.parametrize(
    "bad", ["bfloat", "bf16", "float8_e4m3fn", ml_dtypes.float8_e5m2, "V2", ">f2", np.int16]
)
def test_bad_dtypes_name_the_four(bad):
    for build in (
        lambda: LearnedPositionEmbedding(4, 3, dtype=bad),
        lambda: TokenPositionEmbedding(5, 4, 3, dtype=bad),
        lambda: LearnedPositionEmbedding.from_pretrained(np.ones((2, 3)), dtype=bad),
    ):
        with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64; got"):
            build()


# -- the seed's draw ------------------------------------------------------------------
@half
@pytest.mark.parametrize("seed", [0, 7, 123])
def test_draw_is_the_reference_table_astype(dtype, seed):
    pe = LearnedPositionEmbedding(33, 17, seed=seed, dtype=dtype)
    assert same_bits(pe.embeddings, Reference(33, 17, seed=seed).embeddings.astype(dtype))


@half
def test_draw_with_seed_none_follows_the_global_rng(dtype):
    np.random.seed(5)
    pe = LearnedPositionEmbedding(6, 4, dtype=dtype)
    np.random.seed(5)
    assert same_bits(pe.embeddings, Reference(6, 4).embeddings.astype(dtype))


@half
def test_token_position_draw_is_one_stream_astype(dtype):
    m = TokenPositionEmbedding(50, 12, 8, seed=4, dtype=dtype, padding_idx=3)
    rng = np.random.RandomState(4)
    positions = rng.randn(12, 8) * (1.0 / np.sqrt(8))
    tokens = rng.randn(50, 8) * (1.0 / np.sqrt(8))
    tokens[3] = 0
    assert same_bits(m.position_embeddings, positions.astype(dtype))
    assert same_bits(m.token_embeddings, tokens.astype(dtype))


@half
def test_padding_row_of_a_half_table_starts_at_zero(dtype):
    pe = LearnedPositionEmbedding(8, 4, seed=2, dtype=dtype, padding_idx=-3)
    want = Reference(8, 4, seed=2).embeddings.astype(dtype)
    want[5] = 0
    assert same_bits(pe.embeddings, want)


# -- forward: lookups and adds keep NumPy's dtype and bits -----------------------------
@half
def test_lookup_and_add_are_numpys(dtype):
    pe = LearnedPositionEmbedding(16, 8, seed=1, dtype=dtype)
    table = pe.embeddings.copy()
    positions = np.array([[3, 0, 15, -1], [3, 3, 2, 1]])
    assert same_bits(pe(positions), table[positions])
    rng = np.random.default_rng(0)
    for tok_dtype in (dtype, np.float32, np.float64):
        tok = rng.standard_normal((2, 4, 8)).astype(tok_dtype)
        assert same_bits(pe.add_to(tok, positions), tok + table[positions])
        assert same_bits(pe.add_to(tok, offset=5), tok + table[5:9])
    # half + half: in float32, rounded once
    tok = rng.standard_normal((2, 4, 8)).astype(dtype)
    want = (tok.astype(F32) + table[positions].astype(F32)).astype(dtype)
    assert same_bits(pe.add_to(tok, positions), want)


@half
@pytest.mark.parametrize("table_dtype", [np.float32, np.float64])
def test_half_tokens_into_a_wider_table_are_numpys(dtype, table_dtype):
    pe = LearnedPositionEmbedding(16, 8, seed=1, dtype=table_dtype)
    table = pe.embeddings.copy()
    tok = np.random.default_rng(2).standard_normal((3, 5, 8)).astype(dtype)
    got = pe.add_to(tok, offset=2)
    assert same_bits(got, tok + table[2:7])
    assert same_bits(got, tok.astype(table_dtype) + table[2:7])  # exact widening
    out = np.empty((3, 5, 8), table_dtype)
    assert pe.add_to(tok, [[0], [5], [15]], out=out) is out
    assert same_bits(out, tok + table[[[0], [5], [15]]])


def test_add_of_float16_with_bfloat16_is_a_type_error():
    pe = LearnedPositionEmbedding(8, 4, seed=0, dtype="bfloat16")
    before = pe.embeddings.copy()
    tok = np.ones((1, 3, 4), np.float16)
    with pytest.raises(TypeError, match="float16 with bfloat16.*got token_embeddings"):
        pe.add_to(tok)
    with pytest.raises(TypeError, match="float16 with bfloat16"):
        cposembed.add_positions(tok.astype(BF16), np.ones((8, 4), F16))
    with pytest.raises(TypeError, match="token_table and position_table must not mix"):
        cposembed.embed([[1, 2]], np.ones((5, 4), F16), np.ones((8, 4), BF16))
    assert same_bits(pe.embeddings, before)


@half
def test_token_position_call_is_numpys(dtype):
    m = TokenPositionEmbedding(40, 10, 6, seed=3, dtype=dtype)
    wte, wpe = m.token_embeddings.copy(), m.position_embeddings.copy()
    ids = np.array([[5, 39, 5, 0], [1, 2, 3, 4]])
    want = (wte[ids].astype(F32) + wpe[:4].astype(F32)).astype(dtype)
    assert same_bits(m(ids), want)
    assert same_bits(m(ids), wte[ids] + wpe[:4])
    positions = np.array([9, 0, 9, 1])
    assert same_bits(m(ids, positions), wte[ids] + wpe[positions])


# -- backward: float32 master gradients --------------------------------------------
@half
@pytest.mark.parametrize("g_dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_backward_keeps_a_float32_gradient_that_is_np_add_at(dtype, g_dtype):
    pe = LearnedPositionEmbedding(12, 5, seed=0, dtype=dtype, padding_idx=4)
    rng = np.random.default_rng(1)
    positions = np.array([[1, 4, 1, 11], [0, 1, 1, 4]])
    g = rng.standard_normal((2, 4, 5)).astype(g_dtype)
    grad = pe.backward(g, positions)
    assert grad is pe.grad and grad.dtype == np.float32
    want = np.zeros((12, 5), np.float32)
    np.add.at(want, positions, g)
    want[4] = 0
    assert same_bits(grad, want)
    pe.backward(g[:, :2], offset=3)
    np.add.at(want, np.broadcast_to([3, 4], (2, 2)), g[:, :2])
    want[4] = 0
    assert same_bits(pe.grad, want)


def test_float16_grad_output_into_a_bfloat16_table():
    pe = LearnedPositionEmbedding(6, 3, seed=0, dtype="bfloat16")
    pe.grad = np.zeros((6, 3), BF16)  # a bfloat16 gradient table, assigned
    g = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float16)
    want = np.zeros((6, 3), BF16)
    np.add.at(want, [0, 5, 0, 1], g)
    pe.backward(g, [0, 5, 0, 1])  # np.add.at's bits (the contract allows a TypeError too)
    assert same_bits(pe.grad, want)


@half
def test_token_position_backward_keeps_float32_gradients(dtype):
    m = TokenPositionEmbedding(30, 8, 4, seed=0, dtype=dtype, padding_idx=7)
    ids = np.array([[7, 3, 3, 29], [1, 7, 0, 3]])
    g = np.random.default_rng(3).standard_normal((2, 4, 4)).astype(dtype)
    token_grad, position_grad = m.backward(g, ids)
    assert token_grad.dtype == position_grad.dtype == np.float32
    want_t = np.zeros((30, 4), np.float32)
    np.add.at(want_t, ids, g)
    want_t[7] = 0
    want_p = np.zeros((8, 4), np.float32)
    np.add.at(want_p, np.broadcast_to(np.arange(4), ids.shape), g)
    assert same_bits(token_grad, want_t)
    assert same_bits(position_grad, want_p)


@half
def test_assigned_half_gradient_is_accumulated_as_np_add_at(dtype):
    pe = LearnedPositionEmbedding(6, 3, seed=0, dtype=dtype)
    pe.grad = np.full((6, 3), 2048, dtype)
    g = np.ones((100, 3), dtype)
    pe.backward(g, np.zeros(100, np.int64))
    want = np.full((6, 3), 2048, dtype)
    np.add.at(want, np.zeros(100, np.int64), g)
    assert pe.grad.dtype == dtype and same_bits(pe.grad, want)
    if dtype == F16:  # 2048 + 1 is a tie in float16: each add rounds back to 2048
        assert (pe.grad[0] == 2048).all()


# -- sgd_step ----------------------------------------------------------------------------
def tie_cases(dtype, n):
    """Rows, gradients and a rate whose float32 update lands where float64 would round
    to another ``dtype`` value (so a step computed in float64, or with a fused
    multiply-add, would show)."""
    rng = np.random.default_rng(11)
    lr = 0.37
    t = rng.standard_normal(2_000_000).astype(dtype)
    g = rng.standard_normal(2_000_000).astype(np.float32)
    f32 = (t.astype(F32) - F32(lr) * g).astype(dtype)
    f64 = (t.astype(np.float64) - np.float64(F32(lr)) * g.astype(np.float64)).astype(dtype)
    differ = np.flatnonzero(f32.view(np.uint16) != f64.view(np.uint16))[:n]
    assert differ.size == n, "too few values near a tie found"
    return t[differ], g[differ], lr


@half
@pytest.mark.parametrize("n_rows", [40, 3000])
@pytest.mark.parametrize("serial_below", [None, 64])  # both sides of the serial threshold
def test_sgd_step_is_float32_then_one_rounding(dtype, n_rows, serial_below):
    pe = LearnedPositionEmbedding(n_rows, 16, seed=0, dtype=dtype, padding_idx=1)
    t, g_tie, lr = tie_cases(dtype, 16)
    pe.embeddings[2] = t
    rng = np.random.default_rng(4)
    positions = np.concatenate([[2, 1, 5], rng.integers(3, n_rows, size=n_rows // 3)])
    g = rng.standard_normal((positions.size, 16)).astype(np.float32)
    g[0] = g_tie
    pe.backward(g, positions)
    table = pe.embeddings.copy()
    grad = pe.grad.copy()
    for threads in (1, 2):
        pe.embeddings = table
        before = cposembed.get_num_threads()
        cposembed.set_num_threads(threads)
        try:
            with tuned(serial_below=serial_below):
                pe.sgd_step(lr)
        finally:
            cposembed.set_num_threads(before)
        want = table.copy()
        rows = np.unique(positions[positions != 1])
        want[rows] = sgd_rows(table[rows], grad[rows], lr)
        assert same_bits(pe.embeddings, want)
        assert same_bits(pe.embeddings[2], sgd_rows(t, g_tie, lr))


@half
@pytest.mark.parametrize(
    "make_grad",
    [
        lambda g: g.astype(np.float16),  # a half gradient the kernel declines
        lambda g: g.astype(ml_dtypes.bfloat16),
        lambda g: np.asfortranarray(g),  # float32, another layout
        lambda g: g.astype(">f4"),
    ],
    ids=["float16", "bfloat16", "fortran", "big-endian"],
)
def test_sgd_step_on_an_assigned_gradient_gives_the_same_rule(dtype, make_grad):
    pe = LearnedPositionEmbedding(7, 5, seed=0, dtype=dtype)
    grad = make_grad(np.random.default_rng(5).standard_normal((7, 5)).astype(np.float32))
    pe.grad = grad
    table = pe.embeddings.copy()
    pe.sgd_step(0.25)
    assert same_bits(pe.embeddings, sgd_rows(table, grad, 0.25))


@half
def test_token_position_sgd_step(dtype):
    m = TokenPositionEmbedding(20, 6, 4, seed=1, dtype=dtype)
    ids = np.array([[4, 4, 19], [0, 2, 4]])
    m.backward(np.random.default_rng(6).standard_normal((2, 3, 4)).astype(dtype), ids)
    wte, wpe = m.token_embeddings.copy(), m.position_embeddings.copy()
    tg, pg = m.token_grad.copy(), m.position_grad.copy()
    m.sgd_step(0.5)
    want_t, want_p = wte.copy(), wpe.copy()
    rows = np.unique(ids)
    want_t[rows] = sgd_rows(wte[rows], tg[rows], 0.5)
    want_p[:3] = sgd_rows(wpe[:3], pg[:3], 0.5)
    assert same_bits(m.token_embeddings, want_t)
    assert same_bits(m.position_embeddings, want_p)


# -- optimizers: float32 state, the table rounded once per step -----------------------
OPTIMIZERS = [
    (SGD, {"lr": 0.1}),
    (SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    (Adam, {"lr": 0.01}),
    (AdamW, {"lr": 0.01}),
]


@half
@pytest.mark.parametrize("opt_class, hyper", OPTIMIZERS, ids=["sgd", "momentum", "adam", "adamw"])
def test_optimizer_on_a_half_table_is_the_float32_step_rounded_once(dtype, opt_class, hyper):
    half_pe = LearnedPositionEmbedding(10, 4, seed=0, dtype=dtype, padding_idx=9)
    # A float32 twin holding the same values takes the same float32 steps.
    twin = LearnedPositionEmbedding.from_pretrained(half_pe.embeddings, padding_idx=9)
    half_opt, twin_opt = opt_class(half_pe, **hyper), opt_class(twin, **hyper)
    rng = np.random.default_rng(7)
    for _ in range(3):
        positions = rng.integers(0, 10, size=6)
        g = rng.standard_normal((6, 4)).astype(np.float32)
        for pe, opt in ((half_pe, half_opt), (twin, twin_opt)):
            pe.zero_grad()
            pe.backward(g, positions)
            opt.step()
        assert same_bits(half_pe.embeddings, twin.embeddings.astype(dtype))
        # the twin continues from the rounded table, as the half table does
        twin.embeddings = half_pe.embeddings
        half_state = half_opt.state_dict()["state"]["embeddings"]
        twin_state = twin_opt.state_dict()["state"]["embeddings"]
        for name, value in half_state.items():
            assert value.dtype == twin_state[name].dtype
            if name != "rows":
                assert value.dtype == np.float32


@half
@pytest.mark.parametrize("opt_class, hyper", OPTIMIZERS, ids=["sgd", "momentum", "adam", "adamw"])
def test_fused_backward_equals_unfused_on_half_tables(dtype, opt_class, hyper):
    rng = np.random.default_rng(8)
    steps = [
        (rng.integers(0, 25, size=(2, 5)), rng.standard_normal((2, 5, 4)).astype(np.float32))
        for _ in range(3)
    ]
    layers = [TokenPositionEmbedding(25, 5, 4, seed=2, dtype=dtype, padding_idx=0) for _ in "ab"]
    opts = [opt_class(m, **hyper) for m in layers]
    for ids, g in steps:
        layers[0].zero_grad()
        layers[0].backward(g, ids)
        opts[0].step()
        layers[1].backward(g, ids, optimizer=opts[1])
    assert same_bits(layers[0].token_embeddings, layers[1].token_embeddings)
    assert same_bits(layers[0].position_embeddings, layers[1].position_embeddings)
    assert layers[0].token_embeddings.dtype == dtype


# -- save / load / pickle / from_pretrained --------------------------------------------
def special_table(dtype):
    pe = LearnedPositionEmbedding(9, 4, seed=3, dtype=dtype, padding_idx=2)
    pe.embeddings[0, 0] = -0.0
    pe.embeddings[0, 1] = np.nan
    pe.embeddings[0, 2] = np.inf
    pe.embeddings[0, 3] = ml_dtypes.finfo(dtype).smallest_subnormal
    return pe


@half
def test_save_load_round_trip_keeps_the_dtype(tmp_path, dtype):
    pe = special_table(dtype)
    path = tmp_path / "pe.npz"
    pe.save(path)
    back = LearnedPositionEmbedding.load(path)
    assert back.dtype == dtype and same_bits(back.embeddings, pe.embeddings)
    assert back.padding_idx == 2
    with zipfile.ZipFile(path) as archive:
        assert str(np.load(archive.open("dtype.npy"))) == np.dtype(dtype).name
    m = TokenPositionEmbedding(11, 9, 4, seed=0, dtype=dtype, padding_idx=1)
    f = io.BytesIO()
    m.save(f)
    f.seek(0)
    m_back = TokenPositionEmbedding.load(f)
    assert m_back.dtype == dtype and m_back.padding_idx == 1
    assert same_bits(m_back.token_embeddings, m.token_embeddings)
    assert same_bits(m_back.position_embeddings, m.position_embeddings)


def _archive(**members):
    f = io.BytesIO()
    np.savez(f, **members)
    f.seek(0)
    return f


def _members(table, dtype_name):
    return {
        "kind": np.array("cposembed.LearnedPositionEmbedding"),
        "format_version": np.array(1),
        "embeddings": table,
        "dtype": np.array(dtype_name),
        "padding_idx": np.array(-1),
    }


def test_a_saved_bfloat16_table_is_two_byte_void_read_back_by_its_name():
    table = np.arange(8, dtype=np.float32).reshape(2, 4).astype(BF16)
    back = LearnedPositionEmbedding.load(_archive(**_members(table, "bfloat16")))
    assert same_bits(back.embeddings, table)
    # 2-byte void under another name, or other void, is refused
    bits = table.view(np.uint16).view("V2")
    for members, words in [
        (_members(bits, "float16"), "says 'float16'"),
        (_members(np.zeros((2, 2), "V4"), "bfloat16"), "dtype"),
        (_members(np.zeros((2, 2), [("a", "<u2")]), "bfloat16"), "dtype"),
    ]:
        with pytest.raises(ValueError, match=words):
            LearnedPositionEmbedding.load(_archive(**members))
    no_name = _members(table, "bfloat16")
    del no_name["dtype"]
    with pytest.raises(ValueError, match="bfloat16"):
        LearnedPositionEmbedding.load(_archive(**no_name))


@half
def test_pickle_keeps_the_dtype_and_the_float32_gradient(dtype):
    pe = special_table(dtype)
    pe.backward(np.ones((3, 4), np.float32), [0, 5, 5])
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(pe, protocol=protocol))
        assert back.dtype == dtype and same_bits(back.embeddings, pe.embeddings)
        assert back.grad.dtype == np.float32 and same_bits(back.grad, pe.grad)
        back.sgd_step(0.5)
        want = pe.embeddings.copy()
        want[[0, 5]] = sgd_rows(pe.embeddings[[0, 5]], pe.grad[[0, 5]], 0.5)
        assert same_bits(back.embeddings, want)  # only the touched rows moved
    m = TokenPositionEmbedding(11, 9, 4, seed=0, dtype=dtype)
    m.backward(np.ones((1, 2, 4), dtype), [[3, 4]])
    m_back = pickle.loads(pickle.dumps(m))
    assert m_back.dtype == dtype
    assert same_bits(m_back.token_grad, m.token_grad) and m_back.token_grad.dtype == np.float32


@half
def test_pickled_gradient_in_another_layout_becomes_float32(dtype):
    pe = LearnedPositionEmbedding(5, 3, seed=0, dtype=dtype)
    state = pe.__getstate__()
    grad = np.asfortranarray(np.random.default_rng(9).standard_normal((5, 3)))
    state["grad"] = grad
    back = LearnedPositionEmbedding.__new__(LearnedPositionEmbedding)
    back.__setstate__(state)
    assert back.grad.dtype == np.float32 and same_bits(back.grad, grad.astype(np.float32))


def test_from_pretrained_keeps_a_bfloat16_table_bit_for_bit():
    bits = np.array([[0x7FC1, 0x0001, 0x8000, 0x3F80], [0xFF80, 0x7F7F, 0x1234, 0xFFFF]])
    table = bits.astype(np.uint16).view(BF16)
    pe = LearnedPositionEmbedding.from_pretrained(table, dtype="bfloat16")
    assert same_bits(pe.embeddings, table)
    m = TokenPositionEmbedding.from_pretrained(table, table[:1], dtype=ml_dtypes.bfloat16)
    assert same_bits(m.token_embeddings, table) and m.dtype == BF16
    # into another dtype: NumPy's conversion
    assert same_bits(LearnedPositionEmbedding.from_pretrained(table).embeddings, table.astype(F32))
    pe.embeddings = table[::-1]
    assert same_bits(pe.embeddings, table[::-1].copy())


def test_from_pretrained_reads_a_torch_bfloat16_weight():
    torch = pytest.importorskip("torch")
    weight = torch.nn.Parameter(torch.randn(6, 4).to(torch.bfloat16))
    pe = LearnedPositionEmbedding.from_pretrained(weight, dtype="bfloat16")
    want = weight.detach().view(torch.int16).numpy().view(BF16)
    assert same_bits(pe.embeddings, want)
    as_float32 = LearnedPositionEmbedding.from_pretrained(weight)
    assert same_bits(as_float32.embeddings, weight.detach().float().numpy())


@half
def test_resized_keeps_the_dtype_and_the_end_rows(dtype):
    pe = LearnedPositionEmbedding(5, 3, seed=0, dtype=dtype)
    for method in ("linear", "repeat"):
        longer = pe.resized(9, method)
        assert longer.dtype == dtype
        assert same_bits(longer.embeddings[0], pe.embeddings[0])
    assert same_bits(pe.resized(9).embeddings[-1], pe.embeddings[-1])
