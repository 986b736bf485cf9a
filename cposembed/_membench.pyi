# Stubs for the compiled module cposembed._membench (src_c/_membench.pyx):
# machine-limit probes for the benchmark. C types in comments.

import numpy as np
import numpy.typing as npt

def streaming_available() -> bool: ...
def fill(
    out: npt.NDArray[np.float32],  # float[::1], written
    n_threads: int,  # int
    stream: bool = True,  # bint
) -> None: ...
def copy(
    dst: npt.NDArray[np.float32],  # float[::1], written
    src: npt.NDArray[np.float32],  # const float[::1], same length
    n_threads: int,  # int
    stream: bool = True,  # bint
) -> None: ...
def read_sum(
    src: npt.NDArray[np.float32],  # const float[::1]
    n_threads: int,  # int
) -> float: ...  # double
def max_threads() -> int: ...  # omp_get_max_threads(), 1 if serial
