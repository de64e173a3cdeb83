// ops_backward.cc — gradients of the functional ops (linear, layer_norm, activations); parameter
// gradients are summed over rows in fixed blocks, so they do not depend on the thread count.
#include "heads/ops.h"

#include <cmath>
#include <vector>

#include "kernels/dispatch.h"
#include "kernels/linear.h"
#include "kernels/ops_common.h"

namespace heads {

using kernels::f32;
using kernels::row_block_sums;
using kernels::to_f32;

LinearGrads linear_backward(const Tensor& dy_in, const Tensor& x_in, const Tensor& w_in, bool has_bias) {
  const char* op = "linear_backward";
  HEADS_CHECK(w_in.defined() && w_in.dim() == 2, op, ": weight: expected [out, in]");
  const int64_t out = w_in.size(0), in = w_in.size(1);
  HEADS_CHECK(x_in.defined() && x_in.dim() >= 1 && x_in.size(-1) == in, op, ": input ",
              x_in.defined() ? x_in.shape() : Shape{}, " does not match weight ", w_in.shape());
  Shape ys = x_in.shape();
  ys.back() = out;
  HEADS_CHECK(dy_in.defined() && dy_in.shape() == ys, op, ": dy: expected ", ys, ", got ",
              dy_in.defined() ? dy_in.shape() : Shape{});
  const Tensor x = f32(x_in, op, "input").reshape({-1, in});
  const Tensor dy = f32(dy_in, op, "dy").reshape({-1, out});
  const Tensor w = f32(w_in, op, "weight");
  LinearGrads g;
  // dx = dy · W;  dW = dyᵀ · x (dy read transposed in place);  db = column sums of dy
  const int64_t M = x.size(0);
  g.dx = Tensor::empty({M, in}, DType::F32);
  kernels::matmul_f32(M, in, out, dy.data<float>(), out, 1, w.data<float>(), in, 1, g.dx.data<float>(), in);
  g.dx = g.dx.reshape(x_in.shape());
  g.dweight = Tensor::empty({out, in}, DType::F32);  // dyᵀ read in place: strides (1, out)
  kernels::matmul_f32(out, in, M, dy.data<float>(), 1, out, x.data<float>(), in, 1, g.dweight.data<float>(), in);
  if (has_bias) {
    const float* d = dy.data<float>();
    g.dbias = to_f32(row_block_sums(M, out, [&](int64_t r, double* acc) {
                       for (int64_t o = 0; o < out; ++o) acc[o] += d[r * out + o];
                     }), 0, out);
  }
  return g;
}

LayerNormGrads layer_norm_backward(const Tensor& dy_in, const Tensor& x_in, const Tensor& w_in,
                                   const Tensor& b_in, double eps) {
  const char* op = "layer_norm_backward";
  HEADS_CHECK(x_in.defined() && x_in.dim() >= 1, op, ": input must have at least 1 dimension");
  HEADS_CHECK(dy_in.defined() && dy_in.shape() == x_in.shape(), op, ": dy ", dy_in.defined() ? dy_in.shape() : Shape{},
              " does not match input ", x_in.shape());
  const int64_t n = x_in.size(-1), rows = n ? x_in.numel() / n : 0;
  HEADS_CHECK(!w_in.defined() || w_in.shape() == Shape({n}), op, ": weight: expected [", n, "]");
  const Tensor x = f32(x_in, op, "input"), dy = f32(dy_in, op, "dy");
  const Tensor w = w_in.defined() ? f32(w_in, op, "weight") : Tensor();
  LayerNormGrads g;
  g.dx = Tensor::empty(x.shape(), DType::F32);
  const float* wp = w.defined() ? w.data<float>() : nullptr;
  // Per row: xhat = (x - mean)·rstd, dxhat = dy·w, dx = rstd·(dxhat - mean(dxhat) - xhat·mean(dxhat·xhat));
  // acc[0:n] += dy·xhat (dweight), acc[n:2n] += dy (dbias).
  const std::vector<double> sums = row_block_sums(rows, 2 * n, [&](int64_t r, double* acc) {
    const float* xr = x.data<float>() + r * n;
    const float* gr = dy.data<float>() + r * n;
    double mean = 0, var = 0;
    for (int64_t i = 0; i < n; ++i) mean += xr[i];
    mean /= static_cast<double>(n);
    for (int64_t i = 0; i < n; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    const double rstd = 1.0 / std::sqrt(var / static_cast<double>(n) + eps);
    double m1 = 0, m2 = 0;  // mean(dxhat), mean(dxhat·xhat)
    for (int64_t i = 0; i < n; ++i) {
      const double xh = (xr[i] - mean) * rstd, gx = gr[i] * (wp ? wp[i] : 1.0f);
      m1 += gx;
      m2 += gx * xh;
      acc[i] += gr[i] * xh;
      acc[n + i] += gr[i];
    }
    m1 /= static_cast<double>(n);
    m2 /= static_cast<double>(n);
    float* dxr = g.dx.data<float>() + r * n;
    for (int64_t i = 0; i < n; ++i) {
      const double xh = (xr[i] - mean) * rstd, gx = gr[i] * (wp ? wp[i] : 1.0f);
      dxr[i] = static_cast<float>(rstd * (gx - m1 - xh * m2));
    }
  });
  if (w_in.defined()) g.dweight = to_f32(sums, 0, n);
  if (b_in.defined()) g.dbias = to_f32(sums, n, n);
  return g;
}

Tensor activation_backward(const Tensor& dy_in, const Tensor& x_in, Activation act) {
  HEADS_CHECK(dy_in.defined() && x_in.defined() && dy_in.shape() == x_in.shape(), "activation_backward: dy ",
              dy_in.defined() ? dy_in.shape() : Shape{}, " does not match input ", x_in.defined() ? x_in.shape() : Shape{});
  const Tensor x = f32(x_in, "activation_backward", "input");
  const Tensor dy = f32(dy_in, "activation_backward", "dy");
  Tensor dx = Tensor::empty(x.shape(), DType::F32);
  const int code = act == Activation::Relu ? 0 : act == Activation::Gelu ? 1 : 2;
  kernels::active().activation_bwd_f32(x.data<float>(), dy.data<float>(), dx.data<float>(), x.numel(), code);
  return dx;
}

}  // namespace heads
