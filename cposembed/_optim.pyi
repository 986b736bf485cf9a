# Stubs for the compiled cposembed._optim (src_c/_optim.pyx).
import numpy as np
import numpy.typing as npt

def sgd_rows(
    table: npt.NDArray[np.floating],  # real_t[:, ::1], IN/OUT (L, d)
    grad: npt.NDArray[np.floating],  # const real_t[:, ::1], IN (L, d), table's dtype
    rows: npt.NDArray[np.int64],  # const int64_t[::1], distinct, 0 <= r < L
    lr: float,  # double, rounded once to real_t
    n_threads: int,  # int
) -> None: ...
