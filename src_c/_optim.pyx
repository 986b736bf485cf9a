# Optimizer kernels for cposembed: the SGD update of the rows a gradient touched.
#
# Like _kernels.pyx they trust their inputs: cposembed/embedding.py has checked
# that table and grad are C-contiguous (L, d) arrays of one dtype and that every
# entry of `rows` lies in [0, L). Compiler directives are set in setup.py.
#
# Bitwise contract: table[r, k] -= step * grad[r, k] with `step` the learning
# rate rounded once to the table's dtype, which is what NumPy computes for
# `table -= lr * grad` with a Python float `lr` (the scalar is cast to the
# array's dtype, then one multiply and one subtract per element). setup.py
# builds with -ffp-contract=off so the compiler cannot fuse the two into an FMA.

from cython.parallel cimport prange
from libc.stdint cimport int64_t

ctypedef fused real_t:
    float
    double


cdef inline void _step_row(real_t* row, const real_t* g, real_t step,
                           Py_ssize_t d) noexcept nogil:
    cdef Py_ssize_t k
    for k in range(d):
        row[k] = row[k] - step * g[k]


def sgd_rows(real_t[:, ::1] table,          # IN/OUT (L, d)
             const real_t[:, ::1] grad,     # IN     (L, d)
             const int64_t[::1] rows,       # IN     (n,), distinct, 0 <= r < L
             double lr,
             int n_threads):
    """table[r, :] -= real_t(lr) * grad[r, :] for every r in rows.

    Rows are distinct, so each thread owns the rows it updates: no races.
    """
    cdef Py_ssize_t i, n = rows.shape[0], d = table.shape[1]
    cdef real_t step = <real_t>lr
    if n == 0 or d == 0:
        return
    with nogil:
        if n_threads <= 1:
            for i in range(n):
                _step_row(&table[rows[i], 0], &grad[rows[i], 0], step, d)
        else:
            for i in prange(n, schedule="static", num_threads=n_threads):
                _step_row(&table[rows[i], 0], &grad[rows[i], 0], step, d)
