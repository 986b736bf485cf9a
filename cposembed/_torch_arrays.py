"""Tensors and NumPy arrays for the PyTorch operators (:mod:`cposembed._torch_kernels`):
the same memory seen both ways, the checks of tensor arguments, and the memory
of gradients and outputs.

**Gradient memory.** Every table gradient is memory that nothing else
holds, and nothing here touches it after it is returned. Gradients of 2 MiB
or more are blocks handed to torch through DLPack (:func:`fresh_zeros`,
``_core.zeroed_dlpack``): fresh zero pages from the OS, or a block that torch
has freed, zeroed whole before it is handed out again.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cposembed import _core

# Table dtypes the kernels take; other dtypes go to torch's own F.embedding.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPE_NAMES = "float16, bfloat16, float32 or float64"
# NumPy's bfloat16 is ml_dtypes' (torch has no NumPy view of a bfloat16 tensor),
# imported with the first bfloat16 tensor (_core.bfloat16()).
_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}
# float16 with bfloat16: NumPy has no common type (cposembed refuses the pair),
# torch promotes both to float32.
HALF_PAIR = frozenset((torch.float16, torch.bfloat16))

# ---- tensors <-> arrays ----------------------------------------------------------


class _Memory:
    """A tensor's memory as NumPy's array interface describes it, and the tensor
    (a reference keeps it alive, and its storage resizable)."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, tensor: torch.Tensor, interface: dict[str, Any]) -> None:
        self.tensor = tensor
        self.__array_interface__ = interface


@functools.cache
def _typestr(dtype: torch.dtype) -> str:
    """NumPy's type string for a torch dtype (bfloat16: its int16 bits)."""
    if dtype == torch.bfloat16:
        dtype = torch.int16
    return torch.empty(0, dtype=dtype).numpy().dtype.str


def as_array(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as an ndarray (no copy, any strides; a bfloat16
    tensor as an ``ml_dtypes.bfloat16`` array, through its int16 bits) that,
    unlike ``Tensor.numpy()``, leaves the storage resizable (``numpy()`` marks
    it fixed for good: FSDP2 frees an unsharded parameter with
    ``storage.resize_(0)``). The array holds the tensor it reads (``t`` or its
    resolved copy), so its memory lives as long as the array."""
    t = t.detach().resolve_neg().resolve_conj()
    item = t.element_size()
    if t.numel() == 0:  # its data pointer may be null
        a = np.empty(tuple(t.shape), np.dtype(_typestr(t.dtype)))
        return a.view(_core.bfloat16()) if t.dtype == torch.bfloat16 else a
    # A storage resized under the tensor (FSDP2 frees one with resize_(0)):
    # torch's own error, never a read past its end.
    end = t.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    if end * item > t.untyped_storage().nbytes():
        raise RuntimeError(
            f"a tensor of shape {tuple(t.shape)} is out of bounds of its storage of "
            f"{t.untyped_storage().nbytes()} bytes (resized, or freed as FSDP2 frees "
            "an unsharded parameter)"
        )
    a = np.asarray(
        _Memory(
            t,
            {
                "data": (t.data_ptr(), False),
                "shape": tuple(t.shape),
                "strides": tuple(s * item for s in t.stride()),
                "typestr": _typestr(t.dtype),
                "version": 3,
            },
        )
    )
    return a.view(_core.bfloat16()) if t.dtype == torch.bfloat16 else a


def as_tensor(a: np.ndarray) -> torch.Tensor:
    """The array's memory as a tensor (no copy); ``ml_dtypes.bfloat16`` as
    torch.bfloat16, through its int16 view."""
    if a.dtype.kind == "V" and a.dtype == _core.bfloat16():
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def skip_row(padding_idx: int | None, n_rows: int) -> int:
    """The row that gets no gradient, in ``[0, n_rows)``, or -1 for none."""
    if padding_idx is None:
        return -1
    if not -n_rows <= padding_idx < n_rows:
        raise ValueError(
            f"padding_idx must be within [-{n_rows}, {n_rows}) for a table of {n_rows} rows; "
            f"got {padding_idx}"
        )
    return padding_idx + n_rows if padding_idx < 0 else padding_idx


def check_table(t: torch.Tensor, name: str) -> None:
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must have dtype {DTYPE_NAMES}; got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, embed_dim); got shape {tuple(t.shape)}")


def check_index(t: torch.Tensor | None, name: str) -> None:
    # Boolean masks would give data-dependent shapes, which fake kernels cannot.
    if t is not None and (t.dtype == torch.bool or t.is_floating_point() or t.is_complex()):
        raise IndexError(f"{name} must be an integer tensor; got dtype {t.dtype}")


def checked_ids(t: torch.Tensor | None, n_rows: int) -> np.ndarray | None:
    """Ids as ``nn.Embedding`` takes them, as an array: each in ``[0, n_rows)``,
    else ``nn.Embedding``'s ``IndexError`` (negatives too: they would count
    from the end, a NumPy meaning torch does not give them)."""
    if t is None:
        return None
    a = as_array(t)
    if a.size:
        lo, hi = a.min(), a.max()
        if lo < 0 or hi >= n_rows:
            raise IndexError(
                f"index out of range in self: got id {lo if lo < 0 else hi} for a table "
                f"of {n_rows} rows (ids must be in [0, {n_rows}), as nn.Embedding takes them)"
            )
    return a


def check_rows(t: torch.Tensor, d: int, name: str) -> None:
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must have dtype {DTYPE_NAMES}; got {t.dtype}")
    if t.dim() == 0 or t.shape[-1] != d:
        raise ValueError(f"{name} must have shape (..., {d}); got {tuple(t.shape)}")


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"gradient dtype must be {DTYPE_NAMES}; got {dtype}")
    if dtype == torch.bfloat16:
        return _core.bfloat16()
    return _NUMPY_DTYPES[dtype]


# ---- gradient memory ----------------------------------------------------------------

# Below this many bytes a gradient is torch's own memory (torch.empty), zeroed
# on the calling thread: torch.zeros fills on PyTorch's OpenMP threads, which on
# a busy machine wait for cores a memset of this size does not need.
FRESH_MIN_BYTES = 1 << 21


def fresh_zeros(n_rows: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """A new zeroed ``(n_rows, d)`` tensor that nothing else refers to, and
    the same memory as an ndarray (for the kernel to write; drop it after).

    Small ones are torch's memory (``torch.empty``, zeroed here, on the calling
    thread), resizable as ``nn.Embedding``'s gradients are. Large ones are
    handed to torch through DLPack (``_core.zeroed_dlpack``): anonymous
    private memory from the OS, zero until written, or a block
    torch has already freed, zeroed whole. When torch frees the last tensor
    using it, a C deleter (no GIL needed, so never waiting on Python while
    autograd holds its locks) keeps the block or gives it back to the OS.
    """
    itemsize = numpy_dtype(dtype).itemsize
    if n_rows * d * itemsize < FRESH_MIN_BYTES:
        t = torch.empty((n_rows, d), dtype=dtype)
        array = as_array(t)
        array.reshape(-1).view(np.uint8).fill(0)
        return t, array
    block = _core.zeroed_dlpack(n_rows, d, itemsize, dtype == torch.bfloat16)
    t = torch.from_dlpack(block)
    return t, as_array(t)


def small_output(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An output below the output pool's size as torch's own memory
    (``torch.empty``: resizable, as ``nn.Embedding``'s outputs are), for the
    kernel to write; None for a larger one, which is one of the kernels'
    reusable blocks (no page faults; its storage cannot be resized)."""
    if math.prod(shape) * numpy_dtype(dtype).itemsize >= _core.POOL_MIN_BYTES:
        return None
    return torch.empty(shape, dtype=dtype)


def written(y: torch.Tensor | None, compute: Callable[..., np.ndarray]) -> torch.Tensor:
    """``compute(out=...)`` into ``y``, or ``compute()``'s new array as a tensor."""
    if y is None:
        return as_tensor(compute())
    compute(out=as_array(y))
    return y
