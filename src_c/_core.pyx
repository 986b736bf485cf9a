# cposembed._core: one checked C entry per operation.
#
# lookup, add, scatter_add, embed, embed_backward and sgd_step each take the
# caller's objects as they are, check them (dtypes, layout, shapes, overlap,
# position ranges, threads) with a few C comparisons, and either run the
# kernel or decline by returning None with nothing written. The Python layer
# (cposembed/functional.py and layer.py; the classes' sgd_step) normalises what
# was declined (other layouts and dtypes, lists, NumPy's other index forms) or
# raises the worded error, then calls the same entry again: there is no other
# way to a kernel.
#
# Accepted as they are: exact ndarrays, C-contiguous and aligned, in native
# byte order, float32/float64 tables; positions as read by _index.pxi;
# outputs that share no memory with what the call reads (except `out is
# tokens`, the in-place add, where each element reads only itself first).
# Positions are always copied into a buffer the call owns before anything is
# written, so an output may share memory with them.

cimport cython
cimport numpy as cnp
from libc.string cimport memset

include "_kernels.pxi"
include "_pool.pxi"
include "_index.pxi"
include "_team.pxi"
include "_zeros.pxi"

cnp.import_array()


cdef extern from "Python.h":
    ctypedef struct PyThreadState
    PyThreadState* PyEval_SaveThread() noexcept
    void PyEval_RestoreThread(PyThreadState* state) noexcept


cdef inline PyThreadState* _release_gil(Py_ssize_t work) noexcept:
    # Kernels run without the GIL, except small work: releasing and taking
    # it back costs about as much as a tiny call itself (other Python
    # threads wait those few microseconds at most). Pair with _take_gil.
    return PyEval_SaveThread() if work >= _SERIAL_BELOW else NULL


cdef inline void _take_gil(PyThreadState* state) noexcept:
    if state != NULL:
        PyEval_RestoreThread(state)


cdef bint _plain_as(object obj, int typenum) noexcept:
    """An exact ndarray of dtype `typenum`, native byte order, C-contiguous, aligned."""
    if not cnp.PyArray_CheckExact(obj):
        return False
    cdef cnp.ndarray a = <cnp.ndarray>obj
    return (
        cnp.PyArray_TYPE(a) == typenum
        and cnp.PyArray_ISNOTSWAPPED(a)
        and cnp.PyArray_IS_C_CONTIGUOUS(a)
        and cnp.PyArray_ISALIGNED(a)
    )


cdef int _table_type(object table) noexcept:
    """NPY_FLOAT or NPY_DOUBLE for a plain 2-D table; -1 for anything else."""
    if not cnp.PyArray_CheckExact(table):
        return -1
    cdef cnp.ndarray t = <cnp.ndarray>table
    cdef int typenum = cnp.PyArray_TYPE(t)
    if (
        cnp.PyArray_NDIM(t) != 2
        or not (typenum == cnp.NPY_FLOAT or typenum == cnp.NPY_DOUBLE)
        or not _plain_as(t, typenum)
    ):
        return -1
    return typenum


cdef bint _apart(cnp.ndarray a, cnp.ndarray b) noexcept:
    # The byte ranges of two C-contiguous arrays do not meet (an empty array
    # meets nothing, as for np.may_share_memory).
    cdef const char* a0 = cnp.PyArray_BYTES(a)
    cdef const char* b0 = cnp.PyArray_BYTES(b)
    cdef Py_ssize_t na = cnp.PyArray_NBYTES(a), nb = cnp.PyArray_NBYTES(b)
    return na == 0 or nb == 0 or a0 + na <= b0 or b0 + nb <= a0


cdef bint _writable_out(object out, int typenum, int nd, const cnp.npy_intp* dims,
                        cnp.ndarray table) noexcept:
    """`out` is plain, writable, of shape dims[:nd], and apart from the table."""
    if not _plain_as(out, typenum):
        return False
    cdef cnp.ndarray o = <cnp.ndarray>out
    cdef int k
    if not cnp.PyArray_ISWRITEABLE(o) or cnp.PyArray_NDIM(o) != nd:
        return False
    for k in range(nd):
        if cnp.PyArray_DIMS(o)[k] != dims[k]:
            return False
    return _apart(o, table)


cdef cnp.ndarray _new_output(int nd, cnp.npy_intp* dims, int typenum):
    """A fresh C-contiguous array; large ones from the reusable blocks."""
    cdef Py_ssize_t nbytes = 4 if typenum == cnp.NPY_FLOAT else 8
    cdef int k
    for k in range(nd):
        if dims[k] and nbytes > (<Py_ssize_t>1 << 62) // dims[k]:
            return cnp.PyArray_SimpleNew(nd, dims, typenum)  # NumPy words the error
        nbytes *= dims[k]
    if nbytes < _POOL_BYTES:
        return cnp.PyArray_SimpleNew(nd, dims, typenum)
    cdef _Block blk = _new_block(nbytes)
    cdef cnp.ndarray arr = cnp.PyArray_SimpleNewFromData(nd, dims, typenum, blk.ptr)
    cnp.set_array_base(arr, blk)  # the block returns to the pool with the array
    return arr


cdef bint _offset_value(object offset, Py_ssize_t lo, Py_ssize_t hi,
                        Py_ssize_t* value) noexcept:
    # An integer (_is_integer) with lo <= offset <= hi.
    cdef int overflow = 0
    cdef long long v
    if not _is_integer(offset):
        return False
    try:
        v = PyLong_AsLongLongAndOverflow(offset, &overflow)
    except Exception:
        return False
    if overflow or v < lo or v > hi:
        return False
    value[0] = <Py_ssize_t>v
    return True


cdef bint _positions_for(object positions, object offset, Py_ssize_t L,
                         const cnp.npy_intp* lead, int n_lead, Index* ix,
                         Py_ssize_t* m) noexcept:
    """Positions for rows laid out as lead[:n_lead]: row i takes
    ix.rows[i % m]. `positions=None`: offset + arange(T) over the last lead
    axis; else positions whose shape, without leading 1s, equals the
    trailing axes of the lead shape (anything else that broadcasts is
    materialised by the Python layer). False: declined, nothing held."""
    cdef Py_ssize_t T, start, zero
    cdef int k, core
    ix.rows = NULL
    if positions is None:
        if n_lead < 1:
            return False
        T = lead[n_lead - 1]
        if not _offset_value(offset, 0, L - T if T else (<Py_ssize_t>1 << 62), &start):
            return False
        m[0] = T
        return _arange_index(start, T, ix)
    if not _offset_value(offset, 0, 0, &zero):
        return False
    if not _read_index(positions, L, ix):
        return False
    k = 0
    while k < ix.nd and ix.shape[k] == 1:
        k += 1
    core = ix.nd - k
    if ix.nd > n_lead:  # more axes than the rows: NumPy's result would have them
        _index_free(ix)
        return False
    for k in range(core):
        if ix.shape[ix.nd - core + k] != lead[n_lead - core + k]:
            _index_free(ix)
            return False
    m[0] = ix.n
    return True


cdef bint _row_positions(object positions, object offset, cnp.ndarray rows_array,
                         Py_ssize_t L, Index* ix, Py_ssize_t* m) noexcept:
    """_positions_for the rows of `rows_array` (shape (..., d))."""
    return _positions_for(positions, offset, L, cnp.PyArray_DIMS(rows_array),
                          cnp.PyArray_NDIM(rows_array) - 1, ix, m)


def lookup(table, positions, out, num_threads):
    """``table[positions]`` into ``out`` (or a new array), returned; None if declined.

    table: a plain (L, d) float32/float64 table; positions: as _index.pxi
    reads them, every value in [-L, L); out: None, or a plain writable array
    of shape positions.shape + (d,) and the table's dtype, apart from the
    table; num_threads: None or an integer >= 1.
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
        _raise_if_out_of_memory()
        return None
    try:
        ix.shape[ix.nd] = d
        if out is None:
            o = _new_output(ix.nd + 1, ix.shape, typenum)
        elif _writable_out(out, typenum, ix.nd + 1, ix.shape, t):
            o = <cnp.ndarray>out
        else:
            return None
        nt = _threads_for(num_threads, ix.n * d, ix.n)
        if not nt:
            return None
        _run_lookup(t, &ix, o, typenum, nt)
        return o
    finally:
        _index_free(&ix)


cdef void _run_lookup(cnp.ndarray t, Index* ix, cnp.ndarray o, int typenum,
                      int n_threads) noexcept:
    cdef Py_ssize_t L = cnp.PyArray_DIMS(t)[0], d = cnp.PyArray_DIMS(t)[1], n = ix.n
    cdef int stream = cnp.PyArray_NBYTES(o) >= _STREAM_BYTES
    cdef const void* tp = cnp.PyArray_DATA(t)
    cdef void* op = cnp.PyArray_DATA(o)
    cdef const int64_t* rows = ix.rows
    if n == 0 or d == 0:
        return
    cdef PyThreadState* gil = _release_gil(n * d)
    if typenum == cnp.NPY_FLOAT:
        _lookup(<const float*>tp, rows, <float*>op, n, L, d, n_threads, stream)
    else:
        _lookup(<const double*>tp, rows, <double*>op, n, L, d, n_threads, stream)
    _take_gil(gil)


@cython.auto_pickle(False)  # the subclass pickles its checked state itself
cdef class TableCall:
    """Base of :class:`cposembed.LearnedPositionEmbedding`: its ``pe(positions)``.

    The call is the lookup entry itself on ``self._embeddings``, with no
    Python frame in between: a tiny call costs about what NumPy's
    ``table[i]`` does. What the entry declines goes to
    ``self._lookup_declined(positions, out)``, the normalising route of
    :func:`cposembed.lookup`. (No fields here: the subclass keeps its state
    in ``__slots__``, whose reads Python specialises.)
    """

    @cython.embedsignature(False)  # docs/api.rst gives it, without `self`
    def __call__(self, positions, *, out=None):
        """Look up position embeddings: ``embeddings[positions]``.

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
            result = self._lookup_declined(positions, out)
        return result


def add(tokens, table, positions, offset, out, num_threads):
    """``tokens + table[positions]`` into ``out`` (or a new array), returned;
    None if declined.

    tokens: a plain array of shape (..., d) with the table's dtype;
    positions: None (offset + arange(T), T = tokens.shape[-2], offset an
    integer with 0 <= offset <= L - T) or positions whose shape without
    leading 1s equals the trailing axes of tokens.shape[:-1] (offset 0);
    out: None, ``tokens`` (in place), or a plain writable array of tokens'
    shape and dtype, apart from tokens and the table.
    """
    cdef int typenum = _table_type(table)
    if typenum < 0 or not _plain_as(tokens, typenum):
        return None
    cdef cnp.ndarray t = <cnp.ndarray>table
    cdef cnp.ndarray k = <cnp.ndarray>tokens
    cdef Py_ssize_t L = cnp.PyArray_DIMS(t)[0], d = cnp.PyArray_DIMS(t)[1]
    cdef int nd = cnp.PyArray_NDIM(k)
    if nd < 1 or cnp.PyArray_DIMS(k)[nd - 1] != d:
        return None
    cdef Index ix
    cdef Py_ssize_t m, N, i
    cdef bint in_place = out is tokens
    cdef cnp.ndarray o
    cdef int nt
    if not _row_positions(positions, offset, k, L, &ix, &m):
        _raise_if_out_of_memory()
        return None
    try:
        if out is None:
            o = _new_output(nd, cnp.PyArray_DIMS(k), typenum)
        elif in_place or _writable_out(out, typenum, nd, cnp.PyArray_DIMS(k), t):
            o = <cnp.ndarray>out
            if in_place and (not cnp.PyArray_ISWRITEABLE(o) or not _apart(o, t)):
                return None
            if not in_place and not _apart(o, k):
                return None
        else:
            return None
        N = 1
        for i in range(nd - 1):
            N *= cnp.PyArray_DIMS(k)[i]
        nt = _threads_for(num_threads, N * d, N)
        if not nt:
            return None
        if N and d and m:
            _run_add(k, t, ix.rows, o, typenum, N, m, nt, in_place)
        return o
    finally:
        _index_free(&ix)


cdef void _run_add(cnp.ndarray k, cnp.ndarray t, const int64_t* rows, cnp.ndarray o,
                   int typenum, Py_ssize_t N, Py_ssize_t m, int n_threads,
                   bint in_place) noexcept:
    cdef Py_ssize_t d = cnp.PyArray_DIMS(t)[1]
    # In place the lines are read anyway: ordinary stores.
    cdef int stream = not in_place and cnp.PyArray_NBYTES(o) >= _STREAM_BYTES
    cdef const void* kp = cnp.PyArray_DATA(k)
    cdef const void* tp = cnp.PyArray_DATA(t)
    cdef void* op = cnp.PyArray_DATA(o)
    cdef PyThreadState* gil = _release_gil(N * d)
    if typenum == cnp.NPY_FLOAT:
        _add(<const float*>kp, <const float*>tp, rows, <float*>op, N, m, d, n_threads,
             stream, in_place)
    else:
        _add(<const double*>kp, <const double*>tp, rows, <double*>op, N, m, d,
             n_threads, stream, in_place)
    _take_gil(gil)


cdef bint _mask_ok(object mask, Py_ssize_t L) noexcept:
    # None, or a plain writable 1-D bool array of length L.
    if mask is None:
        return True
    if not _plain_as(mask, cnp.NPY_BOOL):
        return False
    cdef cnp.ndarray a = <cnp.ndarray>mask
    return (
        cnp.PyArray_NDIM(a) == 1
        and cnp.PyArray_DIMS(a)[0] == L
        and cnp.PyArray_ISWRITEABLE(a)
    )


def scatter_add(grad, grad_output, positions, offset, num_threads, touched=None,
                Py_ssize_t skip_row=-1, int plan=PLAN_AUTO):
    """``grad[positions[i]] += grad_output[i]`` in np.add.at's order, in place;
    returns grad, or None if declined.

    grad: a plain writable (L, d) table; grad_output: a plain array of shape
    (..., d) with grad's dtype, apart from grad; positions and offset as for
    add. touched: None or a plain writable bool array of length L, apart from
    grad, whose rows that received a contribution are set True. skip_row: a
    row in [0, L) that gets no gradient (zeroed after the sum, and unmarked:
    padding_idx, whose row is zero before every call), or -1. plan: a
    ScatterPlan (PLAN_AUTO: chosen per call; the others force one, for tests).
    """
    cdef int typenum = _table_type(grad)
    if typenum < 0 or not _plain_as(grad_output, typenum):
        return None
    cdef cnp.ndarray G = <cnp.ndarray>grad
    cdef cnp.ndarray g = <cnp.ndarray>grad_output
    cdef Py_ssize_t L = cnp.PyArray_DIMS(G)[0], d = cnp.PyArray_DIMS(G)[1]
    cdef int nd = cnp.PyArray_NDIM(g)
    if (
        nd < 1
        or cnp.PyArray_DIMS(g)[nd - 1] != d
        or not cnp.PyArray_ISWRITEABLE(G)
        or not _apart(g, G)
        or not _mask_ok(touched, L)
        or (touched is not None and not _apart(<cnp.ndarray>touched, G))
        or not -1 <= skip_row < L
        or not <int>PLAN_AUTO <= plan <= <int>PLAN_SORT
    ):
        return None
    cdef Index ix
    cdef Py_ssize_t m, N, T, i
    cdef bint ok = True
    cdef uint8_t* mark
    cdef int nt
    if not _row_positions(positions, offset, g, L, &ix, &m):
        _raise_if_out_of_memory()
        return None
    try:
        N = 1
        for i in range(nd - 1):
            N *= cnp.PyArray_DIMS(g)[i]
        # (B, T) positions that repeat every sequence (arange expanded,
        # typically) are one period of T: the distinct-rows plan takes them.
        if positions is not None and m == N and nd >= 3:
            T = cnp.PyArray_DIMS(g)[nd - 2]
            if 0 < T < N and _repeats(ix.rows, N, T):
                m = T
        nt = _threads_for(num_threads, N * d, min(L, m))
        if not nt:
            return None
        if N and d and m:
            ok = _run_scatter(G, g, ix.rows, typenum, N, m, nt, <ScatterPlan>plan)
            if not ok:
                raise MemoryError("cannot allocate the scatter-add's scratch")
        if touched is not None:
            mark = <uint8_t*>cnp.PyArray_DATA(<cnp.ndarray>touched)
            for i in range(m if N else 0):
                mark[ix.rows[i]] = 1
            if skip_row >= 0:
                mark[skip_row] = 0
        if skip_row >= 0 and d:
            if typenum == cnp.NPY_FLOAT:
                memset(<float*>cnp.PyArray_DATA(G) + skip_row * d, 0, d * sizeof(float))
            else:
                memset(<double*>cnp.PyArray_DATA(G) + skip_row * d, 0, d * sizeof(double))
        return grad
    finally:
        _index_free(&ix)


cdef bint _run_scatter(cnp.ndarray G, cnp.ndarray g, const int64_t* rows, int typenum,
                       Py_ssize_t N, Py_ssize_t m, int n_threads,
                       ScatterPlan plan) noexcept:
    cdef Py_ssize_t L = cnp.PyArray_DIMS(G)[0], d = cnp.PyArray_DIMS(G)[1]
    cdef void* gp = cnp.PyArray_DATA(G)
    cdef const void* sp = cnp.PyArray_DATA(g)
    cdef size_t capacity
    cdef int64_t* scratch = <int64_t*>_scratch_take(_scatter_scratch_bytes(L, m, n_threads),
                                                    &capacity)
    if scratch == NULL:
        return False
    cdef PyThreadState* gil = _release_gil(N * d)
    if typenum == cnp.NPY_FLOAT:
        _scatter_add(<float*>gp, <const float*>sp, rows, L, d, m, N // m, n_threads, plan,
                     scratch)
    else:
        _scatter_add(<double*>gp, <const double*>sp, rows, L, d, m, N // m, n_threads, plan,
                     scratch)
    _take_gil(gil)
    _scratch_give(scratch, capacity)
    return True


def sgd_step(table, grad, touched, double lr, Py_ssize_t skip_row, num_threads=None):
    """``table[r] -= lr * grad[r]`` (lr rounded once to the table's dtype) on
    the rows r that ``touched`` marks (every row if None), except skip_row;
    True, or None if declined.

    table: a plain writable (L, d) table; grad: a plain array of the same
    shape and dtype, apart from it; touched: None or a plain bool array of
    length L; skip_row: a row in [0, L), or -1.
    """
    cdef int typenum = _table_type(table)
    if typenum < 0 or not _plain_as(grad, typenum):
        return None
    cdef cnp.ndarray t = <cnp.ndarray>table
    cdef cnp.ndarray G = <cnp.ndarray>grad
    cdef Py_ssize_t L = cnp.PyArray_DIMS(t)[0], d = cnp.PyArray_DIMS(t)[1]
    if (
        cnp.PyArray_NDIM(G) != 2
        or cnp.PyArray_DIMS(G)[0] != L
        or cnp.PyArray_DIMS(G)[1] != d
        or not cnp.PyArray_ISWRITEABLE(t)
        or not _apart(t, G)
        or (touched is not None and not _plain_as(touched, cnp.NPY_BOOL))
        or (touched is not None and (cnp.PyArray_NDIM(<cnp.ndarray>touched) != 1
                                     or cnp.PyArray_DIMS(<cnp.ndarray>touched)[0] != L))
        or not -1 <= skip_row < L
    ):
        return None
    cdef const uint8_t* mark = NULL
    if touched is not None:
        mark = <const uint8_t*>cnp.PyArray_DATA(<cnp.ndarray>touched)
    cdef size_t capacity
    cdef int64_t* rows = <int64_t*>_scratch_take((L if L > 0 else 1) * sizeof(int64_t),
                                                 &capacity)
    if rows == NULL:
        raise MemoryError("cannot allocate the SGD step's row list")
    cdef Py_ssize_t n = _marked_rows(mark, L, skip_row, rows)
    cdef int nt = _threads_for(num_threads, n * d, n)
    if not nt:
        _scratch_give(rows, capacity)
        return None
    cdef void* tp = cnp.PyArray_DATA(t)
    cdef const void* gp = cnp.PyArray_DATA(G)
    cdef PyThreadState* gil = _release_gil(n * d)
    if typenum == cnp.NPY_FLOAT:
        _sgd_rows(<float*>tp, <const float*>gp, rows, n, d, <float>lr, nt)
    else:
        _sgd_rows(<double*>tp, <const double*>gp, rows, n, d, lr, nt)
    _take_gil(gil)
    _scratch_give(rows, capacity)
    return True


cdef int _pair_type(object token_table, object position_table) noexcept:
    """The tables' dtype when both are plain with the same dtype and embed_dim; -1 else."""
    cdef int typenum = _table_type(token_table)
    if typenum < 0 or _table_type(position_table) != typenum:
        return -1
    if cnp.PyArray_DIMS(<cnp.ndarray>token_table)[1] != cnp.PyArray_DIMS(
            <cnp.ndarray>position_table)[1]:
        return -1
    return typenum


cdef bint _ids_positions(object token_ids, Py_ssize_t V, object positions, object offset,
                         Py_ssize_t L, Index* ids, Index* ix, Py_ssize_t* m) noexcept:
    """Token ids (checked against V) and _positions_for them (laid out as the
    ids). False: declined, nothing held."""
    ix.rows = NULL
    if not _read_index(token_ids, V, ids):
        return False
    if not _positions_for(positions, offset, L, ids.shape, ids.nd, ix, m):
        _index_free(ids)
        return False
    return True


def embed(token_ids, token_table, position_table, positions, offset, out, num_threads):
    """``token_table[token_ids] + position_table[positions]`` into ``out`` (or a
    new array), returned; None if declined.

    token_table (V, d) and position_table (L, d): plain, one dtype; token_ids
    as _index.pxi reads them, in [-V, V); positions: None (offset + arange(T)
    over the last axis of the ids, 0 <= offset <= L - T) or positions whose
    shape without leading 1s equals the trailing axes of the ids' shape
    (offset 0); out: None or a plain writable array of shape
    token_ids.shape + (d,), apart from both tables.
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
    cdef int nt
    if not _ids_positions(token_ids, V, positions, offset, L, &ids, &ix, &m):
        _raise_if_out_of_memory()
        return None
    try:
        ids.shape[ids.nd] = d
        if out is None:
            o = _new_output(ids.nd + 1, ids.shape, typenum)
        elif _writable_out(out, typenum, ids.nd + 1, ids.shape, tt) and _apart(
                <cnp.ndarray>out, pt):
            o = <cnp.ndarray>out
        else:
            return None
        nt = _threads_for(num_threads, ids.n * d, ids.n)
        if not nt:
            return None
        if ids.n and d and m:
            _run_embed(tt, &ids, pt, &ix, m, o, typenum, nt)
        return o
    finally:
        _index_free(&ix)
        _index_free(&ids)


cdef void _run_embed(cnp.ndarray tt, Index* ids, cnp.ndarray pt, Index* ix, Py_ssize_t m,
                     cnp.ndarray o, int typenum, int n_threads) noexcept:
    cdef Py_ssize_t V = cnp.PyArray_DIMS(tt)[0], d = cnp.PyArray_DIMS(tt)[1], N = ids.n
    cdef int stream = cnp.PyArray_NBYTES(o) >= _STREAM_BYTES
    cdef const void* tp = cnp.PyArray_DATA(tt)
    cdef const void* pp = cnp.PyArray_DATA(pt)
    cdef void* op = cnp.PyArray_DATA(o)
    cdef PyThreadState* gil = _release_gil(N * d)
    if typenum == cnp.NPY_FLOAT:
        _embed(<const float*>tp, ids.rows, V, <const float*>pp, ix.rows, <float*>op, N, m,
               d, n_threads, stream)
    else:
        _embed(<const double*>tp, ids.rows, V, <const double*>pp, ix.rows, <double*>op, N,
               m, d, n_threads, stream)
    _take_gil(gil)


def embed_backward(grad_token_table, grad_position_table, grad_output, token_ids, positions,
                   offset, num_threads, token_touched=None, position_touched=None,
                   Py_ssize_t token_skip_row=-1):
    """Both gradients of embed from one pass over grad_output, in place:
    ``grad_token_table[token_ids[i]] += grad_output[i]`` and the same for the
    positions, each bitwise np.add.at; returns True, or None if declined.

    The two tables: plain, writable, one dtype and embed_dim, apart from each
    other (either table alone goes through scatter_add); grad_output: a plain
    array of shape token_ids.shape + (d,) with their dtype, apart from both;
    token_ids and positions as for embed. token_touched / position_touched:
    None or plain writable bool arrays of length V / L whose rows that
    received a contribution are set True; token_skip_row: a token row that
    gets no gradient (padding_idx, zeroed after the sum), or -1.
    """
    cdef int typenum = _pair_type(grad_token_table, grad_position_table)
    if typenum < 0 or not _plain_as(grad_output, typenum):
        return None
    cdef cnp.ndarray gt = <cnp.ndarray>grad_token_table
    cdef cnp.ndarray gp = <cnp.ndarray>grad_position_table
    cdef cnp.ndarray g = <cnp.ndarray>grad_output
    cdef Py_ssize_t V = cnp.PyArray_DIMS(gt)[0], L = cnp.PyArray_DIMS(gp)[0]
    cdef Py_ssize_t d = cnp.PyArray_DIMS(gt)[1], m, i
    cdef int nd = cnp.PyArray_NDIM(g)
    if (
        not cnp.PyArray_ISWRITEABLE(gt)
        or not cnp.PyArray_ISWRITEABLE(gp)
        or not _apart(gt, gp)
        or not _apart(g, gt)
        or not _apart(g, gp)
        or not _mask_ok(token_touched, V)
        or not _mask_ok(position_touched, L)
        or (token_touched is not None and not _apart(<cnp.ndarray>token_touched, gt))
        or (position_touched is not None and not _apart(<cnp.ndarray>position_touched, gp))
        or not -1 <= token_skip_row < V
    ):
        return None
    cdef Index ids, ix
    cdef bint ok = True
    cdef int nt
    cdef uint8_t* mark
    if not _ids_positions(token_ids, V, positions, offset, L, &ids, &ix, &m):
        _raise_if_out_of_memory()
        return None
    try:
        if nd != ids.nd + 1 or cnp.PyArray_DIMS(g)[nd - 1] != d:
            return None
        for i in range(ids.nd):
            if cnp.PyArray_DIMS(g)[i] != ids.shape[i]:
                return None
        nt = _threads_for(num_threads, ids.n * d, ids.n)
        if not nt:
            return None
        if ids.n and d and m:
            ok = _run_scatter_pair(gt, &ids, gp, &ix, m, g, typenum, nt)
            if not ok:
                raise MemoryError("cannot allocate the backward pass's scratch")
        if token_touched is not None:
            mark = <uint8_t*>cnp.PyArray_DATA(<cnp.ndarray>token_touched)
            for i in range(ids.n):
                mark[ids.rows[i]] = 1
            if token_skip_row >= 0:
                mark[token_skip_row] = 0
        if position_touched is not None:
            mark = <uint8_t*>cnp.PyArray_DATA(<cnp.ndarray>position_touched)
            for i in range(m if ids.n else 0):
                mark[ix.rows[i]] = 1
        if token_skip_row >= 0 and d:
            memset(cnp.PyArray_BYTES(gt) + token_skip_row * d * cnp.PyArray_ITEMSIZE(gt), 0,
                   d * cnp.PyArray_ITEMSIZE(gt))
        return True
    finally:
        _index_free(&ix)
        _index_free(&ids)


cdef bint _run_scatter_pair(cnp.ndarray gt, Index* ids, cnp.ndarray gp, Index* ix,
                            Py_ssize_t m, cnp.ndarray g, int typenum,
                            int n_threads) noexcept:
    cdef Py_ssize_t V = cnp.PyArray_DIMS(gt)[0], L = cnp.PyArray_DIMS(gp)[0]
    cdef Py_ssize_t d = cnp.PyArray_DIMS(gt)[1], N = ids.n
    cdef void* tp = cnp.PyArray_DATA(gt)
    cdef void* pp = cnp.PyArray_DATA(gp)
    cdef const void* sp = cnp.PyArray_DATA(g)
    cdef size_t nbytes = _pair_scratch_bytes(V, L, N, n_threads), capacity = 0
    cdef int64_t* scratch = NULL
    if nbytes:
        scratch = <int64_t*>_scratch_take(nbytes, &capacity)
        if scratch == NULL:
            return False
    cdef PyThreadState* gil = _release_gil(N * d)
    if typenum == cnp.NPY_FLOAT:
        _scatter_pair(<float*>tp, V, ids.rows, <float*>pp, L, ix.rows, m,
                      <const float*>sp, N, d, n_threads, scratch)
    else:
        _scatter_pair(<double*>tp, V, ids.rows, <double*>pp, L, ix.rows, m,
                      <const double*>sp, N, d, n_threads, scratch)
    _take_gil(gil)
    _scratch_give(scratch, capacity)
    return True

# The scatter-add plans by name at module level too (tests force them).
for _plan in ScatterPlan:
    globals()[_plan.name] = _plan
del _plan


include "_contract.pxi"
