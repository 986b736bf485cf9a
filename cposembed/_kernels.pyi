# Stubs for the compiled module cposembed._kernels (src_c/_kernels.pyx).
#
# Hand-written, like pandas/_libs/algos.pyi: the C signature of each argument
# is in a comment. Fused types: real_t is float | double (float32 | float64
# arrays), index_t is int32_t | int64_t. A 2-D `[:, ::1]` or 1-D `[::1]`
# memoryview accepts any C-contiguous buffer of that dtype; the kernels trust
# their inputs (validation lives in cposembed/_validation.py), so shapes and
# dtypes that do not match are the caller's bug, not checked here.
#
# Checked against the built module in CI by `python -m mypy.stubtest
# cposembed._kernels`: a kernel added to the .pyx needs a line here.

import numpy as np
import numpy.typing as npt

_Real = npt.NDArray[np.float32] | npt.NDArray[np.float64]
_Index = npt.NDArray[np.int32] | npt.NDArray[np.int64]

def openmp_enabled() -> bool: ...
def omp_max_threads() -> int: ...  # int omp_get_max_threads(), 1 if serial
def default_num_threads() -> int: ...  # CPOSEMBED_NUM_THREADS, else omp_max_threads; -1
def streaming_stores_available() -> bool: ...  # SSE2 non-temporal stores built in
def index_bounds(
    positions: _Index,  # const index_t[::1], non-empty
) -> tuple[int, int]: ...  # (int64_t min, int64_t max)
def repeats_every(
    positions: _Index,  # const index_t[::1]
    period: int,  # Py_ssize_t: positions[i] == positions[i - period] for all i >= period
) -> bool: ...
def lookup_rows(
    table: _Real,  # const real_t[:, ::1]  (L, d)
    positions: _Index,  # const index_t[::1]  (n,)
    out: _Real,  # real_t[:, ::1]  (n, d), written
    n_threads: int,  # int
    stream: bool = False,  # bint: non-temporal stores
    prefetch: bool = True,  # bint: prefetch the next source row
) -> None: ...
def add_rows(
    tokens: _Real,  # const real_t[:, ::1]  (N, d)
    table: _Real,  # const real_t[:, ::1]  (L, d)
    positions: _Index,  # const index_t[::1]  (m,), N % m == 0
    out: _Real,  # real_t[:, ::1]  (N, d), written; may be `tokens`
    n_threads: int,  # int
    stream: bool = False,  # bint: non-temporal stores
    nta: bool = True,  # bint: non-temporal prefetch of the token rows
) -> None: ...
def scatter_add_rows(
    grad: _Real,  # real_t[:, ::1]  (L, d), accumulated into
    g: _Real,  # const real_t[:, ::1]  (N, d)
    positions: _Index,  # const index_t[::1]  (m,), N % m == 0
    row_start: npt.NDArray[np.int64],  # int64_t[::1]  (L + 1,) scratch
    order: npt.NDArray[np.int64],  # int64_t[::1]  (m,) scratch
    n_threads: int,  # int
    allow_distinct: bool = True,  # bint: blocked path for distinct positions
    general_mode: int = 0,  # int: 0 auto, 1 scan by owner, 2 sorted rows, 3 column bands
    scan_block_bytes: int = 8388608,  # Py_ssize_t: per-thread cache budget
) -> None: ...
