/* bf16 CPU kernels for x86 CPUs with AVX512-BF16: matmuls on a packed weight, a whole MoE block,
 * paged decode attention, RMSNorm and rotary. Built for decode; the matmuls serve prefill too
 * (on par with oneDNN there), so a weight is held once.
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
 * Threads: the caller passes the count; OpenMP is the libgomp torch already loaded (same
 * soname), so these are torch's own pool threads, never a second pool competing for cores.
 * Every output element is computed by one thread in a fixed order, so results are bitwise the
 * same for any thread count (a prefill node and a decode node agree exactly).
 * Built at run time by moed/model/kernels/__init__.py with -O3 -mavx512bf16 (no -march=native:
 * one cached .so serves any AVX512-BF16 CPU).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

#define NB 32        /* output columns per packed block */
#define ROW_TILE 8   /* input rows per pass over a block: 2 x 8 accumulators + loads fit 32 zmm */

int moed_abi_version(void) { return 5; }

int moed_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
}

static inline float bf16_to_f32(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 f32_to_bf16(float f) {   /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline __m512 round_bf16_x16(__m512 v) {   /* RNE to bf16 and back, 16 lanes */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
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

/* y[r][0..32) = x[r] . (the 32 columns of packed block wb), r < R (R <= ROW_TILE, a constant
 * after inlining so the accumulators stay in registers); x rows as bf16 pairs (uint32). */
static inline __attribute__((always_inline)) void block_rows(
        const int R, const uint32_t *x, long ldx2, const bf16 *wb, long K2, float *y, long ldy) {
    __m512 a[ROW_TILE][2];
    for (int r = 0; r < R; r++) { a[r][0] = _mm512_setzero_ps(); a[r][1] = _mm512_setzero_ps(); }
    for (long kp = 0; kp < K2; kp++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + kp * 2 * NB);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + kp * 2 * NB + NB);
        for (int r = 0; r < R; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[r * ldx2 + kp]);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], xb, w0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], xb, w1);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(y + r * ldy, a[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, a[r][1]);
    }
}

/* y[r][b*32 .. b*32+32) for packed blocks b in [b0, b1) and all R rows of x [R][ldx] (any R,
 * in tiles of ROW_TILE rows). y [R][ldy], ldy >= 32 * b1. */
static void gemm_packed(const bf16 *x, long R, long ldx, const bf16 *wp, long K, long b0, long b1,
                        float *y, long ldy) {
    const long K2 = K / 2;
    for (long b = b0; b < b1; b++) {
        const bf16 *wb = wp + b * NB * K;
        for (long r0 = 0; r0 < R; r0 += ROW_TILE) {   /* the block stays in L1/L2 across tiles */
            const long rn = R - r0 < ROW_TILE ? R - r0 : ROW_TILE;
            const uint32_t *xr = (const uint32_t *)(x + r0 * ldx);
            float *yr = y + r0 * ldy + b * NB;
            switch (rn) {
                case 1: block_rows(1, xr, ldx / 2, wb, K2, yr, ldy); break;
                case 2: block_rows(2, xr, ldx / 2, wb, K2, yr, ldy); break;
                case 3: block_rows(3, xr, ldx / 2, wb, K2, yr, ldy); break;
                case 4: block_rows(4, xr, ldx / 2, wb, K2, yr, ldy); break;
                case 5: block_rows(5, xr, ldx / 2, wb, K2, yr, ldy); break;
                case 6: block_rows(6, xr, ldx / 2, wb, K2, yr, ldy); break;
                case 7: block_rows(7, xr, ldx / 2, wb, K2, yr, ldy); break;
                default: block_rows(8, xr, ldx / 2, wb, K2, yr, ldy); break;
            }
        }
    }
}

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

/* out[R][N] (bf16) = x[R][K] @ W^T (+ bias[N]), W packed P32 from [N][K]; fp32 accumulation,
 * bias added in fp32, rounded once (as torch's addmm and oneDNN's fused bias do). */
int moed_linear_bf16(const bf16 *x, long R, long K, const bf16 *wp, long N, const bf16 *bias,
                     bf16 *out, int nthreads) {
    const long ldy = nblocks(N) * NB;
    float *acc = malloc(sizeof(float) * R * ldy);
    if (!acc) return -1;
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        long b0, b1, lo, hi;
        split(nblocks(N), tid, nt, &b0, &b1);
        gemm_packed(x, R, K, wp, K, b0, b1, acc, ldy);
        split_cols(N, tid, nt, &lo, &hi);
        for (long r = 0; r < R; r++)
            for (long n = lo; n < hi; n++) {
                float v = acc[r * ldy + n];
                if (bias) v += bf16_to_f32(bias[n]);
                out[r * N + n] = f32_to_bf16(v);
            }
    }
    free(acc);
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
        _mm256_storeu_si256((__m256i *)(act + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(round_bf16_x16(sg), u)));
    }
    for (; i < I; i++) {
        const float g = round_bf16(gu[i]), u = round_bf16(gu[I + i]);
        act[i] = f32_to_bf16(round_bf16(silu(g)) * u);
    }
}

/* Router for T tokens: softmax over E logits (rounded to bf16 first, as a bf16 router matmul
 * leaves them), top-k by descending probability (lower id first on ties, as the loop finds
 * them), optionally renormalised; weights end rounded to bf16 as transformers casts them. */
static int route(const float *logits, long ldl, long T, long E, long k, int norm_topk, long *ids, float *wts) {
    float *p = malloc(sizeof(float) * E);
    if (!p) return -1;
    for (long t = 0; t < T; t++) {
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
    free(p);
    return 0;
}

/* Logical expert -> physical slot for each of the rows (t, j) in flat order t*k + j: the n-th
 * row routed to expert e (n counted per expert, in flat order) goes to replica
 * (n + offset) % nrep[e], so every replica gets floor or ceil of e's rows / replicas (the flat
 * index modulo replicas put all of an expert's rows on one replica when it was mostly some
 * token's j-th choice); offset (the router's call count) rotates which replica takes the extra
 * row. The same split as moed/balance/experts_route.py. load [E] (may be NULL) counts rows per
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

/* A whole MoE block (router + routed experts) for a few tokens, in one call:
 *   out[t] = sum_j w[t][j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = phys(expert[t][j])
 * x [T][H]; out [T][H]; weights packed P32 (H and I even): router from [E][H], each expert's
 * gate_up from [2I][H] (gate rows first), its down from [H][I].
 * Logical expert ids go to physical slots through l2p [E][max_rep] (map_slots: each expert's
 * rows numbered, plus offset, modulo its replicas, as the torch path); load [E] (may be NULL) counts tokens per logical expert. Each
 * expert's weights are read once for all its tokens. Rounding follows a bf16 torch run: the
 * router logits, gate/up, silu(g), silu(g)*u, the down output and its product with the weight
 * are each rounded to bf16; the k expert outputs are summed in fp32 and rounded once (torch
 * rounds after each add: results at most 1 ulp apart). Returns 0; -1 out of memory; -2 a bad
 * expert map. */
int moed_moe_bf16(const bf16 *x, long T, long H, const bf16 *router, long E, long k, int norm_topk,
                  const int64_t *l2p, long max_rep, const int64_t *nrep, long offset, int64_t *load,
                  const bf16 *gate_up, const bf16 *down, long P, long I, bf16 *out, int nthreads) {
    const long rows = T * k;
    const long ldl = nblocks(E) * NB, ldg = nblocks(2 * I) * NB, ldh = nblocks(H) * NB;
    const long gu_stride = ldg * H, down_stride = ldh * I;     /* packed elements per expert */
    float *logits = malloc(sizeof(float) * T * ldl);
    long *ids = malloc(sizeof(long) * rows), *phys = malloc(sizeof(long) * rows);
    float *wts = malloc(sizeof(float) * rows);
    long *count = calloc(P + 1, sizeof(long)), *fill = malloc(sizeof(long) * (P + 1));
    long *order = malloc(sizeof(long) * rows);     /* (t, j) slots sorted by physical expert */
    bf16 *xs = malloc(sizeof(bf16) * rows * H);     /* gathered inputs, grouped by expert */
    float *gu = malloc(sizeof(float) * rows * ldg);
    bf16 *act = malloc(sizeof(bf16) * rows * I);
    float *ys = malloc(sizeof(float) * rows * ldh);
    float *acc = calloc(T * H, sizeof(float));
    int rc = 0;
    if (!logits || !ids || !phys || !wts || !count || !fill || !order || !xs || !gu || !act || !ys || !acc) {
        rc = -1;
        goto done;
    }
#pragma omp parallel num_threads(nthreads)
    {
        long b0, b1;
        split(nblocks(E), omp_get_thread_num(), omp_get_num_threads(), &b0, &b1);
        gemm_packed(x, T, H, router, H, b0, b1, logits, ldl);
    }
    if (route(logits, ldl, T, E, k, norm_topk, ids, wts)) { rc = -1; goto done; }
    if ((rc = map_slots(ids, rows, E, l2p, max_rep, nrep, offset, P, (int64_t *)phys, load))) goto done;
    for (long s = 0; s < rows; s++) count[phys[s] + 1]++;
    for (long e = 0; e < P; e++) count[e + 1] += count[e];   /* count[e] = first slot of e */
    memcpy(fill, count, sizeof(long) * P);
    for (long s = 0; s < rows; s++) order[fill[phys[s]]++] = s;
    for (long i = 0; i < rows; i++) memcpy(xs + i * H, x + (order[i] / k) * H, sizeof(bf16) * H);

#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        long lo, hi, b0, b1;
        for (long e = 0; e < P; e++) {       /* every thread walks the same experts in step */
            const long s0 = count[e], n = count[e + 1] - s0;
            if (n == 0) continue;
            split(nblocks(2 * I), tid, nt, &b0, &b1);
            gemm_packed(xs + s0 * H, n, H, gate_up + e * gu_stride, H, b0, b1, gu + s0 * ldg, ldg);
#pragma omp barrier
            split(n, tid, nt, &lo, &hi);        /* activation: rows split, 16 lanes at a time */
            for (long r = s0 + lo; r < s0 + hi; r++) silu_mul_row(gu + r * ldg, I, act + r * I);
#pragma omp barrier
            split(nblocks(H), tid, nt, &b0, &b1);
            gemm_packed(act + s0 * I, n, I, down + e * down_stride, I, b0, b1, ys + s0 * ldh, ldh);
            /* no barrier: the next expert writes other rows of gu/act/ys, and this thread's ys
             * columns are read back below only by itself */
        }
        /* Scatter: each thread owns the hidden columns its down blocks cover, of every token,
         * so no two threads add into one element. */
        split_cols(H, tid, nt, &lo, &hi);
        for (long i = 0; i < rows; i++) {
            const long s = order[i], t = s / k;
            const float w = wts[s];
            for (long h = lo; h < hi; h++) acc[t * H + h] += round_bf16(round_bf16(ys[i * ldh + h]) * w);
        }
#pragma omp barrier
        split(T * H, tid, nt, &lo, &hi);
        for (long f = lo; f < hi; f++) out[f] = f32_to_bf16(acc[f]);
    }
done:
    free(logits); free(ids); free(phys); free(wts); free(count); free(fill); free(order);
    free(xs); free(gu); free(act); free(ys); free(acc);
    return rc;
}

/* Expert parallelism splits moed_moe_bf16 in two around the token exchange, with the same
 * arithmetic, so an EP group's output equals one process's bit for bit:
 * moed_route_bf16 is its router half (logits, top-k, expert map, load count) -> physical slot
 * phys[T][k] and weight wts[T][k] (bf16 values held in fp32) per choice; moed_experts_bf16 its
 * expert half on rows already grouped by local slot (count[e] rows of slot e, in slot order):
 * out[r] = bf16(down_e(silu(gate_e(x_r)) * up_e(x_r))). The caller multiplies each row by its
 * weight in bf16 and sums a token's k rows in fp32 in ascending slot order, as the fused scatter
 * does. Both return 0; -1 out of memory; -2 a bad expert map. */
int moed_route_bf16(const bf16 *x, long T, long H, const bf16 *router, long E, long k, int norm_topk,
                    const int64_t *l2p, long max_rep, const int64_t *nrep, long offset, int64_t *load,
                    long P, int64_t *phys, float *wts, int nthreads) {
    const long rows = T * k, ldl = nblocks(E) * NB;
    float *logits = malloc(sizeof(float) * (T * ldl + 1));
    long *ids = malloc(sizeof(long) * (rows + 1));
    int rc = 0;
    if (!logits || !ids) { rc = -1; goto done; }
#pragma omp parallel num_threads(nthreads)
    {
        long b0, b1;
        split(nblocks(E), omp_get_thread_num(), omp_get_num_threads(), &b0, &b1);
        gemm_packed(x, T, H, router, H, b0, b1, logits, ldl);
    }
    if (route(logits, ldl, T, E, k, norm_topk, ids, wts)) { rc = -1; goto done; }
    rc = map_slots(ids, rows, E, l2p, max_rep, nrep, offset, P, phys, load);
done:
    free(logits); free(ids);
    return rc;
}

int moed_experts_bf16(const bf16 *xs, long R, long H, const int64_t *count_in, const bf16 *gate_up,
                      const bf16 *down, long P, long I, bf16 *out, int nthreads) {
    const long ldg = nblocks(2 * I) * NB, ldh = nblocks(H) * NB;
    const long gu_stride = ldg * H, down_stride = ldh * I;
    long *count = malloc(sizeof(long) * (P + 1));      /* count[e] = first row of slot e */
    float *gu = malloc(sizeof(float) * (R * ldg + 1));
    bf16 *act = malloc(sizeof(bf16) * (R * I + 1));
    float *ys = malloc(sizeof(float) * (R * ldh + 1));
    int rc = 0;
    if (!count || !gu || !act || !ys) { rc = -1; goto done; }
    count[0] = 0;
    for (long e = 0; e < P; e++) {
        if (count_in[e] < 0) { rc = -2; goto done; }
        count[e + 1] = count[e] + count_in[e];
    }
    if (count[P] != R) { rc = -2; goto done; }
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        long lo, hi, b0, b1;
        for (long e = 0; e < P; e++) {       /* the expert loop of moed_moe_bf16 */
            const long s0 = count[e], n = count[e + 1] - s0;
            if (n == 0) continue;
            split(nblocks(2 * I), tid, nt, &b0, &b1);
            gemm_packed(xs + s0 * H, n, H, gate_up + e * gu_stride, H, b0, b1, gu + s0 * ldg, ldg);
#pragma omp barrier
            split(n, tid, nt, &lo, &hi);
            for (long r = s0 + lo; r < s0 + hi; r++) silu_mul_row(gu + r * ldg, I, act + r * I);
#pragma omp barrier
            split(nblocks(H), tid, nt, &b0, &b1);
            gemm_packed(act + s0 * I, n, I, down + e * down_stride, I, b0, b1, ys + s0 * ldh, ldh);
        }
        split_cols(H, tid, nt, &lo, &hi);      /* the columns this thread's down blocks wrote */
        for (long r = 0; r < R; r++)
            for (long h = lo; h < hi; h++) out[r * H + h] = f32_to_bf16(ys[r * ldh + h]);
    }
done:
    free(count); free(gu); free(act); free(ys);
    return rc;
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

/* Decode attention over the paged cache: one query token per sequence, all its cached keys.
 * q [B][Hq][D] (row stride q_stride elements between tokens, heads contiguous); cache: this
 * layer's [num_blocks][2][bs][Hkv][D] (K at half 0, V at half 1); tables [B][max_blocks] block
 * ids (< num_blocks); lens [B] tokens to attend (the new one included, already written);
 * out [B][Hq][D].
 * GQA: query head g*G.. of kv head g. Rounding follows the torch reference path: q.k in fp32,
 * rounded to bf16 (a bf16 matmul), then scale*s in fp32, softmax in fp32, probabilities rounded
 * to bf16, p.v accumulated in fp32 and rounded once. D is 32, 64, 128 or 256. Returns 0;
 * -1 out of memory; -2 bad shapes or block ids. */
/* One (sequence, kv head) of decode attention; D a compile-time constant after inlining, so
 * the per-key loops unroll and independent keys' dot products overlap in the pipeline.
 * kp[l]: K row of position l (V row at kp[l] + v_off); s: G * max_len scores scratch. */
static inline __attribute__((always_inline)) void attn_task(
        const int D, const bf16 *qh, long G, const bf16 **kp, long v_off, long len, long max_len,
        float scale, float *s, bf16 *oh) {
    enum { NC = 8 };                      /* D/32 <= NC */
    const int nc = D / 32, nd = D / 16;
    for (long g = 0; g < G; g++) {        /* scores, 16 keys at a time */
        __m512bh qv[NC];
        for (int c = 0; c < nc; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qh + g * D + 32 * c);
        for (long l0 = 0; l0 < len; l0 += 16) {
            __m512 a[16];
            const long nk = len - l0 < 16 ? len - l0 : 16;
            if (nk == 16) {
                for (int j = 0; j < 16; j++) {
                    a[j] = _mm512_setzero_ps();
                    for (int c = 0; c < nc; c++)
                        a[j] = _mm512_dpbf16_ps(a[j], qv[c], (__m512bh)_mm512_loadu_si512(kp[l0 + j] + 32 * c));
                }
            } else {
                for (int j = 0; j < 16; j++) {
                    a[j] = _mm512_setzero_ps();
                    if (j < nk)
                        for (int c = 0; c < nc; c++)
                            a[j] = _mm512_dpbf16_ps(a[j], qv[c], (__m512bh)_mm512_loadu_si512(kp[l0 + j] + 32 * c));
                }
            }
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
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a0[c], a1[c])));
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
    float *scores = malloc(sizeof(float) * nthreads * G * max_len);
    const bf16 **rows = malloc(sizeof(bf16 *) * nthreads * max_len);
    if (!scores || !rows) { free(scores); free(rows); return -1; }
    const long v_off = bs * Hkv * D;          /* V rows sit one block-half after K rows */
#pragma omp parallel num_threads(nthreads)
    {
        float *s = scores + omp_get_thread_num() * G * max_len;
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
            switch (D) {
                case 32: attn_task(32, qh, G, kp, v_off, len, max_len, scale, s, oh); break;
                case 64: attn_task(64, qh, G, kp, v_off, len, max_len, scale, s, oh); break;
                case 128: attn_task(128, qh, G, kp, v_off, len, max_len, scale, s, oh); break;
                default: attn_task(256, qh, G, kp, v_off, len, max_len, scale, s, oh); break;
            }
        }
    }
    free(scores);
    free(rows);
    return 0;
}

static inline __m512 bf16x16_or_zero(const bf16 *p, __mmask16 m) {   /* masked load */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline void store_bf16x16(bf16 *p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __mmask16 lanes(long left) { return left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1); }

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

/* y[r][0..32) = x[r] . block wb for a run-time row count R <= ROW_TILE (block_rows needs a
 * constant R to keep its accumulators in registers). */
static inline void block_rows_any(long R, const uint32_t *x, long ldx2, const bf16 *wb, long K2, float *y, long ldy) {
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

/* Causal prefill attention of one sequence, blocked over queries: no [n, L] score matrix, only
 * ROW_TILE query rows' scores at a time (one q head, consecutive tokens), so the whole step is
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
    const long tiles = (n + ROW_TILE - 1) / ROW_TILE;
    bf16 *kp = calloc((size_t)Hkv * Lp * D, sizeof(bf16));      /* per head: [Lp/32][D/2][32][2] */
    bf16 *vt = calloc((size_t)Hkv * Lp * D, sizeof(bf16));      /* per head: [D/32][Lp/2][32][2] */
    float *sbuf = malloc(sizeof(float) * nthreads * ROW_TILE * (Lp + D));
    bf16 *pbuf = malloc(sizeof(bf16) * nthreads * ROW_TILE * Lp);
    int rc = 0;
    if (!kp || !vt || !sbuf || !pbuf) { rc = -1; goto done; }
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (long hl = 0; hl < Hkv * nblocks(L); hl++) {          /* pack K_h and V_h^T */
            const long h = hl / nblocks(L), l0 = (hl % nblocks(L)) * NB;
            bf16 *kh = kp + h * Lp * D, *vh = vt + h * Lp * D;
            for (long l = l0; l < l0 + NB && l < L; l++) {
                const bf16 *kr = k + l * kv_stride + h * D, *vr = v + l * kv_stride + h * D;
                for (long d = 0; d < D; d++) {
                    kh[((l / NB) * D2 + d / 2) * 2 * NB + (l % NB) * 2 + d % 2] = kr[d];
                    vh[((d / NB) * (Lp / 2) + l / 2) * 2 * NB + (d % NB) * 2 + l % 2] = vr[d];
                }
            }
        }
        float *s = sbuf + omp_get_thread_num() * ROW_TILE * (Lp + D), *o = s + ROW_TILE * Lp;
        bf16 *p = pbuf + omp_get_thread_num() * ROW_TILE * Lp;
#pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < Hq * tiles; task++) {
            /* late tiles (most keys) first: dynamic scheduling then ends with the small ones */
            const long qh = task % Hq, tile = tiles - 1 - task / Hq, h = qh / G;
            const long t0 = tile * ROW_TILE, R = n - t0 < ROW_TILE ? n - t0 : ROW_TILE;
            const long kb = nblocks(start + t0 + R);                /* key blocks any row sees */
            const uint32_t *xq = (const uint32_t *)(q + t0 * q_stride + qh * D);
            for (long b = 0; b < kb; b++)
                block_rows_any(R, xq, q_stride / 2, kp + h * Lp * D + b * NB * D, D2, s + b * NB, Lp);
            float inv[ROW_TILE];
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
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), vi)));
            }
        }
    }
done:
    free(kp); free(vt); free(sbuf); free(pbuf);
    return rc;
}
