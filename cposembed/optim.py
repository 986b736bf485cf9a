"""Lazy optimizers for the embedding tables: SGD, Adam and AdamW on the touched rows.

Each optimizer holds one layer (a :class:`~cposembed.LearnedPositionEmbedding`
or a :class:`~cposembed.TokenPositionEmbedding`, both its tables) and updates,
per step, only the rows that got gradient: after ``layer.backward(...)`` the
rows it touched since the last ``zero_grad()``, in a fused
``layer.backward(..., optimizer=opt)`` the rows of that call. Each such row
follows PyTorch's update rule for that optimizer; the other rows and their
state stay as they are (the semantics of ``torch.optim.SparseAdam``).

The state lives per row, for the rows that ever got gradient only: a sorted
index from table row to slot, and the moments in slot order, grown by
doubling. A step costs its touched rows (plus the index insertion of rows
seen for the first time), never the table's rows.

A fused backward sums the call's gradient into scratch rows (one per distinct
row of the call, with the same scatter-add kernel and so the same summation
order as ``layer.backward``) and hands them to the same update function
``step()`` uses: fused and unfused give the same bits by construction.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from . import _routes
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
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, v.REAL_SCALARS):
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
    """Per-row state of one table: for each row that ever got gradient, its buffers.

    ``rows`` (sorted) and ``slots`` map a table row to a slot; ``buffers[name]``
    holds slot ``s`` in its row ``s``. Capacity grows by doubling, so adding
    rows costs in proportion to the rows added (plus the sorted insertion).
    """

    def __init__(self, names: tuple[str, ...], d: int, dtype: np.dtype) -> None:
        self.names = names
        self.d = d
        self.dtype = dtype
        self.rows = np.empty(0, dtype=np.int64)
        self.slots = np.empty(0, dtype=np.int64)
        self.count = 0
        self.buffers = {name: np.empty((0, d), dtype=dtype) for name in names}

    def find(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slots of sorted unique ``rows`` (-1 where a row has none), and where each
        missing row would go in the sorted index."""
        at = np.searchsorted(self.rows, rows)
        slots = np.full(rows.shape, -1, dtype=np.int64)
        if self.rows.size:
            clipped = np.minimum(at, self.rows.size - 1)
            found = self.rows[clipped] == rows
            slots[found] = self.slots[clipped[found]]
        return slots, at

    def add(self, rows: np.ndarray, at: np.ndarray) -> np.ndarray:
        """New slots for ``rows`` (sorted, not yet present; ``at`` from :meth:`find`)."""
        n_new = rows.size
        new = np.arange(self.count, self.count + n_new, dtype=np.int64)
        need = self.count + n_new
        capacity = next(iter(self.buffers.values())).shape[0] if self.names else 0
        if self.names and need > capacity:
            grown = max(need, 2 * capacity, 16)
            for name, buf in self.buffers.items():
                bigger = np.empty((grown, self.d), dtype=self.dtype)
                bigger[: self.count] = buf[: self.count]
                self.buffers[name] = bigger
        self.rows = np.insert(self.rows, at, rows)
        self.slots = np.insert(self.slots, at, new)
        self.count = need
        return new

    def export(self) -> dict[str, np.ndarray]:
        """Copies of the state in row order: ``rows`` and one ``(n, d)`` array per buffer."""
        out = {"rows": self.rows.copy()}
        for name, buf in self.buffers.items():
            out[name] = buf[self.slots]
        return out

    @classmethod
    def restore(
        cls, names: tuple[str, ...], d: int, dtype: np.dtype, data: dict[str, np.ndarray]
    ) -> _RowState:
        state = cls(names, d, dtype)
        rows = data["rows"]
        state.rows = rows
        state.slots = np.arange(rows.size, dtype=np.int64)
        state.count = int(rows.size)
        state.buffers = {name: data[name] for name in names}
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
        self._states = {
            name: _RowState(self._names_for(self._hyper), t.embed_dim, state_dtype(t.dtype))
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
            dt = self._states[name].dtype
            self._apply(name, rows, np.asarray(grad[rows], dtype=dt))

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
                table.embed_dim,
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
        self._hyper, self._step, self._states = self._checked(state["state"])

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={val!r}" for k, val in self._hyper.items())
        return f"{type(self).__name__}({self._layer!r}, {args})"

    # -- the update ------------------------------------------------------------------
    @classmethod
    def _check_hyper(cls, **hyper: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _apply(self, name: str, rows: np.ndarray, grad: np.ndarray) -> None:
        """Update the table ``name`` on sorted unique ``rows`` with their gradient
        ``grad`` (``(len(rows), d)`` in the state's dtype), and their state."""
        if rows.size == 0:
            return
        table = self._tables[name].embeddings
        state = self._states[name]
        if not state.names:  # plain SGD keeps no state
            no_state = np.zeros(rows.size, dtype=bool)
            table[rows] = self._update(
                np.asarray(table[rows], dtype=state.dtype), grad, {}, no_state
            )
            return
        slots, at = state.find(rows)
        new = slots < 0
        if new.any():
            slots[new] = state.add(rows[new], at[new])
        buffers = {n: state.buffers[n][slots] for n in state.names}
        param = np.asarray(table[rows], dtype=state.dtype)
        param = self._update(param, grad, buffers, new)
        for n in state.names:
            state.buffers[n][slots] = buffers[n]
        table[rows] = param

    def _update(
        self,
        param: np.ndarray,
        grad: np.ndarray,
        buffers: dict[str, np.ndarray],
        new: np.ndarray,
    ) -> np.ndarray:
        raise NotImplementedError

    # -- fused backward (called by the layers) ---------------------------------------
    def _check_layer(self, layer: Any) -> None:
        if layer is not self._layer:
            raise ValueError(
                f"optimizer was built for another layer ({self._layer!r}); "
                "pass the optimizer of this layer"
            )

    def _fused(self, updates: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
        """One step from a fused backward: ``(table, rows, gradient rows)`` each."""
        self._step += 1
        for name, rows, grad in updates:
            self._apply(name, rows, np.asarray(grad, dtype=self._states[name].dtype))


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

    def _update(
        self,
        param: np.ndarray,
        grad: np.ndarray,
        buffers: dict[str, np.ndarray],
        new: np.ndarray,
    ) -> np.ndarray:
        h = self._hyper
        if h["weight_decay"] != 0:
            grad = grad + h["weight_decay"] * param
        if h["momentum"] != 0:
            buf = buffers["momentum_buffer"]
            buf[new] = 0  # fresh slots hold whatever the allocation held
            buf = buf * h["momentum"] + (1 - h["dampening"]) * grad
            buf[new] = grad[new]
            buffers["momentum_buffer"] = buf
            grad = grad + h["momentum"] * buf if h["nesterov"] else buf
        return param + -h["lr"] * grad


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

    def _update(
        self,
        param: np.ndarray,
        grad: np.ndarray,
        buffers: dict[str, np.ndarray],
        new: np.ndarray,
    ) -> np.ndarray:
        h = self._hyper
        lr, wd, eps = h["lr"], h["weight_decay"], h["eps"]
        beta1, beta2 = h["betas"]
        dt = param.dtype.type
        exp_avg = buffers["exp_avg"]
        exp_avg_sq = buffers["exp_avg_sq"]
        exp_avg[new] = 0
        exp_avg_sq[new] = 0
        if wd != 0:
            if self._decoupled:
                param = param * (1 - lr * wd)
            else:
                grad = grad + wd * param
        # torch's lerp(m, g, w): m + w * (g - m) for |w| < 0.5, else g - (g - m) * (1 - w),
        # with w in the state's dtype.
        w = dt(1 - beta1)
        if abs(w) < 0.5:
            exp_avg = exp_avg + w * (grad - exp_avg)
        else:
            exp_avg = grad - (grad - exp_avg) * (dt(1) - w)
        exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
        t = self._step
        bias_correction1 = 1 - beta1**t
        bias_correction2 = 1 - beta2**t
        step_size = lr / bias_correction1
        denom = np.sqrt(exp_avg_sq) / bias_correction2**0.5 + eps
        buffers["exp_avg"] = exp_avg
        buffers["exp_avg_sq"] = exp_avg_sq
        return param + -step_size * exp_avg / denom


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
def _flat_rows(pos: np.ndarray | None, off: int, lead: tuple[int, ...], n_rows: int) -> np.ndarray:
    """The rows a backward adds into, flat, in ``[0, n_rows)``."""
    full = v.default_positions(off, lead[-1]) if pos is None else pos
    flat = np.broadcast_to(full, lead).reshape(-1).astype(np.int64)
    return np.where(flat < 0, flat + n_rows, flat)


def _distinct(flat: np.ndarray, lead: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct rows, and each entry's index among them (shaped ``lead``)."""
    rows, inverse = np.unique(flat, return_inverse=True)
    return rows, inverse.reshape(lead)


def _scratch_skip(rows: np.ndarray, skip_row: int) -> int:
    """The scratch row of the table's padding row (-1: not among ``rows``)."""
    if skip_row < 0:
        return -1
    at = int(np.searchsorted(rows, skip_row))
    return at if at < rows.size and rows[at] == skip_row else -1


def fused_position_backward(
    opt: Optimizer, layer: LearnedPositionEmbedding, grad_output: Any, positions: Any, offset: Any
) -> None:
    """``layer.backward(grad_output, positions, offset=offset, optimizer=opt)``."""
    if not isinstance(opt, Optimizer):
        raise TypeError(f"optimizer must be a cposembed optimizer; got {v.describe(opt)}")
    opt._check_layer(layer)
    table = layer.embeddings
    skip_row = layer._grad.skip_row
    n_rows, d = table.shape
    g = v.as_rows(grad_output, d, "grad_output")
    lead = g.shape[:-1]
    pos, off = _routes.row_positions(positions, offset, lead, n_rows, "grad_output")
    rows, inverse = _distinct(_flat_rows(pos, off, lead, n_rows), lead)
    scratch = np.zeros((rows.size, d), dtype=v.work_dtype(table.dtype))
    if rows.size:
        skip = _scratch_skip(rows, skip_row)
        _routes.scatter_add(
            scratch, g, inverse, offset=0, num_threads=None, touched=None, skip_row=skip
        )
    keep = rows != skip_row
    opt._fused([("embeddings", rows[keep], scratch[keep])])


def fused_layer_backward(
    opt: Optimizer, layer: Any, grad_output: Any, token_ids: Any, positions: Any, offset: Any
) -> None:
    """``layer.backward(grad_output, token_ids, positions, offset=offset, optimizer=opt)``
    for a :class:`~cposembed.TokenPositionEmbedding`."""
    if not isinstance(opt, Optimizer):
        raise TypeError(f"optimizer must be a cposembed optimizer; got {v.describe(opt)}")
    opt._check_layer(layer)
    tokens, places = layer._tokens, layer._positions
    skip_row = tokens._grad.skip_row
    d = tokens.embed_dim
    ids = _routes.checked_ids(token_ids, tokens.max_seq_len)
    g = v.as_rows(grad_output, d, "grad_output")
    if g.shape[:-1] != ids.shape:
        raise ValueError(
            f"grad_output must have shape token_ids.shape + (d,) = {ids.shape + (d,)}; "
            f"got {g.shape}"
        )
    pos, off = _routes.id_positions(ids, positions, offset, places.max_seq_len)
    lead = ids.shape
    flat_ids = ids.reshape(-1).astype(np.int64)
    flat_ids = np.where(flat_ids < 0, flat_ids + tokens.max_seq_len, flat_ids)
    token_rows, token_inverse = _distinct(flat_ids, lead)
    if ids.size:
        position_rows, position_inverse = _distinct(
            _flat_rows(pos, off, lead, places.max_seq_len), lead
        )
    else:
        position_rows = np.empty(0, dtype=np.int64)
        position_inverse = np.empty(lead, dtype=np.int64)
    token_scratch = np.zeros((token_rows.size, d), dtype=v.work_dtype(tokens.dtype))
    position_scratch = np.zeros((position_rows.size, d), dtype=v.work_dtype(places.dtype))
    if ids.size:
        _routes.embed_backward(
            token_scratch,
            position_scratch,
            g,
            token_inverse,
            position_inverse,
            offset=0,
            num_threads=None,
            token_touched=None,
            position_touched=None,
            token_skip_row=_scratch_skip(token_rows, skip_row),
        )
    keep = token_rows != skip_row
    opt._fused(
        [
            ("token_embeddings", token_rows[keep], token_scratch[keep]),
            ("position_embeddings", position_rows, position_scratch),
        ]
    )
