"""DTensor sharding rules for the operators a tensor-parallel ``ct.Embedding`` runs.

Under ``parallelize_module`` the weight is a DTensor. With these rules the
kernels run on each rank's local shard:

``ColwiseParallel`` (the weight sharded along ``embedding_dim``): ``lookup`` on
the local columns gives the output sharded along its last dimension, and
``table_grad`` on that gives the gradient's local columns. Anything else is
first made whole (``Replicate``).

A weight sharded along its rows (``RowwiseParallel``) does not reach these
operators: ``cposembed.torch`` passes it to ``F.embedding``, whose own rule
masks the ids each rank does not hold (``torch.distributed.tensor``'s
``MaskPartial``). Imported by ``cposembed.torch`` when ``torch.distributed``
is available.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

ops = torch.ops.cposembed


@register_sharding(ops.lookup.default)
def _lookup(table: Any, positions: Any, padding_idx: Any = None) -> list[Any]:
    """(output placements, input placements) the local ``lookup`` computes."""
    shardings: list[Any] = [([Replicate()], [Replicate(), Replicate(), None])]
    # The table's columns: the output's last dimension.
    shardings.append(([Shard(positions.ndim)], [Shard(1), Replicate(), None]))
    return shardings


@register_sharding(ops.table_grad.default)
def _table_grad(
    grad_output: Any,
    positions: Any,
    offset: Any,
    num_rows: Any,
    dtype: Any,
    padding_idx: Any = None,
) -> list[Any]:
    """(output placements, input placements) the local ``table_grad`` computes."""
    rest = [None, None, None, None]
    pos = None if positions is None else Replicate()
    shardings: list[Any] = [([Replicate()], [Replicate(), pos, *rest])]
    # The gradient's columns: the output's last dimension.
    shardings.append(([Shard(1)], [Shard(grad_output.ndim - 1), pos, *rest]))
    return shardings
