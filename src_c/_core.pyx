# cposembed._core: one checked C entry per operation.
#
# Each entry checks the caller's objects with a few C comparisons and runs the
# kernel, or returns None with nothing written; cposembed._routes then normalises
# the arguments (or raises the worded error) and calls the same entry again.
# Accepted ("canonical"): exact, C-contiguous, aligned, native-order ndarrays of
# a dtype with kernels; positions as _index.pxi reads them (always copied into
# memory the call owns); outputs that share no memory with what the call reads
# (except the in-place add, `out is tokens`).

cimport cython
cimport numpy as cnp

from cposembed._blocks cimport (
    _POOL_BYTES,
    _block_array,
    _scratch_give,
    _scratch_or_raise,
)
from cposembed._marks cimport (
    RowMarks,
    RowSlots,
    _compact_pays,
    _distinct,
    _distinct_scratch_bytes,
)

include "_kernels.pxi"
include "_index.pxi"
include "_parallel.pxi"

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    enum:
        NPY_HALF  # not in Cython's numpy declarations

import sys

import numpy as np

# NumPy's bfloat16 is ml_dtypes', whose type number is known once it is imported:
# on the first bfloat16(), or when an array of a user-defined dtype arrives while
# ml_dtypes is loaded (no bfloat16 array exists before).
cdef object _BFLOAT16 = None
cdef int _NPY_BFLOAT16 = -1


def bfloat16():
    """NumPy's bfloat16 dtype (ml_dtypes', imported on the first call)."""
    global _BFLOAT16, _NPY_BFLOAT16
    if _BFLOAT16 is None:
        import ml_dtypes

        dt = np.dtype(ml_dtypes.bfloat16)
        # float64 -> bfloat16 as the installed ml_dtypes converts: 1 + 2^-8 + 2^-30
        # is 1.0 through float32 (two roundings) and 1 + 2^-7 in one.
        cpe_set_bf16_from_f64_direct(
            int(np.array([1 + 2.0**-8 + 2.0**-30]).astype(dt).view(np.uint16)[0]) == 0x3F81
        )
        _NPY_BFLOAT16 = dt.num
        _BFLOAT16 = dt
    return _BFLOAT16


def loaded_bfloat16():
    """bfloat16() if ml_dtypes has been imported, else None."""
    if _BFLOAT16 is None and "ml_dtypes" in sys.modules:
        return bfloat16()
    return _BFLOAT16


cdef void _look_for_bfloat16() noexcept:
    # An array of a user-defined dtype arrived: it may be bfloat16.
    try:
        loaded_bfloat16()
    except Exception:
        pass  # an ml_dtypes that cannot be used: no bfloat16 kernels


# The half-precision primitives' best variant for this CPU (_rows.h.tp).
cpe_init_isa()
ISAS = ("sse2", "f16c", "avx2")


def set_isa(name):
    """Use the half-precision primitives of variant `name` ("sse2", "f16c" or
    "avx2"; all give the same bits), or the best below it that the CPU has
    (for tests); the name of the one now used."""
    if name not in ISAS:
        raise ValueError(f"name must be one of {ISAS}; got {name!r}")
    return ISAS[cpe_set_isa(ISAS.index(name))]


def isas():
    """The variants this CPU and build have, from the portable one up."""
    return ISAS[: cpe_best_isa() + 1]


cdef extern from "Python.h":
    ctypedef struct PyThreadState
    PyThreadState* PyEval_SaveThread() noexcept
    void PyEval_RestoreThread(PyThreadState* state) noexcept


cdef inline PyThreadState* _release_gil(Py_ssize_t work) noexcept:
    # Small work keeps the GIL: releasing it costs about a tiny call. Pair with _take_gil.
    return PyEval_SaveThread() if work >= _SERIAL_BELOW else NULL


cdef inline void _take_gil(PyThreadState* state) noexcept:
    if state != NULL:
        PyEval_RestoreThread(state)


# ---- the kernels of each dtype -------------------------------------------------
#
# Each entry fills a KernelCall for _run_kernel, the one place that maps dtypes to
# the row primitives (_rows.h; a dtype is added in _type_code and the template's
# CTYPE). A kernel call cannot fail: its memory was taken before, with the GIL, by
# _scratch_or_raise, so the kernels are noexcept nogil.

cdef inline void _kernel_call(KernelCall* c, Kernel kernel, void* out, const void* src,
                              const int64_t* rows, Py_ssize_t n, Py_ssize_t m, Py_ssize_t d,
                              int n_threads) noexcept:
    # The fields every kernel takes; the others zeroed, for the entry to set.
    memset(c, 0, sizeof(KernelCall))
    c.kernel = kernel
    c.out = out
    c.src = src
    c.rows = rows
    c.n = n
    c.m = m
    c.d = d
    c.n_threads = n_threads
    c.src_type = -1


cdef inline int _type_code(int typenum) noexcept:
    """The row primitives' code (_rows.h) of a dtype the kernels run on; -1
    for any other."""
    if typenum == cnp.NPY_FLOAT:
        return CPE_F32
    if typenum == cnp.NPY_DOUBLE:
        return CPE_F64
    if typenum == NPY_HALF:
        return CPE_F16
    if typenum == _NPY_BFLOAT16:
        return CPE_BF16
    return -1


cdef inline bint _has_kernels(int typenum) noexcept:
    """The dtypes the kernels run on: float16, bfloat16, float32, float64."""
    if _NPY_BFLOAT16 < 0 and cnp.PyTypeNum_ISUSERDEF(typenum):
        _look_for_bfloat16()
    return _type_code(typenum) >= 0


cdef void _run_kernel(const KernelCall* c, int typenum) noexcept:
    """Run c.kernel on tables of dtype `typenum` (and a source of dtype
    c.src_type), both ones _has_kernels accepts, without the GIL unless the
    work is small (_release_gil)."""
    cdef cpe_row_ops ops
    cdef int t = _type_code(typenum)
    cdef int g = _type_code(c.src_type) if c.src_type >= 0 else t
    if t < 0 or g < 0:
        abort()  # a dtype _has_kernels does not accept
    cpe_row_ops_for(t, g, &ops)
    cdef KernelCall run = c[0]
    cdef bint measured = _measured(c.n_threads)
    cdef long long t0 = 0
    if measured:
        run.n_threads = cpe_choose(c.kernel, c.n * c.d, c.n_threads)
        t0 = cpe_now_ns()
    cdef PyThreadState* gil = _release_gil(c.n * c.d)
    _kernel(&run, &ops)
    _take_gil(gil)
    if measured:
        cpe_took(c.kernel, c.n * c.d, run.n_threads, cpe_now_ns() - t0)


cdef void _kernel(const KernelCall* c, const cpe_row_ops* ops) noexcept nogil:
    # c.kernel with the row primitives of its dtypes.
    cdef Py_ssize_t rb = c.d * ops.tsize
    if c.kernel == K_SCATTER_ADD:
        _compact_rows(c, rb, False)
        _scatter_add(<char*>c.out, <const char*>c.src, c.rows, c.L, c.d, c.m, c.n // c.m,
                     ops, c.n_threads, <ScatterPlan>c.plan, c.scratch)
        _compact_rows(c, rb, True)
    elif c.kernel == K_SCATTER_PAIR:
        _compact_rows(c, rb, False)
        _scatter_pair(<char*>c.out, c.V, c.ids, <char*>c.out2, c.L, c.rows, c.m,
                      <const char*>c.src, c.n, c.d, ops, c.n_threads, c.scratch, c.fused)
        _compact_rows(c, rb, True)
    elif c.kernel == K_OPT:
        _opt_rows(c.opt, c.n_threads)
    else:
        _row_kernel(c, ops)


cdef bint _is_canonical(object obj, int typenum) noexcept:
    """Canonical, as the entries take arrays: an exact ndarray of dtype `typenum`,
    native byte order, C-contiguous, aligned."""
    if not cnp.PyArray_CheckExact(obj):
        return False
    cdef cnp.ndarray a = <cnp.ndarray>obj
    return (
        cnp.PyArray_TYPE(a) == typenum
        and cnp.PyArray_ISNOTSWAPPED(a)
        and cnp.PyArray_IS_C_CONTIGUOUS(a)
        and cnp.PyArray_ISALIGNED(a)
    )


cdef int _source_type(object arr) noexcept:
    """The dtype of an ndarray whose dtype has kernels, -1 for anything else
    (a source that may differ from the table's dtype: _is_canonical still checks
    it)."""
    if not cnp.PyArray_CheckExact(arr):
        return -1
    cdef int typenum = cnp.PyArray_TYPE(<cnp.ndarray>arr)
    return typenum if _has_kernels(typenum) else -1


cdef int _table_type(object table) noexcept:
    """The dtype of a canonical 2-D table with kernels (_has_kernels); -1 for anything else."""
    if not cnp.PyArray_CheckExact(table):
        return -1
    cdef cnp.ndarray t = <cnp.ndarray>table
    cdef int typenum = cnp.PyArray_TYPE(t)
    if cnp.PyArray_NDIM(t) != 2 or not _has_kernels(typenum) or not _is_canonical(t, typenum):
        return -1
    return typenum


cdef bint _disjoint(cnp.ndarray a, cnp.ndarray b) noexcept:
    # The byte ranges of two C-contiguous arrays do not meet (an empty array
    # meets nothing, as for np.may_share_memory).
    cdef const char* a0 = cnp.PyArray_BYTES(a)
    cdef const char* b0 = cnp.PyArray_BYTES(b)
    cdef Py_ssize_t na = cnp.PyArray_NBYTES(a), nb = cnp.PyArray_NBYTES(b)
    return na == 0 or nb == 0 or a0 + na <= b0 or b0 + nb <= a0


cdef bint _writable_out(object out, int typenum, int nd, const cnp.npy_intp* dims,
                        cnp.ndarray table) noexcept:
    """`out` is canonical, writable, of shape dims[:nd], and not overlapping the table."""
    if not _is_canonical(out, typenum):
        return False
    cdef cnp.ndarray o = <cnp.ndarray>out
    cdef int k
    if not cnp.PyArray_ISWRITEABLE(o) or cnp.PyArray_NDIM(o) != nd:
        return False
    for k in range(nd):
        if cnp.PyArray_DIMS(o)[k] != dims[k]:
            return False
    return _disjoint(o, table)


cdef inline cnp.ndarray _output(object out, int typenum, int nd, cnp.npy_intp* dims,
                                cnp.ndarray table, object other, object num_threads,
                                Py_ssize_t n_rows, Py_ssize_t d, int* nt):
    """Where an entry writes n_rows rows of d and on how many threads (*nt,
    _threads_for): a fresh array of shape dims[:nd] and the table's dtype if
    `out` is None, `out` if _writable_out and not overlapping `other` (an ndarray,
    or None); None if `out` is neither or num_threads is refused."""
    if out is not None and not (
            _writable_out(out, typenum, nd, dims, table)
            and (other is None or _disjoint(<cnp.ndarray>out, <cnp.ndarray>other))):
        return None
    result = _new_output(nd, dims, table) if out is None else out
    nt[0] = _threads_for(num_threads, n_rows * d, n_rows)
    return result if nt[0] else None


cdef cnp.ndarray _new_output(int nd, cnp.npy_intp* dims, cnp.ndarray like):
    """A fresh C-contiguous array of `like`'s dtype; large ones from the reusable blocks."""
    cdef int typenum = cnp.PyArray_TYPE(like)
    cdef Py_ssize_t nbytes = cnp.PyArray_ITEMSIZE(like)
    cdef int k
    for k in range(nd):
        if dims[k] and nbytes > (<Py_ssize_t>1 << 62) // dims[k]:
            return cnp.PyArray_SimpleNew(nd, dims, typenum)  # NumPy words the error
        nbytes *= dims[k]
    if nbytes < _POOL_BYTES:
        return cnp.PyArray_SimpleNew(nd, dims, typenum)
    return _block_array(nd, dims, typenum, nbytes)


# The offset rule, its one home: 0 with explicit positions; with positions=None
# the rows are offset + arange(T), 0 <= offset <= L - T (any offset >= 0 if T == 0).
# _routes.check_offset words the error from the code returned.
cdef enum:
    _OFFSET_OK = 0
    _OFFSET_NOT_INT = 1
    _OFFSET_NEGATIVE = 2
    _OFFSET_WITH_POSITIONS = 3
    _OFFSET_PAST_END = 4
OFFSET_NOT_INT = _OFFSET_NOT_INT
OFFSET_NEGATIVE = _OFFSET_NEGATIVE
OFFSET_WITH_POSITIONS = _OFFSET_WITH_POSITIONS
OFFSET_PAST_END = _OFFSET_PAST_END


cdef int _offset_rule(object offset, bint with_positions, Py_ssize_t T, Py_ssize_t L,
                      Py_ssize_t* start) noexcept:
    cdef long long v
    cdef int sign = _int_sign(offset, &v)
    if sign <= 0:
        return _OFFSET_NOT_INT if sign < 0 else _OFFSET_NEGATIVE
    if with_positions:
        return _OFFSET_WITH_POSITIONS if v else _OFFSET_OK
    start[0] = 0
    if T == 0:
        return _OFFSET_OK
    if v > L - T:
        return _OFFSET_PAST_END
    start[0] = <Py_ssize_t>v
    return _OFFSET_OK


def offset_rule(offset, bint with_positions, Py_ssize_t T, Py_ssize_t n_rows):
    """The offset rule for T rows of a table of n_rows positions: 0 if
    ``offset`` keeps it, else the OFFSET_ code of the part it breaks."""
    cdef Py_ssize_t start
    return _offset_rule(offset, with_positions, T, n_rows, &start)


cdef int _positions_for(object positions, object offset, Py_ssize_t L,
                        const cnp.npy_intp* lead, int n_lead, Index* ix,
                        Py_ssize_t* m) except -1:
    """Positions for rows laid out as lead[:n_lead] (row i takes ix.rows[i % m]):
    offset + arange(T) for None, else positions whose shape without leading 1s
    equals the lead's trailing axes. 1; 0: refused, nothing held; MemoryError."""
    cdef Py_ssize_t T, start
    cdef int k, core
    ix.rows = NULL
    if positions is None:
        if n_lead < 1:
            return 0
        T = lead[n_lead - 1]
        if _offset_rule(offset, False, T, L, &start) != _OFFSET_OK:
            return 0
        m[0] = T
        return _arange_index(start, T, ix)
    if _offset_rule(offset, True, 0, L, &start) != _OFFSET_OK:
        return 0
    if not _read_index(positions, L, ix):
        return 0
    k = 0
    while k < ix.nd and ix.shape[k] == 1:
        k += 1
    core = ix.nd - k
    if ix.nd > n_lead:  # more axes than the rows: NumPy's result would have them
        _index_free(ix)
        return 0
    for k in range(core):
        if ix.shape[ix.nd - core + k] != lead[n_lead - core + k]:
            _index_free(ix)
            return 0
    m[0] = ix.n
    return 1


def index_rows(positions, Py_ssize_t n_rows):
    """``positions`` read as the entries read them (_index.pxi): an int64 array
    of their shape, each row wrapped into [0, n_rows); None for any other form,
    or a value outside [-n_rows, n_rows)."""
    cdef Index ix
    cdef cnp.ndarray a
    if n_rows < 0 or not _read_index(positions, n_rows, &ix):
        return None
    try:
        a = cnp.PyArray_SimpleNew(ix.nd, ix.shape, cnp.NPY_INT64)
        memcpy(cnp.PyArray_DATA(a), ix.rows, ix.n * sizeof(int64_t))
        return a
    finally:
        _index_free(&ix)


cdef inline Py_ssize_t _lead_size(cnp.ndarray a) noexcept:
    # The rows of an array of shape (..., d): the product of its leading axes.
    cdef Py_ssize_t n = 1
    cdef int k
    for k in range(cnp.PyArray_NDIM(a) - 1):
        n *= cnp.PyArray_DIMS(a)[k]
    return n


cdef int _reserve_marks(object touched, Py_ssize_t m) except -1:
    # Room in `touched` (a RowMarks, or None) for m more rows, before the
    # kernel writes anything (MemoryError).
    if touched is not None:
        (<RowMarks>touched)._reserve(m)
    return 0


cdef void _mark_rows(object touched, const int64_t* rows, Py_ssize_t n,
                     Py_ssize_t skip_row) noexcept:
    # The tail of a scatter-add, first half: marks rows[:n] in `touched` (a
    # RowMarks with room reserved, or None), but skip_row (-1: none), which
    # ends unmarked.
    if touched is None:
        return
    cdef RowMarks marks = <RowMarks>touched
    marks._mark(rows, n, skip_row)
    if skip_row >= 0 and marks.flags[skip_row]:
        marks.unmark(skip_row)


cdef void _zero_row(cnp.ndarray table, Py_ssize_t row) noexcept:
    # The tail of a scatter-add, second half: table[row] = 0, the padding
    # row that gets no gradient (row -1: none).
    cdef Py_ssize_t nbytes = cnp.PyArray_DIMS(table)[1] * cnp.PyArray_ITEMSIZE(table)
    if row >= 0 and nbytes:
        memset(cnp.PyArray_BYTES(table) + row * nbytes, 0, nbytes)


def lookup(table, positions, out, num_threads):
    """``table[positions]`` into ``out`` (or a new array), returned; None if refused.

    table: canonical (L, d); positions: as _index.pxi reads them, in [-L, L); out:
    None, or canonical, writable, of shape positions.shape + (d,), disjoint from table.
    """
    return _lookup_entry(table, positions, out, num_threads)


cdef object _lookup_entry(object table, object positions, object out, object num_threads):
    cdef int typenum = _table_type(table)
    if typenum < 0:
        return None
    cdef cnp.ndarray t = <cnp.ndarray>table
    cdef Py_ssize_t L = cnp.PyArray_DIMS(t)[0], d = cnp.PyArray_DIMS(t)[1]
    cdef Index ix
    cdef cnp.ndarray o
    cdef KernelCall c
    cdef int nt
    cdef int64_t row
    if out is None and num_threads is None and _is_integer(positions):
        # One row (`pe(5)`, the commonest tiny call): a copy of it.
        if not _int_value(positions, L, &row):
            return None
        _threads_for(None, d, 1)  # one thread (for last_team)
        o = cnp.PyArray_SimpleNew(1, &cnp.PyArray_DIMS(t)[1], typenum)
        memcpy(cnp.PyArray_DATA(o), cnp.PyArray_BYTES(t) + row * d * cnp.PyArray_ITEMSIZE(t),
               d * cnp.PyArray_ITEMSIZE(t))
        return o
    if not _read_index(positions, L, &ix):
        return None
    try:
        ix.shape[ix.nd] = d
        o = _output(out, typenum, ix.nd + 1, ix.shape, t, None, num_threads, ix.n, d, &nt)
        if o is None:
            return None
        if ix.n and d:
            _kernel_call(&c, K_LOOKUP, cnp.PyArray_DATA(o), cnp.PyArray_DATA(t), ix.rows,
                         ix.n, ix.n, d, nt)
            c.prefetch = L * d * cnp.PyArray_ITEMSIZE(t) > _PREFETCH_TABLE_BYTES
            c.stream = cnp.PyArray_NBYTES(o) >= _STREAM_BYTES
            _run_kernel(&c, typenum)
        return o
    finally:
        _index_free(&ix)


@cython.auto_pickle(False)  # the subclass pickles its checked state itself
cdef class TableCall:
    """Base of :class:`cposembed.LearnedPositionEmbedding`: ``pe(positions)`` is the
    lookup entry on ``self._embeddings`` with no Python frame between; refused
    arguments go to ``self._lookup_normalised(positions, out)``. (No fields: the
    subclass keeps its state in ``__slots__``.)
    """

    @cython.embedsignature(False)  # docs/api.rst gives it, without `self`
    def __call__(self, positions, *, out=None):
        """__call__($self, positions, *, out=None)
--

Look up position embeddings: ``embeddings[positions]``.

        Parameters
        ----------
        positions : int, array_like of int, or any NumPy index
            ``-L <= p < L`` (negatives wrap), as :func:`cposembed.lookup`.
        out : ndarray, optional
            Destination of shape ``positions.shape + (embed_dim,)`` and the
            table's dtype.

        Returns
        -------
        ndarray
            A new array (a scalar position gives a ``(embed_dim,)`` copy of its
            row), or ``out``.
        """
        result = _lookup_entry(self._embeddings, positions, out, None)
        if result is None:
            result = self._lookup_normalised(positions, out)
        return result


cdef int _rows_type(object table, object rows_array, bint any_dtype=False) noexcept:
    # The dtype of a canonical (L, d) table with kernels and of a canonical array
    # of shape (..., d) with that dtype (tokens), or with any dtype that has
    # kernels if any_dtype (a gradient: _source_type); -1 else.
    cdef int typenum = _table_type(table)
    if typenum < 0 or not _is_canonical(
            rows_array, _source_type(rows_array) if any_dtype else typenum):
        return -1
    cdef cnp.ndarray a = <cnp.ndarray>rows_array
    cdef int nd = cnp.PyArray_NDIM(a)
    if nd < 1 or cnp.PyArray_DIMS(a)[nd - 1] != cnp.PyArray_DIMS(<cnp.ndarray>table)[1]:
        return -1
    return typenum


def add(tokens, table, positions, offset, out, num_threads):
    """``tokens + table[positions]`` into ``out`` (or a new array), returned; None if refused.

    tokens: canonical (..., d) of the table's dtype; positions, offset: as
    _positions_for; out: None, ``tokens`` (in place), or canonical, writable, of
    tokens' shape, disjoint from tokens and table.
    """
    cdef int typenum = _rows_type(table, tokens)
    if typenum < 0:
        return None
    cdef cnp.ndarray t = <cnp.ndarray>table
    cdef cnp.ndarray k = <cnp.ndarray>tokens
    cdef Py_ssize_t L = cnp.PyArray_DIMS(t)[0], d = cnp.PyArray_DIMS(t)[1]
    cdef int nd = cnp.PyArray_NDIM(k)
    cdef Index ix
    cdef Py_ssize_t m, N
    cdef bint in_place = out is tokens
    cdef cnp.ndarray o
    cdef KernelCall c
    cdef int nt
    if not _positions_for(positions, offset, L, cnp.PyArray_DIMS(k), nd - 1, &ix, &m):
        return None
    try:
        # In place, `out` is the tokens themselves; else it must not meet them.
        N = _lead_size(k)
        o = _output(out, typenum, nd, cnp.PyArray_DIMS(k), t, None if in_place else k,
                    num_threads, N, d, &nt)
        if o is None:
            return None
        if N and d and m:
            _kernel_call(&c, K_ADD, cnp.PyArray_DATA(o), cnp.PyArray_DATA(k), ix.rows, N, m,
                         d, nt)
            c.table = cnp.PyArray_DATA(t)
            # In place the lines are read anyway: ordinary stores.
            c.stream = not in_place and cnp.PyArray_NBYTES(o) >= _STREAM_BYTES
            c.prefetch = in_place
            _run_kernel(&c, typenum)
        return o
    finally:
        _index_free(&ix)


cdef bint _marks_ok(object marks, Py_ssize_t L) noexcept:
    # None, or a RowMarks of L rows.
    return marks is None or (type(marks) is RowMarks and (<RowMarks>marks).n_rows == L)


cdef struct Compact:
    # The distinct rows of a call's m row numbers (_distinct), in one block
    # of scratch: slot[:m] (a buffer of its own, or the row numbers' own,
    # rewritten in place), uniq[:k], first[:k]; then `rows`: k rows of
    # scratch the kernel sums into (not zeroed). block NULL: none taken.
    int64_t* slot
    int64_t* uniq
    int64_t* first
    Py_ssize_t k
    void* rows
    void* block
    size_t block_capacity, rows_capacity


cdef int _compact(Compact* cp, int64_t* rows, Py_ssize_t m, Py_ssize_t L,
                  Py_ssize_t row_bytes, bint in_place, str what) except -1:
    """The distinct rows of rows[:m] (in [0, L); their slots in place if
    in_place, else in a buffer of their own) and k scratch rows of
    row_bytes; MemoryError "cannot allocate <what>'s scratch" (or rows), with
    what is held left in `cp` for _compact_give."""
    cdef Py_ssize_t n_slot = 0 if in_place else m
    cdef int64_t* block = <int64_t*>_scratch_or_raise(
        (n_slot + 2 * m) * sizeof(int64_t) + _distinct_scratch_bytes(m, L),
        &cp.block_capacity, f"{what}'s scratch")
    cp.block = block
    cp.slot = rows if in_place else block + 2 * m
    cp.uniq = block
    cp.first = block + m
    cp.k = _distinct(rows, m, L, cp.slot, cp.uniq, cp.first, block + 2 * m + n_slot)
    cp.rows = _scratch_or_raise(max(cp.k * row_bytes, 1), &cp.rows_capacity,
                                f"{what}'s rows")
    return 0


cdef void _compact_give(Compact* cp) noexcept:
    if cp.rows != NULL:
        _scratch_give(cp.rows, cp.rows_capacity)
        cp.rows = NULL
    if cp.block != NULL:
        _scratch_give(cp.block, cp.block_capacity)
        cp.block = NULL


cdef void _sum_compact(const Compact* cp, void* table, void** out, const int64_t** rows,
                       Py_ssize_t* n_rows, void** compact_of,
                       const int64_t** compact_rows) noexcept:
    # Points a kernel call's table operand (out, its row numbers, its rows,
    # KernelCall's compact_of and compact_rows) at the compact copy `cp` of
    # table's touched rows, which the kernel gathers, sums into and writes
    # back (the sparse plan).
    out[0] = cp.rows
    rows[0] = cp.slot
    n_rows[0] = cp.k
    compact_of[0] = table
    compact_rows[0] = cp.uniq


def scatter_add(grad, grad_output, positions, offset, num_threads, touched=None,
                Py_ssize_t skip_row=-1, int plan=PLAN_AUTO):
    """``grad[positions[i]] += grad_output[i]`` in np.add.at's order, in place;
    returns grad, or None if refused.

    grad: canonical, writable (L, d); grad_output: canonical (..., d) of any dtype
    with kernels, disjoint from grad; positions, offset: as add's. touched: None or
    a RowMarks of L rows, marked where a row got a contribution; skip_row: -1, or a
    row that gets no gradient (zeroed, unmarked); plan: a ScatterPlan.
    """
    cdef int typenum = _rows_type(grad, grad_output, True)
    if typenum < 0:
        return None
    cdef cnp.ndarray G = <cnp.ndarray>grad
    cdef cnp.ndarray g = <cnp.ndarray>grad_output
    cdef Py_ssize_t L = cnp.PyArray_DIMS(G)[0], d = cnp.PyArray_DIMS(G)[1]
    cdef Py_ssize_t rb = d * cnp.PyArray_ITEMSIZE(G)
    cdef int nd = cnp.PyArray_NDIM(g)
    if (
        not cnp.PyArray_ISWRITEABLE(G)
        or not _disjoint(g, G)
        or not _marks_ok(touched, L)
        or not -1 <= skip_row < L
        or not <int>PLAN_AUTO <= plan <= <int>PLAN_SORT
    ):
        return None
    cdef Index ix
    cdef Py_ssize_t m, N, T
    cdef size_t capacity
    cdef KernelCall c
    cdef Compact sp
    cdef int nt
    if not _positions_for(positions, offset, L, cnp.PyArray_DIMS(g), nd - 1, &ix, &m):
        return None
    memset(&sp, 0, sizeof(Compact))
    try:
        N = _lead_size(g)
        # (B, T) positions that repeat every sequence (arange expanded,
        # typically) are one period of T: the distinct-rows plan takes them.
        if positions is not None and m == N and nd >= 3:
            T = cnp.PyArray_DIMS(g)[nd - 2]
            if 0 < T < N and _repeats(ix.rows, N, T):
                m = T
        nt = _threads_for(num_threads, N * d, min(L, m))
        if not nt:
            return None
        _reserve_marks(touched, min(m, L))
        if N and d and m:
            _kernel_call(&c, K_SCATTER_ADD, cnp.PyArray_DATA(G), cnp.PyArray_DATA(g),
                         ix.rows, N, m, d, nt)
            c.L = L
            c.src_type = cnp.PyArray_TYPE(g)
            c.plan = plan
            if _compact_pays(L, m, rb):
                _compact(&sp, ix.rows, m, L, rb, False, "the sparse plan")
                _sum_compact(&sp, cnp.PyArray_DATA(G), &c.out, &c.rows, &c.L, &c.compact_of,
                             &c.compact_rows)
            c.scratch = <int64_t*>_scratch_or_raise(_scatter_scratch_bytes(c.L, m, nt),
                                                    &capacity, "the scatter-add's scratch")
            _run_kernel(&c, typenum)
            _scratch_give(c.scratch, capacity)
        _mark_rows(touched, ix.rows, m if N else 0, skip_row)
        _zero_row(G, skip_row)
        return grad
    finally:
        _compact_give(&sp)
        _index_free(&ix)


def sgd_step(table, grad, touched, double lr, Py_ssize_t skip_row, num_threads=None):
    """``table[r] -= lr * grad[r]`` on the rows ``touched`` marks (every row if None)
    but skip_row (-1: none); True, or None if refused. grad: canonical, the table's
    shape and dtype (float32 for a half table), disjoint from it.
    """
    cdef int typenum = _table_type(table)
    cdef bint half = typenum == NPY_HALF or typenum == _NPY_BFLOAT16
    if typenum < 0 or not _is_canonical(grad, cnp.NPY_FLOAT if half else typenum):
        return None
    cdef cnp.ndarray t = <cnp.ndarray>table
    cdef cnp.ndarray G = <cnp.ndarray>grad
    cdef Py_ssize_t L = cnp.PyArray_DIMS(t)[0], d = cnp.PyArray_DIMS(t)[1]
    if (
        cnp.PyArray_NDIM(G) != 2
        or cnp.PyArray_DIMS(G)[0] != L
        or cnp.PyArray_DIMS(G)[1] != d
        or not cnp.PyArray_ISWRITEABLE(t)
        or not _disjoint(t, G)
        or not _marks_ok(touched, L)
        or not -1 <= skip_row < L
    ):
        return None
    cdef size_t capacity
    cdef KernelCall c
    cdef Py_ssize_t n = L if touched is None else (<RowMarks>touched).n
    cdef int64_t* rows = <int64_t*>_scratch_or_raise((n if n > 0 else 1) * sizeof(int64_t),
                                                     &capacity, "the SGD step's row list")
    n = _step_rows(touched, L, skip_row, rows)
    cdef int nt = _threads_for(num_threads, n * d, n)
    if nt:
        _kernel_call(&c, K_SGD, cnp.PyArray_DATA(t), cnp.PyArray_DATA(G), rows, n, n, d, nt)
        c.lr = lr
        c.src_type = cnp.NPY_FLOAT if half else typenum
        _run_kernel(&c, typenum)
    _scratch_give(rows, capacity)
    return True if nt else None


cdef Py_ssize_t _step_rows(object touched, Py_ssize_t L, Py_ssize_t skip_row,
                           int64_t* rows) noexcept:
    # rows[:n] = the rows `touched` marks (every row if None) but skip_row;
    # returns n.
    cdef Py_ssize_t i, n = 0
    cdef RowMarks marks
    if touched is None:
        for i in range(L):
            rows[n] = i
            n += i != skip_row
        return n
    marks = <RowMarks>touched
    for i in range(marks.n):
        rows[n] = marks.row_list[i]
        n += marks.row_list[i] != skip_row
    return n


cdef int _pair_type(object token_table, object position_table) noexcept:
    """The tables' dtype when both are canonical with the same dtype and
    embed_dim; -1 else."""
    cdef int typenum = _table_type(token_table)
    if typenum < 0 or _table_type(position_table) != typenum:
        return -1
    if cnp.PyArray_DIMS(<cnp.ndarray>token_table)[1] != cnp.PyArray_DIMS(
            <cnp.ndarray>position_table)[1]:
        return -1
    return typenum


cdef int _ids_positions(object token_ids, Py_ssize_t V, object positions, object offset,
                        Py_ssize_t L, Index* ids, Index* ix, Py_ssize_t* m) except -1:
    """Token ids (checked against V) and _positions_for them (laid out as the
    ids): 1; 0: refused, nothing held; MemoryError as _read_index."""
    cdef int found = -1
    ix.rows = NULL
    if not _read_index(token_ids, V, ids):
        return 0
    try:
        found = _positions_for(positions, offset, L, ids.shape, ids.nd, ix, m)
    finally:
        if found != 1:
            _index_free(ids)
    return found


def embed(token_ids, token_table, position_table, positions, offset, out, num_threads):
    """``token_table[token_ids] + position_table[positions]`` into ``out`` (or a
    new array), returned; None if refused.

    The tables: canonical, one dtype; token_ids: as _index.pxi reads them, in
    [-V, V); positions, offset: as _positions_for over the ids' shape; out: None, or
    canonical, writable, of shape token_ids.shape + (d,), disjoint from both tables.
    """
    cdef int typenum = _pair_type(token_table, position_table)
    if typenum < 0:
        return None
    cdef cnp.ndarray tt = <cnp.ndarray>token_table
    cdef cnp.ndarray pt = <cnp.ndarray>position_table
    cdef Py_ssize_t V = cnp.PyArray_DIMS(tt)[0], L = cnp.PyArray_DIMS(pt)[0]
    cdef Py_ssize_t d = cnp.PyArray_DIMS(tt)[1], m
    cdef Index ids, ix
    cdef cnp.ndarray o
    cdef KernelCall c
    cdef int nt
    if not _ids_positions(token_ids, V, positions, offset, L, &ids, &ix, &m):
        return None
    try:
        ids.shape[ids.nd] = d
        o = _output(out, typenum, ids.nd + 1, ids.shape, tt, pt, num_threads, ids.n, d,
                    &nt)
        if o is None:
            return None
        if ids.n and d and m:
            _kernel_call(&c, K_EMBED, cnp.PyArray_DATA(o), cnp.PyArray_DATA(tt), ix.rows,
                         ids.n, m, d, nt)
            c.ids = ids.rows
            c.table = cnp.PyArray_DATA(pt)
            c.prefetch = V * d * cnp.PyArray_ITEMSIZE(tt) > _PREFETCH_TABLE_BYTES
            c.stream = cnp.PyArray_NBYTES(o) >= _STREAM_BYTES
            _run_kernel(&c, typenum)
        return o
    finally:
        _index_free(&ix)
        _index_free(&ids)


cdef int _id_rows_threads(cnp.ndarray g, const Index* ids, Py_ssize_t d,
                          object num_threads) noexcept:
    # The threads of a backward whose gradient `g` must be ids.shape + (d,); 0: refused.
    cdef int k, nd = cnp.PyArray_NDIM(g)
    if nd != ids.nd + 1 or cnp.PyArray_DIMS(g)[nd - 1] != d:
        return 0
    for k in range(ids.nd):
        if cnp.PyArray_DIMS(g)[k] != ids.shape[k]:
            return 0
    return _threads_for(num_threads, ids.n * d, ids.n)


def embed_backward(grad_token_table, grad_position_table, grad_output, token_ids, positions,
                   offset, num_threads, token_touched=None, position_touched=None,
                   Py_ssize_t token_skip_row=-1):
    """Both gradients of embed from one pass over grad_output, in place, each
    bitwise np.add.at; True, or None if refused. The tables: canonical, writable,
    one dtype, disjoint; grad_output: token_ids.shape + (d,); the rest as embed's
    and scatter_add's.
    """
    cdef int typenum = _pair_type(grad_token_table, grad_position_table)
    if typenum < 0 or not _is_canonical(grad_output, _source_type(grad_output)):
        return None
    cdef cnp.ndarray gt = <cnp.ndarray>grad_token_table
    cdef cnp.ndarray gp = <cnp.ndarray>grad_position_table
    cdef cnp.ndarray g = <cnp.ndarray>grad_output
    cdef Py_ssize_t V = cnp.PyArray_DIMS(gt)[0], L = cnp.PyArray_DIMS(gp)[0]
    cdef Py_ssize_t d = cnp.PyArray_DIMS(gt)[1], m
    if (
        not cnp.PyArray_ISWRITEABLE(gt)
        or not cnp.PyArray_ISWRITEABLE(gp)
        or not _disjoint(gt, gp)
        or not _disjoint(g, gt)
        or not _disjoint(g, gp)
        or not _marks_ok(token_touched, V)
        or not _marks_ok(position_touched, L)
        or (token_touched is not None and token_touched is position_touched)
        or not -1 <= token_skip_row < V
    ):
        return None
    cdef Index ids, ix
    cdef size_t nbytes, capacity = 0
    cdef KernelCall c
    cdef Compact tok, pos
    cdef int nt
    cdef Py_ssize_t rb = d * cnp.PyArray_ITEMSIZE(gt)
    if not _ids_positions(token_ids, V, positions, offset, L, &ids, &ix, &m):
        return None
    memset(&tok, 0, sizeof(Compact))
    memset(&pos, 0, sizeof(Compact))
    try:
        nt = _id_rows_threads(g, &ids, d, num_threads)
        if not nt:
            return None
        _reserve_marks(token_touched, min(ids.n, V))
        _reserve_marks(position_touched, min(m, L))
        if ids.n and d and m:
            _kernel_call(&c, K_SCATTER_PAIR, cnp.PyArray_DATA(gt), cnp.PyArray_DATA(g),
                         ix.rows, ids.n, m, d, nt)
            c.out2 = cnp.PyArray_DATA(gp)
            c.src_type = cnp.PyArray_TYPE(g)
            c.ids = ids.rows
            c.V = V
            c.L = L
            # Tables far larger than the call: the sparse plan, as scatter_add's.
            if _compact_pays(V, ids.n, rb):
                _compact(&tok, ids.rows, ids.n, V, rb, False, "the sparse plan")
                _sum_compact(&tok, cnp.PyArray_DATA(gt), &c.out, &c.ids, &c.V, &c.compact_of,
                             &c.compact_rows)
            if _compact_pays(L, m, rb):
                _compact(&pos, ix.rows, m, L, rb, False, "the sparse plan")
                _sum_compact(&pos, cnp.PyArray_DATA(gp), &c.out2, &c.rows, &c.L,
                             &c.compact_of2, &c.compact_rows2)
            nbytes = _pair_scratch_bytes(c.V, c.L, ids.n, nt)
            if nbytes:
                c.scratch = <int64_t*>_scratch_or_raise(nbytes, &capacity,
                                                        "the backward pass's scratch")
            _run_kernel(&c, typenum)
            _scratch_give(c.scratch, capacity)
        _mark_rows(token_touched, ids.rows, ids.n, token_skip_row)
        _mark_rows(position_touched, ix.rows, m if ids.n else 0, -1)
        _zero_row(gt, token_skip_row)
        return True
    finally:
        _compact_give(&pos)
        _compact_give(&tok)
        _index_free(&ix)
        _index_free(&ids)


# ---- the optimizers (cposembed.optim) ------------------------------------------


def distinct_rows(rows, Py_ssize_t n_rows):
    """``(uniq, slots, first)`` of a canonical int64 array of rows in [0, n_rows): the
    distinct rows in order of first appearance, ``uniq[slots] == rows``, and where
    each first appears (_distinct); None if refused."""
    if not _is_canonical(rows, cnp.NPY_INT64) or n_rows < 0:
        return None
    cdef cnp.ndarray r = <cnp.ndarray>rows
    cdef Py_ssize_t m = cnp.PyArray_SIZE(r), j, k
    cdef const int64_t* p = <const int64_t*>cnp.PyArray_DATA(r)
    for j in range(m):
        if not 0 <= p[j] < n_rows:
            return None
    slots = cnp.PyArray_SimpleNew(cnp.PyArray_NDIM(r), cnp.PyArray_DIMS(r), cnp.NPY_INT64)
    cdef cnp.npy_intp dims = m
    uniq = cnp.PyArray_SimpleNew(1, &dims, cnp.NPY_INT64)
    first = cnp.PyArray_SimpleNew(1, &dims, cnp.NPY_INT64)
    cdef size_t capacity
    cdef int64_t* scratch = <int64_t*>_scratch_or_raise(_distinct_scratch_bytes(m, n_rows),
                                                        &capacity, "the distinct rows' scratch")
    k = _distinct(p, m, n_rows, <int64_t*>cnp.PyArray_DATA(<cnp.ndarray>slots),
                  <int64_t*>cnp.PyArray_DATA(<cnp.ndarray>uniq),
                  <int64_t*>cnp.PyArray_DATA(<cnp.ndarray>first), scratch)
    _scratch_give(scratch, capacity)
    return uniq[:k].copy(), slots, first[:k].copy()


cdef bint _state_ok(object buf, int typenum, cnp.ndarray table) noexcept:
    # None, or a canonical writable array of the table's shape, disjoint from it.
    return buf is None or _writable_out(buf, typenum, 2, cnp.PyArray_DIMS(table), table)


cdef bint _read_hyper(object hyper, cpe_opt_hyper* h) noexcept:
    # hyper: a dict with a value for every field of cpe_opt_hyper; False if not.
    if type(hyper) is not dict:
        return False
    try:
        h[0] = hyper
    except (TypeError, ValueError, OverflowError, KeyError):
        return False
    return h.kind == CPE_OPT_SGD or h.kind == CPE_OPT_ADAM


cdef bint _opt_target(OptJob* job, const cpe_opt_hyper* h, object table, object state1,
                      object state2, object slots, Py_ssize_t skip_row) noexcept:
    # `job` (zeroed first) for a step of h on a canonical writable table, with state
    # arrays as optimizer_step takes them; False: refused.
    memset(job, 0, sizeof(OptJob))
    cdef int typenum = _table_type(table)
    if typenum < 0:
        return False
    cdef int ktype = cnp.NPY_DOUBLE if typenum == cnp.NPY_DOUBLE else cnp.NPY_FLOAT
    cdef cnp.ndarray t = <cnp.ndarray>table
    cdef Py_ssize_t L = cnp.PyArray_DIMS(t)[0], d = cnp.PyArray_DIMS(t)[1]
    if (
        not cnp.PyArray_ISWRITEABLE(t)
        or not _state_ok(state1, ktype, t)
        or not _state_ok(state2, ktype, t)
        or (state1 is not None and state2 is not None
            and not _disjoint(<cnp.ndarray>state1, <cnp.ndarray>state2))
        or not (slots is None or (type(slots) is RowSlots and (<RowSlots>slots).n_rows == L))
        or not -1 <= skip_row < L
        or (h.kind == CPE_OPT_ADAM and (state1 is None or state2 is None))
        or (h.kind == CPE_OPT_SGD and h.momentum_on and state1 is None)
    ):
        return False
    job.table = cnp.PyArray_BYTES(t)
    job.state1 = cnp.PyArray_BYTES(<cnp.ndarray>state1) if state1 is not None else NULL
    job.state2 = cnp.PyArray_BYTES(<cnp.ndarray>state2) if state2 is not None else NULL
    job.d = d
    job.skip_row = skip_row
    job.tsize = cnp.PyArray_ITEMSIZE(t)
    job.ssize = 8 if ktype == cnp.NPY_DOUBLE else 4
    job.update = cpe_opt_for(_type_code(typenum))
    job.hyper = h
    return True


cdef bint _disjoint_from_target(cnp.ndarray a, object table, object state1,
                                object state2) noexcept:
    # `a` shares no memory with a step's table and state arrays.
    return _disjoint(a, <cnp.ndarray>table) and (
        state1 is None or _disjoint(a, <cnp.ndarray>state1)) and (
        state2 is None or _disjoint(a, <cnp.ndarray>state2))


cdef int64_t* _take_slots(object slots, Py_ssize_t n, size_t* capacity) except? NULL:
    # Scratch for the slots of n rows in `slots` (None: NULL), room reserved;
    # MemoryError before anything changes. _give_slots assigns them.
    if slots is None or not n:
        return NULL
    (<RowSlots>slots)._reserve(n)
    return <int64_t*>_scratch_or_raise(n * sizeof(int64_t), capacity, "the step's slots")


cdef void _give_slots(object slots, OptJob* job, Py_ssize_t n, int64_t* buf) noexcept:
    # The slots of job.rows[:n] into `buf` (new ones for rows without state).
    if buf != NULL:
        job.fresh_from = (<RowSlots>slots)._assign(job.rows, n, job.skip_row, buf)
        job.slots = buf


def optimizer_step(table, grad, rows, bint compact, state1, state2, slots, hyper,
                   Py_ssize_t skip_row, num_threads=None):
    """One optimizer step (cpe_opt_T of _rows.h.tp) on the distinct rows `rows`
    (1-D int64 in [0, L)) but skip_row (-1: none); True, or None if refused.

    table: canonical, writable (L, d); K: float64 for a float64 table, else float32.
    grad: canonical K, d columns, row i for rows[i] if compact, else (L, d). state1,
    state2: None or canonical, writable (L, d) K arrays. slots: None (row r's state
    is row r) or a RowSlots of L rows. hyper: a dict of cpe_opt_hyper's fields.
    All disjoint.
    """
    cdef cpe_opt_hyper h
    cdef OptJob job
    if not _read_hyper(hyper, &h) or not _opt_target(&job, &h, table, state1, state2, slots,
                                                     skip_row):
        return None
    cdef Py_ssize_t L = cnp.PyArray_DIMS(<cnp.ndarray>table)[0], n, i
    if not _is_canonical(grad, cnp.NPY_DOUBLE if job.ssize == 8 else cnp.NPY_FLOAT) or (
            not _is_canonical(rows, cnp.NPY_INT64)):
        return None
    cdef cnp.ndarray G = <cnp.ndarray>grad
    cdef cnp.ndarray R = <cnp.ndarray>rows
    n = cnp.PyArray_SIZE(R)
    if (
        cnp.PyArray_NDIM(R) != 1
        or cnp.PyArray_NDIM(G) != 2
        or cnp.PyArray_DIMS(G)[1] != job.d
        or cnp.PyArray_DIMS(G)[0] != (n if compact else L)
        or not _disjoint_from_target(G, table, state1, state2)
    ):
        return None
    cdef const int64_t* rp = <const int64_t*>cnp.PyArray_DATA(R)
    for i in range(n):
        if not 0 <= rp[i] < L:
            return None
    job.grad = cnp.PyArray_BYTES(G)
    job.rows = rp
    job.n = n
    job.compact = compact
    cdef int nt = _threads_for(num_threads, job.n * job.d, job.n)
    if not nt:
        return None
    cdef size_t capacity = 0
    cdef int64_t* buf = _take_slots(slots, job.n, &capacity)
    _give_slots(slots, &job, job.n, buf)
    cdef KernelCall c
    if job.n and job.d:
        _kernel_call(&c, K_OPT, NULL, NULL, NULL, job.n, job.n, job.d, nt)
        c.opt = &job
        _run_kernel(&c, cnp.PyArray_TYPE(<cnp.ndarray>table))
    _scratch_give(buf, capacity)
    return True


def fused_embed_step(token_step, position_step, grad_output, token_ids, positions, offset,
                     hyper, num_threads=None):
    """The layer's backward and an optimizer step on the rows it touches, in one
    pass (FusedStep), with no gradient table; True, or None if refused.
    token_step / position_step: (table, state1, state2, slots, skip_row) as
    optimizer_step's, one dtype, sharing no memory or slots; the rest as
    embed_backward's, grad_output disjoint from both steps' arrays.
    """
    cdef cpe_opt_hyper h
    cdef FusedStep fs
    if (
        not _read_hyper(hyper, &h)
        or type(token_step) is not tuple or len(<tuple>token_step) != 5
        or type(position_step) is not tuple or len(<tuple>position_step) != 5
        or not _opt_target(&fs.tok, &h, token_step[0], token_step[1], token_step[2],
                           token_step[3], token_step[4])
        or not _opt_target(&fs.pos, &h, position_step[0], position_step[1], position_step[2],
                           position_step[3], position_step[4])
        or _table_type(token_step[0]) != _table_type(position_step[0])
        or (token_step[3] is not None and token_step[3] is position_step[3])
        or fs.tok.d != fs.pos.d
        or not _is_canonical(grad_output, _source_type(grad_output))
    ):
        return None
    cdef cnp.ndarray g = <cnp.ndarray>grad_output
    cdef int i_arr
    for i_arr in (0, 1, 2):
        if token_step[i_arr] is not None and not _disjoint_from_target(
                <cnp.ndarray>token_step[i_arr], position_step[0], position_step[1],
                position_step[2]):
            return None
    if not _disjoint_from_target(g, token_step[0], token_step[1], token_step[2]) or (
            not _disjoint_from_target(g, position_step[0], position_step[1], position_step[2])):
        return None
    cdef Py_ssize_t V = cnp.PyArray_DIMS(<cnp.ndarray>token_step[0])[0]
    cdef Py_ssize_t L = cnp.PyArray_DIMS(<cnp.ndarray>position_step[0])[0]
    cdef Py_ssize_t d = fs.tok.d, m, i, N, k, n_multi
    cdef Py_ssize_t rb = d * fs.tok.ssize
    cdef int ktype = cnp.NPY_DOUBLE if fs.tok.ssize == 8 else cnp.NPY_FLOAT
    cdef Index ids, ix
    cdef Compact tok, pos
    cdef size_t nbytes, capacity = 0, lists_capacity = 0
    cdef KernelCall c
    cdef int nt
    cdef int64_t* lists = NULL
    cdef int64_t* tok_slots = NULL
    cdef int64_t* pos_slots = NULL
    cdef size_t tok_slots_capacity = 0, pos_slots_capacity = 0
    cdef uint8_t* single
    memset(&tok, 0, sizeof(Compact))
    memset(&pos, 0, sizeof(Compact))
    if not _ids_positions(token_ids, V, positions, offset, L, &ids, &ix, &m):
        return None
    try:
        N = ids.n
        nt = _id_rows_threads(g, &ids, d, num_threads)
        if not nt:
            return None
        if not (N and d and m):
            return True
        # The call's ids and positions become slots of compact scratch rows, in place.
        _compact(&tok, ids.rows, N, V, rb, True, "the fused step")
        _compact(&pos, ix.rows, m, L, rb, True, "the fused step")
        k = tok.k
        # Rows with one contribution are updated from the gradient row itself when
        # its dtype is the state's; the others, listed, from their scratch rows.
        lists = <int64_t*>_scratch_or_raise(k * (sizeof(int64_t) + 1), &lists_capacity,
                                            "the fused step's row lists")
        single = <uint8_t*>(lists + k)
        memset(single, 0, k)
        for i in range(N):
            if single[tok.slot[i]] < 2:
                single[tok.slot[i]] += 1
        n_multi = 0
        for i in range(k):
            single[i] = single[i] == 1 and cnp.PyArray_TYPE(g) == ktype
            if not single[i]:
                lists[n_multi] = i
                n_multi += 1
        fs.tok_first = tok.first
        fs.pos_first = pos.first
        fs.tok_single = single
        # Singles go with their position rows: nothing in the token split.
        fs.single_cost = -(1 + _ROW_COST)
        fs.tok.rows = tok.uniq
        fs.tok.grad = <const char*>tok.rows
        fs.tok.compact = True
        fs.tok.order = lists
        fs.tok.n = n_multi
        fs.pos.rows = pos.uniq
        fs.pos.grad = <const char*>pos.rows
        fs.pos.compact = True
        fs.pos.n = pos.k
        _kernel_call(&c, K_SCATTER_PAIR, tok.rows, cnp.PyArray_DATA(g), pos.slot, N, m, d, nt)
        c.out2 = pos.rows
        c.src_type = cnp.PyArray_TYPE(g)
        c.ids = tok.slot
        c.V = k
        c.L = pos.k
        c.fused = &fs
        nbytes = _pair_scratch_bytes(k, pos.k, N, nt)
        if nbytes:
            c.scratch = <int64_t*>_scratch_or_raise(nbytes, &capacity,
                                                    "the backward pass's scratch")
        # The state slots of every distinct row, last: nothing can fail after.
        try:
            tok_slots = _take_slots(token_step[3], k, &tok_slots_capacity)
            pos_slots = _take_slots(position_step[3], pos.k, &pos_slots_capacity)
        except MemoryError:
            _scratch_give(c.scratch, capacity)
            raise
        _give_slots(token_step[3], &fs.tok, k, tok_slots)
        _give_slots(position_step[3], &fs.pos, pos.k, pos_slots)
        _run_kernel(&c, ktype)
        _scratch_give(c.scratch, capacity)
        return True
    finally:
        _scratch_give(pos_slots, pos_slots_capacity)
        _scratch_give(tok_slots, tok_slots_capacity)
        _scratch_give(lists, lists_capacity)
        _compact_give(&pos)
        _compact_give(&tok)
        _index_free(&ix)
        _index_free(&ids)


# The scatter-add plans by name at module level too (tests force them).
for _plan in ScatterPlan:
    globals()[_plan.name] = _plan
del _plan


include "_contract.pxi"
