/* Row primitives with optional non-temporal (streaming) stores.
 *
 * Streaming stores write whole cache lines straight to memory without first
 * reading them (no read-for-ownership), which cuts the memory traffic of an
 * output far larger than the cache from 2x to 1x its size. They are only a
 * win for such outputs: for a small output the lines would have stayed in
 * cache for the caller. The entries decide per call (STREAM_THRESHOLD_BYTES in
 * src_c/_team.pxi). SSE2 is part of x86-64, so this stays portable;
 * other architectures get plain stores. Each thread that streamed must call
 * cpe_sfence() before its work counts as done.
 *
 * Only the element-wise IEEE operations of the plain loops are used (a copy,
 * one add), so results are bitwise those of the plain-store path.
 */
#ifndef CPOSEMBED_STREAM_H
#define CPOSEMBED_STREAM_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#include <emmintrin.h>
#define CPE_HAVE_STREAM 1
#else
#define CPE_HAVE_STREAM 0
#endif

static inline int cpe_have_stream(void) { return CPE_HAVE_STREAM; }

static inline void cpe_sfence(void) {
#if CPE_HAVE_STREAM
    _mm_sfence();
#endif
}

static inline void cpe_prefetch(const void *p) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 0, 3);
#else
    (void)p;
#endif
}

static inline void cpe_prefetch_w(const void *p) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 1, 3);
#else
    (void)p;
#endif
}

/* For data read once (token rows, the gradient): fetch it without letting
 * it push the reused rows (the table, the gradient table) out of the caches. */
static inline void cpe_prefetch_nta(const void *p) {
#if CPE_HAVE_STREAM
    _mm_prefetch((const char *)p, _MM_HINT_NTA);
#elif defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 0, 0);
#else
    (void)p;
#endif
}

/* Elements before the first 16-byte-aligned one (all of them if `p` is not
 * even aligned to its element size, e.g. a view at an odd byte offset). */
static inline ptrdiff_t cpe_peel(const void *p, ptrdiff_t n, size_t esize) {
    uintptr_t a = (uintptr_t)p;
    ptrdiff_t k;
    if (a % esize) return n;
    k = (ptrdiff_t)(((16 - (a & 15)) & 15) / esize);
    return k < n ? k : n;
}

/* ---- copy ------------------------------------------------------------ */
static inline void cpe_copy_f32(float *dst, const float *src, ptrdiff_t n, int stream) {
#if CPE_HAVE_STREAM
    if (stream) {
        ptrdiff_t k = 0, peel = cpe_peel(dst, n, sizeof(float));
        for (; k < peel; k++) dst[k] = src[k];
        for (; k + 16 <= n; k += 16) {
            __m128 a = _mm_loadu_ps(src + k), b = _mm_loadu_ps(src + k + 4);
            __m128 c = _mm_loadu_ps(src + k + 8), d = _mm_loadu_ps(src + k + 12);
            _mm_stream_ps(dst + k, a); _mm_stream_ps(dst + k + 4, b);
            _mm_stream_ps(dst + k + 8, c); _mm_stream_ps(dst + k + 12, d);
        }
        for (; k + 4 <= n; k += 4) _mm_stream_ps(dst + k, _mm_loadu_ps(src + k));
        for (; k < n; k++) dst[k] = src[k];
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static inline void cpe_copy_f64(double *dst, const double *src, ptrdiff_t n, int stream) {
#if CPE_HAVE_STREAM
    if (stream) {
        ptrdiff_t k = 0, peel = cpe_peel(dst, n, sizeof(double));
        for (; k < peel; k++) dst[k] = src[k];
        for (; k + 8 <= n; k += 8) {
            __m128d a = _mm_loadu_pd(src + k), b = _mm_loadu_pd(src + k + 2);
            __m128d c = _mm_loadu_pd(src + k + 4), d = _mm_loadu_pd(src + k + 6);
            _mm_stream_pd(dst + k, a); _mm_stream_pd(dst + k + 2, b);
            _mm_stream_pd(dst + k + 4, c); _mm_stream_pd(dst + k + 6, d);
        }
        for (; k + 2 <= n; k += 2) _mm_stream_pd(dst + k, _mm_loadu_pd(src + k));
        for (; k < n; k++) dst[k] = src[k];
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, (size_t)n * sizeof(double));
}

/* ---- add: out = a + b (out may be a; each element reads only itself) ---- */
static inline void cpe_add_f32(float *out, const float *a, const float *b, ptrdiff_t n,
                               int stream) {
    ptrdiff_t k = 0;
#if CPE_HAVE_STREAM
    if (stream) {
        ptrdiff_t peel = cpe_peel(out, n, sizeof(float));
        for (; k < peel; k++) out[k] = a[k] + b[k];
        for (; k + 16 <= n; k += 16) {
            __m128 x0 = _mm_add_ps(_mm_loadu_ps(a + k), _mm_loadu_ps(b + k));
            __m128 x1 = _mm_add_ps(_mm_loadu_ps(a + k + 4), _mm_loadu_ps(b + k + 4));
            __m128 x2 = _mm_add_ps(_mm_loadu_ps(a + k + 8), _mm_loadu_ps(b + k + 8));
            __m128 x3 = _mm_add_ps(_mm_loadu_ps(a + k + 12), _mm_loadu_ps(b + k + 12));
            _mm_stream_ps(out + k, x0);
            _mm_stream_ps(out + k + 4, x1);
            _mm_stream_ps(out + k + 8, x2);
            _mm_stream_ps(out + k + 12, x3);
        }
        for (; k + 4 <= n; k += 4)
            _mm_stream_ps(out + k, _mm_add_ps(_mm_loadu_ps(a + k), _mm_loadu_ps(b + k)));
    } else {
        /* Explicit vectors: in place (out == a) the compiler's own
         * vectorisation gives up on its overlap check and adds one by one. */
        for (; k + 8 <= n; k += 8) {
            __m128 x0 = _mm_add_ps(_mm_loadu_ps(a + k), _mm_loadu_ps(b + k));
            __m128 x1 = _mm_add_ps(_mm_loadu_ps(a + k + 4), _mm_loadu_ps(b + k + 4));
            _mm_storeu_ps(out + k, x0);
            _mm_storeu_ps(out + k + 4, x1);
        }
    }
#endif
    (void)stream;
    for (; k < n; k++) out[k] = a[k] + b[k];
}

static inline void cpe_add_f64(double *out, const double *a, const double *b, ptrdiff_t n,
                               int stream) {
    ptrdiff_t k = 0;
#if CPE_HAVE_STREAM
    if (stream) {
        ptrdiff_t peel = cpe_peel(out, n, sizeof(double));
        for (; k < peel; k++) out[k] = a[k] + b[k];
        for (; k + 8 <= n; k += 8) {
            __m128d x0 = _mm_add_pd(_mm_loadu_pd(a + k), _mm_loadu_pd(b + k));
            __m128d x1 = _mm_add_pd(_mm_loadu_pd(a + k + 2), _mm_loadu_pd(b + k + 2));
            __m128d x2 = _mm_add_pd(_mm_loadu_pd(a + k + 4), _mm_loadu_pd(b + k + 4));
            __m128d x3 = _mm_add_pd(_mm_loadu_pd(a + k + 6), _mm_loadu_pd(b + k + 6));
            _mm_stream_pd(out + k, x0);
            _mm_stream_pd(out + k + 2, x1);
            _mm_stream_pd(out + k + 4, x2);
            _mm_stream_pd(out + k + 6, x3);
        }
        for (; k + 2 <= n; k += 2)
            _mm_stream_pd(out + k, _mm_add_pd(_mm_loadu_pd(a + k), _mm_loadu_pd(b + k)));
    } else {
        for (; k + 4 <= n; k += 4) {
            __m128d x0 = _mm_add_pd(_mm_loadu_pd(a + k), _mm_loadu_pd(b + k));
            __m128d x1 = _mm_add_pd(_mm_loadu_pd(a + k + 2), _mm_loadu_pd(b + k + 2));
            _mm_storeu_pd(out + k, x0);
            _mm_storeu_pd(out + k + 2, x1);
        }
    }
#endif
    (void)stream;
    for (; k < n; k++) out[k] = a[k] + b[k];
}

/* ---- accumulate: acc += src (scatter-add) ----------------------------
 * Explicit vectors: acc and src may not be proven apart, so the compiler's
 * own vectorisation adds a run-time overlap check and scalar fallback per
 * call, which measured 1.2-1.5x slower on 3 KB rows. While summing each
 * 64-byte line it asks for the matching line of `nxt` (the next source row,
 * into L1), of `far` (a source row further ahead, into L2), of `nacc` (the
 * next row to be added into, with intent to write) and of `far_acc` (a row
 * to be added into further ahead, into L2); any may be NULL. The prefetches
 * so trickle out at the pace of the work: a whole row requested at once
 * overflows the core's miss buffers (measured slower). Element k only ever
 * computes acc[k] + src[k], so the bits are the scalar loop's. */
static inline void cpe_prefetch_l2(const void *p) {
#if CPE_HAVE_STREAM
    _mm_prefetch((const char *)p, _MM_HINT_T1);
#elif defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 0, 2);
#else
    (void)p;
#endif
}
static inline void cpe_acc_f32(float *acc, const float *src, const float *nxt,
                               const float *far, float *nacc, const float *far_acc,
                               ptrdiff_t n) {
    ptrdiff_t k = 0;
#if CPE_HAVE_STREAM
    for (; k + 16 <= n; k += 16) {
        if (nxt) cpe_prefetch(nxt + k);
        if (far) cpe_prefetch_l2(far + k);
        if (nacc) cpe_prefetch_w(nacc + k);
        if (far_acc) cpe_prefetch_l2(far_acc + k);
        __m128 x0 = _mm_add_ps(_mm_loadu_ps(acc + k), _mm_loadu_ps(src + k));
        __m128 x1 = _mm_add_ps(_mm_loadu_ps(acc + k + 4), _mm_loadu_ps(src + k + 4));
        __m128 x2 = _mm_add_ps(_mm_loadu_ps(acc + k + 8), _mm_loadu_ps(src + k + 8));
        __m128 x3 = _mm_add_ps(_mm_loadu_ps(acc + k + 12), _mm_loadu_ps(src + k + 12));
        _mm_storeu_ps(acc + k, x0);
        _mm_storeu_ps(acc + k + 4, x1);
        _mm_storeu_ps(acc + k + 8, x2);
        _mm_storeu_ps(acc + k + 12, x3);
    }
#else
    (void)nxt;
    (void)far;
    (void)nacc;
    (void)far_acc;
#endif
    for (; k < n; k++) acc[k] += src[k];
}
static inline void cpe_acc_f64(double *acc, const double *src, const double *nxt,
                               const double *far, double *nacc, const double *far_acc,
                               ptrdiff_t n) {
    ptrdiff_t k = 0;
#if CPE_HAVE_STREAM
    for (; k + 8 <= n; k += 8) {
        if (nxt) cpe_prefetch(nxt + k);
        if (far) cpe_prefetch_l2(far + k);
        if (nacc) cpe_prefetch_w(nacc + k);
        if (far_acc) cpe_prefetch_l2(far_acc + k);
        __m128d x0 = _mm_add_pd(_mm_loadu_pd(acc + k), _mm_loadu_pd(src + k));
        __m128d x1 = _mm_add_pd(_mm_loadu_pd(acc + k + 2), _mm_loadu_pd(src + k + 2));
        __m128d x2 = _mm_add_pd(_mm_loadu_pd(acc + k + 4), _mm_loadu_pd(src + k + 4));
        __m128d x3 = _mm_add_pd(_mm_loadu_pd(acc + k + 6), _mm_loadu_pd(src + k + 6));
        _mm_storeu_pd(acc + k, x0);
        _mm_storeu_pd(acc + k + 2, x1);
        _mm_storeu_pd(acc + k + 4, x2);
        _mm_storeu_pd(acc + k + 6, x3);
    }
#else
    (void)nxt;
    (void)far;
    (void)nacc;
    (void)far_acc;
#endif
    for (; k < n; k++) acc[k] += src[k];
}
/* Both accumulators of the token + position layer from one load of each
 * source line: acc1 += src and acc2 += src (acc1 and acc2 distinct rows),
 * with the prefetches of cpe_acc_* (`far_acc`: a row of acc1's table).
 * Element k computes acc1[k] + src[k] and acc2[k] + src[k], so the bits are
 * those of two cpe_acc_* calls. */
static inline void cpe_acc2_f32(float *acc1, float *acc2, const float *src, const float *nxt,
                                const float *far, const float *far_acc, ptrdiff_t n) {
    ptrdiff_t k = 0;
#if CPE_HAVE_STREAM
    for (; k + 16 <= n; k += 16) {
        if (nxt) cpe_prefetch(nxt + k);
        if (far) cpe_prefetch_l2(far + k);
        if (far_acc) cpe_prefetch_l2(far_acc + k);
        __m128 s0 = _mm_loadu_ps(src + k), s1 = _mm_loadu_ps(src + k + 4);
        __m128 s2 = _mm_loadu_ps(src + k + 8), s3 = _mm_loadu_ps(src + k + 12);
        __m128 a0 = _mm_add_ps(_mm_loadu_ps(acc1 + k), s0);
        __m128 a1 = _mm_add_ps(_mm_loadu_ps(acc1 + k + 4), s1);
        __m128 a2 = _mm_add_ps(_mm_loadu_ps(acc1 + k + 8), s2);
        __m128 a3 = _mm_add_ps(_mm_loadu_ps(acc1 + k + 12), s3);
        __m128 b0 = _mm_add_ps(_mm_loadu_ps(acc2 + k), s0);
        __m128 b1 = _mm_add_ps(_mm_loadu_ps(acc2 + k + 4), s1);
        __m128 b2 = _mm_add_ps(_mm_loadu_ps(acc2 + k + 8), s2);
        __m128 b3 = _mm_add_ps(_mm_loadu_ps(acc2 + k + 12), s3);
        _mm_storeu_ps(acc1 + k, a0);
        _mm_storeu_ps(acc1 + k + 4, a1);
        _mm_storeu_ps(acc1 + k + 8, a2);
        _mm_storeu_ps(acc1 + k + 12, a3);
        _mm_storeu_ps(acc2 + k, b0);
        _mm_storeu_ps(acc2 + k + 4, b1);
        _mm_storeu_ps(acc2 + k + 8, b2);
        _mm_storeu_ps(acc2 + k + 12, b3);
    }
#else
    (void)nxt;
    (void)far;
    (void)far_acc;
#endif
    for (; k < n; k++) {
        acc1[k] += src[k];
        acc2[k] += src[k];
    }
}
static inline void cpe_acc2_f64(double *acc1, double *acc2, const double *src,
                                const double *nxt, const double *far, const double *far_acc,
                                ptrdiff_t n) {
    ptrdiff_t k = 0;
#if CPE_HAVE_STREAM
    for (; k + 4 <= n; k += 4) {
        if ((k & 7) == 0) {
            if (nxt) cpe_prefetch(nxt + k);
            if (far) cpe_prefetch_l2(far + k);
            if (far_acc) cpe_prefetch_l2(far_acc + k);
        }
        __m128d s0 = _mm_loadu_pd(src + k), s1 = _mm_loadu_pd(src + k + 2);
        _mm_storeu_pd(acc1 + k, _mm_add_pd(_mm_loadu_pd(acc1 + k), s0));
        _mm_storeu_pd(acc1 + k + 2, _mm_add_pd(_mm_loadu_pd(acc1 + k + 2), s1));
        _mm_storeu_pd(acc2 + k, _mm_add_pd(_mm_loadu_pd(acc2 + k), s0));
        _mm_storeu_pd(acc2 + k + 2, _mm_add_pd(_mm_loadu_pd(acc2 + k + 2), s1));
    }
#else
    (void)nxt;
    (void)far;
    (void)far_acc;
#endif
    for (; k < n; k++) {
        acc1[k] += src[k];
        acc2[k] += src[k];
    }
}
/* ---- machine-limit probes (cposembed._membench) ----------------------- */
static inline void cpe_fill_f32(float *dst, ptrdiff_t n, float value, int stream) {
    ptrdiff_t k = 0;
#if CPE_HAVE_STREAM
    if (stream) {
        __m128 v = _mm_set1_ps(value);
        ptrdiff_t peel = cpe_peel(dst, n, sizeof(float));
        for (; k < peel; k++) dst[k] = value;
        for (; k + 16 <= n; k += 16) {
            _mm_stream_ps(dst + k, v); _mm_stream_ps(dst + k + 4, v);
            _mm_stream_ps(dst + k + 8, v); _mm_stream_ps(dst + k + 12, v);
        }
        for (; k + 4 <= n; k += 4) _mm_stream_ps(dst + k, v);
    }
#endif
    (void)stream;
    for (; k < n; k++) dst[k] = value;
}

/* Sum of n floats with independent accumulators (4 SSE vectors of 4 lanes,
 * 16 floats a step; 8 scalars without SSE2): bound by memory, not by the
 * latency of one chain of adds. Order differs from NumPy's sum; this is a
 * bandwidth probe, not a numerical routine. */
static inline double cpe_read_sum_f32(const float *src, ptrdiff_t n) {
    ptrdiff_t k = 0;
    double total = 0.0;
#if CPE_HAVE_STREAM
    __m128 s0 = _mm_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (; k + 16 <= n; k += 16) {
        s0 = _mm_add_ps(s0, _mm_loadu_ps(src + k));
        s1 = _mm_add_ps(s1, _mm_loadu_ps(src + k + 4));
        s2 = _mm_add_ps(s2, _mm_loadu_ps(src + k + 8));
        s3 = _mm_add_ps(s3, _mm_loadu_ps(src + k + 12));
    }
    float lanes[4];
    _mm_storeu_ps(lanes, _mm_add_ps(_mm_add_ps(s0, s1), _mm_add_ps(s2, s3)));
    total = (double)lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; k + 8 <= n; k += 8)
        for (int j = 0; j < 8; j++) s[j] += src[k + j];
    for (int j = 0; j < 8; j++) total += s[j];
#endif
    for (; k < n; k++) total += src[k];
    return total;
}

#endif /* CPOSEMBED_STREAM_H */
