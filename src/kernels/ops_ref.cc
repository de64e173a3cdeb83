// ops_ref.cc — float64 references of layer_norm and the activations, the tests' measure.
#include "heads/ops.h"

#include <cmath>

namespace heads {

namespace ref {

Tensor layer_norm_f64(const Tensor& x_in, const Tensor& w_in, const Tensor& b_in, double eps) {
  const Tensor x = x_in.to(DType::F64);
  const Tensor w = w_in.defined() ? w_in.to(DType::F64) : Tensor();
  const Tensor b = b_in.defined() ? b_in.to(DType::F64) : Tensor();
  Tensor y = Tensor::empty(x.shape(), DType::F64);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  const double* xp = x.data<double>();
  double* yp = y.data<double>();
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < n; ++i) mean += xp[r * n + i];
    mean /= static_cast<double>(n);
    for (int64_t i = 0; i < n; ++i) var += (xp[r * n + i] - mean) * (xp[r * n + i] - mean);
    var /= static_cast<double>(n);
    for (int64_t i = 0; i < n; ++i) {
      double v = (xp[r * n + i] - mean) / std::sqrt(var + eps);
      if (w.defined()) v *= w.data<double>()[i];
      if (b.defined()) v += b.data<double>()[i];
      yp[r * n + i] = v;
    }
  }
  return y;
}

Tensor activation_f64(const Tensor& x_in, Activation act) {
  Tensor y = x_in.to(DType::F64).clone();
  double* p = y.data<double>();
  for (int64_t i = 0; i < y.numel(); ++i) {
    const double x = p[i];
    switch (act) {
      case Activation::Relu: p[i] = x > 0 ? x : 0.0; break;
      case Activation::Gelu: p[i] = 0.5 * x * std::erfc(-x / std::sqrt(2.0)); break;
      case Activation::GeluTanh: {  // ½x(1 + tanh u) = x / (1 + e^{-2u}), without cancellation
        const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
        p[i] = x / (1.0 + std::exp(-2.0 * u));
        break;
      }
    }
  }
  return y;
}

}  // namespace ref

}  // namespace heads
