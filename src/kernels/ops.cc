// ops.cc — functional ops (linear, layer_norm, activations, dropout, add): validation, then the
// active ISA's kernels; float64 references beside them.
#include "heads/ops.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/linear.h"
#include "kernels/sdpa_problem.h"

namespace heads {

namespace {

// f32, contiguous (a copy only when needed).
Tensor f32(const Tensor& t, const char* op, const char* name) {
  HEADS_CHECK(t.defined(), op, ": ", name, " is required");
  HEADS_CHECK(is_floating(t.dtype()), op, ": ", name, ": expected a floating dtype, got ",
              dtype_name(t.dtype()));
  return t.to(DType::F32);
}

Shape with_last(Shape s, int64_t n) {
  s.back() = n;
  return s;
}

// Per-column sums over `rows` of width values each row contributes (row_fn(r, acc) adds row r's
// into acc), in double. Rows are split into at most 256 fixed blocks that run in parallel; the
// block sums are added in block order, so the result does not depend on the thread count.
template <class RowFn>
std::vector<double> row_block_sums(int64_t rows, int64_t width, RowFn row_fn) {
  const int64_t per = std::max<int64_t>(16, (rows + 255) / 256);
  const int64_t blocks = (rows + per - 1) / per;
  std::vector<double> part(static_cast<size_t>(blocks * width), 0.0);
  const int threads = static_cast<int>(std::min<int64_t>(get_num_threads(), blocks));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * width >= 32768)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    double* acc = part.data() + blk * width;
    for (int64_t r = blk * per; r < std::min(rows, (blk + 1) * per); ++r) row_fn(r, acc);
  }
  std::vector<double> sum(static_cast<size_t>(width), 0.0);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    for (int64_t i = 0; i < width; ++i) sum[static_cast<size_t>(i)] += part[static_cast<size_t>(blk * width + i)];
  }
  return sum;
}

Tensor to_f32(const std::vector<double>& v, int64_t offset, int64_t n) {
  Tensor t = Tensor::empty({n}, DType::F32);
  for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = static_cast<float>(v[static_cast<size_t>(offset + i)]);
  return t;
}

}  // namespace

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

namespace {

// ids as a contiguous i64 tensor whose values all lie in [0, n) (or equal `allowed`).
Tensor checked_ids(const Tensor& ids, int64_t n, const char* op, const char* name,
                   std::optional<int64_t> allowed = std::nullopt) {
  HEADS_CHECK(ids.defined() && ids.dtype() == DType::I64, op, ": ", name, ": expected int64 ids, got ",
              ids.defined() ? dtype_name(ids.dtype()) : "none");
  Tensor c = ids.contiguous();
  const int64_t* p = c.data<int64_t>();
  for (int64_t i = 0; i < c.numel(); ++i) {
    HEADS_CHECK((p[i] >= 0 && p[i] < n) || p[i] == allowed, op, ": ", name, ": id ", p[i], " at flat index ", i,
                " is out of range [0, ", n, ")");
  }
  return c;
}

}  // namespace

Tensor embedding(const Tensor& w_in, const Tensor& ids_in) {
  const char* op = "embedding";
  HEADS_CHECK(w_in.defined() && w_in.dim() == 2, op, ": weight: expected [num_embeddings, dim], got ",
              w_in.defined() ? w_in.shape() : Shape{});
  const int64_t V = w_in.size(0), E = w_in.size(1);
  const Tensor ids = checked_ids(ids_in, V, op, "ids");
  const Tensor w = f32(w_in, op, "weight");
  Shape s = ids.shape();
  s.push_back(E);
  Tensor y = Tensor::empty(s, DType::F32);
  const int64_t* p = ids.data<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    std::copy_n(w.data<float>() + p[i] * E, E, y.data<float>() + i * E);
  }
  return y;
}

Tensor embedding_backward(const Tensor& dy_in, const Tensor& ids_in, int64_t V) {
  const char* op = "embedding_backward";
  HEADS_CHECK(V >= 1, op, ": num_embeddings must be positive, got ", V);
  const Tensor ids = checked_ids(ids_in, V, op, "ids");
  HEADS_CHECK(dy_in.defined() && dy_in.dim() == ids.dim() + 1, op, ": dy: expected ids' shape ", ids.shape(),
              " plus the embedding dim, got ", dy_in.defined() ? dy_in.shape() : Shape{});
  for (int64_t d = 0; d < ids.dim(); ++d) {
    HEADS_CHECK(dy_in.size(d) == ids.size(d), op, ": dy ", dy_in.shape(), " does not match ids ", ids.shape());
  }
  const Tensor dy = f32(dy_in, op, "dy");
  const int64_t E = dy.size(-1);
  Tensor dw = Tensor::zeros({V, E}, DType::F32);
  const int64_t* p = ids.data<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    float* row = dw.data<float>() + p[i] * E;
    const float* g = dy.data<float>() + i * E;
    for (int64_t c = 0; c < E; ++c) row[c] += g[c];
  }
  return dw;
}

namespace {

struct CrossEntropyInputs {
  Tensor logits, target;
  int64_t n, classes, counted;
};

CrossEntropyInputs cross_entropy_inputs(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                                        const char* op) {
  HEADS_CHECK(logits.defined() && logits.dim() == 2, op, ": logits: expected [N, C], got ",
              logits.defined() ? logits.shape() : Shape{});
  HEADS_CHECK(target.defined() && target.dim() == 1 && target.size(0) == logits.size(0), op,
              ": target: expected [", logits.size(0), "] for logits ", logits.shape(), ", got ",
              target.defined() ? target.shape() : Shape{});
  CrossEntropyInputs in{f32(logits, op, "logits"), checked_ids(target, logits.size(1), op, "target", ignore_index),
                        logits.size(0), logits.size(1), 0};
  for (int64_t i = 0; i < in.n; ++i) in.counted += in.target.data<int64_t>()[i] != ignore_index;
  return in;
}

// log Σ exp of a row, in double.
double log_sum_exp(const float* row, int64_t n) {
  double m = -INFINITY;
  for (int64_t c = 0; c < n; ++c) m = std::max(m, static_cast<double>(row[c]));
  double s = 0;
  for (int64_t c = 0; c < n; ++c) s += std::exp(row[c] - m);
  return m + std::log(s);
}

}  // namespace

double cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index) {
  const CrossEntropyInputs in = cross_entropy_inputs(logits, target, ignore_index, "cross_entropy");
  double sum = 0;
  for (int64_t i = 0; i < in.n; ++i) {
    const int64_t t = in.target.data<int64_t>()[i];
    if (t == ignore_index) continue;
    const float* row = in.logits.data<float>() + i * in.classes;
    sum += log_sum_exp(row, in.classes) - row[t];
  }
  return sum / static_cast<double>(in.counted);
}

Tensor cross_entropy_backward(const Tensor& logits, const Tensor& target, int64_t ignore_index, double dloss) {
  const CrossEntropyInputs in = cross_entropy_inputs(logits, target, ignore_index, "cross_entropy_backward");
  Tensor d = Tensor::zeros({in.n, in.classes}, DType::F32);
  const double scale = dloss / static_cast<double>(in.counted);  // (softmax - onehot) / count
  for (int64_t i = 0; i < in.n; ++i) {
    const int64_t t = in.target.data<int64_t>()[i];
    if (t == ignore_index) continue;
    const float* row = in.logits.data<float>() + i * in.classes;
    const double lse = log_sum_exp(row, in.classes);
    float* out = d.data<float>() + i * in.classes;
    for (int64_t c = 0; c < in.classes; ++c) {
      out[c] = static_cast<float>(scale * (std::exp(row[c] - lse) - (c == t ? 1.0 : 0.0)));
    }
  }
  return d;
}

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
