// Causal attention of prompt chunks over the paged KV cache (float32, CPU): flash attention
// in transposed tiles, one query row per vector lane, with the query heads that share a KV
// head side by side in one GEMM.
//
// First each (sequence, KV head)'s keys are copied out of the cache blocks into a contiguous
// [kv_len, D] buffer and its values into transposed [D, keys] tiles (one pass). One task is
// (sequence, KV head, block of query rows): its queries of the G heads of that KV head become
// the M = G x rows columns of a [D, M] tile (scaled), and it walks the keys it can see in tiles
// of kK:
//   S^T [keys, M] = K Q^T       and      O^T [D, M] += V^T P^T,
// two calls of oneDNN's GEMM microkernel (torch's cpublas::brgemm, JIT-compiled for the CPU's
// ISA on Intel and AMD alike), one thread each (the tasks are the parallelism). With the
// scores transposed, one vector holds 16 query rows: the online softmax's running maximum, its
// sum, the rescaling and the causal limit are all vertical vector operations, with no
// reduction across lanes. Tasks go to the threads largest first
// (the causal work grows with the query position).
//
// Measured on an Intel Xeon (family 6, model 167), 2 threads, SmolLM2's shapes (9 heads, 3 KV
// heads, head_dim 64), 4 prompts x 1,016 tokens per layer: 18.0 ms, against 23.5 for the same
// tiles untransposed on MKL's sgemm (a horizontal reduction per row for the maximum and sum)
// and 24.8 for torch's SDPA. The GEMMs take ~75 % of it, the softmax ~14 %.

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16_rows.h"
#include "bindings.h"
#include "paged_cache.h"
#include "vec_math.h"

namespace {

constexpr int64_t kK = 128;  // keys per tile: a multiple of 16
constexpr int64_t kMaxBatch = 16;  // tasks a thread runs side by side (the bfloat16 kernel)

// Query rows per task and head, for `group` query heads per KV head: a multiple of 16 (the
// lanes), and enough that a task's tile has at least 48 columns for the GEMMs (64 rows for
// one query head per KV head, 32 for two, 16 for three and more: 16 x group columns).
int64_t task_rows_for(int64_t group) { return 16 * std::max<int64_t>(1, 4 / group); }

inline int64_t round16(int64_t x) { return (x + 15) / 16 * 16; }
// The transposed values are stored one key tile at a time, [tiles][D][kVRow]: every GEMM
// reads them with the same leading dimension, so oneDNN compiles its microkernels for a few
// tile widths only (it keeps one per shape and leading dimension, per thread, for the life of
// the process; a leading dimension that followed each sequence's length compiled new ones for
// every prompt length). Rows kK floats long (512 bytes): padding them by 16 floats measured
// the same (it was 5 % of the kernel when a row held a whole sequence, 4 KiB for 1,024 keys).
constexpr int64_t kVRow = kK;

inline int64_t key_tiles(int64_t kv_len) { return (kv_len + kK - 1) / kK; }

struct Task {
  int64_t seq, kv_head, row0, rows, cost;
};

// What both kernels share: the tasks (sequence, KV head, block of query rows) largest first,
// after checking every sequence against its table and q, and the offsets of each (sequence, KV
// head)'s keys [round16(kv_len), k_dim] and transposed value tiles [tiles, v_dim, kVRow] in
// their buffers.
struct Plan {
  std::vector<Task> tasks;
  std::vector<int64_t> k_off, v_off;
};

Plan plan_tasks(const char* op, const int32_t* qs, const int32_t* ql, const int32_t* kl,
                int64_t n, int64_t bs, int64_t max_blocks, int64_t q_rows, int64_t kv_heads,
                int64_t task_rows, int64_t k_dim, int64_t v_dim) {
  Plan plan;
  for (int64_t s = 0; s < n; ++s) {
    TORCH_CHECK(ql[s] >= 1 && kl[s] >= ql[s] && (kl[s] + bs - 1) / bs <= max_blocks &&
                    qs[s] >= 0 && qs[s] + ql[s] <= q_rows,
                op, ": sequence ", s, " does not fit its tables or q");
    for (int64_t r = 0; r < ql[s]; r += task_rows) {
      const int64_t rows = std::min<int64_t>(task_rows, ql[s] - r);
      const int64_t cost = kl[s] - ql[s] + r + rows;  // keys it reads
      for (int64_t h = 0; h < kv_heads; ++h) plan.tasks.push_back({s, h, r, rows, cost});
    }
  }
  std::stable_sort(plan.tasks.begin(), plan.tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  plan.k_off.assign(n * kv_heads + 1, 0);
  plan.v_off.assign(n * kv_heads + 1, 0);
  for (int64_t s = 0; s < n; ++s)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t u = s * kv_heads + h;
      plan.k_off[u + 1] = plan.k_off[u] + round16(kl[s]) * k_dim;
      plan.v_off[u + 1] = plan.v_off[u] + key_tiles(kl[s]) * v_dim * kVRow;
    }
  return plan;
}

// Where a call's cache rows are: (sequence s, position pos, KV head h) starts at
// offset(s, pos, h) in its cache, rows `pitch` elements apart (cache_row_pitch).
struct CacheRows {
  const int32_t* tables;
  int64_t max_blocks, block_size, kv_heads, pitch;
  int64_t token_stride() const { return kv_heads * pitch; }  // between two keys of a block
  int64_t offset(int64_t s, int64_t pos, int64_t h) const {
    return (tables[s * max_blocks + pos / block_size] * block_size + pos % block_size) *
               token_stride() +
           h * pitch;
  }
};

// Checks the caches (`dtype`, contiguous or views of a contiguous cache's rows, sharing
// [blocks, block_size, kv_heads], values no wider than keys) and q's head dim against them.
void check_caches(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, at::ScalarType dtype, int64_t* k_pitch,
                  int64_t* v_pitch) {
  *k_pitch = cache_row_pitch(k_cache, dtype, "k_cache");
  *v_pitch = cache_row_pitch(v_cache, dtype, "v_cache");
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1) &&
                  v_cache.size(2) == k_cache.size(2) && v_cache.size(3) <= k_cache.size(3),
              op, ": the caches must share [blocks, block_size, kv_heads], with values no wider "
              "than keys");
  TORCH_CHECK(k_cache.size(3) == q.size(2), op, ": head_dim of q and the cache");
}

// A task's running maxima and sums before its first key tile: -inf and 0, or, with a learned
// sink per query head (gpt-oss), the sink and exp(0) = 1, as if the sink were one more key
// with a zero value. `sinks` points at the task's first query head; column c belongs to head
// c / rows.
void start_softmax(const float* sinks, int64_t m, int64_t rows, float* row_max, float* row_sum) {
  for (int64_t c = 0; c < m; ++c) {
    row_max[c] = sinks != nullptr ? sinks[c / rows] : -std::numeric_limits<float>::infinity();
    row_sum[c] = sinks != nullptr ? 1.f : 0.f;
  }
}

void check_i32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.is_contiguous(), name,
              " must be a contiguous int32 CPU tensor");
}

// C[m, n] (ldc) = A[m, k] (lda) B[k, n] (ldb), or += with accumulate: row-major, one thread
void gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b, c, false);
}

// The online softmax over one tile of transposed scores s [kn16, M] (M a multiple of 16): the
// scores times `scale` (1 for the float32 kernel, whose queries carry it; the bfloat16 kernel
// scales scores, not its bfloat16 queries, so that the scale adds no rounding), the keys past
// each column's position masked (-inf) where the tile reaches them; the running maxima and sums
// per column move on, o [D, M] is rescaled where a column block's maximum moved (elsewhere
// alpha = exp(0) is exactly 1), and `store(j, c, e)` takes the probabilities e[0..3] of key rows
// j .. j + 3, columns c .. c + 15. A store whose kInPlace is true owns s: the first pass keeps
// the scaled, masked scores there for the second, and the store overwrites them (the others
// leave s as the GEMM wrote it and the second pass computes the scores again, the same values).
// Column c is query row (c % rows) of its head, at position first_pos + c % rows.
template <class Store>
void softmax_tile(const float* s, int64_t kn16, int64_t m, int64_t rows, int64_t first_pos,
                  int64_t k0, float* row_max, float* row_sum, float* o, int64_t dim, float scale,
                  Store&& store) {
  const v16f iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16f neg_inf = v16f{} - std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < m; c += 16) {
    // positions as floats: exact below 2^24 tokens
    const v16f pos = iota + static_cast<float>(first_pos + c % rows);
    const bool reaches_limit = k0 + kn16 - 1 > first_pos + c % rows;  // some key is past a row
    auto score = [&](int64_t j) {  // computed in both passes: the same value each time
      v16f v = load16(s + j * m + c) * scale;
      if (reaches_limit) v = static_cast<float>(k0 + j) > pos ? neg_inf : v;
      return v;
    };
    // four maxima and sums in flight: one running vector would wait out the latency of each
    // max and add (kn16 is a multiple of 16, so of 4)
    v16f mx4[4] = {neg_inf, neg_inf, neg_inf, neg_inf};
    for (int64_t j = 0; j < kn16; j += 4)
      for (int u = 0; u < 4; ++u) {
        const v16f v = score(j + u);
        if constexpr (std::decay_t<Store>::kInPlace)
          *reinterpret_cast<v16f*>(store.s + (j + u) * m + c) = v;
        mx4[u] = v > mx4[u] ? v : mx4[u];
      }
    const v16f old = load16(row_max + c);
    v16f mx = old;
    for (int u = 0; u < 4; ++u) mx = mx4[u] > mx ? mx4[u] : mx;
    // a column's first tile always holds its key 0: mx is finite from then on, and
    // exp(-inf - mx) = 0 for the old sum (with a sink, old is already finite)
    const v16f alpha = exp16(old - mx);
    v16f sum4[4] = {};
    for (int64_t j = 0; j < kn16; j += 4) {
      v16f e[4];
      for (int u = 0; u < 4; ++u) {
        if constexpr (std::decay_t<Store>::kInPlace)
          e[u] = exp16(load16(s + (j + u) * m + c) - mx);
        else
          e[u] = exp16(score(j + u) - mx);
        sum4[u] += e[u];
      }
      store(j, c, e);
    }
    const v16f sum = (sum4[0] + sum4[1]) + (sum4[2] + sum4[3]);
    *reinterpret_cast<v16f*>(row_sum + c) = load16(row_sum + c) * alpha + sum;
    *reinterpret_cast<v16f*>(row_max + c) = mx;
#if defined(__AVX512F__)
    const bool moved = _mm512_cmp_ps_mask(reinterpret_cast<__m512>(old),
                                          reinterpret_cast<__m512>(mx), _CMP_NEQ_UQ) != 0;
#else
    bool moved = false;
    for (int i = 0; i < 16; ++i) moved |= old[i] != mx[i];
#endif
    if (!moved) continue;  // NOTE: a NaN counts as moved
    for (int64_t d = 0; d < dim; ++d) {
      v16f* v = reinterpret_cast<v16f*>(o + d * m + c);
      *v = *v * alpha;
    }
  }
}

// A softmax_tile store that writes the probabilities back over the scores, as float32.
struct StoreInPlace {
  static constexpr bool kInPlace = true;
  float* s;
  int64_t m;
  void operator()(int64_t j, int64_t c, const v16f* e) const {
    for (int u = 0; u < 4; ++u) *reinterpret_cast<v16f*>(s + (j + u) * m + c) = e[u];
  }
};

}  // namespace

// oneDNN's microkernel is in this torch, and the build has AVX-512: the softmax and transposes
// are written for 16-float registers (an AVX2 build of them measured 2.9x slower)
bool prefill_attention_available() {
#if defined(__AVX512F__)
  return at::hasMKLDNN();
#else
  return false;
#endif
}

// q [T, H, Dk] (rows may be strided: a view of the fused QKV output; each row's heads
// contiguous), k_cache [blocks, bs, KH, Dk], v_cache [blocks, bs, KH, Dv] with Dv <= Dk (its own
// cache, or MLA's values: the view k_cache[..., :Dv] of one latent cache), tables [n,
// max_blocks], q_start / q_lens / kv_lens [n] (the chunk of sequence s is rows q_start[s] .. +
// q_lens[s] of q, at positions kv_lens[s] - q_lens[s] ...; its keys are already in the cache).
// Writes those rows of `out` [T, H, Dv] (contiguous). `sinks`: a learned logit per query head
// [H] float32 (gpt-oss) that joins each softmax with no value, or None.
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& tables,
                             const at::Tensor& q_start, const at::Tensor& q_lens,
                             const at::Tensor& kv_lens, double scale, at::Tensor& out,
                             const c10::optional<at::Tensor>& sinks) {
  const char* op_name = "paged_prefill_attention";
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 &&
                  q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_prefill_attention: q must be float32 [T, H, D] with contiguous heads");
  int64_t k_pitch, v_pitch;
  check_caches(op_name, q, k_cache, v_cache, at::kFloat, &k_pitch, &v_pitch);
  check_i32(tables, "tables");
  check_i32(q_start, "q_start");
  check_i32(q_lens, "q_lens");
  check_i32(kv_lens, "kv_lens");
  const int64_t heads = q.size(1), k_dim = q.size(2), v_dim = v_cache.size(3);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 3 && out.size(0) == q.size(0) &&
                  out.size(1) == heads && out.size(2) == v_dim &&
                  out.scalar_type() == at::kFloat,
              "paged_prefill_attention: out must be a contiguous float32 tensor [T, H, Dv]");
  const int64_t bs = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "paged_prefill_attention: heads % kv_heads != 0");
  const int64_t group = heads / kv_heads, n = q_lens.size(0), max_blocks = tables.size(1);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == n && q_start.size(0) == n &&
                  kv_lens.size(0) == n,
              "paged_prefill_attention: one table, start and length per sequence");
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int32_t* qs = q_start.data_ptr<int32_t>();
  const int32_t* ql = q_lens.data_ptr<int32_t>();
  const int32_t* kl = kv_lens.data_ptr<int32_t>();
  const float* sp = sinks_data(sinks, heads, op_name);
  const int64_t task_rows = task_rows_for(group), m = group * task_rows;
  const Plan plan = plan_tasks(op_name, qs, ql, kl, n, bs, max_blocks, q.size(0), kv_heads,
                               task_rows, k_dim, v_dim);
  const std::vector<Task>& tasks = plan.tasks;
  const std::vector<int64_t>& k_off = plan.k_off;
  const std::vector<int64_t>& v_off = plan.v_off;
  const float* qp = q.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t q_row = q.stride(0);
  const CacheRows k_rows{tab, max_blocks, bs, kv_heads, k_pitch};
  const CacheRows v_rows{tab, max_blocks, bs, kv_heads, v_pitch};
  const float fscale = static_cast<float>(scale);
  // per (sequence, KV head): keys [kv_len rounded up to 16, Dk] (a tile's scores are computed
  // 16 keys at a time) and values transposed in tiles [tiles, Dv, kVRow], zeros past kv_len
  auto kbuf = at::empty({k_off.back()}, q.options());
  auto vbuf = at::empty({v_off.back()}, q.options());
  float* kg = kbuf.data_ptr<float>();
  float* vg = vbuf.data_ptr<float>();
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t s = u / kv_heads, h = u % kv_heads, len = kl[s];
      float* keys = kg + k_off[u];
      float* values_t = vg + v_off[u];
      for (int64_t pos = 0; pos < len; ++pos) {
        const float* row = kc + k_rows.offset(s, pos, h);
        std::copy(row, row + k_dim, keys + pos * k_dim);
      }
      std::fill(keys + len * k_dim, keys + round16(len) * k_dim, 0.f);
      const int64_t last = (key_tiles(len) - 1) * v_dim * kVRow;  // the last tile: zeros first
      std::fill(values_t + last, values_t + last + v_dim * kVRow, 0.f);
      // values: runs of positions inside one cache block and one tile, transposed
      for (int64_t pos = 0; pos < len;) {
        const int64_t run = std::min({bs - pos % bs, kK - pos % kK, len - pos});
        float* dst = values_t + (pos / kK) * v_dim * kVRow + pos % kK;
        transpose_block(vc + v_rows.offset(s, pos, h), v_rows.token_stride(), dst, kVRow, run,
                        v_dim);
        pos += run;
      }
    }
  });
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), num_tasks));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> qt(k_dim * m), st(kK * m), ot(v_dim * m), row_max(m), row_sum(m);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < num_tasks; ++ti) {
      const Task& t = tasks[ti];
      const int64_t first_pos = kl[t.seq] - ql[t.seq] + t.row0;  // position of the first row
      const int64_t key_end = first_pos + t.rows;                // keys the last row sees
      const float* keys = kg + k_off[t.seq * kv_heads + t.kv_head];
      const float* values_t = vg + v_off[t.seq * kv_heads + t.kv_head];
      // Q^T: column g * task_rows + i = head kv_head * group + g, token q_start + row0 + i,
      // scaled; columns past the chunk's rows are zeros (computed, never written out)
      std::fill(qt.begin(), qt.end(), 0.f);
      const int64_t row0 = qs[t.seq] + t.row0;  // the task's first row of q and out
      for (int64_t g = 0; g < group; ++g)
        transpose_block(qp + row0 * q_row + (t.kv_head * group + g) * k_dim, q_row,
                        qt.data() + g * task_rows, m, t.rows, k_dim, fscale);
      std::fill(ot.begin(), ot.end(), 0.f);
      start_softmax(sp != nullptr ? sp + t.kv_head * group : nullptr, m, task_rows,
                    row_max.data(), row_sum.data());
      for (int64_t k0 = 0; k0 < key_end; k0 += kK) {
        // 16 keys at a time: the zero keys past the buffer's end are masked like the rest
        const int64_t kn16 = round16(std::min<int64_t>(kK, key_end - k0));
        gemm(kn16, m, k_dim, keys + k0 * k_dim, k_dim, qt.data(), m, st.data(), m, false);
        softmax_tile(st.data(), kn16, m, task_rows, first_pos, k0, row_max.data(),
                     row_sum.data(), ot.data(), v_dim, 1.f, StoreInPlace{st.data(), m});
        gemm(v_dim, m, kn16, values_t + k0 / kK * v_dim * kVRow, kVRow, st.data(), m, ot.data(),
             m, true);
      }
      // O = (O^T)^T / sum, row by row into `out`
      for (int64_t c = 0; c < m; c += 16) {
        const v16f inv = 1.f / load16(row_sum.data() + c);
        for (int64_t d = 0; d < v_dim; ++d) {
          v16f* v = reinterpret_cast<v16f*>(ot.data() + d * m + c);
          *v = *v * inv;
        }
      }
      for (int64_t g = 0; g < group; ++g)
        transpose_block(ot.data() + g * task_rows, m,
                        op + (row0 * heads + t.kv_head * group + g) * v_dim, heads * v_dim,
                        v_dim, t.rows);
    }
  }
}

namespace {

using bf16 = at::BFloat16;

// P^T in the VNNI layout bfloat16 GEMMs read their B in: s [kn16, m] float32 (kn16 even) ->
// p [kn16 / 2][m][2] bfloat16, p[j / 2][c][j % 2] = s[j][c]. (Builds without AVX512-BF16; the
// others write the pairs from softmax_tile's registers: StoreVnniPairs.)
inline void to_vnni_pairs(const float* s, int64_t kn16, int64_t m, uint16_t* p) {
  for (int64_t j = 0; j < kn16; j += 2)
    for (int64_t c = 0; c < m; ++c) {
      p[j * m + 2 * c] = to_bf16(s[j * m + c]);
      p[j * m + 2 * c + 1] = to_bf16(s[(j + 1) * m + c]);
    }
}

#if defined(__AVX512BF16__)
// A softmax_tile store that writes the probabilities straight from their registers into P^T's
// VNNI pairs (16 columns of two key rows: one conversion of 32 floats, then one permute
// interleaves them), never stored as float32 and read back: the same pairs as storing in place
// then to_vnni_pairs, bit for bit. With the vectorised Q^T pairs and output rows, per layer of
// SmolLM2 (Intel Xeon family 6 model 167, 2 threads, 2026-11-27): 4 prompts x 1,016 tokens
// 11.7 -> 10.3 ms, 64 x 70 3.4 -> 2.8 ms.
struct StoreVnniPairs {
  static constexpr bool kInPlace = false;
  uint16_t* p;
  int64_t m;
  __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                        24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                        16, 0);
  void operator()(int64_t j, int64_t c, const v16f* e) const {
    for (int h = 0; h < 4; h += 2) {
      const __m512bh both = _mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(e[h + 1]),
                                                reinterpret_cast<__m512>(e[h]));
      _mm512_storeu_si512(p + ((j + h) * m + 2 * c),
                          _mm512_permutexvar_epi16(interleave, reinterpret_cast<__m512i>(both)));
    }
  }
};
#endif

#if defined(__AVX512F__)
// The task's output rows from O^T [D, M] (columns c0 ..): out row i (of `rows` <= 16, `ld`
// elements apart) = bf16(O^T[:, c0 + i] / sum[c0 + i]), 16 x 16 blocks transposed in registers
// (D a multiple of 16).
inline void store_rows_bf16(const float* ot, int64_t m, int64_t c0, const float* row_sum,
                            int64_t dim, int64_t rows, uint16_t* out, int64_t ld) {
  const v16f inv = 1.f / load16(row_sum + c0);
  for (int64_t d0 = 0; d0 < dim; d0 += 16) {
    v16f r[16];
    for (int i = 0; i < 16; ++i) r[i] = load16(ot + (d0 + i) * m + c0) * inv;
    transpose_round<8>(r);
    transpose_round<4>(r);
    transpose_round<2>(r);
    transpose_round<1>(r);
    for (int64_t i = 0; i < rows; ++i) store_bf16x16(out + i * ld + d0, r[i]);
  }
}
#endif

}  // namespace

// paged_prefill_attention for a bfloat16 model: q [T, H, Dk] (Dk even), the caches and `out`
// [T, H, Dv] bfloat16; scores, softmax and the output accumulate in float32. The same
// transposed tiles, with both GEMMs in bfloat16 on the CPU's matrix units (oneDNN's microkernel
// on AMX tiles):
//   S^T [keys, M] = K Q^T       (A: the keys, bfloat16 rows; B: Q^T in VNNI pairs)
//   O^T [Dv, M]  += V^T P^T     (A: the transposed value tiles; B: the probabilities rounded to
//                                bfloat16, in VNNI pairs)
// The scale multiplies the float32 scores (the queries stay exactly as the model made them).
void paged_prefill_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& tables,
                                  const at::Tensor& q_start, const at::Tensor& q_lens,
                                  const at::Tensor& kv_lens, double scale, at::Tensor& out,
                                  const c10::optional<at::Tensor>& sinks) {
  const char* op = "paged_prefill_attention_bf16";
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kBFloat16 && q.dim() == 3 &&
                  q.stride(2) == 1 && q.stride(1) == q.size(2),
              op, ": q must be bfloat16 [T, H, D] with contiguous heads");
  int64_t k_pitch, v_pitch;
  check_caches(op, q, k_cache, v_cache, at::kBFloat16, &k_pitch, &v_pitch);
  check_i32(tables, "tables");
  check_i32(q_start, "q_start");
  check_i32(q_lens, "q_lens");
  check_i32(kv_lens, "kv_lens");
  const int64_t heads = q.size(1), k_dim = q.size(2), v_dim = v_cache.size(3);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 3 && out.size(0) == q.size(0) &&
                  out.size(1) == heads && out.size(2) == v_dim &&
                  out.scalar_type() == at::kBFloat16,
              op, ": out must be a contiguous bfloat16 tensor [T, H, Dv]");
  const int64_t bs = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_dim % 2 == 0, op, ": head_dim of q and the cache must be even");
  TORCH_CHECK(heads % kv_heads == 0, op, ": heads % kv_heads != 0");
  const int64_t group = heads / kv_heads, n = q_lens.size(0), max_blocks = tables.size(1);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == n && q_start.size(0) == n &&
                  kv_lens.size(0) == n,
              op, ": one table, start and length per sequence");
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int32_t* qs = q_start.data_ptr<int32_t>();
  const int32_t* ql = q_lens.data_ptr<int32_t>();
  const int32_t* kl = kv_lens.data_ptr<int32_t>();
  const float* sp = sinks_data(sinks, heads, op);
  const int64_t task_rows = task_rows_for(group), m = group * task_rows;
  const Plan plan = plan_tasks(op, qs, ql, kl, n, bs, max_blocks, q.size(0), kv_heads,
                               task_rows, k_dim, v_dim);
  const std::vector<Task>& tasks = plan.tasks;
  const std::vector<int64_t>& k_off = plan.k_off;
  const std::vector<int64_t>& v_off = plan.v_off;
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<bf16>());
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<bf16>());
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<bf16>());
  uint16_t* op_out = reinterpret_cast<uint16_t*>(out.data_ptr<bf16>());
  const int64_t q_row = q.stride(0);
  const CacheRows k_rows{tab, max_blocks, bs, kv_heads, k_pitch};
  const CacheRows v_rows{tab, max_blocks, bs, kv_heads, v_pitch};
  const float fscale = static_cast<float>(scale);
  auto kbuf = at::empty({k_off.back()}, q.options());
  auto vbuf = at::empty({v_off.back()}, q.options());
  uint16_t* kg = reinterpret_cast<uint16_t*>(kbuf.data_ptr<bf16>());
  uint16_t* vg = reinterpret_cast<uint16_t*>(vbuf.data_ptr<bf16>());
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t s = u / kv_heads, h = u % kv_heads, len = kl[s];
      uint16_t* keys = kg + k_off[u];
      uint16_t* values_t = vg + v_off[u];
      for (int64_t pos = 0; pos < len; ++pos) {
        const uint16_t* row = kc + k_rows.offset(s, pos, h);
        std::copy(row, row + k_dim, keys + pos * k_dim);
      }
      std::fill(keys + len * k_dim, keys + round16(len) * k_dim, uint16_t{0});
      const int64_t last = (key_tiles(len) - 1) * v_dim * kVRow;
      std::fill(values_t + last, values_t + last + v_dim * kVRow, uint16_t{0});
      for (int64_t pos = 0; pos < len; ++pos) {
        const uint16_t* row = vc + v_rows.offset(s, pos, h);
        uint16_t* dst = values_t + (pos / kK) * v_dim * kVRow + pos % kK;
        for (int64_t d = 0; d < v_dim; ++d) dst[d * kVRow] = row[d];
      }
    }
  });
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t words = k_dim / 2;  // 32-bit pairs of a head's query row
  // A thread takes tasks in batches and runs each GEMM kind across its batch in a row: first
  // every task's S^T tile, then every softmax, then every O^T update (and so on per key tile).
  // Two different microkernels called one after the other configure the tiles again each time
  // (most of the GEMMs' cost on short prompts); the tasks of a batch are neighbours in the
  // largest-first order, mostly of one shape, so a batch switches kernels a few times, not
  // twice per task. Batches shrink with few tasks (each thread gets at least 4) and are capped
  // at ~512 KiB of buffers per thread. The same bits as task by task; 21 prompts of 100 tokens,
  // SmolLM2's 9 heads over 3 (441 tasks, batches of 9), per layer: 1.48 -> 1.33 ms (Intel Xeon
  // family 6 model 167, 2 threads, 2026-12-04).
  const int64_t per_task = (words * m * 4 + kK * m * 6 + v_dim * m * 4 + m * 8);
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), num_tasks));
  const int64_t batch = std::clamp<int64_t>(
      std::min<int64_t>(num_tasks / (4 * threads), (512 << 10) / per_task), 1, kMaxBatch);
  const int64_t num_batches = (num_tasks + batch - 1) / batch;
#pragma omp parallel num_threads(threads)
  {
    std::vector<uint32_t> qt(batch * words * m);  // per task Q^T in VNNI pairs: [Dk / 2][M]
    std::vector<uint16_t> pt(batch * kK * m);     // per task P^T in VNNI pairs: [kK / 2][M][2]
    std::vector<float> st(batch * kK * m), ot(batch * v_dim * m), row_max(batch * m),
        row_sum(batch * m);
#pragma omp for schedule(dynamic, 1)
    for (int64_t bi = 0; bi < num_batches; ++bi) {
      const int64_t t0 = bi * batch, nb = std::min(batch, num_tasks - t0);
      int64_t first_pos[kMaxBatch], key_end[kMaxBatch], last_end = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const Task& t = tasks[t0 + b];
        first_pos[b] = kl[t.seq] - ql[t.seq] + t.row0;
        key_end[b] = first_pos[b] + t.rows;
        last_end = std::max(last_end, key_end[b]);
        // Q^T pairs: column g * task_rows + i = head kv_head * group + g, token row0 + i
        uint32_t* q_b = qt.data() + b * words * m;
        std::fill(q_b, q_b + words * m, 0u);
        const int64_t row0 = qs[t.seq] + t.row0;
        for (int64_t g = 0; g < group; ++g)
          transpose_bits_block(qp + row0 * q_row + (t.kv_head * group + g) * k_dim, q_row * 2,
                               q_b + g * task_rows, m, t.rows, words);
        std::fill(ot.data() + b * v_dim * m, ot.data() + (b + 1) * v_dim * m, 0.f);
        start_softmax(sp != nullptr ? sp + t.kv_head * group : nullptr, m, task_rows,
                      row_max.data() + b * m, row_sum.data() + b * m);
      }
      auto key_rows = [&](int64_t b, int64_t k0) {  // 16 keys at a time, as the kernel above
        return round16(std::min<int64_t>(kK, key_end[b] - k0));
      };
      for (int64_t k0 = 0; k0 < last_end; k0 += kK) {
        for (int64_t b = 0; b < nb; ++b) {
          if (k0 >= key_end[b]) continue;
          const Task& t = tasks[t0 + b];
          const uint16_t* keys = kg + k_off[t.seq * kv_heads + t.kv_head];
          at::native::cpublas::brgemm(key_rows(b, k0), m, k_dim, k_dim, m, m, false,
                                      reinterpret_cast<const bf16*>(keys + k0 * k_dim),
                                      reinterpret_cast<const bf16*>(qt.data() + b * words * m),
                                      st.data() + b * kK * m);
        }
        for (int64_t b = 0; b < nb; ++b) {
          if (k0 >= key_end[b]) continue;
          float* s_b = st.data() + b * kK * m;
          uint16_t* p_b = pt.data() + b * kK * m;
#if defined(__AVX512BF16__)
          softmax_tile(s_b, key_rows(b, k0), m, task_rows, first_pos[b], k0,
                       row_max.data() + b * m, row_sum.data() + b * m,
                       ot.data() + b * v_dim * m, v_dim, fscale, StoreVnniPairs{p_b, m});
#else
          softmax_tile(s_b, key_rows(b, k0), m, task_rows, first_pos[b], k0,
                       row_max.data() + b * m, row_sum.data() + b * m,
                       ot.data() + b * v_dim * m, v_dim, fscale, StoreInPlace{s_b, m});
          to_vnni_pairs(s_b, key_rows(b, k0), m, p_b);
#endif
        }
        for (int64_t b = 0; b < nb; ++b) {
          if (k0 >= key_end[b]) continue;
          const Task& t = tasks[t0 + b];
          const uint16_t* values_t = vg + v_off[t.seq * kv_heads + t.kv_head];
          at::native::cpublas::brgemm(
              v_dim, m, key_rows(b, k0), kVRow, m, m, true,
              reinterpret_cast<const bf16*>(values_t + k0 / kK * v_dim * kVRow),
              reinterpret_cast<const bf16*>(pt.data() + b * kK * m), ot.data() + b * v_dim * m);
        }
      }
      for (int64_t b = 0; b < nb; ++b) {
        const Task& t = tasks[t0 + b];
        const int64_t row0 = qs[t.seq] + t.row0;
        const float* o_b = ot.data() + b * v_dim * m;
        const float* sum_b = row_sum.data() + b * m;
        for (int64_t g = 0; g < group; ++g) {
          uint16_t* dst = op_out + (row0 * heads + t.kv_head * group + g) * v_dim;
          int64_t i0 = 0;
#if defined(__AVX512F__)
          if (v_dim % 16 == 0)
            for (; i0 < t.rows; i0 += 16)
              store_rows_bf16(o_b, m, g * task_rows + i0, sum_b, v_dim,
                              std::min<int64_t>(16, t.rows - i0), dst + i0 * heads * v_dim,
                              heads * v_dim);
#endif
          for (int64_t i = i0; i < t.rows; ++i) {
            const int64_t c = g * task_rows + i;
            const float inv = 1.f / sum_b[c];
            for (int64_t d = 0; d < v_dim; ++d)
              dst[i * heads * v_dim + d] = to_bf16(o_b[d * m + c] * inv);
          }
        }
      }
    }
    at::native::cpublas::brgemm_release();
  }
}

void register_prefill_attention_ops(py::module& m) {
  m.def("paged_prefill_attention_bf16", &paged_prefill_attention_bf16, release_gil(),
        "causal attention of prompt chunks over the paged bfloat16 KV cache (CPU; bfloat16 GEMMs "
        "on the matrix units, float32 softmax)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"),
        py::arg("q_start"), py::arg("q_lens"), py::arg("kv_lens"), py::arg("scale"),
        py::arg("out"), py::arg("sinks") = py::none());
  m.def("prefill_attention_available", &prefill_attention_available, release_gil(),
        "whether the prefill attention runs here (oneDNN's GEMM microkernel, an AVX-512 build)");
  m.def("paged_prefill_attention", &paged_prefill_attention, release_gil(),
        "causal attention of prompt chunks over the paged KV cache (float32, CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"), py::arg("q_start"),
        py::arg("q_lens"), py::arg("kv_lens"), py::arg("scale"), py::arg("out"),
        py::arg("sinks") = py::none());
}
