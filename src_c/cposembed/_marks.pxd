# The rows a call touches, at a cost that grows with the call, not the table
# (cposembed._marks): RowMarks, RowSlots and _distinct, cimported by _core.

cimport cython
from libc.stdint cimport int64_t, uint8_t


# A table of more rows than this many times the call's positions is mapped
# by a hash table (_distinct), whose scratch grows with the call, not the
# table.
cdef enum:
    _SPARSE_ROWS_PER_POSITION = 4
# A scatter-add into such a table sums in a compact copy of its touched rows
# (the sparse plan) once the table's own passes (a few of 8 bytes per table
# row) would cost more than copying the touched rows there and back: when it
# also has more rows per position than a row has bytes / this (the copy costs
# the row's bytes twice, the passes a few bytes per table row: the measurements
# are in docs/performance.md, "Measurements behind the constants").
cdef enum:
    _COMPACT_ROW_BYTES_PER_ROW = 16


cdef inline bint _sparse_table(Py_ssize_t L, Py_ssize_t m) noexcept nogil:
    return L > _SPARSE_ROWS_PER_POSITION * m


cdef inline bint _compact_pays(Py_ssize_t L, Py_ssize_t m, Py_ssize_t row_bytes) noexcept nogil:
    # Whether a scatter-add of m positions into L rows of row_bytes takes the
    # sparse plan.
    return _sparse_table(L, m) and L > m * (row_bytes // _COMPACT_ROW_BYTES_PER_ROW)


cdef size_t _distinct_scratch_bytes(Py_ssize_t m, Py_ssize_t L) noexcept nogil
cdef Py_ssize_t _distinct(const int64_t* rows, Py_ssize_t m, Py_ssize_t L, int64_t* slot,
                          int64_t* uniq, int64_t* first, int64_t* scratch) noexcept nogil


cdef class _RowList:
    cdef int64_t* row_list   # row_list[:n]: rows of a table of n_rows, in their order
    cdef Py_ssize_t n, capacity, n_rows

    cdef int _grow(self, Py_ssize_t need, str what) except -1


@cython.final
cdef class RowMarks(_RowList):
    cdef readonly object mask
    cdef uint8_t* flags

    cdef int _reserve(self, Py_ssize_t extra) except -1
    cdef void _mark(self, const int64_t* rows, Py_ssize_t m, Py_ssize_t skip_row) noexcept
    cdef int _mark_array(self, rows) except -1


@cython.final
cdef class RowSlots(_RowList):
    cdef int64_t* index      # 2**bits entries: a slot, or -1; row_list[s]: the row of slot s
    cdef int bits

    cdef int _reserve(self, Py_ssize_t extra) except -1
    cdef int64_t _slot(self, int64_t row, bint add) noexcept nogil
    cdef Py_ssize_t _assign(self, const int64_t* rows, Py_ssize_t m, Py_ssize_t skip_row,
                            int64_t* slots) noexcept nogil
