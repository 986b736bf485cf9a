# Machine-limit probes for `python -m cposembed bench`: a streaming fill, a
# streaming copy and a read-only sum, with the kernels' bytes and threads, so
# that an op's time over its probe's says how far it is from the memory
# system's limit. Each thread takes one contiguous block.

from cython.parallel cimport prange

from cposembed._core import team

cdef extern from "_stream.h" nogil:
    void cpe_sfence()
    void cpe_copy_bytes(void* dst, const void* src, size_t n, int stream)
    void cpe_fill_f32(float* dst, Py_ssize_t n, float value, int stream)
    double cpe_read_sum_f32(const float* src, Py_ssize_t n)


cdef inline Py_ssize_t _lo(Py_ssize_t n, int t, int n_threads) noexcept nogil:
    # Block starts rounded down to 16 floats (one cache line if aligned).
    if t >= n_threads:
        return n
    return ((n * t) // n_threads) & ~(<Py_ssize_t>15)


cdef int _threads(object n_threads, Py_ssize_t n) except 0:
    # The thread count the kernels' rule gives for n floats (_core.team);
    # ValueError for anything but an integer >= 1.
    cdef int nt = 0 if n_threads is None else team(n_threads, n, max(1, n // 16))
    if nt < 1:
        raise ValueError(f"n_threads must be a positive integer; got {n_threads!r}")
    return nt


def fill(float[::1] out, n_threads, bint stream=True):  # OUT
    """out[:] = 1.0, with streaming stores unless stream=False."""
    cdef Py_ssize_t n = out.shape[0]
    cdef int t
    cdef int nt = _threads(n_threads, n)
    if n == 0:
        return
    cdef float* p = &out[0]
    for t in prange(nt, schedule="static", num_threads=nt, nogil=True):
        cpe_fill_f32(p + _lo(n, t, nt), _lo(n, t + 1, nt) - _lo(n, t, nt), 1.0, stream)
        cpe_sfence()


def copy(float[::1] dst, const float[::1] src, n_threads, bint stream=True):
    """dst[:] = src[:] (same length), with streaming stores unless stream=False."""
    cdef Py_ssize_t n = dst.shape[0]
    cdef int t
    if src.shape[0] != n:
        raise ValueError(f"src must have dst's length {n}; got length {src.shape[0]}")
    cdef int nt = _threads(n_threads, n)
    if n == 0:
        return
    cdef float* dp = &dst[0]
    cdef const float* sp = &src[0]
    for t in prange(nt, schedule="static", num_threads=nt, nogil=True):
        cpe_copy_bytes(dp + _lo(n, t, nt), sp + _lo(n, t, nt),
                       (_lo(n, t + 1, nt) - _lo(n, t, nt)) * sizeof(float), stream)
        cpe_sfence()


def read_sum(const float[::1] src, n_threads):  # IN
    """Sum of src (in no particular order): reads every byte once."""
    cdef Py_ssize_t n = src.shape[0]
    cdef int t
    cdef double total = 0.0
    cdef int nt = _threads(n_threads, n)
    if n == 0:
        return 0.0
    cdef const float* p = &src[0]
    for t in prange(nt, schedule="static", num_threads=nt, nogil=True):
        total += cpe_read_sum_f32(p + _lo(n, t, nt), _lo(n, t + 1, nt) - _lo(n, t, nt))
    return total
