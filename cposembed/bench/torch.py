"""The PyTorch layers: ``cposembed.torch`` against ``nn.Embedding`` modules (with torch only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._common import OURS, Contender, Fixture, Group, max_terms, same


def _grad_of(module: Any) -> np.ndarray:
    grad = module.weight.grad
    assert grad is not None, "no gradient after backward"
    return np.asarray(grad.numpy())


def torch_layer(f: Fixture) -> list[Group]:
    torch = f.torch
    if torch is None:
        return []
    import cposembed.torch as ct

    wte, wpe, ids = f.layer.wte, f.layer.wpe, f.layer.ids
    vocab, d, tdt = f.vocab, f.d, f.tdt
    nbytes = f.rows_bytes
    ids_t = torch.from_numpy(ids)
    pos_t = torch.arange(f.T)
    layer_t = ct.TokenPositionEmbedding(vocab, wpe.shape[0], d, dtype=tdt)
    tok_e = torch.nn.Embedding(vocab, d, dtype=tdt)
    pos_e = torch.nn.Embedding(wpe.shape[0], d, dtype=tdt)
    with torch.no_grad():
        for w, src in (
            (layer_t.tokens.weight, wte),
            (layer_t.positions.weight, wpe),
            (tok_e.weight, wte),
            (pos_e.weight, wpe),
        ):
            w.copy_(torch.from_numpy(src))

    # Each step keeps the last step's gradients alive (as a user logging
    # them or an optimizer holding them would) and starts from .grad None.
    kept: dict[str, list[Any]] = {"ours": [], "theirs": []}

    def step(name: str, modules: list[Any], forward: Callable[[], Any]) -> None:
        kept[name] = [m.weight.grad for m in modules]
        for m in modules:
            m.zero_grad(set_to_none=True)
        forward().backward(f.gout_t)

    def ours() -> None:
        step("ours", [layer_t.tokens, layer_t.positions], lambda: layer_t(ids_t))

    def theirs() -> None:
        step("theirs", [tok_e, pos_e], lambda: tok_e(ids_t) + pos_e(pos_t))

    def ours_fwd() -> None:
        with torch.no_grad():
            layer_t(ids_t)

    def theirs_fwd() -> None:
        with torch.no_grad():
            tok_e(ids_t) + pos_e(pos_t)

    terms = max_terms(ids)
    fb_peer = Contender("torch 2 x nn.Embedding fwd+bwd", theirs, 2 * nbytes, target=0.2)
    ours()
    theirs()
    fb_peer.check = same(
        np.concatenate([_grad_of(layer_t.tokens), _grad_of(layer_t.positions)]),
        np.concatenate([_grad_of(tok_e), _grad_of(pos_e)]),
        rtol=1e-6 * terms,
        atol=1e-6 * terms,
    )
    fwd_peer = Contender("torch 2 x nn.Embedding fwd", theirs_fwd, nbytes, target=0.2)
    with torch.no_grad():
        fwd_peer.check = same(layer_t(ids_t), tok_e(ids_t) + pos_e(pos_t))
    note = (
        f"cposembed.torch.TokenPositionEmbedding vs two nn.Embedding, vocab {vocab}, "
        f"ids ({f.B}, {f.T}) Zipf 1.2"
    )
    # One nn.Embedding (GPT-2's wte) as convert_embeddings leaves it.
    plain_e = torch.nn.Embedding(vocab, d, dtype=tdt)
    conv_e: Any = ct.convert_embeddings(torch.nn.Embedding(vocab, d, dtype=tdt))
    with torch.no_grad():
        plain_e.weight.copy_(torch.from_numpy(wte))
        conv_e.weight.copy_(torch.from_numpy(wte))

    def conv_ours() -> None:
        step("ours", [conv_e], lambda: conv_e(ids_t))

    def conv_theirs() -> None:
        step("theirs", [plain_e], lambda: plain_e(ids_t))

    conv_peer = Contender("torch nn.Embedding fwd+bwd", conv_theirs, 2 * nbytes, target=0.3)
    conv_ours()
    conv_theirs()
    conv_peer.check = same(_grad_of(conv_e), _grad_of(plain_e), rtol=0, atol=0)
    return [
        Group(
            "torch layer fwd+bwd",
            [Contender(OURS, ours, 2 * nbytes), fb_peer],
            note + ", zero_grad(set_to_none=True) each step, last step's .grad kept",
        ),
        Group("torch layer fwd, no_grad", [Contender(OURS, ours_fwd, nbytes), fwd_peer], note),
        Group(
            "torch converted nn.Embedding fwd+bwd",
            [Contender(OURS, conv_ours, 2 * nbytes), conv_peer],
            f"convert_embeddings(nn.Embedding({vocab}, {d})) vs nn.Embedding, "
            f"ids ({f.B}, {f.T}) Zipf 1.2, last step's .grad kept",
        ),
    ]
