// W8A8 on the CPU: per-token int8 quantization and the int8 linear with its dequantizing
// epilogue, each one call instead of ~7 eager torch ops (each ~5-10 us of dispatch on this
// CPU, more than the one-row GEMM itself). The GEMM is at::_int_mm (oneDNN, VNNI), or from
// 2 rows on, where a weight was pre-packed (`w8a8_pack`), oneDNN's int8 matmul on that packed
// copy (torch's onednn::qlinear_pointwise): _int_mm re-packs the weight in every call, which
// cost ~15 % of the GEMMs of a 64-row decode step and ~30 % at 2-16 rows on an AMD EPYC. One
// row stays on _int_mm, faster there (3.5 vs 5.1 ms for SmolLM2's decoder layers). The packed
// path is used only where a probe finds it exact: not on CPUs without VNNI (see w8a8_pack).
//
// Numerics equal lmengine/kernels/w8a8.py's references bit for bit:
//   quant:    amax = max(max|x_row|, 1e-8); q = rint(x * (127 / amax)) (half to even);
//             scale = amax / 127
//   epilogue: out = float(acc) * a_scale[m] * w_scale[n] (+ bias[n]), in that order, with
//             no fused multiply-add (fp-contract off), as the eager ops round.

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "bindings.h"
#include "vec_math.h"

namespace {

constexpr float kQmax = 127.0f;
constexpr float kMinAmax = 1e-8f;

void quant_rows(const float* x, int8_t* q, float* scale, int64_t begin, int64_t end,
                int64_t k) {
  for (int64_t m = begin; m < end; ++m) {
    const float* row = x + m * k;
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
    amax = std::max(amax, kMinAmax);
    const float inv = kQmax / amax;
    int8_t* out = q + m * k;
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) out[i] = static_cast<int8_t>(std::nearbyint(row[i] * inv));
    scale[m] = amax / kQmax;
  }
}

// Acc: int32 (from _int_mm) or float holding the exact int32 value (packed_int8_mm); the
// float conversion is the same either way. `out` may be `acc` itself (float).
template <typename Acc>
__attribute__((optimize("fp-contract=off"))) void dequant_rows(
    const Acc* acc, const float* a_scale, const float* w_scale, const float* bias,
    float* out, int64_t begin, int64_t end, int64_t n) {
  for (int64_t m = begin; m < end; ++m) {
    const Acc* a = acc + m * n;
    float* o = out + m * n;
    const float s = a_scale[m];
    if (bias != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float v = static_cast<float>(a[j]) * s * w_scale[j];
        o[j] = v + bias[j];
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] = static_cast<float>(a[j]) * s * w_scale[j];
    }
  }
}

// One row of w8a8_rms_norm_quant: rms_norm_row into `buf`, then quantized by quant_rows.
void norm_quant_row(const float* x, const float* residual, float* summed, const float* weight,
                    float eps, int64_t k, float* buf, int8_t* q, float* scale) {
  rms_norm_row(x, residual, summed, weight, eps, k, buf);
  quant_rows(buf, q, scale, 0, 1, k);
}

// onednn::qlinear_pointwise, or an invalid handle where this torch has no oneDNN int8 ops
const c10::OperatorHandle* qlinear_op() {
  static const c10::OperatorHandle* op = []() -> const c10::OperatorHandle* {
    auto handle = c10::Dispatcher::singleton().findSchema({"onednn::qlinear_pointwise", ""});
    return handle.has_value() ? new c10::OperatorHandle(*handle) : nullptr;
  }();
  return op;
}

// Unit weight scales and zero points of N output channels for qlinear_pointwise (cached)
std::pair<at::Tensor, at::Tensor> unit_scales(int64_t n) {
  static std::mutex lock;
  static std::unordered_map<int64_t, std::pair<at::Tensor, at::Tensor>> cache;
  std::lock_guard<std::mutex> guard(lock);
  auto it = cache.find(n);
  if (it == cache.end()) {
    it = cache.emplace(n, std::make_pair(at::ones({n}), at::zeros({n}, at::kLong))).first;
  }
  return it->second;
}

// [M, N] float32 holding float(acc) exactly, acc = q @ w.T in int32, from the packed weight:
// the activations go in as uint8 with zero point 128 (q ^ 0x80 = q + 128), every scale 1, so
// oneDNN's epilogue only converts the exact accumulator, and the caller's own epilogue keeps
// the reference's rounding order.
at::Tensor packed_int8_mm(const at::Tensor& q, const at::Tensor& packed, int64_t n) {
  const int64_t m = q.size(0), k = q.size(1);
  auto qc = q.contiguous();
  auto xu = at::empty({m, k}, qc.options().dtype(at::kByte));
  const int8_t* src = qc.data_ptr<int8_t>();
  uint8_t* dst = xu.data_ptr<uint8_t>();
#pragma omp simd
  for (int64_t i = 0; i < m * k; ++i) dst[i] = static_cast<uint8_t>(src[i]) ^ 0x80;
  auto [ones, zeros] = unit_scales(n);
  torch::jit::Stack stack{xu,      1.0,  int64_t{128}, packed,
                          ones,    zeros, c10::IValue(), 1.0,
                          int64_t{0}, c10::IValue(at::kFloat), std::string("none"),
                          c10::List<c10::optional<at::Scalar>>(), std::string("")};
  qlinear_op()->callBoxed(&stack);
  return stack[0].toTensor();
}

// rows per task of the quantize / dequantize passes: about 32K elements
int64_t grain(int64_t row_elems) { return rows_per_task(row_elems, 32768); }

}  // namespace

// x: [M, K] float32 -> (q [M, K] int8, scale [M, 1] float32)
std::tuple<at::Tensor, at::Tensor> w8a8_quant(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "w8a8_quant: x must be [M, K] float32");
  auto xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  auto q = at::empty({m, k}, xc.options().dtype(at::kChar));
  auto scale = at::empty({m, 1}, xc.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, m, grain(k), [&](int64_t begin, int64_t end) {
    quant_rows(xp, qp, sp, begin, end, k);
  });
  return {q, scale};
}

// q: [M, K] int8, a_scale: [M, 1] float32, w: [N, K] int8, w_scale: [N] float32,
// bias: [N] float32 or None -> [M, N] float32
// packed: w8a8_pack(w), or None (then always _int_mm)
at::Tensor w8a8_linear(const at::Tensor& q, const at::Tensor& a_scale, const at::Tensor& w,
                       const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& packed) {
  TORCH_CHECK(q.scalar_type() == at::kChar && w.scalar_type() == at::kChar,
              "w8a8_linear: q and w must be int8");
  TORCH_CHECK(q.dim() == 2 && w.dim() == 2 && q.size(1) == w.size(1),
              "w8a8_linear: q must be [M, K] and w [N, K]");
  const int64_t m = q.size(0), n = w.size(0);
  TORCH_CHECK(a_scale.numel() == m && w_scale.numel() == n, "w8a8_linear: scale sizes");
  TORCH_CHECK(a_scale.scalar_type() == at::kFloat && w_scale.scalar_type() == at::kFloat,
              "w8a8_linear: scales must be float32");
  const bool use_packed = packed.has_value() && packed->defined() && m >= 2 && qlinear_op();
  at::Tensor out, acc;
  if (m == 0) return at::empty({m, n}, a_scale.options());
  if (use_packed) {
    out = acc = packed_int8_mm(q, *packed, n);  // [M, N] float32, dequantized in place
  } else {
    out = at::empty({m, n}, a_scale.options());
    // NOTE: w.t() is a view with K contiguous, the layout _int_mm is fastest with
    acc = at::_int_mm(q.contiguous(), w.t());  // [M, N] int32
  }
  auto as = a_scale.contiguous();
  auto ws = w_scale.contiguous();
  at::Tensor b;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n,
                "w8a8_linear: bias must be [N] float32");
    b = bias->contiguous();
    bp = b.data_ptr<float>();
  }
  const float* asp = as.data_ptr<float>();
  const float* wsp = ws.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, m, grain(n), [&](int64_t begin, int64_t end) {
    if (use_packed) {
      dequant_rows(acc.data_ptr<float>(), asp, wsp, bp, op, begin, end, n);
    } else {
      dequant_rows(acc.data_ptr<int32_t>(), asp, wsp, bp, op, begin, end, n);
    }
  });
  return out;
}

namespace {

// oneDNN's int8 matmul layout of w [N, K], or an undefined tensor where this torch has none
at::Tensor prepack_int8(const at::Tensor& w) {
  auto prepack = c10::Dispatcher::singleton().findSchema({"onednn::qlinear_prepack", ""});
  if (!prepack.has_value() || qlinear_op() == nullptr) return at::Tensor();
  torch::jit::Stack stack{w.contiguous(), std::vector<int64_t>{64, w.size(1)}};
  prepack->callBoxed(&stack);
  return stack[0].toTensor();
}

// Whether the packed GEMM gives the exact int32 accumulator on this CPU. Without VNNI (AVX2
// only, e.g. AMD Zen 3) oneDNN multiplies uint8 by int8 with vpmaddubsw, which saturates each
// pair sum to int16: 255 * 127 * 2 overflows it, and on a Zen 3 the packed results were off by
// up to ~10^5. A probe at those extremes, once per process; _int_mm stays exact there.
bool packed_gemm_exact() {
  static const bool exact = [] {
    const int64_t m = 2, n = 16, k = 64;
    auto q = at::full({m, k}, 127, at::kChar);
    q[1].fill_(-127);
    auto w = at::full({n, k}, 127, at::kChar);
    w.slice(0, n / 2).fill_(-127);
    auto packed = prepack_int8(w);
    if (!packed.defined()) return false;
    auto got = packed_int8_mm(q, packed, n);
    auto want = at::matmul(q.to(at::kFloat), w.to(at::kFloat).t());  // |sums| < 2^24: exact
    return at::equal(got, want);
  }();
  return exact;
}

}  // namespace

// w: [N, K] int8 -> its copy in oneDNN's int8 matmul layout for w8a8_linear(packed=...), or
// None where this torch has no oneDNN int8 ops or their result is not exact on this CPU
c10::optional<at::Tensor> w8a8_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "w8a8_pack: w must be [N, K] int8");
  if (!packed_gemm_exact()) return c10::nullopt;
  auto packed = prepack_int8(w);
  if (!packed.defined()) return c10::nullopt;
  return packed;
}

at::Tensor checked_norm_residual(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& residual);  // layer_ops.cpp
void check_gate_up(const char* op, const at::Tensor& gate_up);                 // layer_ops.cpp

// RMSNorm (of residual + x when residual is given) fused with per-token quantization, one pass
// over each row. x, residual: [M, K] float32, weight: [K] float32 -> (q [M, K] int8,
// scale [M, 1] float32, residual + x [M, K] or an undefined tensor). The sum of squares is
// reduced in another order than torch's, so a value on a rounding boundary may land one int8
// step away from the reference (tests/kernels/test_w8a8.py states the bound).
std::tuple<at::Tensor, at::Tensor, at::Tensor> w8a8_rms_norm_quant(
    const at::Tensor& x, const at::Tensor& weight, double eps,
    const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2, "w8a8_rms_norm_quant: x must be [M, K]");
  const at::Tensor res = checked_norm_residual("w8a8_rms_norm_quant", x, weight, residual);
  const int64_t m = x.size(0), k = x.size(1);
  const at::Tensor summed = res.defined() ? at::empty_like(x) : at::Tensor();
  auto q = at::empty({m, k}, x.options().dtype(at::kChar));
  auto scale = at::empty({m, 1}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  float* sp = summed.defined() ? summed.data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* scp = scale.data_ptr<float>();
  at::parallel_for(0, m, rows_per_task(k, 131072), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(k);
    for (int64_t i = begin; i < end; ++i) {
      norm_quant_row(xp + i * k, rp ? rp + i * k : nullptr, sp ? sp + i * k : nullptr, wp,
                     static_cast<float>(eps), k, buf.data(), qp + i * k, scp + i);
    }
  });
  return {q, scale, summed};
}

// The SwiGLU product of a fused gate/up output, quantized for a w8a8 down projection in the same
// pass: silu_mul_row (within a few ulp of torch's) then quant_rows, as w8a8_quant would.
// gate_up: [M, 2 * I] float32, rows contiguous (gate = columns 0..I-1, up = I..2I-1) ->
// (q [M, I] int8, scale [M, 1]). The float product alone is layer_ops.cpp's silu_mul.
std::tuple<at::Tensor, at::Tensor> w8a8_silu_mul(const at::Tensor& gate_up) {
  check_gate_up("w8a8_silu_mul", gate_up);
  const int64_t m = gate_up.size(0), inter = gate_up.size(1) / 2, ld = gate_up.stride(0);
  at::Tensor out = at::empty({m, inter}, gate_up.options().dtype(at::kChar));
  at::Tensor scale = at::empty({m, 1}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  at::parallel_for(0, m, rows_per_task(inter, 65536), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(inter);
    for (int64_t r = begin; r < end; ++r) {
      silu_mul_row(gp + r * ld, gp + r * ld + inter, buf.data(), inter);
      quant_rows(buf.data(), out.data_ptr<int8_t>() + r * inter, scale.data_ptr<float>() + r, 0,
                 1, inter);
    }
  });
  return {out, scale};
}

// x: [M, K] float32 -> w8a8_linear(w8a8_quant(x), ...): a linear on a float input
at::Tensor w8a8_linear_float(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                             const c10::optional<at::Tensor>& bias,
                             const c10::optional<at::Tensor>& packed) {
  auto [q, scale] = w8a8_quant(x);
  return w8a8_linear(q, scale, w, w_scale, bias, packed);
}

void register_w8a8_ops(py::module& m) {
  m.def("w8a8_quant", &w8a8_quant, release_gil(),
        "per-token int8 quantization (float32 [M, K])", py::arg("x"));
  m.def("w8a8_linear", &w8a8_linear, release_gil(),
        "int8 GEMM + dequantizing epilogue", py::arg("q"),
        py::arg("a_scale"), py::arg("w"), py::arg("w_scale"), py::arg("bias") = py::none(),
        py::arg("packed") = py::none());
  m.def("w8a8_linear_float", &w8a8_linear_float, release_gil(),
        "per-token quantization + w8a8_linear",
        py::arg("x"), py::arg("w"), py::arg("w_scale"), py::arg("bias") = py::none(),
        py::arg("packed") = py::none());
  m.def("w8a8_pack", &w8a8_pack, release_gil(),
        "int8 weight [N, K] in oneDNN's matmul layout (or None)",
        py::arg("w"));
  m.def("w8a8_silu_mul", &w8a8_silu_mul, release_gil(),
        "silu(gate) * up of a fused gate/up output, quantized per token", py::arg("gate_up"));
  m.def("w8a8_rms_norm_quant", &w8a8_rms_norm_quant, release_gil(),
        "RMSNorm (after the residual add) fused with per-token int8 quantization",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
}
