"""Adding rows: ``add_positions`` (into ``out=``, in place), ``pe.add_to`` (allocating,
explicit positions on small calls)."""

from __future__ import annotations

import numpy as np

from .. import _membench
from ..functional import add_positions
from ._common import OURS, SMALL_SIZES, Contender, Fixture, Group, same


def add_out(f: Fixture) -> list[Group]:
    tok, P, out, T, nt = f.tok, f.P, f.out, f.T, f.nt
    nbytes = 2 * f.rows_bytes
    cs = [
        Contender(OURS, lambda: add_positions(tok, P, out=out, num_threads=nt), nbytes),
        Contender(
            "limit: streaming copy",
            lambda: _membench.copy(f.probe_dst, f.probe_src, f.probe_nt),
            nbytes,
            target=1.1,
        ),
        Contender("numpy np.add(tok, P[pos], out=)", lambda: np.add(tok, P[:T], out=out), nbytes),
    ]
    mine = add_positions(tok, P)
    cs[2].check = same(mine, tok + P[np.arange(T)])
    torch = f.torch
    if torch is not None:
        peer = Contender(
            "torch add(tok, P[pos], out=)",
            lambda: torch.add(f.tok_t, f.Pt[:T], out=f.out_t),
            nbytes,
        )
        peer.check = same(mine, torch.add(f.tok_t, f.Pt[:T]).numpy())
        cs.append(peer)
    return [Group("add_positions(out=)", cs, "positions=None (arange(T) per sequence)")]


def add_inplace(f: Fixture) -> list[Group]:
    P, T, nt = f.P, f.T, f.nt
    nbytes = 2 * f.rows_bytes
    work = f.tok.copy()
    wf = work.reshape(-1).view(np.float32)
    cs = [
        Contender(OURS, lambda: add_positions(work, P, out=work, num_threads=nt), nbytes),
        Contender(
            "limit: streaming copy",
            lambda: _membench.copy(f.probe_dst, wf, f.probe_nt),
            nbytes,
            target=1.1,
        ),
        Contender("numpy tok += P[pos]", lambda: np.add(work, P[:T], out=work), nbytes),
    ]
    a = f.tok.copy()
    add_positions(a, P, out=a)
    cs[2].check = same(a, f.tok + P[:T])
    torch = f.torch
    if torch is not None:
        w_t = torch.from_numpy(work)
        peer = Contender("torch tok.add_(P[pos])", lambda: w_t.add_(f.Pt[:T]), nbytes)
        peer.check = same(a, torch.from_numpy(f.tok.copy()).add_(f.Pt[:T]).numpy())
        cs.append(peer)
    return [Group("add_positions in place", cs, "out=tok")]


def add_to(f: Fixture) -> list[Group]:
    pe, tok, P = f.pe, f.tok, f.P
    nbytes = 2 * f.rows_bytes
    idx = np.arange(f.T)
    cs = [
        Contender(OURS, lambda: pe.add_to(tok), nbytes),
        Contender("numpy tok + P[pos]", lambda: tok + P[idx], nbytes, target=0.25),
    ]
    cs[1].check = same(pe.add_to(tok), tok + P[idx])
    if f.torch is not None:
        F = f.torch.nn.functional
        it = f.torch.from_numpy(idx)
        peer = Contender(
            "torch tok + F.embedding(pos)", lambda: f.tok_t + F.embedding(it, f.Pt), nbytes
        )
        peer.check = same(pe.add_to(tok), (f.tok_t + F.embedding(it, f.Pt)).numpy())
        cs.append(peer)
    return [Group("pe.add_to(tok)", cs, "allocating the output")]


def _explicit(f: Fixture, b: int, t: int, target: float) -> Group:
    tok_s = f.rng.standard_normal((b, t, f.d)).astype(f.dt)
    pos_s = f.rng.integers(0, f.L, size=(b, t), dtype=np.int64)
    return f.small_pair(
        f"add_to explicit ({b}, {t}, d)",
        lambda: f.pe.add_to(tok_s, pos_s),
        lambda: tok_s + f.P[pos_s],
        "numpy tok + P[pos]",
        f"{f.L} x {f.d} table, positions ({b}, {t}) random int64, per call",
        target=target,
    )


def add_to_explicit(f: Fixture) -> list[Group]:
    return [_explicit(f, b, t, target) for (b, t), target in zip(SMALL_SIZES, (1.0, 1.0, 0.7))]
