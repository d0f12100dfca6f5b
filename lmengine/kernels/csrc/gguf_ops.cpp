// Linear layers on GGUF's quantized blocks (Q4_0, Q4_1, Q8_0), weight-only: activations and
// accumulation stay float32, and each weight is unpacked in registers to exactly the float32
// value the `gguf` package's dequantization gives it (d * q, d * (q - 8), d * q + m: the
// products are exact in float32, a half scale times a 4- or 8-bit integer, so a fused
// multiply-add rounds them as the separate operations do).
//
// A block covers 32 consecutive weights of one output row (ggml's layouts):
//   Q4_0: half d, 16 bytes            w[j] = d * (q[j] - 8)
//   Q4_1: half d, half m, 16 bytes    w[j] = d * q[j] + m
//   Q8_0: half d, 32 signed bytes     w[j] = d * q[j]
// In the 4-bit types byte j holds q[j] in its low nibble and q[j + 16] in its high one.
//
// `gguf_gemv` serves a few rows (decode): it streams each weight row once, as the float32
// GEMV does, reading 5-6x fewer bytes. `gguf_dequantize` expands a block matrix (or a range of
// its rows) to float32: the reference for the tests, and the way to larger GEMMs.

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include "bindings.h"
#ifdef __F16C__
#include "vec_math.h"  // v16f, v16i32, load16
#endif

namespace {

typedef uint8_t v16u8 __attribute__((vector_size(16), aligned(1)));
typedef int8_t v16i8 __attribute__((vector_size(16), aligned(1)));

// NOTE: bytes -> int32 -> float: GCC turns a direct byte-to-float conversion into one scalar
// conversion per element (3x slower than the float32 GEMV); through int32 it is two vector
// instructions (a widening move, then an int-to-float conversion)
template <typename V>
inline v16f to_float(V v) {
  return __builtin_convertvector(__builtin_convertvector(v, v16i32), v16f);
}

constexpr int64_t kBlock = 32;  // weights per block
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // ggml's type ids (GGMLQuantizationType)

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
  return kType == kQ4_0 ? 18 : kType == kQ4_1 ? 20 : 34;
}

// The 32 weights of the block at `p`, as two vectors: weights 0-15 and 16-31.
template <int64_t kType>
inline void unpack(const uint8_t* p, v16f& lo, v16f& hi) {
  const float d = half_to_float(p);
#ifdef __AVX512F__
  // NOTE: intrinsics here: GCC widens a vector of signed bytes one element at a time (Q8_0 ran
  // 5x slower per weight than Q4_1). A 4-bit weight is a lookup in a table of its 16 values,
  // d * i (+ m) or d * (i - 8), made by one multiply-add per block: two permutes instead of
  // two int-to-float conversions and two multiply-adds. The table entries are the values the
  // separate operations give (d * i is exact).
  if constexpr (kType == kQ8_0) {
    const __m512 dv = _mm512_set1_ps(d);
    lo = (v16f)_mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 2)))), dv);
    hi = (v16f)_mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 18)))), dv);
  } else {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 dv = _mm512_set1_ps(d);
    const __m512 table =
        kType == kQ4_1 ? _mm512_fmadd_ps(iota, dv, _mm512_set1_ps(half_to_float(p + 2)))
                       : _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.f)), dv);
    const __m512i q = _mm512_cvtepu8_epi32(
        _mm_loadu_si128((const __m128i*)(p + (kType == kQ4_1 ? 4 : 2))));
    lo = (v16f)_mm512_permutexvar_ps(q, table);  // the index's low 4 bits: the low nibble
    hi = (v16f)_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  }
#else
  if constexpr (kType == kQ8_0) {
    const v16i8 a = *reinterpret_cast<const v16i8*>(p + 2);
    const v16i8 b = *reinterpret_cast<const v16i8*>(p + 18);
    lo = to_float(a) * d;
    hi = to_float(b) * d;
  } else {
    const uint8_t* qs = p + (kType == kQ4_1 ? 4 : 2);
    const v16u8 q = *reinterpret_cast<const v16u8*>(qs);
    lo = to_float(q & 0x0F);
    hi = to_float(q >> 4);
    if constexpr (kType == kQ4_0) {
      lo = (lo - 8.f) * d;
      hi = (hi - 8.f) * d;
    } else {
      const float m = half_to_float(p + 2);
      lo = lo * d + m;
      hi = hi * d + m;
    }
  }
#endif
}

constexpr int64_t kPrefetchBytes = 1024;

// y[i, r] = x[i] . w[r] (+ bias[r]) for weight rows r in [r0, r1) and kM input rows.
template <int64_t kType, int kM>
void gemv_rows(const float* x, const uint8_t* w, const float* bias, float* y, int64_t k,
               int64_t n, int64_t r0, int64_t r1) {
  constexpr int64_t kBytes = block_bytes<kType>();
  const int64_t blocks = k / kBlock, row_bytes = blocks * kBytes;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wr = w + r * row_bytes;
    v16f acc[kM][2] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      __builtin_prefetch(wr + b * kBytes + kPrefetchBytes);
      v16f lo, hi;
      unpack<kType>(wr + b * kBytes, lo, hi);
      for (int i = 0; i < kM; ++i) {
        const float* xb = x + i * k + b * kBlock;
        acc[i][0] += load16(xb) * lo;
        acc[i][1] += load16(xb + 16) * hi;
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
  constexpr int64_t kBytes = block_bytes<kType>();
  const int64_t blocks = k / kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      v16f lo, hi;
      unpack<kType>(w + (r * blocks + b) * kBytes, lo, hi);
      store16(out + r * k + b * kBlock, lo);
      store16(out + r * k + b * kBlock + 16, hi);
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
    dequantize_rows<kType>(w + p0 * (k / kBlock) * block_bytes<kType>(), panel, k, 0, rows);
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

int64_t bytes_per_block(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return block_bytes<kQ4_0>();
    case kQ4_1: return block_bytes<kQ4_1>();
    case kQ8_0: return block_bytes<kQ8_0>();
  }
  TORCH_CHECK(false, "GGUF blocks of type ", qtype, " are not supported: Q4_0 (2), Q4_1 (3), ",
              "Q8_0 (8)");
}

// w: uint8 [N, K / 32 * bytes per block]; returns K.
int64_t check_blocks(const at::Tensor& w, int64_t qtype, int64_t k) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.dim() == 2,
              "GGUF blocks must be a contiguous uint8 CPU tensor [N, row bytes]");
  TORCH_CHECK(k > 0 && k % kBlock == 0, "GGUF rows must hold a multiple of 32 weights, got ", k);
  const int64_t row_bytes = k / kBlock * bytes_per_block(qtype);
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
#define LMENGINE_GGUF_KERNELS(T)                                                            \
  {gemv_rows<T, 1>, gemv_rows<T, 2>, gemv_rows<T, 3>, gemv_rows<T, 4>, gemv_rows<T, 5>,    \
   gemv_rows<T, 6>, gemv_rows<T, 7>, gemv_rows<T, 8>}
  static constexpr Kernel q4_0[] = LMENGINE_GGUF_KERNELS(kQ4_0);
  static constexpr Kernel q4_1[] = LMENGINE_GGUF_KERNELS(kQ4_1);
  static constexpr Kernel q8_0[] = LMENGINE_GGUF_KERNELS(kQ8_0);
#undef LMENGINE_GGUF_KERNELS
  const Kernel* kernels = qtype == kQ4_0 ? q4_0 : qtype == kQ4_1 ? q4_1 : q8_0;
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
    if (qtype == kQ4_0) gemm_rows<kQ4_0>(xp, wp, bp, yp, m, k, n, r0, r1, panel.data());
    else if (qtype == kQ4_1) gemm_rows<kQ4_1>(xp, wp, bp, yp, m, k, n, r0, r1, panel.data());
    else gemm_rows<kQ8_0>(xp, wp, bp, yp, m, k, n, r0, r1, panel.data());
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
    if (qtype == kQ4_0) dequantize_rows<kQ4_0>(wp, op, k, r0, r1);
    else if (qtype == kQ4_1) dequantize_rows<kQ4_1>(wp, op, k, r0, r1);
    else dequantize_rows<kQ8_0>(wp, op, k, r0, r1);
  });
  return out;
}

void register_gguf_ops(py::module& m) {
  m.def("gguf_gemm", &gguf_gemm, release_gil(),
        "float32 x [M, K] @ w^T (+ bias), w as GGUF blocks (Q4_0, Q4_1, Q8_0) [N, row bytes]",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none());
  m.def("gguf_gemv", &gguf_gemv, release_gil(),
        "float32 x [M<=8, K] @ w^T (+ bias), w as GGUF blocks (Q4_0, Q4_1, Q8_0) [N, row bytes]",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none());
  m.def("gguf_dequantize", &gguf_dequantize, release_gil(),
        "GGUF blocks (Q4_0, Q4_1, Q8_0) [N, row bytes] holding rows of K weights -> float32 "
        "[N, K]",
        py::arg("w"), py::arg("qtype"), py::arg("k"));
}
