// The small per-layer ops of a float32 forward on the CPU: RMSNorm fused with the residual add
// before it, and SwiGLU's silu(gate) * up. Each is one pass over its rows instead of torch's
// eager chain (RMSNorm runs as ~8 ops: pow, mean, add, rsqrt, multiplies, casts), whose
// dispatch costs more than the arithmetic at a decode step's few rows: a single-stream
// SmolLM2 step spent ~8 % of its time in RMSNorm.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "vec_math.h"

namespace {

// rows per task: ~128K elements, so a decode step's few rows stay on one thread (no fork/join)
int64_t row_grain(int64_t row_elems) {
  return std::max<int64_t>(1, 131072 / std::max<int64_t>(1, row_elems));
}

}  // namespace

// x: [..., K] float32 contiguous; weight [K]; residual like x or None. Returns (normed, summed):
// normed = rms_norm_row(residual + x) shaped like x, summed = residual + x (undefined without a
// residual).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rms_norm: x must be a contiguous float32 tensor");
  const int64_t k = x.size(-1), m = k == 0 ? 0 : x.numel() / k;
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == k && weight.is_contiguous(),
              "rms_norm: weight must be contiguous float32 [", k, "]");
  at::Tensor res, summed;
  if (residual.has_value() && residual->defined()) {
    res = *residual;
    TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == at::kFloat && res.is_contiguous(),
                "rms_norm: residual must be contiguous float32 shaped like x");
    summed = at::empty_like(x);
  }
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  float* sp = summed.defined() ? summed.data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, m, row_grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      rms_norm_row(xp + i * k, rp ? rp + i * k : nullptr, sp ? sp + i * k : nullptr, wp, feps, k,
                   op + i * k);
    }
  });
  return {out, summed};
}

// gate_up: [M, 2 * I] float32, rows contiguous (gate = columns 0..I-1, up = I..2I-1) ->
// silu(gate) * up [M, I] (silu_mul_row: within a few ulp of torch's).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat &&
                  gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [M, 2 * I] float32 with contiguous rows");
  const int64_t m = gate_up.size(0), inter = gate_up.size(1) / 2, ld = gate_up.stride(0);
  at::Tensor out = at::empty({m, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, m, row_grain(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      silu_mul_row(gp + r * ld, gp + r * ld + inter, op + r * inter, inter);
    }
  });
  return out;
}

void register_layer_ops(py::module& m) {
  m.def("rms_norm", &rms_norm, "RMSNorm, after the residual add when given (float32, CPU)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up output (float32, CPU)",
        py::arg("gate_up"));
}
