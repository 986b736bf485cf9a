"""The whole input layer (``embed``, ``embed_backward``) at GPT-2's sizes, Zipf-like ids."""

from __future__ import annotations

import numpy as np

from .. import _membench
from ..layer import embed
from ..layer import embed_backward as backward_of_embed
from ._common import OURS, Contender, Fixture, Group, max_terms, same


def embed_out(f: Fixture) -> list[Group]:
    wte, wpe, ids = f.layer.wte, f.layer.wpe, f.layer.ids
    out, nt, B, T, d = f.out, f.nt, f.B, f.T, f.d
    cs = [
        Contender(OURS, lambda: embed(ids, wte, wpe, out=out, num_threads=nt), f.rows_bytes),
        Contender(
            "limit: streaming fill",
            lambda: _membench.fill(f.probe_dst, f.probe_nt),
            f.rows_bytes,
            target=1.15,
        ),
    ]
    mine = embed(ids, wte, wpe)
    torch = f.torch
    if torch is not None:
        wte_t, wpe_t = torch.from_numpy(wte), torch.from_numpy(wpe)
        ids_t = torch.from_numpy(ids.reshape(-1))
        o2 = f.out_t.view(B, T, d)
        o_flat = f.out_t.view(B * T, d)

        def theirs() -> None:
            torch.index_select(wte_t, 0, ids_t, out=o_flat)
            o2.add_(wpe_t[:T])

        peer = Contender("torch index_select(out=) + add_", theirs, f.rows_bytes, target=0.4)
        theirs()
        peer.check = same(mine, out)
        cs.append(peer)
    note = (
        f"vocab {f.vocab}, ids ({B}, {T}) Zipf 1.2 ({len(np.unique(ids))} distinct), positions=None"
    )
    return [Group("embed(out=)", cs, note)]


def embed_alloc(f: Fixture) -> list[Group]:
    wte, wpe, ids, T = f.layer.wte, f.layer.wpe, f.layer.ids, f.T
    cs = [
        Contender(OURS, lambda: embed(ids, wte, wpe, num_threads=f.nt), f.rows_bytes),
        Contender(
            "numpy wte[ids] + wpe[:T]", lambda: wte[ids] + wpe[:T], f.rows_bytes, target=0.15
        ),
    ]
    cs[1].check = same(embed(ids, wte, wpe), wte[ids] + wpe[:T])
    return [Group("embed", cs, "allocating the output")]


def embed_backward(f: Fixture) -> list[Group]:
    wte, wpe, ids, gout = f.layer.wte, f.layer.wpe, f.layer.ids, f.gout
    g_wte, g_wpe = np.zeros_like(wte), np.zeros_like(wpe)
    cs = [
        Contender(
            OURS,
            lambda: backward_of_embed(g_wte, g_wpe, gout, ids, num_threads=f.nt),
            f.rows_bytes,
        ),
        Contender(
            "limit: read once",
            lambda: _membench.read_sum(f.probe_grad, f.probe_nt),
            f.rows_bytes,
            target=1.8,
        ),
    ]
    torch = f.torch
    if torch is not None:
        gt_t = torch.zeros(wte.shape, dtype=f.tdt)
        gp_t = torch.zeros(wpe.shape, dtype=f.tdt)
        ids_t = torch.from_numpy(ids.reshape(-1))
        g_flat = f.gout_t.reshape(f.B * f.T, f.d)

        def theirs() -> None:
            gt_t.index_add_(0, ids_t, g_flat)
            gp_t[: f.T].add_(f.gout_t.sum(0))

        peer = Contender("torch index_add_ + batch sum", theirs, f.rows_bytes, target=0.35)
        a_t, a_p = np.zeros_like(wte), np.zeros_like(wpe)
        backward_of_embed(a_t, a_p, gout, ids)
        gt_t.zero_()
        gp_t.zero_()
        theirs()
        # torch sums each row in its own order: a frequent token's
        # thousands of float32 terms round differently.
        terms = max_terms(ids)
        peer.check = same(
            np.concatenate([a_t, a_p]),
            np.concatenate([gt_t.numpy(), gp_t.numpy()]),
            rtol=1e-6 * terms,
            atol=1e-6 * terms,
        )
        cs.append(peer)
    return [Group("embed_backward", cs, "both tables, positions=None")]
