"""Lazy optimizers for the embedding tables: SGD, Adam and AdamW on the touched rows.

Each optimizer holds one layer (a :class:`~cposembed.LearnedPositionEmbedding`
or a :class:`~cposembed.TokenPositionEmbedding`, both its tables) and updates,
per step, only the rows that got gradient: after ``layer.backward(...)`` the
rows it touched since the last ``zero_grad()``, in a fused
``layer.backward(..., optimizer=opt)`` the rows of that call. Each such row
follows PyTorch's update rule for that optimizer; the other rows and their
state stay as they are (the semantics of ``torch.optim.SparseAdam``).

The state of a table is one array per buffer with the table's shape, as
PyTorch keeps it, allocated zeroed when the optimizer is made (its pages
cost memory only where rows got gradient), and the marks of the rows that
have state (:class:`~cposembed._core.RowMarks`). The update of a row is one
C function (``_core.optimizer_step``) that both ``step()`` and the fused
backward call, so a step costs its touched rows, never the table's rows.

A fused backward finds the call's distinct rows (``_core.distinct_rows``, in
time proportional to the positions), sums the gradient into one scratch row
each (with the same scatter-add kernel and so the same summation order as
``layer.backward``) and hands them to the same update: fused and unfused give
the same bits by construction.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from . import _core, _routes
from . import _validation as v

if TYPE_CHECKING:
    from .embedding import LearnedPositionEmbedding

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "state_dtype"]

# Version of what state_dict() returns and pickle stores.
_STATE_VERSION = 1


def state_dtype(table_dtype: np.dtype) -> np.dtype:
    """The dtype of an optimizer's state (and of its arithmetic) for a table dtype.

    float64 tables keep float64 state; every other table dtype (float32,
    float16, bfloat16) keeps float32, the dtype of its gradient.

    Parameters
    ----------
    table_dtype : numpy.dtype
        The dtype of the table.

    Returns
    -------
    numpy.dtype
        ``float64`` for a float64 table, else ``float32``.
    """
    return v.work_dtype(table_dtype)


# -- hyper-parameter checks, worded as torch.optim words them -------------------
def _real(value: Any, name: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not v.is_real_scalar(value):
        raise TypeError(f"{name} must be a real number; got {v.describe(value)}")
    return float(value)


def _at_least_zero(value: Any, name: str, message: str) -> float:
    x = _real(value, name)
    if not (math.isfinite(x) and x >= 0.0):
        raise ValueError(f"{message}: {value}")
    return x


def _betas(betas: Any) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2); got {v.describe(betas)}")
    out = []
    for i, beta in enumerate(betas):
        b = _real(beta, f"betas[{i}]")
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        out.append(b)
    return out[0], out[1]


class _RowState:
    """The state of one table: a zeroed ``(L, d)`` array per buffer (``buffers``)
    and the rows that have state (``has``, marked at their first step)."""

    def __init__(self, names: tuple[str, ...], shape: tuple[int, int], dtype: np.dtype) -> None:
        self.names = names
        self.dtype = dtype
        self.buffers = {name: _core.zeros(shape, dtype) for name in names}
        # Plain SGD keeps no state: no rows have any.
        self.has = _core.RowMarks(shape[0] if names else 0)

    def export(self) -> dict[str, np.ndarray]:
        """Copies of the state in row order: ``rows`` and one ``(n, d)`` array per buffer."""
        rows = np.sort(self.has.rows())
        out = {"rows": rows}
        for name, buf in self.buffers.items():
            out[name] = buf[rows]
        return out

    @classmethod
    def restore(
        cls,
        names: tuple[str, ...],
        shape: tuple[int, int],
        dtype: np.dtype,
        data: dict[str, np.ndarray],
    ) -> _RowState:
        state = cls(names, shape, dtype)
        rows = data["rows"]
        if names:
            for name in names:
                state.buffers[name][rows] = data[name]
            mask = np.zeros(shape[0], dtype=bool)
            mask[rows] = True
            state.has = _core.RowMarks(shape[0], mask)
        return state


class Optimizer:
    """Base of the lazy optimizers: the layer, its tables, the state and the step count.

    Not used directly: build an :class:`SGD`, :class:`Adam` or :class:`AdamW`.

    Parameters
    ----------
    layer : LearnedPositionEmbedding or TokenPositionEmbedding
        The layer whose tables this optimizer updates.
    """

    #: Names of the per-row buffers of this optimizer's state.
    _buffer_names: ClassVar[tuple[str, ...]] = ()
    #: The keys of the hyper-parameters.
    _hyper_keys: ClassVar[tuple[str, ...]] = ()
    _hyper: dict[str, Any]

    def __init__(self, layer: Any) -> None:
        self._layer = layer
        self._tables = _tables_of(layer, type(self).__name__)
        self._step = 0
        self._scratch: dict[str, np.ndarray] = {}
        self._states = {
            name: _RowState(self._names_for(self._hyper), t.embeddings.shape, state_dtype(t.dtype))
            for name, t in self._tables.items()
        }

    # -- public face ----------------------------------------------------------
    @property
    def layer(self) -> Any:
        """The layer whose tables this optimizer updates."""
        return self._layer

    @property
    def step_count(self) -> int:
        """Steps taken: every :meth:`step` and every fused backward counts one."""
        return self._step

    @property
    def lr(self) -> float:
        """The learning rate; assign a new one between steps (a schedule)."""
        return float(self._hyper["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        self._hyper["lr"] = _at_least_zero(value, "lr", "Invalid learning rate")

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """A copy of the hyper-parameters (``lr``, ``betas``, ...)."""
        return dict(self._hyper)

    def zero_grad(self) -> None:
        """Reset the layer's gradients (``layer.zero_grad()``)."""
        self._layer.zero_grad()

    def step(self) -> None:
        """Update the rows that got gradient since the layer's last ``zero_grad()``.

        Reads ``layer.grad`` (both gradients of a :class:`TokenPositionEmbedding`);
        a table whose gradient is ``None`` is left alone. A gradient array that
        the user assigned counts as touching every row. Counts one step.

        Raises
        ------
        TypeError, ValueError
            A gradient assigned by the user that is not a real-valued array of
            the table's shape; nothing moves then.
        """
        work = []
        for name, table in self._tables.items():
            state = table._grad
            # Checked for both tables before either moves.
            grad = state.for_step(table.embeddings)
            if grad is None:
                continue
            work.append((name, state.step_rows(grad, table.max_seq_len), grad))
        self._step += 1
        for name, rows, grad in work:
            # The gradient as it is; one the user assigned (another dtype or
            # layout, or memory shared with a table) as a compact copy of its rows.
            if not self._apply(name, rows, grad, False, -1, strict=False):
                dt = self._states[name].dtype
                self._apply(name, rows, np.array(grad[rows], dtype=dt, order="C"), True, -1)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state: hyper-parameters, step count and per-row moments.

        Returns
        -------
        dict
            ``{"version", "optimizer", "hyperparameters", "step", "state"}``;
            ``state`` maps each table (``"embeddings"``, or
            ``"token_embeddings"`` and ``"position_embeddings"``) to a dict of
            ``"rows"`` (sorted int64, the rows that have state) and one
            ``(len(rows), embed_dim)`` array per buffer (copies).
        """
        return {
            "version": _STATE_VERSION,
            "optimizer": type(self).__name__,
            "hyperparameters": dict(self._hyper),
            "step": self._step,
            "state": {name: s.export() for name, s in self._states.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the state with one :meth:`state_dict` returned (checked whole first).

        Parameters
        ----------
        state : dict
            From :meth:`state_dict` of an optimizer of the same class over a
            layer with tables of the same shapes and dtype.

        Raises
        ------
        ValueError, TypeError
            A state of another optimizer class, other tables, bad
            hyper-parameters, or arrays of the wrong shape, dtype or rows;
            nothing changes then.
        """
        hyper, step, states = self._checked(state)
        self._hyper = hyper
        self._step = step
        self._states = states

    def _checked(self, state: Any) -> tuple[dict[str, Any], int, dict[str, _RowState]]:
        what = "optimizer state"
        if not isinstance(state, dict) or set(state) != {
            "version",
            "optimizer",
            "hyperparameters",
            "step",
            "state",
        }:
            raise ValueError(
                f"{what} must be a dict from state_dict() with the keys version, optimizer, "
                f"hyperparameters, step, state; got {v.describe(state)}"
            )
        if state["version"] != _STATE_VERSION:
            raise ValueError(
                f"{what} has version {v.describe(state['version'])}; "
                f"this cposembed reads {_STATE_VERSION}"
            )
        if state["optimizer"] != type(self).__name__:
            raise ValueError(
                f"{what} is of a {v.describe(state['optimizer'])} optimizer; "
                f"this is a {type(self).__name__}"
            )
        hyper = state["hyperparameters"]
        if not isinstance(hyper, dict) or set(hyper) != set(self._hyper_keys):
            raise ValueError(
                f"{what}: hyperparameters must be a dict with the keys "
                f"{sorted(self._hyper_keys)}; "
                f"got {v.describe(hyper)}"
            )
        hyper = type(self)._check_hyper(**hyper)
        step = v.check_int(state["step"], "optimizer state: step", min_value=0)
        tables = state["state"]
        if not isinstance(tables, dict) or set(tables) != set(self._tables):
            raise ValueError(
                f"{what}: state must be a dict with the keys {sorted(self._tables)}; "
                f"got {v.describe(tables)}"
            )
        names = self._names_for(hyper)
        checked = {}
        for name, table in self._tables.items():
            checked[name] = _RowState.restore(
                names,
                table.embeddings.shape,
                state_dtype(table.dtype),
                _checked_rows(tables[name], names, table, f"{what}: state[{name!r}]"),
            )
        return hyper, step, checked

    def _names_for(self, hyper: dict[str, Any]) -> tuple[str, ...]:
        """The per-row buffers kept with these hyper-parameters."""
        return self._buffer_names

    # -- pickle: the layer and state_dict() ---------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"layer": self._layer, "state": self.state_dict()}

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != {"layer", "state"}:
            raise ValueError(
                f"not a pickled {type(self).__name__} (expected the keys layer, state); "
                f"got {v.describe(state)}"
            )
        self._layer = state["layer"]
        self._tables = _tables_of(self._layer, type(self).__name__)
        self._scratch = {}
        self._hyper, self._step, self._states = self._checked(state["state"])

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={val!r}" for k, val in self._hyper.items())
        return f"{type(self).__name__}({self._layer!r}, {args})"

    # -- the update ------------------------------------------------------------------
    @classmethod
    def _check_hyper(cls, **hyper: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _apply(
        self,
        name: str,
        rows: np.ndarray,
        grad: np.ndarray,
        compact: bool,
        skip_row: int,
        strict: bool = True,
    ) -> bool:
        """Update the table ``name`` on the distinct ``rows`` (but ``skip_row``)
        and their state: ``grad`` in the state's dtype, row ``i`` that of
        ``rows[i]`` if ``compact``, else of the table's shape. False if the
        entry declined ``grad`` (nothing written), unless ``strict``."""
        table, state1, state2, has, skip = self._target_of(name, skip_row)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        done = _core.optimizer_step(
            table, grad, rows, compact, state1, state2, has, self._hyper_tuple(), skip
        )
        if done is None and strict:  # the optimizer's own arrays: the entry takes them all
            raise RuntimeError("the optimizer step's kernel declined its arguments")
        return done is not None

    def _target_of(self, name: str, skip_row: int) -> tuple[Any, ...]:
        """Table ``name``, its state arrays (None where this optimizer keeps
        none), the marks of the rows with state and the row never to update,
        as the C steps take them."""
        state = self._states[name]
        buffers = [state.buffers.get(n) for n in self._buffer_slots]
        return (
            self._tables[name].embeddings,
            buffers[0],
            buffers[1],
            state.has if state.names else None,
            skip_row,
        )

    #: The buffers handed to the update kernel, in its order (a name may be absent).
    _buffer_slots: ClassVar[tuple[str, str]] = ("", "")

    def _hyper_tuple(self) -> tuple[Any, ...]:
        """The hyper-parameters of this step as ``_core.optimizer_step`` takes them."""
        raise NotImplementedError

    # -- fused backward (called by the layers) ---------------------------------------
    def _check_layer(self, layer: Any) -> None:
        if layer is not self._layer:
            raise ValueError(
                f"optimizer was built for another layer ({self._layer!r}); "
                "pass the optimizer of this layer"
            )


def _tables_of(layer: Any, who: str) -> dict[str, LearnedPositionEmbedding]:
    from .embedding import LearnedPositionEmbedding
    from .token_position import TokenPositionEmbedding

    if isinstance(layer, LearnedPositionEmbedding):
        return {"embeddings": layer}
    if isinstance(layer, TokenPositionEmbedding):
        return {"token_embeddings": layer._tokens, "position_embeddings": layer._positions}
    raise TypeError(
        f"{who} optimizes a LearnedPositionEmbedding or a TokenPositionEmbedding; "
        f"got {v.describe(layer)}"
    )


def _checked_rows(
    data: Any, names: tuple[str, ...], table: LearnedPositionEmbedding, what: str
) -> dict[str, np.ndarray]:
    """The per-row state of one table from a state dict, checked and copied."""
    keys = {"rows", *names}
    if not isinstance(data, dict) or set(data) != keys:
        raise ValueError(
            f"{what} must be a dict with the keys {sorted(keys)}; got {v.describe(data)}"
        )
    rows = data["rows"]
    if not isinstance(rows, np.ndarray) or rows.ndim != 1 or rows.dtype.kind not in "iu":
        raise ValueError(f"{what}['rows'] must be a 1-D integer array; got {v.describe(rows)}")
    rows = rows.astype(np.int64)
    n_rows = table.max_seq_len
    if rows.size and (rows[0] < 0 or rows[-1] >= n_rows or not bool(np.all(rows[1:] > rows[:-1]))):
        raise ValueError(
            f"{what}['rows'] must be sorted, distinct rows in [0, {n_rows}) of the table"
        )
    dt = state_dtype(table.dtype)
    out = {"rows": rows}
    for name in names:
        buf = data[name]
        if (
            not isinstance(buf, np.ndarray)
            or buf.dtype != dt
            or buf.shape != (rows.size, table.embed_dim)
        ):
            raise ValueError(
                f"{what}[{name!r}] must be a {dt} array of shape "
                f"({rows.size}, {table.embed_dim}); got {v.describe(buf)}"
            )
        out[name] = np.array(buf, dtype=dt, order="C", copy=True)
    return out


class SGD(Optimizer):
    """Lazy stochastic gradient descent, with momentum, as ``torch.optim.SGD``.

    Per step, each row that got gradient ``g`` follows ``torch.optim.SGD``:
    ``g += weight_decay * p``; with momentum ``buf = g`` at the row's first
    gradient, else ``buf = momentum * buf + (1 - dampening) * g``, and
    ``g = g + momentum * buf`` (``nesterov``) or ``g = buf``; then
    ``p -= lr * g``. Rows without gradient do not move and their buffer does
    not decay. The ``padding_idx`` row never moves.

    Parameters
    ----------
    layer : LearnedPositionEmbedding or TokenPositionEmbedding
        The layer whose tables this optimizer updates.
    lr : float
        Learning rate, ``>= 0``.
    momentum : float, default 0.0
        Momentum factor, ``>= 0``.
    dampening : float, default 0.0
        Dampening for momentum.
    weight_decay : float, default 0.0
        L2 penalty added to the gradient, ``>= 0``.
    nesterov : bool, default False
        Nesterov momentum (needs a momentum and zero dampening).

    Raises
    ------
    TypeError
        A hyper-parameter that is not a number, or ``layer`` of another class.
    ValueError
        A hyper-parameter out of range (worded as PyTorch words it).

    Examples
    --------
    >>> import numpy as np
    >>> import cposembed
    >>> pe = cposembed.LearnedPositionEmbedding(16, 4, seed=0)
    >>> opt = cposembed.SGD(pe, lr=0.1, momentum=0.9)
    >>> pe.zero_grad()
    >>> _ = pe.backward(np.ones((3, 4), dtype=np.float32), [0, 5, 5])
    >>> opt.step()
    >>> pe.backward(np.ones((2, 4), dtype=np.float32), [1, 2], optimizer=opt)
    """

    _hyper_keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov")

    def __init__(
        self,
        layer: Any,
        lr: float,
        *,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        self._hyper = self._check_hyper(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(layer)

    @classmethod
    def _check_hyper(cls, **hyper: Any) -> dict[str, Any]:
        lr = _at_least_zero(hyper["lr"], "lr", "Invalid learning rate")
        momentum = _at_least_zero(hyper["momentum"], "momentum", "Invalid momentum value")
        dampening = _real(hyper["dampening"], "dampening")
        if not math.isfinite(dampening):
            raise ValueError(f"Invalid dampening value: {hyper['dampening']}")
        weight_decay = _at_least_zero(
            hyper["weight_decay"], "weight_decay", "Invalid weight_decay value"
        )
        nesterov = hyper["nesterov"]
        if not isinstance(nesterov, (bool, np.bool_)):
            raise TypeError(f"nesterov must be a bool; got {v.describe(nesterov)}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        return {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": bool(nesterov),
        }

    def _names_for(self, hyper: dict[str, Any]) -> tuple[str, ...]:
        # As torch: no momentum, no buffer.
        return ("momentum_buffer",) if hyper["momentum"] != 0 else ()

    _buffer_slots = ("momentum_buffer", "")

    def _hyper_tuple(self) -> tuple[Any, ...]:
        h = self._hyper
        wd, momentum = h["weight_decay"], h["momentum"]
        return (0, wd != 0, False, momentum != 0, h["nesterov"], -h["lr"], wd, momentum) + (
            1 - h["dampening"],
            1.0,
            0.0,
            0.0,
            0.0,
            1.0,
            0.0,
            0.0,
        )


class Adam(Optimizer):
    """Lazy Adam: ``torch.optim.Adam``'s rule on the rows that got gradient.

    Per step (``t`` counts every :meth:`step` and every fused backward), each
    row that got gradient ``g`` follows ``torch.optim.Adam``:
    ``g += weight_decay * p`` (L2), ``m = lerp(m, g, 1 - beta1)``,
    ``v = beta2 * v + (1 - beta2) * g * g``,
    ``denom = sqrt(v) / sqrt(1 - beta2**t) + eps``,
    ``p -= (lr / (1 - beta1**t)) * m / denom``. Moments start at zero; rows
    without gradient keep their moments and do not move (as
    ``torch.optim.SparseAdam``). The ``padding_idx`` row never moves.

    Parameters
    ----------
    layer : LearnedPositionEmbedding or TokenPositionEmbedding
        The layer whose tables this optimizer updates.
    lr : float, default 1e-3
        Learning rate, ``>= 0``.
    betas : (float, float), default (0.9, 0.999)
        Decay rates of the first and second moments, each in ``[0, 1)``.
    eps : float, default 1e-8
        Added to the bias-corrected root of the second moment, ``>= 0``.
    weight_decay : float, default 0.0
        L2 penalty added to the gradient, ``>= 0``.

    Raises
    ------
    TypeError
        A hyper-parameter that is not a number, or ``layer`` of another class.
    ValueError
        A hyper-parameter out of range (worded as PyTorch words it).

    Examples
    --------
    >>> import numpy as np
    >>> import cposembed
    >>> m = cposembed.TokenPositionEmbedding(100, 8, 4, seed=0)
    >>> opt = cposembed.Adam(m, lr=1e-2)
    >>> ids = np.array([[3, 9, 3]])
    >>> m.backward(np.ones((1, 3, 4), dtype=np.float32), ids, optimizer=opt)
    >>> opt.step_count
    1
    """

    _buffer_names = ("exp_avg", "exp_avg_sq")
    _hyper_keys = ("lr", "betas", "eps", "weight_decay")
    _decoupled = False

    def __init__(
        self,
        layer: Any,
        lr: float = 1e-3,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        self._hyper = self._check_hyper(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(layer)

    @classmethod
    def _check_hyper(cls, **hyper: Any) -> dict[str, Any]:
        lr = _at_least_zero(hyper["lr"], "lr", "Invalid learning rate")
        eps = _at_least_zero(hyper["eps"], "eps", "Invalid epsilon value")
        betas = _betas(hyper["betas"])
        weight_decay = _at_least_zero(
            hyper["weight_decay"], "weight_decay", "Invalid weight_decay value"
        )
        return {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}

    _buffer_slots = ("exp_avg", "exp_avg_sq")

    def _hyper_tuple(self) -> tuple[Any, ...]:
        # torch.optim.Adam's scalars, in Python floats as it computes them.
        h = self._hyper
        lr, wd, eps = h["lr"], h["weight_decay"], h["eps"]
        beta1, beta2 = h["betas"]
        t = self._step
        step_size = lr / (1 - beta1**t)
        bias_correction2_sqrt = (1 - beta2**t) ** 0.5
        decoupled = self._decoupled and wd != 0
        l2 = not self._decoupled and wd != 0
        return (1, l2, decoupled, False, False, 0.0, wd, 0.0, 0.0, 1 - lr * wd) + (
            1 - beta1,
            beta2,
            1 - beta2,
            bias_correction2_sqrt,
            eps,
            -step_size,
        )


class AdamW(Adam):
    """Lazy AdamW: Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    As :class:`Adam`, except that weight decay is decoupled: each row that got
    gradient is first scaled, ``p *= 1 - lr * weight_decay``, once per step,
    and the gradient is used as it is. Rows without gradient do not decay.

    Parameters
    ----------
    layer : LearnedPositionEmbedding or TokenPositionEmbedding
        The layer whose tables this optimizer updates.
    lr : float, default 1e-3
        Learning rate, ``>= 0``.
    betas : (float, float), default (0.9, 0.999)
        Decay rates of the first and second moments, each in ``[0, 1)``.
    eps : float, default 1e-8
        Added to the bias-corrected root of the second moment, ``>= 0``.
    weight_decay : float, default 1e-2
        Decoupled weight decay, ``>= 0``.

    Raises
    ------
    TypeError
        A hyper-parameter that is not a number, or ``layer`` of another class.
    ValueError
        A hyper-parameter out of range (worded as PyTorch words it).
    """

    _decoupled = True

    def __init__(
        self,
        layer: Any,
        lr: float = 1e-3,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(layer, lr, betas=betas, eps=eps, weight_decay=weight_decay)


# -- fused backward: the layers' backward(..., optimizer=opt) --------------------------
def _wrapped(rows: np.ndarray, n_rows: int) -> np.ndarray:
    """Rows in ``[-n_rows, n_rows)`` as a flat int64 array in ``[0, n_rows)``."""
    flat = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
    return np.where(flat < 0, flat + n_rows, flat)


def _call_rows(
    pos: np.ndarray | None, off: int, lead: tuple[int, ...], n_rows: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """The distinct rows a backward of rows shaped ``lead`` adds into, and the
    positions into a compact scratch of them (None: ``arange(T)`` over the last
    axis, for ``positions=None``, whose rows ``off .. off + T - 1`` are distinct)."""
    if int(np.prod(lead)) == 0:
        return np.empty(0, dtype=np.int64), np.zeros(lead, dtype=np.int64)
    if pos is None:
        return np.arange(off, off + lead[-1], dtype=np.int64), None
    rows, slots, _ = _distinct(_wrapped(np.broadcast_to(pos, lead), n_rows), n_rows)
    return rows, slots.reshape(lead)


def _distinct(flat: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_core.distinct_rows`` of rows already wrapped into ``[0, n_rows)``."""
    found = _core.distinct_rows(flat, n_rows)
    if found is None:  # int64 rows in range: the entry takes them
        raise RuntimeError("distinct_rows declined its rows")
    return found


def _scratch(opt: Optimizer, name: str, n: int, d: int) -> np.ndarray:
    """``n`` zeroed rows of the optimizer's scratch for table ``name`` (kept
    between calls: fresh memory would cost a page fault per 4 KiB each time)."""
    dt = opt._states[name].dtype
    kept = opt._scratch.get(name)
    if kept is None or kept.shape[0] < n:
        kept = np.zeros((max(n, 2 * (0 if kept is None else kept.shape[0])), d), dtype=dt)
        opt._scratch[name] = kept
        return kept[:n]
    rows = kept[:n]
    rows.fill(0)
    return rows


def fused_position_backward(
    opt: Optimizer, layer: LearnedPositionEmbedding, grad_output: Any, positions: Any, offset: Any
) -> None:
    """``layer.backward(grad_output, positions, offset=offset, optimizer=opt)``."""
    if not isinstance(opt, Optimizer):
        raise TypeError(f"optimizer must be a cposembed optimizer; got {v.describe(opt)}")
    opt._check_layer(layer)
    table = layer.embeddings
    n_rows, d = table.shape
    g = v.as_rows(grad_output, d, "grad_output")
    lead = g.shape[:-1]
    pos, off = _routes.row_positions(positions, offset, lead, n_rows, "grad_output")
    rows, slots = _call_rows(pos, off, lead, n_rows)
    scratch = _scratch(opt, "embeddings", rows.size, d)
    if rows.size:
        _routes.scatter_add(
            scratch, g, slots, offset=0, num_threads=None, touched=None, skip_row=-1
        )
    opt._step += 1
    opt._apply("embeddings", rows, scratch, True, layer._grad.skip_row)


def fused_layer_backward(
    opt: Optimizer, layer: Any, grad_output: Any, token_ids: Any, positions: Any, offset: Any
) -> None:
    """``layer.backward(grad_output, token_ids, positions, offset=offset, optimizer=opt)``
    for a :class:`~cposembed.TokenPositionEmbedding`."""
    if not isinstance(opt, Optimizer):
        raise TypeError(f"optimizer must be a cposembed optimizer; got {v.describe(opt)}")
    opt._check_layer(layer)
    # The entry first, as the other operations call theirs; what it declines
    # is normalised (or refused with the worded error) and handed to it again.
    if _fused_layer_step(opt, layer, grad_output, token_ids, positions, offset):
        return
    tokens, places = layer._tokens, layer._positions
    d = tokens.embed_dim
    ids = _routes.checked_ids(token_ids, tokens.max_seq_len)
    g = v.as_rows(grad_output, d, "grad_output")
    if g.shape[:-1] != ids.shape:
        raise ValueError(
            f"grad_output must have shape token_ids.shape + (d,) = {ids.shape + (d,)}; "
            f"got {g.shape}"
        )
    pos, off = _routes.id_positions(ids, positions, offset, places.max_seq_len)
    work = opt._states["token_embeddings"].dtype
    g_c = v.plain_copy(g, _routes.grad_output_dtype(g.dtype, work))
    if any(v.overlaps(g_c, a) for a in _arrays_of(opt)):
        g_c = g_c.copy()  # the step writes rows while it still reads the gradient
    if not _fused_layer_step(opt, layer, g_c, ids, pos, off):
        raise RuntimeError("the fused step's kernel declined its arguments")


def _arrays_of(opt: Optimizer) -> list[np.ndarray]:
    """The tables and state arrays an optimizer writes."""
    out = []
    for name, table in opt._tables.items():
        out.append(table.embeddings)
        out.extend(opt._states[name].buffers.values())
    return out


def _fused_layer_step(
    opt: Optimizer, layer: Any, grad_output: Any, token_ids: Any, positions: Any, offset: Any
) -> bool:
    """The entry of a layer's fused step (one step counted if it ran); False:
    declined, nothing written, no step counted."""
    opt._step += 1
    done = _core.fused_embed_step(
        opt._target_of("token_embeddings", layer._tokens._grad.skip_row),
        opt._target_of("position_embeddings", -1),
        grad_output,
        token_ids,
        positions,
        offset,
        opt._hyper_tuple(),
    )
    if done is None:
        opt._step -= 1
        return False
    return True
