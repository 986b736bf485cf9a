# Stubs for the compiled module cposembed._alloc (src_c/_alloc.pyx): reusable
# output blocks. C types in comments, as in _kernels.pyi.

from typing import final

@final
class _Block:
    # Owns `capacity` bytes (void*); exposes `used` of them as a writable
    # buffer (np.frombuffer(block, dtype)); back to the pool when freed.
    @property
    def reused(self) -> bool: ...  # readonly bint: came from the pool

def block(nbytes: int) -> _Block: ...  # Py_ssize_t nbytes > 0
def pool_info() -> tuple[int, int, int, bool]: ...  # (blocks, bytes, limit, enabled)
def set_pool(enabled: bool = True, limit_bytes: int | None = None) -> None: ...  # bint, size_t
def clear_pool() -> None: ...
