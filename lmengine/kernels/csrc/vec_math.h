// Vectorisable math, vector types and row helpers shared by the compiled CPU kernels.
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
// [-87, 88]; 0 below -87.3 (as expf underflows), inf from 88.7 on.
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

// exp_approx on 16 floats at once, with vector extensions: the scalar form in an `omp simd`
// loop compiled to 8 lanes in the prefill attention kernel, which spent half its time there.
inline v16f exp16(v16f x) {
  const v16f zero = {}, lo = zero - 87.3f, hi = zero + 88.7f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v16f magic = zero + 12582912.f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const v16f n = (x * 1.44269504088896341f + magic) - magic;
  const v16f p = exp_poly(x, n);
  const v16i32 bits = (__builtin_convertvector(n, v16i32) + 127) << 23;
  v16f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= lo ? zero : p * scale;
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
