"""The checks behind every worded error: each normalises an argument the C entries
refused into a form they take, or raises the error that says what was expected and
what came."""

from __future__ import annotations

import math
import operator
import sys
from typing import Any

import numpy as np

from . import _core

# ml_dtypes' bfloat16, imported when first asked for. Its kind is 'V', so "is it a
# float" is asked of is_float or is_real, never of the dtype's kind.
bfloat16 = _core.bfloat16
_FLOAT16 = np.dtype(np.float16)
_FULL_FLOATS = (np.dtype(np.float32), np.dtype(np.float64), _FLOAT16)
FLOAT_NAMES = "float16, bfloat16, float32 or float64"
_INT64 = np.dtype(np.int64)
_REAL_KINDS = "biuf"  # element kinds NumPy adds to a float table, besides bfloat16
# Scalars a real-valued argument (a learning rate, ...) may be, besides bfloat16.
_REAL_SCALARS = (int, float, np.integer, np.floating)


def is_bfloat16(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is NumPy's bfloat16 in native byte order."""
    if dtype.kind != "V" or dtype.itemsize != 2:
        return False
    bf = _core.loaded_bfloat16()
    return bf is not None and dtype == bf


def is_half(dtype: np.dtype) -> bool:
    """float16 or bfloat16, in native byte order."""
    return dtype == _FLOAT16 or is_bfloat16(dtype)


def is_float(dtype: np.dtype) -> bool:
    """One of the table dtypes (:data:`FLOAT_NAMES`), in native byte order."""
    return dtype in _FULL_FLOATS or is_bfloat16(dtype)


def is_real_scalar(value: Any) -> bool:
    """A real number (bools too; the callers refuse them first)."""
    return isinstance(value, _REAL_SCALARS) or (
        isinstance(value, np.generic) and is_bfloat16(value.dtype)
    )


class NotAnIntegerError(TypeError, ValueError):
    """An integer argument that is not an integer (``1.5``, ``"3"``, ``True``).

    Both a ``TypeError`` (as NumPy and PyTorch raise for such a size) and a
    ``ValueError`` (as the handbook's class promises for ``max_seq_len`` and
    ``embed_dim``). An integer out of range is a plain ``ValueError``.
    """


NotAnIntegerError.__module__ = "cposembed"  # public as cposembed.NotAnIntegerError


def describe(value: Any) -> str:
    """Short description of a value for error messages (NumPy scalars as Python values)."""
    if isinstance(value, np.ndarray):
        return f"array of shape {value.shape} and dtype {value.dtype}"
    value = _python_values(value)
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _python_values(value: Any, depth: int = 0) -> Any:
    # NumPy scalars as Python values, also inside (nested) lists and tuples.
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)) and depth < 3 and len(value) <= 20:
        items = [_python_values(x, depth + 1) for x in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def check_int(
    value: Any,
    name: str,
    *,
    min_value: int | None = None,
    max_value: int | None = None,
    expected: str | None = None,
) -> int:
    """``value`` (anything with ``__index__`` but a bool) as a Python int in
    ``[min_value, max_value]``, as ``sklearn.utils.check_scalar``; the message says
    ``expected``, else the range in words."""
    expected = expected or _int_range_text(min_value, max_value)
    try:
        if isinstance(value, (bool, np.bool_)) or (
            isinstance(value, np.ndarray) and value.ndim != 0
        ):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise NotAnIntegerError(f"{name} must be {expected}; got {describe(value)}") from None
    if (min_value is not None and n < min_value) or (max_value is not None and n > max_value):
        raise ValueError(f"{name} must be {expected}; got {n}")
    return n


def padding_index(value: Any, n_rows: int, name: str = "padding_idx") -> int | None:
    """``padding_idx`` (None, or an integer in ``[-L, L)``) normalised to ``[0, L)``."""
    if value is None:
        return None
    p = check_int(value, name, min_value=-n_rows, max_value=n_rows - 1)
    return p + n_rows if p < 0 else p


def is_real(dtype: np.dtype) -> bool:
    """Whether ``dtype`` holds real numbers: bool, integer, float or bfloat16 (either
    byte order)."""
    return dtype.kind in _REAL_KINDS or is_bfloat16(native_dtype(dtype))


def work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype of a table's gradient, optimizer state and steps: float64 for
    float64, else float32 (a float16 or bfloat16 table's master gradient)."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def check_not_mixed_halves(a: np.dtype, a_name: str, b: np.dtype, b_name: str) -> None:
    """float16 with bfloat16 in an add: a ``TypeError`` (they have no common dtype)."""
    a, b = native_dtype(a), native_dtype(b)
    if is_half(a) and is_half(b) and (a == _FLOAT16) != (b == _FLOAT16):
        raise TypeError(
            f"{a_name} and {b_name} must not mix float16 with bfloat16 (they have no "
            f"common dtype; convert one, to float32 say); got {a_name} of dtype {a} and "
            f"{b_name} of dtype {b}"
        )


def learning_rate(lr: Any) -> float:
    """A step's ``lr``: any finite real number, as a Python float."""
    if isinstance(lr, (bool, np.bool_)) or not is_real_scalar(lr):
        raise TypeError(f"lr must be a real number; got {describe(lr)}")
    try:
        value = float(lr)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"lr must be finite; got {value}")
    return value


def table_dtype(dtype: Any) -> np.dtype:
    """A class's ``dtype=``: float32 (also for None, as in NumPy), float64, float16 or
    bfloat16, as a dtype or anything ``np.dtype`` reads as one (``"bfloat16"``,
    ``ml_dtypes.bfloat16``, ``"f2"``)."""
    if dtype is None:
        return np.dtype(np.float32)
    try:
        dt = bfloat16() if isinstance(dtype, str) and dtype == "bfloat16" else np.dtype(dtype)
    except TypeError:
        dt = None
    # (`dt is None` first: NumPy compares None equal to float64.)
    if dt is None or not is_float(dt):
        # A dtype NumPy knows by its name (int8, not <class 'numpy.int8'>).
        got = repr(dtype) if dt is None else dt.name
        if dt is not None and not dt.isnative:
            got += ", big-endian" if dt.byteorder == ">" else ", little-endian"
        raise TypeError(f"dtype must be {FLOAT_NAMES}; got {got}")
    return dt


def _int_range_text(lo: int | None, hi: int | None) -> str:
    if lo == 1 and hi is None:
        return "a positive integer"
    if lo == 0 and hi is None:
        return "a non-negative integer"
    if lo is not None and hi is not None:
        return f"an integer in [{lo}, {hi}]"
    return "an integer"


def refuse_masked(value: Any, name: str) -> None:
    """Masked arrays are refused: dropping the mask would turn padding into data.
    (numpy.ma is asked only once imported: no masked array exists before.)"""
    ma = sys.modules.get("numpy.ma")
    if ma is not None and isinstance(value, ma.MaskedArray):
        raise TypeError(
            f"{name} is a masked array; cposembed does not propagate masks. Pass "
            f"{name}.filled(...) or {name}.data, and apply the mask to the result"
        )


def native_dtype(dtype: np.dtype) -> np.dtype:
    """``dtype`` in this machine's byte order (``>f4`` is float32 too)."""
    return dtype.newbyteorder("=")


def as_table(table: Any, name: str = "table") -> np.ndarray:
    """A 2-D ndarray of a table dtype (:func:`is_float`), native byte order, C-contiguous
    (copied only if not)."""
    refuse_masked(table, name)
    arr = np.asarray(table)
    if not arr.dtype.isnative and is_float(native_dtype(arr.dtype)):
        arr = arr.astype(native_dtype(arr.dtype))  # e.g. a big-endian checkpoint
    if not is_float(arr.dtype):
        raise TypeError(f"{name} must have dtype {FLOAT_NAMES}; got {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (max_seq_len, embed_dim); got shape {arr.shape}")
    return canonical_copy(arr, arr.dtype)


def as_positions(positions: Any, n_rows: int, what: str = "position") -> np.ndarray | None:
    """Any NumPy index into the rows of an ``(n_rows, d)`` table as an owned int64
    array of rows in ``[0, n_rows)``, in the index's shape; None for an index into the
    embedding axis too (``(slice(None), 0)``), which only NumPy's indexing serves.
    Masks, slices, ``None`` and ``...`` become integers first (``_integer_index``);
    ``_core.index_rows`` holds the range rule."""
    refuse_masked(positions, "positions" if what == "position" else "token_ids")
    rows = _core.index_rows(positions, n_rows)
    if rows is not None:
        return rows
    index = _integer_index(positions, n_rows, what)
    if index is None:
        return None
    rows = _core.index_rows(index, n_rows)
    if rows is not None:
        return rows
    try:
        # Flat and in native byte order, as the reader takes any number of axes.
        dtype = _INT64 if index.dtype == object else native_dtype(index.dtype)
        rows = _core.index_rows(np.ascontiguousarray(index, dtype=dtype).reshape(-1), n_rows)
    except OverflowError:
        rows = None  # a Python int beyond int64
    if rows is None:
        raise _range_error(index, n_rows, what)
    return rows.reshape(index.shape)


def _range_error(index: np.ndarray, n_rows: int, what: str) -> IndexError:
    # Names the largest value if it is above the range, else the smallest, as
    # pandas' validate_indices does.
    hi, lo = int(index.max()), int(index.min())
    rows = "positions" if what == "position" else "tokens"
    return IndexError(
        f"{what} {hi if hi >= n_rows else lo} is out of range for a table of {n_rows} {rows} "
        f"(expected {-n_rows} <= {what} < {n_rows})"
    )


def _integer_index(positions: Any, n_rows: int, what: str) -> np.ndarray | None:
    # `positions` as an integer array (object dtype for ints beyond int64), or
    # None for an index that may address the embedding axis too (a tuple, or a
    # boolean mask of more than one dimension).
    if _is_int(positions):
        return np.array(int(positions), dtype=object)
    if isinstance(positions, np.ndarray) and positions.dtype.kind in "iu":
        return positions
    if isinstance(positions, list):
        try:
            arr = np.asarray(positions)
        except (ValueError, TypeError, OverflowError):
            arr = None  # ragged or huge: NumPy's own indexing gives the error
        if arr is not None and arr.dtype.kind in "iu":
            return arr
        if arr is not None and arr.size == 0 and arr.dtype.kind == "f":
            return arr.astype(_INT64)  # NumPy reads [] as an empty index
        if arr is not None and arr.dtype.kind in "fO":
            # A list holding an int beyond int64 becomes float64 or object.
            items = np.asarray(positions, dtype=object)
            if all(_is_int(x) for x in items.flat):
                return items
    multi_axis = isinstance(positions, tuple) or (
        isinstance(positions, np.ndarray) and positions.dtype == bool and positions.ndim > 1
    )
    if isinstance(positions, tuple) and any(p is Ellipsis for p in positions):
        return None  # "..." means other axes for a 1-D arange
    # arange(n_rows) indexed the same way gives the rows the index selects.
    try:
        return np.arange(n_rows, dtype=_INT64)[positions]
    except IndexError as exc:
        if multi_axis:
            return None
        label = "positions" if what == "position" else "token_ids"
        raise IndexError(f"invalid {label} ({exc}); got {describe(positions)}") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def as_rows(values: Any, d: int, name: str) -> np.ndarray:
    """An ndarray of real numbers whose last axis has length ``d``."""
    refuse_masked(values, name)
    arr = np.asarray(values)
    if not is_real(arr.dtype):
        raise TypeError(
            f"{name} must hold real numbers (bool, integer or float); got dtype {arr.dtype}"
        )
    if arr.ndim < 1 or arr.shape[-1] != d:
        raise ValueError(
            f"{name} must have shape (..., {d}) to match the table's embed_dim {d}; "
            f"got shape {arr.shape}"
        )
    return arr


def as_grad_table(grad: Any, name: str) -> np.ndarray:
    """A writable 2-D ndarray of a table dtype, any layout or byte order."""
    if not isinstance(grad, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray; got {describe(grad)}")
    refuse_masked(grad, name)
    if not is_float(native_dtype(grad.dtype)):
        raise TypeError(f"{name} must have dtype {FLOAT_NAMES}; got {grad.dtype}")
    if grad.ndim != 2:
        raise ValueError(f"{name} must be 2-D (L, d); got shape {grad.shape}")
    if not grad.flags.writeable:
        raise ValueError(f"{name} is read-only; pass a writable array")
    return grad


def check_out(out: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``out`` must be a writable ndarray of exactly ``shape`` and ``dtype``."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray; got {describe(out)}")
    refuse_masked(out, "out")
    if out.shape != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}; got {out.shape}")
    if out.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype}; got {out.dtype}")
    if not out.flags.writeable:
        raise ValueError("out is read-only; pass a writable array")
    return out


def broadcast_positions(pos: np.ndarray, lead: tuple[int, ...], what: str) -> np.ndarray:
    """Positions checked to broadcast to the rows' ``lead`` shape (``(B, T)``, say)
    and materialised there."""
    # By hand: np.broadcast_shapes stops at 32 axes, NumPy 2 arrays have up to 64.
    fits = len(pos.shape) <= len(lead) and all(
        p in (1, n) for p, n in zip(pos.shape[::-1], lead[::-1])
    )
    if not fits:
        raise ValueError(f"positions of shape {pos.shape} do not broadcast to {what} {lead}")
    if pos.shape == tuple(lead):
        return pos
    return np.ascontiguousarray(np.broadcast_to(pos, lead))


def overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether writing ``a`` could change ``b``: the entries' ``_core.disjoint``,
    else NumPy's bounds."""
    return not _core.disjoint(a, b) and bool(np.may_share_memory(a, b))


def canonical_copy(arr: Any, dtype: Any) -> np.ndarray:
    """``arr`` itself if the entries take it for ``dtype`` (``_core.is_canonical``),
    else an exact, C-contiguous, aligned copy (``np.ascontiguousarray`` keeps a
    misaligned array)."""
    if _core.is_canonical(arr, dtype):
        return arr
    return np.require(arr, dtype=dtype, requirements=["C", "A", "E"])
