"""cposembed's kernels as PyTorch operators: definitions, CPU and fake kernels, vmap
rules (autograd: :mod:`cposembed._torch_ops`). ``table_grad`` is the dense gradient
of a looked-up table, as ``nn.Embedding``'s; ``embed_backward`` both of ``embed``'s.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.autograd.forward_ad as fwAD

from cposembed import _routes
from cposembed import functional as _f
from cposembed import layer as _layer
from cposembed._torch_arrays import (
    HALF_PAIR,
    as_array,
    check_dtype,
    check_index,
    check_same_width,
    check_table,
    checked_ids,
    new_tensor,
    skip_row,
)

# ---- the operators ----------------------------------------------------------------

LIB = torch.library.Library("cposembed", "DEF")
ops = torch.ops.cposembed


# Set inside ``_torch_ops``' autograd functions, which carry forward-mode AD.
carries_tangents: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "cposembed_carries_tangents", default=False
)


def _refuse_tangents(name: str, args: tuple[Any, ...]) -> None:
    """Raises for an operator called directly under forward-mode AD (no tangent)."""
    if fwAD._current_level < 0 or carries_tangents.get():
        return
    dual = any(
        isinstance(a, torch.Tensor) and fwAD.unpack_dual(a).tangent is not None for a in args
    )
    got = "a dual tensor" if dual else "a call inside torch.func.jvp, jacfwd or a dual level"
    raise RuntimeError(
        f"torch.ops.cposembed.{name} has no forward-mode AD: it got {got}, and its output "
        "would have no tangent. Call cposembed.torch.embedding or the cposembed.torch "
        "modules instead: they carry forward-mode AD, with the tangent F.embedding gives"
    )


def _vmap_by_loop(op: Any) -> Callable[..., Any]:
    """A vmap rule that calls ``op`` once per batch entry and stacks the results."""

    def rule(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        results = []
        for b in range(info.batch_size):
            one = [a.select(dim, b) if dim is not None else a for a, dim in zip(args, in_dims)]
            results.append(op(*one))
        if isinstance(results[0], tuple):
            stacked = tuple(torch.stack(parts) for parts in zip(*results))
            return stacked, (0,) * len(stacked)
        return torch.stack(results), 0

    return rule


def _operator(schema: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Defines ``schema``'s operator: the function is its CPU and (``fake=True``) fake kernel."""
    name = schema.split("(", 1)[0]

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        def kernel(*args: Any) -> Any:
            _refuse_tangents(name, args)
            return fn(*args)

        def fake(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs, fake=True)

        LIB.define(schema)
        LIB.impl(name, kernel, "CPU")
        torch.library.register_fake(f"cposembed::{name}", fake, lib=LIB)
        op = getattr(ops, name).default
        torch.library.register_vmap(f"cposembed::{name}", _vmap_by_loop(op), lib=LIB)
        return fn

    return register


@_operator("lookup(Tensor table, Tensor positions, int? padding_idx=None) -> Tensor")
def _lookup(
    table: torch.Tensor,
    positions: torch.Tensor,
    padding_idx: int | None = None,
    fake: bool = False,
) -> torch.Tensor:
    check_table(table, "table")
    check_index(positions, "positions")
    shape = (*positions.shape, table.shape[1])
    if fake:
        return table.new_empty(shape)
    skip_row(padding_idx, table.shape[0])
    y = new_tensor(shape, table.dtype, zeroed=False)
    _f.lookup(as_array(table), checked_ids(positions, table.shape[0]), out=as_array(y))
    return y


@_operator(
    "add_positions(Tensor tok, Tensor table, Tensor? positions, SymInt offset, "
    "int? padding_idx=None) -> Tensor"
)
def _add_positions(
    tok: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor | None,
    offset: int,
    padding_idx: int | None = None,
    fake: bool = False,
) -> torch.Tensor:
    check_table(table, "table")
    check_dtype(tok.dtype, "tok")
    if tok.dim() == 0 or tok.shape[-1] != table.shape[1]:
        raise ValueError(f"tok must have shape (..., {table.shape[1]}); got {tuple(tok.shape)}")
    check_index(positions, "positions")
    dtype = torch.promote_types(tok.dtype, table.dtype)
    if fake:
        return tok.new_empty(tok.shape, dtype=dtype)
    skip_row(padding_idx, table.shape[0])
    y = new_tensor(tuple(tok.shape), dtype, zeroed=False)
    pos = checked_ids(positions, table.shape[0])
    tok_a = as_array(tok)
    if {tok.dtype, table.dtype} == HALF_PAIR:  # torch adds the pair in float32
        tok_a = tok_a.astype(np.float32)  # the tokens (exact), not the whole table
    _f.add_positions(tok_a, as_array(table), pos, offset=offset, out=as_array(y))
    return y


@_operator(
    "embed(Tensor token_ids, Tensor token_table, Tensor position_table, Tensor? positions, "
    "SymInt offset, int? padding_idx=None) -> Tensor"
)
def _embed(
    token_ids: torch.Tensor,
    token_table: torch.Tensor,
    position_table: torch.Tensor,
    positions: torch.Tensor | None,
    offset: int,
    padding_idx: int | None = None,
    fake: bool = False,
) -> torch.Tensor:
    check_table(token_table, "token_table")
    check_table(position_table, "position_table")
    check_same_width(token_table, position_table)
    check_index(token_ids, "token_ids")
    check_index(positions, "positions")
    shape = (*token_ids.shape, token_table.shape[1])
    dtype = torch.promote_types(token_table.dtype, position_table.dtype)
    if fake:
        return token_table.new_empty(shape, dtype=dtype)
    skip_row(padding_idx, token_table.shape[0])
    ids = checked_ids(token_ids, token_table.shape[0])
    assert ids is not None  # token_ids is a tensor
    pos = checked_ids(positions, position_table.shape[0])
    y = new_tensor(shape, dtype, zeroed=False)
    if {token_table.dtype, position_table.dtype} == HALF_PAIR:
        # torch adds the pair in float32: the looked-up token rows converted, not a table.
        pos, offset = _routes.id_positions(ids, pos, offset, position_table.shape[0])
        rows = _f.lookup(as_array(token_table), ids).astype(np.float32)
        _f.add_positions(rows, as_array(position_table), pos, offset=offset, out=as_array(y))
        return y
    _layer.embed(
        ids, as_array(token_table), as_array(position_table), pos, offset=offset, out=as_array(y)
    )
    return y


@_operator(
    "table_grad(Tensor grad_output, Tensor? positions, SymInt offset, SymInt num_rows, "
    "ScalarType dtype, int? padding_idx=None) -> Tensor"
)
def _table_grad(
    grad_output: torch.Tensor,
    positions: torch.Tensor | None,
    offset: int,
    num_rows: int,
    dtype: torch.dtype,
    padding_idx: int | None = None,
    fake: bool = False,
) -> torch.Tensor:
    check_index(positions, "positions")
    check_dtype(dtype)
    if fake:
        return grad_output.new_empty((num_rows, grad_output.shape[-1]), dtype=dtype)
    grad = new_tensor((num_rows, grad_output.shape[-1]), dtype, zeroed=True)
    _routes.scatter_add(
        as_array(grad),
        as_array(grad_output),
        checked_ids(positions, num_rows),
        offset=offset,
        num_threads=None,
        skip_row=skip_row(padding_idx, num_rows),
    )
    return grad


@_operator(
    "embed_backward(Tensor grad_output, Tensor token_ids, Tensor? positions, SymInt offset, "
    "SymInt vocab_size, SymInt max_seq_len, ScalarType token_dtype, "
    "ScalarType position_dtype, int? padding_idx=None) -> (Tensor, Tensor)"
)
def _embed_backward(
    grad_output: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor | None,
    offset: int,
    vocab_size: int,
    max_seq_len: int,
    token_dtype: torch.dtype,
    position_dtype: torch.dtype,
    padding_idx: int | None = None,
    fake: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_index(token_ids, "token_ids")
    check_index(positions, "positions")
    check_dtype(token_dtype)
    check_dtype(position_dtype)
    d = grad_output.shape[-1]
    if fake:
        return (
            grad_output.new_empty((vocab_size, d), dtype=token_dtype),
            grad_output.new_empty((max_seq_len, d), dtype=position_dtype),
        )
    skip = skip_row(padding_idx, vocab_size)
    ids, pos = checked_ids(token_ids, vocab_size), checked_ids(positions, max_seq_len)
    g_tok = new_tensor((vocab_size, d), token_dtype, zeroed=True)
    g_pos = new_tensor((max_seq_len, d), position_dtype, zeroed=True)
    _routes.embed_backward(
        as_array(g_tok),
        as_array(g_pos),
        as_array(grad_output),
        ids,
        pos,
        offset=offset,
        num_threads=None,
        token_skip_row=skip,
    )
    return g_tok, g_pos
