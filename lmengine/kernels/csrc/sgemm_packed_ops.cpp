// float32 linear on a weight packed once by MKL: y = x W^T (+ b), for any number of rows.
//
// MKL's packed GEMM API (cblas_sgemm_pack / cblas_sgemm_compute) lays a matrix out once in the
// order its kernels read it, so that no GEMM call repacks it. torch's CPU wheels link MKL into
// libtorch_cpu and export these symbols; torch itself uses them only for a fixed batch size
// (`torch.ops.mkl._mkl_linear` falls back to an unpacked GEMM for any other row count). A
// matrix packed once serves every row count: the row count given at packing only steers the
// layout MKL chooses. Measured on an Intel Xeon (family 6, model 167, 2 cores), all of
// SmolLM2-135M's per-layer linears streamed from memory, GFLOP/s at 17 / 32 / 64 / 117 / 256 /
// 1,024 / 2,048 rows: packed for 512 rows 129 / 198 / 292 / 356 / 395 / 401 / 394; oneDNN on
// its own packed weights 122 / 175 / 225 / 285 / 352 / 387 / 391; a hint of 1,024 rows and
// more picks a layout ~1.5x slower below 1,024 rows.
//
// The symbols are declared weak (mkl_cblas.h): a torch built without MKL still loads this
// module, and `sgemm_packed_available()` says False there.
//
// The size MKL asks for is 1.4-3x the matrix (~8 MB at least), while the packed data it
// writes is the matrix's size, spread over the first part of it. The buffer is therefore its
// own anonymous mapping: pages MKL never writes are never backed by memory.

#include <sys/mman.h>
#include <torch/extension.h>

#include <cstring>

#include "bindings.h"
#include "mkl_cblas.h"

namespace {

using namespace mkl_cblas;

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

void check_int(int64_t v, const char* name) {
  TORCH_CHECK(v >= 1 && v <= INT32_MAX, "sgemm_packed: ", name, " out of MKL's int range: ", v);
}

}  // namespace

bool sgemm_packed_available() { return mkl_cblas_available(); }

// weight [N, K] -> an opaque uint8 tensor holding W^T packed for y = x W^T with x [M, K];
// `rows_hint` is the row count MKL optimises the layout for.
at::Tensor sgemm_pack(const at::Tensor& weight, int64_t rows_hint) {
  TORCH_CHECK(sgemm_packed_available(), "sgemm_pack: this torch has no MKL packed GEMM");
  check_f32(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "sgemm_pack: weight must be [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  check_int(n, "N");
  check_int(k, "K");
  check_int(rows_hint, "rows_hint");
  const size_t bytes = cblas_sgemm_pack_get_size(kBMatrix, rows_hint, n, k);
  void* buffer = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(buffer != MAP_FAILED, "sgemm_pack: could not map ", bytes, " bytes");
  cblas_sgemm_pack(kRowMajor, kBMatrix, kTrans, rows_hint, n, k, 1.0f, weight.data_ptr<float>(),
                   k, static_cast<float*>(buffer));
  return torch::from_blob(
      buffer, {static_cast<int64_t>(bytes)}, [bytes](void* p) { munmap(p, bytes); },
      at::TensorOptions().dtype(at::kByte));
}

// x [M, K] @ W^T (+ bias [N]) -> [M, N] on `packed` = sgemm_pack(W, ...); W [N, K] itself is
// read for its shape only (the packed buffer does not say it)
at::Tensor sgemm_packed_linear(const at::Tensor& x, const at::Tensor& packed,
                               const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "sgemm_packed_linear: x must be [M, K] and weight [N, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1,
              "sgemm_packed_linear: packed must come from sgemm_pack");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  check_int(n, "N");
  check_int(k, "K");
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "sgemm_packed_linear: bias must be [N]");
    bp = bias->data_ptr<float>();
  }
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  check_int(m, "M");
  // NOTE: beta = 0 and the bias added after: with one row, MKL's compute ignored beta = 1 (it
  // overwrote C) in the build measured
  float* yp = y.data_ptr<float>();
  cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, m, n, k, x.data_ptr<float>(), k,
                      static_cast<const float*>(packed.data_ptr()), k, 0.f, yp, n);
  if (bp != nullptr)
    for (int64_t i = 0; i < m; ++i)
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) yp[i * n + j] += bp[j];
  return y;
}

void register_sgemm_packed_ops(py::module& m) {
  m.def("sgemm_packed_available", &sgemm_packed_available, release_gil(),
        "whether this torch exports MKL's packed GEMM");
  m.def("sgemm_pack", &sgemm_pack, release_gil(), "MKL-pack a float32 weight [N, K] for x @ W^T",
        py::arg("weight"), py::arg("rows_hint"));
  m.def("sgemm_packed_linear", &sgemm_packed_linear, release_gil(),
        "float32 x [M, K] @ W^T (+ bias) on a weight from sgemm_pack", py::arg("x"),
        py::arg("packed"), py::arg("weight"), py::arg("bias") = py::none());
}
