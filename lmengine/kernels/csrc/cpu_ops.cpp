// CPU kernels of lmengine, built on first use with torch.utils.cpp_extension
// (lmengine/kernels/cpu_ext.py). Each has a PyTorch reference with the same meaning in the
// Python module that calls it; the tests compare the two.
//
// Work is split over ATen's intra-op thread pool (at::parallel_for), so these kernels share
// torch's OpenMP threads instead of starting their own.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

void check_cpu_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

// Decode attention straight from the paged cache: one query token per sequence, no gather.
//   q:            [num_seqs, num_heads, head_dim]
//   k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables: [num_seqs, max_blocks] int32
//   kv_lens:      [num_seqs] int32, keys visible to the sequence's query (its own included)
//   sliding_window: > 0 limits the query to its last `sliding_window` keys (0 = all)
//   softcap:        > 0 caps the scaled scores as softcap * tanh(score / softcap) (Gemma 2)
// Returns [num_seqs, num_heads, head_dim]. The query heads of one KV head (GQA group) are
// served together, so each key and value row is read once per group. Softmax is online
// (running max and sum per head), one block at a time.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& kv_lens, double scale,
                                  int64_t sliding_window, double softcap) {
  check_cpu_f32(q, "q");
  check_cpu_f32(k_cache, "k_cache");
  check_cpu_f32(v_cache, "v_cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be contiguous int32");
  TORCH_CHECK(kv_lens.scalar_type() == at::kInt && kv_lens.is_contiguous(),
              "kv_lens must be contiguous int32");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "bad shapes");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "head_dim of q and cache differ");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads not a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) == num_seqs && kv_lens.size(0) == num_seqs,
              "one block table and kv_len per sequence");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * head_dim;  // between tokens of one block
  auto out = at::empty_like(q);
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = k_cache.data_ptr<float>();
  const float* v_ptr = v_cache.data_ptr<float>();
  const int32_t* table_ptr = block_tables.data_ptr<int32_t>();
  const int32_t* len_ptr = kv_lens.data_ptr<int32_t>();
  float* out_ptr = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const float fcap = static_cast<float>(softcap);
  TORCH_CHECK(sliding_window >= 0 && softcap >= 0, "sliding_window and softcap must be >= 0");

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * block_size);
    std::vector<float> acc(group * head_dim);
    std::vector<float> run_max(group), run_sum(group);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t seq = job / num_kv_heads, kv_head = job % num_kv_heads;
      const int64_t kv_len = len_ptr[seq];
      TORCH_CHECK(kv_len > 0 && kv_len <= max_blocks * block_size, "kv_len out of range");
      const float* q_group = q_ptr + (seq * num_heads + kv_head * group) * head_dim;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(run_sum.begin(), run_sum.end(), 0.f);
      // keys first_key .. kv_len - 1 are visible
      const int64_t first_key = sliding_window > 0 ? std::max<int64_t>(0, kv_len - sliding_window) : 0;
      for (int64_t blk = first_key / block_size; blk * block_size < kv_len; ++blk) {
        const int64_t block_id = table_ptr[seq * max_blocks + blk];
        const int64_t first = std::max<int64_t>(first_key - blk * block_size, 0);
        const int64_t num_keys = std::min(block_size, kv_len - blk * block_size) - first;
        const int64_t base = ((block_id * block_size + first) * num_kv_heads + kv_head) * head_dim;
        const float* k_block = k_ptr + base;
        const float* v_block = v_ptr + base;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q_group + g * head_dim;
          float* sg = scores.data() + g * block_size;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < num_keys; ++t) {
            sg[t] = dot(qg, k_block + t * token_stride, head_dim) * fscale;
            if (fcap > 0.f) sg[t] = fcap * std::tanh(sg[t] / fcap);
            block_max = std::max(block_max, sg[t]);
          }
          const float new_max = std::max(run_max[g], block_max);
          const float correction = std::exp(run_max[g] - new_max);
          float* ag = acc.data() + g * head_dim;
          float block_sum = 0.f;
          for (int64_t t = 0; t < num_keys; ++t) {
            sg[t] = std::exp(sg[t] - new_max);
            block_sum += sg[t];
          }
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) ag[i] *= correction;
          for (int64_t t = 0; t < num_keys; ++t) {
            const float p = sg[t];
            const float* vt = v_block + t * token_stride;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; ++i) ag[i] += p * vt[i];
          }
          run_sum[g] = run_sum[g] * correction + block_sum;
          run_max[g] = new_max;
        }
      }
      float* o_group = out_ptr + (seq * num_heads + kv_head * group) * head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.f / run_sum[g];
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) o_group[g * head_dim + i] = acc[g * head_dim + i] * inv;
      }
    }
  });
  return out;
}

void register_w8a8_ops(py::module& m);  // w8a8_ops.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_w8a8_ops(m);
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the paged KV cache (float32, CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("kv_lens"),
        py::arg("scale"), py::arg("sliding_window") = 0, py::arg("softcap") = 0.0);
}
