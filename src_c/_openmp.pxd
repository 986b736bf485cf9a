# One .pyx builds with and without OpenMP (as scikit-learn's
# sklearn/utils/_openmp_helpers.pxd does): without _OPENMP the one runtime
# calls we use (the default thread count, the CPUs) become serial stand-ins, and
# Cython's prange (the kernels' _run_chunks, _parallel.pxi, and
# _membench.pyx's memory-limit loops) compiles to a plain loop.
cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define CPOSEMBED_OPENMP_ENABLED 1
    #else
    #define CPOSEMBED_OPENMP_ENABLED 0
    static int omp_get_max_threads(void) { return 1; }
    static int omp_get_num_procs(void) { return 1; }
    #endif
    """
    bint CPOSEMBED_OPENMP_ENABLED
    int omp_get_max_threads() noexcept nogil
    int omp_get_num_procs() noexcept nogil
