/* bf16 CPU kernels for x86-64 CPUs (AVX512-BF16, AVX512, or AVX2 + FMA: the variants below):
 * matmuls on a packed weight, a whole MoE block,
 * paged decode and prefill attention, RMSNorm and rotary. Built for decode; the matmuls and the
 * MoE block serve prefill too (on par with oneDNN there on Zen4), so a weight is held once.
 *
 * Why: decode multiplies a few rows (1-16 tokens; 1-4 per expert) by big weights. That is
 * memory-bound work: the best kernel reads each weight byte once, at full bandwidth, whatever
 * the row count. torch's bf16 gemv reads a weight once per row; oneDNN tiles for many rows and
 * spends ~15 us of setup per call; and an MoE layer in torch is ~60 small ops. Measured on the
 * 2-vCPU Zen4 dev VM: this layout streams at 31-36 GB/s for 1-8 rows, oneDNN at 15-25.
 *
 * Packed weight layout ("P32"): W [N][K] -> [ceil(N/32)][K/2][32][2], padded with zero rows.
 * One 64-byte load holds 16 output columns x 2 k values, the operand of vdpbf16ps (32 bf16
 * products summed into 16 fp32 lanes); the next 64 bytes the other 16 columns. Each thread
 * reads its blocks front to back (one sequential stream: what the prefetcher follows at full
 * speed; several interleaved streams measured at half), and multiplies each loaded weight
 * vector into up to 8 input rows (x pairs broadcast) while it sits in a register. No
 * horizontal sums, and outputs land 32 columns at a time. K must be even.
 *
 * Numerics: fp32 accumulation; every matmul output is rounded to bf16 (round to nearest even)
 * before use, as a bf16 torch matmul rounds it, and the elementwise steps round where torch's
 * bf16 ops do, so results match the torch path up to fp32 summation order (an ulp, rarely).
 *
 * Prefill attention (moed_prefill_attn_bf16) is the same two matmuls on the same packed-block
 * kernel, K and V^T packed per call, blocked over 8 query rows: no [T, T] score matrix.
 *
 * A decode step (moed_decode_step, cpu_step.c) strings these kernels (and cpu_quant.c's) together
 * over every layer of a GQA MoE model in one call, so a decode step crosses from Python once.
 *
 * Threads: the caller passes the count; OpenMP is the libgomp torch already loaded (same
 * soname), so these are torch's own pool threads, never a second pool competing for cores.
 * Every output element is computed by one thread in a fixed order, so results are bitwise the
 * same for any thread count (a prefill node and a decode node agree exactly).
 * Built at run time by moed/model/kernels/__init__.py once per ISA variant (no -march=native:
 * one cached .so serves any CPU of its variant): avx512bf16 (-mavx512bf16: Zen4, Sapphire
 * Rapids and later), avx512 (-mavx512f/bw/vl, no BF16: Skylake-SP, Cascade Lake, Ice Lake;
 * real 512-bit code, the bf16 dot product and conversion done by cpu_avx512.h) and avx2
 * (-march=x86-64-v3: Haswell, Zen1-3 and later; through cpu_avx2.h, which does each 512-bit
 * step on two 256-bit halves in the same order). All three give the same bits (see cpu_avx2.h
 * for the one exception, denormals). All build with -ffp-contract=off, so the compiler fuses
 * no multiply-add the source does not spell out (it could fuse differently per variant, and
 * the bits would part).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;
#include "cpu_bf16_scalar.h"

#define NB 32        /* output columns per packed block */
#define ROW_TILE 8   /* input rows per pass over a block: 2 x 8 accumulators + loads fit 32 zmm */
/* Rows per block_rows_any call. The AVX2 variant widens a block's weights to fp32 once a call,
 * so it takes 48 (16 tiles of 3: 46 -> 48 GMAC/s a Zen2 core over 32 rows, with 8 blocks' inputs
 * widened once by blocks_rows_any; 64 was no faster); the AVX512 variants tile by ROW_TILE inside
 * a call. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define SHARE_ROWS 48
#else
#define SHARE_ROWS 32
#endif
/* Packed blocks per blocks_rows_any call where a caller has several in a row. */
#define SHARE_BLOCKS 8

#ifdef __AVX512BF16__
/* the native bf16 dot product and conversion */
#define MOED_ISA "avx512bf16"
#define AS_BH(v) ((__m512bh)(v))
#define CVTNE_BH(v) ((__m256i)_mm512_cvtneps_pbh(v))
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__)
/* AVX512 without BF16 (Skylake-SP to Ice Lake): real 512-bit code, the bf16 steps in cpu_avx512.h */
#define MOED_ISA "avx512"
#include "cpu_avx512.h"
#define CVTNE_BH(v) cvtne_bh16(v)
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* no AVX-512: every 512-bit intrinsic done on two 256-bit halves by cpu_avx2.h */
#define MOED_ISA "avx2"
#include "cpu_avx2.h"
#define AS_BH(v) (v)
#define CVTNE_BH(v) cvtne_bh16(v)
#else
#error "build with -mavx512f -mavx512bw -mavx512vl -mfma (and -mavx512bf16), or -march=x86-64-v3"
#endif

int moed_abi_version(void) { return 19; }

/* Which variant this .so is: the loader refuses one that is not the variant it asked for (a
 * cache shared by machines of different CPUs keeps each variant under its own name). */
const char *moed_isa(void) { return MOED_ISA; }

/* Whether this CPU runs this variant. Checked before any other call: code of either variant
 * may use its instructions anywhere. */
int moed_cpu_supported(void) {
    __builtin_cpu_init();
#ifdef __AVX512BF16__
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#elif defined(__AVX512F__)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
#else
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
#endif
}


/* 1 if this CPU's dot product sums as cpu_avx2.h does (per lane: acc + odd product, then + even
 * product, each rounded once), so the variants give the same bits here. The AVX2 and AVX512
 * variants are that order by construction; vdpbf16ps was measured so on Sapphire Rapids, and this checks the
 * CPU at hand on lanes whose result shows the order: acc = 1 + an odd multiple of 2^-8, products
 * +-2^16 cancelling within the pair. acc + 2^16 rounds to a multiple of 2^-7, acc - 2^16 is exact
 * (below 2^16 the spacing is 2^-8): lanes 0-7 (odd product positive) keep acc exactly only if the
 * even product came first, lanes 8-15 (odd product negative) only if the odd one did. */
int moed_dot_order_matches(void) {
#ifdef __AVX512BF16__
    bf16 a[32], b[32];
    float acc[16], got[16];
    for (int i = 0; i < 16; i++) {
        acc[i] = 1.0f + (float)(2 * i + 1) / 256.0f;
        a[2 * i] = a[2 * i + 1] = f32_to_bf16(16.0f);
        b[2 * i + 1] = f32_to_bf16(i < 8 ? 4096.0f : -4096.0f);
        b[2 * i] = b[2 * i + 1] ^ 0x8000;          /* the negative */
    }
    _mm512_storeu_ps(got, _mm512_dpbf16_ps(_mm512_loadu_ps(acc), (__m512bh)_mm512_loadu_si512(a),
                                           (__m512bh)_mm512_loadu_si512(b)));
    for (int i = 0; i < 16; i++) {
        const float want = fmaf(bf16_to_f32(a[2 * i]), bf16_to_f32(b[2 * i]),
                                fmaf(bf16_to_f32(a[2 * i + 1]), bf16_to_f32(b[2 * i + 1]), acc[i]));
        if (memcmp(&want, &got[i], 4)) return 0;
    }
#endif
    return 1;
}

static inline __m512 round_bf16_x16(__m512 v) {   /* RNE to bf16 and back, 16 lanes */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(CVTNE_BH(v)), 16));
}

static inline __m512 load_bf16_x16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* e^x for 16 lanes, within ~2 ulp of expf (what torch's vectorised exp also gives): x = n ln2 + r,
 * |r| <= ln2/2, degree-7 Taylor polynomial for e^r, times 2^n. Below -103 it returns 0. */
static inline __m512 exp_x16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* Every matmul path prefetches its weight stream PF_PAIRS k pairs (4 KB) ahead, the next
 * block's first lines at a block's end (a thread's blocks are contiguous). Without it, on the
 * Ice Lake VM under load, one row streamed lm_head's 64 MB at 8.7 GB/s with 2 threads (the
 * hardware prefetcher alone), 20 GB/s with it (AVX2); a prefetch changes no result. */
#define PF_PAIRS 32

#ifdef __AVX512BF16__
/* y[r][0..32) = x[r] . (the 32 columns of packed block wb), r < R (R <= ROW_TILE, a constant
 * after inlining so the accumulators stay in registers); x rows as bf16 pairs (uint32). */
static inline __attribute__((always_inline)) void block_rows(
        const int R, const uint32_t *x, long ldx2, const bf16 *wb, long K2, float *y, long ldy) {
    __m512 a[ROW_TILE][2];
    for (int r = 0; r < R; r++) { a[r][0] = _mm512_setzero_ps(); a[r][1] = _mm512_setzero_ps(); }
    for (long kp = 0; kp < K2; kp++) {
        _mm_prefetch((const char *)(wb + (kp + PF_PAIRS) * 2 * NB), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb + (kp + PF_PAIRS) * 2 * NB + NB), _MM_HINT_T0);
        const __m512bh w0 = AS_BH(_mm512_loadu_si512(wb + kp * 2 * NB));
        const __m512bh w1 = AS_BH(_mm512_loadu_si512(wb + kp * 2 * NB + NB));
        for (int r = 0; r < R; r++) {
            const __m512bh xb = AS_BH(_mm512_set1_epi32((int)x[r * ldx2 + kp]));
            a[r][0] = _mm512_dpbf16_ps(a[r][0], xb, w0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], xb, w1);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(y + r * ldy, a[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, a[r][1]);
    }
}
#elif defined(__AVX512F__)
/* K pairs of the inputs widened at a time (8 rows x 2 x 128 floats: 8 KB, in L1). */
#define XCHUNK 128

/* block_rows on AVX512 without BF16: the same sums in the same order as vdpbf16ps (per k pair:
 * + x_odd * w_odd, then + x_even * w_even, each an FMA). Each loaded weight vector is widened
 * once into odd/even fp32 halves and shared by the R rows (16 accumulators + 4 widened weights
 * fit the 32 zmm); the inputs are widened a chunk of k pairs at a time, so each FMA takes its
 * x operand as a broadcast from L1 ({1to16}) rather than a shuffle per row and k pair. */
static inline __attribute__((always_inline)) void block_rows(
        const int R, const uint32_t *x, long ldx2, const bf16 *wb, long K2, float *y, long ldy) {
    float xo[ROW_TILE][XCHUNK] __attribute__((aligned(64))), xe[ROW_TILE][XCHUNK] __attribute__((aligned(64)));
    __m512 a[ROW_TILE][2];
    for (int r = 0; r < R; r++) { a[r][0] = _mm512_setzero_ps(); a[r][1] = _mm512_setzero_ps(); }
    for (long c0 = 0; c0 < K2; c0 += XCHUNK) {
        const long cn = K2 - c0 < XCHUNK ? K2 - c0 : XCHUNK;
        for (int r = 0; r < R; r++)
            for (long kp = 0; kp < cn; kp += 16) {
                const __mmask16 m = cn - kp >= 16 ? 0xffff : (__mmask16)((1u << (cn - kp)) - 1);
                const __m512i u = _mm512_maskz_loadu_epi32(m, x + r * ldx2 + c0 + kp);
                _mm512_store_ps(xo[r] + kp, bf16_odd_x16(u));
                _mm512_store_ps(xe[r] + kp, bf16_even_x16(u));
            }
        const bf16 *wc = wb + c0 * 2 * NB;
        for (long kp = 0; kp < cn; kp++) {
            _mm_prefetch((const char *)(wc + (kp + PF_PAIRS) * 2 * NB), _MM_HINT_T0);
            _mm_prefetch((const char *)(wc + (kp + PF_PAIRS) * 2 * NB + NB), _MM_HINT_T0);
            const __m512i w0 = _mm512_loadu_si512(wc + kp * 2 * NB), w1 = _mm512_loadu_si512(wc + kp * 2 * NB + NB);
            const __m512 w0o = bf16_odd_x16(w0), w0e = bf16_even_x16(w0);
            const __m512 w1o = bf16_odd_x16(w1), w1e = bf16_even_x16(w1);
            for (int r = 0; r < R; r++) {
                const __m512 xro = _mm512_set1_ps(xo[r][kp]), xre = _mm512_set1_ps(xe[r][kp]);
                a[r][0] = dpbf16_wide(a[r][0], xro, xre, w0o, w0e);
                a[r][1] = dpbf16_wide(a[r][1], xro, xre, w1o, w1e);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(y + r * ldy, a[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, a[r][1]);
    }
}
#else
/* block_rows on AVX2: the same sums in the same order (per k pair: + x_odd * w_odd, then
 * + x_even * w_even, each an FMA, as vdpbf16ps), for 1 or 2 rows (decode: 1), the inputs
 * widened as they are read. Row grouping changes no bits (rows are independent). */
static inline __attribute__((always_inline)) void block_rows2(
        const int R, const uint32_t *x, long ldx2, const bf16 *wb, long K2, float *y, long ldy) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    __m256 a[2][4];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) a[r][q] = _mm256_setzero_ps();
    for (long kp = 0; kp < K2; kp++) {
        __m256 xo[2], xe[2];
        for (int r = 0; r < R; r++) {
            const __m256i xv = _mm256_set1_epi32((int)x[r * ldx2 + kp]);
            xo[r] = _mm256_castsi256_ps(_mm256_and_si256(xv, hi));
            xe[r] = _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16));
        }
        for (int q = 0; q < 4; q++) {    /* columns 8q..8q+7: 8 bf16 pairs */
            if (!(q & 1)) _mm_prefetch((const char *)(wb + (kp + PF_PAIRS) * 2 * NB + 16 * q), _MM_HINT_T0);
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wb + kp * 2 * NB + 16 * q));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
            for (int r = 0; r < R; r++) a[r][q] = _mm256_fmadd_ps(xe[r], we, _mm256_fmadd_ps(xo[r], wo, a[r][q]));
        }
    }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) _mm256_storeu_ps(y + r * ldy + 8 * q, a[r][q]);
}

/* K pairs of the inputs widened at a time by block_rows3 (2 rows x 2 x 128 floats: 2 KB). */
#define XCHUNK 128

/* block_rows2 for 2 rows: the inputs are widened to fp32 odd/even a chunk of k pairs at a time,
 * then broadcast straight from memory, so the vector ALUs do FMAs rather than re-widening inputs
 * every k pair. Same sums, same order. */
static inline __attribute__((always_inline)) void block_rows3(
        const int R, const uint32_t *x, long ldx2, const bf16 *wb, long K2, float *y, long ldy) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    uint32_t xw[2][2 * XCHUNK] __attribute__((aligned(32)));      /* per k pair: odd, even (fp32 bits) */
    __m256 a[2][4];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) a[r][q] = _mm256_setzero_ps();
    for (long c0 = 0; c0 < K2; c0 += XCHUNK) {
        const long cn = K2 - c0 < XCHUNK ? K2 - c0 : XCHUNK;
        for (int r = 0; r < R; r++)
            for (long kp = 0; kp < cn; kp++) {
                const uint32_t u = x[r * ldx2 + c0 + kp];
                xw[r][2 * kp] = u & 0xffff0000u;
                xw[r][2 * kp + 1] = u << 16;
            }
        const bf16 *wc = wb + c0 * 2 * NB;
        for (long kp = 0; kp < cn; kp++) {
            for (int q = 0; q < 4; q++) {
                if (!(q & 1)) _mm_prefetch((const char *)(wc + (kp + PF_PAIRS) * 2 * NB + 16 * q), _MM_HINT_T0);
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wc + kp * 2 * NB + 16 * q));
                const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
                const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
                for (int r = 0; r < R; r++) {
                    a[r][q] = _mm256_fmadd_ps(_mm256_broadcast_ss((const float *)&xw[r][2 * kp]), wo, a[r][q]);
                    a[r][q] = _mm256_fmadd_ps(_mm256_broadcast_ss((const float *)&xw[r][2 * kp + 1]), we, a[r][q]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) _mm256_storeu_ps(y + r * ldy + 8 * q, a[r][q]);
}

/* The AVX2 path for 3 or more rows: the block's weights are widened to fp32 a panel of KPANEL k
 * pairs at a time, once for all the rows of the call (up to SHARE_ROWS), the rows' inputs with
 * them; then tiles of up to 3 rows x 32 columns run over the panel, their broadcasts held in
 * registers and the widened weights streamed from L1 (12 accumulators + 3 broadcasts + 1 weight:
 * the 16 ymm), while the next panel's raw weights are prefetched (without it the widening
 * pass waited for each line, and 8 rows took the time of 1 plus the FMAs). Per k pair a 3-row tile does 8 weight loads and 6 broadcasts for 24 FMAs and no
 * widening. block_rows3 widens the raw weight per tile and broadcasts per FMA; it served every
 * many-row tile before (3 rows: 28 loads and 8 shifts/ands per 24 FMAs, load-bound: 1.42x the
 * avx512 variant's time at 8 rows on Ice Lake) and still serves 2 rows, where the widening pass
 * costs more than it saves (1.6-1.9x block_rows3's time with the weight in cache).
 * Each accumulator sums exactly as block_rows2 does (+ x_odd * w_odd, then + x_even * w_even
 * per k pair, k ascending), parked in y between panels (an fp32 store and load: exact), so the
 * bits are the same for any row count. Scratch: 16 KB of weights + 16 KB of inputs on the stack. */
#define KPANEL 64      /* k pairs per panel: 64 x 32 columns x 2 fp32 = 16 KB, in L1 */

/* Rows [0, M) (M <= 3) x 32 columns over one panel of cn k pairs; xo, xe [rows][KPANEL] the
 * widened inputs, pw [cn][64] the widened weights (odd k of the 32 columns, then even k). */
static inline __attribute__((always_inline)) void panel_rows(
        const int M, const float (*xo)[KPANEL], const float (*xe)[KPANEL], const float *pw, long cn,
        float *y, long ldy, const int first) {
    __m256 a[3][4];
    for (int r = 0; r < M; r++)
        for (int q = 0; q < 4; q++) a[r][q] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy + 8 * q);
    for (long kp = 0; kp < cn; kp++) {
        const float *w = pw + kp * 2 * NB;
        __m256 b[3];
        for (int r = 0; r < M; r++) b[r] = _mm256_broadcast_ss(&xo[r][kp]);
        for (int q = 0; q < 4; q++) {
            const __m256 wv = _mm256_load_ps(w + 8 * q);
            for (int r = 0; r < M; r++) a[r][q] = _mm256_fmadd_ps(b[r], wv, a[r][q]);
        }
        for (int r = 0; r < M; r++) b[r] = _mm256_broadcast_ss(&xe[r][kp]);
        for (int q = 0; q < 4; q++) {
            const __m256 wv = _mm256_load_ps(w + NB + 8 * q);
            for (int r = 0; r < M; r++) a[r][q] = _mm256_fmadd_ps(b[r], wv, a[r][q]);
        }
    }
    for (int r = 0; r < M; r++)
        for (int q = 0; q < 4; q++) _mm256_storeu_ps(y + r * ldy + 8 * q, a[r][q]);
}

/* y[r][j*32 .. j*32+32) = x[r] . block j for R rows (R <= SHARE_ROWS) and nb blocks, block j at
 * wb + j * bstride: per panel the rows' inputs are widened once for all nb blocks (once a block
 * cost ~7% of a 32-row call on Zen2), then each block's weights, then the tiles. */
static void blocks_rows_any(long R, const uint32_t *x, long ldx2, const bf16 *wb, long nb, long bstride, long K2,
                            float *y, long ldy) {
    if (R <= 2) {                       /* decode: memory-bound, no widening pass */
        for (long j = 0; j < nb; j++) {
            if (R == 1) block_rows2(1, x, ldx2, wb + j * bstride, K2, y + j * NB, ldy);
            else block_rows3(2, x, ldx2, wb + j * bstride, K2, y + j * NB, ldy);
        }
        return;
    }
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    float pw[KPANEL * 2 * NB] __attribute__((aligned(32)));
    float xo[SHARE_ROWS][KPANEL] __attribute__((aligned(32))), xe[SHARE_ROWS][KPANEL] __attribute__((aligned(32)));
    for (long c0 = 0; c0 < K2; c0 += KPANEL) {
        const long cn = K2 - c0 < KPANEL ? K2 - c0 : KPANEL;
        for (long r = 0; r < R; r++) {
            const uint32_t *xr = x + r * ldx2 + c0;
            long kp = 0;
            for (; kp + 8 <= cn; kp += 8) {
                const __m256i u = _mm256_loadu_si256((const __m256i *)(xr + kp));
                _mm256_store_ps(xo[r] + kp, _mm256_castsi256_ps(_mm256_and_si256(u, hi)));
                _mm256_store_ps(xe[r] + kp, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
            }
            for (; kp < cn; kp++) {
                const uint32_t o = xr[kp] & 0xffff0000u, e = xr[kp] << 16;
                memcpy(&xo[r][kp], &o, 4);
                memcpy(&xe[r][kp], &e, 4);
            }
        }
        for (long j = 0; j < nb; j++) {
            const bf16 *wc = wb + j * bstride + c0 * 2 * NB;
            float *yj = y + j * NB;
            for (long kp = 0; kp < cn; kp++)
                for (int q = 0; q < 4; q++) {
                    if (!(q & 1)) _mm_prefetch((const char *)(wc + (kp + PF_PAIRS) * 2 * NB + 16 * q), _MM_HINT_T0);
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(wc + kp * 2 * NB + 16 * q));
                    _mm256_store_ps(pw + kp * 2 * NB + 8 * q, _mm256_castsi256_ps(_mm256_and_si256(w, hi)));
                    _mm256_store_ps(pw + kp * 2 * NB + NB + 8 * q, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
                }
            long r0 = 0;   /* tiles of 3 rows, the last two 2 + 2 where 3 + 1 would be left (R >= 3) */
            for (; R - r0 >= 3 && R - r0 != 4; r0 += 3) panel_rows(3, xo + r0, xe + r0, pw, cn, yj + r0 * ldy, ldy, c0 == 0);
            for (; r0 < R; r0 += 2) panel_rows(2, xo + r0, xe + r0, pw, cn, yj + r0 * ldy, ldy, c0 == 0);
        }
    }
}

/* y[r][0..32) = x[r] . block wb for R rows, R <= SHARE_ROWS. */
static inline void block_rows_any(long R, const uint32_t *x, long ldx2, const bf16 *wb, long K2, float *y, long ldy) {
    blocks_rows_any(R, x, ldx2, wb, 1, 0, K2, y, ldy);
}
#endif

static inline long nblocks(long n) { return (n + NB - 1) / NB; }

/* This thread's share [*lo, *hi) of n items (blocks or rows). */
static inline void split(long n, int tid, int nt, long *lo, long *hi) {
    const long per = n / nt, extra = n % nt;
    *lo = tid * per + (tid < extra ? tid : extra);
    *hi = *lo + per + (tid < extra);
}

/* Columns [*lo, *hi) of n that this thread's share of the packed blocks covers. */
static inline void split_cols(long n, int tid, int nt, long *lo, long *hi) {
    long b0, b1;
    split(nblocks(n), tid, nt, &b0, &b1);
    *lo = b0 * NB < n ? b0 * NB : n;
    *hi = b1 * NB < n ? b1 * NB : n;
}

static inline __mmask16 lanes(long left) {
    return left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

static inline __m512 bf16x16_or_zero(const bf16 *p, __mmask16 m) {   /* masked load */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline void store_bf16x16(bf16 *p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, CVTNE_BH(v));
}

/* f32 -> bf16 for 16 lanes exactly as f32_to_bf16 (round to nearest even, denormals kept, NaN
 * quieted), in 32-bit lanes; vcvtneps2bf16 would flush denormals. */
static inline __m512i bf16_bits_x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

static inline __m512 round_bf16_exact_x16(__m512 v) {   /* round_bf16, 16 lanes */
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits_x16(v), 16));
}

static inline void store_bf16_exact_x16(bf16 *p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits_x16(v)));
}

#ifdef __AVX512F__
/* y[r][0..32) = x[r] . block wb for a run-time row count R <= ROW_TILE (block_rows needs a
 * constant R to keep its accumulators in registers). */
static inline void block_rows_tile(long R, const uint32_t *x, long ldx2, const bf16 *wb, long K2, float *y, long ldy) {
    switch (R) {
        case 1: block_rows(1, x, ldx2, wb, K2, y, ldy); break;
        case 2: block_rows(2, x, ldx2, wb, K2, y, ldy); break;
        case 3: block_rows(3, x, ldx2, wb, K2, y, ldy); break;
        case 4: block_rows(4, x, ldx2, wb, K2, y, ldy); break;
        case 5: block_rows(5, x, ldx2, wb, K2, y, ldy); break;
        case 6: block_rows(6, x, ldx2, wb, K2, y, ldy); break;
        case 7: block_rows(7, x, ldx2, wb, K2, y, ldy); break;
        default: block_rows(8, x, ldx2, wb, K2, y, ldy); break;
    }
}

/* The same for R <= SHARE_ROWS rows, in tiles of ROW_TILE. */
static inline void block_rows_any(long R, const uint32_t *x, long ldx2, const bf16 *wb, long K2, float *y, long ldy) {
    for (long r0 = 0; r0 < R; r0 += ROW_TILE)   /* the block stays in L1/L2 across tiles */
        block_rows_tile(R - r0 < ROW_TILE ? R - r0 : ROW_TILE, x + r0 * ldx2, ldx2, wb, K2, y + r0 * ldy, ldy);
}

/* ... and over nb blocks, block j at wb + j * bstride (nothing is widened here to share). */
static inline void blocks_rows_any(long R, const uint32_t *x, long ldx2, const bf16 *wb, long nb, long bstride, long K2,
                                   float *y, long ldy) {
    for (long j = 0; j < nb; j++) block_rows_any(R, x, ldx2, wb + j * bstride, K2, y + j * NB, ldy);
}
#endif

/* Input rows per pass over a thread's blocks: for many rows (prefill) the inputs are taken in
 * chunks of ~256 KB, which stay in L2 while every block of the weight streams past them; one
 * pass over all rows would re-read them from L3 or memory once per 32 columns. Any row tiling
 * gives the same bits: a row's dot products never depend on the other rows. */
static inline long row_chunk(long K) {
    const long r = (128L * 1024) / (K > 0 ? K : 1) / ROW_TILE * ROW_TILE;
    return r < 4 * ROW_TILE ? 4 * ROW_TILE : r;
}

/* y[r][b*32 .. b*32+32) for packed blocks b in [b0, b1) and all R rows of x [R][ldx]
 * (in chunks of row_chunk(K) rows, each in tiles of SHARE_ROWS rows). y [R][ldy], ldy >= 32 * b1. */
static void gemm_packed(const bf16 *x, long R, long ldx, const bf16 *wp, long K, long b0, long b1,
                        float *y, long ldy) {
    const long K2 = K / 2, rc = row_chunk(K);
    for (long c0 = 0; c0 < R; c0 += rc) {
        const long c1 = R - c0 < rc ? R : c0 + rc;
        for (long b = b0; b < b1; b += SHARE_BLOCKS) {
            const long nb = b1 - b < SHARE_BLOCKS ? b1 - b : SHARE_BLOCKS;
            for (long r0 = c0; r0 < c1; r0 += SHARE_ROWS)   /* the blocks stay in L2 across tiles */
                blocks_rows_any(c1 - r0 < SHARE_ROWS ? c1 - r0 : SHARE_ROWS, (const uint32_t *)(x + r0 * ldx), ldx / 2,
                                wp + b * NB * K, nb, NB * K, K2, y + r0 * ldy + b * NB, ldy);
        }
    }
}

/* y[r][0..32) = x[r] . packed block wb (K/2 pairs) for R <= ROW_TILE rows of x [R][ldx] (bf16,
 * ldx even), unrounded: cpu_quant.c's many-row path packs one block of a quantized weight at a
 * time and streams every row through it here, so its sums are this kernel's, variant for variant. */
void moed_block_rows_bf16(const bf16 *x, long R, long ldx, const bf16 *wb, long K, float *y, long ldy) {
    block_rows_any(R, (const uint32_t *)x, ldx / 2, wb, K / 2, y, ldy);
}

/* The same for nb blocks at once, block j at wb + j * bstride, its columns at y + 32 j. */
void moed_blocks_rows_bf16(const bf16 *x, long R, long ldx, const bf16 *wb, long nb, long bstride, long K, float *y,
                           long ldy) {
    blocks_rows_any(R, (const uint32_t *)x, ldx / 2, wb, nb, bstride, K / 2, y, ldy);
}

/* out[R][N] (bf16) = x[R][K] @ W^T (+ bias[N]), W packed P32 from [N][K]; fp32 accumulation,
 * bias added in fp32, rounded once (as torch's addmm and oneDNN's fused bias do). Each tile of
 * up to SHARE_ROWS rows x SHARE_BLOCKS blocks is rounded into out as soon as it is computed (no
 * [R][N] fp32 scratch). */
int moed_linear_bf16(const bf16 *x, long R, long K, const bf16 *wp, long N, const bf16 *bias,
                     bf16 *out, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const long K2 = K / 2, rc = row_chunk(K), ldt = SHARE_BLOCKS * NB;
        float tile[SHARE_ROWS * SHARE_BLOCKS * NB] __attribute__((aligned(64)));
        long b0, b1;
        split(nblocks(N), tid, nt, &b0, &b1);
        for (long c0 = 0; c0 < R; c0 += rc) {
            const long c1 = R - c0 < rc ? R : c0 + rc;
            for (long bg = b0; bg < b1; bg += SHARE_BLOCKS) {     /* up to SHARE_BLOCKS blocks a call */
                const long nb = b1 - bg < SHARE_BLOCKS ? b1 - bg : SHARE_BLOCKS;
                for (long r0 = c0; r0 < c1; r0 += SHARE_ROWS) {
                    const long rn = c1 - r0 < SHARE_ROWS ? c1 - r0 : SHARE_ROWS;
                    blocks_rows_any(rn, (const uint32_t *)(x + r0 * K), K / 2, wp + bg * NB * K, nb, NB * K, K2, tile, ldt);
                    for (long b = bg; b < bg + nb; b++) {
                        const long n0 = b * NB;
                        const __mmask16 m0 = lanes(N - n0), m1 = lanes(N - n0 - 16);
                        const __m512 bias0 = bias ? bf16x16_or_zero(bias + n0, m0) : _mm512_setzero_ps();
                        const __m512 bias1 = bias ? bf16x16_or_zero(bias + n0 + 16, m1) : _mm512_setzero_ps();
                        for (long r = 0; r < rn; r++) {
                            bf16 *o = out + (r0 + r) * N + n0;
                            const float *t = tile + r * ldt + (b - bg) * NB;
                            store_bf16_exact_x16(o, m0, _mm512_add_ps(_mm512_load_ps(t), bias0));
                            store_bf16_exact_x16(o + 16, m1, _mm512_add_ps(_mm512_load_ps(t + 16), bias1));
                        }
                    }
                }
            }
        }
    }
    return 0;
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* act[i] = bf16(bf16(silu(g[i])) * u[i]) with g = bf16(gu[i]), u = bf16(gu[I + i]): torch's bf16
 * F.silu(g) * u. */
static void silu_mul_row(const float *gu, long I, bf16 *act) {
    long i = 0;
    for (; i + 16 <= I; i += 16) {
        const __m512 g = round_bf16_x16(_mm512_loadu_ps(gu + i)), u = round_bf16_x16(_mm512_loadu_ps(gu + I + i));
        const __m512 sg = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp_x16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm256_storeu_si256((__m256i *)(act + i), CVTNE_BH(_mm512_mul_ps(round_bf16_x16(sg), u)));
    }
    for (; i < I; i++) {
        const float g = round_bf16(gu[i]), u = round_bf16(gu[I + i]);
        act[i] = f32_to_bf16(round_bf16(silu(g)) * u);
    }
}

/* silu_mul_row for cpu_quant.c's fused quantized MoE (moed_moe_q): one activation rounding for
 * every bf16 MoE path, not a copy that could drift. */
void moed_silu_mul_bf16_row(const float *gu, long I, bf16 *act) { silu_mul_row(gu, I, act); }

/* Router for T tokens: softmax over E logits (rounded to bf16 first, as a bf16 router matmul
 * leaves them), top-k by descending probability (lower id first on ties, as the loop finds
 * them), optionally renormalised; weights end rounded to bf16 as transformers casts them. */
static void route(const float *logits, long ldl, long T, long E, long k, int norm_topk, long *ids, float *wts,
                  int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T >= 64)
    for (long t = 0; t < T; t++) {
        float p[E];    /* a VLA: per token, freed each iteration */
        const float *l = logits + t * ldl;
        float mx = -INFINITY, sum = 0.f;
        for (long e = 0; e < E; e++) { p[e] = round_bf16(l[e]); if (p[e] > mx) mx = p[e]; }
        for (long e = 0; e < E; e++) { p[e] = expf(p[e] - mx); sum += p[e]; }
        for (long e = 0; e < E; e++) p[e] /= sum;
        float tot = 0.f;
        for (long j = 0; j < k; j++) {
            long best = -1;
            for (long e = 0; e < E; e++) {
                int taken = 0;
                for (long q = 0; q < j; q++) taken |= ids[t * k + q] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            ids[t * k + j] = best;
            wts[t * k + j] = p[best];
            tot += p[best];
        }
        for (long j = 0; j < k; j++)
            wts[t * k + j] = round_bf16(norm_topk ? wts[t * k + j] / tot : wts[t * k + j]);
    }
}

/* Logical expert -> physical slot for each of the rows (t, j) in flat order t*k + j: the n-th
 * row routed to expert e (n counted per expert, in flat order) goes to replica
 * (n + offset) % nrep[e], so every replica gets floor or ceil of e's rows / replicas (the flat
 * index modulo replicas put all of an expert's rows on one replica when it was mostly some
 * token's j-th choice); offset (the router's call count) rotates which replica takes the extra
 * row. The same split as moed/model/experts_route.py. load [E] (may be NULL) counts rows per
 * logical expert. Returns 0; -1 out of memory; -2 a bad expert map. */
static int map_slots(const long *ids, long rows, long E, const int64_t *l2p, long max_rep,
                     const int64_t *nrep, long offset, long P, int64_t *phys, int64_t *load) {
    long *seen = calloc(E + 1, sizeof(long));
    if (!seen) return -1;
    int rc = 0;
    for (long s = 0; s < rows; s++) {
        long e = ids[s];
        if (e < 0 || e >= E) { rc = -2; break; }
        long n = nrep[e];
        if (n < 1 || n > max_rep) { rc = -2; break; }
        long p = l2p[e * max_rep + (seen[e]++ + offset) % n];
        if (p < 0 || p >= P) { rc = -2; break; }
        phys[s] = p;
        if (load) load[e]++;
    }
    free(seen);
    return rc;
}

/* Rows of one expert taken through gate_up, the activation and down together: enough that each
 * weight block read from memory serves many rows, few enough that the chunk's inputs, gate_up
 * outputs (fp32) and activations stay in L2 (~0.5 MB at H = 1024, I = 512). */
#define EXPERT_CHUNK 64

/* Rows per chunk for an expert with n rows: equal chunks of at most EXPERT_CHUNK (a multiple of
 * ROW_TILE), so no expert ends on a near-empty chunk that reads its whole weight for a few rows. */
static inline long chunk_rows(long n) {
    const long chunks = (n + EXPERT_CHUNK - 1) / EXPERT_CHUNK;
    return ((n + chunks - 1) / chunks + ROW_TILE - 1) / ROW_TILE * ROW_TILE;
}

/* Scratch of one expert chunk: gathered inputs [EXPERT_CHUNK][H], gate_up outputs (fp32,
 * [EXPERT_CHUNK][ldg]) and activations [EXPERT_CHUNK][I]. */
typedef struct { bf16 *xs; float *gu; bf16 *act; } ExpertScratch;

/* Where row s's expert output y = bf16(down(...)) [H] goes; exactly one of acc, prod, out set:
 *   acc:  acc[src[s]][h] += bf16(y * wts[s]), fp32 rows of ldh (team mode only: each thread
 *         owns its down blocks' columns of every token);
 *   prod: prod[s][h] = bf16(y * wts[s]) (a token's k products are summed afterwards);
 *   out:  out[s][h] = y, or out[src[s]][h] = y where src is set (moed_experts_rows_bf16). */
typedef struct { float *acc; bf16 *prod; bf16 *out; const float *wts; const long *src; } ExpertSink;

/* Rows [s0, s0 + cn) of one expert (input row s at x + (src ? src[s] : s) * H) through gate_up
 * (wgu), silu(gate) * up and down (wdn) into the sink. team: the calling team shares the chunk
 * (columns of each matmul and rows of the activation split between threads, a barrier between
 * phases); else the calling thread does all of it. */
static void expert_chunk(const bf16 *x, const long *src, long s0, long cn, const bf16 *wgu, const bf16 *wdn,
                         long H, long I, const ExpertScratch *sc, const ExpertSink *sink, int team) {
    const int tid = team ? omp_get_thread_num() : 0, nt = team ? omp_get_num_threads() : 1;
    const long ldg = nblocks(2 * I) * NB, ldh = nblocks(H) * NB, ldt = SHARE_BLOCKS * NB;
    float tile[SHARE_ROWS * SHARE_BLOCKS * NB] __attribute__((aligned(64)));
    long lo, hi, b0, b1;
    const bf16 *xin = x + s0 * H;
    if (src) {                              /* gather the chunk's token rows */
        split(cn, tid, nt, &lo, &hi);
        for (long r = lo; r < hi; r++) memcpy(sc->xs + r * H, x + src[s0 + r] * H, sizeof(bf16) * H);
        xin = sc->xs;
        if (team) {
#pragma omp barrier
        }
    }
    split(nblocks(2 * I), tid, nt, &b0, &b1);
    gemm_packed(xin, cn, H, wgu, H, b0, b1, sc->gu, ldg);
    if (team) {
#pragma omp barrier
    }
    split(cn, tid, nt, &lo, &hi);           /* activation: rows split, 16 lanes at a time */
    for (long r = lo; r < hi; r++) silu_mul_row(sc->gu + r * ldg, I, sc->act + r * I);
    if (team) {
#pragma omp barrier
    }
    /* No barrier after down: the next chunk's gather and gate_up write xs and gu, which down
     * does not read, and its activation comes after two more barriers. */
    split(nblocks(H), tid, nt, &b0, &b1);
    for (long bg = b0; bg < b1; bg += SHARE_BLOCKS) {       /* up to SHARE_BLOCKS blocks a call */
        const long nb = b1 - bg < SHARE_BLOCKS ? b1 - bg : SHARE_BLOCKS;
        for (long r0 = 0; r0 < cn; r0 += SHARE_ROWS) {
            const long rn = cn - r0 < SHARE_ROWS ? cn - r0 : SHARE_ROWS;
            blocks_rows_any(rn, (const uint32_t *)(sc->act + r0 * I), I / 2, wdn + bg * NB * I, nb, NB * I, I / 2,
                            tile, ldt);
            for (long b = bg; b < bg + nb; b++) {
                const long h0 = b * NB;
                const __mmask16 m0 = lanes(H - h0), m1 = lanes(H - h0 - 16);
                for (long r = 0; r < rn; r++) {
                    const long s = s0 + r0 + r;
                    const float *t = tile + r * ldt + (b - bg) * NB;
                    __m512 y0 = round_bf16_exact_x16(_mm512_load_ps(t));
                    __m512 y1 = round_bf16_exact_x16(_mm512_load_ps(t + 16));
                    if (sink->out) {            /* row s, or src[s] where the caller has its rows */
                        bf16 *o = sink->out + (sink->src ? sink->src[s] : s) * H;
                        store_bf16_exact_x16(o + h0, m0, y0);    /* y is bf16 already */
                        store_bf16_exact_x16(o + h0 + 16, m1, y1);
                        continue;
                    }
                    const __m512 w = _mm512_set1_ps(sink->wts[s]);
                    y0 = round_bf16_exact_x16(_mm512_mul_ps(y0, w));
                    y1 = round_bf16_exact_x16(_mm512_mul_ps(y1, w));
                    if (sink->prod) {
                        store_bf16_exact_x16(sink->prod + s * H + h0, m0, y0);
                        store_bf16_exact_x16(sink->prod + s * H + h0 + 16, m1, y1);
                    } else {                        /* padded columns: zero weights, never read */
                        float *a = sink->acc + sink->src[s] * ldh + h0;
                        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), y0));
                        _mm512_storeu_ps(a + 16, _mm512_add_ps(_mm512_loadu_ps(a + 16), y1));
                    }
                }
            }
        }
    }
}

/* How the experts' rows are shared out; both give the same bits. Few rows per expert (decode):
 * the whole team works on each chunk in turn (memory-bound work: every core streams a part of
 * each weight). Many rows (prefill): whole chunks are handed out, one thread each, with no
 * barrier between them (on shared cores a barrier per phase lets one preempted thread stall
 * the team); the products then go to a buffer and each token's k are summed at the end. */
static int by_chunk(long rows, long touched, long chunks, int nthreads) {
    return nthreads > 1 && chunks >= 4L * nthreads && rows >= 16 * touched;
}

/* The chunks of every expert with rows, in slot order: expert item_e[i], first row item_s[i],
 * item_n[i] rows. Returns their number; *touched: experts with rows; *largest: most rows in one. */
static long list_chunks(const long *count, long P, long *item_e, long *item_s, long *item_n, long *touched,
                        long *largest) {
    long n_items = 0;
    *touched = *largest = 0;
    for (long e = 0; e < P; e++) {
        const long n = count[e + 1] - count[e];
        if (n == 0) continue;
        ++*touched;
        const long per = chunk_rows(n);
        for (long s0 = count[e]; s0 < count[e + 1]; s0 += per, n_items++) {
            item_e[n_items] = e;
            item_s[n_items] = s0;
            item_n[n_items] = count[e + 1] - s0 < per ? count[e + 1] - s0 : per;
            if (item_n[n_items] > *largest) *largest = item_n[n_items];
        }
    }
    return n_items;
}

static void free_scratch(ExpertScratch *sc, int n) {
    for (int i = 0; sc && i < n; i++) { free(sc[i].xs); free(sc[i].gu); free(sc[i].act); }
    free(sc);
}

/* n sets of scratch for chunks of up to `rows` rows (sized to the batch: a decode step's few
 * rows stay below malloc's mmap threshold, so no call maps and faults in fresh pages). */
static ExpertScratch *alloc_scratch(int n, long rows, long H, long I, int gather) {
    ExpertScratch *sc = calloc(n, sizeof(ExpertScratch));
    if (!sc) return NULL;
    for (int i = 0; i < n; i++) {
        sc[i].xs = gather ? malloc(sizeof(bf16) * rows * H) : NULL;
        sc[i].gu = malloc(sizeof(float) * rows * nblocks(2 * I) * NB);
        sc[i].act = malloc(sizeof(bf16) * rows * I);
        if ((gather && !sc[i].xs) || !sc[i].gu || !sc[i].act) { free_scratch(sc, n); return NULL; }
    }
    return sc;
}

/* All experts' rows (the chunks list_chunks made) into the sink; the team splits them as
 * by_chunk said (chunked). Every thread of the team calls it. */
static void expert_rows(const bf16 *x, const long *src, long H, long I, const bf16 *gate_up, const bf16 *down,
                        const long *item_e, const long *item_s, const long *item_n, long n_items, int chunked,
                        ExpertScratch *sc, const ExpertSink *sink) {
    const long gu_stride = nblocks(2 * I) * NB * H, down_stride = nblocks(H) * NB * I;   /* per expert */
    if (chunked) {
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < n_items; i++)
            expert_chunk(x, src, item_s[i], item_n[i], gate_up + item_e[i] * gu_stride, down + item_e[i] * down_stride,
                         H, I, &sc[omp_get_thread_num()], sink, 0);
    } else {
        for (long i = 0; i < n_items; i++)
            expert_chunk(x, src, item_s[i], item_n[i], gate_up + item_e[i] * gu_stride, down + item_e[i] * down_stride,
                         H, I, &sc[0], sink, 1);
    }
}

/* Router logits [T][ldl] for x [T][H]: rows split between threads when there are enough (E is
 * often one or two blocks of 32), else blocks. Either way the same bits. One block of few rows
 * (decode with E <= 32) would leave the other threads idle: no parallel region then, which
 * spares the step a fork and join per layer. */
static void router_logits(const bf16 *x, long T, long H, const bf16 *router, long E, float *logits, long ldl, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (T >= ROW_TILE * nthreads || nblocks(E) > 1)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        long lo, hi;
        if (T >= ROW_TILE * nt) {
            split(T, tid, nt, &lo, &hi);
            gemm_packed(x + lo * H, hi - lo, H, router, H, 0, nblocks(E), logits + lo * ldl, ldl);
        } else {
            split(nblocks(E), tid, nt, &lo, &hi);
            gemm_packed(x, T, H, router, H, lo, hi, logits, ldl);
        }
    }
}

/* A whole MoE block (router + routed experts) in one call, for any number of tokens:
 *   out[t] = sum_j w[t][j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = phys(expert[t][j])
 * x [T][H]; out [T][H]; weights packed P32 (H and I even): router from [E][H], each expert's
 * gate_up from [2I][H] (gate rows first), its down from [H][I].
 * Logical expert ids go to physical slots through l2p [E][max_rep] (map_slots: each expert's
 * rows numbered, plus offset, modulo its replicas, as the torch path); load [E] (may be NULL)
 * counts tokens per logical expert. Each expert's weights are read once per chunk of its rows.
 * Rounding follows a bf16 torch run: the router logits, gate/up, silu(g), silu(g)*u, the down
 * output and its product with the weight are each rounded to bf16; a token's k products are
 * summed in fp32 in ascending slot order and rounded once (torch rounds after each add: results
 * at most 1 ulp apart). Returns 0; -1 out of memory; -2 a bad expert map. */
int moed_moe_bf16(const bf16 *x, long T, long H, const bf16 *router, long E, long k, int norm_topk,
                  const int64_t *l2p, long max_rep, const int64_t *nrep, long offset, int64_t *load,
                  const bf16 *gate_up, const bf16 *down, long P, long I, bf16 *out, int nthreads) {
    const long rows = T * k, ldl = nblocks(E) * NB, ldh = nblocks(H) * NB;
    float *logits = malloc(sizeof(float) * (T * ldl + 1));
    long *ids = malloc(sizeof(long) * (rows + 1)), *phys = malloc(sizeof(long) * (rows + 1));
    float *wts = malloc(sizeof(float) * (rows + 1)), *sorted_w = malloc(sizeof(float) * (rows + 1));
    long *count = calloc(P + 1, sizeof(long)), *fill = malloc(sizeof(long) * (P + 1));
    long *token = malloc(sizeof(long) * (rows + 1));   /* token of each row, rows sorted by slot */
    long *pos = malloc(sizeof(long) * (rows + 1));     /* sorted position of row t * k + j */
    long *items = malloc(sizeof(long) * 3 * (rows + 1));
    float *acc = NULL;
    bf16 *prod = NULL, *xs = NULL;
    ExpertScratch *sc = NULL;
    int rc = 0, chunked = 0;
    long n_items = 0, touched = 0, largest = 0;
    if (!logits || !ids || !phys || !wts || !sorted_w || !count || !fill || !token || !pos || !items) {
        rc = -1;
        goto done;
    }
    router_logits(x, T, H, router, E, logits, ldl, nthreads);
    route(logits, ldl, T, E, k, norm_topk, ids, wts, nthreads);
    if ((rc = map_slots(ids, rows, E, l2p, max_rep, nrep, offset, P, (int64_t *)phys, load))) goto done;
    for (long s = 0; s < rows; s++) count[phys[s] + 1]++;
    for (long e = 0; e < P; e++) count[e + 1] += count[e];   /* count[e] = first row of slot e */
    memcpy(fill, count, sizeof(long) * P);
    for (long s = 0; s < rows; s++) {
        const long i = fill[phys[s]]++;
        token[i] = s / k;
        sorted_w[i] = wts[s];
        pos[s] = i;
    }
    n_items = list_chunks(count, P, items, items + rows + 1, items + 2 * (rows + 1), &touched, &largest);
    chunked = by_chunk(rows, touched, n_items, nthreads);
    /* Shared chunks (few rows): the rows are gathered once, here, rather than per chunk behind a
     * barrier; handed-out chunks: each thread gathers its own. */
    sc = alloc_scratch(chunked ? nthreads : 1, largest + 1, H, I, chunked);
    if (chunked) prod = malloc(sizeof(bf16) * (rows * H + 1));
    else acc = calloc(T * ldh + 1, sizeof(float)), xs = malloc(sizeof(bf16) * (rows * H + 1));
    if (!sc || (chunked ? !prod : (!acc || !xs))) { rc = -1; goto done; }
    if (!chunked)
        for (long i = 0; i < rows; i++) memcpy(xs + i * H, x + token[i] * H, sizeof(bf16) * H);
    const ExpertSink sink = {acc, prod, NULL, sorted_w, token};
#pragma omp parallel num_threads(nthreads)
    {
        expert_rows(chunked ? x : xs, chunked ? token : NULL, H, I, gate_up, down, items,
                    items + rows + 1, items + 2 * (rows + 1), n_items, chunked, sc, &sink);
#pragma omp barrier
        long lo, hi;
        split(T, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (long t = lo; t < hi; t++) {
            if (!chunked) {
                for (long h = 0; h < H; h += 16)
                    store_bf16_exact_x16(out + t * H + h, lanes(H - h), _mm512_loadu_ps(acc + t * ldh + h));
                continue;
            }
            long p[k];                      /* the token's rows, ascending = ascending slot */
            for (long j = 0; j < k; j++) {
                long v = pos[t * k + j], q = j;
                for (; q > 0 && p[q - 1] > v; q--) p[q] = p[q - 1];
                p[q] = v;
            }
            for (long h = 0; h < H; h += 16) {
                const __mmask16 m = lanes(H - h);
                __m512 sum = _mm512_setzero_ps();
                for (long j = 0; j < k; j++) sum = _mm512_add_ps(sum, bf16x16_or_zero(prod + p[j] * H + h, m));
                store_bf16_exact_x16(out + t * H + h, m, sum);
            }
        }
    }
done:
    free(logits); free(ids); free(phys); free(wts); free(sorted_w); free(count); free(fill); free(token);
    free(pos); free(items); free(acc); free(prod); free(xs);
    free_scratch(sc, chunked ? nthreads : 1);
    return rc;
}

/* Expert parallelism splits moed_moe_bf16 in two around the token exchange, with the same
 * arithmetic, so an EP group's output equals one process's bit for bit:
 * moed_route_bf16 is its router half (logits, top-k, expert map, load count) -> physical slot
 * phys[T][k] and weight wts[T][k] (bf16 values held in fp32) per choice; moed_experts_bf16 its
 * expert half on rows already grouped by local slot (count[e] rows of slot e, in slot order):
 * out[r] = bf16(down_e(silu(gate_e(x_r)) * up_e(x_r))). The caller multiplies each row by its
 * weight in bf16 and sums a token's k rows in fp32 in ascending slot order, as the fused kernel
 * does. Both return 0; -1 out of memory; -2 a bad expert map. */
int moed_route_bf16(const bf16 *x, long T, long H, const bf16 *router, long E, long k, int norm_topk,
                    const int64_t *l2p, long max_rep, const int64_t *nrep, long offset, int64_t *load,
                    long P, int64_t *phys, float *wts, int nthreads) {
    const long rows = T * k, ldl = nblocks(E) * NB;
    float *logits = malloc(sizeof(float) * (T * ldl + 1));
    long *ids = malloc(sizeof(long) * (rows + 1));
    int rc = 0;
    if (!logits || !ids) { rc = -1; goto done; }
    router_logits(x, T, H, router, E, logits, ldl, nthreads);
    route(logits, ldl, T, E, k, norm_topk, ids, wts, nthreads);
    rc = map_slots(ids, rows, E, l2p, max_rep, nrep, offset, P, phys, load);
done:
    free(logits); free(ids);
    return rc;
}

/* moed_experts_bf16 (map NULL) and moed_experts_rows_bf16 (map: sorted row s is row map[s] of x
 * and of out). */
static int experts_sorted(const bf16 *x, const int64_t *map, long R, long H, const int64_t *count_in,
                          const bf16 *gate_up, const bf16 *down, long P, long I, bf16 *out, int nthreads) {
    long *count = malloc(sizeof(long) * (P + 1));      /* count[e] = first row of slot e */
    long *items = malloc(sizeof(long) * 3 * (R + 1));
    ExpertScratch *sc = NULL;
    int rc = 0, chunked = 0;
    long n_items, touched, largest;
    if (!count || !items) { rc = -1; goto done; }
    count[0] = 0;
    for (long e = 0; e < P; e++) {
        if (count_in[e] < 0) { rc = -2; goto done; }
        count[e + 1] = count[e] + count_in[e];
    }
    if (count[P] != R) { rc = -2; goto done; }
    n_items = list_chunks(count, P, items, items + R + 1, items + 2 * (R + 1), &touched, &largest);
    chunked = by_chunk(R, touched, n_items, nthreads);
    if (!(sc = alloc_scratch(chunked ? nthreads : 1, largest + 1, H, I, map != NULL))) { rc = -1; goto done; }
    const ExpertSink sink = {NULL, NULL, out, NULL, (const long *)map};
#pragma omp parallel num_threads(nthreads)
    expert_rows(x, (const long *)map, H, I, gate_up, down, items, items + R + 1, items + 2 * (R + 1), n_items,
                chunked, sc, &sink);
done:
    free(count); free(items);
    free_scratch(sc, chunked ? nthreads : 1);
    return rc;
}

int moed_experts_bf16(const bf16 *xs, long R, long H, const int64_t *count_in, const bf16 *gate_up,
                      const bf16 *down, long P, long I, bf16 *out, int nthreads) {
    return experts_sorted(xs, NULL, R, H, count_in, gate_up, down, P, I, out, nthreads);
}

/* moed_experts_bf16 on rows where the caller has them (the cold-expert store's rounds, which
 * would otherwise gather them into slot order and scatter the outputs back): sorted row s (slot
 * order, count[e] rows of slot e) is row map[s] of x, and its output goes to row map[s] of out
 * (map: R distinct rows). The same bits. */
int moed_experts_rows_bf16(const bf16 *x, const int64_t *map, long R, long H, const int64_t *count_in,
                           const bf16 *gate_up, const bf16 *down, long P, long I, bf16 *out, int nthreads) {
    return experts_sorted(x, map, R, H, count_in, gate_up, down, P, I, out, nthreads);
}

/* A layer call's routed rows grouped by unit (the cold-expert executor's torch argsort,
 * bincount and gather in one pass): phys [T * k] (choice t * k + j of token t) -> order [T * k]
 * (a stable sort of phys: the choices of each unit, ascending), count [P] (rows per unit) and
 * xs [T * k][H] (row i = x[order[i] / k]). Returns 0; -2 a unit outside [0, P). */
int moed_group_rows_bf16(const int64_t *phys, long T, long k, long P, const bf16 *x, long H, int64_t *order,
                         int64_t *count, bf16 *xs) {
    const long rows = T * k;
    for (long e = 0; e < P; e++) count[e] = 0;
    for (long s = 0; s < rows; s++) {
        if (phys[s] < 0 || phys[s] >= P) return -2;
        count[phys[s]]++;
    }
    long *next = malloc(sizeof(long) * (P + 1));
    if (!next) return -1;
    next[0] = 0;
    for (long e = 0; e < P; e++) next[e + 1] = next[e] + count[e];
    for (long s = 0; s < rows; s++) order[next[phys[s]]++] = s;
    free(next);
    for (long i = 0; i < rows; i++) memcpy(xs + i * H, x + order[i] / k * H, sizeof(bf16) * H);
    return 0;
}

/* executor.combine_sorted in one pass: ys [T * k][H] expert outputs in expert order, row i
 * being choice order[i] (= t * k + j) of token t = order[i] / k, weight w[order[i]] -> out[t] =
 * the token's products y * w (rounded to bf16 where prod_bf16: bf16 weights, as torch
 * multiplies two bf16 tensors; fp32 weights: the fp32 product) summed from a zero in fp32 in
 * row order (index_add_'s order, ascending expert), rounded once. Threads split the columns:
 * every sum keeps its order. */
int moed_combine_rows_bf16(const bf16 *ys, const int64_t *order, const float *w, long T, long k, long H,
                           int prod_bf16, bf16 *out, int nthreads) {
    const long ldh = nblocks(H) * NB, rows = T * k;
    float *acc = calloc(T * ldh + 1, sizeof(float));
    if (!acc) return -1;
#pragma omp parallel num_threads(nthreads) if (rows * H >= 65536)
    {
        long c0, c1;
        split(ldh / 16, omp_get_thread_num(), omp_get_num_threads(), &c0, &c1);
        for (long i = 0; i < rows; i++) {
            const long t = order[i] / k;
            const __m512 wv = _mm512_set1_ps(w[order[i]]);
            for (long c = c0; c < c1; c++) {
                const long h = c * 16;
                __m512 p = _mm512_mul_ps(bf16x16_or_zero(ys + i * H + h, lanes(H - h)), wv);
                if (prod_bf16) p = round_bf16_exact_x16(p);
                _mm512_storeu_ps(acc + t * ldh + h, _mm512_add_ps(_mm512_loadu_ps(acc + t * ldh + h), p));
            }
        }
#pragma omp barrier
        for (long t = 0; t < T; t++)
            for (long c = c0; c < c1; c++) {
                const long h = c * 16;
                if (h < H) store_bf16_exact_x16(out + t * H + h, lanes(H - h), _mm512_loadu_ps(acc + t * ldh + h));
            }
    }
    free(acc);
    return 0;
}

/* Lane i of the result = the sum of v[i]'s 16 lanes: 16 horizontal sums in 45 shuffles/adds
 * (a transpose-and-add tree) instead of 16 separate reductions. */
static inline __m512 hsum16(const __m512 v[16]) {
    __m512 t[8], u[4], x[2];
    for (int i = 0; i < 8; i++)    /* per 128-bit chunk: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per chunk: the chunk's sum for 4 consecutive sources */
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)    /* add chunk pairs: [u0 c0+c1, u0 c2+c3, u1 c0+c1, u1 c2+c3] */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
}

/* p[0..n) = bf16(softmax(p)) in fp32, 16 lanes at a time (masked tail). */
static void softmax_bf16(float *p, long n) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (long l = 0; l < n; l += 16) {
        const __mmask16 m = n - l >= 16 ? 0xffff : (__mmask16)((1u << (n - l)) - 1);
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, p + l));
    }
    const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (long l = 0; l < n; l += 16) {
        const __mmask16 m = n - l >= 16 ? 0xffff : (__mmask16)((1u << (n - l)) - 1);
        const __m512 e = exp_x16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + l), vmax));
        _mm512_mask_storeu_ps(p + l, m, e);
        sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (long l = 0; l < n; l += 16) {
        const __mmask16 m = n - l >= 16 ? 0xffff : (__mmask16)((1u << (n - l)) - 1);
        _mm512_mask_storeu_ps(p + l, m, round_bf16_x16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + l), inv)));
    }
}

/* softmax_bf16 for cpu_mla.c's absorbed MLA attention (the same softmax as decode attention's). */
void moed_softmax_bf16_f32(float *p, long n) { softmax_bf16(p, n); }

/* Decode attention over the paged cache: one query token per sequence, all its cached keys.
 * q [B][Hq][D] (row stride q_stride elements between tokens, heads contiguous); cache: this
 * layer's [num_blocks][2][bs][Hkv][D] (K at half 0, V at half 1); tables [B][max_blocks] block
 * ids (< num_blocks); lens [B] tokens to attend (the new one included, already written);
 * out [B][Hq][D].
 * GQA: query head g*G.. of kv head g. Rounding follows the torch reference path: q.k in fp32,
 * rounded to bf16 (a bf16 matmul), then scale*s in fp32, softmax in fp32, probabilities rounded
 * to bf16, p.v accumulated in fp32 and rounded once. D is 32, 64, 128 or 256. Returns 0;
 * -1 out of memory; -2 bad shapes or block ids. */
#ifdef __AVX512BF16__
/* 16 lanes of q . k (lane i: the products of pair i of each 32-element chunk, chunks in order):
 * hsum16 of 16 keys' vectors gives their scores. */
static inline __attribute__((always_inline)) __m512 key_dot(const int nc, const __m512bh *qv, const bf16 *k) {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < nc; c++) a = _mm512_dpbf16_ps(a, qv[c], AS_BH(_mm512_loadu_si512(k + 32 * c)));
    return a;
}
#elif defined(__AVX512F__)
/* key_dot on AVX512 without BF16: the same lanes and order as vdpbf16ps (odd product, then
 * even), q pre-widened (qo/qe [D/2], 16 lanes of chunk c at 16c), each key widened once. */
static inline __attribute__((always_inline)) __m512 key_dot(const int nc, const float *qo, const float *qe,
                                                            const bf16 *k) {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < nc; c++) {
        const __m512i kv = _mm512_loadu_si512(k + 32 * c);
        a = dpbf16_wide(a, _mm512_load_ps(qo + 16 * c), _mm512_load_ps(qe + 16 * c), bf16_odd_x16(kv), bf16_even_x16(kv));
    }
    return a;
}
#else
/* key_dot on AVX2: the same lanes, the same FMAs in the same order as cpu_avx2.h's vdpbf16ps
 * (odd product, then even), q pre-widened (qo/qe [D/2]). */
static inline __attribute__((always_inline)) __m512 key_dot(const int nc, const float *qo, const float *qe,
                                                            const bf16 *k) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    __m256 lo = _mm256_setzero_ps(), up = _mm256_setzero_ps();
    for (int c = 0; c < nc; c++) {
        const __m256i k0 = _mm256_loadu_si256((const __m256i *)(k + 32 * c));
        const __m256i k1 = _mm256_loadu_si256((const __m256i *)(k + 32 * c + 16));
        lo = _mm256_fmadd_ps(_mm256_load_ps(qo + 16 * c), _mm256_castsi256_ps(_mm256_and_si256(k0, hi)), lo);
        lo = _mm256_fmadd_ps(_mm256_load_ps(qe + 16 * c), _mm256_castsi256_ps(_mm256_slli_epi32(k0, 16)), lo);
        up = _mm256_fmadd_ps(_mm256_load_ps(qo + 16 * c + 8), _mm256_castsi256_ps(_mm256_and_si256(k1, hi)), up);
        up = _mm256_fmadd_ps(_mm256_load_ps(qe + 16 * c + 8), _mm256_castsi256_ps(_mm256_slli_epi32(k1, 16)), up);
    }
    return v16f_of(lo, up);
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2 decode attention with the query heads inner. attn_task below runs each of a kv head's G
 * query heads over every key and value row, so each row was loaded and widened G times (Zen2:
 * ~3 multiply-adds a cycle, 37 us a layer at 190 tokens). Here a key row is widened once for
 * GN heads (a divisor of G up to 4: 8 accumulators + 4 widened halves fit the 16 ymm), and the
 * value rows once a tile of ATT_VT floats for all G heads. Each (head, key) score and each
 * head's p.v sums are the same FMAs in the same order as attn_task's (the key tile starts at an
 * even key, so the even/odd accumulator pairs are the same): the same bits. */
#define ATT_VT 4096         /* widened value floats a tile (16 KB: L1) */

/* Scaled scores of GN heads (qo/qe their widened q, 128 floats each) for keys [l0, l0 + nk). */
static inline __attribute__((always_inline)) void att_scores_heads(
        const int D, const int GN, const float (*qo)[128], const float (*qe)[128], const bf16 **kp, long l0,
        long nk, long len, long v_pf, float scale, float *s, long max_len) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    __m512 a[4][16];
    for (int j = 0; j < 16; j++) {
        __m256 lo[4], up[4];
        for (int g = 0; g < GN; g++) lo[g] = up[g] = _mm256_setzero_ps();
        if (j < nk) {
            const bf16 *k = kp[l0 + j];
            /* the rows are scattered over the cache's blocks, past L3 at long contexts: the
             * next tile's keys, and (first pass) this key's value row for the p.v pass,
             * requested ahead (2000-token contexts, int4 decode on Zen2: batch 8 +16%) */
            for (int b = 0; b < 2 * D; b += 64) {
                if (l0 + 16 + j < len) _mm_prefetch((const char *)kp[l0 + 16 + j] + b, _MM_HINT_T0);
                if (v_pf) _mm_prefetch((const char *)(k + v_pf) + b, _MM_HINT_T0);
            }
            for (int c = 0; c < D / 32; c++) {
                const __m256i k0 = _mm256_loadu_si256((const __m256i *)(k + 32 * c));
                const __m256i k1 = _mm256_loadu_si256((const __m256i *)(k + 32 * c + 16));
                const __m256 k0o = _mm256_castsi256_ps(_mm256_and_si256(k0, hi)), k0e = _mm256_castsi256_ps(_mm256_slli_epi32(k0, 16));
                const __m256 k1o = _mm256_castsi256_ps(_mm256_and_si256(k1, hi)), k1e = _mm256_castsi256_ps(_mm256_slli_epi32(k1, 16));
                for (int g = 0; g < GN; g++) {
                    lo[g] = _mm256_fmadd_ps(_mm256_load_ps(qo[g] + 16 * c), k0o, lo[g]);
                    lo[g] = _mm256_fmadd_ps(_mm256_load_ps(qe[g] + 16 * c), k0e, lo[g]);
                    up[g] = _mm256_fmadd_ps(_mm256_load_ps(qo[g] + 16 * c + 8), k1o, up[g]);
                    up[g] = _mm256_fmadd_ps(_mm256_load_ps(qe[g] + 16 * c + 8), k1e, up[g]);
                }
            }
        }
        for (int g = 0; g < GN; g++) a[g][j] = v16f_of(lo[g], up[g]);
    }
    const __mmask16 m = nk == 16 ? 0xffff : (__mmask16)((1u << nk) - 1);
    for (int g = 0; g < GN; g++)
        _mm512_mask_storeu_ps(s + g * max_len + l0, m, _mm512_mul_ps(_mm512_set1_ps(scale), round_bf16_x16(hsum16(a[g]))));
}

/* p.v of one head over value rows [t0, t0 + tn) widened in vw ([tn][D]), its accumulators
 * (even keys, odd keys) kept in acc [2][D] between tiles: 32 dims at a time, so the 8
 * accumulators stay in registers (16-lane vectors for all of D spilled on every FMA). */
static inline __attribute__((always_inline)) void att_pv_tile(
        const int D, const float *sg, const float *vw, long t0, long tn, float *acc) {
    for (int c0 = 0; c0 < D / 8; c0 += 4) {
        __m256 a0[4], a1[4];
        for (int c = 0; c < 4; c++) {
            a0[c] = _mm256_loadu_ps(acc + 8 * (c0 + c));
            a1[c] = _mm256_loadu_ps(acc + D + 8 * (c0 + c));
        }
        long l = 0;
        for (; l + 1 < tn; l += 2) {
            const __m256 p0 = _mm256_set1_ps(sg[t0 + l]), p1 = _mm256_set1_ps(sg[t0 + l + 1]);
            for (int c = 0; c < 4; c++) {
                a0[c] = _mm256_fmadd_ps(p0, _mm256_load_ps(vw + l * D + 8 * (c0 + c)), a0[c]);
                a1[c] = _mm256_fmadd_ps(p1, _mm256_load_ps(vw + (l + 1) * D + 8 * (c0 + c)), a1[c]);
            }
        }
        if (l < tn) {                     /* the last key of an odd count */
            const __m256 p0 = _mm256_set1_ps(sg[t0 + l]);
            for (int c = 0; c < 4; c++) a0[c] = _mm256_fmadd_ps(p0, _mm256_load_ps(vw + l * D + 8 * (c0 + c)), a0[c]);
        }
        for (int c = 0; c < 4; c++) {
            _mm256_storeu_ps(acc + 8 * (c0 + c), a0[c]);
            _mm256_storeu_ps(acc + D + 8 * (c0 + c), a1[c]);
        }
    }
}

/* attn_task's result with the heads inner; s: G * max_len scores, then G * 2 * D accumulators. */
static inline __attribute__((always_inline)) void attn_task_avx2(
        const int D, const bf16 *qh, long G, const bf16 **kp, long v_off, long len, long max_len,
        float scale, float *s, bf16 *oh) {
    const long GN = G % 4 == 0 ? 4 : G % 2 == 0 ? 2 : 1;
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    float qo[4][128] __attribute__((aligned(64))), qe[4][128] __attribute__((aligned(64)));
    for (long g0 = 0; g0 < G; g0 += GN) {
        for (long g = 0; g < GN; g++)
            for (int c = 0; c < D / 16; c++) {   /* 16 bf16 of q: lanes 8c.. of qo/qe */
                const __m256i u = _mm256_loadu_si256((const __m256i *)(qh + (g0 + g) * D + 16 * c));
                _mm256_store_ps(qo[g] + 8 * c, _mm256_castsi256_ps(_mm256_and_si256(u, hi)));
                _mm256_store_ps(qe[g] + 8 * c, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
            }
        for (long l0 = 0; l0 < len; l0 += 16) {
            const long nk = len - l0 < 16 ? len - l0 : 16, vpf = g0 == 0 ? v_off : 0;
            float *sg = s + g0 * max_len;
            if (GN == 4) att_scores_heads(D, 4, (const float (*)[128])qo, (const float (*)[128])qe, kp, l0, nk, len, vpf, scale, sg, max_len);
            else if (GN == 2) att_scores_heads(D, 2, (const float (*)[128])qo, (const float (*)[128])qe, kp, l0, nk, len, vpf, scale, sg, max_len);
            else att_scores_heads(D, 1, (const float (*)[128])qo, (const float (*)[128])qe, kp, l0, nk, len, vpf, scale, sg, max_len);
        }
    }
    for (long g = 0; g < G; g++) softmax_bf16(s + g * max_len, len);
    float *acc = s + G * max_len;
    memset(acc, 0, sizeof(float) * G * 2 * D);
    float vw[ATT_VT] __attribute__((aligned(64)));
    const long vt = ATT_VT / D;           /* keys a tile: even */
    for (long t0 = 0; t0 < len; t0 += vt) {
        const long tn = len - t0 < vt ? len - t0 : vt;
        for (long l = 0; l < tn; l++)
            for (int c = 0; c < D / 8; c++)
                _mm256_store_ps(vw + l * D + 8 * c, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128((const __m128i *)(kp[t0 + l] + v_off + 8 * c))), 16)));
        for (long g = 0; g < G; g++) att_pv_tile(D, s + g * max_len, vw, t0, tn, acc + g * 2 * D);
    }
    for (long g = 0; g < G; g++)
        for (int c = 0; c < D / 16; c++)
            _mm256_storeu_si256((__m256i *)(oh + g * D + 16 * c),
                                CVTNE_BH(_mm512_add_ps(_mm512_loadu_ps(acc + g * 2 * D + 16 * c),
                                                       _mm512_loadu_ps(acc + g * 2 * D + D + 16 * c))));
}
#endif

/* One (sequence, kv head) of decode attention; D a compile-time constant after inlining, so
 * the per-key loops unroll and independent keys' dot products overlap in the pipeline.
 * kp[l]: K row of position l (V row at kp[l] + v_off); s: G * max_len scores scratch. */
static inline __attribute__((always_inline)) void attn_task(
        const int D, const bf16 *qh, long G, const bf16 **kp, long v_off, long len, long max_len,
        float scale, float *s, bf16 *oh) {
    enum { NC = 8 };                      /* D/32 <= NC */
    const int nc = D / 32, nd = D / 16;
    for (long g = 0; g < G; g++) {        /* scores, 16 keys at a time */
#ifdef __AVX512BF16__
        /* vdpbf16ps takes q's bf16 pairs as they are: nc vectors held in registers */
        __m512bh qv[NC];
        for (int c = 0; c < nc; c++) qv[c] = AS_BH(_mm512_loadu_si512(qh + g * D + 32 * c));
#define KEY_DOT(k) key_dot(nc, qv, k)
#else
        /* AVX2 and AVX512 without BF16: q's odd and even elements widened once (16 lanes of
         * chunk c at 16c): the key loop then reads them from L1 instead of holding 2 x nc
         * widened vectors in registers (16 ymm; the 16 keys' accumulators fill half the zmm) */
        float qo[128] __attribute__((aligned(64))), qe[128] __attribute__((aligned(64)));
        for (int c = 0; c < nc; c++) {
            const __m512i u = _mm512_loadu_si512(qh + g * D + 32 * c);
            _mm512_storeu_ps(qo + 16 * c, _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u))));
            _mm512_storeu_ps(qe + 16 * c, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
        }
#define KEY_DOT(k) key_dot(nc, qo, qe, k)
#endif
        for (long l0 = 0; l0 < len; l0 += 16) {
            __m512 a[16];
            const long nk = len - l0 < 16 ? len - l0 : 16;
            if (nk == 16) {
                for (int j = 0; j < 16; j++) a[j] = KEY_DOT(kp[l0 + j]);
            } else {
                for (int j = 0; j < 16; j++) a[j] = j < nk ? KEY_DOT(kp[l0 + j]) : _mm512_setzero_ps();
            }
#undef KEY_DOT
            const __mmask16 m = nk == 16 ? 0xffff : (__mmask16)((1u << nk) - 1);
            _mm512_mask_storeu_ps(s + g * max_len + l0, m,
                                  _mm512_mul_ps(_mm512_set1_ps(scale), round_bf16_x16(hsum16(a))));
        }
        softmax_bf16(s + g * max_len, len);
    }
    for (long g = 0; g < G; g++) {        /* p.v: accumulators in registers, two sets (even/odd
                                            * keys) so consecutive FMAs do not wait on each other */
        __m512 a0[2 * NC], a1[2 * NC];
        for (int c = 0; c < nd; c++) { a0[c] = _mm512_setzero_ps(); a1[c] = _mm512_setzero_ps(); }
        const float *sg = s + g * max_len;
        long l = 0;
        for (; l + 1 < len; l += 2) {
            const __m512 p0 = _mm512_set1_ps(sg[l]), p1 = _mm512_set1_ps(sg[l + 1]);
            const bf16 *v0 = kp[l] + v_off, *v1 = kp[l + 1] + v_off;
            for (int c = 0; c < nd; c++) {
                a0[c] = _mm512_fmadd_ps(p0, load_bf16_x16(v0 + 16 * c), a0[c]);
                a1[c] = _mm512_fmadd_ps(p1, load_bf16_x16(v1 + 16 * c), a1[c]);
            }
        }
        if (l < len) {
            const __m512 p0 = _mm512_set1_ps(sg[l]);
            for (int c = 0; c < nd; c++) a0[c] = _mm512_fmadd_ps(p0, load_bf16_x16(kp[l] + v_off + 16 * c), a0[c]);
        }
        for (int c = 0; c < nd; c++)
            _mm256_storeu_si256((__m256i *)(oh + g * D + 16 * c),
                                CVTNE_BH(_mm512_add_ps(a0[c], a1[c])));
    }
}

int moed_decode_attn_bf16(const bf16 *q, long q_stride, long B, long Hq, long Hkv, long D,
                          const bf16 *cache, long num_blocks, long bs, const int64_t *tables,
                          long max_blocks, const int64_t *lens, float scale, bf16 *out, int nthreads) {
    if (Hq % Hkv || (D != 32 && D != 64 && D != 128 && D != 256)) return -2;
    const long G = Hq / Hkv;
    long max_len = 0;
    for (long b = 0; b < B; b++) {
        if (lens[b] < 1 || lens[b] > max_blocks * bs) return -2;
        for (long j = 0; j < (lens[b] + bs - 1) / bs; j++)
            if (tables[b * max_blocks + j] < 0 || tables[b * max_blocks + j] >= num_blocks) return -2;
        if (lens[b] > max_len) max_len = lens[b];
    }
    const long per = G * max_len + 2 * G * D;    /* scores, then attn_task_avx2's p.v sums */
    float *scores = malloc(sizeof(float) * nthreads * per);
    const bf16 **rows = malloc(sizeof(bf16 *) * nthreads * max_len);
    if (!scores || !rows) { free(scores); free(rows); return -1; }
    const long v_off = bs * Hkv * D;          /* V rows sit one block-half after K rows */
#pragma omp parallel num_threads(nthreads)
    {
        float *s = scores + omp_get_thread_num() * per;
        const bf16 **kp = rows + omp_get_thread_num() * max_len;   /* K row of each position */
#pragma omp for schedule(static)
        for (long task = 0; task < B * Hkv; task++) {
            const long b = task / Hkv, h = task % Hkv, len = lens[b];
            for (long l0 = 0, j = 0; l0 < len; l0 += bs, j++) {   /* no division per key */
                const bf16 *blk = cache + tables[b * max_blocks + j] * 2 * bs * Hkv * D + h * D;
                for (long o = 0; o < bs && l0 + o < len; o++) kp[l0 + o] = blk + o * Hkv * D;
            }
            const bf16 *qh = q + b * q_stride + h * G * D;
            bf16 *oh = out + (b * Hq + h * G) * D;
#if defined(__AVX2__) && !defined(__AVX512F__)
#define ATTN_TASK attn_task_avx2
#else
#define ATTN_TASK attn_task
#endif
            switch (D) {
                case 32: ATTN_TASK(32, qh, G, kp, v_off, len, max_len, scale, s, oh); break;
                case 64: ATTN_TASK(64, qh, G, kp, v_off, len, max_len, scale, s, oh); break;
                case 128: ATTN_TASK(128, qh, G, kp, v_off, len, max_len, scale, s, oh); break;
                default: ATTN_TASK(256, qh, G, kp, v_off, len, max_len, scale, s, oh); break;
            }
#undef ATTN_TASK
        }
    }
    free(scores);
    free(rows);
    return 0;
}

/* RMSNorm over rows of D, optionally after a residual add, as transformers computes it in bf16:
 *   if add: x = bf16(x + add), written back to resid_out (the new residual stream)
 *   out = bf16(weight * bf16(x * rsqrt(mean(x^2) + eps)))    (mean in fp32)
 * x/add/resid_out/out [R][D] contiguous; weight [D]. resid_out may alias x. */
void moed_rms_norm_bf16(const bf16 *x, const bf16 *add, bf16 *resid_out, long R, long D,
                        const bf16 *weight, float eps, bf16 *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R * D >= 8192)
    for (long r = 0; r < R; r++) {
        const bf16 *xr = x + r * D;
        __m512 ss = _mm512_setzero_ps();
        for (long d = 0; d < D; d += 16) {
            const __mmask16 m = lanes(D - d);
            __m512 f = bf16x16_or_zero(xr + d, m);
            if (add) {
                f = round_bf16_x16(_mm512_add_ps(f, bf16x16_or_zero(add + r * D + d, m)));
                store_bf16x16(resid_out + r * D + d, m, f);
            }
            ss = _mm512_fmadd_ps(f, f, ss);
        }
        const bf16 *src = add ? resid_out + r * D : xr;   /* the (rounded) sum, read back */
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)D + eps));
        for (long d = 0; d < D; d += 16) {
            const __mmask16 m = lanes(D - d);
            const __m512 n = round_bf16_x16(_mm512_mul_ps(bf16x16_or_zero(src + d, m), inv));
            store_bf16x16(out + r * D + d, m, _mm512_mul_ps(bf16x16_or_zero(weight + d, m), n));
        }
    }
}

/* The q/k half of a qkv projection, per head: optional RMSNorm (weight [H][D], one row per head)
 * then rotary, as the torch path does it in bf16:
 *   y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))             (if weight)
 *   out = bf16(bf16(y * cos) + bf16(roll(y, D/2) * sin))        (sin signed: see Rotary)
 * qkv [T][row_stride] with the H heads of D first; cos/sin [T][D]; out [T][H][D]. D even. */
void moed_qk_norm_rope_bf16(const bf16 *qkv, long T, long row_stride, long H, long D,
                            const bf16 *weight, float eps, const bf16 *cos, const bf16 *sin,
                            bf16 *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * H * D >= 8192)
    for (long th = 0; th < T * H; th++) {
        const long t = th / H, h = th % H, half = D / 2;
        const bf16 *xr = qkv + t * row_stride + h * D;
        float y[2 * D];                  /* y twice over, so roll(y) is a plain offset read;
                                          * a VLA: freed every iteration (alloca would pile up) */
        __m512 ss = _mm512_setzero_ps();
        for (long d = 0; d < D; d += 16) {
            const __mmask16 m = lanes(D - d);
            const __m512 f = bf16x16_or_zero(xr + d, m);
            _mm512_mask_storeu_ps(y + d, m, f);
            ss = _mm512_fmadd_ps(f, f, ss);
        }
        if (weight) {
            const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)D + eps));
            for (long d = 0; d < D; d += 16) {
                const __mmask16 m = lanes(D - d);
                const __m512 n = round_bf16_x16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, y + d), inv));
                _mm512_mask_storeu_ps(y + d, m, round_bf16_x16(_mm512_mul_ps(bf16x16_or_zero(weight + h * D + d, m), n)));
            }
        }
        memcpy(y + D, y, sizeof(float) * D);
        bf16 *o = out + th * D;
        const bf16 *c = cos + t * D, *sn = sin + t * D;
        for (long d = 0; d < D; d += 16) {   /* roll(y, D/2)[d] = y[d + D/2] (mod D) */
            const __mmask16 m = lanes(D - d);
            const __m512 yv = _mm512_maskz_loadu_ps(m, y + d), rolled = _mm512_maskz_loadu_ps(m, y + d + half);
            store_bf16x16(o + d, m, _mm512_add_ps(round_bf16_x16(_mm512_mul_ps(yv, bf16x16_or_zero(c + d, m))),
                                                  round_bf16_x16(_mm512_mul_ps(rolled, bf16x16_or_zero(sn + d, m)))));
        }
    }
}

#ifdef __AVX512BW__
/* AVX512BW (both AVX512 variants): a word permute across two vectors.
 * Word indices that interleave two vectors of 32 bf16, a and b (b's indices from 32):
 * lo = a0 b0 a1 b1 ... a15 b15, hi = a16 b16 ... a31 b31. */
static inline __m512i interleave_lo(void) {
    return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
}

static inline __m512i interleave_hi(void) {
    return _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                            55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
}

/* 32 dims of keys l and l + 1 (b, or zeros past the last key) interleaved into dst [64]. */
static inline void interleave_keys(const bf16 *v0, const bf16 *v1, bf16 *dst) {
    const __m512i a = _mm512_loadu_si512(v0);
    const __m512i b = v1 ? _mm512_loadu_si512(v1) : _mm512_setzero_si512();
    _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, interleave_lo(), b));
    _mm512_storeu_si512(dst + NB, _mm512_permutex2var_epi16(a, interleave_hi(), b));
}
#else
/* AVX2 has no word permute across lanes: plain C (the compiler vectorises what it can) */
static inline void interleave_keys(const bf16 *v0, const bf16 *v1, bf16 *dst) {
    for (int i = 0; i < NB; i++) { dst[2 * i] = v0[i]; dst[2 * i + 1] = v1 ? v1[i] : 0; }
}
#endif

/* Query rows (one head, consecutive tokens) per prefill attention tile. AVX2 widens each key
 * and value block to fp32 once per block_rows_any call, so it takes 32 rows a call (8 widened
 * each block 4x as often; SHARE_ROWS' 48 was no faster, and a tile's scores grow with it); the
 * AVX512 variants, which widen nothing, the register tile's ROW_TILE. Rows are independent: the
 * tile changes no bits. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define ATTN_ROWS 32
#else
#define ATTN_ROWS ROW_TILE
#endif

/* Causal prefill attention of one sequence, blocked over queries: no [n, L] score matrix, only
 * ATTN_ROWS query rows' scores at a time (one q head, consecutive tokens), so the whole step is
 * two matmuls on the packed-block kernel per tile plus a softmax.
 * q: n token rows at stride q_stride (Hq heads of D contiguous), token t at position start + t;
 * k, v [L][Hkv][D] contiguous, L = start + n (the cached history, then the new tokens);
 * out [n][Hq][D]. GQA: q head g*G.. reads kv head g. Rounding as torch's CPU flash attention
 * (the torch path for prefill): q.k and its scaling in fp32, e = exp(s - max) in fp32 summed in
 * fp32, e rounded to bf16 for the p.v product (fp32 accumulation), divided by the sum and
 * rounded once. (Flash takes the max over key blocks as it goes and rescales; the exact row
 * max here differs from it only in those rescalings' roundings.) D is 32, 64, 128 or 256,
 * q_stride even.
 * K and V^T are packed once per call (P32, zero-padded keys), 2 * Hkv * L * D bf16 of scratch.
 * Returns 0; -1 out of memory; -2 bad shapes. */
int moed_prefill_attn_bf16(const bf16 *q, long q_stride, long n, long start, long Hq, long Hkv, long D,
                           const bf16 *k, const bf16 *v, float scale, bf16 *out, int nthreads) {
    if (n < 1 || start < 0 || Hkv < 1 || Hq % Hkv || (D != 32 && D != 64 && D != 128 && D != 256) || q_stride % 2)
        return -2;
    const long G = Hq / Hkv, L = start + n, Lp = nblocks(L) * NB, D2 = D / 2, kv_stride = Hkv * D;
    const long tiles = (n + ATTN_ROWS - 1) / ATTN_ROWS;
    bf16 *kp = calloc((size_t)Hkv * Lp * D, sizeof(bf16));      /* per head: [Lp/32][D/2][32][2] */
    bf16 *vt = calloc((size_t)Hkv * Lp * D, sizeof(bf16));      /* per head: [D/32][Lp/2][32][2] */
    float *sbuf = malloc(sizeof(float) * nthreads * ATTN_ROWS * (Lp + D));
    bf16 *pbuf = malloc(sizeof(bf16) * nthreads * ATTN_ROWS * Lp);
    int rc = 0;
    if (!kp || !vt || !sbuf || !pbuf) { rc = -1; goto done; }
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (long hl = 0; hl < Hkv * nblocks(L); hl++) {          /* pack K_h and V_h^T */
            const long h = hl / nblocks(L), lb = hl % nblocks(L), l0 = lb * NB, l1 = l0 + NB < L ? l0 + NB : L;
            /* K: a block of 32 keys is a 32 x D/2 transpose of bf16 pairs (uint32) */
            uint32_t *kb32 = (uint32_t *)(kp + h * Lp * D) + lb * D2 * NB;
            for (long l = l0; l < l1; l++) {
                const uint32_t *kr = (const uint32_t *)(k + l * kv_stride + h * D);
                for (long p = 0; p < D2; p++) kb32[p * NB + (l - l0)] = kr[p];
            }
            /* V^T: keys l, l+1 interleaved, 32 dims at a time: [d0 of l, d0 of l+1, d1 of l, ...] */
            bf16 *vh = vt + h * Lp * D;
            for (long l = l0; l < l1; l += 2) {
                const bf16 *v0 = v + l * kv_stride + h * D, *v1 = v0 + kv_stride;
                for (long j = 0; j < D / NB; j++) {
                    interleave_keys(v0 + j * NB, l + 1 < L ? v1 + j * NB : NULL,
                                    vh + (j * (Lp / 2) + l / 2) * 2 * NB);
                }
            }
        }
        float *s = sbuf + omp_get_thread_num() * ATTN_ROWS * (Lp + D), *o = s + ATTN_ROWS * Lp;
        bf16 *p = pbuf + omp_get_thread_num() * ATTN_ROWS * Lp;
#pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < Hq * tiles; task++) {
            /* late tiles (most keys) first: dynamic scheduling then ends with the small ones */
            const long qh = task % Hq, tile = tiles - 1 - task / Hq, h = qh / G;
            const long t0 = tile * ATTN_ROWS, R = n - t0 < ATTN_ROWS ? n - t0 : ATTN_ROWS;
            const long kb = nblocks(start + t0 + R);                /* key blocks any row sees */
            const uint32_t *xq = (const uint32_t *)(q + t0 * q_stride + qh * D);
            for (long b = 0; b < kb; b += SHARE_BLOCKS)
                blocks_rows_any(R, xq, q_stride / 2, kp + h * Lp * D + b * NB * D, kb - b < SHARE_BLOCKS ? kb - b : SHARE_BLOCKS,
                                NB * D, D2, s + b * NB, Lp);
            float inv[ATTN_ROWS];
            for (long r = 0; r < R; r++) {
                const long len = start + t0 + r + 1;              /* keys 0..position */
                const float *sr = s + r * Lp;
                bf16 *pr = p + r * Lp;
                __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
                for (long l = 0; l < len; l += 16)
                    mx = _mm512_mask_max_ps(mx, lanes(len - l), mx, _mm512_maskz_loadu_ps(lanes(len - l), sr + l));
                const __m512 vs = _mm512_set1_ps(scale), vmax = _mm512_mul_ps(vs, _mm512_set1_ps(_mm512_reduce_max_ps(mx)));
                for (long l = 0; l < len; l += 16) {
                    const __mmask16 m = lanes(len - l);
                    const __m512 e = exp_x16(_mm512_sub_ps(_mm512_mul_ps(vs, _mm512_maskz_loadu_ps(m, sr + l)), vmax));
                    sum = _mm512_mask_add_ps(sum, m, sum, e);
                    store_bf16x16(pr + l, m, e);
                }
                inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
                memset(pr + len, 0, sizeof(bf16) * (kb * NB - len));
            }
            for (long j = 0; j < D / NB; j++)
                block_rows_any(R, (const uint32_t *)p, Lp / 2, vt + h * Lp * D + j * NB * Lp, kb * NB / 2, o + j * NB, D);
            for (long r = 0; r < R; r++) {
                bf16 *orow = out + ((t0 + r) * Hq + qh) * D;
                const __m512 vi = _mm512_set1_ps(inv[r]);
                for (long d = 0; d < D; d += 16)
                    _mm256_storeu_si256((__m256i *)(orow + d),
                                        CVTNE_BH(_mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), vi)));
            }
        }
    }
done:
    free(kp); free(vt); free(sbuf); free(pbuf);
    return rc;
}

/* out[b] = the index of row b's largest value in x[B][V] fp32: the first one on ties, and the
 * first NaN where a row has one (torch.argmax's answer). torch's CPU argmax compares scalar by
 * scalar (~55 us for a 32000-entry row on Zen4); here a vector max, then the first lane equal to
 * it: ~5 us, which the sampler's greedy pick takes every decode step. */
void moed_argmax_f32(const float *x, long B, long V, int64_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (B * V >= (1L << 18))
    for (long b = 0; b < B; b++) {
        const float *r = x + b * V;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (long i = 0; i < V; i += 16) {
            const __mmask16 m = lanes(V - i);
            const __m512 v = _mm512_maskz_loadu_ps(m, r + i);
            nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
            mx = _mm512_mask_max_ps(mx, m, mx, v);
        }
        long found = 0;
        if (nan) {
            while (found < V && r[found] == r[found]) found++;
        } else {
            const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            for (long i = 0; i < V; i += 16) {
                const __mmask16 m = lanes(V - i);
                const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, r + i), best, _CMP_EQ_OQ);
                if (hit) { found = i + __builtin_ctz(hit); break; }
            }
        }
        out[b] = found;
    }
}

/* An fp8 KV cache read back (moed/model/kv_layout.py): dst[i] = lut[src[i]], lut the 256 bf16
 * values of the e4m3 bytes (torch's own conversion, exact: every e4m3 value is a bf16). torch's
 * CPU float8 -> bf16 cast is scalar (~6.5 ns an element on Zen4); this is a table lookup. */
void moed_lut_u8_to_u16(const uint8_t *src, long n, const uint16_t *lut, uint16_t *dst, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 1 << 16)
    for (long i = 0; i < n; i++) dst[i] = lut[src[i]];
}
