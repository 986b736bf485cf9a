# How many threads a call runs on, and how it runs on them: every rule, in
# one place (the C half is _threads.h).
#
# The default follows scikit-learn's _openmp_effective_n_threads:
# set_num_threads(n) if called, else CPOSEMBED_NUM_THREADS, else OpenMP's
# own default (omp_get_max_threads(), which honours OMP_NUM_THREADS and
# threadpoolctl), capped by the CPUs this process may run on (read again
# when they change). An explicit num_threads= on a call wins, capped at
# _OVERSUBSCRIBE times those CPUs. Then, per call: small work runs on one
# thread, and no more threads than pieces of work.
#
# A call on the default threads runs on that many or on one, whichever has
# been faster for its kind and size of late (cpe_choose, cpe_took): one
# wins only when the CPUs are taken by another busy process, and a call now
# and then on the other count tells when that changes.
#
# A kernel's parallel loop is _run_chunks: a prange over one share of
# chunks per thread, each thread claiming its own chunks front to back and
# then the others' from the back (_threads.h), on the OpenMP runtime the
# build found. The threads that runtime starts are bounded before a region
# starts (cpe_threads_here): at most _OVERSUBSCRIBE times the CPUs, less
# one, for all calling threads together; where the OS limits threads, what
# it allows. A forked child whose parent had other threads runs every call
# on its caller (a libgomp region would wait for its parent's pool).

from cython.parallel cimport prange
from libc.stdlib cimport getenv

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
    # The state (read with the GIL held; written under the lock, or by
    # the thread that owns it).
    int cpe_serial, cpe_refused, cpe_reserved, cpe_room_max, cpe_entered
    int cpe_adapting
    long cpe_alone_calls
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


# Every thread of a call gets at least this many elements of work (below
# twice this a call runs on its caller alone): waking a helper costs a few
# microseconds, about what copying this much takes, and so does setting up
# a scatter-add's chunks.
SERIAL_THRESHOLD = 1 << 16

cdef Py_ssize_t _SERIAL_BELOW = SERIAL_THRESHOLD

# An explicit num_threads may ask for up to this many times the CPUs.
cdef enum:
    _OVERSUBSCRIBE = 4

cdef int _user_threads = 0       # set_num_threads(n); 0: not set
cdef int _cpus = 1               # CPUs this process may run on (set from Python)
cdef int _last_team = 0          # threads of the last call (set with the GIL held)
cdef bint _planned_default = False  # the last plan came from the default threads


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
        if n < 100000000:
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


cdef long long _cpus_read_at = 0


cdef void _read_cpus() noexcept nogil:
    # The CPU limit again where the OS tells it (Linux: affinity and cgroup
    # quota), at most every 50 ms: os.sched_setaffinity, taskset or a new
    # quota take effect on the next calls.
    global _cpus, _cpus_read_at
    cdef long long now = cpe_now_ns()
    cdef int n
    if now - _cpus_read_at < 50000000:
        return
    _cpus_read_at = now
    n = cpe_cpus_now()
    if n >= 1 and n != _cpus:
        _cpus = n
        cpe_set_locked(&cpe_room_max, max(0, _OVERSUBSCRIBE * _cpus - 1))


cdef int _default_threads() noexcept nogil:
    # The default thread count. An invalid CPOSEMBED_NUM_THREADS is ignored
    # here (the Python layer reports it: get_num_threads warns, show_config
    # says so).
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
    if not CPOSEMBED_OPENMP_ENABLED or cpe_serial:
        return 1
    _read_cpus()
    if overflow > 0 or n > _OVERSUBSCRIBE * _cpus:
        return _OVERSUBSCRIBE * _cpus
    return <int>n


cdef int _threads_for(object num_threads, Py_ssize_t work, Py_ssize_t chunks) noexcept:
    # Threads for a call of `work` element operations in `chunks` pieces
    # (at most one per piece, and per _SERIAL_BELOW elements), or 0 when
    # num_threads is invalid. Called by the entries with the GIL
    # held, right before the kernel runs. Small work does not read the
    # default at all (it runs on one thread whatever the default is).
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


def default_threads():
    """The default thread count (get_num_threads)."""
    return _default_threads()


def env_threads():
    """CPOSEMBED_NUM_THREADS as the default thread count reads it: its value,
    0 when unset or blank, -1 when it is not a positive integer."""
    return _env_threads()


def team(num_threads, Py_ssize_t work, Py_ssize_t chunks):
    """Threads a call of `work` elements in `chunks` pieces runs on; 0 if
    num_threads is not None or an integer >= 1."""
    return _threads_for(num_threads, work, chunks)


def user_threads(n=None):
    """The value of set_num_threads(), or 0 if it was not called; with n,
    sets it first (n >= 1, checked by the caller; 0 restores the default)."""
    global _user_threads
    if n is not None:
        _user_threads = n
    return _user_threads


def set_cpu_limit(int n):
    """The CPUs this process may run on (read by the Python layer at import,
    when the affinity or quota changes, and in a forked child); all calling
    threads together may cause _OVERSUBSCRIBE times as many OpenMP threads,
    less one."""
    global _cpus, _cpus_read_at
    _cpus = max(1, n)
    _cpus_read_at = cpe_now_ns()
    cpe_set_locked(&cpe_room_max, max(0, _OVERSUBSCRIBE * _cpus - 1))


def cpu_limit():
    """The CPUs this process may run on, as the thread rules read them."""
    _read_cpus()
    return _cpus


cdef inline bint _measured(int n) noexcept:
    # Whether a kernel call planned on n threads chooses between n and one by
    # measurement (cpe_choose) and reports what it took (cpe_took): a call on
    # the default threads, planned on more than one (with the GIL held).
    return _planned_default and n > 1


def set_tuning(serial_below=None, stream_bytes=None, scan_block_bytes=None,
               chunk_elems=None, adapt=None):
    """Change the size rules (for tests that force every kernel path on small
    data): the serial threshold, the streaming-store threshold, the scan's
    cache budget, the row kernels' chunk size, and whether calls on the
    default threads choose between them and one thread by measurement
    (setting it forgets what was measured); returns the previous values as
    a dict. None keeps a value."""
    global _SERIAL_BELOW, _STREAM_BYTES, _scan_block_bytes, _chunk_elems
    old = {"serial_below": _SERIAL_BELOW, "stream_bytes": _STREAM_BYTES,
           "scan_block_bytes": _scan_block_bytes, "chunk_elems": _chunk_elems,
           "adapt": bool(cpe_adapting)}
    if chunk_elems is not None:
        _chunk_elems = max(1, <Py_ssize_t>chunk_elems)
    if adapt is not None:
        cpe_set_adapting(1 if adapt else 0)
    if serial_below is not None:
        _SERIAL_BELOW = max(0, <Py_ssize_t>serial_below)
    if stream_bytes is not None:
        _STREAM_BYTES = max(0, <Py_ssize_t>stream_bytes)
    if scan_block_bytes is not None:
        _scan_block_bytes = max(1, <Py_ssize_t>scan_block_bytes)
    return old


def last_team():
    """Threads the last kernel call of this process was planned on (for tests
    and diagnostics)."""
    return _last_team


def thread_info():
    """The threads' state: the OpenMP helper threads all calling threads
    together may cause (0 in a serial build) and have reserved, whether the
    OS refused a thread (then no more are reserved), whether this process is
    a forked child that runs every call on its caller, whether a kernel ran
    a region on several threads here, this process's OS threads as the fork
    rule counts them (-1 where they cannot be), how many calls the measured
    choice sent to one thread, and at how many sites (kinds and sizes of
    call) one thread is now the faster."""
    return {"room": cpe_room_max if CPOSEMBED_OPENMP_ENABLED else 0,
            "reserved": cpe_reserved,
            "refused": bool(cpe_refused),
            "serial_child": bool(cpe_serial),
            "went_parallel": bool(cpe_entered),
            "os_threads": cpe_os_threads(),
            "alone_calls": cpe_alone_calls,
            "alone_sites": cpe_sites_alone()}


def choose_threads(int kind, Py_ssize_t work, int n):
    """cpe_choose: the threads a default call of `kind` (a Kernel number) and
    `work` elements planned on n runs on. For tests of the rule (use a kind
    no kernel uses, KINDS - 1)."""
    return cpe_choose(kind, work, n)


def took_threads(int kind, Py_ssize_t work, int threads, long long ns):
    """cpe_took: tells the rule what such a call took on `threads`."""
    cpe_took(kind, work, threads, ns)


def set_threads_refused(bint refused):
    """Act as if the OS had refused a thread (True: reserve no more helpers),
    or allow new ones again (False). For tests."""
    cpe_set_locked(&cpe_refused, refused)


def openmp_enabled():
    """True if this extension was compiled with OpenMP."""
    return bool(CPOSEMBED_OPENMP_ENABLED)


def omp_max_threads():
    """omp_get_max_threads() of the OpenMP runtime, or 1 in a serial build."""
    return omp_get_max_threads()
