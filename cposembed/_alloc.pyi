# Stubs for the compiled module cposembed._alloc (src_c/_alloc.pyx): large
# output blocks that are reused instead of returned to the OS.

from typing_extensions import disjoint_base

@disjoint_base
class _Block:
    """Owner of one block of memory; a writable buffer of the requested size
    (the buffer protocol is implemented in C: wrap it in memoryview())."""

    @property
    def reused(self) -> bool: ...

def block(nbytes: int) -> _Block: ...  # Py_ssize_t nbytes > 0
def pool_info() -> tuple[int, int, int, bool]: ...  # (blocks, bytes, limit, enabled)
def set_pool(enabled: bool = True, limit_bytes: int | None = None) -> None: ...
def clear_pool() -> None: ...
