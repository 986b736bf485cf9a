# Kernels for cposembed, as called from Python: gather rows, add rows,
# scatter-add rows, and the runtime queries of the build.
#
# The kernels themselves are in _kernels_impl.pxi (shared with
# _fastcall.pyx); these entry points take typed memoryviews and trust their
# inputs, which the Python layer (cposembed/_validation.py and
# cposembed/functional.py) has checked. Compiler directives are set in
# setup.py.

include "_kernels_impl.pxi"


def openmp_enabled():
    """True if this extension was compiled with OpenMP."""
    return bool(CPOSEMBED_OPENMP_ENABLED)


def omp_max_threads():
    """omp_get_max_threads() of the OpenMP runtime, or 1 in a serial build."""
    return omp_get_max_threads()


def default_num_threads():
    """CPOSEMBED_NUM_THREADS if it is set to plain decimal digits, else
    omp_get_max_threads() if it is unset or blank, else -1 (let Python parse
    it, and word the error). One C call: the default thread count is asked
    for on every kernel call, and the Python route through os.environ costs
    about 0.1 ms when the interpreter's code is cold after a large call."""
    cdef const char* raw = getenv("CPOSEMBED_NUM_THREADS")
    cdef long n = 0
    cdef int digits = 0
    if raw == NULL:
        return omp_get_max_threads()
    while raw[0] == 32 or (9 <= raw[0] <= 13):  # leading white space
        raw += 1
    while 48 <= raw[0] <= 57 and digits < 9:
        n = n * 10 + (raw[0] - 48)
        digits += 1
        raw += 1
    while raw[0] == 32 or (9 <= raw[0] <= 13):
        raw += 1
    if raw[0] != 0:
        return -1
    if digits == 0:
        return omp_get_max_threads()  # blank
    return n if n >= 1 else -1


def streaming_stores_available():
    """True if this build streams large outputs with non-temporal stores (x86-64 SSE2)."""
    return bool(cpe_have_stream())


def index_bounds(const index_t[::1] positions):  # IN
    """(min, max) of a non-empty index array, in one pass without the GIL."""
    cdef int64_t lo, hi
    with nogil:
        _min_max(&positions[0], positions.shape[0], &lo, &hi)
    return lo, hi


def repeats_every(const index_t[::1] positions, Py_ssize_t period):  # IN
    """True if positions[i] == positions[i - period] for every i >= period."""
    cdef bint same = True
    if positions.shape[0] == 0:
        return same
    with nogil:
        same = _repeats(&positions[0], positions.shape[0], period)
    return same


# ---- lookup ------------------------------------------------------------------


def lookup_rows(const real_t[:, ::1] table,    # IN  (L, d)
                const index_t[::1] positions,  # IN  (n,)
                real_t[:, ::1] out,            # OUT (n, d)
                int n_threads,
                bint stream=False,
                bint prefetch=True):
    """out[i, :] = table[positions[i], :]; `stream`: non-temporal stores;
    `prefetch`: ask for the next source row ahead (for random positions)."""
    cdef Py_ssize_t n = out.shape[0], d = table.shape[1]
    cdef Py_ssize_t L = table.shape[0]
    if n == 0 or d == 0:
        return
    cdef const real_t* tp = &table[0, 0]
    cdef const index_t* pp = &positions[0]
    cdef real_t* op = &out[0, 0]
    with nogil:
        _lookup(tp, pp, op, n, L, d, n_threads, stream, prefetch)


# ---- add ---------------------------------------------------------------------


def add_rows(const real_t[:, ::1] tokens,     # IN  (N, d)
             const real_t[:, ::1] table,      # IN  (L, d)
             const index_t[::1] positions,    # IN  (m,), N % m == 0
             real_t[:, ::1] out,              # OUT (N, d), may be `tokens`
             int n_threads,
             bint stream=False,
             bint nta=True):
    """out[i, :] = tokens[i, :] + table[positions[i % m], :].

    `stream`: non-temporal stores; `nta`: prefetch the token rows with a
    non-temporal hint so that they do not evict the table rows.
    """
    cdef Py_ssize_t N = out.shape[0], d = table.shape[1]
    cdef Py_ssize_t L = table.shape[0], m = positions.shape[0]
    if N == 0 or d == 0:
        return
    cdef const real_t* kp = &tokens[0, 0]
    cdef const real_t* tp = &table[0, 0]
    cdef const index_t* pp = &positions[0]
    cdef real_t* op = &out[0, 0]
    with nogil:
        _add(kp, tp, pp, op, N, L, m, d, n_threads, stream, nta)


# ---- scatter-add -------------------------------------------------------------


def scatter_add_rows(real_t[:, ::1] grad,            # IN/OUT (L, d)
                     const real_t[:, ::1] g,         # IN (N, d)
                     const index_t[::1] positions,   # IN (m,), N % m == 0
                     int64_t[::1] row_start,         # SCRATCH (L + 1,)
                     int64_t[::1] order,             # SCRATCH (m,)
                     int n_threads,
                     bint allow_distinct=True,
                     int general_mode=0,
                     Py_ssize_t scan_block_bytes=_SCAN_BLOCK_BYTES):
    """grad[positions[i % m], :] += g[i, :] for i = 0..N-1, deterministically.

    Each thread owns a set of table rows; no two threads write the same row,
    so there are no races and no atomics, and each row's sum has one fixed
    order (input order, as np.add.at). Positions that are distinct within
    the period (arange, the usual case) take a blocked path that reads the
    gradient once in long contiguous runs. Others (general_mode 0 = auto):
    mode 1, the scan: each thread reads the gradient rows of its own table
    rows front to back (a stable split of the positions by owner) and
    updates those rows in cache, in column blocks of about
    `scan_block_bytes` per thread; mode 2, when the rows would not stay in
    cache: a counting sort, then each row sums all its contributions at once,
    read at random; mode 3: each thread scans a band of columns of all rows.
    `allow_distinct=False`
    and `general_mode` force a path (for tests); all paths give the same bits.
    """
    cdef Py_ssize_t L = grad.shape[0], d = grad.shape[1]
    cdef Py_ssize_t m = positions.shape[0], N = g.shape[0]
    cdef Py_ssize_t nb
    if N == 0 or d == 0 or m == 0:
        return
    nb = N // m
    cdef real_t* gp = &grad[0, 0]
    cdef const real_t* sp = &g[0, 0]
    cdef const index_t* pp = &positions[0]
    cdef int64_t* rs = &row_start[0]
    cdef int64_t* od = &order[0]
    with nogil:
        _scatter_add(gp, sp, pp, rs, od, L, d, m, nb, n_threads, allow_distinct,
                     general_mode, scan_block_bytes)
