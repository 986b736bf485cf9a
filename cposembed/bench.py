"""``python -m cposembed bench``: cposembed side by side with the machine and its peers.

Every comparison runs in this one process on the same arrays with the same
threads: warm-up first, then rounds in which each contender runs once, in a
fresh shuffled order each round (so drifting machine load hits all alike,
and no contender always follows the same other one: a peer whose OpenMP
threads still spin after its call would otherwise always slow down the same
contender); the median per contender is reported, and ratios are
``time(cposembed) / time(other)`` (below 1: cposembed is faster).

The machine's own limits are measured in the same run on the same number of
bytes: a streaming (non-temporal store) fill, a streaming copy and a
vectorised read-only sum (``cposembed._membench``). Peers: the handbook's
NumPy class, plain NumPy (``np.take``, ``tok + P[pos]``, ``np.add.at``) and,
when it is installed, PyTorch's CPU ops. Outputs are checked equal to each
peer's before timing.

Options: ``--quick`` (a few seconds, a smoke test for CI), ``--table L D``, ``--vocab V``,
``--batch B T``, ``--threads N``, ``--repeats R``, ``--dtype``, ``--json FILE``,
``--no-torch``, ``--only NAME...``. Progress goes to stderr, the table to stdout:
each row's ``ours/this`` ratio and, for a row with a target, the rule it is
judged by (``ours/this <= 0.65``; the threads rows also pass within 1.1 x
the machine's limit) and the verdict. Comparisons whose only peer is PyTorch
are named as not compared when torch is missing. The table ends with a line
per missed target and a one-line summary (targets met and missed, output
check mismatches). A ``--quick`` run measures at small sizes, where the
targets (set for the full sizes) say nothing: it reports them as
``n/a (quick)``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _membench, _state, _threads
from .embedding import LearnedPositionEmbedding
from .functional import add_positions, lookup, scatter_add
from .layer import embed, embed_backward
from .reference import LearnedPositionEmbedding as ReferenceEmbedding

OURS = "cposembed"

# Targets: (op, contender) -> the largest acceptable
# time(cposembed) / time(contender). Reported as ok/MISS, never asserted.
TARGETS: dict[tuple[str, str], float] = {
    ("lookup(out=)", "limit: streaming fill"): 1.1,
    ("lookup(out=)", "torch index_select(out=)"): 0.6,
    ("pe(pos)", "reference r(pos) [float64]"): 0.3,
    ("pe(pos)", "numpy P[pos]"): 0.65,
    ("add_positions(out=)", "limit: streaming copy"): 1.1,
    ("add_positions in place", "limit: streaming copy"): 1.1,
    ("pe.add_to(tok)", "numpy tok + P[pos]"): 0.25,
    ("scatter_add arange", "limit: read once"): 1.3,
    ("scatter_add arange", "numpy np.add.at"): 0.025,
    ("scatter_add arange", "torch index_add_"): 0.8,
    ("scatter_add random", "limit: read once"): 1.5,
    ("scatter_add random", "numpy np.add.at"): 0.025,
    ("scatter_add random", "torch index_add_"): 0.7,
    ("pe(pos, out=) + pe.backward", "torch F.embedding fwd+bwd"): 0.25,
    ("threads: lookup(out=)", "1 thread"): 0.8,
    ("threads: scatter_add random", "1 thread"): 0.7,
    ("tiny: pe(5)", "reference"): 1.3,
    ("tiny: pe([0])", "reference"): 0.6,
    ("tiny: pe(arange(10))", "reference"): 0.6,
    ("tiny: pe(4x128 array)", "reference"): 0.3,
    ("tiny: add_to((1,1,d), offset=i)", "numpy tok + table[i]"): 1.2,
    # The scalar and list forms NumPy users pass, explicit positions on small
    # calls, batched decoding, the class's backward against the function it wraps.
    ("tiny: pe(np.int64(5))", "reference"): 1.3,
    ("tiny: pe(positions[i])", "reference"): 1.3,
    ("tiny: pe([np.int64(1), np.int64(2)])", "reference"): 0.6,
    ("tiny: add_to((1,1,d), offset=np.int64(i))", "numpy tok + table[i]"): 1.2,
    ("add_to explicit (4, 1, d)", "numpy tok + P[pos]"): 1.0,
    ("add_to explicit (32, 1, d)", "numpy tok + P[pos]"): 1.0,
    ("add_to explicit (4, 100, d)", "numpy tok + P[pos]"): 0.7,
    ("backward vs scatter_add (4, 1, d)", "scatter_add"): 1.3,
    ("backward vs scatter_add (32, 1, d)", "scatter_add"): 1.3,
    ("backward vs scatter_add (4, 100, d)", "scatter_add"): 1.3,
    ("backward vs scatter_add (B, T, d)", "scatter_add"): 1.3,
    ("decode batched: add_to((8,1,d), pos (8,1))", "numpy tok + table[pos]"): 1.0,
    # The whole input layer, GPT-2 sizes, Zipf-like token ids.
    ("embed(out=)", "limit: streaming fill"): 1.15,
    ("embed(out=)", "torch index_select(out=) + add_"): 0.4,
    ("embed", "numpy wte[ids] + wpe[:T]"): 0.15,
    ("embed_backward", "limit: read once"): 1.8,
    ("embed_backward", "torch index_add_ + batch sum"): 0.35,
    # PyTorch layers: cposembed.torch against nn.Embedding modules.
    ("torch layer fwd+bwd", "torch 2 x nn.Embedding fwd+bwd"): 0.2,
    ("torch layer fwd, no_grad", "torch 2 x nn.Embedding fwd"): 0.2,
    ("torch converted nn.Embedding fwd+bwd", "torch nn.Embedding fwd+bwd"): 0.3,
}

# The names --only takes, in the order the comparisons run (threads_* only
# with more than one thread).
GROUP_NAMES = (
    "lookup",
    "pe_alloc",
    "add_out",
    "add_inplace",
    "add_to",
    "add_to_explicit",
    "scatter_arange",
    "scatter_random",
    "backward_vs_scatter",
    "fwd_bwd",
    "threads_lookup",
    "threads_scatter",
    "tiny",
    "decode_batched",
    "embed_out",
    "embed_alloc",
    "embed_backward",
    "torch_layer",
)


@dataclass
class Contender:
    name: str
    fn: Callable[[], Any]
    nbytes: int  # bytes this contender must move through memory at least
    times: list[float] = field(default_factory=list)
    check: str = ""

    @property
    def median(self) -> float:
        return float(np.median(self.times)) if self.times else float("nan")


@dataclass
class Group:
    op: str
    contenders: list[Contender]
    note: str = ""
    # Microsecond calls: timed in batches of calls (_time_tiny), not one by one.
    tiny: bool = False


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _round_orders(n: int, rounds: int) -> list[list[int]]:
    """A shuffled order of the n contenders per round (seeded: repeatable).

    A rotating order keeps the cyclic sequence, so each contender would
    always run right after the same other one; shuffling spreads whatever a
    contender leaves behind (spinning OpenMP workers of another runtime,
    dirty cache lines) over all of them.
    """
    rng = random.Random(n * 1000 + rounds)
    orders = []
    for _ in range(rounds):
        order = list(range(n))
        rng.shuffle(order)
        orders.append(order)
    return orders


def _time_group(group: Group, repeats: int, slow_s: float = 0.3) -> None:
    """Warm-up, then alternating rounds in shuffled order; fills ``.times``."""
    for c in group.contenders:
        t0 = time.perf_counter()
        c.fn()
        c.times = []
        c._warm = time.perf_counter() - t0  # type: ignore[attr-defined]
    for order in _round_orders(len(group.contenders), repeats):
        for k in order:
            c = group.contenders[k]
            # A contender taking seconds (np.add.at) gets 3 runs, not all.
            if c._warm > slow_s and len(c.times) >= 3:  # type: ignore[attr-defined]
                continue
            t0 = time.perf_counter()
            c.fn()
            c.times.append(time.perf_counter() - t0)


def _time_tiny(group: Group, repeats: int, budget_s: float = 0.005) -> None:
    """Per-call times of microsecond calls: batches of calls, alternating."""
    for c in group.contenders:
        c.fn()
        per_call = timeit.Timer(c.fn).timeit(50) / 50
        c._number = max(1, int(budget_s / max(per_call, 1e-8)))  # type: ignore[attr-defined]
        c.times = []
    for order in _round_orders(len(group.contenders), repeats * 3):
        for k in order:
            c = group.contenders[k]
            t = timeit.Timer(c.fn).timeit(c._number)  # type: ignore[attr-defined]
            c.times.append(t / c._number)  # type: ignore[attr-defined]
    for c in group.contenders:
        # The fastest batches: the ones least disturbed by other processes.
        c.times = sorted(c.times)[: max(3, len(c.times) // 3)]


def _same(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6) -> str:
    """How ``a`` compares with ``b``. Sums of many terms in another order (a
    peer's) need a looser tolerance: pass one scaled to the number of terms."""
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape:
        return f"MISMATCH shape {a.shape} vs {b.shape}"
    if np.array_equal(a, b):
        return "equal"
    if np.allclose(a, b, rtol=rtol, atol=atol):
        diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
        return f"close (max |diff| {diff:.1e})"
    return "MISMATCH"


def _grad_of(module: Any) -> np.ndarray:
    grad = module.weight.grad
    assert grad is not None, "no gradient after backward"
    return np.asarray(grad.numpy())


def _try_torch(enabled: bool, n_threads: int) -> Any:
    if not enabled:
        return None
    try:
        import torch
    except Exception:  # not installed or broken: the torch rows are skipped
        return None
    torch.set_num_threads(n_threads)
    return torch


def build_groups(
    args: argparse.Namespace, torch: Any
) -> list[tuple[str, Callable[[], Group | list[Group]]]]:
    """(name, factory) per comparison, in GROUP_NAMES order.

    Factories allocate lazily to save memory.
    """
    L, d = args.table
    B, T = args.batch
    nt = args.threads
    dt = np.dtype(args.dtype)
    rng = np.random.default_rng(0)
    pe = LearnedPositionEmbedding(L, d, seed=0, dtype=dt)
    P = pe.embeddings
    ref = None
    pos_ar = np.broadcast_to(np.arange(T, dtype=np.int64), (B, T)).copy()
    pos_rand = rng.integers(0, L, size=(B, T), dtype=np.int64)
    tok = rng.standard_normal((B, T, d)).astype(dt)
    gout = rng.standard_normal((B, T, d)).astype(dt)
    out = np.empty((B, T, d), dt)
    isz = dt.itemsize
    rows_bytes = B * T * d * isz
    # The limit probes work on float32 buffers of the same byte count.
    probe_dst = out.view(np.float32).reshape(-1)
    probe_src = tok.view(np.float32).reshape(-1)
    probe_grad = gout.view(np.float32).reshape(-1)
    # The probes follow the kernels' thread rule (small work runs serially).
    probe_nt = _threads.effective_num_threads(nt, probe_dst.size, B * T)

    t_ = torch
    if t_ is not None:
        tdt = {np.dtype(np.float32): t_.float32, np.dtype(np.float64): t_.float64}[dt]
        Pt = t_.from_numpy(P)
        pos_ar_t = t_.from_numpy(pos_ar)
        pos_rand_t = t_.from_numpy(pos_rand)
        tok_t = t_.from_numpy(tok)
        gout_t = t_.from_numpy(gout)
        out_t = t_.from_numpy(out)

    def g_lookup() -> Group:
        cs = [
            Contender(OURS, lambda: lookup(P, pos_ar, out=out, num_threads=nt), rows_bytes),
            Contender(
                "limit: streaming fill", lambda: _membench.fill(probe_dst, probe_nt), rows_bytes
            ),
            Contender(
                "numpy np.take(out=)", lambda: np.take(P, pos_ar, axis=0, out=out), rows_bytes
            ),
        ]
        mine = lookup(P, pos_ar, num_threads=nt)
        cs[2].check = _same(mine, np.take(P, pos_ar, axis=0))
        if t_ is not None:
            o2 = out_t.view(B * T, d)
            p2 = pos_ar_t.view(-1)
            cs.append(
                Contender(
                    "torch index_select(out=)",
                    lambda: t_.index_select(Pt, 0, p2, out=o2),
                    rows_bytes,
                )
            )
            cs[-1].check = _same(mine, t_.index_select(Pt, 0, p2).numpy().reshape(B, T, d))
        return Group("lookup(out=)", cs, f"positions {pos_ar.shape} arange")

    def g_pe_alloc() -> Group:
        nonlocal ref
        if ref is None:
            state = np.random.get_state()
            ref = ReferenceEmbedding(L, d, seed=0)
            np.random.set_state(state)
        cs = [
            Contender(OURS, lambda: pe(pos_rand), rows_bytes),
            Contender("reference r(pos) [float64]", lambda: ref(pos_rand), rows_bytes * 8 // isz),
            Contender("numpy P[pos]", lambda: P[pos_rand], rows_bytes),
        ]
        mine = pe(pos_rand)
        cs[1].check = _same(mine, ref(pos_rand).astype(dt))
        cs[2].check = _same(mine, P[pos_rand])
        if t_ is not None:
            F = t_.nn.functional
            cs.append(
                Contender("torch F.embedding", lambda: F.embedding(pos_rand_t, Pt), rows_bytes)
            )
            cs[-1].check = _same(mine, F.embedding(pos_rand_t, Pt).numpy())
        return Group("pe(pos)", cs, "allocating the output; positions random")

    def g_add_out() -> Group:
        cs = [
            Contender(OURS, lambda: add_positions(tok, P, out=out, num_threads=nt), 2 * rows_bytes),
            Contender(
                "limit: streaming copy",
                lambda: _membench.copy(probe_dst, probe_src, probe_nt),
                2 * rows_bytes,
            ),
            Contender(
                "numpy np.add(tok, P[pos], out=)",
                lambda: np.add(tok, P[:T], out=out),
                2 * rows_bytes,
            ),
        ]
        mine = add_positions(tok, P)
        cs[2].check = _same(mine, tok + P[np.arange(T)])
        if t_ is not None:
            cs.append(
                Contender(
                    "torch add(tok, P[pos], out=)",
                    lambda: t_.add(tok_t, Pt[:T], out=out_t),
                    2 * rows_bytes,
                )
            )
            cs[-1].check = _same(mine, t_.add(tok_t, Pt[:T]).numpy())
        return Group("add_positions(out=)", cs, "positions=None (arange(T) per sequence)")

    def g_add_inplace() -> Group:
        work = tok.copy()
        wf = work.reshape(-1).view(np.float32)
        cs = [
            Contender(
                OURS, lambda: add_positions(work, P, out=work, num_threads=nt), 2 * rows_bytes
            ),
            Contender(
                "limit: streaming copy",
                lambda: _membench.copy(probe_dst, wf, probe_nt),
                2 * rows_bytes,
            ),
            Contender("numpy tok += P[pos]", lambda: np.add(work, P[:T], out=work), 2 * rows_bytes),
        ]
        a = tok.copy()
        add_positions(a, P, out=a)
        cs[2].check = _same(a, tok + P[:T])
        if t_ is not None:
            w_t = t_.from_numpy(work)
            cs.append(Contender("torch tok.add_(P[pos])", lambda: w_t.add_(Pt[:T]), 2 * rows_bytes))
            cs[-1].check = _same(a, t_.from_numpy(tok.copy()).add_(Pt[:T]).numpy())
        return Group("add_positions in place", cs, "out=tok")

    def g_add_to() -> Group:
        idx = np.arange(T)
        cs = [
            Contender(OURS, lambda: pe.add_to(tok), 2 * rows_bytes),
            Contender("numpy tok + P[pos]", lambda: tok + P[idx], 2 * rows_bytes),
        ]
        cs[1].check = _same(pe.add_to(tok), tok + P[idx])
        if t_ is not None:
            F = t_.nn.functional
            it = t_.from_numpy(idx)
            cs.append(
                Contender(
                    "torch tok + F.embedding(pos)",
                    lambda: tok_t + F.embedding(it, Pt),
                    2 * rows_bytes,
                )
            )
            cs[-1].check = _same(pe.add_to(tok), (tok_t + F.embedding(it, Pt)).numpy())
        return Group("pe.add_to(tok)", cs, "allocating the output")

    def g_scatter(kind: str) -> Group:
        pos = pos_ar if kind == "arange" else pos_rand
        G = np.zeros_like(P)
        G2 = np.zeros_like(P)
        # Ours with positions=None for arange: the common training call.
        pos_arg = None if kind == "arange" else pos
        cs = [
            Contender(OURS, lambda: scatter_add(G, gout, pos_arg, num_threads=nt), rows_bytes),
            Contender(
                "limit: read once", lambda: _membench.read_sum(probe_grad, probe_nt), rows_bytes
            ),
            Contender("numpy np.add.at", lambda: np.add.at(G2, pos, gout), rows_bytes),
        ]
        a = np.zeros_like(P)
        scatter_add(a, gout, pos_arg)
        b = np.zeros_like(P)
        np.add.at(b, pos, gout)
        cs[2].check = _same(a, b)
        if t_ is not None:
            Gt = t_.zeros(L, d, dtype=tdt)
            pt = (pos_ar_t if kind == "arange" else pos_rand_t).reshape(-1)
            g2 = gout_t.reshape(-1, d)
            cs.append(Contender("torch index_add_", lambda: Gt.index_add_(0, pt, g2), rows_bytes))
            cs[-1].check = _same(a, t_.zeros(L, d, dtype=tdt).index_add_(0, pt, g2).numpy())
        return Group(
            f"scatter_add {kind}",
            cs,
            "positions=None" if kind == "arange" else "positions (B, T) uniform",
        )

    def g_fwd_bwd() -> Group:
        pe2 = LearnedPositionEmbedding(L, d, seed=0, dtype=dt)

        def ours() -> None:
            pe2(pos_ar, out=out)
            pe2.zero_grad()
            pe2.backward(gout, pos_ar)

        cs = [Contender(OURS, ours, 2 * rows_bytes)]
        if t_ is not None:
            F = t_.nn.functional
            W = t_.from_numpy(P.copy()).requires_grad_(True)

            def theirs() -> None:
                W.grad = None
                F.embedding(pos_ar_t, W).backward(gout_t)

            cs.append(Contender("torch F.embedding fwd+bwd", theirs, 2 * rows_bytes))
            ours()
            theirs()
            cs[-1].check = _same(pe2.grad, W.grad.numpy())
        return Group("pe(pos, out=) + pe.backward", cs, "positions (B, T) arange")

    def g_threads(kind: str) -> Group:
        if kind == "lookup":

            def run(n: int) -> Callable[[], Any]:
                return lambda: lookup(P, pos_ar, out=out, num_threads=n)

            nbytes = rows_bytes
            extra = [
                Contender(
                    "limit: streaming fill", lambda: _membench.fill(probe_dst, probe_nt), rows_bytes
                )
            ]
            op = "threads: lookup(out=)"
        else:
            G = np.zeros_like(P)

            def run(n: int) -> Callable[[], Any]:
                return lambda: scatter_add(G, gout, pos_rand, num_threads=n)

            nbytes = rows_bytes
            extra = []
            op = "threads: scatter_add random"
        cs = [Contender(OURS, run(nt), nbytes), Contender("1 thread", run(1), nbytes)] + extra
        return Group(op, cs, f"{nt} threads vs 1")

    def small_pair(
        op: str, mine: Callable[[], Any], theirs: Callable[[], Any], name: str, note: str
    ) -> Group:
        """A per-call comparison whose outputs must be equal (in the table's dtype)."""
        cs = [Contender(OURS, mine, 0), Contender(name, theirs, 0)]
        cs[1].check = _same(mine(), np.asarray(theirs()).astype(dt))
        return Group(op, cs, note, tiny=True)

    def tiny_table() -> tuple[LearnedPositionEmbedding, Any]:
        """The handbook's 128 x 64 table, ours and the reference's."""
        tp = LearnedPositionEmbedding(128, 64, seed=42, dtype=dt)
        state = np.random.get_state()
        tr = ReferenceEmbedding(128, 64, seed=42)
        np.random.set_state(state)
        return tp, tr

    def g_tiny() -> list[Group]:
        tp, tr = tiny_table()
        table = tp.embeddings
        a10 = np.arange(10)
        a4 = np.random.default_rng(1).integers(0, 128, size=(4, 128))
        t1 = np.random.default_rng(2).standard_normal((1, 1, 64)).astype(dt)
        i5 = np.int64(5)
        pos_i64 = np.arange(128, dtype=np.int64)
        two = [np.int64(1), np.int64(2)]
        off17 = np.int64(17)
        return [
            small_pair(op, mine, theirs, name, "128 x 64 table, per call")
            for op, mine, theirs, name in [
                ("tiny: pe(5)", lambda: tp(5), lambda: tr(5), "reference"),
                ("tiny: pe(np.int64(5))", lambda: tp(i5), lambda: tr(i5), "reference"),
                (
                    "tiny: pe(positions[i])",
                    lambda: tp(pos_i64[7]),
                    lambda: tr(pos_i64[7]),
                    "reference",
                ),
                ("tiny: pe([0])", lambda: tp([0]), lambda: tr([0]), "reference"),
                (
                    "tiny: pe([np.int64(1), np.int64(2)])",
                    lambda: tp(two),
                    lambda: tr(two),
                    "reference",
                ),
                ("tiny: pe(arange(10))", lambda: tp(a10), lambda: tr(a10), "reference"),
                ("tiny: pe(4x128 array)", lambda: tp(a4), lambda: tr(a4), "reference"),
                (
                    "tiny: add_to((1,1,d), offset=i)",
                    lambda: tp.add_to(t1, offset=77),
                    lambda: t1 + table[77],
                    "numpy tok + table[i]",
                ),
                (
                    "tiny: add_to((1,1,d), offset=np.int64(i))",
                    lambda: tp.add_to(t1, offset=off17),
                    lambda: t1 + table[17],
                    "numpy tok + table[i]",
                ),
            ]
        ]

    def g_decode_batched() -> Group:
        tp, _ = tiny_table()
        table = tp.embeddings
        rng8 = np.random.default_rng(3)
        tok8 = rng8.standard_normal((8, 1, 64)).astype(dt)
        pos8 = rng8.integers(0, 128, size=(8, 1), dtype=np.int64)
        return small_pair(
            "decode batched: add_to((8,1,d), pos (8,1))",
            lambda: tp.add_to(tok8, pos8),
            lambda: tok8 + table[pos8],
            "numpy tok + table[pos]",
            "128 x 64 table, 8 rows at their own positions, per call",
        )

    # (B, T) of the small calls: decode steps of 4 and 32 rows, a short prefill.
    small_sizes = [(4, 1), (32, 1), (4, 100)]

    def add_to_explicit(b: int, t: int) -> Group:
        tok_s = rng.standard_normal((b, t, d)).astype(dt)
        pos_s = rng.integers(0, L, size=(b, t), dtype=np.int64)
        return small_pair(
            f"add_to explicit ({b}, {t}, d)",
            lambda: pe.add_to(tok_s, pos_s),
            lambda: tok_s + P[pos_s],
            "numpy tok + P[pos]",
            f"{L} x {d} table, positions ({b}, {t}) random int64, per call",
        )

    def g_add_to_explicit() -> list[Group]:
        return [add_to_explicit(b, t) for b, t in small_sizes]

    def backward_vs_scatter(label: str, g_s: np.ndarray, pos_s: np.ndarray, tiny: bool) -> Group:
        pe_b = LearnedPositionEmbedding(L, d, seed=0, dtype=dt)
        G = np.zeros_like(P)
        # Checked from zero; then both keep accumulating into their gradient,
        # so the timed calls do the same work and no table-sized reset hides
        # the per-call cost of the small ones.
        ours = pe_b.backward(g_s, pos_s)
        cs = [
            Contender(OURS, lambda: pe_b.backward(g_s, pos_s), g_s.nbytes),
            Contender("scatter_add", lambda: scatter_add(G, g_s, pos_s), g_s.nbytes),
        ]
        cs[1].check = _same(ours, scatter_add(G, g_s, pos_s))
        note = (
            f"pe.backward(g, pos) vs scatter_add(G, g, pos), accumulating; "
            f"positions {pos_s.shape} random"
        )
        return Group(f"backward vs scatter_add {label}", cs, note, tiny=tiny)

    def g_backward_vs_scatter() -> list[Group]:
        out_groups = []
        for b, t in small_sizes:
            g_s = rng.standard_normal((b, t, d)).astype(dt)
            pos_s = rng.integers(0, L, size=(b, t), dtype=np.int64)
            out_groups.append(backward_vs_scatter(f"({b}, {t}, d)", g_s, pos_s, tiny=True))
        # The full batch, on the arrays the other groups use.
        out_groups.append(backward_vs_scatter("(B, T, d)", gout, pos_rand, tiny=False))
        return out_groups

    # The whole input layer: GPT-2's vocabulary (--vocab), a position table
    # of at least T rows, token ids drawn Zipf-like (exponent 1.2: about
    # 7,400 distinct ids in 32 x 1024, the most frequent thousands of times).
    layer: dict[str, Any] = {}

    def layer_arrays() -> dict[str, Any]:
        if not layer:
            n_pos = max(T, min(L, 1024))
            layer["wte"] = np.random.default_rng(1).standard_normal((args.vocab, d)).astype(dt)
            layer["wpe"] = np.ascontiguousarray(np.resize(P, (n_pos, d)))
            zipf = np.random.default_rng(2).zipf(1.2, size=(B, T))
            layer["ids"] = (zipf - 1) % args.vocab
        return layer

    def g_embed_out() -> Group:
        a = layer_arrays()
        wte, wpe, ids = a["wte"], a["wpe"], a["ids"]
        cs = [
            Contender(OURS, lambda: embed(ids, wte, wpe, out=out, num_threads=nt), rows_bytes),
            Contender(
                "limit: streaming fill", lambda: _membench.fill(probe_dst, probe_nt), rows_bytes
            ),
        ]
        mine = embed(ids, wte, wpe)
        if t_ is not None:
            wte_t, wpe_t = t_.from_numpy(wte), t_.from_numpy(wpe)
            ids_t = t_.from_numpy(ids.reshape(-1))
            o2 = out_t.view(B, T, d)
            o_flat = out_t.view(B * T, d)

            def theirs() -> None:
                t_.index_select(wte_t, 0, ids_t, out=o_flat)
                o2.add_(wpe_t[:T])

            cs.append(Contender("torch index_select(out=) + add_", theirs, rows_bytes))
            theirs()
            cs[-1].check = _same(mine, out)
        return Group(
            "embed(out=)",
            cs,
            f"vocab {args.vocab}, ids ({B}, {T}) Zipf 1.2 "
            f"({len(np.unique(ids))} distinct), positions=None",
        )

    def g_embed_alloc() -> Group:
        a = layer_arrays()
        wte, wpe, ids = a["wte"], a["wpe"], a["ids"]
        cs = [
            Contender(OURS, lambda: embed(ids, wte, wpe, num_threads=nt), rows_bytes),
            Contender("numpy wte[ids] + wpe[:T]", lambda: wte[ids] + wpe[:T], rows_bytes),
        ]
        cs[1].check = _same(embed(ids, wte, wpe), wte[ids] + wpe[:T])
        return Group("embed", cs, "allocating the output")

    def g_embed_backward() -> Group:
        a = layer_arrays()
        wte, wpe, ids = a["wte"], a["wpe"], a["ids"]
        g_wte, g_wpe = np.zeros_like(wte), np.zeros_like(wpe)
        cs = [
            Contender(
                OURS,
                lambda: embed_backward(g_wte, g_wpe, gout, ids, num_threads=nt),
                rows_bytes,
            ),
            Contender(
                "limit: read once", lambda: _membench.read_sum(probe_grad, probe_nt), rows_bytes
            ),
        ]
        if t_ is not None:
            gt_t = t_.zeros(wte.shape, dtype=tdt)
            gp_t = t_.zeros(wpe.shape, dtype=tdt)
            ids_t = t_.from_numpy(ids.reshape(-1))
            g_flat = gout_t.reshape(B * T, d)

            def theirs() -> None:
                gt_t.index_add_(0, ids_t, g_flat)
                gp_t[:T].add_(gout_t.sum(0))

            cs.append(Contender("torch index_add_ + batch sum", theirs, rows_bytes))
            a_t, a_p = np.zeros_like(wte), np.zeros_like(wpe)
            embed_backward(a_t, a_p, gout, ids)
            gt_t.zero_()
            gp_t.zero_()
            theirs()
            # torch sums each row in its own order: a frequent token's
            # thousands of float32 terms round differently.
            terms = int(np.bincount(ids.ravel()).max())
            cs[-1].check = _same(
                np.concatenate([a_t, a_p]),
                np.concatenate([gt_t.numpy(), gp_t.numpy()]),
                rtol=1e-6 * terms,
                atol=1e-6 * terms,
            )
        return Group("embed_backward", cs, "both tables, positions=None")

    def g_torch_layer() -> list[Group]:
        if t_ is None:
            return []
        import cposembed.torch as ct

        a = layer_arrays()
        wte, wpe, ids = a["wte"], a["wpe"], a["ids"]
        ids_t = t_.from_numpy(ids)
        pos_t = t_.arange(T)
        layer_t = ct.TokenPositionEmbedding(args.vocab, wpe.shape[0], d, dtype=tdt)
        tok_e = t_.nn.Embedding(args.vocab, d, dtype=tdt)
        pos_e = t_.nn.Embedding(wpe.shape[0], d, dtype=tdt)
        with t_.no_grad():
            for w, src in (
                (layer_t.tokens.weight, wte),
                (layer_t.positions.weight, wpe),
                (tok_e.weight, wte),
                (pos_e.weight, wpe),
            ):
                w.copy_(t_.from_numpy(src))

        # Each step keeps the last step's gradients alive (as a user logging
        # them or an optimizer holding them would) and starts from .grad None.
        kept: dict[str, list[Any]] = {"ours": [], "theirs": []}

        def step(name: str, modules: list[Any], forward: Callable[[], Any]) -> None:
            kept[name] = [m.weight.grad for m in modules]
            for m in modules:
                m.zero_grad(set_to_none=True)
            forward().backward(gout_t)

        def ours() -> None:
            step("ours", [layer_t.tokens, layer_t.positions], lambda: layer_t(ids_t))

        def theirs() -> None:
            step("theirs", [tok_e, pos_e], lambda: tok_e(ids_t) + pos_e(pos_t))

        def ours_fwd() -> None:
            with t_.no_grad():
                layer_t(ids_t)

        def theirs_fwd() -> None:
            with t_.no_grad():
                tok_e(ids_t) + pos_e(pos_t)

        fb = [
            Contender(OURS, ours, 2 * rows_bytes),
            Contender("torch 2 x nn.Embedding fwd+bwd", theirs, 2 * rows_bytes),
        ]
        ours()
        theirs()
        terms = int(np.bincount(ids.ravel()).max())
        fb[1].check = _same(
            np.concatenate([_grad_of(layer_t.tokens), _grad_of(layer_t.positions)]),
            np.concatenate([_grad_of(tok_e), _grad_of(pos_e)]),
            rtol=1e-6 * terms,
            atol=1e-6 * terms,
        )
        fwd = [
            Contender(OURS, ours_fwd, rows_bytes),
            Contender("torch 2 x nn.Embedding fwd", theirs_fwd, rows_bytes),
        ]
        with t_.no_grad():
            fwd[1].check = _same(layer_t(ids_t), tok_e(ids_t) + pos_e(pos_t))
        note = (
            f"cposembed.torch.TokenPositionEmbedding vs two nn.Embedding, vocab {args.vocab}, "
            f"ids ({B}, {T}) Zipf 1.2"
        )
        # One nn.Embedding (GPT-2's wte) as convert_embeddings leaves it.
        plain_e = t_.nn.Embedding(args.vocab, d, dtype=tdt)
        conv_e: Any = ct.convert_embeddings(t_.nn.Embedding(args.vocab, d, dtype=tdt))
        with t_.no_grad():
            plain_e.weight.copy_(t_.from_numpy(wte))
            conv_e.weight.copy_(t_.from_numpy(wte))

        def conv_ours() -> None:
            step("ours", [conv_e], lambda: conv_e(ids_t))

        def conv_theirs() -> None:
            step("theirs", [plain_e], lambda: plain_e(ids_t))

        conv = [
            Contender(OURS, conv_ours, 2 * rows_bytes),
            Contender("torch nn.Embedding fwd+bwd", conv_theirs, 2 * rows_bytes),
        ]
        conv_ours()
        conv_theirs()
        conv[1].check = _same(_grad_of(conv_e), _grad_of(plain_e), rtol=0, atol=0)
        return [
            Group(
                "torch layer fwd+bwd",
                fb,
                note + ", zero_grad(set_to_none=True) each step, last step's .grad kept",
            ),
            Group("torch layer fwd, no_grad", fwd, note),
            Group(
                "torch converted nn.Embedding fwd+bwd",
                conv,
                f"convert_embeddings(nn.Embedding({args.vocab}, {d})) vs nn.Embedding, "
                f"ids ({B}, {T}) Zipf 1.2, last step's .grad kept",
            ),
        ]

    groups: list[tuple[str, Callable[[], Group | list[Group]]]] = [
        ("lookup", g_lookup),
        ("pe_alloc", g_pe_alloc),
        ("add_out", g_add_out),
        ("add_inplace", g_add_inplace),
        ("add_to", g_add_to),
        ("add_to_explicit", g_add_to_explicit),
        ("scatter_arange", lambda: g_scatter("arange")),
        ("scatter_random", lambda: g_scatter("random")),
        ("backward_vs_scatter", g_backward_vs_scatter),
        ("fwd_bwd", g_fwd_bwd),
    ]
    if nt > 1:
        groups += [
            ("threads_lookup", lambda: g_threads("lookup")),
            ("threads_scatter", lambda: g_threads("scatter")),
        ]
    groups += [("tiny", g_tiny), ("decode_batched", g_decode_batched)]
    groups += [
        ("embed_out", g_embed_out),
        ("embed_alloc", g_embed_alloc),
        ("embed_backward", g_embed_backward),
        ("torch_layer", g_torch_layer),
    ]
    return groups


def _fmt_ms(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:9.2f} us"
    return f"{s * 1e3:9.2f} ms"


QUICK_VERDICT = "n/a (quick)"
RATIO = "ours/this"
# Printed above the table and in the Markdown: the one direction of every ratio.
RATIO_LEGEND = (
    "ours/this = time(cposembed) / time(this contender), from the same run: "
    "below 1, cposembed is faster. A target is the largest ours/this that meets it."
)
# The exception for the threads rows: more threads need not help once
# cposembed already runs within this factor of the machine's limit.
THREADS_LIMIT_FACTOR = 1.1


def _rule(group: Group, target: float) -> str:
    """The rule a row with ``target`` is judged by, as the table prints it."""
    rule = f"{RATIO} <= {target:g}"
    if group.op.startswith("threads:") and _limit_of(group) is not None:
        rule += f", or ours/limit <= {THREADS_LIMIT_FACTOR:g}"
    return rule


def _limit_of(group: Group) -> Contender | None:
    return next((c for c in group.contenders if c.name.startswith("limit:")), None)


def _judge(group: Group, ratio: float, target: float) -> tuple[bool, str]:
    """Whether a row meets its target, and the verdict with the numbers that decided it."""
    if ratio <= target:
        return True, "ok"
    limit = _limit_of(group)
    if group.op.startswith("threads:") and limit is not None:
        ours = next(c for c in group.contenders if c.name == OURS)
        to_limit = ours.median / limit.median
        if to_limit <= THREADS_LIMIT_FACTOR:
            return True, f"ok (ours/limit {to_limit:.2f})"
        return False, f"MISS (ours/limit {to_limit:.2f})"
    return False, "MISS"


def report(
    groups: list[Group], file: Any = None, judge: bool = True, why_no_peer: str = ""
) -> list[dict[str, Any]]:
    """Print the table; ``judge=False`` (a --quick run) shows targets without verdicts.

    A row's ``met`` is True/False when its target was judged, else None; its
    ``rule`` says what was judged (``ours/this <= target``, and for the
    threads rows the limit exception). Groups with no contender but
    cposembed are not comparisons: they are left out, and ``why_no_peer``
    (e.g. "torch not installed") is printed with their names. ``file`` defaults to the current ``sys.stdout``.
    """
    if file is None:
        file = sys.stdout
    rows: list[dict[str, Any]] = []
    lines: list[tuple[str, ...] | str] = []
    lonely = [g.op for g in groups if len(g.contenders) < 2]
    for g in groups:
        if len(g.contenders) < 2:
            continue
        ours = next(c for c in g.contenders if c.name == OURS)
        lines.append(f"{g.op}  [{g.note}]" if g.note else g.op)
        for c in g.contenders:
            med = c.median
            gbs = c.nbytes / med / 1e9 if c.nbytes and med > 0 else float("nan")
            ratio = ours.median / med if c is not ours else 1.0
            target = TARGETS.get((g.op, c.name))
            rule = _rule(g, target) if target is not None else ""
            verdict = ""
            met = None
            if target is not None and not judge:
                verdict = f"{rule}: {QUICK_VERDICT}"
            elif target is not None:
                met, said = _judge(g, ratio, target)
                verdict = f"{rule}: {said}"
            lines.append(
                (
                    f"  {c.name}",
                    _fmt_ms(med).strip(),
                    f"{gbs:.2f}" if gbs == gbs else "",
                    f"{ratio:.3f}" if c is not ours else "",
                    c.check,
                    verdict,
                )
            )
            rows.append(
                {
                    "op": g.op,
                    "contender": c.name,
                    "note": g.note,
                    "median_s": med,
                    "runs": len(c.times),
                    "gb_per_s": gbs if gbs == gbs else None,
                    "ratio_ours_to_this": ratio,
                    "target": target,
                    "rule": rule or None,
                    "met": met,
                    "check": c.check,
                }
            )
    head = ("op / contender", "time", "GB/s", RATIO, "check", "target: verdict")
    cells = [x for x in lines if isinstance(x, tuple)]
    widths = [max(len(row[i]) for row in [head, *cells]) for i in range(len(head))]

    def fmt(row: tuple[str, ...]) -> str:
        name, time_s, gbs_s, ratio_s, check, verdict = row
        return (
            f"{name:<{widths[0]}}  {time_s:>{widths[1]}}  {gbs_s:>{widths[2]}}  "
            f"{ratio_s:>{widths[3]}}  {check:<{widths[4]}}  {verdict}"
        ).rstrip()

    print(RATIO_LEGEND, file=file)
    print(fmt(head), file=file)
    for line in lines:
        print(line if isinstance(line, str) else fmt(line), file=file)
    if lonely:
        print(f"not compared ({why_no_peer or 'no peer'}): {', '.join(lonely)}", file=file)
    return rows


def markdown(rows: list[dict[str, Any]], info: dict[str, Any]) -> str:
    """The results as a Markdown table (for BENCHMARKS.md)."""
    lines = [
        RATIO_LEGEND,
        "",
        f"| op | contender | time | GB/s | {RATIO} | target | check |",
        "| --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    last = None
    for r in rows:
        op = r["op"] if r["op"] != last else ""
        last = r["op"]
        t = r["median_s"]
        time_s = f"{t * 1e6:.2f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"
        gbs = f"{r['gb_per_s']:.2f}" if r["gb_per_s"] else ""
        ratio = "" if r["contender"] == OURS else f"{r['ratio_ours_to_this']:.3f}"
        target = ""
        if r["target"] is not None:
            verdict = {True: "ok", False: "**miss**", None: QUICK_VERDICT}[r["met"]]
            target = f"{r['rule']}: {verdict}"
        lines.append(
            f"| {op} | {r['contender']} | {time_s} | {gbs} | {ratio} | {target} | {r['check']} |"
        )
    return "\n".join(lines) + "\n"


def _mismatched(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows whose output differed from the peer's."""
    return [r for r in rows if r["check"].startswith("MISMATCH")]


def summary(rows: list[dict[str, Any]], judged: bool) -> str:
    """The one line that ends every run: targets met and missed, check mismatches."""
    mismatches = len(_mismatched(rows))
    if not judged:
        return f"summary: quick run, targets not judged; {mismatches} check mismatches"
    with_target = [r for r in rows if r["target"] is not None]
    ok = sum(bool(r["met"]) for r in with_target)
    return (
        f"summary: {len(with_target)} rows with targets, {ok} ok, "
        f"{len(with_target) - ok} miss; {mismatches} check mismatches"
    )


def missed(rows: list[dict[str, Any]]) -> list[str]:
    """One line per judged row that missed its target: what, its ratio, its rule."""
    return [
        f"missed: {r['op']} vs {r['contender']}: {RATIO} {r['ratio_ours_to_this']:.3f}, "
        f"rule {r['rule']}"
        for r in rows
        if r["met"] is False
    ]


def machine_info(args: argparse.Namespace, torch: Any) -> dict[str, Any]:
    from ._config import config

    cfg = config()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus_available": cfg["cpus_available"],
        "platform": cfg["platform"],
        "python": cfg["python"],
        "numpy": cfg["numpy"],
        "torch": getattr(torch, "__version__", None),
        "cposembed": cfg["cposembed"],
        "openmp": cfg["openmp_enabled"],
        "compile_args": cfg["compile_args"],
        "streaming_stores": _membench.streaming_available(),
        "threads": args.threads,
        "table": list(args.table),
        "batch": list(args.batch),
        "dtype": args.dtype,
        "repeats": args.repeats,
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "openblas_env": {
            k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ
        },
    }


def make_parser() -> argparse.ArgumentParser:
    """The bench's command line: every option with its help."""
    p = argparse.ArgumentParser(
        prog="python -m cposembed bench",
        description="cposembed against the machine's memory limits, NumPy and PyTorch "
        "(one process, alternating runs, medians). Every ratio is ours/this = "
        "time(cposembed) / time(contender): below 1, cposembed is faster; a target is "
        "the largest ratio that meets it. The run ends with a summary of the targets.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes and few repeats: a smoke test of a few seconds",
    )
    p.add_argument(
        "--table",
        nargs=2,
        type=int,
        metavar=("L", "D"),
        default=None,
        help="table shape (default 2048 768)",
    )
    p.add_argument(
        "--batch",
        nargs=2,
        type=int,
        metavar=("B", "T"),
        default=None,
        help="positions shape (default 32 1024)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for cposembed, the limits and torch (default: all)",
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="token table rows for the embed rows (default 50257, GPT-2's vocabulary)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 21)")
    p.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default="float32",
        help="dtype of the tables, token embeddings and gradients (default float32)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="also write the results as JSON (tools/perf_table.py makes the README's "
        "performance table from such files)",
    )
    p.add_argument("--markdown", metavar="FILE", help="also write the whole table as Markdown")
    p.add_argument("--no-torch", action="store_true", help="leave out the PyTorch rows")
    p.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="run only these comparisons: " + " ".join(GROUP_NAMES),
    )
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = make_parser()
    args = p.parse_args(argv)
    if args.quick:
        args.table = args.table or [256, 64]
        args.batch = args.batch or [4, 128]
        args.repeats = args.repeats or 3
        args.vocab = args.vocab or 1000
    args.vocab = args.vocab or 50257
    args.table = args.table or [2048, 768]
    args.batch = args.batch or [32, 1024]
    args.repeats = args.repeats or 21
    if args.threads is None:
        args.threads = _threads.get_num_threads()
    else:
        # num_threads='s rules: the same check and the same cap as every call's.
        try:
            requested = _threads.check_num_threads(args.threads)
        except ValueError as exc:
            p.error(f"--threads: {exc}")
        args.threads = _threads.effective_num_threads(requested, sys.maxsize, sys.maxsize)
        if args.threads < requested:
            _progress(
                f"--threads {requested}: capped at {args.threads}, the most that "
                "num_threads= runs on here"
            )
    for name, vals in (("--table", args.table), ("--batch", args.batch)):
        if min(vals) < 1:
            p.error(f"{name} sizes must be positive; got {vals}")
    if args.table[0] < args.batch[1]:
        p.error(f"--table L ({args.table[0]}) must be >= T ({args.batch[1]})")
    if args.repeats < 1 or args.vocab < 1:
        p.error("--repeats and --vocab must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    for option, path in (("--json", args.json), ("--markdown", args.markdown)):
        problem = path and _state.output_problem(path, option)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    torch = _try_torch(not args.no_torch, args.threads)
    info = machine_info(args, torch)
    no_torch = "--no-torch" if args.no_torch else "torch not installed"
    _progress(
        f"cposembed bench: table {args.table[0]}x{args.table[1]} {args.dtype}, "
        f"positions {args.batch[0]}x{args.batch[1]}, {args.threads} threads, "
        f"{args.repeats} rounds, torch {info['torch'] or no_torch + ': its rows are left out'}"
    )
    factories = build_groups(args, torch)
    if args.only:
        known = {name for name, _ in factories}
        unknown = set(args.only) - known
        if unknown:
            print(
                f"unknown --only names: {sorted(unknown)}; known: {sorted(known)}", file=sys.stderr
            )
            return 2
        factories = [(n, f) for n, f in factories if n in args.only]
    done: list[Group] = []
    t_start = time.perf_counter()
    for i, (name, factory) in enumerate(factories, 1):
        _progress(f"[{i}/{len(factories)}] {name} ...")
        made = factory()
        for g in made if isinstance(made, list) else [made]:
            if len(g.contenders) < 2:
                # Its only peers are PyTorch's: nothing to compare with.
                _progress(f"      {g.op}: not compared ({no_torch})")
                done.append(g)
                continue
            if g.tiny:
                _time_tiny(g, args.repeats)
            else:
                _time_group(g, args.repeats)
            ours = next(c for c in g.contenders if c.name == OURS)
            others = ", ".join(
                f"{c.name} {ours.median / c.median:.3f}" for c in g.contenders if c is not ours
            )
            _progress(f"      {g.op}: {_fmt_ms(ours.median).strip()}; {RATIO}: {others}")
            done.append(g)
    _progress(f"done in {time.perf_counter() - t_start:.1f} s")
    print()
    print(
        "cposembed bench: "
        + ", ".join(f"{k}={v}" for k, v in info.items() if k not in ("compile_args",))
    )
    rows = report(done, judge=not args.quick, why_no_peer=no_torch)
    bad = _mismatched(rows)
    outputs = []
    if args.json:
        outputs.append((args.json, json.dumps({"machine": info, "results": rows}, indent=1)))
    if args.markdown:
        outputs.append((args.markdown, markdown(rows, info)))
    for path, text in outputs:
        try:
            with _state.atomic_write(path) as f:
                f.write(text.encode())
        except OSError as exc:
            print(f"error: could not write {path}: {exc}", file=sys.stderr)
            return 1
        _progress(f"wrote {path}")
    for line in missed(rows):
        print(line)
    print(summary(rows, judged=not args.quick))
    if bad:
        print(f"{len(bad)} output check(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
