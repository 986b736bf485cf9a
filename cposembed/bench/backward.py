"""The class's backward: against the ``scatter_add`` it wraps, and forward + backward
against PyTorch's ``F.embedding``."""

from __future__ import annotations

import numpy as np

from ..embedding import LearnedPositionEmbedding
from ..functional import scatter_add
from ._common import OURS, SMALL_SIZES, Contender, Fixture, Group, same

# The largest acceptable time(pe.backward) / time(scatter_add), at every size.
BACKWARD_TARGET = 1.3


def _versus_scatter(
    f: Fixture, label: str, g_s: np.ndarray, pos_s: np.ndarray, tiny: bool
) -> Group:
    pe_b = LearnedPositionEmbedding(f.L, f.d, seed=0, dtype=f.dt)
    G = np.zeros_like(f.P)
    # Checked from zero; then both keep accumulating into their gradient,
    # so the timed calls do the same work and no table-sized reset hides
    # the per-call cost of the small ones.
    ours = pe_b.backward(g_s, pos_s)
    peer = Contender(
        "scatter_add", lambda: scatter_add(G, g_s, pos_s), g_s.nbytes, target=BACKWARD_TARGET
    )
    peer.check = same(ours, scatter_add(G, g_s, pos_s))
    note = (
        f"pe.backward(g, pos) vs scatter_add(G, g, pos), accumulating; "
        f"positions {pos_s.shape} random"
    )
    return Group(
        f"backward vs scatter_add {label}",
        [Contender(OURS, lambda: pe_b.backward(g_s, pos_s), g_s.nbytes), peer],
        note,
        tiny=tiny,
    )


def backward_vs_scatter(f: Fixture) -> list[Group]:
    groups = []
    for b, t in SMALL_SIZES:
        g_s = f.rng.standard_normal((b, t, f.d)).astype(f.dt)
        pos_s = f.rng.integers(0, f.L, size=(b, t), dtype=np.int64)
        groups.append(_versus_scatter(f, f"({b}, {t}, d)", g_s, pos_s, tiny=True))
    # The full batch, on the arrays the other groups use.
    groups.append(_versus_scatter(f, "(B, T, d)", f.gout, f.pos_rand, tiny=False))
    return groups


def fwd_bwd(f: Fixture) -> list[Group]:
    pe2 = LearnedPositionEmbedding(f.L, f.d, seed=0, dtype=f.dt)
    pos, out, gout = f.pos_ar, f.out, f.gout

    def ours() -> None:
        pe2(pos, out=out)
        pe2.zero_grad()
        pe2.backward(gout, pos)

    cs = [Contender(OURS, ours, 2 * f.rows_bytes)]
    if f.torch is not None:
        F = f.torch.nn.functional
        W = f.torch.from_numpy(f.P.copy()).requires_grad_(True)

        def theirs() -> None:
            W.grad = None
            F.embedding(f.pos_ar_t, W).backward(f.gout_t)

        peer = Contender("torch F.embedding fwd+bwd", theirs, 2 * f.rows_bytes, target=0.25)
        ours()
        theirs()
        peer.check = same(pe2.grad, W.grad.numpy())
        cs.append(peer)
    return [Group("pe(pos, out=) + pe.backward", cs, "positions (B, T) arange")]
