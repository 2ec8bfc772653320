/* A whole decode step in one call (moed_decode_step; the caller is moed/model/decode_step.py).
 *
 * B sequences, one new token each, through every layer of a GQA MoE decoder and the lm_head:
 * the same kernels, in the same order, on the same inputs as the layer-by-layer path
 * (decoder.py's DecoderLayer, layers.AttentionBlock and Linear, moe.MoELayer,
 * attention/torch_backend.py), so the logits, the KV written and the expert-load counts are
 * bitwise the same. What it saves is the Python and torch glue between those calls (~30 small
 * ops and 6 ctypes calls a layer: ~0.25 ms a layer on the 2-core bench, as much as a batch-1
 * layer's weights take to stream).
 *
 * Per layer:  x, h = rms_norm(h + delta)        (delta: the previous layer's MoE output)
 *             qkv = x Wqkv^T (+ b);  q, k = rope(qk_norm(qkv's q, k heads));  v = qkv's v heads
 *             cache[block of pos][K|V][pos % bs] = k, v;  a = attention over positions 0..pos
 *             x, h = rms_norm(h + a Wo^T (+ b));  delta = moe(x)
 * then logits = fp32(rms_norm(h + delta) Wlm^T).
 *
 * Each projection (qkv, o, lm_head) is a DecodeProj and each MoE layer a DecodeMoE: which kernel
 * the layered path calls for that weight, with the arguments it passes. bf16 weights: cpu_bf16.c's
 * moed_linear_bf16 on the packed copy, moed_moe_bf16. Quantized (int8, int4, fp8, as stored):
 * cpu_quant.c's moed_qlinear, or cpu_qdot.c's moed_qdot_linear where the model runs int8
 * activations (kernels/quant.py linear_act), bf16 in and out, the bias in fp32; the experts
 * through moed_moe_q_routed (the bf16 router in front, few-row mode, int8 activations per
 * experts_act). The caller decides each kind with the same functions the layered path decides
 * it with, and serves only the row counts where that path takes these kernels.
 *
 * Compiled into the kernels' .so with cpu_bf16.c, cpu_quant.c and cpu_qdot.c (once per ISA
 * variant; no vector code here). */
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

/* the kernels the step strings together (cpu_bf16.c, cpu_quant.c, cpu_qdot.c) */
void moed_rms_norm_bf16(const bf16 *x, const bf16 *add, bf16 *resid_out, long R, long D,
                        const bf16 *weight, float eps, bf16 *out, int nthreads);
void moed_qk_norm_rope_bf16(const bf16 *qkv, long T, long row_stride, long H, long D,
                            const bf16 *weight, float eps, const bf16 *cos, const bf16 *sin,
                            bf16 *out, int nthreads);
int moed_decode_attn_bf16(const bf16 *q, long q_stride, long B, long Hq, long Hkv, long D,
                          const bf16 *cache, long num_blocks, long bs, const int64_t *tables,
                          long max_blocks, const int64_t *lens, float scale, bf16 *out, int nthreads);
int moed_linear_bf16(const bf16 *x, long R, long K, const bf16 *wp, long N, const bf16 *bias,
                     bf16 *out, int nthreads);
int moed_moe_bf16(const bf16 *x, long T, long H, const bf16 *router, long E, long k, int norm_topk,
                  const int64_t *l2p, long max_rep, const int64_t *nrep, long offset, int64_t *load,
                  const bf16 *gate_up, const bf16 *down, long P, long I, bf16 *out, int nthreads);
int moed_qlinear(const void *x_in, int x_f32, long R, long K, int fmt, const uint8_t *w, long ldw,
                 const float *s, long lds, const uint8_t *z, long ldz, long group, long N,
                 const float *bias, void *out, int out_f32, int nthreads);
int moed_qdot_linear(const void *x_in, int x_f32, long R, long K, int fmt, const uint8_t *w, long ldw,
                     const float *s, long lds, const uint8_t *z, long ldz, long group, long N,
                     const float *bias, void *out, int out_f32, int nthreads);
int moed_moe_q_routed(const uint16_t *x, long T, long H, const uint16_t *router, long E, long k, int norm_topk,
                      const int64_t *l2p, long max_rep, const int64_t *nrep, long offset, int64_t *load,
                      int fmt, long P, long I, const void *const gptr[3], const long gdim[7],
                      const void *const dptr[3], const long ddim[7], uint16_t *out, int blocked, int qact,
                      int nthreads);
void moed_argmax_f32(const float *x, long B, long V, int64_t *out, int nthreads);

/* A projection's weight and the kernel the layered path reads it with. */
enum { PROJ_BF16 = 0, PROJ_QLINEAR = 1, PROJ_QDOT = 2 };
typedef struct {
    int kind;                  /* PROJ_*: moed_linear_bf16, moed_qlinear, moed_qdot_linear */
    int fmt;                   /* quantized: 0 int8, 1 int4, 2 fp8 (cpu_quant.c's codes) */
    const void *w;             /* bf16: packed P32 from [N][K]; quantized: codes [N][ldw] */
    const float *s;            /* quantized: scales [N][lds] */
    const uint8_t *z;          /* quantized: zero points [N][ldz], or NULL (symmetric) */
    long ldw, lds, ldz, group;
    const void *bias;          /* [N] or NULL: bf16 (PROJ_BF16), fp32 (quantized) */
} DecodeProj;

/* An MoE layer's experts and the kernel the layered path runs them with. */
enum { MOE_BF16 = 0, MOE_Q = 1 };
typedef struct {
    int kind;                  /* MOE_BF16: moed_moe_bf16; MOE_Q: moed_moe_q_routed */
    int fmt, qact;             /* MOE_Q: format, int8 activations (1) or not */
    const void *gptr[3];       /* bf16: [0] gate_up packed [P][2I][H]; quantized: {codes, scales, zeros} */
    const void *dptr[3];       /* bf16: [0] down packed [P][H][I]; quantized: as gptr */
    long gdim[7], ddim[7];     /* MOE_Q: strides and group (cpu_quant.c's expert_mat) */
} DecodeMoE;

typedef struct {
    const bf16 *input_norm, *post_norm;       /* [H] */
    DecodeProj qkv;                           /* [(Hq + 2 Hkv) D][H] */
    const bf16 *qk_norm;                      /* [Hq + Hkv][D], or NULL: no q/k norm */
    DecodeProj o;                             /* [H][Hq D] */
    bf16 *kv;                                 /* this layer's cache [num_blocks][2][bs][Hkv][D] */
    const bf16 *router;                       /* packed from [E][H] */
    const int64_t *l2p, *nrep;                /* expert map [E][max_rep], replicas [E] */
    long max_rep;
    int64_t *load;                            /* [E], tokens routed per expert (added to) */
    DecodeMoE moe;
    long P;                                   /* physical expert slots */
} DecodeLayer;

typedef struct {
    long L, H, Hq, Hkv, D, E, k, I, vocab, num_blocks, bs;
    int norm_topk;
    float eps, scale;
    const bf16 *embed, *norm;                 /* [vocab][H], [H] */
    DecodeProj lm_head;                       /* [vocab][H], no bias */
    const DecodeLayer *layers;                /* [L] */
} DecodeModel;

/* out [R][N] bf16 = x [R][K] bf16 @ W^T (+ bias), by the projection's kernel. */
static int project(const DecodeProj *p, const bf16 *x, long R, long K, long N, bf16 *out, int nthreads) {
    switch (p->kind) {
    case PROJ_BF16:
        return moed_linear_bf16(x, R, K, (const bf16 *)p->w, N, (const bf16 *)p->bias, out, nthreads);
    case PROJ_QLINEAR:
        return moed_qlinear(x, 0, R, K, p->fmt, (const uint8_t *)p->w, p->ldw, p->s, p->lds, p->z, p->ldz,
                            p->group, N, (const float *)p->bias, out, 0, nthreads);
    case PROJ_QDOT:
        return moed_qdot_linear(x, 0, R, K, p->fmt, (const uint8_t *)p->w, p->ldw, p->s, p->lds, p->z, p->ldz,
                                p->group, N, (const float *)p->bias, out, 0, nthreads);
    }
    return -2;
}

/* delta [B][H] = the MoE layer's output for x [B][H], by its kernel. */
static int experts(const DecodeModel *m, const DecodeLayer *ly, const bf16 *x, long B, long offset, bf16 *delta,
                   int nthreads) {
    const DecodeMoE *e = &ly->moe;
    switch (e->kind) {
    case MOE_BF16:
        return moed_moe_bf16(x, B, m->H, ly->router, m->E, m->k, m->norm_topk, ly->l2p, ly->max_rep, ly->nrep,
                             offset, ly->load, (const bf16 *)e->gptr[0], (const bf16 *)e->dptr[0], ly->P, m->I,
                             delta, nthreads);
    case MOE_Q:
        return moed_moe_q_routed(x, B, m->H, ly->router, m->E, m->k, m->norm_topk, ly->l2p, ly->max_rep, ly->nrep,
                                 offset, ly->load, e->fmt, ly->P, m->I, e->gptr, e->gdim, e->dptr, e->ddim, delta,
                                 0, e->qact, nthreads);
    }
    return -2;
}

/* Bytes of scratch moed_decode_step needs for B sequences (the caller keeps one buffer, so a
 * step allocates nothing of its own: fresh pages for the [B][vocab] logits cost ~0.3 ms at
 * batch 8; the quantized kernels allocate their small per-call buffers themselves). */
static long step_scratch(const DecodeModel *m, long B, long offs[8]) {
    const long nqk = (m->Hq + m->Hkv) * m->D, nqkv = (m->Hq + 2 * m->Hkv) * m->D;
    const long sizes[8] = {B * m->H, B * m->H, B * m->H, B * nqkv, B * nqk, B * m->Hq * m->D, 2 * B * m->D,
                           B * m->vocab};
    long off = 0;
    for (int i = 0; i < 8; i++) {
        if (offs) offs[i] = off;
        off += (sizes[i] * (long)sizeof(bf16) + 63) / 64 * 64;      /* each part on its own lines */
    }
    return off;
}

long moed_decode_step_scratch(const DecodeModel *m, long B) { return step_scratch(m, B, NULL); }

/* Where in the scratch the final norm's output x [B][H] bf16 is: a step called with logits NULL
 * stops there, for a caller whose lm_head runs elsewhere (oneDNN won its row class, or a
 * quantized head past its few-row kernel). */
long moed_decode_step_hidden_offset(const DecodeModel *m, long B) {
    long offs[8];
    step_scratch(m, B, offs);
    return offs[2];
}

/* ids, pos [B]; tables [B][max_blocks] (sequence b's blocks, covering positions 0..pos[b]);
 * offsets [L]: each layer's replica-split offset (moed_moe_bf16's); cos, sin: the rotary tables
 * [> max pos][D]; scratch: moed_decode_step_scratch(m, B) bytes, 64-byte aligned; logits
 * [B][vocab] fp32, or NULL: stop after the final norm, its output at
 * moed_decode_step_hidden_offset in the scratch; argmax [B] (or NULL): each row's moed_argmax_f32,
 * taken while the logits are in cache (the sampler's greedy pick otherwise reads them back
 * after the step). Returns 0; -1 out of memory; -2 a bad token id, block id or table (checked
 * before anything is written), a bad expert map (as moed_moe_bf16) or a weight its kernel
 * refuses. */
int moed_decode_step(const DecodeModel *m, long B, const int64_t *ids, const int64_t *pos,
                     const int64_t *tables, long max_blocks, const int64_t *offsets,
                     const bf16 *cos, const bf16 *sin, void *scratch, float *logits,
                     int64_t *argmax, int nthreads) {
    const long H = m->H, D = m->D, Hq = m->Hq, Hkv = m->Hkv, bs = m->bs;
    const long nqk = (Hq + Hkv) * D, nqkv = (Hq + 2 * Hkv) * D;
    for (long b = 0; b < B; b++) {
        const long blk = pos[b] / bs;
        if (pos[b] < 0 || blk >= max_blocks || ids[b] < 0 || ids[b] >= m->vocab) return -2;
        for (long j = 0; j <= blk; j++)
            if (tables[b * max_blocks + j] < 0 || tables[b * max_blocks + j] >= m->num_blocks) return -2;
    }
    bf16 *part[8];
    long offs[8];
    step_scratch(m, B, offs);
    for (int i = 0; i < 8; i++) part[i] = (bf16 *)((char *)scratch + offs[i]);
    bf16 *h = part[0], *delta = part[1], *x = part[2], *qkv = part[3], *qk = part[4], *att = part[5];
    bf16 *cs = part[6], *lg = part[7];
    int64_t lens[B];
    int rc = 0;
    for (long b = 0; b < B; b++) {
        lens[b] = pos[b] + 1;
        memcpy(h + b * H, m->embed + ids[b] * H, sizeof(bf16) * H);
        memcpy(cs + b * D, cos + pos[b] * D, sizeof(bf16) * D);          /* the tokens' rows */
        memcpy(cs + (B + b) * D, sin + pos[b] * D, sizeof(bf16) * D);
    }
    for (long l = 0; l < m->L; l++) {
        const DecodeLayer *ly = m->layers + l;
        moed_rms_norm_bf16(h, l ? delta : NULL, h, B, H, ly->input_norm, m->eps, x, nthreads);
        if ((rc = project(&ly->qkv, x, B, H, nqkv, qkv, nthreads))) goto done;
        moed_qk_norm_rope_bf16(qkv, B, nqkv, Hq + Hkv, D, ly->qk_norm, m->eps, cs, cs + B * D, qk, nthreads);
        for (long b = 0; b < B; b++) {      /* the new token's K and V into its block */
            bf16 *slot = ly->kv + (tables[b * max_blocks + pos[b] / bs] * 2 * bs + pos[b] % bs) * Hkv * D;
            memcpy(slot, qk + b * nqk + Hq * D, sizeof(bf16) * Hkv * D);
            memcpy(slot + bs * Hkv * D, qkv + b * nqkv + nqk, sizeof(bf16) * Hkv * D);
        }
        if ((rc = moed_decode_attn_bf16(qk, nqk, B, Hq, Hkv, D, ly->kv, m->num_blocks, bs, tables,
                                        max_blocks, lens, m->scale, att, nthreads))) goto done;
        if ((rc = project(&ly->o, att, B, Hq * D, H, delta, nthreads))) goto done;
        moed_rms_norm_bf16(h, delta, h, B, H, ly->post_norm, m->eps, x, nthreads);
        if ((rc = experts(m, ly, x, B, offsets[l], delta, nthreads))) goto done;
    }
    moed_rms_norm_bf16(h, m->L ? delta : NULL, h, B, H, m->norm, m->eps, x, nthreads);
    if (!logits) goto done;     /* the caller runs lm_head on x */
    if ((rc = project(&m->lm_head, x, B, H, m->vocab, lg, nthreads))) goto done;
    /* bf16 -> fp32, exact (torch's .float()); a shift the compiler vectorizes (the memcpy form
     * did not: 31-41 us of a batch-1 int4 step at a vocabulary of 32000, Zen4 AVX2) */
    uint32_t *bits = (uint32_t *)logits;
    const long nl = B * m->vocab;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nl >= 1L << 18)
    for (long i = 0; i < nl; i++) bits[i] = (uint32_t)lg[i] << 16;
    if (argmax) moed_argmax_f32(logits, B, m->vocab, argmax, nthreads);
done:
    return rc;
}
