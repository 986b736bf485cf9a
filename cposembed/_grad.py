"""The gradient of one table (a layer keeps one :class:`GradientState` per table):
the array, the rows it touched, the row it skips; and the rule of a step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from . import _blocks, _core, _marks, _routes
from . import _validation as v


class GradientState:
    """``grad``, the rows ``touched`` since the last zero (marks of ``touched_grad`` only),
    and the row that gets no gradient (``skip_row``; -1: none)."""

    __slots__ = ("grad", "touched", "touched_grad", "skip_row")

    def __init__(self, skip_row: int = -1) -> None:
        self.grad: np.ndarray | None = None
        self.touched: _marks.RowMarks | None = None
        self.touched_grad: np.ndarray | None = None
        self.skip_row = skip_row

    @property
    def padding_idx(self) -> int | None:
        return None if self.skip_row < 0 else self.skip_row

    def set_padding(self, padding_idx: int | None, table: np.ndarray) -> None:
        """A new skip row (in ``[0, L)``, or None), its gradient row zeroed and unmarked."""
        if padding_idx is not None and self.grad is not None:
            check_grad(self.grad, table)  # before anything changes
            self.grad[padding_idx] = 0
        self.skip_row = -1 if padding_idx is None else padding_idx
        if padding_idx is not None and self.touched is not None:
            self.touched.unmark(padding_idx)

    def restore(self, grad: np.ndarray | None, touched: np.ndarray | None) -> None:
        """The gradient and touched-rows mask of a checked pickled state."""
        self.grad = grad
        if touched is not None:
            self.touched = _marks.RowMarks(touched.shape[0], touched)
            self.touched_grad = grad

    def kept_touched(self) -> np.ndarray | None:
        """A copy of the mask, if it describes ``grad`` (what a pickle keeps)."""
        marks = self.step_marks(self.grad)
        return None if marks is None else np.array(marks.mask)

    def to_accumulate(self, table: np.ndarray) -> tuple[np.ndarray, _marks.RowMarks]:
        """The gradient a backward adds into and the rows to mark (kept by :meth:`keep`)."""
        grad = self.grad
        if grad is self.touched_grad and self.touched is not None and grad is not None:
            return grad, self.touched
        touched = _marks.RowMarks(table.shape[0])
        if grad is None:
            return _blocks.zeros(table.shape, v.work_dtype(table.dtype)), touched
        check_grad(grad, table)
        touched.mark_all()
        return grad, touched

    def keep(self, grad: np.ndarray, touched: _marks.RowMarks) -> None:
        self.grad = grad
        self.touched = touched
        self.touched_grad = grad

    def accumulate(
        self, table: np.ndarray, grad_output: Any, positions: Any, offset: Any
    ) -> np.ndarray:
        """``grad[positions[i]] += grad_output[i]``, marking the rows; the gradient."""
        grad, touched = self.to_accumulate(table)
        skip = self.skip_row
        # The entry first: the route's keyword call is slower on a tiny backward.
        if _core.scatter_add(grad, grad_output, positions, offset, None, touched, skip) is None:
            _routes.scatter_add(
                grad,
                grad_output,
                positions,
                offset=offset,
                num_threads=None,
                touched=touched,
                skip_row=skip,
            )
        if touched is not self.touched:
            self.keep(grad, touched)
        return grad

    def zero(self) -> None:
        """Zeros in the gradient (its buffer kept), no row touched."""
        grad, touched = self.grad, self.touched
        if grad is not None and touched is not None and grad is self.touched_grad:
            touched.zero_rows(grad)
            return
        if grad is not None:
            grad.fill(0)
        if touched is not None:
            touched.clear()

    def for_step(self, table: np.ndarray) -> np.ndarray | None:
        """``grad``, checked for a step on ``table`` (None: nothing to do)."""
        grad = self.grad
        if grad is not None:
            check_grad(grad, table, True)
        return grad

    def step_marks(self, grad: np.ndarray | None) -> _marks.RowMarks | None:
        """The rows a step on ``grad`` visits, as marks (None: every row)."""
        return self.touched if grad is self.touched_grad else None

    def step_rows(self, grad: np.ndarray, n_rows: int) -> np.ndarray:
        """The rows a step on ``grad`` visits, in the order first touched, but the skip row."""
        touched = self.step_marks(grad)
        rows = np.arange(n_rows) if touched is None else touched.rows()
        if self.skip_row >= 0:
            rows = rows[rows != self.skip_row]
        return rows


@dataclass(frozen=True, slots=True)
class Trainable:
    """One table an optimizer updates (``holder.embeddings``, read at each use) and its
    :class:`GradientState`."""

    holder: Any
    gradient: GradientState

    @property
    def table(self) -> np.ndarray:
        return self.holder.embeddings


class FusedOptimizer(Protocol):
    """What a layer's ``backward(..., optimizer=)`` takes: a cposembed optimizer."""

    def fused_backward(
        self, layer: Any, grad_output: Any, *inputs: Any, offset: Any = 0
    ) -> None: ...


def fused_backward_of(optimizer: Any) -> Callable[..., None]:
    """The optimizer's ``fused_backward``; a ``TypeError`` for anything else."""
    fused = getattr(optimizer, "fused_backward", None)
    if not callable(fused):
        raise TypeError(f"optimizer must be a cposembed optimizer; got {v.describe(optimizer)}")
    return fused


def check_grad(grad: Any, table: np.ndarray, step: bool = False) -> None:
    """A gradient of the table's shape: real for a step; float and writable for a backward."""
    if not isinstance(grad, np.ndarray) or not (
        v.is_real(grad.dtype) if step else v.is_float(v.native_dtype(grad.dtype))
    ):
        kind = "real-valued" if step else v.FLOAT_NAMES
        raise TypeError(
            f"grad must be a {kind} numpy.ndarray of the table's shape {table.shape}; "
            f"got {v.describe(grad)}"
        )
    if grad.shape != table.shape:
        raise ValueError(f"grad must have the table's shape {table.shape}; got {grad.shape}")
    if not (step or grad.flags.writeable):
        raise ValueError("grad is read-only; assign a writable array (or None)")


def sgd_step(table: np.ndarray, state: GradientState, grad: np.ndarray, lr: float) -> None:
    """``table -= lr * grad`` on the rows a step visits (a half table in float32)."""
    if _core.sgd_step(table, grad, state.step_marks(grad), lr, state.skip_row) is None:
        rows = state.step_rows(grad, table.shape[0])
        if v.is_half(table.dtype):
            work = v.work_dtype(table.dtype).type
            step = work(lr) * grad[rows].astype(work)
            table[rows] = (table[rows].astype(work) - step).astype(table.dtype)
        else:
            table[rows] -= lr * grad[rows]
