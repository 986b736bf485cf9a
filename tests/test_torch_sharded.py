"""Sharded training on two gloo processes, against the same models of ``nn.Embedding``
under the same plan, bitwise: FSDP2 (``fully_shard``: cposembed's modules and a
converted Hugging Face GPT-2; losses, gradient shards, parameter shards) and tensor
parallelism (``parallelize_module`` with ``RowwiseParallel`` and ``ColwiseParallel``:
outputs, gradient shards, and which plans run on the kernels)."""

from __future__ import annotations

import pytest
from helpers import run_on_two_ranks

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

_FSDP = """
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
import cposembed.torch as ct

VOCAB, T, D = 70000, 16, 8   # 70000 x 8 float32: 2.1 MiB gradients (kept storages)


class Layer(nn.Module):
    # GPT-2's input layer of two nn.Embedding: what ct.TokenPositionEmbedding replaces.
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D)
        self.positions = nn.Embedding(T, D)

    def forward(self, ids):
        # Positions of ids.shape: the position gradient sums over every token.
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[-1]).expand(ids.shape))


def models(kind, ours):
    torch.manual_seed(0)
    if kind == "Embedding":
        emb = (ct.Embedding if ours else nn.Embedding)(VOCAB, D)
        return nn.Sequential(emb, nn.Linear(D, 3)), [emb]
    if kind == "TokenPositionEmbedding":
        layer = ct.TokenPositionEmbedding(VOCAB, T, D) if ours else Layer()
        return nn.Sequential(layer, nn.Linear(D, 3)), [layer]
    import transformers
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=T, n_embd=D, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    if ours:
        ct.convert_embeddings(model)
    return model, list(model.transformer.h)


def loss_of(kind, model, ids):
    if kind == "gpt2":
        return model(ids, labels=ids).loss
    return model(ids).pow(2).mean()


def train(kind, ours, rank):
    model, parts = models(kind, ours)
    for part in parts:
        fully_shard(part)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)  # each rank its own batch
    losses, grads = [], []
    for _ in range(3):
        opt.zero_grad()
        loss = loss_of(kind, model, torch.randint(0, VOCAB, (4, T), generator=g))
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
        opt.step()
    params = [p.detach().to_local().clone() for p in model.parameters()]
    return losses, grads, params


def work(rank, world):
    result = {}
    for kind in ("Embedding", "TokenPositionEmbedding", "gpt2"):
        (l1, g1, p1), (l2, g2, p2) = train(kind, True, rank), train(kind, False, rank)
        result[kind] = {
            "losses": l1 == l2,
            "grads": all(torch.equal(a, b) for s1, s2 in zip(g1, g2) for a, b in zip(s1, s2)),
            "params": all(map(torch.equal, p1, p2)),
        }
    return result

"""


def test_fully_shard_trains_as_nn_embedding(tmp_path) -> None:
    pytest.importorskip("transformers")
    verdicts = run_on_two_ranks(_FSDP, tmp_path)
    every = {"losses": True, "grads": True, "params": True}
    want = dict.fromkeys(("Embedding", "TokenPositionEmbedding", "gpt2"), every)
    assert verdicts == [want, want], verdicts


_TP = """
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
import cposembed.torch as ct

VOCAB, T, D = 64, 6, 8


class Layer(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D, dtype=dtype)
        self.positions = nn.Embedding(T, D, dtype=dtype)

    def forward(self, ids):
        # Positions of ids.shape: the position gradient sums over every token.
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[-1]).expand(ids.shape))


PLANS = {
    "rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "colwise": lambda: ColwiseParallel(),
    "colwise, DTensor output": lambda: ColwiseParallel(use_local_output=False),
}


def build(kind, ours, plan, mesh, dtype):
    torch.manual_seed(0)
    if kind == "Embedding":
        m = (ct.Embedding if ours else nn.Embedding)(VOCAB, D, padding_idx=3, dtype=dtype)
        return parallelize_module(m, mesh, PLANS[plan]())
    m = ct.TokenPositionEmbedding(VOCAB, T, D, dtype=dtype) if ours else Layer(dtype)
    return parallelize_module(m, mesh, {"tokens": PLANS[plan](), "positions": PLANS[plan]()})


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def step(kind, ours, plan, mesh, dtype):
    m = build(kind, ours, plan, mesh, dtype)
    ids = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(1))
    ids[0, :2] = 3  # the padding row
    with torch.profiler.profile() as prof:
        y = m(ids)
        full(y).pow(2).sum().backward()
    kernels = any(e.name.startswith("cposembed::") for e in prof.events())
    grads = [p.grad.to_local() for p in m.parameters()]
    return full(y), grads, kernels


def work(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("Embedding", "TokenPositionEmbedding"):
            for plan in PLANS:
                (y1, g1, k1), (y2, g2, _) = (step(kind, o, plan, mesh, dtype) for o in (True, False))
                result[f"{dtype} {kind} {plan}"] = {
                    "output": torch.equal(y1, y2),
                    "grads": all(map(torch.equal, g1, g2)),
                    "kernels": k1,
                }
    return result

"""


def test_tensor_parallel_plans_give_nn_embeddings_outputs_and_gradient_shards(tmp_path) -> None:
    pytest.importorskip("torch.distributed.tensor.parallel")
    verdicts = run_on_two_ranks(_TP, tmp_path)
    assert verdicts[0] == verdicts[1]
    rows = verdicts[0]
    assert len(rows) == 12
    for name, row in rows.items():
        assert row["output"] and row["grads"], (name, row)
        # Column shards run on the kernels; row shards on F.embedding's masking rule.
        assert row["kernels"] == ("colwise" in name), (name, row)
