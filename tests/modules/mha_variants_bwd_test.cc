// mha_variants_bwd_test.cc — MultiheadAttention's variants (mha_variants.h) backward: gradients
// against the forward's directional derivative, gates on unbatched input, and an encoder layer with
// each variant training.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "common/testing.h"
#include "heads/encoder.h"
#include "heads/error.h"
#include "heads/linear_attention.h"
#include "heads/mha.h"
#include "common/mha_variants.h"

namespace heads {
namespace {

using testing::base;
using testing::Case;
using testing::cases;
using testing::compare;
using testing::directional;
using testing::dot;
using testing::make;
using testing::randn;

TEST(MhaVariants, BackwardIsTheForwardsDerivative) {
  std::vector<Case> all = cases();
  all.push_back({"head_dim 5 + bias_kv + zero_attn + gates(first)", [](MultiheadAttentionOptions& o) {
                   o.head_dim = 5, o.add_bias_kv = true, o.add_zero_attn = true, o.variant.head_gate = HeadGate::FirstToken;
                 }});
  all.push_back({"linear batch_first + gates(mean)", [](MultiheadAttentionOptions& o) {
                   o.variant.kind = AttentionKind::Linear, o.batch_first = true, o.variant.head_gate = HeadGate::MeanPool;
                 }});
  all.push_back({"linear causal + gates(first)", [](MultiheadAttentionOptions& o) {
                   o.variant.kind = AttentionKind::Linear, o.variant.head_gate = HeadGate::FirstToken;
                 }});
  all.push_back({"cross kdim/vdim + gates(mean) + head_dim 5", [](MultiheadAttentionOptions& o) {
                   o.kdim = 7, o.vdim = 9, o.head_dim = 5, o.variant.head_gate = HeadGate::MeanPool;
                 }});
  for (const Case& c : all) {
    MultiheadAttentionOptions o = base();
    c.set(o);
    // relu's kink (and rows whose features are all 0, whose output jumps from 0 when one turns
    // positive) defeats central differences; its backward is checked in linear_attention_test.
    o.variant.feature_map = FeatureMap::EluPlusOne;
    MultiheadAttention m = make(o, 5);
    const bool causal = (c.name.find("causal") != std::string::npos || c.name.find("window") != std::string::npos) &&
                        o.variant.head_gate != HeadGate::MeanPool;
    const Tensor q = randn({7, 2, 12});
    const Tensor k = o.kdim ? randn({7, 2, o.kdim}) : q, v = o.kdim ? randn({7, 2, o.vdim}) : q;
    MhaForwardArgs a;
    a.need_weights = false;
    a.is_causal = causal && o.add_bias_kv == false;
    const Tensor w = randn({7, 2, 12});
    auto loss = [&] { return dot(m.forward(q, k, v, a).first, w); };
    MhaTape tape;
    MhaForwardArgs at = a;
    at.tape = &tape;
    m.forward(q, k, v, at);
    const MhaGrads g = m.backward(tape, w);
    // elu + 1 has a jump in its second derivative at 0, which costs Richardson's extrapolation its
    // O(h⁴) error: a looser bound there (the float64 gradients against torch are in tests/python).
    const double tol = o.variant.kind == AttentionKind::Linear ? 2e-2 : 2e-3;
    auto close = [&](double analytic, double numeric, const std::string& what) {
      EXPECT_NEAR(analytic, numeric, tol * std::max(1.0, std::abs(numeric))) << c.name << ": " << what;
    };
    const Tensor dq_dir = randn(q.shape());
    close(dot(g.dquery, dq_dir), directional(q, dq_dir, 1e-2, loss), "query");
    if (o.kdim) {
      const Tensor dk_dir = randn(k.shape()), dv_dir = randn(v.shape());
      close(dot(g.dkey, dk_dir), directional(k, dk_dir, 1e-2, loss), "key");
      close(dot(g.dvalue, dv_dir), directional(v, dv_dir, 1e-2, loss), "value");
    }
    const StateDict sd = m.state_dict();
    ASSERT_EQ(g.params.size(), sd.size());
    for (size_t i = 0; i < g.params.size(); ++i) {
      const auto& [n, p] = sd[i];
      ASSERT_EQ(g.params[i].first, n);
      const Tensor d = randn(p.shape());
      close(dot(g.params[i].second, d), directional(p, d, 1e-2, loss), n);
    }
  }
}

TEST(MhaVariants, GateBackwardOnUnbatchedInput) {
  MultiheadAttentionOptions o = base();
  o.variant.head_gate = HeadGate::MeanPool;
  MultiheadAttention m = make(o, 8);
  const Tensor x = randn({6, 12}), w = randn({6, 12});
  MhaForwardArgs a;
  a.need_weights = false;
  auto loss = [&] { return dot(m.forward(x, x, x, a).first, w); };
  MhaTape tape;
  MhaForwardArgs at = a;
  at.tape = &tape;
  m.forward(x, x, x, at);
  const MhaGrads g = m.backward(tape, w);
  const Tensor d = randn(x.shape());
  const double num = directional(x, d, 1e-2, loss);
  EXPECT_NEAR(dot(g.dquery, d), num, 2e-3 * std::max(1.0, std::abs(num)));
  const StateDict sd = m.state_dict();
  for (size_t i = 0; i < sd.size(); ++i) {
    const Tensor dp = randn(sd[i].second.shape());
    const double n2 = directional(sd[i].second, dp, 1e-2, loss);
    EXPECT_NEAR(dot(g.params[i].second, dp), n2, 2e-3 * std::max(1.0, std::abs(n2))) << sd[i].first;
  }
}

// The backward follows the module's attention: a tape recorded by a module of the other kind is refused.
TEST(MhaVariants, TapeOfTheOtherAttentionKindIsAClearError) {
  MultiheadAttentionOptions o = base();
  MultiheadAttentionOptions lo = o;
  lo.variant.kind = AttentionKind::Linear;
  const MultiheadAttention softmax = make(o, 3), lin = make(lo, 3);
  const Tensor x = randn({5, 2, 12});
  MhaTape tape;
  MhaForwardArgs a;
  a.need_weights = false;
  a.tape = &tape;
  const Tensor y = softmax.forward(x, x, x, a).first;
  EXPECT_THAT(testing::error_of([&] { lin.backward(tape, y); }),
              ::testing::HasSubstr("the tape comes from a module with softmax attention, this one has linear attention"));
  EXPECT_TRUE(softmax.backward(tape, y).dquery.defined());
}

TEST(MhaVariants, EncoderLayerWithEachVariantTrains) {
  // The layer passes its variant to the self-attention; its backward is the forward's derivative.
  for (const Case& c : cases()) {
    MultiheadAttentionOptions probe = base();
    c.set(probe);
    if (probe.kdim != 0 || probe.head_dim != 0) continue;
    TransformerEncoderLayerOptions o;
    o.d_model = 12;
    o.nhead = 3;
    o.dim_feedforward = 16;
    o.dropout = 0.0;
    o.norm_first = true;
    o.activation = Activation::Gelu;  // smooth: relu's kinks defeat central differences
    o.attention = probe.variant;
    o.attention.feature_map = FeatureMap::EluPlusOne;
    TransformerEncoderLayer layer(o, 4);
    for (auto& [n, t] : layer.state_dict()) {
      if (n.find("head_gate") != std::string::npos) t.copy_from(randn(t.shape(), 0.5));
    }
    const Tensor x = randn({6, 2, 12}), w = randn({6, 2, 12});
    EncoderForwardArgs a;
    a.is_causal = probe.variant.head_gate != HeadGate::MeanPool;
    auto loss = [&] { return dot(layer.forward(x, a), w); };
    EncoderLayerTape tape;
    EncoderForwardArgs at = a;
    at.tape = &tape;
    layer.forward(x, at);
    const EncoderGrads g = layer.backward(tape, w);
    const double tol = o.attention.kind == AttentionKind::Linear ? 2e-2 : 2e-3;  // as in the test above
    const Tensor d = randn(x.shape());
    EXPECT_NEAR(dot(g.dsrc, d), directional(x, d, 1e-2, loss), tol * std::max(1.0, std::abs(dot(g.dsrc, d)))) << c.name;
    const StateDict sd = layer.state_dict();
    ASSERT_EQ(g.params.size(), sd.size());
    for (size_t i = 0; i < g.params.size(); ++i) {
      const auto& [n, p] = sd[i];
      const Tensor dp = randn(p.shape());
      const double num = directional(p, dp, 1e-2, loss);
      EXPECT_NEAR(dot(g.params[i].second, dp), num, tol * std::max(1.0, std::abs(num))) << c.name << ": " << n;
    }
  }
}

}  // namespace
}  // namespace heads
