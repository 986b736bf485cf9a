/* Conversions between the half-precision formats (uint16_t bit patterns)
 * and float32 / float64, by NumPy's rules for float16 (IEEE binary16) and
 * ml_dtypes' for bfloat16 (the top 16 bits of a float32):
 *   - half to float32 is exact, NaN payloads kept;
 *   - float32 and float64 to float16 round once, to nearest even; overflow
 *     gives a signed infinity; a NaN keeps the top bits of its payload
 *     (made nonzero);
 *   - float32 to bfloat16 rounds to nearest even; a NaN becomes 0x7fc0 with
 *     its sign;
 *   - float64 to bfloat16 rounds through float32 (ml_dtypes < 0.7) or once
 *     (0.7), as cpe_set_bf16_from_f64_direct says at import.
 * One rounding from float64 is float64 to float32 rounded to odd, then to
 * the half format to nearest even: float32 keeps enough more bits for that
 * to be the correctly rounded result.
 *
 * The SSE2 versions convert eight values at a time with the scalar
 * functions' bits; eight normal float16 values take a short path.
 */
#ifndef CPOSEMBED_HALF_H
#define CPOSEMBED_HALF_H

#include "_stream.h" /* CPE_HAVE_STREAM: SSE2 */

static inline uint32_t cpe_f32_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}
static inline float cpe_bits_f32(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static inline uint64_t cpe_f64_bits(double x) {
    uint64_t b;
    memcpy(&b, &x, 8);
    return b;
}

/* ---- scalar ------------------------------------------------------------ */

static inline float cpe_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = h & 0x7c00u, m = h & 0x03ffu;
    if (e == 0x7c00u) return cpe_bits_f32(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        /* zero or subnormal: m * 2^-24, exact in float32 */
        float v = (float)m * 5.9604644775390625e-08f;
        return cpe_bits_f32(sign | cpe_f32_bits(v));
    }
    return cpe_bits_f32(sign | (((uint32_t)(h & 0x7fffu) << 13) + 0x38000000u));
}

static inline uint16_t cpe_f16_nan(uint16_t sign, uint32_t top10) {
    uint16_t h = (uint16_t)(0x7c00u + top10);
    return (uint16_t)(sign | (h == 0x7c00u ? h + 1 : h));
}

static inline uint16_t cpe_f32_to_f16(float f) {
    uint32_t b = cpe_f32_bits(f);
    uint16_t sign = (uint16_t)((b >> 16) & 0x8000u);
    uint32_t a = b & 0x7fffffffu;
    if (a >= 0x47800000u) { /* |f| >= 65536, inf or NaN */
        if (a > 0x7f800000u) return cpe_f16_nan(sign, (a & 0x007fffffu) >> 13);
        return (uint16_t)(sign | 0x7c00u);
    }
    if (a < 0x38800000u) { /* below 2^-14: a subnormal half or zero */
        uint32_t e = a >> 23, m, shift, h, rest, half;
        if (e < 102) return sign; /* below 2^-25: rounds to zero */
        m = (a & 0x007fffffu) | 0x00800000u;
        shift = 126 - e; /* 14..24 */
        h = m >> shift;
        rest = m & ((1u << shift) - 1);
        half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1))) h += 1;
        return (uint16_t)(sign | h);
    }
    {
        uint32_t r = a + 0x00000fffu + ((a >> 13) & 1u) - 0x38000000u;
        return (uint16_t)(sign | (r >> 13)); /* a carry into the exponent is right */
    }
}

static inline float cpe_bf16_to_f32(uint16_t h) { return cpe_bits_f32((uint32_t)h << 16); }

static inline uint16_t cpe_f32_to_bf16(float f) {
    uint32_t b = cpe_f32_bits(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(((b >> 16) & 0x8000u) | 0x7fc0u);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/* float64 to float32 rounded to odd (see above); NaN and inf as a cast. */
static inline float cpe_f64_to_f32_odd(double x) {
    float f = (float)x;
    if ((double)f != x && x == x) {
        uint32_t b = cpe_f32_bits(f);
        double af = (double)f < 0 ? -(double)f : (double)f;
        double ax = x < 0 ? -x : x;
        if (af > ax) b -= 1; /* rounded away from zero: step back */
        f = cpe_bits_f32(b | 1u);
    }
    return f;
}

static inline uint16_t cpe_f64_to_f16(double x) {
    if (x != x) {
        uint64_t b = cpe_f64_bits(x);
        return cpe_f16_nan((uint16_t)((b >> 48) & 0x8000u),
                           (uint32_t)((b & 0x000fffffffffffffULL) >> 42));
    }
    return cpe_f32_to_f16(cpe_f64_to_f32_odd(x));
}

static int cpe_bf16_from_f64_direct = 0;

static inline void cpe_set_bf16_from_f64_direct(int direct) {
    cpe_bf16_from_f64_direct = direct;
}

static inline uint16_t cpe_f64_to_bf16(double x) {
    if (x != x) return (uint16_t)(((cpe_f64_bits(x) >> 48) & 0x8000u) | 0x7fc0u);
    return cpe_f32_to_bf16(cpe_bf16_from_f64_direct ? cpe_f64_to_f32_odd(x) : (float)x);
}

/* ---- SSE2: eight values at a time --------------------------------------- */
#if CPE_HAVE_STREAM

/* Four float16 (zero-extended into 32-bit lanes): their sign in float32's
 * place, and their other bits as a normal float32 (exponent rebiased). */
static inline __m128i cpe_f16x4_sign(__m128i h) {
    return _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16);
}
static inline __m128i cpe_f16x4_rebias(__m128i h) {
    return _mm_add_epi32(_mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x7fff)), 13),
                         _mm_set1_epi32(0x38000000));
}

static inline __m128 cpe_f16x4_normal_to_f32(__m128i h) {
    return _mm_castsi128_ps(_mm_or_si128(cpe_f16x4_rebias(h), cpe_f16x4_sign(h)));
}

static inline __m128 cpe_f16x4_to_f32(__m128i h) {
    const __m128i e = _mm_and_si128(h, _mm_set1_epi32(0x7c00));
    const __m128i m = _mm_and_si128(h, _mm_set1_epi32(0x03ff));
    __m128i normal = cpe_f16x4_rebias(h);
    __m128i infnan = _mm_add_epi32(normal, _mm_set1_epi32(0x38000000));
    __m128i sub = _mm_castps_si128(
        _mm_mul_ps(_mm_cvtepi32_ps(m), _mm_set1_ps(5.9604644775390625e-08f)));
    __m128i is_sub = _mm_cmpeq_epi32(e, _mm_setzero_si128());
    __m128i is_inf = _mm_cmpeq_epi32(e, _mm_set1_epi32(0x7c00));
    __m128i r = _mm_or_si128(_mm_and_si128(is_sub, sub), _mm_andnot_si128(is_sub, normal));
    r = _mm_or_si128(_mm_and_si128(is_inf, infnan), _mm_andnot_si128(is_inf, r));
    return _mm_castsi128_ps(_mm_or_si128(r, cpe_f16x4_sign(h)));
}

static inline void cpe_ld8_f16(const uint16_t *p, __m128 *lo, __m128 *hi) {
    __m128i x = _mm_loadu_si128((const __m128i *)p), z = _mm_setzero_si128();
    /* a zero, subnormal, infinity or NaN (exponent 0 or 31) takes the full
     * conversion */
    __m128i e = _mm_and_si128(x, _mm_set1_epi16(0x7c00));
    __m128i special = _mm_or_si128(_mm_cmpeq_epi16(e, z), _mm_cmpeq_epi16(e, _mm_set1_epi16(0x7c00)));
    if (_mm_movemask_epi8(special)) {
        *lo = cpe_f16x4_to_f32(_mm_unpacklo_epi16(x, z));
        *hi = cpe_f16x4_to_f32(_mm_unpackhi_epi16(x, z));
    } else {
        *lo = cpe_f16x4_normal_to_f32(_mm_unpacklo_epi16(x, z));
        *hi = cpe_f16x4_normal_to_f32(_mm_unpackhi_epi16(x, z));
    }
}

static inline void cpe_ld8_bf16(const uint16_t *p, __m128 *lo, __m128 *hi) {
    __m128i x = _mm_loadu_si128((const __m128i *)p), z = _mm_setzero_si128();
    *lo = _mm_castsi128_ps(_mm_unpacklo_epi16(z, x));
    *hi = _mm_castsi128_ps(_mm_unpackhi_epi16(z, x));
}

/* float32's sign of four lanes, sign-extended from float16's bit 15 (for
 * packs), and the float16 bits of |f| (`a`) in the normal range: rounded to
 * nearest even at bit 13, the exponent rebiased (65520 and up carry to inf). */
static inline __m128i cpe_f32x4_half_sign(__m128 f) {
    return _mm_srai_epi32(
        _mm_and_si128(_mm_castps_si128(f), _mm_set1_epi32((int)0x80000000u)), 16);
}
static inline __m128i cpe_f32x4_round_normal(__m128i a) {
    __m128i odd = _mm_and_si128(_mm_srli_epi32(a, 13), _mm_set1_epi32(1));
    return _mm_srli_epi32(
        _mm_sub_epi32(_mm_add_epi32(_mm_add_epi32(a, _mm_set1_epi32(0xfff)), odd),
                      _mm_set1_epi32(0x38000000)),
        13);
}

/* Four float32 to float16, sign-extended into 32-bit lanes (for packs). */
static inline __m128i cpe_f32x4_to_f16(__m128 f) {
    const __m128i a = _mm_and_si128(_mm_castps_si128(f), _mm_set1_epi32(0x7fffffff));
    __m128i normal = cpe_f32x4_round_normal(a);
    /* subnormal: adding 0.5 (2^-1) leaves the rounded value m * 2^-24 in the
     * low bits of the sum's significand (the FPU rounds to nearest even) */
    __m128 magic = _mm_castsi128_ps(_mm_set1_epi32(0x3f000000));
    __m128i sub = _mm_sub_epi32(_mm_castps_si128(_mm_add_ps(_mm_castsi128_ps(a), magic)),
                                _mm_castps_si128(magic));
    /* NaN: 0x7c00 + the top 10 payload bits, made nonzero; inf: 0x7c00 */
    __m128i is_nan = _mm_cmpgt_epi32(a, _mm_set1_epi32(0x7f800000));
    __m128i pay = _mm_and_si128(_mm_srli_epi32(a, 13), _mm_set1_epi32(0x3ff));
    __m128i pay0 = _mm_cmpeq_epi32(pay, _mm_setzero_si128());
    __m128i nan = _mm_sub_epi32(_mm_or_si128(pay, _mm_set1_epi32(0x7c00)), pay0);
    __m128i big = _mm_cmpgt_epi32(a, _mm_set1_epi32(0x477fffff));
    __m128i small = _mm_cmpgt_epi32(_mm_set1_epi32(0x38800000), a);
    __m128i r = _mm_or_si128(_mm_and_si128(small, sub), _mm_andnot_si128(small, normal));
    __m128i special = _mm_or_si128(_mm_and_si128(is_nan, nan),
                                   _mm_andnot_si128(is_nan, _mm_set1_epi32(0x7c00)));
    r = _mm_or_si128(_mm_and_si128(big, special), _mm_andnot_si128(big, r));
    return _mm_or_si128(r, cpe_f32x4_half_sign(f));
}

static inline __m128i cpe_f32x4_normal_to_f16(__m128 f, __m128i a) {
    return _mm_or_si128(cpe_f32x4_round_normal(a), cpe_f32x4_half_sign(f));
}

/* |f| in [2^-14, 65536) in every lane (normal float16 results, or 65536
 * after rounding up, which the normal path also gives as inf). */
static inline __m128i cpe_f16x4_in_normal_range(__m128i a) {
    return _mm_and_si128(_mm_cmpgt_epi32(a, _mm_set1_epi32(0x387fffff)),
                         _mm_cmpgt_epi32(_mm_set1_epi32(0x47800000), a));
}

static inline __m128i cpe_pack8_f16(__m128 lo, __m128 hi) {
    const __m128i abs = _mm_set1_epi32(0x7fffffff);
    __m128i a = _mm_and_si128(_mm_castps_si128(lo), abs);
    __m128i b = _mm_and_si128(_mm_castps_si128(hi), abs);
    __m128i ok = _mm_and_si128(cpe_f16x4_in_normal_range(a), cpe_f16x4_in_normal_range(b));
    if (_mm_movemask_epi8(ok) == 0xffff)
        return _mm_packs_epi32(cpe_f32x4_normal_to_f16(lo, a), cpe_f32x4_normal_to_f16(hi, b));
    return _mm_packs_epi32(cpe_f32x4_to_f16(lo), cpe_f32x4_to_f16(hi));
}

/* Four float32 that are not NaN to bfloat16, rounded to nearest even,
 * sign-extended into 32-bit lanes (for packs). */
static inline __m128i cpe_f32x4_to_bf16(__m128 f) {
    const __m128i b = _mm_castps_si128(f);
    __m128i odd = _mm_and_si128(_mm_srli_epi32(b, 16), _mm_set1_epi32(1));
    return _mm_srai_epi32(_mm_add_epi32(_mm_add_epi32(b, _mm_set1_epi32(0x7fff)), odd), 16);
}

/* The NaN lanes of f replaced by the quiet NaN 0x7fc0 with their sign. */
static inline __m128i cpe_bf16x4_nans(__m128 f, __m128i r) {
    const __m128i b = _mm_castps_si128(f);
    __m128i is_nan = _mm_castps_si128(_mm_cmpunord_ps(f, f));
    __m128i nan = _mm_or_si128(
        _mm_srai_epi32(_mm_and_si128(b, _mm_set1_epi32((int)0x80000000u)), 16),
        _mm_set1_epi32(0x7fc0));
    return _mm_or_si128(_mm_and_si128(is_nan, nan), _mm_andnot_si128(is_nan, r));
}

static inline __m128i cpe_pack8_bf16(__m128 lo, __m128 hi) {
    __m128i a = cpe_f32x4_to_bf16(lo), b = cpe_f32x4_to_bf16(hi);
    if (_mm_movemask_ps(_mm_cmpunord_ps(lo, hi))) { /* a NaN in either */
        a = cpe_bf16x4_nans(lo, a);
        b = cpe_bf16x4_nans(hi, b);
    }
    return _mm_packs_epi32(a, b);
}

#endif /* CPE_HAVE_STREAM */
#endif /* CPOSEMBED_HALF_H */
