/* Which summation order AMX's TDPBF16PS follows, against the one the native kernels share
 * (per fp32 lane: + a_odd*b_odd, then + a_even*b_even, each an FMA, k pairs in order: what
 * vdpbf16ps does and cpu_avx2.h reproduces). Run on an AMX CPU (Linux >= 5.16):
 *
 *     gcc -O2 -mamx-tile -mamx-bf16 -mavx512f -ffp-contract=off bench/amx_order_probe.c -o /tmp/p -lm && /tmp/p
 *
 * Prints, over 512k output lanes (half random, half with cancelling 2^16-sized products), how
 * many differ from each candidate order. 2026-12-03, Sapphire Rapids-class Xeon: every candidate
 * differs on 54-70% of lanes (the layout is right: the rest agree to the bit), so an AMX matmul
 * cannot be bitwise equal to the native variants: it would join the start-up race as oneDNN
 * does (within an ulp, not bitwise). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct { uint8_t palette, start_row, res[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) TileCfg;

static float b2f(uint16_t v) { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t f2b(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return u >> 16; }
static float rnd(void) { return (float)rand() / RAND_MAX * 2 - 1; }
static int differ(float a, float b) { return memcmp(&a, &b, 4) != 0; }

enum { ODD_FIRST, EVEN_FIRST, PAIR_THEN_ADD, ALL_EXACT_ONCE, PRODUCTS_EXACT_THEN_C, PAIR_EXACT_CHAIN, ORDERS };
static const char *names[ORDERS] = {"odd-first FMA chain (the native kernels')", "even-first FMA chain",
                                    "pair sum then add", "all exact, rounded once", "products exact, then + C",
                                    "each pair exact, added in order"};

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
        printf("no AMX here (or the kernel refuses tile data)\n");
        return 1;
    }
    TileCfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 3; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    long n = 0, bad[ORDERS] = {0};
    srand(3);
    for (int it = 0; it < 2000; it++) {
        uint16_t A[16][32], B[16][32];              /* A [m][k], B [k pair][n][2] */
        float C[16][16], C0[16][16];
        const int hard = it & 1;                    /* cancelling big products every third pair */
        for (int m = 0; m < 16; m++)
            for (int k = 0; k < 32; k++) A[m][k] = f2b(hard && (k / 2) % 3 == 0 ? 16.f : rnd() * 4);
        for (int kp = 0; kp < 16; kp++)
            for (int c = 0; c < 16; c++) {
                const float s = 4096.f * (1 + (float)rand() / RAND_MAX);
                B[kp][2 * c + 1] = f2b(hard && kp % 3 == 0 ? s : rnd());
                B[kp][2 * c] = f2b(hard && kp % 3 == 0 ? -b2f(B[kp][2 * c + 1]) : rnd());
            }
        for (int m = 0; m < 16; m++)
            for (int c = 0; c < 16; c++) C0[m][c] = C[m][c] = rnd();
        _tile_loadd(0, C, 64);
        _tile_loadd(1, A, 64);
        _tile_loadd(2, B, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, C, 64);
        for (int m = 0; m < 16; m++)
            for (int c = 0; c < 16; c++, n++) {
                float o = C0[m][c], e = o, p = o, q = o;
                double all = o, prods = 0;
                for (int kp = 0; kp < 16; kp++) {
                    const float ao = b2f(A[m][2 * kp + 1]), ae = b2f(A[m][2 * kp]);
                    const float bo = b2f(B[kp][2 * c + 1]), be = b2f(B[kp][2 * c]);
                    o = fmaf(ae, be, fmaf(ao, bo, o));
                    e = fmaf(ao, bo, fmaf(ae, be, e));
                    p = p + (ae * be + ao * bo);
                    const double pair = (double)ae * be + (double)ao * bo;
                    all += pair;
                    prods += pair;
                    q = (float)((double)q + pair);
                }
                const float got = C[m][c];
                bad[ODD_FIRST] += differ(o, got);
                bad[EVEN_FIRST] += differ(e, got);
                bad[PAIR_THEN_ADD] += differ(p, got);
                bad[ALL_EXACT_ONCE] += differ((float)all, got);
                bad[PRODUCTS_EXACT_THEN_C] += differ(C0[m][c] + (float)prods, got);
                bad[PAIR_EXACT_CHAIN] += differ(q, got);
            }
    }
    _tile_release();
    printf("%ld lanes; differing from TDPBF16PS:\n", n);
    for (int i = 0; i < ORDERS; i++) printf("  %-42s %6ld (%.1f%%)\n", names[i], bad[i], 100.0 * bad[i] / n);
    return 0;
}
