# Large output buffers, and the calls' scratch, reused instead of returned
# to the OS (included by _core.pyx, whose entries allocate fresh outputs and
# their scratch from here).
#
# A fresh multi-megabyte NumPy array comes from mmap: every page is faulted
# in and zeroed by the kernel on first write, which costs more than the
# lookup that fills it (on a VM several times more). Typical use allocates
# outputs of the same size step after step, so this module keeps a few freed
# blocks and hands them out again. When it is full, a freed block takes the
# place of kept blocks smaller than itself (returned to the OS, smallest
# first), or is returned to the OS if only larger ones would make room: what
# a miss costs grows with the block's size (a 50 MB output faults in for
# milliseconds; the calls' scratch for tenths of one), and the scratch shares
# the places. A block returns to the pool only when the last array (or view)
# using its memory is gone: the ndarray's base is a _Block, whose __dealloc__
# runs exactly then, with the GIL held, which also serialises access to the
# pool.

from cpython.buffer cimport PyBuffer_FillInfo

cdef extern from *:
    """
    #include <stdlib.h>
    #if defined(__linux__)
    #include <sys/mman.h>
    #endif
    static void *cpe_alloc_block(size_t nbytes) {
        void *p = NULL;
    #if defined(_WIN32)
        p = malloc(nbytes);
    #else
        /* 2 MiB alignment lets Linux back the block with huge pages. */
        size_t align = nbytes >= (4u << 20) ? (2u << 20) : 64;
        if (posix_memalign(&p, align, nbytes) != 0) return NULL;
    #if defined(__linux__) && defined(MADV_HUGEPAGE)
        if (align == (2u << 20)) madvise(p, nbytes, MADV_HUGEPAGE);
    #endif
    #endif
        return p;
    }
    """
    void* cpe_alloc_block(size_t nbytes) nogil

cdef enum:
    _MAX_BLOCKS = 8

cdef void* _pool_ptr[_MAX_BLOCKS]
cdef size_t _pool_size[_MAX_BLOCKS]
cdef int _pool_n = 0
cdef size_t _pool_limit = (<size_t>1) << 30   # bytes kept at most (1 GiB)
cdef bint _enabled = True


cdef size_t _pool_bytes() noexcept:
    cdef size_t total = 0
    cdef int i
    for i in range(_pool_n):
        total += _pool_size[i]
    return total


cdef void _drop(int i) noexcept:
    # Removes kept block i from the list.
    global _pool_n
    _pool_n -= 1
    _pool_ptr[i] = _pool_ptr[_pool_n]
    _pool_size[i] = _pool_size[_pool_n]


cdef bint _give_back(void* ptr, size_t nbytes) noexcept:
    # Keeps a freed block, in the place of kept blocks smaller than it
    # (returned to the OS, smallest first) if it needs their places or
    # bytes; False (the caller frees it) if even all of those would not make
    # room.
    global _pool_n
    cdef int i, smallest, n_small = 0
    cdef size_t small_bytes = 0
    if not _enabled or nbytes > _pool_limit:
        return False
    for i in range(_pool_n):
        if _pool_size[i] < nbytes:
            n_small += 1
            small_bytes += _pool_size[i]
    if _pool_n - n_small >= _MAX_BLOCKS or _pool_bytes() - small_bytes + nbytes > _pool_limit:
        return False
    while _pool_n >= _MAX_BLOCKS or _pool_bytes() + nbytes > _pool_limit:
        smallest = 0
        for i in range(1, _pool_n):
            if _pool_size[i] < _pool_size[smallest]:
                smallest = i
        free(_pool_ptr[smallest])
        _drop(smallest)
    _pool_ptr[_pool_n] = ptr
    _pool_size[_pool_n] = nbytes
    _pool_n += 1
    return True


cdef void* _take(size_t nbytes, size_t* got) noexcept:
    # The smallest pooled block that fits without wasting more than half.
    cdef int i, best = -1
    for i in range(_pool_n):
        if nbytes <= _pool_size[i] <= 2 * nbytes:
            if best < 0 or _pool_size[i] < _pool_size[best]:
                best = i
    if best < 0:
        return NULL
    cdef void* p = _pool_ptr[best]
    got[0] = _pool_size[best]
    _drop(best)
    return p


cdef class _Block:
    """Owner of one block; exposes `used` bytes of it as a writable buffer."""
    cdef void* ptr
    cdef size_t capacity
    cdef size_t used
    cdef readonly bint reused

    def __getbuffer__(self, Py_buffer* view, int flags):
        PyBuffer_FillInfo(view, self, self.ptr, <Py_ssize_t>self.used, 0, flags)

    def __releasebuffer__(self, Py_buffer* view):
        pass

    def __dealloc__(self):
        if self.ptr != NULL and not _give_back(self.ptr, self.capacity):
            free(self.ptr)
        self.ptr = NULL


cdef _Block _new_block(Py_ssize_t nbytes):
    """A _Block of at least `nbytes` (> 0) bytes, from the pool if one fits."""
    cdef size_t got = 0
    cdef _Block b = _Block.__new__(_Block)
    cdef void* p = _take(<size_t>nbytes, &got) if _enabled else NULL
    if p == NULL:
        p = cpe_alloc_block(<size_t>nbytes)
        if p == NULL:
            raise MemoryError(f"cannot allocate {nbytes} bytes")
        got = <size_t>nbytes
        b.reused = False
    else:
        b.reused = True
    b.ptr = p
    b.capacity = got
    b.used = <size_t>nbytes
    return b


def block(Py_ssize_t nbytes):
    """A _Block of at least `nbytes` (> 0) bytes, from the pool if one fits."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive; got {nbytes}")
    return _new_block(nbytes)


def pool_info():
    """(number of pooled blocks, bytes they hold, byte limit, enabled)."""
    return _pool_n, _pool_bytes(), _pool_limit, _enabled


def set_pool(bint enabled=True, limit_bytes=None):
    """Turn reuse on/off and set the byte limit; turning it off frees the pool
    (and the kept zeroed tables of _zeros.pxi)."""
    global _enabled, _pool_limit
    _enabled = enabled
    zeroed_kept(enabled)
    if limit_bytes is not None:
        _pool_limit = <size_t>max(0, limit_bytes)
    if not enabled:
        clear_pool()


def clear_pool():
    """Free every pooled block."""
    global _pool_n
    while _pool_n > 0:
        _pool_n -= 1
        free(_pool_ptr[_pool_n])


# The entries' scratch (the buffer of a call's positions, the scatter-adds'
# counts and lists, the SGD step's rows): blocks of this many bytes and more
# come from the pool and go back to it. Given back to glibc, blocks of a few
# hundred KiB are returned to the OS and faulted in again by the next call of
# the same size (up to a hundred page faults, 0.2 ms, per scatter-add).
cdef enum:
    _SCRATCH_POOLED = 65536


# Requests of scratch that fail on purpose, after _scratch_spared more
# succeed (fail_scratch): how the tests reach every entry's MemoryError.
cdef Py_ssize_t _scratch_failures = 0
cdef Py_ssize_t _scratch_spared = 0


cdef void* _scratch_take(size_t nbytes, size_t* capacity) noexcept:
    """At least `nbytes` (> 0) of scratch, its size in `capacity`; NULL if
    out of memory. With the GIL held; give it back with _scratch_give."""
    global _scratch_failures, _scratch_spared
    cdef void* p = NULL
    if _scratch_failures:
        if _scratch_spared:
            _scratch_spared -= 1
        else:
            _scratch_failures -= 1
            return NULL
    if nbytes >= _SCRATCH_POOLED and _enabled:
        p = _take(nbytes, capacity)
    if p == NULL:
        p = malloc(nbytes)
        capacity[0] = nbytes
    return p


cdef void _scratch_give(void* p, size_t capacity) noexcept:
    """Scratch from _scratch_take, back to the pool or freed; with the GIL held."""
    if p != NULL and (capacity < _SCRATCH_POOLED or not _give_back(p, capacity)):
        free(p)


cdef void* _scratch_or_raise(size_t nbytes, size_t* capacity, str what) except NULL:
    """_scratch_take, or MemoryError("cannot allocate <what>"). Every entry
    takes its scratch this way, with the GIL held and before its kernel
    starts: the kernels never allocate, so they stay noexcept nogil and
    nothing on their hot paths checks for an error or takes the GIL."""
    cdef void* p = _scratch_take(nbytes, capacity)
    if p == NULL:
        raise MemoryError(f"cannot allocate {what}")
    return p


def fail_scratch(Py_ssize_t n, Py_ssize_t after=0):
    """Make `n` requests of scratch fail, as if out of memory, once `after`
    more have succeeded (tests); n=0 ends it. Returns how many failures were
    still to come."""
    global _scratch_failures, _scratch_spared
    cdef Py_ssize_t pending = _scratch_failures
    _scratch_failures = max(0, n)
    _scratch_spared = max(0, after)
    return pending
