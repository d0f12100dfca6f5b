// Linear layers on GGUF's quantized blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), weight-only:
// activations and accumulation stay float32, and each weight is unpacked in registers to
// exactly the float32 value the `gguf` package's dequantization gives it (d * q, d * (q - 8),
// d * q + m, (d * sc) * q - dmin * m, (d * sc) * q: each a product that is exact in float32,
// a half scale times small integers, then at most one rounding, as the package's operations).
//
// A block covers 32 consecutive weights of one output row (ggml's layouts):
//   Q4_0: half d, 16 bytes            w[j] = d * (q[j] - 8)
//   Q4_1: half d, half m, 16 bytes    w[j] = d * q[j] + m
//   Q8_0: half d, 32 signed bytes     w[j] = d * q[j]
// In the 4-bit types byte j holds q[j] in its low nibble and q[j + 16] in its high one.
// The K types cover 256 weights, in 8 groups of 32:
//   Q4_K (144 bytes): half d, half dmin, 12 bytes of 6-bit scales sc[8] and minima m[8], 128
//     bytes of 4-bit quants (bytes 32c..32c+31 hold group 2c in their low nibbles, 2c+1 in
//     their high ones); w = (d * sc[g]) * q - dmin * m[g]
//   Q6_K (210 bytes): 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 signed scales (one
//     per 16 weights), half d; w = (d * sc) * (q - 32)
//
// `gguf_gemv` serves a few rows (decode): it streams each weight row once, as the float32
// GEMV does, reading 3.8-7x fewer bytes. `gguf_gemm` serves decode batches: panels of weight
// rows unpacked once into the cache, register tiles of dot products. `gguf_dequantize` expands
// a block matrix to float32: the reference for the tests, and the way to larger GEMMs.

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include "bindings.h"
#ifdef __F16C__
#include "vec_math.h"  // v16f, v16i32, load16
#endif

namespace {

#if defined(__AVX2__) && !defined(__AVX512F__)
// Two 256-bit halves as one 16-lane vector (two AVX registers to GCC).
template <typename V, typename H>
inline V join_halves(H lo, H hi) {
  V r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
}
#endif

// 16 bytes at `p` widened to int32, sign- or zero-extended.
// NOTE: intrinsics: GCC widens a vector of signed bytes (and unsigned ones in some contexts)
// one element at a time, 5-16x slower per weight than these instructions
template <bool kSigned>
inline v16i32 widen16(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (v16i32)(kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i c = _mm_unpackhi_epi64(b, b);
  const __m256i lo = kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  const __m256i hi = kSigned ? _mm256_cvtepi8_epi32(c) : _mm256_cvtepu8_epi32(c);
  return join_halves<v16i32>(lo, hi);
#else
  v16i32 r;
  for (int j = 0; j < 16; ++j) r[j] = kSigned ? static_cast<int8_t>(p[j]) : p[j];
  return r;
#endif
}

inline v16f to_float(v16i32 v) { return __builtin_convertvector(v, v16f); }

// `v` in all 16 lanes.
// NOTE: GCC builds a vector from a scalar operand (v16f * float) through 16 stores to the stack
// where a v16f is two AVX registers, and then keeps the loop's accumulators in memory too
// (8x slower per weight on AVX2)
inline v16f splat16(float v) {
#if defined(__AVX512F__)
  return (v16f)_mm512_set1_ps(v);
#elif defined(__AVX2__)
  const __m256 h = _mm256_set1_ps(v);
  return join_halves<v16f>(h, h);
#else
  v16f r;
  for (int j = 0; j < 16; ++j) r[j] = v;
  return r;
#endif
}

constexpr int64_t kBlock = 32;  // weights per group (a whole block in the 32-weight types)
// ggml's type ids (GGMLQuantizationType)
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction; c10::Half converts with integer arithmetic
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline void store16(float* p, v16f v) { *reinterpret_cast<v16f*>(p) = v; }

template <int64_t kType>
constexpr int64_t block_bytes() {
  return kType == kQ4_0   ? 18
         : kType == kQ4_1 ? 20
         : kType == kQ8_0 ? 34
         : kType == kQ4_K ? 144
                          : 210;
}

template <int64_t kType>
constexpr int64_t block_weights() {
  return kType == kQ4_K || kType == kQ6_K ? 256 : 32;
}

// The 6-bit scale and minimum of group g (0-7) of a Q4_K block, from its 12 packed bytes s:
// groups 0-3 in the low 6 bits of s[g] and s[g + 4]; groups 4-7 in the nibbles of s[g + 4],
// their top 2 bits in the top bits of s[g - 4] and s[g].
inline void q4_k_scale_min(const uint8_t* s, int g, int& sc, int& m) {
  if (g < 4) {
    sc = s[g] & 63;
    m = s[g + 4] & 63;
  } else {
    sc = (s[g + 4] & 15) | ((s[g - 4] >> 6) << 4);
    m = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
  }
}

// Group g of a Q6_K block: 16 weights (half 0 or 1) as float q - 32 (exact). Group g = 4h + gg
// takes its low 4 bits from nibble gg / 2 of bytes 64h + 32 (gg % 2) + j, its high 2 bits
// from bits 2gg of bytes 128 + 32h + j.
inline v16f q6_k_quants(const uint8_t* p, int g, int half) {
  const int h = g / 4, gg = g % 4;
  const uint8_t* low = p + 64 * h + 32 * (gg & 1) + 16 * half;
  const uint8_t* high = p + 128 + 32 * h + 16 * half;
  const v16i32 l = widen16<false>(low), hb = widen16<false>(high);
  return to_float((((l >> (4 * (gg >> 1))) & 15) | (((hb >> (2 * gg)) & 3) << 4)) - 32);
}

#ifdef __AVX512F__
// 16 4-bit quants, the nibbles at `shift` (0 or 4) of the 16 bytes at `qs`, looked up in
// `table`, their 16 values: one permute per 16 weights where a conversion and a multiply-add
// would take two.
inline v16f lookup16(const uint8_t* qs, int shift, __m512 table) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return (v16f)_mm512_permutexvar_ps(_mm512_srli_epi32(q, shift), table);  // low 4 bits index
}

// The table of a block's 16 4-bit values: scale * i + offset (i = 0-15) by one multiply-add,
// each the value the separate operations give (scale * i is exact).
inline __m512 table16(float scale, float offset) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(iota, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
}
#endif

// Weights 32g to 32g + 31 of the block at `p` (g = 0 in the 32-weight types), as two vectors:
// weights 0-15 and 16-31 of the group.
template <int64_t kType>
inline void unpack(const uint8_t* p, int g, v16f& lo, v16f& hi) {
  if constexpr (kType == kQ6_K) {
    const float d = half_to_float(p + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192) + 2 * g;
    lo = q6_k_quants(p, g, 0) * splat16(d * sc[0]);  // d * sc: exact
    hi = q6_k_quants(p, g, 1) * splat16(d * sc[1]);
    return;
  }
  if constexpr (kType == kQ4_K) {
    int sc, m;
    q4_k_scale_min(p + 4, g, sc, m);
    const float dsc = half_to_float(p) * sc, dm = half_to_float(p + 2) * m;  // exact
    const uint8_t* qs = p + 16 + 32 * (g / 2);
    const int shift = 4 * (g % 2);
#ifdef __AVX512F__
    const __m512 table = table16(dsc, -dm);  // fma(i, dsc, -dm): one rounding, as i * dsc - dm
    lo = lookup16(qs, shift, table);
    hi = lookup16(qs + 16, shift, table);
#else
    const v16f dscv = splat16(dsc), dmv = splat16(dm);
    lo = to_float((widen16<false>(qs) >> shift) & 15) * dscv - dmv;
    hi = to_float((widen16<false>(qs + 16) >> shift) & 15) * dscv - dmv;
#endif
    return;
  }
  const float d = half_to_float(p);
  if constexpr (kType == kQ8_0) {
    lo = to_float(widen16<true>(p + 2)) * splat16(d);
    hi = to_float(widen16<true>(p + 18)) * splat16(d);
    return;
  }
  const uint8_t* qs = p + (kType == kQ4_1 ? 4 : 2);
#ifdef __AVX512F__
  // d * i + m, or d * i - 8d = d * (i - 8) (both products exact, one rounding in each)
  const __m512 table = table16(d, kType == kQ4_1 ? half_to_float(p + 2) : -8.f * d);
  lo = lookup16(qs, 0, table);
  hi = lookup16(qs, 4, table);
#else
  const v16i32 q = widen16<false>(qs);
  lo = to_float(q & 0x0F);
  hi = to_float(q >> 4);
  const v16f dv = splat16(d);
  if constexpr (kType == kQ4_0) {
    const v16f eight = splat16(8.f);
    lo = (lo - eight) * dv;
    hi = (hi - eight) * dv;
  } else {
    const v16f mv = splat16(half_to_float(p + 2));
    lo = lo * dv + mv;
    hi = hi * dv + mv;
  }
#endif
}

constexpr int64_t kPrefetchBytes = 1024;

// y[i, r] = x[i] . w[r] (+ bias[r]) for weight rows r in [r0, r1) and kM input rows.
template <int64_t kType, int kM>
void gemv_rows(const float* x, const uint8_t* w, const float* bias, float* y, int64_t k,
               int64_t n, int64_t r0, int64_t r1) {
  constexpr int64_t kBytes = block_bytes<kType>(), kGroups = block_weights<kType>() / kBlock;
  const int64_t blocks = k / block_weights<kType>(), row_bytes = blocks * kBytes;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wr = w + r * row_bytes;
    v16f acc[kM][2] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      __builtin_prefetch(wr + b * kBytes + kPrefetchBytes);
      for (int g = 0; g < kGroups; ++g) {
        v16f lo, hi;
        unpack<kType>(wr + b * kBytes, g, lo, hi);
        for (int i = 0; i < kM; ++i) {
          const float* xb = x + i * k + (b * kGroups + g) * kBlock;
          acc[i][0] += load16(xb) * lo;
          acc[i][1] += load16(xb + 16) * hi;
        }
      }
    }
    for (int i = 0; i < kM; ++i) {
      const v16f total = acc[i][0] + acc[i][1];
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += total[j];
      y[i * n + r] = s + (bias ? bias[r] : 0.f);
    }
  }
}

template <int64_t kType>
void dequantize_rows(const uint8_t* w, float* out, int64_t k, int64_t r0, int64_t r1) {
  constexpr int64_t kBytes = block_bytes<kType>(), kGroups = block_weights<kType>() / kBlock;
  const int64_t blocks = k / block_weights<kType>();
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      for (int g = 0; g < kGroups; ++g) {
        v16f lo, hi;
        unpack<kType>(w + (r * blocks + b) * kBytes, g, lo, hi);
        float* o = out + r * k + (b * kGroups + g) * kBlock;
        store16(o, lo);
        store16(o + 16, hi);
      }
    }
  }
}

// [sum a, sum b, sum c, sum d] of four vectors: pairwise interleaving adds (a transposing
// reduction), 13 shuffles and adds where four separate horizontal sums take ~30.
typedef float v4f __attribute__((vector_size(16), aligned(4)));
inline v4f hsum4(v16f a, v16f b, v16f c, v16f d) {
  const v16f ab = __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28,
                                          13, 29) +
                  __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30,
                                          15, 31);
  const v16f cd = __builtin_shufflevector(c, d, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28,
                                          13, 29) +
                  __builtin_shufflevector(c, d, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30,
                                          15, 31);
  // per group of four lanes: partial sums of a, b, a, b (and c, d, c, d); then of a, b, c, d
  const v16f abcd = __builtin_shufflevector(ab, cd, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12,
                                            13, 28, 29) +
                    __builtin_shufflevector(ab, cd, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14,
                                            15, 30, 31);
  typedef float v8f __attribute__((vector_size(32), aligned(4)));
  const v8f half = __builtin_shufflevector(abcd, abcd, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(abcd, abcd, 8, 9, 10, 11, 12, 13, 14, 15);
  return __builtin_shufflevector(half, half, 0, 1, 2, 3) +
         __builtin_shufflevector(half, half, 4, 5, 6, 7);
}

constexpr int kTileRows = 6;  // input rows per register tile
constexpr int kTileCols = 4;  // weight rows (outputs) per register tile

// y[i, c0 + j] = x[i] . w[j] for kM input rows and the 4 unpacked weight rows at `w` (float32,
// `k` apart), over k: a 6 x 4 tile of dot products in 24 registers, each step loading 6 + 4
// vectors for 24 multiply-adds. `cols` (1-4) of the 4 are stored.
template <int kM>
void dot_tile(const float* x, const float* w, const float* bias, float* y, int64_t k, int64_t n,
              int cols) {
  v16f acc[kM][kTileCols];
  for (int i = 0; i < kM; ++i)
    for (int j = 0; j < kTileCols; ++j) acc[i][j] = v16f{};  // registers (`= {}`: a memset)
  for (int64_t c = 0; c < k; c += 16) {
    v16f wv[kTileCols];
    for (int j = 0; j < kTileCols; ++j) wv[j] = load16(w + j * k + c);
    for (int i = 0; i < kM; ++i) {
      const v16f xv = load16(x + i * k + c);
      for (int j = 0; j < kTileCols; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < kM; ++i) {
    const v4f s = hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    for (int j = 0; j < cols; ++j) y[i * n + j] = s[j] + (bias ? bias[j] : 0.f);
  }
}

constexpr int64_t kPanelRows = 32;  // weight rows unpacked at a time, per thread

// y rows [0, m) x weight rows [r0, r1): each panel of 32 weight rows is unpacked once into a
// buffer that stays in the core's cache (32 x K floats: 72-192 KiB at K 576-1,536), then
// multiplied with every input row in 6 x 4 register tiles.
template <int64_t kType>
void gemm_rows(const float* x, const uint8_t* w, const float* bias, float* y, int64_t m,
               int64_t k, int64_t n, int64_t r0, int64_t r1, float* panel) {
  using Tile = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int);
  static constexpr Tile tiles[] = {dot_tile<1>, dot_tile<2>, dot_tile<3>,
                                   dot_tile<4>, dot_tile<5>, dot_tile<6>};
  for (int64_t p0 = r0; p0 < r1; p0 += kPanelRows) {
    const int64_t rows = std::min(kPanelRows, r1 - p0);
    const int64_t row_bytes = k / block_weights<kType>() * block_bytes<kType>();
    dequantize_rows<kType>(w + p0 * row_bytes, panel, k, 0, rows);
    // a partial tile's missing weight rows: zeros, their outputs not stored
    const int64_t padded = (rows + kTileCols - 1) / kTileCols * kTileCols;
    std::fill(panel + rows * k, panel + padded * k, 0.f);
    for (int64_t c0 = 0; c0 < rows; c0 += kTileCols) {
      const int cols = static_cast<int>(std::min<int64_t>(kTileCols, rows - c0));
      for (int64_t i0 = 0; i0 < m; i0 += kTileRows) {
        const int rows_i = static_cast<int>(std::min<int64_t>(kTileRows, m - i0));
        tiles[rows_i - 1](x + i0 * k, panel + c0 * k, bias ? bias + p0 + c0 : nullptr,
                          y + i0 * n + p0 + c0, k, n, cols);
      }
    }
  }
}

// f(std::integral_constant<int64_t, type>{}) for the block type `qtype`: one instance of a
// generic lambda per supported type
template <typename F>
decltype(auto) dispatch(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>{});
  }
  TORCH_CHECK(false, "GGUF blocks of type ", qtype, " are not supported: Q4_0 (2), Q4_1 (3), ",
              "Q8_0 (8), Q4_K (12), Q6_K (14)");
}

// w: uint8 [N, K / weights per block * bytes per block]; returns K.
int64_t check_blocks(const at::Tensor& w, int64_t qtype, int64_t k) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.dim() == 2,
              "GGUF blocks must be a contiguous uint8 CPU tensor [N, row bytes]");
  const auto [weights, bytes] = dispatch(qtype, [](auto t) {
    constexpr int64_t T = decltype(t)::value;
    return std::pair<int64_t, int64_t>(block_weights<T>(), block_bytes<T>());
  });
  TORCH_CHECK(k > 0 && k % weights == 0, "GGUF rows of type ", qtype, " must hold a multiple of ",
              weights, " weights, got ", k);
  const int64_t row_bytes = k / weights * bytes;
  TORCH_CHECK(w.size(1) == row_bytes, "GGUF blocks: rows of ", k, " weights take ", row_bytes,
              " bytes in type ", qtype, ", got ", w.size(1));
  return k;
}

// x float32 [M, K] @ blocks [N, row bytes]^T (+ bias [N]): the sizes, once every input is
// checked
struct LinearSizes {
  int64_t m, k, n;
  const float* bias;
};

LinearSizes check_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                         const c10::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.dim() == 2,
              op, ": x must be a contiguous float32 CPU tensor [M, K]");
  const int64_t k = check_blocks(w, qtype, x.size(1)), n = w.size(0);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->dim() == 1 && bias->size(0) == n,
                op, ": bias must be a contiguous float32 [N]");
    bp = bias->data_ptr<float>();
  }
  return {x.size(0), k, n, bp};
}

}  // namespace

constexpr int kMaxGgufGemvRows = 8;

// x float32 [M, K] (1 <= M <= 8) @ dequantized(w)^T (+ bias) -> [M, N]
at::Tensor gguf_gemv(const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                     const c10::optional<at::Tensor>& bias) {
  // NOTE: named members, not a structured binding: the lambda below captures them
  const LinearSizes sizes = check_linear(x, w, qtype, bias, "gguf_gemv");
  const int64_t m = sizes.m, k = sizes.k, n = sizes.n;
  const float* bp = sizes.bias;
  TORCH_CHECK(m >= 1 && m <= kMaxGgufGemvRows, "gguf_gemv: 1 to ", kMaxGgufGemvRows,
              " rows, got ", m);
  auto y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  using Kernel = void (*)(const float*, const uint8_t*, const float*, float*, int64_t, int64_t,
                         int64_t, int64_t);
  const Kernel* kernels = dispatch(qtype, [](auto t) -> const Kernel* {
    constexpr int64_t T = decltype(t)::value;
    static constexpr Kernel rows[] = {gemv_rows<T, 1>, gemv_rows<T, 2>, gemv_rows<T, 3>,
                                      gemv_rows<T, 4>, gemv_rows<T, 5>, gemv_rows<T, 6>,
                                      gemv_rows<T, 7>, gemv_rows<T, 8>};
    return rows;
  });
  // at least ~16 KiB of blocks per task
  const int64_t grain = std::max<int64_t>(1, 16384 / w.size(1));
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    kernels[m - 1](xp, wp, bp, yp, k, n, r0, r1);
  });
  return y;
}

// x float32 [M, K] @ dequantized(w)^T (+ bias) -> [M, N] for any M, each panel of weight rows
// unpacked once per call into a per-thread buffer (gemm_rows)
at::Tensor gguf_gemm(const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                     const c10::optional<at::Tensor>& bias) {
  // NOTE: named members, not a structured binding: the lambda below captures them
  const LinearSizes sizes = check_linear(x, w, qtype, bias, "gguf_gemm");
  const int64_t m = sizes.m, k = sizes.k, n = sizes.n;
  const float* bp = sizes.bias;
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (n + kPanelRows - 1) / kPanelRows, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> panel(kPanelRows * k);
    const int64_t r0 = p0 * kPanelRows, r1 = std::min(n, p1 * kPanelRows);
    dispatch(qtype, [&](auto t) {
      gemm_rows<decltype(t)::value>(xp, wp, bp, yp, m, k, n, r0, r1, panel.data());
    });
  });
  return y;
}

// uint8 blocks [N, row bytes] of `qtype` holding rows of K weights -> float32 [N, K]
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t qtype, int64_t k) {
  check_blocks(w, qtype, k);
  const int64_t n = w.size(0);
  auto out = at::empty({n, k}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 16384 / w.size(1));
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    dispatch(qtype, [&](auto t) { dequantize_rows<decltype(t)::value>(wp, op, k, r0, r1); });
  });
  return out;
}

void register_gguf_ops(py::module& m) {
  m.def("gguf_gemm", &gguf_gemm, release_gil(),
        "float32 x [M, K] @ w^T (+ bias), w as GGUF blocks [N, row bytes]",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none());
  m.def("gguf_gemv", &gguf_gemv, release_gil(),
        "float32 x [M<=8, K] @ w^T (+ bias), w as GGUF blocks [N, row bytes]",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none());
  m.def("gguf_dequantize", &gguf_dequantize, release_gil(),
        "GGUF blocks [N, row bytes] holding rows of K weights -> float32 [N, K]",
        py::arg("w"), py::arg("qtype"), py::arg("k"));
}
