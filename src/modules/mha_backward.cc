// mha_backward.cc — MultiheadAttention::backward: the forward's steps (mha.cc) in reverse, each
// from what the forward kept on its tape.
//   out = attn Woᵀ + bo               ->  dWo, dbo, d(attn)
//   attn = SDPA(q, k, v) (+ appended)  ->  dq, dk, dv (and dbias_k, dbias_v)
//   q, k, v = x W{q,k,v}ᵀ + b          ->  dW_in / dW{q,k,v}, db_in, d(query), d(key), d(value)
// The gradient buffers of the projections are in each input's row order; the SDPA backward writes
// dq, dk, dv into them through head views, as the forward wrote its output.
#include "heads/mha.h"

#include <array>
#include <map>
#include <string>
#include <vector>

#include "heads/ops.h"
#include "heads/sdpa.h"
#include "modules/attention_block.h"
#include "modules/common.h"
#include "modules/mha_attention.h"

namespace heads {

using modules::rows;
using modules::split_heads;
using modules::kMhaOp;

namespace {


using Grads = std::map<std::string, Tensor>;  // parameter gradients by name

// dq3, dk3, dv3 ([d0, d1, E] in the inputs' row order) from d(attn) through the module's attention
// backward. Keys appended by add_bias_kv / add_zero_attn need rows of their own: then the gradients
// go through a temporary, bias_k / bias_v (key S of every batch entry) get theirs summed over N, and
// the appended keys' rows are dropped.
void attention_backward(const modules::MhaAttention& attention, const MhaTape& t, const Tensor& dattn4,
                        bool batch_first, bool bias_kv, const Tensor& dq3, const Tensor& dk3, const Tensor& dv3,
                        Grads& pg) {
  const int64_t N = t.q4.size(0), H = t.q4.size(1), hd = t.q4.size(3);
  const int64_t S = t.xk.size(batch_first ? 1 : 0);
  auto nle = [&](const Tensor& x3) { return batch_first ? x3 : x3.transpose(0, 1); };
  if (t.k4.size(2) == S) {
    attention.backward(t, dattn4, split_heads(nle(dq3), H), split_heads(nle(dk3), H), split_heads(nle(dv3), H));
    return;
  }
  SdpaGrads gs;
  gs.dq = Tensor::empty(t.q4.shape(), DType::F32);
  gs.dk = Tensor::empty({N, H, t.k4.size(2), hd}, DType::F32);
  gs.dv = Tensor::empty({N, H, t.v4.size(2), t.v4.size(3)}, DType::F32);
  attention.backward(t, dattn4, gs.dq, gs.dk, gs.dv);
  if (bias_kv && t.k4.size(2) > S) {
    for (const auto& [g, name] : {std::pair{&gs.dk, "bias_k"}, {&gs.dv, "bias_v"}}) {
      Tensor d = Tensor::zeros({1, 1, H * hd}, DType::F32);
      float* dp = d.data<float>();
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t h = 0; h < H; ++h) {
          const float* src = g->data<float>() + ((n * H + h) * g->size(2) + S) * hd;
          for (int64_t c = 0; c < hd; ++c) dp[h * hd + c] += src[c];
        }
      }
      pg[name] = d;
    }
  }
  split_heads(nle(dq3), H).copy_from(gs.dq);
  split_heads(nle(dk3), H).copy_from(gs.dk.slice(2, 0, S));
  split_heads(nle(dv3), H).copy_from(gs.dv.slice(2, 0, S));
}

// d(input) in the input's own shape from a [rows, width] gradient.
Tensor as_input(const Tensor& dx2, const Tensor& x3, const Shape& shape) { return dx2.reshape(x3.shape()).reshape(shape); }

// The in-projection's three GEMMs (q/k/v_proj_weight, or the three slices of in_proj_weight when
// query, key and value differ).
void in_projection_backward(const MhaTape& t, int64_t Ei, const Tensor* w_in, const Tensor* b_in,
                            const std::array<const Tensor*, 3>& w, const std::array<Tensor, 3>& dys,
                            MhaGrads& out, Grads& pg) {
  static const char* names[3] = {"q_proj_weight", "k_proj_weight", "v_proj_weight"};
  Tensor dw_in = w_in ? Tensor::empty(w_in->shape(), DType::F32) : Tensor();
  Tensor db_in = b_in ? Tensor::empty({3 * Ei}, DType::F32) : Tensor();
  const Tensor* xs[3] = {&t.xq, &t.xk, &t.xv};
  const Shape* shapes[3] = {&t.query_shape, &t.key_shape, &t.value_shape};
  Tensor* dxs[3] = {&out.dquery, &out.dkey, &out.dvalue};
  for (int64_t part = 0; part < 3; ++part) {
    const Tensor wp = w_in ? w_in->slice(0, part * Ei, (part + 1) * Ei) : *w[part];
    const LinearGrads g = linear_backward(rows(dys[part]), rows(*xs[part]), wp, b_in != nullptr);
    *dxs[part] = as_input(g.dx, *xs[part], *shapes[part]);
    if (w_in) {
      dw_in.slice(0, part * Ei, (part + 1) * Ei).copy_from(g.dweight);
    } else {
      pg[names[part]] = g.dweight;
    }
    if (b_in) db_in.slice(0, part * Ei, (part + 1) * Ei).copy_from(g.dbias);
  }
  if (w_in) pg["in_proj_weight"] = dw_in;
  if (b_in) pg["in_proj_bias"] = db_in;
}

// Head gates: the out-projection's input was attn3 · g. Turns dattn3 (d(gated)) into d(attn3) in
// place and returns d(loss)/d(logit) = Σ d(gated) · attn3 · g (1 - g) per (batch entry, head).
Tensor gates_backward(const MhaTape& t, const Tensor& dattn3, bool batch_first) {
  const int64_t d0 = dattn3.size(0), d1 = dattn3.size(1), W = dattn3.size(2);
  const int64_t N = t.gates.size(0), H = t.gates.size(1), hd = W / H;
  const Tensor a = t.attn3.to(DType::F32).contiguous();
  std::vector<double> dg(static_cast<size_t>(N * H), 0.0);
  float* dp = dattn3.data<float>();
  const float* ap = a.data<float>();
  const float* g = t.gates.data<float>();
  for (int64_t x = 0; x < d0; ++x) {
    for (int64_t y = 0; y < d1; ++y) {
      const int64_t n = batch_first ? x : y, off = (x * d1 + y) * W;
      for (int64_t h = 0; h < H; ++h) {
        double acc = 0.0;
        for (int64_t c = h * hd; c < (h + 1) * hd; ++c) {
          acc += static_cast<double>(dp[off + c]) * ap[off + c];
          dp[off + c] *= g[n * H + h];
        }
        dg[static_cast<size_t>(n * H + h)] += acc;
      }
    }
  }
  Tensor dz = Tensor::empty({N, H}, DType::F32);
  for (int64_t e = 0; e < N * H; ++e) dz.data<float>()[e] = static_cast<float>(dg[static_cast<size_t>(e)] * g[e] * (1.0 - g[e]));
  return dz;
}

// dquery += the pooling's gradient for dpool [N, E] (the first token, or every token / L).
void add_pool_grad(const MhaTape& t, const Tensor& dpool, HeadGate kind, bool batch_first, const Tensor& dquery) {
  const Tensor dq3 = dquery.reshape(t.xq.shape());  // a view: dquery is a fresh contiguous tensor
  const int64_t N = dpool.size(0), E = dpool.size(1);
  const int64_t L = batch_first ? dq3.size(1) : dq3.size(0);
  const int64_t n_rows = kind == HeadGate::FirstToken ? std::min<int64_t>(L, 1) : L;
  const float w = kind == HeadGate::FirstToken ? 1.0f : 1.0f / static_cast<float>(L);
  float* base = dq3.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t l = 0; l < n_rows; ++l) {
      float* row = base + (batch_first ? n * dq3.stride(0) + l * dq3.stride(1) : l * dq3.stride(0) + n * dq3.stride(1));
      for (int64_t c = 0; c < E; ++c) row[c] += w * dpool.data<float>()[n * E + c];
    }
  }
}

}  // namespace

MhaGrads MultiheadAttention::backward(const MhaTape& t, const Tensor& dout_in) const {
  const int64_t E = opt_.embed_dim, H = opt_.num_heads, Ei = H * opt_.head_dim;
  HEADS_CHECK(t.defined(), kMhaOp, "::backward: empty tape; run forward with MhaForwardArgs::tape set");
  HEADS_CHECK(t.attn3.size(2) == Ei && t.q4.size(1) == H && t.gates.defined() == (opt_.variant.head_gate != HeadGate::None),
              kMhaOp, "::backward: the tape comes from a module of other dimensions");
  HEADS_CHECK(t.linear == (opt_.variant.kind == AttentionKind::Linear), kMhaOp,
              "::backward: the tape comes from a module with ", t.linear ? "linear" : "softmax", " attention, this one has ",
              opt_.variant.kind == AttentionKind::Linear ? "linear" : "softmax", " attention");
  HEADS_CHECK(dout_in.defined() && dout_in.shape() == t.out_shape, kMhaOp, "::backward: dout: expected ",
              t.out_shape, " (the forward's output), got ", dout_in.defined() ? dout_in.shape() : Shape{});
  HEADS_CHECK(is_floating(dout_in.dtype()), kMhaOp, "::backward: dout: expected a floating dtype, got ",
              dtype_name(dout_in.dtype()));
  const bool bf = t.batched && opt_.batch_first;
  Grads pg;

  // Out-projection: out = attn Woᵀ + bo (attn · gates with head gates).
  const Tensor& proj_in = t.gated.defined() ? t.gated : t.attn3;
  const Tensor dout = dout_in.to(DType::F32).reshape({t.attn3.size(0), t.attn3.size(1), E});
  const LinearGrads go =
      linear_backward(rows(dout), rows(proj_in), *param("out_proj.weight"), param("out_proj.bias") != nullptr);
  pg["out_proj.weight"] = go.dweight;
  if (go.dbias.defined()) pg["out_proj.bias"] = go.dbias;
  const Tensor dattn3 = go.dx.reshape(t.attn3.shape());
  Tensor dgate_logit;  // [N, H]: d(loss)/d(gate logit)
  if (t.gates.defined()) dgate_logit = gates_backward(t, dattn3, bf);

  // Attention, into the projections' gradient buffers ([dq | dk | dv] side by side for the fused
  // self-attention projection, so that its backward is one GEMM).
  const Tensor* w_in = param("in_proj_weight");
  const Tensor* b_in = param("in_proj_bias");
  const bool fused = t.self_attn && w_in != nullptr;
  auto buffer = [](const Tensor& x3, int64_t width) { return Tensor::empty({x3.size(0), x3.size(1), width}, DType::F32); };
  const Tensor dy = fused ? buffer(t.xq, 3 * Ei) : Tensor();
  const Tensor dq3 = fused ? dy.slice(2, 0, Ei) : buffer(t.xq, Ei);
  const Tensor dk3 = fused ? dy.slice(2, Ei, 2 * Ei) : buffer(t.xk, Ei);
  const Tensor dv3 = fused ? dy.slice(2, 2 * Ei, 3 * Ei) : buffer(t.xv, Ei);
  const Tensor dattn4 = split_heads(bf ? dattn3 : dattn3.transpose(0, 1), H);
  attention_backward(*attention_, t, dattn4, bf, opt_.add_bias_kv, dq3, dk3, dv3, pg);

  // In-projection.
  MhaGrads out;
  if (fused) {  // one GEMM for dY = [dq | dk | dv]
    const LinearGrads g = linear_backward(rows(dy), rows(t.xq), *w_in, b_in != nullptr);
    out.dquery = as_input(g.dx, t.xq, t.query_shape);
    pg["in_proj_weight"] = g.dweight;
    if (b_in) pg["in_proj_bias"] = g.dbias;
  } else {
    in_projection_backward(t, Ei, w_in, b_in, {param("q_proj_weight"), param("k_proj_weight"), param("v_proj_weight")},
                           {dq3, dk3, dv3}, out, pg);
  }

  // Gates: logits = Wg · pool(query) + bg.
  if (dgate_logit.defined()) {
    const LinearGrads gg = linear_backward(dgate_logit, t.gate_in, *param("head_gate.weight"), true);
    pg["head_gate.weight"] = gg.dweight;
    pg["head_gate.bias"] = gg.dbias;
    add_pool_grad(t, gg.dx, opt_.variant.head_gate, bf, out.dquery);
  }
  for (const auto& p : params_) out.params.emplace_back(p.name, pg.at(p.name));
  return out;
}

}  // namespace heads
