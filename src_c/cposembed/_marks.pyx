# cposembed._marks: the rows a call touches, at a cost that grows with the call.
#
# RowMarks: the rows a gradient received since its last zero, as a mask (calloc'd:
# untouched pages cost nothing) and a list, so that zeroing, stepping or listing
# them costs the marked rows only. RowSlots: where an optimizer keeps each row's
# state. _distinct: a call's distinct rows and each position's slot among them,
# in O(positions). The rules the entries share are in _marks.pxd.

cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memset

import os

import numpy as np

cnp.import_array()


cdef extern from *:
    """
    /* Slot of a row in _distinct's hash table: multiply-shift hashing by an
     * odd key drawn when the module is imported (cpe_set_row_hash_key), so
     * that no fixed set of rows collides in every process; the slots a call
     * gets do not depend on it (they number rows by first appearance). */
    static uint64_t cpe_row_hash_key = 0x9E3779B97F4A7C15ull;
    static inline void cpe_set_row_hash_key(uint64_t key) { cpe_row_hash_key = key | 1; }
    static inline size_t cpe_row_hash(int64_t row, int bits) {
        return (size_t)(((uint64_t)row * cpe_row_hash_key) >> (64 - bits));
    }
    """
    size_t cpe_row_hash(int64_t row, int bits) nogil
    void cpe_set_row_hash_key(uint64_t key)


cpe_set_row_hash_key(int.from_bytes(os.urandom(8), "little"))


cdef inline int _hash_bits(Py_ssize_t m) noexcept nogil:
    # log2 of a hash table's size: at least twice the entries.
    cdef int bits = 4
    while (<Py_ssize_t>1 << bits) < 2 * m:
        bits += 1
    return bits


cdef size_t _distinct_scratch_bytes(Py_ssize_t m, Py_ssize_t L) noexcept nogil:
    # _distinct's scratch: the hash table, or the direct map of the table.
    if _sparse_table(L, m):
        return (<size_t>1 << _hash_bits(m)) * sizeof(int64_t)
    return (L if L > 0 else 1) * sizeof(int64_t)


cdef Py_ssize_t _distinct(const int64_t* rows, Py_ssize_t m, Py_ssize_t L, int64_t* slot,
                          int64_t* uniq, int64_t* first, int64_t* scratch) noexcept nogil:
    # uniq[:k] = the distinct values of rows[:m] (each in [0, L)) in order
    # of first appearance, first[:k] (unless NULL) where each first
    # appears, slot[j] = the s with uniq[s] == rows[j]; returns k. scratch:
    # _distinct_scratch_bytes(m, L) of it.
    cdef Py_ssize_t j, k = 0, n_map
    cdef int64_t r, s
    cdef size_t h, mask
    cdef int bits
    if not _sparse_table(L, m):
        for j in range(L):
            scratch[j] = -1
        for j in range(m):
            r = rows[j]
            s = scratch[r]
            if s < 0:
                s = k
                scratch[r] = s
                uniq[k] = r
                if first != NULL:
                    first[k] = j
                k += 1
            slot[j] = s
        return k
    bits = _hash_bits(m)
    n_map = <Py_ssize_t>1 << bits
    mask = <size_t>(n_map - 1)
    for j in range(n_map):
        scratch[j] = -1
    for j in range(m):
        r = rows[j]
        h = cpe_row_hash(r, bits)
        while True:
            s = scratch[h]
            if s < 0:
                s = k
                scratch[h] = s
                uniq[k] = r
                if first != NULL:
                    first[k] = j
                k += 1
                break
            if uniq[s] == r:
                break
            h = (h + 1) & mask
        slot[j] = s
    return k


cdef object _int64_array(const int64_t* rows, Py_ssize_t n):
    # rows[:n] as a new int64 array.
    cdef cnp.npy_intp dims = n
    out = cnp.PyArray_SimpleNew(1, &dims, cnp.NPY_INT64)
    if n:
        memcpy(cnp.PyArray_DATA(<cnp.ndarray>out), rows, n * sizeof(int64_t))
    return out


cdef class _RowList:
    """Rows of a table of ``n_rows``, listed in the order they came."""

    def __cinit__(self, Py_ssize_t n_rows, *args, **kwargs):
        if n_rows < 0:
            raise ValueError(f"n_rows must be >= 0; got {n_rows}")
        self.n_rows = n_rows

    def __dealloc__(self):
        free(self.row_list)

    cdef int _grow(self, Py_ssize_t need, str what) except -1:
        # Room for `need` rows in the list (MemoryError before anything changes).
        cdef Py_ssize_t size
        cdef int64_t* p
        if need <= self.capacity:
            return 0
        size = max(need, 2 * self.capacity, 16)
        p = <int64_t*>realloc(self.row_list, size * sizeof(int64_t))
        if p == NULL:
            raise MemoryError(f"cannot allocate {what}")
        self.row_list = p
        self.capacity = size
        return 0

    def __len__(self):
        return self.n

    @property
    def n_rows(self):
        """The table's rows."""
        return self.n_rows

    def rows(self):
        """The listed rows in their order: marked (RowMarks), or by slot (RowSlots); a
        new int64 array."""
        return _int64_array(self.row_list, self.n)


cdef class RowMarks(_RowList):
    """RowMarks(n_rows, mask=None)

    The rows of a table marked since the last :meth:`clear`: a flag per
    row (:attr:`mask`, read-only) and the list of marked rows
    (:meth:`rows`), so that clearing, listing or zeroing them costs the
    marked rows, not the table. ``mask``: a bool array of length
    ``n_rows`` whose rows start marked (a pickled gradient's)."""

    def __cinit__(self, Py_ssize_t n_rows, mask=None):
        cdef cnp.npy_intp dims = n_rows
        arr = cnp.PyArray_ZEROS(1, &dims, cnp.NPY_BOOL, 0)
        self.flags = <uint8_t*>cnp.PyArray_DATA(<cnp.ndarray>arr)
        if mask is not None:
            given = np.asarray(mask, dtype=bool)
            if given.shape != (n_rows,):
                raise ValueError(f"mask must have shape ({n_rows},); got {given.shape}")
            self._mark_array(np.flatnonzero(given))
        arr.flags.writeable = False
        # A view of the read-only array: NumPy refuses to make it writable
        # again (the array itself, owning its data, would allow it).
        self.mask = arr.view()

    cdef int _reserve(self, Py_ssize_t extra) except -1:
        # Room for `extra` more rows in the list (MemoryError before
        # anything changes).
        return self._grow(self.n + extra, "the list of touched rows")

    cdef void _mark(self, const int64_t* rows, Py_ssize_t m, Py_ssize_t skip_row) noexcept:
        # Marks rows[:m] (in [0, n_rows)) but skip_row; room for m more
        # rows reserved first (_reserve).
        cdef Py_ssize_t j
        cdef int64_t r
        for j in range(m):
            r = rows[j]
            if not self.flags[r] and r != skip_row:
                self.flags[r] = 1
                self.row_list[self.n] = r
                self.n += 1

    cdef int _mark_array(self, rows) except -1:
        # Marks `rows`, an array of integers in [0, n_rows).
        cdef cnp.ndarray r = np.ascontiguousarray(rows, dtype=np.int64)
        self._reserve(r.size)
        self._mark(<const int64_t*>cnp.PyArray_DATA(r), r.size, -1)
        return 0

    def mark_all(self):
        """Mark every row."""
        self._mark_array(np.arange(self.n_rows))

    def unmark(self, Py_ssize_t row):
        """Unmark one row (in [0, n_rows))."""
        cdef Py_ssize_t i
        if not 0 <= row < self.n_rows:
            raise IndexError(f"row {row} is out of bounds for {self.n_rows} rows")
        if not self.flags[row]:
            return
        self.flags[row] = 0
        for i in range(self.n):
            if self.row_list[i] == row:
                self.row_list[i] = self.row_list[self.n - 1]
                self.n -= 1
                return

    def clear(self):
        """Unmark every row (at the cost of the marked ones)."""
        cdef Py_ssize_t i
        for i in range(self.n):
            self.flags[self.row_list[i]] = 0
        self.n = 0

    def zero_rows(self, grad):
        """``grad[rows] = 0`` for the marked rows, then :meth:`clear`: at the
        cost of the marked rows (a whole ``fill`` when most are marked).
        grad: a C-contiguous writable (n_rows, d) array of numbers."""
        if not (
            cnp.PyArray_CheckExact(grad)
            and cnp.PyArray_NDIM(<cnp.ndarray>grad) == 2
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>grad)
            and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>grad)
            and cnp.PyArray_DIMS(<cnp.ndarray>grad)[0] == self.n_rows
            and not grad.dtype.hasobject
        ):
            raise ValueError(
                f"grad must be a C-contiguous writable ({self.n_rows}, d) array of numbers; "
                f"got {type(grad).__name__}"
            )
        cdef char* base = cnp.PyArray_BYTES(<cnp.ndarray>grad)
        cdef Py_ssize_t rb = (cnp.PyArray_DIMS(<cnp.ndarray>grad)[1]
                              * cnp.PyArray_ITEMSIZE(<cnp.ndarray>grad))
        cdef Py_ssize_t i
        if 2 * self.n >= self.n_rows:
            memset(base, 0, self.n_rows * rb)
        else:
            for i in range(self.n):
                memset(base + self.row_list[i] * rb, 0, rb)
        self.clear()

    def __reduce__(self):
        return (RowMarks, (self.n_rows, np.array(self.mask)))


cdef class RowSlots(_RowList):
    """RowSlots(n_rows, rows=None)

    Where an optimizer keeps each row's state: row ``r``'s is row :meth:`slot_of`
    ``(r)`` of the state arrays. Rows get slots 0, 1, 2, ... in the order they are
    first stepped, so new state fills the arrays in order, however scattered the
    rows; a hash table (open addressing, at most half full) maps a row to its slot.
    ``rows``: rows that start with state, given slots in their order."""

    def __cinit__(self, Py_ssize_t n_rows, rows=None):
        cdef cnp.ndarray given
        cdef Py_ssize_t i
        self._reserve(0)
        if rows is not None:
            rows = np.asarray(rows)
            if rows.dtype.kind not in "iu":
                raise ValueError(f"rows must be integers; got {rows.dtype}")
            given = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
            if given.size and (given.min() < 0 or given.max() >= n_rows):
                raise ValueError(f"rows must be in [0, {n_rows})")
            if np.unique(given).size != given.size:
                raise ValueError("rows must be distinct")
            self._reserve(given.size)
            for i in range(given.size):
                self._slot(<int64_t>given[i], True)

    def __dealloc__(self):
        free(self.index)

    cdef int _reserve(self, Py_ssize_t extra) except -1:
        # Room for `extra` more rows (MemoryError before anything changes).
        cdef Py_ssize_t need = self.n + extra, size, s
        cdef int bits = _hash_bits(need)
        cdef int64_t* index
        cdef size_t h, mask
        self._grow(need, "the optimizer's row slots")
        if self.index != NULL and bits <= self.bits:
            return 0
        size = <Py_ssize_t>1 << bits
        index = <int64_t*>malloc(size * sizeof(int64_t))
        if index == NULL:
            raise MemoryError("cannot allocate the optimizer's row slots")
        memset(index, 0xff, size * sizeof(int64_t))  # every entry -1
        mask = <size_t>(size - 1)
        for s in range(self.n):
            h = cpe_row_hash(self.row_list[s], bits)
            while index[h] >= 0:
                h = (h + 1) & mask
            index[h] = s
        free(self.index)
        self.index = index
        self.bits = bits
        return 0

    cdef int64_t _slot(self, int64_t row, bint add) noexcept nogil:
        # The slot of `row` (in [0, n_rows)); a new one if it has none and
        # `add` (room reserved first: _reserve), else -1.
        cdef size_t mask = (<size_t>1 << self.bits) - 1
        cdef size_t h = cpe_row_hash(row, self.bits)
        cdef int64_t s
        while True:
            s = self.index[h]
            if s < 0:
                if not add:
                    return -1
                s = self.n
                self.index[h] = s
                self.row_list[s] = row
                self.n += 1
                return s
            if self.row_list[s] == row:
                return s
            h = (h + 1) & mask

    cdef Py_ssize_t _assign(self, const int64_t* rows, Py_ssize_t m, Py_ssize_t skip_row,
                            int64_t* slots) noexcept nogil:
        # slots[j] = the slot of rows[j] (distinct, in [0, n_rows)), new ones
        # made (room for m reserved first: _reserve); -1 for skip_row. Returns
        # the first new slot: slots from it on belong to rows without state
        # before this call.
        cdef Py_ssize_t j, before = self.n
        for j in range(m):
            slots[j] = -1 if rows[j] == skip_row else self._slot(rows[j], True)
        return before

    def slot_of(self, Py_ssize_t row):
        """The slot of ``row``, or -1 if it has no state."""
        if not 0 <= row < self.n_rows:
            raise IndexError(f"row {row} is out of bounds for {self.n_rows} rows")
        return self._slot(row, False)

    def __reduce__(self):
        return (RowSlots, (self.n_rows, self.rows()))
