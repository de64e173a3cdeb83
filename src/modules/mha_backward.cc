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

#include "heads/ops.h"
#include "heads/sdpa.h"
#include "modules/common.h"

namespace heads {

using modules::rows;
using modules::split_heads;

namespace {

constexpr const char* kOp = "MultiheadAttention";

using Grads = std::map<std::string, Tensor>;  // parameter gradients by name

// dq3, dk3, dv3 ([d0, d1, E] in the inputs' row order) from d(attn) through the SDPA backward.
// Keys appended by add_bias_kv / add_zero_attn need rows of their own: then the gradients go
// through a temporary, bias_k / bias_v (key S of every batch entry) get theirs summed over N, and
// the appended keys' rows are dropped.
void attention_backward(const MhaTape& t, const Tensor& dattn4, bool batch_first, bool bias_kv,
                        const Tensor& dq3, const Tensor& dk3, const Tensor& dv3, Grads& pg) {
  const int64_t N = t.q4.size(0), H = t.q4.size(1), hd = t.q4.size(3);
  const int64_t S = t.xk.size(batch_first ? 1 : 0);
  auto nle = [&](const Tensor& x3) { return batch_first ? x3 : x3.transpose(0, 1); };
  if (t.k4.size(2) == S) {
    sdpa_backward_out(split_heads(nle(dq3), H), split_heads(nle(dk3), H), split_heads(nle(dv3), H), dattn4,
                      t.q4, t.k4, t.v4, t.attention, t.sdpa);
    return;
  }
  const SdpaGrads gs = sdpa_backward(dattn4, t.q4, t.k4, t.v4, t.attention, t.sdpa);
  if (bias_kv) {
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
void in_projection_backward(const MhaTape& t, int64_t E, const Tensor* w_in, const Tensor* b_in,
                            const std::array<const Tensor*, 3>& w, const std::array<Tensor, 3>& dys,
                            MhaGrads& out, Grads& pg) {
  static const char* names[3] = {"q_proj_weight", "k_proj_weight", "v_proj_weight"};
  Tensor dw_in = w_in ? Tensor::empty({3 * E, E}, DType::F32) : Tensor();
  Tensor db_in = b_in ? Tensor::empty({3 * E}, DType::F32) : Tensor();
  const Tensor* xs[3] = {&t.xq, &t.xk, &t.xv};
  const Shape* shapes[3] = {&t.query_shape, &t.key_shape, &t.value_shape};
  Tensor* dxs[3] = {&out.dquery, &out.dkey, &out.dvalue};
  for (int64_t part = 0; part < 3; ++part) {
    const Tensor wp = w_in ? w_in->slice(0, part * E, (part + 1) * E) : *w[part];
    const LinearGrads g = linear_backward(rows(dys[part]), rows(*xs[part]), wp, b_in != nullptr);
    *dxs[part] = as_input(g.dx, *xs[part], *shapes[part]);
    if (w_in) {
      dw_in.slice(0, part * E, (part + 1) * E).copy_from(g.dweight);
    } else {
      pg[names[part]] = g.dweight;
    }
    if (b_in) db_in.slice(0, part * E, (part + 1) * E).copy_from(g.dbias);
  }
  if (w_in) pg["in_proj_weight"] = dw_in;
  if (b_in) pg["in_proj_bias"] = db_in;
}

}  // namespace

MhaGrads MultiheadAttention::backward(const MhaTape& t, const Tensor& dout_in) const {
  const int64_t E = opt_.embed_dim, H = opt_.num_heads;
  HEADS_CHECK(t.defined(), kOp, "::backward: empty tape; run forward with MhaForwardArgs::tape set");
  HEADS_CHECK(t.attn3.size(2) == E && t.q4.size(1) == H, kOp,
              "::backward: the tape comes from a module of other dimensions");
  HEADS_CHECK(dout_in.defined() && dout_in.shape() == t.out_shape, kOp, "::backward: dout: expected ",
              t.out_shape, " (the forward's output), got ", dout_in.defined() ? dout_in.shape() : Shape{});
  HEADS_CHECK(is_floating(dout_in.dtype()), kOp, "::backward: dout: expected a floating dtype, got ",
              dtype_name(dout_in.dtype()));
  const bool bf = t.batched && opt_.batch_first;
  Grads pg;

  // Out-projection: out = attn Woᵀ + bo.
  const Tensor dout = dout_in.to(DType::F32).reshape({t.attn3.size(0), t.attn3.size(1), E});
  const LinearGrads go =
      linear_backward(rows(dout), rows(t.attn3), *param("out_proj.weight"), param("out_proj.bias") != nullptr);
  pg["out_proj.weight"] = go.dweight;
  if (go.dbias.defined()) pg["out_proj.bias"] = go.dbias;
  const Tensor dattn3 = go.dx.reshape(t.attn3.shape());

  // Attention, into the projections' gradient buffers ([dq | dk | dv] side by side for the fused
  // self-attention projection, so that its backward is one GEMM).
  const Tensor* w_in = param("in_proj_weight");
  const Tensor* b_in = param("in_proj_bias");
  const bool fused = t.self_attn && w_in != nullptr;
  auto buffer = [](const Tensor& x3, int64_t width) { return Tensor::empty({x3.size(0), x3.size(1), width}, DType::F32); };
  const Tensor dy = fused ? buffer(t.xq, 3 * E) : Tensor();
  const Tensor dq3 = fused ? dy.slice(2, 0, E) : buffer(t.xq, E);
  const Tensor dk3 = fused ? dy.slice(2, E, 2 * E) : buffer(t.xk, E);
  const Tensor dv3 = fused ? dy.slice(2, 2 * E, 3 * E) : buffer(t.xv, E);
  const Tensor dattn4 = split_heads(bf ? dattn3 : dattn3.transpose(0, 1), H);
  attention_backward(t, dattn4, bf, opt_.add_bias_kv, dq3, dk3, dv3, pg);

  // In-projection.
  MhaGrads out;
  if (fused) {  // one GEMM for dY = [dq | dk | dv]
    const LinearGrads g = linear_backward(rows(dy), rows(t.xq), *w_in, b_in != nullptr);
    out.dquery = as_input(g.dx, t.xq, t.query_shape);
    pg["in_proj_weight"] = g.dweight;
    if (b_in) pg["in_proj_bias"] = g.dbias;
  } else {
    in_projection_backward(t, E, w_in, b_in, {param("q_proj_weight"), param("k_proj_weight"), param("v_proj_weight")},
                           {dq3, dk3, dv3}, out, pg);
  }
  for (const auto& p : params_) out.params.emplace_back(p.name, pg.at(p.name));
  return out;
}

}  // namespace heads
