# How many threads a call runs on, and the team that runs them: every rule,
# in one place.
#
# The default follows scikit-learn's _openmp_effective_n_threads:
# set_num_threads(n) if called, else CPOSEMBED_NUM_THREADS, else OpenMP's
# own default (omp_get_max_threads(), which honours OMP_NUM_THREADS and
# threadpoolctl), capped by the CPUs this process may run on. An explicit
# num_threads= on a call wins, capped at _OVERSUBSCRIBE times those CPUs.
# Then, per call: small work runs on one thread, and no more threads than
# pieces of work.
#
# The kernels do not enter OpenMP parallel regions (libgomp keeps a pool of
# threads per calling thread, and exits the process when it cannot start
# one): a call's work runs on the package's own team. A kernel planned on
# n threads first borrows up to n - 1 idle helpers from one fixed set of
# package-owned threads (cpe_crew_borrow); with none free it takes its
# one-thread path. Else it splits its work into chunks and its caller starts
# on them at once while the helpers are woken (cpe_crew_run). Each thread
# first gets one contiguous share of the chunks (what OpenMP's static
# schedule gives: a streaming kernel runs on one long run per thread, which
# the prefetchers follow); it claims its own chunks front to back, and when
# its share is empty it steals the last chunks of the others' shares, one at
# a time, so a helper that its CPU gives no time to simply runs fewer chunks
# (or none). What a chunk
# covers is fixed by the kernel (each table row lies in one chunk and sums
# its contributions in input order), so only which thread runs a chunk
# varies, never a result. The caller waits only for helpers that have
# started a chunk; one that has not is called off. Helpers spin briefly
# after their last chunk (back-to-back calls find them awake), then sleep on
# a condition variable; a caller waiting for a helper's last chunk does the
# same: a waiting thread does not take the CPU another process needs. A call
# that its helpers did not make clearly faster than its caller alone would
# have been (a helper or the caller lost its CPU to another process midway),
# or one that found two of its threads on one CPU (a busy machine had no CPU
# free for a helper; such a helper leaves its share to its caller at once),
# sends the calls of the next 20 ms to 2 s to their callers alone (cpe_judge;
# tests may set a longer shortest back-off, set_tuning(backoff_s=)).
# The set of helpers is bounded (_OVERSUBSCRIBE times the CPUs, less one),
# however many Python threads call at once. Helpers are started on first
# need; if the OS refuses one, the call runs with those it has (serially
# with none) and no more are started. A forked child starts with no helpers
# (pthread_atfork) and starts its own when it needs them.

from libc.stdlib cimport getenv

cdef extern from *:
    """
    /* The package's team (see the top of _team.pxi). POSIX threads; on
     * other platforms, and in a build without OpenMP, there are no helpers
     * and every call runs on its caller. */
    #if CPOSEMBED_OPENMP_ENABLED && !defined(_WIN32)
    #define CPE_TEAM 1
    #include <pthread.h>
    #include <signal.h>
    #include <time.h>
    #if defined(__linux__)
    #include <sched.h>
    #endif
    #else
    #define CPE_TEAM 0
    #endif

    typedef void (*cpe_chunk_fn)(void *arg, Py_ssize_t chunk);

    #define CPE_CREW_MAX 64
    #define CPE_BACKOFF_MIN 20000000LL      /* ns: the shortest back-off (below) */
    #define CPE_BACKOFF_MAX 2000000000LL    /* ns: the longest */
    #if CPE_TEAM
    /* The CPU the calling thread runs on, or -1 where that is unknown. */
    static inline int cpe_cpu(void) {
    #if defined(__linux__)
        return sched_getcpu();
    #else
        return -1;
    #endif
    }

    /* One thread's share of a call's chunks: [lo, hi) packed as lo << 32 | hi,
     * on a cache line of its own. Its owner claims from the front (lo),
     * others steal from the back (hi). */
    typedef struct {
        unsigned long long v;
        char pad[64 - sizeof(unsigned long long)];
    } cpe_share;

    /* One call's work: chunks 0..n_chunks-1 of fn(arg, chunk), cut into one
     * contiguous share per thread (share 0: the caller's; 1 + i: its i-th
     * helper's); a thread whose share is empty steals from the backs of the
     * others. Lives on the caller's stack. */
    typedef struct {
        cpe_chunk_fn fn;
        void *arg;
        Py_ssize_t n_chunks;
        int n_shares;
        int caller_cpu;         /* the CPU the caller started on (-1: unknown) */
        cpe_share share[CPE_CREW_MAX + 1] __attribute__((aligned(64)));
    } cpe_job;

    static void cpe_job_init(cpe_job *job, cpe_chunk_fn fn, void *arg, Py_ssize_t n_chunks,
                             int n_threads) {
        int t;
        job->fn = fn;
        job->arg = arg;
        job->n_chunks = n_chunks;
        job->n_shares = n_threads;
        job->caller_cpu = cpe_cpu();
        for (t = 0; t < n_threads; t++) {
            unsigned long long lo = (unsigned long long)(n_chunks * t / n_threads);
            unsigned long long hi = (unsigned long long)(n_chunks * (t + 1) / n_threads);
            job->share[t].v = lo << 32 | hi;
        }
    }

    /* The next chunk for thread t (its share's front, else the back of
     * another's), or -1 when none is left. */
    static Py_ssize_t cpe_claim(cpe_job *job, int t) {
        unsigned long long v;
        int k;
        v = __atomic_fetch_add(&job->share[t].v, 1ULL << 32, __ATOMIC_RELAXED);
        if ((v >> 32) < (v & 0xffffffffULL)) return (Py_ssize_t)(v >> 32);
        for (k = 1; k < job->n_shares; k++) {
            cpe_share *s = &job->share[(t + k) % job->n_shares];
            v = __atomic_load_n(&s->v, __ATOMIC_RELAXED);
            while ((v >> 32) < (v & 0xffffffffULL)) {
                if (__atomic_compare_exchange_n(&s->v, &v, v - 1, 0, __ATOMIC_RELAXED,
                                                __ATOMIC_RELAXED))
                    return (Py_ssize_t)(v & 0xffffffffULL) - 1;
            }
        }
        return -1;
    }

    /* Runs chunks as thread t until none is left. */
    static void cpe_job_run(cpe_job *job, int t) {
        Py_ssize_t c;
        while ((c = cpe_claim(job, t)) >= 0) job->fn(job->arg, c);
    }

    /* A helper's state: who may touch its `job`, and who sleeps on `cv`.
     * FREE (idle, awake) -> ASSIGNED (by a caller) -> RUNNING (the helper
     * took it) -> DONE -> FREE (the caller gives it back). A caller that
     * finds its helper still ASSIGNED at the end sets it FREE again: the
     * helper never read the job and never will. The *_SLEEP states: the
     * helper sleeps on cv; RUNNING_WAITED: the caller does. */
    enum { H_FREE, H_FREE_SLEEP, H_ASSIGNED, H_RUNNING, H_RUNNING_WAITED, H_DONE,
           H_DONE_SLEEP };

    typedef struct {
        int state;
        int share;              /* its share of the job */
        int cpu[2];             /* the CPU it ran on at its run's start and end */
        cpe_job *job;
        pthread_mutex_t mu;
        pthread_cond_t cv;
    } cpe_helper;

    #define CPE_MAX_HELPERS 64
    static cpe_helper cpe_helpers[CPE_MAX_HELPERS];
    static int cpe_idle[CPE_MAX_HELPERS];   /* stack of idle helpers' numbers */
    static int cpe_n_idle = 0;
    static int cpe_n_started = 0;
    static int cpe_max_helpers = 0;         /* set from the CPU count */
    static int cpe_refused = 0;             /* the OS refused a thread: start no more */
    static long cpe_spin_ns = 20000;        /* how long an idle thread spins before sleeping */
    #define CPE_FINISH_SPIN_MAX 1000000L    /* ns: the longest a caller spins for a chunk */
    /* After a call that took longer with helpers than it would have alone,
     * calls run on their callers alone until cpe_serial_until (ns,
     * CLOCK_MONOTONIC): for cpe_backoff_ns, doubled while such calls keep
     * coming (up to CPE_BACKOFF_MAX), back to cpe_backoff_min once they
     * stop. cpe_backoff_min is CPE_BACKOFF_MIN unless a test set it (to
     * anything up to an hour, which then also wins over CPE_BACKOFF_MAX). */
    static long long cpe_serial_until = 0;
    static long long cpe_backoff_min = CPE_BACKOFF_MIN;
    static long long cpe_backoff_ns = CPE_BACKOFF_MIN;
    static long long cpe_last_loss = 0;
    static long cpe_losses = 0;
    static long cpe_helped = 0;             /* calls a helper took part in */
    static long cpe_shared = 0;             /* calls whose threads shared a CPU */
    static int cpe_judging = 1;             /* 0: never back off (tests) */
    static pthread_mutex_t cpe_pool_mu = PTHREAD_MUTEX_INITIALIZER;

    static inline int cpe_ld(int *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static inline int cpe_cas(int *p, int from, int to) {
        return __atomic_compare_exchange_n(p, &from, to, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }
    static inline long long cpe_now_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    }
    /* What a caller's own chunks took: how many, their sum and the
     * longest (ns). */
    typedef struct {
        Py_ssize_t n;
        long long sum, longest;
        int cpu[2];             /* the CPU the caller ran on at the start and end */
    } cpe_pace;

    /* cpe_job_run, timing each chunk. */
    static void cpe_job_run_timed(cpe_job *job, cpe_pace *pace) {
        Py_ssize_t c;
        long long t0 = cpe_now_ns(), t1;
        pace->n = 0;
        pace->sum = pace->longest = 0;
        pace->cpu[0] = job->caller_cpu;
        while ((c = cpe_claim(job, 0)) >= 0) {
            job->fn(job->arg, c);
            t1 = cpe_now_ns();
            pace->n++;
            pace->sum += t1 - t0;
            if (t1 - t0 > pace->longest) pace->longest = t1 - t0;
            t0 = t1;
        }
        pace->cpu[1] = cpe_cpu();
    }

    static inline void cpe_pause(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #elif defined(__aarch64__)
        __asm__ __volatile__("yield");
    #endif
    }

    /* Spins while h->state == v, for at most cpe_spin_ns; the state last seen. */
    static int cpe_spin_while_ns(cpe_helper *h, int v, long spin_ns) {
        long long t0 = 0;
        unsigned k = 0;
        int s;
        while ((s = cpe_ld(&h->state)) == v) {
            cpe_pause();
            if ((++k & 63) == 0) {
                long long t = cpe_now_ns();
                if (t0 == 0) t0 = t;
                else if (t - t0 > spin_ns) break;
            }
        }
        return s;
    }
    static int cpe_spin_while(cpe_helper *h, int v) {
        return cpe_spin_while_ns(h, v, __atomic_load_n(&cpe_spin_ns, __ATOMIC_RELAXED));
    }

    /* Sleeps while the state is `asleep`, if it can move it from `awake`. */
    static void cpe_sleep(cpe_helper *h, int awake, int asleep) {
        pthread_mutex_lock(&h->mu);
        if (cpe_cas(&h->state, awake, asleep))
            while (cpe_ld(&h->state) == asleep) pthread_cond_wait(&h->cv, &h->mu);
        pthread_mutex_unlock(&h->mu);
    }

    /* Sets the state to v; wakes the sleeper if it was `asleep`. */
    static void cpe_set(cpe_helper *h, int v, int asleep) {
        if (__atomic_exchange_n(&h->state, v, __ATOMIC_ACQ_REL) == asleep) {
            pthread_mutex_lock(&h->mu);
            pthread_cond_broadcast(&h->cv);
            pthread_mutex_unlock(&h->mu);
        }
    }

    static void *cpe_helper_main(void *arg) {
        cpe_helper *h = (cpe_helper *)arg;
        for (;;) {
            int s = cpe_ld(&h->state);
            if (s == H_ASSIGNED) {
                if (cpe_cas(&h->state, H_ASSIGNED, H_RUNNING)) {
                    /* On its caller's CPU, the two would take turns: it
                     * leaves its share to the caller (and the call counts
                     * as one whose threads shared a CPU). */
                    h->cpu[0] = h->cpu[1] = cpe_cpu();
                    if (h->cpu[0] < 0 || h->cpu[0] != h->job->caller_cpu) {
                        cpe_job_run(h->job, h->share);
                        h->cpu[1] = cpe_cpu();
                    }
                    cpe_set(h, H_DONE, H_RUNNING_WAITED);
                }
                continue;
            }
            /* FREE or DONE: spin a little, then sleep until it changes. */
            if (cpe_spin_while(h, s) == s)
                cpe_sleep(h, s, s == H_DONE ? H_DONE_SLEEP : H_FREE_SLEEP);
        }
        return NULL;
    }

    /* Starts helper number i (pool lock held); 0 if the OS refused. */
    static int cpe_start_helper(int i) {
        cpe_helper *h = &cpe_helpers[i];
        pthread_attr_t attr;
        pthread_t thread;
        sigset_t all, old;
        int rc;
        h->state = H_FREE;
        h->job = NULL;
        pthread_mutex_init(&h->mu, NULL);
        pthread_cond_init(&h->cv, NULL);
        if (pthread_attr_init(&attr) != 0) return 0;
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        /* Signals go to the interpreter's threads, never to a helper. */
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        rc = pthread_create(&thread, &attr, cpe_helper_main, h);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
        return rc == 0;
    }

    /* Up to `want` idle helpers into got[]; starts new ones up to the cap. */
    static int cpe_borrow(int *got, int want) {
        int n = 0;
        pthread_mutex_lock(&cpe_pool_mu);
        while (n < want && cpe_n_idle > 0) got[n++] = cpe_idle[--cpe_n_idle];
        while (n < want && !cpe_refused && cpe_n_started < cpe_max_helpers) {
            if (!cpe_start_helper(cpe_n_started)) {
                __atomic_store_n(&cpe_refused, 1, __ATOMIC_RELAXED);
                break;
            }
            got[n++] = cpe_n_started;
            __atomic_store_n(&cpe_n_started, cpe_n_started + 1, __ATOMIC_RELAXED);
        }
        pthread_mutex_unlock(&cpe_pool_mu);
        return n;
    }

    /* A call that took `took` ns with helpers, where its caller ran its
     * own chunks at `pace`: unless the helpers made it at least 10 % and
     * 5 us faster than its caller alone would have been (all n_chunks at
     * the caller's pace), calls run alone for a while. The pace leaves out
     * the caller's longest chunk, where the scheduler most likely took its
     * CPU away. A helper its CPU gives no
     * time to in the middle of a chunk holds its caller up for as long as
     * the scheduler keeps it off, and a caller its own helper displaces
     * waits as long (milliseconds on a busy machine): this is how the team
     * learns that the machine is busy. A call with two of its threads seen
     * on one CPU (`shared`, cpe_crew_shared) counts as slower whatever it
     * took: its caller's pace, which the estimate rests on, was then slowed
     * by its own helper or by the other process on its CPU, while a caller
     * alone would have had a CPU of its own. */
    static int cpe_is_loss(long long took, const cpe_pace *pace, Py_ssize_t n_chunks,
                           int shared) {
        double alone;
        if (pace->n <= 0) return 0;
        if (pace->n == 1)
            alone = (double)pace->sum * (double)n_chunks;
        else
            alone = (double)(pace->sum - pace->longest) / (double)(pace->n - 1)
                    * (double)n_chunks;
        return shared || (double)took > 0.9 * alone - 5000.0;
    }
    static void cpe_judge(long long took, const cpe_pace *pace, Py_ssize_t n_chunks,
                          int shared, long long now) {
        if (!cpe_is_loss(took, pace, n_chunks, shared)) return;
        pthread_mutex_lock(&cpe_pool_mu);
        if (now - cpe_last_loss < 4 * cpe_backoff_ns) {
            cpe_backoff_ns *= 2;
            if (cpe_backoff_ns > CPE_BACKOFF_MAX) cpe_backoff_ns = CPE_BACKOFF_MAX;
            if (cpe_backoff_ns < cpe_backoff_min) cpe_backoff_ns = cpe_backoff_min;
        } else {
            cpe_backoff_ns = cpe_backoff_min;
        }
        cpe_last_loss = now;
        __atomic_add_fetch(&cpe_losses, 1, __ATOMIC_RELAXED);
        __atomic_store_n(&cpe_serial_until, now + cpe_backoff_ns, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&cpe_pool_mu);
    }

    /* Whether two of a call's threads were seen on one CPU: the caller
     * (`pace`) and the helpers in took[] that took part, each seen at the
     * start and the end of its run. A helper woken onto a CPU that one of
     * the call's threads is using means the machine had no CPU free for it:
     * the threads take turns there. */
    static int cpe_crew_shared(const cpe_pace *pace, const int *got, const int *took, int n) {
        int seen[2 * (CPE_CREW_MAX + 1)];
        int n_seen = 0, i, k, j;
        for (k = 0; k < 2; k++) seen[n_seen++] = pace->cpu[k];
        for (i = 0; i < n; i++) {
            if (!took[i]) continue;
            for (k = 0; k < 2; k++) {
                int cpu = cpe_helpers[got[i]].cpu[k];
                if (cpu < 0) continue;
                for (j = 0; j < n_seen; j++)  /* the other threads' CPUs */
                    if (seen[j] == cpu) return 1;
            }
            for (k = 0; k < 2; k++) seen[n_seen++] = cpe_helpers[got[i]].cpu[k];
        }
        return 0;
    }

    static void cpe_give_back(const int *got, int n) {
        int i;
        pthread_mutex_lock(&cpe_pool_mu);
        for (i = 0; i < n; i++) cpe_idle[cpe_n_idle++] = got[i];
        pthread_mutex_unlock(&cpe_pool_mu);
    }

    /* The end of a helper's part in a call: called off if it never started,
     * else waited for (it is in its last chunk): spinning for up to
     * `spin_ns`, then asleep; then FREE again. */
    static int cpe_finish(cpe_helper *h, long spin_ns) {
        /* 1 if the helper took part (it started on the call's chunks before the
         * caller finished them), 0 if it was called off. */
        if (cpe_cas(&h->state, H_ASSIGNED, H_FREE)) return 0;
        if (cpe_spin_while_ns(h, H_RUNNING, spin_ns) == H_RUNNING)
            cpe_sleep(h, H_RUNNING, H_RUNNING_WAITED);
        cpe_set(h, H_FREE, H_DONE_SLEEP);
        return 1;
    }

    /* A fork copies no helper thread: the child starts with none. The lock
     * is held across the fork, so the child's copy of the pool is whole. */
    static void cpe_fork_prepare(void) { pthread_mutex_lock(&cpe_pool_mu); }
    static void cpe_fork_parent(void) { pthread_mutex_unlock(&cpe_pool_mu); }
    static void cpe_fork_child(void) {
        /* The forking thread took the lock in cpe_fork_prepare and is the
         * child's only thread: it releases it (re-initialising a locked
         * mutex is undefined). */
        pthread_mutex_unlock(&cpe_pool_mu);
        cpe_n_idle = 0;
        cpe_n_started = 0;
        cpe_refused = 0;
        cpe_serial_until = 0;
        cpe_backoff_ns = cpe_backoff_min;
        cpe_last_loss = 0;
        cpe_losses = 0;
        cpe_helped = 0;
        cpe_shared = 0;
    }
    static void cpe_team_init(void) {
        pthread_atfork(cpe_fork_prepare, cpe_fork_parent, cpe_fork_child);
    }
    static void cpe_team_set_max(int n) {
        pthread_mutex_lock(&cpe_pool_mu);
        cpe_max_helpers = n < 0 ? 0 : (n > CPE_MAX_HELPERS ? CPE_MAX_HELPERS : n);
        pthread_mutex_unlock(&cpe_pool_mu);
    }
    static int cpe_team_started(void) { return __atomic_load_n(&cpe_n_started, __ATOMIC_RELAXED); }
    static int cpe_team_refused(void) { return __atomic_load_n(&cpe_refused, __ATOMIC_RELAXED); }
    static long cpe_team_losses(void) { return __atomic_load_n(&cpe_losses, __ATOMIC_RELAXED); }
    static long cpe_team_helped(void) { return __atomic_load_n(&cpe_helped, __ATOMIC_RELAXED); }
    static long cpe_team_shared(void) { return __atomic_load_n(&cpe_shared, __ATOMIC_RELAXED); }
    static int cpe_team_max(void) { return __atomic_load_n(&cpe_max_helpers, __ATOMIC_RELAXED); }
    static int cpe_team_available(void) { return 1; }
    static void cpe_team_set_spin(long ns) {
        __atomic_store_n(&cpe_spin_ns, ns < 0 ? 0 : ns, __ATOMIC_RELAXED);
    }
    static long cpe_team_spin(void) { return __atomic_load_n(&cpe_spin_ns, __ATOMIC_RELAXED); }
    /* For tests: judging on or off, and the shortest back-off (ns; <= 0
     * keeps it); either way the back-off ends now. */
    static void cpe_team_set_judging(int on, long long backoff_min_ns) {
        pthread_mutex_lock(&cpe_pool_mu);
        cpe_judging = on;
        if (backoff_min_ns > 0)
            __atomic_store_n(&cpe_backoff_min, backoff_min_ns, __ATOMIC_RELAXED);
        __atomic_store_n(&cpe_serial_until, 0, __ATOMIC_RELAXED);
        cpe_backoff_ns = cpe_backoff_min;
        cpe_last_loss = 0;
        pthread_mutex_unlock(&cpe_pool_mu);
    }
    static int cpe_team_judging(void) { return __atomic_load_n(&cpe_judging, __ATOMIC_RELAXED); }
    static long long cpe_team_backoff_min(void) {
        return __atomic_load_n(&cpe_backoff_min, __ATOMIC_RELAXED);
    }
    /* For tests: cpe_is_loss of a call whose caller's chunks took
     * n, sum and longest ns. */
    static int cpe_team_is_loss(long long took, Py_ssize_t n, long long sum, long long longest,
                                Py_ssize_t n_chunks, int shared) {
        cpe_pace pace;
        pace.n = n;
        pace.sum = sum;
        pace.longest = longest;
        pace.cpu[0] = pace.cpu[1] = -1;
        return cpe_is_loss(took, &pace, n_chunks, shared);
    }
    /* For tests: as if the OS had refused (or again allowed) new threads. */
    static void cpe_team_set_refused(int refused) {
        pthread_mutex_lock(&cpe_pool_mu);
        cpe_refused = refused;
        pthread_mutex_unlock(&cpe_pool_mu);
    }
    #endif

    /* The helpers one call has borrowed (cpe_crew_borrow), until it has run
     * its chunks with them (cpe_crew_run gives them back). */
    typedef struct {
        int n;
        int got[CPE_CREW_MAX];
    } cpe_crew;

    /* Borrows up to n_threads - 1 idle helpers for a call; returns the
     * threads the call has, its caller included (1: run alone, nothing to
     * give back). None while the team learns the machine is busy. Without
     * the GIL. */
    static int cpe_crew_borrow(cpe_crew *crew, int n_threads) {
        crew->n = 0;
    #if CPE_TEAM
        {
            int want = n_threads - 1;
            if (want > CPE_CREW_MAX) want = CPE_CREW_MAX;
            if (want > 0 &&
                cpe_now_ns() >= __atomic_load_n(&cpe_serial_until, __ATOMIC_RELAXED))
                crew->n = cpe_borrow(crew->got, want);
        }
    #endif
        return 1 + crew->n;
    }

    /* Runs fn(arg, c) for c < n_chunks on the caller and its crew, each
     * chunk on whichever is free, then gives the crew back. */
    static void cpe_crew_run(cpe_crew *crew, cpe_chunk_fn fn, void *arg,
                             Py_ssize_t n_chunks) {
        Py_ssize_t c;
    #if CPE_TEAM
        if (crew->n > 0) {
            cpe_job job;
            int i;
            long long t_start = cpe_now_ns(), t_end;
            long spin;
            int helped, shared, took[CPE_CREW_MAX];
            cpe_pace pace;
            cpe_job_init(&job, fn, arg, n_chunks, 1 + crew->n);
            for (i = 0; i < crew->n; i++) {
                cpe_helpers[crew->got[i]].job = &job;
                cpe_helpers[crew->got[i]].share = 1 + i;
                cpe_set(&cpe_helpers[crew->got[i]], H_ASSIGNED, H_FREE_SLEEP);
            }
            cpe_job_run_timed(&job, &pace);
            /* A running helper ends its last chunk within about one chunk's
             * time unless its CPU was taken away: the caller spins that long
             * (at least cpe_spin_ns, at most CPE_FINISH_SPIN_MAX) before it
             * sleeps, so an idle machine does not pay a wake-up per call. */
            spin = cpe_team_spin();
            if (spin > 0 && pace.n > 0 && pace.sum / pace.n > spin)
                spin = pace.sum / pace.n < CPE_FINISH_SPIN_MAX ? (long)(pace.sum / pace.n)
                                                               : CPE_FINISH_SPIN_MAX;
            helped = 0;
            for (i = 0; i < crew->n; i++) {
                took[i] = cpe_finish(&cpe_helpers[crew->got[i]], spin);
                helped |= took[i];
            }
            if (helped) __atomic_add_fetch(&cpe_helped, 1, __ATOMIC_RELAXED);
            shared = helped && cpe_crew_shared(&pace, crew->got, took, crew->n);
            if (shared) __atomic_add_fetch(&cpe_shared, 1, __ATOMIC_RELAXED);
            cpe_give_back(crew->got, crew->n);
            crew->n = 0;
            t_end = cpe_now_ns();
            if (cpe_team_judging()) cpe_judge(t_end - t_start, &pace, n_chunks, shared, t_end);
            return;
        }
    #endif
        for (c = 0; c < n_chunks; c++) fn(arg, c);
    }
    #if !CPE_TEAM
    static void cpe_team_init(void) {}
    static void cpe_team_set_max(int n) { (void)n; }
    static int cpe_team_started(void) { return 0; }
    static int cpe_team_refused(void) { return 0; }
    static long cpe_team_losses(void) { return 0; }
    static void cpe_team_set_spin(long ns) { (void)ns; }
    static long cpe_team_spin(void) { return 0; }
    static void cpe_team_set_refused(int refused) { (void)refused; }
    static long cpe_team_helped(void) { return 0; }
    static long cpe_team_shared(void) { return 0; }
    static int cpe_team_max(void) { return 0; }
    static int cpe_team_available(void) { return 0; }
    static void cpe_team_set_judging(int on, long long backoff_min_ns) {
        (void)on; (void)backoff_min_ns;
    }
    static int cpe_team_judging(void) { return 1; }
    static long long cpe_team_backoff_min(void) { return CPE_BACKOFF_MIN; }
    static int cpe_team_is_loss(long long took, Py_ssize_t n, long long sum, long long longest,
                                Py_ssize_t n_chunks, int shared) {
        (void)took; (void)n; (void)sum; (void)longest; (void)n_chunks; (void)shared;
        return 0;
    }
    #endif
    """
    ctypedef void (*cpe_chunk_fn)(void* arg, Py_ssize_t chunk) noexcept nogil
    ctypedef struct cpe_crew:
        pass
    int cpe_crew_borrow(cpe_crew* crew, int n_threads) noexcept nogil
    void cpe_crew_run(cpe_crew* crew, cpe_chunk_fn fn, void* arg,
                      Py_ssize_t n_chunks) noexcept nogil
    void cpe_team_init() noexcept nogil
    void cpe_team_set_max(int n) noexcept nogil
    int cpe_team_started() noexcept nogil
    int cpe_team_refused() noexcept nogil
    long cpe_team_losses() noexcept nogil
    void cpe_team_set_spin(long ns) noexcept nogil
    long cpe_team_spin() noexcept nogil
    void cpe_team_set_refused(int refused) noexcept nogil
    long cpe_team_helped() noexcept nogil
    long cpe_team_shared() noexcept nogil
    int cpe_team_max() noexcept nogil
    int cpe_team_available() noexcept nogil
    void cpe_team_set_judging(int on, long long backoff_min_ns) noexcept nogil
    int cpe_team_judging() noexcept nogil
    long long cpe_team_backoff_min() noexcept nogil
    int cpe_team_is_loss(long long took, Py_ssize_t n, long long sum, long long longest,
                         Py_ssize_t n_chunks, int shared) noexcept nogil

cpe_team_init()

# Every thread of a call gets at least this many elements of work (below
# twice this a call runs on its caller alone): waking a helper costs a few
# microseconds, about what copying this much takes, and so does setting up
# a scatter-add's chunks.
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
cdef bint _went_parallel = False  # a call was planned on more than one thread
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


cdef int _default_threads() noexcept nogil:
    # The default thread count. An invalid CPOSEMBED_NUM_THREADS is ignored
    # here (the Python layer reports it: get_num_threads warns, show_config
    # says so).
    cdef int n
    if not cpe_team_available():  # 0 in a serial build and where there is no team
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
    if not cpe_team_available():
        return 1
    if overflow > 0 or n > _OVERSUBSCRIBE * _cpus:
        return _OVERSUBSCRIBE * _cpus
    return <int>n


cdef int _threads_for(object num_threads, Py_ssize_t work, Py_ssize_t chunks) noexcept:
    # Threads for a call of `work` element operations in `chunks` pieces
    # (at most one per piece, and per _SERIAL_BELOW elements), or 0 when
    # num_threads is invalid. Called by the entries with the GIL
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
    if n > 1 and _SERIAL_BELOW > 0 and work // _SERIAL_BELOW < n:
        n = <int>(work // _SERIAL_BELOW)
    if n > 1:
        _went_parallel = True
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


def set_user_threads(int n):
    """set_num_threads(n) (n >= 1, checked by the caller); 0 restores the default."""
    global _user_threads
    _user_threads = n


def user_threads():
    """The value of set_num_threads(), or 0 if it was not called."""
    return _user_threads


def set_cpu_limit(int n):
    """The CPUs this process may run on (read by the Python layer at import
    and in a forked child); the team may hold _OVERSUBSCRIBE times as many
    threads, the callers included."""
    global _cpus
    _cpus = max(1, n)
    cpe_team_set_max(_OVERSUBSCRIBE * _cpus - 1)


def cpu_limit():
    return _cpus


def set_tuning(serial_below=None, stream_bytes=None, scan_block_bytes=None,
               chunk_elems=None, judge=None, backoff_s=None):
    """Change the size rules (for tests that force every kernel path on small
    data): the serial threshold, the streaming-store threshold, the scan's
    cache budget, the row kernels' chunk size, whether the team backs off
    after calls its helpers did not speed up, and the shortest such back-off
    in seconds (setting either of the last two ends a back-off); returns the
    previous values as a dict. None keeps a value."""
    global _SERIAL_BELOW, _STREAM_BYTES, _scan_block_bytes, _chunk_elems
    old = {"serial_below": _SERIAL_BELOW, "stream_bytes": _STREAM_BYTES,
           "scan_block_bytes": _scan_block_bytes, "chunk_elems": _chunk_elems,
           "judge": bool(cpe_team_judging()),
           "backoff_s": cpe_team_backoff_min() * 1e-9}
    cdef double backoff = 0.0
    if backoff_s is not None:
        backoff = backoff_s
        if not 1e-6 <= backoff <= 3600.0:
            raise ValueError(f"backoff_s must be from 1e-6 to 3600 seconds, got {backoff_s!r}")
    if chunk_elems is not None:
        _chunk_elems = max(1, <Py_ssize_t>chunk_elems)
    if judge is not None or backoff_s is not None:
        cpe_team_set_judging(
            cpe_team_judging() if judge is None else (1 if judge else 0),
            0 if backoff_s is None else <long long>(backoff * 1e9))
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
    """Whether a call in this process was planned on more than one thread."""
    return _went_parallel


def team_info():
    """The team's state: a dict of the helper threads started in this
    process, the most it may start (0 where there is no team: a serial
    build, Windows), whether the OS refused one, how many calls took longer
    with helpers than they would have alone (each sends the following calls
    to their callers alone for a while), how many calls a helper took part
    in (started on the chunks before its caller had finished them), and how
    many of those had two of their threads on one CPU (the machine had none
    free for a helper: each such call counts as slower than alone)."""
    return {"started": cpe_team_started(),
            "max": cpe_team_max(),
            "refused": bool(cpe_team_refused()), "losses": cpe_team_losses(),
            "helped": cpe_team_helped(), "shared": cpe_team_shared()}


def set_team_spin(long ns):
    """How long (ns) an idle helper, or a caller waiting for one, spins
    before it sleeps; returns the previous value (for the bench and tests)."""
    cdef long old = cpe_team_spin()
    cpe_team_set_spin(ns)
    return old


def team_judges_loss(long long took_ns, chunks_ns, Py_ssize_t n_chunks, bint shared):
    """Whether the team counts a call as slower than its caller alone (and
    backs off): the call took took_ns with helpers, its caller's own chunks
    took chunks_ns (a sequence of ns), the call had n_chunks, and two of its
    threads were seen on one CPU (shared). False where there is no team. For
    tests of the rule."""
    cdef long long c, total = 0, longest = 0
    cdef Py_ssize_t n = 0
    for value in chunks_ns:
        if not 0 <= value <= 10**15:
            raise ValueError(f"chunk times must be from 0 to 1e15 ns, got {value!r}")
        c = value
        total += c
        longest = max(longest, c)
        n += 1
    if n_chunks < n:
        raise ValueError(f"n_chunks must be at least the caller's {n} chunks, got {n_chunks}")
    return bool(cpe_team_is_loss(took_ns, n, total, longest, n_chunks, shared))


def set_team_refused(bint refused):
    """Act as if the OS had refused a thread (True: start no more helpers),
    or allow new helpers again (False). For tests."""
    cpe_team_set_refused(refused)


def openmp_enabled():
    """True if this extension was compiled with OpenMP."""
    return bool(CPOSEMBED_OPENMP_ENABLED)


def omp_max_threads():
    """omp_get_max_threads() of the OpenMP runtime, or 1 in a serial build."""
    return omp_get_max_threads()


def streaming_stores_available():
    """True if this build streams large outputs with non-temporal stores (x86-64 SSE2)."""
    return bool(cpe_have_stream())
