// Training paths in C++ (they also run under ASan/UBSan in CI): the module backward passes give
// the directional derivative of their forward (central differences, float64 sums), AdamW follows
// its formula, and cross_entropy / embedding backward agree with their forwards. The PyTorch
// comparisons of the same paths live in tests/python.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "common/testing.h"
#include "heads/encoder.h"
#include "heads/error.h"
#include "heads/mha.h"
#include "heads/ops.h"
#include "heads/optim.h"
#include "heads/tiny_lm.h"

namespace heads {
namespace {

using testing::directional;
using testing::dot;
using testing::randn;

void expect_close(double analytic, double numeric, const std::string& what) {
  EXPECT_NEAR(analytic, numeric, 2e-3 * std::max(1.0, std::abs(numeric))) << what;
}

TEST(Training, MultiheadAttentionBackwardIsTheForwardsDerivative) {
  MultiheadAttentionOptions o;
  o.embed_dim = 12;
  o.num_heads = 3;
  o.kdim = 5;
  o.vdim = 7;
  o.add_bias_kv = true;
  o.add_zero_attn = true;
  MultiheadAttention mha(o, 3);
  for (auto& [n, t] : mha.state_dict()) t.copy_from(randn(t.shape(), 0.4));
  const Tensor q = randn({7, 2, 12}), k = randn({9, 2, 5}), v = randn({9, 2, 7});
  MhaForwardArgs a;
  a.key_padding_mask = testing::rand_bool({2, 9}, 0.3);
  a.need_weights = false;
  const Tensor w = randn({7, 2, 12});
  auto loss = [&] { return dot(mha.forward(q, k, v, a).first, w); };
  MhaTape tape;
  MhaForwardArgs at = a;
  at.tape = &tape;
  mha.forward(q, k, v, at);
  const MhaGrads g = mha.backward(tape, w);
  for (const auto& [x, dx, name] : {std::tuple{&q, &g.dquery, "query"}, {&k, &g.dkey, "key"}, {&v, &g.dvalue, "value"}}) {
    const Tensor d = randn(x->shape());
    expect_close(dot(*dx, d), directional(*x, d, 1e-2, loss), name);
  }
  ASSERT_EQ(g.params.size(), mha.state_dict().size());
  for (const auto& [n, p] : mha.state_dict()) {
    const Tensor d = randn(p.shape());
    expect_close(dot(testing::entry(g.params, n), d), directional(p, d, 1e-2, loss), n);
  }
  EXPECT_THROW(mha.backward(MhaTape{}, w), Error);
  EXPECT_THROW(mha.backward(tape, randn({7, 12})), Error);
}

TEST(Training, EncoderBackwardIsTheForwardsDerivative) {
  for (const bool norm_first : {false, true}) {
    TransformerEncoderLayerOptions o;
    o.d_model = 16;
    o.nhead = 4;
    o.dim_feedforward = 24;
    o.dropout = 0.2;
    o.activation = Activation::Gelu;
    o.batch_first = true;
    o.norm_first = norm_first;
    TransformerEncoder enc(o, 2, /*final_norm=*/true, 5);
    const Tensor x = randn({2, 6, 16}), w = randn({2, 6, 16});
    auto loss = [&] {
      manual_seed(9);  // the same dropout masks on every call
      return dot(enc.forward(x, {}, {}, /*is_causal=*/true), w);
    };
    EncoderTape tape;
    manual_seed(9);
    enc.forward(x, {}, {}, true, nullptr, &tape);
    const EncoderGrads g = enc.backward(tape, w);
    const Tensor d = randn(x.shape());
    expect_close(dot(g.dsrc, d), directional(x, d, 1e-2, loss), "src");
    ASSERT_EQ(g.params.size(), enc.state_dict().size());
    for (const auto& [n, p] : enc.state_dict()) {
      const Tensor dp = randn(p.shape());
      expect_close(dot(testing::entry(g.params, n), dp), directional(p, dp, 1e-2, loss), n);
    }
  }
}

// The small causal LM `heads train-demo` trains: the gradient of its cross-entropy loss, for every
// parameter, is the loss's directional derivative.
TEST(Training, TinyCausalLMBackwardIsTheLossDerivative) {
  TinyLMOptions o;
  o.vocab = 7;
  o.max_len = 9;
  o.d_model = 12;
  o.nhead = 3;
  o.dim_feedforward = 20;
  o.num_layers = 2;
  TinyCausalLM lm(o, 4);
  Tensor ids = Tensor::empty({2, 9}, DType::I64), target = Tensor::empty({18}, DType::I64);
  for (int64_t i = 0; i < 18; ++i) {
    ids.data<int64_t>()[i] = static_cast<int64_t>(testing::rng()() % 7);
    target.data<int64_t>()[i] = i % 5 == 0 ? -100 : static_cast<int64_t>(testing::rng()() % 7);
  }
  auto loss = [&] { return cross_entropy(lm.forward(ids), target); };
  TinyCausalLM::Tape tape;
  const Tensor logits = lm.forward(ids, &tape);
  const StateDict g = lm.backward(tape, cross_entropy_backward(logits, target));
  ASSERT_EQ(g.size(), lm.state_dict().size());
  for (const auto& [n, p] : lm.state_dict()) {
    // The embeddings start near 0.02 and the first pre-norm LayerNorm divides by their spread: a
    // smaller step keeps the difference quotient in the region where the loss is smooth.
    const Tensor d = randn(p.shape());
    expect_close(dot(testing::entry(g, n), d), directional(p, d, n.find("_emb.") != std::string::npos ? 1e-3 : 1e-2, loss), n);
  }
  EXPECT_THAT(testing::error_of([&] { lm.forward(Tensor::zeros({1, 10}, DType::I64)); }),
              ::testing::HasSubstr("longer than max_len 9"));
}

TEST(Training, CrossEntropyAndEmbeddingBackward) {
  const Tensor logits = randn({9, 6}, 2.0);
  Tensor target = Tensor::empty({9}, DType::I64);
  for (int64_t i = 0; i < 9; ++i) target.data<int64_t>()[i] = i % 3 == 0 ? -100 : (i * 5) % 6;
  const Tensor d = randn(logits.shape());
  const double numeric = directional(logits, d, 1e-2, [&] { return cross_entropy(logits, target); });
  expect_close(dot(cross_entropy_backward(logits, target), d), numeric, "cross_entropy");

  const Tensor table = randn({5, 4});
  Tensor ids = Tensor::empty({2, 3}, DType::I64);
  for (int64_t i = 0; i < 6; ++i) ids.data<int64_t>()[i] = (i * 2) % 5;
  const Tensor w = randn({2, 3, 4}), dt = randn(table.shape());
  expect_close(dot(embedding_backward(w, ids, 5), dt),
               directional(table, dt, 1e-2, [&] { return dot(embedding(table, ids), w); }), "embedding");
  ids.data<int64_t>()[4] = 5;
  EXPECT_THROW(embedding(table, ids), Error);
}

TEST(Training, AdamWFollowsItsFormula) {
  Tensor p = Tensor::empty({3}, DType::F32), g = Tensor::empty({3}, DType::F32);
  const float p0[3] = {1.0f, -2.0f, 0.5f}, g0[3] = {0.5f, 0.25f, -4.0f};
  std::copy(p0, p0 + 3, p.data<float>());
  std::copy(g0, g0 + 3, g.data<float>());
  AdamWOptions o;
  o.lr = 0.1;
  o.weight_decay = 0.05;
  AdamW opt({{"p", p}}, o);
  opt.step({{"p", g}});
  opt.step({{"p", g}});
  for (int i = 0; i < 3; ++i) {  // float64 replay of two steps
    double x = p0[i], m = 0, v = 0;
    for (int t = 1; t <= 2; ++t) {
      x *= 1 - o.lr * o.weight_decay;
      m = o.beta1 * m + (1 - o.beta1) * g0[i];
      v = o.beta2 * v + (1 - o.beta2) * g0[i] * g0[i];
      const double mh = m / (1 - std::pow(o.beta1, t)), vh = v / (1 - std::pow(o.beta2, t));
      x -= o.lr * mh / (std::sqrt(vh) + o.eps);
    }
    EXPECT_NEAR(p.data<float>()[i], x, 1e-6) << i;
  }
  EXPECT_EQ(opt.steps(), 2);
  EXPECT_THROW(opt.step({{"q", g}}), Error);
  EXPECT_THROW(opt.step({{"p", randn({4})}}), Error);
}

}  // namespace
}  // namespace heads
