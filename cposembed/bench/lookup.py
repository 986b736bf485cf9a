"""Reading rows: ``lookup(out=)`` against the streaming fill and its peers; ``pe(pos)``."""

from __future__ import annotations

import numpy as np

from .. import _membench
from ..functional import lookup
from ._common import OURS, Contender, Fixture, Group, same


def lookup_out(f: Fixture) -> list[Group]:
    P, pos, out, nt = f.P, f.pos_ar, f.out, f.nt
    cs = [
        Contender(OURS, lambda: lookup(P, pos, out=out, num_threads=nt), f.rows_bytes),
        Contender(
            "limit: streaming fill",
            lambda: _membench.fill(f.probe_dst, f.probe_nt),
            f.rows_bytes,
            target=1.1,
        ),
        Contender("numpy np.take(out=)", lambda: np.take(P, pos, axis=0, out=out), f.rows_bytes),
    ]
    mine = lookup(P, pos, num_threads=nt)
    cs[2].check = same(mine, np.take(P, pos, axis=0))
    torch = f.torch
    if torch is not None:
        o2 = f.out_t.view(f.B * f.T, f.d)
        p2 = f.pos_ar_t.view(-1)
        peer = Contender(
            "torch index_select(out=)",
            lambda: torch.index_select(f.Pt, 0, p2, out=o2),
            f.rows_bytes,
            target=0.6,
        )
        peer.check = same(mine, torch.index_select(f.Pt, 0, p2).numpy().reshape(f.B, f.T, f.d))
        cs.append(peer)
    return [Group("lookup(out=)", cs, f"positions {pos.shape} arange")]


def pe_alloc(f: Fixture) -> list[Group]:
    pe, P, pos, ref = f.pe, f.P, f.pos_rand, f.ref
    cs = [
        Contender(OURS, lambda: pe(pos), f.rows_bytes),
        Contender(
            "reference r(pos) [float64]",
            lambda: ref(pos),
            f.rows_bytes * 8 // f.isz,
            target=0.3,
        ),
        Contender("numpy P[pos]", lambda: P[pos], f.rows_bytes, target=0.65),
    ]
    mine = pe(pos)
    cs[1].check = same(mine, ref(pos).astype(f.dt))
    cs[2].check = same(mine, P[pos])
    if f.torch is not None:
        F = f.torch.nn.functional
        peer = Contender("torch F.embedding", lambda: F.embedding(f.pos_rand_t, f.Pt), f.rows_bytes)
        peer.check = same(mine, F.embedding(f.pos_rand_t, f.Pt).numpy())
        cs.append(peer)
    return [Group("pe(pos)", cs, "allocating the output; positions random")]
