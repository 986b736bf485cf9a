# Machine-limit probes for `python -m cposembed bench`.
#
# What the hardware can do with the same bytes and the same threads as the
# kernels: a streaming (non-temporal) fill, a streaming copy, and a
# vectorised read-only sum. An op's time divided by the matching probe's is
# how far it sits from the memory system's limit. Each thread takes one
# contiguous block, as the kernels do; blocks start on 64-byte boundaries.

from cython.parallel cimport prange

from _openmp cimport omp_get_max_threads

cdef extern from "_stream.h" nogil:
    int cpe_have_stream()
    void cpe_sfence()
    void cpe_copy_f32(float* dst, const float* src, Py_ssize_t n, int stream)
    void cpe_fill_f32(float* dst, Py_ssize_t n, float value, int stream)
    double cpe_read_sum_f32(const float* src, Py_ssize_t n)


cdef inline Py_ssize_t _lo(Py_ssize_t n, int t, int n_threads) noexcept nogil:
    # Block starts rounded down to 16 floats (one cache line if aligned).
    if t >= n_threads:
        return n
    return ((n * t) // n_threads) & ~(<Py_ssize_t>15)


def streaming_available():
    """True if the probes use non-temporal stores (x86-64 SSE2)."""
    return bool(cpe_have_stream())


def fill(float[::1] out, int n_threads, bint stream=True):  # OUT
    """out[:] = 1.0, with streaming stores unless stream=False."""
    cdef Py_ssize_t n = out.shape[0]
    cdef int t
    if n == 0:
        return
    cdef float* p = &out[0]
    with nogil:
        if n_threads <= 1:
            cpe_fill_f32(p, n, 1.0, stream)
            cpe_sfence()
        else:
            for t in prange(n_threads, schedule="static", num_threads=n_threads):
                cpe_fill_f32(p + _lo(n, t, n_threads),
                             _lo(n, t + 1, n_threads) - _lo(n, t, n_threads), 1.0, stream)
                cpe_sfence()


def copy(float[::1] dst, const float[::1] src, int n_threads, bint stream=True):
    """dst[:] = src[:] (same length), with streaming stores unless stream=False."""
    cdef Py_ssize_t n = dst.shape[0]
    cdef int t
    if n == 0:
        return
    cdef float* dp = &dst[0]
    cdef const float* sp = &src[0]
    with nogil:
        if n_threads <= 1:
            cpe_copy_f32(dp, sp, n, stream)
            cpe_sfence()
        else:
            for t in prange(n_threads, schedule="static", num_threads=n_threads):
                cpe_copy_f32(dp + _lo(n, t, n_threads), sp + _lo(n, t, n_threads),
                             _lo(n, t + 1, n_threads) - _lo(n, t, n_threads), stream)
                cpe_sfence()


def read_sum(const float[::1] src, int n_threads):  # IN
    """Sum of src (in no particular order): reads every byte once."""
    cdef Py_ssize_t n = src.shape[0]
    cdef int t
    cdef double total = 0.0
    if n == 0:
        return 0.0
    cdef const float* p = &src[0]
    with nogil:
        if n_threads <= 1:
            total = cpe_read_sum_f32(p, n)
        else:
            for t in prange(n_threads, schedule="static", num_threads=n_threads):
                total += cpe_read_sum_f32(p + _lo(n, t, n_threads),
                                          _lo(n, t + 1, n_threads) - _lo(n, t, n_threads))
    return total


def max_threads():
    return omp_get_max_threads()
