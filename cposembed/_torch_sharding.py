"""DTensor sharding rules, registered with the first DTensor weight: ``lookup`` and
``table_grad`` run on the local columns of a weight sharded along ``embedding_dim``;
anything else is made whole first (row-sharded weights go to ``F.embedding``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

ops = torch.ops.cposembed


@register_sharding(ops.lookup.default)
def _lookup(table: Any, positions: Any, *_: Any, **__: Any) -> list[Any]:
    """Whole, or the table's columns as the output's last dimension."""
    return [
        ([Replicate()], [Replicate(), Replicate(), None]),
        ([Shard(positions.ndim)], [Shard(1), Replicate(), None]),
    ]


@register_sharding(ops.table_grad.default)
def _table_grad(grad_output: Any, positions: Any, *_: Any, **__: Any) -> list[Any]:
    """Whole, or the gradient's columns from the last dimension of ``grad_output``."""
    pos = None if positions is None else Replicate()
    rest = [None, None, None, None]
    return [
        ([Replicate()], [Replicate(), pos, *rest]),
        ([Shard(1)], [Shard(grad_output.ndim - 1), pos, *rest]),
    ]
