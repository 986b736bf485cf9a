# cposembed._blocks: the one module that includes _blocks.h: arrays over its
# blocks, the entries' scratch (cimported by _core) and the allocator's switches.

cimport numpy as cnp
from cpython.buffer cimport PyBuffer_FillInfo
from libc.stdlib cimport free, malloc

import numpy as np

cnp.import_array()

cdef extern from "_blocks.h" nogil:
    enum:
        CPE_DENSE
        CPE_ZEROED
        CPE_GROWING
        CPE_KEEP_SLOTS
    ctypedef struct cpe_Mem:
        void* ptr
        size_t capacity
        int mapped
        int kind
    cpe_Mem cpe_fresh(size_t nbytes, int kind)
    cpe_Mem cpe_dense_get(size_t nbytes, int* reused)
    void cpe_block_put(cpe_Mem m)
    int cpe_blocks_clear()
    void cpe_blocks_init()
    int cpe_kept_n
    size_t cpe_keep_limit
    int cpe_keep_on
    size_t cpe_kept_bytes()
    void cpe_zero_memory(void* p, size_t nbytes, int lazily)
    void cpe_advise_huge(void* p, size_t nbytes)

cpe_blocks_init()

# Fresh outputs at least this large come from the allocator's blocks.
POOL_MIN_BYTES = _POOL_BYTES


cdef class _Block:
    """Owner of one block, `used` bytes of it a writable buffer; the block goes back
    when the last array over it is gone (the ndarray's base is the _Block)."""
    cdef cpe_Mem mem
    cdef size_t used
    cdef readonly bint reused

    def __getbuffer__(self, Py_buffer* view, int flags):
        PyBuffer_FillInfo(view, self, self.mem.ptr, <Py_ssize_t>self.used, 0, flags)

    def __releasebuffer__(self, Py_buffer* view):
        pass

    def __dealloc__(self):
        cpe_block_put(self.mem)
        self.mem.ptr = NULL


cdef _Block _new_block(Py_ssize_t nbytes, int kind=CPE_DENSE):
    """A _Block of at least `nbytes` (> 0) bytes of the kind (only dense ones are kept)."""
    cdef _Block b = _Block.__new__(_Block)
    cdef int reused = 0
    with nogil:
        if kind == CPE_DENSE:
            b.mem = cpe_dense_get(<size_t>nbytes, &reused)
        else:
            b.mem = cpe_fresh(<size_t>nbytes, kind)
    if b.mem.ptr == NULL:
        raise MemoryError(f"cannot allocate {nbytes} bytes")
    b.reused = reused
    b.used = <size_t>nbytes
    return b


cdef cnp.ndarray _block_array(int nd, cnp.npy_intp* dims, int typenum, Py_ssize_t nbytes):
    """A C-contiguous array of shape dims[:nd] over a dense block of its `nbytes`."""
    cdef _Block blk = _new_block(nbytes)
    cdef cnp.ndarray arr = cnp.PyArray_SimpleNewFromData(nd, dims, typenum, blk.mem.ptr)
    cnp.set_array_base(arr, blk)  # the block returns to the pool with the array
    return arr


def block(Py_ssize_t nbytes):
    """A dense _Block of at least `nbytes` (> 0) bytes, kept or fresh (tests)."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive; got {nbytes}")
    return _new_block(nbytes)


# Zeroed tables at least this large are the allocator's; smaller ones np.zeros.
ZEROED_MIN_BYTES = 1 << 22


def zeros(shape, dtype, bint growing=False):
    """``np.zeros(shape, dtype)`` for a table kept long: from ``ZEROED_MIN_BYTES`` on,
    fresh pages that fault in where written, 4 KiB at a time (a gradient) or 2 MiB
    if ``growing`` (an optimizer's state)."""
    dt = np.dtype(dtype)
    nbytes = dt.itemsize
    for n in shape:
        nbytes *= n
    if nbytes < ZEROED_MIN_BYTES:
        return np.zeros(shape, dt)
    return np.frombuffer(_new_block(nbytes, CPE_GROWING if growing else CPE_ZEROED),
                         dt).reshape(shape)


KEEP_SLOTS = CPE_KEEP_SLOTS


def zero_memory(size_t address, size_t nbytes, bint lazily):
    """Zero ``nbytes`` at ``address``, memory the caller owns (cpe_zero_memory;
    ``lazily``: whole pages zero until written, on Linux)."""
    with nogil:
        cpe_zero_memory(<void*>address, nbytes, lazily)


def advise_huge(size_t address, size_t nbytes):
    """Huge pages for the 2 MiB-aligned part of ``nbytes`` at ``address``, memory the
    caller owns and has not written (Linux)."""
    cpe_advise_huge(<void*>address, nbytes)


def pool_info():
    """(number of kept blocks, bytes they hold, byte limit, keeping on)."""
    return cpe_kept_n, cpe_kept_bytes(), cpe_keep_limit, bool(cpe_keep_on)


def set_pool(bint enabled=True, limit_bytes=None):
    """Turn keeping on/off and set the byte limit; turning it off releases
    every kept block."""
    global cpe_keep_on, cpe_keep_limit
    cpe_keep_on = enabled
    if limit_bytes is not None:
        cpe_keep_limit = <size_t>max(0, limit_bytes)
    if not enabled:
        clear_pool()


# Called by clear_pool after the blocks go: memory kept elsewhere (torch's storages).
_clear_hooks = []


def on_clear_pool(hook):
    """Have ``clear_pool`` (and ``set_pool(False)``) call ``hook()``."""
    _clear_hooks.append(hook)


def clear_pool():
    """Release every kept block, then call the hooks of ``on_clear_pool``."""
    while not cpe_blocks_clear():
        pass  # another thread is putting a block back: a moment
    for hook in _clear_hooks:
        hook()


# Scratch of this many bytes and more is the allocator's dense blocks, kept between
# calls (glibc would return blocks of a few hundred KiB to the OS each time).
cdef enum:
    _SCRATCH_KEPT = 65536


# Scratch requests that fail on purpose (fail_scratch), for the tests.
cdef Py_ssize_t _scratch_failures = 0
cdef Py_ssize_t _scratch_spared = 0


cdef void* _scratch_take(size_t nbytes, size_t* capacity) noexcept:
    """At least `nbytes` (> 0) of scratch, its size in `capacity`; NULL if none."""
    global _scratch_failures, _scratch_spared
    cdef cpe_Mem m
    cdef int reused
    if _scratch_failures:
        if _scratch_spared:
            _scratch_spared -= 1
        else:
            _scratch_failures -= 1
            return NULL
    if nbytes < _SCRATCH_KEPT:
        capacity[0] = nbytes
        return malloc(nbytes)
    m = cpe_dense_get(nbytes, &reused)
    capacity[0] = m.capacity
    return m.ptr


cdef void _scratch_give(void* p, size_t capacity) noexcept:
    """Scratch from _scratch_take, back to the allocator or freed."""
    cdef cpe_Mem m
    if p == NULL:
        return
    if capacity < _SCRATCH_KEPT:
        free(p)
        return
    m.ptr = p
    m.capacity = capacity
    m.mapped = 0
    m.kind = CPE_DENSE
    cpe_block_put(m)


cdef void* _scratch_or_raise(size_t nbytes, size_t* capacity, str what) except NULL:
    """_scratch_take, or MemoryError("cannot allocate <what>"): how every entry takes
    its scratch, with the GIL, before its kernel starts (kernels never allocate)."""
    cdef void* p = _scratch_take(nbytes, capacity)
    if p == NULL:
        raise MemoryError(f"cannot allocate {what}")
    return p


def fail_scratch(Py_ssize_t n, Py_ssize_t after=0):
    """Make `n` scratch requests fail once `after` more have succeeded (tests; n=0
    ends it); returns the failures still to come."""
    global _scratch_failures, _scratch_spared
    cdef Py_ssize_t pending = _scratch_failures
    _scratch_failures = max(0, n)
    _scratch_spared = max(0, after)
    return pending
