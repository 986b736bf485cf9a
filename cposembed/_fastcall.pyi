# Stubs for the compiled module cposembed._fastcall (src_c/_fastcall.pyx).
#
# Hand-written, like the other stubs: the C-level expectations are in
# comments. Both functions never raise for bad input: they return None and
# the caller takes the full (validating) path.

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
