"""The list of comparisons, written once: what ``--only`` takes, in the order they run."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import add, backward, contention, half, layer, lookup, optim, scatter, threads, tiny
from . import torch as torch_layers
from ._common import Fixture, Group


@dataclass(frozen=True)
class Entry:
    name: str  # what --only takes
    build: Callable[[Fixture], list[Group]]
    # Runs only with more than one thread (cposembed's threads against one).
    threaded: bool = False


GROUPS = (
    Entry("lookup", lookup.lookup_out),
    Entry("pe_alloc", lookup.pe_alloc),
    Entry("add_out", add.add_out),
    Entry("add_inplace", add.add_inplace),
    Entry("add_to", add.add_to),
    Entry("add_to_explicit", add.add_to_explicit),
    Entry("scatter_arange", scatter.scatter_arange),
    Entry("scatter_random", scatter.scatter_random),
    Entry("backward_vs_scatter", backward.backward_vs_scatter),
    Entry("fwd_bwd", backward.fwd_bwd),
    Entry("threads_lookup", threads.threads_lookup, threaded=True),
    Entry("threads_scatter", threads.threads_scatter, threaded=True),
    Entry("tiny", tiny.tiny),
    Entry("decode_batched", tiny.decode_batched),
    Entry("embed_out", layer.embed_out),
    Entry("embed_alloc", layer.embed_alloc),
    Entry("embed_backward", layer.embed_backward),
    Entry("half", half.half),
    Entry("torch_layer", torch_layers.torch_layer),
    Entry("optim_steps", optim.optim_steps),
    Entry("optim_huge", optim.optim_huge),
    Entry("contention", contention.contention),
)
GROUP_NAMES = tuple(entry.name for entry in GROUPS)


def build_groups(
    args: argparse.Namespace, torch: Any
) -> list[tuple[str, Callable[[], list[Group]]]]:
    """(name, factory) per comparison that runs with ``args``, in GROUPS order.

    The factories share one Fixture and make their own arrays when called.
    """
    fixture = Fixture(args, torch)
    return [
        (entry.name, functools.partial(entry.build, fixture))
        for entry in GROUPS
        if args.threads > 1 or not entry.threaded
    ]


def _torch_or_none() -> Any:
    try:
        import torch
    except Exception:  # not installed or broken: no torch rows
        return None
    return torch


def targets() -> dict[tuple[str, str], float]:
    """Every (op, contender) with a target, read off the groups as built on small
    arrays (with PyTorch's rows when torch imports, the threads rows always)."""
    args = argparse.Namespace(
        table=[16, 4], batch=[2, 8], threads=2, vocab=32, dtype="float32", quick=True
    )
    fixture = Fixture(args, _torch_or_none())
    return {
        (group.op, c.name): c.target
        for entry in GROUPS
        for group in entry.build(fixture)
        for c in group.contenders
        if c.target is not None
    }
