// Vectorisable math, vector types and row helpers shared by the compiled CPU kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Rows per at::parallel_for task for rows of `row_elems` elements: about `elems_per_task`
// elements each, so a decode step's few rows stay on one thread (no fork / join, which costs
// more than the work on a busy machine).
inline int64_t rows_per_task(int64_t row_elems, int64_t elems_per_task) {
  return std::max<int64_t>(1, elems_per_task / std::max<int64_t>(1, row_elems));
}

// Sixteen floats as one vector (one AVX-512 register; two AVX registers elsewhere), GCC's
// vector extensions; and sixteen int32.
typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i32 __attribute__((vector_size(64)));

inline v16f load16(const float* p) { return *reinterpret_cast<const v16f*>(p); }

inline float hsum16(v16f a) {
  typedef float v8f __attribute__((vector_size(32)));
  v8f h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += h[i];
  return s;
}

// One round of a 16 x 16 transpose held in 16 vectors: every 2h x 2h block swaps its two
// off-diagonal h x h blocks (row i takes, in its columns with bit h set, row i + h's columns
// with it clear, and the other way round). Rounds h = 8, 4, 2, 1 transpose the whole block;
// each row pair is two 2-source permutes (one instruction each on AVX-512).
template <int h>
inline void transpose_round(v16f* r) {
  const v16i32 j = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16i32 high = (j & h) != 0;  // -1 where column j has bit h set
  const v16i32 lo = j + (high & (16 - h)), hi = j + h + (high & (16 - h));
  for (int i = 0; i < 16; ++i) {
    if (i & h) continue;
    const v16f a = r[i], b = r[i + h];
    r[i] = __builtin_shuffle(a, b, lo);
    r[i + h] = __builtin_shuffle(a, b, hi);
  }
}

// dst[j][i] = src[i][j] * scale for a 16 x 16 block (rows src_ld and dst_ld floats apart).
inline void transpose16(const float* src, int64_t src_ld, float* dst, int64_t dst_ld,
                        float scale = 1.f) {
  v16f r[16];
  for (int i = 0; i < 16; ++i) r[i] = load16(src + i * src_ld) * scale;
  transpose_round<8>(r);
  transpose_round<4>(r);
  transpose_round<2>(r);
  transpose_round<1>(r);
  for (int i = 0; i < 16; ++i) std::memcpy(dst + i * dst_ld, &r[i], sizeof(v16f));
}

// dst[j][i] = src[i][j] * scale for a rows x cols block: 16 x 16 register transposes where
// both are whole, element by element for the rest.
inline void transpose_block(const float* src, int64_t src_ld, float* dst, int64_t dst_ld,
                            int64_t rows, int64_t cols, float scale = 1.f) {
  const int64_t rows16 = rows / 16 * 16, cols16 = cols / 16 * 16;
  for (int64_t i0 = 0; i0 < rows16; i0 += 16)
    for (int64_t j0 = 0; j0 < cols16; j0 += 16)
      transpose16(src + i0 * src_ld + j0, src_ld, dst + j0 * dst_ld + i0, dst_ld, scale);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = i < rows16 ? cols16 : 0; j < cols; ++j)
      dst[j * dst_ld + i] = src[i * src_ld + j] * scale;
}

// dst[j][i] = src[i][j] for a rows x cols block of 32-bit words (bfloat16 pairs), src rows
// src_ld_bytes apart: the registers' shuffles move the bits untouched (no arithmetic, so every
// pattern, NaN or denormal, arrives as it left).
inline void transpose_bits_block(const void* src_bytes, int64_t src_ld_bytes, uint32_t* dst,
                                 int64_t dst_ld, int64_t rows, int64_t cols) {
  const char* src = static_cast<const char*>(src_bytes);
  auto at = [&](int64_t i, int64_t j) { return src + i * src_ld_bytes + j * 4; };
  const int64_t rows16 = rows / 16 * 16, cols16 = cols / 16 * 16;
  for (int64_t i0 = 0; i0 < rows16; i0 += 16)
    for (int64_t j0 = 0; j0 < cols16; j0 += 16) {
      v16f r[16];
      for (int i = 0; i < 16; ++i) std::memcpy(&r[i], at(i0 + i, j0), sizeof(v16f));
      transpose_round<8>(r);
      transpose_round<4>(r);
      transpose_round<2>(r);
      transpose_round<1>(r);
      for (int j = 0; j < 16; ++j) std::memcpy(dst + (j0 + j) * dst_ld + i0, &r[j], sizeof(v16f));
    }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = i < rows16 ? cols16 : 0; j < cols; ++j)
      std::memcpy(dst + j * dst_ld + i, at(i, j), 4);
}

// exp(x) once x is split as n ln2 + r: the degree-6 polynomial for exp(r), |r| <= ln2 / 2
// (Cephes' coefficients), with r computed from x and n; a float, or a v16f (exp16 below).
template <typename T>
inline T exp_poly(T x, T n) {
  const T r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln2 in two parts
  T p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) written so that a `#pragma omp simd` loop vectorises it (std::exp is a scalar libm
// call): x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for exp(r) (Cephes'
// coefficients), then 2^n put into the exponent bits. Within 2 ulp of std::exp over
// [-87, 88]; 0 below -87.3 (as expf underflows), inf from 88.38 on (n = 128 overflows).
// Vectorises only with -fno-trapping-math (cpu_ext.py's flags): GCC otherwise keeps the
// clamps and the select as branches.
#pragma omp declare simd notinbranch
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float p = exp_poly(x, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= -87.3f ? 0.f : p * scale;
}

// 1 / d on 16 lanes. With AVX-512: vrcp14ps's estimate (14 bits) and one Newton step, within
// ~1 ulp of the division, which holds one of the two 512-bit ports for 16 cycles (a third of a
// SwiGLU element's time); lanes where d is infinite keep the estimate (0), as 1 / inf is.
inline v16f recip16(v16f d) {
#if defined(__AVX512F__)
  const __m512 dv = reinterpret_cast<__m512>(d);
  const __m512 r = _mm512_rcp14_ps(dv);
  const __m512 refined = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(dv, r, _mm512_set1_ps(1.0f)), r);
  const __mmask16 inf = _mm512_fpclass_ps_mask(dv, 0x18);  // 0x08 | 0x10: +inf, -inf
  return reinterpret_cast<v16f>(_mm512_mask_mov_ps(refined, inf, r));
#else
  return (v16f{} + 1.0f) / d;
#endif
}

// exp_approx on 16 floats at once, with vector extensions: the scalar form in an `omp simd`
// loop compiled to 8 lanes in the prefill attention kernel, which spent half its time there.
inline v16f exp16(v16f x) {
  const v16f zero = {}, lo = zero - 87.3f;
#if defined(__AVX512F__)
  // the same n, polynomial and result, in fewer instructions: vrndscaleps rounds n (to
  // nearest even, as the magic-number add does) and vscalefps multiplies by 2^n exactly; lanes
  // at or below -87.3 (-inf included) are zeroed by the mask instead of clamped first, and
  // 88.38-88.72 give their finite value where the portable form overflows. x is capped at
  // 88.73 (past log(FLT_MAX): +inf still gives inf, not inf - inf = NaN); vminps returns its
  // second operand for a NaN, so NaN stays NaN
  const __m512 xv = _mm512_min_ps(_mm512_set1_ps(88.73f), reinterpret_cast<__m512>(x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xv, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const v16f p = exp_poly(reinterpret_cast<v16f>(xv), reinterpret_cast<v16f>(n));
  const __mmask16 above = _mm512_cmp_ps_mask(xv, reinterpret_cast<__m512>(lo), _CMP_NLE_UQ);
  return reinterpret_cast<v16f>(_mm512_maskz_scalef_ps(above, reinterpret_cast<__m512>(p), n));
#else
  const v16f hi = zero + 88.7f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v16f magic = zero + 12582912.f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const v16f n = (x * 1.44269504088896341f + magic) - magic;
  const v16f p = exp_poly(x, n);
  const v16i32 bits = (__builtin_convertvector(n, v16i32) + 127) << 23;
  v16f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= lo ? zero : p * scale;
#endif
}

// Ask for the cache line holding p (read, all cache levels). NOTE: not __builtin_prefetch in
// a loop of its own: GCC treats the builtin as free of side effects and deleted whole loops
// made only of prefetches (the decode kernel's lookahead compiled to nothing); an asm
// statement is kept.
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__)
  asm volatile("prfm pldl1keep, %0" : : "Q"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

// Ask for the cache line holding p, to be written (exclusive ownership where the CPU has
// PREFETCHW, else a read prefetch). For scattered stores into cold memory: a store that
// misses waits in the store buffer for its line, and few such misses overlap.
inline void prefetch_line_for_write(const void* p) {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__PRFCHW__)
  asm volatile("prefetchw %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__)
  asm volatile("prfm pstl1keep, %0" : : "Q"(*static_cast<const char*>(p)));
#else
  prefetch_line(p);
#endif
}

// One row of RMSNorm as transformers' LlamaRMSNorm computes it in float32: src = residual + x
// (also written to `summed`) or x, out = weight * (src * (1 / sqrt(mean(src^2) + eps))). The
// sum of squares is reduced in another order than torch's, so out is within a few ulp of it.
inline void rms_norm_row(const float* x, const float* residual, float* summed,
                         const float* weight, float eps, int64_t k, float* out) {
  const float* src = x;
  if (residual != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) summed[i] = residual[i] + x[i];
    src = summed;
  }
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < k; ++i) ss += src[i] * src[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(k) + eps);
#pragma omp simd
  for (int64_t i = 0; i < k; ++i) out[i] = weight[i] * (src[i] * r);
}

// One row of SwiGLU's product: act = silu(gate) * up, silu(g) = g / (1 + exp(-g)) through
// exp_approx (2 ulp), so act is within a few ulp of torch's silu then multiply. AVX-512
// vectors (exp16, recip16) where the build has them: GCC's `omp simd` form runs 8 lanes.
inline void silu_mul_row(const float* gate, const float* up, float* act, int64_t n) {
  int64_t i0 = 0;
#if defined(__AVX512F__)
  const v16f one = v16f{} + 1.0f;
  for (; i0 + 16 <= n; i0 += 16) {
    const v16f g = load16(gate + i0);
    *reinterpret_cast<v16f*>(act + i0) = g * recip16(one + exp16(-g)) * load16(up + i0);
  }
#endif
#pragma omp simd
  for (int64_t i = i0; i < n; ++i) act[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
}
