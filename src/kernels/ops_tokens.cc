// ops_tokens.cc — the ops on token ids: embedding lookup and cross-entropy, forward and backward.
#include "heads/ops.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "kernels/ops_common.h"

namespace heads {

using kernels::f32;

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

}  // namespace heads
