"""Accumulating rows: ``scatter_add`` (positions=None and random) against the read-once
limit, ``np.add.at`` and ``index_add_``."""

from __future__ import annotations

import numpy as np

from .. import _membench
from ..functional import scatter_add
from ._common import OURS, Contender, Fixture, Group, same


def _scatter(f: Fixture, kind: str, targets: tuple[float, float, float]) -> list[Group]:
    """``targets``: against the limit, np.add.at and torch's index_add_."""
    limit_target, numpy_target, torch_target = targets
    P, gout, nt = f.P, f.gout, f.nt
    pos = f.pos_ar if kind == "arange" else f.pos_rand
    G = np.zeros_like(P)
    G2 = np.zeros_like(P)
    # Ours with positions=None for arange: the common training call.
    pos_arg = None if kind == "arange" else pos
    cs = [
        Contender(OURS, lambda: scatter_add(G, gout, pos_arg, num_threads=nt), f.rows_bytes),
        Contender(
            "limit: read once",
            lambda: _membench.read_sum(f.probe_grad, f.probe_nt),
            f.rows_bytes,
            target=limit_target,
        ),
        Contender(
            "numpy np.add.at", lambda: np.add.at(G2, pos, gout), f.rows_bytes, target=numpy_target
        ),
    ]
    a = np.zeros_like(P)
    scatter_add(a, gout, pos_arg)
    b = np.zeros_like(P)
    np.add.at(b, pos, gout)
    cs[2].check = same(a, b)
    torch = f.torch
    if torch is not None:
        Gt = torch.zeros(f.L, f.d, dtype=f.tdt)
        pt = (f.pos_ar_t if kind == "arange" else f.pos_rand_t).reshape(-1)
        g2 = f.gout_t.reshape(-1, f.d)
        peer = Contender(
            "torch index_add_", lambda: Gt.index_add_(0, pt, g2), f.rows_bytes, target=torch_target
        )
        peer.check = same(a, torch.zeros(f.L, f.d, dtype=f.tdt).index_add_(0, pt, g2).numpy())
        cs.append(peer)
    note = "positions=None" if kind == "arange" else "positions (B, T) uniform"
    return [Group(f"scatter_add {kind}", cs, note)]


def scatter_arange(f: Fixture) -> list[Group]:
    return _scatter(f, "arange", (1.3, 0.025, 0.8))


def scatter_random(f: Fixture) -> list[Group]:
    return _scatter(f, "random", (1.5, 0.025, 0.7))
