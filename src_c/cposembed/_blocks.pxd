# The allocator's C interface (cposembed._blocks), cimported by _core: arrays
# over its blocks (large outputs) and the entries' scratch. Only _blocks.pyx
# includes _blocks.h, so the kept blocks have one home.

cimport numpy as cnp


cdef enum:
    _POOL_BYTES = 4194304  # fresh outputs at least this large: the allocator's blocks


cdef cnp.ndarray _block_array(int nd, cnp.npy_intp* dims, int typenum, Py_ssize_t nbytes)
cdef void* _scratch_or_raise(size_t nbytes, size_t* capacity, str what) except NULL
cdef void _scratch_give(void* p, size_t capacity) noexcept
