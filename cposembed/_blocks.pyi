# Stubs for the compiled module cposembed._blocks (src_c/cposembed/_blocks.pyx):
# the allocator (src_c/_blocks.h): outputs, scratch, zeroed tables.

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

# The C functions _core cimports (_block_array, _scratch_or_raise, _scratch_give), as capsules.
__pyx_capi__: dict[str, Any]

POOL_MIN_BYTES: int  # fresh outputs at least this large come from the pool

@disjoint_base
class _Block:
    """Owner of one block of memory; a writable buffer of the requested size
    (the buffer protocol is implemented in C: wrap it in memoryview())."""

    @property
    def reused(self) -> bool: ...

def block(nbytes: int) -> _Block: ...  # Py_ssize_t nbytes > 0

KEEP_SLOTS: int  # the most blocks the allocator keeps

def zero_memory(address: int, nbytes: int, lazily: bool) -> None: ...  # (size_t, size_t, bint)
def advise_huge(address: int, nbytes: int) -> None: ...  # (size_t, size_t)
def pool_info() -> tuple[int, int, int, bool]: ...  # (blocks, bytes, limit, enabled)
def set_pool(enabled: bool = True, limit_bytes: int | None = None) -> None: ...
def clear_pool() -> None: ...
def on_clear_pool(hook: Callable[[], object]) -> None: ...
def fail_scratch(n: int, after: int = 0) -> int: ...  # tests: n requests of scratch fail

# Zeroed tables, as NumPy arrays.
ZEROED_MIN_BYTES: int  # zeroed tables at least this large are the allocator's

def zeros(shape: tuple[int, ...], dtype: npt.DTypeLike, growing: bool = False) -> np.ndarray: ...
