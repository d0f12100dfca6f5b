// Rows of bfloat16 ops shared by bf16_ops.cpp and w8a8_ops.cpp: the conversions, and the
// RMSNorm and SwiGLU rows that round to bfloat16 where transformers' eager bfloat16 ops round.
// bfloat16 values are handled as their uint16_t bits (vectorisable).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_math.h"

namespace {

// bfloat16 -> float32 and back (round to nearest even, NaN kept), vectorisable
#pragma omp declare simd notinbranch
inline float to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#pragma omp declare simd notinbranch
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>((bits >> 16) | 0x40u) : static_cast<uint16_t>(rounded);
}

// The value a float32 takes once stored as bfloat16 (the rounding between two eager ops)
#pragma omp declare simd notinbranch
inline float round_bf16(float f) { return to_f32(to_bf16(f)); }

// transformers' LlamaRMSNorm on a bfloat16 row: src = bf16(residual + x) (the decoder layer's
// bfloat16 add, written to `summed`) or x; out = bf16(weight * bf16(src * rsqrt(mean(src^2) +
// eps))), the mean over float32 values.
inline void rms_norm_row_bf16(const uint16_t* x, const uint16_t* residual, uint16_t* summed,
                              const uint16_t* weight, float eps, int64_t k, uint16_t* out) {
  const uint16_t* src = x;
  if (residual != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) summed[i] = to_bf16(to_f32(residual[i]) + to_f32(x[i]));
    src = summed;
  }
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < k; ++i) ss += to_f32(src[i]) * to_f32(src[i]);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(k) + eps);
#pragma omp simd
  for (int64_t i = 0; i < k; ++i) out[i] = to_bf16(to_f32(weight[i]) * round_bf16(to_f32(src[i]) * r));
}

// bf16(bf16(silu(gate)) * up): torch's bfloat16 silu rounds before the multiply
inline void silu_mul_row_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* act, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = to_f32(gate[i]);
    act[i] = to_bf16(round_bf16(g / (1.0f + exp_approx(-g))) * to_f32(up[i]));
  }
}

}  // namespace
