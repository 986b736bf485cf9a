"""Two processes train a model on ``cposembed.torch.TokenPositionEmbedding`` with FSDP2.

PyTorch's fully sharded data parallelism (``torch.distributed.fsdp.fully_shard``,
gloo backend, CPU, 127.0.0.1 only) trains a tiny next-token model whose input
layer is cposembed's: each process holds half of every parameter, gathers the
whole one for its forward and backward, and keeps half of the averaged gradient.
Each process takes half of every batch. After the last SGD step, the shards are
gathered and rank 0 trains the same model in one process on the whole batches
and checks that both ended with the same parameters.

Run it as ``ddp_train.py`` beside it, whose model, batches, two processes and
needs (PyTorch's CPU build and the ``torch`` extra) it shares:

    torchrun --standalone --nproc-per-node 2 examples/fsdp_train.py
    python examples/fsdp_train.py          # spawns the two processes itself

Exits 1 if the parameters differ.
"""

from __future__ import annotations

# ddp_train says so and exits if torch is missing.
from ddp_train import compare, main, my_batches, new_model, torch, train
from torch.distributed.fsdp import fully_shard


def check(rank: int, world: int) -> bool:
    """Train this rank's halves under FSDP2; rank 0 also trains alone and compares."""
    torch.set_num_threads(1)
    model = new_model()
    fully_shard(model.embed)  # the input layer's tables, sharded on their own
    fully_shard(model)
    train(model, my_batches(rank, world))
    gathered = [p.full_tensor() for p in model.parameters()]  # every rank takes part
    return rank != 0 or compare(gathered, world, "FSDP2")


if __name__ == "__main__":
    main(check)
