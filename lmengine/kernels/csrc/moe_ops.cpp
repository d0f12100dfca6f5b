// A mixture-of-experts layer on the CPU in one call: every expert's gate/up GEMM, bias and gated
// activation, its down GEMM and bias, and the router-weighted sum over each token's top-k
// experts, for float32 and bfloat16 (float32 accumulators either way).
//
// The (token, k) slots are counting-sorted by expert. Two parallel phases follow:
// 1. gate/up: tasks of (expert, block of kBlockN intermediate columns); each computes the gate
//    and the up columns of the block for all the expert's rows and writes act(gate, up) to an
//    intermediate [num_slots, inter] buffer in expert order (rounded to bfloat16 in bfloat16).
// 2. down: tasks of one block of output columns (up to kDownBlockN), over every expert: a task
//    owns its columns of the float32 output accumulator, so the weighted sum needs no atomics
//    and no [num_slots, hidden] buffer. Contributions arrive in expert order.
// Tasks go to the threads through a shared counter (a thread on a busy core takes fewer).
//
// The GEMMs read the weights as stored ([N, K] rows, no packed copy); at decode sizes a MoE layer
// is a stream over the weights of the experts that have tokens, and the kernels' job is to keep
// that stream at the memory's speed. Below `amx_rows` rows an expert runs dot-product tiles:
// kMaxRows rows of x against kWeightRows weight rows, every weight row read once from memory,
// float32 accumulators (bfloat16: AVX512-BF16 pair products where the build has them, else a
// 16-bit shift to float32 and an FMA). From `amx_rows` rows a bfloat16 expert takes the AMX
// tiles where the build has them (amx_tiles: the weights as the A operand, loaded from their
// rows as stored, the rows of x as B); float32 stays on the dot products (brgemm on weight
// blocks transposed per task and MKL's sgemm per block were no faster up to 128 rows per
// expert). Why AMX from 2 rows: a core's AVX512-BF16 pair products take 0.65 ns each, so 4 rows
// of x against the weights compute at 25 GB/s of weights with the data in L1, about twice what
// one core streams from memory (12-16 GB/s), and a stream and a computation that long do not
// overlap: Qwen3-MoE's layer at 64 tokens (~4 rows per expert) read 18 GB/s on two cores. A
// tile product takes 16 rows x 32 k of weights per 16 cycles (~160 GB/s) whatever the rows of
// x: the same layer reads 21-22 GB/s, 25 on huge pages.
//
// bfloat16 rounds where transformers' eager bfloat16 experts round: each GEMM output, the bias
// sum, the activation's intermediate products (silu before the multiply by up; ClampedSwiGLU's
// alpha * gate, sigmoid, glu and up + 1), the router weight and the weighted output; the sum
// over the top-k experts is float32, rounded once.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define LMENGINE_MOE_AMX 1
#endif

#include "bf16_rows.h"
#include "bindings.h"
#include "vec_math.h"

namespace {

// the activation codes of lmengine/kernels/moe.py
enum class Act : int64_t { kSilu = 0, kGeluTanh = 1, kClampedSwiglu = 2 };

constexpr int64_t kBlockN = 64;       // intermediate columns per task of phase 1
constexpr int64_t kDownBlockN = 256;  // at most, output columns per task of phase 2
constexpr int64_t kChunkRows = 32;  // rows per GEMM call and per epilogue pass
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

typedef int32_t vec_i32 __attribute__((vector_size(kLanes * 4)));

// One round of the sums of kLanes vectors: lane j of the result is a[j] + a[j + h] where bit h
// of j is clear, b[j - h] + b[j] where it is set (the shuffles of vec_math.h's transpose_round).
// Rounds h = kLanes / 2, ..., 1 over pairs (i, i + h) leave lane j holding the sum of vector j.
template <int h>
inline vecf fold(vecf a, vecf b) {
  vec_i32 j;
  for (int t = 0; t < kLanes; ++t) j[t] = t;
  const vec_i32 high = (j & h) != 0;  // -1 where bit h is set
  const vec_i32 lo = j + (high & (kLanes - h)), hi = j + h + (high & (kLanes - h));
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// The sums of kLanes vectors, lane j the sum of v[j]: 3 (kLanes - 1) instructions for all of
// them, where reducing each alone took a dependent chain per vector (the 4 x 4 tile spent as
// long in its sixteen sums as in its dot products at K = 2,048)
inline vecf sum_lanes(vecf* v) {
  if constexpr (kLanes == 16)
    for (int i = 0; i < 8; ++i) v[i] = fold<8>(v[i], v[i + 8]);
  for (int i = 0; i < 4; ++i) v[i] = fold<4>(v[i], v[i + 4]);
  for (int i = 0; i < 2; ++i) v[i] = fold<2>(v[i], v[i + 2]);
  return fold<1>(v[0], v[1]);
}

static_assert(kMaxRows * kWeightRows == kLanes, "a tile's sums fill one vector");

// Ask for the cache line holding p. NOTE: the builtin, not vec_math.h's prefetch_line: that
// one is an asm statement reading memory, and GCC then stored every accumulator of a tile to
// the stack before each prefetch (their array's address goes to sum_lanes); the loops here
// also load, so the builtin is not deleted as in a loop made only of prefetches
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

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

// The next weight tile's rows, requested while a tile runs: every `every` steps one more line
// of each row, up to `lines` lines from `rows[j]` on (null rows: nothing to request)
template <typename TW>
struct Ahead {
  const TW* rows[kWeightRows] = {};
  int64_t every = 1, lines = 0;

  // at each step of the tile loop: the next line of each row, every `every` calls
  struct Cursor {
    const Ahead& ahead;
    int64_t countdown, line = 0;
    explicit Cursor(const Ahead& a) : ahead(a), countdown(a.every) {}
    inline void step() {
      if (line >= ahead.lines || --countdown > 0) return;
      countdown = ahead.every;
      for (int j = 0; j < kWeightRows; ++j) prefetch(ahead.rows[j] + line * (64 / sizeof(TW)));
      ++line;
    }
  };
};

// out[m * kWeightRows + j] = dot(a[m], w[j]) over k, for kM rows of x and kWeightRows weight rows
// (row pointers: the rows need not be evenly spaced). One pass over k: each weight vector is
// loaded once and used for the kM rows, while `ahead` requests the next tile's weights. The
// last k % kLanes elements are added one by one.
template <int kM, typename TA, typename TW>
void dot_tile(const TA* const* a, const TW* const* w, const Ahead<TW>& ahead, int64_t k,
              float* out) {
  vecf acc[kMaxRows * kWeightRows] = {};
  int64_t i = 0;
  typename Ahead<TW>::Cursor cursor(ahead);
  for (; i + kLanes <= k; i += kLanes) {
    cursor.step();
    vecf wv[kWeightRows];
    for (int j = 0; j < kWeightRows; ++j) wv[j] = load_vec(w[j] + i);
    for (int m = 0; m < kM; ++m) {
      const vecf av = load_vec(a[m] + i);
      for (int j = 0; j < kWeightRows; ++j) acc[m * kWeightRows + j] += av * wv[j];
    }
  }
  const vecf sums = sum_lanes(acc);
  for (int m = 0; m < kM; ++m)
    for (int j = 0; j < kWeightRows; ++j) {
      float s = sums[m * kWeightRows + j];
      for (int64_t t = i; t < k; ++t) s += to_float(a[m][t]) * to_float(w[j][t]);
      out[m * kWeightRows + j] = s;
    }
}

#if defined(__AVX512BF16__)
// dot_tile for bfloat16 x and weights on AVX512-BF16: one vdpbf16ps adds 16 pair products
// (32 multiply-adds) into float32 lanes
template <int kM>
void dot_tile_dpbf16(const uint16_t* const* a, const uint16_t* const* w,
                     const Ahead<uint16_t>& ahead, int64_t k, float* out) {
  __m512 acc[kMaxRows * kWeightRows];
  for (int t = 0; t < kMaxRows * kWeightRows; ++t) acc[t] = _mm512_setzero_ps();
  int64_t i = 0;
  Ahead<uint16_t>::Cursor cursor(ahead);
  for (; i + 32 <= k; i += 32) {
    cursor.step();
    __m512bh wv[kWeightRows];
    for (int j = 0; j < kWeightRows; ++j)
      wv[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w[j] + i));
    for (int m = 0; m < kM; ++m) {
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_loadu_si512(a[m] + i));
      for (int j = 0; j < kWeightRows; ++j)
        acc[m * kWeightRows + j] = _mm512_dpbf16_ps(acc[m * kWeightRows + j], av, wv[j]);
    }
  }
  vecf v[kMaxRows * kWeightRows];
  for (int t = 0; t < kMaxRows * kWeightRows; ++t) v[t] = reinterpret_cast<vecf>(acc[t]);
  const vecf sums = sum_lanes(v);
  for (int m = 0; m < kM; ++m)
    for (int j = 0; j < kWeightRows; ++j) {
      float s = sums[m * kWeightRows + j];
      for (int64_t t = i; t < k; ++t) s += to_f32(a[m][t]) * to_f32(w[j][t]);
      out[m * kWeightRows + j] = s;
    }
}
#endif

// Which kernels a call may use (the build decides what exists; a call may ask for less, which
// is how the tests reach the portable kernels on a CPU that has more)
struct Units {
  bool dpbf16 = false;  // AVX512-BF16 pair products
  bool amx = false;     // AMX tiles for bfloat16
};

// One dot_tile call: kM = rows (1 to kMaxRows), the AVX512-BF16 form where it applies
template <typename T>
inline void dot_tile_rows(int rows, const T* const* a, const T* const* w, const Ahead<T>& ahead,
                          int64_t k, const Units& units, float* out) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (units.dpbf16) {
      switch (rows) {
        case 1: return dot_tile_dpbf16<1>(a, w, ahead, k, out);
        case 2: return dot_tile_dpbf16<2>(a, w, ahead, k, out);
        case 3: return dot_tile_dpbf16<3>(a, w, ahead, k, out);
        default: return dot_tile_dpbf16<4>(a, w, ahead, k, out);
      }
    }
  }
#endif
  (void)units;
  switch (rows) {
    case 1: return dot_tile<1>(a, w, ahead, k, out);
    case 2: return dot_tile<2>(a, w, ahead, k, out);
    case 3: return dot_tile<3>(a, w, ahead, k, out);
    default: return dot_tile<4>(a, w, ahead, k, out);
  }
}

// c[m, j] (float32, row stride ldc) = dot(a[m], w[j]) for m < mb, j < nb, through the
// dot-product tiles: weight rows outermost, so each is read from memory once for all mb rows.
// Rows past nb in the last weight tile repeat the last row (their results are dropped).
// NOTE: the next tile's weights are requested over all the passes of the rows of x over this
// one, a share each. Requested during the first pass only, memory sat idle during the others:
// 16 rows (4 passes) ran at 53 GFLOP/s in float32 against ~140 with the data in cache.
// Blocking k (512) so that a tile's weight rows stay in L1 while the rows of x pass was no
// faster from 4 to 32 rows.
template <typename T>
void dot_gemm(const T* const* a, int64_t mb, const T* const* w, int64_t nb, int64_t k,
              const Units& units, float* c, int64_t ldc) {
  constexpr int64_t kLine = 64 / sizeof(T);                     // elements per cache line
  const int64_t lines = (k + kLine - 1) / kLine;                 // per weight row
  const int64_t passes = (mb + kMaxRows - 1) / kMaxRows;         // of x over one weight tile
  const int64_t share = (lines + passes - 1) / passes;           // lines per row per pass
  const int64_t steps = std::max<int64_t>(1, k / (units.dpbf16 && sizeof(T) == 2 ? 32 : kLanes));
  float tile[kMaxRows * kWeightRows];
  for (int64_t j0 = 0; j0 < nb; j0 += kWeightRows) {
    const int64_t cols = std::min<int64_t>(kWeightRows, nb - j0);
    const T* wr[kWeightRows];
    for (int j = 0; j < kWeightRows; ++j) wr[j] = w[std::min<int64_t>(j0 + j, nb - 1)];
    for (int64_t m0 = 0, pass = 0; m0 < mb; m0 += kMaxRows, ++pass) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, mb - m0));
      Ahead<T> ahead;
      if (j0 + kWeightRows < nb) {
        for (int j = 0; j < kWeightRows; ++j)
          ahead.rows[j] = w[std::min<int64_t>(j0 + kWeightRows + j, nb - 1)] + pass * share * kLine;
        ahead.lines = std::max<int64_t>(0, std::min(share, lines - pass * share));
        ahead.every = std::max<int64_t>(1, steps / std::max<int64_t>(1, ahead.lines));
      }
      dot_tile_rows(rows, a + m0, wr, ahead, k, units, tile);
      for (int m = 0; m < rows; ++m)
        for (int64_t j = 0; j < cols; ++j) c[(m0 + m) * ldc + j0 + j] = tile[m * kWeightRows + j];
    }
  }
}

// x rows (pointers) [mb, k] -> dst [k / 2, mb] 32-bit words: the rows as the B operand of
// amx_tiles, in VNNI pairs (x^T: a bfloat16 pair of a row is one word). vec_math.h's
// transpose_bits_block over row pointers.
inline void vnni_rows(const uint16_t* const* rows, int64_t mb, int64_t k, uint32_t* dst) {
  const int64_t cols = k / 2, rows16 = mb / 16 * 16, cols16 = cols / 16 * 16;
  auto word = [&](int64_t i) { return reinterpret_cast<const uint32_t*>(rows[i]); };
  for (int64_t i0 = 0; i0 < rows16; i0 += 16)
    for (int64_t j0 = 0; j0 < cols16; j0 += 16) {
      // NOTE: vector loads and stores, not memcpy: GCC copied each row through the stack in
      // two 32-byte halves read back as one 64-byte vector, a store-forwarding stall per row
      v16f r[16];
      for (int i = 0; i < 16; ++i) r[i] = *reinterpret_cast<const v16f*>(word(i0 + i) + j0);
      transpose_round<8>(r);
      transpose_round<4>(r);
      transpose_round<2>(r);
      transpose_round<1>(r);
      for (int j = 0; j < 16; ++j) *reinterpret_cast<v16f*>(dst + (j0 + j) * mb + i0) = r[j];
    }
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t j = i < rows16 ? cols16 : 0; j < cols; ++j) dst[j * mb + i] = word(i)[j];
}

#if LMENGINE_MOE_AMX
// The 64-byte block ldtilecfg reads (palette 1): each tile's rows and bytes per row
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether Linux lets this process use the AMX tile state (asked once: a process must ask before
// its first tile instruction)
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// Steps of 32 k by which amx_tiles requests the weights ahead of its tile loads: 8 (4 KiB over
// 16 rows) read Qwen3-MoE's layer at 64 tokens 2-8 % faster than 0, 2, 4 or 16
constexpr int64_t kAmxAhead = 8;

// c[m, j] = dot(x[m], w[j]) on AMX tiles for the mb (at most 32) rows of x given as xv =
// vnni_rows(x) [k / 2, mb] words and the nb weight rows of w (k apart; nb % 16 == 0,
// k % 32 == 0): 16 weight rows at a time as the A operand, loaded from their rows as stored (16
// rows x 32 k per tile), against the rows of x as B (16 k pairs x 16 rows each), into C tiles
// of 16 weight rows x 16 rows of x. The lines kAmxAhead steps ahead are requested before each
// step, past the end of a group into the next one. ct: [16, 32] scratch.
inline void amx_tiles(const uint16_t* w, int64_t nb, int64_t k, const uint32_t* xv, int64_t mb,
                      float* ct, float* c, int64_t ldc) {
  const int n0 = static_cast<int>(std::min<int64_t>(mb, 16)), n1 = static_cast<int>(mb) - n0;
  // tiles 0, 1: C (16 weight rows x n0 | n1 rows of x); 2: A; 3, 4: B (16 k pairs x n0 | n1)
  TileConfig cfg;
  cfg.rows[0] = cfg.rows[2] = cfg.rows[3] = 16;
  cfg.colsb[0] = cfg.colsb[3] = static_cast<uint16_t>(n0 * 4);
  cfg.colsb[2] = 64;
  if (n1 > 0) {
    cfg.rows[1] = cfg.rows[4] = 16;
    cfg.colsb[1] = cfg.colsb[4] = static_cast<uint16_t>(n1 * 4);
  }
  _tile_loadconfig(&cfg);
  const int64_t steps = k / 32, row_bytes = k * 2, x_bytes = mb * 4;
  for (int64_t j0 = 0; j0 < nb; j0 += 16) {
    const char* group = reinterpret_cast<const char*>(w + j0 * k);
    const char* next = j0 + 16 < nb ? group + 16 * row_bytes : nullptr;
    _tile_zero(0);
    if (n1 > 0) _tile_zero(1);
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t ahead = s + kAmxAhead;
      if (ahead < steps) {
        for (int r = 0; r < 16; ++r) prefetch(group + r * row_bytes + ahead * 64);
      } else if (next != nullptr) {
        for (int r = 0; r < 16; ++r) prefetch(next + r * row_bytes + (ahead - steps) * 64);
      }
      _tile_loadd(2, group + s * 64, row_bytes);
      _tile_loadd(3, xv + s * 16 * mb, x_bytes);
      _tile_dpbf16ps(0, 2, 3);
      if (n1 > 0) {
        _tile_loadd(4, xv + s * 16 * mb + 16, x_bytes);
        _tile_dpbf16ps(1, 2, 4);
      }
    }
    _tile_stored(0, ct, 32 * 4);
    if (n1 > 0) _tile_stored(1, ct + 16, 32 * 4);
    for (int64_t m = 0; m < mb; ++m)
      for (int j = 0; j < 16; ++j) c[m * ldc + j0 + j] = ct[j * 32 + m];
  }
}
#endif

// Whether an expert of `rows` rows runs on the AMX tiles (else the dot products): bfloat16 from
// amx_rows rows on an AMX build
template <typename T>
bool takes_amx(int64_t rows, int64_t amx_rows, int64_t k, const Units& units) {
  return std::is_same_v<T, uint16_t> && units.amx && rows >= amx_rows && k % 32 == 0;
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
  int64_t amx_rows;
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
#if LMENGINE_MOE_AMX
    if (scratch.used_tiles) _tile_release();
#endif
  });
}

struct Scratch {
  std::vector<float> c0, c1;  // GEMM outputs: [kChunkRows, kBlockN] gate and up; phase 2: c0 [kChunkRows, block2]
  std::vector<float> ct;      // [16, 32] amx_tiles' C tiles
  bool used_tiles = false;    // amx_tiles ran (the AMX tile state is to be released)
};

// A run of sorted rows (at most kChunkRows) of an expert that takes amx_tiles
struct Chunk {
  int64_t first, rows;  // sorted row index, count
};

// For each chunk, vnni_rows of its rows (sorted row r: rows_of(r)) into out at word
// first * k / 2: once for all the tasks that read them
template <typename RowsOf>
void vnni_chunks(const std::vector<Chunk>& chunks, int64_t k, const RowsOf& rows_of,
                 uint32_t* out) {
  run_tasks<Scratch>(static_cast<int64_t>(chunks.size()), [&](int64_t t, Scratch&) {
    const Chunk& ch = chunks[t];
    const uint16_t* r[kChunkRows];
    for (int64_t m = 0; m < ch.rows; ++m) r[m] = rows_of(ch.first + m);
    vnni_rows(r, ch.rows, k, out + ch.first * k / 2);
  });
}

// c [mb, nb] (row stride nb) = the chunk's rows (a: pointers; xv: their vnni_rows, for amx)
// against nb (at most kDownBlockN) weight rows of w, k apart; on the tiles, the rows past the
// last multiple of 16 take the dot products
template <typename T>
void chunk_gemm(bool amx, const T* const* a, const uint32_t* xv, int64_t mb, const T* w,
                int64_t nb, int64_t k, const Units& units, Scratch& s, float* c) {
  int64_t done = 0;  // weight rows computed on the tiles
#if LMENGINE_MOE_AMX
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (amx) {
      s.used_tiles = true;
      s.ct.resize(16 * 32);
      done = nb / 16 * 16;
      amx_tiles(w, done, k, xv, mb, s.ct.data(), c, nb);
    }
  }
#endif
  (void)amx;
  (void)xv;
  (void)s;
  if (done == nb) return;
  const T* wr[kDownBlockN];
  for (int64_t j = done; j < nb; ++j) wr[j - done] = w + j * k;
  dot_gemm(a, mb, wr, nb - done, k, units, c + done, nb);
}

template <typename T>
void moe_layer(const Layer& L, const T* x, const T* w13, const T* w2, const T* b13,
               int64_t b13_stride, const T* b2, int64_t b2_stride, const float* topk_weights,
               const int64_t* topk_ids, float* acc) {
  const int64_t E = L.num_experts, H = L.hidden, I = L.inter, K = L.top_k;
  const int64_t all_slots = L.num_tokens * K;
  // counting sort of the slots by expert; a slot of id -1 has no expert and is left out
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t s = 0; s < all_slots; ++s) {
    const int64_t e = topk_ids[s];
    TORCH_CHECK(e >= -1 && e < E, "fused_moe: expert id ", e, " out of range [0, ", E,
                ") (or -1: no expert)");
    if (e >= 0) ++start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  const int64_t num_slots = start[E];       // the slots that have an expert
  std::vector<int64_t> sorted(num_slots);  // their ids in expert order
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < all_slots; ++s)
      if (topk_ids[s] >= 0) sorted[fill[topk_ids[s]]++] = s;
  }
  std::vector<int64_t> active;                   // experts with rows
  std::vector<Chunk> amx_chunks1, amx_chunks2;  // of the gate/up and of the down GEMMs
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = start[e + 1] - start[e];
    if (rows == 0) continue;
    active.push_back(e);
    for (int64_t m0 = 0; m0 < rows; m0 += kChunkRows) {
      const Chunk ch{start[e] + m0, std::min(kChunkRows, rows - m0)};
      if (takes_amx<T>(rows, L.amx_rows, H, L.units)) amx_chunks1.push_back(ch);
      if (takes_amx<T>(rows, L.amx_rows, I, L.units)) amx_chunks2.push_back(ch);
    }
  }
  const int64_t num_active = static_cast<int64_t>(active.size());
  auto x_row = [&](int64_t r) { return x + (sorted[r] / K) * H; };  // of sorted row r
  std::vector<T> inter(static_cast<size_t>(num_slots * I));  // [num_slots, I], sorted rows
  std::vector<uint32_t> x_vnni, inter_vnni;  // the AMX chunks' rows as amx_tiles' B operand
  if constexpr (std::is_same_v<T, uint16_t>) {
    x_vnni.resize(amx_chunks1.empty() ? 0 : static_cast<size_t>(num_slots * H / 2));
    vnni_chunks(amx_chunks1, H, x_row, x_vnni.data());
  }

  // phase 1: inter = act(x W13^T + b13)
  const int64_t blocks1 = (I + kBlockN - 1) / kBlockN;
  run_tasks<Scratch>(num_active * blocks1, [&](int64_t task, Scratch& s) {
    const int64_t e = active[task / blocks1];
    const int64_t n0 = (task % blocks1) * kBlockN, nb = std::min(kBlockN, I - n0);
    const int64_t first = start[e], rows = start[e + 1] - first;
    const T* gate_w = w13 + (e * 2 * I + n0) * H;
    const T* up_w = gate_w + I * H;
    const T* gate_b = b13 + e * b13_stride + n0;
    const T* up_b = gate_b + (b13_stride == 0 ? 0 : I);
    const bool amx = takes_amx<T>(rows, L.amx_rows, H, L.units);
    s.c0.resize(kChunkRows * kBlockN);
    s.c1.resize(kChunkRows * kBlockN);
    for (int64_t m0 = 0; m0 < rows; m0 += kChunkRows) {
      const int64_t mb = std::min(kChunkRows, rows - m0);
      const T* a[kChunkRows];
      for (int64_t m = 0; m < mb; ++m) a[m] = x_row(first + m0 + m);
      const uint32_t* xv = amx ? x_vnni.data() + (first + m0) * H / 2 : nullptr;
      chunk_gemm(amx, a, xv, mb, gate_w, nb, H, L.units, s, s.c0.data());
      chunk_gemm(amx, a, xv, mb, up_w, nb, H, L.units, s, s.c1.data());
      for (int64_t m = 0; m < mb; ++m)
        act_row(L.act, s.c0.data() + m * nb, s.c1.data() + m * nb, gate_b, up_b, L.alpha,
                L.limit, inter.data() + (first + m0 + m) * I + n0, nb);
    }
  });

  if constexpr (std::is_same_v<T, uint16_t>) {
    inter_vnni.resize(amx_chunks2.empty() ? 0 : static_cast<size_t>(num_slots * I / 2));
    vnni_chunks(amx_chunks2, I, [&](int64_t r) { return inter.data() + r * I; },
                inter_vnni.data());
  }

  // phase 2: acc[token] += weight * (inter W2^T + b2), a task per block of output columns
  // the widest blocks of kBlockN columns up to kDownBlockN that still make 4 tasks a thread:
  // each task reads a longer run of each expert's rows (256: 12 % faster than 64 on two threads)
  const int64_t threads = at::get_num_threads();
  const int64_t block2 = std::clamp<int64_t>(
      (H / (4 * threads) + kBlockN - 1) / kBlockN * kBlockN, kBlockN, kDownBlockN);
  const int64_t blocks2 = (H + block2 - 1) / block2;
  run_tasks<Scratch>(blocks2, [&](int64_t task, Scratch& s) {
    const int64_t n0 = task * block2, nb = std::min(block2, H - n0);
    s.c0.resize(kChunkRows * block2);
    for (const int64_t e : active) {
      const int64_t first = start[e], rows = start[e + 1] - first;
      const T* down_w = w2 + (e * H + n0) * I;
      const T* down_b = b2 + e * b2_stride + n0;
      const bool amx = takes_amx<T>(rows, L.amx_rows, I, L.units);
      for (int64_t m0 = 0; m0 < rows; m0 += kChunkRows) {
        const int64_t mb = std::min(kChunkRows, rows - m0);
        const T* a[kChunkRows];
        for (int64_t m = 0; m < mb; ++m) a[m] = inter.data() + (first + m0 + m) * I;
        const uint32_t* xv = amx ? inter_vnni.data() + (first + m0) * I / 2 : nullptr;
        chunk_gemm(amx, a, xv, mb, down_w, nb, I, L.units, s, s.c0.data());
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

// Whether this build runs bfloat16 experts on AMX tiles when asked
bool fused_moe_amx_available() {
#if LMENGINE_MOE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// x [T, H]; w_gate_up [E, 2I, H] (gate rows, then up); w_down [E, H, I]; b_gate_up [E, 2I] and
// b_down [E, H] or None; topk_weights [T, top_k] float32; topk_ids [T, top_k] int64; all
// float32 or all bfloat16 (weights, biases, x), contiguous. act: 0 SiLU, 1 GELU (tanh), 2
// ClampedSwiGLU(alpha, limit). bfloat16 experts with amx_rows rows or more take the AMX tiles;
// use_bf16_units=False keeps bfloat16 on the portable kernels (no AVX512-BF16, no AMX).
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                     const c10::optional<at::Tensor>& b_gate_up,
                     const c10::optional<at::Tensor>& b_down, const at::Tensor& topk_weights,
                     const at::Tensor& topk_ids, int64_t act, double alpha, double limit,
                     int64_t amx_rows, bool use_bf16_units) {
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
          std::max<int64_t>(1, amx_rows),
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
        "whether fused_moe runs bfloat16 experts on AMX tiles");
  m.def("fused_moe", &fused_moe, release_gil(),
        "a mixture-of-experts layer: every expert's gate/up GEMM, bias, activation, down GEMM, "
        "bias and the router-weighted sum, in one call (float32 or bfloat16, CPU)",
        py::arg("x"), py::arg("w_gate_up"), py::arg("w_down"), py::arg("b_gate_up"),
        py::arg("b_down"), py::arg("topk_weights"), py::arg("topk_ids"), py::arg("act"),
        py::arg("alpha"), py::arg("limit"), py::arg("amx_rows"), py::arg("use_bf16_units"));
}
