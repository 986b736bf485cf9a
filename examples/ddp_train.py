"""Two processes train a model on ``cposembed.torch.TokenPositionEmbedding`` with DDP.

PyTorch's own distributed engine (``DistributedDataParallel``, gloo backend, CPU,
127.0.0.1 only) trains a tiny next-token model whose input layer is cposembed's.
Each process takes half of every batch; DDP averages the gradients. After the
last SGD step, rank 0 trains the same model in one process on the whole batches
and checks that both ended with the same parameters.

Run it either way:

    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py
    python examples/ddp_train.py          # spawns the two processes itself

Needs PyTorch (its CPU build, then the extra from a checkout: ``pip install torch
--index-url https://download.pytorch.org/whl/cpu && pip install ".[torch]"``); without
it the example says so and exits. Exits 1 if the parameters differ.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
except ModuleNotFoundError:
    print(
        "skipped: this example needs torch (pip install torch --index-url "
        'https://download.pytorch.org/whl/cpu && pip install ".[torch]")'
    )
    raise SystemExit(0) from None

import cposembed.torch as ct

# A token table of 4096 x 128 float32 (2 MiB): large enough that its gradient
# is a storage the bridge keeps and hands out again, as a real vocabulary's is.
VOCAB, MAX_LEN, DIM = 4096, 32, 128
BATCH, T, STEPS, LR = 8, 32, 5, 0.5
WORLD = 2


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = ct.TokenPositionEmbedding(VOCAB, MAX_LEN, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def new_model() -> TinyLM:
    torch.manual_seed(0)  # the same initial parameters in every process
    return TinyLM()


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    # Skewed ids (many repeats), one token sequence per row.
    return [(torch.randint(0, 64, (BATCH, T + 1), generator=g) ** 2) % VOCAB for _ in range(STEPS)]


def train(model: nn.Module, data: list[torch.Tensor]) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in data:
        opt.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def my_batches(rank: int, world: int) -> list[torch.Tensor]:
    """This rank's share of every batch."""
    half = BATCH // world
    return [ids[rank * half : (rank + 1) * half] for ids in batches()]


def compare(params: list[torch.Tensor], world: int, engine: str) -> bool:
    """Rank 0: train the same model in one process on the whole batches, and
    compare its parameters with ``params``, those the ``world`` processes trained."""
    alone = new_model()
    losses = train(alone, batches())
    pairs = list(zip(params, alone.parameters()))
    worst = max(float((a - b).detach().abs().max()) for a, b in pairs)
    ok = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)
    print(f"one process, whole batches: losses {' '.join(f'{x:.4f}' for x in losses)}")
    print(
        f"{world} processes ({engine}, gloo) vs one: largest parameter difference "
        f"{worst:.1e}: {'match' if ok else 'MISMATCH'}"
    )
    return ok


def check(rank: int, world: int) -> bool:
    """Train this rank's halves with DDP; rank 0 also trains alone and compares."""
    torch.set_num_threads(1)
    ddp = DistributedDataParallel(new_model())
    train(ddp, my_batches(rank, world))
    return rank != 0 or compare(list(ddp.module.parameters()), world, "DDP")


def worker(rank: int, world: int, check: Callable[[int, int], bool] = check) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ok = False
    try:
        ok = check(rank, world)  # the model, and its hold on the group, end here
        dist.barrier()  # every rank done before any rank tears gloo down
    finally:
        dist.destroy_process_group()  # the last reference: gloo's threads are joined here
    # The result is settled and the group is gone: leave without the interpreter's
    # and C++ runtime's exit-time teardown, where PyTorch's distributed threads
    # have been seen to abort a finished worker (std::terminate) on a loaded machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(check: Callable[[int, int], bool] = check) -> None:
    """Run ``check`` on every rank: under torchrun, or in ``WORLD`` processes of
    its own."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    if "RANK" in os.environ:  # started by torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), check)
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    try:
        mp.spawn(worker, args=(WORLD, check), nprocs=WORLD, join=True)
    except mp.ProcessExitedException as exc:
        print(f"a worker failed: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
