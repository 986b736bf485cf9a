"""Positions from an attention mask: left/right padding and incremental decoding."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _validation as v

__all__ = ["positions_from_mask"]


_INT64_MAX = int(np.iinfo(np.int64).max)
_INT64_MIN = int(np.iinfo(np.int64).min)
_OFFSET = f"a non-negative integer that fits in int64 (at most {_INT64_MAX})"


def _offsets(offset: Any, rows_shape: tuple[int, ...]) -> int | np.ndarray:
    """``offset`` as a Python int or an int64 array of one value per row."""
    if isinstance(offset, (bool, np.bool_)) or (
        hasattr(offset, "__index__") and not isinstance(offset, np.ndarray)
    ):
        return v.check_int(offset, "offset", min_value=0, max_value=_INT64_MAX, expected=_OFFSET)
    arr = np.asarray(offset)
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"offset must be a non-negative integer or an integer array with one value "
            f"per row; got {v.describe(offset)}"
        )
    if arr.ndim == 0:
        return _offsets(int(arr), rows_shape)
    if arr.shape != rows_shape:
        raise ValueError(
            f"an offset array must have one value per row, shape {rows_shape}; got {arr.shape}"
        )
    if arr.size:
        # Python ints: a uint64 maximum must not wrap on its way to int64.
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high > _INT64_MAX:
            raise ValueError(f"offset must be {_OFFSET}; got {low if low < 0 else high}")
    return arr.astype(np.int64)


def _check_fits(off: int | np.ndarray, tokens_per_row: np.ndarray) -> None:
    """Refuse an offset whose row's last position would pass the int64 maximum."""
    # room >= 0, as every offset is in [0, int64 max].
    room = np.subtract(_INT64_MAX, off, dtype=np.int64)
    too_far = (tokens_per_row > 0) & (tokens_per_row - 1 > room)
    if not too_far.any():
        return
    row = np.unravel_index(int(np.argmax(too_far)), too_far.shape)
    value = off if isinstance(off, int) else int(off[row])
    n = int(tokens_per_row[row])
    where = "" if isinstance(off, int) else f" (row {tuple(int(i) for i in row)})"
    raise ValueError(
        f"offset {value}{where} plus {n} tokens gives positions up to {value + n - 1}, "
        f"beyond the int64 maximum {_INT64_MAX}"
    )


def positions_from_mask(
    attention_mask: Any, *, offset: Any = 0, pad_position: int = 0
) -> np.ndarray:
    """Position ids for a padded batch from its attention mask.

    Each token's position is ``offset`` plus the number of tokens (mask 1)
    before it in its row; padding (mask 0) gets ``pad_position``. So a
    left-padded row ``[0, 0, 1, 1, 1]`` gets ``[p, p, 0, 1, 2]`` and a
    right-padded ``[1, 1, 1, 0, 0]`` gets ``[0, 1, 2, p, p]``.

    Parameters
    ----------
    attention_mask : array_like of shape (B, T)
        1 (or True) for a token, 0 (or False) for padding, in any real dtype;
        any number of leading axes (or one row ``(T,)``).
    offset : int or array_like of int, default 0
        Tokens already seen (incremental decoding): a non-negative int, or one
        value per row, shape ``(B,)`` (e.g. ``past_mask.sum(-1)``).
    pad_position : int, default 0
        Position given to padding.

    Returns
    -------
    ndarray of int64, the mask's shape

    Raises
    ------
    TypeError
        A mask that is not numeric, non-integer ``offset``/``pad_position``.
    ValueError
        A mask value other than 0 or 1, a 0-d mask, a negative offset, an
        offset array of the wrong shape, or a position (``offset`` plus the
        tokens of a row, or ``pad_position``) that does not fit in int64.

    Examples
    --------
    >>> positions_from_mask([[0, 0, 1, 1], [1, 1, 1, 1]])
    array([[0, 0, 0, 1],
           [0, 1, 2, 3]])

    Incremental decoding: one new token per row after the prompt above,
    with ``offset`` the tokens each row has seen so far:

    >>> positions_from_mask([[1], [1]], offset=[2, 4])
    array([[2],
           [4]])
    """
    mask = np.asarray(attention_mask)
    if not v.is_real(mask.dtype):
        raise TypeError(
            f"attention_mask must hold 0/1 (bool, integer or float); got dtype {mask.dtype}"
        )
    if mask.ndim == 0:
        raise ValueError("attention_mask must have shape (B, T) (or (T,)); got a 0-d array")
    pad = v.check_int(pad_position, "pad_position", min_value=_INT64_MIN, max_value=_INT64_MAX)
    if mask.dtype.kind != "b":
        bad = (mask != 0) & (mask != 1)
        if bad.any():
            value = mask[bad].flat[0]
            raise ValueError(
                f"attention_mask must hold only 0 (padding) and 1 (token); found {value.item()!r}"
            )
    is_token = mask.astype(bool)
    off = _offsets(offset, mask.shape[:-1])
    # Tokens before each entry = inclusive running count minus the entry itself.
    before = np.cumsum(is_token, axis=-1, dtype=np.int64)
    if before.size:
        _check_fits(off, before[..., -1])
    before -= is_token
    row_offset = off if isinstance(off, int) else off[..., None]
    # Only tokens get offset + count (padding's could pass the int64 maximum).
    positions = np.full(mask.shape, pad, dtype=np.int64)
    np.add(before, row_offset, out=positions, where=is_token)
    return positions
