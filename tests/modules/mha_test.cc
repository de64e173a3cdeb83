// mha_test.cc — MultiheadAttention: layouts, paths and state dicts agree with each other and
// with a float64 composition of the same math (PyTorch itself is checked in tests/python).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "common/testing.h"
#include "heads/encoder.h"
#include "heads/mha.h"
#include "heads/safetensors.h"
#include "heads/sdpa.h"

namespace heads {
namespace {

using ::testing::HasSubstr;
using testing::compare;
using testing::randn;

MultiheadAttention make(int64_t E, int64_t H, bool bias = true, bool bias_kv = false,
                        bool zero_attn = false, int64_t kdim = 0, int64_t vdim = 0,
                        bool batch_first = false) {
  MultiheadAttentionOptions o;
  o.embed_dim = E;
  o.num_heads = H;
  o.bias = bias;
  o.add_bias_kv = bias_kv;
  o.add_zero_attn = zero_attn;
  o.kdim = kdim;
  o.vdim = vdim;
  o.batch_first = batch_first;
  MultiheadAttention m(o, 11);
  // Non-zero biases so that they are exercised.
  for (auto& [name, t] : m.state_dict()) {
    if (name.find("bias") != std::string::npos) t.copy_from(randn(t.shape(), 0.5));
  }
  m.eval();
  return m;
}

// float64 composition: projections, then ref::sdpa_fwd_f64 per head, then out-projection.
Tensor reference(const MultiheadAttention& m, const Tensor& q_lne, const Tensor& k_lne,
                 const Tensor& v_lne) {
  const auto sd = m.state_dict();
  auto get = [&](const std::string& n) {
    for (const auto& [k, t] : sd) if (k == n) return t.to(DType::F64);
    return Tensor();
  };
  const int64_t E = m.options().embed_dim, H = m.options().num_heads, hd = E / H;
  const int64_t L = q_lne.size(0), N = q_lne.size(1), S = k_lne.size(0);
  Tensor w = get("in_proj_weight"), b = get("in_proj_bias");
  auto project = [&](const Tensor& x, int part, const char* sep) {  // -> [N, H, T, hd]
    const Tensor W = w.defined() ? w.slice(0, part * E, part * E + E) : get(sep);
    const int64_t T = x.size(0), K = x.size(2);
    Tensor y = Tensor::zeros({N, H, T, hd}, DType::F64);
    double* yp = y.data<double>();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t e = 0; e < E; ++e) {
          double acc = b.defined() ? b.item_as_double({part * E + e}) : 0.0;
          for (int64_t kk = 0; kk < K; ++kk) acc += W.item_as_double({e, kk}) * x.item_as_double({t, n, kk});
          yp[((n * H + e / hd) * T + t) * hd + e % hd] = acc;
        }
    return y;
  };
  const Tensor q = project(q_lne, 0, "q_proj_weight"), k = project(k_lne, 1, "k_proj_weight"),
               v = project(v_lne, 2, "v_proj_weight");
  const Tensor o = ref::sdpa_fwd_f64(q, k, v).out;  // [N, H, L, hd]
  const Tensor wo = get("out_proj.weight"), bo = get("out_proj.bias");
  Tensor out = Tensor::zeros({L, N, E}, DType::F64);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) {
        double acc = bo.defined() ? bo.item_as_double({e}) : 0.0;
        for (int64_t c = 0; c < E; ++c) acc += wo.item_as_double({e, c}) * o.item_as_double({n, c / hd, l, c % hd});
        out.data<double>()[(l * N + n) * E + e] = acc;
      }
  (void)S;
  return out;
}

// On every path (the portable one runs its own GEMMs, the SIMD ones oneDNN's).
TEST(MultiheadAttention, SelfAndCrossAttentionMatchFloat64Composition) {
  testing::IsaGuard guard;
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    for (bool bias : {true, false}) {
      const MultiheadAttention m = make(24, 4, bias);
      const Tensor x = randn({7, 3, 24}), kv = randn({5, 3, 24});
      MhaForwardArgs a;
      a.need_weights = false;
      const auto [self_out, w0] = m.forward(x, x, x, a);
      EXPECT_TRUE(compare(self_out, reference(m, x, x, x)).within(1e-5, 1e-6)) << "self bias=" << bias << " " << isa_name(isa);
      EXPECT_FALSE(w0.defined());
      const auto [cross_out, w1] = m.forward(x, kv, kv, a);
      EXPECT_TRUE(compare(cross_out, reference(m, x, kv, kv)).within(1e-5, 1e-6)) << "cross bias=" << bias << " " << isa_name(isa);
    }
    const MultiheadAttention m = make(16, 2, true, false, false, 9, 5);
    const Tensor q = randn({6, 2, 16}), k = randn({4, 2, 9}), v = randn({4, 2, 5});
    EXPECT_TRUE(compare(m.forward(q, k, v).first, reference(m, q, k, v)).within(1e-5, 1e-6)) << "kdim/vdim " << isa_name(isa);
  }
}

// A relative position bias [buckets, H] (MPNet's; T5's encoder) is the table's entry of each (query,
// key) pair's bucket added to the scaled scores: the same output as that bias written out as a float
// attn_mask [N·H, L, S], with and without a key padding mask; linear attention refuses it.
TEST(MultiheadAttention, RelativeAttentionBiasIsTheBucketedTableAddedToTheScores) {
  const int64_t H = 4, E = 24, N = 3, L = 7, buckets = 8, max_distance = 5;  // distances to 6: past max_distance
  const MultiheadAttention m = make(E, H, true);
  const Tensor x = randn({L, N, E}), table = randn({buckets, H});
  Tensor mask = Tensor::empty({N * H, L, L}, DType::F32);
  for (int64_t b = 0; b < N * H; ++b) {
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t j = 0; j < L; ++j) {
        const int64_t bucket = t5_relative_bucket(j - i, true, buckets, max_distance);
        mask.data<float>()[(b * L + i) * L + j] = table.data<float>()[bucket * H + b % H];
      }
    }
  }
  Tensor kpm = Tensor::zeros({N, L}, DType::Bool);
  static_cast<uint8_t*>(kpm.raw_data())[1 * L + 6] = 1;  // the last key of sequence 1 is padding
  for (const bool padded : {false, true}) {
    MhaForwardArgs rel, written;
    rel.need_weights = written.need_weights = false;
    rel.relative_attention_bias = table;
    rel.relative_attention_max_distance = max_distance;
    written.attn_mask = mask;
    if (padded) rel.key_padding_mask = written.key_padding_mask = kpm;
    const Tensor got = m.forward(x, x, x, rel).first, want = m.forward(x, x, x, written).first;
    EXPECT_TRUE(compare(got, want).within(1e-5, 1e-6)) << "padded=" << padded;
    EXPECT_FALSE(compare(got, m.forward(x, x, x, MhaForwardArgs{}).first).within(1e-3, 1e-3));  // it changes the output
  }
  MultiheadAttentionOptions o;
  o.embed_dim = E;
  o.num_heads = H;
  o.variant.kind = AttentionKind::Linear;
  MhaForwardArgs rel;
  rel.relative_attention_bias = table;
  EXPECT_THAT(testing::error_of([&] { MultiheadAttention(o, 1).forward(x, x, x, rel); }),
              HasSubstr("linear attention takes no relative_attention_bias"));
}

TEST(MultiheadAttention, LayoutsAgree) {
  const MultiheadAttention seq = make(32, 4);
  MultiheadAttention bf = make(32, 4, true, false, false, 0, 0, true);
  bf.load_state_dict(seq.state_dict());
  const Tensor x = randn({9, 2, 32});  // [L, N, E]
  MhaForwardArgs a;
  a.key_padding_mask = testing::rand_bool({2, 9}, 0.3);
  const auto [o1, w1] = seq.forward(x, x, x, a);
  const Tensor xb = x.transpose(0, 1).contiguous();
  const auto [o2, w2] = bf.forward(xb, xb, xb, a);
  EXPECT_TRUE(compare(o2.transpose(0, 1), o1).within(1e-6, 1e-7));
  EXPECT_TRUE(compare(w2, w1).within(1e-6, 1e-7));
  // Unbatched [L, E] equals batch of one.
  const Tensor u = randn({9, 32});
  MhaForwardArgs b;
  b.key_padding_mask = testing::rand_bool({9}, 0.3);
  const auto [ou, wu] = seq.forward(u, u, u, b);
  MhaForwardArgs b1 = b;
  b1.key_padding_mask = b.key_padding_mask.unsqueeze(0);
  const auto [o3, w3] = seq.forward(u.unsqueeze(1), u.unsqueeze(1), u.unsqueeze(1), b1);
  EXPECT_EQ(ou.shape(), Shape({9, 32}));
  EXPECT_EQ(wu.shape(), Shape({9, 9}));
  EXPECT_TRUE(compare(ou, o3.squeeze(1)).within(1e-6, 1e-7));
  // Self-attention (one fused projection) equals the same input passed as three tensors.
  const Tensor x2 = x.clone();
  const auto [o4, w4] = seq.forward(x, x2, x2.clone(), a);
  EXPECT_TRUE(compare(o4, o1).within(1e-6, 1e-7));
}

TEST(MultiheadAttention, InitialisationFollowsTorch) {
  MultiheadAttentionOptions o;
  o.embed_dim = 64;
  o.num_heads = 8;
  o.add_bias_kv = true;
  const MultiheadAttention m(o, 3);
  for (const auto& [name, t] : m.state_dict()) {
    double mx = 0, sum2 = 0;
    testing::for_each_index(t.shape(), [&](const Shape& i) {
      const double v = t.item_as_double(i);
      mx = std::max(mx, std::fabs(v));
      sum2 += v * v;
    });
    const double rms = std::sqrt(sum2 / static_cast<double>(t.numel()));
    if (name == "in_proj_weight") {
      const double bound = std::sqrt(6.0 / (64 + 192));
      EXPECT_LE(mx, bound);
      EXPECT_NEAR(rms, bound / std::sqrt(3.0), 0.05 * bound);
    } else if (name == "out_proj.weight") {
      EXPECT_LE(mx, 1.0 / 8.0);
      EXPECT_NEAR(rms, 1.0 / 8.0 / std::sqrt(3.0), 0.01);
    } else if (name == "bias_k" || name == "bias_v") {
      EXPECT_NEAR(rms, 1.0 / 8.0, 0.04);
    } else {
      EXPECT_EQ(mx, 0.0) << name;  // biases start at zero
    }
  }
}

// SkipInit: the seeded module's names and shapes, every value zero (norm weights one); loaded with
// a seeded module's state dict, the same module.
TEST(MultiheadAttention, SkipInitIsTheModuleZeroedUntilLoaded) {
  const auto check_zeroed = [](const StateDict& got, const StateDict& seeded) {
    ASSERT_EQ(got.size(), seeded.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const auto& [name, t] = got[i];
      EXPECT_EQ(name, seeded[i].first);
      EXPECT_EQ(t.shape(), seeded[i].second.shape()) << name;
      const double want = name.find("norm") != std::string::npos && name.find(".weight") != std::string::npos;
      for (int64_t j = 0; j < t.numel(); ++j) ASSERT_EQ(t.data<float>()[j], want) << name << "[" << j << "]";
    }
  };
  MultiheadAttentionOptions o;
  o.embed_dim = 12;
  o.num_heads = 3;
  o.kdim = 7;
  o.add_bias_kv = true;
  o.variant.head_gate = HeadGate::FirstToken;
  MultiheadAttention seeded(o, 3), skipped(o, SkipInit{});
  check_zeroed(skipped.state_dict(), seeded.state_dict());
  skipped.load_state_dict(seeded.state_dict());
  seeded.eval();
  skipped.eval();
  const Tensor q = randn({4, 2, 12}), k = randn({5, 2, 7}), v = randn({5, 2, 12});
  EXPECT_TRUE(testing::bitwise_equal(seeded.forward(q, k, v).first, skipped.forward(q, k, v).first));

  TransformerEncoderLayerOptions lo;
  lo.d_model = 16;
  lo.nhead = 4;
  lo.dim_feedforward = 24;
  lo.dropout = 0.0;
  TransformerEncoderLayer layer(lo, 4), skipped_layer(lo, SkipInit{});
  check_zeroed(skipped_layer.state_dict(), layer.state_dict());
  skipped_layer.load_state_dict(layer.state_dict());
  layer.eval();
  skipped_layer.eval();
  const Tensor x = randn({6, 2, 16});
  EXPECT_TRUE(testing::bitwise_equal(layer.forward(x), skipped_layer.forward(x)));
}

TEST(MultiheadAttention, StateDictRoundTripThroughSafetensors) {
  const MultiheadAttention m = make(12, 3, true, true, false, 7, 5);
  const auto path = (std::filesystem::temp_directory_path() / "heads_mha_rt.safetensors").string();
  m.save(path);
  MultiheadAttentionOptions o = m.options();
  MultiheadAttention m2(o, 99);
  m2.load(path);
  m2.eval();
  const Tensor q = randn({4, 2, 12}), k = randn({6, 2, 7}), v = randn({6, 2, 5});
  EXPECT_TRUE(testing::bitwise_equal(m.forward(q, k, v).first, m2.forward(q, k, v).first));
  std::vector<std::string> names;
  for (const auto& [n, t] : m2.state_dict()) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"q_proj_weight", "k_proj_weight", "v_proj_weight",
                                             "in_proj_bias", "bias_k", "bias_v", "out_proj.weight",
                                             "out_proj.bias"}));
  const MultiheadAttention m3 = MultiheadAttention::from_state_dict(load_safetensors(path), 3);
  EXPECT_EQ(m3.options().kdim, 7);
  EXPECT_EQ(m3.options().vdim, 5);
  EXPECT_TRUE(m3.options().add_bias_kv);
  std::filesystem::remove(path);
}

using testing::error_of;

// No keys (S = 0): every query sees nothing, attention gives zeros (DESIGN.md), so the output is
// out_proj's bias. Lq = 1 and 3 take the decode kernel, which once divided by a zero chunk size.
TEST(MultiheadAttention, NoKeysGiveTheOutputBias) {
  const MultiheadAttention m = make(8, 2);
  const Tensor bias = m.state_dict().back().second;  // out_proj.bias
  for (int64_t L : {1, 3, 9}) {
    const Tensor x = randn({L, 3, 8}), y = randn({0, 3, 8});
    const auto [out, weights] = m.forward(x, y, y);
    ASSERT_EQ(out.shape(), Shape({L, 3, 8}));
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t n = 0; n < 3; ++n) {
        for (int64_t e = 0; e < 8; ++e) {
          ASSERT_EQ(out.item_as_double({i, n, e}), bias.item_as_double({e})) << "L=" << L;
        }
      }
    }
    EXPECT_EQ(weights.shape(), Shape({3, L, 0}));
  }
}

TEST(MultiheadAttention, BadInputIsAClearError) {
  MultiheadAttentionOptions o;
  o.embed_dim = 10;
  o.num_heads = 3;
  EXPECT_THAT(error_of([&] { MultiheadAttention m(o); }),
              HasSubstr("embed_dim 10 is not divisible by num_heads 3"));
  o.embed_dim = int64_t{1} << 62;  // 3 * embed_dim would overflow
  o.num_heads = 1;
  EXPECT_THAT(error_of([&] { MultiheadAttention m(o); }),
              HasSubstr("embed_dim must be in [1, 16777216], got 4611686018427387904"));
  const MultiheadAttention m = make(8, 2);
  const Tensor x = randn({5, 2, 8});
  EXPECT_THAT(error_of([&] { m.forward(randn({5, 2, 6}), x, x); }),
              HasSubstr("query: expected embed_dim 8 in the last dim, got [5, 2, 6]"));
  EXPECT_THAT(error_of([&] { m.forward(x, randn({4, 2, 8}), x); }),
              HasSubstr("must have the same sequence length"));
  EXPECT_THAT(error_of([&] { m.forward(x, randn({5, 8}), x); }), HasSubstr("of the same rank"));
  MhaForwardArgs a;
  a.key_padding_mask = testing::rand_bool({2, 4}, 0.5);
  EXPECT_THAT(error_of([&] { m.forward(x, x, x, a); }),
              HasSubstr("key_padding_mask: expected [2, 5], got [2, 4]"));
  a = {};
  a.attn_mask = Tensor::zeros({5, 5}, DType::I64);
  EXPECT_THAT(error_of([&] { m.forward(x, x, x, a); }),
              HasSubstr("attn_mask: only bool and floating masks are supported, got i64"));
  a.attn_mask = testing::rand_bool({3, 5, 5}, 0.5);
  EXPECT_THAT(error_of([&] { m.forward(x, x, x, a); }),
              HasSubstr("attn_mask: expected [4, 5, 5] ([N * num_heads, L, S]), got [3, 5, 5]"));
  MultiheadAttention m2 = make(8, 2);
  auto sd = m.state_dict();
  sd.erase(sd.begin());
  EXPECT_THAT(error_of([&] { m2.load_state_dict(sd); }),
              HasSubstr("tensor \"in_proj_weight\" missing (have: in_proj_bias"));
  sd = m.state_dict();
  sd[0].second = randn({24, 7});
  EXPECT_THAT(error_of([&] { m2.load_state_dict(sd); }),
              HasSubstr("\"in_proj_weight\": expected shape [24, 8], got [24, 7]"));
}

}  // namespace
}  // namespace heads
