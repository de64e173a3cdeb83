// mha_variants_test.cc — MultiheadAttention's extensions: linear, local-window and block-sparse
// attention, per-head gates (soft, and skipped below a threshold), head_dim != embed_dim / num_heads
// and prune_heads. Each against a float64 composition of the same math; gradients against the
// forward's directional derivative (mha_variants_bwd_test.cc). (PyTorch formulas are checked in
// tests/python.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <tuple>

#include "common/testing.h"
#include "heads/encoder.h"
#include "heads/error.h"
#include "heads/linear_attention.h"
#include "heads/mha.h"
#include "heads/sdpa.h"
#include "common/mha_variants.h"

namespace heads {
namespace {

using ::testing::HasSubstr;
using testing::compare;
using testing::directional;
using testing::dot;
using testing::error_of;
using testing::randn;
using testing::Case;
using testing::base;
using testing::cases;
using testing::make;

Tensor get(const StateDict& sd, const std::string& n) {
  for (const auto& [k, t] : sd) {
    if (k == n) return t.to(DType::F64);
  }
  return Tensor();
}

// The module's math in float64 for [L, N, E] inputs (batch_first false): projections, heads, the
// variant's attention (ref::sdpa_fwd_f64 with the same options, or ref::linear_attention_f64), gates
// (zero below `threshold`), out-projection.
Tensor reference(const MultiheadAttention& m, const Tensor& xq, const Tensor& xk, const Tensor& xv, bool causal,
                 double threshold = 0.0) {
  const MultiheadAttentionOptions& o = m.options();
  const auto sd = m.state_dict();
  const int64_t E = o.embed_dim, H = o.num_heads, hd = o.head_dim, Ei = H * hd;
  const int64_t L = xq.size(0), N = xq.size(1);
  const Tensor w = get(sd, "in_proj_weight"), b = get(sd, "in_proj_bias");
  auto project = [&](const Tensor& x, int part, const char* sep) {  // -> [N, H, T, hd]
    const Tensor W = w.defined() ? w.slice(0, part * Ei, part * Ei + Ei) : get(sd, sep);
    const int64_t T = x.size(0), K = x.size(2);
    Tensor y = Tensor::zeros({N, H, T, hd}, DType::F64);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t e = 0; e < Ei; ++e) {
          double acc = b.defined() ? b.item_as_double({part * Ei + e}) : 0.0;
          for (int64_t kk = 0; kk < K; ++kk) acc += W.item_as_double({e, kk}) * x.item_as_double({t, n, kk});
          y.data<double>()[((n * H + e / hd) * T + t) * hd + e % hd] = acc;
        }
    return y;
  };
  const Tensor q = project(xq, 0, "q_proj_weight"), k = project(xk, 1, "k_proj_weight"),
               v = project(xv, 2, "v_proj_weight");
  const AttentionVariant& var = o.variant;
  Tensor att;
  if (var.kind == AttentionKind::Linear) {
    LinearAttentionOptions lo;
    lo.feature_map = var.feature_map;
    lo.causal = causal;
    att = ref::linear_attention_f64(q, k, v, lo);
  } else {
    SdpaOptions so;
    so.is_causal = causal;
    if (var.window >= 0) {
      so.window_left = var.window;
      if (!causal) so.window_right = var.window;
    }
    if (var.sparse_block > 0) {  // the fixed pattern, spelt out as an element mask
      const int64_t S = k.size(2);
      Tensor mask = Tensor::empty({L, S}, DType::Bool);
      auto* mp = static_cast<uint8_t*>(mask.raw_data());
      for (int64_t i = 0; i < L; ++i) {
        for (int64_t j = 0; j < S; ++j) {
          const int64_t qb = i / var.sparse_block, kb = j / var.sparse_block;
          const int64_t st = var.sparse_stride;
          mp[i * S + j] = kb == qb || kb % st == st - 1 || (qb % st == st - 1 && kb / st == qb / st);
        }
      }
      so.attn_mask = mask;
    }
    att = ref::sdpa_fwd_f64(q, k, v, so).out;  // [N, H, L, hd]
  }
  std::vector<double> gate(static_cast<size_t>(N * H), 1.0);
  if (var.head_gate != HeadGate::None) {
    const Tensor gw = get(sd, "head_gate.weight"), gb = get(sd, "head_gate.bias");
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t h = 0; h < H; ++h) {
        double z = gb.item_as_double({h});
        for (int64_t c = 0; c < E; ++c) {
          double pool = 0;
          if (var.head_gate == HeadGate::FirstToken) {
            pool = xq.item_as_double({0, n, c});
          } else {
            for (int64_t l = 0; l < L; ++l) pool += xq.item_as_double({l, n, c}) / static_cast<double>(L);
          }
          z += gw.item_as_double({h, c}) * pool;
        }
        const double g = 1.0 / (1.0 + std::exp(-z));
        gate[static_cast<size_t>(n * H + h)] = g < threshold ? 0.0 : g;
      }
    }
  }
  const Tensor wo = get(sd, "out_proj.weight"), bo = get(sd, "out_proj.bias");
  Tensor out = Tensor::zeros({L, N, E}, DType::F64);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) {
        double acc = bo.defined() ? bo.item_as_double({e}) : 0.0;
        for (int64_t c = 0; c < Ei; ++c) {
          acc += wo.item_as_double({e, c}) * att.item_as_double({n, c / hd, l, c % hd}) *
                 gate[static_cast<size_t>(n * H + c / hd)];
        }
        out.data<double>()[(l * N + n) * E + e] = acc;
      }
  return out;
}

TEST(MhaVariants, ForwardMatchesFloat64Composition) {
  testing::IsaGuard guard;
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    for (const Case& c : cases()) {
      MultiheadAttentionOptions o = base();
      c.set(o);
      MultiheadAttention m = make(o);
      m.eval();
      for (const bool causal : {false, true}) {
        if (causal && o.variant.head_gate == HeadGate::MeanPool) {  // the mean would see later tokens
          const Tensor x = randn({5, 2, 12});
          MhaForwardArgs a;
          a.is_causal = true;
          EXPECT_THAT(error_of([&] { m.forward(x, x, x, a); }), HasSubstr("head_gate mean pools every query token"));
          continue;
        }
        for (const int64_t L : {1, 7, 13}) {
          const Tensor x = randn({L, 2, 12});
          const Tensor k = randn({L, 2, o.kdim ? o.kdim : 12}), v = randn({L, 2, o.vdim ? o.vdim : 12});
          const bool self = o.kdim == 0;
          MhaForwardArgs a;
          a.need_weights = false;
          a.is_causal = causal;
          const Tensor out = self ? m.forward(x, x, x, a).first : m.forward(x, k, v, a).first;
          const Tensor want = self ? reference(m, x, x, x, causal) : reference(m, x, k, v, causal);
          const auto e = compare(out, want);
          EXPECT_TRUE(e.within(2e-5, 2e-6)) << c.name << " causal=" << causal << " L=" << L << " "
                                            << isa_name(isa) << ": max err " << e.max_abs;
        }
      }
      // batch_first and unbatched inputs give the same numbers.
      MultiheadAttentionOptions ob = o;
      ob.batch_first = true;
      MultiheadAttention mb = make(ob);
      mb.load_state_dict(m.state_dict());
      mb.eval();
      const Tensor x = randn({6, 2, 12});
      const Tensor k = randn({6, 2, o.kdim ? o.kdim : 12}), v = randn({6, 2, o.vdim ? o.vdim : 12});
      const Tensor& kk = o.kdim ? k : x;
      const Tensor& vv = o.kdim ? v : x;
      MhaForwardArgs a;
      a.need_weights = false;
      const Tensor seq_first = m.forward(x, kk, vv, a).first;
      const Tensor bf = mb.forward(x.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), a).first;
      EXPECT_TRUE(compare(bf.transpose(0, 1), seq_first.to(DType::F64)).within(1e-6, 1e-7)) << c.name;
      const Tensor un = m.forward(x.select(1, 1), kk.select(1, 1), vv.select(1, 1), a).first;
      EXPECT_TRUE(compare(un, seq_first.select(1, 1).to(DType::F64)).within(1e-6, 1e-7)) << c.name;
    }
  }
}

TEST(MhaVariants, AttentionWeightsOfEveryVariantGiveTheOutput) {
  // The returned weights W (per head) satisfy out_h = W_h V_h: checked through a module whose
  // projections are identities (so V_h is the input's columns of head h).
  for (const Case& c : cases()) {
    MultiheadAttentionOptions o = base();
    c.set(o);
    if (o.kdim != 0 || o.head_dim != 0 || o.variant.head_gate != HeadGate::None) continue;
    MultiheadAttention m = make(o);
    m.eval();
    for (auto& [n, t] : m.state_dict()) {
      if (n == "in_proj_weight") {
        Tensor eye = Tensor::zeros(t.shape(), DType::F32);
        for (int64_t r = 0; r < t.size(0); ++r) eye.data<float>()[r * 12 + r % 12] = 1.0f;
        t.copy_from(eye);
      } else if (n == "out_proj.weight") {
        Tensor eye = Tensor::zeros(t.shape(), DType::F32);
        for (int64_t r = 0; r < 12; ++r) eye.data<float>()[r * 12 + r] = 1.0f;
        t.copy_from(eye);
      } else {
        t.copy_from(Tensor::zeros(t.shape(), DType::F32));
      }
    }
    const Tensor x = randn({9, 1, 12});
    MhaForwardArgs a;
    a.average_attn_weights = false;
    a.is_causal = true;
    const auto [out, w] = m.forward(x, x, x, a);  // w [1, H, L, L]
    ASSERT_TRUE(w.defined()) << c.name;
    for (int64_t h = 0; h < 3; ++h) {
      for (int64_t i = 0; i < 9; ++i) {
        for (int64_t d = 0; d < 4; ++d) {
          double acc = 0;
          for (int64_t j = 0; j < 9; ++j) acc += w.item_as_double({0, h, i, j}) * x.item_as_double({j, 0, h * 4 + d});
          EXPECT_NEAR(out.item_as_double({i, 0, h * 4 + d}), acc, 1e-5) << c.name;
          if (i < 8) EXPECT_EQ(w.item_as_double({0, h, i, i + 1}), 0.0) << c.name << ": causal";
        }
      }
    }
  }
}

TEST(MhaVariants, GatesBelowTheThresholdSkipTheirHeads) {
  for (const AttentionKind kind : {AttentionKind::Softmax, AttentionKind::Linear}) {
    MultiheadAttentionOptions o = base();
    o.num_heads = 4;
    o.variant.kind = kind;
    o.variant.head_gate = HeadGate::FirstToken;
    o.variant.gate_threshold = 0.5;
    MultiheadAttention m = make(o);
    const Tensor x = randn({8, 5, 12});
    MhaForwardArgs a;
    a.need_weights = false;
    // Training mode: soft gates, nothing skipped.
    const Tensor soft = m.forward(x, x, x, a).first;
    EXPECT_TRUE(compare(soft, reference(m, x, x, x, false, 0.0)).within(2e-5, 2e-6));
    m.eval();
    const Tensor g = m.head_gates(x);  // [N, H]
    int64_t off = 0;
    for (int64_t e = 0; e < g.numel(); ++e) off += g.data<float>()[e] < 0.5f;
    ASSERT_GT(off, 0) << "the random weights should turn some heads off";
    ASSERT_LT(off, g.numel());
    const Tensor hard = m.forward(x, x, x, a).first;
    EXPECT_TRUE(compare(hard, reference(m, x, x, x, false, 0.5)).within(2e-5, 2e-6));
    // Thresholds 0 and 1 bracket it: every head, and none (the output is then out_proj.bias alone).
    MultiheadAttentionOptions none = o;
    none.variant.gate_threshold = 1.0;
    MultiheadAttention m1 = make(none);
    m1.load_state_dict(m.state_dict());
    m1.eval();
    const Tensor only_bias = m1.forward(x, x, x, a).first;
    for (const auto& [n, t] : m.state_dict()) {
      if (n != "out_proj.bias") continue;
      for (int64_t r = 0; r < 8 * 5; ++r) {
        for (int64_t e = 0; e < 12; ++e) {
          ASSERT_EQ(only_bias.data<float>()[r * 12 + e], t.data<float>()[e]) << "every head off";
        }
      }
    }
  }
}

TEST(MhaVariants, PruneHeadsRemovesExactlyThoseHeads) {
  for (const bool gates : {false, true}) {
    MultiheadAttentionOptions o = base();
    o.num_heads = 4;
    o.add_bias_kv = true;
    if (gates) o.variant.head_gate = HeadGate::MeanPool;
    MultiheadAttention m = make(o);
    m.eval();
    MultiheadAttention pruned = m;
    pruned.prune_heads({2, 0, 2});
    EXPECT_EQ(pruned.options().num_heads, 2);
    EXPECT_EQ(pruned.options().head_dim, 3);
    // The original with heads 0 and 2 silenced through their out_proj columns.
    MultiheadAttention silenced = make(o);
    silenced.load_state_dict(m.state_dict());
    silenced.eval();
    for (auto& [n, t] : silenced.state_dict()) {
      if (n != "out_proj.weight") continue;
      for (int64_t e = 0; e < 12; ++e) {
        for (int64_t c : {0, 1, 2, 6, 7, 8}) t.data<float>()[e * 12 + c] = 0.0f;
      }
    }
    const Tensor x = randn({7, 3, 12});
    MhaForwardArgs a;
    a.need_weights = false;
    const Tensor want = silenced.forward(x, x, x, a).first, got = pruned.forward(x, x, x, a).first;
    EXPECT_TRUE(compare(got, want.to(DType::F64)).within(1e-5, 1e-6)) << "gates=" << gates;
    for (const auto& [n, t] : pruned.state_dict()) {
      if (n == "in_proj_weight") EXPECT_EQ(t.shape(), (Shape{18, 12}));
      if (n == "out_proj.weight") EXPECT_EQ(t.shape(), (Shape{12, 6}));
      if (n == "bias_k") EXPECT_EQ(t.shape(), (Shape{1, 1, 6}));
      if (n == "head_gate.weight") EXPECT_EQ(t.shape(), (Shape{2, 12}));
    }
    // A pruned state dict loads into a module built from it.
    const MultiheadAttention back =
        MultiheadAttention::from_state_dict(pruned.state_dict(), 2, false, false, pruned.options().variant);
    EXPECT_EQ(back.options().head_dim, 3);
    EXPECT_TRUE(testing::bitwise_equal(back.forward(x, x, x, a).first, got));
    if (gates) {
      EXPECT_THAT(error_of([&] { MultiheadAttention::from_state_dict(pruned.state_dict(), 2); }),
                  HasSubstr("the state dict has head gates (head_gate.weight): pass the variant's head_gate"));
    }
    EXPECT_THAT(error_of([&] { pruned.prune_heads({0, 1}); }), HasSubstr("removing all 2 heads would leave no attention"));
    EXPECT_THAT(error_of([&] { pruned.prune_heads({2}); }), HasSubstr("prune_heads: head 2 is out of range for 2 heads"));
  }
  // Through an encoder: layer 1 loses a head, layer 0 keeps its four.
  TransformerEncoderLayerOptions lo;
  lo.d_model = 8;
  lo.nhead = 4;
  lo.dim_feedforward = 16;
  lo.dropout = 0.0;
  TransformerEncoder enc(lo, 2, false, 3);
  enc.prune_heads({{1, {3}}});
  EXPECT_EQ(enc.layer(0).self_attn().options().num_heads, 4);
  EXPECT_EQ(enc.layer(1).self_attn().options().num_heads, 3);
  EXPECT_EQ(enc.forward(randn({5, 2, 8})).shape(), (Shape{5, 2, 8}));
  EXPECT_THAT(error_of([&] { enc.prune_heads({{2, {0}}}); }), HasSubstr("layer 2 is out of range for 2 layers"));
}

TEST(MhaVariants, BadOptionsAreClearErrors) {
  auto err = [](const std::function<void(MultiheadAttentionOptions&)>& set) {
    MultiheadAttentionOptions o = base();
    set(o);
    return error_of([&] { MultiheadAttention m(o, 1); });
  };
  EXPECT_THAT(err([](MultiheadAttentionOptions& o) { o.variant.window = -2; }),
              HasSubstr("window must be -1 (every key) or >= 0, got -2"));
  EXPECT_THAT(err([](MultiheadAttentionOptions& o) { o.variant.sparse_stride = 0; }),
              HasSubstr("sparse_stride must be at least 1, got 0"));
  EXPECT_THAT(err([](MultiheadAttentionOptions& o) { o.variant.gate_threshold = 1.5; }),
              HasSubstr("gate_threshold must be in [0, 1], got 1.5"));
  EXPECT_THAT(err([](MultiheadAttentionOptions& o) {
                o.variant.kind = AttentionKind::Linear;
                o.variant.window = 4;
              }),
              HasSubstr("linear attention takes neither"));
  EXPECT_THAT(err([](MultiheadAttentionOptions& o) {
                o.variant.kind = AttentionKind::Linear;
                o.dropout = 0.1;
              }),
              HasSubstr("linear attention has none to drop"));
  EXPECT_THAT(err([](MultiheadAttentionOptions& o) { o.num_heads = 5; }),
              HasSubstr("embed_dim 12 is not divisible by num_heads 5"));
  EXPECT_THAT(err([](MultiheadAttentionOptions& o) { o.head_dim = -1; }), HasSubstr("head_dim must be in [1, "));
  MultiheadAttentionOptions o = base();
  o.num_heads = 5;
  o.head_dim = 2;  // 5 heads of 2: fine with an explicit head_dim
  EXPECT_NO_THROW(MultiheadAttention(o, 1));
  o = base();
  o.variant.kind = AttentionKind::Linear;
  MultiheadAttention m(o, 1);
  const Tensor x = randn({4, 1, 12});
  MhaForwardArgs a;
  a.attn_mask = Tensor::zeros({4, 4}, DType::Bool);
  EXPECT_THAT(error_of([&] { m.forward(x, x, x, a); }), HasSubstr("linear attention takes no attn_mask"));
  a = MhaForwardArgs{};
  a.key_padding_mask = Tensor::zeros({1, 4}, DType::F32);
  EXPECT_THAT(error_of([&] { m.forward(x, x, x, a); }), HasSubstr("linear attention takes a bool mask"));
  EXPECT_THAT(err([](MultiheadAttentionOptions& o) {
                o.variant.window = 3;
                o.add_bias_kv = true;
              }),
              HasSubstr("window and sparse_block place keys by position"));
  o = base();
  o.variant.kind = AttentionKind::Linear;
  o.add_zero_attn = true;
  MultiheadAttention lz(o, 1);
  MhaForwardArgs ac;
  ac.is_causal = true;
  EXPECT_THAT(error_of([&] { lz.forward(x, x, x, ac); }),
              HasSubstr("causal linear attention needs as many keys as queries, got 4 queries and 5 keys (with the "
                        "appended bias_k / zero keys)"));
  EXPECT_THAT(error_of([] { attention_kind_from_name("cosine"); }),
              HasSubstr("attention must be \"softmax\" or \"linear\", got \"cosine\""));
  EXPECT_THAT(error_of([] { head_gate_from_name("max"); }), HasSubstr("head_gate must be \"none\", \"first\" or \"mean\""));
}

}  // namespace
}  // namespace heads
