// The decoder layers of a Llama-shaped model at a decode step, as one native call.
//
// At one to a few rows a decode step's kernels are short (a SmolLM2 layer's GEMVs take tens of
// microseconds), and the Python between them (module calls, dispatch, argument checks, ~13
// kernel calls per layer) cost about a third of a single-stream step on the GGUF blocks; at 64
// rows in bfloat16 it was ~8 ms of a 64 ms step, and the GIL it held between kernels slowed the
// server's threads and was slowed by them. This loop calls the very kernels the patched modules
// call, in the same order with the same arguments (so the results are bit-identical), without
// returning to Python between layers; each linear takes the route that
// lmengine/kernels/linear.py's `route` chose for the step. lmengine/models/decode_loop.py
// decides when a step may take it and builds it from the model's modules.

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "bindings.h"

// the kernels the patched modules call, defined in the other sources of this module
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w,
                     const c10::optional<at::Tensor>& bias);
at::Tensor gguf_gemv(const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                     const c10::optional<at::Tensor>& bias);
at::Tensor sgemm_packed_linear(const at::Tensor& x, const at::Tensor& packed,
                               const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor bf16_vnni_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                            const c10::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps, const c10::optional<at::Tensor>& residual);
std::tuple<at::Tensor, at::Tensor> bf16_rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                                 double eps,
                                                 const c10::optional<at::Tensor>& residual);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor bf16_silu_mul(const at::Tensor& gate_up);
at::Tensor bf16_linear_rows(const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias);
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias);
at::Tensor bf16_onednn_linear_rows(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                   const c10::optional<at::Tensor>& bias);
at::Tensor rotary_fill_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                          at::Tensor& v_cache, const at::Tensor& slot_mapping);
at::Tensor rotary_fill_kv_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                               at::Tensor& v_cache, const at::Tensor& slot_mapping);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& kv_lens, double scale,
                                  int64_t sliding_window, double softcap,
                                  const c10::optional<at::Tensor>& sinks);
at::Tensor paged_decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                                       const at::Tensor& kv_lens, double scale,
                                       int64_t sliding_window, double softcap,
                                       const c10::optional<at::Tensor>& sinks);
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& tables,
                             const at::Tensor& q_start, const at::Tensor& q_lens,
                             const at::Tensor& kv_lens, double scale, at::Tensor& out,
                             const c10::optional<at::Tensor>& sinks);
void paged_prefill_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& tables,
                                  const at::Tensor& q_start, const at::Tensor& q_lens,
                                  const at::Tensor& kv_lens, double scale, at::Tensor& out,
                                  const c10::optional<at::Tensor>& sinks);

namespace {

// What the weights are, and so which kernels run: float32 (activations float32), bfloat16
// (activations bfloat16, attention computed in float32) or GGUF blocks (activations float32).
enum class Weights : int64_t { kFloat32 = 0, kBFloat16 = 1, kGGUF = 2 };

// The kernel a linear runs: kernels/linear.py's routes (PLAIN .. BF16_TILES), same numbers
enum Route : int64_t { kPlain = 0, kGemv, kBf16Gemv, kMklPacked, kOneDNN, kBf16Tiles };

struct Linear {
  at::Tensor weight;  // [N, K] float32 / bfloat16, or GGUF blocks [N, row bytes]
  c10::optional<at::Tensor> bias;
  int64_t qtype;  // the GGUF block type; unused otherwise
  c10::optional<at::Tensor> packed;  // kernels/linear.py's pack_weight(weight); not GGUF
};

// One group of the step's attention (kernels/attention_metadata.py's _GroupPlan), with the
// tensors its compiled kernel reads. A decode group: `tables` and `kv_lens` of its sequences,
// and unless it is the whole step (`rows` undefined), `rows` (its packed token per sequence,
// q_index[:, 0]) and `out_tokens` (where its results go). A group of prompt chunks:
// prefill_args (tables, q_start, q_lens, kv_lens); its kernel writes its own rows.
struct Group {
  bool decode;
  at::Tensor tables, kv_lens, rows, out_tokens, q_start, q_lens;
};

Group make_group(int64_t kind, const std::vector<at::Tensor>& t) {
  TORCH_CHECK(kind == 0 || kind == 1, "DecodeLoop.run: a group is a decode (0) or prompts (1)");
  if (kind == 0) {
    TORCH_CHECK(t.size() == 2 || t.size() == 4,
                "DecodeLoop.run: a decode group is (tables, kv_lens[, rows, out_tokens])");
    Group g{true, t[0], t[1]};
    if (t.size() == 4) g.rows = t[2], g.out_tokens = t[3];
    return g;
  }
  TORCH_CHECK(t.size() == 4, "DecodeLoop.run: a prompt group is (tables, q_start, q_lens, kv_lens)");
  Group g{false, t[0], t[3]};
  g.q_start = t[1], g.q_lens = t[2];
  return g;
}

struct Layer {
  Linear qkv, o, gate_up, down;
  at::Tensor input_norm, post_norm;  // RMSNorm weights [hidden]
};

class DecodeLoop {
 public:
  // Per layer, in this order: the weights of qkv, o, gate_up, down (float or GGUF blocks),
  // then the input and post-attention RMSNorm weights: 6 tensors. `biases`, `qtypes` and
  // `packed` (the packed weights; None for GGUF blocks): 4 per layer, in the linears' order.
  DecodeLoop(int64_t weights, const std::vector<at::Tensor>& tensors,
             const std::vector<c10::optional<at::Tensor>>& biases,
             const std::vector<int64_t>& qtypes,
             const std::vector<c10::optional<at::Tensor>>& packed, double eps, int64_t q_size,
             int64_t kv_size, double scale)
      : weights_(static_cast<Weights>(weights)),
        eps_(eps),
        q_size_(q_size),
        kv_size_(kv_size),
        scale_(scale) {
    TORCH_CHECK(weights >= 0 && weights <= 2, "DecodeLoop: unknown weights kind ", weights);
    const size_t n = tensors.size() / 6;
    TORCH_CHECK(tensors.size() == 6 * n && biases.size() == 4 * n && qtypes.size() == 4 * n &&
                    packed.size() == 4 * n,
                "DecodeLoop: 6 tensors, 4 biases, 4 qtypes and 4 packed weights per layer");
    for (size_t i = 0; i < n; ++i) {
      auto linear = [&](size_t j) {
        return Linear{tensors[6 * i + j], biases[4 * i + j], qtypes[4 * i + j],
                      packed[4 * i + j]};
      };
      layers_.push_back(
          Layer{linear(0), linear(1), linear(2), linear(3), tensors[6 * i + 4], tensors[6 * i + 5]});
    }
  }

  // hidden [T, hidden] (the embeddings), cos/sin [T, head_dim], slot_mapping [T]; the step's
  // attention groups, in the metadata's order (`group_kinds` 0 decode, 1 prompt chunks, and
  // each group's tensors: see Group); the caches of every layer; the route of each of qkv, o,
  // gate_up and down at this step (the same in every layer; ignored for GGUF blocks).
  // `kept` (empty, or rows [S] int64, tables [S, blocks] and kv_lens [S] int32: context.py's
  // KeptRows) runs the last layer on those rows alone once every row's K and V are cached:
  // their queries attend as one-token decodes, `kept_routes` and `kept_padded` serve their
  // linears; with no row kept, the last layer stops once its K and V are cached. Returns
  // (hidden states, residual stream) after the last layer, of every row or of the kept rows:
  // the final norm adds them.
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& hidden, const at::Tensor& cos,
                                         const at::Tensor& sin, const at::Tensor& slot_mapping,
                                         const std::vector<int64_t>& group_kinds,
                                         const std::vector<std::vector<at::Tensor>>& group_tensors,
                                         std::vector<at::Tensor> k_caches,
                                         std::vector<at::Tensor> v_caches,
                                         const std::vector<int64_t>& routes,
                                         int64_t padded_rows, const std::vector<at::Tensor>& kept,
                                         const std::vector<int64_t>& kept_routes,
                                         int64_t kept_padded) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "DecodeLoop.run: one k and one v cache per layer");
    TORCH_CHECK(!group_kinds.empty() && group_kinds.size() == group_tensors.size(),
                "DecodeLoop.run: one kind and one list of tensors per attention group");
    std::vector<Group> groups;
    for (size_t g = 0; g < group_kinds.size(); ++g) {
      groups.push_back(make_group(group_kinds[g], group_tensors[g]));
    }
    TORCH_CHECK(routes.size() == 4, "DecodeLoop.run: one route for each of the 4 linears");
    TORCH_CHECK(kept.empty() || (kept.size() == 3 && kept_routes.size() == 4 &&
                                 kept_padded >= kept[0].size(0)),
                "DecodeLoop.run: kept is (rows, tables, kv_lens) with 4 routes and its padded rows");
    for (const int64_t r : routes) {
      TORCH_CHECK(r >= kPlain && r <= kBf16Tiles, "DecodeLoop.run: unknown route ", r);
    }
    const int64_t rows = hidden.size(0);
    TORCH_CHECK(padded_rows >= rows, "DecodeLoop.run: padded_rows below the step's rows");
    // kernels/linear.py's `padded_rows`: the linears run on `padded_rows` rows (zeros past the
    // step's), every row-wise op with them; rotary, the cache write and attention take the
    // step's rows only, and the pad rows of attention's output are zeros
    at::Tensor h = pad(hidden, padded_rows), residual, normed;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      if (i == 0) {
        normed = std::get<0>(norm(h, layer.input_norm, c10::nullopt));
        residual = h;
      } else {
        std::tie(normed, residual) = norm(h, layer.input_norm, residual);
      }
      const at::Tensor qkv = apply(layer.qkv, normed, routes[0]).narrow(0, 0, rows);
      const at::Tensor q = qkv.narrow(1, 0, q_size_);
      const at::Tensor k = qkv.narrow(1, q_size_, kv_size_);
      const at::Tensor v = qkv.narrow(1, q_size_ + kv_size_, kv_size_);
      if (!kept.empty() && i + 1 == layers_.size()) {
        const int64_t num_kept = kept[0].size(0);
        const at::Tensor rotated =
            rotate_fill(q, k, v, cos, sin, k_caches[i], v_caches[i], slot_mapping);
        if (num_kept == 0) {  // as the modules: the layer's input rows, none of them
          const at::Tensor none = residual.narrow(0, 0, 0);
          return {none, none};
        }
        const at::Tensor qd = rotated.index_select(0, kept[0]).contiguous();
        const at::Tensor attn = decode(qd, k_caches[i], v_caches[i], kept[1], kept[2]);
        residual = pad(residual.index_select(0, kept[0]), kept_padded);
        h = mlp_block(layer, pad(attn.view({num_kept, -1}), kept_padded), residual, kept_routes);
        return {h.narrow(0, 0, num_kept), residual.narrow(0, 0, num_kept)};
      }
      const at::Tensor attn = attend(q, k, v, cos, sin, k_caches[i], v_caches[i], slot_mapping,
                                     groups, padded_rows);
      h = mlp_block(layer, attn.view({padded_rows, -1}), residual, routes);
    }
    return {h.narrow(0, 0, rows), residual.narrow(0, 0, rows)};
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  bool bf16() const { return weights_ == Weights::kBFloat16; }

  // kernels/linear.py's `linear` along `route` (GGUF blocks: their GEMV)
  at::Tensor apply(const Linear& linear, const at::Tensor& x, int64_t route) const {
    if (weights_ == Weights::kGGUF) return gguf_gemv(x, linear.weight, linear.qtype, linear.bias);
    const bool has_packed = linear.packed.has_value();
    switch (route) {
      case kPlain:
        return bf16() ? bf16_linear_rows(x, linear.weight, linear.bias)
                      : at::linear(x, linear.weight, linear.bias);
      case kGemv:
        return gemv(x.contiguous(), linear.weight, linear.bias);
      case kBf16Gemv:
        return bf16_gemv(x.contiguous(), linear.weight, linear.bias);
      case kMklPacked:
        TORCH_CHECK(has_packed, "DecodeLoop: no packed weight");
        return sgemm_packed_linear(x.contiguous(), *linear.packed, linear.weight, linear.bias);
      case kOneDNN:
        TORCH_CHECK(has_packed, "DecodeLoop: no packed weight");
        return bf16() ? bf16_onednn_linear_rows(x, *linear.packed, linear.weight.size(0),
                                                linear.bias)
                      : onednn_linear(x, *linear.packed, linear.bias);
      case kBf16Tiles:
        TORCH_CHECK(has_packed, "DecodeLoop: no packed weight");
        return bf16_vnni_linear(x, *linear.packed, linear.weight.size(0), linear.bias);
    }
    TORCH_CHECK(false, "DecodeLoop: unknown route ", route);
  }

  // o projection, the residual add and post-attention norm, then the MLP: the layer after
  // attention. `residual` is updated; returns the MLP's output.
  at::Tensor mlp_block(const Layer& layer, const at::Tensor& attn, at::Tensor& residual,
                       const std::vector<int64_t>& routes) const {
    const at::Tensor o = apply(layer.o, attn, routes[1]);
    at::Tensor normed;
    std::tie(normed, residual) = norm(o, layer.post_norm, residual);
    at::Tensor act;
    {  // NOTE: gate_up freed before down runs, as in the modules: its memory serves down's output
      const at::Tensor gate_up = apply(layer.gate_up, normed, routes[2]);
      act = bf16() ? bf16_silu_mul(gate_up) : silu_mul(gate_up);
    }
    return apply(layer.down, act, routes[3]);
  }

  // `x` [rows, ...] with zero rows up to `padded` rows
  static at::Tensor pad(const at::Tensor& x, int64_t padded) {
    if (padded == x.size(0)) return x;
    at::Tensor out = at::zeros({padded, x.size(1)}, x.options());
    out.narrow(0, 0, x.size(0)).copy_(x);
    return out;
  }

  std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x, const at::Tensor& weight,
                                          const c10::optional<at::Tensor>& residual) const {
    return bf16() ? bf16_rms_norm(x, weight, eps_, residual) : rms_norm(x, weight, eps_, residual);
  }

  // rotary on q and k fused with the cache write, then each group's attention over the cache:
  // as PagedAttentionMixin.paged_attend and paged_attention_cpu do it with the compiled kernels.
  // Returns [padded_rows, heads, head_dim]: the step's rows, then zeros.
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    const std::vector<Group>& groups, int64_t padded_rows) const {
    const at::Tensor rotated = rotate_fill(q, k, v, cos, sin, k_cache, v_cache, slot_mapping);
    const int64_t rows = rotated.size(0);
    at::Tensor out, step_out;  // [padded_rows, heads, head_dim] and its first `rows`
    auto outputs = [&]() -> at::Tensor& {
      if (!out.defined()) {
        out = at::empty({padded_rows, rotated.size(1), rotated.size(2)}, rotated.options());
        if (padded_rows > rows) out.narrow(0, rows, padded_rows - rows).zero_();
        step_out = out.narrow(0, 0, rows);
      }
      return step_out;
    };
    for (const Group& g : groups) {
      if (g.decode) {
        const bool whole = !g.rows.defined();
        const at::Tensor qd = whole ? rotated : rotated.index_select(0, g.rows).contiguous();
        at::Tensor res = decode(qd, k_cache, v_cache, g.tables, g.kv_lens);
        if (whole && padded_rows == rows) return res;
        if (whole) {
          outputs().copy_(res);
        } else {
          outputs().index_put_({g.out_tokens}, res);
        }
        continue;
      }
      if (bf16()) {
        paged_prefill_attention_bf16(rotated, k_cache, v_cache, g.tables, g.q_start, g.q_lens,
                                     g.kv_lens, scale_, outputs(), c10::nullopt);
      } else {
        paged_prefill_attention(rotated, k_cache, v_cache, g.tables, g.q_start, g.q_lens,
                                g.kv_lens, scale_, outputs(), c10::nullopt);
      }
    }
    return out;
  }

  // rotary on q and k fused with the cache write: rotated q [T, heads, head_dim]
  at::Tensor rotate_fill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                         at::Tensor& v_cache, const at::Tensor& slot_mapping) const {
    return bf16() ? rotary_fill_kv_bf16(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
                  : rotary_fill_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping);
  }

  // one-token queries qd [n, heads, head_dim] over the cache (paged_attention_cpu's kernel)
  at::Tensor decode(const at::Tensor& qd, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& tables, const at::Tensor& kv_lens) const {
    return bf16() ? paged_decode_attention_bf16(qd, k_cache, v_cache, tables, kv_lens, scale_, 0,
                                                0.0, c10::nullopt)
                  : paged_decode_attention(qd, k_cache, v_cache, tables, kv_lens, scale_, 0, 0.0,
                                           c10::nullopt);
  }

  Weights weights_;
  double eps_;
  int64_t q_size_, kv_size_;
  double scale_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_decode_loop_ops(py::module& m) {
  py::class_<DecodeLoop>(m, "DecodeLoop",
                         "the decoder layers of a Llama-shaped model at one step, in one call "
                         "(models/decode_loop.py builds it)")
      .def(py::init<int64_t, const std::vector<at::Tensor>&,
                    const std::vector<c10::optional<at::Tensor>>&, const std::vector<int64_t>&,
                    const std::vector<c10::optional<at::Tensor>>&, double, int64_t, int64_t,
                    double>(),
           py::arg("weights"), py::arg("tensors"), py::arg("biases"), py::arg("qtypes"),
           py::arg("packed"), py::arg("eps"), py::arg("q_size"), py::arg("kv_size"),
           py::arg("scale"))
      .def("run", &DecodeLoop::run, release_gil(), py::arg("hidden"), py::arg("cos"),
           py::arg("sin"), py::arg("slot_mapping"), py::arg("group_kinds"),
           py::arg("group_tensors"), py::arg("k_caches"), py::arg("v_caches"), py::arg("routes"),
           py::arg("padded_rows"), py::arg("kept"), py::arg("kept_routes"),
           py::arg("kept_padded"))
      .def_property_readonly("num_layers", &DecodeLoop::num_layers);
}
