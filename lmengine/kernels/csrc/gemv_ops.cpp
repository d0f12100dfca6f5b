// float32 linear for a few rows (decode of one or a handful of sequences): y = x W^T (+ b).
//
// With so few rows the GEMM is a stream over the weights, each read once, and its speed is the
// memory bandwidth that stream reaches. This kernel reads each thread's weight rows as one
// sequential stream and asks for every cache line 4 KiB ahead of use, so the hardware
// prefetcher does not stall at page boundaries. Measured on an AMD EPYC Zen 3 (2 cores, AVX2)
// over SmolLM2-135M's 210 per-layer linears (425 MB, one row, noisy shared machine): this kernel
// 16-20 GB/s, MKL's GEMV 9-11 GB/s, torch's plain sum over 540 MB 21-25 GB/s.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>

#include "bindings.h"
#include "vec_math.h"  // v16f, load16, hsum16

namespace {

constexpr int64_t kPrefetch = 1024;  // floats ahead of the current read (4 KiB)

// y[m, r] for weight rows r in [r0, r1) and the kM input rows; k % 16 == 0. One weight row at a
// time, front to back: the weights are read as one sequential stream per thread (reading four
// rows side by side measured ~20 % slower), every cache line of it requested kPrefetch ahead.
// kVec 16-float vectors per step, each with its own accumulator per input row: one row (the
// single-stream decode) takes four, which streamed SmolLM2's linears at 16.6-18.1 GB/s on an
// AMD EPYC Zen 3 against 13.6 with two; more rows keep two (their accumulators fill the
// registers).
template <int kM>
void gemv_rows(const float* x, const float* w, const float* bias, float* y, int64_t k,
               int64_t n, int64_t r0, int64_t r1) {
  constexpr int kVec = kM == 1 ? 4 : 2;
  constexpr int64_t kStep = 16 * kVec;
  for (int64_t r = r0; r < r1; ++r) {
    const float* wr = w + r * k;
    v16f acc[kM][kVec] = {};
    int64_t i = 0;
    for (; i + kStep <= k; i += kStep) {
      v16f wv[kVec];
      for (int v = 0; v < kVec; ++v) {
        __builtin_prefetch(wr + i + 16 * v + kPrefetch);
        wv[v] = load16(wr + i + 16 * v);
      }
      for (int m = 0; m < kM; ++m)
        for (int v = 0; v < kVec; ++v) acc[m][v] += load16(x + m * k + i + 16 * v) * wv[v];
    }
    for (; i < k; i += 16) {  // the last k % kStep elements
      const v16f w0 = load16(wr + i);
      for (int m = 0; m < kM; ++m) acc[m][0] += load16(x + m * k + i) * w0;
    }
    for (int m = 0; m < kM; ++m) {
      v16f total = acc[m][0];
      for (int v = 1; v < kVec; ++v) total += acc[m][v];
      y[m * n + r] = hsum16(total) + (bias ? bias[r] : 0.f);
    }
  }
}

#if !defined(__AVX512F__)
// Two to 24 rows without AVX-512: sixteen AVX registers, so gemv_rows' two 16-float vectors
// per input row (four registers each row) spill from three rows on, and the kernel ran at the
// speed of its spills: on an AMD EPYC Zen 3 SmolLM2's linears took 106 ms at eight rows against
// 17 at one (oneDNN: 29). Here every output sums its products in one order whatever the row
// count, so that a token's logits do not depend on how many rows share its step (scoring a
// text alone or in a batch gives the same bits): one 8-float accumulator per output, over K
// front to back, then its lanes in order.
typedef float v8f __attribute__((vector_size(32), aligned(4)));

inline v8f load8(const float* p) { return *reinterpret_cast<const v8f*>(p); }

inline float sum8(v8f a) {
  float s = 0.f;
  for (int j = 0; j < 8; ++j) s += a[j];
  return s;
}

// kM input rows against one weight row at a time (2-8 rows: one pass, the weights one stream)
template <int kM>
void gemv_rows_avx2(const float* x, const float* w, const float* bias, float* y, int64_t k,
                    int64_t n, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* wr = w + r * k;
    v8f acc[kM] = {};
    for (int64_t i = 0; i < k; i += 8) {
      if (i % 16 == 0) __builtin_prefetch(wr + i + kPrefetch);
      const v8f wv = load8(wr + i);
      for (int m = 0; m < kM; ++m) acc[m] += load8(x + m * k + i) * wv;
    }
    for (int m = 0; m < kM; ++m) y[m * n + r] = sum8(acc[m]) + (bias ? bias[r] : 0.f);
  }
}

// kM input rows against two weight rows at a time: each input vector loaded serves both, so
// a step of 8 floats takes kM + 2 loads for 2 kM FMAs (one weight row: kM + 1 for kM)
template <int kM>
void gemv_rows_avx2_pairs(const float* x, const float* w, const float* bias, float* y,
                          int64_t k, int64_t n, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + 2 <= r1; r += 2) {
    const float* w0 = w + r * k;
    const float* w1 = w0 + k;
    v8f acc0[kM] = {}, acc1[kM] = {};
    for (int64_t i = 0; i < k; i += 8) {
      if (i % 16 == 0) {
        __builtin_prefetch(w0 + i + kPrefetch);
        __builtin_prefetch(w1 + i + kPrefetch);
      }
      const v8f a = load8(w0 + i), b = load8(w1 + i);
      for (int m = 0; m < kM; ++m) {
        const v8f xv = load8(x + m * k + i);
        acc0[m] += xv * a;
        acc1[m] += xv * b;
      }
    }
    for (int m = 0; m < kM; ++m) {
      y[m * n + r] = sum8(acc0[m]) + (bias ? bias[r] : 0.f);
      y[m * n + r + 1] = sum8(acc1[m]) + (bias ? bias[r + 1] : 0.f);
    }
  }
  if (r < r1) gemv_rows_avx2<kM>(x, w, bias, y, k, n, r, r1);
}
#endif

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

using Kernel = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t,
                       int64_t, int64_t);

// Up to 8 rows: one pass over each weight row, the weights one sequential stream. Without
// AVX-512 also 9 to 24 rows, in passes of up to 6 input rows against two weight rows at a time
// over blocks of 16 weight rows (in the core's caches between passes, so the weights still come
// from memory once): on the Zen 3, SmolLM2's linears at 12 / 16 / 24 rows took 27.8 / 37.3 /
// 48.1 ms against oneDNN's 33.6 / 39.7 / 50.1 (at 32 rows 64 against 60: oneDNN from there).
// Up to 24 rows a decode step also takes the compiled decode loop: a SmolLM2 step of 24 rows
// 95 -> 84 ms.
#if defined(__AVX512F__)
constexpr int64_t kMaxGemvRows = 8;
constexpr Kernel kOnePass[8] = {gemv_rows<1>, gemv_rows<2>, gemv_rows<3>, gemv_rows<4>,
                                gemv_rows<5>, gemv_rows<6>, gemv_rows<7>, gemv_rows<8>};
#else
constexpr int64_t kMaxGemvRows = 24;
constexpr Kernel kOnePass[8] = {gemv_rows<1>,      gemv_rows_avx2<2>, gemv_rows_avx2<3>,
                                gemv_rows_avx2<4>, gemv_rows_avx2<5>, gemv_rows_avx2<6>,
                                gemv_rows_avx2<7>, gemv_rows_avx2<8>};
constexpr Kernel kPairs[6] = {gemv_rows_avx2_pairs<1>, gemv_rows_avx2_pairs<2>,
                              gemv_rows_avx2_pairs<3>, gemv_rows_avx2_pairs<4>,
                              gemv_rows_avx2_pairs<5>, gemv_rows_avx2_pairs<6>};
#endif

}  // namespace

int64_t gemv_max_rows() { return kMaxGemvRows; }

// x [M, K] (1 <= M <= gemv_max_rows(), K a multiple of 16), w [N, K], bias [N] or None -> [M, N]
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "gemv: x must be [M, K] and w [N, K]");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(m >= 1 && m <= kMaxGemvRows, "gemv: 1 to ", kMaxGemvRows, " rows, got ", m);
  TORCH_CHECK(k % 16 == 0, "gemv: K must be a multiple of 16, got ", k);
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "gemv: bias must be [N]");
    bp = bias->data_ptr<float>();
  }
  auto y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // at least ~64 KiB of weights per task: smaller ones cost more to hand out than to run
  const int64_t grain = std::max<int64_t>(1, 16384 / k);
  if (m <= 8) {
    at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
      kOnePass[m - 1](xp, wp, bp, yp, k, n, r0, r1);
    });
    return y;
  }
#if !defined(__AVX512F__)
  const int64_t passes = (m + 5) / 6;
  const int64_t per_pass = (m + passes - 1) / passes;  // 9 rows: 5 + 4, not 6 + 3
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t b0 = r0; b0 < r1; b0 += 16) {
      const int64_t b1 = std::min(r1, b0 + 16);
      for (int64_t c0 = 0; c0 < m; c0 += per_pass) {
        kPairs[std::min(per_pass, m - c0) - 1](xp + c0 * k, wp, bp, yp + c0 * n, k, n, b0, b1);
      }
    }
  });
#endif
  return y;
}

void register_gemv_ops(py::module& m) {
  m.def("gemv", &gemv, release_gil(),
        "float32 x [M<=gemv_max_rows(), K] @ w[N, K]^T (+ bias): a weight-streaming GEMV",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("gemv_max_rows", &gemv_max_rows, release_gil(),
        "the most rows gemv takes: 8, or 24 on CPUs without AVX-512");
}
