# Tiny calls in C, on NumPy's C API: `pe(5)`, `pe([0])`, `pe(small array)` and
# the one-token decode step `pe.add_to(tok, offset=i)`.
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
from libc.stdint cimport (
    int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t,
)
from libc.string cimport memcpy

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

ctypedef fused real_t:
    float
    double


cdef bint _plain_table(object table) noexcept:
    """An exact ndarray: C-contiguous, aligned, native float32/float64, 2-D."""
    if not cnp.PyArray_CheckExact(table):
        return False
    cdef cnp.ndarray t = <cnp.ndarray>table
    cdef int typenum = cnp.PyArray_TYPE(t)
    return (
        cnp.PyArray_NDIM(t) == 2
        and (typenum == cnp.NPY_FLOAT or typenum == cnp.NPY_DOUBLE)
        and cnp.PyArray_ISNOTSWAPPED(t)
        and cnp.PyArray_IS_C_CONTIGUOUS(t)
        and cnp.PyArray_ISALIGNED(t)
    )


cdef inline bint _wrap(long long p, Py_ssize_t n_rows, Py_ssize_t* row) noexcept nogil:
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
        return _wrap(i8, n_rows, row)
    elif code == 1:
        memcpy(&i16, p, 2)
        return _wrap(i16, n_rows, row)
    elif code == 2:
        memcpy(&i32, p, 4)
        return _wrap(i32, n_rows, row)
    elif code == 3:
        memcpy(&i64, p, 8)
        return _wrap(i64, n_rows, row)
    elif code == 4:
        memcpy(&u8, p, 1)
        return _wrap(u8, n_rows, row)
    elif code == 5:
        memcpy(&u16, p, 2)
        return _wrap(u16, n_rows, row)
    elif code == 6:
        memcpy(&u32, p, 4)
        return _wrap(u32, n_rows, row)
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
            if overflow or not _wrap(value, n_rows, &row):
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
        if overflow or not _wrap(value, cnp.PyArray_DIMS(t)[0], &row):
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
        or cnp.PyArray_TYPE(a) != typenum
        or not cnp.PyArray_ISNOTSWAPPED(a)
        or not cnp.PyArray_IS_C_CONTIGUOUS(a)
        or not cnp.PyArray_ISALIGNED(a)
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
