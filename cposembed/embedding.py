"""The drop-in ``LearnedPositionEmbedding``: the handbook's class on C kernels."""

from __future__ import annotations

import copyreg
import sys
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, overload

import numpy as np

from . import _core, _grad, _routes, _state
from . import _validation as v
from ._state import PathOrFile
from .functional import add_positions

# Versions of the .npz layout save() writes and of the pickled state; newer ones are refused.
SAVE_FORMAT_VERSION = 1
_PICKLE_VERSION = 1

__all__ = ["LearnedPositionEmbedding"]

_L = TypeVar("_L", bound="_Layer")


def _values_of(table: Any) -> np.ndarray:
    """An array-like as an ndarray; a tensor that requires grad is detached (on
    the CPU, without importing torch), a torch bfloat16 one viewed as ml_dtypes'."""
    if not isinstance(table, np.ndarray) and callable(getattr(table, "detach", None)):
        table = table.detach()
        if callable(getattr(table, "cpu", None)):
            table = table.cpu()
        torch = sys.modules.get("torch")
        if torch is not None and getattr(table, "dtype", None) is torch.bfloat16:
            return table.contiguous().view(torch.int16).numpy().view(v.bfloat16())
    return np.asarray(table)


def draw_tables(seed: Any, embed_dim: int, *n_rows: int) -> list[np.ndarray]:
    """The reference's float64 tables ``randn(n, d) / sqrt(d)``, each ``n`` of ``n_rows``
    in turn, from ``RandomState(seed)`` (``None``: the global legacy RNG)."""
    rng = np.random if seed is None else np.random.RandomState(seed)
    scale = 1.0 / np.sqrt(embed_dim)
    return [rng.randn(n, embed_dim) * scale for n in n_rows]


class _CallSignature:
    """An instance's ``__signature__``: its class's ``__call__`` without ``self``."""

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        if obj is None:
            return None
        import inspect  # only when asked: inspect takes milliseconds to import

        sig = inspect.signature(type(obj).__call__)
        return sig.replace(parameters=list(sig.parameters.values())[1:])


class _Layer:
    """What both layers share: gradients, SGD, saving and repr over ``_tables``."""

    __slots__ = ()
    _tables: dict[str, _grad.Trainable]
    padding_idx: int | None
    from_pretrained: ClassVar[Callable[..., Any]]
    #: The ``kind`` and tables :meth:`save` writes, and the sizes :meth:`__repr__` shows.
    _SAVE_KIND: ClassVar[str]
    _TABLE_NAMES: ClassVar[tuple[str, ...]]
    _SIZES: ClassVar[tuple[str, ...]]

    def zero_grad(self) -> None:
        """Reset the accumulated gradients to zeros (keeping their buffers)."""
        for t in self._tables.values():
            t.gradient.zero()

    def trainable_tables(self) -> dict[str, _grad.Trainable]:
        """The tables an optimizer updates, by name, with their gradient state."""
        return dict(self._tables)

    def sgd_step(self, lr: float) -> None:
        """One SGD step (no momentum), ``table -= lr * grad``, on each table's touched rows.

        Bitwise NumPy's ``pe.embeddings -= float(lr) * pe.grad``; a float16 or
        bfloat16 table computes in float32 and rounds once. Only rows touched
        since :meth:`zero_grad` are visited (all rows for an assigned
        gradient); a table whose gradient is ``None`` does not move. The
        gradients are not reset.

        Parameters
        ----------
        lr : float
            Learning rate: any finite real number (negative values ascend).

        Raises
        ------
        TypeError
            ``lr`` is not a real number, or a gradient is not a numeric array.
        ValueError
            ``lr`` is NaN or infinite, or a gradient has the wrong shape.
            Every gradient is checked before any table moves.
        """
        step = v.learning_rate(lr)
        work = [(t.table, t.gradient, t.gradient.for_step(t.table)) for t in self._tables.values()]
        for table, state, grad in work:
            if grad is not None:
                _grad.sgd_step(table, state, grad, step)

    def save(self, path: PathOrFile) -> None:
        """Write the tables and their settings to ``path`` as an ``.npz`` archive.

        The tables bitwise, their dtype, ``padding_idx`` and a format version;
        not the gradients (pickle keeps them).

        Parameters
        ----------
        path : str, path-like or binary file
            Exactly this file name (no suffix added), written atomically, or
            an open binary file.
        """
        tables = {name: t.table for name, t in self._tables.items()}
        _state.save_npz(path, self._SAVE_KIND, SAVE_FORMAT_VERSION, tables, self.padding_idx)

    @classmethod
    def load(cls: type[_L], path: PathOrFile) -> _L:
        """Read back what :meth:`save` wrote.

        Parameters
        ----------
        path : str, path-like or binary file
            Exactly this file name, or an open binary file.

        Returns
        -------
        LearnedPositionEmbedding or TokenPositionEmbedding
            Of the class ``load`` is called on.

        Raises
        ------
        ValueError
            The file is not one :meth:`save` wrote, or is damaged or truncated.
        FileNotFoundError
            No file at ``path``.
        """
        tables, pad, name = _state.load_npz(
            path, cls._SAVE_KIND, SAVE_FORMAT_VERSION, cls._TABLE_NAMES
        )
        if len({t.shape[1] for t in tables}) != 1:
            raise ValueError(f"{name}: the tables differ in embed_dim")
        layer: _L = cls.from_pretrained(*tables, dtype=tables[0].dtype, padding_idx=pad)
        return layer

    def __repr__(self) -> str:
        args = [f"{name}={getattr(self, name)}" for name in (*self._SIZES, "dtype")]
        if self.padding_idx is not None:
            args.append(f"padding_idx={self.padding_idx}")
        return f"{type(self).__name__}({', '.join(args)})"


class LearnedPositionEmbedding(_core.TableCall, _Layer):
    """Learned position embedding table with C-accelerated lookup, add and backward.

    A drop-in for the handbook's NumPy class (:mod:`cposembed.reference`):
    same constructor, same table for the same ``seed`` (the reference's
    float64 table ``.astype(dtype)``), same ``pe(positions)`` results.

    Parameters
    ----------
    max_seq_len : int
        Number of positions ``L`` (rows of the table).
    embed_dim : int
        Embedding dimension ``d``.
    seed : int, optional
        Seed for the initial table; ``None`` uses NumPy's global legacy RNG.
    dtype : {float32, float64, float16, bfloat16}, default float32
        Table dtype, or its name (``"bfloat16"``). float16 and bfloat16
        tables keep a float32 :attr:`grad`.
    padding_idx : int, optional
        As in ``torch.nn.Embedding``: that row starts at zero and never
        receives gradient. Negative values count from the end.

    Examples
    --------
    A bfloat16 table (NumPy's bfloat16 comes from ``ml_dtypes``):

    >>> import numpy as np
    >>> from cposembed import LearnedPositionEmbedding
    >>> pe = LearnedPositionEmbedding(16, 8, seed=0, dtype="bfloat16")
    >>> pe.embeddings.dtype, pe([0, 3]).dtype
    (dtype(bfloat16), dtype(bfloat16))
    >>> pe.backward(np.ones((2, 8), dtype=np.float32), [0, 3]).dtype
    dtype('float32')
    >>> pe.sgd_step(0.1)
    """

    # Slots read faster than an instance __dict__ on a class with a C base.
    __slots__ = ("_embeddings", "_grad", "_tables", "__dict__", "__weakref__")
    __signature__ = _CallSignature()
    _SAVE_KIND = "cposembed.LearnedPositionEmbedding"
    _TABLE_NAMES = ("embeddings",)
    _SIZES = ("max_seq_len", "embed_dim")

    def __init__(
        self,
        max_seq_len: int,
        embed_dim: int,
        seed: Any = None,
        *,
        dtype: Any = np.float32,
        padding_idx: int | None = None,
    ) -> None:
        n_rows = v.check_int(max_seq_len, "max_seq_len", min_value=1)
        d = v.check_int(embed_dim, "embed_dim", min_value=1)
        dt = v.table_dtype(dtype)
        pad = v.padding_index(padding_idx, n_rows)
        self._embeddings = np.ascontiguousarray(draw_tables(seed, d, n_rows)[0], dtype=dt)
        if pad is not None:
            self._embeddings[pad] = 0
        self._init_state(pad)

    def _init_state(self, padding_idx: int | None) -> None:
        self._grad = _grad.GradientState(-1 if padding_idx is None else padding_idx)
        self._tables = {"embeddings": _grad.Trainable(self, self._grad)}

    @classmethod
    def from_pretrained(
        cls, table: Any, *, dtype: Any = np.float32, padding_idx: int | None = None
    ) -> LearnedPositionEmbedding:
        """Build one around a copy of an existing ``(L, d)`` table (e.g. GPT-2's ``wpe``).

        Parameters
        ----------
        table : array_like of shape (L, d)
            Any array-like of real numbers, a torch tensor that requires grad
            included (its values are copied).
        dtype : {float32, float64, float16, bfloat16}, default float32
            Dtype of the new table, converted as by NumPy's ``astype``.
        padding_idx : int, optional
            As in ``torch.nn.Embedding.from_pretrained``: that row keeps its
            value and never receives gradient.

        Returns
        -------
        LearnedPositionEmbedding
        """
        dt = v.table_dtype(dtype)
        v.refuse_masked(table, "table")
        arr = _values_of(table)
        if not v.is_real(arr.dtype):
            raise TypeError(f"table must hold real numbers; got dtype {arr.dtype}")
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
            raise ValueError(
                f"table must be 2-D (max_seq_len, embed_dim) with both sizes >= 1; "
                f"got shape {arr.shape}"
            )
        pad = v.padding_index(padding_idx, arr.shape[0])
        self = cls.__new__(cls)
        self._embeddings = np.array(arr, dtype=dt, order="C", copy=True)
        self._init_state(pad)
        return self

    @property
    def embeddings(self) -> np.ndarray:
        """The live table ``(L, d)``, C-contiguous and writable; assigning copies in."""
        return self._embeddings

    @embeddings.setter
    def embeddings(self, value: Any) -> None:
        arr = np.asarray(value)
        if not v.is_real(arr.dtype):
            raise TypeError(f"embeddings must hold real numbers; got dtype {arr.dtype}")
        if arr.shape != self._embeddings.shape:
            raise ValueError(
                f"embeddings must have shape {self._embeddings.shape}; got {arr.shape} "
                "(use from_pretrained for a table of another size)"
            )
        self._embeddings = np.array(arr, dtype=self.dtype, order="C", copy=True)

    @property
    def grad(self) -> np.ndarray | None:
        """Accumulated gradient (float32 for a half table), ``None`` before :meth:`backward`.

        An assigned array counts as touching every row.
        """
        return self._grad.grad

    @grad.setter
    def grad(self, value: np.ndarray | None) -> None:
        self._grad.grad = value

    @property
    def padding_idx(self) -> int | None:
        """The row that gets no gradient (normalised to ``[0, L)``), or None."""
        return self._grad.padding_idx

    @padding_idx.setter
    def padding_idx(self, value: int | None) -> None:
        # As in torch, the row is not zeroed.
        self._grad.set_padding(v.padding_index(value, self.max_seq_len), self._embeddings)

    @property
    def max_seq_len(self) -> int:
        """Number of positions ``L``: the rows of the table."""
        return int(self._embeddings.shape[0])

    @property
    def embed_dim(self) -> int:
        """Embedding dimension ``d``: the columns of the table."""
        return int(self._embeddings.shape[1])

    @property
    def dtype(self) -> np.dtype:
        """The table's dtype: the constructor's ``dtype`` (``float32`` by default)."""
        return self._embeddings.dtype

    # pe(positions) is TableCall.__call__; this takes what its entry refused.
    def _lookup_normalised(self, positions: Any, out: np.ndarray | None) -> np.ndarray:
        return _routes.lookup(self._embeddings, positions, out=out, num_threads=None)

    def add_to(
        self,
        token_embeddings: Any,
        positions: Any = None,
        *,
        offset: int = 0,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """``token_embeddings + embeddings[positions]``, fused.

        Parameters
        ----------
        token_embeddings : array_like of shape (..., T, embed_dim)
        positions : array_like of int, optional
        offset : int, default 0
        out : ndarray, optional
            As ``tokens``, ``positions``, ``offset`` and ``out`` of
            :func:`cposembed.add_positions`.

        Returns
        -------
        ndarray
            See :func:`cposembed.add_positions`.
        """
        return add_positions(token_embeddings, self._embeddings, positions, offset=offset, out=out)

    @overload
    def backward(
        self, grad_output: Any, positions: Any = None, *, offset: int = 0, optimizer: None = None
    ) -> np.ndarray: ...

    @overload
    def backward(
        self,
        grad_output: Any,
        positions: Any = None,
        *,
        offset: int = 0,
        optimizer: _grad.FusedOptimizer,
    ) -> None: ...

    def backward(
        self,
        grad_output: Any,
        positions: Any = None,
        *,
        offset: int = 0,
        optimizer: _grad.FusedOptimizer | None = None,
    ) -> np.ndarray | None:
        """Accumulate the table gradient of :meth:`add_to` / ``__call__`` into :attr:`grad`.

        As :func:`cposembed.scatter_add`; the ``padding_idx`` row gets none.
        With ``optimizer``, :attr:`grad` is not touched: the step runs on this
        call's rows, bitwise as ``zero_grad(); backward(...); optimizer.step()``.

        Parameters
        ----------
        grad_output : array_like of shape (..., embed_dim)
            Gradient of the output (dtypes as :func:`cposembed.scatter_add`).
        positions : array_like of int, optional
            The positions of the forward call.
        offset : int, default 0
            Only with ``positions=None``.
        optimizer : SGD, Adam or AdamW, optional
            An optimizer of this layer whose step to fuse into this backward.

        Returns
        -------
        ndarray or None
            :attr:`grad`; ``None`` when fused with an optimizer.

        Raises
        ------
        TypeError, ValueError
            An assigned :attr:`grad` that is not a writable float array of the
            table's shape, an optimizer of another layer, or bad arguments;
            nothing is written then.
        """
        if optimizer is not None:
            _grad.fused_backward_of(optimizer)(self, grad_output, positions, offset=offset)
            return None
        return self._grad.accumulate(self._embeddings, grad_output, positions, offset)

    # One table: the shared methods without their loops (a tiny step's time).
    def zero_grad(self) -> None:
        self._grad.zero()

    def sgd_step(self, lr: float) -> None:
        step = v.learning_rate(lr)
        grad = self._grad.for_step(self._embeddings)
        if grad is not None:
            _grad.sgd_step(self._embeddings, self._grad, grad, step)

    zero_grad.__doc__ = _Layer.zero_grad.__doc__
    sgd_step.__doc__ = _Layer.sgd_step.__doc__

    def resized(self, new_max_len: int, method: str = "linear") -> LearnedPositionEmbedding:
        """A new instance whose table has ``new_max_len`` rows (for longer or shorter contexts).

        Parameters
        ----------
        new_max_len : int
            Rows of the new table.
        method : {"linear", "repeat"}
            ``"linear"``: new row ``i`` is the old table interpolated at
            ``i * (L - 1) / (new_max_len - 1)``; ``"repeat"``: old row ``i % L``.

        Returns
        -------
        LearnedPositionEmbedding
            Same dtype and ``padding_idx`` (its row copied); no gradient.

        Raises
        ------
        ValueError
            ``new_max_len`` not a positive integer, an unknown ``method``, or a
            ``padding_idx`` that does not fit in the new length.
        """
        new_len = v.check_int(new_max_len, "new_max_len", min_value=1)
        if method not in ("linear", "repeat"):
            raise ValueError(f'method must be "linear" or "repeat"; got {v.describe(method)}')
        pad = self.padding_idx
        if pad is not None and pad >= new_len:
            raise ValueError(
                f"padding_idx {pad} does not fit in new_max_len {new_len}; "
                "build the new table with from_pretrained and another padding_idx"
            )
        old = self._embeddings
        n_old = old.shape[0]
        if method == "repeat":
            table = old[np.arange(new_len) % n_old]
        else:
            table = _interpolate_rows(old, new_len)
        if pad is not None:
            table[pad] = old[pad]
        return type(self).from_pretrained(table, dtype=self.dtype, padding_idx=pad)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "version": _PICKLE_VERSION,
            "embeddings": self._embeddings,
            "grad": self._grad.grad,
            "touched": self._grad.kept_touched(),
            "padding_idx": self.padding_idx,
        }

    def __reduce__(self) -> tuple[Any, ...]:
        # Protocol 2's default for every protocol (0 and 1 cannot rebuild a C-based class).
        newobj = copyreg.__newobj__  # type: ignore[attr-defined]
        return (newobj, (type(self),), self.__getstate__())

    def __setstate__(self, state: dict[str, Any]) -> None:
        checked = _state.from_pickle(state, _PICKLE_VERSION)
        self._embeddings = checked.embeddings
        self._init_state(checked.padding_idx)
        self._grad.restore(checked.grad, checked.touched)


def _interpolate_rows(old: np.ndarray, new_len: int) -> np.ndarray:
    """The rows of ``old`` interpolated in float64 at ``i * (L - 1) / (new_len - 1)``;
    a point on an old row copies it bitwise."""
    n_old = old.shape[0]
    if n_old == 1 or new_len == 1:
        return old[np.zeros(new_len, dtype=np.intp)]
    # Integer numerator, one division: exact at both ends.
    x = np.arange(new_len, dtype=np.int64) * (n_old - 1) / (new_len - 1)
    lo = np.minimum(np.floor(x).astype(np.intp), n_old - 2)
    w = (x - lo)[:, None]
    a = old[lo].astype(np.float64)
    b = old[lo + 1].astype(np.float64)
    table = ((1.0 - w) * a + w * b).astype(old.dtype)
    on_row = x == np.floor(x)
    table[on_row] = old[x[on_row].astype(np.intp)]
    return table
