/* Checks the _WIN32 branches of src_c/_threads.h on a Windows OpenMP
 * runtime, outside Python (tools/windows_threads_check.sh builds it with
 * mingw-w64 and runs it under wine): a region runs on several threads, the
 * helper budget is reserved per calling thread and given back when that
 * thread ends, and the claim runs every chunk exactly once. Prints one line
 * per check and exits 1 if one fails. */
#include <stddef.h>
typedef ptrdiff_t Py_ssize_t;
#define CPOSEMBED_OPENMP_ENABLED 1
#include "../src_c/_threads.h"
#include <omp.h>

static int failed = 0;
static void check(int ok, const char *what) {
    printf("%s: %s\n", ok ? "ok  " : "FAIL", what);
    if (!ok) failed = 1;
}

/* The claim: each chunk counts its runs; chunk 0's thread is slowed down
 * so that the others take from its share. */
#define MAX_CHUNKS 4096
static volatile long runs[MAX_CHUNKS];
static volatile long ran_by[MAX_CHUNKS];
static void count_chunk(void *arg, Py_ssize_t c) {
    (void)arg;
    InterlockedIncrement(&runs[c]);
    ran_by[c] = omp_get_thread_num();
    if (c == 0) Sleep(20);
}

static int claim_once(Py_ssize_t n_chunks, int n_threads, int *stolen) {
    cpe_job job;
    Py_ssize_t c;
    int ok = 1;
    for (c = 0; c < n_chunks; c++) runs[c] = 0;
    cpe_job_init(&job, count_chunk, NULL, n_chunks, n_threads);
    #pragma omp parallel num_threads(n_threads)
    cpe_job_run(&job, omp_get_thread_num());
    *stolen = 0;
    for (c = 0; c < n_chunks; c++) {
        ok &= runs[c] == 1;
        /* share t holds [n t / T, n (t + 1) / T) */
        *stolen |= ran_by[c] != ((c + 1) * n_threads - 1) / n_chunks;
    }
    return ok;
}

/* A calling thread of its own: the threads it may have for a region of 4,
 * and how many threads that region then had. */
typedef struct { int here, ran; HANDLE go; } caller;
static DWORD WINAPI call_region(void *p) {
    caller *c = (caller *)p;
    c->here = cpe_threads_here(4);
    #pragma omp parallel num_threads(c->here)
    {
        #pragma omp single
        c->ran = omp_get_num_threads();
    }
    cpe_region_ran(c->here);
    if (c->go) WaitForSingleObject(c->go, INFINITE);
    return 0;
}

int main(void) {
    int seen = 0, i, stolen, all = 1, any_stolen = 0;
    long long t0 = cpe_now_ns();
    char line[160];
    caller a = {0, 0, NULL}, b = {0, 0, NULL};
    HANDLE ta, tb;

    cpe_threads_init();
    cpe_room_max = 3;  /* room for one caller's 3 helpers */
    printf("omp_get_max_threads %d, omp_get_num_procs %d\n", omp_get_max_threads(),
           omp_get_num_procs());

    #pragma omp parallel num_threads(4)
    {
        #pragma omp atomic
        seen |= 1 << omp_get_thread_num();
    }
    check(seen == 15, "a region of 4 runs on 4 distinct OpenMP threads");

    /* Caller a reserves 3 helpers and keeps them while it lives; b, while a
     * lives, finds the budget spent and runs alone; after a ends (its
     * fiber-local value's destructor gives them back) b gets them. */
    a.go = CreateEventA(NULL, TRUE, FALSE, NULL);
    ta = CreateThread(NULL, 0, call_region, &a, 0, NULL);
    while (!((volatile caller *)&a)->ran && cpe_now_ns() - t0 < 5000000000LL) Sleep(1);
    snprintf(line, sizeof(line), "caller a: 4 threads, region of %d; %d reserved", a.ran,
             cpe_reserved);
    check(a.here == 4 && a.ran == 4 && cpe_reserved == 3, line);
    tb = CreateThread(NULL, 0, call_region, &b, 0, NULL);
    WaitForSingleObject(tb, INFINITE);
    snprintf(line, sizeof(line), "caller b while a lives: %d thread(s), budget spent", b.here);
    check(b.here == 1 && b.ran == 1, line);
    SetEvent(a.go);
    WaitForSingleObject(ta, INFINITE);
    snprintf(line, sizeof(line), "a ended: %d reserved (given back)", cpe_reserved);
    check(cpe_reserved == 0, line);
    tb = CreateThread(NULL, 0, call_region, &b, 0, NULL);
    WaitForSingleObject(tb, INFINITE);
    snprintf(line, sizeof(line), "caller b after a ended: %d threads; after b: %d reserved",
             b.here, cpe_reserved);
    check(b.here == 4 && b.ran == 4 && cpe_reserved == 0, line);
    check(cpe_mine == 0, "the main thread's reservation is its own (thread-local)");

    for (i = 0; i < 200; i++) {
        Py_ssize_t n = 1 + (i * 37) % MAX_CHUNKS;
        all &= claim_once(n, 2 + i % 3, &stolen);
        any_stolen |= stolen;
    }
    check(all, "the claim runs every chunk exactly once (200 regions, 2-4 threads)");
    check(any_stolen, "threads took chunks from a slow thread's share");
    snprintf(line, sizeof(line), "the clock advances (%lld ms in all)",
             (cpe_now_ns() - t0) / 1000000);
    check(cpe_now_ns() > t0, line);
    printf(failed ? "FAILED\n" : "all passed\n");
    return failed;
}
