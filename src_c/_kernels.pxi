# Kernels: gather, add and scatter-add rows, the SGD and optimizer row
# updates, on inputs the entries in _core.pyx have checked (row numbers in
# [0, L)). In the add, embed and scatter-adds, `rows` has m entries for
# N = nb * m rows: row i uses rows[i % m]. Work for several
# threads is cut into chunks (_run_chunks, _parallel.pxi): blocks of output
# rows, or ranges of table rows that one chunk owns. Rows move as bytes; the
# arithmetic is the row primitives' of _rows.h (`ops`: cpe_row_ops_for).

from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.stdlib cimport abort, calloc, free, malloc, realloc
from libc.string cimport memcpy, memset

from _openmp cimport CPOSEMBED_OPENMP_ENABLED, omp_get_max_threads, omp_get_num_procs


cdef extern from "_stream.h" nogil:
    int cpe_have_stream()
    void cpe_sfence()
    void cpe_prefetch(const void* p)
    void cpe_prefetch_l2(const void* p)
    void cpe_prefetch_nta(const void* p)
    void cpe_copy_bytes(void* dst, const void* src, size_t n, int stream)


cdef extern from "_rows.h" nogil:
    enum:
        CPE_F16
        CPE_BF16
        CPE_F32
        CPE_F64
    ctypedef void (*cpe_add_fn)(void*, const void*, const void*, Py_ssize_t, int)
    ctypedef void (*cpe_acc_fn)(void*, const void*, const void*, const void*, void*,
                                const void*, Py_ssize_t)
    ctypedef void (*cpe_acc2_fn)(void*, void*, const void*, const void*, const void*,
                                 const void*, Py_ssize_t)
    ctypedef void (*cpe_sgd_fn)(void*, const void*, Py_ssize_t, double)
    ctypedef struct cpe_row_ops:
        cpe_add_fn add
        cpe_acc_fn acc
        cpe_acc2_fn acc2
        cpe_sgd_fn sgd
        Py_ssize_t tsize
        Py_ssize_t gsize
    void cpe_row_ops_for(int t, int g, cpe_row_ops* ops)
    enum:
        CPE_OPT_SGD
        CPE_OPT_ADAM
        CPE_OPT_FRESH
        CPE_OPT_ADD_ZERO
    ctypedef struct cpe_opt_hyper:
        int kind
        int l2
        int decoupled
        int momentum_on
        int nesterov
        double neg_lr
        double weight_decay
        double momentum
        double damp1
        double decay
        double w1
        double beta2
        double omb2
        double bc2_sqrt
        double eps
        double neg_step
    ctypedef void (*cpe_opt_fn)(void*, const void*, void*, void*, int, const cpe_opt_hyper*,
                                Py_ssize_t)
    cpe_opt_fn cpe_opt_for(int t)
    void cpe_set_bf16_from_f64_direct(int direct)
    void cpe_init_isa()
    int cpe_set_isa(int isa)
    int cpe_best_isa()


# How the scatter-add assigns contributions to threads (each table row is
# summed by one thread in input order, as np.add.at sums it): chosen per call
# (_choose_plan), or distinct rows (_sum_distinct), the scan (_scan_rows) or
# the sort (_sum_rows).
cpdef enum ScatterPlan:
    PLAN_AUTO = 0
    PLAN_DISTINCT = 1
    PLAN_SCAN = 2
    PLAN_SORT = 3


cdef enum:
    # The distinct plan's block of table rows, in bytes: well inside L2.
    _BLOCK_BYTES = 262144
    # Lookups prefetch the next row from tables larger than this (beyond L2).
    _PREFETCH_TABLE_BYTES = 524288
    # How many rows ahead rows read once, and rows to add into, are prefetched.
    _AHEAD = 4
    # How many rows ahead rows read out of order are asked for into L2.
    _GATHER_AHEAD = 8
    # A row kernel's chunk, in elements of output (a few microseconds: a slow
    # thread holds the others up by little); the distinct plan's, of gradient.
    _CHUNK_ELEMS = 65536
    _SCATTER_CHUNK_ELEMS = 524288
    # A table row's cost (_owner_bounds) besides one per contribution.
    _ROW_COST = 3

# The scan plan's largest share of the table per thread, in bytes.
cdef Py_ssize_t _scan_block_bytes = 8388608
cdef Py_ssize_t _chunk_elems = _CHUNK_ELEMS

# Outputs at least this large are written with streaming (non-temporal)
# stores (_stream.h); smaller ones stay in cache for the next op.
STREAM_THRESHOLD_BYTES = 1 << 23
cdef Py_ssize_t _STREAM_BYTES = STREAM_THRESHOLD_BYTES


def streaming_stores_available():
    """True if this build streams large outputs with non-temporal stores (x86-64 SSE2)."""
    return bool(cpe_have_stream())


def set_tuning(serial_below=None, stream_bytes=None, scan_block_bytes=None,
               chunk_elems=None, adapt=None):
    """Change the size rules and the measured choice (for tests); returns
    the old values. None keeps a value; setting adapt forgets what was measured."""
    global _SERIAL_BELOW, _STREAM_BYTES, _scan_block_bytes, _chunk_elems
    old = {"serial_below": _SERIAL_BELOW, "stream_bytes": _STREAM_BYTES,
           "scan_block_bytes": _scan_block_bytes, "chunk_elems": _chunk_elems,
           "adapt": bool(cpe_adapting)}
    if chunk_elems is not None:
        _chunk_elems = max(1, <Py_ssize_t>chunk_elems)
    if adapt is not None:
        cpe_set_adapting(1 if adapt else 0)
    if serial_below is not None:
        _SERIAL_BELOW = max(0, <Py_ssize_t>serial_below)
    if stream_bytes is not None:
        _STREAM_BYTES = max(0, <Py_ssize_t>stream_bytes)
    if scan_block_bytes is not None:
        _scan_block_bytes = max(1, <Py_ssize_t>scan_block_bytes)
    return old


cdef inline Py_ssize_t _per_chunk(Py_ssize_t unit, Py_ssize_t elems) noexcept nogil:
    # Items of `unit` elements each in a chunk of about `elems`: at least one.
    return elems // unit if unit and elems // unit > 1 else 1


cdef inline Py_ssize_t _chunks_of(Py_ssize_t n, Py_ssize_t per) noexcept nogil:
    return (n + per - 1) // per


cdef bint _repeats(const int64_t* p, Py_ssize_t n, Py_ssize_t period) noexcept nogil:
    # p[i] == p[i - period] for all i >= period (n a multiple of period).
    cdef Py_ssize_t i
    for i in range(period, n):
        if p[i] != p[i - period]:
            return False
    return True


# Where _prefetch_row asks a row's lines to go: L1 (the next row), L2 (a row a
# few ahead), or non-temporal (a row read once: it should not evict others).
cdef enum:
    _TO_L1 = 0
    _TO_L2 = 1
    _ONCE = 2


cdef inline void _prefetch_row(const char* src, Py_ssize_t nbytes, int where) noexcept nogil:
    # Asks for every cache line of a row (where: a constant at each call).
    cdef Py_ssize_t k = 0
    while k < nbytes:
        if where == _TO_L1:
            cpe_prefetch(src + k)
        elif where == _TO_L2:
            cpe_prefetch_l2(src + k)
        else:
            cpe_prefetch_nta(src + k)
        k += 64


# ---- the kernels' calls --------------------------------------------------------


cdef enum Kernel:
    K_LOOKUP
    K_ADD
    K_SCATTER_ADD
    K_SGD
    K_EMBED
    K_SCATTER_PAIR
    K_OPT  # the optimizers' step


cdef struct KernelCall:
    # One kernel call (_core.pyx's _run_kernel); each kernel reads the fields it takes.
    #   out (written): the output, grad, the SGD table or gtok; out2: gpos
    #   src (read): the lookup's table, tokens, the token table, g or SGD's grad;
    #   table: the position table; rows: the rows of src (lookup, SGD) or of table
    #   src_type: src's dtype where it may differ from the table's; -1: the table's
    Kernel kernel
    void* out
    void* out2
    const void* src
    const void* table
    const int64_t* rows
    const int64_t* ids
    Py_ssize_t n         # rows to write or read (N)
    Py_ssize_t m         # entries of `rows` (the period)
    Py_ssize_t L
    Py_ssize_t V
    Py_ssize_t d
    int n_threads
    int stream
    int prefetch         # lookup, embed: the table is beyond L2; add: in place
    int plan             # a ScatterPlan
    double lr            # the SGD step, rounded to the compute type by the row primitive
    int64_t* scratch
    int src_type
    # The sparse plan: `out` (`out2`) is a compact copy of the rows compact_rows
    # (compact_rows2) of compact_of (compact_of2), L of them (the pair's `out`: V),
    # gathered before the sums and written back after (_compact_rows).
    void* compact_of
    const int64_t* compact_rows
    void* compact_of2
    const int64_t* compact_rows2
    FusedStep* fused     # the optimizer step fused into the pair's sums, or NULL
    OptJob* opt          # K_OPT's step


# ---- row kernels: lookup, add, embed, SGD ------------------------------------


cdef void _add_block(const char* tokens, const int64_t* ids, const char* table,
                     const int64_t* rows, char* out, Py_ssize_t lo, Py_ssize_t hi,
                     Py_ssize_t m, Py_ssize_t d, const cpe_row_ops* ops, int stream,
                     int prefetch) noexcept nogil:
    # out[i] = tokens[ids[i]] (tokens[i] if ids is NULL) + table[rows[i % m]];
    # `out` may be `tokens`. prefetch: without ids (in place), the token row
    # _AHEAD on, once; with ids, the next one into L1, the one _AHEAD on, L2.
    cdef Py_ssize_t i, j = lo % m, rb = d * ops.tsize
    cdef const char* src
    for i in range(lo, hi):
        if ids == NULL:
            if prefetch and i + _AHEAD < hi:
                _prefetch_row(tokens + (i + _AHEAD) * rb, rb, _ONCE)
            src = tokens + i * rb
        else:
            if prefetch and i + 1 < hi:
                _prefetch_row(tokens + ids[i + 1] * rb, rb, _TO_L1)
                if i + _AHEAD < hi:
                    _prefetch_row(tokens + ids[i + _AHEAD] * rb, rb, _TO_L2)
            src = tokens + ids[i] * rb
        ops.add(out + i * rb, src, table + rows[j] * rb, d, stream)
        j += 1
        if j == m:
            j = 0


cdef void _run_split(void (*chunk)(void*, Py_ssize_t) noexcept nogil, void* job,
                     Py_ssize_t* per, Py_ssize_t n, Py_ssize_t d, int n_threads) noexcept nogil:
    # chunk(job, c) for chunks of *per rows of d elements (about _chunk_elems)
    # on up to n_threads (cpe_threads_here); on one thread, one chunk of n.
    cdef Py_ssize_t n_chunks
    per[0] = _per_chunk(d, _chunk_elems)
    n_chunks = _chunks_of(n, per[0])
    if n_threads > 1:
        n_threads = cpe_threads_here(min(n_threads, n_chunks))
    if n_threads <= 1:
        per[0] = n
        chunk(job, 0)
    else:
        _run_chunks(chunk, job, n_chunks, n_threads)


cdef struct RowJob:
    # A row kernel's call: chunk c does rows c * per .. min(n, (c + 1) * per) - 1.
    const KernelCall* call
    const cpe_row_ops* ops
    Py_ssize_t per


cdef void _row_chunk(void* arg, Py_ssize_t c) noexcept nogil:
    # lookup: out[i] = src[rows[i]]; add: out[i] = src[i] + table[rows[i % m]];
    # embed: out[i] = src[ids[i]] + table[rows[i % m]]; SGD: out[r] -= lr * src[r]
    # for the distinct rows r in rows (ops.sgd: NumPy's `table -= lr * grad`).
    cdef const RowJob* job = <RowJob*>arg
    cdef const KernelCall* k = job.call
    cdef const cpe_row_ops* ops = job.ops
    cdef const char* src = <const char*>k.src
    cdef char* out = <char*>k.out
    cdef const int64_t* rows = k.rows
    cdef Py_ssize_t i, lo = c * job.per, hi = min(k.n, lo + job.per)
    cdef Py_ssize_t tb = k.d * ops.tsize, gb = k.d * ops.gsize
    if k.kernel == K_LOOKUP:
        for i in range(lo, hi):
            if k.prefetch and i + 1 < hi:
                _prefetch_row(src + rows[i + 1] * tb, tb, _TO_L1)
            cpe_copy_bytes(out + i * tb, src + rows[i] * tb, tb, k.stream)
    elif k.kernel == K_SGD:
        for i in range(lo, hi):
            ops.sgd(out + rows[i] * tb, src + rows[i] * gb, k.d, k.lr)
    else:
        _add_block(src, k.ids, <const char*>k.table, rows, out, lo, hi, k.m, k.d, ops,
                   k.stream, k.prefetch)
    if k.stream:
        cpe_sfence()


cdef void _row_kernel(const KernelCall* call, const cpe_row_ops* ops) noexcept nogil:
    # A lookup, add, embed or SGD call, in chunks of output rows.
    cdef RowJob job = RowJob(call=call, ops=ops, per=0)
    _run_split(_row_chunk, &job, &job.per, call.n, call.d, call.n_threads)


# ---- scatter-add -------------------------------------------------------------


cdef bint _count_rows(const int64_t* rows, Py_ssize_t m, Py_ssize_t L,
                      int64_t* row_start) noexcept nogil:
    # row_start[r + 1] = number of j with rows[j] == r; returns whether
    # every row is hit at most once.
    cdef Py_ssize_t j, r
    cdef bint distinct = True
    cdef int64_t c
    for r in range(L + 1):
        row_start[r] = 0
    for j in range(m):
        r = rows[j] + 1
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


cdef void _sort_by_row(const int64_t* rows, Py_ssize_t m, Py_ssize_t L,
                       int64_t* row_start, int64_t* order) noexcept nogil:
    # Stable counting sort of j < m by row (row_start prefixed): the j with
    # rows[j] == r are then order[row_start[r]:row_start[r + 1]], ascending.
    cdef Py_ssize_t j, r, p
    for j in range(m):
        p = rows[j]
        order[row_start[p]] = j
        row_start[p] += 1
    # row_start[r] now holds the end of row r; shift back to starts.
    for r in range(L, 0, -1):
        row_start[r] = row_start[r - 1]
    row_start[0] = 0


cdef struct RowCursor:
    # A place in _sum_rows' reading order: row r, batch k, slot t of the
    # row's contributions order[s:e].
    int64_t r, s, e, t
    Py_ssize_t k
    bint done


cdef inline void _cursor_row(RowCursor* c, const int64_t* row_start,
                             Py_ssize_t r_hi) noexcept nogil:
    # Moves c to the first row from c.r on (below r_hi) with contributions.
    while c.r < r_hi:
        c.s = row_start[c.r]
        c.e = row_start[c.r + 1]
        if c.s < c.e:
            c.k = 0
            c.t = c.s
            return
        c.r += 1
    c.done = True


cdef inline void _cursor_next(RowCursor* c, const int64_t* row_start, Py_ssize_t r_hi,
                              Py_ssize_t nb) noexcept nogil:
    if c.done:
        return
    c.t += 1
    if c.t < c.e:
        return
    c.k += 1
    if c.k < nb:
        c.t = c.s
        return
    c.r += 1
    _cursor_row(c, row_start, r_hi)


cdef void _sum_rows(char* grad, const char* g, const int64_t* row_start,
                    const int64_t* order, Py_ssize_t r_lo, Py_ssize_t r_hi, Py_ssize_t nb,
                    Py_ssize_t m, Py_ssize_t d, const cpe_row_ops* ops) noexcept nogil:
    # Rows r_lo..r_hi-1 of grad, one at a time, each summing its contributions
    # in input order (i = k*m + j ascending). Prefetched: the next source row
    # (L1), the one _GATHER_AHEAD on (L2).
    cdef RowCursor cur, nxt, far
    cdef int k
    cdef const char* pn
    cdef const char* pf
    cdef Py_ssize_t tb = d * ops.tsize, gb = d * ops.gsize
    cur.r = r_lo
    cur.done = False
    _cursor_row(&cur, row_start, r_hi)
    nxt = cur
    _cursor_next(&nxt, row_start, r_hi, nb)
    far = nxt
    for k in range(_GATHER_AHEAD - 1):
        _cursor_next(&far, row_start, r_hi, nb)
    while not cur.done:
        pn = NULL
        pf = NULL
        if not nxt.done:
            pn = g + (nxt.k * m + order[nxt.t]) * gb
        if not far.done:
            pf = g + (far.k * m + order[far.t]) * gb
        ops.acc(grad + cur.r * tb, g + (cur.k * m + order[cur.t]) * gb, pn, pf, NULL, NULL, d)
        cur = nxt
        _cursor_next(&nxt, row_start, r_hi, nb)
        _cursor_next(&far, row_start, r_hi, nb)


cdef void _scan_rows(char* grad, const char* g, const int64_t* rows,
                     const int64_t* order, Py_ssize_t q_lo, Py_ssize_t q_hi,
                     Py_ssize_t nb, Py_ssize_t m, Py_ssize_t d,
                     const cpe_row_ops* ops) noexcept nogil:
    # The contributions j = order[q] (q if order is NULL), q_lo <= q < q_hi,
    # for every batch k, in input order. Prefetched: the next source row (L1),
    # the one _AHEAD on (L2), the next row added into.
    cdef Py_ssize_t k, q, j, j1
    cdef Py_ssize_t tb = d * ops.tsize, gb = d * ops.gsize
    cdef const char* nxt
    cdef const char* far
    cdef char* nacc
    for k in range(nb):
        for q in range(q_lo, q_hi):
            j = order[q] if order != NULL else q
            nxt = NULL
            far = NULL
            nacc = NULL
            if q + 1 < q_hi:
                j1 = order[q + 1] if order != NULL else q + 1
                nxt = g + (k * m + j1) * gb
                nacc = grad + rows[j1] * tb
            if q + _AHEAD < q_hi:
                j1 = order[q + _AHEAD] if order != NULL else q + _AHEAD
                far = g + (k * m + j1) * gb
            ops.acc(grad + rows[j] * tb, g + (k * m + j) * gb, nxt, far, nacc, NULL, d)


cdef void _sum_distinct(char* grad, const char* g, const int64_t* rows,
                        Py_ssize_t j_lo, Py_ssize_t j_hi, Py_ssize_t nb,
                        Py_ssize_t m, Py_ssize_t d, const cpe_row_ops* ops) noexcept nogil:
    # Positions j_lo..j_hi-1 hit distinct rows: a block of table rows that
    # stays in cache takes the whole batch, reading each block of g once.
    cdef Py_ssize_t b0 = j_lo, per_block = max(1, _BLOCK_BYTES // (d * ops.tsize))
    while b0 < j_hi:
        _scan_rows(grad, g, rows, NULL, b0, min(j_hi, b0 + per_block), nb, m, d, ops)
        b0 += per_block


cdef void _owner_bounds(const int64_t* row_start, Py_ssize_t L, int n_threads,
                        int64_t* bounds, int64_t single_cost=0) noexcept nogil:
    # Thread t owns rows bounds[t]..bounds[t+1]-1 (row_start: prefixed
    # counts), about 1/n of the cost each: a row costs its contributions,
    # plus _ROW_COST if any, plus single_cost if one. Ranges, so that no two
    # threads write one cache line.
    cdef Py_ssize_t r
    cdef int64_t c, total = row_start[L], acc = 0
    cdef int t = 1
    for r in range(L):
        c = row_start[r + 1] - row_start[r]
        total += _ROW_COST * (c > 0) + single_cost * (c == 1)
    bounds[0] = 0
    for r in range(L):
        while t < n_threads and acc * n_threads >= t * total:
            bounds[t] = r
            t += 1
        c = row_start[r + 1] - row_start[r]
        if c:
            acc += c + _ROW_COST + single_cost * (c == 1)
    while t <= n_threads:
        bounds[t] = L
        t += 1


cdef void _set_owners(int64_t* owner, int n_threads, const int64_t* bounds) noexcept nogil:
    # owner[r] = the thread whose range of _owner_bounds holds row r.
    cdef int t
    cdef Py_ssize_t r
    for t in range(n_threads):
        for r in range(bounds[t], bounds[t + 1]):
            owner[r] = t


cdef void _group_by_owner(const int64_t* rows, Py_ssize_t m, int64_t* row_start,
                          int n_chunks, const int64_t* bounds, int64_t* q_start,
                          int64_t* q_fill, int64_t* order) noexcept nogil:
    # order[q_start[c]:q_start[c + 1]] = the j (ascending) whose row chunk c
    # owns (row_start: prefixed counts, overwritten with owners). Branch-free.
    cdef int c
    cdef Py_ssize_t j
    cdef int64_t o
    for c in range(n_chunks + 1):
        q_start[c] = row_start[bounds[c]]
    for c in range(n_chunks):
        q_fill[c] = q_start[c]
    _set_owners(row_start, n_chunks, bounds)
    for j in range(m):
        o = row_start[rows[j]]
        order[q_fill[o]] = j
        q_fill[o] += 1


cdef int64_t _rereads(const int64_t* row_start, Py_ssize_t L,
                      Py_ssize_t cached) noexcept nogil:
    # The contributions beyond the first of each row other than the `cached`
    # most hit ones: what a scan reads from memory again when only those
    # stay in cache. -1 if the scratch cannot be allocated.
    cdef Py_ssize_t r
    cdef int64_t c, max_c = 0, extra = 0, n
    for r in range(L):
        c = row_start[r + 1] - row_start[r]
        if c > max_c:
            max_c = c
    cdef int64_t* rows_of = <int64_t*>calloc(max_c + 1, sizeof(int64_t))
    if rows_of == NULL:
        return -1
    for r in range(L):
        rows_of[row_start[r + 1] - row_start[r]] += 1
    for c in range(max_c, 1, -1):
        n = rows_of[c]
        if cached >= n:
            cached -= n
        else:
            extra += (n - cached) * (c - 1)
            cached = 0
    free(rows_of)
    return extra


cdef ScatterPlan _choose_plan(ScatterPlan plan, const int64_t* row_start, Py_ssize_t L,
                              Py_ssize_t m, const int64_t* bounds, Py_ssize_t d,
                              Py_ssize_t esz, int n_threads) noexcept nogil:
    # The plan for rows that are not distinct: the scan while the rows each
    # thread hits stay in cache, or while those that would not take few
    # contributions more than once; else the sort.
    cdef Py_ssize_t r, hit, owned = 0
    cdef int64_t extra
    cdef int t
    if plan == PLAN_SCAN or plan == PLAN_SORT:
        return plan
    for t in range(n_threads):
        hit = 0
        for r in range(bounds[t], bounds[t + 1]):
            hit += row_start[r] < row_start[r + 1]
        if hit > owned:
            owned = hit
    if owned * d * esz <= _scan_block_bytes:
        return PLAN_SCAN
    extra = _rereads(row_start, L, _scan_block_bytes // (d * esz))
    return PLAN_SCAN if 0 <= extra <= m // 8 else PLAN_SORT


cdef size_t _scatter_scratch_bytes(Py_ssize_t L, Py_ssize_t m, int n_threads) noexcept nogil:
    # The bytes of _scatter_add's scratch.
    return ((L + 1) + m + 3 * (n_threads + 1)) * sizeof(int64_t)


cdef struct ScatterJob:
    # Chunk c sums, by plan: the positions j in [c * per, (c + 1) * per),
    # the positions order[q_start[c]:q_start[c + 1]], or the table rows
    # bounds[c]..bounds[c + 1] - 1.
    char* grad
    const char* g
    const int64_t* rows
    const int64_t* order
    const int64_t* row_start
    const int64_t* bounds
    const int64_t* q_start
    Py_ssize_t m, nb, d, per
    int plan             # a ScatterPlan
    const cpe_row_ops* ops


cdef void _scatter_chunk(void* arg, Py_ssize_t c) noexcept nogil:
    cdef ScatterJob* j = <ScatterJob*>arg
    cdef Py_ssize_t lo
    if j.plan == PLAN_DISTINCT:
        lo = c * j.per
        _sum_distinct(j.grad, j.g, j.rows, lo, min(j.m, lo + j.per), j.nb, j.m, j.d, j.ops)
    elif j.plan == PLAN_SCAN:
        _scan_rows(j.grad, j.g, j.rows, j.order, j.q_start[c], j.q_start[c + 1], j.nb, j.m,
                   j.d, j.ops)
    else:
        _sum_rows(j.grad, j.g, j.row_start, j.order, j.bounds[c], j.bounds[c + 1], j.nb, j.m,
                  j.d, j.ops)


cdef void _scatter_add(char* grad, const char* g, const int64_t* rows,
                       Py_ssize_t L, Py_ssize_t d, Py_ssize_t m, Py_ssize_t nb,
                       const cpe_row_ops* ops, int n_threads, ScatterPlan plan,
                       int64_t* scratch) noexcept nogil:
    # grad[rows[i % m], :] += g[i, :] for i < nb * m, each row summed in
    # input order by one chunk. `scratch` (_scatter_scratch_bytes): row_start
    # (L + 1), order (m), then per chunk its first table row, its first slot
    # in order and its next free slot (n_threads + 1 each).
    cdef ScatterJob job
    cdef int64_t* row_start = scratch
    cdef int64_t* order = row_start + (L + 1)
    cdef int64_t* bounds = order + m
    cdef int64_t* q_start = bounds + (n_threads + 1)
    cdef int64_t* q_fill = q_start + (n_threads + 1)
    cdef Py_ssize_t n_chunks = n_threads, per = _per_chunk(nb * d, _SCATTER_CHUNK_ELEMS)
    if _count_rows(rows, m, L, row_start) and (plan == PLAN_AUTO or plan == PLAN_DISTINCT):
        plan = PLAN_DISTINCT
        n_chunks = _chunks_of(m, per)
    else:
        _prefix_rows(L, row_start)
        _owner_bounds(row_start, L, n_threads, bounds)
        plan = _choose_plan(plan, row_start, L, m, bounds, d, ops.tsize, n_threads)
    if n_threads > 1:
        n_threads = cpe_threads_here(min(n_threads, n_chunks))
    if n_threads <= 1:
        if plan == PLAN_DISTINCT:
            _sum_distinct(grad, g, rows, 0, m, nb, m, d, ops)
        elif plan == PLAN_SCAN:
            _scan_rows(grad, g, rows, NULL, 0, m, nb, m, d, ops)
        else:
            _sort_by_row(rows, m, L, row_start, order)
            _sum_rows(grad, g, row_start, order, 0, L, nb, m, d, ops)
        return
    job = ScatterJob(grad=grad, g=g, rows=rows, order=order, row_start=row_start,
                     bounds=bounds, q_start=q_start, m=m, nb=nb, d=d, per=per, plan=<int>plan,
                     ops=ops)
    if plan != PLAN_DISTINCT:
        # One chunk (a range of table rows) per thread the call has.
        n_chunks = n_threads
        _owner_bounds(row_start, L, n_threads, bounds)
        if plan == PLAN_SCAN:
            _group_by_owner(rows, m, row_start, n_threads, bounds, q_start, q_fill, order)
        else:
            _sort_by_row(rows, m, L, row_start, order)
    _run_chunks(_scatter_chunk, &job, n_chunks, n_threads)


# ---- the sparse plan's compact rows ------------------------------------------


cdef void _move_rows(char* compact, char* table, const int64_t* rows, Py_ssize_t k,
                     Py_ssize_t row_bytes, bint back) noexcept nogil:
    # compact[s] = table[rows[s]] for s < k (back: table[rows[s]] = compact[s]);
    # nothing if table is NULL.
    cdef Py_ssize_t s
    for s in range(k if table != NULL else 0):
        if back:
            memcpy(table + rows[s] * row_bytes, compact + s * row_bytes, row_bytes)
        else:
            memcpy(compact + s * row_bytes, table + rows[s] * row_bytes, row_bytes)


cdef void _compact_rows(const KernelCall* c, Py_ssize_t row_bytes, bint back) noexcept nogil:
    # The sparse plan's compact copies (KernelCall) gathered, or written back.
    cdef Py_ssize_t k = c.V if c.kernel == K_SCATTER_PAIR else c.L
    _move_rows(<char*>c.out, <char*>c.compact_of, c.compact_rows, k, row_bytes, back)
    _move_rows(<char*>c.out2, <char*>c.compact_of2, c.compact_rows2, c.L, row_bytes, back)


# ---- the optimizers' step ------------------------------------------------------


cdef struct OptJob:
    # An optimizer's step: chunk c updates the distinct rows rows[i] (but
    # skip_row), i = order[q] (q if order is NULL), c * per <= q < n. Row i's
    # gradient is grad row i (compact) or rows[i]; its state is row slots[i]
    # (rows[i] if slots is NULL) of state1 / state2 (NULL: none), new if
    # slots[i] >= fresh_from.
    char* table
    const char* grad
    const int64_t* rows
    const int64_t* order
    const int64_t* slots
    char* state1
    char* state2
    Py_ssize_t n, d, per, skip_row, tsize, ssize, fresh_from
    bint compact
    cpe_opt_fn update
    const cpe_opt_hyper* hyper


cdef inline void _opt_row(const OptJob* j, Py_ssize_t i, const char* grad,
                          int flags) noexcept nogil:
    # The step of row rows[i] with the gradient row `grad` (flags: 0, or
    # CPE_OPT_ADD_ZERO).
    cdef Py_ssize_t r = j.rows[i], s = r, sb = j.d * j.ssize
    if r == j.skip_row:
        return
    if j.slots != NULL:
        s = j.slots[i]
        if s >= j.fresh_from:
            flags |= CPE_OPT_FRESH
    j.update(j.table + r * j.d * j.tsize, grad,
             j.state1 + s * sb if j.state1 != NULL else NULL,
             j.state2 + s * sb if j.state2 != NULL else NULL, flags, j.hyper, j.d)


cdef void _opt_block(const OptJob* j, Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    # The rows lie at random: those of the step _AHEAD on are asked for into
    # L2 while this one is updated.
    cdef Py_ssize_t q, i, r, s, sb = j.d * j.ssize, rb = j.d * j.tsize
    for q in range(lo, hi):
        if q + _AHEAD < hi:
            i = j.order[q + _AHEAD] if j.order != NULL else q + _AHEAD
            r = j.rows[i]
            s = j.slots[i] if j.slots != NULL else r
            _prefetch_row(j.table + r * rb, rb, _TO_L2)
            _prefetch_row(j.grad + (i if j.compact else r) * sb, sb, _TO_L2)
            if j.state1 != NULL and s >= 0:
                _prefetch_row(j.state1 + s * sb, sb, _TO_L2)
            if j.state2 != NULL and s >= 0:
                _prefetch_row(j.state2 + s * sb, sb, _TO_L2)
        i = j.order[q] if j.order != NULL else q
        _opt_row(j, i, j.grad + (i if j.compact else j.rows[i]) * sb, 0)


cdef void _opt_chunk(void* arg, Py_ssize_t c) noexcept nogil:
    cdef OptJob* j = <OptJob*>arg
    cdef Py_ssize_t lo = c * j.per
    _opt_block(j, lo, min(j.n, lo + j.per))


cdef void _opt_rows(OptJob* job, int n_threads) noexcept nogil:
    # The step of job.rows[:job.n], each row by one chunk.
    _run_split(_opt_chunk, job, &job.per, job.n, job.d, n_threads)


# ---- the token + position layer ------------------------------------------------


cdef void _count_owned(const int64_t* rows, Py_ssize_t m, Py_ssize_t L, int n_threads,
                       int64_t* owner, int64_t* bounds, int64_t single_cost=0) noexcept nogil:
    # owner[r] = the thread that owns table row r (owner: L + 1 entries).
    _count_rows(rows, m, L, owner)
    _prefix_rows(L, owner)
    _owner_bounds(owner, L, n_threads, bounds, single_cost)
    _set_owners(owner, n_threads, bounds)


cdef Py_ssize_t _collect_pair(const int64_t* ids, const int64_t* tok_owner,
                              const int64_t* rows, const int64_t* pos_owner, Py_ssize_t N,
                              Py_ssize_t m, int64_t t, int64_t* out) noexcept nogil:
    # out[:n] = 2*i + (thread t owns i's token row) for every i (ascending)
    # whose token row or position row thread t owns; returns n. Branch-free.
    cdef Py_ssize_t i, j = 0, n = 0
    cdef int64_t own_tok, own_pos
    for i in range(N):
        own_tok = tok_owner[ids[i]] == t
        own_pos = pos_owner[rows[j]] == t
        out[n] = 2 * i + own_tok
        n += own_tok | own_pos
        j += 1
        if j == m:
            j = 0
    return n


cdef inline void _first_zero(char* scratch, int64_t slot, const int64_t* first,
                             Py_ssize_t i, Py_ssize_t tb) noexcept nogil:
    # Zeroes scratch row `slot` if contribution i is its first (first[slot]):
    # a fused step's scratch is zeroed row by row, when in cache.
    if first[slot] == i:
        memset(scratch + slot * tb, 0, tb)


cdef inline bint _single(const FusedStep* fused, int64_t slot) noexcept nogil:
    # Whether token row `slot` is a fused step's single (FusedStep).
    return fused != NULL and fused.tok_single != NULL and fused.tok_single[slot]


cdef void _sum_pair(char* gtok, const int64_t* ids, char* gpos, const int64_t* rows,
                    const int64_t* pos_owner, int64_t t, const char* g,
                    const int64_t* work, Py_ssize_t n, Py_ssize_t m,
                    Py_ssize_t d, const cpe_row_ops* ops,
                    const FusedStep* fused) noexcept nogil:
    # For each listed contribution i (work[q] >> 1), ascending: gtok[ids[i]]
    # += g[i] if thread t owns the token row (work[q] & 1), gpos[rows[i % m]]
    # += g[i] if it owns the position row; work NULL: every i < n, both rows.
    # Prefetched: the next gradient row (L1), the listed one _GATHER_AHEAD on
    # (L2), and the owned token row _AHEAD on (L2).
    cdef Py_ssize_t q, i, w
    cdef int64_t p
    cdef Py_ssize_t tb = d * ops.tsize, gb = d * ops.gsize
    cdef const char* src
    cdef const char* nxt
    cdef const char* far
    cdef const char* far_acc
    for q in range(n):
        i = work[q] >> 1 if work != NULL else q
        src = g + i * gb
        nxt = g + (work[q + 1] >> 1 if work != NULL else q + 1) * gb if q + 1 < n else NULL
        far = NULL
        if work != NULL and q + _GATHER_AHEAD < n:
            far = g + (work[q + _GATHER_AHEAD] >> 1) * gb
        far_acc = NULL
        if q + _AHEAD < n:
            w = work[q + _AHEAD] if work != NULL else 2 * (q + _AHEAD) + 1
            if w & 1:
                far_acc = _token_dest(fused, gtok, ids[w >> 1], tb)
        w = work[q] if work != NULL else 2 * q + 1
        p = rows[i % m]
        if fused != NULL and (not w & 1 or work == NULL or pos_owner[p] == t):
            _first_zero(gpos, p, fused.pos_first, i, tb)
        if not w & 1:
            ops.acc(gpos + p * tb, src, nxt, far, NULL, NULL, d)
            continue
        if _single(fused, ids[i]):
            # This thread owns a single's position row too (_scatter_pair).
            ops.acc(gpos + p * tb, src, nxt, far, NULL, far_acc, d)
            _opt_row(&fused.tok, ids[i], src, CPE_OPT_ADD_ZERO)
            continue
        if fused != NULL:
            _first_zero(gtok, ids[i], fused.tok_first, i, tb)
        if work == NULL or pos_owner[p] == t:
            ops.acc2(gtok + ids[i] * tb, gpos + p * tb, src, nxt, far, far_acc, d)
        else:
            ops.acc(gtok + ids[i] * tb, src, nxt, far, NULL, far_acc, d)


cdef size_t _pair_scratch_bytes(Py_ssize_t V, Py_ssize_t L, Py_ssize_t N,
                                int n_threads) noexcept nogil:
    # The bytes of _scatter_pair's scratch (none for one thread).
    if n_threads <= 1:
        return 0
    return (V + L + 2 + n_threads + 1 + n_threads * N) * sizeof(int64_t)


cdef struct FusedStep:
    # An optimizer's step fused into the layer's backward (_scatter_pair):
    # tok, pos, the steps of both tables, scratch row i that of rows[i]. A
    # token row with one contribution (tok_single[slot]) is updated from it
    # when read; the others are summed into their scratch rows (zeroed at
    # their first contribution) and updated once all chunks are done.
    const int64_t* tok_first
    const int64_t* pos_first
    const uint8_t* tok_single
    int64_t single_cost   # a single row's cost in the token split (_owner_bounds)
    OptJob tok
    OptJob pos


cdef inline const char* _token_dest(const FusedStep* fused, const char* gtok, int64_t slot,
                                    Py_ssize_t tb) noexcept nogil:
    # The scratch row a token contribution adds into, for the caller to
    # prefetch; NULL for a single, whose rows are prefetched here, into L2.
    cdef Py_ssize_t r, s, sb, rb
    if not _single(fused, slot):
        return gtok + slot * tb
    r = fused.tok.rows[slot]
    s = fused.tok.slots[slot] if fused.tok.slots != NULL else r
    sb = fused.tok.d * fused.tok.ssize
    rb = fused.tok.d * fused.tok.tsize
    _prefetch_row(fused.tok.table + r * rb, rb, _TO_L2)
    if fused.tok.state1 != NULL and s >= 0:
        _prefetch_row(fused.tok.state1 + s * sb, sb, _TO_L2)
    if fused.tok.state2 != NULL and s >= 0:
        _prefetch_row(fused.tok.state2 + s * sb, sb, _TO_L2)
    return NULL


cdef struct PairJob:
    # The layer's backward: chunk c owns the rows marked c in tok_owner and
    # pos_owner and lists its contributions in work[c * N : (c + 1) * N].
    char* gtok
    char* gpos
    const char* g
    const int64_t* ids
    const int64_t* rows
    int64_t* tok_owner
    int64_t* pos_owner
    int64_t* work
    Py_ssize_t N, m, d
    const cpe_row_ops* ops
    FusedStep* fused


cdef void _pair_chunk(void* arg, Py_ssize_t c) noexcept nogil:
    cdef PairJob* j = <PairJob*>arg
    cdef int64_t* work = j.work + c * j.N
    cdef Py_ssize_t n = _collect_pair(j.ids, j.tok_owner, j.rows, j.pos_owner, j.N, j.m, c,
                                      work)
    _sum_pair(j.gtok, j.ids, j.gpos, j.rows, j.pos_owner, c, j.g, work, n, j.m, j.d, j.ops,
              j.fused)


cdef void _scatter_pair(char* gtok, Py_ssize_t V, const int64_t* ids, char* gpos,
                        Py_ssize_t L, const int64_t* rows, Py_ssize_t m, const char* g,
                        Py_ssize_t N, Py_ssize_t d, const cpe_row_ops* ops, int n_threads,
                        int64_t* scratch, FusedStep* fused) noexcept nogil:
    # gtok[ids[i]] += g[i] and gpos[rows[i % m]] += g[i] for i < N, each
    # table row summed in input order by one chunk, which owns a range of
    # each table (_owner_bounds). `scratch`: _pair_scratch_bytes of it.
    # fused: NULL, or an optimizer step on the rows summed (FusedStep).
    cdef Py_ssize_t i
    cdef PairJob job
    cdef int64_t* tok_owner = scratch
    cdef int64_t* pos_owner
    cdef int64_t* bounds
    if n_threads > 1:
        n_threads = cpe_threads_here(n_threads)
    if n_threads <= 1:
        _sum_pair(gtok, ids, gpos, rows, NULL, 0, g, NULL, N, m, d, ops, fused)
        if fused != NULL:
            _opt_block(&fused.tok, 0, fused.tok.n)
            _opt_block(&fused.pos, 0, fused.pos.n)
        return
    # One chunk per thread the call has (the scratch holds those it asked for).
    pos_owner = tok_owner + (V + 1)
    bounds = pos_owner + (L + 1)
    _count_owned(ids, N, V, n_threads, tok_owner, bounds,
                 fused.single_cost if fused != NULL and fused.tok_single != NULL else 0)
    _count_owned(rows, m, L, n_threads, pos_owner, bounds)
    if fused != NULL and fused.tok_single != NULL:
        # A single goes to the owner of its position row, which reads its
        # gradient row anyway.
        for i in range(N):
            if fused.tok_single[ids[i]]:
                tok_owner[ids[i]] = pos_owner[rows[i % m]]
    job = PairJob(gtok=gtok, gpos=gpos, g=g, ids=ids, rows=rows, tok_owner=tok_owner,
                  pos_owner=pos_owner, work=bounds + (n_threads + 1), N=N, m=m, d=d, ops=ops,
                  fused=fused)
    _run_chunks(_pair_chunk, &job, n_threads, n_threads)
    if fused != NULL:
        _opt_rows(&fused.tok, n_threads)
        _opt_rows(&fused.pos, n_threads)
