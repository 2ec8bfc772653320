/* Integer dot products for int8 / int4 weights on few rows (decode): model.quantization_activations
 * = "int8" (W8A8 / W4A8). Compiled into the same .so as cpu_bf16.c and cpu_quant.c, per variant.
 *
 * Numerics (kernels/qdot.py's reference computes the same bits in torch):
 *  - Each activation row is quantized per weight group g (columns [gG, gG + G), G = the weight's
 *    group, or K for one group per row): amax = max |x|, inv = 127 / amax, sx = amax / 127 (fp32
 *    divisions; amax 0: inv 0), x_q = round-half-even(x * inv) clamped to [-127, 127]. The block
 *    is the weight group so that the integer sum runs the whole group and the fp32 work is one
 *    scale per (row, output, group); int8 per-channel weights get one scale per row.
 *  - Within a group the columns are laid out in chunks of 64 bytes (int8: column order; int4:
 *    the chunk's 32 even columns then its 32 odd ones, the low and high nibbles of 32 weight
 *    bytes), zero padded. Lane l (0..15) of a chunk holds its bytes 4l..4l+3. Per lane, over the
 *    group: I_l = sum (w_q - z) * x_q, exact in int32 (z: the zero point; int4 symmetric 8,
 *    int8 symmetric 0), computed as sum w_q x_q - z * sum x_q.
 *  - Per lane in fp32: acc_l = acc_l + float(I_l) * (sx_g * s_g), group by group, not fused.
 *  - y = the 16 lanes summed in halves (l + l+8, then + 4, + 2, + 1), + bias (fp32), rounded once
 *    to the output dtype.
 * So a row's result depends on neither its batch nor the thread count, and the variants agree
 * bit for bit (the integer sums are exact whichever instruction makes them).
 *
 * Instructions: vpdpbusd (AVX512-VNNI, u8 x s8 in 4-byte groups into int32, no saturation) where
 * the CPU has it, checked at run time (the avx512 variant also runs on Skylake-SP, which lacks
 * it; emitted by inline asm so no compiler flag puts VNNI anywhere else); else vpmaddubsw +
 * vpmaddwd (AVX512BW, or AVX2 on 256-bit halves). The unsigned operand is the weight: int4 codes
 * (0..15) as they are; int8 |w| with w's sign moved onto x (|x_q| <= 127, so a pair of products
 * is at most 2 * 128 * 127 < 2^15: vpmaddubsw never saturates).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16_scalar.h"

enum { QD_INT8 = 0, QD_INT4 = 1 };

#if defined(__AVX512F__)
#define QDN 4        /* output rows per unit: cpu_quant.c's QNR, so moed_moe_q's unit split fits */
#define QDR 4        /* input rows per register tile */
typedef __m512i vi;
typedef __m512 vf;
typedef struct { __m512i u; __mmask64 neg; } wv;
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_load(const int8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vi vi_dp(const int vnni, vi acc, vi u, vi s) {
    if (vnni) {
        __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
        return acc;
    }
    const vi t = _mm512_maddubs_epi16(u, s);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(t, _mm512_set1_epi16(1)));
}
static inline vi vi_zcorr(vi acc, int z, vi xl) { return _mm512_sub_epi32(acc, _mm512_mullo_epi32(_mm512_set1_epi32(z), xl)); }
static inline vi vi_neg8(vi xl) { return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(xl, 3)); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_acc(vf acc, vi i, float s) { return _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(s))); }
static inline float vf_sum(vf a) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 t = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
static inline wv w8_load(const uint8_t *p, long n) {
    const __m512i v = _mm512_maskz_loadu_epi8(n >= 64 ? ~0ULL : (1ULL << n) - 1, (const void *)p);
    wv w = {_mm512_abs_epi8(v), _mm512_movepi8_mask(v)};
    return w;
}
static inline wv w4_load(const uint8_t *p, long n) {      /* n <= 32 bytes: 2n nibbles */
    const __m256i b = _mm256_maskz_loadu_epi8(n >= 32 ? ~0U : (1U << n) - 1, (const void *)p);
    const __m256i f = _mm256_set1_epi8(15);
    wv w = {_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, f)),
                               _mm256_and_si256(_mm256_srli_epi16(b, 4), f), 1), 0};
    return w;
}
static inline vi x_signed(vi x, wv w) { return _mm512_mask_sub_epi8(x, w.neg, _mm512_setzero_si512(), x); }
#elif defined(__AVX2__) && defined(__FMA__)
#define QDN 2
#define QDR 2        /* int4 only: 8 accumulators + 2 rows' nibbles + x = 14 of 16 ymm; int8's
                        sign operands leave no room for a second row (qd_units_t) */
typedef struct { __m256i a, b; } vi;      /* 16 int32 lanes: a = lanes 0..7, b = 8..15 */
typedef struct { __m256 a, b; } vf;
typedef struct { vi u, w; } wv;
static inline vi vi_zero(void) { vi v = {_mm256_setzero_si256(), _mm256_setzero_si256()}; return v; }
static inline vi vi_load(const int8_t *p) {
    vi v = {_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))};
    return v;
}
static inline __m256i dp8(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
static inline vi vi_dp(const int vnni, vi acc, vi u, vi s) {
    (void)vnni;
    vi v = {dp8(acc.a, u.a, s.a), dp8(acc.b, u.b, s.b)};
    return v;
}
static inline vi vi_zcorr(vi acc, int z, vi xl) {
    const __m256i zv = _mm256_set1_epi32(z);
    vi v = {_mm256_sub_epi32(acc.a, _mm256_mullo_epi32(zv, xl.a)), _mm256_sub_epi32(acc.b, _mm256_mullo_epi32(zv, xl.b))};
    return v;
}
static inline vi vi_neg8(vi xl) {
    vi v = {_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(xl.a, 3)),
            _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(xl.b, 3))};
    return v;
}
static inline vf vf_zero(void) { vf v = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return v; }
static inline vf vf_acc(vf acc, vi i, float s) {
    const __m256 sv = _mm256_set1_ps(s);
    vf v = {_mm256_add_ps(acc.a, _mm256_mul_ps(_mm256_cvtepi32_ps(i.a), sv)),
            _mm256_add_ps(acc.b, _mm256_mul_ps(_mm256_cvtepi32_ps(i.b), sv))};
    return v;
}
static inline float vf_sum(vf a) {
    const __m256 h = _mm256_add_ps(a.a, a.b);
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 t = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
static inline const uint8_t *padded(const uint8_t *p, long n, long full, uint8_t *buf) {
    if (n >= full) return p;
    memset(buf, 0, 64);
    memcpy(buf, p, n);
    return buf;
}
static inline wv w8_load(const uint8_t *p, long n) {
    uint8_t buf[64];
    const vi v = vi_load((const int8_t *)padded(p, n, 64, buf));
    wv w = {{_mm256_abs_epi8(v.a), _mm256_abs_epi8(v.b)}, v};
    return w;
}
static inline wv w4_load(const uint8_t *p, long n) {
    uint8_t buf[64];
    const __m256i b = _mm256_loadu_si256((const __m256i *)padded(p, n, 32, buf)), f = _mm256_set1_epi8(15);
    wv w = {{_mm256_and_si256(b, f), _mm256_and_si256(_mm256_srli_epi16(b, 4), f)}, vi_zero()};
    return w;
}
static inline vi x_signed(vi x, wv w) { vi v = {_mm256_sign_epi8(x.a, w.w.a), _mm256_sign_epi8(x.b, w.w.b)}; return v; }
#else
#error "build with -mavx512f or -march=x86-64-v3"
#endif

typedef struct {
    const uint8_t *w; long ldw; const float *s; long lds; const uint8_t *z; long ldz;
    long G, K;              /* columns per group (<= K), input columns */
} QDMat;

/* Quantized rows: R x [ng groups][cg chunks][64] codes, then sx [R][ng], then lane sums [R][ng][16]. */
typedef struct { long ng, cg, rowb; } QDShape;

static inline QDShape qd_shape(long K, long G) {
    QDShape s = {(K + G - 1) / G, (G + 63) / 64, 0};
    s.rowb = s.ng * s.cg * 64;
    return s;
}

static int use_vnni = -1;       /* -1: not decided yet; moed_qdot_vnni */

/* Whether the integer dots use vpdpbusd. set -1: ask; 0: no (the tests' way to run the
 * vpmaddubsw path on a VNNI CPU); 1: yes if this CPU has it. Same bits either way. */
int moed_qdot_vnni(int set) {
#if defined(__AVX512F__)
    __builtin_cpu_init();
    const int has = !!__builtin_cpu_supports("avx512vnni");
#else
    const int has = 0;
#endif
    if (set >= 0 || use_vnni < 0) use_vnni = set == 0 ? 0 : has;
    return use_vnni;
}

/* Bytes moed_qdot_quantize writes for R rows of K columns in groups of G. */
long moed_qdot_bytes(long R, long K, long G) {
    const QDShape sh = qd_shape(K, G);
    return R * (sh.rowb + sh.ng * (4 + 64)) + 64;
}

#if defined(__AVX512BW__)
/* The scalar loop below for one full chunk (64 columns x, codes to q in layout order, their
 * 4-byte lane sums added to l), 16 lanes at a time and bit for bit: x * inv rounded once,
 * roundscale to nearest even (nearbyintf's default mode), the clamps in the order that keeps a
 * NaN (vminps / vmaxps return their second operand on NaN), then truncation to int32 and to a
 * byte as the scalar (int8_t) cast compiles (cvttss2si: NaN -> 0x80000000 -> byte 0). */
static inline void qd_chunk64(const int fmt, const float *x, __m512 inv, int8_t *q, int32_t *l) {
    __m512 v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm512_loadu_ps(x + 16 * i);
    if (fmt == QD_INT4) {          /* positions 0..31 the even columns, 32..63 the odd */
        const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
        const __m512 e0 = _mm512_permutex2var_ps(v[0], ev, v[1]), e1 = _mm512_permutex2var_ps(v[2], ev, v[3]);
        const __m512 o0 = _mm512_permutex2var_ps(v[0], od, v[1]), o1 = _mm512_permutex2var_ps(v[2], od, v[3]);
        v[0] = e0, v[1] = e1, v[2] = o0, v[3] = o1;
    }
    __m128i b[4];
    for (int i = 0; i < 4; i++) {
        __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm512_max_ps(_mm512_set1_ps(-127.0f), _mm512_min_ps(_mm512_set1_ps(127.0f), t));
        b[i] = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(t));
    }
    const __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(b[1], b[0])), _mm256_set_m128i(b[3], b[2]), 1);
    _mm512_storeu_si512((void *)q, c);
    const __m512i sums = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_set1_epi8(1), c), _mm512_set1_epi16(1));
    _mm512_storeu_si512((void *)l, _mm512_add_epi32(_mm512_loadu_si512((const void *)l), sums));
}
#endif

#if !defined(__AVX512BW__)
/* qd_chunk64 on AVX2, bit for bit: the same rounding and clamps on 8 lanes; the byte is the
 * int32's low byte as the scalar cast keeps it (NaN -> 0x80000000 -> 0), by masking to 0..255
 * and packing unsigned (exact there). 32 columns of x -> their 32 bytes in column order. */
static inline __m256i qd_bytes32(const float *x, __m256 inv) {
    __m256i v[4];
    for (int i = 0; i < 4; i++) {
        __m256 t = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm256_max_ps(_mm256_set1_ps(-127.0f), _mm256_min_ps(_mm256_set1_ps(127.0f), t));
        v[i] = _mm256_and_si256(_mm256_cvttps_epi32(t), _mm256_set1_epi32(0xFF));
    }
    /* the packs interleave by 128-bit lane: dwords come out as columns 0, 8, 16, 24, 4, 12, 20, 28 (x4) */
    const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(v[0], v[1]), _mm256_packus_epi32(v[2], v[3]));
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
static inline void qd_chunk64(const int fmt, const float *x, __m256 inv, int8_t *q, int32_t *l) {
    __m256i a = qd_bytes32(x, inv), b = qd_bytes32(x + 32, inv);
    if (fmt == QD_INT4) {          /* positions 0..31 the even columns, 32..63 the odd */
        const __m256i m = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        const __m256i ea = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(a, m), 0xD8);   /* [even | odd] of a */
        const __m256i eb = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, m), 0xD8);
        a = _mm256_permute2x128_si256(ea, eb, 0x20);
        b = _mm256_permute2x128_si256(ea, eb, 0x31);
    }
    _mm256_storeu_si256((__m256i *)q, a);
    _mm256_storeu_si256((__m256i *)(q + 32), b);
    const __m256i one8 = _mm256_set1_epi8(1), one16 = _mm256_set1_epi16(1);
    const __m256i sa = _mm256_madd_epi16(_mm256_maddubs_epi16(one8, a), one16);
    const __m256i sb = _mm256_madd_epi16(_mm256_maddubs_epi16(one8, b), one16);
    _mm256_storeu_si256((__m256i *)l, _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)l), sa));
    _mm256_storeu_si256((__m256i *)(l + 8), _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(l + 8)), sb));
}
#endif

/* R rows of x (fp32, row stride ldx) into buf (layout above; numerics in the header). */
void moed_qdot_quantize(int fmt, const float *x, long ldx, long R, long K, long G, void *buf) {
    const QDShape sh = qd_shape(K, G);
    int8_t *codes = buf;
    float *sx = (float *)(codes + R * sh.rowb);
    int32_t *xl = (int32_t *)(sx + R * sh.ng);
    memset(codes, 0, R * sh.rowb);
    memset(xl, 0, sizeof(int32_t) * R * sh.ng * 16);
    for (long r = 0; r < R; r++)
        for (long g = 0; g < sh.ng; g++) {
            const float *xr = x + r * ldx;
            const long k0 = g * G, k1 = k0 + G < K ? k0 + G : K;
            float amax = 0.0f;
            long k = k0;
#if defined(__AVX512BW__)
            __m512 m = _mm512_setzero_ps();   /* vmaxps(|x|, m) keeps m where |x| is NaN, as `a > amax` does */
            for (; k + 16 <= k1; k += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xr + k)), m);
            amax = _mm512_reduce_max_ps(m);
#else
            __m256 m = _mm256_setzero_ps();   /* as above: vmaxps keeps m where |x| is NaN */
            const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
            for (; k + 8 <= k1; k += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xr + k), absmask), m);
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
#endif
            for (; k < k1; k++) { const float a = fabsf(xr[k]); if (a > amax) amax = a; }
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            sx[r * sh.ng + g] = amax / 127.0f;
            int8_t *q = codes + r * sh.rowb + g * sh.cg * 64;
            int32_t *l = xl + (r * sh.ng + g) * 16;
            k = k0;
#if defined(__AVX512BW__)
            for (; k + 64 <= k1; k += 64) qd_chunk64(fmt, xr + k, _mm512_set1_ps(inv), q + (k - k0), l);
#else
            for (; k + 64 <= k1; k += 64) qd_chunk64(fmt, xr + k, _mm256_set1_ps(inv), q + (k - k0), l);
#endif
            for (; k < k1; k++) {
                const long p = k - k0, c = p & 63, pos = (p >> 6) * 64 + (fmt == QD_INT4 ? (c >> 1) + ((c & 1) << 5) : c);
                float v = nearbyintf(xr[k] * inv);
                v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
                q[pos] = (int8_t)v;
                l[(pos & 63) >> 2] += (int8_t)v;
            }
        }
}


/* zk: 0 no zero point (int8 symmetric), 1 the constant 8 (int4 symmetric), 2 stored zeros. */
static inline int zero_of(const int fmt, const int zk, const QDMat *q, long n, long g) {
    if (zk == 0) return 0;
    if (zk == 1) return 8;
    const uint8_t b = q->z[n * q->ldz + g];
    return fmt == QD_INT8 ? (int)(int8_t)b : (int)b;
}

#if !defined(__AVX512F__)
/* AVX2, int4: two chunks' vpmaddubsw products summed in int16 before one vpmaddwd (a pair of
 * products is at most 2 * 15 * 127 = 3810, two chunks 7620 < 2^15): 3 integer multiplies for
 * two chunks' 16 bytes of a lane half instead of 4 (Zen2 has one vector integer multiplier).
 * x: the two chunks' 128 codes. Exact integer sums: the lanes vi_dp gives chunk by chunk. */
static inline vi qd_pair4(vi acc, wv w0, wv w1, const int8_t *x) {
    const vi x0 = vi_load(x), x1 = vi_load(x + 64);
    const __m256i one = _mm256_set1_epi16(1);
    const __m256i sa = _mm256_add_epi16(_mm256_maddubs_epi16(w0.u.a, x0.a), _mm256_maddubs_epi16(w1.u.a, x1.a));
    const __m256i sb = _mm256_add_epi16(_mm256_maddubs_epi16(w0.u.b, x0.b), _mm256_maddubs_epi16(w1.u.b, x1.b));
    vi v = {_mm256_add_epi32(acc.a, _mm256_madd_epi16(sa, one)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(sb, one))};
    return v;
}
#endif

#if !defined(__AVX512F__)
#define QP_MIN 3       /* fewest input rows the panels take: at two qd_tile is as fast (int8: faster) */
#define QP_ROWS 32      /* input rows of a panel: their fp32 lanes, 32 x QDN x 64 B = 4 KiB of L1 */
/* Whether a weight takes the panels below: symmetric int4 whose groups are whole chunk pairs,
 * symmetric int8 whose groups are whole chunks. */
static inline int qd_panel_takes(int fmt, int zk, long K, long G) {
    return K % G == 0 && ((fmt == QD_INT4 && zk == 1 && G % 128 == 0) || (fmt == QD_INT8 && zk == 0 && G % 64 == 0));
}

/* A panel's unit from output row n0: its weight rows (past N: the last, not written), fp32 lanes 0. */
static inline void qd_panel_start(const QDMat *q, long n0, long N, long nr, long rows[QDN], const uint8_t *wr[QDN],
                                  __m256 acc[][QDN][2]) {
    for (int j = 0; j < QDN; j++) {
        rows[j] = n0 + j < N ? n0 + j : N - 1;
        wr[j] = q->w + rows[j] * q->ldw;
    }
    for (long r = 0; r < nr; r++)
        for (int j = 0; j < QDN; j++) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
}

/* A panel's nr rows x QDN outputs: the 16 lanes summed as vf_sum does, + bias, rounded once. */
static inline void qd_panel_out(__m256 acc[][QDN][2], long nr, long rb, long n0, long N, const float *bias,
                                void *out, long ldo, int out_f32) {
    for (long r = 0; r < nr; r++)
        for (int j = 0; j < QDN; j++) {
            const long n = n0 + j;
            if (n >= N) continue;
            const vf v = {acc[r][j][0], acc[r][j][1]};
            float y = vf_sum(v);
            if (bias) y += bias[n];
            if (out_f32) ((float *)out)[(rb + r) * ldo + n] = y;
            else ((uint16_t *)out)[(rb + r) * ldo + n] = f32_to_bf16(y);
        }
}

/* AVX2, int4 symmetric, every group whole chunk pairs (G % 128 == 0, K % G == 0): qd_tile's
 * sums for up to QP_ROWS input rows of a unit at once, group by group. The unit's two weight
 * rows are unpacked once a chunk pair (8 registers) for all those rows; x codes come straight
 * from memory; each (row, output)'s 16 fp32 lanes live in an L1 panel (qd_tile holds them in
 * registers that 16 ymm cannot keep: its epilogue spilled every group). Per lane and group the
 * same exact integer sum, then the same acc + float(I) * (sx * s) in fp32, groups in order:
 * qd_tile's bits. */
static inline __attribute__((always_inline)) void qd_panel4(
        const QDMat *q, QDShape sh, long R, long N, long u0, long u1, const int8_t *codes,
        const float *sx, const int32_t *xl, const float *bias, void *out, long ldo, int out_f32) {
    __m256 acc[QP_ROWS][QDN][2];
    __m256i part[QP_ROWS][QDN][2];           /* a group's integer lanes between its chunk pairs */
    const __m256i f = _mm256_set1_epi8(15), one = _mm256_set1_epi16(1);
    const long pairs = q->G / 128, gb = q->G / 2;      /* chunk pairs and weight bytes a group */
    for (long rb = 0; rb < R; rb += QP_ROWS) {        /* a row block's codes stay in cache across units */
        const long nr = R - rb < QP_ROWS ? R - rb : QP_ROWS;
        for (long u = u0; u < u1; u++) {
            const long n0 = u * QDN;
            long rows[QDN];
            const uint8_t *wr[QDN];
            qd_panel_start(q, n0, N, nr, rows, wr, acc);
            for (long g = 0; g < sh.ng; g++) {
                float s[QDN];
                for (int j = 0; j < QDN; j++) s[j] = q->s[rows[j] * q->lds + g];
                for (long c = 0; c < pairs; c++) {
                    __m256i lo[QDN][2], hi[QDN][2];     /* [j][chunk]: even columns, odd columns */
                    for (int j = 0; j < QDN; j++) {
                        const uint8_t *p = wr[j] + g * gb + c * 64;
                        _mm_prefetch((const char *)p + QDN * q->ldw, _MM_HINT_T0);     /* the next unit's */
                        for (int h = 0; h < 2; h++) {
                            const __m256i b = _mm256_loadu_si256((const __m256i *)(p + h * 32));
                            lo[j][h] = _mm256_and_si256(b, f);
                            hi[j][h] = _mm256_and_si256(_mm256_srli_epi16(b, 4), f);
                        }
                    }
                    const int first = c == 0, last = c == pairs - 1;
                    for (long r = 0; r < nr; r++) {
                        const long row = rb + r;
                        const int8_t *x = codes + row * sh.rowb + (g * sh.cg + 2 * c) * 64;
                        const __m256i x0a = _mm256_loadu_si256((const __m256i *)x), x0b = _mm256_loadu_si256((const __m256i *)(x + 32));
                        const __m256i x1a = _mm256_loadu_si256((const __m256i *)(x + 64)), x1b = _mm256_loadu_si256((const __m256i *)(x + 96));
                        __m256i z0 = _mm256_setzero_si256(), z1 = z0;
                        if (first) {        /* -8 * sum x_q per lane: int4's zero point */
                            const int32_t *l = xl + (row * sh.ng + g) * 16;
                            z0 = _mm256_sub_epi32(z0, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)l), 3));
                            z1 = _mm256_sub_epi32(z1, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(l + 8)), 3));
                        }
                        const __m256 sv = _mm256_set1_ps(sx[row * sh.ng + g]);
                        for (int j = 0; j < QDN; j++) {
                            const __m256i sa = _mm256_add_epi16(_mm256_maddubs_epi16(lo[j][0], x0a), _mm256_maddubs_epi16(lo[j][1], x1a));
                            const __m256i sb = _mm256_add_epi16(_mm256_maddubs_epi16(hi[j][0], x0b), _mm256_maddubs_epi16(hi[j][1], x1b));
                            __m256i ia = _mm256_add_epi32(first ? z0 : part[r][j][0], _mm256_madd_epi16(sa, one));
                            __m256i ib = _mm256_add_epi32(first ? z1 : part[r][j][1], _mm256_madd_epi16(sb, one));
                            if (!last) {
                                part[r][j][0] = ia, part[r][j][1] = ib;
                                continue;
                            }
                            const __m256 sc = _mm256_mul_ps(sv, _mm256_set1_ps(s[j]));     /* sx * s, as qd_tile's scalar */
                            acc[r][j][0] = _mm256_add_ps(acc[r][j][0], _mm256_mul_ps(_mm256_cvtepi32_ps(ia), sc));
                            acc[r][j][1] = _mm256_add_ps(acc[r][j][1], _mm256_mul_ps(_mm256_cvtepi32_ps(ib), sc));
                        }
                    }
                }
            }
            qd_panel_out(acc, nr, rb, n0, N, bias, out, ldo, out_f32);
        }
    }
}
#endif

#if !defined(__AVX512F__)
/* AVX2, int8 symmetric (no zero point), every group whole chunks (G % 64 == 0, K % G == 0): the
 * int8 counterpart of qd_panel4, up to QP_ROWS input rows of a unit at once, chunk by chunk.
 * The unit's |w| of a chunk is made once for all those rows (qd_tile redid it row by row);
 * the chunk's signed bytes are read again from L1 to move their signs onto x. Integer lanes
 * ride in an L1 panel between a group's chunks, fp32 lanes between groups: qd_tile's bits. */
static inline __attribute__((always_inline)) void qd_panel8(
        const QDMat *q, QDShape sh, long R, long N, long u0, long u1, const int8_t *codes,
        const float *sx, const float *bias, void *out, long ldo, int out_f32) {
    __m256 acc[QP_ROWS][QDN][2];
    __m256i part[QP_ROWS][QDN][2];
    const __m256i one = _mm256_set1_epi16(1);
    for (long rb = 0; rb < R; rb += QP_ROWS) {        /* a row block's codes stay in cache across units */
        const long nr = R - rb < QP_ROWS ? R - rb : QP_ROWS;
        for (long u = u0; u < u1; u++) {
            const long n0 = u * QDN;
            long rows[QDN];
            const uint8_t *wr[QDN];
            qd_panel_start(q, n0, N, nr, rows, wr, acc);
            for (long g = 0; g < sh.ng; g++) {
                float s[QDN];
                for (int j = 0; j < QDN; j++) s[j] = q->s[rows[j] * q->lds + g];
                for (long c = 0; c < sh.cg; c++) {
                    const __m256i *wp[QDN];
                    __m256i ua[QDN], ub[QDN];
                    for (int j = 0; j < QDN; j++) {
                        wp[j] = (const __m256i *)(wr[j] + g * q->G + c * 64);
                        _mm_prefetch((const char *)wp[j] + QDN * q->ldw, _MM_HINT_T0);
                        ua[j] = _mm256_abs_epi8(_mm256_loadu_si256(wp[j]));
                        ub[j] = _mm256_abs_epi8(_mm256_loadu_si256(wp[j] + 1));
                    }
                    const int first = c == 0, last = c == sh.cg - 1;
                    for (long r = 0; r < nr; r++) {
                        const long row = rb + r;
                        const int8_t *x = codes + row * sh.rowb + (g * sh.cg + c) * 64;
                        const __m256i xa = _mm256_loadu_si256((const __m256i *)x), xb = _mm256_loadu_si256((const __m256i *)(x + 32));
                        for (int j = 0; j < QDN; j++) {
                            const __m256i pa = _mm256_madd_epi16(_mm256_maddubs_epi16(ua[j], _mm256_sign_epi8(xa, _mm256_loadu_si256(wp[j]))), one);
                            const __m256i pb = _mm256_madd_epi16(_mm256_maddubs_epi16(ub[j], _mm256_sign_epi8(xb, _mm256_loadu_si256(wp[j] + 1))), one);
                            const __m256i ia = first ? pa : _mm256_add_epi32(part[r][j][0], pa);
                            const __m256i ib = first ? pb : _mm256_add_epi32(part[r][j][1], pb);
                            if (!last) {
                                part[r][j][0] = ia, part[r][j][1] = ib;
                                continue;
                            }
                            const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(sx[row * sh.ng + g]), _mm256_set1_ps(s[j]));
                            acc[r][j][0] = _mm256_add_ps(acc[r][j][0], _mm256_mul_ps(_mm256_cvtepi32_ps(ia), sc));
                            acc[r][j][1] = _mm256_add_ps(acc[r][j][1], _mm256_mul_ps(_mm256_cvtepi32_ps(ib), sc));
                        }
                    }
                }
            }
            qd_panel_out(acc, nr, rb, n0, N, bias, out, ldo, out_f32);
        }
    }
}
#endif

/* RT input rows x QDN output rows (rows[]) over all groups -> out. */
static inline __attribute__((always_inline)) void qd_tile(
        const int fmt, const int zk, const int vnni, const int RT, const QDMat *q, QDShape sh,
        const long rows[QDN], long n0, long N, const int8_t *codes, const float *sx, const int32_t *xl,
        long r0, const float *bias, void *out, long ldo, int out_f32) {
    vf facc[QDR][QDN];
    const uint8_t *wr[QDN];
    for (int j = 0; j < QDN; j++) wr[j] = q->w + rows[j] * q->ldw;
    for (int r = 0; r < RT; r++)
        for (int j = 0; j < QDN; j++) facc[r][j] = vf_zero();
    for (long g = 0; g < sh.ng; g++) {
        vi acc[QDR][QDN];
        for (int r = 0; r < RT; r++) {     /* int4 symmetric: start from -8 * sum x_q (per row) */
            const vi a0 = zk == 1 ? vi_neg8(vi_load((const int8_t *)(xl + ((r0 + r) * sh.ng + g) * 16))) : vi_zero();
            for (int j = 0; j < QDN; j++) acc[r][j] = a0;
        }
        const long k0 = g * q->G, k1 = k0 + q->G < q->K ? k0 + q->G : q->K;
        long c = 0;
#if !defined(__AVX512F__)
        if (fmt == QD_INT4)     /* two full chunks at a time: qd_pair4 */
            for (; c + 2 <= sh.cg && k0 + (c + 2) * 64 <= k1; c += 2)
                for (int j = 0; j < QDN; j++) {
                    const uint8_t *p = wr[j] + (k0 + c * 64) / 2;
                    _mm_prefetch((const char *)p + QDN * q->ldw, _MM_HINT_T0);
                    _mm_prefetch((const char *)p + 32 + QDN * q->ldw, _MM_HINT_T0);
                    const wv w0 = w4_load(p, 32), w1 = w4_load(p + 32, 32);
                    for (int r = 0; r < RT; r++)
                        acc[r][j] = qd_pair4(acc[r][j], w0, w1, codes + (r0 + r) * sh.rowb + (g * sh.cg + c) * 64);
                }
#endif
        for (; c < sh.cg; c++) {
            const long kc = k0 + c * 64, nv = k1 - kc < 64 ? k1 - kc : 64;
            wv w[QDN];
            for (int j = 0; j < QDN; j++) {
                const uint8_t *p = wr[j] + (fmt == QD_INT4 ? kc / 2 : kc);
                _mm_prefetch((const char *)p + QDN * q->ldw, _MM_HINT_T0);     /* the next unit's rows, as qd_row1 */
                w[j] = fmt == QD_INT4 ? w4_load(p, (nv + 1) / 2) : w8_load(p, nv);
            }
            for (int r = 0; r < RT; r++) {
                const vi x = vi_load(codes + (r0 + r) * sh.rowb + (g * sh.cg + c) * 64);
                for (int j = 0; j < QDN; j++)
                    acc[r][j] = vi_dp(vnni, acc[r][j], w[j].u, fmt == QD_INT4 ? x : x_signed(x, w[j]));
            }
        }
        for (int r = 0; r < RT; r++) {
            const vi l = vi_load((const int8_t *)(xl + ((r0 + r) * sh.ng + g) * 16));
            const float sxr = sx[(r0 + r) * sh.ng + g];
            for (int j = 0; j < QDN; j++) {
                const vi a = zk == 2 ? vi_zcorr(acc[r][j], zero_of(fmt, zk, q, rows[j], g), l) : acc[r][j];
                facc[r][j] = vf_acc(facc[r][j], a, sxr * q->s[rows[j] * q->lds + g]);
            }
        }
    }
    for (int r = 0; r < RT; r++)
        for (int j = 0; j < QDN; j++) {
            const long n = n0 + j;
            if (n >= N) continue;
            float y = vf_sum(facc[r][j]);
            if (bias) y += bias[n];
            if (out_f32) ((float *)out)[(r0 + r) * ldo + n] = y;
            else ((uint16_t *)out)[(r0 + r) * ldo + n] = f32_to_bf16(y);
        }
}

#if defined(__AVX512F__)
#define QD1 (2 * QDN)   /* batch 1: output rows per pass (two units) */
/* One input row (R = 1) x NR output rows: what qd_tile computes, with twice its rows in flight
 * and int4 read 64 bytes (two chunks) a load. Chunks c, c+1 of a row unpack to L = low nibbles
 * [c | c+1] and H = high nibbles [c | c+1]; against x = [c's first half | c+1's first half] and
 * [c's second half | c+1's second half], lane l < 8 of L's sums holds chunk c's lane l and lane
 * l + 8 chunk c+1's lane l (H likewise for lanes 8..15), so one shuffle pair per group gives the
 * per-lane sums I_l exactly (integer adds), and the fp32 work is qd_tile's, in its order. */
static inline __attribute__((always_inline)) void qd_row1(
        const int fmt, const int zk, const int vnni, const int NR, const QDMat *q, QDShape sh, long n0, long N,
        const int8_t *codes, const float *sx, const int32_t *xl, const float *bias, void *out, int out_f32) {
    const uint8_t *wr[QD1];
    long rows[QD1];
    vf facc[QD1];
    for (int j = 0; j < NR; j++) {
        rows[j] = n0 + j < N ? n0 + j : N - 1;
        wr[j] = q->w + rows[j] * q->ldw;
        facc[j] = vf_zero();
    }
    /* prefetch: the same bytes of the next pass's rows (QD1 rows on). A fixed distance along the
     * row is no use here: an int4 row of K = 1024 is 512 bytes, so +512 is the next row's line
     * that this pass loads itself; one pass ahead is ~4-8 KiB, about a memory latency's worth. */
    const long pf = QD1 * q->ldw, pairs = fmt == QD_INT4 ? sh.cg / 2 : 0;
    const __m512i f = _mm512_set1_epi8(15);
    for (long g = 0; g < sh.ng; g++) {
        const long k0 = g * q->G, k1 = k0 + q->G < q->K ? k0 + q->G : q->K;
        const int8_t *xg = codes + g * sh.cg * 64;
        vi acc[QD1], acch[QD1];
        for (int j = 0; j < NR; j++) acc[j] = acch[j] = vi_zero();
        for (long c = 0; c < pairs; c++) {
            const long kc = k0 + c * 128, nb = k1 - kc >= 128 ? 64 : k1 - kc > 0 ? (k1 - kc + 1) / 2 : 0;
            const __mmask64 m = nb >= 64 ? ~0ULL : (1ULL << nb) - 1;
            const vi x0 = vi_load(xg + c * 128), x1 = vi_load(xg + c * 128 + 64);
            const vi xa = _mm512_shuffle_i64x2(x0, x1, 0x44), xb = _mm512_shuffle_i64x2(x0, x1, 0xEE);
            for (int j = 0; j < NR; j++) {
                const uint8_t *p = wr[j] + kc / 2;
                _mm_prefetch((const char *)p + pf, _MM_HINT_T0);
                const __m512i v = _mm512_maskz_loadu_epi8(m, (const void *)p);
                acc[j] = vi_dp(vnni, acc[j], _mm512_and_si512(v, f), xa);
                acch[j] = vi_dp(vnni, acch[j], _mm512_and_si512(_mm512_srli_epi16(v, 4), f), xb);
            }
        }
        if (pairs)
            for (int j = 0; j < NR; j++)
                acc[j] = _mm512_add_epi32(_mm512_shuffle_i64x2(acc[j], acch[j], 0x44),
                                          _mm512_shuffle_i64x2(acc[j], acch[j], 0xEE));
        for (long c = 2 * pairs; c < sh.cg; c++) {     /* int8, or int4's odd chunk: qd_tile's way */
            const long kc = k0 + c * 64, nv = k1 - kc < 64 ? k1 - kc : 64;
            const vi x = vi_load(xg + c * 64);
            for (int j = 0; j < NR; j++) {
                const uint8_t *p = wr[j] + (fmt == QD_INT4 ? kc / 2 : kc);
                _mm_prefetch((const char *)p + pf, _MM_HINT_T0);
                const wv w = fmt == QD_INT4 ? w4_load(p, (nv + 1) / 2) : w8_load(p, nv);
                acc[j] = vi_dp(vnni, acc[j], w.u, fmt == QD_INT4 ? x : x_signed(x, w));
            }
        }
        const vi l = vi_load((const int8_t *)(xl + g * 16)), a0 = zk == 1 ? vi_neg8(l) : vi_zero();
        const __m512 sxr = _mm512_set1_ps(sx[g]);
        for (int j = 0; j < NR; j++) {     /* vf_acc, its scale product made in vector lanes */
            const vi a = zk == 2 ? vi_zcorr(acc[j], zero_of(fmt, zk, q, rows[j], g), l)
                                 : zk == 1 ? _mm512_add_epi32(a0, acc[j]) : acc[j];
            const __m512 sv = _mm512_mul_ps(sxr, _mm512_set1_ps(q->s[rows[j] * q->lds + g]));
            facc[j] = _mm512_add_ps(facc[j], _mm512_mul_ps(_mm512_cvtepi32_ps(a), sv));
        }
    }
    for (int j = 0; j < NR; j++) {
        const long n = n0 + j;
        if (n >= N) continue;
        float y = vf_sum(facc[j]);
        if (bias) y += bias[n];
        if (out_f32) ((float *)out)[n] = y;
        else ((uint16_t *)out)[n] = f32_to_bf16(y);
    }
}
#endif

#if !defined(__AVX512F__)
/* AVX2, int8, one input row (R = 1) x one output row n: qd_tile's sums for a single row, so that
 * a thread reads its rows one after another, one sequential stream (int8 is memory-bound here;
 * int4, compute-bound, keeps qd_tile's two rows, whose x loads serve both). On a 2-core Zen2,
 * rows of 1 KiB (an lm_head of K = 1024) read 13-16 GB/s two rows interleaved, 25 GB/s row by
 * row; at K = 4096 both ~27 (bench/quant_kernels.py --activations int8 --shape 32000,1024). The
 * prefetch runs 2 * QDN rows ahead (4 KiB at K = 1024: no longer distance measured faster).
 * Same integer sums, same fp32 work. */
static inline __attribute__((always_inline)) void qd_row8(
        const int zk, const QDMat *q, QDShape sh, long n, const int8_t *codes, const float *sx,
        const int32_t *xl, const float *bias, void *out, int out_f32) {
    const uint8_t *wr = q->w + n * q->ldw;
    const long pf = 2 * QDN * q->ldw;
    vf facc = vf_zero();
    for (long g = 0; g < sh.ng; g++) {
        const long k0 = g * q->G, k1 = k0 + q->G < q->K ? k0 + q->G : q->K;
        const int8_t *xg = codes + g * sh.cg * 64;
        vi acc = vi_zero();
        for (long c = 0; c < sh.cg; c++) {
            const long kc = k0 + c * 64, nv = k1 - kc < 64 ? k1 - kc : 64;
            _mm_prefetch((const char *)wr + kc + pf, _MM_HINT_T0);
            const wv w = w8_load(wr + kc, nv);
            acc = vi_dp(0, acc, w.u, x_signed(vi_load(xg + c * 64), w));
        }
        if (zk == 2) acc = vi_zcorr(acc, zero_of(QD_INT8, zk, q, n, g), vi_load((const int8_t *)(xl + g * 16)));
        facc = vf_acc(facc, acc, sx[g] * q->s[n * q->lds + g]);
    }
    float y = vf_sum(facc);
    if (bias) y += bias[n];
    if (out_f32) ((float *)out)[n] = y;
    else ((uint16_t *)out)[n] = f32_to_bf16(y);
}
#endif

#if !defined(__AVX512F__)
#define QR4_GROUPS 256   /* most groups a row qd_row4 takes (its zero-point lanes sit on the stack) */
/* qd_row4's prefetch distance, bytes: whole rows, ~8 KiB ahead (16 rows of K = 1024). The native
 * decode step at batch 1 (int4, Zen2, the bench checkpoint): the MoE layers 0.90 -> 0.82 ms a step
 * against 2 KiB ahead; qd_row8 (int8) was slower at 8 KiB than at its 4. */
#define QR4_AHEAD 7680
/* AVX2, int4 symmetric, one input row (R = 1) x one output row n, every group whole chunk pairs
 * (qd_panel_takes): qd_tile's sums row by row, as qd_row8 does for int8, so a thread reads its
 * rows one after another (one sequential stream) and nothing spills: two fp32 and two int32
 * lane vectors, the chunk pair's nibbles, x as memory operands. z: -8 * the row's lane sums per
 * group (int4's zero point, made once per call), the start of each group's integer lanes as
 * qd_tile's vi_neg8. Same exact integer sums, the same fp32 work in the same group order.
 * one_pair: groups of 128 (the online default) as a constant, no pair loop: one thread's
 * int4 [1, 1024] x [32000, 1024] 12.5 -> 15.9 GB/s on Zen2 (bench/quant_kernels.py). */
static inline __attribute__((always_inline)) void qd_row4(
        const int one_pair, const QDMat *q, QDShape sh, long n, const int8_t *codes, const float *sx, const int32_t *z,
        const float *bias, void *out, int out_f32) {
    const uint8_t *wr = q->w + n * q->ldw;
    const long pf = (QR4_AHEAD / q->ldw + 1) * q->ldw, pairs = one_pair ? 1 : q->G / 128, gb = one_pair ? 64 : q->G / 2;
    const __m256i f = _mm256_set1_epi8(15), one = _mm256_set1_epi16(1);
    __m256 fa = _mm256_setzero_ps(), fb = fa;
    for (long g = 0; g < sh.ng; g++) {
        __m256i ia = _mm256_loadu_si256((const __m256i *)(z + g * 16));
        __m256i ib = _mm256_loadu_si256((const __m256i *)(z + g * 16 + 8));
        for (long c = 0; c < pairs; c++) {
            const uint8_t *p = wr + g * gb + c * 64;
            _mm_prefetch((const char *)p + pf, _MM_HINT_T0);
            _mm_prefetch((const char *)p + pf + 63, _MM_HINT_T0);
            const __m256i b0 = _mm256_loadu_si256((const __m256i *)p), b1 = _mm256_loadu_si256((const __m256i *)(p + 32));
            const __m256i *x = (const __m256i *)(codes + (g * sh.cg + 2 * c) * 64);
            const __m256i sa = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(b0, f), _mm256_loadu_si256(x)),
                                                _mm256_maddubs_epi16(_mm256_and_si256(b1, f), _mm256_loadu_si256(x + 2)));
            const __m256i sb = _mm256_add_epi16(
                _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(b0, 4), f), _mm256_loadu_si256(x + 1)),
                _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(b1, 4), f), _mm256_loadu_si256(x + 3)));
            ia = _mm256_add_epi32(ia, _mm256_madd_epi16(sa, one));
            ib = _mm256_add_epi32(ib, _mm256_madd_epi16(sb, one));
        }
        const __m256 sc = _mm256_set1_ps(sx[g] * q->s[n * q->lds + g]);      /* vf_acc's scalar */
        fa = _mm256_add_ps(fa, _mm256_mul_ps(_mm256_cvtepi32_ps(ia), sc));
        fb = _mm256_add_ps(fb, _mm256_mul_ps(_mm256_cvtepi32_ps(ib), sc));
    }
    const vf v = {fa, fb};
    float y = vf_sum(v);
    if (bias) y += bias[n];
    if (out_f32) ((float *)out)[n] = y;
    else ((uint16_t *)out)[n] = f32_to_bf16(y);
}
#endif

static inline __attribute__((always_inline)) void qd_units_t(
        const int fmt, const int zk, const int vnni, const QDMat *q, const void *buf, long R, long N,
        long u0, long u1, const float *bias, void *out, long ldo, int out_f32) {
    const QDShape sh = qd_shape(q->K, q->G);
    const int8_t *codes = buf;
    const float *sx = (const float *)(codes + R * sh.rowb);
    const int32_t *xl = (const int32_t *)(sx + R * sh.ng);
#if defined(__AVX512F__)
    if (R == 1) {
        long u = u0;
        for (; u + QD1 / QDN <= u1; u += QD1 / QDN)
            qd_row1(fmt, zk, vnni, QD1, q, sh, u * QDN, N, codes, sx, xl, bias, out, out_f32);
        for (; u < u1; u++) qd_row1(fmt, zk, vnni, QDN, q, sh, u * QDN, N, codes, sx, xl, bias, out, out_f32);
        return;
    }
#else
    if (R == 1 && fmt == QD_INT8) {
        for (long n = u0 * QDN; n < u1 * QDN && n < N; n++) qd_row8(zk, q, sh, n, codes, sx, xl, bias, out, out_f32);
        return;
    }
    if (R == 1 && zk == 1 && sh.ng <= QR4_GROUPS && qd_panel_takes(fmt, zk, q->K, q->G)) {
        int32_t z[QR4_GROUPS * 16];
        for (long i = 0; i < sh.ng * 16; i++) z[i] = -8 * xl[i];
        if (q->G == 128)
            for (long n = u0 * QDN; n < u1 * QDN && n < N; n++) qd_row4(1, q, sh, n, codes, sx, z, bias, out, out_f32);
        else
            for (long n = u0 * QDN; n < u1 * QDN && n < N; n++) qd_row4(0, q, sh, n, codes, sx, z, bias, out, out_f32);
        return;
    }
    if (R >= QP_MIN && qd_panel_takes(fmt, zk, q->K, q->G)) {
        if (fmt == QD_INT4) qd_panel4(q, sh, R, N, u0, u1, codes, sx, xl, bias, out, ldo, out_f32);
        else qd_panel8(q, sh, R, N, u0, u1, codes, sx, bias, out, ldo, out_f32);
        return;
    }
#endif
    for (long u = u0; u < u1; u++) {
        const long n0 = u * QDN;
        long rows[QDN];
        for (int j = 0; j < QDN; j++) rows[j] = n0 + j < N ? n0 + j : N - 1;
        long r0 = 0;
#if defined(__AVX512F__)
        const int tiled = 1;
#else
        const int tiled = fmt == QD_INT4;
#endif
        if (tiled)
            for (; r0 + QDR <= R; r0 += QDR)
                qd_tile(fmt, zk, vnni, QDR, q, sh, rows, n0, N, codes, sx, xl, r0, bias, out, ldo, out_f32);
        for (; r0 < R; r0++)
            qd_tile(fmt, zk, vnni, 1, q, sh, rows, n0, N, codes, sx, xl, r0, bias, out, ldo, out_f32);
    }
}

/* Output units [u0, u1) (QDN rows each) of q for the R rows buf holds (moed_qdot_quantize's):
 * out [R][ldo] (fp32 or bf16). For moed_qdot_linear and moed_moe_q. */
void moed_qdot_units(int fmt, const QDMat *q, const void *buf, long R, long N, long u0, long u1,
                     const float *bias, void *out, long ldo, int out_f32) {
    const int zk = q->z ? 2 : fmt == QD_INT4 ? 1 : 0, vnni = use_vnni < 0 ? moed_qdot_vnni(-1) : use_vnni;
#define QD_CASE(F, Z, V) if (fmt == F && zk == Z && vnni == V) { qd_units_t(F, Z, V, q, buf, R, N, u0, u1, bias, out, ldo, out_f32); return; }
    QD_CASE(QD_INT8, 0, 1) QD_CASE(QD_INT8, 2, 1) QD_CASE(QD_INT4, 1, 1) QD_CASE(QD_INT4, 2, 1)
    QD_CASE(QD_INT8, 0, 0) QD_CASE(QD_INT8, 2, 0) QD_CASE(QD_INT4, 1, 0) QD_CASE(QD_INT4, 2, 0)
#undef QD_CASE
}

/* QDN: the unit size (rows) moed_qdot_units takes. */
int moed_qdot_unit_rows(void) { return QDN; }

/* moed_qlinear's call (same arguments; fmt int8 or int4 only) with int8 activations: out [R][N]
 * = x [R][K] @ W^T (+ bias) as the header says. Returns 0, -1 out of memory, -2 an argument it
 * cannot take (fp8, int4 with odd K). */
int moed_qdot_linear(const void *x_in, int x_f32, long R, long K, int fmt, const uint8_t *w, long ldw,
                     const float *s, long lds, const uint8_t *z, long ldz, long group, long N,
                     const float *bias, void *out, int out_f32, int nthreads) {
    if ((fmt != QD_INT8 && fmt != QD_INT4) || group <= 0 || (fmt == QD_INT4 && K % 2)) return -2;
    if (R <= 0 || N <= 0) return 0;
    const long G = group < K ? group : K;
    float *xf = x_f32 ? NULL : malloc(sizeof(float) * (R * K + 1));
    void *buf = malloc(moed_qdot_bytes(R, K, G));
    if ((!x_f32 && !xf) || !buf) { free(xf); free(buf); return -1; }
    if (!x_f32)
        for (long i = 0; i < R * K; i++) {
            const uint32_t u = (uint32_t)((const uint16_t *)x_in)[i] << 16;
            memcpy(xf + i, &u, 4);
        }
    moed_qdot_quantize(fmt, x_f32 ? (const float *)x_in : xf, K, R, K, G, buf);
    const QDMat q = {w, ldw, s, lds, z, ldz, G, K};
    const long units = (N + QDN - 1) / QDN;
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const long per = units / nt, extra = units % nt;
        const long u0 = tid * per + (tid < extra ? tid : extra), u1 = u0 + per + (tid < extra);
        moed_qdot_units(fmt, &q, buf, R, N, u0, u1, bias, out, N, out_f32);
    }
    free(xf);
    free(buf);
    return 0;
}
