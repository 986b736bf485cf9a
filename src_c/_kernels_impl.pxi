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
#
# Work is split by hand into one contiguous block of rows per thread (what
# schedule="static" would do) so that each thread can end its block with a
# store fence after streaming stores (see _stream.h), and so that freshly
# allocated outputs are first touched by the thread that writes them.
#
# Included by _kernels.pyx (the Python-facing kernel entry points) and by
# _fastcall.pyx (the plain-case fast paths), so both call the same code.

from cython.parallel cimport prange
from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free, getenv, malloc

from _openmp cimport CPOSEMBED_OPENMP_ENABLED, omp_get_max_threads


cdef extern from "_stream.h" nogil:
    int cpe_have_stream()
    void cpe_sfence()
    void cpe_prefetch(const void* p)
    void cpe_prefetch_nta(const void* p)
    void cpe_prefetch_w(const void* p)
    void cpe_copy_f32(float* dst, const float* src, Py_ssize_t n, int stream)
    void cpe_copy_f64(double* dst, const double* src, Py_ssize_t n, int stream)
    void cpe_add_f32(float* out, const float* a, const float* b, Py_ssize_t n, int stream)
    void cpe_add_f64(double* out, const double* a, const double* b, Py_ssize_t n,
                     int stream)
    void cpe_acc_f32(float* acc, const float* src, const float* nxt, const float* far,
                     float* nacc, Py_ssize_t n)
    void cpe_acc_f64(double* acc, const double* src, const double* nxt, const double* far,
                     double* nacc, Py_ssize_t n)


ctypedef fused real_t:
    float
    double


ctypedef fused index_t:
    int32_t
    int64_t

# The "distinct positions" scatter-add path sums a block of table rows over
# the whole batch before moving on; this is the block's size in bytes per
# thread: well inside a 512 KiB-1 MiB L2 next to the gradient streaming by.
cdef enum:
    _BLOCK_BYTES = 262144
# The general scatter-add path keeps each thread's share of the table in
# cache while the gradient streams by: this many bytes of it per thread
# (most of a shared L3 of a few MiB per core).
cdef enum:
    _SCAN_BLOCK_BYTES = 8388608


cdef void _min_max(const index_t* p, Py_ssize_t n, int64_t* lo,
                   int64_t* hi) noexcept nogil:
    # The smallest and largest of p[0..n-1], n >= 1 (the bounds check of
    # the Python layer, _kernels.index_bounds, and of _fastcall's entries).
    cdef Py_ssize_t i
    cdef int64_t a = p[0], b = p[0], v
    for i in range(1, n):
        v = p[i]
        a = v if v < a else a
        b = v if v > b else b
    lo[0] = a
    hi[0] = b


cdef bint _repeats(const index_t* p, Py_ssize_t n, Py_ssize_t period) noexcept nogil:
    # p[i] == p[i - period] for all i >= period (n a multiple of period):
    # explicit (B, T) positions that are one period of T (arange expanded,
    # typically), which scatter-add's blocked path can take. Stops at the
    # first difference, which random positions show at once.
    cdef Py_ssize_t i
    for i in range(period, n):
        if p[i] != p[i - period]:
            return False
    return True


cdef inline Py_ssize_t _wrap(int64_t p, Py_ssize_t n_rows) noexcept nogil:
    # Positions were checked to lie in [-n_rows, n_rows).
    return <Py_ssize_t>(p + n_rows if p < 0 else p)


cdef inline void _copy_row(real_t* dst, const real_t* src, Py_ssize_t d,
                           int stream) noexcept nogil:
    if real_t is float:
        cpe_copy_f32(dst, src, d, stream)
    else:
        cpe_copy_f64(dst, src, d, stream)


cdef inline void _add_row(const real_t* a, const real_t* b, real_t* out,
                          Py_ssize_t d, int stream) noexcept nogil:
    # `out` may be `a` (in-place add_to); element k only reads a[k], b[k].
    if real_t is float:
        cpe_add_f32(out, a, b, d, stream)
    else:
        cpe_add_f64(out, a, b, d, stream)


cdef inline void _acc_row(real_t* acc, const real_t* src, const real_t* nxt,
                          const real_t* far, real_t* nacc, Py_ssize_t d) noexcept nogil:
    # acc += src; asks for the lines of `nxt` (next source row, L1), `far`
    # (a source row further ahead, L2) and `nacc` (the next row to add
    # into) as it goes; any may be NULL (see _stream.h).
    if real_t is float:
        cpe_acc_f32(acc, src, nxt, far, nacc, d)
    else:
        cpe_acc_f64(acc, src, nxt, far, nacc, d)


cdef inline void _prefetch_row(const real_t* src, Py_ssize_t d) noexcept nogil:
    # The next row of a random gather: ask for all its cache lines now, so
    # they arrive while the current row is copied.
    cdef Py_ssize_t k = 0
    cdef Py_ssize_t step = 64 // sizeof(real_t)
    while k < d:
        cpe_prefetch(src + k)
        k += step


cdef inline void _prefetch_once(const real_t* src, Py_ssize_t d) noexcept nogil:
    # A row read once, a few rows ahead: fetched without evicting the rows
    # that are reused (non-temporal hint).
    cdef Py_ssize_t k = 0
    cdef Py_ssize_t step = 64 // sizeof(real_t)
    while k < d:
        cpe_prefetch_nta(src + k)
        k += step


# How many rows ahead the streamed-once rows are prefetched.
cdef enum:
    _AHEAD = 4


cdef inline Py_ssize_t _block_lo(Py_ssize_t n, int t, int n_threads) noexcept nogil:
    return <Py_ssize_t>((<int64_t>n * t) // n_threads)


# ---- lookup ------------------------------------------------------------------


cdef void _lookup_block(const real_t* table, const index_t* positions, real_t* out,
                        Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t L, Py_ssize_t d,
                        int stream, int prefetch) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(lo, hi):
        if prefetch and i + 1 < hi:
            _prefetch_row(table + _wrap(positions[i + 1], L) * d, d)
        _copy_row(out + i * d, table + _wrap(positions[i], L) * d, d, stream)
    if stream:
        cpe_sfence()


cdef void _lookup(const real_t* tp, const index_t* pp, real_t* op, Py_ssize_t n,
                  Py_ssize_t L, Py_ssize_t d, int n_threads, int stream,
                  int prefetch) noexcept nogil:
    # op[i, :] = tp[pp[i], :] for i < n, on n_threads.
    cdef int t
    if n_threads <= 1:
        _lookup_block(tp, pp, op, 0, n, L, d, stream, prefetch)
    else:
        for t in prange(n_threads, schedule="static", num_threads=n_threads):
            _lookup_block(tp, pp, op, _block_lo(n, t, n_threads),
                          _block_lo(n, t + 1, n_threads), L, d, stream, prefetch)


# ---- add ---------------------------------------------------------------------


cdef void _add_block(const real_t* tokens, const real_t* table, const index_t* positions,
                     real_t* out, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t L,
                     Py_ssize_t m, Py_ssize_t d, int stream, int nta) noexcept nogil:
    cdef Py_ssize_t i, j = lo % m
    for i in range(lo, hi):
        if nta and i + _AHEAD < hi:
            _prefetch_once(tokens + (i + _AHEAD) * d, d)
        _add_row(tokens + i * d, table + _wrap(positions[j], L) * d, out + i * d, d, stream)
        j += 1
        if j == m:
            j = 0
    if stream:
        cpe_sfence()


cdef void _add(const real_t* kp, const real_t* tp, const index_t* pp, real_t* op,
               Py_ssize_t N, Py_ssize_t L, Py_ssize_t m, Py_ssize_t d, int n_threads,
               int stream, int nta) noexcept nogil:
    # op[i, :] = kp[i, :] + tp[pp[i % m], :] for i < N, on n_threads.
    cdef int t
    if n_threads <= 1:
        _add_block(kp, tp, pp, op, 0, N, L, m, d, stream, nta)
    else:
        for t in prange(n_threads, schedule="static", num_threads=n_threads):
            _add_block(kp, tp, pp, op, _block_lo(N, t, n_threads),
                       _block_lo(N, t + 1, n_threads), L, m, d, stream, nta)


# ---- scatter-add -------------------------------------------------------------


cdef bint _count_rows(const index_t* positions, Py_ssize_t m, Py_ssize_t L,
                      int64_t* row_start) noexcept nogil:
    # row_start[r + 1] = number of j with positions[j] == r; returns whether
    # every row is hit at most once (positions distinct within the period).
    cdef Py_ssize_t j, r
    cdef bint distinct = True
    cdef int64_t c
    for r in range(L + 1):
        row_start[r] = 0
    for j in range(m):
        r = _wrap(positions[j], L) + 1
        c = row_start[r] + 1
        row_start[r] = c
        if c > 1:
            distinct = False
    return distinct


cdef void _prefix_rows(Py_ssize_t L, int64_t* row_start) noexcept nogil:
    # Counts in row_start[1:] -> row_start[r] = first slot of row r.
    cdef Py_ssize_t r
    for r in range(L):
        row_start[r + 1] += row_start[r]


cdef void _sort_by_row(const index_t* positions, Py_ssize_t m, Py_ssize_t L,
                       int64_t* row_start, int64_t* order) noexcept nogil:
    # Stable counting sort of j = 0..m-1 by row (row_start already prefixed):
    # afterwards the j with positions[j] == r are
    # order[row_start[r]:row_start[r + 1]], ascending.
    cdef Py_ssize_t j, r, p
    for j in range(m):
        p = _wrap(positions[j], L)
        order[row_start[p]] = j
        row_start[p] += 1
    # row_start[r] now holds the end of row r; shift back to starts.
    for r in range(L, 0, -1):
        row_start[r] = row_start[r - 1]
    row_start[0] = 0


cdef inline Py_ssize_t _col_edge(Py_ssize_t d, int t, int n_threads,
                                 Py_ssize_t esz) noexcept nogil:
    # Start of thread t's column band: a multiple of 64 bytes, d at the end.
    cdef Py_ssize_t per_line = 64 // esz
    cdef Py_ssize_t c
    if t >= n_threads:
        return d
    c = (d * t) // n_threads
    c = (c // per_line) * per_line
    return c


cdef Py_ssize_t _first_row_at(const int64_t* row_start, Py_ssize_t L,
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


cdef void _sum_rows(real_t* grad, const real_t* g,
                    const int64_t* row_start, const int64_t* order,
                    Py_ssize_t r_lo, Py_ssize_t r_hi, Py_ssize_t nb,
                    Py_ssize_t m, Py_ssize_t d) noexcept nogil:
    # Rows r_lo..r_hi-1 of grad, each summing its contributions in input
    # order (i = k*m + j ascending): the order np.add.at uses, so results
    # are bitwise those of np.add.at whatever the thread count. The source
    # rows come in random order, so the next one is prefetched.
    cdef Py_ssize_t r, k, t, d_ = d
    cdef int64_t s, e, last = row_start[r_hi]
    cdef real_t* acc
    cdef const real_t* nxt
    for r in range(r_lo, r_hi):
        s = row_start[r]
        e = row_start[r + 1]
        if s == e:
            continue
        acc = grad + r * d_
        for k in range(nb):
            for t in range(s, e):
                if t + 1 < e:
                    nxt = g + (k * m + order[t + 1]) * d_
                elif k + 1 < nb:
                    nxt = g + ((k + 1) * m + order[s]) * d_
                elif e < last:
                    nxt = g + order[e] * d_
                else:
                    nxt = NULL
                _acc_row(acc, g + (k * m + order[t]) * d_, nxt, NULL, NULL, d_)


cdef void _sum_distinct(real_t* grad, const real_t* g, const index_t* positions,
                        Py_ssize_t j_lo, Py_ssize_t j_hi, Py_ssize_t nb,
                        Py_ssize_t m, Py_ssize_t L, Py_ssize_t d) noexcept nogil:
    # Positions j_lo..j_hi-1 hit distinct rows, so row positions[j] receives
    # exactly g[k*m + j] for k = 0..nb-1, summed in that order (np.add.at's).
    # Blocked: a block of table rows small enough to stay in cache takes the
    # whole batch, reading each block of g (contiguous rows) once; the next
    # row of g is prefetched line by line (a jump at each block's end).
    cdef Py_ssize_t rows_per_block = _BLOCK_BYTES // (d * sizeof(real_t))
    cdef Py_ssize_t b0, b1, j, k
    cdef const real_t* nxt
    if rows_per_block < 1:
        rows_per_block = 1
    b0 = j_lo
    while b0 < j_hi:
        b1 = b0 + rows_per_block
        if b1 > j_hi:
            b1 = j_hi
        for k in range(nb):
            for j in range(b0, b1):
                if j + 1 < b1:
                    nxt = g + (k * m + j + 1) * d
                elif k + 1 < nb:
                    nxt = g + ((k + 1) * m + b0) * d
                else:
                    nxt = NULL
                _acc_row(grad + _wrap(positions[j], L) * d, g + (k * m + j) * d,
                         nxt, NULL, NULL, d)
        b0 = b1


cdef void _scan_rows(real_t* grad, const real_t* g, const index_t* positions,
                     const int64_t* order, Py_ssize_t q_lo, Py_ssize_t q_hi,
                     Py_ssize_t n_rows, Py_ssize_t nb, Py_ssize_t m, Py_ssize_t L,
                     Py_ssize_t d, Py_ssize_t block_bytes, Py_ssize_t col_lo,
                     Py_ssize_t col_hi) noexcept nogil:
    # Takes the contributions j = order[q] (j = q if order is NULL) for q in
    # q_lo..q_hi-1, ascending, for every batch k: input order i = k*m + j,
    # so bitwise np.add.at's, while reading g front to back. The caller
    # hands each thread only the j that fall in its own n_rows rows, so no
    # two threads write the same row. Those rows are
    # updated at random, so they must stay in cache: columns are done in
    # blocks small enough for that (one block, the whole row, for GPT-2-size
    # tables). A thread may also own only the columns col_lo..col_hi-1.
    cdef Py_ssize_t k, q, j, j1, c0, c1, bd
    cdef Py_ssize_t esz = sizeof(real_t)
    cdef const real_t* nxt
    cdef const real_t* far
    cdef real_t* nacc
    if q_hi <= q_lo:
        return
    bd = block_bytes // (n_rows * esz) if n_rows > 0 else d
    bd = (bd // 16) * 16
    if bd < 16:
        bd = 16
    c0 = col_lo
    while c0 < col_hi:
        c1 = c0 + bd
        if c1 > col_hi:
            c1 = col_hi
        for k in range(nb):
            for q in range(q_lo, q_hi):
                j = order[q] if order != NULL else q
                # The rows read next are at random distances: the next one
                # line by line into L1, the one _AHEAD further into L2; the
                # row added into next is at random in the cache.
                nxt = NULL
                far = NULL
                nacc = NULL
                if q + 1 < q_hi:
                    j1 = order[q + 1] if order != NULL else q + 1
                    nxt = g + (k * m + j1) * d + c0
                    nacc = grad + _wrap(positions[j1], L) * d + c0
                if q + _AHEAD < q_hi:
                    j1 = order[q + _AHEAD] if order != NULL else q + _AHEAD
                    far = g + (k * m + j1) * d + c0
                _acc_row(grad + _wrap(positions[j], L) * d + c0, g + (k * m + j) * d + c0,
                         nxt, far, nacc, c1 - c0)
        c0 = c1


cdef void _owner_bounds(const int64_t* row_start, Py_ssize_t L, Py_ssize_t m,
                        int n_threads, int64_t* bounds) noexcept nogil:
    # Thread t owns rows bounds[t]..bounds[t+1]-1, holding about the t-th
    # 1/n of the contributions (row_start: prefixed counts).
    cdef int t
    for t in range(n_threads):
        bounds[t] = _first_row_at(row_start, L, (t * <int64_t>m) // n_threads)
    bounds[n_threads] = L


cdef void _mark_owners(int64_t* row_start, Py_ssize_t L, int n_threads,
                       const int64_t* bounds, int64_t* q_start) noexcept nogil:
    # q_start[t]: where thread t's contributions begin in `order` (q_start[n]
    # = m); then row_start[:L] is overwritten with each row's owner, so that
    # finding the owner of a position is one load.
    cdef int t
    cdef Py_ssize_t r
    for t in range(n_threads + 1):
        q_start[t] = row_start[bounds[t]]
    for t in range(n_threads):
        for r in range(bounds[t], bounds[t + 1]):
            row_start[r] = t


cdef Py_ssize_t _collect_own(const index_t* positions, Py_ssize_t m, Py_ssize_t L,
                             const int64_t* owner, int64_t t, Py_ssize_t n_own,
                             int64_t* out) noexcept nogil:
    # out[:n_own] = the j (ascending) whose row thread t owns. Branch-free
    # but for the end test: a branch on the owner would be a coin flip for
    # random positions (10 ns per position measured). Every thread runs this
    # at once over all positions, each writing only its own out[:n_own].
    cdef Py_ssize_t j, n = 0
    for j in range(m):
        if n == n_own:
            break
        out[n] = j
        n += owner[_wrap(positions[j], L)] == t
    return n


cdef void _scatter_add(real_t* gp, const real_t* sp, const index_t* pp, int64_t* rs,
                       int64_t* od, Py_ssize_t L, Py_ssize_t d, Py_ssize_t m,
                       Py_ssize_t nb, int n_threads, bint allow_distinct,
                       int general_mode, Py_ssize_t scan_block_bytes) noexcept nogil:
    cdef Py_ssize_t r_lo, r_hi, owned, t_rows, q_lo, q_hi
    cdef Py_ssize_t esz = sizeof(real_t)
    # bounds and q_start, n+1 each (the scan with threads, mode 1)
    cdef int64_t* work = NULL
    cdef int t
    cdef bint distinct
    distinct = _count_rows(pp, m, L, rs) and allow_distinct
    if distinct:
        if n_threads <= 1:
            _sum_distinct(gp, sp, pp, 0, m, nb, m, L, d)
        else:
            for t in prange(n_threads, schedule="static", num_threads=n_threads):
                _sum_distinct(gp, sp, pp, _block_lo(m, t, n_threads),
                              _block_lo(m, t + 1, n_threads), nb, m, L, d)
        return
    _prefix_rows(L, rs)
    if n_threads > 1 and (general_mode == 0 or general_mode == 1):
        work = <int64_t*>malloc(2 * (n_threads + 1) * sizeof(int64_t))
        if work == NULL:
            general_mode = 2
        else:
            _owner_bounds(rs, L, m, n_threads, work)
    if general_mode == 0:
        # The scan (mode 1) reads the gradient in order, each thread only
        # the rows of its own table rows, which must then stay in cache.
        # One thread: column blocks keep them there, unless even 16-column
        # blocks overflow the budget. Several threads: whole rows, if each
        # thread's rows fit. Otherwise the counting sort (mode 2): each
        # output row sums its contributions at once, read at random.
        # (Column bands per thread, mode 3, measured slower; kept as an option.)
        if n_threads <= 1:
            general_mode = 1 if L * 16 * esz <= scan_block_bytes else 2
        else:
            owned = 0
            for t in range(n_threads):
                t_rows = work[t + 1] - work[t]
                if t_rows > owned:
                    owned = t_rows
            general_mode = 1 if owned * d * esz <= scan_block_bytes else 2
    if general_mode == 1 and n_threads > 1:
        _mark_owners(rs, L, n_threads, work, work + (n_threads + 1))
    if general_mode == 3 and n_threads <= 1:
        general_mode = 1
    if general_mode == 2:
        _sort_by_row(pp, m, L, rs, od)
    if n_threads <= 1:
        if general_mode == 1:
            _scan_rows(gp, sp, pp, NULL, 0, m, L, nb, m, L, d, scan_block_bytes, 0, d)
        else:
            _sum_rows(gp, sp, rs, od, 0, L, nb, m, d)
    elif general_mode == 1:
        # Thread t lists its own contributions, then scans them in order.
        for t in prange(n_threads, schedule="static", num_threads=n_threads):
            q_lo = work[n_threads + 1 + t]
            q_hi = work[n_threads + 2 + t]
            _collect_own(pp, m, L, rs, t, q_hi - q_lo, od + q_lo)
            _scan_rows(gp, sp, pp, od, q_lo, q_hi, work[t + 1] - work[t], nb, m, L, d,
                       scan_block_bytes, 0, d)
    elif general_mode == 3:
        # Thread t owns a band of columns of every row (64-byte aligned
        # edges): it reads its part of every gradient row, front to back.
        for t in prange(n_threads, schedule="static", num_threads=n_threads):
            _scan_rows(gp, sp, pp, NULL, 0, m, L, nb, m, L, d, scan_block_bytes,
                       _col_edge(d, t, n_threads, sizeof(real_t)),
                       _col_edge(d, t + 1, n_threads, sizeof(real_t)))
    else:
        # Thread t owns the rows holding about the t-th 1/n of the contributions.
        for t in prange(n_threads, schedule="static", num_threads=n_threads):
            r_lo = _first_row_at(rs, L, (t * m) // n_threads)
            r_hi = _first_row_at(rs, L, ((t + 1) * m) // n_threads)
            if t == n_threads - 1:
                r_hi = L
            _sum_rows(gp, sp, rs, od, r_lo, r_hi, nb, m, d)
    free(work)
