# Positions into a buffer the call owns: the one reader of integer positions.
#
# Each value is converted to int64, range-checked and wrapped into [0, L) in one
# pass, with the GIL held, into a private buffer that the kernels alone read: no
# other thread or overlapping output can change a row after its check. Read: Python
# ints, exact NumPy integer scalars, native-order integer ndarrays (any shape and
# strides) and nested lists of ints. Anything else, or a value out of range: 0,
# nothing held (the route takes over). A failed allocation raises MemoryError.

from libc.stdint cimport int8_t, int16_t, int32_t, uint16_t, uint32_t, uint64_t
from libc.limits cimport LLONG_MAX
from libc.string cimport memcpy

cdef extern from "Python.h":
    bint PyLong_CheckExact(object o)
    bint PyList_CheckExact(object o)
    long long PyLong_AsLongLongAndOverflow(object o, int* overflow) except? -1

cdef extern from *:
    """
    /* Exact NumPy integer scalar types (not bool, not timedelta64, no subclass). */
    static int cpe_is_np_int_scalar(PyObject *o) {
        PyTypeObject *t = Py_TYPE(o);
        return t == &PyByteArrType_Type || t == &PyShortArrType_Type
            || t == &PyIntArrType_Type || t == &PyLongArrType_Type
            || t == &PyLongLongArrType_Type || t == &PyUByteArrType_Type
            || t == &PyUShortArrType_Type || t == &PyUIntArrType_Type
            || t == &PyULongArrType_Type || t == &PyULongLongArrType_Type;
    }
    /* The value of an exact NumPy integer scalar (cpe_is_np_int_scalar), read
     * from the scalar itself (no Python int made); 0 if it lies beyond int64
     * (a uint64 above 2**63 - 1), else 1. */
    static int cpe_np_int_value(PyObject *o, long long *value) {
        PyTypeObject *t = Py_TYPE(o);
        if (t == &PyByteArrType_Type) { *value = PyArrayScalar_VAL(o, Byte); return 1; }
        if (t == &PyShortArrType_Type) { *value = PyArrayScalar_VAL(o, Short); return 1; }
        if (t == &PyIntArrType_Type) { *value = PyArrayScalar_VAL(o, Int); return 1; }
        if (t == &PyLongArrType_Type) { *value = PyArrayScalar_VAL(o, Long); return 1; }
        if (t == &PyLongLongArrType_Type) { *value = PyArrayScalar_VAL(o, LongLong); return 1; }
        if (t == &PyUByteArrType_Type) { *value = PyArrayScalar_VAL(o, UByte); return 1; }
        if (t == &PyUShortArrType_Type) { *value = PyArrayScalar_VAL(o, UShort); return 1; }
        if (t == &PyUIntArrType_Type) { *value = PyArrayScalar_VAL(o, UInt); return 1; }
        if (t == &PyULongArrType_Type) {
            npy_ulong v = PyArrayScalar_VAL(o, ULong);
            *value = (long long)v;
            return v <= (npy_ulong)0x7fffffffffffffffULL;
        }
        {
            npy_ulonglong v = PyArrayScalar_VAL(o, ULongLong);
            *value = (long long)v;
            return v <= (npy_ulonglong)0x7fffffffffffffffULL;
        }
    }
    """
    bint cpe_is_np_int_scalar(object o)
    bint cpe_np_int_value(object o, long long* value)

# Dimensions of a positions array: NumPy 1.x allows 32 (2.x: 64), and the
# result has one more. The routes serve deeper ones (MAX_POSITION_DIMS).
cdef enum:
    _MAX_DIMS = 31
MAX_POSITION_DIMS = _MAX_DIMS
# Positions held inside the Index itself (no allocation for small calls).
cdef enum:
    _INLINE = 512


cdef struct Index:
    int64_t* rows                 # n row numbers in [0, L): `inline` or scratch
    size_t capacity               # bytes of the scratch block
    Py_ssize_t n
    int nd
    cnp.npy_intp shape[_MAX_DIMS + 1]  # room for the result's last axis
    int64_t inline[_INLINE]


cdef inline void _index_free(Index* ix) noexcept:
    if ix.rows != ix.inline:
        _scratch_give(ix.rows, ix.capacity)
    ix.rows = NULL


cdef inline int _index_alloc(Index* ix, Py_ssize_t n) except -1:
    # Room for n rows in `ix`, or MemoryError (nothing held).
    ix.n = n
    ix.rows = NULL
    if n <= _INLINE:
        ix.rows = ix.inline
        return 0
    if n > (<Py_ssize_t>1 << 60) // <Py_ssize_t>sizeof(int64_t):
        # Absurd: no machine holds it (and n * 8 could overflow).
        raise MemoryError("cannot allocate the buffer for the call's positions")
    ix.rows = <int64_t*>_scratch_or_raise(n * sizeof(int64_t), &ix.capacity,
                                          "the buffer for the call's positions")
    return 0


cdef inline bint _is_integer(object o) noexcept:
    # A Python int (not bool) or an exact NumPy integer scalar.
    return PyLong_CheckExact(o) or cpe_is_np_int_scalar(o)


cdef inline int _int_sign(object o, long long* v) noexcept:
    # For an _is_integer value: 1 if >= 0 (*v: it, LLONG_MAX beyond), 0 if
    # negative; -1 for anything else.
    cdef int overflow = 0
    if not _is_integer(o):
        return -1
    try:
        v[0] = PyLong_AsLongLongAndOverflow(o, &overflow)
    except Exception:
        return -1
    if overflow > 0:
        v[0] = LLONG_MAX
    return overflow >= 0 and v[0] >= 0


cdef inline bint _int_value(object o, Py_ssize_t L, int64_t* row) noexcept:
    # `o` (a _is_integer value) wrapped into [0, L); False if out of range.
    cdef int overflow = 0
    cdef long long v
    if PyLong_CheckExact(o):
        try:
            v = PyLong_AsLongLongAndOverflow(o, &overflow)
        except Exception:
            return False
        if overflow:
            return False
    elif not cpe_np_int_value(o, &v):
        return False
    if v < 0:
        v += L
    if v < 0 or v >= L:
        return False
    row[0] = v
    return True


ctypedef fused int_t:
    int8_t
    int16_t
    int32_t
    int64_t
    uint8_t
    uint16_t
    uint32_t
    uint64_t


cdef bint _read_run(const char* p, Py_ssize_t stride, Py_ssize_t n, int64_t L,
                    int64_t* dst, int_t* kind) noexcept nogil:
    # dst[i] = the int_t at p + i*stride, wrapped into [0, L); False if any
    # is out of range. memcpy: the array need not be aligned. Branch-free.
    cdef Py_ssize_t i
    cdef int_t v
    cdef int64_t w
    cdef uint64_t bad = 0
    for i in range(n):
        memcpy(&v, p + i * stride, sizeof(int_t))
        if int_t is uint64_t:
            bad |= v >= <uint64_t>L  # beyond int64 too
        w = <int64_t>v
        w += L & (w >> 63)
        bad |= <uint64_t>w >= <uint64_t>L
        dst[i] = w
    return bad == 0


cdef bint _read_typed(const char* p, Py_ssize_t stride, Py_ssize_t n, int64_t L,
                      int64_t* dst, int typenum, int itemsize) noexcept nogil:
    cdef bint signed = (typenum == cnp.NPY_BYTE or typenum == cnp.NPY_SHORT
                        or typenum == cnp.NPY_INT or typenum == cnp.NPY_LONG
                        or typenum == cnp.NPY_LONGLONG)
    if signed:
        if itemsize == 1:
            return _read_run(p, stride, n, L, dst, <int8_t*>NULL)
        if itemsize == 2:
            return _read_run(p, stride, n, L, dst, <int16_t*>NULL)
        if itemsize == 4:
            return _read_run(p, stride, n, L, dst, <int32_t*>NULL)
        return _read_run(p, stride, n, L, dst, <int64_t*>NULL)
    if itemsize == 1:
        return _read_run(p, stride, n, L, dst, <uint8_t*>NULL)
    if itemsize == 2:
        return _read_run(p, stride, n, L, dst, <uint16_t*>NULL)
    if itemsize == 4:
        return _read_run(p, stride, n, L, dst, <uint32_t*>NULL)
    return _read_run(p, stride, n, L, dst, <uint64_t*>NULL)


cdef int _read_array(cnp.ndarray a, Py_ssize_t L, Index* ix) except -1:
    cdef int typenum = cnp.PyArray_TYPE(a)
    cdef int nd = cnp.PyArray_NDIM(a)
    cdef int itemsize = <int>cnp.PyArray_ITEMSIZE(a)
    cdef Py_ssize_t n = cnp.PyArray_SIZE(a)
    cdef cnp.npy_intp* shape = cnp.PyArray_DIMS(a)
    cdef cnp.npy_intp* strides = cnp.PyArray_STRIDES(a)
    cdef Py_ssize_t counter[_MAX_DIMS]
    cdef const char* p = cnp.PyArray_BYTES(a)
    cdef Py_ssize_t i, inner, step
    cdef int k
    if (
        not (cnp.NPY_BYTE <= typenum <= cnp.NPY_ULONGLONG)
        or not cnp.PyArray_ISNOTSWAPPED(a)
        or nd > _MAX_DIMS
    ):
        return False
    ix.nd = nd
    for k in range(nd):
        ix.shape[k] = shape[k]
    _index_alloc(ix, n)
    if n == 0:
        return True
    if nd == 0 or cnp.PyArray_IS_C_CONTIGUOUS(a):
        if _read_typed(p, itemsize, n, L, ix.rows, typenum, itemsize):
            return True
        _index_free(ix)
        return False
    # Any strides: runs along the last axis, an odometer over the others.
    inner = shape[nd - 1]
    step = strides[nd - 1]
    for k in range(nd):
        counter[k] = 0
    i = 0
    while i < n:
        if not _read_typed(p, step, inner, L, ix.rows + i, typenum, itemsize):
            _index_free(ix)
            return False
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
    return True


cdef bint _list_shape(object lst, Index* ix) noexcept:
    # The shape of a (nested) list, from the first item at each depth;
    # _fill_from_list checks that every other item agrees.
    cdef object obj = lst
    cdef Py_ssize_t n = 1, size
    ix.nd = 0
    while PyList_CheckExact(obj):
        if ix.nd == _MAX_DIMS:
            return False
        size = len(<list>obj)
        ix.shape[ix.nd] = size
        ix.nd += 1
        if size == 0:
            n = 0
            break
        if n > (<Py_ssize_t>1 << 40) // size:
            return False  # absurd: NumPy could not build it either
        n *= size
        obj = (<list>obj)[0]
    ix.n = n
    return True


cdef bint _fill_from_list(list lst, int depth, Index* ix, Py_ssize_t L,
                          Py_ssize_t* pos) noexcept:
    # Rows of a (nested) list of integers of shape ix.shape; False if it is
    # not one (ragged, other items) or a value is out of range. Each item is
    # held (a strong reference) while it is used, and the list's length is
    # checked at every step, so the walk stays valid whatever runs meanwhile.
    cdef Py_ssize_t i
    cdef object item
    if len(lst) != ix.shape[depth]:
        return False
    for i in range(ix.shape[depth]):
        if len(lst) != ix.shape[depth]:
            return False
        item = lst[i]
        if depth + 1 < ix.nd:
            if not PyList_CheckExact(item):
                return False
            if not _fill_from_list(<list>item, depth + 1, ix, L, pos):
                return False
        else:
            if pos[0] >= ix.n or not _is_integer(item):
                return False
            if not _int_value(item, L, ix.rows + pos[0]):
                return False
            pos[0] += 1
    return True


cdef int _read_list(list lst, Py_ssize_t L, Index* ix) except -1:
    cdef Py_ssize_t pos = 0
    if not _list_shape(lst, ix):
        return False
    _index_alloc(ix, ix.n)
    if not (_fill_from_list(lst, 0, ix, L, &pos) and pos == ix.n):
        _index_free(ix)
        return False
    return True


cdef int _read_index(object positions, Py_ssize_t L, Index* ix) except -1:
    """Positions into `ix` (rows wrapped into [0, L)): 1; 0: not read, nothing
    held; MemoryError if no buffer for them could be had."""
    ix.rows = NULL
    if _is_integer(positions):
        ix.nd = 0
        _index_alloc(ix, 1)  # inline: cannot fail
        if _int_value(positions, L, ix.rows):
            return True
        return False
    if cnp.PyArray_CheckExact(positions):
        return _read_array(<cnp.ndarray>positions, L, ix)
    if PyList_CheckExact(positions):
        return _read_list(<list>positions, L, ix)
    return False


cdef int _arange_index(Py_ssize_t start, Py_ssize_t T, Index* ix) except -1:
    # offset + arange(T) (checked by the caller to lie in [0, L)): 1.
    cdef Py_ssize_t i
    ix.nd = 1
    ix.shape[0] = T
    _index_alloc(ix, T)
    for i in range(T):
        ix.rows[i] = start + i
    return True
