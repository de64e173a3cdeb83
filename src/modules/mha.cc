// mha.cc — MultiheadAttention's forward: in-projection, attention over strided head views (the
// layouts of attention_block.h, which the decoders' blocks read too; the module's softmax or linear
// attention: mha_attention.cc), out-projection (its parameters, state and pruning: mha_params.cc).
//
// Follows torch.nn.functional.multi_head_attention_forward step by step; the comments name
// the step. Inputs are projected in their own row order ([L, N] or [N, L]); heads are strided
// views [N, H, L, hd] of the projection output (no transpose copies), and SDPA writes straight
// into the [rows, E] buffer that the out-projection reads.
#include "heads/mha.h"

#include <array>
#include <cmath>
#include <limits>

#include "heads/ops.h"
#include "heads/runtime.h"
#include "heads/sdpa.h"
#include "modules/attention_block.h"
#include "modules/common.h"
#include "modules/mha_attention.h"

namespace heads {

using modules::as3;
using modules::find;
using modules::MhaHeads;
using modules::MhaInputs;
using modules::PackedWeights;
using modules::project;
using modules::rows;
using modules::split_heads;
using modules::kMhaOp;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Bool mask (true = masked out) -> 0 / -inf; float mask -> f32 copy. Contiguous result.
Tensor additive_mask(const Tensor& m, const char* name) {
  HEADS_CHECK(m.dtype() == DType::Bool || is_floating(m.dtype()), kMhaOp, ": ", name,
              ": only bool and floating masks are supported, got ", dtype_name(m.dtype()));
  if (m.dtype() != DType::Bool) return m.to(DType::F32);
  const Tensor b = m.contiguous();
  Tensor f = Tensor::empty(b.shape(), DType::F32);
  const auto* src = static_cast<const uint8_t*>(b.raw_data());
  float* dst = f.data<float>();
  for (int64_t i = 0; i < b.numel(); ++i) dst[i] = src[i] ? kNegInf : 0.0f;
  return f;
}
}  // namespace

namespace {

// _mha_shape_check, and the masks of _canonical_mask.
MhaInputs check_inputs(const MultiheadAttentionOptions& o, const Tensor& query, const Tensor& key,
                       const Tensor& value, const MhaForwardArgs& args) {
  const int64_t E = o.embed_dim, H = o.num_heads;
  HEADS_CHECK(query.defined() && key.defined() && value.defined(), kMhaOp, ": query, key and value are required");
  HEADS_CHECK(query.dim() == 2 || query.dim() == 3, kMhaOp,
              ": query should be unbatched 2-D or batched 3-D, got ", query.shape());
  MhaInputs in;
  in.batched = query.dim() == 3;
  in.batch_first = in.batched && o.batch_first;
  HEADS_CHECK(key.dim() == query.dim() && value.dim() == query.dim(), kMhaOp, ": for ",
              in.batched ? "batched (3-D)" : "unbatched (2-D)", " query ", query.shape(),
              ", expected key and value of the same rank, got key ", key.shape(), " and value ",
              value.shape());
  for (const auto& [t, name] : {std::pair{&query, "query"}, {&key, "key"}, {&value, "value"}}) {
    HEADS_CHECK(is_floating(t->dtype()), kMhaOp, ": ", name, ": expected a floating dtype, got ",
                dtype_name(t->dtype()));
  }
  const Tensor& kpm = args.key_padding_mask;
  const Tensor& am = args.attn_mask;
  if (kpm.defined()) {
    HEADS_CHECK(kpm.dim() == (in.batched ? 2 : 1), kMhaOp, ": key_padding_mask: expected ",
                in.batched ? "[N, S]" : "[S]", " for query ", query.shape(), ", got ", kpm.shape());
  }
  if (am.defined()) {
    HEADS_CHECK(am.dim() == 2 || am.dim() == 3, kMhaOp,
                ": attn_mask: expected 2-D [L, S] or 3-D [N * num_heads, L, S], got ", am.shape());
  }
  auto native = [&](const Tensor& x) {  // [d0, d1, width] with rows in memory order
    Tensor t = x.to(DType::F32);
    return in.batched ? t : t.unsqueeze(1);  // unbatched [L, E] -> [L, 1, E]
  };
  in.xq = native(query);
  in.self_attn = query.raw_data() == key.raw_data() && key.raw_data() == value.raw_data() &&
                 query.shape() == key.shape() && key.shape() == value.shape() &&
                 query.strides() == key.strides() && key.strides() == value.strides() &&
                 query.dtype() == key.dtype() && key.dtype() == value.dtype();
  in.xk = in.self_attn ? in.xq : native(key);
  in.xv = in.self_attn ? in.xq : native(value);
  const Shape qs = in.nle(in.xq).shape(), ks = in.nle(in.xk).shape(), vs = in.nle(in.xv).shape();
  in.N = qs[0], in.L = qs[1], in.S = ks[1];
  HEADS_CHECK(qs[2] == E, kMhaOp, ": query: expected embed_dim ", E, " in the last dim, got ", query.shape());
  HEADS_CHECK(ks[2] == o.kdim, kMhaOp, ": key: expected kdim ", o.kdim, " in the last dim, got ", key.shape());
  HEADS_CHECK(vs[2] == o.vdim, kMhaOp, ": value: expected vdim ", o.vdim, " in the last dim, got ", value.shape());
  HEADS_CHECK(ks[0] == in.N && vs[0] == in.N, kMhaOp, ": key ", key.shape(), " and value ", value.shape(),
              " must have the batch size of query ", query.shape());
  HEADS_CHECK(vs[1] == in.S, kMhaOp, ": key ", key.shape(), " and value ", value.shape(),
              " must have the same sequence length");
  if (kpm.defined()) {
    const Shape want = in.batched ? Shape{in.N, in.S} : Shape{in.S};
    HEADS_CHECK(kpm.shape() == want, kMhaOp, ": key_padding_mask: expected ", want, ", got ", kpm.shape());
  }
  if (am.defined()) {
    const Shape want = am.dim() == 2 ? Shape{in.L, in.S} : Shape{in.N * H, in.L, in.S};
    HEADS_CHECK(am.shape() == want, kMhaOp, ": attn_mask: expected ", want,
                am.dim() == 3 ? " ([N * num_heads, L, S])" : " ([L, S])", ", got ", am.shape());
  }
  in.kpm = kpm.defined() ? additive_mask(kpm, "key_padding_mask") : Tensor();
  in.am = am.defined() ? additive_mask(am, "attn_mask") : Tensor();
  return in;
}

// Attention weights [N, H, L, S2] averaged over the heads: [N, L, S2].
Tensor average_heads(const Tensor& weights) {
  const int64_t N = weights.size(0), H = weights.size(1), LS = weights.size(2) * weights.size(3);
  Tensor avg = Tensor::zeros({N, weights.size(2), weights.size(3)}, DType::F32);
  const float* w = weights.data<float>();
  float* a = avg.data<float>();
  const float inv_h = 1.0f / static_cast<float>(H);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t x = 0; x < LS; ++x) a[n * LS + x] += w[(n * H + h) * LS + x];
    }
    for (int64_t x = 0; x < LS; ++x) a[n * LS + x] *= inv_h;
  }
  return avg;
}

// _in_projection_packed / _in_projection: q = x Wqᵀ + bq, ... read as heads [N, H, T, hd]; one GEMM
// for self-attention with the packed weight w_in [3E, E] (else w[0..2] are q/k/v_proj_weight).
// With `packed` (reduced precision), the weights come from there, and q, k, v are in `act`.
modules::QkvViews in_projection(const MhaInputs& in, int64_t H, int64_t hd, const Tensor* w_in, const Tensor* b_in,
                                const std::array<const Tensor*, 3>& w, const PackedWeights* packed, DType act) {
  const int64_t Ei = H * hd;
  static const char* const kParts[3] = {"q_proj_weight", "k_proj_weight", "v_proj_weight"};
  const PackedLinear* p_in = packed && w_in ? packed->find("in_proj_weight") : nullptr;
  auto weight = [&](int64_t part) { return w_in ? w_in->slice(0, part * Ei, part * Ei + Ei) : *w[part]; };
  auto bias = [&](int64_t part) { return b_in ? b_in->slice(0, part * Ei, part * Ei + Ei) : Tensor(); };
  auto proj = [&](const Tensor& x, int64_t part) {
    const PackedLinear* pp = p_in ? packed->part("in_proj_weight", part, 3) : packed ? packed->find(kParts[part]) : nullptr;
    return split_heads(in.nle(as3(project(rows(x), weight(part), bias(part), pp, act), x)), H);
  };
  if (in.self_attn && w_in) {
    const Tensor y = in.nle(as3(project(rows(in.xq), *w_in, b_in ? *b_in : Tensor(), p_in, act), in.xq));
    return modules::fused_qkv_views(y, H, H, hd);
  }
  return {proj(in.xq, 0), proj(in.xk, 1), proj(in.xv, 2)};
}

// add_bias_kv appends bias_k / bias_v ([1, 1, E]) as one more key; add_zero_attn a zero key.
void append_keys(Tensor& k4, Tensor& v4, const Tensor* bias_k, const Tensor* bias_v, bool zero_attn) {
  const int64_t extra = (bias_k ? 1 : 0) + (zero_attn ? 1 : 0);
  if (extra == 0) return;
  const int64_t N = k4.size(0), H = k4.size(1), S = k4.size(2), hd = k4.size(3);
  Tensor k2 = Tensor::zeros({N, H, S + extra, hd}, k4.dtype());
  Tensor v2 = Tensor::zeros({N, H, S + extra, hd}, v4.dtype());
  k2.slice(2, 0, S).copy_from(k4);
  v2.slice(2, 0, S).copy_from(v4);
  if (bias_k) {
    k2.slice(2, S, S + 1).copy_from(bias_k->reshape({1, H, 1, hd}).expand({N, H, 1, hd}));
    v2.slice(2, S, S + 1).copy_from(bias_v->reshape({1, H, 1, hd}).expand({N, H, 1, hd}));
  }
  k4 = k2;
  v4 = v2;
}

// The gates' input: each batch entry's first query token, or the mean of its tokens: [N, E] f32.
Tensor gate_input(const MhaInputs& in, HeadGate kind) {
  const Tensor x = in.nle(in.xq);  // [N, L, E]
  const int64_t N = x.size(0), L = x.size(1), E = x.size(2);
  Tensor p = Tensor::zeros({N, E}, DType::F32);
  float* pp = p.data<float>();
  const float* xp = x.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t n_rows = kind == HeadGate::FirstToken ? std::min<int64_t>(L, 1) : L;
    for (int64_t l = 0; l < n_rows; ++l) {
      const float* row = xp + n * x.stride(0) + l * x.stride(1);
      for (int64_t c = 0; c < E; ++c) pp[n * E + c] += row[c * x.stride(2)];
    }
    if (kind == HeadGate::MeanPool && L > 0) {
      for (int64_t c = 0; c < E; ++c) pp[n * E + c] /= static_cast<float>(L);
    }
  }
  return p;
}

// attn3 ([d0, d1, H·hd], rows in the input's order) times each (batch entry, head)'s gate, in f32.
Tensor apply_gates(const Tensor& attn3, const Tensor& gates, bool batch_first) {
  Tensor y = attn3.to(DType::F32).clone();
  const int64_t d0 = y.size(0), d1 = y.size(1), W = y.size(2), H = gates.size(1), hd = W / H;
  float* yp = y.data<float>();
  const float* g = gates.data<float>();
  for (int64_t a = 0; a < d0; ++a) {
    for (int64_t b = 0; b < d1; ++b) {
      const int64_t n = batch_first ? a : b;
      float* row = yp + (a * d1 + b) * W;
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t c = 0; c < hd; ++c) row[h * hd + c] *= g[n * H + h];
      }
    }
  }
  return y;
}

// A call's head gates: sigmoid(gate_input · Wᵀ + b) [N, H]; `used` are those applied (heads below
// the threshold at 0, and off in `head_mask`, when skipping is allowed).
struct Gates {
  Tensor input, gates, used, head_mask;
};

Gates compute_gates(const MhaInputs& in, const AttentionVariant& var, const Tensor& w, const Tensor& b, bool skip) {
  // (in: xq, batched and batch_first are read)
  Gates g;
  if (var.head_gate == HeadGate::None) return g;
  g.input = gate_input(in, var.head_gate);
  g.gates = linear(g.input, w, b);
  float* gp = g.gates.data<float>();
  for (int64_t x = 0; x < g.gates.numel(); ++x) gp[x] = 1.0f / (1.0f + std::exp(-gp[x]));
  g.used = g.gates;
  if (skip && var.gate_threshold > 0.0) {
    g.used = g.gates.clone();
    g.head_mask = Tensor::empty(g.gates.shape(), DType::Bool);
    auto* on = static_cast<uint8_t*>(g.head_mask.raw_data());
    float* gu = g.used.data<float>();
    for (int64_t x = 0; x < g.gates.numel(); ++x) {
      on[x] = gu[x] >= var.gate_threshold;
      if (!on[x]) gu[x] = 0.0f;
    }
  }
  return g;
}

}  // namespace

Tensor MultiheadAttention::head_gates(const Tensor& query) const {
  if (opt_.variant.head_gate == HeadGate::None) return Tensor();
  HEADS_CHECK(query.defined() && (query.dim() == 2 || query.dim() == 3) && query.size(-1) == opt_.embed_dim &&
                  is_floating(query.dtype()),
              kMhaOp, "::head_gates: query: expected a floating [L, N, E] ([N, L, E] with batch_first) or [L, E] with E = ",
              opt_.embed_dim, ", got ", query.defined() ? query.shape() : Shape{});
  MhaInputs in{};
  in.batched = query.dim() == 3;
  in.batch_first = in.batched && opt_.batch_first;
  in.xq = in.batched ? query.to(DType::F32) : query.to(DType::F32).unsqueeze(1);
  const Tensor g = compute_gates(in, opt_.variant, *param("head_gate.weight"), *param("head_gate.bias"), false).gates;
  return in.batched ? g : g.squeeze(0);
}

std::pair<Tensor, Tensor> MultiheadAttention::forward(const Tensor& query, const Tensor& key,
                                                      const Tensor& value,
                                                      const MhaForwardArgs& args) const {
  const int64_t H = opt_.num_heads, Ei = H * opt_.head_dim;
  const AttentionVariant& var = opt_.variant;
  const MhaInputs in = check_inputs(opt_, query, key, value, args);
  attention_->check_call(args);
  HEADS_CHECK(!(args.is_causal && var.head_gate == HeadGate::MeanPool), kMhaOp,
              ": head_gate mean pools every query token, which a causal call must not see; use head_gate first");

  const PackedWeights* packed = args.tape == nullptr ? packed_.get() : nullptr;  // training runs in f32
  // q, k, v and the attention output in the attention's dtype for the precision (bf16 in a bf16 model
  // with softmax attention: the projections round their f32 sums once), else f32.
  const DType act = packed != nullptr ? attention_->activations(packed->precision) : DType::F32;
  const auto [q4, k4, v4] =
      in_projection(in, H, opt_.head_dim, param("in_proj_weight"), param("in_proj_bias"),
                    {param("q_proj_weight"), param("k_proj_weight"), param("v_proj_weight")}, packed, act);
  MhaHeads h{q4, k4, v4, Tensor{}, Tensor{}};
  append_keys(h.k4, h.v4, param("bias_k"), param("bias_v"), opt_.add_zero_attn);

  // Head gates; in eval mode without a tape, heads below the threshold are skipped (gate 0).
  const Gates g = var.head_gate == HeadGate::None
                      ? Gates{}
                      : compute_gates(in, var, *param("head_gate.weight"), *param("head_gate.bias"),
                                      !training_ && args.tape == nullptr);
  h.head_mask = g.head_mask;

  // Attention, written into the [rows, H·hd] buffer in the query's memory order.
  Tensor attn3 = Tensor::empty({in.xq.size(0), in.xq.size(1), Ei}, act);
  h.out4 = split_heads(in.nle(attn3), H);
  if (args.tape != nullptr) {  // the attention's part of the tape, which attend() fills
    args.tape->sdpa = SdpaOptions{};
    args.tape->attention = SdpaResult{};
    args.tape->linear = false;
    args.tape->linear_options = LinearAttentionOptions{};
  }
  const SdpaResult r = attention_->attend(in, args, h, training_ ? opt_.dropout : 0.0, args.tape);

  // Out-projection (of the gated heads, with gates).
  const Tensor gated = g.gates.defined() ? apply_gates(attn3, g.used, in.batch_first) : Tensor();
  const Tensor* b_out = param("out_proj.bias");
  const Tensor& proj_in = gated.defined() ? gated : attn3;
  Tensor out = as3(project(rows(proj_in), *param("out_proj.weight"), b_out ? *b_out : Tensor(),
                           packed ? packed->find("out_proj.weight") : nullptr),
                   proj_in);
  if (!in.batched) out = out.squeeze(1);

  if (args.tape != nullptr) {
    MhaTape& t = *args.tape;
    t.batched = in.batched;
    t.self_attn = in.self_attn;
    t.query_shape = query.shape();
    t.key_shape = key.shape();
    t.value_shape = value.shape();
    t.xq = in.xq;
    t.xk = in.xk;
    t.xv = in.xv;
    t.q4 = h.q4;
    t.k4 = h.k4;
    t.v4 = h.v4;
    t.attn3 = attn3;
    t.gate_in = g.input;
    t.gates = g.gates;
    t.gated = gated;
    t.out_shape = out.shape();
  }

  Tensor weights;
  if (args.need_weights) {
    weights = args.average_attn_weights ? average_heads(r.weights) : r.weights;  // [N, (H,) L, S2]
    if (!in.batched) weights = weights.squeeze(0);
  }
  return {out, weights};
}

}  // namespace heads
