"""``TokenPositionEmbedding``: the whole input layer (token + position) on the C kernels."""

from __future__ import annotations

from typing import Any, overload

import numpy as np

from . import _grad, _routes, _state
from . import _validation as v
from .embedding import LearnedPositionEmbedding, _Layer, draw_tables
from .layer import embed

_PICKLE_VERSION = 1

__all__ = ["TokenPositionEmbedding"]


def _part_property(part: str, name: str, doc: str, writable: bool = True) -> Any:
    """A property for attribute ``name`` of the table ``part`` (``_tokens`` or ``_positions``)."""

    def get(self: TokenPositionEmbedding) -> Any:
        return getattr(getattr(self, part), name)

    def set_(self: TokenPositionEmbedding, value: Any) -> None:
        setattr(getattr(self, part), name, value)

    return property(get, set_ if writable else None, doc=doc)


class TokenPositionEmbedding(_Layer):
    """Token and position embedding tables, looked up and added in one pass.

    GPT-2's input layer ``wte[token_ids] + wpe[positions]``: :meth:`__call__`
    is :func:`cposembed.embed`, :meth:`backward` :func:`cposembed.embed_backward`.

    Parameters
    ----------
    vocab_size : int
        Number of tokens ``V`` (rows of the token table).
    max_seq_len : int
        Number of positions ``L`` (rows of the position table).
    embed_dim : int
        Embedding dimension ``d`` of both tables.
    seed : int, optional
        Seed of the initial draw: one stream, the position table first, so it
        equals ``LearnedPositionEmbedding(L, d, seed, dtype=dtype).embeddings``.
    dtype : {float32, float64, float16, bfloat16}, default float32
        Dtype of both tables, as in :class:`LearnedPositionEmbedding`.
    padding_idx : int, optional
        A token id, as in ``torch.nn.Embedding``: its row starts at zero and
        never receives gradient.

    Examples
    --------
    >>> import numpy as np
    >>> from cposembed import TokenPositionEmbedding
    >>> m = TokenPositionEmbedding(100, 16, 8, seed=0)
    >>> ids = np.array([[5, 7, 7]])
    >>> x = m(ids)
    >>> x.shape
    (1, 3, 8)
    >>> bool(np.array_equal(x, m.token_embeddings[ids] + m.position_embeddings[:3]))
    True
    >>> _ = m.backward(np.ones_like(x), ids)
    >>> m.sgd_step(0.1)
    """

    _SAVE_KIND = "cposembed.TokenPositionEmbedding"
    _TABLE_NAMES = ("token_embeddings", "position_embeddings")
    _SIZES = ("vocab_size", "max_seq_len", "embed_dim")

    def __init__(
        self,
        vocab_size: int,
        max_seq_len: int,
        embed_dim: int,
        seed: Any = None,
        *,
        dtype: Any = np.float32,
        padding_idx: int | None = None,
    ) -> None:
        n_tokens = v.check_int(vocab_size, "vocab_size", min_value=1)
        n_rows = v.check_int(max_seq_len, "max_seq_len", min_value=1)
        d = v.check_int(embed_dim, "embed_dim", min_value=1)
        dt = v.table_dtype(dtype)
        positions, tokens = draw_tables(seed, d, n_rows, n_tokens)
        built = self.from_pretrained(tokens, positions, dtype=dt, padding_idx=padding_idx)
        if built.padding_idx is not None:
            built.token_embeddings[built.padding_idx] = 0
        self._set_tables(built._tokens, built._positions)

    def _set_tables(
        self, tokens: LearnedPositionEmbedding, positions: LearnedPositionEmbedding
    ) -> None:
        """Keep the two tables and their trainable_tables() entries."""
        self._tokens = tokens
        self._positions = positions
        self._tables = {
            "token_embeddings": tokens.trainable_tables()["embeddings"],
            "position_embeddings": positions.trainable_tables()["embeddings"],
        }

    @classmethod
    def from_pretrained(
        cls,
        token_table: Any,
        position_table: Any,
        *,
        dtype: Any = np.float32,
        padding_idx: int | None = None,
    ) -> TokenPositionEmbedding:
        """Build one around copies of existing tables (GPT-2's ``wte`` and ``wpe``).

        Parameters
        ----------
        token_table : array_like of shape (V, d)
        position_table : array_like of shape (L, d)
        dtype : {float32, float64, float16, bfloat16}, default float32
        padding_idx : int, optional
            As :meth:`LearnedPositionEmbedding.from_pretrained`'s ``table``,
            ``dtype`` and ``padding_idx`` (a token id).

        Returns
        -------
        TokenPositionEmbedding
        """
        tokens = LearnedPositionEmbedding.from_pretrained(
            token_table, dtype=dtype, padding_idx=padding_idx
        )
        positions = LearnedPositionEmbedding.from_pretrained(position_table, dtype=dtype)
        if tokens.embed_dim != positions.embed_dim:
            raise ValueError(
                f"token_table and position_table must share embed_dim; got "
                f"{tokens.embed_dim} and {positions.embed_dim}"
            )
        self = cls.__new__(cls)
        self._set_tables(tokens, positions)
        return self

    token_embeddings = _part_property("_tokens", "embeddings", "The live token table ``(V, d)``.")
    position_embeddings = _part_property(
        "_positions", "embeddings", "The live position table ``(L, d)``."
    )
    token_grad = _part_property("_tokens", "grad", "The token table's gradient, or None.")
    position_grad = _part_property("_positions", "grad", "The position table's gradient, or None.")
    padding_idx = _part_property(
        "_tokens",
        "padding_idx",
        "The token id that gets no gradient (normalised to ``[0, V)``), or None.",
        writable=False,
    )
    vocab_size = _part_property("_tokens", "max_seq_len", "Number of tokens ``V``.", False)
    max_seq_len = _part_property("_positions", "max_seq_len", "Number of positions ``L``.", False)
    embed_dim = _part_property("_tokens", "embed_dim", "Embedding dimension ``d``.", False)
    dtype = _part_property("_tokens", "dtype", "Dtype of both tables.", False)

    def __call__(
        self,
        token_ids: Any,
        positions: Any = None,
        *,
        offset: int = 0,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """``token_embeddings[token_ids] + position_embeddings[positions]``, in one pass.

        Parameters
        ----------
        token_ids : int, array_like of int
        positions : array_like of int, optional
        offset : int, default 0
        out : ndarray, optional
            As in :func:`cposembed.embed`.

        Returns
        -------
        ndarray
            See :func:`cposembed.embed`.
        """
        return embed(
            token_ids,
            self._tokens.embeddings,
            self._positions.embeddings,
            positions,
            offset=offset,
            out=out,
        )

    @overload
    def backward(
        self,
        grad_output: Any,
        token_ids: Any,
        positions: Any = None,
        *,
        offset: int = 0,
        optimizer: None = None,
    ) -> tuple[np.ndarray, np.ndarray]: ...

    @overload
    def backward(
        self,
        grad_output: Any,
        token_ids: Any,
        positions: Any = None,
        *,
        offset: int = 0,
        optimizer: _grad.FusedOptimizer,
    ) -> None: ...

    def backward(
        self,
        grad_output: Any,
        token_ids: Any,
        positions: Any = None,
        *,
        offset: int = 0,
        optimizer: _grad.FusedOptimizer | None = None,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Accumulate both tables' gradients of :meth:`__call__` from one read of ``grad_output``.

        As :meth:`LearnedPositionEmbedding.backward`, for both tables.

        Parameters
        ----------
        grad_output : array_like of shape token_ids.shape + (embed_dim,)
        token_ids : int, array_like of int
        positions : array_like of int, optional
        offset : int, default 0
            As in :func:`cposembed.embed_backward`.
        optimizer : SGD, Adam or AdamW, optional
            An optimizer of this layer whose step to fuse into this backward.

        Returns
        -------
        (ndarray, ndarray) or None
            :attr:`token_grad` and :attr:`position_grad`; ``None`` when fused.
        """
        if optimizer is not None:
            fused = _grad.fused_backward_of(optimizer)
            fused(self, grad_output, token_ids, positions, offset=offset)
            return None
        tokens, positions_of = self._tables.values()
        token_grad, token_touched = tokens.gradient.to_accumulate(tokens.table)
        position_grad, position_touched = positions_of.gradient.to_accumulate(positions_of.table)
        _routes.embed_backward(
            token_grad,
            position_grad,
            grad_output,
            token_ids,
            positions,
            offset=offset,
            num_threads=None,
            token_touched=token_touched,
            position_touched=position_touched,
            token_skip_row=tokens.gradient.skip_row,
        )
        tokens.gradient.keep(token_grad, token_touched)
        positions_of.gradient.keep(position_grad, position_touched)
        return token_grad, position_grad

    def __getstate__(self) -> dict[str, Any]:
        return {
            "version": _PICKLE_VERSION,
            "tokens": self._tokens.__getstate__(),
            "positions": self._positions.__getstate__(),
        }

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != {"version", "tokens", "positions"}:
            raise ValueError(
                "not a pickled TokenPositionEmbedding state (expected the keys "
                f"version, tokens, positions); got {v.describe(state)}"
            )
        _state.check_version(
            state["version"], _PICKLE_VERSION, "pickled TokenPositionEmbedding state"
        )
        tokens = LearnedPositionEmbedding.__new__(LearnedPositionEmbedding)
        tokens.__setstate__(state["tokens"])
        positions = LearnedPositionEmbedding.__new__(LearnedPositionEmbedding)
        positions.__setstate__(state["positions"])
        same = tokens.embed_dim == positions.embed_dim and tokens.dtype == positions.dtype
        if positions.padding_idx is not None or not same:
            raise ValueError(
                "pickled TokenPositionEmbedding state: the position table has a "
                "padding_idx, or another embed_dim or dtype than the token table"
            )
        self._set_tables(tokens, positions)
