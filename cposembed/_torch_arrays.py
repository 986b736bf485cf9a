"""Tensors as NumPy arrays, the checks of tensor arguments, and the memory of
gradients and outputs (docs/torch.md, "Gradient memory")."""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
from types import SimpleNamespace

import numpy as np
import torch

from cposembed import _blocks, _core
from cposembed._validation import FLOAT_NAMES

# Table dtypes the kernels take; other dtypes go to torch's own F.embedding.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# float16 with bfloat16: NumPy has no common type (cposembed refuses the pair),
# torch promotes both to float32.
HALF_PAIR = frozenset((torch.float16, torch.bfloat16))

# ---- tensors <-> arrays ----------------------------------------------------------


@functools.cache
def _typestr(dtype: torch.dtype) -> str:
    """NumPy's type string for a torch dtype (bfloat16: its int16 bits)."""
    if dtype == torch.bfloat16:
        dtype = torch.int16
    return torch.empty(0, dtype=dtype).numpy().dtype.str


def as_array(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as an ndarray, leaving it resizable (FSDP2 frees with resize_(0))."""
    t = t.detach().resolve_neg().resolve_conj()
    item = t.element_size()
    end = t.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    if t.numel() == 0:  # its data pointer may be null
        a = np.empty(tuple(t.shape), np.dtype(_typestr(t.dtype)))
    elif end * item > t.untyped_storage().nbytes():
        raise RuntimeError(
            f"a tensor of shape {tuple(t.shape)} is out of bounds of its storage of "
            f"{t.untyped_storage().nbytes()} bytes (resized, or freed as FSDP2 frees "
            "an unsharded parameter)"
        )
    else:
        interface = {
            "data": (t.data_ptr(), False),
            "shape": tuple(t.shape),
            "strides": tuple(s * item for s in t.stride()),
            "typestr": _typestr(t.dtype),
            "version": 3,
        }
        a = np.asarray(SimpleNamespace(__array_interface__=interface, tensor=t))
    return a.view(_core.bfloat16()) if t.dtype == torch.bfloat16 else a


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
    check_dtype(t.dtype, name)
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, embed_dim); got shape {tuple(t.shape)}")


def check_same_width(token_table: torch.Tensor, position_table: torch.Tensor) -> None:
    if token_table.shape[1] != position_table.shape[1]:
        raise ValueError(
            "token_table and position_table must share embed_dim; got "
            f"{token_table.shape[1]} and {position_table.shape[1]}"
        )


def is_integer(dtype: torch.dtype) -> bool:
    """An index dtype (not bool: masks would give shapes fake kernels cannot know)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_index(t: torch.Tensor | None, name: str) -> None:
    if t is not None and not is_integer(t.dtype):
        raise IndexError(f"{name} must be an integer tensor; got dtype {t.dtype}")


def checked_ids(t: torch.Tensor | None, n_rows: int) -> np.ndarray | None:
    """The ids as an array, each in ``[0, n_rows)`` (negatives too), as ``nn.Embedding``'s."""
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


def check_dtype(dtype: torch.dtype, name: str = "gradient") -> None:
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must have dtype {FLOAT_NAMES}; got {dtype}")


# ---- gradient and output memory ---------------------------------------------------

# Below this many bytes a gradient is torch.empty zeroed on the calling thread
# (torch.zeros fills on PyTorch's threads, which wait for cores on a busy machine).
FRESH_MIN_BYTES = 1 << 21


class _Held:
    """A storage handed out, held through a tensor of its own (never handed out)."""

    __slots__ = ("tensor", "ptr", "nbytes", "zeroed")

    def __init__(self, storage: torch.UntypedStorage, zeroed: bool) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.ptr = storage.data_ptr()
        self.nbytes = storage.nbytes()
        self.zeroed = zeroed

    def references(self) -> tuple[int, int]:
        """The storage's use count and its Python storage object's reference count."""
        s = self.tensor.untyped_storage()
        assert _USE_COUNT is not None
        return _USE_COUNT(s._cdata), sys.getrefcount(s)


# The storages handed out (live or free), newest last, at most _HELD_MAX. The
# calls only try the lock (a thread that finds it taken makes new memory).
_held: list[_Held] = []
_HELD_MAX = 2 * _blocks.KEEP_SLOTS
_held_lock = threading.Lock()
# The one private torch function the bridge uses; without it nothing is reused.
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _free_references() -> tuple[int, int] | None:
    """A free storage's references, or None if holding it elsewhere would not change them."""
    if _USE_COUNT is None:
        return None
    h = _Held(torch.UntypedStorage(64), False)
    free = h.references()
    t = torch.empty(0, dtype=torch.uint8).set_(h.tensor.untyped_storage())
    with_tensor = h.references()
    del t
    s = h.tensor.untyped_storage()
    with_storage = h.references()
    del s
    if h.references() != free or free in (with_tensor, with_storage):
        return None
    return free


def _forget_after_fork() -> None:
    global _held_lock
    _held_lock = threading.Lock()
    _held.clear()


def _release_held() -> None:
    """Forget every storage handed out (``_blocks.clear_pool`` and ``set_pool(False)``)."""
    with _held_lock:
        _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
_blocks.on_clear_pool(_release_held)


def _reusable(nbytes: int, zeroed: bool, room: int) -> _Held | None:
    """A free storage of ``nbytes`` for the same use; the others kept as ``_blocks`` keeps."""
    found = None
    free = []
    for h in list(_held):
        if h.references() != _FREE:
            continue
        if h.tensor.data_ptr() != h.ptr or h.tensor.untyped_storage().nbytes() != h.nbytes:
            # a user resized it
            _held.remove(h)
        elif found is None and h.nbytes == nbytes and h.zeroed == zeroed:
            found = h
        else:
            free.append(h)
    slots = _blocks.KEEP_SLOTS
    for h in sorted(free, key=lambda h: h.nbytes, reverse=True):
        if slots and h.nbytes <= room:
            slots, room = slots - 1, room - h.nbytes
        else:
            _held.remove(h)
    return found


def _storage(nbytes: int, zeroed: bool) -> torch.UntypedStorage:
    """A storage of ``nbytes`` nothing else refers to, zero if ``zeroed``; reused if free."""
    _, kept_bytes, limit, enabled = _blocks.pool_info()
    if not enabled or _FREE is None or not _held_lock.acquire(blocking=False):
        return _new_storage(nbytes, zeroed)
    try:
        found = _reusable(nbytes, zeroed, limit - kept_bytes)
        if found is None:
            s = _new_storage(nbytes, zeroed)
            _held.append(_Held(s, zeroed))
            del _held[: max(0, len(_held) - _HELD_MAX)]
            return s
        _held.remove(found)
        _held.append(found)
        if zeroed:
            _blocks.zero_memory(found.ptr, nbytes, False)
        return found.tensor.untyped_storage()
    finally:
        _held_lock.release()


def _new_storage(nbytes: int, zeroed: bool) -> torch.UntypedStorage:
    s = torch.UntypedStorage(nbytes)
    if zeroed:  # whole pages read as zero, and fault in only where written
        _blocks.zero_memory(s.data_ptr(), nbytes, True)
    else:  # an output, written whole: huge pages, as the allocator's dense blocks
        _blocks.advise_huge(s.data_ptr(), nbytes)
    return s


def new_tensor(shape: tuple[int, ...], dtype: torch.dtype, *, zeroed: bool) -> torch.Tensor:
    """A new C-order tensor, zero if ``zeroed``; large ones are storages kept here."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= (FRESH_MIN_BYTES if zeroed else _blocks.POOL_MIN_BYTES):
        return torch.empty(0, dtype=dtype).set_(_storage(nbytes, zeroed), 0, shape, ())
    t = torch.empty(shape, dtype=dtype)
    if zeroed and nbytes:
        _blocks.zero_memory(t.data_ptr(), nbytes, False)
    return t


_FREE = _free_references()
