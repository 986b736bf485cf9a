"""The lazy optimizers (cposembed.SGD, Adam, AdamW): against an independent NumPy
formula written here, against PyTorch where installed, fused backward against
backward + step (bitwise, any thread count), state round trips, hyper-parameter
checks, the padding row and a huge table."""

from __future__ import annotations

import pickle
import tracemalloc
import warnings

import numpy as np
import pytest
from helpers import FLOAT_TABLE_DTYPES
from hypothesis import given, settings
from hypothesis import strategies as st

import cposembed
from cposembed import SGD, Adam, AdamW, LearnedPositionEmbedding, TokenPositionEmbedding

DTYPES = [np.float32, np.float64]


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def same_state(s1, s2) -> bool:
    if s1.keys() != s2.keys():
        return False
    for key in s1:
        a, b = s1[key], s2[key]
        if isinstance(a, dict):
            if not same_state(a, b):
                return False
        elif isinstance(a, np.ndarray):
            if not same_bits(a, b):
                return False
        elif a != b:
            return False
    return True


@pytest.fixture(params=[1, 2, 4], ids=["1thread", "2threads", "4threads"])
def threads(request):
    cposembed.set_num_threads(request.param)
    yield request.param
    cposembed.set_num_threads(None)


# -- the independent formula: per row, in float64, lazy -------------------------------
class LazyReference:
    """Each optimizer's rule written per row, with dicts for the state."""

    def __init__(self, kind, **h):
        self.kind, self.h = kind, h
        self.t = 0
        self.state: dict[int, dict[str, np.ndarray]] = {}

    def step(self, table, grads):
        """``grads``: {row: summed gradient of the step}."""
        self.t += 1
        h = self.h
        for r, g in grads.items():
            p = table[r].astype(np.float64)
            g = g.astype(np.float64)
            s = self.state.setdefault(r, {})
            if self.kind == "sgd":
                g = g + h.get("weight_decay", 0.0) * p
                mom = h.get("momentum", 0.0)
                if mom:
                    if "buf" not in s:
                        s["buf"] = g.copy()
                    else:
                        s["buf"] = mom * s["buf"] + (1 - h.get("dampening", 0.0)) * g
                    g = g + mom * s["buf"] if h.get("nesterov") else s["buf"]
                p = p - h["lr"] * g
            else:
                b1, b2 = h.get("betas", (0.9, 0.999))
                lr, eps = h.get("lr", 1e-3), h.get("eps", 1e-8)
                wd = h.get("weight_decay", 1e-2 if self.kind == "adamw" else 0.0)
                if self.kind == "adamw":
                    p = p * (1 - lr * wd)
                else:
                    g = g + wd * p
                s["m"] = b1 * s.get("m", 0.0) + (1 - b1) * g
                s["v"] = b2 * s.get("v", 0.0) + (1 - b2) * g * g
                m_hat_scale = lr / (1 - b1**self.t)
                denom = np.sqrt(s["v"]) / np.sqrt(1 - b2**self.t) + eps
                p = p - m_hat_scale * s["m"] / denom
            table[r] = p


def step_grads(positions, grads, n_rows, pad=None):
    out: dict[int, np.ndarray] = {}
    for p, g in zip(np.ravel(positions), grads.reshape(-1, grads.shape[-1])):
        r = int(p) % n_rows
        if r == pad:
            continue
        out[r] = out.get(r, 0.0) + g.astype(np.float64)
    return out


def make(kind, layer, **h):
    return {"sgd": SGD, "adam": Adam, "adamw": AdamW}[kind](layer, **h)


CONFIGS = [
    ("sgd", {"lr": 0.1}),
    ("sgd", {"lr": 0.1, "momentum": 0.9}),
    ("sgd", {"lr": 0.05, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.01}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    ("adam", {"lr": 0.01}),
    ("adam", {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
    ("adam", {"lr": 0.01, "betas": (0.3, 0.9)}),  # 1 - beta1 >= 0.5: lerp's other form
    ("adamw", {"lr": 0.01}),
    ("adamw", {"lr": 0.02, "weight_decay": 0.3}),
]
CONFIG_IDS = [f"{k}-{'-'.join(map(str, h.values()))}" for k, h in CONFIGS]

# Steps touching different rows, with repeats, so that laziness shows.
STEPS = [[0, 3, 3, 7], [3, 5], [9, 0, 0, 0], [5], [1, 3, 7, 9, 2]]


@pytest.mark.parametrize("kind, h", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("fused", [False, True], ids=["step", "fused"])
def test_matches_the_lazy_formula(kind, h, fused):
    rng = np.random.default_rng(1)
    pe = LearnedPositionEmbedding(10, 6, seed=3, dtype=np.float64)
    ref_table = pe.embeddings.copy()
    opt = make(kind, pe, **h)
    ref = LazyReference(kind, **h)
    for positions in STEPS:
        g = rng.standard_normal((len(positions), 6))
        before = pe.embeddings.copy()
        if fused:
            pe.backward(g, positions, optimizer=opt)
        else:
            pe.zero_grad()
            pe.backward(g, positions)
            opt.step()
        ref.step(ref_table, step_grads(positions, g, 10))
        np.testing.assert_allclose(pe.embeddings, ref_table, rtol=1e-12, atol=1e-15)
        untouched = np.setdiff1d(np.arange(10), positions)
        assert same_bits(pe.embeddings[untouched], before[untouched])
    assert opt.step_count == len(STEPS)


def test_fused_position_step_takes_negative_positions_as_numpy_wraps_them():
    # The fused step finds its distinct rows in [0, L): negative positions reach
    # it wrapped, as the unfused backward and NumPy index them.
    g = np.arange(1, 6, dtype=np.float32)[None, :, None] * np.ones((1, 5, 4), np.float32)
    tables = []
    for pos in ([[-1, 0, -3, 5, -1]], [[7, 0, 5, 5, 7]]):
        pe = cposembed.LearnedPositionEmbedding.from_pretrained(
            np.arange(32, dtype=np.float32).reshape(8, 4)
        )
        pe.backward(g, np.array(pos), optimizer=cposembed.optim.Adam(pe, 0.1))
        tables.append(pe.embeddings)
    assert np.array_equal(tables[0], tables[1])
    assert not np.array_equal(tables[0][[7, 0, 5]], np.arange(32.0).reshape(8, 4)[[7, 0, 5]])


@pytest.mark.parametrize("kind, h", CONFIGS[:2] + CONFIGS[4:5] + CONFIGS[7:8])
def test_state_moves_only_on_touched_rows(kind, h):
    pe = LearnedPositionEmbedding(10, 3, seed=0)
    opt = make(kind, pe, **h)
    pe.backward(np.ones((2, 3)), [1, 4], optimizer=opt)
    first = opt.state_dict()["state"]["embeddings"]
    pe.backward(np.ones((1, 3)), [6], optimizer=opt)
    second = opt.state_dict()["state"]["embeddings"]
    rows = list(second["rows"])
    assert rows == ([] if kind == "sgd" and not h.get("momentum") else [1, 4, 6])
    for name in second:
        if name != "rows":  # rows 1 and 4 kept their state, bitwise
            assert same_bits(second[name][:2], first[name])


def test_sgd_without_momentum_is_sgd_step_bitwise():
    rng = np.random.default_rng(0)
    a = LearnedPositionEmbedding(20, 8, seed=1)
    b = LearnedPositionEmbedding(20, 8, seed=1)
    opt = SGD(a, 0.3)
    for _ in range(3):
        g = rng.standard_normal((5, 8)).astype(np.float32)
        pos = rng.integers(0, 20, 5)
        a.zero_grad()
        a.backward(g, pos)
        opt.step()
        b.zero_grad()
        b.backward(g, pos)
        b.sgd_step(0.3)
    assert same_bits(a.embeddings, b.embeddings)


def test_momentum_buffer_starts_at_the_rows_first_gradient_and_does_not_decay():
    pe = LearnedPositionEmbedding(4, 2, seed=0, dtype=np.float64)
    opt = SGD(pe, 1.0, momentum=0.5, dampening=0.5)
    pe.backward(np.ones((1, 2)), [0], optimizer=opt)  # buf[0] = 1 (not 0.5)
    pe.backward(np.ones((1, 2)), [1], optimizer=opt)  # buf[0] untouched
    pe.backward(np.ones((1, 2)), [0], optimizer=opt)  # buf[0] = 0.5 + 0.5
    state = opt.state_dict()["state"]["embeddings"]
    assert list(state["rows"]) == [0, 1]
    assert same_bits(state["momentum_buffer"], np.ones((2, 2)))


def test_adam_counts_every_step_for_bias_correction():
    # A row touched at step 3 only is bias-corrected with t = 3, as SparseAdam does.
    pe = LearnedPositionEmbedding(4, 1, seed=0, dtype=np.float64)
    start = pe.embeddings[3, 0]
    opt = Adam(pe, 0.1, eps=0.0)
    opt.step()  # no gradient yet: counts, moves nothing
    pe.backward(np.ones((1, 1)), [0], optimizer=opt)
    pe.backward(np.ones((1, 1)), [3], optimizer=opt)
    assert opt.step_count == 3
    m, v = 0.1, 0.001
    expected = start - 0.1 / (1 - 0.9**3) * m / (np.sqrt(v) / np.sqrt(1 - 0.999**3))
    assert pe.embeddings[3, 0] == pytest.approx(expected, rel=1e-12)


# -- fused equals unfused, bitwise ----------------------------------------------------
def run_position(kind, h, dtype, fused, steps, pad=None):
    pe = LearnedPositionEmbedding(30, 5, seed=2, dtype=dtype, padding_idx=pad)
    opt = make(kind, pe, **h)
    for g, positions in steps:
        if fused:
            assert pe.backward(g, positions, optimizer=opt) is None
            assert pe.grad is None
        else:
            pe.zero_grad()
            pe.backward(g, positions)
            opt.step()
    return pe, opt


def run_layer(kind, h, dtype, fused, steps, pad=None):
    m = TokenPositionEmbedding(40, 6, 5, seed=2, dtype=dtype, padding_idx=pad)
    opt = make(kind, m, **h)
    for g, ids in steps:
        if fused:
            assert m.backward(g, ids, optimizer=opt) is None
            assert m.token_grad is None and m.position_grad is None
        else:
            m.zero_grad()
            m.backward(g, ids)
            opt.step()
    return m, opt


@pytest.mark.parametrize("dtype", FLOAT_TABLE_DTYPES)
@pytest.mark.parametrize("kind, h", CONFIGS, ids=CONFIG_IDS)
def test_fused_equals_unfused_bitwise_any_thread_count(kind, h, dtype, threads):
    rng = np.random.default_rng(7)
    pos_steps = [
        (rng.standard_normal((4, 9, 5)).astype(dtype), rng.integers(-30, 30, (4, 9)))
        for _ in range(4)
    ]
    a, oa = run_position(kind, h, dtype, False, pos_steps, pad=3)
    b, ob = run_position(kind, h, dtype, True, pos_steps, pad=3)
    assert same_bits(a.embeddings, b.embeddings)
    assert same_state(oa.state_dict(), ob.state_dict())
    cposembed.set_num_threads(1)
    c, _ = run_position(kind, h, dtype, True, pos_steps, pad=3)
    assert same_bits(b.embeddings, c.embeddings)
    cposembed.set_num_threads(threads)

    layer_steps = [
        (rng.standard_normal((3, 6, 5)).astype(dtype), rng.integers(0, 40, (3, 6)))
        for _ in range(4)
    ]
    a2, oa2 = run_layer(kind, h, dtype, False, layer_steps, pad=0)
    b2, ob2 = run_layer(kind, h, dtype, True, layer_steps, pad=0)
    assert same_bits(a2.token_embeddings, b2.token_embeddings)
    assert same_bits(a2.position_embeddings, b2.position_embeddings)
    assert same_state(oa2.state_dict(), ob2.state_dict())


def test_fused_takes_what_backward_takes():
    # offset, positions=None, broadcast positions, a float64 gradient into float32
    rng = np.random.default_rng(0)
    g = rng.standard_normal((2, 4, 3))
    for kwargs in [{"offset": 5}, {"positions": np.array([1, -1, 1, 0])}, {}]:
        a = LearnedPositionEmbedding(12, 3, seed=0)
        b = LearnedPositionEmbedding(12, 3, seed=0)
        oa, ob = Adam(a, 0.1), Adam(b, 0.1)
        a.backward(g, **kwargs)
        oa.step()
        b.backward(g, **kwargs, optimizer=ob)
        assert same_bits(a.embeddings, b.embeddings)
        assert same_state(oa.state_dict(), ob.state_dict())


def test_fused_layer_step_takes_what_its_entry_refuses_as_the_unfused_step_does():
    # A Fortran-ordered, a float64 and a read-only overlapping gradient, ids as a
    # nested list and positions that broadcast: the route normalises them.
    rng = np.random.default_rng(0)
    base = rng.standard_normal((2, 5, 4))
    ids = [[1, 2, 2, 3, 49], [5, 5, 5, 1, 0]]
    for g, kwargs in [
        (np.asfortranarray(base.astype(np.float32)), {}),
        (base, {"positions": np.array([4, 3, 2, 1, 0])}),
        (base.astype(np.float32)[:, ::-1], {"offset": 3}),
    ]:
        a = TokenPositionEmbedding(50, 16, 4, seed=0)
        b = TokenPositionEmbedding(50, 16, 4, seed=0)
        oa, ob = Adam(a, 0.1), Adam(b, 0.1)
        a.backward(np.ascontiguousarray(g), np.array(ids), **kwargs)
        oa.step()
        b.backward(g, ids, **kwargs, optimizer=ob)
        assert same_bits(a.token_embeddings, b.token_embeddings)
        assert same_bits(a.position_embeddings, b.position_embeddings)
        assert same_state(oa.state_dict(), ob.state_dict())
    c = TokenPositionEmbedding(50, 16, 4, seed=0)
    table = c.token_embeddings  # a gradient over the table the step writes
    c.backward(table[:10].reshape(2, 5, 4), ids, optimizer=Adam(c, 0.1))
    d = TokenPositionEmbedding(50, 16, 4, seed=0)
    od = Adam(d, 0.1)
    d.backward(d.token_embeddings[:10].reshape(2, 5, 4).copy(), ids)
    od.step()
    assert same_bits(c.token_embeddings, d.token_embeddings)


def test_fused_leaves_an_accumulated_grad_alone():
    pe = LearnedPositionEmbedding(8, 2, seed=0)
    opt = SGD(pe, 0.1)
    grad = pe.backward(np.ones((2, 2)), [1, 2]).copy()
    pe.backward(np.ones((2, 2)), [5, 6], optimizer=opt)
    assert same_bits(pe.grad, grad)


def test_fused_with_bad_input_writes_nothing():
    m = TokenPositionEmbedding(10, 4, 2, seed=0)
    opt = Adam(m, 0.1)
    before = (m.token_embeddings.copy(), m.position_embeddings.copy())
    with pytest.raises(IndexError):
        m.backward(np.ones((1, 3, 2)), [[1, 2, 10]], optimizer=opt)
    with pytest.raises(ValueError):
        m.backward(np.ones((1, 3, 3)), [[1, 2, 3]], optimizer=opt)
    with pytest.raises(IndexError):
        m.backward(np.ones((1, 5, 2)), [[1, 2, 3, 4, 5]], optimizer=opt)  # T > L
    pe = LearnedPositionEmbedding(4, 2, seed=0)
    with pytest.raises(ValueError, match="another layer"):
        m.backward(np.ones((1, 3, 2)), [[1, 2, 3]], optimizer=Adam(pe))
    with pytest.raises(TypeError, match="optimizer"):
        pe.backward(np.ones((1, 2)), [0], optimizer="adam")
    assert same_bits(m.token_embeddings, before[0])
    assert same_bits(m.position_embeddings, before[1])
    assert opt.step_count == 0
    assert opt.state_dict()["state"]["token_embeddings"]["rows"].size == 0


def test_fused_on_empty_input_counts_a_step_and_moves_nothing():
    pe = LearnedPositionEmbedding(4, 2, seed=0)
    before = pe.embeddings.copy()
    opt = Adam(pe)
    pe.backward(np.ones((0, 2)), np.zeros(0, dtype=int), optimizer=opt)
    assert opt.step_count == 1
    assert same_bits(pe.embeddings, before)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 20),
    d=st.integers(1, 9),
    data=st.data(),
    kind=st.sampled_from(["sgd", "adam", "adamw"]),
    f64=st.booleans(),
    threads=st.sampled_from([1, 2, 4]),
)
def test_property_fused_equals_unfused(n, d, data, kind, f64, threads):
    dtype = np.float64 if f64 else np.float32
    h = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01} if kind == "sgd" else {"lr": 0.01}
    shape = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=3).map(tuple))
    steps = []
    for _ in range(data.draw(st.integers(1, 3))):
        pos = np.array(
            data.draw(
                st.lists(
                    st.integers(-n, n - 1),
                    min_size=int(np.prod(shape)),
                    max_size=int(np.prod(shape)),
                )
            ),
            dtype=np.int64,
        ).reshape(shape)
        g = np.random.default_rng(len(steps)).standard_normal(shape + (d,)).astype(dtype)
        steps.append((g, pos))
    cposembed.set_num_threads(threads)
    try:
        for pad in (None, n - 1):
            a = LearnedPositionEmbedding(n, d, seed=0, dtype=dtype, padding_idx=pad)
            b = LearnedPositionEmbedding(n, d, seed=0, dtype=dtype, padding_idx=pad)
            oa, ob = make(kind, a, **h), make(kind, b, **h)
            for g, pos in steps:
                a.zero_grad()
                a.backward(g, pos)
                oa.step()
                b.backward(g, pos, optimizer=ob)
            assert same_bits(a.embeddings, b.embeddings)
            assert same_state(oa.state_dict(), ob.state_dict())
    finally:
        cposembed.set_num_threads(None)


# -- the padding row -----------------------------------------------------------------
@pytest.mark.parametrize("kind, h", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("fused", [False, True], ids=["step", "fused"])
def test_padding_row_never_moves(kind, h, fused):
    m = TokenPositionEmbedding(10, 4, 3, seed=0, padding_idx=2)
    m.token_embeddings[2] = 1.5  # decay would move a non-zero row
    opt = make(kind, m, **h)
    ids = np.array([[2, 2, 5, 2]])
    for _ in range(3):
        g = np.ones((1, 4, 3), dtype=np.float32)
        if fused:
            m.backward(g, ids, optimizer=opt)
        else:
            m.zero_grad()
            m.backward(g, ids)
            opt.step()
    assert same_bits(m.token_embeddings[2], np.full(3, 1.5, dtype=np.float32))
    assert 2 not in opt.state_dict()["state"]["token_embeddings"]["rows"]


def test_assigned_grad_counts_as_touching_every_row():
    pe = LearnedPositionEmbedding(5, 2, seed=0, dtype=np.float64, padding_idx=0)
    before = pe.embeddings.copy()
    opt = SGD(pe, 0.5)
    pe.grad = np.ones((5, 2))
    opt.step()
    assert same_bits(pe.embeddings[1:], before[1:] - 0.5)
    assert same_bits(pe.embeddings[0], before[0])


def test_step_checks_both_grads_before_either_table_moves():
    m = TokenPositionEmbedding(10, 4, 3, seed=0)
    opt = SGD(m, 0.5)
    m.backward(np.ones((1, 2, 3)), [[1, 2]])
    before = m.token_embeddings.copy()
    m.position_grad = np.ones((2, 2))
    with pytest.raises(ValueError, match="shape"):
        opt.step()
    assert same_bits(m.token_embeddings, before)
    assert opt.step_count == 0


def test_state_dtype_follows_the_table():
    assert cposembed.optim.state_dtype(np.float32) == np.float32
    assert cposembed.optim.state_dtype(np.float64) == np.float64
    assert cposembed.optim.state_dtype(np.float16) == np.float32
    for dtype in DTYPES:
        pe = LearnedPositionEmbedding(4, 2, seed=0, dtype=dtype)
        opt = Adam(pe)
        pe.backward(np.ones((1, 2)), [1], optimizer=opt)
        assert opt.state_dict()["state"]["embeddings"]["exp_avg"].dtype == dtype


# -- state round trips ----------------------------------------------------------------
def continue_steps(layer, opt, seed, n=3):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        g = rng.standard_normal((1, 4, 3)).astype(np.float32)
        layer.backward(g, rng.integers(0, 10, (1, 4)), optimizer=opt)


@pytest.mark.parametrize("kind, h", CONFIGS, ids=CONFIG_IDS)
def test_state_dict_round_trip(kind, h):
    m = TokenPositionEmbedding(10, 4, 3, seed=0)
    opt = make(kind, m, **h)
    continue_steps(m, opt, 0)
    state = opt.state_dict()
    copy = pickle.loads(pickle.dumps(m))
    opt2 = make(kind, copy, lr=123.0)  # other hyper-parameters: loaded from the state
    opt2.load_state_dict(state)
    assert opt2.hyperparameters == opt.hyperparameters
    assert same_state(opt2.state_dict(), state)
    continue_steps(m, opt, 1)
    continue_steps(copy, opt2, 1)
    assert same_bits(m.token_embeddings, copy.token_embeddings)
    assert same_state(opt.state_dict(), opt2.state_dict())


@pytest.mark.parametrize("kind, h", CONFIGS, ids=CONFIG_IDS)
def test_pickle_takes_the_layer_along(kind, h):
    m = TokenPositionEmbedding(10, 4, 3, seed=0)
    opt = make(kind, m, **h)
    continue_steps(m, opt, 0)
    opt2 = pickle.loads(pickle.dumps(opt))
    assert opt2.layer is not m
    assert same_bits(opt2.layer.token_embeddings, m.token_embeddings)
    m2, opt3 = pickle.loads(pickle.dumps((m, opt)))
    assert opt3.layer is m2
    continue_steps(m, opt, 1)
    continue_steps(opt2.layer, opt2, 1)
    assert same_bits(m.token_embeddings, opt2.layer.token_embeddings)
    assert same_state(opt.state_dict(), opt2.state_dict())


def test_load_state_dict_refuses_and_changes_nothing():
    pe = LearnedPositionEmbedding(10, 3, seed=0)
    opt = Adam(pe, 0.1)
    continue_steps_pe = np.ones((2, 3), dtype=np.float32)
    pe.backward(continue_steps_pe, [1, 2], optimizer=opt)
    good = opt.state_dict()
    bad_cases = []
    s = opt.state_dict()
    s["optimizer"] = "SGD"
    bad_cases.append(s)
    s = opt.state_dict()
    s["hyperparameters"]["lr"] = -1.0
    bad_cases.append(s)
    s = opt.state_dict()
    s["state"]["embeddings"]["exp_avg"] = s["state"]["embeddings"]["exp_avg"][:1]
    bad_cases.append(s)
    s = opt.state_dict()
    s["state"]["embeddings"]["rows"] = np.array([2, 1])
    bad_cases.append(s)
    s = opt.state_dict()
    s["state"]["embeddings"]["rows"] = np.array([1, 10])
    bad_cases.append(s)
    s = opt.state_dict()
    s["state"]["embeddings"]["exp_avg_sq"] = s["state"]["embeddings"]["exp_avg_sq"].astype(
        np.float64
    )
    bad_cases.append(s)
    s = opt.state_dict()
    s["state"] = {"token_embeddings": s["state"]["embeddings"]}
    bad_cases.append(s)
    bad_cases.append("not a state")
    for bad in bad_cases:
        with pytest.raises((ValueError, TypeError)):
            opt.load_state_dict(bad)
        assert same_state(opt.state_dict(), good)
    with pytest.raises(ValueError, match="SGD"):
        SGD(pe, 0.1).load_state_dict(good)


# -- hyper-parameters -----------------------------------------------------------------
@pytest.mark.parametrize(
    "make_it, message",
    [
        (lambda pe: SGD(pe, -1), "Invalid learning rate: -1"),
        (lambda pe: SGD(pe, 0.1, momentum=-0.5), "Invalid momentum value: -0.5"),
        (lambda pe: SGD(pe, 0.1, weight_decay=-1e-3), "Invalid weight_decay value: -0.001"),
        (
            lambda pe: SGD(pe, 0.1, nesterov=True),
            "Nesterov momentum requires a momentum and zero dampening",
        ),
        (
            lambda pe: SGD(pe, 0.1, momentum=0.9, dampening=0.1, nesterov=True),
            "Nesterov momentum requires a momentum and zero dampening",
        ),
        (lambda pe: Adam(pe, -0.1), "Invalid learning rate: -0.1"),
        (lambda pe: Adam(pe, eps=-1e-8), "Invalid epsilon value: -1e-08"),
        (lambda pe: Adam(pe, betas=(1.0, 0.999)), "Invalid beta parameter at index 0: 1.0"),
        (lambda pe: Adam(pe, betas=(0.9, -0.1)), "Invalid beta parameter at index 1: -0.1"),
        (lambda pe: Adam(pe, weight_decay=-1), "Invalid weight_decay value: -1"),
        (lambda pe: AdamW(pe, lr=float("nan")), "Invalid learning rate: nan"),
        (lambda pe: AdamW(pe, weight_decay=-0.01), "Invalid weight_decay value: -0.01"),
    ],
)
def test_bad_hyperparameters_worded_as_torch(make_it, message):
    pe = LearnedPositionEmbedding(4, 2, seed=0)
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
        make_it(pe)


@pytest.mark.parametrize(
    "make_it",
    [
        lambda pe: SGD(pe, "0.1"),
        lambda pe: SGD(pe, None),
        lambda pe: SGD(pe, True),
        lambda pe: SGD(pe, 0.1, momentum=[0.9]),
        lambda pe: SGD(pe, 0.1, momentum=0.9, nesterov=1),
        lambda pe: Adam(pe, betas=0.9),
        lambda pe: Adam(pe, betas=(0.9, "x")),
        lambda pe: Adam(pe, eps=None),
        lambda pe: SGD(pe.embeddings, 0.1),
        lambda pe: Adam(object()),
    ],
)
def test_non_numbers_and_other_layers_are_type_errors(make_it):
    pe = LearnedPositionEmbedding(4, 2, seed=0)
    with pytest.raises(TypeError):
        make_it(pe)


def test_lr_can_be_changed_between_steps():
    pe = LearnedPositionEmbedding(4, 1, seed=0, dtype=np.float64)
    opt = SGD(pe, 1.0)
    opt.lr = 0.5
    before = pe.embeddings[1, 0]
    pe.backward(np.ones((1, 1)), [1], optimizer=opt)
    assert pe.embeddings[1, 0] == before - 0.5
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.lr = -1
    assert opt.lr == 0.5
    assert "SGD(LearnedPositionEmbedding" in repr(opt)


# -- a huge table: a step costs its rows -------------------------------------------------
def test_huge_table_step_allocates_only_for_touched_rows():
    n_rows, d = 2_000_000, 4
    m = TokenPositionEmbedding.from_pretrained(
        np.zeros((n_rows, d), dtype=np.float32), np.zeros((8, d), dtype=np.float32)
    )
    opt = Adam(m, 0.1, weight_decay=0.01)
    ids = np.array([[5, 1_999_999, 5, 123_456]])
    g = np.ones((1, 4, d), dtype=np.float32)
    tracemalloc.start()
    try:
        m.backward(g, ids, optimizer=opt)  # warm-up: the state's first allocation
        tracemalloc.reset_peak()
        for _ in range(3):
            m.backward(g, ids, optimizer=opt)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The table is 32 MB, a bool per row 2 MB; a fused step allocates a few KB.
    assert peak < 200_000
    state = opt.state_dict()["state"]["token_embeddings"]
    assert list(state["rows"]) == [5, 123_456, 1_999_999]
    assert state["exp_avg"].shape == (3, d)
    assert np.count_nonzero(m.token_embeddings.any(axis=1)) == 3


def test_huge_table_unfused_step_allocates_only_for_touched_rows():
    n_rows, d = 2_000_000, 4
    pe = LearnedPositionEmbedding.from_pretrained(np.zeros((n_rows, d), dtype=np.float32))
    opt = SGD(pe, 0.1, momentum=0.9)
    pe.backward(np.ones((3, d), dtype=np.float32), [7, 7, 1_500_000])
    tracemalloc.start()
    try:
        opt.step()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200_000
    assert list(opt.state_dict()["state"]["embeddings"]["rows"]) == [7, 1_500_000]


# -- against PyTorch --------------------------------------------------------------------
def torch_dtype(torch, dtype):
    return torch.float32 if dtype == np.float32 else torch.float64


# Every step touches the same rows (with a repeat), so lazy and dense agree on them;
# torch's updates use fused multiply-adds (add_ with alpha, lerp_), ours round the
# product first: the two differ by an ulp or so per step, not bitwise.
SAME_ROWS = np.array([3, 7, 7, 10, 0, 19])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "h",
    [
        {"lr": 0.1},
        {"lr": 0.1, "momentum": 0.9},
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.3},
        {"lr": 0.1, "momentum": 0.9, "nesterov": True},
    ],
)
def test_sgd_matches_torch_sgd_on_a_sparse_embedding(h, dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    pe = LearnedPositionEmbedding(20, 7, seed=1, dtype=dtype)
    emb = torch.nn.Embedding(20, 7, sparse=True, dtype=torch_dtype(torch, dtype))
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(pe.embeddings))
    opt, topt = SGD(pe, **h), torch.optim.SGD(emb.parameters(), **h)
    for _ in range(6):
        g = rng.standard_normal((SAME_ROWS.size, 7)).astype(dtype)
        pe.backward(g, SAME_ROWS, optimizer=opt)
        topt.zero_grad()
        emb(torch.from_numpy(SAME_ROWS)).backward(torch.from_numpy(g))
        topt.step()
    ours, theirs = pe.embeddings, emb.weight.detach().numpy()
    tol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(ours, theirs, rtol=tol, atol=tol)
    untouched = np.setdiff1d(np.arange(20), SAME_ROWS)
    assert same_bits(ours[untouched], theirs[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kind, h",
    [
        ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.05}),
        ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.05}),
        ("adam", {"lr": 0.01}),
        ("adam", {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
        ("adam", {"lr": 0.01, "betas": (0.3, 0.9)}),
        ("adamw", {"lr": 0.01}),
        ("adamw", {"lr": 0.01, "weight_decay": 0.3}),
    ],
)
def test_matches_torch_dense_optimizers_when_every_row_is_touched(kind, h, dtype):
    # torch's sparse gradients refuse weight decay ("add(sparse, dense) is not
    # supported") and Adam takes none: dense gradients over rows that every step
    # touches, where lazy and dense updates are the same rule.
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    n = 12
    pe = LearnedPositionEmbedding(n, 7, seed=1, dtype=dtype)
    w = torch.nn.Parameter(torch.from_numpy(pe.embeddings.copy()))
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    opt, topt = make(kind, pe, **h), cls([w], **h)
    every_row = np.concatenate([np.arange(n), [4, 4]])
    for _ in range(8):
        g = rng.standard_normal((every_row.size, 7)).astype(dtype)
        pe.zero_grad()
        pe.backward(g, every_row)
        opt.step()
        w.grad = torch.from_numpy(pe.grad.copy())
        topt.step()
    tol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(pe.embeddings, w.detach().numpy(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_matches_torch_sparse_adam_lazily(dtype):
    # Different rows each step: SparseAdam is lazy too. It adds eps to the root of
    # v before the bias correction (ours after, as Adam does), and updates the
    # moments as m + (g - m) * (1 - beta1): close, not bitwise.
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    pe = LearnedPositionEmbedding(20, 7, seed=1, dtype=dtype)
    emb = torch.nn.Embedding(20, 7, sparse=True, dtype=torch_dtype(torch, dtype))
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(pe.embeddings))
    opt, topt = Adam(pe, 0.01), torch.optim.SparseAdam(emb.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(8):
            rows = rng.integers(0, 20, 6)
            g = rng.standard_normal((6, 7)).astype(dtype)
            pe.backward(g, rows, optimizer=opt)
            topt.zero_grad()
            emb(torch.from_numpy(rows)).backward(torch.from_numpy(g))
            topt.step()
    np.testing.assert_allclose(pe.embeddings, emb.weight.detach().numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind, h", CONFIGS[:2] + CONFIGS[4:5] + CONFIGS[7:8])
@pytest.mark.parametrize("form", ["the table itself", "byte-swapped", "strided", "float64"])
def test_step_takes_any_assigned_gradient_as_a_plain_copy(kind, h, form):
    """An assigned gradient the C step cannot take as it is (sharing the table's
    memory, another byte order, layout or dtype) steps as its plain float32 copy."""
    pe = LearnedPositionEmbedding(10, 4, seed=0)
    ref = LearnedPositionEmbedding(10, 4, seed=0)
    opt, ref_opt = make(kind, pe, **h), make(kind, ref, **h)
    for _ in range(2):
        if form == "the table itself":
            grad = pe.embeddings
        elif form == "byte-swapped":
            grad = pe.embeddings.astype(">f4")
        elif form == "strided":
            grad = np.repeat(pe.embeddings, 2, axis=1)[:, ::2]
        else:
            grad = pe.embeddings.astype(np.float64)
        ref.grad = np.array(grad, dtype=np.float32)
        pe.grad = grad
        opt.step()
        ref_opt.step()
    assert same_bits(pe.embeddings, ref.embeddings)
    assert same_state(opt.state_dict(), ref_opt.state_dict())
