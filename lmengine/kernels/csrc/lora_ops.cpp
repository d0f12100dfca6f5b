// Multi-LoRA on the CPU (S-LoRA / Punica SGMV): out[t] += B_a(scale_a * A_a x[t]) for each
// LoRA token t of a packed batch, reading the adapter's pages of the shared pool in place.
//
// The PyTorch path (lmengine/kernels/lora.py, lora_add_cpu) gathers every tile's A and B
// pages into fresh tensors, pads tiles to one size, runs two bmm and a gather-add-copy back:
// five passes over memory and ~10 dispatched ops per linear. Here each token reads its
// adapter's pages where they live (rank x (in + out) floats, L2-resident for a segment) and
// adds its delta straight into out: one pass, no padding, no temporaries.
//
// Layout as lora.py: page p holds one rank-row of an adapter, lora_a[p] ([in]) a row of A,
// lora_b[p] ([out]) a row of B^T, lora_scale[p] its scale; page_table[a] lists adapter a's
// pages, padded with a page whose scale is 0 (skipped here: its A and B are zero). A page of
// one part of a merged linear (q of qkv) is zero outside that part's columns: given each
// page's column range, the B pass touches only those (a third of qkv's width for q/k/v).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bindings.h"

namespace {

constexpr int64_t kMaxRank = 256;
constexpr int64_t kGroup = 4;    // tokens of one segment that share each A and B row read
constexpr int64_t kColBlock = 64;  // output columns kept in registers / L1 while ranks add up

// G tokens of one adapter: h[g] = scale * (A x_g); out_g += h[g] B, over the live pages.
// Each A row is read once for the G dots, and each block of out_g is loaded and stored once
// while all ranks add into it.
template <int64_t G>
inline void lora_group(const float* const* xs, float* const* outs, const float* a,
                       const float* b, const int64_t* pages, const float* scales,
                       const int64_t* cols, int64_t rank, int64_t in, int64_t n_out) {
  float h[G][kMaxRank];
  for (int64_t r = 0; r < rank; ++r) {
    const float* row = a + pages[r] * in;
    float acc[G] = {};
    for (int64_t g = 0; g < G; ++g) {
      const float* x = xs[g];
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < in; ++i) sum += row[i] * x[i];
      acc[g] = sum;
    }
    for (int64_t g = 0; g < G; ++g) h[g][r] = acc[g] * scales[r];
  }
  for (int64_t j0 = 0; j0 < n_out; j0 += kColBlock) {
    const int64_t width = std::min(kColBlock, n_out - j0);
    float blk[G][kColBlock];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < width; ++j) blk[g][j] = outs[g][j0 + j];
    for (int64_t r = 0; r < rank; ++r) {
      // only the page's own columns (its part of a merged linear) can be non-zero
      const int64_t lo = std::max<int64_t>(cols[2 * r] - j0, 0);
      const int64_t hi = std::min<int64_t>(cols[2 * r + 1] - j0, width);
      if (lo >= hi) continue;
      const float* row = b + pages[r] * n_out + j0;
      for (int64_t g = 0; g < G; ++g) {
        const float hr = h[g][r];
#pragma omp simd
        for (int64_t j = lo; j < hi; ++j) blk[g][j] += hr * row[j];
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < width; ++j) outs[g][j0 + j] = blk[g][j];
  }
}

}  // namespace

// out [T, O] float32 (updated in place) += per-token LoRA of x [T, I] float32.
// lora_a [P, I], lora_b [P, O], lora_scale [P] float32; lora_cols [P, 2] int64 or None: the
// [begin, end) columns of B where page p can be non-zero (None: all); page_table [A, R] int;
// sorted_tokens [N] int64 (LoRA tokens grouped by adapter); seg_starts [S + 1] int64
// (offsets into sorted_tokens); seg_adapter [S] int64 (row of page_table per segment).
void lora_sgmv(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a,
               const at::Tensor& lora_b, const at::Tensor& lora_scale,
               const c10::optional<at::Tensor>& lora_cols, const at::Tensor& page_table,
               const at::Tensor& sorted_tokens, const at::Tensor& seg_starts,
               const at::Tensor& seg_adapter) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  lora_a.scalar_type() == at::kFloat && lora_b.scalar_type() == at::kFloat &&
                  lora_scale.scalar_type() == at::kFloat,
              "lora_sgmv: float32 tensors only");
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous() && lora_a.is_contiguous() &&
                  lora_b.is_contiguous() && lora_scale.is_contiguous(),
              "lora_sgmv: contiguous tensors only");
  TORCH_CHECK(page_table.size(1) <= kMaxRank, "lora_sgmv: rank above ", kMaxRank);
  const int64_t in = x.size(1), n_out = out.size(1);
  const int64_t num_segments = seg_adapter.size(0);
  const int64_t num_tokens = sorted_tokens.size(0);
  if (num_tokens == 0) return;
  auto table = page_table.to(at::kLong).contiguous();
  auto tokens = sorted_tokens.to(at::kLong).contiguous();
  auto starts = seg_starts.to(at::kLong).contiguous();
  auto seg_ad = seg_adapter.to(at::kLong).contiguous();
  const int64_t max_rank = table.size(1);
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* sa = seg_ad.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* ap = lora_a.data_ptr<float>();
  const float* bp = lora_b.data_ptr<float>();
  const float* sp = lora_scale.data_ptr<float>();
  at::Tensor col_range;
  if (lora_cols.has_value()) {
    col_range = lora_cols->to(at::kLong).contiguous();
    TORCH_CHECK(col_range.dim() == 2 && col_range.size(0) == lora_a.size(0) &&
                    col_range.size(1) == 2,
                "lora_sgmv: lora_cols must be [pages, 2]");
  }
  const int64_t* cp = col_range.defined() ? col_range.data_ptr<int64_t>() : nullptr;

  // each segment's live pages (scale != 0), their scales and column ranges, found once
  std::vector<int64_t> live_pages(num_segments * max_rank);
  std::vector<float> live_scales(num_segments * max_rank);
  std::vector<int64_t> live_cols(num_segments * max_rank * 2);
  std::vector<int64_t> live_rank(num_segments);
  for (int64_t s = 0; s < num_segments; ++s) {
    int64_t rank = 0;
    for (int64_t r = 0; r < max_rank; ++r) {
      const int64_t page = tp[sa[s] * max_rank + r];
      if (sp[page] != 0.0f) {
        live_pages[s * max_rank + rank] = page;
        live_scales[s * max_rank + rank] = sp[page];
        const int64_t k = 2 * (s * max_rank + rank);
        live_cols[k] = cp != nullptr ? std::max<int64_t>(cp[2 * page], 0) : 0;
        live_cols[k + 1] = cp != nullptr ? std::min(cp[2 * page + 1], n_out) : n_out;
        ++rank;
      }
    }
    live_rank[s] = rank;
  }
  // tokens per task: about 64K multiply-adds, and whole groups where that allows
  const int64_t work = std::max<int64_t>(1, max_rank * (in + n_out));
  const int64_t grain = std::max<int64_t>(kGroup, 65536 / work);
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    int64_t s = std::upper_bound(st, st + num_segments + 1, begin) - st - 1;
    const float* xs[kGroup];
    float* outs[kGroup];
    for (int64_t i = begin; i < end;) {
      while (i >= st[s + 1]) ++s;
      const int64_t n = std::min({kGroup, end - i, st[s + 1] - i});  // same segment
      for (int64_t g = 0; g < n; ++g) {
        xs[g] = xp + tok[i + g] * in;
        outs[g] = op + tok[i + g] * n_out;
      }
      const int64_t* pages = live_pages.data() + s * max_rank;
      const float* scales = live_scales.data() + s * max_rank;
      const int64_t* cols = live_cols.data() + 2 * s * max_rank;
      const int64_t rank = live_rank[s];
      switch (n) {
        case 4: lora_group<4>(xs, outs, ap, bp, pages, scales, cols, rank, in, n_out); break;
        case 3: lora_group<3>(xs, outs, ap, bp, pages, scales, cols, rank, in, n_out); break;
        case 2: lora_group<2>(xs, outs, ap, bp, pages, scales, cols, rank, in, n_out); break;
        default: lora_group<1>(xs, outs, ap, bp, pages, scales, cols, rank, in, n_out);
      }
      i += n;
    }
  });
}

void register_lora_ops(py::module& m) {
  m.def("lora_sgmv", &lora_sgmv, release_gil(),
        "out += per-token LoRA over adapter segments, pages read in place (float32, CPU)",
        py::arg("out"), py::arg("x"), py::arg("lora_a"), py::arg("lora_b"),
        py::arg("lora_scale"), py::arg("lora_cols"), py::arg("page_table"),
        py::arg("sorted_tokens"),
        py::arg("seg_starts"), py::arg("seg_adapter"));
}
