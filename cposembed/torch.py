"""PyTorch bridge: ``torch.nn.Embedding`` on cposembed's kernels (docs/torch.md).

Importing it registers the operators ``torch.ops.cposembed.*``. What the kernels
do not take goes to torch's own ``F.embedding``, with the same results: tensors on
other devices or of other dtypes than float16, bfloat16, float32 and float64,
``scale_grad_by_freq=True``, ``sparse=True`` under ``torch.compile``, and calls
traced by ``torch.export`` or ``torch.jit.trace`` (their graphs hold torch's own
operators, for ONNX and runtimes without Python). ``torch.jit.script`` compiles
each module's ``torch.jit.is_scripting()`` branch.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

try:
    import torch
    from torch import nn
    from torch.nn import functional as F
except ImportError as exc:  # torch is the optional extra "torch"
    raise ImportError(
        "cposembed.torch needs PyTorch. Install its CPU build, then the extra from a "
        "checkout: pip install torch --index-url https://download.pytorch.org/whl/cpu && "
        'pip install ".[torch]"'
    ) from exc

from cposembed import _torch_arrays as _arrays
from cposembed import _torch_ops as _ops
from cposembed import _validation

__all__ = [
    "Embedding",
    "LearnedPositionEmbedding",
    "TokenPositionEmbedding",
    "convert_embeddings",
    "embedding",
]

# ---- indices and routes -------------------------------------------------------------


def _index(x: Any) -> torch.Tensor:
    """An index tensor: tensors as they are, anything else copied (for the backward)."""
    if isinstance(x, torch.Tensor):
        return x
    a = np.array(x)  # a copy
    if a.dtype.kind in "iu":
        a = a.astype(a.dtype.newbyteorder("="), copy=False)
    return torch.from_numpy(a)


def _on_kernels(table: torch.Tensor, *indices: torch.Tensor | None) -> bool:
    """Whether the kernels take this call (see the module docstring)."""
    tensors = (table, *(i for i in indices if i is not None))
    return (
        table.dtype in _arrays.KERNEL_DTYPES
        and table.dim() == 2
        and all(t.device.type == "cpu" and t.layout == torch.strided for t in tensors)
        and all(_arrays.is_integer(i.dtype) for i in tensors[1:])
        and not (_is_dtensor(table) or torch.jit.is_tracing() or torch.compiler.is_exporting())
    )


def _is_dtensor(t: torch.Tensor | None) -> bool:
    """A DTensor; the first one seen registers the operators' sharding rules."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None or not isinstance(t, dtensor.DTensor):
        return False
    from cposembed import _torch_sharding  # noqa: F401  (registers the rules once)

    return True


def _sharded_lookup(weight: torch.Tensor, idx: torch.Tensor) -> bool:
    """Whether a lookup of a DTensor weight not split along its rows runs on the kernels."""
    w: Any = weight
    if not _is_dtensor(w) or any(p.is_shard(0) for p in w.placements):
        return False
    i: Any = idx
    return _on_kernels(w.to_local(), i.to_local() if _is_dtensor(i) else i)


def _values(x: Any) -> torch.Tensor:
    """Token embeddings as a tensor (a native NumPy array's memory, ml_dtypes' bfloat16 too)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if not x.dtype.isnative:
            x = x.astype(x.dtype.newbyteorder("="))
        if _validation.is_bfloat16(x.dtype):  # through its int16 bits
            return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
    return torch.as_tensor(x)


def _check_offset(positions: torch.Tensor | None, offset: int) -> None:
    """An offset only with positions=None, on every path."""
    if positions is not None and offset != 0:
        raise ValueError(
            f"offset={offset} only applies with positions=None; "
            "add it to the explicit positions instead"
        )


@torch.jit.unused
def embedding(
    input: Any,
    weight: torch.Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.embedding`` on cposembed's kernels: ``weight[input]``.

    Same arguments, values and gradients as ``F.embedding``, which takes
    what the kernels do not (see the module docstring).
    """
    idx = _index(input)
    on_kernels = _on_kernels(weight, idx) or (
        _sharded_lookup(weight, idx) and max_norm is None and not sparse
    )
    on_kernels = on_kernels and not scale_grad_by_freq
    if padding_idx is not None and on_kernels:  # else F.embedding's own AssertionError
        on_kernels = -weight.shape[0] <= padding_idx < weight.shape[0]
    if not on_kernels or (sparse and torch.compiler.is_compiling()):
        return F.embedding(
            idx, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse
        )
    if max_norm is not None:  # rows rescaled in place; torch's renorm takes int32/int64 ids
        ids = idx
        if idx.dtype not in (torch.int32, torch.int64):
            _arrays.checked_ids(idx, weight.shape[0])
            ids = idx.to(torch.int64)
        with torch.no_grad():
            torch.embedding_renorm_(weight.detach(), ids.contiguous(), max_norm, norm_type)
    return _ops.lookup(weight, idx, padding_idx, sparse)


# ---- modules ------------------------------------------------------------------------


class Embedding(nn.Embedding):
    """``torch.nn.Embedding`` on cposembed's kernels.

    A subclass of ``torch.nn.Embedding`` with the same constructor,
    :meth:`from_pretrained`, attributes, ``weight`` parameter and state dict,
    whose values and gradients are bitwise ``nn.Embedding``'s.

    Parameters
    ----------
    num_embeddings, embedding_dim : int
        Shape of ``weight``.
    padding_idx : int, optional
        That row starts at zero and gets no gradient.
    max_norm : float, optional
        Looked-up rows whose ``norm_type``-norm exceeds it are rescaled in
        place to that norm.
    norm_type : float, default 2.0
    scale_grad_by_freq : bool, default False
        Each row's gradient divided by the row's count in the batch.
    sparse : bool, default False
        A sparse COO gradient, ``nn.Embedding``'s entry for entry.
    _weight : Tensor, optional
        Used as ``weight`` (no copy).
    _freeze : bool, default False
        ``weight`` without ``requires_grad``.
    device, dtype : optional
        Of ``weight``; default ``torch.get_default_dtype()``.

    See Also
    --------
    convert_embeddings : Turn every ``nn.Embedding`` of a model into this class.

    Examples
    --------
    >>> import torch
    >>> import cposembed.torch as ct
    >>> e = ct.Embedding(10, 3, padding_idx=0)
    >>> isinstance(e, torch.nn.Embedding)
    True
    >>> e  # nn.Embedding's repr, named as cposembed's
    cposembed.Embedding(10, 3, padding_idx=0)
    >>> ref = torch.nn.Embedding(10, 3, padding_idx=0)
    >>> ref.load_state_dict(e.state_dict())
    <All keys matched successfully>
    >>> ids = torch.tensor([[0, 4, 4]])
    >>> torch.equal(e(ids), ref(ids))
    True
    """

    def _get_name(self) -> str:  # the name print(model) shows
        return f"cposembed.{type(self).__name__}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``weight[input]``: shape ``input.shape + (embedding_dim,)``.

        Parameters
        ----------
        input : Tensor, array_like of int
            Indices into ``weight``. NumPy arrays and lists are copied.

        Returns
        -------
        Tensor
        """
        if torch.jit.is_scripting():  # what torch.jit.script compiles
            return F.embedding(
                input,
                self.weight,
                self.padding_idx,
                self.max_norm,
                self.norm_type,
                self.scale_grad_by_freq,
                self.sparse,
            )
        return embedding(
            input,
            self.weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )

    def _fusable(self, *indices: Any) -> bool:
        """Whether a fused kernel can look ``indices`` up: no renorm, a dense unscaled gradient."""
        as_is = self.max_norm is None and not (self.scale_grad_by_freq or self.sparse)
        return as_is and _on_kernels(self.weight, *indices)


def convert_embeddings(module: nn.Module) -> nn.Module:
    """Put every ``torch.nn.Embedding`` of ``module`` on cposembed's kernels, in place.

    Each module whose type is exactly ``nn.Embedding`` (``module`` itself
    included) becomes an :class:`Embedding`: the same object with the same
    ``weight`` ``Parameter``, so tied weights, optimizers and state dicts
    keep working. Subclasses of ``nn.Embedding`` are left as they are.

    Parameters
    ----------
    module : torch.nn.Module

    Returns
    -------
    torch.nn.Module
        ``module`` itself.

    Examples
    --------
    >>> import torch
    >>> import cposembed.torch as ct
    >>> model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
    >>> model[1].weight = model[0].weight  # tied, as in GPT-2
    >>> ct.convert_embeddings(model)[0]
    cposembed.Embedding(50, 8)
    >>> model[1].weight is model[0].weight
    True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
    for m in module.modules():
        if type(m) is nn.Embedding:
            m.__class__ = Embedding
    return module


def _shape(rows: Any, rows_name: str, embed_dim: Any, dtype: torch.dtype | None) -> tuple[int, int]:
    """A new table's shape, each a positive int, once its dtype is checked."""
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype; got {dtype}")
    check = _validation.check_int
    return check(rows, rows_name, min_value=1), check(embed_dim, "embed_dim", min_value=1)


class LearnedPositionEmbedding(Embedding):
    """A learned position table: an :class:`Embedding` with the handbook's names.

    A drop-in for ``nn.Embedding(max_seq_len, embed_dim)`` as a position table
    (GPT-2's ``wpe``), plus :meth:`add_to`, which adds the rows to token
    embeddings in one pass.

    Parameters
    ----------
    max_seq_len, embed_dim : int
        Shape of ``weight``.
    padding_idx, device, dtype : optional
        As in :class:`Embedding`.
    **kwargs
        ``max_norm``, ``norm_type``, ``scale_grad_by_freq``, ``sparse``,
        ``_weight``, ``_freeze``: as in :class:`Embedding`.

    Examples
    --------
    >>> import torch
    >>> import cposembed.torch as ct
    >>> pe = ct.LearnedPositionEmbedding(16, 4)
    >>> pe.load_state_dict(torch.nn.Embedding(16, 4).state_dict())
    <All keys matched successfully>
    >>> pe(torch.arange(3)).shape
    torch.Size([3, 4])
    >>> pe.add_to(torch.zeros(2, 3, 4), offset=5).shape
    torch.Size([2, 3, 4])
    """

    # Properties torch.jit.script would otherwise compile (eager only).
    __jit_unused_properties__ = ["max_seq_len", "embed_dim"]

    def __init__(
        self,
        max_seq_len: int,
        embed_dim: int,
        *,
        padding_idx: int | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            *_shape(max_seq_len, "max_seq_len", embed_dim, dtype),
            padding_idx=padding_idx,
            device=device,
            dtype=dtype,
            **kwargs,
        )

    @classmethod
    def from_pretrained(
        cls,
        embeddings: torch.Tensor,
        freeze: bool = True,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> LearnedPositionEmbedding:
        """A table around ``embeddings``, as ``nn.Embedding.from_pretrained``.

        Parameters
        ----------
        embeddings : Tensor of shape (max_seq_len, embed_dim)
            Used as ``weight`` (not copied).
        freeze : bool, default True
            ``weight`` without ``requires_grad``.
        padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse : optional
            As in :class:`Embedding`.

        Returns
        -------
        LearnedPositionEmbedding
        """
        if embeddings.dim() != 2:
            raise ValueError(
                f"embeddings must be 2-D (max_seq_len, embed_dim); got {tuple(embeddings.shape)}"
            )
        return cls(
            *embeddings.shape,
            padding_idx=padding_idx,
            max_norm=max_norm,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            sparse=sparse,
            _weight=embeddings,
            _freeze=freeze,
        )

    @property
    def max_seq_len(self) -> int:
        """Rows of the table (``num_embeddings``)."""
        return int(self.num_embeddings)

    @property
    def embed_dim(self) -> int:
        """Width of each row (``embedding_dim``)."""
        return int(self.embedding_dim)

    def add_to(self, tok: torch.Tensor, positions: Any = None, offset: int = 0) -> torch.Tensor:
        """``tok + weight[positions]`` in one pass.

        Parameters
        ----------
        tok : Tensor or array_like of shape (..., T, embed_dim)
            Token embeddings (a native NumPy array is used without a copy).
        positions : Tensor, array_like of int, optional
            Must broadcast to ``tok.shape[:-1]``; ``None`` means
            ``offset + arange(T)``.
        offset : int, default 0
            Tokens already seen (incremental decoding); only with ``positions=None``.

        Returns
        -------
        Tensor
            Of dtype ``torch.promote_types(tok.dtype, weight.dtype)``.
        """
        tok = _values(tok)
        pos = None if positions is None else _index(positions)
        _check_offset(pos, offset)
        if not (
            self._fusable(pos) and tok.dtype in _arrays.KERNEL_DTYPES and tok.device.type == "cpu"
        ):
            return tok + self(_ops.full_positions(pos, offset, tok.shape[:-1]).to(tok.device))
        return _ops.add_positions(tok, self.weight, pos, offset, self.padding_idx)


class TokenPositionEmbedding(nn.Module):
    """GPT-2's input layer ``wte[token_ids] + wpe[positions]`` as one torch module.

    Values and gradients equal two ``nn.Embedding`` modules added (the
    position gradient sums over every token), computed in one pass forward
    and one read of the gradient backward.

    Parameters
    ----------
    vocab_size, max_seq_len, embed_dim : int
        Shapes of ``tokens.weight`` ``(vocab_size, embed_dim)`` and
        ``positions.weight`` ``(max_seq_len, embed_dim)``.
    padding_idx : int, optional
        A token id whose row starts at zero and gets no gradient.
    device, dtype : optional
        Of both tables; default ``torch.get_default_dtype()``.

    Attributes
    ----------
    tokens : Embedding
        The token table (state dict key ``tokens.weight``; GPT-2's ``wte``).
    positions : LearnedPositionEmbedding
        The position table (``positions.weight``; GPT-2's ``wpe``).

    Examples
    --------
    >>> import torch
    >>> import cposembed.torch as ct
    >>> m = ct.TokenPositionEmbedding(100, 16, 8)
    >>> x = m(torch.tensor([[5, 7, 7]]))
    >>> torch.equal(x, m.tokens.weight[torch.tensor([[5, 7, 7]])] + m.positions.weight[:3])
    True
    """

    __jit_unused_properties__ = ["vocab_size", "max_seq_len", "embed_dim", "padding_idx"]

    def __init__(
        self,
        vocab_size: int,
        max_seq_len: int,
        embed_dim: int,
        *,
        padding_idx: int | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tokens = Embedding(
            *_shape(vocab_size, "vocab_size", embed_dim, dtype),
            padding_idx=padding_idx,
            device=device,
            dtype=dtype,
        )
        self.positions = LearnedPositionEmbedding(
            max_seq_len, embed_dim, device=device, dtype=dtype
        )

    @classmethod
    def from_pretrained(
        cls,
        token_table: torch.Tensor,
        position_table: torch.Tensor,
        *,
        freeze: bool = True,
        padding_idx: int | None = None,
    ) -> TokenPositionEmbedding:
        """A layer around two tables (used, not copied), as ``nn.Embedding.from_pretrained``.

        Parameters
        ----------
        token_table, position_table : Tensor
            Of shapes ``(vocab_size, embed_dim)`` and ``(max_seq_len, embed_dim)``.
        freeze : bool, default True
            Tables without ``requires_grad``.
        padding_idx : int, optional
            A token id whose row gets no gradient.

        Notes
        -----
        Each table becomes a new ``Parameter``: a weight tied to the original one
        (GPT-2's ``lm_head``) is not tied to it. :func:`convert_embeddings` keeps ties.
        """
        for name, t in (("token_table", token_table), ("position_table", position_table)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"{name} must be a 2-D tensor; got {t!r:.60}")
        _arrays.check_same_width(token_table, position_table)
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.tokens = Embedding.from_pretrained(token_table, freeze=freeze, padding_idx=padding_idx)
        m.positions = LearnedPositionEmbedding.from_pretrained(position_table, freeze=freeze)
        return m

    @property
    def vocab_size(self) -> int:
        """Rows of the token table."""
        return int(self.tokens.num_embeddings)

    @property
    def max_seq_len(self) -> int:
        """Rows of the position table."""
        return self.positions.max_seq_len

    @property
    def embed_dim(self) -> int:
        """Width of each row of both tables."""
        return int(self.tokens.embedding_dim)

    @property
    def padding_idx(self) -> int | None:
        """The token id whose row gets no gradient, or ``None``."""
        return self.tokens.padding_idx

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor | None = None, offset: int = 0
    ) -> torch.Tensor:
        """``tokens.weight[token_ids] + positions.weight[positions]``.

        Parameters
        ----------
        token_ids : Tensor, array_like of int
            Shape ``(..., T)``. NumPy arrays and lists are copied.
        positions, offset : optional
            As in :meth:`LearnedPositionEmbedding.add_to`, for ``token_ids.shape``.

        Returns
        -------
        Tensor
            Shape ``token_ids.shape + (embed_dim,)``.
        """
        _check_offset(positions, offset)
        if torch.jit.is_scripting():  # what torch.jit.script compiles
            return self._unfused(token_ids, positions, offset)
        return self._eager(token_ids, positions, offset)

    def _unfused(
        self, token_ids: torch.Tensor, positions: torch.Tensor | None, offset: int
    ) -> torch.Tensor:
        if positions is None:
            if token_ids.dim() == 0:
                raise ValueError(  # _routes.id_positions' words, in TorchScript too
                    "token_ids must have shape (..., T) when positions is None; got a single "
                    "id (pass positions=, e.g. the token's position)"
                )
            T = token_ids.shape[-1]
            positions = torch.arange(offset, offset + T, device=token_ids.device)
        return self.tokens(token_ids) + self.positions(positions.expand(token_ids.shape))

    @torch.jit.unused
    def _eager(self, token_ids: Any, positions: Any, offset: int) -> torch.Tensor:
        ids = _index(token_ids)
        pos = None if positions is None else _index(positions)
        if not (self.tokens._fusable(ids, pos) and self.positions._fusable()):
            return self._unfused(ids, pos, offset)
        return _ops.embed(
            ids, self.tokens.weight, self.positions.weight, pos, offset, self.padding_idx
        )
