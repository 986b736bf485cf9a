# Kernels for cposembed: gather rows, add rows, scatter-add rows.
#
# They trust their inputs. The Python layer (cposembed/_validation.py and
# cposembed/functional.py) has already checked dtypes, shapes, contiguity,
# aliasing and that every position p satisfies -L <= p < L; the kernels only
# wrap negative positions. Compiler directives are set in setup.py.
#
# "Period" convention shared by add_rows and scatter_add_rows: `positions` has
# m entries and the row arrays have N = nb * m rows; row i uses position
# positions[i % m]. It lets `positions=None` (offset + arange(T), the same for
# every sequence of a batch) and any positions array that broadcasts along
# leading axes run without materialising N indices.

from cython.parallel cimport prange
from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy

from _openmp cimport CPOSEMBED_OPENMP_ENABLED, omp_get_max_threads

ctypedef fused real_t:
    float
    double

ctypedef fused index_t:
    int32_t
    int64_t


def openmp_enabled():
    """True if this extension was compiled with OpenMP."""
    return bool(CPOSEMBED_OPENMP_ENABLED)


def omp_max_threads():
    """omp_get_max_threads() of the OpenMP runtime, or 1 in a serial build."""
    return omp_get_max_threads()


def index_bounds(const index_t[::1] positions):  # IN
    """(min, max) of a non-empty index array, in one pass without the GIL."""
    cdef Py_ssize_t i, n = positions.shape[0]
    cdef int64_t lo = positions[0], hi = positions[0], v
    with nogil:
        for i in range(1, n):
            v = positions[i]
            if v < lo:
                lo = v
            if v > hi:
                hi = v
    return lo, hi


cdef inline Py_ssize_t _wrap(int64_t p, Py_ssize_t n_rows) noexcept nogil:
    # Positions were checked to lie in [-n_rows, n_rows).
    return <Py_ssize_t>(p + n_rows if p < 0 else p)


cdef inline void _add_row(const real_t* a, const real_t* b, real_t* out,
                          Py_ssize_t d) noexcept nogil:
    # `out` may be `a` (in-place add_to); element k only reads a[k], b[k].
    cdef Py_ssize_t k
    for k in range(d):
        out[k] = a[k] + b[k]


cdef inline void _acc_row(real_t* acc, const real_t* src,
                          Py_ssize_t d) noexcept nogil:
    cdef Py_ssize_t k
    for k in range(d):
        acc[k] += src[k]


def lookup_rows(const real_t[:, ::1] table,    # IN  (L, d)
                const index_t[::1] positions,  # IN  (n,)
                real_t[:, ::1] out,            # OUT (n, d)
                int n_threads):
    """out[i, :] = table[positions[i], :]."""
    cdef Py_ssize_t i, n = out.shape[0], d = table.shape[1]
    cdef Py_ssize_t L = table.shape[0]
    cdef size_t row_bytes = d * sizeof(real_t)
    if n == 0 or d == 0:
        return
    with nogil:
        if n_threads <= 1:
            for i in range(n):
                memcpy(&out[i, 0], &table[_wrap(positions[i], L), 0], row_bytes)
        else:
            for i in prange(n, schedule="static", num_threads=n_threads):
                memcpy(&out[i, 0], &table[_wrap(positions[i], L), 0], row_bytes)


def add_rows(const real_t[:, ::1] tokens,     # IN  (N, d)
             const real_t[:, ::1] table,      # IN  (L, d)
             const index_t[::1] positions,    # IN  (m,), N % m == 0
             real_t[:, ::1] out,              # OUT (N, d), may be `tokens`
             int n_threads):
    """out[i, :] = tokens[i, :] + table[positions[i % m], :]."""
    cdef Py_ssize_t i, N = out.shape[0], d = table.shape[1]
    cdef Py_ssize_t L = table.shape[0], m = positions.shape[0]
    if N == 0 or d == 0:
        return
    with nogil:
        if n_threads <= 1:
            for i in range(N):
                _add_row(&tokens[i, 0], &table[_wrap(positions[i % m], L), 0],
                         &out[i, 0], d)
        else:
            for i in prange(N, schedule="static", num_threads=n_threads):
                _add_row(&tokens[i, 0], &table[_wrap(positions[i % m], L), 0],
                         &out[i, 0], d)


cdef void _sort_by_row(const index_t[::1] positions, Py_ssize_t L,
                       int64_t[::1] row_start, int64_t[::1] order) noexcept nogil:
    # Stable counting sort of j = 0..m-1 by row: afterwards the j with
    # positions[j] == r are order[row_start[r]:row_start[r + 1]], ascending.
    cdef Py_ssize_t j, r, m = positions.shape[0]
    cdef Py_ssize_t p
    for r in range(L + 1):
        row_start[r] = 0
    for j in range(m):
        row_start[_wrap(positions[j], L) + 1] += 1
    for r in range(L):
        row_start[r + 1] += row_start[r]
    for j in range(m):
        p = _wrap(positions[j], L)
        order[row_start[p]] = j
        row_start[p] += 1
    # row_start[r] now holds the end of row r; shift back to starts.
    for r in range(L, 0, -1):
        row_start[r] = row_start[r - 1]
    row_start[0] = 0


cdef Py_ssize_t _first_row_at(const int64_t[::1] row_start, Py_ssize_t L,
                              int64_t target) noexcept nogil:
    # First row r in [0, L] with row_start[r] >= target (row_start ascends).
    cdef Py_ssize_t lo = 0, hi = L, mid
    while lo < hi:
        mid = (lo + hi) // 2
        if row_start[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef void _sum_rows(real_t[:, ::1] grad, const real_t[:, ::1] g,
                    const int64_t[::1] row_start, const int64_t[::1] order,
                    Py_ssize_t r_lo, Py_ssize_t r_hi, Py_ssize_t nb,
                    Py_ssize_t m) noexcept nogil:
    # Rows r_lo..r_hi-1 of grad, each summing its contributions in input
    # order (i = k*m + j ascending): the order np.add.at uses, so results
    # are bitwise those of np.add.at whatever the thread count.
    cdef Py_ssize_t r, k, t, d = grad.shape[1]
    cdef int64_t s, e
    for r in range(r_lo, r_hi):
        s = row_start[r]
        e = row_start[r + 1]
        if s == e:
            continue
        for k in range(nb):
            for t in range(s, e):
                _acc_row(&grad[r, 0], &g[k * m + order[t], 0], d)


def scatter_add_rows(real_t[:, ::1] grad,            # IN/OUT (L, d)
                     const real_t[:, ::1] g,         # IN (N, d)
                     const index_t[::1] positions,   # IN (m,), N % m == 0
                     int64_t[::1] row_start,         # SCRATCH (L + 1,)
                     int64_t[::1] order,             # SCRATCH (m,)
                     int n_threads):
    """grad[positions[i % m], :] += g[i, :] for i = 0..N-1, deterministically.

    Each thread owns a contiguous block of table rows holding about 1/n of
    the contributions; no two threads write the same row, so there are no
    races and no atomics, and each row's sum has one fixed order.
    """
    cdef Py_ssize_t L = grad.shape[0], d = grad.shape[1]
    cdef Py_ssize_t m = positions.shape[0], N = g.shape[0]
    cdef Py_ssize_t nb, t, r_lo, r_hi
    if N == 0 or d == 0 or m == 0:
        return
    nb = N // m
    with nogil:
        _sort_by_row(positions, L, row_start, order)
        if n_threads <= 1:
            _sum_rows(grad, g, row_start, order, 0, L, nb, m)
        else:
            for t in prange(n_threads, schedule="static", num_threads=n_threads):
                r_lo = _first_row_at(row_start, L, (t * m) // n_threads)
                r_hi = _first_row_at(row_start, L, ((t + 1) * m) // n_threads)
                if t == n_threads - 1:
                    r_hi = L
                _sum_rows(grad, g, row_start, order, r_lo, r_hi, nb, m)
