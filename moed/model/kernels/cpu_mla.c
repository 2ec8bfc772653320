/* Absorbed MLA attention (DeepSeek-V2/V3) over the latent cache, every absorbed row of a step in
 * one call (moed_mla_decode_bf16; the caller is moed/model/attention/mla_torch.py). The math is
 * mla.absorbed's (moed/model/attention/mla.py), per query row t and head h:
 *
 *   q_lat = bf16(q_nope . W_uk[h])              fp32 sum over nope, W_uk fp32 [H][nope][r]
 *   s_l   = scale * bf16([q_lat | q_rope] . [c_kv | k_rope]_l)    fp32 sum, l < len[t]
 *   p     = bf16(softmax(s))                    fp32 (cpu_bf16.c's softmax_bf16, exported)
 *   o_lat = bf16(sum_l p_l c_kv_l)              fp32, l in order
 *   out   = bf16(o_lat . W_uv[h])               fp32 sum over r, W_uv fp32 [H][vd][r]
 *
 * Why one call: the torch form is ~12 ops a layer (350-585 us of dispatch on the demo model's
 * sizes), and its batched matmuls pad every history to the longest one and may block their sums
 * by shape, so a row's bits depended on its company (a verify chunk alone took another form).
 * Here a row's output depends only on its own query, its own history (read through its block
 * table, no gather) and the weights: every sum runs in a fixed order over that row's own length
 * (16 fp32 lanes, chunks in order, then the fixed lane tree of _mm512_reduce_add_ps), never over
 * padding. Threads take (row, block of heads) tasks; how heads are grouped into tasks or tasks
 * into threads changes no bits (each head's sums are its own), so any batch, any thread count,
 * any variant gives each row the same bits.
 *
 * Variants: compiled once per ISA with the rest of the kernels; no bf16 instruction here, only
 * fp32 FMAs and the shared reduction order (cpu_avx2.h does each 512-bit step on two halves in
 * the same order), so avx512bf16, avx512 and avx2 give the same bits. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#elif defined(__AVX2__) && defined(__FMA__)
#include "cpu_avx2.h"
#else
#error "build with -mavx512f or -march=x86-64-v3"
#endif

typedef uint16_t bf16;
#include "cpu_bf16_scalar.h"

/* cpu_bf16.c: p[0..n) = bf16(softmax(p)) in fp32 (decode_attn_bf16's softmax, the same bits) */
void moed_softmax_bf16_f32(float *p, long n);


static inline __mmask16 m_lanes(long left) {
    return left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

static inline long pad16(long n) { return (n + 15) / 16 * 16; }

/* dst[0..n) = src as fp32 (exact), dst[n..npad) = 0 */
static inline void widen(const bf16 *src, long n, float *dst, long npad) {
    long c = 0;
    for (; c + 16 <= n; c += 16)
        _mm512_storeu_ps(dst + c, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + c))), 16)));
    for (; c < n; c++) dst[c] = bf16_to_f32(src[c]);
    for (; c < npad; c++) dst[c] = 0.0f;
}

/* sum_c a[c] * b[c] over n (a multiple of 16) floats: 16 lanes, chunks in order, one tree */
static inline float dot_f32(const float *a, const float *b, long n) {
    __m512 acc = _mm512_setzero_ps();
    for (long c = 0; c < n; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), acc);
    return _mm512_reduce_add_ps(acc);
}

/* One task: query row t over its len keys (block table tab), heads h0..h0+nh. Scratch (this
 * thread's): q [nh][Dp], s [nh][len], kf [Dp], o [nh][rp]. */
static void mla_task(const bf16 *qn, long qn_h, const bf16 *qr, long qr_h, long h0, long nh,
                     long nope, long rope, long r, long vd, const bf16 *cache, long bs,
                     const int64_t *tab, long len, const float *w_uk, const float *w_uv,
                     float scale, bf16 *out, float *q, float *s, float *kf, float *o) {
    const long D = r + rope, Dp = pad16(D), rp = pad16(r);
    for (long hh = 0; hh < nh; hh++) {            /* q = [bf16(q_nope W_uk) | q_rope], zero-padded */
        const bf16 *qnh = qn + (h0 + hh) * qn_h;
        const float *wk = w_uk + (h0 + hh) * nope * r;
        float *qh = q + hh * Dp;
        for (long c = 0; c < r; c += 16) {
            const __mmask16 m = m_lanes(r - c);
            __m512 acc = _mm512_setzero_ps();
            for (long n = 0; n < nope; n++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_f32(qnh[n])), _mm512_maskz_loadu_ps(m, wk + n * r + c), acc);
            _mm512_mask_storeu_ps(qh + c, m, acc);
        }
        for (long c = 0; c < r; c++) qh[c] = round_bf16(qh[c]);
        widen(qr + (h0 + hh) * qr_h, rope, qh + r, Dp - r);
    }
    for (long l0 = 0, j = 0; l0 < len; l0 += bs, j++) {          /* scores, key by key */
        const bf16 *blk = cache + tab[j] * bs * D;
        for (long k = 0; k < bs && l0 + k < len; k++) {
            widen(blk + k * D, D, kf, Dp);
            for (long hh = 0; hh < nh; hh++)
                s[hh * len + l0 + k] = scale * round_bf16(dot_f32(q + hh * Dp, kf, Dp));
        }
    }
    for (long hh = 0; hh < nh; hh++) moed_softmax_bf16_f32(s + hh * len, len);
    memset(o, 0, sizeof(float) * nh * rp);
    for (long l0 = 0, j = 0; l0 < len; l0 += bs, j++) {          /* o_lat = p . c_kv, key by key */
        const bf16 *blk = cache + tab[j] * bs * D;
        for (long k = 0; k < bs && l0 + k < len; k++) {
            widen(blk + k * D, r, kf, rp);
            for (long hh = 0; hh < nh; hh++) {
                const __m512 p = _mm512_set1_ps(s[hh * len + l0 + k]);
                float *oh = o + hh * rp;
                for (long c = 0; c < rp; c += 16)
                    _mm512_storeu_ps(oh + c, _mm512_fmadd_ps(p, _mm512_loadu_ps(kf + c), _mm512_loadu_ps(oh + c)));
            }
        }
    }
    for (long hh = 0; hh < nh; hh++) {            /* out = bf16(o_lat) W_uv^T */
        float *oh = o + hh * rp;
        for (long c = 0; c < r; c++) oh[c] = round_bf16(oh[c]);
        for (long v = 0; v < vd; v++) {
            const float *wv = w_uv + ((h0 + hh) * vd + v) * r;
            __m512 acc = _mm512_setzero_ps();
            for (long c = 0; c < r; c += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(oh + c), _mm512_maskz_loadu_ps(m_lanes(r - c), wv + c), acc);
            out[(h0 + hh) * vd + v] = f32_to_bf16(_mm512_reduce_add_ps(acc));
        }
    }
}

/* R query rows of a step: row i is token rows[i] of q_nope [T][H][nope] (strides qn_t, qn_h;
 * dims contiguous) and q_rope [T][H][rope] (qr_t, qr_h), of sequence seqs[i] (its block table
 * tables[seqs[i]][0..max_blocks)), attending to that sequence's first lens[i] cached tokens
 * (a verify chunk's row j: the history + j + 1). cache: the layer's [num_blocks][bs][r + rope]
 * (dense); w_uk fp32 [H][nope][r], w_uv fp32 [H][vd][r]; out [T][H][vd] (row stride out_t,
 * heads and dims contiguous): rows[i] written, the others untouched. Returns 0; -1 out of
 * memory; -2 a bad row, sequence, length or block id. */
int moed_mla_decode_bf16(const bf16 *qn, long qn_t, long qn_h, const bf16 *qr, long qr_t, long qr_h,
                         long T, long R, const int64_t *rows, const int64_t *seqs, const int64_t *lens,
                         long H, long nope, long rope, long r, long vd, const bf16 *cache, long num_blocks,
                         long bs, const int64_t *tables, long S, long max_blocks, const float *w_uk,
                         const float *w_uv, float scale, bf16 *out, long out_t, int nthreads) {
    if (H < 1 || nope < 1 || rope < 0 || r < 1 || vd < 1 || bs < 1) return -2;
    long max_len = 0;
    for (long i = 0; i < R; i++) {
        if (rows[i] < 0 || rows[i] >= T || seqs[i] < 0 || seqs[i] >= S) return -2;
        if (lens[i] < 1 || lens[i] > max_blocks * bs) return -2;
        for (long j = 0; j < (lens[i] + bs - 1) / bs; j++) {
            const int64_t b = tables[seqs[i] * max_blocks + j];
            if (b < 0 || b >= num_blocks) return -2;
        }
        if (lens[i] > max_len) max_len = lens[i];
    }
    if (R == 0) return 0;
    /* heads per task: up to 8 (one key row read serves them all), fewer when that leaves
     * threads idle; no bits depend on it */
    long hb = H < 8 ? H : 8;
    while (hb > 1 && R * ((H + hb - 1) / hb) < nthreads) hb = (hb + 1) / 2;
    const long nhb = (H + hb - 1) / hb, Dp = pad16(r + rope), rp = pad16(r);
    const long per = hb * Dp + hb * max_len + Dp + hb * rp;
    float *scratch = malloc(sizeof(float) * nthreads * per);
    if (!scratch) return -1;
#pragma omp parallel num_threads(nthreads)
    {
        float *q = scratch + omp_get_thread_num() * per, *s = q + hb * Dp, *kf = s + hb * max_len, *o = kf + Dp;
#pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < R * nhb; task++) {
            const long i = task / nhb, h0 = task % nhb * hb, nh = H - h0 < hb ? H - h0 : hb, t = rows[i];
            mla_task(qn + t * qn_t, qn_h, qr + t * qr_t, qr_h, h0, nh, nope, rope, r, vd, cache, bs,
                     tables + seqs[i] * max_blocks, lens[i], w_uk, w_uv, scale, out + t * out_t, q, s, kf, o);
        }
    }
    free(scratch);
    return 0;
}
