"""The NumPy (with ml_dtypes) answers of the half-precision tests, computed on
copies, and the one bitwise comparison they share."""

from __future__ import annotations

import numpy as np
from strategies import BFLOAT16, TABLE_DTYPES

PAIRS = [(a, b) for a in TABLE_DTYPES for b in TABLE_DTYPES]


def pair_id(pair) -> str:
    return "-".join(np.dtype(dt).name for dt in pair)


def no_common_type(*dtypes) -> bool:
    """float16 together with bfloat16: no common type (API.md section 9)."""
    names = {np.dtype(dt) for dt in dtypes}
    return np.dtype(np.float16) in names and BFLOAT16 in names


def uint_bits(a: np.ndarray) -> np.ndarray:
    """``a``'s elements as unsigned integers of their size: the bits compared."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.size else a.view(np.uint8)


def is_nan(a) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.isnan(np.asarray(a).astype(np.float64))


def _non_finite(a) -> np.ndarray:
    with np.errstate(all="ignore"):
        return ~np.isfinite(np.asarray(a).astype(np.float64))


def numpy_add(tokens: np.ndarray, table: np.ndarray, rows) -> tuple[np.ndarray, np.ndarray]:
    """``tokens + table[rows]``, and where two NaNs were added: IEEE 754 leaves
    the payload and sign of NaN + NaN open (NumPy's own float16 loop returns
    the second operand's, its float32 loop the first's), so there only
    NaN-ness is compared."""
    rows_of_table = table[rows]
    with np.errstate(all="ignore"):
        want = tokens + rows_of_table
    two_nans = is_nan(tokens) & is_nan(rows_of_table)
    return want, np.broadcast_to(two_nans, want.shape)


def numpy_add_at(table: np.ndarray, rows, grad_output) -> tuple[np.ndarray, np.ndarray]:
    """``np.add.at`` on a copy of ``table`` (grad_output as is, any dtype), with
    ``rows`` broadcast to the leading axes of grad_output; and the elements where
    a NaN may have met another NaN (two or more non-finite operands, the table's
    included), where only NaN-ness is compared."""
    want = table.copy()
    g = np.asarray(grad_output)
    d = table.shape[1]
    idx = np.broadcast_to(rows, g.shape[:-1]).reshape(-1)
    with np.errstate(all="ignore"):
        np.add.at(want, idx, g.reshape(idx.size, d))
    count = _non_finite(table).astype(np.int64)
    np.add.at(count, idx, _non_finite(g).reshape(idx.size, d).astype(np.int64))
    return want, is_nan(want) & (count >= 2)


def assert_bitwise(got, want, nan_pairs=None) -> None:
    """Same shape, dtype and bits; where ``nan_pairs`` is set, any NaN will do."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if not got.size:
        return
    g, w = uint_bits(got), uint_bits(want)
    differ = g != w
    if nan_pairs is not None:
        differ &= ~(np.asarray(nan_pairs) & is_nan(got))
    if differ.any():
        where = np.argwhere(differ)[:5]
        shown = ", ".join(
            f"{tuple(i)}: {int(g[tuple(i)]):#x} != {int(w[tuple(i)]):#x}" for i in where
        )
        raise AssertionError(
            f"{int(differ.sum())} of {got.size} {got.dtype} elements differ from NumPy's: {shown}"
        )


def unchanged(*arrays):
    """A check that every array still holds its bytes of now."""
    before = [(a, a.tobytes()) for a in arrays if a is not None]

    def check() -> None:
        for i, (a, data) in enumerate(before):
            assert a.tobytes() == data, f"argument {i} ({a.dtype}, {a.shape}) was written"

    return check
