/* The C half of the thread rules of _parallel.pxi: a region's chunks, the
 * bound on the OS threads the package causes, the fork rule and the
 * measured choice between one thread and several. */
#ifndef CPE_THREADS_H
#define CPE_THREADS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(_WIN32)
#include <windows.h>
#else
#include <time.h>
#endif
#if defined(__linux__)
#include <sched.h>
#endif

typedef void (*cpe_chunk_fn)(void *arg, Py_ssize_t chunk);

/* A monotonic clock in ns (LLVM's omp_get_wtime reads the wall clock, which
 * can step). */
static long long cpe_now_ns(void) {
#if defined(_WIN32)
    LARGE_INTEGER f, c;
    QueryPerformanceFrequency(&f);
    QueryPerformanceCounter(&c);
    return (long long)((double)c.QuadPart * (1e9 / (double)f.QuadPart));
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
#endif
}

/* ---- a region's chunks ------------------------------------------------------
 * One contiguous share of the chunks per thread, [lo, hi) packed as
 * lo << 32 | hi on a cache line of its own. A thread takes its own share from
 * the front, then the others' from the back. A chunk's work is fixed by the
 * kernel, so only which thread runs it varies, never a result. */
#define CPE_MAX_REGION 256

typedef struct {
    unsigned long long v;
    char pad[64 - sizeof(unsigned long long)];
} cpe_share;

typedef struct {
    cpe_chunk_fn fn;
    void *arg;
    int n_shares;
    cpe_share share[CPE_MAX_REGION];
} cpe_job;

static void cpe_job_init(cpe_job *job, cpe_chunk_fn fn, void *arg, Py_ssize_t n_chunks,
                         int n_threads) {
    int t;
    job->fn = fn;
    job->arg = arg;
    job->n_shares = n_threads;
    for (t = 0; t < n_threads; t++)
        job->share[t].v = (unsigned long long)(n_chunks * t / n_threads) << 32 |
                          (unsigned long long)(n_chunks * (t + 1) / n_threads);
}

#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>
#define CPE_ADD(p, v) ((unsigned long long)_InterlockedExchangeAdd64((volatile long long *)(p), (long long)(v)))
#define CPE_LOAD(p) ((unsigned long long)_InterlockedCompareExchange64((volatile long long *)(p), 0, 0))
#define CPE_SWAP(p, seen, to) ((unsigned long long)_InterlockedCompareExchange64( \
    (volatile long long *)(p), (long long)(to), (long long)(seen)))
#else
#define CPE_ADD(p, v) __atomic_fetch_add((p), (v), __ATOMIC_RELAXED)
#define CPE_LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define CPE_SWAP(p, seen, to) __sync_val_compare_and_swap((p), (seen), (to))
#endif

/* The next chunk for share t (its front, else another's back); -1: none. */
static Py_ssize_t cpe_claim(cpe_job *job, int t) {
    unsigned long long v = CPE_ADD(&job->share[t].v, 1ULL << 32), was;
    int k;
    if ((v >> 32) < (v & 0xffffffffULL)) return (Py_ssize_t)(v >> 32);
    for (k = 1; k < job->n_shares; k++) {
        cpe_share *s = &job->share[(t + k) % job->n_shares];
        for (v = CPE_LOAD(&s->v); (v >> 32) < (v & 0xffffffffULL); v = was)
            if ((was = CPE_SWAP(&s->v, v, v - 1)) == v) return (Py_ssize_t)(v & 0xffffffffULL) - 1;
    }
    return -1;
}

static void cpe_job_run(cpe_job *job, int t) {
    Py_ssize_t c;
    while ((c = cpe_claim(job, t)) >= 0) job->fn(job->arg, c);
}

/* ---- the threads the package causes ------------------------------------------
 * The OpenMP runtime keeps a pool of helpers per calling thread, and libgomp
 * exits the process when it cannot start one. A calling thread reserves its
 * helpers from one budget (cpe_room_max) and gives them back when it ends.
 * Under RLIMIT_NPROC, a region that would start threads first starts and ends
 * as many; if the OS refuses, no caller asks for more. */
static void cpe_give_back(void *mine);
#if CPOSEMBED_OPENMP_ENABLED && defined(_WIN32)
#if defined(_MSC_VER)
#define CPE_TLS __declspec(thread)
#else
#define CPE_TLS __thread  /* mingw's gcc ignores __declspec(thread) */
#endif
static SRWLOCK cpe_mu = SRWLOCK_INIT;
static void cpe_lock(void) { AcquireSRWLockExclusive(&cpe_mu); }
static void cpe_unlock(void) { ReleaseSRWLockExclusive(&cpe_mu); }
static DWORD cpe_key = FLS_OUT_OF_INDEXES;
static void WINAPI cpe_key_done(void *mine) { if (mine) cpe_give_back(mine); }
static void cpe_key_init(void) { cpe_key = FlsAlloc(cpe_key_done); }
static int cpe_key_set(int mine) {
    return cpe_key != FLS_OUT_OF_INDEXES && FlsSetValue(cpe_key, (void *)(intptr_t)mine);
}
#elif CPOSEMBED_OPENMP_ENABLED
#include <pthread.h>
#include <signal.h>
#include <unistd.h>
#include <sys/resource.h>
#define CPE_TLS __thread
static pthread_mutex_t cpe_mu = PTHREAD_MUTEX_INITIALIZER;
static void cpe_lock(void) { pthread_mutex_lock(&cpe_mu); }
static void cpe_unlock(void) { pthread_mutex_unlock(&cpe_mu); }
static pthread_key_t cpe_key;
static int cpe_key_ok = 0;
static void cpe_key_init(void) { cpe_key_ok = pthread_key_create(&cpe_key, cpe_give_back) == 0; }
static int cpe_key_set(int mine) {
    return cpe_key_ok && pthread_setspecific(cpe_key, (void *)(intptr_t)mine) == 0;
}
#else
#define CPE_TLS
static void cpe_lock(void) {}
static void cpe_unlock(void) {}
static void cpe_key_init(void) {}
static int cpe_key_set(int mine) { (void)mine; return 0; }
#endif

static int cpe_room_max = 0;    /* helpers all callers together may reserve */
static int cpe_reserved = 0;    /* helpers reserved by calling threads alive now */
static int cpe_refused = 0;     /* the OS refused a thread: reserve no more */
static int cpe_serial = 0;      /* a forked child that runs every call on its caller */
static int cpe_entered = 0;     /* a region ran in this process */
static CPE_TLS int cpe_mine = 0;    /* helpers this thread reserved */
static CPE_TLS int cpe_pool = 1;    /* threads of this thread's last region */

static void cpe_give_back(void *mine) {
    cpe_lock();
    cpe_reserved -= (int)(intptr_t)mine;
    if (cpe_reserved < 0) cpe_reserved = 0;
    cpe_unlock();
}

static void cpe_set_locked(int *var, int value) {
    cpe_lock();
    *var = value;
    cpe_unlock();
}

/* The OS threads of this process, or -1 where that is unknown. */
static int cpe_os_threads(void) {
    int n = -1;
#if defined(__linux__)
    char line[128];
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    while (n < 0 && fgets(line, sizeof(line), f))
        if (sscanf(line, "Threads: %d", &n) != 1) n = -1;
    fclose(f);
#endif
    return n > 0 ? n : -1;
}

/* The CPUs this process may use now (affinity, and the cgroup quota rounded
 * up); -1 where that is unknown. */
static int cpe_cpus_now(void) {
    int n = -1;
#if defined(__linux__)
    cpu_set_t set;
    long long q, period;
    FILE *f = fopen("/sys/fs/cgroup/cpu.max", "r");
    if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
    if (f) {
        if (fscanf(f, "%lld %lld", &q, &period) == 2 && q > 0 && period > 0 &&
            (n < 0 || (q + period - 1) / period < n))
            n = (int)((q + period - 1) / period);
        fclose(f);
    }
#endif
    return n;
}

#if CPOSEMBED_OPENMP_ENABLED && defined(__linux__)
/* Whether the OS limits this user's threads (root, or no limit: no). */
static int cpe_os_limits_threads(void) {
    struct rlimit rl;
    if (geteuid() == 0) return 0;
    return getrlimit(RLIMIT_NPROC, &rl) != 0 || rl.rlim_cur != RLIM_INFINITY;
}

/* A probe thread ends as soon as it gets the lock its creator holds. */
static pthread_mutex_t cpe_probe_mu = PTHREAD_MUTEX_INITIALIZER;
static void *cpe_probe_main(void *arg) {
    pthread_mutex_lock(&cpe_probe_mu);
    pthread_mutex_unlock(&cpe_probe_mu);
    return arg;
}

/* How many of k more threads the OS allows now (lock held): starts them,
 * ends them, and waits until the OS has counted them out. */
static int cpe_os_allows(int k) {
    pthread_t t[CPE_MAX_REGION];
    sigset_t all, old;
    int made = 0, i, before = cpe_os_threads();
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);  /* signals stay with Python's threads */
    pthread_mutex_lock(&cpe_probe_mu);
    while (made < k && made < CPE_MAX_REGION &&
           pthread_create(&t[made], NULL, cpe_probe_main, NULL) == 0)
        made++;
    pthread_mutex_unlock(&cpe_probe_mu);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    for (i = 0; i < made; i++) pthread_join(t[i], NULL);
    for (i = 0; before > 0 && cpe_os_threads() > before && i < 2000; i++) {
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
    return made;
}
static void cpe_start_pool(int n) {
    #pragma omp parallel num_threads(n)
    {
        __asm__ __volatile__("" ::: "memory");
    }
}
#else
static int cpe_os_limits_threads(void) { return 0; }
static int cpe_os_allows(int k) { return k; }
static void cpe_start_pool(int n) { (void)n; }
#endif

/* The threads a region of up to n may have on this calling thread now:
 * from 1 to n, all reserved and, where the OS limits threads, allowed.
 * Without the GIL. */
static int cpe_threads_here(int n) {
    int want, limited;
#if CPOSEMBED_OPENMP_ENABLED
    if (n > CPE_MAX_REGION) n = CPE_MAX_REGION;
    if (n <= 1 || cpe_serial) return 1;
    if (n <= 1 + cpe_mine && n <= cpe_pool) return n;  /* the pool holds them */
    limited = cpe_os_limits_threads();
    if (n <= 1 + cpe_mine && !limited) return n;
    cpe_lock();
    want = n - 1 - cpe_mine;
    if (want > cpe_room_max - cpe_reserved || cpe_refused)
        want = cpe_refused ? 0 : cpe_room_max - cpe_reserved;
    if (want > 0 && cpe_key_set(cpe_mine + want)) {
        cpe_mine += want;
        cpe_reserved += want;
    }
    if (n > 1 + cpe_mine) n = 1 + cpe_mine;
    if (limited && n > cpe_pool) {
        int made = cpe_os_allows(n - cpe_pool);
        if (made < n - cpe_pool) {
            cpe_refused = 1;
            n = cpe_pool + made;
        }
        if (n > cpe_pool) cpe_start_pool(n);
        cpe_pool = n;
    }
    cpe_unlock();
    return n;
#else
    (void)n; (void)want; (void)limited;
    return 1;
#endif
}

/* After a region of n threads: the pool now has n (a smaller region ends
 * the threads it does not use). */
static void cpe_region_ran(int n) {
    cpe_pool = n;
    cpe_entered = 1;
}

/* ---- fork ---------------------------------------------------------------------
 * A libgomp region with more than one thread in a forked child waits forever
 * for the parent's pool. A child whose parent had other threads (or, where
 * threads cannot be counted, ran a region) runs every call on its caller, and
 * so do its children. */
static int cpe_fork_threads = -1;
#if CPOSEMBED_OPENMP_ENABLED && !defined(_WIN32)
static void cpe_fork_prepare(void) {
    cpe_lock();
    cpe_fork_threads = cpe_os_threads();
}
static void cpe_fork_parent(void) { cpe_unlock(); }
static void cpe_fork_child(void) {
    cpe_unlock();  /* the forking thread took it and is the child's only thread */
    if (cpe_fork_threads > 1 || (cpe_fork_threads < 0 && cpe_entered)) cpe_serial = 1;
    cpe_reserved = cpe_mine = cpe_refused = 0;
    cpe_pool = 1;
}
static void cpe_threads_init(void) {
    cpe_key_init();
    pthread_atfork(cpe_fork_prepare, cpe_fork_parent, cpe_fork_child);
}
#else
static void cpe_threads_init(void) { cpe_key_init(); }
#endif

/* ---- one thread or several: measured -------------------------------------------
 * Each site (a kernel, and the work's power of two) keeps its recent times per
 * element on its planned threads and on one thread, runs on the faster count,
 * and tries the other every `every` calls (cpe_interval). Several threads lose
 * to one only when the CPUs are taken; idle or spinning pools of other
 * libraries do not do that. Called with the GIL held. */
#define CPE_KINDS 8
#define CPE_SIZES 48
#define CPE_RING 4
#define CPE_PROBE_COST 0.04
#define CPE_MARGIN 0.9       /* one thread wins below this fraction of several's time */

typedef struct {
    int n;                      /* the planned threads; 0: nothing measured */
    int alone;                  /* runs on one thread, trying n now and then */
    int since, every;           /* calls since the last on the other count; the interval */
    int count[2], next[2];      /* [0]: one thread, [1]: n threads */
    double rate[2][CPE_RING];   /* ns per element, the latest CPE_RING calls */
    double latest;              /* the latest rate on one thread */
} cpe_site;

static cpe_site cpe_sites[CPE_KINDS][CPE_SIZES];
static int cpe_adapting = 1;

static cpe_site *cpe_site_of(int kind, Py_ssize_t work) {
    int b = 0;
    while (b < CPE_SIZES - 1 && ((Py_ssize_t)1 << (b + 1)) <= work) b++;
    if (kind < 0 || kind >= CPE_KINDS) kind = CPE_KINDS - 1;
    return &cpe_sites[kind][b];
}

/* The median of the recent rates on one thread (k = 0) or several; 0
 * while there are none. */
static double cpe_median(const cpe_site *s, int k) {
    double v[CPE_RING], x;
    int n = s->count[k], i, j;
    if (n == 0) return 0;
    for (i = 0; i < n; i++) {
        x = s->rate[k][i];
        for (j = i; j > 0 && v[j - 1] > x; j--) v[j] = v[j - 1];
        v[j] = x;
    }
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* The threads a call planned on n (> 1) by default runs on. */
static int cpe_choose(int kind, Py_ssize_t work, int n) {
    cpe_site *s;
    if (!cpe_adapting || n <= 1) return n;
    s = cpe_site_of(kind, work);
    if (s->n != n) {
        memset(s, 0, sizeof(*s));
        s->n = n;
        s->every = 4;
    }
    if (++s->since >= s->every) return s->alone ? n : 1;
    return s->alone ? 1 : n;
}

/* The calls between tries of the other count, so that tries cost about
 * CPE_PROBE_COST of the time: 4 to 32 on several threads; on one, 4 to 8, or
 * to as many as run in CPE_ALONE_SPAN_NS (at most 1024) for short calls, where
 * a try while the CPUs are taken can cost a scheduler wait. */
#define CPE_ALONE_SPAN_NS 5e7
static void cpe_interval(cpe_site *s, double other, double own, Py_ssize_t work) {
    double calls = own > 0 ? (other / own - 1.0) / CPE_PROBE_COST : 4;
    double most = 32;
    if (s->alone) {
        most = own > 0 ? CPE_ALONE_SPAN_NS / (own * (double)work) : 8;
        most = most < 8 ? 8 : most > 1024 ? 1024 : most;
    }
    s->every = calls < 4 ? 4 : calls > most ? (int)most : (int)calls;
}

/* What a call of `work` chosen by cpe_choose took on `threads`. */
static void cpe_took(int kind, Py_ssize_t work, int threads, long long ns) {
    cpe_site *s;
    int k = threads > 1;
    double r;
    if (!cpe_adapting || work <= 0 || ns < 0) return;
    s = cpe_site_of(kind, work);
    if (s->n == 0 || (k && threads != s->n)) return;
    r = (double)ns / (double)work;
    s->rate[k][s->next[k]] = r;
    s->next[k] = (s->next[k] + 1) % CPE_RING;
    if (s->count[k] < CPE_RING) s->count[k]++;
    if (!k) s->latest = r;
    if (k == s->alone) s->since = 0;  /* it ran on the other count */
    if (!s->alone) {
        /* Several threads, one now and then: one wins if its latest call
         * beat the recent calls on several by the margin. */
        double multi = cpe_median(s, 1);
        if (s->count[0] && s->count[1] && s->latest < CPE_MARGIN * multi) {
            s->alone = 1;
            s->since = 0;
            cpe_interval(s, multi, s->latest, work);
        } else if (!k && s->count[1]) {
            cpe_interval(s, r, multi, work);
        }
    } else if (k) {
        /* One thread, several now and then: several win back as soon as
         * one call on them beats the recent calls on one. */
        double single = cpe_median(s, 0);
        if (r < single) {
            s->alone = 0;
            s->since = 0;
            s->rate[1][0] = r;
            s->count[1] = 1;
            s->next[1] = 1;
            cpe_interval(s, single, r, work);
        } else {
            cpe_interval(s, r, single, work);
        }
    }
}

static void cpe_set_adapting(int on) {
    cpe_adapting = on;
    memset(cpe_sites, 0, sizeof(cpe_sites));
}
static int cpe_sites_alone(void) {
    int k, b, n = 0;
    for (k = 0; k < CPE_KINDS; k++)
        for (b = 0; b < CPE_SIZES; b++) n += cpe_sites[k][b].n > 0 && cpe_sites[k][b].alone;
    return n;
}

#endif
