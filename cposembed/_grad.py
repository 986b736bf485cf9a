"""The gradient of one table: the array, the rows it touched, the row it skips.

:class:`~cposembed.LearnedPositionEmbedding` keeps one :class:`GradientState`,
:class:`~cposembed.TokenPositionEmbedding` one per table (those of its two
tables), and the optimizers (:mod:`cposembed.optim`) read theirs: every rule
about the gradient a backward accumulates into, which rows a step visits and
which row never moves is here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from . import _blocks, _core, _marks, _routes
from . import _validation as v


class GradientState:
    """``grad`` (None until the first backward), the rows touched since the last
    zero, and the row that gets no gradient (``padding_idx``; -1: none).

    ``touched`` (a :class:`~cposembed._marks.RowMarks`: a mask and the list of
    the marked rows, so that zeroing and stepping cost the touched rows, not
    the table) describes ``touched_grad``, the array it was built for: if the
    user assigns another array to ``grad``, the marks are not trusted and
    every row counts as touched.
    """

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
        """A new skip row (normalised to ``[0, L)``, or None): its gradient row is
        zeroed and unmarked now, as no backward has given it any."""
        grad = self.grad
        if padding_idx is not None and grad is not None:
            check_grad(grad, table)  # before anything changes
            grad[padding_idx] = 0
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
        if self.touched_grad is not self.grad or self.touched is None:
            return None
        return np.array(self.touched.mask)

    # -- backward ------------------------------------------------------------
    def to_accumulate(self, table: np.ndarray) -> tuple[np.ndarray, _marks.RowMarks]:
        """The gradient a backward adds into, and the touched rows to mark.

        A fresh gradient is zeros in :func:`~cposembed._validation.work_dtype`
        (the table's dtype; float32 for a float16 or bfloat16 table, a master
        gradient). It is kept (:meth:`keep`) only once the call has
        succeeded, so an invalid first call leaves ``grad`` as None. A
        ``grad`` the user assigned is checked, and all its rows count as
        touched (it may hold anything).
        """
        grad = self.grad
        if grad is not None and grad is self.touched_grad and self.touched is not None:
            return grad, self.touched
        fresh = grad is None
        if grad is None:
            grad = _blocks.zeros(table.shape, v.work_dtype(table.dtype))
        check_grad(grad, table)
        touched = _marks.RowMarks(table.shape[0])
        if not fresh:
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
        # The entry directly first: the route's keyword call would be a good part
        # of a tiny backward's time. Arguments it refuses go to the route.
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
        """Zeros in the gradient (its buffer kept), no row touched: at the cost
        of the touched rows when the marks describe the gradient."""
        grad, touched = self.grad, self.touched
        if grad is not None and touched is not None and grad is self.touched_grad:
            touched.zero_rows(grad)
            return
        if grad is not None:
            grad.fill(0)
        if touched is not None:
            touched.clear()

    # -- steps ---------------------------------------------------------------
    def for_step(self, table: np.ndarray) -> np.ndarray | None:
        """``grad``, checked for a step on ``table`` (None: nothing to do)."""
        grad = self.grad
        if grad is None:
            return None
        if not isinstance(grad, np.ndarray) or not v.is_real(grad.dtype):
            raise TypeError(f"grad must be a real-valued numpy.ndarray; got {v.describe(grad)}")
        if grad.shape != table.shape:
            raise ValueError(f"grad must have the table's shape {table.shape}; got {grad.shape}")
        return grad

    def step_marks(self, grad: np.ndarray) -> _marks.RowMarks | None:
        """The rows a step on ``grad`` visits, as marks (None: every row)."""
        return self.touched if grad is self.touched_grad else None

    def step_rows(self, grad: np.ndarray, n_rows: int) -> np.ndarray:
        """The rows a step on ``grad`` visits: the touched ones in the order
        they were first touched (every row of an assigned gradient), the skip
        row left out."""
        touched = self.step_marks(grad)
        rows = np.arange(n_rows) if touched is None else touched.rows()
        if self.skip_row >= 0:
            rows = rows[rows != self.skip_row]
        return rows


class _HoldsTable(Protocol):
    @property
    def embeddings(self) -> np.ndarray: ...


class Trainable:
    """One table an optimizer updates, as a layer's ``trainable_tables()`` gives
    it: the table (read through its holder, so that a table assigned later is
    the one stepped) and its :class:`GradientState`."""

    __slots__ = ("_holder", "gradient")

    def __init__(self, holder: _HoldsTable, gradient: GradientState) -> None:
        self._holder = holder
        self.gradient = gradient

    @property
    def table(self) -> np.ndarray:
        return self._holder.embeddings


class FusedOptimizer(Protocol):
    """What a layer's ``backward(..., optimizer=)`` takes: a cposembed optimizer."""

    def fused_backward(
        self, layer: Any, grad_output: Any, *inputs: Any, offset: Any = 0
    ) -> None: ...


def fused_backward_of(optimizer: Any) -> Callable[..., None]:
    """What a layer's ``backward(..., optimizer=optimizer)`` hands its gradient to:
    the optimizer's ``fused_backward``; a ``TypeError`` for anything else."""
    fused = getattr(optimizer, "fused_backward", None)
    if not callable(fused):
        raise TypeError(f"optimizer must be a cposembed optimizer; got {v.describe(optimizer)}")
    return fused


def check_grad(grad: Any, table: np.ndarray) -> None:
    """A gradient a backward may accumulate into: a writable float ndarray (any of
    the four float dtypes, whatever the table's) of the table's shape."""
    if not isinstance(grad, np.ndarray) or not v.is_float(v.native_dtype(grad.dtype)):
        raise TypeError(
            f"grad must be a {v.FLOAT_NAMES} numpy.ndarray of the table's shape "
            f"{table.shape}; got {v.describe(grad)}"
        )
    if grad.shape != table.shape:
        raise ValueError(f"grad must have the table's shape {table.shape}; got {grad.shape}")
    if not grad.flags.writeable:
        raise ValueError("grad is read-only; assign a writable array (or None)")


def sgd_step(table: np.ndarray, state: GradientState, grad: np.ndarray, lr: float) -> None:
    """``table -= lr * grad`` on the rows a step visits (``grad`` from
    :meth:`GradientState.for_step`): the kernel, else NumPy's own arithmetic
    under the same rule, for a gradient the kernel does not take.

    A float32 or float64 table: NumPy's ``table[rows] -= lr * grad[rows]``. A
    float16 or bfloat16 table: ``T(float32(row) - float32(lr) * float32(grad))``,
    a multiply, then a subtract, in float32, and one rounding to the table's
    dtype ``T`` (the kernel's rule for a float32 gradient; another gradient dtype
    is converted to float32 first).
    """
    if _core.sgd_step(table, grad, state.step_marks(grad), lr, state.skip_row) is None:
        rows = state.step_rows(grad, table.shape[0])
        if v.is_half(table.dtype):
            work = v.work_dtype(table.dtype).type
            step = work(lr) * grad[rows].astype(work)
            table[rows] = (table[rows].astype(work) - step).astype(table.dtype)
        else:
            table[rows] -= lr * grad[rows]
