/* cposembed's one allocator and its one policy for keeping freed blocks
   (docs/architecture.md, "Memory", describes both):
   - CPE_DENSE (outputs, scratch), written whole; fresh ones of 4 MiB or more are
     2 MiB-aligned and advised for huge pages. Freed ones are kept for later dense
     requests within CPE_KEEP_SLOTS blocks and cpe_keep_limit bytes.
   - CPE_ZEROED (sparsely touched gradients): mmap'd zero pages advised against huge
     pages; CPE_GROWING (optimizer state, filled from its first row): the same,
     advised for huge pages. Neither is kept.
   The kept list's lock is only ever tried, never waited for (a thread that finds it
   taken goes to the OS; only clear_pool retries), so any thread may take or free
   a block, and a child forked while it was held forgets the list. */

#ifndef CPE_BLOCKS_H
#define CPE_BLOCKS_H

#include <stdlib.h>
#include <string.h>
#if defined(_WIN32)
#include <windows.h>
#else
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>
#endif

enum { CPE_DENSE = 0, CPE_ZEROED = 1, CPE_GROWING = 2 };

/* A block: its memory, its size, how to release it, and its kind. */
typedef struct {
    void *ptr;
    size_t capacity;
    int mapped; /* 1: from mmap (munmap it); 0: from malloc (free it) */
    int kind;
} cpe_Mem;

#define CPE_KEEP_SLOTS 8
#define CPE_ZERO_MMAP_MIN ((size_t)64 << 10)
#define CPE_HUGE_MIN ((size_t)4 << 20)
/* Freed blocks smaller than this are released: malloc keeps them cheaply. */
#define CPE_KEEP_MIN ((size_t)64 << 10)

static cpe_Mem cpe_kept[CPE_KEEP_SLOTS];
static int cpe_kept_n = 0;
static size_t cpe_keep_limit = (size_t)1 << 30;
static int cpe_keep_on = 1;
static volatile long cpe_kept_lock = 0;

#if defined(_MSC_VER)
static int cpe_kept_try_lock(void) { return InterlockedExchange(&cpe_kept_lock, 1) == 0; }
static void cpe_kept_unlock(void) { InterlockedExchange(&cpe_kept_lock, 0); }
#else
static int cpe_kept_try_lock(void) {
    return __atomic_exchange_n(&cpe_kept_lock, 1, __ATOMIC_ACQUIRE) == 0;
}
static void cpe_kept_unlock(void) { __atomic_store_n(&cpe_kept_lock, 0, __ATOMIC_RELEASE); }
#endif

static void cpe_release(cpe_Mem m) {
    if (m.ptr == NULL) return;
#if !defined(_WIN32)
    if (m.mapped) {
        munmap(m.ptr, m.capacity);
        return;
    }
#endif
    free(m.ptr);
}

/* Fresh memory of the kind (zeroed unless CPE_DENSE); m.ptr NULL if there is none. */
static cpe_Mem cpe_fresh(size_t nbytes, int kind) {
    cpe_Mem m = {NULL, nbytes, 0, kind};
    if (kind != CPE_DENSE) {
#if defined(MAP_ANONYMOUS)
        if (nbytes >= CPE_ZERO_MMAP_MIN) {
            void *p = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                           -1, 0);
            if (p != MAP_FAILED) {
#if defined(MADV_NOHUGEPAGE) && defined(MADV_HUGEPAGE)
                madvise(p, nbytes, kind == CPE_ZEROED ? MADV_NOHUGEPAGE : MADV_HUGEPAGE);
#endif
                m.ptr = p;
                m.mapped = 1;
                return m;
            }
        }
#endif
        m.ptr = calloc(nbytes > 0 ? nbytes : 1, 1);
        return m;
    }
#if defined(_WIN32)
    m.ptr = malloc(nbytes > 0 ? nbytes : 1);
#else
    {
        size_t align = nbytes >= CPE_HUGE_MIN ? ((size_t)2 << 20) : 64;
        if (posix_memalign(&m.ptr, align, nbytes > 0 ? nbytes : 1) != 0) m.ptr = NULL;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
        if (m.ptr != NULL && nbytes >= CPE_HUGE_MIN) madvise(m.ptr, nbytes, MADV_HUGEPAGE);
#endif
    }
#endif
    return m;
}

static size_t cpe_kept_bytes(void) {
    size_t total = 0;
    int i;
    for (i = 0; i < cpe_kept_n; i++) total += cpe_kept[i].capacity;
    return total;
}

static void cpe_kept_drop(int i) {
    cpe_kept[i] = cpe_kept[--cpe_kept_n];
}

/* A dense block of at least `nbytes`: a kept one that fits without wasting
   more than half, else fresh; *reused says which. */
static cpe_Mem cpe_dense_get(size_t nbytes, int *reused) {
    cpe_Mem m = {NULL, 0, 0, CPE_DENSE};
    int i, best = -1;
    if (cpe_keep_on && cpe_kept_try_lock()) {
        for (i = 0; i < cpe_kept_n; i++) {
            size_t cap = cpe_kept[i].capacity;
            if (nbytes <= cap && cap / 2 <= nbytes && (best < 0 || cap < cpe_kept[best].capacity))
                best = i;
        }
        if (best >= 0) {
            m = cpe_kept[best];
            cpe_kept_drop(best);
        }
        cpe_kept_unlock();
    }
    *reused = m.ptr != NULL;
    return m.ptr != NULL ? m : cpe_fresh(nbytes, CPE_DENSE);
}

/* Keeps a freed block (the policy above) or releases it. */
static void cpe_block_put(cpe_Mem m) {
    int i, smallest, n_small = 0;
    size_t small_bytes = 0, kept;
    if (m.ptr == NULL) return;
    if (m.kind != CPE_DENSE || m.capacity < CPE_KEEP_MIN || !cpe_keep_on || m.capacity > cpe_keep_limit ||
        !cpe_kept_try_lock()) {
        cpe_release(m);
        return;
    }
    if (!cpe_keep_on) { /* turned off (and the list cleared) since the check above */
        cpe_kept_unlock();
        cpe_release(m);
        return;
    }
    kept = cpe_kept_bytes();
    for (i = 0; i < cpe_kept_n; i++) {
        if (cpe_kept[i].capacity < m.capacity) {
            n_small++;
            small_bytes += cpe_kept[i].capacity;
        }
    }
    if (cpe_kept_n - n_small >= CPE_KEEP_SLOTS || kept - small_bytes + m.capacity > cpe_keep_limit) {
        cpe_kept_unlock();
        cpe_release(m);
        return;
    }
    while (cpe_kept_n >= CPE_KEEP_SLOTS || kept + m.capacity > cpe_keep_limit) {
        smallest = 0;
        for (i = 1; i < cpe_kept_n; i++)
            if (cpe_kept[i].capacity < cpe_kept[smallest].capacity) smallest = i;
        kept -= cpe_kept[smallest].capacity;
        cpe_release(cpe_kept[smallest]);
        cpe_kept_drop(smallest);
    }
    cpe_kept[cpe_kept_n++] = m;
    cpe_kept_unlock();
}

/* Every kept block released; 0 if another thread held the list (try again). */
static int cpe_blocks_clear(void) {
    if (!cpe_kept_try_lock()) return 0;
    while (cpe_kept_n > 0) cpe_release(cpe_kept[--cpe_kept_n]);
    cpe_kept_unlock();
    return 1;
}

#if !defined(_WIN32)
static void cpe_blocks_after_fork(void) {
    if (cpe_kept_lock) { /* the fork came mid-change: the list may be torn */
        cpe_kept_n = 0;
        cpe_kept_unlock();
    }
}
#endif

static void cpe_blocks_init(void) {
#if !defined(_WIN32)
    pthread_atfork(NULL, NULL, cpe_blocks_after_fork);
#endif
}

/* Zeroes `nbytes` at `p` (the PyTorch bridge's gradients, torch's memory). `lazily`
   (Linux): whole pages go back with MADV_DONTNEED (zero until written) and are
   advised against huge pages, the edges memset; else, or if that fails, memset. */
static void cpe_zero_memory(void *p, size_t nbytes, int lazily) {
#if defined(__linux__) && defined(MADV_DONTNEED)
    if (lazily && nbytes >= CPE_ZERO_MMAP_MIN) {
        long ps = sysconf(_SC_PAGESIZE);
        size_t page = ps > 0 ? (size_t)ps : 4096, start = (size_t)p, end = start + nbytes;
        size_t lo = (start + page - 1) & ~(page - 1), hi = end & ~(page - 1);
        if (lo < hi && madvise((void *)lo, hi - lo, MADV_DONTNEED) == 0) {
#if defined(MADV_NOHUGEPAGE)
            madvise((void *)lo, hi - lo, MADV_NOHUGEPAGE);
#endif
            memset(p, 0, lo - start);
            memset((void *)hi, 0, end - hi);
            return;
        }
    }
#else
    (void)lazily;
#endif
    memset(p, 0, nbytes);
}

/* Advises the 2 MiB-aligned interior of `nbytes` at `p` (the PyTorch bridge's large
   outputs) for huge pages, as fresh dense blocks are (Linux only). */
static void cpe_advise_huge(void *p, size_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    size_t huge = (size_t)2 << 20, start = (size_t)p;
    size_t lo = (start + huge - 1) & ~(huge - 1), hi = (start + nbytes) & ~(huge - 1);
    if (nbytes >= CPE_HUGE_MIN && lo < hi) madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)p;
    (void)nbytes;
#endif
}

#endif
