// The small per-layer ops of a float32 forward on the CPU: RMSNorm fused with the residual add
// before it, and SwiGLU's silu(gate) * up. Each is one pass over its rows instead of torch's
// eager chain (RMSNorm runs as ~8 ops: pow, mean, add, rsqrt, multiplies, casts), whose
// dispatch costs more than the arithmetic at a decode step's few rows: a single-stream
// SmolLM2 step spent ~8 % of its time in RMSNorm.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "bindings.h"
#include "vec_math.h"

constexpr int64_t kElemsPerTask = 131072;

// The inputs of a compiled RMSNorm (rms_norm here, w8a8_ops.cpp's w8a8_rms_norm_quant), checked:
// x contiguous float32 [..., K], weight contiguous float32 [K], residual None or contiguous
// float32 shaped like x. Returns the residual, an undefined tensor without one.
at::Tensor checked_norm_residual(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous float32 tensor");
  const int64_t k = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == k && weight.is_contiguous(),
              op, ": weight must be contiguous float32 [", k, "]");
  if (!residual.has_value() || !residual->defined()) return at::Tensor();
  TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kFloat &&
                  residual->is_contiguous(),
              op, ": residual must be contiguous float32 shaped like x");
  return *residual;
}

// x: [..., K] float32 contiguous; weight [K]; residual like x or None. Returns (normed, summed):
// normed = rms_norm_row(residual + x) shaped like x, summed = residual + x (undefined without a
// residual).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps, const c10::optional<at::Tensor>& residual) {
  const at::Tensor res = checked_norm_residual("rms_norm", x, weight, residual);
  const int64_t k = x.size(-1), m = k == 0 ? 0 : x.numel() / k;
  const at::Tensor summed = res.defined() ? at::empty_like(x) : at::Tensor();
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  float* sp = summed.defined() ? summed.data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, m, rows_per_task(k, kElemsPerTask), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      rms_norm_row(xp + i * k, rp ? rp + i * k : nullptr, sp ? sp + i * k : nullptr, wp, feps, k,
                   op + i * k);
    }
  });
  return {out, summed};
}

// The input of a compiled SwiGLU product (silu_mul here, w8a8_ops.cpp's w8a8_silu_mul), checked:
// [M, 2 * I] float32 with contiguous rows.
void check_gate_up(const char* op, const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat &&
                  gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              op, ": gate_up must be [M, 2 * I] float32 with contiguous rows");
}

// gate_up: [M, 2 * I] float32, rows contiguous (gate = columns 0..I-1, up = I..2I-1) ->
// silu(gate) * up [M, I] (silu_mul_row: within a few ulp of torch's).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_gate_up("silu_mul", gate_up);
  const int64_t m = gate_up.size(0), inter = gate_up.size(1) / 2, ld = gate_up.stride(0);
  at::Tensor out = at::empty({m, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, m, rows_per_task(2 * inter, kElemsPerTask), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      silu_mul_row(gp + r * ld, gp + r * ld + inter, op + r * inter, inter);
    }
  });
  return out;
}

void register_moe_ops(py::module& m);  // moe_ops.cpp

void register_layer_ops(py::module& m) {
  // NOTE: the MoE layer registers from here, not from cpu_ops.cpp's module definition, so that
  // adding it left that file (edited by others at the time) alone
  register_moe_ops(m);
  m.def("rms_norm", &rms_norm, release_gil(),
        "RMSNorm, after the residual add when given (float32, CPU)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("silu_mul", &silu_mul, release_gil(),
        "silu(gate) * up of a fused gate/up output (float32, CPU)",
        py::arg("gate_up"));
}
