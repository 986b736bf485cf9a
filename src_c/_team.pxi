# How many OpenMP threads a call runs on: every rule, in one place.
#
# The default follows scikit-learn's _openmp_effective_n_threads:
# set_num_threads(n) if called, else CPOSEMBED_NUM_THREADS, else OpenMP's
# own default (omp_get_max_threads(), which honours OMP_NUM_THREADS and
# threadpoolctl), capped by the CPUs this process may run on. An explicit
# num_threads= on a call wins, capped at _OVERSUBSCRIBE times those CPUs (a
# request beyond that is never handed to OpenMP, whose thread creation
# fails or crashes for tens of thousands). Then, per call: small work runs
# on one thread, and no more threads than pieces of work.

from libc.stdlib cimport getenv

# Below this many elements of work a call runs on one thread: waking an
# OpenMP team costs a few microseconds, about what copying this much takes.
SERIAL_THRESHOLD = 1 << 16
# Outputs at least this large are written with streaming (non-temporal)
# stores: far beyond what the caches keep, so reading each line in before
# overwriting it (what an ordinary store does) would only double the memory
# traffic. Below it, ordinary stores leave the result in cache for the next op.
STREAM_THRESHOLD_BYTES = 1 << 23
# Fresh outputs at least this large come from the reusable blocks (_pool.pxi).
POOL_MIN_BYTES = 1 << 22

cdef Py_ssize_t _SERIAL_BELOW = SERIAL_THRESHOLD
cdef Py_ssize_t _STREAM_BYTES = STREAM_THRESHOLD_BYTES
cdef Py_ssize_t _POOL_BYTES = POOL_MIN_BYTES

# An explicit num_threads may ask for up to this many times the CPUs.
cdef enum:
    _OVERSUBSCRIBE = 4

cdef int _user_threads = 0       # set_num_threads(n); 0: not set
cdef int _cpus = 1               # CPUs this process may run on (set from Python)
cdef bint _serial_child = False  # a forked child that must not start threads
cdef bint _went_parallel = False  # a parallel region ran in this process
cdef int _last_team = 0          # threads of the last call (set with the GIL held)


cdef int _env_threads() noexcept nogil:
    # CPOSEMBED_NUM_THREADS as plain decimal digits (white space around
    # allowed): its value; unset or blank: 0; anything else: -1.
    cdef const char* raw = getenv("CPOSEMBED_NUM_THREADS")
    cdef long n = 0
    cdef int digits = 0
    if raw == NULL:
        return 0
    while raw[0] == 32 or (9 <= raw[0] <= 13):
        raw += 1
    while 48 <= raw[0] <= 57:
        if digits < 9:
            n = n * 10 + (raw[0] - 48)
        else:
            n = 1000000000  # more threads than any cap: capped below
        digits += 1
        raw += 1
    while raw[0] == 32 or (9 <= raw[0] <= 13):
        raw += 1
    if raw[0] != 0 or (digits > 0 and n < 1):
        return -1
    return <int>n


cdef int _default_threads() noexcept nogil:
    # The default thread count. An invalid CPOSEMBED_NUM_THREADS is ignored
    # here (the Python layer reports it: get_num_threads warns, show_config
    # says so).
    cdef int n
    if not CPOSEMBED_OPENMP_ENABLED or _serial_child:
        return 1
    n = _user_threads
    if n == 0:
        n = _env_threads()
        if n <= 0:
            n = omp_get_max_threads()
    return max(1, min(n, _cpus))


cdef int _explicit_threads(object num_threads) noexcept:
    # An explicit num_threads: >= 1 (capped), or 0 when it is not an integer
    # >= 1 (bools excluded).
    cdef int overflow = 0
    cdef long long n
    if not _is_integer(num_threads):
        return 0
    try:
        n = PyLong_AsLongLongAndOverflow(num_threads, &overflow)
    except Exception:
        return 0
    if overflow < 0 or (overflow == 0 and n < 1):
        return 0
    if not CPOSEMBED_OPENMP_ENABLED or _serial_child:
        return 1
    if overflow > 0 or n > _OVERSUBSCRIBE * _cpus:
        return _OVERSUBSCRIBE * _cpus
    return <int>n


cdef int _threads_for(object num_threads, Py_ssize_t work, Py_ssize_t chunks) noexcept:
    # Threads for a call of `work` element operations in `chunks` pieces,
    # or 0 when num_threads is invalid. Called by the entries with the GIL
    # held, right before the kernel runs. Small work does not read the
    # default at all (it runs on one thread whatever the default is).
    global _went_parallel, _last_team
    cdef int n
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
    if n > 1:
        _went_parallel = True
    _last_team = n
    return n


def default_threads():
    """The default thread count (get_num_threads)."""
    return _default_threads()


def team(num_threads, Py_ssize_t work, Py_ssize_t chunks):
    """Threads a call of `work` elements in `chunks` pieces runs on; 0 if
    num_threads is not None or an integer >= 1."""
    return _threads_for(num_threads, work, chunks)


def set_user_threads(int n):
    """set_num_threads(n) (n >= 1, checked by the caller); 0 restores the default."""
    global _user_threads
    _user_threads = n


def user_threads():
    """The value of set_num_threads(), or 0 if it was not called."""
    return _user_threads


def set_cpu_limit(int n):
    """The CPUs this process may run on (read by the Python layer at import
    and in a forked child)."""
    global _cpus
    _cpus = max(1, n)


def cpu_limit():
    return _cpus


def set_serial_child(bint serial):
    """Run everything on one thread (a forked child whose parent's OpenMP
    pool could not be released)."""
    global _serial_child
    _serial_child = serial


def serial_child():
    return _serial_child


def set_tuning(serial_below=None, stream_bytes=None, scan_block_bytes=None):
    """Change the size rules (for tests that force every kernel path on small
    data); returns the previous values as a dict. None keeps a value."""
    global _SERIAL_BELOW, _STREAM_BYTES, _scan_block_bytes
    old = {"serial_below": _SERIAL_BELOW, "stream_bytes": _STREAM_BYTES,
           "scan_block_bytes": _scan_block_bytes}
    if serial_below is not None:
        _SERIAL_BELOW = max(0, <Py_ssize_t>serial_below)
    if stream_bytes is not None:
        _STREAM_BYTES = max(0, <Py_ssize_t>stream_bytes)
    if scan_block_bytes is not None:
        _scan_block_bytes = max(1, <Py_ssize_t>scan_block_bytes)
    return old


def last_team():
    """Threads the last kernel call of this process ran on (for tests and diagnostics)."""
    return _last_team


def went_parallel():
    """Whether a parallel region has run in this process."""
    return _went_parallel


def openmp_enabled():
    """True if this extension was compiled with OpenMP."""
    return bool(CPOSEMBED_OPENMP_ENABLED)


def omp_max_threads():
    """omp_get_max_threads() of the OpenMP runtime, or 1 in a serial build."""
    return omp_get_max_threads()


def streaming_stores_available():
    """True if this build streams large outputs with non-temporal stores (x86-64 SSE2)."""
    return bool(cpe_have_stream())
