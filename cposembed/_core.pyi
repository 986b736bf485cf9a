# Stubs for the compiled module cposembed._core (src_c/_core.pyx): the one
# checked C entry per operation and the thread rules.
#
# The six entries take the caller's objects as they are and return the
# result, or None (nothing written) for anything but the canonical case;
# cposembed/functional.py, layer.py and the classes' sgd_step hand the
# arguments it refused to a route, which calls the same entry again with
# normalised ones. _core.index_rows reads positions as the entries do.
# Positions: a Python int, an exact NumPy integer scalar, a (nested) list of
# those, or an ndarray of a native-order integer dtype; values in [-L, L).

import enum
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from cposembed._marks import RowMarks, RowSlots

_A = TypeVar("_A", bound=np.ndarray)

SERIAL_THRESHOLD: int  # elements of work below which a call runs on one thread
STREAM_THRESHOLD_BYTES: int  # outputs at least this large use streaming stores

def bfloat16() -> np.dtype[Any]: ...
def loaded_bfloat16() -> np.dtype[Any] | None: ...

class ScatterPlan(enum.IntEnum):
    PLAN_AUTO = 0
    PLAN_DISTINCT = 1
    PLAN_SCAN = 2
    PLAN_SORT = 3

PLAN_AUTO: ScatterPlan  # the members, also at module level
PLAN_DISTINCT: ScatterPlan
PLAN_SCAN: ScatterPlan
PLAN_SORT: ScatterPlan

def lookup(
    table: Any,  # canonical (L, d) float32/float64
    positions: Any,
    out: Any,  # None, or canonical writable positions.shape + (d,), not overlapping table
    num_threads: Any,  # None or an integer >= 1
) -> np.ndarray | None: ...

MAX_POSITION_DIMS: int  # the most axes of positions the entries read

def index_rows(
    positions: Any,  # as the entries read them (_index.pxi)
    n_rows: int,
) -> npt.NDArray[np.int64] | None: ...  # rows in [0, n_rows), positions' shape
def offset_rule(
    offset: Any, with_positions: bool, T: int, n_rows: int
) -> int: ...  # 0: kept, else one of the OFFSET_ codes

OFFSET_NOT_INT: int  # not an integer
OFFSET_NEGATIVE: int
OFFSET_WITH_POSITIONS: int  # not 0 with explicit positions
OFFSET_PAST_END: int  # offset + T > n_rows

class TableCall:
    # Base of LearnedPositionEmbedding: pe(positions) is the lookup entry on
    # self._embeddings, then self._lookup_normalised(positions, out) for what
    # it refused.
    def __call__(self, positions: Any, *, out: np.ndarray | None = None) -> np.ndarray: ...

def add(
    tokens: Any,  # canonical (..., T, d), the table's dtype
    table: Any,
    positions: Any,  # None: offset + arange(T)
    offset: Any,  # integer; 0 unless positions is None
    out: Any,  # None, tokens itself, or canonical writable, overlapping neither tokens nor table
    num_threads: Any,
) -> np.ndarray | None: ...
def scatter_add(
    grad: _A,  # canonical writable (L, d)
    grad_output: Any,  # canonical (..., d), grad's dtype, not overlapping grad
    positions: Any,
    offset: Any,
    num_threads: Any,
    touched: RowMarks | None = None,  # of L rows: the rows that got a contribution
    skip_row: int = -1,  # Py_ssize_t: a row that gets no gradient, or -1
    plan: int = ...,  # int: a ScatterPlan
) -> _A | None: ...
def sgd_step(
    table: Any,  # canonical writable (L, d)
    grad: Any,  # canonical, same shape and dtype, not overlapping table
    touched: Any,  # None (every row) or a RowMarks of L rows
    lr: float,  # double, rounded once to the table's dtype
    skip_row: int,  # Py_ssize_t
    num_threads: Any = None,
) -> bool | None: ...
def embed(
    token_ids: Any,  # in [-V, V)
    token_table: Any,  # canonical (V, d)
    position_table: Any,  # canonical (L, d), same dtype and d
    positions: Any,
    offset: Any,
    out: Any,  # None, or canonical writable token_ids.shape + (d,), overlapping neither table
    num_threads: Any,
) -> np.ndarray | None: ...
def embed_backward(
    grad_token_table: Any,  # canonical writable (V, d)
    grad_position_table: Any,  # canonical writable (L, d), same dtype and d, not overlapping it
    grad_output: Any,  # canonical token_ids.shape + (d,), overlapping neither
    token_ids: Any,
    positions: Any,
    offset: Any,
    num_threads: Any,
    token_touched: RowMarks | None = None,  # of V rows
    position_touched: RowMarks | None = None,  # of L rows
    token_skip_row: int = -1,  # Py_ssize_t
) -> bool | None: ...
def distinct_rows(
    rows: Any,  # canonical int64, any shape, in [0, n_rows)
    n_rows: int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]] | None: ...

# The optimizers' step (cposembed.optim): hyper is a dict of cpe_opt_hyper's fields.
def optimizer_step(
    table: Any,  # canonical writable (L, d)
    grad: Any,  # canonical, the state's dtype: (len(rows), d) if compact, else (L, d)
    rows: Any,  # canonical int64 (k,), distinct, in [0, L)
    compact: bool,
    state1: Any,  # None or canonical writable (L, d), the state's dtype
    state2: Any,
    slots: RowSlots | None,  # None: row r's state is row r
    hyper: dict[str, Any],
    skip_row: int,
    num_threads: Any = None,
) -> bool | None: ...
def fused_embed_step(
    token_step: tuple[Any, ...],  # (table, state1, state2, slots, skip_row) of the tokens
    position_step: tuple[Any, ...],  # the same for the positions
    grad_output: Any,  # as embed_backward's, disjoint from both tables and their state
    token_ids: Any,
    positions: Any,
    offset: Any,
    hyper: dict[str, Any],
    num_threads: Any = None,
) -> bool | None: ...

# What the entries take as it is (src_c/_contract.pxi).
def is_canonical(
    obj: object,
    dtype: npt.DTypeLike,  # compared by type number; native byte order required
    writable: bool = False,  # bint
) -> bool: ...
def disjoint(a: object, b: object) -> bool: ...  # exact C-contiguous arrays whose bytes do not meet

# Threads (src_c/_parallel.pxi, src_c/_threads.h).
def default_threads() -> int: ...
def team(num_threads: Any, work: int, chunks: int) -> int: ...  # 0: invalid num_threads
def user_threads(n: int | None = None) -> int: ...  # sets it first; 0 restores the default
def env_threads() -> int: ...
def cpu_limit() -> int: ...
def thread_info() -> dict[str, int | bool]: ...  # os_threads -1: cannot be counted
def choose_threads(kind: int, work: int, n: int) -> int: ...  # ints
def took_threads(kind: int, work: int, threads: int, ns: int) -> None: ...  # ns: long long
def set_threads_refused(refused: bool) -> None: ...
def last_team() -> int: ...
def set_tuning(
    serial_below: int | None = None,
    stream_bytes: int | None = None,
    scan_block_bytes: int | None = None,
    chunk_elems: int | None = None,
    adapt: bool | None = None,
) -> dict[str, int | bool]: ...
def openmp_enabled() -> bool: ...
def omp_max_threads() -> int: ...
def streaming_stores_available() -> bool: ...

ISAS: tuple[str, ...]  # the half-precision primitives' variants: sse2, f16c, avx2

def set_isa(name: str) -> str: ...  # tests: use a variant (same bits); the one used
def isas() -> tuple[str, ...]: ...  # the variants this CPU has
