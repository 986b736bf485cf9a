"""The autograd of cposembed's PyTorch operators, registered on them (what
``torch.compile`` traces), and the differentiable calls :mod:`cposembed.torch` makes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD

from cposembed._torch_arrays import skip_row
from cposembed._torch_kernels import LIB, carries_tangents, ops

__all__ = ["add_positions", "embed", "full_positions", "lookup"]

# ---- autograd formulas ------------------------------------------------------------


def full_positions(positions: Any, offset: int, token_shape: Any) -> torch.Tensor:
    """``positions``; for ``None``, ``offset + arange(T)`` broadcast to ``token_shape``."""
    if positions is not None:
        return positions
    T = token_shape[-1] if len(token_shape) else 1
    return torch.arange(offset, offset + T).expand(tuple(token_shape))


def _save(ctx: Any, inputs: tuple[Any, ...], output: Any, tok: Any, tables: list[Any]) -> None:
    """Saves ``tok``'s dtype (or None) and each table's (slot, index, offset, padding_idx)."""
    ctx.save_for_backward(*(index for _, index, _, _ in tables))
    ctx.tables = [(i, off, inputs[i].shape[0], inputs[i].dtype, pad) for i, _, off, pad in tables]
    ctx.n_inputs, ctx.tok_dtype, ctx.out_dtype = len(inputs), tok, output.dtype
    ctx.sparse = len(inputs) == 4 and bool(inputs[3])  # lookup's eager call


def _lookup_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _save(ctx, inputs, output, None, [(0, inputs[1], 0, inputs[2])])


def _add_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    tok, _, positions, offset, padding_idx = inputs
    _save(ctx, inputs, output, tok.dtype, [(1, positions, offset, padding_idx)])


def _embed_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    token_ids, _, _, positions, offset, padding_idx = inputs
    tables = [(1, token_ids, 0, padding_idx), (2, positions, offset, None)]
    _save(ctx, inputs, output, None, tables)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    """The backward of ``lookup``, ``add_positions`` and ``embed``, as ``nn.Embedding``'s."""
    grads: list[Any] = [None] * ctx.n_inputs
    if ctx.tok_dtype is not None and ctx.needs_input_grad[0]:
        grads[0] = grad.to(ctx.tok_dtype)
    todo = [(t, idx) for t, idx in zip(ctx.tables, ctx.saved_tensors) if ctx.needs_input_grad[t[0]]]
    if len(todo) == 2 and len({dtype for (_, _, _, dtype, _), _ in todo}) == 1:
        ((_, _, vocab_size, dtype, pad), ids), ((_, offset, max_seq_len, _, _), pos) = todo
        g = grad.to(dtype)
        grads[1:3] = embed_backward(g, ids, pos, offset, vocab_size, max_seq_len, dtype, dtype, pad)
        return tuple(grads)
    for (i, offset, rows, dtype, pad), idx in todo:
        if ctx.sparse:
            grads[i] = _sparse_table_grad(grad, idx, rows, dtype, pad)
        else:
            grads[i] = table_grad(grad.to(dtype), idx, offset, rows, dtype, pad)
    return tuple(grads)


def _sparse_table_grad(
    grad: torch.Tensor, positions: torch.Tensor, num_rows: int, dtype: torch.dtype, pad: Any
) -> torch.Tensor:
    """``nn.Embedding``'s sparse gradient, its values copied with their layout (as torch sums it)."""
    ids = positions.to(torch.int64)
    g = torch.ops.aten.embedding_sparse_backward(
        grad, ids, num_rows, skip_row(pad, num_rows), False
    )
    values = _copy_keeping_strides(g._values()).to(dtype)
    return torch.sparse_coo_tensor(g._indices(), values, g.shape, check_invariants=False)


def _copy_keeping_strides(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its sizes and strides (an expanded tensor stays expanded)."""
    if t.is_contiguous() or t.numel() == 0:
        return t.clone(memory_format=torch.contiguous_format)
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    own = t.as_strided((span,), (1,), t.storage_offset()).clone()
    return own.as_strided(t.shape, t.stride())


def _grad_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    """Setup of ``table_grad`` and ``embed_backward``: one or two index tensors, then the rest."""
    n = 1 if len(inputs) == 6 else 2
    ctx.save_for_backward(*inputs[1 : n + 1])
    ctx.rest = inputs[n + 1 :]
    ctx.shape, ctx.grad_dtype = tuple(inputs[0].shape), inputs[0].dtype


def _grad_backward(ctx: Any, *ggs: Any) -> tuple[Any, ...]:
    """The gradient of ``table_grad`` or ``embed_backward`` with respect to ``grad_output``."""
    *ids, positions = ctx.saved_tensors
    none = (None,) * (len(ids) + len(ctx.rest) + 1)
    if not ctx.needs_input_grad[0]:
        return (None, *none)
    offset, padding_idx = ctx.rest[0], ctx.rest[-1]
    indices = (*ids, full_positions(positions, offset, ctx.shape[:-1]))
    pads = (padding_idx, None) if ids else (padding_idx,)
    terms = tuple(
        _looked_up_grad(gg, idx, pad, ctx.shape, ctx.grad_dtype)
        for gg, idx, pad in zip(ggs, indices, pads)
        if gg is not None
    )
    return (_tangent_sum(terms, ctx.grad_dtype) if terms else None, *none)


def _looked_up_grad(
    gg: torch.Tensor,
    positions: torch.Tensor,
    padding_idx: int | None,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """``gg`` looked up at ``positions``, zero at the padding row."""
    positions = positions.expand(shape[:-1])
    g = lookup(gg, positions, None, False).to(dtype)
    skip = skip_row(padding_idx, gg.shape[0])
    if skip >= 0:  # positions passed the forward's checks: each in [0, rows)
        g = g.masked_fill((positions == skip).unsqueeze(-1), 0)
    return g


# ---- the calls: autograd functions in eager mode, the operators when compiling ----


def _tangent_sum(parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """The terms in ``dtype``, added."""
    terms = [p.to(dtype) for p in parts]
    return sum(terms[1:], terms[0])


def _differentiable(
    op: str,
    setup: Callable[..., None],
    for_jvp: Callable[[tuple[Any, ...]], tuple[Any, ...]],
    forward: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """Registers ``op``'s autograd; returns its autograd function's call (``forward`` under Dynamo)."""
    linear = setup is _grad_setup  # table_grad and embed_backward
    backward, jvp = (_grad_backward, _grad_jvp) if linear else (_backward, _jvp)
    torch.library.register_autograd(f"cposembed::{op}", backward, setup_context=setup, lib=LIB)
    name = "".join(word.title() for word in op.split("_")) + "Fn"
    if forward is None:
        # A function: Function.apply inspects forward's signature, slow for an operator.
        overload = getattr(ops, op).default

        def forward(*args: Any) -> Any:
            return overload(*args)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        setup(ctx, inputs, output)
        ctx.save_for_forward(*for_jvp(inputs))

    fn: Any = type(
        name,
        (torch.autograd.Function,),
        {
            "generate_vmap_rule": True,
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
            "jvp": staticmethod(jvp),
        },
    )

    def call(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return forward(*args)
        if fwAD._current_level < 0:
            return fn.apply(*args)
        token = carries_tangents.set(True)  # fn carries the operators' tangents
        try:
            return fn.apply(*args)
        finally:
            carries_tangents.reset(token)

    call.__name__ = call.__qualname__ = name
    return call


def _jvp(ctx: Any, *tangents: Any) -> Any:
    """Each table's tangent looked up at its saved index, plus ``tok``'s (saved None)."""
    terms = tuple(
        t if idx is None else lookup(t, idx, None, False)
        for t, idx in zip(tangents, ctx.saved_tensors)
        if t is not None
    )
    return _tangent_sum(terms, ctx.out_dtype)


def _grad_jvp(ctx: Any, grad_output_t: Any, *_: Any) -> Any:
    """The tangent of ``table_grad`` or ``embed_backward``: linear in ``grad_output``."""
    op = table_grad if len(ctx.saved_tensors) == 1 else embed_backward
    return op(grad_output_t, *ctx.saved_tensors, *ctx.rest)


# Each with its operator's arguments; lookup's sparse: a sparse gradient (eager only).
lookup = _differentiable(
    "lookup",
    _lookup_setup,
    lambda i: (i[1],),
    forward=lambda table, positions, padding_idx, sparse: ops.lookup.default(
        table, positions, padding_idx
    ),
)
add_positions = _differentiable(
    "add_positions", _add_setup, lambda i: (None, full_positions(i[2], i[3], i[0].shape[:-1]))
)
embed = _differentiable(
    "embed", _embed_setup, lambda i: (None, i[0], full_positions(i[3], i[4], i[0].shape))
)
table_grad = _differentiable("table_grad", _grad_setup, lambda i: (i[1],))
embed_backward = _differentiable("embed_backward", _grad_setup, lambda i: (i[1], i[2]))
