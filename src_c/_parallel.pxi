# How many threads a call runs on, and the loop that runs it (_run_chunks, a
# prange over one share of chunks per thread); the C half is _threads.h.
# The default, as scikit-learn's _openmp_effective_n_threads: set_num_threads(n),
# else CPOSEMBED_NUM_THREADS, else omp_get_max_threads(), capped by the CPUs
# this process may run on. An explicit num_threads= is capped at
# _OVERSUBSCRIBE times the CPUs.

from cython.parallel cimport prange
from libc.stdlib cimport getenv, strtol

cdef extern from "_threads.h" nogil:
    ctypedef void (*cpe_chunk_fn)(void* arg, Py_ssize_t chunk) noexcept nogil
    ctypedef struct cpe_job:
        pass
    void cpe_job_init(cpe_job* job, cpe_chunk_fn fn, void* arg, Py_ssize_t n_chunks,
                      int n_threads)
    void cpe_job_run(cpe_job* job, int t)
    int cpe_threads_here(int n)
    void cpe_region_ran(int n)
    void cpe_set_locked(int* var, int value)
    void cpe_threads_init()
    int cpe_serial, cpe_refused, cpe_reserved, cpe_room_max, cpe_entered, cpe_adapting
    int cpe_os_threads()
    long long cpe_now_ns()
    int cpe_cpus_now()
    int cpe_choose(int kind, Py_ssize_t work, int n)
    void cpe_took(int kind, Py_ssize_t work, int threads, long long ns)
    void cpe_set_adapting(int on)
    int cpe_sites_alone()

cpe_threads_init()


cdef void _run_chunks(cpe_chunk_fn fn, void* arg, Py_ssize_t n_chunks,
                      int n_threads) noexcept nogil:
    # fn(arg, c) for every c < n_chunks, on n_threads (from cpe_threads_here).
    cdef Py_ssize_t c
    cdef int t
    cdef cpe_job job
    if n_threads <= 1 or n_chunks <= 1:
        for c in range(n_chunks):
            fn(arg, c)
        return
    cpe_job_init(&job, fn, arg, n_chunks, n_threads)
    for t in prange(n_threads, schedule="static", chunksize=1, num_threads=n_threads):
        cpe_job_run(&job, t)
    cpe_region_ran(n_threads)


# Every thread of a call gets at least this many elements (waking a helper
# costs about what copying this much does).
SERIAL_THRESHOLD = 1 << 16

cdef Py_ssize_t _SERIAL_BELOW = SERIAL_THRESHOLD

cdef enum:
    _OVERSUBSCRIBE = 4

cdef int _user_threads = 0       # set_num_threads(n); 0: not set
cdef int _cpus = 1               # CPUs this process may run on
cdef long long _cpus_read_at = 0
cdef int _last_team = 0          # threads of the last call
cdef bint _planned_default = False  # the last plan came from the default threads


cdef int _env_threads() noexcept nogil:
    # CPOSEMBED_NUM_THREADS: its value; unset or blank: 0; not a positive
    # decimal integer (white space around allowed): -1.
    cdef const char* raw = getenv("CPOSEMBED_NUM_THREADS")
    cdef char* end
    cdef long n
    if raw == NULL:
        return 0
    while raw[0] == 32 or (9 <= raw[0] <= 13):
        raw += 1
    if raw[0] == 0:
        return 0
    if not 48 <= raw[0] <= 57:
        return -1
    n = strtol(raw, &end, 10)
    while end[0] == 32 or (9 <= end[0] <= 13):
        end += 1
    return -1 if end[0] != 0 or n < 1 else <int>min(n, 1 << 30)


cdef void _read_cpus() noexcept nogil:
    # The CPUs this process may use (Linux: affinity and cgroup quota; else
    # the OpenMP runtime's count), read again at most every 50 ms.
    global _cpus, _cpus_read_at
    cdef int n
    if cpe_now_ns() - _cpus_read_at < 50000000:
        return
    n = cpe_cpus_now()
    _cpus = max(1, n if n >= 1 else omp_get_num_procs())
    _cpus_read_at = cpe_now_ns()
    cpe_set_locked(&cpe_room_max, max(0, _OVERSUBSCRIBE * _cpus - 1))


_read_cpus()


cdef int _default_threads() noexcept nogil:
    # An invalid CPOSEMBED_NUM_THREADS is ignored here (the Python layer
    # reports it).
    cdef int n
    if not CPOSEMBED_OPENMP_ENABLED or cpe_serial:
        return 1
    _read_cpus()
    n = _user_threads
    if n == 0:
        n = _env_threads()
        if n <= 0:
            n = omp_get_max_threads()
    return max(1, min(n, _cpus))


cdef int _explicit_threads(object num_threads) noexcept:
    # num_threads as an int >= 1, capped; 0 when it is not an integer >= 1.
    cdef long long n
    if _int_sign(num_threads, &n) <= 0 or n < 1:
        return 0
    if not CPOSEMBED_OPENMP_ENABLED or cpe_serial:
        return 1
    _read_cpus()
    return <int>min(n, _OVERSUBSCRIBE * _cpus)


cdef int _threads_for(object num_threads, Py_ssize_t work, Py_ssize_t chunks) noexcept:
    # Threads for a call of `work` elements in `chunks` pieces (at most one
    # per piece and per _SERIAL_BELOW elements), or 0 when num_threads is
    # invalid. With the GIL, right before the kernel runs.
    global _planned_default, _last_team
    cdef int n
    _planned_default = num_threads is None
    if num_threads is None:
        n = 1 if work < _SERIAL_BELOW else _default_threads()
    else:
        n = _explicit_threads(num_threads)
        if n == 0:
            return 0
    if n <= 1 or work < _SERIAL_BELOW:
        n = 1
    elif chunks < n:
        n = <int>chunks if chunks > 1 else 1
    if n > 1 and _SERIAL_BELOW > 0 and work // _SERIAL_BELOW < n:
        n = <int>(work // _SERIAL_BELOW)
    _last_team = n
    return n


cdef inline bint _measured(int n) noexcept:
    # Whether a call planned on n threads chooses by measurement: a call on
    # the default threads, planned on more than one.
    return _planned_default and n > 1


def default_threads():
    return _default_threads()


def env_threads():
    # CPOSEMBED_NUM_THREADS as the default reads it (0: unset, -1: invalid).
    return _env_threads()


def team(num_threads, Py_ssize_t work, Py_ssize_t chunks):
    # Threads such a call runs on; 0 if num_threads is invalid.
    return _threads_for(num_threads, work, chunks)


def user_threads(n=None):
    """set_num_threads()'s value (0: not called); with n, sets it first."""
    global _user_threads
    if n is not None:
        _user_threads = n
    return _user_threads


def cpu_limit():
    _read_cpus()
    return _cpus


def last_team():
    return _last_team


def thread_info():
    """The helper budget (room, reserved), the OS refusal, the fork rule, whether
    a region ran, the OS threads (-1: unknown), the sites where one thread wins."""
    return {"room": cpe_room_max if CPOSEMBED_OPENMP_ENABLED else 0,
            "reserved": cpe_reserved, "refused": bool(cpe_refused),
            "serial_child": bool(cpe_serial), "went_parallel": bool(cpe_entered),
            "os_threads": cpe_os_threads(), "alone_sites": cpe_sites_alone()}


def choose_threads(int kind, Py_ssize_t work, int n):
    return cpe_choose(kind, work, n)


def took_threads(int kind, Py_ssize_t work, int threads, long long ns):
    cpe_took(kind, work, threads, ns)


def set_threads_refused(bint refused):
    cpe_set_locked(&cpe_refused, refused)


def openmp_enabled():
    return bool(CPOSEMBED_OPENMP_ENABLED)


def omp_max_threads():
    return omp_get_max_threads()
