"""Training steps with the optimizers (``cposembed.SGD``, ``Adam``): the fused step on
GPT-2's input layer against ``embed_backward`` alone, the unfused step, PyTorch's and
FBGEMM's; a step on a table of millions of rows against ``np.add.at``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _core, _threads
from ..embedding import LearnedPositionEmbedding
from ..functional import scatter_add
from ..layer import embed_backward
from ..optim import SGD, Adam
from ..token_position import TokenPositionEmbedding
from ._common import OURS, Contender, Fixture, Group, max_terms, same

SGD_LR = 0.01
ADAM_LR = 1e-3
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
# The huge table: 20,000,000 rows (--quick: 200,000, still far more than the
# work), d = 16, 256 random positions.
HUGE_ROWS = 20_000_000
QUICK_HUGE_ROWS = 200_000
HUGE_DIM = 16
HUGE_POSITIONS = 256


def _on_threads(n: int, run: Callable[[], Any]) -> Callable[[], None]:
    """``run`` on ``n`` threads: the layers' methods take no ``num_threads=``, so the
    default is set for the call and the previous setting restored after it."""

    def call() -> None:
        before = _core.user_threads() or None  # set_num_threads(n), or None: not set
        _threads.set_num_threads(n)
        try:
            run()
        finally:
            _threads.set_num_threads(before)

    return call


def _layer(f: Fixture) -> TokenPositionEmbedding:
    """A layer over copies of the run's GPT-2 tables (the Fixture's stay as they are)."""
    return TokenPositionEmbedding.from_pretrained(f.layer.wte, f.layer.wpe, dtype=f.dt)


def _tables(layer: TokenPositionEmbedding) -> np.ndarray:
    return np.concatenate([layer.token_embeddings, layer.position_embeddings])


def _stepped(
    f: Fixture,
    grads: tuple[np.ndarray, np.ndarray],
    update: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> np.ndarray:
    """Both tables after one step from the run's tables: ``update(rows, their
    gradient)`` on the rows the batch touched, the other rows as they were."""
    out = []
    for table, grad, rows in (
        (f.layer.wte, grads[0], np.unique(f.layer.ids)),
        (f.layer.wpe, grads[1], np.arange(f.T)),
    ):
        new = table.copy()
        new[rows] = update(table[rows], grad[rows])
        out.append(new)
    return np.concatenate(out)


def _sgd_rule(p: np.ndarray, g: np.ndarray) -> np.ndarray:
    """torch.optim.SGD's step without momentum."""
    return p + -SGD_LR * g


def _adam_first_rule(p: np.ndarray, g: np.ndarray) -> np.ndarray:
    """torch.optim.Adam's first step (moments from zero, t = 1)."""
    beta1, beta2 = ADAM_BETAS
    m = p.dtype.type(1 - beta1) * g
    v = (1 - beta2) * g * g
    denom = np.sqrt(v) / (1 - beta2) ** 0.5 + ADAM_EPS
    return p + -(ADAM_LR / (1 - beta1)) * m / denom


def _fused_steps(f: Fixture) -> list[Group]:
    """Fused SGD and Adam steps against ``embed_backward`` alone, and the unfused SGD step."""
    ids, gout, nt = f.layer.ids, f.gout, f.nt
    g_wte, g_wpe = np.zeros_like(f.layer.wte), np.zeros_like(f.layer.wpe)
    # From zero for the checks; the timed calls then keep accumulating.
    embed_backward(g_wte, g_wpe, gout, ids, num_threads=nt)
    after_sgd = _stepped(f, (g_wte, g_wpe), _sgd_rule)
    after_adam = _stepped(f, (g_wte, g_wpe), _adam_first_rule)

    def alone(target: float) -> Contender:
        return Contender(
            "cposembed, embed_backward alone",
            lambda: embed_backward(g_wte, g_wpe, gout, ids, num_threads=nt),
            f.rows_bytes,
            target=target,
        )

    fused, unfused = _layer(f), _layer(f)
    sgd, sgd_unfused = SGD(fused, SGD_LR), SGD(unfused, SGD_LR)

    def unfused_step() -> None:
        unfused.zero_grad()
        unfused.backward(gout, ids)
        sgd_unfused.step()

    run_fused = _on_threads(nt, lambda: fused.backward(gout, ids, optimizer=sgd))
    run_unfused = _on_threads(nt, unfused_step)
    run_fused()
    run_unfused()
    mine = _tables(fused)
    sgd_alone = alone(1.15)
    sgd_alone.check = same(mine, after_sgd)
    peer = Contender("cposembed, unfused zero_grad + backward + step", run_unfused, f.rows_bytes)
    peer.check = same(mine, _tables(unfused), rtol=0, atol=0)

    with_adam = _layer(f)
    adam = Adam(with_adam, ADAM_LR, betas=ADAM_BETAS, eps=ADAM_EPS)
    run_adam = _on_threads(nt, lambda: with_adam.backward(gout, ids, optimizer=adam))
    run_adam()
    adam_alone = alone(1.8)
    adam_alone.check = same(_tables(with_adam), after_adam)
    note = f"both tables, vocab {f.vocab}, ids ({f.B}, {f.T}) Zipf 1.2, positions=None"
    return [
        Group(
            "optim: fused SGD step",
            [Contender(OURS, run_fused, f.rows_bytes), sgd_alone, peer],
            f"layer.backward(g, ids, optimizer=SGD(lr={SGD_LR:g})), {note}",
        ),
        Group(
            "optim: fused Adam step",
            [Contender(OURS, run_adam, f.rows_bytes), adam_alone],
            f"layer.backward(g, ids, optimizer=Adam(lr={ADAM_LR:g})), {note}",
        ),
    ]


def _fbgemm() -> Any:
    """FBGEMM's training modules, or None where fbgemm_gpu does not import (it is
    built against one PyTorch release: another one fails to load its libraries)."""
    try:
        training = importlib.import_module("fbgemm_gpu.split_table_batched_embeddings_ops_training")
        common = importlib.import_module("fbgemm_gpu.split_table_batched_embeddings_ops_common")
        configs = importlib.import_module("fbgemm_gpu.split_embedding_configs")
    except Exception:  # not installed, or not loadable with this torch
        return None
    return training, common, configs


def _fbgemm_step(f: Fixture, fbgemm: Any) -> tuple[Callable[[], None], Callable[[], Any]]:
    """FBGEMM's CPU table-batched embeddings over the run's two tables, unpooled,
    with its exact SGD fused into the backward: the step, and its tables."""
    training, common, configs = fbgemm
    torch = f.torch
    wte, wpe, ids = f.layer.wte, f.layer.wpe, f.layer.ids
    host, cpu = common.EmbeddingLocation.HOST, training.ComputeDevice.CPU
    tbe = training.SplitTableBatchedEmbeddingBagsCodegen(
        [(wte.shape[0], f.d, host, cpu), (wpe.shape[0], f.d, host, cpu)],
        optimizer=configs.EmbOptimType.EXACT_SGD,
        learning_rate=SGD_LR,
        pooling_mode=common.PoolingMode.NONE,
    )
    with torch.no_grad():
        for weight, src in zip(tbe.split_embedding_weights(), (wte, wpe)):
            weight.copy_(torch.from_numpy(src))
    n = ids.size
    # One bag per row looked up: the token ids (table 0), then the positions (table 1).
    indices = torch.cat([torch.from_numpy(ids.reshape(-1)), torch.arange(f.T).repeat(f.B)])
    offsets = torch.arange(2 * n + 1)
    g_flat = f.gout_t.reshape(n, f.d)

    def step() -> None:
        rows = tbe(indices, offsets)
        (rows[:n] + rows[n:]).backward(g_flat)

    def tables() -> Any:
        return torch.cat(tbe.split_embedding_weights()).numpy()

    return step, tables


def fwd_fused_step(f: Fixture) -> list[Group]:
    """Forward + fused SGD step against PyTorch's (and FBGEMM's) forward, backward and step."""
    ids, gout, nt = f.layer.ids, f.gout, f.nt
    layer = _layer(f)
    sgd = SGD(layer, SGD_LR)

    def fwd_step() -> None:
        layer(ids)
        layer.backward(gout, ids, optimizer=sgd)

    run_ours = _on_threads(nt, fwd_step)
    cs = [Contender(OURS, run_ours, 2 * f.rows_bytes)]
    note = (
        f"fwd + fused SGD(lr={SGD_LR:g}) step, vocab {f.vocab}, ids ({f.B}, {f.T}) Zipf 1.2, "
        "torch: opt.zero_grad() each step"
    )
    torch = f.torch
    if torch is None:
        return [Group("optim: fwd + fused SGD step", cs, note)]
    run_ours()
    mine = _tables(layer)
    # Theirs sum each row in their own order: the step moves by lr x the gradient.
    atol = SGD_LR * 1e-6 * max_terms(ids)
    tok_e = torch.nn.Embedding(*f.layer.wte.shape, sparse=True, dtype=f.tdt)
    pos_e = torch.nn.Embedding(*f.layer.wpe.shape, sparse=True, dtype=f.tdt)
    with torch.no_grad():
        tok_e.weight.copy_(torch.from_numpy(f.layer.wte))
        pos_e.weight.copy_(torch.from_numpy(f.layer.wpe))
    opt = torch.optim.SGD([tok_e.weight, pos_e.weight], lr=SGD_LR)
    ids_t, pos_t = torch.from_numpy(ids), torch.arange(f.T)

    def theirs() -> None:
        opt.zero_grad()
        (tok_e(ids_t) + pos_e(pos_t)).backward(f.gout_t)
        opt.step()

    peer = Contender(
        "torch 2 x nn.Embedding(sparse=True) + SGD", theirs, 2 * f.rows_bytes, target=0.15
    )
    theirs()
    theirs_tables = torch.cat([tok_e.weight, pos_e.weight]).detach().numpy()
    peer.check = same(mine, theirs_tables, atol=atol)
    cs.append(peer)
    fbgemm = _fbgemm() if f.dt == np.float32 else None
    if fbgemm is not None:
        fb_step, fb_tables = _fbgemm_step(f, fbgemm)
        fb = Contender("fbgemm TBE fwd + fused exact SGD", fb_step, 2 * f.rows_bytes)
        fb_step()
        fb.check = same(mine, fb_tables(), atol=atol)
        cs.append(fb)
    else:
        note += ", no FBGEMM row (fbgemm_gpu does not import, or not float32)"
    return [Group("optim: fwd + fused SGD step", cs, note)]


def optim_steps(f: Fixture) -> list[Group]:
    return [*_fused_steps(f), *fwd_fused_step(f)]


def optim_huge(f: Fixture) -> list[Group]:
    """256 random positions into a table of millions of rows: the cost must follow
    the positions, not the table (np.add.at's does)."""
    n_rows = QUICK_HUGE_ROWS if f.quick else HUGE_ROWS
    d, nt = HUGE_DIM, f.nt
    pos = f.rng.integers(0, n_rows, size=HUGE_POSITIONS, dtype=np.int64)
    g = f.rng.standard_normal((HUGE_POSITIONS, d)).astype(f.dt)
    # np.zeros: pages that are never written cost no memory.
    G, G2 = np.zeros((n_rows, d), f.dt), np.zeros((n_rows, d), f.dt)
    # From zero for the checks; the timed calls then keep accumulating.
    scatter_add(G, g, pos, num_threads=nt)
    np.add.at(G2, pos, g)
    rows = np.unique(pos)
    after = np.zeros((n_rows, d), f.dt)
    after[rows] = _sgd_rule(after[rows], G2[rows])
    pe = LearnedPositionEmbedding.from_pretrained(np.zeros((n_rows, d), f.dt), dtype=f.dt)
    sgd = SGD(pe, SGD_LR)
    pe.backward(g, pos, optimizer=sgd)
    nbytes = g.nbytes
    scatter_peer = Contender("numpy np.add.at", lambda: np.add.at(G2, pos, g), nbytes, target=1.0)
    scatter_peer.check = same(G, G2, rtol=0, atol=0)
    sgd_peer = Contender("numpy np.add.at", lambda: np.add.at(G2, pos, g), nbytes, target=2.0)
    sgd_peer.check = same(pe.embeddings, after)
    note = f"table {n_rows} x {d}, {HUGE_POSITIONS} random positions"
    return [
        Group(
            "huge table: scatter_add",
            [Contender(OURS, lambda: scatter_add(G, g, pos, num_threads=nt), nbytes), scatter_peer],
            f"scatter_add(G, g, pos) vs np.add.at(G, pos, g), {note}",
        ),
        Group(
            "huge table: fused SGD step",
            [Contender(OURS, lambda: pe.backward(g, pos, optimizer=sgd), nbytes), sgd_peer],
            f"pe.backward(g, pos, optimizer=SGD(lr={SGD_LR:g})) vs np.add.at, {note}",
        ),
        _adam_new_rows(f, n_rows, g, note),
    ]


def _adam_new_rows(f: Fixture, n_rows: int, g: np.ndarray, note: str) -> Group:
    """The fused Adam step on rows no step touched before (their state is the next
    rows of the state arrays) against the same step on rows it touched already:
    the same rows every time (in cache), and rows drawn from a pool stepped before
    (about a million rows: in memory, as new rows' table rows are). The table is
    resident first, as a trained one is."""
    n, d = g.shape
    pe = LearnedPositionEmbedding.from_pretrained(np.full((n_rows, d), 0.01, f.dt), dtype=f.dt)
    adam = Adam(pe, ADAM_LR)
    order = f.rng.permutation(n_rows)
    old, pool = order[:n], order[n : n + min(n_rows // 4, 4096 * n)]
    g_all = np.resize(g, (n + pool.size, d))  # g, then g again and again
    pe.backward(g_all, order[: n + pool.size], optimizer=adam)
    before = np.full(g_all.shape, 0.01, f.dt)
    first = same(pe.embeddings[order[: n + pool.size]], _adam_first_rule(before, g_all))
    drawn = [f.rng.choice(pool, n, replace=False) for _ in range(64)]
    fresh = {"next": n + pool.size, "drawn": 0}

    def new_rows() -> None:
        start = fresh["next"] if fresh["next"] + n <= n_rows else n  # then: rows seen before
        fresh["next"] = start + n
        pe.backward(g, order[start : start + n], optimizer=adam)

    def pool_rows() -> None:
        fresh["drawn"] += 1
        pe.backward(g, drawn[fresh["drawn"] % len(drawn)], optimizer=adam)

    peer = Contender(
        "cposembed, rows stepped before", lambda: pe.backward(g, old, optimizer=adam), 0
    )
    peer.target = 1.5
    peer.check = first  # the first step on distinct rows: torch.optim.Adam's rule
    pool_peer = Contender("cposembed, pool rows stepped before", pool_rows, 0)
    pool_peer.check = first
    return Group(
        "huge table: fused Adam, new rows",
        [Contender(OURS, new_rows, g.nbytes), peer, pool_peer],
        f"pe.backward(g, rows, optimizer=Adam(lr={ADAM_LR:g})), 256 rows no step touched "
        f"before vs 256 rows stepped before (the same ones; or drawn from a pool), {note}",
    )
