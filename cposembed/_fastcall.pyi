# Stubs for the compiled module cposembed._fastcall (src_c/_fastcall.pyx).
#
# Hand-written, like the other stubs: the C-level expectations are in
# comments. None of the functions raises for bad input: the tiny ones return
# None, the large-call entries 0 (nothing written), and the caller takes the
# full (validating) path. The large-call entries return the threads they ran on.

import numpy as np
import numpy.typing as npt

SMALL_TAKE_ELEMENTS: int  # most output elements take_small serves
SMALL_ADD_ELEMENTS: int  # most token elements add_row_small serves

def take_small(
    table: object,  # exact ndarray, C-contiguous, aligned, native float32/float64, 2-D
    positions: object,  # int (not bool), list (nested, equal lengths) of ints, integer ndarray
) -> npt.NDArray[np.floating] | None: ...  # new positions.shape + (d,) array, or None
def add_row_small(
    tok: object,  # exact ndarray (..., T, d), the table's dtype, C-contiguous, aligned
    table: object,  # as for take_small
    offset: object,  # int (not bool), 0 <= offset, offset + T <= L
) -> npt.NDArray[np.floating] | None: ...  # new tok + table[offset:offset + T], or None
def lookup_into(
    table: object,  # as for take_small
    positions: object,  # exact non-empty ndarray, native int32/int64, C-contiguous, aligned
    out: object,  # exact writable ndarray positions.shape + (d,), table dtype, apart
    n_threads: int,  # int: threads asked for, before the size rules
    serial_below: int,  # Py_ssize_t: _threads.SERIAL_THRESHOLD
    stream_bytes: int,  # Py_ssize_t: functional.STREAM_THRESHOLD_BYTES
) -> int: ...
def add_into(
    tokens: object,  # exact ndarray (..., T, d), table dtype, C-contiguous, aligned
    table: object,  # as for take_small
    offset: object,  # int (not bool), 0 <= offset <= L - T
    out: object,  # tokens itself, or an exact writable ndarray like it, apart
    n_threads: int,  # int
    serial_below: int,  # Py_ssize_t
    stream_bytes: int,  # Py_ssize_t
) -> int: ...
def scatter_into(
    grad: object,  # writable table, as for take_small
    g: object,  # exact ndarray (..., d), grad's dtype, C-contiguous, aligned, apart
    positions: object,  # None, or exact ndarray of native int32/int64 of shape g.shape[:-1]
    offset: object,  # int (not bool): 0 <= offset <= L - T if positions is None, else 0
    n_threads: int,  # int
    serial_below: int,  # Py_ssize_t
) -> int: ...
