// A mixture-of-experts layer on the CPU in one call: every expert's gate/up GEMM, bias and gated
// activation, its down GEMM and bias, and the router-weighted sum over each token's top-k
// experts, for float32 and bfloat16 (float32 accumulators either way).
//
// The (token, k) slots are counting-sorted by expert. Two parallel phases follow:
// 1. gate/up: tasks of (expert, block of kBlockN intermediate columns); each computes the gate
//    and the up columns of the block for all the expert's rows and writes act(gate, up) to an
//    intermediate [num_slots, inter] buffer in expert order (rounded to bfloat16 in bfloat16).
// 2. down: tasks of one block of output columns, over every expert: a task owns its columns of
//    the float32 output accumulator, so the weighted sum needs no atomics and no [num_slots,
//    hidden] buffer. Contributions arrive in expert order.
// Tasks go to the threads through a shared counter (a thread on a busy core takes fewer).
//
// The GEMMs read the weights as stored ([N, K] rows, no packed copy). An expert with few rows
// (decode: about top_k * num_tokens / num_experts) is a stream over its weights: a dot-product
// kernel reads kMaxRows rows of x against kWeightRows weight rows at a time, every weight row
// read once from memory, accumulating in float32 (bfloat16: AVX512-BF16 pair products where
// the build has them, else a 16-bit shift to float32 and an FMA). An expert with `gemm_rows`
// rows or more takes oneDNN's brgemm microkernel on the task's weight block re-laid out in L2
// (float32: transposed to [K, N]; bfloat16 on AMX builds: VNNI pairs), in chunks of kChunkRows
// rows.
//
// bfloat16 rounds where transformers' eager bfloat16 experts round: each GEMM output, the bias
// sum, the activation's intermediate products (silu before the multiply by up; ClampedSwiGLU's
// alpha * gate, sigmoid, glu and up + 1), the router weight and the weighted output; the sum
// over the top-k experts is float32, rounded once.

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16_rows.h"
#include "bindings.h"
#include "vec_math.h"

namespace {

// the activation codes of lmengine/kernels/moe.py
enum class Act : int64_t { kSilu = 0, kGeluTanh = 1, kClampedSwiglu = 2 };

constexpr int64_t kBlockN = 64;     // output columns per task (intermediate ones in phase 1)
constexpr int64_t kChunkRows = 32;  // rows per brgemm call and per epilogue pass
constexpr int kMaxRows = 4;         // rows of x per dot-product tile

// float32 vectors of the build's width: 16 lanes (one AVX-512 register), else 8 (one AVX
// register; 16 would take two each and the 4 x 4 tile's accumulators would spill)
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kWeightRows = 4;  // weight rows per tile: 4 x 4 accumulators
#else
constexpr int kLanes = 8;
constexpr int kWeightRows = 2;  // 4 x 2 accumulators in 16 AVX registers
#endif
typedef float vecf __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef uint16_t vec_u16 __attribute__((vector_size(kLanes * 2), aligned(2)));
typedef uint32_t vec_u32 __attribute__((vector_size(kLanes * 4), aligned(4)));

// NOTE: loads through the under-aligned vector types, not memcpy: GCC copied the memcpy'd
// vectors through the stack and kept the tile's accumulators in memory (4x slower)
inline vecf load_vec(const float* p) { return *reinterpret_cast<const vecf*>(p); }

// kLanes bfloat16 -> float32 (a 16-bit shift each)
inline vecf load_vec(const uint16_t* p) {
  const vec_u32 bits = __builtin_convertvector(*reinterpret_cast<const vec_u16*>(p), vec_u32);
  return reinterpret_cast<vecf>(bits << 16);
}

inline float hsum(vecf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return to_f32(v); }

// The value as stored in T: float32 keeps it, bfloat16 rounds (the rounding between two eager
// bfloat16 ops)
#pragma omp declare simd notinbranch
inline float rnd(float v, float) { return v; }
#pragma omp declare simd notinbranch
inline float rnd(float v, uint16_t) { return round_bf16(v); }

inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) { *p = to_bf16(v); }

// Ask for the cache lines of a weight row segment [p, p + bytes) ahead of its use
inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) prefetch_line(c + b);
}

// out[m * kWeightRows + j] = dot(a[m], w[j]) over k, for kM rows of x and kWeightRows weight rows
// (row pointers: the rows need not be evenly spaced). One pass over k: each weight vector is
// loaded once and used for the kM rows; `next` (or null): kWeightRows rows to prefetch, the
// same span of them as this step reads of `w` (the next tile's weights, a stream ahead).
template <int kM, typename TA, typename TW>
void dot_tile(const TA* const* a, const TW* const* w, const TW* const* next, int64_t k,
              float* out) {
  vecf acc[kM][kWeightRows] = {};
  int64_t i = 0;
  constexpr int64_t kLine = 64 / sizeof(TW);  // elements of a cache line
  for (; i + kLanes <= k; i += kLanes) {
    if (next != nullptr && i % kLine == 0)
      for (int j = 0; j < kWeightRows; ++j) prefetch_line(next[j] + i);
    vecf wv[kWeightRows];
    for (int j = 0; j < kWeightRows; ++j) wv[j] = load_vec(w[j] + i);
    for (int m = 0; m < kM; ++m) {
      const vecf av = load_vec(a[m] + i);
      for (int j = 0; j < kWeightRows; ++j) acc[m][j] += av * wv[j];
    }
  }
  for (int m = 0; m < kM; ++m)
    for (int j = 0; j < kWeightRows; ++j) {
      float s = hsum(acc[m][j]);
      for (int64_t t = i; t < k; ++t) s += to_float(a[m][t]) * to_float(w[j][t]);
      out[m * kWeightRows + j] = s;
    }
}

#if defined(__AVX512BF16__)
// dot_tile for bfloat16 x and weights on AVX512-BF16: one vdpbf16ps adds 16 pair products
// (32 multiply-adds) into float32 lanes
template <int kM>
void dot_tile_dpbf16(const uint16_t* const* a, const uint16_t* const* w,
                     const uint16_t* const* next, int64_t k, float* out) {
  __m512 acc[kM][kWeightRows];
  for (int m = 0; m < kM; ++m)
    for (int j = 0; j < kWeightRows; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    if (next != nullptr)
      for (int j = 0; j < kWeightRows; ++j) prefetch_line(next[j] + i);
    __m512bh wv[kWeightRows];
    for (int j = 0; j < kWeightRows; ++j)
      wv[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w[j] + i));
    for (int m = 0; m < kM; ++m) {
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_loadu_si512(a[m] + i));
      for (int j = 0; j < kWeightRows; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], av, wv[j]);
    }
  }
  for (int m = 0; m < kM; ++m)
    for (int j = 0; j < kWeightRows; ++j) {
      float s = _mm512_reduce_add_ps(acc[m][j]);
      for (int64_t t = i; t < k; ++t) s += to_f32(a[m][t]) * to_f32(w[j][t]);
      out[m * kWeightRows + j] = s;
    }
}
#endif

// Which kernels a call may use (the build decides what exists; a call may ask for less, which
// is how the tests reach the portable kernels on a CPU that has more)
struct Units {
  bool dpbf16 = false;  // AVX512-BF16 pair products
  bool amx = false;     // brgemm on AMX tiles for bfloat16
};

// c[m, j] (float32, row stride ldc) = dot(a[m], w[j]) for m < mb, j < nb, through the
// dot-product tiles: weight rows outermost, so each is read from memory once for all mb rows.
// Rows past nb in the last weight tile repeat the last row (their results are dropped).
template <typename T>
void dot_gemm(const T* const* a, int64_t mb, const T* const* w, int64_t nb, int64_t k,
              const Units& units, float* c, int64_t ldc) {
  float tile[kMaxRows * kWeightRows];
  for (int64_t j0 = 0; j0 < nb; j0 += kWeightRows) {
    const T* wr[kWeightRows];
    const T* nx[kWeightRows];
    for (int j = 0; j < kWeightRows; ++j) {
      wr[j] = w[std::min<int64_t>(j0 + j, nb - 1)];
      nx[j] = w[std::min<int64_t>(j0 + kWeightRows + j, nb - 1)];
    }
    const bool has_next = j0 + kWeightRows < nb;
    for (int64_t m0 = 0; m0 < mb; m0 += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, mb - m0));
      // NOTE: the prefetch of the next weight rows rides on the first pass over these ones
      const T* const* pf = (m0 == 0 && has_next) ? nx : nullptr;
      bool done = false;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (units.dpbf16) {
          switch (rows) {
            case 1: dot_tile_dpbf16<1>(a + m0, wr, pf, k, tile); break;
            case 2: dot_tile_dpbf16<2>(a + m0, wr, pf, k, tile); break;
            case 3: dot_tile_dpbf16<3>(a + m0, wr, pf, k, tile); break;
            default: dot_tile_dpbf16<4>(a + m0, wr, pf, k, tile); break;
          }
          done = true;
        }
      }
#endif
      if (!done) {
        switch (rows) {
          case 1: dot_tile<1>(a + m0, wr, pf, k, tile); break;
          case 2: dot_tile<2>(a + m0, wr, pf, k, tile); break;
          case 3: dot_tile<3>(a + m0, wr, pf, k, tile); break;
          default: dot_tile<4>(a + m0, wr, pf, k, tile); break;
        }
      }
      const int64_t cols = std::min<int64_t>(kWeightRows, nb - j0);
      for (int m = 0; m < rows; ++m)
        for (int64_t j = 0; j < cols; ++j) c[(m0 + m) * ldc + j0 + j] = tile[m * kWeightRows + j];
    }
  }
  (void)units;
}

// A weight block (nb rows of w, k apart) laid out for brgemm in `dst`: float32 transposed to
// [k, nb]; bfloat16 in VNNI pairs [k / 2, nb, 2].
inline void layout_block(const float* w, int64_t nb, int64_t k, float* dst) {
  transpose_block(w, k, dst, nb, nb, k);
}
inline void layout_block(const uint16_t* w, int64_t nb, int64_t k, uint16_t* dst) {
  // NOTE: the pairs of one row are one 32-bit word: a bit transpose of the [nb, k / 2] words
  transpose_bits_block(w, k * 2, reinterpret_cast<uint32_t*>(dst), nb, nb, k / 2);
}

inline void brgemm_block(int64_t mb, int64_t nb, int64_t k, const float* a, const float* b,
                         float* c) {
  at::native::cpublas::brgemm(mb, nb, k, k, nb, nb, false, a, b, c, false);
}
inline void brgemm_block(int64_t mb, int64_t nb, int64_t k, const uint16_t* a,
                         const uint16_t* b, float* c) {
  at::native::cpublas::brgemm(mb, nb, k, k, nb, nb, false,
                              reinterpret_cast<const at::BFloat16*>(a),
                              reinterpret_cast<const at::BFloat16*>(b), c, true);
}

// Whether an expert of `rows` rows takes brgemm: enough rows, and a brgemm for T here
template <typename T>
bool takes_brgemm(int64_t rows, int64_t gemm_rows, int64_t k, const Units& units) {
  if (rows < gemm_rows) return false;
  if constexpr (std::is_same_v<T, uint16_t>) return units.amx && k % 2 == 0;
  return true;
}

// ---- the epilogues -----------------------------------------------------------------------

// 1 / (1 + exp(-v)), through exp_approx (2 ulp)
#pragma omp declare simd notinbranch
inline float sigmoid(float v) { return 1.f / (1.f + exp_approx(-v)); }

// One row of act(gate + bias, up + bias) -> out, for n columns. gate and up are the float32
// GEMM outputs; T's roundings as transformers' eager ops (the identity for float32).
template <Act kAct, typename T>
void act_row(const float* gate, const float* up, const T* gate_bias, const T* up_bias,
             float alpha, float limit, T* out, int64_t n) {
  const T z{};
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float g = rnd(rnd(gate[j], z) + to_float(gate_bias[j]), z);
    const float u = rnd(rnd(up[j], z) + to_float(up_bias[j]), z);
    float v;
    if constexpr (kAct == Act::kSilu) {
      v = rnd(g * sigmoid(g), z) * u;  // torch's silu rounds before the multiply
    } else if constexpr (kAct == Act::kGeluTanh) {
      // 0.5 g (1 + tanh(s)) = g * sigmoid(2 s), s = sqrt(2 / pi) (g + 0.044715 g^3)
      const float s = 0.7978845608028654f * (g + 0.044715f * g * g * g);
      v = rnd(g * sigmoid(2.f * s), z) * u;
    } else {
      // gpt-oss: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
      const float gc = g > limit ? limit : g;  // NaN stays NaN, as torch's clamp
      const float uc = u > limit ? limit : (u < -limit ? -limit : u);
      const float glu = rnd(gc * rnd(sigmoid(rnd(gc * alpha, z)), z), z);
      v = rnd(uc + 1.f, z) * glu;
    }
    store(out + j, v);
  }
}

template <typename T>
void act_row(Act act, const float* gate, const float* up, const T* gate_bias, const T* up_bias,
             float alpha, float limit, T* out, int64_t n) {
  switch (act) {
    case Act::kSilu:
      act_row<Act::kSilu>(gate, up, gate_bias, up_bias, alpha, limit, out, n);
      break;
    case Act::kGeluTanh:
      act_row<Act::kGeluTanh>(gate, up, gate_bias, up_bias, alpha, limit, out, n);
      break;
    case Act::kClampedSwiglu:
      act_row<Act::kClampedSwiglu>(gate, up, gate_bias, up_bias, alpha, limit, out, n);
      break;
  }
}

// acc[j] += weight * rnd(rnd(y[j]) + bias[j]), rnd to T, the product rounded too (transformers
// multiplies the bfloat16 expert output by the bfloat16 router weight)
template <typename T>
void add_weighted_row(const float* y, const T* bias, float weight, float* acc, int64_t n) {
  const T z{};
#pragma omp simd
  for (int64_t j = 0; j < n; ++j)
    acc[j] += rnd(rnd(rnd(y[j], z) + to_float(bias[j]), z) * weight, z);
}

// ---- the layer ---------------------------------------------------------------------------

struct Layer {
  int64_t num_tokens, top_k, num_experts, hidden, inter;
  Act act;
  float alpha, limit;
  int64_t gemm_rows;
  Units units;
};

// Runs fn(task, scratch) for every task in [0, num_tasks) on the intra-op threads, each thread
// taking the next task from a shared counter.
template <typename Scratch, typename Fn>
void run_tasks(int64_t num_tasks, const Fn& fn) {
  if (num_tasks == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) fn(t, scratch);
    if (scratch.used_tiles) at::native::cpublas::brgemm_release();
  });
}

struct Scratch {
  std::vector<float> c0, c1;  // [kChunkRows, kBlockN] GEMM outputs (gate and up)
  std::vector<char> b0, b1;   // weight blocks laid out for brgemm
  std::vector<char> rows;     // gathered rows of x for brgemm
  bool used_tiles = false;    // a bfloat16 brgemm ran (its AMX tile state is to be released)
};

template <typename T>
T* grow(std::vector<char>& v, int64_t count) {
  const size_t bytes = static_cast<size_t>(count) * sizeof(T);
  if (v.size() < bytes) v.resize(bytes);
  return reinterpret_cast<T*>(v.data());
}

template <typename T>
void moe_layer(const Layer& L, const T* x, const T* w13, const T* w2, const T* b13,
               int64_t b13_stride, const T* b2, int64_t b2_stride, const float* topk_weights,
               const int64_t* topk_ids, float* acc) {
  const int64_t E = L.num_experts, H = L.hidden, I = L.inter, K = L.top_k;
  const int64_t num_slots = L.num_tokens * K;
  // counting sort of the slots by expert
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t e = topk_ids[s];
    TORCH_CHECK(e >= 0 && e < E, "fused_moe: expert id ", e, " out of range [0, ", E, ")");
    ++start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> sorted(num_slots);  // slot ids in expert order
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < num_slots; ++s) sorted[fill[topk_ids[s]]++] = s;
  }
  std::vector<int64_t> active;  // experts with rows
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  const int64_t num_active = static_cast<int64_t>(active.size());

  // phase 1: inter = act(x W13^T + b13), rows in expert order
  std::vector<T> inter(static_cast<size_t>(num_slots * I));
  const int64_t blocks1 = (I + kBlockN - 1) / kBlockN;
  run_tasks<Scratch>(num_active * blocks1, [&](int64_t task, Scratch& s) {
    const int64_t e = active[task / blocks1];
    const int64_t n0 = (task % blocks1) * kBlockN, nb = std::min(kBlockN, I - n0);
    const int64_t first = start[e], rows = start[e + 1] - first;
    const T* gate_w = w13 + (e * 2 * I + n0) * H;
    const T* up_w = gate_w + I * H;
    const T* gate_b = b13 + e * b13_stride + n0;
    const T* up_b = gate_b + (b13_stride == 0 ? 0 : I);
    s.c0.resize(kChunkRows * kBlockN);
    s.c1.resize(kChunkRows * kBlockN);
    const bool brgemm = takes_brgemm<T>(rows, L.gemm_rows, H, L.units);
    T* gate_blk = nullptr;
    T* up_blk = nullptr;
    T* gathered = nullptr;
    const T* wg[kBlockN];
    const T* wu[kBlockN];
    if (brgemm) {
      gate_blk = grow<T>(s.b0, nb * H);
      up_blk = grow<T>(s.b1, nb * H);
      s.used_tiles |= std::is_same_v<T, uint16_t>;
      layout_block(gate_w, nb, H, gate_blk);
      layout_block(up_w, nb, H, up_blk);
      gathered = grow<T>(s.rows, kChunkRows * H);
    } else {
      for (int64_t j = 0; j < nb; ++j) {
        wg[j] = gate_w + j * H;
        wu[j] = up_w + j * H;
      }
    }
    for (int64_t m0 = 0; m0 < rows; m0 += kChunkRows) {
      const int64_t mb = std::min(kChunkRows, rows - m0);
      const T* a[kChunkRows];
      for (int64_t m = 0; m < mb; ++m) a[m] = x + (sorted[first + m0 + m] / K) * H;
      if (brgemm) {
        for (int64_t m = 0; m < mb; ++m) std::memcpy(gathered + m * H, a[m], H * sizeof(T));
        brgemm_block(mb, nb, H, gathered, gate_blk, s.c0.data());
        brgemm_block(mb, nb, H, gathered, up_blk, s.c1.data());
      } else {
        dot_gemm(a, mb, wg, nb, H, L.units, s.c0.data(), nb);
        dot_gemm(a, mb, wu, nb, H, L.units, s.c1.data(), nb);
      }
      for (int64_t m = 0; m < mb; ++m)
        act_row(L.act, s.c0.data() + m * nb, s.c1.data() + m * nb, gate_b, up_b, L.alpha,
                L.limit, inter.data() + (first + m0 + m) * I + n0, nb);
    }
  });

  // phase 2: acc[token] += weight * (inter W2^T + b2), a task per block of output columns
  const int64_t blocks2 = (H + kBlockN - 1) / kBlockN;
  run_tasks<Scratch>(blocks2, [&](int64_t task, Scratch& s) {
    const int64_t n0 = task * kBlockN, nb = std::min(kBlockN, H - n0);
    s.c0.resize(kChunkRows * kBlockN);
    for (const int64_t e : active) {
      const int64_t first = start[e], rows = start[e + 1] - first;
      const T* down_w = w2 + (e * H + n0) * I;
      const T* down_b = b2 + e * b2_stride + n0;
      const bool brgemm = takes_brgemm<T>(rows, L.gemm_rows, I, L.units);
      T* blk = nullptr;
      const T* wd[kBlockN];
      if (brgemm) {
        s.used_tiles |= std::is_same_v<T, uint16_t>;
        blk = grow<T>(s.b0, nb * I);
        layout_block(down_w, nb, I, blk);
      } else {
        for (int64_t j = 0; j < nb; ++j) wd[j] = down_w + j * I;
      }
      for (int64_t m0 = 0; m0 < rows; m0 += kChunkRows) {
        const int64_t mb = std::min(kChunkRows, rows - m0);
        const T* rows_in = inter.data() + (first + m0) * I;
        if (brgemm) {
          brgemm_block(mb, nb, I, rows_in, blk, s.c0.data());
        } else {
          const T* a[kChunkRows];
          for (int64_t m = 0; m < mb; ++m) a[m] = rows_in + m * I;
          dot_gemm(a, mb, wd, nb, I, L.units, s.c0.data(), nb);
        }
        for (int64_t m = 0; m < mb; ++m) {
          const int64_t slot = sorted[first + m0 + m];
          const float w = rnd(topk_weights[slot], T{});
          add_weighted_row(s.c0.data() + m * nb, down_b, w, acc + (slot / K) * H + n0, nb);
        }
      }
    }
  });
}

void check_cpu(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(),
              "fused_moe: ", name, " must be a contiguous ", c10::toString(dtype),
              " CPU tensor");
}

}  // namespace

// Whether this build runs bfloat16 experts with brgemm on AMX tiles when asked
bool fused_moe_amx_available() {
#if defined(__AMX_BF16__)
  return at::hasMKLDNN();
#else
  return false;
#endif
}

// x [T, H]; w_gate_up [E, 2I, H] (gate rows, then up); w_down [E, H, I]; b_gate_up [E, 2I] and
// b_down [E, H] or None; topk_weights [T, top_k] float32; topk_ids [T, top_k] int64; all
// float32 or all bfloat16 (weights, biases, x), contiguous. act: 0 SiLU, 1 GELU (tanh), 2
// ClampedSwiGLU(alpha, limit). Experts with gemm_rows rows or more take brgemm;
// use_bf16_units=False keeps bfloat16 on the portable kernels (no AVX512-BF16, no AMX).
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                     const c10::optional<at::Tensor>& b_gate_up,
                     const c10::optional<at::Tensor>& b_down, const at::Tensor& topk_weights,
                     const at::Tensor& topk_ids, int64_t act, double alpha, double limit,
                     int64_t gemm_rows, bool use_bf16_units) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "fused_moe: x must be float32 or bfloat16, got ", dtype);
  check_cpu(x, dtype, "x");
  check_cpu(w_gate_up, dtype, "w_gate_up");
  check_cpu(w_down, dtype, "w_down");
  check_cpu(topk_weights, at::kFloat, "topk_weights");
  check_cpu(topk_ids, at::kLong, "topk_ids");
  TORCH_CHECK(x.dim() == 2 && w_gate_up.dim() == 3 && w_down.dim() == 3,
              "fused_moe: x must be [T, H], w_gate_up [E, 2I, H], w_down [E, H, I]");
  const int64_t T = x.size(0), H = x.size(1), E = w_gate_up.size(0);
  const int64_t I = w_gate_up.size(1) / 2;
  TORCH_CHECK(w_gate_up.size(1) == 2 * I && w_gate_up.size(2) == H && w_down.size(0) == E &&
                  w_down.size(1) == H && w_down.size(2) == I,
              "fused_moe: shapes do not fit: x ", x.sizes(), ", w_gate_up ", w_gate_up.sizes(),
              ", w_down ", w_down.sizes());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_weights.sizes() ==
                  topk_ids.sizes(),
              "fused_moe: topk_ids and topk_weights must both be [T, top_k]");
  TORCH_CHECK(act >= 0 && act <= 2, "fused_moe: unknown activation code ", act);
  if (b_gate_up.has_value()) {
    check_cpu(*b_gate_up, dtype, "b_gate_up");
    TORCH_CHECK(b_gate_up->dim() == 2 && b_gate_up->size(0) == E && b_gate_up->size(1) == 2 * I,
                "fused_moe: b_gate_up must be [E, 2I]");
  }
  if (b_down.has_value()) {
    check_cpu(*b_down, dtype, "b_down");
    TORCH_CHECK(b_down->dim() == 2 && b_down->size(0) == E && b_down->size(1) == H,
                "fused_moe: b_down must be [E, H]");
  }
  Layer L{T,
          topk_ids.size(1),
          E,
          H,
          I,
          static_cast<Act>(act),
          static_cast<float>(alpha),
          static_cast<float>(limit),
          std::max<int64_t>(1, gemm_rows),
          Units{}};
#if defined(__AVX512BF16__)
  L.units.dpbf16 = use_bf16_units;
#endif
  L.units.amx = use_bf16_units && fused_moe_amx_available();
  // absent biases: one zero row, read with an expert stride of 0
  const auto zeros = at::zeros({std::max(2 * I, H)}, x.options());
  const auto bgu = b_gate_up.has_value() ? *b_gate_up : zeros;
  const auto bd = b_down.has_value() ? *b_down : zeros;
  const int64_t bgu_stride = b_gate_up.has_value() ? 2 * I : 0;
  const int64_t bd_stride = b_down.has_value() ? H : 0;
  const bool f32 = dtype == at::kFloat;
  at::Tensor acc = at::zeros({T, H}, x.options().dtype(at::kFloat));
  if (T == 0) return f32 ? acc : acc.to(dtype);
  const float* wp = topk_weights.data_ptr<float>();
  const int64_t* ip = topk_ids.data_ptr<int64_t>();
  if (f32) {
    moe_layer<float>(L, x.data_ptr<float>(), w_gate_up.data_ptr<float>(),
                     w_down.data_ptr<float>(), bgu.data_ptr<float>(), bgu_stride,
                     bd.data_ptr<float>(), bd_stride, wp, ip, acc.data_ptr<float>());
    return acc;
  }
  auto u16 = [](const at::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
  };
  moe_layer<uint16_t>(L, u16(x), u16(w_gate_up), u16(w_down), u16(bgu), bgu_stride, u16(bd),
                      bd_stride, wp, ip, acc.data_ptr<float>());
  return acc.to(dtype);
}

void register_moe_ops(py::module& m) {
  m.def("fused_moe_amx_available", &fused_moe_amx_available, release_gil(),
        "whether fused_moe runs bfloat16 experts with brgemm on AMX tiles");
  m.def("fused_moe", &fused_moe, release_gil(),
        "a mixture-of-experts layer: every expert's gate/up GEMM, bias, activation, down GEMM, "
        "bias and the router-weighted sum, in one call (float32 or bfloat16, CPU)",
        py::arg("x"), py::arg("w_gate_up"), py::arg("w_down"), py::arg("b_gate_up"),
        py::arg("b_down"), py::arg("topk_weights"), py::arg("topk_ids"), py::arg("act"),
        py::arg("alpha"), py::arg("limit"), py::arg("gemm_rows"), py::arg("use_bf16_units"));
}
