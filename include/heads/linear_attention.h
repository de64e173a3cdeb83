// linear_attention.h — kernelized linear attention (Katharopoulos et al., "Transformers are RNNs",
// arXiv:2006.16236):
//
//   out_i = φ(q_i)ᵀ S / (φ(q_i)ᵀ z + eps),   S = Σ_j φ(k_j) v_jᵀ  [D, Dv],   z = Σ_j φ(k_j)  [D]
//
// over every key (non-causal) or keys j <= i (causal, Lq == Lk: S and z are prefix sums). Time
// O(L·D·Dv), state O(D·Dv): no L×L matrix exists. Feature maps: elu(x) + 1 (the paper's, always
// positive), relu and identity (whose denominators can reach 0: eps is then all that is left).
// Shapes: q [B, H, Lq, D], k [B, H, Lk, D], v [B, H, Lk, Dv] (f32, any strides with a unit inner
// one) -> [B, H, Lq, Dv] f32.
#pragma once

#include <cstdint>
#include <string>

#include "heads/tensor.h"

namespace heads {

enum class FeatureMap { EluPlusOne, Relu, Identity };
FeatureMap feature_map_from_name(const std::string& name);  // "elu", "relu", "identity"

struct LinearAttentionOptions {
  FeatureMap feature_map = FeatureMap::EluPlusOne;
  bool causal = false;
  double eps = 1e-6;
  // [B, Lk] bool, true = ignore the key (padding, as torch's key_padding_mask): it adds nothing to
  // any sum (whatever its key and value hold, inf and NaN included), and its dk and dv are zero. A
  // row that sees no key gives zeros when eps > 0 (with eps = 0 it is 0 / 0).
  Tensor key_padding_mask;
};

Tensor linear_attention(const Tensor& q, const Tensor& k, const Tensor& v, const LinearAttentionOptions& o = {});

struct LinearAttentionGrads {
  Tensor dq, dk, dv;
};
// Backward of linear_attention for dout [B, H, Lq, Dv] (recomputes S and z; reverse prefix sums
// when causal).
LinearAttentionGrads linear_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                               const LinearAttentionOptions& o = {});

// The weights linear attention gives each key, A_ij = φ(q_i)·φ(k_j) / (Σ_j' φ(q_i)·φ(k_j') + eps)
// (j, j' <= i when causal): [B, H, Lq, Lk] f32, so that out = A V. For inspection (attention maps):
// this is the L×L matrix the kernel never forms.
Tensor linear_attention_weights(const Tensor& q, const Tensor& k, const LinearAttentionOptions& o = {});

// The recurrent form for decoding: the state after t keys; step() takes one new (q, k, v) per
// (b, h) — q, k [B, H, D], v [B, H, Dv] — adds k, v to the state and returns out [B, H, Dv],
// equal to the causal call's row t.
class LinearAttentionState {
 public:
  LinearAttentionState(int64_t batch, int64_t heads, int64_t head_dim, int64_t value_dim, FeatureMap fm,
                       double eps = 1e-6);
  Tensor step(const Tensor& q, const Tensor& k, const Tensor& v);
  int64_t length() const { return length_; }
  const Tensor& S() const { return S_; }  // [B, H, D, Dv]
  const Tensor& z() const { return z_; }  // [B, H, D]

 private:
  int64_t B_, H_, D_, Dv_, length_ = 0;
  FeatureMap fm_;
  double eps_;
  Tensor S_, z_;
};

namespace ref {
// The definition with the full [Lq, Lk] matrix in float64: A = φ(Q) φ(K)ᵀ (masked j > i when
// causal), out = A V / (A 1 + eps).
Tensor linear_attention_f64(const Tensor& q, const Tensor& k, const Tensor& v, const LinearAttentionOptions& o = {});
}  // namespace ref

}  // namespace heads
