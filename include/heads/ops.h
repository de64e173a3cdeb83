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

namespace ref {
// float64 specifications (any floating input, f64 output).
Tensor layer_norm_f64(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps);
Tensor activation_f64(const Tensor& x, Activation act);
}  // namespace ref

}  // namespace heads
