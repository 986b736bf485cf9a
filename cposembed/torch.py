"""PyTorch bridge: cposembed's kernels as torch operators and ``nn.Module`` layers.

``import cposembed.torch as ct`` registers three operators with
:func:`torch.library.custom_op` (CPU), each with a fake (meta) kernel and an
autograd formula whose backward is itself a registered operator, so
``torch.compile`` traces forward and backward alike:

- ``torch.ops.cposembed.lookup(table, positions, padding_idx=None)``: ``table[positions]``
- ``torch.ops.cposembed.add_positions(tok, table, positions, offset, padding_idx=None)``:
  ``tok + table[positions]``
- ``torch.ops.cposembed.embed(token_ids, token_table, position_table, positions, offset,
  padding_idx=None)``: ``token_table[token_ids] + position_table[positions]``

and the layers :class:`LearnedPositionEmbedding` and
:class:`TokenPositionEmbedding`, whose values and gradients equal those of
``torch.nn.Embedding``. The kernels read and write the tensors' memory
directly (``Tensor.numpy()`` shares it); any layout, integer index dtype and
float32/float64 tables are handled as in the NumPy API (:mod:`cposembed.functional`).

Gradients of the tables are dense tensors, as ``nn.Embedding``'s are (see
:class:`_GradBuffers` for how they avoid zeroing a whole table every step).
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import torch
    from torch import nn
except ImportError as exc:  # torch is the optional extra "torch"
    raise ImportError('cposembed.torch needs PyTorch: pip install "cposembed[torch]"') from exc

from cposembed import functional as _f
from cposembed import layer as _layer
from cposembed.embedding import _padding_index
from cposembed.embedding import _skip_row as _skip_row_of

__all__ = ["LearnedPositionEmbedding", "TokenPositionEmbedding"]

_TABLE_DTYPES = (torch.float32, torch.float64)
_ROW_DTYPES = (torch.float16, torch.float32, torch.float64)


# ---- tensors <-> arrays ----------------------------------------------------------


def _array(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as an ndarray (no copy, any strides)."""
    return t.detach().resolve_neg().numpy()


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a)


def _check_table(t: torch.Tensor, name: str) -> None:
    if t.dtype not in _TABLE_DTYPES:
        raise TypeError(f"{name} must have dtype float32 or float64; got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, embed_dim); got shape {tuple(t.shape)}")


def _check_index(t: torch.Tensor | None, name: str) -> None:
    # Boolean masks would give data-dependent shapes, which fake kernels cannot.
    if t is not None and (t.dtype == torch.bool or t.is_floating_point() or t.is_complex()):
        raise IndexError(f"{name} must be an integer tensor; got dtype {t.dtype}")


def _check_rows(t: torch.Tensor, d: int, name: str) -> None:
    if t.dtype not in _ROW_DTYPES:
        raise TypeError(f"{name} must have dtype float16, float32 or float64; got {t.dtype}")
    if t.dim() == 0 or t.shape[-1] != d:
        raise ValueError(f"{name} must have shape (..., {d}); got {tuple(t.shape)}")


def _skip_row(padding_idx: int | None, n_rows: int) -> int:
    return _skip_row_of(_padding_index(padding_idx, n_rows))


# ---- dense gradients without zeroing a whole table every step ---------------------

# Gradients smaller than this come from torch.zeros (zeroing them is cheap).
_RECYCLE_MIN_BYTES = 1 << 21
# Free buffers kept for reuse, across shapes.
_MAX_FREE_BUFFERS = 4


@dataclass
class _Slot:
    keeper: torch.Tensor  # a detach() of the tensor handed out: same storage and version counter
    array: np.ndarray  # the same memory
    version: int  # the version counter when handed out
    touched: np.ndarray | None  # rows the kernel wrote (None: unknown, zero all)
    free_use_count: int  # the storage's use count when only `keeper` holds it


def _storage_use_count(t: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class _GradBuffers:
    """Zeroed ``(rows, d)`` gradient tensors, reused without zeroing all of them.

    ``torch.zeros`` of a GPT-2 token table (50257 x 768 float32, 154 MB) costs
    more than the whole backward: every 4 KiB page is faulted in and zeroed.
    Instead, a gradient buffer is

    - new: anonymous private memory with transparent huge pages asked for; the
      kernel hands it out already zeroed, 2 MiB at a time (one fault per 2 MiB);
    - reused, once nothing but this pool refers to its storage (the autograd
      ``.grad`` that held it was set to ``None`` or replaced): only the rows the
      scatter-add wrote are zeroed again, provided the tensor's version counter
      shows no in-place change since it was handed out. PyTorch bumps that
      counter on every in-place operation (optimizers, ``+=`` accumulation of a
      second backward, DDP's averaging, ``zero_()``); any change, or rows not
      recorded, and the whole buffer is zeroed. Writes that bypass the counter
      (through ``.data`` or ``.numpy()``) are the ones autograd does not see
      either; ``CPOSEMBED_TORCH_REUSE_GRADS=0`` turns reuse off.

    The tensor handed out is a plain dense CPU tensor that autograd takes over
    as ``.grad`` without a copy; accumulation, optimizers and DDP see nothing
    unusual.
    """

    def __init__(self) -> None:
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()
        self.reuse = os.environ.get("CPOSEMBED_TORCH_REUSE_GRADS", "").strip() != "0" and hasattr(
            torch._C, "_storage_Use_Count"
        )

    def zeros(
        self, n_rows: int, d: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, np.ndarray, _Slot | None]:
        """A zeroed ``(n_rows, d)`` tensor, its memory as an array, and its slot
        (record the rows written with :meth:`written`)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = n_rows * d * itemsize
        if nbytes < _RECYCLE_MIN_BYTES:
            t = torch.zeros((n_rows, d), dtype=dtype)
            return t, t.numpy(), None
        np_dtype = np.dtype(np.float32 if dtype == torch.float32 else np.float64)
        if self.reuse:
            slot = self._take_free((n_rows, d), np_dtype)
            if slot is not None:
                t = torch.from_numpy(slot.array)
                slot.keeper = t.detach()
                slot.version = t._version
                slot.touched = None
                with self._lock:
                    self._slots.append(slot)
                return t, slot.array, slot
        array = _fresh_zeros(nbytes).view(np_dtype).reshape(n_rows, d)
        t = torch.from_numpy(array)
        if not self.reuse:
            return t, array, None
        keeper = t.detach()
        slot = _Slot(keeper, array, t._version, None, _storage_use_count(keeper) - 1)
        with self._lock:
            self._slots.append(slot)
            self._trim()
        return t, array, slot

    @staticmethod
    def written(slot: _Slot | None, touched: np.ndarray | None) -> None:
        if slot is not None:
            slot.touched = touched
            slot.version = slot.keeper._version

    def _take_free(self, shape: tuple[int, int], dtype: np.dtype) -> _Slot | None:
        with self._lock:
            for i, slot in enumerate(self._slots):
                a = slot.array
                if a.shape == shape and a.dtype == dtype and self._is_free(slot):
                    del self._slots[i]
                    break
            else:
                return None
        if slot.keeper._version != slot.version or slot.touched is None:
            a.fill(0)
        else:
            rows = np.flatnonzero(slot.touched)
            if rows.size:
                a[rows] = 0
        return slot

    def _is_free(self, slot: _Slot) -> bool:
        return _storage_use_count(slot.keeper) <= slot.free_use_count

    def _trim(self) -> None:
        free = [s for s in self._slots if self._is_free(s)]
        for s in free[: max(0, len(free) - _MAX_FREE_BUFFERS)]:
            self._slots.remove(s)

    def clear(self) -> None:
        """Forget every buffer (memory in use stays with its tensors)."""
        with self._lock:
            self._slots.clear()


def _fresh_zeros(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeroed memory straight from the OS, as a uint8 array."""
    flags = getattr(mmap, "MAP_PRIVATE", None)
    anon = getattr(mmap, "MAP_ANONYMOUS", None)
    if flags is None or anon is None:
        return np.zeros(nbytes, dtype=np.uint8)  # calloc: fresh zero pages too
    buf = mmap.mmap(-1, nbytes, flags=flags | anon)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buf.madvise(advice)
        except OSError:  # a kernel without transparent huge pages
            pass
    return np.frombuffer(buf, dtype=np.uint8)


_grads = _GradBuffers()


# ---- forward operators ------------------------------------------------------------


@torch.library.custom_op("cposembed::lookup", mutates_args=(), device_types="cpu")
def _lookup(
    table: torch.Tensor, positions: torch.Tensor, padding_idx: int | None = None
) -> torch.Tensor:
    _check_table(table, "table")
    _check_index(positions, "positions")
    _skip_row(padding_idx, table.shape[0])
    return _tensor(_f.lookup(_array(table), _array(positions)))


@_lookup.register_fake
def _lookup_fake(
    table: torch.Tensor, positions: torch.Tensor, padding_idx: int | None = None
) -> torch.Tensor:
    _check_table(table, "table")
    _check_index(positions, "positions")
    return table.new_empty((*positions.shape, table.shape[1]))


@torch.library.custom_op("cposembed::add_positions", mutates_args=(), device_types="cpu")
def _add_positions(
    tok: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor | None,
    offset: int,
    padding_idx: int | None = None,
) -> torch.Tensor:
    _check_add(tok, table, positions)
    _skip_row(padding_idx, table.shape[0])
    pos = None if positions is None else _array(positions)
    return _tensor(_f.add_positions(_array(tok), _array(table), pos, offset=offset))


def _check_add(tok: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None) -> None:
    _check_table(table, "table")
    _check_rows(tok, table.shape[1], "tok")
    _check_index(positions, "positions")


@_add_positions.register_fake
def _add_positions_fake(
    tok: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor | None,
    offset: int,
    padding_idx: int | None = None,
) -> torch.Tensor:
    _check_add(tok, table, positions)
    return tok.new_empty(tok.shape, dtype=torch.promote_types(tok.dtype, table.dtype))


@torch.library.custom_op("cposembed::embed", mutates_args=(), device_types="cpu")
def _embed(
    token_ids: torch.Tensor,
    token_table: torch.Tensor,
    position_table: torch.Tensor,
    positions: torch.Tensor | None,
    offset: int,
    padding_idx: int | None = None,
) -> torch.Tensor:
    _check_embed(token_ids, token_table, position_table, positions)
    _skip_row(padding_idx, token_table.shape[0])
    pos = None if positions is None else _array(positions)
    out = _layer.embed(
        _array(token_ids), _array(token_table), _array(position_table), pos, offset=offset
    )
    return _tensor(out)


def _check_embed(
    token_ids: torch.Tensor,
    token_table: torch.Tensor,
    position_table: torch.Tensor,
    positions: torch.Tensor | None,
) -> None:
    _check_table(token_table, "token_table")
    _check_table(position_table, "position_table")
    if token_table.shape[1] != position_table.shape[1]:
        raise ValueError(
            "token_table and position_table must share embed_dim; got "
            f"{token_table.shape[1]} and {position_table.shape[1]}"
        )
    _check_index(token_ids, "token_ids")
    _check_index(positions, "positions")


@_embed.register_fake
def _embed_fake(
    token_ids: torch.Tensor,
    token_table: torch.Tensor,
    position_table: torch.Tensor,
    positions: torch.Tensor | None,
    offset: int,
    padding_idx: int | None = None,
) -> torch.Tensor:
    _check_embed(token_ids, token_table, position_table, positions)
    dtype = torch.promote_types(token_table.dtype, position_table.dtype)
    return token_table.new_empty((*token_ids.shape, token_table.shape[1]), dtype=dtype)


# ---- backward operators -------------------------------------------------------------


@torch.library.custom_op("cposembed::table_grad", mutates_args=(), device_types="cpu")
def _table_grad(
    grad_output: torch.Tensor,
    positions: torch.Tensor | None,
    offset: int,
    num_rows: int,
    dtype: torch.dtype,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """The gradient of a table looked up at ``positions`` (``None``: ``offset +
    arange(T)``): a dense ``(num_rows, d)`` tensor, ``np.add.at`` bitwise."""
    d = grad_output.shape[-1]
    grad, array, slot = _grads.zeros(num_rows, d, dtype)
    touched = np.zeros(num_rows, dtype=bool) if slot is not None else None
    pos = None if positions is None else _array(positions)
    _f.scatter_add_marking(
        array, _array(grad_output), pos, offset, None, touched, _skip_row(padding_idx, num_rows)
    )
    _grads.written(slot, touched)
    return grad


@_table_grad.register_fake
def _table_grad_fake(
    grad_output: torch.Tensor,
    positions: torch.Tensor | None,
    offset: int,
    num_rows: int,
    dtype: torch.dtype,
    padding_idx: int | None = None,
) -> torch.Tensor:
    return grad_output.new_empty((num_rows, grad_output.shape[-1]), dtype=dtype)


@torch.library.custom_op("cposembed::embed_backward", mutates_args=(), device_types="cpu")
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both table gradients of :func:`embed` from one read of ``grad_output``."""
    d = grad_output.shape[-1]
    g_tok, a_tok, s_tok = _grads.zeros(vocab_size, d, token_dtype)
    g_pos, a_pos, s_pos = _grads.zeros(max_seq_len, d, position_dtype)
    t_tok = np.zeros(vocab_size, dtype=bool) if s_tok is not None else None
    t_pos = np.zeros(max_seq_len, dtype=bool) if s_pos is not None else None
    pos = None if positions is None else _array(positions)
    _layer.embed_backward_marking(
        a_tok,
        a_pos,
        _array(grad_output),
        _array(token_ids),
        pos,
        offset,
        None,
        t_tok,
        t_pos,
        _skip_row(padding_idx, vocab_size),
    )
    _grads.written(s_tok, t_tok)
    _grads.written(s_pos, t_pos)
    return g_tok, g_pos


@_embed_backward.register_fake
def _embed_backward_fake(
    grad_output: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor | None,
    offset: int,
    vocab_size: int,
    max_seq_len: int,
    token_dtype: torch.dtype,
    position_dtype: torch.dtype,
    padding_idx: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    d = grad_output.shape[-1]
    return (
        grad_output.new_empty((vocab_size, d), dtype=token_dtype),
        grad_output.new_empty((max_seq_len, d), dtype=position_dtype),
    )


# ---- autograd formulas (backward through the operators above) ---------------------


def _lookup_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    table, positions, padding_idx = inputs
    ctx.save_for_backward(positions)
    ctx.num_rows, ctx.dtype, ctx.padding_idx = table.shape[0], table.dtype, padding_idx


def _lookup_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    (positions,) = ctx.saved_tensors
    g_table = torch.ops.cposembed.table_grad(
        grad, positions, 0, ctx.num_rows, ctx.dtype, ctx.padding_idx
    )
    return g_table, None, None


_lookup.register_autograd(_lookup_backward, setup_context=_lookup_setup)


def _add_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    tok, table, positions, offset, padding_idx = inputs
    ctx.save_for_backward(positions)
    ctx.tok_dtype, ctx.offset, ctx.padding_idx = tok.dtype, offset, padding_idx
    ctx.num_rows, ctx.dtype = table.shape[0], table.dtype


def _add_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    (positions,) = ctx.saved_tensors
    g_tok = g_table = None
    if ctx.needs_input_grad[0]:
        g_tok = grad.to(ctx.tok_dtype)
    if ctx.needs_input_grad[1]:
        g_table = torch.ops.cposembed.table_grad(
            grad, positions, ctx.offset, ctx.num_rows, ctx.dtype, ctx.padding_idx
        )
    return g_tok, g_table, None, None, None


_add_positions.register_autograd(_add_backward, setup_context=_add_setup)


def _embed_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    token_ids, token_table, position_table, positions, offset, padding_idx = inputs
    ctx.save_for_backward(token_ids, positions)
    ctx.offset, ctx.padding_idx = offset, padding_idx
    ctx.vocab_size, ctx.token_dtype = token_table.shape[0], token_table.dtype
    ctx.max_seq_len, ctx.position_dtype = position_table.shape[0], position_table.dtype


def _embed_backward_formula(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    token_ids, positions = ctx.saved_tensors
    need_tok, need_pos = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    g_tok = g_pos = None
    if need_tok and need_pos:
        g_tok, g_pos = torch.ops.cposembed.embed_backward(
            grad,
            token_ids,
            positions,
            ctx.offset,
            ctx.vocab_size,
            ctx.max_seq_len,
            ctx.token_dtype,
            ctx.position_dtype,
            ctx.padding_idx,
        )
    elif need_tok:
        g_tok = torch.ops.cposembed.table_grad(
            grad, token_ids, 0, ctx.vocab_size, ctx.token_dtype, ctx.padding_idx
        )
    elif need_pos:
        if positions is None:
            # offset + arange(T) along the last axis of token_ids.
            positions = torch.arange(
                ctx.offset, ctx.offset + token_ids.shape[-1], device=grad.device
            ).expand(token_ids.shape)
        g_pos = torch.ops.cposembed.table_grad(
            grad, positions, 0, ctx.max_seq_len, ctx.position_dtype, None
        )
    return None, g_tok, g_pos, None, None, None


_embed.register_autograd(_embed_backward_formula, setup_context=_embed_setup)


# ---- modules --------------------------------------------------------------------------


def _as_index(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


class _Table(nn.Module):
    """A ``(num_rows, embed_dim)`` parameter ``weight``, initialised as
    ``nn.Embedding`` does: ``N(0, 1)``, the ``padding_idx`` row zero."""

    def __init__(
        self,
        num_rows: int,
        embed_dim: int,
        *,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("num_rows", num_rows), ("embed_dim", embed_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        dt = torch.get_default_dtype() if dtype is None else dtype
        if dt not in _TABLE_DTYPES:
            raise TypeError(f"dtype must be torch.float32 or torch.float64; got {dt}")
        self.padding_idx = _padding_index(padding_idx, num_rows)
        self.weight = nn.Parameter(torch.empty((num_rows, embed_dim), dtype=dt))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].fill_(0)

    @property
    def embed_dim(self) -> int:
        return int(self.weight.shape[1])

    def extra_repr(self) -> str:
        rows, d = self.weight.shape
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{rows}, {d}{pad}"

    def forward(self, indices: Any) -> torch.Tensor:
        """``weight[indices]``, as ``nn.Embedding(indices)``."""
        return torch.ops.cposembed.lookup(self.weight, _as_index(indices), self.padding_idx)


class LearnedPositionEmbedding(_Table):
    """A learned position table as a torch module: ``weight[positions]``.

    A drop-in for ``nn.Embedding(max_seq_len, embed_dim)`` used as a position
    table (GPT-2's ``wpe``): same ``weight`` parameter and state dict key, same
    values and gradients, on cposembed's kernels.

    Parameters
    ----------
    max_seq_len, embed_dim : int
        Shape of ``weight``.
    padding_idx : int, optional
        As in ``nn.Embedding``: that row starts at zero and gets no gradient.
    dtype : torch.float32 or torch.float64, optional
        Default: ``torch.get_default_dtype()``.

    Examples
    --------
    >>> import torch
    >>> import cposembed.torch as ct
    >>> pe = ct.LearnedPositionEmbedding(16, 4)
    >>> pe.load_state_dict(torch.nn.Embedding(16, 4).state_dict())
    <All keys matched successfully>
    >>> pe(torch.arange(3)).shape
    torch.Size([3, 4])
    """

    def __init__(
        self,
        max_seq_len: int,
        embed_dim: int,
        *,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(max_seq_len, embed_dim, padding_idx=padding_idx, dtype=dtype)

    @property
    def max_seq_len(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, positions: Any) -> torch.Tensor:
        """``weight[positions]``: shape ``positions.shape + (embed_dim,)``."""
        return super().forward(positions)

    def add_to(self, tok: torch.Tensor, positions: Any = None, offset: int = 0) -> torch.Tensor:
        """``tok + weight[positions]`` in one pass; ``positions=None`` means
        ``offset + arange(T)`` for ``tok`` of shape ``(..., T, embed_dim)``."""
        pos = None if positions is None else _as_index(positions)
        return torch.ops.cposembed.add_positions(tok, self.weight, pos, offset, self.padding_idx)


class TokenPositionEmbedding(nn.Module):
    """GPT-2's input layer ``wte[token_ids] + wpe[positions]`` as one torch module.

    Values and gradients equal two ``nn.Embedding`` modules added, computed
    in one pass forward and one read of the gradient backward.

    Parameters
    ----------
    vocab_size, max_seq_len, embed_dim : int
        Shapes of ``tokens.weight`` ``(vocab_size, embed_dim)`` and
        ``positions.weight`` ``(max_seq_len, embed_dim)``.
    padding_idx : int, optional
        A token id, as in ``nn.Embedding``: its row starts at zero and gets no
        gradient.
    dtype : torch.float32 or torch.float64, optional
        Default: ``torch.get_default_dtype()``.

    Attributes
    ----------
    tokens, positions : nn.Module
        Each with a ``weight`` parameter (state dict keys ``tokens.weight``
        and ``positions.weight``, loadable from ``nn.Embedding`` state dicts
        and GPT-2's ``wte.weight`` and ``wpe.weight``).

    Examples
    --------
    >>> import torch
    >>> import cposembed.torch as ct
    >>> m = ct.TokenPositionEmbedding(100, 16, 8)
    >>> x = m(torch.tensor([[5, 7, 7]]))
    >>> torch.equal(x, m.tokens.weight[[[5, 7, 7]]] + m.positions.weight[:3])
    True
    """

    def __init__(
        self,
        vocab_size: int,
        max_seq_len: int,
        embed_dim: int,
        *,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tokens = _Table(vocab_size, embed_dim, padding_idx=padding_idx, dtype=dtype)
        self.positions = LearnedPositionEmbedding(max_seq_len, embed_dim, dtype=dtype)

    @property
    def padding_idx(self) -> int | None:
        return self.tokens.padding_idx

    def forward(self, token_ids: Any, positions: Any = None, offset: int = 0) -> torch.Tensor:
        """``tokens.weight[token_ids] + positions.weight[positions]``; ``positions=None``
        means ``offset + arange(T)`` for ``token_ids`` of shape ``(..., T)``."""
        pos = None if positions is None else _as_index(positions)
        return torch.ops.cposembed.embed(
            _as_index(token_ids),
            self.tokens.weight,
            self.positions.weight,
            pos,
            offset,
            self.tokens.padding_idx,
        )
