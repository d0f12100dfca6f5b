// What the paged-attention kernels (cpu_ops.cpp: decode, prefill_attention_ops.cpp: prefill)
// share about their inputs: where a cache's rows are, and the learned sinks.
#pragma once

#include <torch/extension.h>

namespace {

// The elements between two rows of a paged cache [num_blocks, block_size, num_kv_heads, dim]:
// row r = (slot, KV head), slot = block * block_size + offset, starts r * pitch elements in.
// A contiguous cache has pitch = dim; a view of the first `dim` elements of a wider contiguous
// cache's rows (MLA's values: the latent part of its keys, k_cache[..., :kv_lora_rank]) has
// the wider cache's. Any other layout is refused.
inline int64_t cache_row_pitch(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  const char* type_name = dtype == at::kFloat       ? "float32"
                          : dtype == at::kBFloat16  ? "bfloat16"
                          : dtype == at::kChar      ? "int8"
                                                    : "?";
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 4, name,
              " must be a ", type_name, " CPU tensor [num_blocks, block_size, num_kv_heads, D]");
  if (t.is_contiguous()) return t.size(3);
  const int64_t pitch = t.stride(2);
  TORCH_CHECK(t.stride(3) == 1 && pitch >= t.size(3) && t.stride(1) == t.size(2) * pitch &&
                  t.stride(0) == t.size(1) * t.stride(1),
              name, " must be contiguous, or the first D elements of a contiguous cache's rows");
  return pitch;
}

// Whether the values are the first elements of the keys' own rows (one latent cache, MLA):
// kernels that convert rows then convert them once.
inline bool values_in_keys(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t k_pitch,
                           int64_t v_pitch) {
  return v_cache.data_ptr() == k_cache.data_ptr() && v_pitch == k_pitch;
}

// The sinks' data (float32 [num_heads] on the CPU: a learned logit per query head), or nullptr
// without sinks
inline const float* sinks_data(const c10::optional<at::Tensor>& sinks, int64_t num_heads,
                               const char* op) {
  if (!sinks.has_value()) return nullptr;
  const at::Tensor& t = *sinks;
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.dim() == 1 && t.size(0) == num_heads,
              op, ": sinks must be a contiguous float32 CPU tensor [num_heads]");
  return t.data_ptr<float>();
}

}  // namespace
