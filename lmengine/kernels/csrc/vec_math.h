// Vectorisable math and row helpers shared by the compiled CPU kernels (cpu_ops.cpp,
// w8a8_ops.cpp, layer_ops.cpp, rotary_ops.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// Rows per at::parallel_for task for rows of `row_elems` elements: about `elems_per_task`
// elements each, so a decode step's few rows stay on one thread (no fork / join, which costs
// more than the work on a busy machine).
inline int64_t rows_per_task(int64_t row_elems, int64_t elems_per_task) {
  return std::max<int64_t>(1, elems_per_task / std::max<int64_t>(1, row_elems));
}

// exp(x) written so that a `#pragma omp simd` loop vectorises it (std::exp is a scalar libm
// call): x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for exp(r) (Cephes'
// coefficients), then 2^n put into the exponent bits. Within 2 ulp of std::exp over
// [-87, 88]; 0 below -87.3 (as expf underflows), inf from 88.7 on.
// Vectorises only with -fno-trapping-math (cpu_ext.py's flags): GCC otherwise keeps the
// clamps and the select as branches.
#pragma omp declare simd notinbranch
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= -87.3f ? 0.f : p * scale;
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
// exp_approx (2 ulp), so act is within a few ulp of torch's silu then multiply.
inline void silu_mul_row(const float* gate, const float* up, float* act, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) act[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
}
