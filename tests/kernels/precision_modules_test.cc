// precision_modules_test.cc — modules in reduced precision (heads/precision.h): MultiheadAttention in
// bf16 with every option, modules running their linear layers in the chosen precision (and back),
// and all-MiniLM-L6-v2's embeddings in bf16 and int8 against f32. The linear layers themselves:
// precision_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.h"
#include "heads/encoder.h"
#include "heads/mha.h"
#include "heads/ops.h"
#include "heads/precision.h"
#include "heads/sentence_encoder.h"

namespace heads {
namespace {

using ::testing::HasSubstr;
using testing::randn;

// A bf16 MultiheadAttention keeps q, k, v and the attention in bf16: every option (bias_k/v, a zero
// key, kdim/vdim, key_padding_mask, attn_mask, weights) stays within bf16's error of the f32 module.
TEST(Precision, Bf16MultiheadAttentionEveryOption) {
  testing::IsaGuard guard;
  MultiheadAttentionOptions o;
  o.embed_dim = 48;
  o.num_heads = 4;
  o.add_bias_kv = true;
  o.add_zero_attn = true;
  o.kdim = 40;
  o.vdim = 24;
  o.batch_first = true;
  MultiheadAttention m(o, 7);
  m.eval();
  const Tensor q = randn({2, 37, 48}), k = randn({2, 29, 40}), v = randn({2, 29, 24});
  MhaForwardArgs a;
  a.key_padding_mask = testing::rand_bool({2, 29}, 0.2);
  a.attn_mask = randn({37, 29});  // [L, S]: padded for bias_k and the zero key as torch does
  a.average_attn_weights = false;
  const auto [ref, ref_w] = m.forward(q, k, v, a);
  m.set_precision(Precision::BF16);
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    const auto [out, w] = m.forward(q, k, v, a);
    ASSERT_EQ(out.dtype(), DType::F32);
    const auto e = testing::compare(out, ref), ew = testing::compare(w, ref_w);
    EXPECT_GT(e.max_abs, 0.0) << isa_name(isa);
    EXPECT_LT(e.max_abs, 3e-2 * e.max_ref) << isa_name(isa);
    EXPECT_LT(ew.max_abs, 3e-2) << isa_name(isa);
    EXPECT_FALSE(e.nan || ew.nan) << isa_name(isa);
  }
  // Self-attention through the packed in_proj (q, k, v as strided bf16 views of one projection),
  // sequence-first layout (a strided bf16 attention buffer), unbatched input, causal.
  MultiheadAttentionOptions so;
  so.embed_dim = 32;
  so.num_heads = 4;
  MultiheadAttention self(so, 8);
  self.eval();
  const Tensor x = randn({19, 2, 32}), xu = randn({19, 32});
  MhaForwardArgs causal;
  causal.is_causal = true;
  causal.need_weights = false;
  const Tensor r1 = self.forward(x, x, x, causal).first, r2 = self.forward(xu, xu, xu, causal).first;
  self.set_precision(Precision::BF16);
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    const auto e1 = testing::compare(self.forward(x, x, x, causal).first, r1);
    const auto e2 = testing::compare(self.forward(xu, xu, xu, causal).first, r2);
    EXPECT_TRUE(e1.max_abs > 0 && e1.max_abs < 3e-2 * e1.max_ref && !e1.nan) << isa_name(isa) << " " << e1.max_abs;
    EXPECT_TRUE(e2.max_abs > 0 && e2.max_abs < 3e-2 * e2.max_ref && !e2.nan) << isa_name(isa) << " " << e2.max_abs;
  }
}

// Cross-attention through the packed in_proj_weight (q, k and v projected by its three parts, each
// laid out for the GEMM once and kept): close to the f32 module in bf16 and int8, the plain bits
// after pack_f32, and each call's bits those of the first (the parts made by it, then reused), for
// the query part and the key/value parts alike (a part mixed up shows against f32).
TEST(Precision, CrossAttentionThroughTheParts) {
  testing::IsaGuard guard;
  MultiheadAttentionOptions o;
  o.embed_dim = 40;  // not a multiple of 16
  o.num_heads = 4;
  o.batch_first = true;
  MultiheadAttention plain(o, 21);
  plain.eval();
  const Tensor q = randn({2, 5, 40}), k = randn({2, 13, 40}), v = randn({2, 13, 40});
  MhaForwardArgs a;
  a.need_weights = false;
  const Tensor ref = plain.forward(q, k, v, a).first;
  for (auto [p, tol] : {std::pair{Precision::F32, 0.0}, {Precision::BF16, 3e-2}, {Precision::Int8, 4e-2}}) {
    MultiheadAttention m = plain.clone();
    if (p == Precision::F32) {
      m.pack_f32();
    } else {
      m.set_precision(p);
    }
    for (Isa isa : supported_isas()) {
      set_isa(isa);
      const Tensor first = m.forward(q, k, v, a).first;
      EXPECT_TRUE(testing::bitwise_equal(m.forward(q, k, v, a).first, first)) << precision_name(p) << " " << isa_name(isa);
      const auto e = testing::compare(first, ref);
      if (p == Precision::F32) {
        EXPECT_TRUE(testing::bitwise_equal(first, plain.forward(q, k, v, a).first)) << isa_name(isa);
      } else {
        EXPECT_GT(e.max_abs, 0.0) << precision_name(p) << " " << isa_name(isa);
        EXPECT_LT(e.max_abs, tol * e.max_ref) << precision_name(p) << " " << isa_name(isa);
      }
      EXPECT_FALSE(e.nan) << precision_name(p) << " " << isa_name(isa);
    }
  }
}

// A module in reduced precision: close to its f32 output by the precision's step, back to f32 bits
// when set back, and re-packed when new weights are loaded.
TEST(Precision, ModulesRunTheirLinearLayersInTheChosenPrecision) {
  TransformerEncoderLayerOptions o;
  o.d_model = 64;
  o.nhead = 4;
  o.dim_feedforward = 96;
  o.dropout = 0.0;
  o.batch_first = true;
  TransformerEncoderLayer layer(o, 3);
  layer.eval();
  const Tensor x = randn({2, 9, 64});
  const Tensor ref = layer.forward(x);
  for (auto [p, tol] : {std::pair{Precision::BF16, 2e-2}, {Precision::Int8, 4e-2}}) {
    layer.set_precision(p);
    EXPECT_EQ(layer.precision(), p);
    const auto e = testing::compare(layer.forward(x), ref);
    EXPECT_GT(e.max_abs, 0.0) << precision_name(p);  // it did run in another precision
    EXPECT_LT(e.max_abs, tol * e.max_ref) << precision_name(p);
  }
  TransformerEncoderLayer other(o, 4);
  layer.load_state_dict(other.state_dict());  // int8 still in force: packed again from the new weights
  other.eval();
  other.set_precision(Precision::Int8);
  EXPECT_TRUE(testing::bitwise_equal(layer.forward(x), other.forward(x)));
  // A weight that cannot be packed (inf) fails the load and leaves the layer as it was.
  StateDict bad = TransformerEncoderLayer(o, 5).state_dict();
  for (auto& [n, t] : bad) {
    if (n == "linear2.weight") t.data<float>()[3] = std::numeric_limits<float>::infinity();
  }
  const Tensor before = layer.forward(x);
  EXPECT_THAT(testing::error_of([&] { layer.load_state_dict(bad); }), HasSubstr("holds NaN or inf"));
  EXPECT_TRUE(testing::bitwise_equal(layer.forward(x), before));
  EXPECT_EQ(layer.precision(), Precision::Int8);
  layer.set_precision(Precision::F32);
  other.set_precision(Precision::F32);
  EXPECT_TRUE(testing::bitwise_equal(layer.forward(x), other.forward(x)));
}

// pack_f32: the f32 weights read through the GEMM's own layout give the bits of the plain weights, on
// every path and every call (the layout is made at the first), the precision stays f32, and
// load_state_dict / set_precision replace it (new weights are seen, nothing stale is read).
TEST(Precision, F32WeightsInTheGemmsLayoutGiveThePlainBits) {
  testing::IsaGuard guard;
  TransformerEncoderLayerOptions o;
  o.d_model = 40;  // not a multiple of 16
  o.nhead = 4;
  o.dim_feedforward = 72;
  o.dropout = 0.0;
  o.batch_first = true;
  TransformerEncoderLayer plain(o, 11), layer(o, 11);
  plain.eval();
  layer.eval();
  layer.pack_f32();
  EXPECT_EQ(layer.precision(), Precision::F32);
  Tensor pad = Tensor::zeros({3, 7}, DType::Bool);
  static_cast<uint8_t*>(pad.raw_data())[6] = 1;
  EncoderForwardArgs a;
  a.src_key_padding_mask = pad;
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    for (int64_t L : {1, 7}) {
      const Tensor x = randn({3, L, 40});
      EncoderForwardArgs args = L == 7 ? a : EncoderForwardArgs{};
      const Tensor want = plain.forward(x, args);
      for (int call = 0; call < 2; ++call) {
        EXPECT_TRUE(testing::bitwise_equal(layer.forward(x, args), want)) << isa_name(isa) << " L " << L;
      }
    }
  }
  // The linear layer alone, with an activation, against the plain weight's.
  const Tensor w = randn({33, 40}), b = randn({33}), x = randn({5, 40});
  const PackedLinear pw = PackedLinear::f32_shared(w);
  EXPECT_EQ(pw.data().raw_data(), w.raw_data());  // shares the weight's storage
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    EXPECT_TRUE(testing::bitwise_equal(linear(x, pw, b, DType::F32, Activation::Gelu),
                                       activation(linear(x, w, b), Activation::Gelu)))
        << isa_name(isa);
  }
  EXPECT_THAT(testing::error_of([&] { PackedLinear::f32_shared(w.transpose(0, 1)); }),
              HasSubstr("expected a contiguous f32 [out, in] tensor"));
  EXPECT_THAT(testing::error_of([&] { PackedLinear::f32_shared(w.to(DType::BF16)); }), HasSubstr("bf16"));
  // New weights through load_state_dict: the layer computes with them (the packing is replaced).
  const Tensor x2 = randn({3, 7, 40});
  const TransformerEncoderLayer other(o, 12);
  layer.load_state_dict(other.state_dict());
  TransformerEncoderLayer other_plain = other.clone();
  other_plain.eval();
  EXPECT_TRUE(testing::bitwise_equal(layer.forward(x2), other_plain.forward(x2)));
  layer.pack_f32();
  EXPECT_TRUE(testing::bitwise_equal(layer.forward(x2), other_plain.forward(x2)));
  // In another precision pack_f32 does nothing; back in f32 the plain bits again.
  layer.set_precision(Precision::BF16);
  layer.pack_f32();
  EXPECT_EQ(layer.precision(), Precision::BF16);
  layer.set_precision(Precision::F32);
  EXPECT_TRUE(testing::bitwise_equal(layer.forward(x2), other_plain.forward(x2)));
}

// all-MiniLM-L6-v2 in bf16 and int8: embeddings within the cosine the issue asks for.
TEST(Precision, SentenceEmbeddingsStayCloseToF32) {
  const std::vector<std::string> texts = {
      "The cat sat on the mat.", "A quick brown fox jumps over the lazy dog near the river bank.",
      "Quantum chromodynamics describes the strong interaction between quarks and gluons.",
      "I'd like a coffee, please!", "Attention is all you need."};
  const Tensor f32 = SentenceEncoder::load(testing::model_dir()).encode(texts);
  for (auto [p, floor] : {std::pair{Precision::BF16, 0.9999}, {Precision::Int8, 0.999}}) {
    const SentenceEncoder enc = SentenceEncoder::load(testing::model_dir(), p);
    EXPECT_EQ(enc.precision(), p);
    const Tensor e = enc.encode(texts);
    for (int64_t i = 0; i < e.size(0); ++i) {
      double dot = 0;
      for (int64_t d = 0; d < e.size(1); ++d) dot += static_cast<double>(e.data<float>()[i * e.size(1) + d]) * f32.data<float>()[i * e.size(1) + d];
      EXPECT_GE(dot, floor) << precision_name(p) << " text " << i;  // unit rows: the cosine
      EXPECT_LT(dot, 1.0 - 1e-9) << precision_name(p) << " text " << i;
    }
  }
}

}  // namespace
}  // namespace heads
