# Calls served in C, on NumPy's C API: tiny ones (`pe(5)`, `pe([0])`,
# `pe(small array)`, the one-token decode step `pe.add_to(tok, offset=i)`)
# and, at the end of this file, the plain case of large `lookup(out=)`,
# `add_positions(out=)` and `scatter_add` calls, straight into the kernels.
#
# For such calls the copy itself takes tens of nanoseconds, so what counts is
# the fixed cost around it: Python-level type checks, `np.asarray(list)`,
# NumPy's generic indexing and copy machinery, typed-memoryview acquisition.
# Here the checks are a few C comparisons, the output comes straight from
# PyArray_SimpleNew and rows are copied with memcpy.
#
# Unlike the kernels in _kernels.pyx these functions do not trust their
# inputs, but they do not validate them either: anything that is not a plain,
# valid, small case (bools, other types, non-native byte order, an index out
# of range, ...) returns None, and the caller takes the full path, which
# raises the package's own error messages. Nothing is written before None is
# returned except a fresh output array, which is then dropped. No Python code
# runs while a list is walked (items must be exact ints and lists), so the
# borrowed references stay valid.

cimport numpy as cnp
from libc.stdint cimport int8_t, int16_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

# The kernels (and real_t, index_t), shared with _kernels.pyx: the large-call
# entries at the end run them directly.
include "_kernels_impl.pxi"

cnp.import_array()

cdef extern from "Python.h":
    ctypedef struct PyObject
    bint PyLong_CheckExact(PyObject* o)
    bint PyList_CheckExact(PyObject* o)
    Py_ssize_t PyList_GET_SIZE(PyObject* o)
    PyObject* PyList_GET_ITEM(PyObject* o, Py_ssize_t i)
    # Never raises for an exact int: out of range sets *overflow instead.
    long long PyLong_AsLongLongAndOverflow(PyObject* o, int* overflow)

# Largest tiny calls (outputs of this many elements): beyond them the
# multithreaded kernels of the full path pay for their fixed costs.
SMALL_TAKE_ELEMENTS = 1 << 15
SMALL_ADD_ELEMENTS = 1 << 14
cdef Py_ssize_t _TAKE_LIMIT = SMALL_TAKE_ELEMENTS
cdef Py_ssize_t _ADD_LIMIT = SMALL_ADD_ELEMENTS
# Output dimensions: NumPy 1.x allows 32 (2.x: 64); positions get one less.
cdef enum:
    _MAX_POS_DIMS = 31

cdef bint _plain_as(cnp.ndarray a, int typenum) noexcept:
    """Of dtype `typenum` in native byte order, C-contiguous and aligned."""
    return (
        cnp.PyArray_TYPE(a) == typenum
        and cnp.PyArray_ISNOTSWAPPED(a)
        and cnp.PyArray_IS_C_CONTIGUOUS(a)
        and cnp.PyArray_ISALIGNED(a)
    )


cdef bint _plain_table(object table) noexcept:
    """An exact ndarray: C-contiguous, aligned, native float32/float64, 2-D."""
    if not cnp.PyArray_CheckExact(table):
        return False
    cdef cnp.ndarray t = <cnp.ndarray>table
    cdef int typenum = cnp.PyArray_TYPE(t)
    return (
        cnp.PyArray_NDIM(t) == 2
        and (typenum == cnp.NPY_FLOAT or typenum == cnp.NPY_DOUBLE)
        and _plain_as(t, typenum)
    )


cdef inline bint _wrap_index(long long p, Py_ssize_t n_rows, Py_ssize_t* row) noexcept nogil:
    """row = p, or p + n_rows for -n_rows <= p < 0; False when out of range."""
    if p < 0:
        p += n_rows
        if p < 0:
            return False
    elif p >= n_rows:
        return False
    row[0] = <Py_ssize_t>p
    return True


cdef inline bint _read_row(const char* p, int code, Py_ssize_t n_rows,
                           Py_ssize_t* row) noexcept nogil:
    """The index at p (code: see _index_code), wrapped; False when out of range.

    memcpy, not a typed load: the array need not be aligned.
    """
    cdef int8_t i8
    cdef int16_t i16
    cdef int32_t i32
    cdef int64_t i64
    cdef uint8_t u8
    cdef uint16_t u16
    cdef uint32_t u32
    cdef uint64_t u64
    if code == 0:
        memcpy(&i8, p, 1)
        return _wrap_index(i8, n_rows, row)
    elif code == 1:
        memcpy(&i16, p, 2)
        return _wrap_index(i16, n_rows, row)
    elif code == 2:
        memcpy(&i32, p, 4)
        return _wrap_index(i32, n_rows, row)
    elif code == 3:
        memcpy(&i64, p, 8)
        return _wrap_index(i64, n_rows, row)
    elif code == 4:
        memcpy(&u8, p, 1)
        return _wrap_index(u8, n_rows, row)
    elif code == 5:
        memcpy(&u16, p, 2)
        return _wrap_index(u16, n_rows, row)
    elif code == 6:
        memcpy(&u32, p, 4)
        return _wrap_index(u32, n_rows, row)
    else:
        memcpy(&u64, p, 8)
        if u64 >= <uint64_t>n_rows:  # also values beyond int64's range
            return False
        row[0] = <Py_ssize_t>u64
        return True


cdef int _index_code(cnp.ndarray a) noexcept:
    """0-3: int8..int64, 4-7: uint8..uint64 (native order); -1: anything else."""
    if not cnp.PyTypeNum_ISINTEGER(cnp.PyArray_TYPE(a)) or not cnp.PyArray_ISNOTSWAPPED(a):
        return -1
    cdef int base = 0 if cnp.PyTypeNum_ISSIGNED(cnp.PyArray_TYPE(a)) else 4
    cdef Py_ssize_t size = cnp.PyArray_ITEMSIZE(a)
    if size == 1:
        return base
    if size == 2:
        return base + 1
    if size == 4:
        return base + 2
    if size == 8:
        return base + 3
    return -1


cdef inline bint _small(Py_ssize_t n, Py_ssize_t d, Py_ssize_t limit) noexcept:
    return n <= limit and (d == 0 or n <= limit // d)


cdef object _take_array(cnp.ndarray table, cnp.ndarray pos):
    cdef int code = _index_code(pos)
    cdef int nd = cnp.PyArray_NDIM(pos)
    cdef Py_ssize_t n = cnp.PyArray_SIZE(pos)
    cdef Py_ssize_t n_rows = cnp.PyArray_DIMS(table)[0]
    cdef Py_ssize_t d = cnp.PyArray_DIMS(table)[1]
    if code < 0 or nd > _MAX_POS_DIMS or not _small(n, d, _TAKE_LIMIT):
        return None
    cdef cnp.npy_intp dims[_MAX_POS_DIMS + 1]
    cdef cnp.npy_intp* shape = cnp.PyArray_DIMS(pos)
    cdef cnp.npy_intp* strides = cnp.PyArray_STRIDES(pos)
    cdef int k
    for k in range(nd):
        dims[k] = shape[k]
    dims[nd] = d
    out = cnp.PyArray_SimpleNew(nd + 1, dims, cnp.PyArray_TYPE(table))
    if n == 0:
        return out

    cdef Py_ssize_t row_bytes = d * cnp.PyArray_ITEMSIZE(table)
    cdef const char* src = cnp.PyArray_BYTES(table)
    cdef char* dst = cnp.PyArray_BYTES(<cnp.ndarray>out)
    cdef const char* p = cnp.PyArray_BYTES(pos)
    cdef Py_ssize_t i, row, inner, step
    cdef Py_ssize_t counter[_MAX_POS_DIMS]
    if nd == 0 or cnp.PyArray_IS_C_CONTIGUOUS(pos):
        # One flat run (a 0-d array holds one index).
        for i in range(n):
            if not _read_row(p + i * cnp.PyArray_ITEMSIZE(pos), code, n_rows, &row):
                return None
            memcpy(dst + i * row_bytes, src + row * row_bytes, row_bytes)
        return out
    # Any strides: C order, an odometer over the outer axes.
    inner = shape[nd - 1]
    step = strides[nd - 1]
    for k in range(nd):
        counter[k] = 0
    i = 0
    while i < n:
        for k in range(inner):
            if not _read_row(p + k * step, code, n_rows, &row):
                return None
            memcpy(dst, src + row * row_bytes, row_bytes)
            dst += row_bytes
        i += inner
        k = nd - 2
        while k >= 0:
            counter[k] += 1
            p += strides[k]
            if counter[k] < shape[k]:
                break
            p -= counter[k] * strides[k]
            counter[k] = 0
            k -= 1
    return out


cdef bint _fill_from_list(PyObject* lst, int depth, int nd, const cnp.npy_intp* dims,
                          const char* src, Py_ssize_t n_rows, Py_ssize_t row_bytes,
                          char** dst) noexcept:
    """Copy the rows a (nested) list of exact ints names; False if it is not one."""
    cdef Py_ssize_t i, row
    cdef PyObject* item
    cdef long long value
    cdef int overflow = 0
    for i in range(dims[depth]):
        item = PyList_GET_ITEM(lst, i)
        if depth + 1 < nd:
            if not PyList_CheckExact(item) or PyList_GET_SIZE(item) != dims[depth + 1]:
                return False
            if not _fill_from_list(item, depth + 1, nd, dims, src, n_rows, row_bytes, dst):
                return False
        else:
            if not PyLong_CheckExact(item):  # bools are masks, not ints
                return False
            value = PyLong_AsLongLongAndOverflow(item, &overflow)
            if overflow or not _wrap_index(value, n_rows, &row):
                return False
            memcpy(dst[0], src + row * row_bytes, row_bytes)
            dst[0] += row_bytes
    return True


cdef object _take_list(cnp.ndarray table, list positions):
    cdef PyObject* obj = <PyObject*>positions
    cdef cnp.npy_intp dims[_MAX_POS_DIMS + 1]
    cdef int nd = 0
    cdef Py_ssize_t n = 1
    cdef Py_ssize_t n_rows = cnp.PyArray_DIMS(table)[0]
    cdef Py_ssize_t d = cnp.PyArray_DIMS(table)[1]
    # The shape, from the first item at each depth; _fill_from_list checks
    # that every other item agrees.
    while PyList_CheckExact(obj):
        if nd == _MAX_POS_DIMS:
            return None
        dims[nd] = PyList_GET_SIZE(obj)
        nd += 1
        n = n * dims[nd - 1] if _small(n, dims[nd - 1], _TAKE_LIMIT) else _TAKE_LIMIT + 1
        if dims[nd - 1] == 0:
            break
        obj = PyList_GET_ITEM(obj, 0)
    if not _small(n, d, _TAKE_LIMIT):
        return None
    dims[nd] = d
    out = cnp.PyArray_SimpleNew(nd + 1, dims, cnp.PyArray_TYPE(table))
    cdef char* dst = cnp.PyArray_BYTES(<cnp.ndarray>out)
    if not _fill_from_list(<PyObject*>positions, 0, nd, dims, cnp.PyArray_BYTES(table),
                           n_rows, d * cnp.PyArray_ITEMSIZE(table), &dst):
        return None
    return out


def take_small(table, positions):
    """``table[positions]`` as a new array for a small plain integer index, else None.

    ``table``: an exact ndarray, C-contiguous, aligned, native float32 or
    float64, 2-D (else None).
    ``positions``: a Python int (not bool), a list (or equal-length nested
    lists) of Python ints, or an ndarray of any native-order integer dtype,
    every value in ``[-L, L)``, with at most ``SMALL_TAKE_ELEMENTS`` output
    elements. Anything else, or a position out of range, returns None: the
    caller's full path handles it (and words the error). Never raises for
    bad input.
    """
    if not _plain_table(table):
        return None
    cdef cnp.ndarray t = <cnp.ndarray>table
    cdef PyObject* obj = <PyObject*>positions
    cdef long long value
    cdef int overflow = 0
    cdef Py_ssize_t row
    cdef cnp.npy_intp d
    if PyLong_CheckExact(obj):
        value = PyLong_AsLongLongAndOverflow(obj, &overflow)
        if overflow or not _wrap_index(value, cnp.PyArray_DIMS(t)[0], &row):
            return None
        d = cnp.PyArray_DIMS(t)[1]
        out = cnp.PyArray_SimpleNew(1, &d, cnp.PyArray_TYPE(t))
        memcpy(cnp.PyArray_DATA(<cnp.ndarray>out),
               cnp.PyArray_BYTES(t) + row * d * cnp.PyArray_ITEMSIZE(t),
               d * cnp.PyArray_ITEMSIZE(t))
        return out
    if cnp.PyArray_CheckExact(positions):
        return _take_array(t, <cnp.ndarray>positions)
    if PyList_CheckExact(obj):
        return _take_list(t, <list>positions)
    return None


cdef void _add_rows(const real_t* tok, const real_t* rows, real_t* out,
                    Py_ssize_t n_seq, Py_ssize_t block) noexcept nogil:
    # Same dtype, one IEEE add per element, tok first: NumPy's `tok + rows`.
    cdef Py_ssize_t _b, j
    for _b in range(n_seq):
        for j in range(block):
            out[j] = tok[j] + rows[j]
        tok += block
        out += block


def add_row_small(tok, table, offset):
    """``tok + table[offset:offset + T]`` as a new array for a small decode step, else None.

    ``tok``: an exact ndarray of shape ``(..., T, d)`` with the table's dtype,
    C-contiguous and aligned, at most ``SMALL_ADD_ELEMENTS`` elements;
    ``offset``: a Python int (not bool) with ``0 <= offset`` and
    ``offset + T <= L``. Anything else returns None (the caller's full path
    handles it, e.g. mixed dtypes, which NumPy promotes). Never raises for
    bad input.
    """
    if not _plain_table(table) or not cnp.PyArray_CheckExact(tok):
        return None
    cdef cnp.ndarray t = <cnp.ndarray>table
    cdef cnp.ndarray a = <cnp.ndarray>tok
    cdef int nd = cnp.PyArray_NDIM(a)
    cdef int typenum = cnp.PyArray_TYPE(t)
    if (
        nd < 2
        or not _plain_as(a, typenum)
        or cnp.PyArray_SIZE(a) > _ADD_LIMIT
    ):
        return None
    cdef cnp.npy_intp* shape = cnp.PyArray_DIMS(a)
    cdef Py_ssize_t n_rows = cnp.PyArray_DIMS(t)[0]
    cdef Py_ssize_t d = cnp.PyArray_DIMS(t)[1]
    cdef Py_ssize_t n_tok = shape[nd - 2]
    cdef PyObject* obj = <PyObject*>offset
    cdef int overflow = 0
    if shape[nd - 1] != d or not PyLong_CheckExact(obj):
        return None
    cdef long long start = PyLong_AsLongLongAndOverflow(obj, &overflow)
    if overflow or start < 0 or start > n_rows - n_tok:
        return None
    out = cnp.PyArray_SimpleNew(nd, shape, typenum)
    cdef Py_ssize_t block = n_tok * d
    cdef Py_ssize_t n_seq = cnp.PyArray_SIZE(a) // block if block else 0
    if typenum == cnp.NPY_FLOAT:
        _add_rows(<const float*>cnp.PyArray_DATA(a),
                  <const float*>cnp.PyArray_DATA(t) + start * d,
                  <float*>cnp.PyArray_DATA(<cnp.ndarray>out), n_seq, block)
    else:
        _add_rows(<const double*>cnp.PyArray_DATA(a),
                  <const double*>cnp.PyArray_DATA(t) + start * d,
                  <double*>cnp.PyArray_DATA(<cnp.ndarray>out), n_seq, block)
    return out


# ---- large calls: the plain case straight into the kernels -------------------
#
# For a call of many megabytes the kernel dominates, but the Python layer
# around it (some 40 calls: conversions, checks, thread rules, typed-memoryview
# acquisition, fused-type dispatch) costs 0.2-0.3 ms when, as after any large
# call, the interpreter's code and data have been pushed out of the caches:
# 3-5% of a lookup or add of a GPT-2-size batch (measured). These entries
# check the plain, common case with a few C comparisons and run the kernel;
# anything else returns 0 with nothing written, and the caller takes the
# full path (which words the errors); else they return the number of threads
# the kernel ran on. `n_threads` is the caller's thread count
# before the size rules (_threads.requested_threads), `serial_below` is
# _threads.SERIAL_THRESHOLD and `stream_bytes` functional.STREAM_THRESHOLD_BYTES,
# so both paths make the same choices.

cdef int _plain_index(object positions) noexcept:
    """8 or 4: an exact, non-empty ndarray of native int64/int32, C-contiguous
    and aligned, at least 1-D; 0: anything else."""
    if not cnp.PyArray_CheckExact(positions):
        return 0
    cdef cnp.ndarray p = <cnp.ndarray>positions
    if (
        cnp.PyArray_NDIM(p) < 1
        or cnp.PyArray_SIZE(p) == 0
        or not cnp.PyArray_IS_C_CONTIGUOUS(p)
        or not cnp.PyArray_ISALIGNED(p)
    ):
        return 0
    cdef int code = _index_code(p)
    return 8 if code == 3 else (4 if code == 2 else 0)


cdef bint _apart(cnp.ndarray a, cnp.ndarray b) noexcept:
    # The byte ranges of two C-contiguous arrays do not meet.
    cdef const char* a0 = cnp.PyArray_BYTES(a)
    cdef const char* b0 = cnp.PyArray_BYTES(b)
    return a0 + cnp.PyArray_NBYTES(a) <= b0 or b0 + cnp.PyArray_NBYTES(b) <= a0


cdef bint _exact_int(object value, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t* out) noexcept:
    # A Python int (not bool) with lo <= value <= hi.
    cdef int overflow = 0
    cdef long long v
    if not PyLong_CheckExact(<PyObject*>value):
        return False
    v = PyLong_AsLongLongAndOverflow(<PyObject*>value, &overflow)
    if overflow or v < lo or v > hi:
        return False
    out[0] = <Py_ssize_t>v
    return True


cdef int _team(int n_threads, Py_ssize_t work, Py_ssize_t chunks,
               Py_ssize_t serial_below) noexcept:
    # _threads.effective_num_threads' rules for the size of the call.
    if n_threads <= 1 or work < serial_below:
        return 1
    if chunks < n_threads:
        return <int>chunks if chunks > 1 else 1
    return n_threads


cdef bint _in_range(const index_t* p, Py_ssize_t n, Py_ssize_t n_rows) noexcept nogil:
    cdef int64_t lo, hi
    _min_max(p, n, &lo, &hi)
    return lo >= -n_rows and hi < n_rows


cdef int64_t* _arange(Py_ssize_t start, Py_ssize_t n) noexcept nogil:
    cdef int64_t* a = <int64_t*>malloc(max(n, 1) * sizeof(int64_t))
    cdef Py_ssize_t i
    if a != NULL:
        for i in range(n):
            a[i] = start + i
    return a


cdef bint _same_shape(cnp.ndarray a, cnp.ndarray b, int nd) noexcept:
    # The first nd dimensions of a and b agree.
    cdef int k
    for k in range(nd):
        if cnp.PyArray_DIMS(a)[k] != cnp.PyArray_DIMS(b)[k]:
            return False
    return True


def lookup_into(table, positions, out, int n_threads, Py_ssize_t serial_below,
                Py_ssize_t stream_bytes):
    """``out[...] = table[positions]`` for the plain case, returning the
    threads it ran on; 0 (nothing written) for anything else.

    ``table`` as for take_small; ``positions`` an exact, non-empty ndarray of
    native int32/int64, C-contiguous and aligned, every value in ``[-L, L)``;
    ``out`` an exact, writable ndarray of shape ``positions.shape + (d,)``
    and the table's dtype, C-contiguous, aligned, sharing no memory with the
    table or the positions.
    """
    cdef int isz = _plain_index(positions)
    if not isz or not _plain_table(table) or not cnp.PyArray_CheckExact(out):
        return 0
    cdef cnp.ndarray t = <cnp.ndarray>table
    cdef cnp.ndarray p = <cnp.ndarray>positions
    cdef cnp.ndarray o = <cnp.ndarray>out
    cdef int typenum = cnp.PyArray_TYPE(t)
    cdef int nd = cnp.PyArray_NDIM(p)
    cdef Py_ssize_t L = cnp.PyArray_DIMS(t)[0]
    cdef Py_ssize_t d = cnp.PyArray_DIMS(t)[1]
    cdef Py_ssize_t n = cnp.PyArray_SIZE(p)
    if (
        d == 0
        or not _plain_as(o, typenum)
        or not cnp.PyArray_ISWRITEABLE(o)
        or cnp.PyArray_NDIM(o) != nd + 1
        or not _same_shape(o, p, nd)
        or cnp.PyArray_DIMS(o)[nd] != d
        or not _apart(o, t)
        or not _apart(o, p)
    ):
        return 0
    cdef int nt = _team(n_threads, n * d, n, serial_below)
    cdef int stream = cnp.PyArray_NBYTES(o) >= stream_bytes
    cdef const void* tp = cnp.PyArray_DATA(t)
    cdef const void* pp = cnp.PyArray_DATA(p)
    cdef void* op = cnp.PyArray_DATA(o)
    cdef bint ok
    with nogil:
        if isz == 8:
            ok = _in_range(<const int64_t*>pp, n, L)
        else:
            ok = _in_range(<const int32_t*>pp, n, L)
        if ok:
            if typenum == cnp.NPY_FLOAT:
                if isz == 8:
                    _lookup(<const float*>tp, <const int64_t*>pp, <float*>op, n, L, d, nt,
                            stream, 1)
                else:
                    _lookup(<const float*>tp, <const int32_t*>pp, <float*>op, n, L, d, nt,
                            stream, 1)
            else:
                if isz == 8:
                    _lookup(<const double*>tp, <const int64_t*>pp, <double*>op, n, L, d, nt,
                            stream, 1)
                else:
                    _lookup(<const double*>tp, <const int32_t*>pp, <double*>op, n, L, d, nt,
                            stream, 1)
    return nt if ok else 0


def add_into(tokens, table, offset, out, int n_threads, Py_ssize_t serial_below,
             Py_ssize_t stream_bytes):
    """``out[...] = tokens + table[offset:offset + T]`` (positions=None) for
    the plain case, returning the threads it ran on; 0 (nothing written) for
    anything else.

    ``tokens`` an exact ndarray of shape ``(..., T, d)`` with the table's
    dtype, C-contiguous and aligned; ``offset`` a Python int with
    ``0 <= offset <= L - T``; ``out`` ``tokens`` itself (in place), or an
    exact writable ndarray of the same shape and dtype, C-contiguous,
    aligned, sharing no memory with ``tokens``; neither shares memory with
    the table.
    """
    if (
        not _plain_table(table)
        or not cnp.PyArray_CheckExact(tokens)
        or not cnp.PyArray_CheckExact(out)
    ):
        return 0
    cdef cnp.ndarray t = <cnp.ndarray>table
    cdef cnp.ndarray k = <cnp.ndarray>tokens
    cdef cnp.ndarray o = <cnp.ndarray>out
    cdef int typenum = cnp.PyArray_TYPE(t)
    cdef int nd = cnp.PyArray_NDIM(k)
    cdef Py_ssize_t L = cnp.PyArray_DIMS(t)[0]
    cdef Py_ssize_t d = cnp.PyArray_DIMS(t)[1]
    cdef bint in_place = o is k
    cdef Py_ssize_t T, N, start
    if nd < 2 or d == 0 or cnp.PyArray_DIMS(k)[nd - 1] != d:
        return 0
    T = cnp.PyArray_DIMS(k)[nd - 2]
    N = cnp.PyArray_SIZE(k) // d
    if (
        T == 0
        or N == 0
        or not _exact_int(offset, 0, L - T, &start)
        or not _plain_as(k, typenum)
        or not _plain_as(o, typenum)
        or not cnp.PyArray_ISWRITEABLE(o)
        or cnp.PyArray_NDIM(o) != nd
        or not _same_shape(o, k, nd)
        or not _apart(o, t)
        or not _apart(k, t)
        or not (in_place or _apart(o, k))
    ):
        return 0
    cdef int nt = _team(n_threads, N * d, N, serial_below)
    # In place the lines are read anyway: ordinary stores, and the token rows
    # prefetched with a non-temporal hint (as functional.add_positions).
    cdef int stream = not in_place and cnp.PyArray_NBYTES(o) >= stream_bytes
    cdef const void* kp = cnp.PyArray_DATA(k)
    cdef const void* tp = cnp.PyArray_DATA(t)
    cdef void* op = cnp.PyArray_DATA(o)
    cdef int64_t* pos
    with nogil:
        pos = _arange(start, T)
        if pos != NULL:
            if typenum == cnp.NPY_FLOAT:
                _add(<const float*>kp, <const float*>tp, pos, <float*>op, N, L, T, d, nt,
                     stream, in_place)
            else:
                _add(<const double*>kp, <const double*>tp, pos, <double*>op, N, L, T, d, nt,
                     stream, in_place)
            free(pos)
    return nt if pos != NULL else 0


def scatter_into(grad, g, positions, offset, int n_threads, Py_ssize_t serial_below):
    """``grad[positions] += g`` (np.add.at's order) for the plain case,
    returning the threads it ran on; 0 (nothing written) for anything else.

    ``grad`` a writable table as for take_small; ``g`` an exact ndarray of
    shape ``(..., d)`` with grad's dtype, C-contiguous, aligned, sharing no
    memory with grad; ``positions`` None (then ``offset`` a Python int with
    ``0 <= offset <= L - T``, T = g.shape[-2]) or an exact ndarray of native
    int32/int64 of shape ``g.shape[:-1]``, C-contiguous, aligned, sharing no
    memory with grad, every value in ``[-L, L)`` (and ``offset`` 0).
    """
    if not _plain_table(grad) or not cnp.PyArray_CheckExact(g):
        return 0
    cdef cnp.ndarray t = <cnp.ndarray>grad
    cdef cnp.ndarray a = <cnp.ndarray>g
    cdef cnp.ndarray p
    cdef int typenum = cnp.PyArray_TYPE(t)
    cdef int nd = cnp.PyArray_NDIM(a)
    cdef Py_ssize_t L = cnp.PyArray_DIMS(t)[0]
    cdef Py_ssize_t d = cnp.PyArray_DIMS(t)[1]
    cdef Py_ssize_t N, m, start, zero
    cdef int isz = 8
    cdef bint explicit = positions is not None
    if (
        nd < 1
        or d == 0
        or cnp.PyArray_DIMS(a)[nd - 1] != d
        or not cnp.PyArray_ISWRITEABLE(t)
        or not _plain_as(a, typenum)
        or not _apart(a, t)
    ):
        return 0
    N = cnp.PyArray_SIZE(a) // d
    if N == 0:
        return 0
    if explicit:
        isz = _plain_index(positions)
        if not isz or not _exact_int(offset, 0, 0, &zero):
            return 0
        p = <cnp.ndarray>positions
        if (
            cnp.PyArray_NDIM(p) != nd - 1
            or not _same_shape(p, a, nd - 1)
            or not _apart(p, t)
        ):
            return 0
        m = N
    else:
        if nd < 2:
            return 0
        m = cnp.PyArray_DIMS(a)[nd - 2]
        if m == 0 or not _exact_int(offset, 0, L - m, &start):
            return 0
    cdef const void* sp = cnp.PyArray_DATA(a)
    cdef void* gp = cnp.PyArray_DATA(t)
    cdef const void* pp = cnp.PyArray_DATA(p) if explicit else NULL
    cdef int64_t* own = NULL
    cdef int64_t* row_start = NULL
    cdef int64_t* order = NULL
    cdef bint ok = True
    cdef int nt
    with nogil:
        if explicit:
            if isz == 8:
                ok = _in_range(<const int64_t*>pp, m, L)
            else:
                ok = _in_range(<const int32_t*>pp, m, L)
            # (B, T) positions that repeat every sequence (arange expanded,
            # typically) are one period of T: the blocked path can take them.
            if ok and nd >= 3 and cnp.PyArray_DIMS(a)[nd - 2] < m:
                if isz == 8:
                    if _repeats(<const int64_t*>pp, m, cnp.PyArray_DIMS(a)[nd - 2]):
                        m = cnp.PyArray_DIMS(a)[nd - 2]
                elif _repeats(<const int32_t*>pp, m, cnp.PyArray_DIMS(a)[nd - 2]):
                    m = cnp.PyArray_DIMS(a)[nd - 2]
        else:
            own = _arange(start, m)
            pp = own
            ok = own != NULL
        if ok:
            row_start = <int64_t*>malloc((L + 1) * sizeof(int64_t))
            order = <int64_t*>malloc(m * sizeof(int64_t))
            ok = row_start != NULL and order != NULL
    nt = 0
    if ok:
        nt = _team(n_threads, N * d, min(L, m), serial_below)
        with nogil:
            if typenum == cnp.NPY_FLOAT:
                if isz == 8:
                    _scatter_add(<float*>gp, <const float*>sp, <const int64_t*>pp, row_start,
                                 order, L, d, m, N // m, nt, True, 0, _SCAN_BLOCK_BYTES)
                else:
                    _scatter_add(<float*>gp, <const float*>sp, <const int32_t*>pp, row_start,
                                 order, L, d, m, N // m, nt, True, 0, _SCAN_BLOCK_BYTES)
            else:
                if isz == 8:
                    _scatter_add(<double*>gp, <const double*>sp, <const int64_t*>pp, row_start,
                                 order, L, d, m, N // m, nt, True, 0, _SCAN_BLOCK_BYTES)
                else:
                    _scatter_add(<double*>gp, <const double*>sp, <const int32_t*>pp, row_start,
                                 order, L, d, m, N // m, nt, True, 0, _SCAN_BLOCK_BYTES)
    free(own)
    free(row_start)
    free(order)
    return nt
