/* The AVX512 build of cpu_bf16.c for CPUs with AVX512F/BW/VL but no AVX512-BF16 (Skylake-SP,
 * Cascade Lake, Ice Lake: most Intel cloud VMs). Every 512-bit intrinsic is the real one; only
 * the two bf16 instructions are done another way, with the same arithmetic as cpu_avx2.h, so
 * this variant gives the same bits as the other two (tests/unit/model/test_cpu_isa.py):
 *  - vdpbf16ps (per fp32 lane: acc + odd product, then + even product, each rounded once):
 *    the bf16 pairs widened to fp32 odd/even halves (exact: a bf16 is the top half of an fp32),
 *    then two FMAs in that order. cpu_bf16.c widens each weight vector once and shares it across
 *    the rows of a tile (block_rows) and widens q once per head (key_dot).
 *  - vcvtneps2bf16 (round to nearest even, NaN quieted, denormal to signed zero): in 32-bit
 *    integer lanes with mask registers, then narrowed by vpmovdw.
 * Included by cpu_bf16.c only when the compiler targets AVX512F without AVX512-BF16. */
#ifndef MOED_CPU_AVX512_H
#define MOED_CPU_AVX512_H

/* The odd (high) and even (low) bf16 of each 32-bit lane, as fp32. */
static inline __m512 bf16_odd_x16(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline __m512 bf16_even_x16(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }

/* vdpbf16ps: acc + a_odd * b_odd, then + a_even * b_even (cpu_avx2.h's dpbf16_x8, 16 lanes). */
static inline __m512 dpbf16_wide(__m512 acc, __m512 ao, __m512 ae, __m512 bo, __m512 be) {
    return _mm512_fmadd_ps(ae, be, _mm512_fmadd_ps(ao, bo, acc));
}

/* vcvtneps2bf16, bit for bit as cpu_avx2.h's cvtne_bits8: NaN -> quiet NaN, denormal (exponent
 * 0) -> signed zero, else round to nearest even; 16 lanes -> 16 bf16. */
static inline __m256i cvtne_bh16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __mmask16 den = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000));
    __m512i out = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    out = _mm512_mask_mov_epi32(out, den, _mm512_srli_epi32(_mm512_and_si512(u, _mm512_set1_epi32((int)0x80000000u)), 16));
    return _mm512_cvtepi32_epi16(out);
}

#endif
