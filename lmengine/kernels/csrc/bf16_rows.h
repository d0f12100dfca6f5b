// Rows of bfloat16 ops shared by bf16_ops.cpp and w8a8_ops.cpp: the conversions, and the
// RMSNorm and SwiGLU rows that round to bfloat16 where transformers' eager bfloat16 ops round.
// bfloat16 values are handled as their uint16_t bits (vectorisable).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_math.h"

#if defined(__AVX512F__)
// bf16(silu(g)) for each of the 65,536 bfloat16 values g, indexed by g's bits (65,537 entries:
// the gather below reads 4 bytes at each index). bf16_ops.cpp builds it once with
// silu_bf16x16, so a table entry has the very bits the formula gives for its gate.
const uint16_t* silu_bf16_table();
#endif

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

#if defined(__AVX512F__)
// 16 bfloat16 -> 16 float32 (a 16-bit shift of each)
inline v16f load_bf16x16(const uint16_t* p) {
  const __m512i wide =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<v16f>(_mm512_slli_epi32(wide, 16));
}

// 16 float32 -> bfloat16 bits, exactly as to_bf16 (round to nearest even, NaN kept quiet).
// With AVX512-BF16, vcvtneps2bf16 rounds the same way in one instruction but flushes
// denormals to zero: it serves every vector without a denormal lane (one vfpclassps tells),
// the integer rounding below the rest. The integer form took 7 of the ~45 vector operations
// of a SwiGLU element, on the two ports that run 512-bit operations.
#if defined(__AVX512BF16__)
// No lane of f is a denormal (vfpclassps category 0x20): vcvtneps2bf16 rounds it as to_bf16.
inline bool no_denormal16(v16f f) {
  return _mm512_fpclass_ps_mask(reinterpret_cast<__m512>(f), 0x20) == 0;
}
#endif

inline __m512i bf16_bits16(v16f f) {
#if defined(__AVX512BF16__)
  if (no_denormal16(f))
    return _mm512_cvtepu16_epi32(
        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(f))));
#endif
  const __m512i bits = reinterpret_cast<__m512i>(f);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(reinterpret_cast<__m512>(f),
                                           reinterpret_cast<__m512>(f), _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(rounded, nan, high, _mm512_set1_epi32(0x40));
}

inline void store_bf16x16(uint16_t* p, v16f f) {
#if defined(__AVX512BF16__)
  if (no_denormal16(f)) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(f))));
    return;
  }
#endif
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(f)));
}

// round_bf16 on 16 lanes: the value once stored as bfloat16
inline v16f round_bf16x16(v16f f) {
  return reinterpret_cast<v16f>(_mm512_slli_epi32(bf16_bits16(f), 16));
}
#endif

// transformers' LlamaRMSNorm on a bfloat16 row: src = bf16(residual + x) (the decoder layer's
// bfloat16 add, written to `summed`) or x; out = bf16(weight * bf16(src * rsqrt(mean(src^2) +
// eps))), the mean over float32 values. Written with AVX-512 vectors where the build has them
// (GCC's `omp simd` form compiles to 8 lanes and ran at a third of the speed), the `omp simd`
// loops for the rest of the row and for other builds.
inline void rms_norm_row_bf16(const uint16_t* x, const uint16_t* residual, uint16_t* summed,
                              const uint16_t* weight, float eps, int64_t k, uint16_t* out) {
  const uint16_t* src = x;
  int64_t i0 = 0;
  if (residual != nullptr) {
#if defined(__AVX512F__)
    for (; i0 + 16 <= k; i0 += 16)
      store_bf16x16(summed + i0, load_bf16x16(residual + i0) + load_bf16x16(x + i0));
#endif
#pragma omp simd
    for (int64_t i = i0; i < k; ++i) summed[i] = to_bf16(to_f32(residual[i]) + to_f32(x[i]));
    src = summed;
  }
  float ss = 0.0f;
  i0 = 0;
#if defined(__AVX512F__)
  v16f acc = {};
  for (; i0 + 16 <= k; i0 += 16) {
    const v16f v = load_bf16x16(src + i0);
    acc += v * v;
  }
  ss = hsum16(acc);
#endif
  for (int64_t i = i0; i < k; ++i) ss += to_f32(src[i]) * to_f32(src[i]);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(k) + eps);
  i0 = 0;
#if defined(__AVX512F__)
  for (; i0 + 16 <= k; i0 += 16)
    store_bf16x16(out + i0,
                  load_bf16x16(weight + i0) * round_bf16x16(load_bf16x16(src + i0) * r));
#endif
#pragma omp simd
  for (int64_t i = i0; i < k; ++i) out[i] = to_bf16(to_f32(weight[i]) * round_bf16(to_f32(src[i]) * r));
}

// silu of 16 bfloat16 values as float32, the way SwiGLU computes it: g / (1 + exp(-g)), with
// exp16 (2 ulp) and recip16 (~1 ulp), rounded to bfloat16 as torch's bfloat16 silu rounds
#if defined(__AVX512F__)
inline v16f silu_bf16x16(v16f g) {
  const v16f one = v16f{} + 1.0f;
  return round_bf16x16(g * recip16(one + exp16(-g)));
}
#endif

// bf16(bf16(silu(gate)) * up): torch's bfloat16 silu rounds before the multiply. With AVX-512
// the rounded silu of each gate value comes from silu_bf16_table (one vpgatherdd for 16 lanes)
// instead of silu_bf16x16 (exp, reciprocal and roundings: some 40 vector operations for 16
// lanes, on the two ports that run 512-bit operations). The same bits; SwiGLU at 2,112 x 1,536
// (SmolLM2's prompt step) 1.03 -> 0.55 ms, where it runs at the memory's speed (Intel Xeon
// family 6 model 167, 2 threads, 2026-12-04).
inline void silu_mul_row_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* act, int64_t n) {
#if defined(__AVX512F__)
  const uint16_t* silu = silu_bf16_table();
  int64_t i0 = 0;
  for (; i0 + 16 <= n; i0 += 16) {
    const __m512i g =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gate + i0)));
    // entry g is the low half of the 4 bytes at silu + g; shifted up it is a float32
    const __m512i s = _mm512_slli_epi32(_mm512_i32gather_epi32(g, silu, 2), 16);
    store_bf16x16(act + i0, reinterpret_cast<v16f>(s) * load_bf16x16(up + i0));
  }
  for (int64_t i = i0; i < n; ++i) act[i] = to_bf16(to_f32(silu[gate[i]]) * to_f32(up[i]));
#else
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = to_f32(gate[i]);
    act[i] = to_bf16(round_bf16(g / (1.0f + exp_approx(-g))) * to_f32(up[i]));
  }
#endif
}

}  // namespace
