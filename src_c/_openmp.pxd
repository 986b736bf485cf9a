# One .pyx builds with and without OpenMP (as scikit-learn's
# sklearn/utils/_openmp_helpers.pxd does): without _OPENMP the two runtime
# calls we use become serial stand-ins, and Cython's prange compiles to a
# plain loop.
cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define CPOSEMBED_OPENMP_ENABLED 1
    #else
    #define CPOSEMBED_OPENMP_ENABLED 0
    static int omp_get_max_threads(void) { return 1; }
    static int omp_get_thread_num(void) { return 0; }
    #endif
    """
    bint CPOSEMBED_OPENMP_ENABLED
    int omp_get_max_threads() noexcept nogil
    int omp_get_thread_num() noexcept nogil
