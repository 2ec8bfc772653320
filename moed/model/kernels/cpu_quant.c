/* Quantized-weight matmul (decode and small batches here; many-row bf16 calls: the blocked
 * section below): y[m][n] = sum_k x[m][k] * W[n][k] with W
 * int8 / int4 / fp8 in moed's QuantWeight layout (moed/model/quant/weight.py), read as stored:
 *
 *     W[n][k] = (q[n][k] - zero[n][k / group]) * scale[n][k / group]
 *
 *   int8  q int8 [N][ldw]; zero int8 or none (0)
 *   int4  q two unsigned nibbles per byte [N][ldw], column 2c in the low nibble; zero uint8 or
 *         none (8)
 *   fp8   q float8_e4m3fn [N][ldw]; no zero
 *   scale float32 [N][lds]
 *
 * Compiled into the same .so as cpu_bf16.c, once per ISA variant (both AVX512 ones alike: no
 * bf16 instruction here; and AVX2 + FMA through cpu_avx2.h): the variants compute every output with the same operations in the same order, so
 * they are bitwise equal (tests/unit/model/test_quant_kernels.py).
 *
 * Numerics: "dequantize in registers". Each weight becomes the fp32 value the reference
 * (QuantWeight.dequantize, fp32) gives it, bit for bit: q - zero is exact in fp32 and the scale
 * product is rounded once (fp8: the e4m3 value is exact in fp32; h * (256 * scale) below is the
 * same one rounding as value * scale). Activations (bf16 or fp32) are widened to fp32 exactly,
 * products are summed in fp32 by FMA, and the sum is rounded once to the output dtype (bias, if
 * any, added in fp32 first). So the result is the reference's fp32 matmul of the dequantized
 * weight up to fp32 summation order; in bf16 it is that fp32 result rounded, where the bf16
 * reference rounds the dequantized weight to bf16 first (the kernel is the closer of the two to
 * the exact product). Activations are not quantized here; model.quantization_activations = int8
 * runs these calls (and moed_moe_q's few-row experts, qact) on cpu_qdot.c's integer dot products.
 * e4m3 NaN codes (0x7f, 0xff) read as +-480 here: quantizers clamp to +-448, so no weight holds one.
 *
 * Layout and threads: W is read row-major, as stored (no repack: the same tensors serve the
 * reference path, expert moves and the cold-expert store). Each thread takes a contiguous range
 * of output rows (one forward stream through memory) in units of QNR rows (AVX512 4, AVX2 2),
 * dequantizes 16 weights of each of those rows per step in registers and multiplies them into
 * up to QRT input rows (QNR x QRT accumulators of 16 fp32 lanes; 16 lanes of a row-column pair summed
 * horizontally at the end in the fixed order of _mm512_reduce_add_ps). More input rows than
 * QRT: the unit's weights are dequantized once into a per-thread fp32 buffer (L2) and every
 * tile of QRT input rows reads them there; the values and the per-lane order are the same, so a
 * row's result never depends on the batch (nor on the thread count). int4: x is permuted per 32
 * columns to [even, odd] once per call, so low and high nibbles multiply contiguous x.
 * Columns past the last full vector (K % 16, int4 K % 32) are summed in scalar C after the
 * vector sum (same code in both variants). group must be a multiple of 16 (int4: 32) unless
 * there is one group per row: the Python side checks (kernels/quant.py unserved).
 */
#define _GNU_SOURCE     /* preadv2 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#include "cpu_bf16_scalar.h"

/* QNR output rows per unit x QRT input rows per register tile: QNR x QRT accumulators. Neither
 * changes any bits (every row-column pair has its own accumulator, summed in k order), so each
 * variant takes what fits its registers. */
#if defined(__AVX512F__)
#define QNR 4        /* 16 accumulators + 4 weights + x fit 32 zmm */
#define QRT 4
#elif defined(__AVX2__) && defined(__FMA__)
#include "cpu_avx2.h"
#define QNR 2        /* a 16-lane vector is 2 ymm: 4 accumulators + 2 weights + x = 14 of 16 ymm */
#define QRT 2
#else
#error "build with -mavx512f or -march=x86-64-v3"
#endif

enum { Q_INT8 = 0, Q_INT4 = 1, Q_FP8 = 2 };

#ifndef QPF
#define QPF 512      /* bytes ahead of each row's reads that software prefetch asks for */
#endif



/* e4m3fn byte -> its value (exact in fp32), for the scalar tail: 2^(e-7) * (1 + m/8), or
 * m * 2^-9 for e = 0. */
static inline float e4m3_value(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float mag = e ? ldexpf((float)(8 + m), e - 10) : (float)m / 512.0f;
    return b & 0x80 ? -mag : mag;
}

/* ---- 16 weights -> 16 fp32 lanes (unscaled codes), per variant ---------------------------- */

/* fp16 bit patterns of 16 e4m3 codes (16-bit lanes): sign to bit 15, exponent and mantissa to bits
 * 7..13, so the fp16 value is the e4m3 value / 256 (subnormals included: fp16's subnormal range
 * holds e4m3's). */
static inline __m256i e4m3_as_f16(__m128i b) {
    /* sign-extended s: s << 7 has the sign in bit 15 and exponent|mantissa in bits 7..13; a
     * negative code also sets bit 14, which the mask clears */
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xbf80));
}

#if defined(__AVX512F__)
static inline __m512 codes_i8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline void codes_u4(const uint8_t *p, __m512 *lo, __m512 *hi) {   /* 16 bytes: 32 nibbles */
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
static inline __m512 codes_e4m3(const uint8_t *p) {   /* value / 256 */
    return _mm512_cvtph_ps(e4m3_as_f16(_mm_loadu_si128((const __m128i *)p)));
}
#else
static inline __m256 i8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m512 codes_i8(const uint8_t *p) { return v16f_of(i8x8(p), i8x8(p + 8)); }
static inline void codes_u4(const uint8_t *p, __m512 *lo, __m512 *hi) {
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    const __m256i f = _mm256_set1_epi32(15);
    *lo = v16f_of(_mm256_cvtepi32_ps(_mm256_and_si256(b0, f)), _mm256_cvtepi32_ps(_mm256_and_si256(b1, f)));
    *hi = v16f_of(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)));
}
static inline __m512 codes_e4m3(const uint8_t *p) {
    const __m256i h = e4m3_as_f16(_mm_loadu_si128((const __m128i *)p));
    return v16f_of(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}
#endif

/* One weight's value, scalar (the tail columns): the same roundings as the vector path. */
static inline float weight_at(const int fmt, const uint8_t *row, long k, float s, float z) {
    if (fmt == Q_INT8) return ((float)(int8_t)row[k] - z) * s;
    if (fmt == Q_INT4) return ((float)(k & 1 ? row[k >> 1] >> 4 : row[k >> 1] & 15) - z) * s;
    return e4m3_value(row[k]) * s;
}

typedef struct {
    const uint8_t *w;       /* codes, row n at w + n * ldw bytes */
    long ldw;
    const float *s;         /* scales, row n at s + n * lds */
    long lds;
    const uint8_t *z;       /* zero points (int8 or uint8 as fmt says), row n at z + n * ldz; NULL: symmetric */
    long ldz;
    long group, K, KV;      /* KV: columns the vector loop covers (a multiple of its step) */
} QMat;

static inline float zero_at(const int fmt, const QMat *q, long n, long g) {
    if (!q->z) return fmt == Q_INT4 ? 8.0f : 0.0f;
    const uint8_t b = q->z[n * q->ldz + g];
    return fmt == Q_INT8 ? (float)(int8_t)b : (float)b;
}

/* The weights of rows rows[0..QNR) for columns [k0, k0 + step) of group g, scaled: w[j] (and for
 * int4 w2[j], the odd columns). Inlined with constant fmt. */
static inline __attribute__((always_inline)) void dequant_step(
        const int fmt, const int asym, const uint8_t *const wr[QNR], const __m512 s[QNR],
        const __m512 z[QNR], long k, __m512 w[QNR], __m512 w2[QNR]) {
    for (int j = 0; j < QNR; j++) {
        if (fmt == Q_INT4) {
            __m512 lo, hi;
            codes_u4(wr[j] + k / 2, &lo, &hi);
            w[j] = _mm512_mul_ps(_mm512_sub_ps(lo, z[j]), s[j]);
            w2[j] = _mm512_mul_ps(_mm512_sub_ps(hi, z[j]), s[j]);
        } else if (fmt == Q_INT8) {
            const __m512 c = codes_i8(wr[j] + k);
            w[j] = _mm512_mul_ps(asym ? _mm512_sub_ps(c, z[j]) : c, s[j]);
        } else {
            w[j] = _mm512_mul_ps(codes_e4m3(wr[j] + k), s[j]);   /* s holds 256 * scale */
        }
    }
}

static inline __attribute__((always_inline)) void group_consts(
        const int fmt, const QMat *q, const long rows[QNR], long g, __m512 s[QNR], __m512 z[QNR]) {
    for (int j = 0; j < QNR; j++) {
        const float sc = q->s[rows[j] * q->lds + g];
        s[j] = _mm512_set1_ps(fmt == Q_FP8 ? sc * 256.0f : sc);
        z[j] = _mm512_set1_ps(zero_at(fmt, q, rows[j], g));
    }
}

/* acc[r][j] over the vector columns for RT input rows (x fp32 [RT][ldx], int4: permuted), the
 * weights dequantized in registers. */
static inline __attribute__((always_inline)) void tile_fused(
        const int fmt, const int asym, const int RT, const QMat *q, const long rows[QNR],
        const float *x, long ldx, __m512 acc[][QNR]) {
    const int step = fmt == Q_INT4 ? 32 : 16;
    const uint8_t *wr[QNR];
    for (int j = 0; j < QNR; j++) wr[j] = q->w + rows[j] * q->ldw;
    for (int r = 0; r < RT; r++)
        for (int j = 0; j < QNR; j++) acc[r][j] = _mm512_setzero_ps();
    for (long k0 = 0, g = 0; k0 < q->KV; k0 += q->group, g++) {
        __m512 s[QNR], z[QNR];
        group_consts(fmt, q, rows, g, s, z);
        const long k1 = k0 + q->group < q->KV ? k0 + q->group : q->KV;
        for (long k = k0; k < k1; k += step) {
            __m512 w[QNR], w2[QNR];
            /* QNR streams a row apart: the hardware prefetcher alone reads them at ~half speed */
            if (QPF) for (int j = 0; j < QNR; j++) _mm_prefetch((const char *)wr[j] + (fmt == Q_INT4 ? k / 2 : k) + QPF, _MM_HINT_T0);
            dequant_step(fmt, asym, wr, s, z, k, w, w2);
            for (int r = 0; r < RT; r++) {
                const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
                for (int j = 0; j < QNR; j++) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
                if (fmt == Q_INT4) {
                    const __m512 xo = _mm512_loadu_ps(x + r * ldx + k + 16);
                    for (int j = 0; j < QNR; j++) acc[r][j] = _mm512_fmadd_ps(xo, w2[j], acc[r][j]);
                }
            }
        }
    }
}

/* The unit's vector-column weights into wbuf [QNR][KV] (int4: per 32 columns, even then odd). */
static inline __attribute__((always_inline)) void unit_dequant(
        const int fmt, const int asym, const QMat *q, const long rows[QNR], float *wbuf) {
    const int step = fmt == Q_INT4 ? 32 : 16;
    const uint8_t *wr[QNR];
    for (int j = 0; j < QNR; j++) wr[j] = q->w + rows[j] * q->ldw;
    for (long k0 = 0, g = 0; k0 < q->KV; k0 += q->group, g++) {
        __m512 s[QNR], z[QNR];
        group_consts(fmt, q, rows, g, s, z);
        const long k1 = k0 + q->group < q->KV ? k0 + q->group : q->KV;
        for (long k = k0; k < k1; k += step) {
            __m512 w[QNR], w2[QNR];
            if (QPF) for (int j = 0; j < QNR; j++) _mm_prefetch((const char *)wr[j] + (fmt == Q_INT4 ? k / 2 : k) + QPF, _MM_HINT_T0);
            dequant_step(fmt, asym, wr, s, z, k, w, w2);
            for (int j = 0; j < QNR; j++) {
                _mm512_storeu_ps(wbuf + j * q->KV + k, w[j]);
                if (fmt == Q_INT4) _mm512_storeu_ps(wbuf + j * q->KV + k + 16, w2[j]);
            }
        }
    }
}

/* tile_fused's sums from the dequantized buffer: the same FMAs in the same order. */
static inline __attribute__((always_inline)) void tile_buf(
        const int RT, long KV, const float *wbuf, const float *x, long ldx, __m512 acc[][QNR]) {
    for (int r = 0; r < RT; r++)
        for (int j = 0; j < QNR; j++) acc[r][j] = _mm512_setzero_ps();
    for (long k = 0; k < KV; k += 16)
        for (int r = 0; r < RT; r++) {
            const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
            for (int j = 0; j < QNR; j++)
                acc[r][j] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wbuf + j * KV + k), acc[r][j]);
        }
}

/* Finish RT x QNR outputs: horizontal sum, scalar tail, bias, rounding, store. */
static inline __attribute__((always_inline)) void finish(
        const int fmt, const int RT, const QMat *q, const long rows[QNR], long n0, long N, long r0,
        const float *xnat, long ldx, __m512 acc[][QNR], const float *bias, void *out, int out_f32) {
    for (int r = 0; r < RT; r++)
        for (int j = 0; j < QNR; j++) {
            const long n = n0 + j;
            if (n >= N) continue;
            float sum = _mm512_reduce_add_ps(acc[r][j]);
            if (q->KV < q->K) {
                const uint8_t *row = q->w + n * q->ldw;
                const float *xr = xnat + r * ldx;
                float t = 0.0f, s = 0.0f, z = 0.0f;
                long g = -1;
                for (long k = q->KV; k < q->K; k++) {
                    if (k / q->group != g) {
                        g = k / q->group;
                        s = q->s[n * q->lds + g];
                        z = zero_at(fmt, q, n, g);
                    }
                    t += xr[k] * weight_at(fmt, row, k, s, z);
                }
                sum += t;
            }
            if (bias) sum += bias[n];
            if (out_f32) ((float *)out)[(r0 + r) * N + n] = sum;
            else ((uint16_t *)out)[(r0 + r) * N + n] = f32_to_bf16(sum);
        }
    (void)rows;
}

/* All rows of x for the output rows of [u0, u1) units, one (fmt, asym) instantiation. */
static inline __attribute__((always_inline)) void run_units(
        const int fmt, const int asym, const QMat *q, const float *x, long R, long N, long u0, long u1,
        float *wbuf, const float *bias, void *out, int out_f32) {
    const long ldx = q->K;
    __m512 acc[QRT][QNR];
    for (long u = u0; u < u1; u++) {
        const long n0 = u * QNR;
        long rows[QNR];
        for (int j = 0; j < QNR; j++) rows[j] = n0 + j < N ? n0 + j : N - 1;   /* past N: a real row, result dropped */
        const int buffered = R > QRT;
        if (buffered) unit_dequant(fmt, asym, q, rows, wbuf);
        for (long r0 = 0; r0 < R; r0 += QRT) {
            const float *xr = x + r0 * ldx;
#define Q_TILE(RT)                                                                              \
            do {                                                                                \
                if (buffered) tile_buf(RT, q->KV, wbuf, xr, ldx, acc);                          \
                else tile_fused(fmt, asym, RT, q, rows, xr, ldx, acc);                          \
                finish(fmt, RT, q, rows, n0, N, r0, xr, ldx, acc, bias, out, out_f32);          \
            } while (0)
            if (R - r0 >= QRT) Q_TILE(QRT);
#if QRT > 2
            else if (R - r0 == 3) Q_TILE(3);
            else if (R - r0 == 2) Q_TILE(2);
#endif
            else Q_TILE(1);
#undef Q_TILE
        }
    }
}

/* out [R][N] (bf16, or fp32 if out_f32) = x [R][K] (bf16, or fp32 if x_f32) @ W^T (+ bias fp32
 * [N]). fmt: 0 int8, 1 int4, 2 fp8; w/ldw, s/lds, z/ldz: see QMat (z NULL: symmetric).
 * Returns 0, -1 out of memory, -2 a group the vector loop cannot take. */
int moed_qlinear(const void *x_in, int x_f32, long R, long K, int fmt, const uint8_t *w, long ldw,
                 const float *s, long lds, const uint8_t *z, long ldz, long group, long N,
                 const float *bias, void *out, int out_f32, int nthreads) {
    const int step = fmt == Q_INT4 ? 32 : 16;
    if (fmt < 0 || fmt > 2 || group <= 0 || (group < K && group % step) || (fmt == Q_FP8 && z)) return -2;
    if (R <= 0 || N <= 0) return 0;
    QMat q = {w, ldw, s, lds, z, ldz, group, K, K - K % step};
    /* x as fp32 [R][K]; int4: each full 32-column block reordered to its 16 even then 16 odd
     * columns (the low and high nibbles of 16 bytes); the tail stays in order. */
    float *x = NULL, *xn = NULL;
    const int copy = !x_f32 || fmt == Q_INT4;
    if (copy) {
        x = aligned_alloc(64, (size_t)(R * K * 2 + 16) * sizeof(float));
        if (!x) return -1;
        xn = x + R * K;
        for (long i = 0; i < R * K; i++)
            xn[i] = x_f32 ? ((const float *)x_in)[i] : bf16_to_f32(((const uint16_t *)x_in)[i]);
        if (fmt == Q_INT4) {
            for (long r = 0; r < R; r++)
                for (long k = 0; k < K; k++) {
                    const long b = k - k % 32, c = k % 32;
                    x[r * K + (k < q.KV ? b + (c & 1) * 16 + c / 2 : k)] = xn[r * K + k];
                }
        } else {
            memcpy(x, xn, (size_t)(R * K) * sizeof(float));
        }
    }
    const float *xv = copy ? x : (const float *)x_in;
    const long units = (N + QNR - 1) / QNR;
    int oom = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const long per = units / nt, extra = units % nt;
        const long u0 = tid * per + (tid < extra ? tid : extra), u1 = u0 + per + (tid < extra);
        float *wbuf = NULL;
        if (R > QRT && u1 > u0) {
            wbuf = aligned_alloc(64, (size_t)(QNR * q.KV + 16) * sizeof(float));
            if (!wbuf) {
#pragma omp atomic write
                oom = 1;
            }
        }
        if (!(R > QRT && u1 > u0 && !wbuf)) {
            const int asym = z != NULL;
            if (fmt == Q_INT8 && !asym) run_units(Q_INT8, 0, &q, xv, R, N, u0, u1, wbuf, bias, out, out_f32);
            else if (fmt == Q_INT8) run_units(Q_INT8, 1, &q, xv, R, N, u0, u1, wbuf, bias, out, out_f32);
            else if (fmt == Q_INT4 && !asym) run_units(Q_INT4, 0, &q, xv, R, N, u0, u1, wbuf, bias, out, out_f32);
            else if (fmt == Q_INT4) run_units(Q_INT4, 1, &q, xv, R, N, u0, u1, wbuf, bias, out, out_f32);
            else run_units(Q_FP8, 0, &q, xv, R, N, u0, u1, wbuf, bias, out, out_f32);
        }
        free(wbuf);
    }
    free(x);
    return oom ? -1 : 0;
}

/* ---- Many rows (prefill), bf16 activations: each weight block dequantized once -------------
 *
 * Past a few dozen rows the loop above re-reads every input row once per QNR output rows, and
 * its FMAs take fp32 weights; cpu_bf16.c's prefill kernel is the fast many-row matmul here. So a
 * bf16 call of many rows takes each block of 32 weight rows, dequantizes it once (unit_dequant's
 * fp32 values, rounded to nearest even: exactly QuantWeight.dequantize(bfloat16)) into that
 * kernel's packed layout (P32: [K/2][32] pairs) in a per-thread buffer, and streams every input
 * row through it (moed_block_rows_bf16). Numerics: the reference path's own (the bf16-rounded
 * weight, bf16 inputs, products exact in fp32, summed in fp32, bias added in fp32, one rounding)
 * up to fp32 summation order; not the fp32-weight bits of the few-row loop above. K even.
 * int4 on AVX512BW packs straight from the nibbles through a 16-entry table per (row, group)
 * (block_p32_u4: the same bits at ~1/4 of the cost, 0.67 -> 0.17 ms per 1M weights on one Ice Lake
 * core; at 64 rows an expert, what a 512-token prefill gives 16 experts top-2, the fp32 route's
 * packing was ~30% of the matmul: 1.70 -> 1.20 ms for [64, 1024] x [1024, 1024]). */

#define QB 32        /* weight rows per packed block (cpu_bf16.c's NB) */
/* Input rows per moed_block_rows_bf16 call (cpu_bf16.c SHARE_ROWS: its AVX2 tile widens a block
 * once a call, so 8-row calls widened it 4x as often), and packed blocks per
 * moed_blocks_rows_bf16 call (SHARE_BLOCKS: the AVX2 tile widens the inputs once for all). */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define QBT 48
#else
#define QBT 32
#endif
#define QMB 8

void moed_block_rows_bf16(const uint16_t *x, long R, long ldx, const uint16_t *wb, long K, float *y, long ldy);
void moed_blocks_rows_bf16(const uint16_t *x, long R, long ldx, const uint16_t *wb, long nb, long bstride, long K,
                           float *y, long ldy);

static void unit_dequant_any(int fmt, int asym, const QMat *q, const long rows[QNR], float *wbuf) {
    if (fmt == Q_INT8 && !asym) unit_dequant(Q_INT8, 0, q, rows, wbuf);
    else if (fmt == Q_INT8) unit_dequant(Q_INT8, 1, q, rows, wbuf);
    else if (fmt == Q_INT4 && !asym) unit_dequant(Q_INT4, 0, q, rows, wbuf);
    else if (fmt == Q_INT4) unit_dequant(Q_INT4, 1, q, rows, wbuf);
    else unit_dequant(Q_FP8, 0, q, rows, wbuf);
}

/* f's bf16 bits (f32_to_bf16) for n floats, written so the compiler vectorizes it: the
 * same integer operations in every variant, so the same bits. */
static inline void bf16_bits(const float *f, long n, uint16_t *h) {
    for (long i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, f + i, 4);
        const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        h[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)r;
    }
}

/* d[i][j] = s[j][i] for an 8 x 8 tile of 32-bit values (AVX2, which every variant has: data
 * movement only, so the same bits everywhere). nt: non-temporal stores (d 32-byte aligned; the
 * caller fences): the destination's lines are not read first. */
static inline __attribute__((always_inline)) void transpose8_to(const uint32_t *s, long ls, uint32_t *d, long ld,
                                                                const int nt) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps((const float *)(s + i * ls));
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        const __m256 lo = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20), hi = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
        if (nt) {
            _mm256_stream_ps((float *)(d + i * ld), lo);
            _mm256_stream_ps((float *)(d + (i + 4) * ld), hi);
        } else {
            _mm256_storeu_ps((float *)(d + i * ld), lo);
            _mm256_storeu_ps((float *)(d + (i + 4) * ld), hi);
        }
    }
}

static inline void transpose8(const uint32_t *s, long ls, uint32_t *d, long ld) { transpose8_to(s, ls, d, ld, 0); }

/* moed_pack_p32's loop; nt: non-temporal stores (dst 32-byte aligned) */
static inline __attribute__((always_inline)) void pack_p32(const uint32_t *src, long nb, long k2, uint32_t *dst,
                                                           const int nt) {
    for (long b = 0; b < nb; b++) {
        const uint32_t *s = src + b * 32 * k2;
        uint32_t *d = dst + b * k2 * 32;
        long j = 0;
        for (; j + 8 <= k2; j += 8)
            for (long r = 0; r < 32; r += 8) transpose8_to(s + r * k2 + j, k2, d + j * 32 + r, 32, nt);
        for (; j < k2; j++)
            for (long r = 0; r < 32; r++) d[j * 32 + r] = s[r * k2 + j];
    }
}

/* P32 (cpu_bf16.c) of bf16 W [N][K], N a multiple of 32 and K even, moved as 32-bit pairs:
 * dst[b][j][r] = src[32 b + r][j] for the K / 2 pairs j of every row. On the calling thread
 * alone (no OpenMP team: the cold-expert store packs a missed expert on the step or the reading
 * thread, kernels/pack.py). The bench model's expert: 23 us against 127 us numpy's strided copy. */
void moed_pack_p32(const uint32_t *src, long nb, long k2, uint32_t *dst) { pack_p32(src, nb, k2, dst, 0); }

#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008   /* linux/fs.h: fail with EAGAIN rather than wait for the disk */
#endif
#define READ_PACK_CHUNK (256L * 1024)   /* bytes read at a time: the pack then reads them from L2 */

/* want bytes at byte off of fd read into buf with preadv2(RWF_NOWAIT) -> whether all of them
 * came (not: not cached, short, failed). */
static int read_chunk_nowait(int fd, int64_t off, long want, uint32_t *buf) {
    long got = 0;
    while (got < want) {
        struct iovec v = {(char *)buf + got, (size_t)(want - got)};
        const ssize_t r = preadv2(fd, &v, 1, off + got, RWF_NOWAIT);
        if (r <= 0) return 0;
        got += r;
    }
    return 1;
}

/* The cold-expert store's misses of a round read from the page cache and packed into their
 * slots, the team splitting the work (a read from the page cache is a memory copy: the step
 * thread alone did them while the other cores waited). Item i: nb[i] blocks of 32 rows of a
 * plain bf16 matrix, k2[i] pairs a row, at byte off[i] of file fd[i], packed as moed_pack_p32
 * into dst[i]. Read with preadv2(RWF_NOWAIT) in chunks of about READ_PACK_CHUNK bytes, each
 * packed only once it is whole: a chunk the page cache does not hold (EAGAIN, a short read;
 * past the end of a truncated file) or whose read fails sets status[i] = 1 and writes nothing,
 * and the caller reads that item's expert the blocking way, which reports the error. Returns
 * 0; -1 out of memory (every status then 1). */
int moed_read_pack_p32(long n, const int *fd, const int64_t *off, const int64_t *nb, const int64_t *k2,
                       const uint64_t *dst, int *status, int nthreads) {
    long *first = malloc(sizeof(long) * (n + 1));   /* first[i]: item i's first chunk */
    long *per = malloc(sizeof(long) * (n + 1));     /* blocks per chunk of item i */
    int oom = 0;
    if (!first || !per) {
        free(first); free(per);
        for (long i = 0; i < n; i++) status[i] = 1;
        return -1;
    }
    first[0] = 0;
    for (long i = 0; i < n; i++) {
        const long block = 32 * k2[i] * 4;
        per[i] = READ_PACK_CHUNK / block > 0 ? READ_PACK_CHUNK / block : 1;
        first[i + 1] = first[i] + (nb[i] + per[i] - 1) / per[i];
        status[i] = 0;
    }
    long most = 0;
    for (long i = 0; i < n; i++) most = per[i] * 32 * k2[i] > most ? per[i] * 32 * k2[i] : most;
#pragma omp parallel num_threads(nthreads)
    {
        uint32_t *buf = malloc(sizeof(uint32_t) * (most + 1));
        long i = 0;
#pragma omp for schedule(dynamic, 1)
        for (long c = 0; c < first[n]; c++) {
            while (first[i + 1] <= c) i++;              /* c ascends within a thread */
            while (first[i] > c) i--;
            if (!buf) {
#pragma omp atomic write
                status[i] = 1;
#pragma omp atomic write
                oom = 1;
                continue;
            }
            const long b0 = (c - first[i]) * per[i], bn = nb[i] - b0 < per[i] ? nb[i] - b0 : per[i];
            if (!read_chunk_nowait(fd[i], off[i] + b0 * 32 * k2[i] * 4, bn * 32 * k2[i] * 4, buf)) {
#pragma omp atomic write
                status[i] = 1;
                continue;
            }
            uint32_t *d = (uint32_t *)(uintptr_t)dst[i] + b0 * 32 * k2[i];
            if ((uintptr_t)d & 31) {
                pack_p32(buf, bn, k2[i], d, 0);
            } else {        /* no read of the slot's old lines: a third less memory traffic */
                pack_p32(buf, bn, k2[i], d, 1);
                _mm_sfence();
            }
        }
        free(buf);
    }
    free(first); free(per);
    return oom ? -1 : 0;
}

void moed_silu_mul_bf16_row(const float *gu, long I, uint16_t *act);

/* n 32-bit words of src (a packed block in L1) into dst: non-temporal where dst is 32-byte
 * aligned (a slot's lines are not read first; the caller fences). */
static inline void copy_block(const uint32_t *src, uint32_t *dst, long n) {
    if ((uintptr_t)dst & 31) {
        memcpy(dst, src, sizeof(uint32_t) * n);
        return;
    }
    long i = 0;
    for (; i + 8 <= n; i += 8) _mm256_stream_si256((__m256i *)(dst + i), _mm256_loadu_si256((const __m256i *)(src + i)));
    for (; i < n; i++) dst[i] = src[i];
}

/* Rows of x [R][ldx] through each block of a chunk read into buf: block j packed (P32) into
 * pbuf (L1/L2), copied to dst's block j where dst is set (a slot being installed), and every
 * row run through it by moed_block_rows_bf16, as the slot path runs the same packed block: the
 * same bits. y: the chunk's first output column of row 0, ldy apart. */
static void chunk_rows(const uint32_t *buf, long bn, long k2, uint32_t *pbuf, uint32_t *dst, const uint16_t *x,
                       long R, long ldx, float *y, long ldy) {
    for (long j = 0; j < bn; j++) {
        pack_p32(buf + j * 32 * k2, 1, k2, pbuf, 0);
        if (dst) copy_block(pbuf, dst + j * 32 * k2, 32 * k2);
        for (long r0 = 0; r0 < R; r0 += QBT)
            moed_block_rows_bf16(x + r0 * ldx, R - r0 < QBT ? R - r0 : QBT, ldx, (const uint16_t *)pbuf, 2 * k2,
                                 y + r0 * ldy + j * 32, ldy);
    }
}

/* The cold-expert store's misses of few rows computed straight from the page cache, without
 * reading them back from a slot (cold/packread.py run_direct): expert i's rows
 * x[first[i] .. first[i] + count[i]) [H] (bf16) -> out's same rows, bf16(down(silu(gate) * up)), the bits moed_experts_bf16 gives from a slot
 * holding that expert (expert_chunk). Its gate [I][H], up [I][H] and down [H][I] (plain bf16,
 * H and I multiples of 32) are at byte off[3i + m] of fd[3i + m] (m: 0 gate, 1 up, 2 down).
 * Each matrix is read by the team in chunks of about READ_PACK_CHUNK bytes (preadv2 with
 * RWF_NOWAIT into a thread's buffer: the page-cache copy), and each 32-row block is packed into
 * a second, L1-sized buffer and run there: one pass over the expert's bytes in memory, where a
 * slot costs three (the copy, the slot's write, the kernel's read of it). gate and up first,
 * then the activation, then down, a barrier between. dst[3i + m], where not 0, is where matrix m
 * of expert i is installed as it goes (a slot's packed gate, up and down: each packed block
 * also streamed there, one write and no read). A chunk the page cache does not hold, a short
 * read (a truncated file) or a failed one sets status[i] = 1: that expert's out rows are then
 * not its output, nor its slot whole (the caller runs it through a slot, whose blocking read
 * reports an error). Returns 0; -1 out of memory (every status then 1). */
int moed_read_experts_p32(long n, const int *fd, const int64_t *off, const uint64_t *dst, long H, long I,
                          const uint16_t *x, const int64_t *first, const int64_t *count, uint16_t *out, int *status,
                          int nthreads) {
    long *start = malloc(sizeof(long) * (n + 1));  /* expert i's first row in the scratch */
    if (!start) {
        for (long i = 0; i < n; i++) status[i] = 1;
        return -1;
    }
    start[0] = 0;
    for (long i = 0; i < n; i++) start[i + 1] = start[i] + count[i];
    const long R = start[n], ldg = 2 * I;
    const long per_gu = READ_PACK_CHUNK / (64L * H) > 0 ? READ_PACK_CHUNK / (64L * H) : 1;   /* blocks a chunk */
    const long per_dn = READ_PACK_CHUNK / (64L * I) > 0 ? READ_PACK_CHUNK / (64L * I) : 1;
    const long c_gu = (I / 32 + per_gu - 1) / per_gu, c_dn = (H / 32 + per_dn - 1) / per_dn;   /* chunks a matrix */
    const long kmax = H > I ? H : I, most = (per_gu * H > per_dn * I ? per_gu * H : per_dn * I) * 32;
    float *gu = malloc(sizeof(float) * (R * ldg + 1));
    uint16_t *act = malloc(sizeof(uint16_t) * (R * I + 1));
    int oom = !gu || !act;
    for (long i = 0; i < n; i++) status[i] = oom;
    if (oom) { free(gu); free(act); free(start); return -1; }
#pragma omp parallel num_threads(nthreads)
    {
        uint32_t *buf = aligned_alloc(64, (size_t)(most * 2 + 64) / 64 * 64);
        uint32_t *pbuf = aligned_alloc(64, (size_t)(kmax * 64 + 64) / 64 * 64);
        float tile[QBT * 32] __attribute__((aligned(64)));
        const int mine = buf && pbuf;
        if (!mine) {
#pragma omp atomic write
            oom = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < n * 2 * c_gu; t++) {       /* (expert, gate or up, chunk) */
            const long i = t / (2 * c_gu), m = t / c_gu % 2, c = t % c_gu;
            const long b0 = c * per_gu, bn = I / 32 - b0 < per_gu ? I / 32 - b0 : per_gu;
            if (!mine || !read_chunk_nowait(fd[3 * i + m], off[3 * i + m] + b0 * 64 * H, bn * 64 * H, buf)) {
#pragma omp atomic write
                status[i] = 1;
                continue;
            }
            uint32_t *d = dst[3 * i + m] ? (uint32_t *)(uintptr_t)dst[3 * i + m] + b0 * 16 * H : NULL;
            chunk_rows(buf, bn, H / 2, pbuf, d, x + first[i] * H, count[i], H,
                       gu + start[i] * ldg + m * I + b0 * 32, ldg);
        }   /* implicit barrier: every gate and up column written (or its expert failed) */
#pragma omp for schedule(static)
        for (long i = 0; i < n; i++) {
            int failed;
#pragma omp atomic read
            failed = status[i];
            if (failed || oom) continue;
            for (long r = start[i]; r < start[i + 1]; r++) moed_silu_mul_bf16_row(gu + r * ldg, I, act + r * I);
        }
#pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < n * c_dn; t++) {           /* (expert, chunk of down) */
            const long i = t / c_dn, c = t % c_dn, rows = start[i + 1] - start[i];
            const long b0 = c * per_dn, bn = H / 32 - b0 < per_dn ? H / 32 - b0 : per_dn;
            int failed;
#pragma omp atomic read
            failed = status[i];
            if (failed || oom) continue;
            if (!mine || !read_chunk_nowait(fd[3 * i + 2], off[3 * i + 2] + b0 * 64 * I, bn * 64 * I, buf)) {
#pragma omp atomic write
                status[i] = 1;
                continue;
            }
            for (long j = 0; j < bn; j++) {
                pack_p32(buf + j * 32 * (I / 2), 1, I / 2, pbuf, 0);
                if (dst[3 * i + 2]) copy_block(pbuf, (uint32_t *)(uintptr_t)dst[3 * i + 2] + (b0 + j) * 16 * I, 16 * I);
                for (long r0 = 0; r0 < rows; r0 += QBT) {
                    const long rn = rows - r0 < QBT ? rows - r0 : QBT;
                    moed_block_rows_bf16(act + (start[i] + r0) * I, rn, I, (const uint16_t *)pbuf, I, tile, 32);
                    for (long r = 0; r < rn; r++)
                        bf16_bits(tile + r * 32, 32, out + (first[i] + r0 + r) * H + (b0 + j) * 32);
                }
            }
        }
        _mm_sfence();
        free(buf); free(pbuf);
    }
    free(gu); free(act); free(start);
    if (oom)
        for (long i = 0; i < n; i++) status[i] = 1;
    return oom ? -1 : 0;
}

#if defined(__AVX512BW__)
/* ---- int4 blocks straight from the nibbles (AVX512BW) ----------------------------------------
 * An int4 weight takes one of 16 values per (row, group): bf16((c - z) * s), c = 0..15. So the
 * 16 bf16 values are made once per row and group (the same fp32 sub and mul as unit_dequant, the
 * same rounding as f32_to_bf16: the same bits), and every byte, which is a column pair (low
 * nibble even), becomes its P32 pair by one vpermw lookup of both nibbles; 16 rows x 16 pairs are
 * then transposed in registers into the block. No fp32 buffer, no separate rounding pass. */

/* The 16 bf16 values of codes 0..15 in the low 16 words of a zmm. */
static inline __m512i u4_lut(float s, float z) {
    const __m512 c = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_sub_ps(c, _mm512_set1_ps(z)), _mm512_set1_ps(s)));
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                         _mm512_and_si512(hi, _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i v = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    return _mm512_zextsi256_si512(_mm512_cvtepi32_epi16(v));
}

/* d[j] = column j of the 16 x 16 32-bit matrix whose rows are r[0..16) (in place). */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int a = 0; a < 16; a += 4) {   /* u[a + b]: rows a..a+3 of columns b + 4 * lane */
        u[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
        u[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
        u[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
        u[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
    }
    for (int b = 0; b < 4; b++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0x88), w0 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0x88);
        const __m512i v1 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0xdd), w1 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0xdd);
        r[b] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        r[b + 8] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
        r[b + 4] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[b + 12] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
    }
}

/* block_p32 for int4: rows [n0, n0 + QB) of q (zeros past N) into wb [K/2][QB]. A group spans
 * whole chunks of 16 pairs (group % 32 == 0, or one group a row), so a chunk has one LUT a row. */
static void block_p32_u4(const QMat *q, long n0, long N, uint32_t *wb) {
    const long K2 = q->K / 2, gp = q->group < q->K ? q->group / 2 : K2;
    const __m512i m4 = _mm512_set1_epi32(15), m4h = _mm512_set1_epi32(0xf0000);
    for (long h = 0; h < QB; h += 16) {
        const uint8_t *row[16];
        for (int i = 0; i < 16; i++) row[i] = q->w + (n0 + h + i < N ? n0 + h + i : N - 1) * q->ldw;
        __m512i lut[16];
        for (long p0 = 0; p0 < K2; p0 += 16) {
            if (p0 % gp == 0) {
                const long g = p0 / gp;
                for (int i = 0; i < 16; i++) {
                    const long n = n0 + h + i;
                    lut[i] = n < N ? u4_lut(q->s[n * q->lds + g], zero_at(Q_INT4, q, n, g)) : _mm512_setzero_si512();
                }
            }
            const long np = K2 - p0 < 16 ? K2 - p0 : 16;
            const __mmask16 m = (__mmask16)((1u << np) - 1);
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                const __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, row[i] + p0));
                const __m512i idx = _mm512_or_si512(_mm512_and_si512(v, m4), _mm512_and_si512(_mm512_slli_epi32(v, 12), m4h));
                r[i] = _mm512_permutexvar_epi16(idx, lut[i]);
            }
            transpose16(r);
            for (long j = 0; j < np; j++) _mm512_storeu_si512(wb + (p0 + j) * QB + h, r[j]);
        }
    }
}
#endif

/* Row n's pairs past the vector columns (p from KV / 2; zeros from K / 2 to K2r), scalar. */
static void tail_pairs(int fmt, const QMat *q, long n, long K2r, uint32_t *pr) {
    const long K2 = q->K / 2;
    float s = 0.0f, z = 0.0f;
    const uint8_t *row = q->w + n * q->ldw;
    for (long p = q->KV / 2, g = -1; p < K2r; p++) {
        uint16_t hv[2] = {0, 0};
        for (int e = 0; e < 2 && p < K2; e++) {
            const long k = 2 * p + e;
            if (k / q->group != g) { g = k / q->group; s = q->s[n * q->lds + g]; z = zero_at(fmt, q, n, g); }
            hv[e] = f32_to_bf16(weight_at(fmt, row, k, s, z));
        }
        pr[p] = hv[0] | (uint32_t)hv[1] << 16;
    }
}

#if !defined(__AVX512BW__)
/* Row n of an int4 q as bf16 pairs [KV / 2] straight from its nibbles: per group a 16-entry
 * table of the bf16 values of codes 0..15 ((c - z) * s in fp32, rounded once, then to bf16: the
 * fp32 route's value), split into low and high bytes that pshufb looks up, 32 columns at a
 * time. On Zen2 the fp32 route (unit_dequant, bf16_bits, pairing) was ~5% of an int4 prefill. */
static void row_pairs_u4(const QMat *q, long n, uint32_t *pr) {
    const uint8_t *row = q->w + n * q->ldw;
    const __m128i m4 = _mm_set1_epi8(0x0f);
    for (long k0 = 0, g = 0; k0 < q->KV; k0 += q->group, g++) {
        const float s = q->s[n * q->lds + g], z = zero_at(Q_INT4, q, n, g);
        uint8_t lo[16], hi[16];
        for (int c = 0; c < 16; c++) {
            const uint16_t h = f32_to_bf16(((float)c - z) * s);
            lo[c] = (uint8_t)h;
            hi[c] = (uint8_t)(h >> 8);
        }
        const __m128i tl = _mm_loadu_si128((const __m128i *)lo), th = _mm_loadu_si128((const __m128i *)hi);
        const long k1 = k0 + q->group < q->KV ? k0 + q->group : q->KV;
        for (long k = k0; k < k1; k += 32) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(row + k / 2));
            const __m128i e = _mm_and_si128(b, m4), o = _mm_and_si128(_mm_srli_epi16(b, 4), m4);   /* columns 2p, 2p + 1 */
            const __m128i el = _mm_shuffle_epi8(tl, e), eh = _mm_shuffle_epi8(th, e);
            const __m128i ol = _mm_shuffle_epi8(tl, o), oh = _mm_shuffle_epi8(th, o);
            const __m128i e0 = _mm_unpacklo_epi8(el, eh), e1 = _mm_unpackhi_epi8(el, eh);
            const __m128i o0 = _mm_unpacklo_epi8(ol, oh), o1 = _mm_unpackhi_epi8(ol, oh);
            uint32_t *d = pr + k / 2;
            _mm_storeu_si128((__m128i *)d, _mm_unpacklo_epi16(e0, o0));
            _mm_storeu_si128((__m128i *)(d + 4), _mm_unpackhi_epi16(e0, o0));
            _mm_storeu_si128((__m128i *)(d + 8), _mm_unpacklo_epi16(e1, o1));
            _mm_storeu_si128((__m128i *)(d + 12), _mm_unpackhi_epi16(e1, o1));
        }
    }
}
#endif

/* Weight rows [n0, n0 + QB) of q (zeros past N) into wb, P32 pairs as uint32 [K/2][QB].
 * fbuf: [QNR][KV] floats (unit_dequant's; int4 in [16 even, 16 odd] order per 32 columns),
 * then hb: [QB][K/2] pairs row by row (bf16_bits; int4 without AVX512BW: row_pairs_u4), then
 * transposed 8 x 8 into wb. */
static void block_p32(int fmt, int asym, const QMat *q, long n0, long N, float *fbuf, uint32_t *wb) {
#if defined(__AVX512BW__)
    if (fmt == Q_INT4) { block_p32_u4(q, n0, N, wb); return; }
#endif
    const long K2 = q->K / 2, KV = q->KV, K2r = (K2 + 7) / 8 * 8;
    uint32_t *hb = (uint32_t *)(fbuf + ((QNR * KV + 15) / 16) * 16);
#if !defined(__AVX512BW__)
    if (fmt == Q_INT4) {
        for (long c = 0; c < QB; c++) {
            uint32_t *pr = hb + c * K2r;
            if (n0 + c >= N) {
                memset(pr, 0, sizeof(uint32_t) * K2r);
                continue;
            }
            row_pairs_u4(q, n0 + c, pr);
            tail_pairs(fmt, q, n0 + c, K2r, pr);
        }
    } else
#endif
    for (long u = 0; u < QB / QNR; u++) {
        long rows[QNR];
        for (int j = 0; j < QNR; j++) rows[j] = n0 + u * QNR + j < N ? n0 + u * QNR + j : N - 1;
        unit_dequant_any(fmt, asym, q, rows, fbuf);
        for (int j = 0; j < QNR; j++) {
            const long c = u * QNR + j, n = n0 + c;
            uint32_t *pr = hb + c * K2r;
            if (n >= N) {
                memset(pr, 0, sizeof(uint32_t) * K2r);
                continue;
            }
            bf16_bits(fbuf + j * KV, KV, (uint16_t *)pr);   /* little-endian: pair p = [2p, 2p + 1] */
            tail_pairs(fmt, q, n, K2r, pr);
        }
    }
    for (long p0 = 0; p0 + 8 <= K2; p0 += 8)
        for (long c0 = 0; c0 < QB; c0 += 8) transpose8(hb + c0 * K2r + p0, K2r, wb + p0 * QB + c0, QB);
    for (long p = K2 / 8 * 8; p < K2; p++)
        for (long c = 0; c < QB; c++) wb[p * QB + c] = hb[c * K2r + p];
}

/* y [R][ldy] fp32 (or out bf16 [R][N] rounded, bias fp32 added first, when out is set), columns
 * [n0, n0 + nb QB) clipped to N, for every row of x bf16 [R][K], through the nb (<= QMB) packed
 * blocks from wb. */
static void block_all_rows(const uint16_t *x, long R, long K, const uint32_t *wb, long nb, long n0, long N,
                           const float *bias, float *y, long ldy, uint16_t *out) {
    float tile[QBT * QMB * QB] __attribute__((aligned(64)));
    const long nc = N - n0 < nb * QB ? N - n0 : nb * QB, bw = QB * K / 2;
    for (long r0 = 0; r0 < R; r0 += QBT) {
        const long rn = R - r0 < QBT ? R - r0 : QBT;
        if (!out && nc == nb * QB) {
            moed_blocks_rows_bf16(x + r0 * K, rn, K, (const uint16_t *)wb, nb, 2 * bw, K, y + r0 * ldy + n0, ldy);
            continue;
        }
        moed_blocks_rows_bf16(x + r0 * K, rn, K, (const uint16_t *)wb, nb, 2 * bw, K, tile, nb * QB);
        for (long r = 0; r < rn; r++)
            for (long c = 0; c < nc; c++) {
                const float v = tile[r * nb * QB + c] + (bias ? bias[n0 + c] : 0.0f);
                if (out) out[(r0 + r) * N + n0 + c] = f32_to_bf16(v);
                else y[(r0 + r) * ldy + n0 + c] = v;
            }
    }
}

/* Packed blocks a thread holds at once (QCAP bytes, at least one) and input rows per pass over
 * them (~256 KB of bf16, as cpu_bf16.c's row_chunk): the rows stay in L2 while the group's
 * blocks stream past, and each block is still packed once per call. */
#define QCAP (1L << 20)
static inline long group_blocks(long K) { const long g = QCAP / (QB * K * 2); return g > 0 ? g : 1; }
static inline long rows_per_pass(long K) { const long r = (128L * 1024) / K / QBT * QBT; return r > 4 * QBT ? r : 4 * QBT; }

/* A thread's packing buffers for K up to kmax: fbuf [QNR][KV] floats, block_p32's rows of pairs
 * [QB][K/2 + 8], then the packed group at blocked_wb(fbuf, K). NULL: out of memory. */
static inline uint32_t *blocked_wb(float *fbuf, long K) {
    return (uint32_t *)(fbuf + ((QNR * K + 15) / 16) * 16) + QB * ((K / 2 + 7) / 8 * 8);
}
static float *blocked_scratch(long kmax) {
    const long wb = QB * kmax * 2 > QCAP ? QB * kmax * 2 : QCAP;
    const long pairs = QB * ((kmax / 2 + 7) / 8 * 8);
    return aligned_alloc(64, ((QNR * kmax + 16) * sizeof(float) + pairs * 4 + wb + 127) / 64 * 64);
}

/* Packed blocks [b0, b1) of q (N rows) through every row of x bf16 [R][K]: a group of blocks
 * packed, then the rows a pass at a time over the group; y / out as block_all_rows. */
static void blocks_through(int fmt, int asym, const QMat *q, long N, long b0, long b1, const uint16_t *x, long R,
                           float *fbuf, const float *bias, float *y, long ldy, uint16_t *out) {
    const long K = q->K, gb = group_blocks(K), rp = rows_per_pass(K), bw = QB * K / 2;
    uint32_t *wb = blocked_wb(fbuf, K);
    for (long g0 = b0; g0 < b1; g0 += gb) {
        const long g1 = b1 - g0 < gb ? b1 : g0 + gb;
        for (long b = g0; b < g1; b++) block_p32(fmt, asym, q, b * QB, N, fbuf, wb + (b - g0) * bw);
        for (long c0 = 0; c0 < R; c0 += rp)
            for (long b = g0; b < g1; b += QMB)
                block_all_rows(x + c0 * K, R - c0 < rp ? R - c0 : rp, K, wb + (b - g0) * bw, g1 - b < QMB ? g1 - b : QMB,
                               b * QB, N, bias, y ? y + c0 * ldy : NULL, ldy, out ? out + c0 * N : NULL);
    }
}

/* moed_qlinear's product for bf16 x [R][K] and out [R][N] by packed blocks (the reference's
 * numerics, above): blocks split contiguously between threads, each output by one thread, so
 * the bits do not depend on the thread count. K even. Returns 0, -1 out of memory, -2 bad
 * arguments. */
int moed_qlinear_blocked(const uint16_t *x, long R, long K, int fmt, const uint8_t *w, long ldw,
                         const float *s, long lds, const uint8_t *z, long ldz, long group, long N,
                         const float *bias, uint16_t *out, int nthreads) {
    const int step = fmt == Q_INT4 ? 32 : 16;
    if (fmt < 0 || fmt > 2 || group <= 0 || (group < K && group % step) || (fmt == Q_FP8 && z) || K % 2) return -2;
    if (R <= 0 || N <= 0) return 0;
    const QMat q = {w, ldw, s, lds, z, ldz, group, K, K - K % step};
    const long blocks = (N + QB - 1) / QB;
    int oom = 0;
#pragma omp parallel num_threads(nthreads)
    {
        long b0, b1;
        const long per = blocks / omp_get_num_threads(), extra = blocks % omp_get_num_threads();
        const int tid = omp_get_thread_num();
        b0 = tid * per + (tid < extra ? tid : extra);
        b1 = b0 + per + (tid < extra);
        float *fbuf = b1 > b0 ? blocked_scratch(K) : NULL;
        if (b1 > b0 && !fbuf) {
#pragma omp atomic write
            oom = 1;
        }
        if (fbuf) blocks_through(fmt, z != NULL, &q, N, b0, b1, x, R, fbuf, bias, NULL, 0, out);
        free(fbuf);
    }
    return oom ? -1 : 0;
}

/* ---- A whole MoE layer over quantized experts, routed rows in, weighted sum out ------------ */

void moed_silu_mul_bf16_row(const float *gu, long I, uint16_t *act);   /* cpu_bf16.c */

/* run_units for a run-time (fmt, asym): the five instantiations moed_qlinear dispatches to. */
static void run_units_any(int fmt, int asym, const QMat *q, const float *x, long R, long N, long u0, long u1,
                          float *wbuf, void *out, int out_f32) {
    if (fmt == Q_INT8 && !asym) run_units(Q_INT8, 0, q, x, R, N, u0, u1, wbuf, NULL, out, out_f32);
    else if (fmt == Q_INT8) run_units(Q_INT8, 1, q, x, R, N, u0, u1, wbuf, NULL, out, out_f32);
    else if (fmt == Q_INT4 && !asym) run_units(Q_INT4, 0, q, x, R, N, u0, u1, wbuf, NULL, out, out_f32);
    else if (fmt == Q_INT4) run_units(Q_INT4, 1, q, x, R, N, u0, u1, wbuf, NULL, out, out_f32);
    else run_units(Q_FP8, 0, q, x, R, N, u0, u1, wbuf, NULL, out, out_f32);
}

/* cpu_qdot.c's integer-dot path (int8 activations): its matrix view (QDMat there) and calls. */
typedef struct { const uint8_t *w; long ldw; const float *s; long lds; const uint8_t *z; long ldz; long G, K; } QDMat;
long moed_qdot_bytes(long R, long K, long G);
void moed_qdot_quantize(int fmt, const float *x, long ldx, long R, long K, long G, void *buf);
void moed_qdot_units(int fmt, const QDMat *q, const void *buf, long R, long N, long u0, long u1,
                     const float *bias, void *out, long ldo, int out_f32);

/* Expert e's matrix of a [P][N][K] stack: ptr = {codes, scales, zeros}, dim = {ldw, expert stride
 * of codes, lds, of scales, ldz, of zeros, group} (elements). */
static QMat expert_mat(const void *const ptr[3], const long dim[7], long e, long K, int fmt) {
    const int step = fmt == Q_INT4 ? 32 : 16;
    const uint8_t *z = ptr[2] ? (const uint8_t *)ptr[2] + e * dim[5] : NULL;
    QMat q = {(const uint8_t *)ptr[0] + e * dim[1], dim[0], (const float *)ptr[1] + e * dim[3], dim[2], z, dim[4],
              dim[6], K, K - K % step};
    return q;
}

/* Row r of src [K] fp32 into dst [K] as run_units reads x: int4 permuted per 32 columns. */
static void put_row(int fmt, long K, long KV, const float *src, float *dst) {
    if (fmt != Q_INT4) { memcpy(dst, src, sizeof(float) * K); return; }
    for (long c = 0; c < K; c++) dst[c < KV ? c - c % 32 + (c % 32 & 1) * 16 + c % 32 / 2 : c] = src[c];
}

/* This thread's share [lo, hi) of n items, contiguous (as moed_qlinear splits units). */
static inline void q_split(long n, int tid, int nt, long *lo, long *hi) {
    const long per = n / nt, extra = n % nt;
    *lo = tid * per + (tid < extra ? tid : extra);
    *hi = *lo + per + (tid < extra);
}

/* A unit's work in rows' worth: its expert's rows, plus one for reading the weights (what a
 * unit of a one-row expert costs at decode) or, for an expert packed to bf16 blocks (blocked,
 * more rows), PACK_ROWS for the packing (~25% of a 70-row expert's FMAs in a Zen2 profile). */
#define PACK_ROWS 16
static inline long unit_weight(long n, int blocked) { return n + (blocked && n > blocked ? PACK_ROWS : 1); }

/* Where thread t's share of an experts phase starts, as a unit index in slot order: the cut
 * falls where the units' running weight reaches t / nt of the whole. Equal unit counts left the
 * thread with the busier experts working alone at the end (a 512-token int4 layer ran 1.80x
 * faster on 2 threads than on 1). Every output is still made by one thread: no bits change. */
static long unit_cut(const long *count, const long *touched, long nt_e, long units, int blocked, int t, int nt) {
    if (t <= 0) return 0;
    if (t >= nt) return nt_e * units;
    long total = 0;
    for (long i = 0; i < nt_e; i++) total += unit_weight(count[touched[i] + 1] - count[touched[i]], blocked) * units;
    const long goal = total / nt * t + total % nt * t / nt;
    long acc = 0;
    for (long i = 0; i < nt_e; i++) {
        const long c = unit_weight(count[touched[i] + 1] - count[touched[i]], blocked);
        if (acc + c * units >= goal) return i * units + (goal - acc + c - 1) / c;
        acc += c * units;
    }
    return nt_e * units;
}

/* act rows [r0, r0 + n) of one expert = silu(gate) * up of its gate_up rows (gu [R][2I] fp32), as
 * run_units reads them (int4 permuted). bf16: cpu_bf16.c's silu_mul_row on the unrounded sums
 * (it rounds g and u to bf16 first, as the bf16 gate_up output is); tmp: 2I floats. */
static void act_rows(int x_f32, int fmt, long I, const float *gu, long r0, long n, float *act, float *tmp) {
    const int step = fmt == Q_INT4 ? 32 : 16;
    for (long r = r0; r < r0 + n; r++) {
        const float *g = gu + r * 2 * I;
        if (!x_f32) {
            uint16_t *ab = (uint16_t *)tmp;
            moed_silu_mul_bf16_row(g, I, ab);
            for (long c = 0; c < I; c++) tmp[I + c] = bf16_to_f32(ab[c]);
        } else {
            for (long c = 0; c < I; c++) tmp[I + c] = g[c] / (1.0f + expf(-g[c])) * g[I + c];
        }
        put_row(fmt, I, I - I % step, tmp + I, act + (r - r0) * I);
    }
}

/* One matmul phase over every touched expert: units (QNR output rows) of all experts in slot
 * order split contiguously between threads; each output by one thread, as moed_qlinear (bycol:
 * each thread the same share of every expert's units instead, so that it holds all the rows of
 * its output columns and can sum them without waiting for the others). With
 * gu set (the down phase), the thread first makes each of its experts' activations itself into
 * its own act buffer (a few rows: cheaper than a barrier between SiLU and down, which on shared
 * cores waits for the slowest thread's time slice). blocked (moed_moe_q's): units of QB rows, x
 * bf16 rows by slot, each expert by its row count as moed_moe_q says. */
static void experts_phase(int fmt, int asym, const void *const ptr[3], const long dim[7], const long *count,
                          const long *touched, long nt_e, long K, long N, const float *x, float *out,
                          float *wbuf, int tid, int nt, int x_f32, const float *gu, float *act, float *tmp,
                          int blocked, void *qbuf, int bycol) {
    const long units = blocked ? (N + QB - 1) / QB : (N + QNR - 1) / QNR;
    long lo, hi;
    if (bycol) {
        q_split(units, tid, nt, &lo, &hi);
    } else {
        lo = unit_cut(count, touched, nt_e, units, blocked, tid, nt);
        hi = unit_cut(count, touched, nt_e, units, blocked, tid + 1, nt);
    }
    for (long i = bycol ? 0 : lo / units; i < nt_e && (bycol || i * units < hi); i++) {
        const long e = touched[i], r0 = count[e], n = count[e + 1] - r0;
        long u0 = lo > i * units ? lo - i * units : 0, u1 = hi < (i + 1) * units ? hi - i * units : units;
        if (bycol) u0 = lo, u1 = hi;
        if (u0 >= u1) continue;
        const QMat q = expert_mat(ptr, dim, e, K, fmt);
        if (qbuf && !(blocked && n > blocked)) {
            /* int8 activations (cpu_qdot.c): rows in column order as fp32, quantized once per
             * expert and thread; units as the loop below would take them */
            const float *xr = x ? x + r0 * K : act;
            if (gu) {
                act_rows(blocked ? 0 : x_f32, Q_INT8, K, gu, r0, n, act, tmp);
            } else if (blocked) {
                for (long i = 0; i < n * K; i++) act[i] = bf16_to_f32(((const uint16_t *)x)[r0 * K + i]);
                xr = act;
            }
            const QDMat qd = {q.w, q.ldw, q.s, q.lds, q.z, q.ldz, q.group < K ? q.group : K, K};
            const long uq = (N + QNR - 1) / QNR, v0 = blocked ? u0 * (QB / QNR) : u0;
            const long v1 = !blocked ? u1 : u1 * (QB / QNR) < uq ? u1 * (QB / QNR) : uq;
            moed_qdot_quantize(fmt, xr, K, n, K, qd.G, qbuf);
            moed_qdot_units(fmt, &qd, qbuf, n, N, v0, v1, NULL, out + r0 * N, N, 1);
        } else if (blocked && n <= blocked) {
            /* few rows: moed_qlinear's loop, as the per-expert path takes them (x: bf16 rows
             * made fp32 here, act as act_rows makes it; the unit range of the same blocks) */
            const long uq = (N + QNR - 1) / QNR, v1 = u1 * (QB / QNR) < uq ? u1 * (QB / QNR) : uq;
            if (gu) {
                act_rows(0, fmt, K, gu, r0, n, act, tmp);
            } else {
                for (long r = 0; r < n; r++) {
                    for (long c = 0; c < K; c++) tmp[c] = bf16_to_f32(((const uint16_t *)x)[(r0 + r) * K + c]);
                    put_row(fmt, K, q.KV, tmp, act + r * K);
                }
            }
            run_units_any(fmt, asym, &q, act, n, N, u0 * (QB / QNR), v1, wbuf, out + r0 * N, 1);
        } else if (blocked) {   /* x, act: bf16 rows; wbuf: blocked_scratch(K); each block packed once */
            const uint16_t *xin = (const uint16_t *)x + r0 * K;
            if (gu) {
                for (long r = 0; r < n; r++) moed_silu_mul_bf16_row(gu + (r0 + r) * 2 * K, K, (uint16_t *)act + r * K);
                xin = (const uint16_t *)act;
            }
            blocks_through(fmt, asym, &q, N, u0, u1, xin, n, wbuf, NULL, out + r0 * N, N, NULL);
        } else if (gu) {
            act_rows(x_f32, fmt, K, gu, r0, n, act, tmp);
            run_units_any(fmt, asym, &q, act, n, N, u0, u1, wbuf, out + r0 * N, 1);
        } else {
            run_units_any(fmt, asym, &q, x + r0 * K, n, N, u0, u1, wbuf, out + r0 * N, 1);
        }
    }
}

/* f32_to_bf16 of 8 lanes (round to nearest even, denormals kept, NaN quieted) as 32-bit lanes. */
static inline __m256i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                                         _mm256_and_si256(hi, _mm256_set1_epi32(1))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}

static inline __m256 round_bf16x8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }

/* Columns [c, c + 8) of moed_moe_q's weighted sum of token t (out element o = t * H + c): the
 * scalar loop below it, 8 columns at a time (the same operations per column; prefill spent ~8%
 * of a layer there). */
static inline void weighted_sum8(const float *y, long H, long c, const long *p, const float *wv, long k,
                                 int single, int x_f32, void *out, long o) {
    __m256 sum = _mm256_setzero_ps();
    for (long j = 0; j < k; j++) {
        const __m256 yv = _mm256_loadu_ps(y + p[j] * H + c), w = _mm256_set1_ps(wv[j]);
        const __m256 v = x_f32 ? _mm256_mul_ps(yv, w) : round_bf16x8(_mm256_mul_ps(round_bf16x8(yv), w));
        if (j == 0 && single) sum = v;
        else if (single && !x_f32) sum = round_bf16x8(_mm256_add_ps(sum, v));
        else sum = _mm256_add_ps(sum, v);
    }
    if (x_f32) {
        _mm256_storeu_ps((float *)out + o, sum);
    } else {
        const __m256i b = bf16_bits8(sum);   /* 0..0xffff in each lane: packus keeps them */
        _mm_storeu_si128((__m128i *)((uint16_t *)out + o),
                         _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    }
}

/* out[t] = sum_j w[t][j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = phys[t][j]: the experts
 * and weighted sum of a quantized MoE layer in one call, the routing (phys [T][k] slots, wts
 * [T][k] the router's weights in x's dtype, as float) done by the caller. Experts: gate_up a
 * [P][2I][H] stack (gate rows first), down [P][H][I]; gptr/dptr {codes, scales, zeros or NULL},
 * gdim/ddim as expert_mat says; one format fmt for both. Each touched expert's weights are read
 * once per call (all its rows in one pass, buffered tiles past QRT rows: the same bits as
 * moed_qlinear on those rows, a row's result independent of the others and of the threads).
 * Roundings are those of the per-expert torch path (moe.LocalExperts) on moed_qlinear:
 *   bf16  gate_up and down outputs rounded to bf16; act = bf16(bf16(silu(g)) * u) by cpu_bf16.c's
 *         silu_mul_row (the bf16 MoE kernel's); each product bf16(y * w); summed, single (one token,
 *         no replicas: LocalExperts._single_token) in top-k order rounding after each add, else
 *         in ascending slot order in fp32, rounded once (torch's index_add_);
 *   fp32  act = silu(g) * u with expf (torch's vectorised exp may differ by an ulp: the only
 *         difference from the torch path); products and sums in fp32 in the same orders.
 * One barrier for one token (gate_up -> down and sum, each thread the down rows of its own
 * output columns); two for more (gate_up -> down -> sum).
 * blocked > 0 (bf16, H and I even; prefill): an expert with more than `blocked` rows takes the
 * packed-block path (moed_qlinear_blocked's numerics, each of its blocks packed once per call),
 * one with fewer moed_qlinear's loop: what the per-expert path's Linears do past and within
 * their qrows = blocked, so the layer stays bitwise equal to that path. 0: every expert the loop.
 * qact (int8 / int4): every expert of at most `blocked` rows (all, when blocked is 0) on int8
 * activations (cpu_qdot.c), as the per-expert path's Linears with the setting.
 * Returns 0; -1 out of memory; -2 a group or slot it cannot take. */
int moed_moe_q(const void *x_in, int x_f32, long T, long H, long k, const int64_t *phys, const float *wts,
               int single, int fmt, long P, long I, const void *const gptr[3], const long gdim[7],
               const void *const dptr[3], const long ddim[7], void *out, int blocked, int qact, int nthreads) {
    const int step = fmt == Q_INT4 ? 32 : 16, asym = gptr[2] != NULL, pf = qact ? Q_INT8 : fmt;   /* pf: x's layout */
    if (fmt < 0 || fmt > 2 || (fmt == Q_FP8 && asym) || (dptr[2] != NULL) != asym) return -2;
    if (qact && (fmt == Q_FP8 || (fmt == Q_INT4 && (H % 2 || I % 2)))) return -2;
    if (blocked < 0 || (blocked && (x_f32 || H % 2 || I % 2))) return -2;
    if (gdim[6] <= 0 || (gdim[6] < H && gdim[6] % step) || ddim[6] <= 0 || (ddim[6] < I && ddim[6] % step)) return -2;
    const long R = T * k;
    if (R <= 0) return 0;
    if (nthreads < 1) nthreads = 1;
    for (long s = 0; s < R; s++) if (phys[s] < 0 || phys[s] >= P) return -2;
    long *count = calloc(P + 1, sizeof(long)), *fill = malloc(sizeof(long) * (P + 1));
    long *pos = malloc(sizeof(long) * R), *touched = malloc(sizeof(long) * (R + 1));
    float *xg = malloc(sizeof(float) * (R * H + 16)), *gu = malloc(sizeof(float) * (R * 2 * I + 16));
    float *y = malloc(sizeof(float) * (R * H + 16));
    const long kvmax = H > I ? H : I;
    long most = 0;                                             /* rows of the busiest expert */
    /* per thread: dequantized unit [QNR][kvmax], an expert's activations [most][I], a row [2 kvmax] */
    float **wbuf = calloc(nthreads, sizeof(float *)), **act = calloc(nthreads, sizeof(float *));
    float **tmp = calloc(nthreads, sizeof(float *));
    void **qbuf = calloc(nthreads, sizeof(void *));            /* int8 activations of an expert's rows */
    int rc = 0;
    if (!count || !fill || !pos || !touched || !xg || !gu || !y || !wbuf || !act || !tmp || !qbuf) { rc = -1; goto done; }
    for (long s = 0; s < R; s++) count[phys[s] + 1]++;
    for (long e = 0; e < P; e++) {
        if (count[e + 1] > most) most = count[e + 1];
        count[e + 1] += count[e];                              /* count[e]: first sorted row of slot e */
    }
    for (int i = 0; i < nthreads; i++) {
        wbuf[i] = blocked ? blocked_scratch(kvmax) : aligned_alloc(64, (size_t)(QNR * kvmax + 16) * sizeof(float));
        const long few = most < blocked ? most : blocked;           /* blocked: a few-row expert's x as fp32 */
        act[i] = malloc(sizeof(float) * ((most * I > few * H ? most * I : few * H) + 16));
        tmp[i] = malloc(sizeof(float) * (2 * kvmax + 16));
        if (qact) {
            const long qr = blocked ? few : most, bh = moed_qdot_bytes(qr, H, gdim[6] < H ? gdim[6] : H);
            const long bi = moed_qdot_bytes(qr, I, ddim[6] < I ? ddim[6] : I);
            qbuf[i] = malloc(bh > bi ? bh : bi);
        }
        if (!wbuf[i] || !act[i] || !tmp[i] || (qact && !qbuf[i])) { rc = -1; goto done; }
    }
    memcpy(fill, count, sizeof(long) * P);
    for (long s = 0; s < R; s++) pos[s] = fill[phys[s]]++;     /* stable: flat order within a slot */
    long nt_e = 0;
    for (long e = 0; e < P; e++) if (count[e + 1] > count[e]) touched[nt_e++] = e;
    if (blocked) {                         /* bf16 rows by slot, as they come */
        for (long s = 0; s < R; s++)
            memcpy((uint16_t *)xg + pos[s] * H, (const uint16_t *)x_in + s / k * H, sizeof(uint16_t) * H);
    } else {
        for (long t = 0; t < T; t++) {     /* each token as fp32 (int4 permuted) into y, free till down */
            for (long c = 0; c < H; c++)
                tmp[0][c] = x_f32 ? ((const float *)x_in)[t * H + c] : bf16_to_f32(((const uint16_t *)x_in)[t * H + c]);
            put_row(pf, H, H - H % step, tmp[0], y + t * H);
        }
        for (long s = 0; s < R; s++) memcpy(xg + pos[s] * H, y + s / k * H, sizeof(float) * H);   /* rows by slot */
    }
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        experts_phase(fmt, asym, gptr, gdim, count, touched, nt_e, H, 2 * I, xg, gu, wbuf[tid], tid, nt, x_f32,
                      NULL, act[tid], tmp[tid], blocked, qbuf[tid], 0);
#pragma omp barrier
        /* one token (decode at batch 1): the down rows by columns, each thread then sums its own
         * columns (no second barrier; the same sums, made by another thread; each thread makes
         * the k experts' activations itself, a few microseconds). More rows: by expert (each
         * expert's activations made once), a barrier, then the sum by tokens */
        const int bycol = !blocked && T == 1;
        experts_phase(fmt, asym, dptr, ddim, count, touched, nt_e, I, H, NULL, y, wbuf[tid], tid, nt, x_f32,
                      gu, act[tid], tmp[tid], blocked, qbuf[tid], bycol);
        long lo = 0, hi = T, c0 = 0, c1 = H;
        if (!bycol) {
#pragma omp barrier
            q_split(T, tid, nt, &lo, &hi);
        } else {
            q_split((H + QNR - 1) / QNR, tid, nt, &c0, &c1);
            c0 *= QNR;
            c1 = c1 * QNR < H ? c1 * QNR : H;
        }
        for (long t = lo; t < hi; t++) {                       /* weighted sum per token */
            long p[k];                                         /* single: top-k order; else ascending slot */
            float wv[k];
            for (long j = 0; j < k; j++) {
                long v = pos[t * k + j], q = j;
                if (!single) for (; q > 0 && p[q - 1] > v; q--) { p[q] = p[q - 1]; wv[q] = wv[q - 1]; }
                p[q] = v;
                wv[q] = wts[t * k + j];
            }
            long c = c0;
            for (; c + 8 <= c1; c += 8) weighted_sum8(y, H, c, p, wv, k, single, x_f32, out, t * H + c);
            for (; c < c1; c++) {
                float sum = 0.0f;
                for (long j = 0; j < k; j++) {
                    const float yv = y[p[j] * H + c];
                    const float v = x_f32 ? yv * wv[j] : bf16_to_f32(f32_to_bf16(bf16_to_f32(f32_to_bf16(yv)) * wv[j]));
                    if (j == 0 && single) sum = v;
                    else if (single && !x_f32) sum = bf16_to_f32(f32_to_bf16(sum + v));
                    else sum += v;
                }
                if (x_f32) ((float *)out)[t * H + c] = sum;
                else ((uint16_t *)out)[t * H + c] = f32_to_bf16(sum);
            }
        }
    }
done:
    for (int i = 0; i < nthreads && wbuf && act && tmp && qbuf; i++) { free(wbuf[i]); free(act[i]); free(tmp[i]); free(qbuf[i]); }
    free(wbuf); free(act); free(tmp); free(qbuf);
    free(count); free(fill); free(pos); free(touched); free(xg); free(gu); free(y);
    return rc;
}

int moed_route_bf16(const uint16_t *x, long T, long H, const uint16_t *router, long E, long k, int norm_topk,
                    const int64_t *l2p, long max_rep, const int64_t *nrep, long offset, int64_t *load,
                    long P, int64_t *phys, float *wts, int nthreads);   /* cpu_bf16.c */

/* moed_moe_q with the bf16 MoE kernel's router in front (bf16 models): moed_route_bf16 (router
 * [E][H] packed P32, logits rounded to bf16, softmax, top-k, renormalised, slots through l2p as
 * moed_moe_bf16; load counted) gives the slots and weights, then the experts as above; a lone
 * token with no replicated expert sums in top-k order (LocalExperts._single_token, combine).
 * The router half is the very function expert parallelism calls (CpuKernels.route_bf16), so an
 * EP group or the cold store (route, then MoEMode.QFUSED) equals this call bit for bit. */
int moed_moe_q_routed(const uint16_t *x, long T, long H, const uint16_t *router, long E, long k, int norm_topk,
                      const int64_t *l2p, long max_rep, const int64_t *nrep, long offset, int64_t *load,
                      int fmt, long P, long I, const void *const gptr[3], const long gdim[7],
                      const void *const dptr[3], const long ddim[7], uint16_t *out, int blocked, int qact, int nthreads) {
    int64_t *phys = malloc(sizeof(int64_t) * (T * k + 1));
    float *wts = malloc(sizeof(float) * (T * k + 1));
    int rc = phys && wts ? 0 : -1;
    if (!rc) rc = moed_route_bf16(x, T, H, router, E, k, norm_topk, l2p, max_rep, nrep, offset, load, P, phys, wts, nthreads);
    if (!rc) rc = moed_moe_q(x, 0, T, H, k, phys, wts, T == 1 && max_rep == 1, fmt, P, I, gptr, gdim, dptr, ddim,
                             out, blocked, qact, nthreads);
    free(phys);
    free(wts);
    return rc;
}
