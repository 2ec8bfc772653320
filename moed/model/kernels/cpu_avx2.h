/* The AVX2 + FMA (x86-64-v3) build of cpu_bf16.c: the 512-bit intrinsics that file uses, each
 * done on a pair of 256-bit registers with the same lane order and the same arithmetic, so the
 * AVX2 variant computes every output in the same order, with the same roundings, as the
 * AVX512-BF16 variant: the two are bitwise equal (moed/model/kernels/__init__.py builds both
 * from the one source; tests/unit/model/test_cpu_isa.py holds them to it).
 *
 * Included by cpu_bf16.c only when the compiler does not target AVX-512 (__AVX512F__ unset).
 * immintrin.h has declared the real _mm512_* functions and types by then; the macros below
 * shadow those names in cpu_bf16.c only.
 *
 * The two places where they could part, and why they do not:
 *  - vdpbf16ps computes acc + a_odd*b_odd, then + a_even*b_even, each step rounded once (the
 *    products of two bf16 are exact in fp32): two FMAs in that order (measured bitwise equal
 *    on Sapphire Rapids over 320k random lanes). It treats denormal inputs as zero and flushes
 *    denormal results; the FMAs here do not, so the variants can differ where a dot product
 *    meets a denormal (|x| < 1.2e-38: no trained weight or activation sits there).
 *  - vcvtneps2bf16 (round to nearest even, NaN quieted, denormal input to signed zero): done
 *    bit for bit in integer lanes (cvtne_bits below), denormal flush included. */
#ifndef MOED_CPU_AVX2_H
#define MOED_CPU_AVX2_H

typedef struct { __m256 lo, hi; } v16f;
typedef struct { __m256i lo, hi; } v16i;

#define __m512 v16f
#define __m512d v16f
#define __m512i v16i
#define __m512bh v16i

static inline v16f v16f_of(__m256 lo, __m256 hi) { v16f r = {lo, hi}; return r; }
static inline v16i v16i_of(__m256i lo, __m256i hi) { v16i r = {lo, hi}; return r; }

/* __mmask16 -> all-ones 32-bit lanes where the mask bit is set (8 lanes from bit `shift`). */
static inline __m256i mask_lanes8(unsigned m, int shift) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)((m >> shift) & 0xff)), bit), bit);
}

#define _mm512_setzero_ps() v16f_of(_mm256_setzero_ps(), _mm256_setzero_ps())
#define _mm512_setzero_si512() v16i_of(_mm256_setzero_si256(), _mm256_setzero_si256())
static inline v16f s_set1_ps(float f) { return v16f_of(_mm256_set1_ps(f), _mm256_set1_ps(f)); }
static inline v16i s_set1_epi32(int i) { return v16i_of(_mm256_set1_epi32(i), _mm256_set1_epi32(i)); }
#define _mm512_set1_ps s_set1_ps
#define _mm512_set1_epi32 s_set1_epi32

#define S_BINOP_PS(name, op) \
    static inline v16f s_##name(v16f a, v16f b) { return v16f_of(op(a.lo, b.lo), op(a.hi, b.hi)); }
S_BINOP_PS(add_ps, _mm256_add_ps)
S_BINOP_PS(sub_ps, _mm256_sub_ps)
S_BINOP_PS(mul_ps, _mm256_mul_ps)
S_BINOP_PS(div_ps, _mm256_div_ps)
S_BINOP_PS(max_ps, _mm256_max_ps)
S_BINOP_PS(unpacklo_ps, _mm256_unpacklo_ps)
S_BINOP_PS(unpackhi_ps, _mm256_unpackhi_ps)
#define _mm512_add_ps s_add_ps
#define _mm512_sub_ps s_sub_ps
#define _mm512_mul_ps s_mul_ps
#define _mm512_div_ps s_div_ps
#define _mm512_max_ps s_max_ps
#define _mm512_unpacklo_ps s_unpacklo_ps
#define _mm512_unpackhi_ps s_unpackhi_ps

static inline v16f s_unpacklo_pd(v16f a, v16f b) {
    return v16f_of(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a.lo), _mm256_castps_pd(b.lo))),
                   _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a.hi), _mm256_castps_pd(b.hi))));
}
static inline v16f s_unpackhi_pd(v16f a, v16f b) {
    return v16f_of(_mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a.lo), _mm256_castps_pd(b.lo))),
                   _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a.hi), _mm256_castps_pd(b.hi))));
}
#define _mm512_unpacklo_pd s_unpacklo_pd
#define _mm512_unpackhi_pd s_unpackhi_pd
#define _mm512_castps_pd(v) (v)
#define _mm512_castpd_ps(v) (v)

/* Only the two selectors cpu_bf16.c uses: 0x88 = [a.c0 a.c2 b.c0 b.c2], 0xdd = [a.c1 a.c3 b.c1 b.c3]
 * (128-bit chunks c0..c3; a pair holds c0 c1 in lo, c2 c3 in hi). */
static inline v16f s_shuffle_f32x4(v16f a, v16f b, int imm) {
    return imm == 0x88 ? v16f_of(_mm256_permute2f128_ps(a.lo, a.hi, 0x20), _mm256_permute2f128_ps(b.lo, b.hi, 0x20))
                       : v16f_of(_mm256_permute2f128_ps(a.lo, a.hi, 0x31), _mm256_permute2f128_ps(b.lo, b.hi, 0x31));
}
#define _mm512_shuffle_f32x4 s_shuffle_f32x4

static inline v16f s_fmadd_ps(v16f a, v16f b, v16f c) {
    return v16f_of(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline v16f s_fnmadd_ps(v16f a, v16f b, v16f c) {
    return v16f_of(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
#define _mm512_fmadd_ps s_fmadd_ps
#define _mm512_fnmadd_ps s_fnmadd_ps

static inline v16f s_loadu_ps(const float *p) { return v16f_of(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void s_storeu_ps(float *p, v16f v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline v16i s_loadu_si512(const void *p) {
    return v16i_of(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1));
}
static inline void s_storeu_si512(void *p, v16i v) {
    _mm256_storeu_si256((__m256i *)p, v.lo);
    _mm256_storeu_si256((__m256i *)p + 1, v.hi);
}
#define _mm512_loadu_ps s_loadu_ps
#define _mm512_load_ps s_loadu_ps
#define _mm512_storeu_ps s_storeu_ps
#define _mm512_loadu_si512 s_loadu_si512
#define _mm512_storeu_si512 s_storeu_si512

static inline v16i s_castps_si512(v16f v) { return v16i_of(_mm256_castps_si256(v.lo), _mm256_castps_si256(v.hi)); }
static inline v16f s_castsi512_ps(v16i v) { return v16f_of(_mm256_castsi256_ps(v.lo), _mm256_castsi256_ps(v.hi)); }
#define _mm512_castps_si512 s_castps_si512
#define _mm512_castsi512_ps s_castsi512_ps

static inline v16i s_slli_epi32(v16i a, int n) { return v16i_of(_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)); }
static inline v16i s_srli_epi32(v16i a, int n) { return v16i_of(_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)); }
static inline v16i s_add_epi32(v16i a, v16i b) { return v16i_of(_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)); }
static inline v16i s_and_si512(v16i a, v16i b) { return v16i_of(_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)); }
#define _mm512_slli_epi32 s_slli_epi32
#define _mm512_srli_epi32 s_srli_epi32
#define _mm512_add_epi32 s_add_epi32
#define _mm512_and_si512 s_and_si512

/* 16 u16 -> 16 u32, and back (values < 2^16 here: packus does not saturate them). */
static inline v16i s_cvtepu16_epi32(__m256i x) {
    return v16i_of(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(x)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(x, 1)));
}
static inline __m256i s_cvtepi32_epi16(v16i v) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(v.lo, v.hi), 0xd8);
}
#define _mm512_cvtepu16_epi32 s_cvtepu16_epi32
#define _mm512_cvtepi32_epi16 s_cvtepi32_epi16

static inline __mmask16 s_cmpgt_epu32_mask(v16i a, v16i b) {
    const __m256i flip = _mm256_set1_epi32((int)0x80000000u);
    const __m256i lo = _mm256_cmpgt_epi32(_mm256_xor_si256(a.lo, flip), _mm256_xor_si256(b.lo, flip));
    const __m256i hi = _mm256_cmpgt_epi32(_mm256_xor_si256(a.hi, flip), _mm256_xor_si256(b.hi, flip));
    return (__mmask16)(_mm256_movemask_ps(_mm256_castsi256_ps(lo)) | _mm256_movemask_ps(_mm256_castsi256_ps(hi)) << 8);
}
#define _mm512_cmpgt_epu32_mask s_cmpgt_epu32_mask

static inline v16i s_mask_or_epi32(v16i src, __mmask16 m, v16i a, v16i b) {
    return v16i_of(_mm256_blendv_epi8(src.lo, _mm256_or_si256(a.lo, b.lo), mask_lanes8(m, 0)),
                   _mm256_blendv_epi8(src.hi, _mm256_or_si256(a.hi, b.hi), mask_lanes8(m, 8)));
}
#define _mm512_mask_or_epi32 s_mask_or_epi32

/* Masked loads/stores. maskload/maskstore never touch masked-off lanes' memory. */
static inline v16f s_maskz_loadu_ps(__mmask16 m, const float *p) {
    if (m == 0xffff) return s_loadu_ps(p);
    return v16f_of(_mm256_maskload_ps(p, mask_lanes8(m, 0)), _mm256_maskload_ps(p + 8, mask_lanes8(m, 8)));
}
static inline void s_mask_storeu_ps(float *p, __mmask16 m, v16f v) {
    if (m == 0xffff) { s_storeu_ps(p, v); return; }
    _mm256_maskstore_ps(p, mask_lanes8(m, 0), v.lo);
    _mm256_maskstore_ps(p + 8, mask_lanes8(m, 8), v.hi);
}
static inline v16f s_mask_max_ps(v16f src, __mmask16 m, v16f a, v16f b) {
    return v16f_of(_mm256_blendv_ps(src.lo, _mm256_max_ps(a.lo, b.lo), _mm256_castsi256_ps(mask_lanes8(m, 0))),
                   _mm256_blendv_ps(src.hi, _mm256_max_ps(a.hi, b.hi), _mm256_castsi256_ps(mask_lanes8(m, 8))));
}
static inline v16f s_mask_add_ps(v16f src, __mmask16 m, v16f a, v16f b) {
    return v16f_of(_mm256_blendv_ps(src.lo, _mm256_add_ps(a.lo, b.lo), _mm256_castsi256_ps(mask_lanes8(m, 0))),
                   _mm256_blendv_ps(src.hi, _mm256_add_ps(a.hi, b.hi), _mm256_castsi256_ps(mask_lanes8(m, 8))));
}
#define _mm512_maskz_loadu_ps s_maskz_loadu_ps
#define _mm512_mask_storeu_ps s_mask_storeu_ps
#define _mm512_mask_max_ps s_mask_max_ps
#define _mm512_mask_add_ps s_mask_add_ps
#define _mm512_mask_cmp_ps_mask(m, a, b, pred) \
    ((__mmask16)((m) & (_mm256_movemask_ps(_mm256_cmp_ps((a).lo, (b).lo, pred)) | \
                        _mm256_movemask_ps(_mm256_cmp_ps((a).hi, (b).hi, pred)) << 8)))

/* 16 bf16 (u16) lanes; the masks cpu_bf16.c passes here are prefixes (lanes()), any mask works. */
static inline __m256i s_maskz_loadu_epi16(__mmask16 m, const void *p) {
    if (m == 0xffff) return _mm256_loadu_si256((const __m256i *)p);
    uint16_t t[16] = {0};
    for (int i = 0; i < 16; i++) if (m >> i & 1) t[i] = ((const uint16_t *)p)[i];
    return _mm256_loadu_si256((const __m256i *)t);
}
static inline void s_mask_storeu_epi16(void *p, __mmask16 m, __m256i v) {
    if (m == 0xffff) { _mm256_storeu_si256((__m256i *)p, v); return; }
    uint16_t t[16];
    _mm256_storeu_si256((__m256i *)t, v);
    for (int i = 0; i < 16; i++) if (m >> i & 1) ((uint16_t *)p)[i] = t[i];
}
#define _mm256_maskz_loadu_epi16 s_maskz_loadu_epi16
#define _mm256_mask_storeu_epi16 s_mask_storeu_epi16

/* GCC's _mm512_reduce_add_ps / _mm512_reduce_max_ps, step for step (the order decides the bits):
 * hi half op lo half, then the 128-bit halves, then lanes {2,3} onto {0,1}, then lane 1 onto 0. */
static inline float s_reduce_add_ps(v16f v) {
    const __m256 t3 = _mm256_add_ps(v.hi, v.lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
static inline float s_reduce_max_ps(v16f v) {
    const __m256 t3 = _mm256_max_ps(v.hi, v.lo);
    const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m128 t10 = _mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1)));
    return _mm_cvtss_f32(t10);
}
#define _mm512_reduce_add_ps s_reduce_add_ps
#define _mm512_reduce_max_ps s_reduce_max_ps

#define _mm512_roundscale_ps(v, imm) v16f_of(_mm256_round_ps((v).lo, imm), _mm256_round_ps((v).hi, imm))

/* 2^n for integral n in [-100, 100], built in the exponent field. */
static inline __m256 pow2_x8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
/* vscalefps for integral n: p * 2^n rounded once. n is clamped to [-200, 200] (p is within
 * [0.5, 2) in exp_x16: beyond that range the answer is 0 or inf either way) and applied in two
 * halves, each a power of two that is a normal float: the first product is exact, the second
 * rounds once (into a denormal when the result is one), as vscalefps does. */
static inline __m256 scalef_x8(__m256 p, __m256 n) {
    n = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-200.f)), _mm256_set1_ps(200.f));
    const __m256 n1 = _mm256_round_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    return _mm256_mul_ps(_mm256_mul_ps(p, pow2_x8(n1)), pow2_x8(_mm256_sub_ps(n, n1)));
}
static inline v16f s_scalef_ps(v16f p, v16f n) { return v16f_of(scalef_x8(p.lo, n.lo), scalef_x8(p.hi, n.hi)); }
#define _mm512_scalef_ps s_scalef_ps

/* vcvtneps2bf16, 8 lanes -> bf16 bits in 32-bit lanes: NaN -> quiet NaN, denormal -> signed
 * zero, else round to nearest even. */
static inline __m256i cvtne_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                                         _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000));
    const __m256i den = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f800000)), _mm256_setzero_si256());
    __m256i out = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm256_blendv_epi8(out, _mm256_srli_epi32(_mm256_and_si256(u, _mm256_set1_epi32((int)0x80000000u)), 16), den);
}
static inline __m256i cvtne_bh16(v16f v) { return s_cvtepi32_epi16(v16i_of(cvtne_bits8(v.lo), cvtne_bits8(v.hi))); }

/* vdpbf16ps: per fp32 lane i, acc + a[2i+1]*b[2i+1], then + a[2i]*b[2i] (see the top). */
static inline __m256 dpbf16_x8(__m256 acc, __m256i a, __m256i b) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, hi)), _mm256_castsi256_ps(_mm256_and_si256(b, hi)), acc);
    return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), acc);
}
static inline v16f s_dpbf16_ps(v16f acc, v16i a, v16i b) {
    return v16f_of(dpbf16_x8(acc.lo, a.lo, b.lo), dpbf16_x8(acc.hi, a.hi, b.hi));
}
#define _mm512_dpbf16_ps s_dpbf16_ps

#endif
