# Stubs for the compiled module cposembed._marks (src_c/cposembed/_marks.pyx):
# the rows a call touches, at a cost that grows with the call, not the table.

from typing import Any, final

import numpy as np
import numpy.typing as npt

# The C functions _core cimports (_distinct, _distinct_scratch_bytes), as capsules.
__pyx_capi__: dict[str, Any]

# Rows marked at a cost that grows with the call.
@final
class RowMarks:
    def __new__(cls, n_rows: int, mask: npt.ArrayLike | None = None) -> RowMarks: ...
    @property
    def mask(self) -> npt.NDArray[np.bool_]: ...  # read-only, one flag per row
    @property
    def n_rows(self) -> int: ...
    def __len__(self) -> int: ...
    def rows(self) -> npt.NDArray[np.int64]: ...  # in marking order
    def mark_all(self) -> None: ...
    def unmark(self, row: int) -> None: ...
    def clear(self) -> None: ...
    def zero_rows(self, grad: np.ndarray) -> None: ...

# Where an optimizer keeps each row's state.
@final
class RowSlots:
    def __new__(cls, n_rows: int, rows: npt.ArrayLike | None = None) -> RowSlots: ...
    @property
    def n_rows(self) -> int: ...
    def __len__(self) -> int: ...
    def rows(self) -> npt.NDArray[np.int64]: ...  # in slot order
    def slot_of(self, row: int) -> int: ...  # -1: no state
