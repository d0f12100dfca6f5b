// The bfloat16 forward on the CPU: the ops whose float32 forms live in gemv_ops.cpp,
// layer_ops.cpp and rotary_ops.cpp, for bfloat16 activations and weights.
//
// Each keeps transformers' bfloat16 numerics where they are cheap to keep: every value that
// transformers rounds to bfloat16 between two eager ops is rounded here at the same point
// (RMSNorm's normalised row before the weight multiply, silu before the multiply by up, each
// rotary product before their sum), and everything in between is computed in float32, as
// torch's bfloat16 CPU kernels do. Only reductions (a row's sum of squares, a dot product)
// add in another order.
//
// - bf16_gemv: the weight-streaming GEMV for 1-8 rows (decode). Half the bytes of float32 per
//   weight; on CPUs with AVX512-BF16 one vdpbf16ps does 32 multiply-adds of bfloat16 pairs.
// - bf16_rms_norm, bf16_silu_mul: one pass per row instead of torch's eager chains.
// rotary_fill_kv_bf16 (rotary on q and k fused with the write into a bfloat16 KV cache) is
// rotary_ops.cpp's float32 kernel for bfloat16 rows.

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_rows.h"
#include "bindings.h"
#include "brgemm_tiles.h"
#include "vec_math.h"

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kElemsPerTask = 131072;

void check_bf16(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, op, ": ", name,
              " must be a bfloat16 CPU tensor, got ", t.scalar_type());
}

// ---- the weight-streaming GEMV ------------------------------------------------------------

constexpr int64_t kPrefetch = 2048;  // bfloat16 elements ahead of the current read (4 KiB)

#if defined(__AVX512F__)
// 32 bfloat16 weights times 32 bfloat16 inputs, added pairwise into 16 float32 lanes.
inline __m512 dot32(__m512 acc, const bf16* x, const bf16* w) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(_mm512_loadu_si512(x)),
                          reinterpret_cast<__m512bh>(_mm512_loadu_si512(w)));
#else
  // bfloat16 -> float32 is a 16-bit shift: the even and the odd elements of each pair
  const __m512i xi = _mm512_loadu_si512(x), wi = _mm512_loadu_si512(w);
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  const __m512 x_even = _mm512_castsi512_ps(_mm512_slli_epi32(xi, 16));
  const __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(wi, 16));
  const __m512 x_odd = _mm512_castsi512_ps(_mm512_and_si512(xi, hi_mask));
  const __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(wi, hi_mask));
  return _mm512_fmadd_ps(x_odd, w_odd, _mm512_fmadd_ps(x_even, w_even, acc));
#endif
}

// y[m, r] for weight rows r in [r0, r1) and the kM input rows; k % 32 == 0. As gemv_ops.cpp's
// float32 kernel: one weight row at a time, front to back, one sequential stream per thread,
// every cache line requested kPrefetch elements ahead; accumulators in float32.
template <int kM>
void bf16_gemv_rows(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t k,
                    int64_t n, int64_t r0, int64_t r1) {
  constexpr int kVec = kM <= 2 ? 4 : 2;
  constexpr int64_t kStep = 32 * kVec;
  for (int64_t r = r0; r < r1; ++r) {
    const bf16* wr = w + r * k;
    __m512 acc[kM][kVec];
    for (int m = 0; m < kM; ++m)
      for (int v = 0; v < kVec; ++v) acc[m][v] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + kStep <= k; i += kStep) {
      for (int v = 0; v < kVec; ++v) prefetch_line(wr + i + 32 * v + kPrefetch);
      for (int m = 0; m < kM; ++m)
        for (int v = 0; v < kVec; ++v)
          acc[m][v] = dot32(acc[m][v], x + m * k + i + 32 * v, wr + i + 32 * v);
    }
    for (; i < k; i += 32) {
      for (int m = 0; m < kM; ++m) acc[m][0] = dot32(acc[m][0], x + m * k + i, wr + i);
    }
    const float b = bias ? static_cast<float>(bias[r]) : 0.f;
    for (int m = 0; m < kM; ++m) {
      __m512 total = acc[m][0];
      for (int v = 1; v < kVec; ++v) total = _mm512_add_ps(total, acc[m][v]);
      y[m * n + r] = static_cast<bf16>(_mm512_reduce_add_ps(total) + b);
    }
  }
}
#endif

constexpr int64_t kMaxGemvRows = 8;

// ---- rows of the small ops ----------------------------------------------------------------

inline const uint16_t* u16(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<bf16>());
}
inline uint16_t* u16_mut(const at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<bf16>());
}

}  // namespace

bool bf16_gemv_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// x [M, K] (1 <= M <= 8, K a multiple of 32), w [N, K], bias [N] or None, all bfloat16 and
// contiguous -> [M, N] bfloat16, accumulated in float32.
at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w,
                     const c10::optional<at::Tensor>& bias) {
  check_bf16(x, "bf16_gemv", "x");
  check_bf16(w, "bf16_gemv", "w");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "bf16_gemv: x and w must be contiguous");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "bf16_gemv: x must be [M, K] and w [N, K]");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(m >= 1 && m <= kMaxGemvRows, "bf16_gemv: 1 to ", kMaxGemvRows, " rows, got ", m);
  TORCH_CHECK(k % 32 == 0, "bf16_gemv: K must be a multiple of 32, got ", k);
  const bf16* bp = nullptr;
  if (bias.has_value()) {
    check_bf16(*bias, "bf16_gemv", "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                "bf16_gemv: bias must be [N]");
    bp = bias->data_ptr<bf16>();
  }
  auto y = at::empty({m, n}, x.options());
#if defined(__AVX512F__)
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  using Kernel = void (*)(const bf16*, const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t,
                          int64_t);
  static constexpr Kernel kernels[kMaxGemvRows] = {
      bf16_gemv_rows<1>, bf16_gemv_rows<2>, bf16_gemv_rows<3>, bf16_gemv_rows<4>,
      bf16_gemv_rows<5>, bf16_gemv_rows<6>, bf16_gemv_rows<7>, bf16_gemv_rows<8>};
  // at least ~64 KiB of weights per task
  const int64_t grain = std::max<int64_t>(1, 32768 / k);
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    kernels[m - 1](xp, wp, bp, yp, k, n, r0, r1);
  });
#else
  TORCH_CHECK(false, "bf16_gemv: this build has no AVX-512");
#endif
  return y;
}

// x: [..., K] bfloat16 contiguous; weight [K] bfloat16; residual like x or None. Returns
// (normed, summed) as layer_ops.cpp's rms_norm, in bfloat16.
std::tuple<at::Tensor, at::Tensor> bf16_rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                                 double eps,
                                                 const c10::optional<at::Tensor>& residual) {
  check_bf16(x, "bf16_rms_norm", "x");
  check_bf16(weight, "bf16_rms_norm", "weight");
  const int64_t k = x.size(-1);
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.numel() == k,
              "bf16_rms_norm: x [..., K] and weight [K] must be contiguous");
  at::Tensor res;
  if (residual.has_value() && residual->defined()) {
    res = *residual;
    check_bf16(res, "bf16_rms_norm", "residual");
    TORCH_CHECK(res.sizes() == x.sizes() && res.is_contiguous(),
                "bf16_rms_norm: residual must be contiguous and shaped like x");
  }
  const int64_t m = k == 0 ? 0 : x.numel() / k;
  const at::Tensor summed = res.defined() ? at::empty_like(x) : at::Tensor();
  at::Tensor out = at::empty_like(x);
  const uint16_t* xp = u16(x);
  const uint16_t* rp = res.defined() ? u16(res) : nullptr;
  uint16_t* sp = summed.defined() ? u16_mut(summed) : nullptr;
  const uint16_t* wp = u16(weight);
  uint16_t* op = u16_mut(out);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, m, rows_per_task(k, kElemsPerTask), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      rms_norm_row_bf16(xp + i * k, rp ? rp + i * k : nullptr, sp ? sp + i * k : nullptr, wp,
                        feps, k, op + i * k);
    }
  });
  return {out, summed};
}

// ---- large GEMMs, rows split between the threads ---------------------------------------------

namespace {

// Rows per thread from which the bfloat16 GEMMs below split a GEMM between the threads, and up
// to which (exclusive) they do; and the most threads they split for. Measured with two: with
// many, each thread would read the whole weight for its block, where oneDNN shares its tiles.
constexpr int64_t kSplitRowsPerThread = 256;
constexpr int64_t kSplitRowsPerThreadEnd = 1024;
constexpr int64_t kMaxSplitThreads = 2;

// The rows of one thread's block when x [M, K] is split (a multiple of 64), or 0: not split.
// oneDNN's own split of a mid-size GEMM over two threads leaves one of them idle for some
// shapes and row counts; each thread running oneDNN alone on its own block of rows does not.
// On an Intel Xeon (family 6, model 167, 2 threads, 2026-12-04), SmolLM2's four linears per
// layer, whole -> split: on the packed weight 1.82 -> 1.56 ms at 512 rows, 3.10 -> 2.38 at 768,
// 3.77 -> 3.18 at 1,000; on the plain weight 4.25 -> 3.25 at 1,024, 6.60 -> 3.61 at 1,152,
// 5.14 -> 3.93 at 1,280; level (within 1 %) at 2,112-2,176, where it is not split. The down
// projection (1,536 -> 576) ran at 1.2-1.7 us a row whole from 512 to 1,280 rows and at
// 0.72-0.91 split; gate/up (576 -> 3,072) alone is 5-20 % slower split. oneDNN picks its
// blocking of K per row count, so a split GEMM's rows can differ from the whole GEMM's in the
// last bit: the modules and the layer loop both call these functions.
int64_t split_block_rows(const at::Tensor& x) {
  const int64_t rows = x.dim() == 2 ? x.size(0) : 0;
  const int64_t threads = at::get_num_threads();
  if (threads < 2 || threads > kMaxSplitThreads || rows < kSplitRowsPerThread * threads ||
      rows >= kSplitRowsPerThreadEnd * threads || at::in_parallel_region() ||
      x.scalar_type() != at::kBFloat16) {
    return 0;
  }
  return ((rows + threads - 1) / threads + 63) / 64 * 64;
}

// fn(r0, r1) for each thread's block of `rows` rows, `step` rows each, on the caller's
// thread-local state (inference mode, grad mode: the blocks run ATen ops on the workers).
template <class F>
void for_each_block(int64_t rows, int64_t step, F&& fn) {
  const at::ThreadLocalState caller;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(caller);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = std::min(rows, t * step), r1 = std::min(rows, r0 + step);
      if (r1 > r0) fn(r0, r1);
    }
  });
}

}  // namespace

// oneDNN's linear on its packed weight, as kernels/linear.py's _onednn calls it
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x.contiguous(), packed, bias, "none", c10::List<std::optional<at::Scalar>>(),
                 c10::string_view(""));
}

// x [M, K] @ weight [N, K]^T (+ bias) as at::linear (bfloat16 prompt steps on the plain
// weight), split between the threads where split_block_rows says so.
at::Tensor bf16_linear_rows(const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias) {
  const int64_t step = split_block_rows(x);
  if (step == 0) return at::linear(x, weight, bias);
  check_bf16(weight, "bf16_linear_rows", "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1),
              "bf16_linear_rows: x [M, K] and weight [N, K]");
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  const at::Tensor wt = weight.t();
  for_each_block(x.size(0), step, [&](int64_t r0, int64_t r1) {
    at::Tensor part = out.narrow(0, r0, r1 - r0);
    if (bias.has_value() && bias->defined())  // as at::linear: the bias in the same rounding
      at::addmm_out(part, *bias, x.narrow(0, r0, r1 - r0), wt);
    else
      at::mm_out(part, x.narrow(0, r0, r1 - r0), wt);
  });
  return out;
}

// onednn_linear on the weight packed for `n` outputs, split between the threads where
// split_block_rows says so (bfloat16 steps of a few hundred rows).
at::Tensor bf16_onednn_linear_rows(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                   const c10::optional<at::Tensor>& bias) {
  const int64_t step = split_block_rows(x);
  if (step == 0) return onednn_linear(x, packed, bias);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  const at::Tensor xc = x.contiguous();
  for_each_block(x.size(0), step, [&](int64_t r0, int64_t r1) {
    out.narrow(0, r0, r1 - r0).copy_(onednn_linear(xc.narrow(0, r0, r1 - r0), packed, bias));
  });
  return out;
}

#if defined(__AVX512F__)
const uint16_t* silu_bf16_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(65536 + 1, 0);
    alignas(64) uint16_t bits[16];
    for (int32_t g0 = 0; g0 < 65536; g0 += 16) {
      for (int32_t j = 0; j < 16; ++j) bits[j] = static_cast<uint16_t>(g0 + j);
      store_bf16x16(t.data() + g0, silu_bf16x16(load_bf16x16(bits)));
    }
    return t;
  }();
  return table.data();
}
#endif

// gate_up: [M, 2 * I] bfloat16, rows contiguous -> bf16(bf16(silu(gate)) * up) [M, I]
at::Tensor bf16_silu_mul(const at::Tensor& gate_up) {
  check_bf16(gate_up, "bf16_silu_mul", "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "bf16_silu_mul: gate_up must be [M, 2 * I] with contiguous rows");
  const int64_t m = gate_up.size(0), inter = gate_up.size(1) / 2, ld = gate_up.stride(0);
  at::Tensor out = at::empty({m, inter}, gate_up.options());
  const uint16_t* gp = u16(gate_up);
  uint16_t* op = u16_mut(out);
  at::parallel_for(0, m, rows_per_task(2 * inter, kElemsPerTask), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      silu_mul_row_bf16(gp + r * ld, gp + r * ld + inter, op + r * inter, inter);
    }
  });
  return out;
}

// ---- the GEMM on AMX tiles -------------------------------------------------------------------

namespace {

constexpr int64_t kTileN = 64;            // output channels per weight block
constexpr int64_t kTileM = 128;           // rows per task
constexpr int64_t kChunkBytes = 1 << 20;  // weight bytes per chunk of blocks (vnni_tiles)

// a tile's rows (float32, nb apart) + bias -> bfloat16 rows of out, rounded once
void store_tile_bf16(const float* tile, int64_t mb, int64_t nb, const uint16_t* bias,
                     uint16_t* out, int64_t ld_out) {
  for (int64_t r = 0; r < mb; ++r) {
    const float* t = tile + r * nb;
    uint16_t* o = out + r * ld_out;
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= nb; j += 16) {
      v16f v = load16(t + j);
      if (bias != nullptr) v += load_bf16x16(bias + j);
      store_bf16x16(o + j, v);
    }
#endif
    for (; j < nb; ++j) o[j] = to_bf16(t[j] + (bias != nullptr ? to_f32(bias[j]) : 0.f));
  }
}

}  // namespace

// Whether bf16_vnni_linear runs here: a build for a CPU with AMX-BF16 tiles
bool bf16_vnni_available() {
#if defined(__AMX_BF16__)
  return at::hasMKLDNN();
#else
  return false;
#endif
}

// w [N, K] bfloat16 (K even) -> its copy in the blocked VNNI layout bf16_vnni_linear reads
at::Tensor bf16_vnni_pack(const at::Tensor& w) {
  check_bf16(w, "bf16_vnni_pack", "w");
  TORCH_CHECK(w.dim() == 2 && w.size(1) % 2 == 0, "bf16_vnni_pack: w must be [N, K], K even");
  auto wc = w.contiguous();
  auto out = at::empty({wc.numel()}, wc.options());
  vnni_pack_into<2>(u16(wc), wc.size(0), wc.size(1), kTileN, u16_mut(out));
  return out;
}

// x [M, K] @ w.T (+ bias) on the AMX tiles, packed = bf16_vnni_pack(w) of w [N, K]: float32
// accumulation, each output rounded once to bfloat16 (after the bias), as oneDNN's matmul.
at::Tensor bf16_vnni_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                            const c10::optional<at::Tensor>& bias) {
  check_bf16(x, "bf16_vnni_linear", "x");
  check_bf16(packed, "bf16_vnni_linear", "packed");
  TORCH_CHECK(x.dim() == 2, "bf16_vnni_linear: x must be [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 2 == 0 && packed.dim() == 1 && packed.numel() == n * k && packed.is_contiguous(),
              "bf16_vnni_linear: packed must be bf16_vnni_pack of an [N, K] weight");
  const uint16_t* bp = nullptr;
  if (bias.has_value()) {
    check_bf16(*bias, "bf16_vnni_linear", "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                "bf16_vnni_linear: bias must be [N]");
    bp = u16(*bias);
  }
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  auto xc = x.contiguous();
  uint16_t* op = u16_mut(out);
  vnni_tiles<float>(xc.data_ptr<bf16>(), m, k, packed.data_ptr<bf16>(), n, kTileM, kTileN,
                    kChunkBytes, [&](const float* tile, int64_t m0, int64_t mb, int64_t n0,
                                     int64_t nb) {
                      store_tile_bf16(tile, mb, nb, bp ? bp + n0 : nullptr, op + m0 * n + n0, n);
                    });
  return out;
}

void register_bf16_ops(py::module& m) {
  m.def("bf16_gemv_available", &bf16_gemv_available, release_gil(),
        "whether bf16_gemv was built (it needs AVX-512)");
  m.def("bf16_gemv", &bf16_gemv, release_gil(),
        "bfloat16 x [M<=8, K] @ w[N, K]^T (+ bias), float32 accumulation: a weight-streaming GEMV",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("bf16_vnni_available", &bf16_vnni_available, release_gil(),
        "whether bf16_vnni_linear runs here (AMX-BF16 tiles)");
  m.def("bf16_vnni_pack", &bf16_vnni_pack, release_gil(),
        "a bfloat16 weight [N, K] in the blocked VNNI layout of bf16_vnni_linear", py::arg("w"));
  m.def("bf16_vnni_linear", &bf16_vnni_linear, release_gil(),
        "bfloat16 x [M, K] @ w.T (+ bias) on AMX tiles from bf16_vnni_pack(w)", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("bf16_rms_norm", &bf16_rms_norm, release_gil(),
        "RMSNorm, after the residual add when given (bfloat16, CPU)", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("bf16_linear_rows", &bf16_linear_rows, release_gil(),
        "x @ weight^T (+ bias), bfloat16, mid-size row counts split between the threads (CPU)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("bf16_onednn_linear_rows", &bf16_onednn_linear_rows, release_gil(),
        "oneDNN's linear on a packed weight, bfloat16, mid-size row counts split between the "
        "threads (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("bf16_silu_mul", &bf16_silu_mul, release_gil(),
        "silu(gate) * up of a fused gate/up output (bfloat16, CPU)", py::arg("gate_up"));
}
