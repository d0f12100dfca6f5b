// Vectorisable math shared by the compiled CPU kernels (cpu_ops.cpp, w8a8_ops.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// exp(x) written so that a `#pragma omp simd` loop vectorises it (std::exp is a scalar libm
// call): x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for exp(r) (Cephes'
// coefficients), then 2^n put into the exponent bits. Within 2 ulp of std::exp over
// [-87, 88]; 0 below -87.3 (as expf underflows), inf from 88.7 on.
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
