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
#include <ATen/native/CPUBlas.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "bf16_rows.h"
#include "bindings.h"
#include "brgemm_tiles.h"
#include "vec_math.h"

namespace {

constexpr float kQmax = 127.0f;
constexpr float kMinAmax = 1e-8f;

// a row element as float32: float32 itself, or bfloat16 (its uint16_t bits) widened exactly
inline float widen(float v) { return v; }
inline float widen(uint16_t h) { return to_f32(h); }

// In: float (float32) or uint16_t (bfloat16 bits). The bfloat16 rows are widened exactly, so
// they quantize as the reference's x.to(float32) does.
template <typename In>
void quant_rows(const In* x, int8_t* q, float* scale, int64_t begin, int64_t end, int64_t k) {
  for (int64_t m = begin; m < end; ++m) {
    const In* row = x + m * k;
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(widen(row[i])));
    amax = std::max(amax, kMinAmax);
    const float inv = kQmax / amax;
    int8_t* out = q + m * k;
#pragma omp simd
    for (int64_t i = 0; i < k; ++i)
      out[i] = static_cast<int8_t>(std::nearbyint(widen(row[i]) * inv));
    scale[m] = amax / kQmax;
  }
}

// a float32 result stored as Out: float32 itself, or bfloat16 bits (round to nearest even)
inline void narrow(float v, float* out) { *out = v; }
inline void narrow(float v, uint16_t* out) { *out = to_bf16(v); }

// Acc: int32 (from _int_mm) or float holding the exact int32 value (packed_int8_mm); the
// float conversion is the same either way. Out (and bias): float32, or bfloat16 bits, rounded
// once from the float32 result as the reference's final .to(bfloat16). `out` may be `acc`
// itself (float).
template <typename Acc, typename Out>
__attribute__((optimize("fp-contract=off"))) void dequant_rows(
    const Acc* acc, const float* a_scale, const float* w_scale, const Out* bias, Out* out,
    int64_t begin, int64_t end, int64_t n, int64_t ld_acc, int64_t ld_out) {
  for (int64_t m = begin; m < end; ++m) {
    const Acc* a = acc + m * ld_acc;
    Out* o = out + m * ld_out;
    const float s = a_scale[m];
    if (bias != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float v = static_cast<float>(a[j]) * s * w_scale[j];
        narrow(v + widen(bias[j]), o + j);
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) narrow(static_cast<float>(a[j]) * s * w_scale[j], o + j);
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

namespace {

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

const uint16_t* bf16_bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
uint16_t* bf16_bits_mut(const at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

// The epilogue over [M, N] accumulators (int32 or float holding int32 values, row stride
// ld_acc) into out (float32 or bfloat16 [M, N]), rows split over threads.
template <typename Acc>
void dequant_into(const Acc* acc, int64_t ld_acc, const at::Tensor& a_scale,
                  const at::Tensor& w_scale, const at::Tensor& bias, const at::Tensor& out,
                  int64_t begin, int64_t end) {
  const int64_t n = out.size(1);
  const float* asp = a_scale.data_ptr<float>();
  const float* wsp = w_scale.data_ptr<float>();
  if (is_bf16(out)) {
    const uint16_t* bp = bias.defined() ? bf16_bits(bias) : nullptr;
    dequant_rows(acc, asp, wsp, bp, bf16_bits_mut(out), begin, end, n, ld_acc, n);
  } else {
    const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    dequant_rows(acc, asp, wsp, bp, out.data_ptr<float>(), begin, end, n, ld_acc, n);
  }
}

// The checked, contiguous scales and bias of an int8 linear with N outputs: the bias must have
// the output's dtype (float32 or bfloat16).
std::tuple<at::Tensor, at::Tensor, at::Tensor> epilogue_operands(
    const char* op, const at::Tensor& a_scale, const at::Tensor& w_scale,
    const c10::optional<at::Tensor>& bias, int64_t m, int64_t n, at::ScalarType out_type) {
  TORCH_CHECK(a_scale.numel() == m && w_scale.numel() == n, op, ": scale sizes");
  TORCH_CHECK(a_scale.scalar_type() == at::kFloat && w_scale.scalar_type() == at::kFloat, op,
              ": scales must be float32");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == out_type && bias->numel() == n, op,
                ": bias must be [N] of the output dtype");
    b = bias->contiguous();
  }
  return {a_scale.contiguous(), w_scale.contiguous(), b};
}

}  // namespace

// x: [M, K] float32 or bfloat16 -> (q [M, K] int8, scale [M, 1] float32)
std::tuple<at::Tensor, at::Tensor> w8a8_quant(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || is_bf16(x)),
              "w8a8_quant: x must be [M, K] float32 or bfloat16");
  auto xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  auto q = at::empty({m, k}, xc.options().dtype(at::kChar));
  auto scale = at::empty({m, 1}, xc.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  if (is_bf16(xc)) {
    const uint16_t* xp = bf16_bits(xc);
    at::parallel_for(0, m, grain(k), [&](int64_t begin, int64_t end) {
      quant_rows(xp, qp, sp, begin, end, k);
    });
  } else {
    const float* xp = xc.data_ptr<float>();
    at::parallel_for(0, m, grain(k), [&](int64_t begin, int64_t end) {
      quant_rows(xp, qp, sp, begin, end, k);
    });
  }
  return {q, scale};
}

// q: [M, K] int8, a_scale: [M, 1] float32, w: [N, K] int8, w_scale: [N] float32,
// bias: [N] of the output dtype or None -> [M, N] float32, or bfloat16 with bf16_out
// packed: w8a8_pack(w), or None (then always _int_mm)
at::Tensor w8a8_linear(const at::Tensor& q, const at::Tensor& a_scale, const at::Tensor& w,
                       const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& packed, bool bf16_out) {
  TORCH_CHECK(q.scalar_type() == at::kChar && w.scalar_type() == at::kChar,
              "w8a8_linear: q and w must be int8");
  TORCH_CHECK(q.dim() == 2 && w.dim() == 2 && q.size(1) == w.size(1),
              "w8a8_linear: q must be [M, K] and w [N, K]");
  const int64_t m = q.size(0), n = w.size(0);
  const auto out_type = bf16_out ? at::kBFloat16 : at::kFloat;
  auto [as, ws, b] = epilogue_operands("w8a8_linear", a_scale, w_scale, bias, m, n, out_type);
  if (m == 0) return at::empty({m, n}, a_scale.options().dtype(out_type));
  const bool use_packed = packed.has_value() && packed->defined() && m >= 2 && qlinear_op();
  at::Tensor acc;
  if (use_packed) {
    acc = packed_int8_mm(q, *packed, n);  // [M, N] float32 holding the int32 accumulators
  } else {
    // NOTE: w.t() is a view with K contiguous, the layout _int_mm is fastest with
    acc = at::_int_mm(q.contiguous(), w.t());  // [M, N] int32
  }
  // float32 output: dequantized in place over the packed GEMM's float accumulators
  const at::Tensor out = use_packed && !bf16_out ? acc : at::empty({m, n}, as.options().dtype(out_type));
  at::parallel_for(0, m, grain(n), [&](int64_t begin, int64_t end) {
    if (use_packed) {
      dequant_into(acc.data_ptr<float>(), n, as, ws, b, out, begin, end);
    } else {
      dequant_into(acc.data_ptr<int32_t>(), n, as, ws, b, out, begin, end);
    }
  });
  return out;
}

// ---- the int8 GEMM on AMX tiles: oneDNN's brgemm microkernel, s8 x s8 -> s32 ---------------
//
// AMX-INT8 multiplies signed by signed bytes (tdpbssd), so the symmetric int8 activations go in
// as they are: no uint8 shift and no compensation term. The weight is packed once into blocks
// of kVnniN output channels, each [K / 4, kVnniN, 4] (brgemm_tiles.h). A task computes kVnniM
// rows x one block into an int32 tile buffer and runs the epilogue on it while it is in cache:
// no [M, N] float buffer goes to memory, unlike the packed oneDNN matmul above.

namespace {

constexpr int64_t kVnniN = 64;   // output channels per weight block
constexpr int64_t kVnniM = 128;  // rows per task
constexpr int64_t kChunkBytes = 1 << 20;  // weight bytes per chunk of blocks (see vnni_tiles)

// w [N, K] int8 (K % 4 == 0) -> [N * K] int8 in the blocked VNNI layout above
at::Tensor vnni_pack(const at::Tensor& w) {
  auto wc = w.contiguous();
  auto out = at::empty({wc.numel()}, wc.options());
  vnni_pack_into<4>(wc.data_ptr<int8_t>(), wc.size(0), wc.size(1), kVnniN, out.data_ptr<int8_t>());
  return out;
}

// [M, N] out = epilogue(q [M, K] @ w.T) from the VNNI-packed weight, tiles over threads
void vnni_gemm(const int8_t* q, int64_t m, int64_t k, const int8_t* packed, int64_t n,
               const at::Tensor& a_scale, const at::Tensor& w_scale, const at::Tensor& bias,
               const at::Tensor& out) {
  const float* asp = a_scale.data_ptr<float>();
  const float* wsp = w_scale.data_ptr<float>();
  vnni_tiles<int32_t>(q, m, k, packed, n, kVnniM, kVnniN, kChunkBytes,
                      [&](const int32_t* tile, int64_t m0, int64_t mb, int64_t n0, int64_t nb) {
    const float* as = asp + m0;
    const float* ws = wsp + n0;
    if (is_bf16(out)) {
      const uint16_t* bp = bias.defined() ? bf16_bits(bias) + n0 : nullptr;
      dequant_rows(tile, as, ws, bp, bf16_bits_mut(out) + m0 * n + n0, 0, mb, nb, nb, n);
    } else {
      const float* bp = bias.defined() ? bias.data_ptr<float>() + n0 : nullptr;
      dequant_rows(tile, as, ws, bp, out.data_ptr<float>() + m0 * n + n0, 0, mb, nb, nb, n);
    }
  });
}

// Whether the brgemm int8 GEMM runs here and is exact: the CPU has AMX-INT8 (s8 x s8 on VNNI
// alone would need a compensation term oneDNN's microkernel does not add for us) and a probe
// at the extremes (+-127 x +-127, odd sizes) gives the exact accumulators. Once per process.
bool vnni_gemm_exact() {
  static const bool exact = [] {
#if defined(__AMX_INT8__)
    try {
      const int64_t m = 3, n = 70, k = 132;
      auto q = at::full({m, k}, 127, at::kChar);
      q[1].fill_(-127);
      q[2].copy_(at::arange(k).remainder(255).sub(127).to(at::kChar));
      auto w = at::full({n, k}, 127, at::kChar);
      w.slice(0, n / 2).fill_(-127);
      w[3].copy_(at::arange(k).remainder(251).sub(125).to(at::kChar));
      auto packed = vnni_pack(w);
      auto ones_m = at::ones({m, 1});
      auto ones_n = at::ones({n});
      auto got = at::empty({m, n});
      vnni_gemm(q.data_ptr<int8_t>(), m, k, packed.data_ptr<int8_t>(), n, ones_m, ones_n,
                at::Tensor(), got);
      auto want = at::matmul(q.to(at::kFloat), w.to(at::kFloat).t());  // |sums| < 2^24: exact
      return at::equal(got, want);
    } catch (const std::exception&) {
      return false;
    }
#else
    return false;
#endif
  }();
  return exact;
}

}  // namespace

// w: [N, K] int8 -> its copy in the blocked VNNI layout for w8a8_vnni_linear, or None where
// that GEMM does not run here (no AMX-INT8, K not a multiple of 4, or the probe failed)
c10::optional<at::Tensor> w8a8_vnni_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar,
              "w8a8_vnni_pack: w must be [N, K] int8");
  if (w.size(1) % 4 != 0 || w.size(0) == 0 || !vnni_gemm_exact()) return c10::nullopt;
  return vnni_pack(w);
}

// w8a8_linear on the AMX tiles: q [M, K] int8, a_scale [M, 1], packed = w8a8_vnni_pack(w)
// of w [N, K], w_scale [N], bias [N] of the output dtype or None -> [M, N] float32 or bfloat16
at::Tensor w8a8_vnni_linear(const at::Tensor& q, const at::Tensor& a_scale,
                            const at::Tensor& packed, int64_t n, const at::Tensor& w_scale,
                            const c10::optional<at::Tensor>& bias, bool bf16_out) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && packed.scalar_type() == at::kChar,
              "w8a8_vnni_linear: q must be [M, K] int8 and packed int8");
  const int64_t m = q.size(0), k = q.size(1);
  TORCH_CHECK(k % 4 == 0 && packed.numel() == n * k && packed.is_contiguous(),
              "w8a8_vnni_linear: packed must be w8a8_vnni_pack of an [N, K] weight");
  const auto out_type = bf16_out ? at::kBFloat16 : at::kFloat;
  auto [as, ws, b] = epilogue_operands("w8a8_vnni_linear", a_scale, w_scale, bias, m, n, out_type);
  auto out = at::empty({m, n}, as.options().dtype(out_type));
  if (m == 0) return out;
  auto qc = q.contiguous();
  vnni_gemm(qc.data_ptr<int8_t>(), m, k, packed.data_ptr<int8_t>(), n, as, ws, b, out);
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

namespace {

void check_bf16_rows(const char* op, const at::Tensor& t, const char* name, int64_t k) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.size(-1) == k, op,
              ": ", name, " must be contiguous bfloat16 with ", k, " columns");
}

// w8a8_rms_norm_quant on bfloat16 rows: bf16_ops.cpp's bf16_rms_norm row (rounding where
// transformers' bfloat16 RMSNorm rounds) into `buf`, then quantized as w8a8_quant quantizes a
// bfloat16 row
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_quant_bf16(
    const at::Tensor& x, const at::Tensor& weight, double eps,
    const c10::optional<at::Tensor>& residual) {
  const char* op = "w8a8_rms_norm_quant";
  const int64_t m = x.size(0), k = x.size(1);
  check_bf16_rows(op, x, "x", k);
  check_bf16_rows(op, weight, "weight", k);
  at::Tensor res;
  if (residual.has_value() && residual->defined()) {
    res = *residual;
    check_bf16_rows(op, res, "residual", k);
    TORCH_CHECK(res.sizes() == x.sizes(), op, ": residual must be shaped like x");
  }
  const at::Tensor summed = res.defined() ? at::empty_like(x) : at::Tensor();
  auto q = at::empty({m, k}, x.options().dtype(at::kChar));
  auto scale = at::empty({m, 1}, x.options().dtype(at::kFloat));
  const uint16_t* xp = bf16_bits(x);
  const uint16_t* rp = res.defined() ? bf16_bits(res) : nullptr;
  uint16_t* sp = summed.defined() ? bf16_bits_mut(summed) : nullptr;
  const uint16_t* wp = bf16_bits(weight);
  int8_t* qp = q.data_ptr<int8_t>();
  float* scp = scale.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, m, rows_per_task(k, 131072), [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> buf(k);
    for (int64_t i = begin; i < end; ++i) {
      rms_norm_row_bf16(xp + i * k, rp ? rp + i * k : nullptr, sp ? sp + i * k : nullptr, wp,
                        feps, k, buf.data());
      quant_rows(buf.data(), qp + i * k, scp + i, 0, 1, k);
    }
  });
  return {q, scale, summed};
}

}  // namespace

at::Tensor checked_norm_residual(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& residual);  // layer_ops.cpp
void check_gate_up(const char* op, const at::Tensor& gate_up);                 // layer_ops.cpp

// RMSNorm (of residual + x when residual is given) fused with per-token quantization, one pass
// over each row. x, residual: [M, K] float32, weight: [K] float32 -> (q [M, K] int8,
// scale [M, 1] float32, residual + x [M, K] or an undefined tensor); or all of x, weight and
// residual bfloat16 (then residual + x is bfloat16). The sum of squares is reduced in another
// order than torch's, so a value on a rounding boundary may land one int8 step away from the
// reference (tests/kernels/test_w8a8.py states the bound).
std::tuple<at::Tensor, at::Tensor, at::Tensor> w8a8_rms_norm_quant(
    const at::Tensor& x, const at::Tensor& weight, double eps,
    const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2, "w8a8_rms_norm_quant: x must be [M, K]");
  if (is_bf16(x)) return rms_norm_quant_bf16(x, weight, eps, residual);
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
// (q [M, I] int8, scale [M, 1]). The float product alone is layer_ops.cpp's silu_mul. For
// bfloat16 rows bf16_ops.cpp's row, which rounds silu(gate) and the product to bfloat16 as
// torch's bfloat16 ops do, then the quantization of that bfloat16 row.
std::tuple<at::Tensor, at::Tensor> w8a8_silu_mul(const at::Tensor& gate_up) {
  const bool bf16 = is_bf16(gate_up);
  if (bf16) {
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
                "w8a8_silu_mul: gate_up must be [M, 2 * I] with contiguous rows");
  } else {
    check_gate_up("w8a8_silu_mul", gate_up);
  }
  const int64_t m = gate_up.size(0), inter = gate_up.size(1) / 2, ld = gate_up.stride(0);
  at::Tensor out = at::empty({m, inter}, gate_up.options().dtype(at::kChar));
  at::Tensor scale = at::empty({m, 1}, gate_up.options().dtype(at::kFloat));
  int8_t* op = out.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, m, rows_per_task(inter, 65536), [&](int64_t begin, int64_t end) {
    if (bf16) {
      const uint16_t* gp = bf16_bits(gate_up);
      std::vector<uint16_t> buf(inter);
      for (int64_t r = begin; r < end; ++r) {
        silu_mul_row_bf16(gp + r * ld, gp + r * ld + inter, buf.data(), inter);
        quant_rows(buf.data(), op + r * inter, sp + r, 0, 1, inter);
      }
    } else {
      const float* gp = gate_up.data_ptr<float>();
      std::vector<float> buf(inter);
      for (int64_t r = begin; r < end; ++r) {
        silu_mul_row(gp + r * ld, gp + r * ld + inter, buf.data(), inter);
        quant_rows(buf.data(), op + r * inter, sp + r, 0, 1, inter);
      }
    }
  });
  return {out, scale};
}

// x: [M, K] float32 or bfloat16 -> w8a8_linear(w8a8_quant(x), ...) in x's dtype: a linear on a
// float input
at::Tensor w8a8_linear_float(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                             const c10::optional<at::Tensor>& bias,
                             const c10::optional<at::Tensor>& packed) {
  auto [q, scale] = w8a8_quant(x);
  return w8a8_linear(q, scale, w, w_scale, bias, packed, is_bf16(x));
}

void register_w8a8_ops(py::module& m) {
  m.def("w8a8_quant", &w8a8_quant, release_gil(),
        "per-token int8 quantization (float32 or bfloat16 [M, K])", py::arg("x"));
  m.def("w8a8_linear", &w8a8_linear, release_gil(),
        "int8 GEMM + dequantizing epilogue (float32 out, or bfloat16 with bf16_out)",
        py::arg("q"), py::arg("a_scale"), py::arg("w"), py::arg("w_scale"),
        py::arg("bias") = py::none(), py::arg("packed") = py::none(),
        py::arg("bf16_out") = false);
  m.def("w8a8_linear_float", &w8a8_linear_float, release_gil(),
        "per-token quantization + w8a8_linear, out in x's dtype",
        py::arg("x"), py::arg("w"), py::arg("w_scale"), py::arg("bias") = py::none(),
        py::arg("packed") = py::none());
  m.def("w8a8_pack", &w8a8_pack, release_gil(),
        "int8 weight [N, K] in oneDNN's matmul layout (or None)",
        py::arg("w"));
  m.def("w8a8_vnni_pack", &w8a8_vnni_pack, release_gil(),
        "int8 weight [N, K] in blocks for the AMX int8 GEMM (or None where it does not run)",
        py::arg("w"));
  m.def("w8a8_vnni_linear", &w8a8_vnni_linear, release_gil(),
        "int8 GEMM on AMX tiles (brgemm s8 x s8) + dequantizing epilogue", py::arg("q"),
        py::arg("a_scale"), py::arg("packed"), py::arg("n"), py::arg("w_scale"),
        py::arg("bias") = py::none(), py::arg("bf16_out") = false);
  m.def("w8a8_silu_mul", &w8a8_silu_mul, release_gil(),
        "silu(gate) * up of a fused gate/up output, quantized per token", py::arg("gate_up"));
  m.def("w8a8_rms_norm_quant", &w8a8_rms_norm_quant, release_gil(),
        "RMSNorm (after the residual add) fused with per-token int8 quantization",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
}
