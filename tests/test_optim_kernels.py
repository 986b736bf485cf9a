"""The optimizers' C update (cpe_opt_T) and the fused step: bitwise against the
NumPy formulas the optimizers computed with before (ported here), fused against
unfused with single contributions and -0.0, the entries' declines, and the cost
of a step on a huge table."""

from __future__ import annotations

import contextlib
import os
import pickle
import tracemalloc

import numpy as np
import pytest
from helpers import FLOAT_TABLE_DTYPES, run_json, tuned
from hypothesis import given, settings
from hypothesis import strategies as st
from test_optim import CONFIG_IDS, CONFIGS, make

import cposembed
from cposembed import LearnedPositionEmbedding, TokenPositionEmbedding, _core, _marks
from cposembed.optim import state_dtype

BUFFERS = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq")}
BUFFERS["adamw"] = BUFFERS["adam"]


def hyper_of(kind, h):
    """Every hyper-parameter, the defaults filled in."""
    if kind == "sgd":
        full = {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}
    else:
        full = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}
        full["weight_decay"] = 1e-2 if kind == "adamw" else 0.0
    full.update(h)
    return full


class NumpyOptimizer:
    """The optimizers' update as NumPy computed it: each table's touched rows read
    as the state's dtype, SGD's or Adam's formula on those arrays with Python-float
    hyper-parameters, the table rows written back (one rounding), dense zeroed
    state arrays and the rows that have state."""

    def __init__(self, kind, h, tables):
        self.kind, self.h = kind, hyper_of(kind, h)
        self.t = 0
        self.tables = tables  # name -> the reference's own table (an ndarray)
        stateful = kind != "sgd" or self.h["momentum"] != 0
        self.names = BUFFERS[kind] if stateful else ()
        self.state = {}
        for name, table in tables.items():
            dt = state_dtype(table.dtype)
            buffers = {n: np.zeros(table.shape, dt) for n in self.names}
            self.state[name] = (buffers, np.zeros(table.shape[0], bool))

    def step(self, grads):
        """grads: name -> (rows, their summed gradient rows in the state's dtype)."""
        self.t += 1
        for name, (rows, grad) in grads.items():
            self._apply(name, rows, grad)

    def _apply(self, name, rows, grad):
        if rows.size == 0:
            return
        table = self.tables[name]
        buffers, has = self.state[name]
        dt = state_dtype(table.dtype)
        new = ~has[rows]
        param = np.asarray(table[rows], dtype=dt)
        rows_state = {n: buffers[n][rows] for n in self.names}
        update = self._sgd if self.kind == "sgd" else self._adam
        param = update(param, grad, rows_state, new)
        for n in self.names:
            buffers[n][rows] = rows_state[n]
        if self.names:
            has[rows] = True
        table[rows] = param

    def _sgd(self, param, grad, buffers, new):
        h = self.h
        if h["weight_decay"] != 0:
            grad = grad + h["weight_decay"] * param
        if h["momentum"] != 0:
            buf = buffers["momentum_buffer"]
            buf = buf * h["momentum"] + (1 - h["dampening"]) * grad
            buf[new] = grad[new]
            buffers["momentum_buffer"] = buf
            grad = grad + h["momentum"] * buf if h["nesterov"] else buf
        return param + -h["lr"] * grad

    def _adam(self, param, grad, buffers, new):
        h = self.h
        lr, wd, eps = h["lr"], h["weight_decay"], h["eps"]
        beta1, beta2 = h["betas"]
        dt = param.dtype.type
        exp_avg, exp_avg_sq = buffers["exp_avg"], buffers["exp_avg_sq"]
        if wd != 0:
            if self.kind == "adamw":
                param = param * (1 - lr * wd)
            else:
                grad = grad + wd * param
        # torch's lerp(m, g, w): m + w * (g - m) for |w| < 0.5, else g - (g - m) * (1 - w),
        # with w in the state's dtype.
        w = dt(1 - beta1)
        if abs(w) < 0.5:
            exp_avg = exp_avg + w * (grad - exp_avg)
        else:
            exp_avg = grad - (grad - exp_avg) * (dt(1) - w)
        exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
        bias_correction1 = 1 - beta1**self.t
        bias_correction2 = 1 - beta2**self.t
        step_size = lr / bias_correction1
        denom = np.sqrt(exp_avg_sq) / bias_correction2**0.5 + eps
        buffers["exp_avg"] = exp_avg
        buffers["exp_avg_sq"] = exp_avg_sq
        return param + -step_size * exp_avg / denom


def summed(rows, g, n_rows, dt, skip_row=None):
    """The distinct rows (wrapped; skip_row left out) and their gradient: np.add.at
    into zeros of the state's dtype, as the layer's backward sums them."""
    flat = np.asarray(rows).reshape(-1) % n_rows
    grad = np.zeros((n_rows, g.shape[-1]), dt)
    np.add.at(grad, flat, g.reshape(flat.size, -1))
    uniq = np.unique(flat)
    if skip_row is not None:
        uniq = uniq[uniq != skip_row]
    return uniq, grad[uniq]


def same_bits_but_nan(got, want, what=""):
    """Bitwise equal where `want` is a number, NaN where it is NaN (an operation
    on two NaNs may give either one; NumPy's loops and the kernel may differ)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan_got, nan_want = np.isnan(got.astype(np.float64)), np.isnan(want.astype(np.float64))
    assert np.array_equal(nan_got, nan_want), f"{what}: NaN in other places"
    bad = got[~nan_want].tobytes() != want[~nan_want].tobytes()
    assert not bad, f"{what}: bits differ at {np.argwhere((got != want) & ~nan_want)[:5]}"


def assert_like_reference(opt, ref, layer_tables):
    for name, table in layer_tables.items():
        same_bits_but_nan(table, ref.tables[name], f"table {name}")
        buffers, has = ref.state[name]
        exported = opt.state_dict()["state"][name]
        rows = np.flatnonzero(has)
        np.testing.assert_array_equal(exported["rows"], rows)
        for n in ref.names:
            same_bits_but_nan(exported[n], buffers[n][rows], f"{name} {n}")


def special_gradient(rng, shape, dtype):
    """Normal values, with -0.0, +-inf, NaN and subnormals sprinkled in."""
    g = rng.standard_normal(shape)
    flat = g.reshape(-1, shape[-1])
    specials = [-0.0, np.inf, -np.inf, np.nan, 1e-41, -3e-39, 5e-324]
    for i, value in enumerate(specials):
        if i < flat.shape[0]:
            flat[i * 7 % flat.shape[0], i % shape[-1]] = value
    return g.astype(dtype)


@pytest.fixture(params=list(_core.isas()))
def isa(request):
    """Each variant of the half-precision primitives and the update (same bits)."""
    used = _core.set_isa(request.param)
    assert used == request.param
    yield used
    _core.set_isa(_core.isas()[-1])


THREADS = [1, 2, 3, 4]


@contextlib.contextmanager
def parallel(threads):
    """Every call on `threads` threads of the team, in small chunks, no back-off."""
    cposembed.set_num_threads(threads)
    try:
        with tuned(serial_below=0, chunk_elems=32, adapt=False):
            yield
    finally:
        cposembed.set_num_threads(None)


def train_step(layer, opt, fused, g, *args, **kw):
    """One step: the fused backward, or zero_grad(); backward(); step()."""
    if fused:
        assert layer.backward(g, *args, optimizer=opt, **kw) is None
        return
    layer.zero_grad()
    layer.backward(g, *args, **kw)
    opt.step()


# -- 4. the C update against NumPy, bitwise --------------------------------------------
@pytest.mark.parametrize("dtype", FLOAT_TABLE_DTYPES, ids=str)
@pytest.mark.parametrize("kind, h", CONFIGS, ids=CONFIG_IDS)
def test_position_steps_are_the_numpy_formula_bitwise(kind, h, dtype, isa):
    # d = 70: a full block of the update (64) and a tail.
    n_rows, d = 24, 70
    rng = np.random.default_rng(20)
    steps = [rng.integers(-n_rows, n_rows, (3, 5)) for _ in range(4)]
    steps.append(np.array([[1, 1, 2, 1, 23]]))
    grads = [special_gradient(rng, p.shape + (d,), np.float32) for p in steps]
    for fused in (False, True):
        for threads in THREADS:
            pe = LearnedPositionEmbedding(n_rows, d, seed=4, dtype=dtype, padding_idx=2)
            pe.embeddings[5] = -0.0
            ref = NumpyOptimizer(kind, h, {"embeddings": pe.embeddings.copy()})
            opt = make(kind, pe, **h)
            dt = state_dtype(pe.dtype)
            with parallel(threads), np.errstate(all="ignore"):
                for positions, g in zip(steps, grads):
                    train_step(pe, opt, fused, g, positions)
                    ref.step({"embeddings": summed(positions, g, n_rows, dt, skip_row=2)})
            assert_like_reference(opt, ref, {"embeddings": pe.embeddings})


@pytest.mark.parametrize("dtype", FLOAT_TABLE_DTYPES, ids=str)
@pytest.mark.parametrize("kind, h", CONFIGS, ids=CONFIG_IDS)
def test_layer_steps_are_the_numpy_formula_bitwise(kind, h, dtype, isa):
    # Token ids of which some appear once in a step (the fused step's singles),
    # others several times, the padding row among them.
    V, L, d = 60, 8, 67
    rng = np.random.default_rng(21)
    steps = []
    for s in range(4):
        ids = rng.permutation(V)[:12].reshape(2, 6)  # all distinct: singles
        if s % 2:
            ids[1, :3] = ids[0, 0]  # one id four times
            ids[0, 5] = 0  # the padding row
        steps.append(ids)
    grads = [special_gradient(rng, ids.shape + (d,), np.float32) for ids in steps]
    grads[0][0, 1] = -0.0  # a whole -0.0 row of a single
    # Positions: the default, an offset, (B, T) with repeats, one row for every sequence.
    places = [
        ({}, np.arange(6)),
        ({"offset": 2}, 2 + np.arange(6)),
        ({"positions": rng.integers(-L, L, (2, 6))}, None),
        ({"positions": np.array([0, 7, 7, -1, 3, 0])}, None),
    ]
    dt = np.float64 if dtype == np.float64 else np.float32
    for fused in (False, True):
        for threads in (1, 2, 4):
            m = TokenPositionEmbedding(V, L, d, seed=5, dtype=dtype, padding_idx=0)
            m.token_embeddings[steps[0][0, 1]] = -0.0
            tables = {
                "token_embeddings": m.token_embeddings,
                "position_embeddings": m.position_embeddings,
            }
            ref = NumpyOptimizer(kind, h, {k: t.copy() for k, t in tables.items()})
            opt = make(kind, m, **h)
            with parallel(threads), np.errstate(all="ignore"):
                for ids, g, (kw, rows) in zip(steps, grads, places):
                    g = g.astype(dt)
                    train_step(m, opt, fused, g, ids, **kw)
                    rows = kw["positions"] if rows is None else rows
                    positions = np.broadcast_to(rows, ids.shape)
                    ref.step(
                        {
                            "token_embeddings": summed(ids, g, V, dt, skip_row=0),
                            "position_embeddings": summed(positions, g, L, dt),
                        }
                    )
            assert_like_reference(opt, ref, tables)


@pytest.mark.parametrize("kind, h", CONFIGS, ids=CONFIG_IDS)
def test_optimizer_step_entry_is_the_numpy_formula(kind, h, isa):
    # The entry itself: compact and table-shaped gradients, rows in any order,
    # fresh and stateful rows, every table dtype.
    rng = np.random.default_rng(22)
    n_rows, d = 30, 130
    for dtype in FLOAT_TABLE_DTYPES:
        pe = LearnedPositionEmbedding(n_rows, d, seed=6, dtype=dtype)
        opt = make(kind, pe, **h)
        ref = NumpyOptimizer(kind, h, {"embeddings": pe.embeddings.copy()})
        dt = state_dtype(pe.dtype)
        for s in range(3):
            rows = rng.permutation(n_rows)[: 5 + 5 * s]
            g = special_gradient(rng, (rows.size, d), dt)
            opt._step += 1
            compact = s != 1
            grad = g if compact else np.zeros((n_rows, d), dt)
            if not compact:
                grad[rows] = g
            with parallel(1 + s), np.errstate(all="ignore"):
                assert opt._apply("embeddings", rows, grad, compact, -1) is True
                ref.step({"embeddings": (rows, g)})
        assert_like_reference(opt, ref, {"embeddings": pe.embeddings})


# -- 5. fused equals unfused with singles and -0.0 --------------------------------------
FUSED_CONFIGS = [
    ("sgd", {"lr": 0.1}),
    ("sgd", {"lr": 0.1, "momentum": 0.9}),
    ("sgd", {"lr": 0.1, "weight_decay": 0.1}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1, "nesterov": True}),
    ("adam", {"lr": 0.01, "weight_decay": 0.1}),
    ("adam", {"lr": 0.01, "betas": (0.3, 0.9)}),
    ("adamw", {"lr": 0.01}),
]


@pytest.mark.parametrize("gdt", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("kind, h", FUSED_CONFIGS, ids=lambda x: str(x))
def test_fused_equals_unfused_with_negative_zero_singles(kind, h, gdt):
    """A token that appears once with a -0.0 gradient row: its update reads 0 + g
    (+0.0), as the unfused gradient holds it. Rows of -0.0 in the table and a
    fresh momentum buffer show a sign."""
    V, L, d = 50, 6, 9
    tdt = np.float64 if gdt == "float64" else np.float32
    rng = np.random.default_rng(23)
    ids = np.array([[3, 7, 11, 7, 20, 21], [30, 31, 3, 40, 41, 42]])
    g = rng.standard_normal(ids.shape + (d,))
    singles = [11, 20, 21, 30, 31, 40, 41, 42]
    g[ids == 11] = -0.0  # whole rows of -0.0
    g[ids == 30] = -0.0
    g[0, 4, :4] = -0.0  # part of a row
    g = g.astype(gdt)
    results = []
    for fused in (False, True):
        for threads in (1, 2, 4):
            m = TokenPositionEmbedding(V, L, d, seed=7, dtype=tdt)
            m.token_embeddings[singles] = -0.0
            m.token_embeddings[[3, 7]] = 0.0
            opt = make(kind, m, **h)
            with parallel(threads):
                for _ in range(2):
                    train_step(m, opt, fused, g, ids)
                    if fused:
                        assert m.token_grad is None
            results.append((m, opt))
    (a, oa) = results[0]
    for b, ob in results[1:]:
        assert a.token_embeddings.tobytes() == b.token_embeddings.tobytes()
        assert a.position_embeddings.tobytes() == b.position_embeddings.tobytes()
        sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
        for name in sa:
            for key in sa[name]:
                assert sa[name][key].tobytes() == sb[name][key].tobytes(), (name, key)
    if kind == "sgd" and not h.get("weight_decay"):
        # -0.0 - lr * (+0.0) is -0.0: the rows stayed -0.0 (with -0.0 + lr * 0 ...
        # +0.0 had the -0.0 gradient been used as it is).
        assert np.signbit(a.token_embeddings[11]).all()


# -- 6. the entries decline crafted arguments, writing nothing -------------------------
CRAFTED = r"""
import json
import numpy as np
import cposembed
from cposembed import _core, _marks, Adam, SGD, TokenPositionEmbedding

V, L, d = 20, 4, 8
failures = []


def snapshot(*arrays):
    return [(a, a.copy()) for a in arrays if isinstance(a, np.ndarray)]


def unchanged(snap):
    return all(a.tobytes() == b.tobytes() for a, b in snap)


def opt_call(table, grad, rows, compact, s1, s2, slots, hyper, skip_row=-1):
    return _core.optimizer_step(table, grad, rows, compact, s1, s2, slots, hyper, skip_row)


def check(name, call, *watched):
    slot_maps = [w for w in watched if isinstance(w, _marks.RowSlots)]
    before = [(m, m.rows().copy()) for m in slot_maps]
    snap = snapshot(*watched)
    try:
        result = call()
    except Exception as exc:
        failures.append(f"{name}: raised {type(exc).__name__}: {exc}")
        return
    if result is not None:
        failures.append(f"{name}: not declined ({result!r})")
    if not unchanged(snap):
        failures.append(f"{name}: wrote an argument")
    for m, rows in before:
        if list(m.rows()) != list(rows):
            failures.append(f"{name}: changed the slots")


# ---- optimizer_step
m = TokenPositionEmbedding(V, L, d, seed=0)
adam = Adam(m, 0.1)
adam._step = 1
sgd = SGD(m, 0.1, momentum=0.9)
A = adam._kernel_hyper()
S = sgd._kernel_hyper()
table = m.token_embeddings
grad = np.ones((V, d), np.float32)
rows = np.array([1, 5, 19], np.int64)
s1, s2 = np.zeros((V, d), np.float32), np.zeros((V, d), np.float32)
has = _marks.RowSlots(V)
args = (table, grad, rows, False, s1, s2, has, A)
t2 = table.copy()
assert opt_call(t2, grad, rows, False, s1.copy(), s2.copy(), _marks.RowSlots(V), A) is True
assert opt_call(t2, grad[:3], rows, True, s1.copy(), s2.copy(), _marks.RowSlots(V), A) is True

W = (table, grad, s1, s2, has)
for name, bad_rows in [
    ("row L", [1, V]), ("row -1", [-1, 2]), ("row huge", [2**62]), ("row -2**63", [-(2**63)]),
]:
    r = np.array(bad_rows, np.int64)
    check(name, lambda: opt_call(table, grad, r, False, s1, s2, has, A), *W, r)
    check(name + " compact", lambda: opt_call(table, grad[:2], r, True, s1, s2, has, A), *W, r)
for name, r in [("rows int32", rows.astype(np.int32)), ("rows 2-D", rows[None]),
                ("rows list", [1, 5]), ("rows strided", np.repeat(rows, 2)[::2])]:
    check(name, lambda: opt_call(table, grad, r, False, s1, s2, has, A), *W)
for name, g in [
    ("grad rows", np.ones((V + 1, d), np.float32)),
    ("grad compact rows", np.ones((4, d), np.float32)),
    ("grad d", np.ones((V, d + 1), np.float32)),
    ("grad float64", np.ones((V, d))),
    ("grad float16", np.ones((V, d), np.float16)),
    ("grad 1-D", np.ones(V * d, np.float32)),
    ("grad fortran", np.asfortranarray(np.ones((V, d), np.float32))),
]:
    compact = name == "grad compact rows"
    check(name, lambda: opt_call(table, g, rows, compact, s1, s2, has, A), *W, g)
check("grad is the table", lambda: opt_call(table, table, rows, False, s1, s2, has, A), *W)
check("state1 is the table", lambda: opt_call(table, grad, rows, False, table, s2, has, A), *W)
check("state2 on the table",
      lambda: opt_call(table, grad, rows, False, s1, table[::-1].copy()[::-1], has, A), *W)
both = np.zeros((V + 1, d), np.float32)
check("state2 overlaps state1",
      lambda: opt_call(table, grad, rows, False, both[:V], both[1:], has, A), *W, both)
check("state1 is state2", lambda: opt_call(table, grad, rows, False, s1, s1, has, A), *W)
check("state is grad", lambda: opt_call(table, grad, rows, False, grad, s2, has, A), *W)
check("state float64",
      lambda: opt_call(table, grad, rows, False, s1.astype(np.float64), s2, has, A), *W)
check("state rows", lambda: opt_call(table, grad, rows, False, s1[:-1], s2, has, A), *W)
ro = s1.copy()
ro.flags.writeable = False
check("state read-only", lambda: opt_call(table, grad, rows, False, ro, s2, has, A), *W, ro)
check("adam without state1", lambda: opt_call(table, grad, rows, False, None, s2, has, A), *W)
check("adam without state2", lambda: opt_call(table, grad, rows, False, s1, None, has, A), *W)
check("momentum without a buffer",
      lambda: opt_call(table, grad, rows, False, None, None, has, S), *W)
def hyper_with(**fields):
    return {**A, **fields}


A_short = dict(A)
del A_short["neg_step"]
for name, hyper in [
    ("hyper short", A_short), ("hyper tuple", tuple(A.values())), ("hyper list", list(A)),
    ("hyper string", hyper_with(weight_decay="x")), ("hyper None", hyper_with(kind=None)),
    ("hyper kind 2", hyper_with(kind=2)), ("hyper kind -1", hyper_with(kind=-1)),
    ("hyper kind huge", hyper_with(kind=2**70)),
    ("hyper float huge", hyper_with(weight_decay=10**400)),
    ("hyper not a dict", None),
]:
    check(name, lambda: opt_call(table, grad, rows, False, s1, s2, has, hyper), *W)
for name, marks in [("slots length", _marks.RowSlots(V + 1)), ("slots RowMarks", _marks.RowMarks(V)),
                    ("slots bool mask", np.zeros(V, bool))]:
    check(name, lambda: opt_call(table, grad, rows, False, s1, s2, marks, A), *W, marks)
for skip in (V, -2):
    check(f"skip {skip}", lambda: opt_call(table, grad, rows, False, s1, s2, has, A, skip), *W)
rot = table.copy()
rot.flags.writeable = False
check("table read-only", lambda: opt_call(rot, grad, rows, False, s1, s2, has, A), *W, rot)
check("table int", lambda: opt_call(table.astype(np.int32), grad, rows, False, s1, s2, has, A), *W)

# ---- fused_embed_step
tok = m.token_embeddings
pos = m.position_embeddings
ts1, ts2 = adam._states["token_embeddings"].buffers["exp_avg"], adam._states["token_embeddings"].buffers["exp_avg_sq"]
ps1, ps2 = adam._states["position_embeddings"].buffers["exp_avg"], adam._states["position_embeddings"].buffers["exp_avg_sq"]
th, ph = adam._states["token_embeddings"].slots, adam._states["position_embeddings"].slots
k_ids = np.array([[1, 2, 1, 5]], np.int64)


def fused(g=None, ids=None, positions=None, offset=0, tstep=None, pstep=None, hyper=None):
    g = np.ones((1, 4, d), np.float32) if g is None else g
    return _core.fused_embed_step(
        (tok, ts1, ts2, th, -1) if tstep is None else tstep,
        (pos, ps1, ps2, ph, -1) if pstep is None else pstep,
        g,
        k_ids if ids is None else ids,
        positions,
        offset,
        A if hyper is None else hyper,
    )


FW = (tok, pos, ts1, ts2, ps1, ps2, th, ph)
# The good call first, on copies.
saved = [a.copy() for a in (tok, pos, ts1, ts2, ps1, ps2)]
assert fused() is True
for a, b in zip((tok, pos, ts1, ts2, ps1, ps2), saved):
    a[...] = b

for name, ids in [("id V", np.array([[0, 1, 0, V]])), ("id huge", np.array([[0, 1, 0, 2**40]])),
                  ("id -V-1", np.array([[0, 1, 0, -V - 1]])), ("ids float", k_ids.astype(float)),
                  ("ids shape", k_ids.reshape(4, 1)), ("ids 3 long", k_ids[:, :3])]:
    check(name, lambda: fused(ids=ids), *FW)
for name, positions in [("position L", np.array([0, 1, 2, L])),
                        ("position -L-1", np.array([0, 1, 2, -L - 1])),
                        ("positions 5 long", np.array([0, 1, 2, 3, 4]))]:
    check(name, lambda: fused(positions=positions), *FW)
check("offset past the table", lambda: fused(offset=L - 3), *FW)
check("offset with positions", lambda: fused(positions=np.array([0, 1, 2, 3]), offset=1), *FW)
check("the same table twice", lambda: fused(pstep=(tok, ps1, ps2, ph, -1)), *FW)
check("the same state twice", lambda: fused(pstep=(pos, ts1[:L], ps2, ph, -1)), *FW)
check("token state on the position table", lambda: fused(pstep=(tok[:L], ps1, ps2, ph, -1)), *FW)
check("a table inside the other's state", lambda: fused(pstep=(ts1[:L], ps1, ps2, ph, -1)), *FW)
check("grad_output over the token table",
      lambda: fused(g=tok.reshape(-1)[: 4 * d].reshape(1, 4, d)), *FW)
check("grad_output over a position state",
      lambda: fused(g=ps2.reshape(-1)[: 4 * d].reshape(1, 4, d)), *FW)
check("grad_output shape", lambda: fused(g=np.ones((1, 5, d), np.float32)), *FW)
check("grad_output d", lambda: fused(g=np.ones((1, 4, d + 1), np.float32)), *FW)
check("grad_output int", lambda: fused(g=np.ones((1, 4, d), np.int32)), *FW)
check("step short", lambda: fused(tstep=(tok, ts1, ts2, th)), *FW)
check("step list", lambda: fused(tstep=[tok, ts1, ts2, th, -1]), *FW)
check("skip row V", lambda: fused(tstep=(tok, ts1, ts2, th, V)), *FW)
check("fused hyper short", lambda: fused(hyper=A_short), *FW)
check("fused hyper unknown kind", lambda: fused(hyper=hyper_with(kind=7)), *FW)
check("fused slots length", lambda: fused(tstep=(tok, ts1, ts2, _marks.RowSlots(V + 1), -1)), *FW)
check("fused adam without state", lambda: fused(tstep=(tok, None, ts2, th, -1)), *FW)
check("position table float64",
      lambda: fused(pstep=(pos.astype(np.float64), ps1.astype(np.float64),
                           ps2.astype(np.float64), ph, -1)), *FW)
check("position table of another d",
      lambda: fused(pstep=(np.zeros((L, d + 1), np.float32), np.zeros((L, d + 1), np.float32),
                           np.zeros((L, d + 1), np.float32), ph, -1)), *FW)
rot = tok.copy()
rot.flags.writeable = False
check("token table read-only", lambda: fused(tstep=(rot, ts1, ts2, th, -1)), *FW)
print(json.dumps({"failures": failures}))
"""


def test_entries_decline_crafted_arguments_and_write_nothing():
    """In a child: a declined call that wrote out of bounds would crash it."""
    result = run_json(CRAFTED, timeout=300)
    assert result["failures"] == []


# -- 7. cost grows with the work, without timing --------------------------------------
def resident_bytes():
    """This process's resident memory (Linux), or 0 where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_of(fn):
    """What fn() allocates at most (tracemalloc), and how much the resident memory
    grows: a pass that writes a zeroed table or state array whole (zeroing a
    gradient, stepping every row) faults in all its pages, 1.28 GB here."""
    before = resident_bytes()
    tracemalloc.start()
    try:
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, resident_bytes() - before


HUGE_ROWS = 20_000_000


def test_huge_position_table_every_step_allocates_little():
    d = 16
    pe = LearnedPositionEmbedding.from_pretrained(np.zeros((HUGE_ROWS, d), np.float32))
    opt = cposembed.SGD(pe, 0.1, momentum=0.9)
    rng = np.random.default_rng(24)
    positions = rng.integers(-HUGE_ROWS, HUGE_ROWS, 256)
    positions[:3] = [0, HUGE_ROWS - 1, 0]
    g = np.ones((256, d), np.float32)
    pe.backward(g, positions)  # the gradient's first allocation (zeroed pages)
    opt.step()

    def steps():
        for _ in range(2):
            pe.zero_grad()
            pe.backward(g, positions)
            pe.sgd_step(0.01)
            opt.step()
            pe.backward(g, positions, optimizer=opt)

    peak, grown = peak_of(steps)
    # 256 rows of 64 bytes are 16 KB; a dense pass would allocate or touch 1.28 GB.
    assert peak < 200_000, peak
    assert grown < 64 << 20, grown
    touched = np.unique(positions % HUGE_ROWS)
    nonzero = np.flatnonzero(pe.embeddings.any(axis=1))
    np.testing.assert_array_equal(nonzero, touched)
    pe.zero_grad()
    assert not pe.grad.any()
    state = opt.state_dict()["state"]["embeddings"]
    np.testing.assert_array_equal(state["rows"], touched)


def test_huge_vocabulary_every_step_allocates_little():
    d = 16
    m = TokenPositionEmbedding.from_pretrained(
        np.zeros((HUGE_ROWS, d), np.float32), np.zeros((64, d), np.float32)
    )
    opt = cposembed.Adam(m, 0.01, weight_decay=0.01)
    rng = np.random.default_rng(25)
    ids = rng.integers(0, HUGE_ROWS, (4, 64))
    ids[0, :2] = [HUGE_ROWS - 1, HUGE_ROWS - 1]
    g = np.ones((4, 64, d), np.float32)
    m.backward(g, ids)  # the gradients' first allocation
    opt.step()
    m.backward(g, ids, optimizer=opt)  # the fused step's scratch

    def steps():
        for _ in range(2):
            m.zero_grad()
            m.backward(g, ids)
            opt.step()
            m.backward(g, ids, optimizer=opt)

    peak, grown = peak_of(steps)
    assert peak < 200_000, peak
    assert grown < 64 << 20, grown
    touched = np.unique(ids)
    np.testing.assert_array_equal(np.flatnonzero(m.token_embeddings.any(axis=1)), touched)
    m.zero_grad()
    assert not m.token_grad.any()
    state = opt.state_dict()["state"]["token_embeddings"]
    np.testing.assert_array_equal(state["rows"], touched)


NEW_ROWS_CHILD = """
import json, os
import numpy as np
import cposembed

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

L, d, n, steps = 4_000_000, 16, 256, 20
pe = cposembed.LearnedPositionEmbedding.from_pretrained(np.full((L, d), 0.01, np.float32))
rows = np.random.default_rng(0).permutation(L)[: 2 * steps * n].reshape(2, steps, n)
g = np.ones((n, d), np.float32)
before = resident()
for step in range(steps):  # 256 rows no step touched before, every step
    pe.zero_grad()
    pe.backward(g, rows[0, step])
grad = resident() - before
opt = cposembed.Adam(pe, 1e-3)
before = resident()
for step in range(steps):
    pe.backward(g, rows[1, step], optimizer=opt)
adam = resident() - before
state = opt.state_dict()["state"]["embeddings"]
print(json.dumps({
    "grad": grad, "adam": adam,
    "grad_rows": int(np.count_nonzero(pe.grad.any(axis=1))),
    "state_rows": len(state["rows"]),
    "moved": int(np.count_nonzero((pe.embeddings != np.float32(0.01)).any(axis=1))),
}))
"""


def _huge_pages_mode() -> str:
    """The transparent huge pages mode ("always", "madvise", "never"), or "" if
    this kernel has none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1 : text.find("]")]


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
@pytest.mark.skipif(
    _huge_pages_mode() not in ("always", "madvise"),
    reason="without transparent huge pages every array faults in 4 KiB pages",
)
def test_state_of_rows_touched_for_the_first_time_costs_their_pages():
    """The gradient faults in about a 4 KiB page per new row, not the 2 MiB huge
    page around it: 20 steps of 256 new rows of a 4,000,000-row table are 5,120
    rows, about 20 MiB (NumPy's zeros, advised for huge pages, grew by the whole
    256 MB array, in the madvise and always modes of transparent huge pages).
    Adam's moments of those rows lie next to each other (RowSlots), 320 KiB per
    moment: a few MiB resident, not a page per row and moment (40 MiB)."""
    got = run_json(NEW_ROWS_CHILD, timeout=300)
    assert got["state_rows"] == got["moved"] == 20 * 256
    assert got["grad_rows"] == 256  # the last step's, after its zero_grad
    assert got["grad"] < 64 << 20, got
    assert got["adam"] < 16 << 20, got


COMPACT_STATE_CHILD = """
import json, os
import numpy as np
import cposembed

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

L, d, n, steps = 4_000_000, 16, 256, 40
rows = np.random.default_rng(1).permutation(L)[: (steps + 1) * n].reshape(steps + 1, n)
g = np.ones((n, d), np.float32)
out = {}
for name, make, fused in [
    ("adam fused", lambda pe: cposembed.Adam(pe, 1e-3), True),
    ("adamw step", lambda pe: cposembed.AdamW(pe, 1e-3), False),
    ("sgd momentum fused", lambda pe: cposembed.SGD(pe, 0.1, momentum=0.9), True),
]:
    pe = cposembed.LearnedPositionEmbedding.from_pretrained(np.full((L, d), 0.01, np.float32))
    opt = make(pe)
    grown = 0
    for s in range(steps + 1):
        if not fused:  # the gradient's pages are the backward's, not the state's
            pe.zero_grad()
            pe.backward(g, rows[s])
        before = resident()
        if fused:
            pe.backward(g, rows[s], optimizer=opt)
        else:
            opt.step()
        if s:  # the first step's allocations (scratch) are not the state's
            grown += resident() - before
    out[name] = [grown, len(opt.state_dict()["state"]["embeddings"]["rows"])]
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_state_of_new_rows_costs_about_its_own_bytes():
    """Rows stepped for the first time every step, by the fused step (Adam, SGD
    with momentum) and by step() (AdamW; the gradient's own pages left out):
    their state lies next to each other (RowSlots), so 40 steps of 256 new
    rows of a 4,000,000-row table (10,240 rows: 640 KiB per float32 buffer of
    16 columns) grow the resident memory by a few times that, not by a 4 KiB
    page per row and buffer (80 MiB for Adam's two moments)."""
    got = run_json(COMPACT_STATE_CHILD, timeout=300)
    for name, (grown, n_rows) in got.items():
        assert n_rows == 41 * 256, (name, n_rows)
        assert grown < 12 << 20, (name, grown)


# ---- RowSlots: where each row's state is -----------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 300),
    st.lists(st.lists(st.integers(0, 299), max_size=40), max_size=6),
    st.integers(-1, 299),
)
def test_rows_get_state_slots_in_the_order_they_are_first_stepped(n_rows, batches, skip):
    """A SGD step with momentum on batches of rows: each row's momentum is in
    the buffer row of its slot, slots numbered by first step; the skipped row
    gets none; the exported state is the same as a table-shaped reference's."""
    skip = skip if skip < n_rows else -1
    pe = LearnedPositionEmbedding.from_pretrained(np.zeros((n_rows, 3), np.float32))
    sgd = cposembed.SGD(pe, 0.5, momentum=0.5)
    ref_buf = np.zeros((n_rows, 3), np.float32)
    ref_has = np.zeros(n_rows, bool)
    first_seen = []
    for batch in batches:
        rows = np.unique(np.array(batch, np.int64) % n_rows)
        grad = np.arange(1, rows.size * 3 + 1, dtype=np.float32).reshape(-1, 3)
        assert sgd._apply("embeddings", rows, grad, True, skip)
        for i, r in enumerate(rows):
            if r == skip:
                continue
            if not ref_has[r]:
                first_seen.append(int(r))
                ref_buf[r] = grad[i]
                ref_has[r] = True
            else:
                ref_buf[r] = ref_buf[r] * np.float32(0.5) + grad[i]
    slots = sgd._states["embeddings"].slots
    assert list(slots.rows()) == first_seen
    assert all(slots.slot_of(r) == i for i, r in enumerate(first_seen))
    if skip >= 0:
        assert slots.slot_of(skip) == -1
    exported = sgd.state_dict()["state"]["embeddings"]
    np.testing.assert_array_equal(exported["rows"], np.flatnonzero(ref_has))
    np.testing.assert_array_equal(exported["momentum_buffer"], ref_buf[ref_has])


def test_row_slots_refuse_bad_rows_and_pickle():
    s = _marks.RowSlots(10, np.array([7, 2, 9]))
    assert len(s) == 3 and list(s.rows()) == [7, 2, 9] and s.slot_of(2) == 1
    assert s.slot_of(3) == -1
    copy = pickle.loads(pickle.dumps(s))
    assert type(copy) is _marks.RowSlots and copy.n_rows == 10 and list(copy.rows()) == [7, 2, 9]
    for rows, message in [([10], "in \\[0, 10\\)"), ([-1], "in \\[0, 10\\)"), ([3, 3], "distinct")]:
        with pytest.raises(ValueError, match=message):
            _marks.RowSlots(10, np.array(rows))
    with pytest.raises(ValueError, match="n_rows must be >= 0"):
        _marks.RowSlots(-1)
    with pytest.raises(IndexError):
        s.slot_of(10)


SHARED_SLOTS_CHILD = """
import json
import numpy as np
from cposembed import _core, _marks
from cposembed.optim import Adam
from cposembed import TokenPositionEmbedding

n, d = 100, 4
m = TokenPositionEmbedding(n, n, d, seed=0)
adam = Adam(m, 0.1)
adam._step = 1
h = adam._kernel_hyper()
slots = _marks.RowSlots(n)
s = [np.zeros((n, d), np.float32) for _ in range(4)]
ids = np.arange(10, dtype=np.int64)[None]
positions = np.arange(50, 60, dtype=np.int64)
got = _core.fused_embed_step(
    (m.token_embeddings, s[0], s[1], slots, -1), (m.position_embeddings, s[2], s[3], slots, -1),
    np.ones((1, 10, d), np.float32), ids, positions, 0, h)
print(json.dumps({"result": repr(got), "slots": len(slots),
                  "unchanged": all(not a.any() for a in s)}))
"""


def test_the_fused_step_declines_one_row_slots_for_both_tables():
    """Each table's state has its own slots: one RowSlots given for both (tables of
    the same rows) is declined, nothing written (it would get two calls' rows)."""
    got = run_json(SHARED_SLOTS_CHILD)
    assert got == {"result": "None", "slots": 0, "unchanged": True}
