"""Lazy optimizers for the embedding tables: SGD, Adam and AdamW on the touched rows,
each by PyTorch's rule; the other rows and their state stay as they are."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from . import _core, _routes
from . import _validation as v
from ._grad import Trainable
from ._optim_state import (
    STATE_VERSION,
    RowState,
    at_least_zero,
    call_rows,
    check_betas,
    check_saved,
    real,
    state_dtype,
)

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "state_dtype"]

# The C step's hyper-parameters (cpe_opt_hyper) at values that change nothing.
_KERNEL_UNUSED: dict[str, Any] = {
    "decoupled": False,
    "momentum_on": False,
    "nesterov": False,
    "neg_lr": 0.0,
    "momentum": 0.0,
    "damp1": 0.0,
    "decay": 1.0,
    "w1": 0.0,
    "beta2": 0.0,
    "omb2": 0.0,
    "bc2_sqrt": 1.0,
    "eps": 0.0,
    "neg_step": 0.0,
}

# Each hyper-parameter's check, worded as torch.optim words it (SGD checks its other two).
_CHECKS: dict[str, Callable[[Any], Any]] = {
    "lr": lambda x: at_least_zero(x, "lr", "Invalid learning rate"),
    "momentum": lambda x: at_least_zero(x, "momentum", "Invalid momentum value"),
    "eps": lambda x: at_least_zero(x, "eps", "Invalid epsilon value"),
    "weight_decay": lambda x: at_least_zero(x, "weight_decay", "Invalid weight_decay value"),
    "betas": check_betas,
}


class Optimizer:
    """Base of :class:`SGD`, :class:`Adam` and :class:`AdamW`.

    Parameters
    ----------
    layer : LearnedPositionEmbedding or TokenPositionEmbedding
        The layer whose tables this optimizer updates.
    """

    #: The per-row buffers, in the update kernel's order.
    _buffer_names: ClassVar[tuple[str, ...]] = ()
    _hyper_keys: ClassVar[tuple[str, ...]] = ()
    _hyper: dict[str, Any]

    def __init__(self, layer: Any) -> None:
        self._bind(layer)
        self._step = 0
        names = self._names_for(self._hyper)
        self._states = {
            name: RowState(names, t.table.shape, state_dtype(t.table.dtype))
            for name, t in self._tables.items()
        }

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
        self._hyper["lr"] = _CHECKS["lr"](value)

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """A copy of the hyper-parameters (``lr``, ``betas``, ...)."""
        return dict(self._hyper)

    def zero_grad(self) -> None:
        """Reset the layer's gradients (``layer.zero_grad()``)."""
        self._layer.zero_grad()

    def step(self) -> None:
        """Update the rows that got gradient since the layer's last ``zero_grad()``.

        A table whose gradient is ``None`` is left alone; an assigned gradient
        counts as touching every row.

        Raises
        ------
        TypeError, ValueError
            An assigned gradient that is not a real array of the table's shape;
            nothing moves then.
        """
        work = []
        for name, t in self._tables.items():
            grad = t.gradient.for_step(t.table)
            if grad is None:
                continue
            work.append((name, t.gradient.step_rows(grad, t.table.shape[0]), grad))
        self._step += 1
        for name, rows, grad in work:
            self._apply(name, rows, grad, False, -1)

    def fused_backward(self, layer: Any, grad_output: Any, *inputs: Any, offset: Any = 0) -> None:
        """``layer.backward(grad_output, *inputs, offset=offset, optimizer=self)``: one step."""
        if layer is not self._layer:
            raise ValueError(
                f"optimizer was built for another layer ({self._layer!r}); "
                "pass the optimizer of this layer"
            )
        wanted = ("positions",) if "embeddings" in self._tables else ("token_ids", "positions")
        if len(inputs) != len(wanted):
            raise TypeError(
                f"fused_backward of this layer takes grad_output, {', '.join(wanted)}; "
                f"got {len(inputs)} inputs after grad_output"
            )
        if len(inputs) == 1:
            self._position_backward(grad_output, inputs[0], offset)
        else:
            self._layer_backward(grad_output, inputs[0], inputs[1], offset)

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
            "version": STATE_VERSION,
            "optimizer": type(self).__name__,
            "hyperparameters": dict(self._hyper),
            "step": self._step,
            "state": {name: s.export() for name, s in self._states.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the state with one :meth:`state_dict` returned.

        Parameters
        ----------
        state : dict
            From :meth:`state_dict` of an optimizer of the same class over a
            layer with tables of the same shapes and dtype.

        Raises
        ------
        ValueError, TypeError
            A state of another optimizer or tables, or bad values; nothing changes.
        """
        self._hyper, self._step, self._states = self._checked(state)

    def _checked(self, state: Any) -> tuple[dict[str, Any], int, dict[str, RowState]]:
        check_saved(state, type(self).__name__, self._hyper_keys)
        hyper = type(self)._check_hyper(**state["hyperparameters"])
        step = v.check_int(state["step"], "optimizer state: step", min_value=0)
        tables = state["state"]
        if not isinstance(tables, dict) or set(tables) != set(self._tables):
            raise ValueError(
                f"optimizer state: state must be a dict with the keys {sorted(self._tables)}; "
                f"got {v.describe(tables)}"
            )
        names = self._names_for(hyper)
        checked = {
            name: RowState.restore(
                names, t.table, tables[name], f"optimizer state: state[{name!r}]"
            )
            for name, t in self._tables.items()
        }
        return hyper, step, checked

    def _bind(self, layer: Any) -> None:
        """Keep ``layer``, its tables and an empty scratch."""
        tables = getattr(layer, "trainable_tables", None)
        if not callable(tables):
            raise TypeError(
                f"{type(self).__name__} optimizes a LearnedPositionEmbedding or a "
                f"TokenPositionEmbedding; got {v.describe(layer)}"
            )
        self._layer = layer
        self._tables: dict[str, Trainable] = tables()
        self._scratch: dict[str, np.ndarray] = {}

    def _names_for(self, hyper: dict[str, Any]) -> tuple[str, ...]:
        """The per-row buffers kept with these hyper-parameters."""
        return self._buffer_names

    def __getstate__(self) -> dict[str, Any]:
        return {"layer": self._layer, "state": self.state_dict()}

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != {"layer", "state"}:
            raise ValueError(
                f"not a pickled {type(self).__name__} (expected the keys layer, state); "
                f"got {v.describe(state)}"
            )
        self._bind(state["layer"])
        self._hyper, self._step, self._states = self._checked(state["state"])

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={val!r}" for k, val in self._hyper.items())
        return f"{type(self).__name__}({self._layer!r}, {args})"

    @classmethod
    def _check_hyper(cls, **hyper: Any) -> dict[str, Any]:
        """``hyper`` checked, in ``_hyper_keys`` order."""
        return {k: _CHECKS[k](hyper[k]) if k in _CHECKS else hyper[k] for k in cls._hyper_keys}

    def _kernel_hyper(self) -> dict[str, Any]:
        """This step's hyper-parameters as the C step takes them."""
        raise NotImplementedError

    def _apply(
        self, name: str, rows: np.ndarray, grad: np.ndarray, compact: bool, skip_row: int
    ) -> bool:
        """Update table ``name`` on ``rows`` (but ``skip_row``) from ``grad`` (of
        the rows if ``compact``); True."""
        table, state1, state2, slots, _ = self._target_of(name, skip_row)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        hyper = self._kernel_hyper()
        if _core.optimizer_step(table, grad, rows, compact, state1, state2, slots, hyper, skip_row):
            return True
        if not compact:
            # A full gradient the entry refuses (an assigned one) goes as a copy of its rows.
            grad = np.array(grad[rows], dtype=self._states[name].dtype, order="C")
            if _core.optimizer_step(
                table, grad, rows, True, state1, state2, slots, hyper, skip_row
            ):
                return True
        raise RuntimeError("the optimizer step's kernel refused its arguments")

    def _target_of(self, name: str, skip_row: int) -> tuple[Any, ...]:
        """Table ``name``, its two state arrays (or None), RowSlots and skip row."""
        state = self._states[name]
        buffers = [state.buffers.get(n) for n in self._buffer_names] + [None, None]
        slots = state.slots if state.names else None
        return self._tables[name].table, buffers[0], buffers[1], slots, skip_row

    def _scratch_rows(self, name: str, n: int, d: int) -> np.ndarray:
        """``n`` zeroed rows of scratch for table ``name``, kept between calls."""
        kept = self._scratch.get(name, np.zeros((0, d), dtype=self._states[name].dtype))
        if kept.shape[0] < n:
            kept = self._scratch[name] = np.zeros((max(n, 2 * kept.shape[0]), d), dtype=kept.dtype)
        rows = kept[:n]
        rows.fill(0)
        return rows

    def _position_backward(self, grad_output: Any, positions: Any, offset: Any) -> None:
        """The fused backward of a :class:`LearnedPositionEmbedding`."""
        t = self._tables["embeddings"]
        n_rows, d = t.table.shape
        g = v.as_rows(grad_output, d, "grad_output")
        lead = g.shape[:-1]
        pos, off = _routes.row_positions(positions, offset, lead, n_rows, "grad_output")
        rows, slots = call_rows(pos, off, lead, n_rows)
        scratch = self._scratch_rows("embeddings", rows.size, d)
        if rows.size:
            _routes.scatter_add(
                scratch, g, slots, offset=0, num_threads=None, touched=None, skip_row=-1
            )
        self._step += 1
        self._apply("embeddings", rows, scratch, True, t.gradient.skip_row)

    def _layer_backward(
        self, grad_output: Any, token_ids: Any, positions: Any, offset: Any
    ) -> None:
        """The fused backward of a :class:`TokenPositionEmbedding`: the entry, then
        what it refused, normalised."""
        if self._layer_step(grad_output, token_ids, positions, offset):
            return
        tokens, positions_of = self._tables["token_embeddings"], self._tables["position_embeddings"]
        ids = _routes.checked_ids(token_ids, tokens.table.shape[0])
        g = _routes.id_rows(grad_output, ids, tokens.table.shape[1])
        pos, off = _routes.id_positions(ids, positions, offset, positions_of.table.shape[0])
        work = self._states["token_embeddings"].dtype
        g_c = v.canonical_copy(g, _routes.grad_output_dtype(g.dtype, work))
        written = [t.table for t in self._tables.values()]
        written += [b for s in self._states.values() for b in s.buffers.values()]
        if any(v.overlaps(g_c, a) for a in written):
            g_c = g_c.copy()  # the step writes rows while it still reads the gradient
        if not self._layer_step(g_c, ids, pos, off):
            raise RuntimeError("the fused step's kernel refused its arguments")

    def _layer_step(self, grad_output: Any, token_ids: Any, positions: Any, offset: Any) -> bool:
        """The entry of a layer's fused step; False if it refused (no step counted)."""
        self._step += 1
        skip = self._tables["token_embeddings"].gradient.skip_row
        done = _core.fused_embed_step(
            self._target_of("token_embeddings", skip),
            self._target_of("position_embeddings", -1),
            grad_output,
            token_ids,
            positions,
            offset,
            self._kernel_hyper(),
        )
        if done is None:
            self._step -= 1
        return done is not None


class SGD(Optimizer):
    """Lazy stochastic gradient descent, with momentum, as ``torch.optim.SGD``.

    Rows without gradient do not move and their buffer does not decay; the
    ``padding_idx`` row never moves.

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
        h = super()._check_hyper(**hyper)
        h["dampening"] = real(hyper["dampening"], "dampening")
        if not math.isfinite(h["dampening"]):
            raise ValueError(f"Invalid dampening value: {hyper['dampening']}")
        if not isinstance(hyper["nesterov"], (bool, np.bool_)):
            raise TypeError(f"nesterov must be a bool; got {v.describe(hyper['nesterov'])}")
        h["nesterov"] = bool(hyper["nesterov"])
        if h["nesterov"] and (h["momentum"] <= 0 or h["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        return h

    _buffer_names = ("momentum_buffer",)

    def _names_for(self, hyper: dict[str, Any]) -> tuple[str, ...]:
        # As torch: no momentum, no buffer.
        return self._buffer_names if hyper["momentum"] != 0 else ()

    def _kernel_hyper(self) -> dict[str, Any]:
        h = self._hyper
        wd, momentum = h["weight_decay"], h["momentum"]
        return {
            **_KERNEL_UNUSED,
            "kind": 0,
            "l2": wd != 0,
            "momentum_on": momentum != 0,
            "nesterov": h["nesterov"],
            "neg_lr": -h["lr"],
            "weight_decay": wd,
            "momentum": momentum,
            "damp1": 1 - h["dampening"],
        }


class Adam(Optimizer):
    """Lazy Adam: ``torch.optim.Adam``'s rule on the rows that got gradient.

    The step count ``t`` counts every :meth:`step` and fused backward. Rows
    without gradient keep their moments and do not move; the ``padding_idx``
    row never moves.

    Parameters
    ----------
    layer, lr : as in :class:`SGD`
        ``lr`` defaults to 1e-3.
    betas : (float, float), default (0.9, 0.999)
        Decay rates of the first and second moments, each in ``[0, 1)``.
    eps : float, default 1e-8
        Added to the bias-corrected root of the second moment, ``>= 0``.
    weight_decay : float, default 0.0
        As in :class:`SGD`.

    Raises
    ------
    TypeError, ValueError
        As in :class:`SGD`.

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

    def _kernel_hyper(self) -> dict[str, Any]:
        # torch.optim.Adam's scalars, in Python floats as it computes them.
        h = self._hyper
        lr, wd = h["lr"], h["weight_decay"]
        beta1, beta2 = h["betas"]
        t = self._step
        return {
            **_KERNEL_UNUSED,
            "kind": 1,
            "l2": not self._decoupled and wd != 0,
            "decoupled": self._decoupled and wd != 0,
            "weight_decay": wd,
            "decay": 1 - lr * wd,
            "w1": 1 - beta1,
            "beta2": beta2,
            "omb2": 1 - beta2,
            "bc2_sqrt": (1 - beta2**t) ** 0.5,
            "eps": h["eps"],
            "neg_step": -(lr / (1 - beta1**t)),
        }


class AdamW(Adam):
    """Lazy AdamW: Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    Rows without gradient do not decay.

    Parameters
    ----------
    layer, lr, betas, eps : as in :class:`Adam`
    weight_decay : float, default 1e-2
        Decoupled weight decay, ``>= 0``.

    Raises
    ------
    TypeError, ValueError
        As in :class:`Adam`.
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
