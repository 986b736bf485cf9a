"""The PyTorch layers: ``cposembed.torch`` against ``nn.Embedding`` modules (with torch only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._common import OURS, Contender, Fixture, Group, max_terms, same


def _numpy(t: Any) -> np.ndarray:
    """A tensor as NumPy: bfloat16 as float32 (exact), the others as they are."""
    if str(t.dtype) == "torch.bfloat16":
        t = t.float()
    return np.asarray(t.detach().numpy())


def _grad_of(module: Any) -> np.ndarray:
    grad = module.weight.grad
    assert grad is not None, "no gradient after backward"
    return _numpy(grad)


def _layer_twins(f: Fixture, dtype: Any) -> tuple[Any, Any, Any]:
    """``ct.TokenPositionEmbedding`` and two ``nn.Embedding`` on the run's GPT-2
    tables (rounded to ``dtype``)."""
    torch = f.torch
    import cposembed.torch as ct

    wte, wpe = f.layer.wte, f.layer.wpe
    layer_t = ct.TokenPositionEmbedding(f.vocab, wpe.shape[0], f.d, dtype=dtype)
    tok_e = torch.nn.Embedding(f.vocab, f.d, dtype=dtype)
    pos_e = torch.nn.Embedding(wpe.shape[0], f.d, dtype=dtype)
    with torch.no_grad():
        for w, src in (
            (layer_t.tokens.weight, wte),
            (layer_t.positions.weight, wpe),
            (tok_e.weight, wte),
            (pos_e.weight, wpe),
        ):
            w.copy_(torch.from_numpy(src))
    return layer_t, tok_e, pos_e


class _Steps:
    """Forward + backward steps of modules, each keeping the last step's
    gradients alive (as a user logging them or an optimizer holding them
    would) and starting from ``.grad`` None."""

    def __init__(self, grad_output: Any) -> None:
        self.grad_output = grad_output
        self.kept: dict[str, list[Any]] = {"ours": [], "theirs": []}

    def step(self, name: str, modules: list[Any], forward: Callable[[], Any]) -> None:
        self.kept[name] = [m.weight.grad for m in modules]
        for m in modules:
            m.zero_grad(set_to_none=True)
        forward().backward(self.grad_output)


def _layer_groups(f: Fixture, dtype: Any, label: str) -> tuple[Group, Group, _Steps]:
    """The layer's fwd+bwd and no_grad fwd groups at ``dtype`` (op names with ``label``)."""
    torch = f.torch
    layer_t, tok_e, pos_e = _layer_twins(f, dtype)
    ids_t = torch.from_numpy(f.layer.ids)
    pos_t = torch.arange(f.T)
    nbytes = f.B * f.T * f.d * layer_t.tokens.weight.element_size()
    steps = _Steps(f.gout_t.to(dtype))

    def ours() -> None:
        steps.step("ours", [layer_t.tokens, layer_t.positions], lambda: layer_t(ids_t))

    def theirs() -> None:
        steps.step("theirs", [tok_e, pos_e], lambda: tok_e(ids_t) + pos_e(pos_t))

    def ours_fwd() -> None:
        with torch.no_grad():
            layer_t(ids_t)

    def theirs_fwd() -> None:
        with torch.no_grad():
            tok_e(ids_t) + pos_e(pos_t)

    fb_peer = Contender("torch 2 x nn.Embedding fwd+bwd", theirs, 2 * nbytes, target=0.2)
    ours()
    theirs()
    fb_peer.check = _layer_grad_check(layer_t, tok_e, pos_e, max_terms(f.layer.ids), f.B)
    fwd_peer = Contender("torch 2 x nn.Embedding fwd", theirs_fwd, nbytes, target=0.2)
    with torch.no_grad():
        fwd_peer.check = same(_numpy(layer_t(ids_t)), _numpy(tok_e(ids_t) + pos_e(pos_t)))
    note = (
        f"cposembed.torch.TokenPositionEmbedding vs two nn.Embedding{label}, vocab {f.vocab}, "
        f"ids ({f.B}, {f.T}) Zipf 1.2"
    )
    return (
        Group(
            f"torch layer{label} fwd+bwd",
            [Contender(OURS, ours, 2 * nbytes), fb_peer],
            note + ", zero_grad(set_to_none=True) each step, last step's .grad kept",
        ),
        Group(
            f"torch layer{label} fwd, no_grad", [Contender(OURS, ours_fwd, nbytes), fwd_peer], note
        ),
        steps,
    )


def _layer_grad_check(layer_t: Any, tok_e: Any, pos_e: Any, terms: int, batch: int) -> str:
    """How the layer's gradients compare with the two modules'. float32 and
    float64: both tables within a tolerance scaled to the terms summed; half
    dtypes: the token gradient bitwise, the position gradient (which autograd
    sums over the batch first, in float32, where ours rounds each of the
    ``batch`` adds) within ``batch`` roundings of the largest row value."""
    if layer_t.tokens.weight.element_size() > 2:
        return same(
            np.concatenate([_grad_of(layer_t.tokens), _grad_of(layer_t.positions)]),
            np.concatenate([_grad_of(tok_e), _grad_of(pos_e)]),
            rtol=1e-6 * terms,
            atol=1e-6 * terms,
        )
    tokens = same(_grad_of(layer_t.tokens), _grad_of(tok_e), rtol=0, atol=0)
    theirs = _grad_of(pos_e)
    atol = batch * 2.0**-8 * float(np.abs(theirs).max(initial=0.0))
    positions = same(_grad_of(layer_t.positions), theirs, rtol=0, atol=atol)
    if tokens.startswith("MISMATCH") or positions.startswith("MISMATCH"):
        return f"MISMATCH tokens {tokens}, positions {positions}"
    return f"tokens {tokens}, positions {positions}"


def torch_layer(f: Fixture) -> list[Group]:
    torch = f.torch
    if torch is None:
        return []
    import cposembed.torch as ct

    fb, fwd, steps = _layer_groups(f, f.tdt, "")
    bf_fb, bf_fwd, _ = _layer_groups(f, torch.bfloat16, " bf16")
    vocab, d, tdt = f.vocab, f.d, f.tdt
    nbytes = f.rows_bytes
    ids_t = torch.from_numpy(f.layer.ids)
    # One nn.Embedding (GPT-2's wte) as convert_embeddings leaves it.
    plain_e = torch.nn.Embedding(vocab, d, dtype=tdt)
    conv_e: Any = ct.convert_embeddings(torch.nn.Embedding(vocab, d, dtype=tdt))
    with torch.no_grad():
        plain_e.weight.copy_(torch.from_numpy(f.layer.wte))
        conv_e.weight.copy_(torch.from_numpy(f.layer.wte))

    def conv_ours() -> None:
        steps.step("ours", [conv_e], lambda: conv_e(ids_t))

    def conv_theirs() -> None:
        steps.step("theirs", [plain_e], lambda: plain_e(ids_t))

    conv_peer = Contender("torch nn.Embedding fwd+bwd", conv_theirs, 2 * nbytes, target=0.3)
    conv_ours()
    conv_theirs()
    conv_peer.check = same(_grad_of(conv_e), _grad_of(plain_e), rtol=0, atol=0)
    # bfloat16 first: the float32 steps' freed gradients (154 MB) then take
    # the places of the smaller bfloat16 ones in the kept blocks, as a process
    # training one model of one dtype has them (docs/architecture.md, "Memory").
    return [
        bf_fb,
        bf_fwd,
        fb,
        fwd,
        Group(
            "torch converted nn.Embedding fwd+bwd",
            [Contender(OURS, conv_ours, 2 * nbytes), conv_peer],
            f"convert_embeddings(nn.Embedding({vocab}, {d})) vs nn.Embedding, "
            f"ids ({f.B}, {f.T}) Zipf 1.2, last step's .grad kept",
        ),
    ]
