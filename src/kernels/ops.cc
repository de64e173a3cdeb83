// ops.cc — the functional ops' forwards (linear, layer_norm, activations, dropout, add): argument
// checks, then the active ISA's kernels. Backwards in ops_backward.cc, the token ops (embedding,
// cross-entropy) in ops_tokens.cc, float64 references in ops_ref.cc.
#include "heads/ops.h"

#include <utility>

#include "kernels/dispatch.h"
#include "kernels/linear.h"
#include "kernels/ops_common.h"
#include "kernels/sdpa_problem.h"

namespace heads {

using kernels::f32;
using kernels::with_last;

Tensor linear(const Tensor& x_in, const Tensor& w_in, const Tensor& b_in) {
  const char* op = "linear";
  HEADS_CHECK(x_in.defined() && x_in.dim() >= 1, op, ": input must have at least 1 dimension");
  HEADS_CHECK(w_in.defined() && w_in.dim() == 2, op, ": weight: expected [out, in], got ",
              w_in.defined() ? w_in.shape() : Shape{});
  const int64_t in = w_in.size(1), out = w_in.size(0);
  HEADS_CHECK(x_in.size(-1) == in, op, ": input ", x_in.shape(), " does not match weight ",
              w_in.shape(), " (expected last dim ", in, ")");
  HEADS_CHECK(!b_in.defined() || b_in.shape() == Shape({out}), op, ": bias: expected [", out,
              "], got ", b_in.defined() ? b_in.shape() : Shape{});
  const Tensor x = f32(x_in, op, "input"), w = f32(w_in, op, "weight");
  const Tensor b = b_in.defined() ? f32(b_in, op, "bias") : Tensor();
  Tensor y = Tensor::empty(with_last(x.shape(), out), DType::F32);
  const int64_t rows = in > 0 ? x.numel() / in : y.numel() / std::max<int64_t>(out, 1);
  kernels::linear_f32(x.data<float>(), rows, in, in, w.data<float>(),
                      b.defined() ? b.data<float>() : nullptr, out, y.data<float>(), out);
  return y;
}

namespace {

Tensor layer_norm_impl(const Tensor& x_in, const Tensor* r_in, const Tensor& w_in, const Tensor& b_in,
                       double eps) {
  const char* op = "layer_norm";
  HEADS_CHECK(x_in.defined() && x_in.dim() >= 1, op, ": input must have at least 1 dimension");
  const int64_t n = x_in.size(-1);
  for (const auto& [t, name] : {std::pair{&w_in, "weight"}, {&b_in, "bias"}}) {
    HEADS_CHECK(!t->defined() || t->shape() == Shape({n}), op, ": ", name, ": expected [", n,
                "] to match input ", x_in.shape(), ", got ", t->defined() ? t->shape() : Shape{});
  }
  HEADS_CHECK(r_in == nullptr || (r_in->defined() && r_in->shape() == x_in.shape()), op,
              ": residual ", r_in && r_in->defined() ? r_in->shape() : Shape{}, " does not match input ",
              x_in.shape());
  HEADS_CHECK(eps >= 0.0, op, ": eps must be non-negative, got ", eps);
  const Tensor x = f32(x_in, op, "input");
  const Tensor r = r_in ? f32(*r_in, op, "residual") : Tensor();
  const Tensor w = w_in.defined() ? f32(w_in, op, "weight") : Tensor();
  const Tensor b = b_in.defined() ? f32(b_in, op, "bias") : Tensor();
  Tensor y = Tensor::empty(x.shape(), DType::F32);
  if (n == 0) return y;
  kernels::active().layer_norm_f32(x.data<float>(), r.defined() ? r.data<float>() : nullptr, y.data<float>(),
                                   x.numel() / n, n, n, n, w.defined() ? w.data<float>() : nullptr,
                                   b.defined() ? b.data<float>() : nullptr, static_cast<float>(eps));
  return y;
}

}  // namespace

Tensor layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  return layer_norm_impl(x, nullptr, w, b, eps);
}

Tensor add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& w, const Tensor& b, double eps) {
  return layer_norm_impl(x, &residual, w, b, eps);
}

Activation activation_from_name(const std::string& name) {
  if (name == "relu") return Activation::Relu;
  if (name == "gelu") return Activation::Gelu;
  if (name == "gelu_tanh" || name == "gelu_new" || name == "gelu_pytorch_tanh") return Activation::GeluTanh;
  fail("activation must be relu, gelu or gelu_tanh, got \"", name, "\"");
}

Tensor activation(const Tensor& x_in, Activation act) {
  const Tensor x = f32(x_in, "activation", "input");
  Tensor y = Tensor::empty(x.shape(), DType::F32);
  const int64_t n = x.numel();
  if (n == 0) return y;
  const auto& k = kernels::active();
  if (act == Activation::Relu) {
    k.relu_f32(x.data<float>(), y.data<float>(), 1, n, n, n);
  } else {
    k.gelu_f32(x.data<float>(), y.data<float>(), 1, n, n, n, act == Activation::GeluTanh);
  }
  return y;
}

Tensor dropout(const Tensor& x_in, double p, uint64_t seed) {
  HEADS_CHECK(p >= 0.0 && p <= 1.0, "dropout: p must be in [0, 1], got ", p);
  if (p == 0.0) return x_in;
  Tensor y = f32(x_in, "dropout", "input").clone();
  float* v = y.data<float>();
  const float scale = kernels::dropout_keep_scale(p);
  for (int64_t i = 0; i < y.numel(); ++i) {
    v[i] = kernels::dropout_keep(seed, static_cast<uint64_t>(i), p) ? v[i] * scale : 0.0f;
  }
  return y;
}

Tensor add(const Tensor& a_in, const Tensor& b_in) {
  HEADS_CHECK(a_in.defined() && b_in.defined() && a_in.shape() == b_in.shape(), "add: shapes ",
              a_in.defined() ? a_in.shape() : Shape{}, " and ", b_in.defined() ? b_in.shape() : Shape{},
              " differ");
  const Tensor a = f32(a_in, "add", "a"), b = f32(b_in, "add", "b");
  Tensor y = Tensor::empty(a.shape(), DType::F32);
  kernels::active().add_f32(a.data<float>(), b.data<float>(), y.data<float>(), a.numel());
  return y;
}

}  // namespace heads
