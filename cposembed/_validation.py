"""Every check the kernels rely on, in one place, before anything is written.

The kernels in ``src_c/`` trust their inputs. This module turns what users
pass into exactly what the kernels expect (C-contiguous float32/float64 rows,
int32/int64 positions known to lie in ``[-L, L)``) or raises a ``TypeError``,
``ValueError`` or ``IndexError`` that says what was expected and what came.
As in pandas' ``validate_indices``, bounds are checked with the minimum and
maximum of the whole index array, so ``L`` and ``-L - 1`` cannot slip through.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import numpy as np

from . import _kernels

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_INT32 = np.dtype(np.int32)
_INT64 = np.dtype(np.int64)
# Element kinds NumPy can add to a float table: bool, signed, unsigned, float.
_REAL_KINDS = "biuf"


class Positions(NamedTuple):
    """Positions ready for a kernel.

    ``flat`` is a 1-D C-contiguous int32/int64 array with every value in
    ``[-L, L)``; ``shape`` is the shape of the index (the result has
    ``shape + (d,)``). ``flat is None`` means the index also reaches into the
    embedding axis (a tuple such as ``(slice(None), 0)``): only NumPy's own
    indexing can serve it.
    """

    flat: np.ndarray | None
    shape: tuple[int, ...] | None


def describe(value: Any) -> str:
    """Short description of a value for error messages."""
    if isinstance(value, np.ndarray):
        return f"array of shape {value.shape} and dtype {value.dtype}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _range_error(bad: int, n_rows: int) -> IndexError:
    return IndexError(
        f"position {bad} is out of range for a table of {n_rows} positions "
        f"(expected {-n_rows} <= position < {n_rows})"
    )


def _from_int_array(arr: np.ndarray, n_rows: int) -> Positions:
    shape = arr.shape
    dt = arr.dtype
    if arr.size and dt.kind == "u" and dt.itemsize >= 8:
        # uint64 values above int64's range would wrap when converted.
        hi = int(arr.max())
        if hi >= n_rows:
            raise _range_error(hi, n_rows)
    if dt == _INT32 or dt == _INT64:
        target = dt
    elif dt.itemsize < 4 or (dt.kind == "i" and dt.itemsize == 4):
        target = _INT32  # int8/16, uint8/16, non-native int32: fit in int32
    else:
        target = _INT64  # uint32, uint64, non-native int64
    flat = np.ascontiguousarray(arr, dtype=target).reshape(-1)
    if flat.size:
        lo, hi = _kernels.index_bounds(flat)
        if hi >= n_rows:
            raise _range_error(hi, n_rows)
        if lo < -n_rows:
            raise _range_error(lo, n_rows)
    return Positions(flat, shape)


def as_positions(positions: Any, n_rows: int) -> Positions:
    """Validate any NumPy-style index into the rows of an ``(n_rows, d)`` table.

    Integers and integer arrays (any integer dtype, any shape) are checked
    against ``[-n_rows, n_rows)``. Everything else NumPy accepts along the
    first axis (boolean masks, slices, ``None``, ``...``) is translated into
    the equivalent integer positions. Floats, strings and other non-indices
    raise ``IndexError`` as NumPy does.
    """
    if isinstance(positions, (int, np.integer)) and not isinstance(positions, bool):
        p = int(positions)
        if not -n_rows <= p < n_rows:
            raise _range_error(p, n_rows)
        return Positions(np.array([p], dtype=_INT64), ())

    arr = None
    if isinstance(positions, np.ndarray):
        arr = positions
    elif isinstance(positions, list):
        try:
            arr = np.asarray(positions)
        except (ValueError, TypeError, OverflowError):
            arr = None  # ragged or huge: NumPy's own indexing gives the error
        else:
            if arr.size == 0 and arr.dtype.kind == "f":
                arr = arr.astype(np.intp)  # NumPy reads [] as an empty index
            elif arr.dtype.kind in "fO":
                _check_huge_ints(positions, n_rows)
    if arr is not None and arr.dtype.kind in "iu":
        return _from_int_array(arr, n_rows)
    return _from_general(positions, n_rows)


def _check_huge_ints(positions: list, n_rows: int) -> None:
    # NumPy turns a list holding an int beyond int64 into float64 or object
    # and then rejects it as "not an integer"; it is an integer out of range.
    try:
        items = np.asarray(positions, dtype=object).reshape(-1)
    except (ValueError, TypeError):
        return
    if all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in items):
        for x in items:
            if not -n_rows <= int(x) < n_rows:
                raise _range_error(int(x), n_rows)


def _from_general(positions: Any, n_rows: int) -> Positions:
    # An index that may also address the embedding axis: a tuple (one index
    # per axis) or a boolean mask of more than one dimension. Only NumPy's own
    # indexing serves it (lookup does; add and scatter-add reject it).
    if isinstance(positions, tuple) or (
        isinstance(positions, np.ndarray) and positions.dtype == bool and positions.ndim > 1
    ):
        multi_axis = True
        if isinstance(positions, tuple) and any(p is Ellipsis for p in positions):
            return Positions(None, None)  # "..." means other axes for a 1-D arange
    else:
        multi_axis = False
    # Indexing arange(n_rows) the same way yields the row numbers the index
    # selects, in the shape it selects them (masks, slices, newaxis).
    try:
        rows = np.arange(n_rows, dtype=np.intp)[positions]
    except IndexError as exc:
        if multi_axis:
            return Positions(None, None)
        raise IndexError(f"invalid positions ({exc}); got {describe(positions)}") from None
    rows = np.asarray(rows)
    return Positions(np.ascontiguousarray(rows).reshape(-1), rows.shape)


def as_offset(offset: Any) -> int:
    if isinstance(offset, bool) or not hasattr(offset, "__index__"):
        raise TypeError(f"offset must be a non-negative integer; got {describe(offset)}")
    value = operator.index(offset)
    if value < 0:
        raise ValueError(f"offset must be a non-negative integer; got {value}")
    return value


def native_dtype(dtype: np.dtype) -> np.dtype:
    """``dtype`` in this machine's byte order (``>f4`` is float32 too)."""
    return dtype.newbyteorder("=")


def as_table(table: Any, name: str = "table") -> np.ndarray:
    """A 2-D float32/float64 array, C-contiguous (copied only if it is not)."""
    arr = np.asarray(table)
    if not arr.dtype.isnative and native_dtype(arr.dtype) in FLOAT_DTYPES:
        arr = arr.astype(native_dtype(arr.dtype))  # e.g. a big-endian checkpoint
    if arr.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float32 or float64; got {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (max_seq_len, embed_dim); got shape {arr.shape}")
    return np.ascontiguousarray(arr)


def as_rows(values: Any, d: int, name: str) -> np.ndarray:
    """An array of real numbers whose last axis has length ``d``."""
    arr = np.asarray(values)
    if arr.dtype.kind not in _REAL_KINDS:
        raise TypeError(
            f"{name} must hold real numbers (bool, integer or float); got dtype {arr.dtype}"
        )
    if arr.ndim < 1 or arr.shape[-1] != d:
        raise ValueError(
            f"{name} must have shape (..., {d}) to match the table's embed_dim {d}; "
            f"got shape {arr.shape}"
        )
    return arr


def check_out(out: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``out`` must be a writable ndarray of exactly ``shape`` and ``dtype``."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray; got {describe(out)}")
    if out.shape != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}; got {out.shape}")
    if out.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype}; got {out.dtype}")
    if not out.flags.writeable:
        raise ValueError("out is read-only; pass a writable array")
    return out


def broadcast_positions(
    pos: Positions, lead: tuple[int, ...], what: str
) -> tuple[np.ndarray, tuple[int, ...]]:
    """Positions for rows laid out as ``lead`` (e.g. ``(B, T)``).

    Returns ``(flat, core)`` such that row ``i`` of the ``prod(lead)`` rows
    uses ``flat[i % flat.size]`` and ``core`` is the shape the positions
    broadcast as. When the positions only repeat along leading axes (the
    usual ``(T,)`` against ``(B, T)``) ``flat`` is the validated array itself;
    otherwise the broadcast is materialised (positions are ``d`` times smaller
    than the rows they index).
    """
    if pos.flat is None:
        raise IndexError(
            "positions must select rows of the table (integers, integer arrays, "
            "boolean masks or slices); an index into the embedding axis only works "
            "with lookup"
        )
    pshape = pos.shape
    assert pshape is not None  # set whenever flat is (for mypy)
    try:
        full = np.broadcast_shapes(pshape, lead)
    except ValueError:
        full = None
    if full != tuple(lead):
        raise ValueError(f"positions of shape {pshape} do not broadcast to {what} {tuple(lead)}")
    core = pshape
    while core and core[0] == 1:
        core = core[1:]
    if core == tuple(lead[len(lead) - len(core) :]):
        return pos.flat, core
    expanded = np.broadcast_to(pos.flat.reshape(pshape), lead)
    return np.ascontiguousarray(expanded).reshape(-1), tuple(lead)


def default_positions(offset: int, n_tokens: int, n_rows: int) -> np.ndarray:
    """``offset + arange(T)``, checked against the table length."""
    if n_tokens and offset + n_tokens > n_rows:
        raise IndexError(
            f"position {offset + n_tokens - 1} (offset {offset} + {n_tokens} tokens) is "
            f"out of range for a table of {n_rows} positions "
            f"(expected 0 <= position < {n_rows})"
        )
    dtype = _INT32 if offset + n_tokens < 2**31 else _INT64
    return np.arange(offset, offset + n_tokens, dtype=dtype)


def overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether writing ``a`` could change ``b`` (a cheap, conservative test)."""
    return bool(np.may_share_memory(a, b))
