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
#include <type_traits>
#include <vector>

#include "bindings.h"
#include "paged_cache.h"
#include "vec_math.h"

namespace {

void check_cpu_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_int8_cache(const at::Tensor& cache, const at::Tensor& scale, const char* name) {
  TORCH_CHECK(cache.device().is_cpu() && cache.scalar_type() == at::kChar && cache.is_contiguous(),
              name, " must be a contiguous int8 CPU tensor");
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat &&
                  scale.is_contiguous() && scale.dim() == 3 && scale.size(0) == cache.size(0) &&
                  scale.size(1) == cache.size(1) && scale.size(2) == cache.size(2),
              name, " scales must be contiguous float32 [num_blocks, block_size, num_kv_heads]");
}

// Eight floats as one vector (GCC / Clang vector extension: AVX on x86, NEON pairs on ARM).
// aligned(4): loads and stores through it may be unaligned (cache rows are 4-byte aligned).
typedef float v8f __attribute__((vector_size(32), aligned(4)));

inline v8f load8(const float* p) { return *reinterpret_cast<const v8f*>(p); }

inline float hsum8(v8f a) {
  typedef float v4f __attribute__((vector_size(16)));
  v4f h = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  h = h + __builtin_shufflevector(h, h, 2, 3, 0, 1);
  return h[0] + h[1];
}

// Where the rows of the block a task reads next are (the next block of the sequence, or the
// first block of the thread's next task): while a block is scored, key t's turn prefetches
// row t of the next one, K and V, for the same KV head. Blocks sit anywhere in the pool, so
// the hardware prefetchers cannot guess them, and spreading the requests over the block's
// work kept them from queueing up: 64 sequences x 105-170 keys read from memory ran 1.35-1.6x
// faster than with no prefetch, or with the whole next block requested at once.
template <typename Cache>
struct NextRows {
  const Cache* k = nullptr;
  const Cache* v = nullptr;
  int64_t num_keys = 0;  // rows to prefetch, `k_stride` / `v_stride` elements apart
  int64_t k_stride = 0, v_stride = 0;
  int64_t k_elems = 0, v_elems = 0;  // elements of one row (one KV head); 0: none

  inline void prefetch(int64_t t) const {
    if (t >= num_keys) return;
    constexpr int64_t kLine = 64 / sizeof(Cache);
    for (int64_t i = 0; i < k_elems; i += kLine) prefetch_line(k + t * k_stride + i);
    for (int64_t i = 0; i < v_elems; i += kLine) prefetch_line(v + t * v_stride + i);
  }
};

// Lane i of the result = the sum of the lanes of s[i]: eight horizontal sums in one
// transposing tree (three rounds of pairwise adds) instead of three shuffle rounds per key.
inline v8f transpose_sum8(const v8f* s) {
  auto hadd = [](v8f a, v8f b) {  // [a01 a23 b01 b23 | a45 a67 b45 b67], as vhaddps
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  const v8f lo = hadd(hadd(s[0], s[1]), hadd(s[2], s[3]));  // keys 0-3: low | high halves
  const v8f hi = hadd(hadd(s[4], s[5]), hadd(s[6], s[7]));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

// Scaled (and capped) scores of one block: s[g * block_size + t] = q_g . k_t for every query
// head g of the group and key t. head_dim fixed at kDim (a multiple of 8). Keys go eight at a
// time: for each head, eight independent accumulators (one per key, each FMA's key row from
// L1 after the group's first head), then one transposed reduction gives the eight scores as
// one vector. A last partial group of keys repeats its last key in the missing lanes (their
// scores are dropped), so every key's score is summed in the same order wherever it sits.
template <int64_t kDim, typename Cache>
inline void block_scores(const float* q_group, const float* k_block, int64_t stride,
                         int64_t num_keys, int64_t group, int64_t block_size, float fscale,
                         float fcap, float* scores, const NextRows<Cache>& next) {
  constexpr int64_t kVec = kDim / 8;
  for (int64_t t0 = 0; t0 < num_keys; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, num_keys - t0);
    for (int64_t t = t0; t < t0 + 8; ++t) next.prefetch(t);
    const float* kt[8];
    for (int64_t i = 0; i < 8; ++i) kt[i] = k_block + (t0 + std::min(i, n - 1)) * stride;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q_group + g * kDim;
      v8f acc[8] = {};
      for (int64_t j = 0; j < kVec; ++j) {
        const v8f qj = load8(qg + 8 * j);
        for (int64_t i = 0; i < 8; ++i) acc[i] += qj * load8(kt[i] + 8 * j);
      }
      const v8f sum = transpose_sum8(acc) * fscale;
      float* out = scores + g * block_size + t0;
      if (n == 8) {
        *reinterpret_cast<v8f*>(out) = sum;
      } else {
        for (int64_t i = 0; i < n; ++i) out[i] = sum[i];
      }
    }
  }
  if (fcap > 0.f) {
    for (int64_t g = 0; g < group; ++g)
      for (int64_t t = 0; t < num_keys; ++t) {
        float& s = scores[g * block_size + t];
        s = fcap * std::tanh(s / fcap);
      }
  }
}

// acc_g += sum_t p[g][t] * v_t for every head g, the head's kDim accumulator in registers.
template <int64_t kDim>
inline void block_values(const float* v_block, int64_t stride, int64_t num_keys, int64_t group,
                         int64_t block_size, const float* scores, float* acc) {
  constexpr int64_t kVec = kDim / 8;
  for (int64_t g = 0; g < group; ++g) {
    const float* sg = scores + g * block_size;
    float* ag = acc + g * kDim;
    v8f a[kVec];
    for (int64_t j = 0; j < kVec; ++j) a[j] = load8(ag + 8 * j);
    for (int64_t t = 0; t < num_keys; ++t) {
      const float* vt = v_block + t * stride;
      const float p = sg[t];
      for (int64_t j = 0; j < kVec; ++j) a[j] += p * load8(vt + 8 * j);
    }
    for (int64_t j = 0; j < kVec; ++j) *reinterpret_cast<v8f*>(ag + 8 * j) = a[j];
  }
}

// One block of keys for the `group` query heads of one KV head, online softmax. kDim > 0 fixes
// both head dims at compile time (64, 128: the loops over them unroll into registers); 0 reads
// `k_dim_rt` (queries, keys) and `v_dim_rt` (values, accumulators; <= k_dim_rt, e.g. MLA's
// latent values inside its keys). Key rows are `k_stride` elements apart, value rows
// `v_stride`. Each key row and value row is loaded once for the whole group: scores for every
// (head, key) first, then the block's exponentials, then one pass over the values.
template <int64_t kDim, typename Cache>
inline void attend_block(const float* q_group, const float* k_block, const float* v_block,
                         int64_t k_stride, int64_t v_stride, int64_t num_keys, int64_t group,
                         int64_t k_dim_rt, int64_t v_dim_rt, int64_t block_size, float fscale,
                         float fcap, float* scores, float* acc, float* run_max, float* run_sum,
                         const NextRows<Cache>& next) {
  const int64_t k_dim = kDim > 0 ? kDim : k_dim_rt;
  const int64_t v_dim = kDim > 0 ? kDim : v_dim_rt;
  if constexpr (kDim > 0) {
    block_scores<kDim>(q_group, k_block, k_stride, num_keys, group, block_size, fscale, fcap,
                       scores, next);
    for (int64_t t = num_keys; t < next.num_keys; ++t) next.prefetch(t);  // a longer next block
  } else {
    for (int64_t t = 0; t < next.num_keys; ++t) next.prefetch(t);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q_group + g * k_dim;
      float* sg = scores + g * block_size;
      int64_t t = 0;
      for (; t + 4 <= num_keys; t += 4) {  // four keys at once: independent sums, more ILP
        const float* k0 = k_block + t * k_stride;
        const float* k1 = k0 + k_stride;
        const float* k2 = k1 + k_stride;
        const float* k3 = k2 + k_stride;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t i = 0; i < k_dim; ++i) {
          s0 += qg[i] * k0[i];
          s1 += qg[i] * k1[i];
          s2 += qg[i] * k2[i];
          s3 += qg[i] * k3[i];
        }
        sg[t] = s0;
        sg[t + 1] = s1;
        sg[t + 2] = s2;
        sg[t + 3] = s3;
      }
      for (; t < num_keys; ++t) {
        const float* kt = k_block + t * k_stride;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < k_dim; ++i) s += qg[i] * kt[i];
        sg[t] = s;
      }
      for (t = 0; t < num_keys; ++t) {
        float s = sg[t] * fscale;
        if (fcap > 0.f) s = fcap * std::tanh(s / fcap);
        sg[t] = s;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * block_size;
    float block_max = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < num_keys; ++t) block_max = std::max(block_max, sg[t]);
    const float new_max = std::max(run_max[g], block_max);
    const float correction = std::exp(run_max[g] - new_max);
    float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
    for (int64_t t = 0; t < num_keys; ++t) {
      sg[t] = exp_approx(sg[t] - new_max);
      block_sum += sg[t];
    }
    float* ag = acc + g * v_dim;
#pragma omp simd
    for (int64_t i = 0; i < v_dim; ++i) ag[i] *= correction;
    run_sum[g] = run_sum[g] * correction + block_sum;
    run_max[g] = new_max;
  }
  if constexpr (kDim > 0) {
    block_values<kDim>(v_block, v_stride, num_keys, group, block_size, scores, acc);
  } else {
    for (int64_t t = 0; t < num_keys; ++t) {
      const float* vt = v_block + t * v_stride;
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * block_size + t];
        float* ag = acc + g * v_dim;
#pragma omp simd
        for (int64_t i = 0; i < v_dim; ++i) ag[i] += p * vt[i];
      }
    }
  }
}

// The shapes of one decode call. Queries and keys are k_dim wide, values and outputs v_dim
// (v_dim <= k_dim: MLA's values are the first v_dim elements of its latent keys). The caches'
// (slot, KV head) rows start k_pitch / v_pitch elements apart (cache_row_pitch).
struct DecodeShape {
  int64_t num_seqs, num_heads, num_kv_heads, k_dim, v_dim, k_pitch, v_pitch, block_size,
      max_blocks;
  bool v_in_k;  // the values are the first v_dim elements of the keys' rows (values_in_keys)
};

// The decode loop, for a float32 cache (Cache = float, no scales), an int8 cache (Cache =
// int8_t, one float32 scale per (slot, KV head) in k_scale / v_scale) or a bfloat16 cache
// (Cache = at::BFloat16, no scales). The int8 and bfloat16 variants convert each block's K and V
// rows of one KV head once into a small float buffer (it stays in L1) and then run the float32
// loop on it, so the GQA group's query heads share the conversion (values inside the keys' rows
// are read from the converted keys, not converted again); the float32 variant reads the cache
// directly. Queries and outputs are float32, or bfloat16 (Query = at::BFloat16: each
// task widens its query rows exactly and rounds its outputs to nearest even, as `.float()` before
// and `.to(torch.bfloat16)` after the float32 kernel would, without those two passes).
// `sinks_ptr`: a learned logit per query head (gpt-oss), or nullptr. Each head's online softmax
// starts from its sink as if it were one more key with a zero value: running maximum = the
// sink, running sum = exp(0) = 1; the keys' blocks then rescale it as they go.
template <typename Cache, int64_t kDim, typename Query = float>
void decode_loop(const Query* q_ptr, const Cache* k_ptr, const Cache* v_ptr, const float* ks_ptr,
                 const float* vs_ptr, const float* sinks_ptr, const int32_t* table_ptr,
                 const int32_t* len_ptr, Query* out_ptr, const DecodeShape& shape, float fscale,
                 float fcap, int64_t sliding_window) {
  constexpr bool kQuant = std::is_same<Cache, int8_t>::value;
  constexpr bool kConvert = !std::is_same<Cache, float>::value;  // through the float buffers
  constexpr bool kWideQuery = !std::is_same<Query, float>::value;
  const int64_t num_seqs = shape.num_seqs, num_heads = shape.num_heads;
  const int64_t num_kv_heads = shape.num_kv_heads, block_size = shape.block_size;
  const int64_t max_blocks = shape.max_blocks, k_dim = shape.k_dim, v_dim = shape.v_dim;
  const int64_t k_pitch = shape.k_pitch, v_pitch = shape.v_pitch;
  // NOTE: int8 values have their own scales: converted apart even from the same memory
  const bool v_in_k = shape.v_in_k && !kQuant;
  const int64_t group = num_heads / num_kv_heads;
  // between tokens of one block
  const int64_t k_token_stride = num_kv_heads * k_pitch, v_token_stride = num_kv_heads * v_pitch;
  // A task serves all KV heads of a sequence when there are sequences enough for the threads:
  // a token's rows of every KV head are adjacent, so a block is then read as one contiguous
  // run instead of one strided pass per KV head. Few sequences: one KV head per task.
  const int64_t heads_per_job = num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t jobs_per_seq = num_kv_heads / heads_per_job;
  const int64_t job_heads = heads_per_job * group;  // query heads of one task
  at::parallel_for(0, num_seqs * jobs_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * block_size);
    std::vector<float> acc(job_heads * v_dim);
    std::vector<float> run_max(job_heads), run_sum(job_heads);
    std::vector<float> k_buf(kConvert ? block_size * k_dim : 0);
    std::vector<float> v_buf(kConvert && !v_in_k ? block_size * v_dim : 0);
    std::vector<float> q_buf(kWideQuery ? job_heads * k_dim : 0);  // the task's query rows
    // keys first_key(seq) .. kv_len - 1 are visible
    auto first_key_of = [&](int64_t seq) {
      return sliding_window > 0 ? std::max<int64_t>(0, len_ptr[seq] - sliding_window) : int64_t{0};
    };
    for (int64_t job = begin; job < end; ++job) {
      const int64_t seq = job / jobs_per_seq, kv_first = (job % jobs_per_seq) * heads_per_job;
      const int64_t kv_len = len_ptr[seq];
      TORCH_CHECK(kv_len > 0 && kv_len <= max_blocks * block_size, "kv_len out of range");
      std::fill(acc.begin(), acc.end(), 0.f);
      if (sinks_ptr != nullptr) {
        std::copy(sinks_ptr + kv_first * group, sinks_ptr + kv_first * group + job_heads,
                  run_max.begin());
        std::fill(run_sum.begin(), run_sum.end(), 1.f);
      } else {
        std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
        std::fill(run_sum.begin(), run_sum.end(), 0.f);
      }
      const int64_t first_key = first_key_of(seq);
      const Query* q_job = q_ptr + (seq * num_heads + kv_first * group) * k_dim;
      if constexpr (kWideQuery) {
        for (int64_t i = 0; i < job_heads * k_dim; ++i) q_buf[i] = static_cast<float>(q_job[i]);
      }
      for (int64_t blk = first_key / block_size; blk * block_size < kv_len; ++blk) {
        const int64_t block_id = table_ptr[seq * max_blocks + blk];
        const int64_t first = std::max<int64_t>(first_key - blk * block_size, 0);
        const int64_t num_keys = std::min(block_size, kv_len - blk * block_size) - first;
        // the block read next: this sequence's next one, else the next task's first one
        int64_t next_seq = seq, next_blk = blk + 1, next_kv_first = kv_first;
        if (next_blk * block_size >= kv_len) {
          next_seq = job + 1 < end ? (job + 1) / jobs_per_seq : -1;
          next_kv_first = ((job + 1) % jobs_per_seq) * heads_per_job;
          next_blk = next_seq >= 0 ? first_key_of(next_seq) / block_size : 0;
        }
        int64_t next_row = 0, next_keys = 0;  // (slot, KV head) row of next_kv_first
        if (next_seq >= 0 && len_ptr[next_seq] > 0) {
          const int64_t n_first = std::max<int64_t>(first_key_of(next_seq) - next_blk * block_size, 0);
          const int64_t n_id = table_ptr[next_seq * max_blocks + next_blk];
          next_row = (n_id * block_size + n_first) * num_kv_heads + next_kv_first;
          next_keys = std::min(block_size, len_ptr[next_seq] - next_blk * block_size) - n_first;
        }
        for (int64_t h = 0; h < heads_per_job; ++h) {
          const int64_t kv_head = kv_first + h;
          const int64_t row = (block_id * block_size + first) * num_kv_heads + kv_head;
          NextRows<Cache> next;
          if (next_keys > 0) {
            next = {k_ptr + (next_row + h) * k_pitch, v_ptr + (next_row + h) * v_pitch,
                    next_keys, k_token_stride, v_token_stride, k_dim, v_in_k ? 0 : v_dim};
          }
          const float* k_block;
          const float* v_block;
          int64_t k_stride, v_stride;  // between the keys of k_block / v_block
          if constexpr (kConvert) {
            for (int64_t t = 0; t < num_keys; ++t) {
              next.prefetch(t);
              const int64_t r = row + t * num_kv_heads;  // (slot, KV head) row
              const Cache* kt = k_ptr + r * k_pitch;
              const Cache* vt = v_ptr + r * v_pitch;
              float* kd = k_buf.data() + t * k_dim;
              float* vd = v_in_k ? nullptr : v_buf.data() + t * v_dim;
              if constexpr (kQuant) {
                const float ks = ks_ptr[r], vs = vs_ptr[r];
#pragma omp simd
                for (int64_t i = 0; i < k_dim; ++i) kd[i] = static_cast<float>(kt[i]) * ks;
#pragma omp simd
                for (int64_t i = 0; i < v_dim; ++i) vd[i] = static_cast<float>(vt[i]) * vs;
              } else {  // bfloat16: the high half of a float32
                const uint16_t* kh = reinterpret_cast<const uint16_t*>(kt);
                const uint16_t* vh = reinterpret_cast<const uint16_t*>(vt);
#pragma omp simd
                for (int64_t i = 0; i < k_dim; ++i) {
                  const uint32_t kb = static_cast<uint32_t>(kh[i]) << 16;
                  std::memcpy(kd + i, &kb, sizeof(float));
                }
                if (!v_in_k) {
#pragma omp simd
                  for (int64_t i = 0; i < v_dim; ++i) {
                    const uint32_t vb = static_cast<uint32_t>(vh[i]) << 16;
                    std::memcpy(vd + i, &vb, sizeof(float));
                  }
                }
              }
            }
            for (int64_t t = num_keys; t < next.num_keys; ++t) next.prefetch(t);
            next = {};  // requested: attend_block reads the float buffers
            k_block = k_buf.data();
            v_block = v_in_k ? k_buf.data() : v_buf.data();
            k_stride = k_dim;
            v_stride = v_in_k ? k_dim : v_dim;
          } else {
            k_block = k_ptr + row * k_pitch;
            v_block = v_ptr + row * v_pitch;
            k_stride = k_token_stride;
            v_stride = v_token_stride;
          }
          const float* q_group;
          if constexpr (kWideQuery) {
            q_group = q_buf.data() + h * group * k_dim;
          } else {
            q_group = q_job + h * group * k_dim;
          }
          attend_block<kDim>(q_group, k_block, v_block, k_stride, v_stride, num_keys, group,
                             k_dim, v_dim, block_size, fscale, fcap, scores.data(),
                             acc.data() + h * group * v_dim, run_max.data() + h * group,
                             run_sum.data() + h * group, next);
        }
      }
      Query* o_job = out_ptr + (seq * num_heads + kv_first * group) * v_dim;
      for (int64_t g = 0; g < job_heads; ++g) {
        const float inv = 1.f / run_sum[g];
        if constexpr (kWideQuery) {
          for (int64_t i = 0; i < v_dim; ++i) {
            o_job[g * v_dim + i] = static_cast<Query>(acc[g * v_dim + i] * inv);
          }
        } else {
#pragma omp simd
          for (int64_t i = 0; i < v_dim; ++i) o_job[g * v_dim + i] = acc[g * v_dim + i] * inv;
        }
      }
    }
  });
}

// decode_loop with the head dims fixed at compile time where they are one common size
template <typename Cache, typename Query = float>
void decode_dispatch(const Query* q_ptr, const Cache* k_ptr, const Cache* v_ptr,
                     const float* ks_ptr, const float* vs_ptr, const float* sinks_ptr,
                     const int32_t* table_ptr, const int32_t* len_ptr, Query* out_ptr,
                     const DecodeShape& shape, float fscale, float fcap, int64_t sliding_window) {
  auto run = [&](auto dim_tag) {
    decode_loop<Cache, decltype(dim_tag)::value, Query>(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                                                        sinks_ptr, table_ptr, len_ptr, out_ptr,
                                                        shape, fscale, fcap, sliding_window);
  };
  const int64_t dim = shape.k_dim == shape.v_dim ? shape.k_dim : 0;
  if (dim == 64) {
    run(std::integral_constant<int64_t, 64>());
  } else if (dim == 128) {
    run(std::integral_constant<int64_t, 128>());
  } else {
    run(std::integral_constant<int64_t, 0>());
  }
}

// Checks what every decode entry shares and returns the call's shapes. q: contiguous float32
// on the CPU, or bfloat16 where `bf16_query` allows it; the caches: `cache_dtype`, contiguous
// or views of a contiguous cache's rows (cache_row_pitch), values no wider than keys.
DecodeShape decode_shape(const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_tables,
                         const at::Tensor& kv_lens, int64_t sliding_window, double softcap,
                         at::ScalarType cache_dtype, bool bf16_query = false) {
  if (bf16_query && q.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(q.device().is_cpu() && q.is_contiguous(), "q must be a contiguous CPU tensor");
  } else {
    check_cpu_f32(q, "q");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be contiguous int32");
  TORCH_CHECK(kv_lens.scalar_type() == at::kInt && kv_lens.is_contiguous(),
              "kv_lens must be contiguous int32");
  const int64_t k_pitch = cache_row_pitch(k_cache, cache_dtype, "k_cache");
  const int64_t v_pitch = cache_row_pitch(v_cache, cache_dtype, "v_cache");
  TORCH_CHECK(q.dim() == 3 && v_cache.size(0) == k_cache.size(0) &&
                  v_cache.size(1) == k_cache.size(1) && v_cache.size(2) == k_cache.size(2) &&
                  v_cache.size(3) <= k_cache.size(3),
              "bad shapes: the caches must share [num_blocks, block_size, num_kv_heads], with "
              "values no wider than keys");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "head_dim of q and cache differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads not a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && kv_lens.size(0) == q.size(0),
              "one block table and kv_len per sequence");
  TORCH_CHECK(sliding_window >= 0 && softcap >= 0, "sliding_window and softcap must be >= 0");
  DecodeShape shape;
  shape.num_seqs = q.size(0);
  shape.num_heads = q.size(1);
  shape.num_kv_heads = k_cache.size(2);
  shape.k_dim = k_cache.size(3);
  shape.v_dim = v_cache.size(3);
  shape.k_pitch = k_pitch;
  shape.v_pitch = v_pitch;
  shape.block_size = k_cache.size(1);
  shape.max_blocks = block_tables.size(1);
  shape.v_in_k = values_in_keys(k_cache, v_cache, k_pitch, v_pitch);
  return shape;
}

}  // namespace

// Decode attention straight from the paged cache: one query token per sequence, no gather.
//   q:            [num_seqs, num_heads, k_dim]
//   k_cache:      [num_blocks, block_size, num_kv_heads, k_dim]
//   v_cache:      [num_blocks, block_size, num_kv_heads, v_dim], v_dim <= k_dim: its own
//                 contiguous cache, or (MLA, one latent cache) the view k_cache[..., :v_dim]
//   block_tables: [num_seqs, max_blocks] int32
//   kv_lens:      [num_seqs] int32, keys visible to the sequence's query (its own included)
//   sliding_window: > 0 limits the query to its last `sliding_window` keys (0 = all)
//   softcap:        > 0 caps the scaled scores as softcap * tanh(score / softcap) (Gemma 2)
//   sinks:          [num_heads] float32, a learned logit per head in the softmax with no value
//                   (gpt-oss), or None
// Returns [num_seqs, num_heads, v_dim]. The query heads of one KV head (GQA group) are
// served together, so each key and value row is read once per group. Softmax is online
// (running max and sum per head), one block at a time.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& kv_lens, double scale,
                                  int64_t sliding_window, double softcap,
                                  const c10::optional<at::Tensor>& sinks) {
  const DecodeShape shape = decode_shape(q, k_cache, v_cache, block_tables, kv_lens,
                                         sliding_window, softcap, at::kFloat);
  auto out = at::empty({shape.num_seqs, shape.num_heads, shape.v_dim}, q.options());
  decode_dispatch<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                         v_cache.data_ptr<float>(), nullptr, nullptr,
                         sinks_data(sinks, shape.num_heads, "paged_decode_attention"),
                         block_tables.data_ptr<int32_t>(), kv_lens.data_ptr<int32_t>(),
                         out.data_ptr<float>(), shape, static_cast<float>(scale),
                         static_cast<float>(softcap), sliding_window);
  return out;
}

// The same over an int8 cache: k/v_cache int8, contiguous and as wide as each other, k/v_scale
// [num_blocks, block_size, num_kv_heads] float32 (value = int8 * scale,
// lmengine/kernels/kv_quant.py).
at::Tensor paged_decode_attention_int8(const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& k_scale,
                                       const at::Tensor& v_scale, const at::Tensor& block_tables,
                                       const at::Tensor& kv_lens, double scale,
                                       int64_t sliding_window, double softcap,
                                       const c10::optional<at::Tensor>& sinks) {
  check_int8_cache(k_cache, k_scale, "k_cache");
  check_int8_cache(v_cache, v_scale, "v_cache");
  TORCH_CHECK(v_cache.size(3) == k_cache.size(3), "the int8 cache needs values as wide as keys");
  const DecodeShape shape = decode_shape(q, k_cache, v_cache, block_tables, kv_lens,
                                         sliding_window, softcap, at::kChar);
  auto out = at::empty({shape.num_seqs, shape.num_heads, shape.v_dim}, q.options());
  decode_dispatch<int8_t>(q.data_ptr<float>(), k_cache.data_ptr<int8_t>(),
                          v_cache.data_ptr<int8_t>(), k_scale.data_ptr<float>(),
                          v_scale.data_ptr<float>(),
                          sinks_data(sinks, shape.num_heads, "paged_decode_attention_int8"),
                          block_tables.data_ptr<int32_t>(), kv_lens.data_ptr<int32_t>(),
                          out.data_ptr<float>(), shape, static_cast<float>(scale),
                          static_cast<float>(softcap), sliding_window);
  return out;
}

// The same over a bfloat16 cache (the model's bfloat16 forward): k/v_cache bfloat16, q float32 or
// bfloat16, the result in q's dtype; queries, keys and values are widened to float32 as they are
// read, so scores, softmax and the weighted sum are float32 throughout, and a bfloat16 result is
// the float32 one rounded to nearest even.
at::Tensor paged_decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                                       const at::Tensor& kv_lens, double scale,
                                       int64_t sliding_window, double softcap,
                                       const c10::optional<at::Tensor>& sinks) {
  const DecodeShape shape = decode_shape(q, k_cache, v_cache, block_tables, kv_lens,
                                         sliding_window, softcap, at::kBFloat16, true);
  auto out = at::empty({shape.num_seqs, shape.num_heads, shape.v_dim}, q.options());
  const float* sinks_ptr = sinks_data(sinks, shape.num_heads, "paged_decode_attention_bf16");
  auto run = [&](auto* q_ptr, auto* out_ptr) {
    decode_dispatch<at::BFloat16>(q_ptr, k_cache.data_ptr<at::BFloat16>(),
                                  v_cache.data_ptr<at::BFloat16>(), nullptr, nullptr, sinks_ptr,
                                  block_tables.data_ptr<int32_t>(), kv_lens.data_ptr<int32_t>(),
                                  out_ptr, shape, static_cast<float>(scale),
                                  static_cast<float>(softcap), sliding_window);
  };
  if (q.scalar_type() == at::kBFloat16) {
    run(q.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  } else {
    run(q.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

// The first index of the maximum of row[0, n), or of its first NaN if it has one (torch.argmax's
// answer). One pass: two sets of 16 lanes each keep their running maximum and where it was first
// seen (a strictly larger value replaces it, so a lane keeps its earliest), and a NaN flag;
// then the lanes holding the overall maximum give the smallest index, and the tail comes last.
// (A maximum pass, then a scan for it, read the row twice and took 2.3 ms for 64 x 49,152
// logits; this pass takes 0.3.)
inline int64_t argmax_row(const float* row, int64_t n) {
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  const v16f lowest = v16f{} + kLowest;
  v16f best0 = lowest, best1 = lowest;
  const v16i32 lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  v16i32 at0 = {}, at1 = {}, nan = {};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const v16f x0 = load16(row + i), x1 = load16(row + i + 16);
    const v16i32 i0 = lanes + static_cast<int32_t>(i), i1 = i0 + 16;
    const v16i32 up0 = x0 > best0, up1 = x1 > best1;
    best0 = up0 ? x0 : best0;
    best1 = up1 ? x1 : best1;
    at0 = up0 ? i0 : at0;
    at1 = up1 ? i1 : at1;
    nan |= (x0 != x0) | (x1 != x1);
  }
  float best = kLowest;
  int64_t at = 0;
  bool has_nan = false;
  for (int l = 0; l < 32; ++l) {  // the lanes, then the tail: earliest index among the best
    const float v = l < 16 ? best0[l] : best1[l - 16];
    const int64_t j = l < 16 ? at0[l] : at1[l - 16];
    has_nan |= nan[l % 16] != 0;
    if (v > best || (v == best && j < at)) best = v, at = j;
  }
  for (; i < n; ++i) {
    has_nan |= row[i] != row[i];
    if (row[i] > best) best = row[i], at = i;
  }
  if (has_nan) {
    at = 0;
    while (row[at] == row[at]) ++at;
  }
  return at;
}

// Index of the largest value of every row of x [M, N] float32 -> [M] int64: the first
// maximum, or the first NaN of a row that has one (torch.argmax's answer, ~10x faster here).
at::Tensor argmax_rows(const at::Tensor& x) {
  check_cpu_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows: x must be [M, N] with N > 0");
  const int64_t m = x.size(0), n = x.size(1);
  TORCH_CHECK(n < std::numeric_limits<int32_t>::max(), "argmax_rows: rows too long");
  auto out = at::empty({m}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, m, rows_per_task(n, 65536), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

// Per selected row r = rows[k] of x [M, N] float32: its log-sum-exp, maximum and the first
// index of the maximum -> ([K] float32, [K] float32, [K] int64). Scoring a prompt needs only
// these and one logit per row (logprob = logit - lse), so the [K, N] log-softmax is never
// written: one vectorised pass for the maximum, one for sum(exp(x - max)), while the row is
// in cache. NaN rows give NaN (as torch.logsumexp).
std::vector<at::Tensor> logsumexp_max_rows(const at::Tensor& x, const at::Tensor& rows) {
  check_cpu_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "logsumexp_max_rows: x must be [M, N] with N > 0");
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1 &&
                  rows.is_contiguous(),
              "logsumexp_max_rows: rows must be a contiguous int64 CPU vector");
  const int64_t m = x.size(0), n = x.size(1), k = rows.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < m, "logsumexp_max_rows: row ", rp[i], " out of range");
  }
  auto lse = at::empty({k}, x.options());
  auto best = at::empty({k}, x.options());
  auto at_best = at::empty({k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  float* bp = best.data_ptr<float>();
  int64_t* ip = at_best.data_ptr<int64_t>();
  at::parallel_for(0, k, rows_per_task(n, 65536), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = xp + rp[i] * n;
      float mx = -std::numeric_limits<float>::infinity();
      int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
      for (int64_t j = 0; j < n; ++j) {
        mx = std::max(mx, row[j]);
        nan |= row[j] != row[j];
      }
      if (nan) {
        lp[i] = bp[i] = std::numeric_limits<float>::quiet_NaN();
        int64_t at = 0;
        while (row[at] == row[at]) ++at;
        ip[i] = at;
        continue;
      }
      int64_t at = 0;
      while (at < n - 1 && row[at] != mx) ++at;
      float sum = 0.f;
      if (std::isfinite(mx)) {
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) sum += exp_approx(row[j] - mx);
      }
      lp[i] = std::isfinite(mx) ? mx + std::log(sum) : mx;
      bp[i] = mx;
      ip[i] = at;
    }
  });
  return {lse, best, at_best};
}

void register_w8a8_ops(py::module& m);  // w8a8_ops.cpp
void register_lora_ops(py::module& m);  // lora_ops.cpp
void register_rotary_ops(py::module& m);  // rotary_ops.cpp
void register_gemv_ops(py::module& m);  // gemv_ops.cpp
void register_layer_ops(py::module& m);  // layer_ops.cpp
void register_gguf_ops(py::module& m);  // gguf_ops.cpp
void register_sgemm_packed_ops(py::module& m);  // sgemm_packed_ops.cpp
void register_prefill_attention_ops(py::module& m);  // prefill_attention_ops.cpp
void register_bf16_ops(py::module& m);  // bf16_ops.cpp
void register_decode_loop_ops(py::module& m);  // decode_loop_ops.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_w8a8_ops(m);
  register_lora_ops(m);
  register_rotary_ops(m);
  register_gemv_ops(m);
  register_layer_ops(m);
  register_gguf_ops(m);
  register_sgemm_packed_ops(m);
  register_prefill_attention_ops(m);
  register_bf16_ops(m);
  register_decode_loop_ops(m);
  m.def("argmax_rows", &argmax_rows, release_gil(),
        "first index of each row's maximum (float32 [M, N])",
        py::arg("x"));
  m.def("logsumexp_max_rows", &logsumexp_max_rows, release_gil(),
        "log-sum-exp, maximum and its first index of selected rows (float32 [M, N])",
        py::arg("x"), py::arg("rows"));
  m.def("paged_decode_attention", &paged_decode_attention, release_gil(),
        "decode attention over the paged KV cache (float32, CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("kv_lens"),
        py::arg("scale"), py::arg("sliding_window") = 0, py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none());
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8, release_gil(),
        "decode attention over the paged int8 KV cache (float32 queries, CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("block_tables"), py::arg("kv_lens"), py::arg("scale"),
        py::arg("sliding_window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("paged_decode_attention_bf16", &paged_decode_attention_bf16, release_gil(),
        "decode attention over the paged bfloat16 KV cache (float32 or bfloat16 queries, CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("kv_lens"),
        py::arg("scale"), py::arg("sliding_window") = 0, py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none());
}
