// Rotary embedding fused with the KV-cache write, for float32 and bfloat16 on the CPU: one call
// per layer instead of ~15 eager ops (the sign-flipped sin, q * cos, roll, multiply, add for q
// and for k, two index_copy_ into the cache, and the views between them). Each eager op costs a
// few microseconds of dispatch, more than its arithmetic for a decode step's few tokens.
//
// Numerics equal lmengine/kernels/rotary.py's reference (transformers' rotate-half form) bit
// for bit: out = x * cos + rotate_half(x) * sin, each product rounded, then the sum (no fused
// multiply-add: fp-contract off), where rotate_half(x)[i] = -x[i + d/2] for i < d/2 and
// x[i - d/2] after; in bfloat16 each product and the sum are rounded to bfloat16, as
// transformers' eager bfloat16 ops round them.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "bf16_rows.h"
#include "bindings.h"
#include "vec_math.h"

namespace {

__attribute__((optimize("fp-contract=off"))) inline void rotate_row(
    const float* x, const float* cos, const float* sin, float* out, int64_t dim) {
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i] * cos[i];
    const float b = -x[i + half] * sin[i];
    out[i] = a + b;
  }
#pragma omp simd
  for (int64_t i = half; i < dim; ++i) {
    const float a = x[i] * cos[i];
    const float b = x[i - half] * sin[i];
    out[i] = a + b;
  }
}

// bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)): transformers' apply_rotary_pos_emb in
// bfloat16 (its bits as uint16_t), each product and the sum rounded
__attribute__((optimize("fp-contract=off"))) inline void rotate_row(
    const uint16_t* x, const uint16_t* cos, const uint16_t* sin, uint16_t* out, int64_t dim) {
  const int64_t half = dim / 2;
#if defined(__AVX512F__)
  // 16 lanes at a time where the halves are whole vectors (GCC's `omp simd` form below
  // compiles to 8 lanes)
  if (half % 16 == 0) {
    for (int64_t i = 0; i < half; i += 16) {
      const v16f lo = load_bf16x16(x + i), hi = load_bf16x16(x + i + half);
      const v16f c_lo = load_bf16x16(cos + i), c_hi = load_bf16x16(cos + i + half);
      const v16f s_lo = load_bf16x16(sin + i), s_hi = load_bf16x16(sin + i + half);
      store_bf16x16(out + i, round_bf16x16(lo * c_lo) + round_bf16x16(-hi * s_lo));
      store_bf16x16(out + i + half, round_bf16x16(hi * c_hi) + round_bf16x16(lo * s_hi));
    }
    return;
  }
#endif
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = round_bf16(to_f32(x[i]) * to_f32(cos[i]));
    const float b = round_bf16(-to_f32(x[i + half]) * to_f32(sin[i]));
    out[i] = to_bf16(a + b);
  }
#pragma omp simd
  for (int64_t i = half; i < dim; ++i) {
    const float a = round_bf16(to_f32(x[i]) * to_f32(cos[i]));
    const float b = round_bf16(to_f32(x[i - half]) * to_f32(sin[i]));
    out[i] = to_bf16(a + b);
  }
}

// The kernel for element type T: float (float32 tensors) or uint16_t (bfloat16 tensors, their
// bits); `op` names it in errors.
template <typename T>
at::Tensor rotary_fill_kv_as(const char* op, const char* dtype_name, at::ScalarType dtype,
                             const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                             at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const std::initializer_list<const at::Tensor*> all = {&q, &k, &v, &cos, &sin, &k_cache, &v_cache};
  for (const at::Tensor* t : all) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dtype, op, ": ", dtype_name,
                " CPU tensors only, got ", t->scalar_type());
  }
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && v.dim() == 2 && q.stride(1) == 1 &&
                  k.stride(1) == 1 && v.stride(1) == 1,
              op, ": q, k, v must be [T, heads * head_dim] with contiguous rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              op, ": cos, sin and the caches must be contiguous");
  const int64_t num_tokens = q.size(0), dim = cos.size(1);
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == dim && v_cache.sizes() == k_cache.sizes(),
              op, ": caches must be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(dim % 2 == 0 && q.size(1) % dim == 0 && k.size(1) == kv_heads * dim &&
                  v.size(1) == kv_heads * dim && cos.size(0) == num_tokens &&
                  sin.sizes() == cos.sizes() && k.size(0) == num_tokens &&
                  v.size(0) == num_tokens && slot_mapping.numel() == num_tokens,
              op, ": shapes do not fit");
  const int64_t heads = q.size(1) / dim;
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, op, ": slot ", sp[t], " out of range");
  }
  auto q_out = at::empty({num_tokens, heads, dim}, q.options());
  auto in = [](const at::Tensor& t) { return static_cast<const T*>(t.data_ptr()); };
  auto out = [](const at::Tensor& t) { return static_cast<T*>(t.data_ptr()); };
  const T *qp = in(q), *kp = in(k), *vp = in(v), *cp = in(cos), *snp = in(sin);
  T* qo = out(q_out);
  T* kc = out(k_cache);
  T* vc = out(v_cache);
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  const int64_t row = kv_heads * dim;  // one slot of a cache
  // ~64K elements per task: a decode batch (tens of tokens, a few microseconds of work) stays
  // on one thread, without a fork / join that costs more than the work on a busy machine
  const int64_t grain = rows_per_task((heads + 2 * kv_heads) * dim, 65536);
  // The slots are scattered over a pool far larger than the caches: each written line is a
  // miss, and stores that miss barely overlap. Claiming the lines of the token kLookahead
  // ahead overlaps them: 64 decode tokens into a cold 776-block pool, 122 -> 100 us per call
  // on an AMD EPYC (Zen 4, float32); cache-bypassing stores instead measured no better
  // (109-124 us).
  constexpr int64_t kLookahead = 4;
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(T));
  auto claim = [&](int64_t t) {
    const char* kd = reinterpret_cast<const char*>(kc + sp[t] * row);
    const char* vd = reinterpret_cast<const char*>(vc + sp[t] * row);
    for (int64_t b = 0; b < row_bytes; b += 64) {
      prefetch_line_for_write(kd + b);
      prefetch_line_for_write(vd + b);
    }
  };
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < std::min(end, begin + kLookahead); ++t) claim(t);
    for (int64_t t = begin; t < end; ++t) {
      if (t + kLookahead < end) claim(t + kLookahead);
      const T* c = cp + t * dim;
      const T* s = snp + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        rotate_row(qp + t * qs + h * dim, c, s, qo + (t * heads + h) * dim, dim);
      }
      T* k_slot = kc + sp[t] * row;
      for (int64_t h = 0; h < kv_heads; ++h) {
        rotate_row(kp + t * ks + h * dim, c, s, k_slot + h * dim, dim);
      }
      std::copy(vp + t * vs, vp + t * vs + row, vc + sp[t] * row);
    }
  });
  return q_out;
}

}  // namespace

// q [T, H * D] and k, v [T, KH * D]: float32 rows (any row stride, contiguous inside a row:
// the q/k/v column slices of one fused qkv output); cos, sin [T, D] contiguous;
// k_cache, v_cache [num_blocks, block_size, KH, D] contiguous float32; slot_mapping [T] int.
// Writes rotated k and v into their cache slots; returns rotated q [T, H, D].
at::Tensor rotary_fill_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                          at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  return rotary_fill_kv_as<float>("rotary_fill_kv", "float32", at::kFloat, q, k, v, cos, sin,
                                  k_cache, v_cache, slot_mapping);
}

// The same for bfloat16 q, k, v, cos, sin and caches, rounding where transformers' bfloat16
// ops round (bit-identical to its eager bfloat16 rotary and cache write).
at::Tensor rotary_fill_kv_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                               at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  return rotary_fill_kv_as<uint16_t>("rotary_fill_kv_bf16", "bfloat16", at::kBFloat16, q, k,
                                     v, cos, sin, k_cache, v_cache, slot_mapping);
}

void register_rotary_ops(py::module& m) {
  m.def("rotary_fill_kv", &rotary_fill_kv, release_gil(),
        "rotary on q and k, rotated k and v written to their paged cache slots (float32, CPU)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cos"), py::arg("sin"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"));
  m.def("rotary_fill_kv_bf16", &rotary_fill_kv_bf16, release_gil(),
        "rotary on q and k, rotated k and v written to their paged cache slots (bfloat16, CPU)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cos"), py::arg("sin"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"));
}
