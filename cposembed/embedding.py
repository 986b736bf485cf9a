"""The drop-in ``LearnedPositionEmbedding``: the handbook's class on C kernels."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from . import _validation as v
from .functional import SMALL_TAKE_ELEMENTS as _SMALL_TAKE_ELEMENTS
from .functional import add_positions, lookup, scatter_add, small_take

# Token arrays up to this many elements are added by NumPy directly when
# positions=None (a decode step): the full path's fixed costs would dominate.
_SMALL_ADD_ELEMENTS = 1 << 14
_ndarray = np.ndarray

__all__ = ["LearnedPositionEmbedding"]


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be a positive integer; got {v.describe(value)}")
    n = operator.index(value)
    if n < 1:
        raise ValueError(f"{name} must be a positive integer; got {n}")
    return n


def _table_dtype(dtype: Any) -> np.dtype:
    if dtype is None:
        return np.dtype(np.float32)  # None means the default, as in NumPy
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    # (`dt is None` first: NumPy compares None equal to float64.)
    if dt is None or dt not in v.FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32 or float64; got {dtype!r}")
    return dt


def draw_table(max_seq_len: int, embed_dim: int, seed: Any = None) -> np.ndarray:
    """The reference's float64 initial table: ``randn(L, d) * (1 / sqrt(d))``.

    An integer ``seed`` draws from a private ``RandomState(seed)``, which yields
    the stream ``np.random.seed(seed)`` would, without touching the global RNG;
    ``seed=None`` draws from the global legacy RNG exactly as the reference does.
    """
    rng = np.random if seed is None else np.random.RandomState(seed)
    return rng.randn(max_seq_len, embed_dim) * (1.0 / np.sqrt(embed_dim))


class LearnedPositionEmbedding:
    """Learned position embedding table with C-accelerated lookup, add and backward.

    A drop-in for the handbook's NumPy class (:mod:`cposembed.reference`):
    same constructor, same table for the same ``seed`` (cast to ``dtype``),
    same ``pe(positions)`` results.

    Parameters
    ----------
    max_seq_len : int
        Number of positions ``L`` (rows of the table).
    embed_dim : int
        Embedding dimension ``d``.
    seed : int, optional
        Seed for the initial table; ``None`` uses NumPy's global legacy RNG.
    dtype : {numpy.float32, numpy.float64}, default float32
        Table dtype. float32 is the fast path; float64 is bitwise the reference.

    Attributes
    ----------
    embeddings : ndarray of shape (max_seq_len, embed_dim)
        The live table (C-contiguous, writable).
    grad : ndarray or None
        Accumulated gradient, ``None`` until the first :meth:`backward`.
    """

    def __init__(
        self, max_seq_len: int, embed_dim: int, seed: Any = None, *, dtype: Any = np.float32
    ) -> None:
        n_rows = _positive_int(max_seq_len, "max_seq_len")
        d = _positive_int(embed_dim, "embed_dim")
        dt = _table_dtype(dtype)
        self._embeddings = np.ascontiguousarray(draw_table(n_rows, d, seed), dtype=dt)
        self.grad: np.ndarray | None = None

    @classmethod
    def from_pretrained(cls, table: Any, *, dtype: Any = np.float32) -> LearnedPositionEmbedding:
        """Build one around a copy of an existing ``(L, d)`` table (e.g. GPT-2's ``wpe``)."""
        dt = _table_dtype(dtype)
        arr = np.asarray(table)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"table must hold real numbers; got dtype {arr.dtype}")
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
            raise ValueError(
                f"table must be 2-D (max_seq_len, embed_dim) with both sizes >= 1; "
                f"got shape {arr.shape}"
            )
        self = cls.__new__(cls)
        self._embeddings = np.array(arr, dtype=dt, order="C", copy=True)
        self.grad = None
        return self

    # -- the table ---------------------------------------------------------
    @property
    def embeddings(self) -> np.ndarray:
        return self._embeddings

    @embeddings.setter
    def embeddings(self, value: Any) -> None:
        arr = np.asarray(value)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"embeddings must hold real numbers; got dtype {arr.dtype}")
        if arr.shape != self._embeddings.shape:
            raise ValueError(
                f"embeddings must have shape {self._embeddings.shape}; got {arr.shape} "
                "(use from_pretrained for a table of another size)"
            )
        self._embeddings = np.array(arr, dtype=self.dtype, order="C", copy=True)

    @property
    def max_seq_len(self) -> int:
        return int(self._embeddings.shape[0])

    @property
    def embed_dim(self) -> int:
        return int(self._embeddings.shape[1])

    @property
    def dtype(self) -> np.dtype:
        return self._embeddings.dtype

    # -- forward -----------------------------------------------------------
    def __call__(self, positions: Any, *, out: np.ndarray | None = None) -> np.ndarray:
        """Look up position embeddings: ``embeddings[positions]`` (a new array, or ``out``)."""
        table = self._embeddings
        if out is None:
            # Tiny calls: NumPy directly; anything unusual or invalid (whose
            # error message is ours) takes the full path below.
            kind = type(positions)
            if kind is int:
                try:
                    return table[positions].copy()
                except IndexError:
                    pass
            elif kind is _ndarray:
                if (
                    positions.dtype.kind == "i"
                    and positions.size * table.shape[1] <= _SMALL_TAKE_ELEMENTS
                ):
                    try:
                        return table.take(positions, 0)
                    except IndexError:
                        pass
            else:
                result = small_take(table, positions)
                if result is not None:
                    return result
        return lookup(table, positions, out=out)

    def add_to(
        self,
        token_embeddings: Any,
        positions: Any = None,
        *,
        offset: int = 0,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """``token_embeddings + embeddings[positions]``, fused.

        ``positions=None`` means ``offset + arange(T)`` for each sequence of
        ``token_embeddings`` (shape ``(..., T, d)``). ``out`` may be
        ``token_embeddings`` itself. See :func:`cposembed.add_positions`.
        """
        tok = token_embeddings
        if positions is None and out is None and type(tok) is _ndarray and type(offset) is int:
            # A decode step: NumPy's own broadcast add of the rows in use
            # (the fixed costs of the full path would dominate).
            table = self._embeddings
            shape = tok.shape
            if (
                len(shape) >= 2
                and shape[-1] == table.shape[1]
                and 0 <= offset
                and offset + shape[-2] <= table.shape[0]
                and tok.size <= _SMALL_ADD_ELEMENTS
                and (tok.dtype is table.dtype or tok.dtype.kind == "f")
            ):
                if shape[-2] == 1:
                    return tok + table[offset]
                return tok + table[offset : offset + shape[-2]]
        return add_positions(token_embeddings, self._embeddings, positions, offset=offset, out=out)

    # -- backward ----------------------------------------------------------
    def backward(self, grad_output: Any, positions: Any = None, *, offset: int = 0) -> np.ndarray:
        """Accumulate the table gradient of :meth:`add_to` / ``__call__`` into :attr:`grad`.

        ``grad[positions[i]] += grad_output[i]`` for every ``i``; deterministic
        (bitwise the same for any thread count). Returns :attr:`grad`.
        """
        # A fresh gradient is only kept once the call has succeeded, so an
        # invalid first call leaves ``grad`` as None.
        grad = self.grad if self.grad is not None else np.zeros_like(self._embeddings)
        scatter_add(grad, grad_output, positions, offset=offset)
        self.grad = grad
        return grad

    def zero_grad(self) -> None:
        """Reset the accumulated gradient to zeros (keeping its buffer)."""
        if self.grad is not None:
            self.grad.fill(0)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_seq_len={self.max_seq_len}, "
            f"embed_dim={self.embed_dim}, dtype={self.dtype.name})"
        )
