/* Scalar bf16 <-> fp32, the one copy every kernel source includes (the vector forms live beside
 * their ISA code). Round to nearest even; a NaN stays a NaN (quiet bit set, as torch rounds). */
#ifndef MOED_CPU_BF16_SCALAR_H
#define MOED_CPU_BF16_SCALAR_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#endif
