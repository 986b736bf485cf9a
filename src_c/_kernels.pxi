# Kernels: gather rows, add rows, scatter-add rows, the SGD row update.
#
# They trust their inputs: the entries in _core.pyx have checked dtypes,
# shapes, layout and overlap, and hand over row numbers already wrapped into
# [0, L) in a buffer the call owns (_index.pxi), so nothing a kernel reads
# can change under it or point outside the table.
#
# "Period" convention shared by _add, _scatter_add, _embed and _scatter_pair
# (for the positions): `rows` has m entries
# and the row arrays have N = nb * m rows; row i uses rows[i % m]. It lets
# `positions=None` (offset + arange(T), the same for every sequence of a
# batch) and positions that repeat along leading axes run without
# materialising N indices.
#
# On more than one thread, a kernel first asks how many it may have
# (_parallel.pxi, cpe_threads_here); with one it takes its one-thread path.
# Else its work is split into chunks that _run_chunks runs on its OpenMP
# threads, each chunk on whichever thread claims it: contiguous blocks of
# output rows, or, in the scatter-adds, ranges of table rows that one chunk
# owns. A chunk that streams its stores
# ends with a store fence (see _stream.h). Each kernel's job is a struct
# (RowJob, ...) and a function of (job, chunk number) that calls the block
# function.
#
# The kernels are written once for every element type: they move rows as
# bytes and leave the arithmetic on elements to the row primitives of
# _rows.h (generated from _rows.h.tp for float16, bfloat16, float32 and
# float64), chosen per call: `ops` holds those of the table's type and the
# source's (cpe_row_ops_for). Row r of a table starts r * d * ops.tsize
# bytes in; row i of a source (a gradient) i * d * ops.gsize bytes in.

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
    enum:
        CPE_ISA_SSE2
        CPE_ISA_F16C
        CPE_ISA_AVX2
    void cpe_init_isa()
    int cpe_set_isa(int isa)
    int cpe_best_isa()


# How the scatter-add assigns contributions to threads. Each table row is
# always summed by one thread in input order, so every plan gives the same
# bits as np.add.at.
cpdef enum ScatterPlan:
    # Chosen per call (see _choose_plan).
    PLAN_AUTO = 0
    # Rows distinct within the period: blocks of table rows take the whole
    # batch, reading the gradient in long contiguous runs.
    PLAN_DISTINCT = 1
    # Each thread owns the table rows holding about 1/n of the contributions
    # and reads only their gradient rows, front to back, updating its rows in
    # cache.
    PLAN_SCAN = 2
    # A counting sort by row, then each row sums all its contributions at
    # once, read at random: for owned rows too large to stay in cache.
    PLAN_SORT = 3


# The distinct-rows plan sums a block of table rows over the whole batch
# before moving on; this is the block's size in bytes per thread: well inside
# a 512 KiB-1 MiB L2 next to the gradient streaming by.
cdef enum:
    _BLOCK_BYTES = 262144
# The scan plan keeps each thread's share of the table in cache while the
# gradient streams by: this many bytes of it per thread (most of a shared L3
# of a few MiB per core); larger shares take the sort. A variable only so
# that tests can force the sort (_core.set_tuning).
cdef Py_ssize_t _scan_block_bytes = 8388608
# Lookups prefetch the next row from tables larger than this (beyond L2).
cdef enum:
    _PREFETCH_TABLE_BYTES = 524288
# How many rows ahead the streamed-once rows, and the rows to add into, are
# prefetched.
cdef enum:
    _AHEAD = 4
# How many rows ahead a thread reading gradient rows out of order (a sparse
# subset, or at random) asks for one into L2: the hardware prefetcher does
# not follow such reads.
cdef enum:
    _GATHER_AHEAD = 8


# Outputs at least this large are written with streaming (non-temporal)
# stores: far beyond what the caches keep, so reading each line in before
# overwriting it (what an ordinary store does) would only double the memory
# traffic. Below it, ordinary stores leave the result in cache for the next op.
STREAM_THRESHOLD_BYTES = 1 << 23
cdef Py_ssize_t _STREAM_BYTES = STREAM_THRESHOLD_BYTES


def streaming_stores_available():
    """True if this build streams large outputs with non-temporal stores (x86-64 SSE2)."""
    return bool(cpe_have_stream())


# A row kernel's chunk: about this many elements of output (256 KiB of
# float32): a few microseconds of work, so that a thread its core neglects
# holds the others up by little, for a claim that costs tens of nanoseconds.
cdef enum:
    _CHUNK_ELEMS = 65536
cdef Py_ssize_t _chunk_elems = _CHUNK_ELEMS  # set_tuning(chunk_elems=) for tests


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


# The scatter-adds' chunks are larger (each reads its table rows into cache
# first): the distinct-rows plan's chunk reads about this many elements of
# the gradient; the scan and the sort cut the table into this many ranges
# per thread, and so does the layer's backward: one each (a chunk of the scan
# or of the backward reads every gradient row its table rows need, so more
# chunks would read more: docs/performance.md, "Measurements behind the
# constants").
cdef enum:
    _SCATTER_CHUNK_ELEMS = 524288
    _CHUNKS_PER_THREAD = 1
    _PAIR_CHUNKS_PER_THREAD = 1


cdef inline Py_ssize_t _per_chunk(Py_ssize_t unit, Py_ssize_t elems) noexcept nogil:
    # Items of `unit` elements each in a chunk of about `elems`: at least one.
    return elems // unit if unit and elems // unit > 1 else 1


cdef inline Py_ssize_t _chunks_of(Py_ssize_t n, Py_ssize_t per) noexcept nogil:
    return (n + per - 1) // per


cdef struct ScatterScratch:
    # The scratch of one scatter-add call: one block from the caller
    # (_scatter_scratch_bytes), starting at row_start.
    int64_t* row_start   # (L + 1,) counts, then first slot per row, then owners
    int64_t* order       # (m,) contribution numbers grouped by row or by owner
    int64_t* bounds      # (n_chunks + 1,) first table row of each chunk
    int64_t* q_start     # (n_chunks + 1,) first slot in `order` of each chunk
    int64_t* q_fill      # (n_chunks,) next free slot of each chunk while grouping


cdef bint _repeats(const int64_t* p, Py_ssize_t n, Py_ssize_t period) noexcept nogil:
    # p[i] == p[i - period] for all i >= period (n a multiple of period):
    # explicit (B, T) positions that are one period of T (arange expanded,
    # typically). Stops at the first difference, which random positions
    # show at once.
    cdef Py_ssize_t i
    for i in range(period, n):
        if p[i] != p[i - period]:
            return False
    return True


# Where _prefetch_row asks a row's lines to go. _TO_L1: the next row of a
# random gather, which arrives while the current one is done. _TO_L2: a row
# of a random gather a few rows ahead (the memory latency of a row that
# misses every cache is longer than one row's work). _ONCE: a row read once,
# a few rows ahead, fetched without evicting the rows that are reused
# (non-temporal hint).
cdef enum:
    _TO_L1 = 0
    _TO_L2 = 1
    _ONCE = 2


cdef inline void _prefetch_row(const char* src, Py_ssize_t nbytes, int where) noexcept nogil:
    # Asks for every cache line of a row of `nbytes` now (where: _TO_L1,
    # _TO_L2 or _ONCE, a constant at each call, so the test folds away).
    cdef Py_ssize_t k = 0
    while k < nbytes:
        if where == _TO_L1:
            cpe_prefetch(src + k)
        elif where == _TO_L2:
            cpe_prefetch_l2(src + k)
        else:
            cpe_prefetch_nta(src + k)
        k += 64


cdef struct RowJob:
    # A row kernel's call on the team: chunk c writes output rows
    # c * per .. min(n, (c + 1) * per) - 1.
    const void* src      # lookup: the table; add: the tokens; embed: the token table
    const void* table    # add, embed: the position table
    const int64_t* ids   # lookup: rows of src; embed: token ids
    const int64_t* rows  # add, embed: position rows, period m
    void* out
    Py_ssize_t n, m, d, per
    int stream
    int flag             # lookup, embed: prefetch; add: in place
    cpe_row_ops ops      # lookup: only tsize


# ---- lookup ------------------------------------------------------------------


cdef void _lookup_block(const char* table, const int64_t* rows, char* out,
                        Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t rb, int stream,
                        int prefetch) noexcept nogil:
    # Rows of rb bytes.
    cdef Py_ssize_t i
    for i in range(lo, hi):
        if prefetch and i + 1 < hi:
            _prefetch_row(table + rows[i + 1] * rb, rb, _TO_L1)
        cpe_copy_bytes(out + i * rb, table + rows[i] * rb, rb, stream)
    if stream:
        cpe_sfence()


cdef void _lookup(const char* table, const int64_t* rows, char* out, Py_ssize_t n,
                  Py_ssize_t L, Py_ssize_t d, const cpe_row_ops* ops, int n_threads,
                  int stream) noexcept nogil:
    # out[i, :] = table[rows[i], :] for i < n, on n_threads. The next row
    # is prefetched only from a table beyond the L2 cache (rows read at
    # random from memory); a smaller one is in cache already.
    cdef RowJob job
    cdef Py_ssize_t rb = d * ops.tsize
    cdef int prefetch = L * rb > _PREFETCH_TABLE_BYTES
    cdef Py_ssize_t per = _per_chunk(d, _chunk_elems), n_chunks = _chunks_of(n, per)
    if n_threads > 1:
        n_threads = cpe_threads_here(min(n_threads, n_chunks))
    if n_threads <= 1:
        _lookup_block(table, rows, out, 0, n, rb, stream, prefetch)
        return
    job.src = table
    job.ids = rows
    job.out = out
    job.n = n
    job.d = d
    job.per = per
    job.stream = stream
    job.flag = prefetch
    job.ops = ops[0]
    _run_chunks(_lookup_chunk, &job, n_chunks, n_threads)


cdef void _lookup_chunk(void* arg, Py_ssize_t c) noexcept nogil:
    cdef RowJob* j = <RowJob*>arg
    cdef Py_ssize_t lo = c * j.per, hi = min(j.n, lo + j.per)
    _lookup_block(<const char*>j.src, j.ids, <char*>j.out, lo, hi, j.d * j.ops.tsize,
                  j.stream, j.flag)


# ---- add ---------------------------------------------------------------------


cdef void _add_block(const char* tokens, const char* table, const int64_t* rows,
                     char* out, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t m,
                     Py_ssize_t d, const cpe_row_ops* ops, int stream,
                     int in_place) noexcept nogil:
    # In place the lines are read anyway, so ordinary stores cost nothing
    # extra; there the token rows are prefetched with a non-temporal hint.
    # `out` may be `tokens` (in place): element k only reads itself.
    cdef Py_ssize_t i, j = lo % m, rb = d * ops.tsize
    for i in range(lo, hi):
        if in_place and i + _AHEAD < hi:
            _prefetch_row(tokens + (i + _AHEAD) * rb, rb, _ONCE)
        ops.add(out + i * rb, tokens + i * rb, table + rows[j] * rb, d, stream)
        j += 1
        if j == m:
            j = 0
    if stream:
        cpe_sfence()


cdef void _add(const char* tokens, const char* table, const int64_t* rows, char* out,
               Py_ssize_t N, Py_ssize_t m, Py_ssize_t d, const cpe_row_ops* ops,
               int n_threads, int stream, int in_place) noexcept nogil:
    # out[i, :] = tokens[i, :] + table[rows[i % m], :] for i < N, on n_threads.
    cdef RowJob job
    cdef Py_ssize_t per = _per_chunk(d, _chunk_elems), n_chunks = _chunks_of(N, per)
    if n_threads > 1:
        n_threads = cpe_threads_here(min(n_threads, n_chunks))
    if n_threads <= 1:
        _add_block(tokens, table, rows, out, 0, N, m, d, ops, stream, in_place)
        return
    job.src = tokens
    job.table = table
    job.rows = rows
    job.out = out
    job.n = N
    job.m = m
    job.d = d
    job.per = per
    job.stream = stream
    job.flag = in_place
    job.ops = ops[0]
    _run_chunks(_add_chunk, &job, n_chunks, n_threads)


cdef void _add_chunk(void* arg, Py_ssize_t c) noexcept nogil:
    cdef RowJob* j = <RowJob*>arg
    cdef Py_ssize_t lo = c * j.per, hi = min(j.n, lo + j.per)
    _add_block(<const char*>j.src, <const char*>j.table, j.rows, <char*>j.out, lo, hi,
               j.m, j.d, &j.ops, j.stream, j.flag)


# ---- scatter-add -------------------------------------------------------------


cdef bint _count_rows(const int64_t* rows, Py_ssize_t m, Py_ssize_t L,
                      int64_t* row_start) noexcept nogil:
    # row_start[r + 1] = number of j with rows[j] == r; returns whether
    # every row is hit at most once (rows distinct within the period).
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
    # Stable counting sort of j = 0..m-1 by row (row_start already prefixed):
    # afterwards the j with rows[j] == r are
    # order[row_start[r]:row_start[r + 1]], ascending.
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
    # A place in the sort plan's reading order: row r, batch k, slot t of the
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
    # Rows r_lo..r_hi-1 of grad, each summing its contributions in input
    # order (i = k*m + j ascending): the order np.add.at uses. One row at a
    # time, so it stays in L1 while its source rows come at random: the next
    # one is asked for line by line (L1) and the one _GATHER_AHEAD further
    # (L2).
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


cdef void _sum_distinct(char* grad, const char* g, const int64_t* rows,
                        Py_ssize_t j_lo, Py_ssize_t j_hi, Py_ssize_t nb,
                        Py_ssize_t m, Py_ssize_t d, const cpe_row_ops* ops) noexcept nogil:
    # Positions j_lo..j_hi-1 hit distinct rows, so row rows[j] receives
    # exactly g[k*m + j] for k = 0..nb-1, summed in that order (np.add.at's).
    # Blocked: a block of table rows small enough to stay in cache takes the
    # whole batch, reading each block of g (contiguous rows) once; the next
    # row of g is prefetched line by line (a jump at each block's end).
    cdef Py_ssize_t tb = d * ops.tsize, gb = d * ops.gsize
    cdef Py_ssize_t rows_per_block = _BLOCK_BYTES // tb
    cdef Py_ssize_t b0, b1, j, k
    cdef const char* nxt
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
                    nxt = g + (k * m + j + 1) * gb
                elif k + 1 < nb:
                    nxt = g + ((k + 1) * m + b0) * gb
                else:
                    nxt = NULL
                ops.acc(grad + rows[j] * tb, g + (k * m + j) * gb, nxt, NULL, NULL, NULL, d)
        b0 = b1


cdef void _scan_rows(char* grad, const char* g, const int64_t* rows,
                     const int64_t* order, Py_ssize_t q_lo, Py_ssize_t q_hi,
                     Py_ssize_t nb, Py_ssize_t m, Py_ssize_t d,
                     const cpe_row_ops* ops) noexcept nogil:
    # Takes the contributions j = order[q] (j = q if order is NULL) for q in
    # q_lo..q_hi-1, ascending, for every batch k: input order i = k*m + j,
    # so np.add.at's, while reading g front to back. The caller hands each
    # chunk only the j that fall in its own table rows, so no two chunks
    # write the same row; those rows are updated at random, in cache.
    cdef Py_ssize_t k, q, j, j1
    cdef Py_ssize_t tb = d * ops.tsize, gb = d * ops.gsize
    cdef const char* nxt
    cdef const char* far
    cdef char* nacc
    for k in range(nb):
        for q in range(q_lo, q_hi):
            j = order[q] if order != NULL else q
            # The rows read next are at random distances: the next one line
            # by line into L1, the one _AHEAD further into L2; the row added
            # into next is at random in the cache.
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


# A thread's cost for a table row it sums: one unit per contribution, plus
# this many for fetching the row from memory.
cdef enum:
    _ROW_COST = 3


cdef void _owner_bounds(const int64_t* row_start, Py_ssize_t L, int n_threads,
                        int64_t* bounds, int64_t single_cost=0) noexcept nogil:
    # Thread t owns rows bounds[t]..bounds[t+1]-1 (row_start: prefixed
    # counts): ranges of about 1/n of the cost each, a row costing its
    # contributions plus _ROW_COST if it has any. The token ids of a
    # Zipf-like batch put thousands of contributions on a few rows, which
    # stay in cache, and one or two on each of thousands of rows, each a
    # trip to memory. Ranges, not rows dealt out one by one: a table row need
    # not start on a cache line, so two threads' neighbouring rows would
    # share one.
    # single_cost: what a row with one contribution costs besides (a fused
    # step gives such rows to the owners of their position rows, FusedStep:
    # -(1 + _ROW_COST), nothing, in the token split).
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
    # owner[r] = the thread whose range of _owner_bounds holds row r, so that
    # finding the owner of a position is one load.
    cdef int t
    cdef Py_ssize_t r
    for t in range(n_threads):
        for r in range(bounds[t], bounds[t + 1]):
            owner[r] = t


cdef void _group_by_owner(const int64_t* rows, Py_ssize_t m, int64_t* row_start,
                          int n_chunks, const int64_t* bounds, int64_t* q_start,
                          int64_t* q_fill, int64_t* order) noexcept nogil:
    # order[q_start[c]:q_start[c + 1]] = the j (ascending) whose row chunk c
    # owns (row_start: prefixed counts, overwritten with each row's owner).
    # One pass, branch-free: a branch on the owner would be a coin flip for
    # random positions.
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
    # most hit ones: what a scan in input order reads from memory again when
    # only those rows stay in cache. -1 if the scratch cannot be allocated.
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
    # The plan for rows that are not distinct (or a forced scan or sort).
    # The scan while the rows each thread hits stay in cache, or while those
    # that would not (beyond the cache's worth of the most hit) take few
    # contributions more than once: then the scan, reading the gradient in
    # order, beats the sort's reads at random (the token ids of a Zipf-like
    # batch: a few rows hit thousands of times, thousands once or twice).
    # Else the sort, which takes each row from memory once. A forced
    # distinct plan for repeated rows falls back to this choice.
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


cdef inline int _scatter_chunks(int n_threads) noexcept nogil:
    # The scan's and the sort's number of chunks (table row ranges).
    return _CHUNKS_PER_THREAD * n_threads


cdef size_t _scatter_scratch_bytes(Py_ssize_t L, Py_ssize_t m, int n_threads) noexcept nogil:
    # The bytes of _scatter_add's scratch (one block, see ScatterScratch).
    cdef Py_ssize_t c = _scatter_chunks(n_threads)
    return ((L + 1) + m + 3 * (c + 1)) * sizeof(int64_t)


cdef struct ScatterJob:
    # A scatter-add on the team. Chunk c sums, by plan: PLAN_DISTINCT, the
    # positions j in c * per .. (c + 1) * per - 1; PLAN_SCAN, the positions
    # order[q_start[c]:q_start[c + 1]]; PLAN_SORT, table rows
    # bounds[c]..bounds[c + 1] - 1. Each table row lies in one chunk.
    void* grad
    const void* g
    const int64_t* rows
    const int64_t* order
    const int64_t* row_start
    const int64_t* bounds
    const int64_t* q_start
    Py_ssize_t m, nb, d, per
    ScatterPlan plan
    cpe_row_ops ops


cdef void _scatter_chunk(void* arg, Py_ssize_t c) noexcept nogil:
    cdef ScatterJob* j = <ScatterJob*>arg
    cdef char* grad = <char*>j.grad
    cdef const char* g = <const char*>j.g
    cdef Py_ssize_t lo
    if j.plan == PLAN_DISTINCT:
        lo = c * j.per
        _sum_distinct(grad, g, j.rows, lo, min(j.m, lo + j.per), j.nb, j.m, j.d, &j.ops)
    elif j.plan == PLAN_SCAN:
        _scan_rows(grad, g, j.rows, j.order, j.q_start[c], j.q_start[c + 1], j.nb, j.m, j.d,
                   &j.ops)
    else:
        _sum_rows(grad, g, j.row_start, j.order, j.bounds[c], j.bounds[c + 1], j.nb, j.m,
                  j.d, &j.ops)


cdef void _scatter_add(char* grad, const char* g, const int64_t* rows,
                       Py_ssize_t L, Py_ssize_t d, Py_ssize_t m, Py_ssize_t nb,
                       const cpe_row_ops* ops, int n_threads, ScatterPlan plan,
                       int64_t* scratch) noexcept nogil:
    # grad[rows[i % m], :] += g[i, :] for i < nb * m, each row summed in
    # input order by one chunk; `scratch`: _scatter_scratch_bytes of it.
    cdef ScatterScratch s
    cdef ScatterJob job
    cdef int c = _scatter_chunks(n_threads)
    cdef Py_ssize_t n_chunks = c, per = _per_chunk(nb * d, _SCATTER_CHUNK_ELEMS)
    s.row_start = scratch
    s.order = s.row_start + (L + 1)
    s.bounds = s.order + m
    s.q_start = s.bounds + (c + 1)
    s.q_fill = s.q_start + (c + 1)
    if _count_rows(rows, m, L, s.row_start) and (plan == PLAN_AUTO or plan == PLAN_DISTINCT):
        plan = PLAN_DISTINCT
        n_chunks = _chunks_of(m, per)
    else:
        _prefix_rows(L, s.row_start)
        # The plan by each thread's share of the table.
        _owner_bounds(s.row_start, L, n_threads, s.bounds)
        plan = _choose_plan(plan, s.row_start, L, m, s.bounds, d, ops.tsize, n_threads)
    if n_threads > 1:
        n_threads = cpe_threads_here(min(n_threads, n_chunks))
    if n_threads <= 1:
        if plan == PLAN_DISTINCT:
            _sum_distinct(grad, g, rows, 0, m, nb, m, d, ops)
        elif plan == PLAN_SCAN:
            _scan_rows(grad, g, rows, NULL, 0, m, nb, m, d, ops)
        else:
            _sort_by_row(rows, m, L, s.row_start, s.order)
            _sum_rows(grad, g, s.row_start, s.order, 0, L, nb, m, d, ops)
        return
    job.grad = grad
    job.g = g
    job.rows = rows
    job.order = s.order
    job.row_start = s.row_start
    job.bounds = s.bounds
    job.q_start = s.q_start
    job.m = m
    job.nb = nb
    job.d = d
    job.per = per
    job.plan = plan
    job.ops = ops[0]
    if plan != PLAN_DISTINCT:
        # The chunks: ranges of table rows, for the threads the call has.
        c = _scatter_chunks(n_threads)
        n_chunks = c
        _owner_bounds(s.row_start, L, c, s.bounds)
        if plan == PLAN_SCAN:
            _group_by_owner(rows, m, s.row_start, c, s.bounds, s.q_start, s.q_fill, s.order)
        else:
            _sort_by_row(rows, m, L, s.row_start, s.order)
    _run_chunks(_scatter_chunk, &job, n_chunks, n_threads)


# ---- the sparse plan's compact rows ------------------------------------------


cdef void _gather_rows(char* compact, const char* table, const int64_t* rows, Py_ssize_t k,
                       Py_ssize_t row_bytes) noexcept nogil:
    # compact[s] = table[rows[s]] for s < k; nothing if table is NULL.
    cdef Py_ssize_t s
    if table != NULL:
        for s in range(k):
            memcpy(compact + s * row_bytes, table + rows[s] * row_bytes, row_bytes)


cdef void _put_rows(char* table, const char* compact, const int64_t* rows, Py_ssize_t k,
                    Py_ssize_t row_bytes) noexcept nogil:
    # table[rows[s]] = compact[s] for s < k; nothing if table is NULL.
    cdef Py_ssize_t s
    if table != NULL:
        for s in range(k):
            memcpy(table + rows[s] * row_bytes, compact + s * row_bytes, row_bytes)


# ---- SGD ---------------------------------------------------------------------


cdef void _sgd_rows(char* table, const char* grad, const int64_t* rows, Py_ssize_t n,
                    Py_ssize_t d, const cpe_row_ops* ops, double step,
                    int n_threads) noexcept nogil:
    # The update of the n distinct rows `rows` (row -= step * grad row, by
    # ops.sgd: a multiply, then a subtract, in the compute type, as NumPy's
    # `table -= lr * grad`); each chunk owns its rows.
    cdef SgdJob job
    cdef Py_ssize_t per = _per_chunk(d, _chunk_elems), n_chunks = _chunks_of(n, per)
    if n_threads > 1:
        n_threads = cpe_threads_here(min(n_threads, n_chunks))
    if n_threads <= 1:
        _sgd_block(table, grad, rows, 0, n, d, ops, step)
        return
    job.table = table
    job.grad = grad
    job.rows = rows
    job.n = n
    job.d = d
    job.per = per
    job.step = step
    job.ops = ops[0]
    _run_chunks(_sgd_chunk, &job, n_chunks, n_threads)


cdef void _sgd_block(char* table, const char* grad, const int64_t* rows,
                     Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t d, const cpe_row_ops* ops,
                     double step) noexcept nogil:
    cdef Py_ssize_t i, tb = d * ops.tsize, gb = d * ops.gsize
    for i in range(lo, hi):
        ops.sgd(table + rows[i] * tb, grad + rows[i] * gb, d, step)


cdef struct SgdJob:
    # The SGD step on the team: chunk c updates rows[c * per : (c + 1) * per].
    void* table
    const void* grad
    const int64_t* rows
    Py_ssize_t n, d, per
    double step          # rounded to the compute type by ops.sgd
    cpe_row_ops ops


cdef void _sgd_chunk(void* arg, Py_ssize_t c) noexcept nogil:
    cdef SgdJob* j = <SgdJob*>arg
    cdef Py_ssize_t lo = c * j.per, hi = min(j.n, lo + j.per)
    _sgd_block(<char*>j.table, <const char*>j.grad, j.rows, lo, hi, j.d, &j.ops, j.step)


# ---- the optimizers' step ------------------------------------------------------


cdef struct OptJob:
    # An optimizer's step on the team: chunk c updates the rows rows[i] for
    # i = order[q] (i = q if order is NULL), q in c * per .. (c + 1) * per - 1
    # (q < n): distinct table rows, skip_row left alone. Row i's gradient is
    # grad row i (compact) or grad row rows[i]; its state is row slots[i]
    # (rows[i] if slots is NULL) of state1 / state2 (NULL: none), fresh (SGD's
    # momentum starts at it) if slots[i] >= fresh_from (never if slots is NULL).
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
    # The rows lie at random in the table: the rows of the step _AHEAD
    # further are asked for into L2 while this one is updated.
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
    cdef Py_ssize_t n_chunks
    job.per = _per_chunk(job.d, _chunk_elems)
    n_chunks = _chunks_of(job.n, job.per)
    if n_threads > 1:
        n_threads = cpe_threads_here(min(n_threads, n_chunks))
    if n_threads <= 1:
        _opt_block(job, 0, job.n)
        return
    _run_chunks(_opt_chunk, job, n_chunks, n_threads)


# ---- the token + position layer ------------------------------------------------


cdef void _embed_block(const char* tokens, const int64_t* ids, const char* table,
                       const int64_t* rows, char* out, Py_ssize_t lo, Py_ssize_t hi,
                       Py_ssize_t m, Py_ssize_t d, const cpe_row_ops* ops, int stream,
                       int prefetch) noexcept nogil:
    cdef Py_ssize_t i, j = lo % m, rb = d * ops.tsize
    for i in range(lo, hi):
        if prefetch and i + 1 < hi:
            _prefetch_row(tokens + ids[i + 1] * rb, rb, _TO_L1)
            if i + _AHEAD < hi:
                _prefetch_row(tokens + ids[i + _AHEAD] * rb, rb, _TO_L2)
        ops.add(out + i * rb, tokens + ids[i] * rb, table + rows[j] * rb, d, stream)
        j += 1
        if j == m:
            j = 0
    if stream:
        cpe_sfence()


cdef void _embed(const char* tokens, const int64_t* ids, Py_ssize_t V,
                 const char* table, const int64_t* rows, char* out, Py_ssize_t N,
                 Py_ssize_t m, Py_ssize_t d, const cpe_row_ops* ops, int n_threads,
                 int stream) noexcept nogil:
    # out[i, :] = tokens[ids[i], :] + table[rows[i % m], :] for i < N: the
    # token rows are gathered at random from a vocabulary table far larger
    # than the caches, so the next one is prefetched into L1 and the one
    # _AHEAD rows on into L2.
    cdef RowJob job
    cdef int prefetch = V * d * ops.tsize > _PREFETCH_TABLE_BYTES
    cdef Py_ssize_t per = _per_chunk(d, _chunk_elems), n_chunks = _chunks_of(N, per)
    if n_threads > 1:
        n_threads = cpe_threads_here(min(n_threads, n_chunks))
    if n_threads <= 1:
        _embed_block(tokens, ids, table, rows, out, 0, N, m, d, ops, stream, prefetch)
        return
    job.src = tokens
    job.ids = ids
    job.table = table
    job.rows = rows
    job.out = out
    job.n = N
    job.m = m
    job.d = d
    job.per = per
    job.stream = stream
    job.flag = prefetch
    job.ops = ops[0]
    _run_chunks(_embed_chunk, &job, n_chunks, n_threads)


cdef void _embed_chunk(void* arg, Py_ssize_t c) noexcept nogil:
    cdef RowJob* j = <RowJob*>arg
    cdef Py_ssize_t lo = c * j.per, hi = min(j.n, lo + j.per)
    _embed_block(<const char*>j.src, j.ids, <const char*>j.table, j.rows, <char*>j.out,
                 lo, hi, j.m, j.d, &j.ops, j.stream, j.flag)


cdef void _count_owned(const int64_t* rows, Py_ssize_t m, Py_ssize_t L, int n_threads,
                       int64_t* owner, int64_t* bounds, int64_t single_cost=0) noexcept nogil:
    # owner[r] (r < L; owner needs L + 1) = the thread that owns table row r,
    # by the ranges of _owner_bounds.
    _count_rows(rows, m, L, owner)
    _prefix_rows(L, owner)
    _owner_bounds(owner, L, n_threads, bounds, single_cost)
    _set_owners(owner, n_threads, bounds)


cdef Py_ssize_t _collect_pair(const int64_t* ids, const int64_t* tok_owner,
                              const int64_t* rows, const int64_t* pos_owner, Py_ssize_t N,
                              Py_ssize_t m, int64_t t, int64_t* out) noexcept nogil:
    # out[:n] = 2*i + (thread t owns i's token row) for every i (ascending)
    # whose token row or position row thread t owns; n is returned.
    # Branch-free: the test is a coin flip for random ids.
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
    # A fused step's scratch is not zeroed beforehand: row `slot` is zeroed
    # at its first contribution, just before it is added (the line is in
    # cache then), first[slot] being that contribution (i: the one at hand).
    if first[slot] == i:
        memset(scratch + slot * tb, 0, tb)


cdef inline bint _single(const FusedStep* fused, int64_t slot) noexcept nogil:
    # Whether the fused step updates token row `slot` at its one
    # contribution, from the gradient row itself (FusedStep).
    return fused != NULL and fused.tok_single != NULL and fused.tok_single[slot]


cdef void _sum_pair(char* gtok, const int64_t* ids, char* gpos, const int64_t* rows,
                    const int64_t* pos_owner, int64_t t, const char* g,
                    const int64_t* work, Py_ssize_t n, Py_ssize_t m,
                    Py_ssize_t d, const cpe_row_ops* ops,
                    const FusedStep* fused) noexcept nogil:
    # For each listed contribution i, ascending: gtok[ids[i]] += g[i] if this
    # thread owns the token row, gpos[rows[i % m]] += g[i] if it owns the
    # position row; one read of g[i] serves both. As it goes it asks for the
    # next listed gradient row (L1), the one _GATHER_AHEAD further (L2) and
    # the token row _AHEAD further that it owns (L2): a thread's rows are a
    # sparse subset of the gradient, which the hardware prefetcher does not
    # follow, and token rows come from memory at random. fused: NULL, or the
    # optimizer step it makes as it goes (FusedStep).
    cdef Py_ssize_t q, i, w
    cdef int64_t p
    cdef Py_ssize_t tb = d * ops.tsize, gb = d * ops.gsize
    cdef const char* src
    cdef const char* nxt
    cdef const char* far
    cdef const char* far_acc
    for q in range(n):
        i = work[q] >> 1
        src = g + i * gb
        nxt = g + (work[q + 1] >> 1) * gb if q + 1 < n else NULL
        far = g + (work[q + _GATHER_AHEAD] >> 1) * gb if q + _GATHER_AHEAD < n else NULL
        far_acc = NULL
        if q + _AHEAD < n:
            w = work[q + _AHEAD]
            if w & 1:
                far_acc = _token_dest(fused, gtok, ids[w >> 1], tb)
        p = rows[i % m]
        if fused != NULL and (not work[q] & 1 or pos_owner[p] == t):
            _first_zero(gpos, p, fused.pos_first, i, tb)
        if not work[q] & 1:
            ops.acc(gpos + p * tb, src, nxt, far, NULL, NULL, d)
            continue
        if _single(fused, ids[i]):
            # A single's token row goes with its position row (_scatter_pair):
            # this thread owns both.
            ops.acc(gpos + p * tb, src, nxt, far, NULL, far_acc, d)
            _opt_row(&fused.tok, ids[i], src, CPE_OPT_ADD_ZERO)
            continue
        if fused != NULL:
            _first_zero(gtok, ids[i], fused.tok_first, i, tb)
        if pos_owner[p] == t:
            ops.acc2(gtok + ids[i] * tb, gpos + p * tb, src, nxt, far, far_acc, d)
        else:
            ops.acc(gtok + ids[i] * tb, src, nxt, far, NULL, far_acc, d)


cdef size_t _pair_scratch_bytes(Py_ssize_t V, Py_ssize_t L, Py_ssize_t N,
                                int n_threads) noexcept nogil:
    # The bytes of _scatter_pair's scratch (none for one thread).
    cdef Py_ssize_t c = _PAIR_CHUNKS_PER_THREAD * n_threads
    if n_threads <= 1:
        return 0
    return (V + L + 2 + c + 1 + c * N) * sizeof(int64_t)


cdef struct FusedStep:
    # An optimizer's step fused into the layer's backward (_scatter_pair).
    # tok, pos: the steps of both tables, scratch row i (a compact gradient,
    # one row per distinct row of the call) being that of tok.rows[i] and
    # pos.rows[i]. A token row with one contribution (tok_single[slot]; the
    # gradient's dtype is the state's) is updated by the thread that owns it
    # when it reads that contribution, from the gradient row itself, in
    # cache; the others are summed into their scratch rows, and so are the
    # position rows, each zeroed at its first contribution (tok_first,
    # pos_first: _first_zero), and updated once all chunks are done
    # (tok.order lists the token rows).
    const int64_t* tok_first
    const int64_t* pos_first
    const uint8_t* tok_single
    int64_t single_cost   # a single row's cost in the token split (_owner_bounds)
    OptJob tok
    OptJob pos


cdef inline const char* _token_dest(const FusedStep* fused, const char* gtok, int64_t slot,
                                    Py_ssize_t tb) noexcept nogil:
    # The scratch row a token contribution adds into, to be prefetched by
    # the caller; NULL for a single, whose table and state rows are asked
    # for here, into L2.
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
    # The layer's backward on the team: chunk c owns the token rows and the
    # position rows marked c in tok_owner and pos_owner, and lists its
    # contributions in work[c * N : (c + 1) * N]. fused: NULL, or the
    # optimizer step the chunks make as they sum (FusedStep).
    void* gtok
    void* gpos
    const void* g
    const int64_t* ids
    const int64_t* rows
    const int64_t* tok_owner
    const int64_t* pos_owner
    int64_t* work
    Py_ssize_t N, m, d
    cpe_row_ops ops
    FusedStep* fused


cdef void _pair_chunk(void* arg, Py_ssize_t c) noexcept nogil:
    cdef PairJob* j = <PairJob*>arg
    cdef int64_t* work = j.work + c * j.N
    cdef Py_ssize_t n = _collect_pair(j.ids, j.tok_owner, j.rows, j.pos_owner, j.N, j.m, c,
                                      work)
    _sum_pair(<char*>j.gtok, j.ids, <char*>j.gpos, j.rows, j.pos_owner, c,
              <const char*>j.g, work, n, j.m, j.d, &j.ops, j.fused)


cdef void _scatter_pair(char* gtok, Py_ssize_t V, const int64_t* ids, char* gpos,
                        Py_ssize_t L, const int64_t* rows, Py_ssize_t m, const char* g,
                        Py_ssize_t N, Py_ssize_t d, const cpe_row_ops* ops, int n_threads,
                        int64_t* scratch, FusedStep* fused) noexcept nogil:
    # Both gradients of the token + position layer from one pass over g:
    # gtok[ids[i]] += g[i] and gpos[rows[i % m]] += g[i] for i < N, each
    # table row summed in input order by one chunk (bitwise np.add.at on
    # each table). Chunk c owns a range of token rows and one of position
    # rows, each about 1/n of its table's cost (_owner_bounds), and reads, in
    # order, every g[i] that either of its rows needs: with two chunks about
    # 1.5 reads of g in all. `scratch`: _pair_scratch_bytes of it. fused:
    # NULL, or an optimizer step on the rows summed (FusedStep).
    cdef Py_ssize_t i
    cdef int c
    cdef PairJob job
    cdef int64_t* bounds
    cdef Py_ssize_t tb = d * ops.tsize, gb = d * ops.gsize
    cdef const char* nxt
    cdef const char* far_acc
    if n_threads > 1:
        n_threads = cpe_threads_here(n_threads)
    if n_threads <= 1:
        for i in range(N):
            nxt = g + (i + 1) * gb if i + 1 < N else NULL
            far_acc = _token_dest(fused, gtok, ids[i + _AHEAD], tb) if i + _AHEAD < N else NULL
            if fused != NULL:
                _first_zero(gpos, rows[i % m], fused.pos_first, i, tb)
            if _single(fused, ids[i]):
                ops.acc(gpos + rows[i % m] * tb, g + i * gb, nxt, NULL, NULL, far_acc, d)
                _opt_row(&fused.tok, ids[i], g + i * gb, CPE_OPT_ADD_ZERO)
                continue
            if fused != NULL:
                _first_zero(gtok, ids[i], fused.tok_first, i, tb)
            ops.acc2(gtok + ids[i] * tb, gpos + rows[i % m] * tb, g + i * gb, nxt, NULL,
                     far_acc, d)
        if fused != NULL:
            _opt_block(&fused.tok, 0, fused.tok.n)
            _opt_block(&fused.pos, 0, fused.pos.n)
        return
    # The chunks for the threads the call has (the scratch holds those of
    # the threads it asked for).
    c = _PAIR_CHUNKS_PER_THREAD * n_threads
    job.tok_owner = scratch
    job.pos_owner = scratch + (V + 1)
    bounds = scratch + (V + 1) + (L + 1)
    job.work = bounds + (c + 1)
    _count_owned(ids, N, V, c, <int64_t*>job.tok_owner, bounds,
                 fused.single_cost if fused != NULL and fused.tok_single != NULL else 0)
    _count_owned(rows, m, L, c, <int64_t*>job.pos_owner, bounds)
    if fused != NULL and fused.tok_single != NULL:
        # A single goes to the thread that owns its position row, which
        # reads its gradient row anyway: that row is then read once.
        for i in range(N):
            if fused.tok_single[ids[i]]:
                (<int64_t*>job.tok_owner)[ids[i]] = job.pos_owner[rows[i % m]]
    job.fused = fused
    job.gtok = gtok
    job.gpos = gpos
    job.g = g
    job.ids = ids
    job.rows = rows
    job.N = N
    job.m = m
    job.d = d
    job.ops = ops[0]
    _run_chunks(_pair_chunk, &job, c, n_threads)
    if fused != NULL:
        # The summed rows, once every chunk is done with them.
        _opt_rows(&fused.tok, n_threads)
        _opt_rows(&fused.pos, n_threads)
