# Stubs for the compiled module cposembed._membench (src_c/_membench.pyx):
# the machine-limit probes of `python -m cposembed bench`. Buffers are 1-D
# C-contiguous float32 arrays (`float[::1]`); blocks per thread as the kernels.
# n_threads: an integer >= 1 (else ValueError), capped and used for small work
# as the kernels' num_threads= is (_core.team).

import numpy as np
import numpy.typing as npt

def fill(
    out: npt.NDArray[np.float32],  # float[::1], written with 1.0
    n_threads: int,  # object: an integer >= 1
    stream: bool = True,  # bint: non-temporal stores
) -> None: ...
def copy(
    dst: npt.NDArray[np.float32],  # float[::1], written
    src: npt.NDArray[np.float32],  # const float[::1], dst's length (else ValueError)
    n_threads: int,  # object: an integer >= 1
    stream: bool = True,  # bint: non-temporal stores
) -> None: ...
def read_sum(
    src: npt.NDArray[np.float32],  # const float[::1]
    n_threads: int,  # object: an integer >= 1
) -> float: ...  # double, in no particular order
