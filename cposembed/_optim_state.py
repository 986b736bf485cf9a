"""The optimizers' per-row state, the checks of hyper-parameters and saved states
(worded as ``torch.optim`` words them), and the distinct rows of a fused backward."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _blocks, _core, _marks
from . import _validation as v

# Version of what state_dict() returns and pickle stores.
STATE_VERSION = 1


def state_dtype(table_dtype: np.dtype) -> np.dtype:
    """The dtype of an optimizer's state (and of its arithmetic) for a table dtype.

    Parameters
    ----------
    table_dtype : numpy.dtype
        The dtype of the table.

    Returns
    -------
    numpy.dtype
        ``float64`` for a float64 table, else ``float32`` (the dtype of its gradient).
    """
    return v.work_dtype(table_dtype)


def real(value: Any, name: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not v.is_real_scalar(value):
        raise TypeError(f"{name} must be a real number; got {v.describe(value)}")
    return float(value)


def at_least_zero(value: Any, name: str, message: str) -> float:
    x = real(value, name)
    if not (math.isfinite(x) and x >= 0.0):
        raise ValueError(f"{message}: {value}")
    return x


def check_betas(pair: Any) -> tuple[float, float]:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2); got {v.describe(pair)}")
    out = []
    for i, beta in enumerate(pair):
        b = real(beta, f"betas[{i}]")
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        out.append(b)
    return out[0], out[1]


class RowState:
    """One table's state: an ``(L, d)`` array per buffer and each row's slot in them."""

    def __init__(self, names: tuple[str, ...], shape: tuple[int, int], dtype: np.dtype) -> None:
        self.names = names
        self.dtype = dtype
        self.buffers = {name: _blocks.zeros(shape, dtype, growing=True) for name in names}
        self.slots = _marks.RowSlots(shape[0] if names else 0)

    def export(self) -> dict[str, np.ndarray]:
        """Copies of the state in row order: ``rows`` and one ``(n, d)`` array per buffer."""
        rows = self.slots.rows()
        order = np.argsort(rows, kind="stable")
        return {"rows": rows[order], **{name: buf[order] for name, buf in self.buffers.items()}}

    @classmethod
    def restore(cls, names: tuple[str, ...], table: np.ndarray, data: Any, what: str) -> RowState:
        """The state of ``table`` from a state dict's ``data``, checked whole first."""
        dt = state_dtype(table.dtype)
        keys = {"rows", *names}
        if not isinstance(data, dict) or set(data) != keys:
            raise ValueError(
                f"{what} must be a dict with the keys {sorted(keys)}; got {v.describe(data)}"
            )
        rows = data["rows"]
        if not isinstance(rows, np.ndarray) or rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise ValueError(f"{what}['rows'] must be a 1-D integer array; got {v.describe(rows)}")
        rows = rows.astype(np.int64)
        n_rows, d = table.shape
        if rows.size and (rows[0] < 0 or rows[-1] >= n_rows or not np.all(rows[1:] > rows[:-1])):
            raise ValueError(
                f"{what}['rows'] must be sorted, distinct rows in [0, {n_rows}) of the table"
            )
        for name in names:
            buf = data[name]
            if not isinstance(buf, np.ndarray) or buf.dtype != dt or buf.shape != (rows.size, d):
                raise ValueError(
                    f"{what}[{name!r}] must be a {dt} array of shape "
                    f"({rows.size}, {d}); got {v.describe(buf)}"
                )
        state = cls(names, table.shape, dt)
        if names:
            for name in names:
                state.buffers[name][: rows.size] = data[name]
            state.slots = _marks.RowSlots(table.shape[0], rows)
        return state


def check_saved(state: Any, optimizer: str, hyper_keys: tuple[str, ...]) -> None:
    """The frame of a ``state_dict()`` of ``optimizer`` (a class name) with these keys."""
    keys = ("version", "optimizer", "hyperparameters", "step", "state")
    if not isinstance(state, dict) or set(state) != set(keys):
        problem = f" must be a dict from state_dict() with the keys {', '.join(keys)}"
        problem += f"; got {v.describe(state)}"
    elif state["version"] != STATE_VERSION:
        problem = f" has version {v.describe(state['version'])}"
        problem += f"; this cposembed reads {STATE_VERSION}"
    elif state["optimizer"] != optimizer:
        problem = f" is of a {v.describe(state['optimizer'])} optimizer; this is a {optimizer}"
    elif not isinstance(h := state["hyperparameters"], dict) or set(h) != set(hyper_keys):
        problem = f": hyperparameters must be a dict with the keys {sorted(hyper_keys)}"
        problem += f"; got {v.describe(h)}"
    else:
        return
    raise ValueError(f"optimizer state{problem}")


def call_rows(
    pos: np.ndarray | None, off: int, lead: tuple[int, ...], n_rows: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """The distinct rows a backward of rows shaped ``lead`` adds into, and the positions
    into a compact scratch of them (None for ``pos=None``: rows ``off .. off + T - 1``)."""
    if int(np.prod(lead)) == 0:
        return np.empty(0, dtype=np.int64), np.zeros(lead, dtype=np.int64)
    if pos is None:
        return np.arange(off, off + lead[-1], dtype=np.int64), None
    flat = np.ascontiguousarray(np.broadcast_to(pos, lead), dtype=np.int64).reshape(-1)
    found = _core.distinct_rows(flat, n_rows)
    if found is None:  # int64 rows in range: the entry takes them
        raise RuntimeError("distinct_rows refused its rows")
    rows, slots, _ = found
    return rows, slots.reshape(lead)
