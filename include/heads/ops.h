// ops.h — functional building blocks of transformer layers, as torch.nn.functional:
// linear, layer_norm, gelu (erf and tanh forms), relu, dropout. f32; they act on the last
// dimension and accept any strides (the last dimension is made contiguous if it is not).
#pragma once

#include <cstdint>
#include <string>

#include "heads/tensor.h"

namespace heads {

// y = x Wᵀ + b: x [..., in], weight [out, in] (torch's layout), bias [out] or undefined.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = {});

// Normalises over the last dimension: (x - mean) / sqrt(var + eps) · weight + bias (biased
// variance). weight, bias [n] or undefined.
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
// layer_norm(x + residual, ...) in one pass (post-norm residual connections).
Tensor add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                      double eps = 1e-5);

enum class Activation { Relu, Gelu, GeluTanh };  // GeluTanh = gelu(approximate="tanh")
Tensor activation(const Tensor& x, Activation act);
Activation activation_from_name(const std::string& name);  // "relu", "gelu", "gelu_tanh"

// Zeroes each element with probability p (a pure function of seed and index) and scales the
// rest by 1/(1-p). p = 0 returns x.
Tensor dropout(const Tensor& x, double p, uint64_t seed);

// y = a + b (same shapes), for residual connections.
Tensor add(const Tensor& a, const Tensor& b);

// Rows of weight [num_embeddings, dim] picked by integer ids (i64, any shape) -> [..., dim].
Tensor embedding(const Tensor& weight, const Tensor& ids);

// Mean cross-entropy of logits [N, C] against class ids target [N] (i64), as
// torch.nn.functional.cross_entropy(reduction="mean"): targets equal to ignore_index are left out
// of the sum and of the count (no counted target gives NaN, as torch).
double cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index = -100);

// Backward passes (f32 in, f32 out): given the forward's inputs and dL/dy.
struct LinearGrads {
  Tensor dx, dweight, dbias;  // dbias undefined when the forward had no bias
};
LinearGrads linear_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, bool has_bias);

struct LayerNormGrads {
  Tensor dx, dweight, dbias;  // dweight / dbias undefined when weight / bias were
};
LayerNormGrads layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                   const Tensor& bias, double eps = 1e-5);

// dL/dx of activation(x); dropout's backward is dropout(dy, p, seed) with the forward's seed.
Tensor activation_backward(const Tensor& dy, const Tensor& x, Activation act);

// dL/dweight [num_embeddings, dim] of embedding(weight, ids): rows of dy summed per id.
Tensor embedding_backward(const Tensor& dy, const Tensor& ids, int64_t num_embeddings);

// dL/dlogits of cross_entropy(logits, target, ignore_index), times dloss.
Tensor cross_entropy_backward(const Tensor& logits, const Tensor& target, int64_t ignore_index = -100,
                              double dloss = 1.0);

// Decoder building blocks (ops_decoder.cc).

// RMSNorm over the last dimension, as Llama / T5: x / sqrt(mean(x²) + eps) · w, or · (1 + w) with
// unit_offset (Gemma). f32 out; weight [n].
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, bool unit_offset = false);

// Gated activation of a fused [..., 2F] gate|up product: act(gate) · up -> [..., F], with act SiLU
// (Llama, Mistral, Qwen2) or the tanh GELU (Gemma 2).
enum class GatedAct { Silu, GeluTanh, Gelu };  // Gelu: exact (erf), as Activation::Gelu
Tensor gated_activation(const Tensor& gate_up, GatedAct act);

// Rotary position embedding (RoFormer; transformers' rotate_half / GPT-J layouts).
struct RopeOptions {
  double theta = 10000.0;
  bool interleaved = false;  // pairs (2i, 2i+1) as GPT-J; false: halves (i, i + dim/2) as Llama
  int64_t rotary_dim = 0;    // leading dims rotated (0: all); even
  enum class Scaling { None, Linear, Llama3 } scaling = Scaling::None;
  double factor = 1.0;                   // linear and llama3
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // llama3
  int64_t original_max_position = 8192;                  // llama3
};
// The rotation frequencies [rotary_dim / 2] f32, computed as transformers computes them.
Tensor rope_inv_freq(int64_t rotary_dim, const RopeOptions& o);
// Rotates x [B, H, L, D] (any strides with a unit inner one, f32 or bf16) in place: row l at
// position position_offset + l is turned by angle position · inv_freq. inverse = true turns back
// (the backward: the rotation is orthogonal, so dL/dx is dL/dy turned back).
void rope_(const Tensor& x, int64_t position_offset, const RopeOptions& o, bool inverse = false);

namespace ref {
// float64 specifications (any floating input, f64 output).
Tensor layer_norm_f64(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps);
Tensor activation_f64(const Tensor& x, Activation act);
// rope_ in float64 (angles from the same f32 frequencies), returning a new [B, H, L, D] tensor.
Tensor rope_f64(const Tensor& x, int64_t position_offset, const RopeOptions& o);
}  // namespace ref

}  // namespace heads
