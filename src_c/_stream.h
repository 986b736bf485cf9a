/* Memory primitives: streaming (non-temporal) stores, prefetches, a row copy
 * and the benchmark's probes. Streaming stores write whole cache lines without
 * reading them first, halving the traffic of an output far larger than the
 * cache (STREAM_THRESHOLD_BYTES, _kernels.pxi). They need SSE2 (x86-64);
 * elsewhere stores are ordinary. A thread that streamed calls cpe_sfence()
 * before its work counts as done. */
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

/* Prefetches: into L1, into L1 for writing, into L2 (rows a few ahead), and
 * non-temporal (data read once, which should not evict the rows reused). */
#if defined(__GNUC__) || defined(__clang__)
static inline void cpe_prefetch(const void *p) { __builtin_prefetch(p, 0, 3); }
static inline void cpe_prefetch_w(const void *p) { __builtin_prefetch(p, 1, 3); }
static inline void cpe_prefetch_l2(const void *p) { __builtin_prefetch(p, 0, 2); }
static inline void cpe_prefetch_nta(const void *p) { __builtin_prefetch(p, 0, 0); }
#else
static inline void cpe_prefetch(const void *p) { (void)p; }
static inline void cpe_prefetch_w(const void *p) { (void)p; }
#if CPE_HAVE_STREAM
static inline void cpe_prefetch_l2(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T1); }
static inline void cpe_prefetch_nta(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_NTA); }
#else
static inline void cpe_prefetch_l2(const void *p) { (void)p; }
static inline void cpe_prefetch_nta(const void *p) { (void)p; }
#endif
#endif

/* The row primitives' prefetches at byte offsets gk of source rows and tk of
 * rows added into: nxt into L1, far and far_acc into L2, nacc for writing. */
static inline void cpe_prefetch_acc(const void *nxt, const void *far, const void *nacc,
                                    const void *far_acc, ptrdiff_t gk, ptrdiff_t tk) {
    if (nxt) cpe_prefetch((const char *)nxt + gk);
    if (far) cpe_prefetch_l2((const char *)far + gk);
    if (nacc) cpe_prefetch_w((const char *)nacc + tk);
    if (far_acc) cpe_prefetch_l2((const char *)far_acc + tk);
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

/* ---- copy: n bytes (a row of any element type) -------------------------- */
static inline void cpe_copy_bytes(void *dst, const void *src, size_t n, int stream) {
#if CPE_HAVE_STREAM
    if (stream) {
        char *d = (char *)dst;
        const char *s = (const char *)src;
        size_t k = (size_t)((16 - ((uintptr_t)d & 15)) & 15);
        if (k > n) k = n;
        memcpy(d, s, k);
        for (; k + 64 <= n; k += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + k));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + k + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + k + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + k + 48));
            _mm_stream_si128((__m128i *)(d + k), a);
            _mm_stream_si128((__m128i *)(d + k + 16), b);
            _mm_stream_si128((__m128i *)(d + k + 32), c);
            _mm_stream_si128((__m128i *)(d + k + 48), e);
        }
        for (; k + 16 <= n; k += 16)
            _mm_stream_si128((__m128i *)(d + k), _mm_loadu_si128((const __m128i *)(s + k)));
        memcpy(d + k, s + k, n - k);
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, n);
}

/* ---- machine-limit probes (cposembed._membench) ----------------------- */
static inline void cpe_fill_f32(float *dst, ptrdiff_t n, float value, int stream) {
    ptrdiff_t k = 0;
#if CPE_HAVE_STREAM
    if (stream) {
        __m128 v = _mm_set1_ps(value);
        ptrdiff_t peel = cpe_peel(dst, n, sizeof(float));
        for (; k < peel; k++) dst[k] = value;
        for (; k + 4 <= n; k += 4) _mm_stream_ps(dst + k, v);
    }
#endif
    (void)stream;
    for (; k < n; k++) dst[k] = value;
}

/* Sum of n floats with independent accumulators, so that memory bounds it,
 * not one chain of adds (a bandwidth probe: not NumPy's order). */
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
