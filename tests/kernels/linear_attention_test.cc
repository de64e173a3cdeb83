// linear_attention_test.cc — linear attention against its float64 definition (the full matrix),
// its backward against finite differences of that definition, and the recurrent state against the
// causal call.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/testing.h"
#include "heads/linear_attention.h"
#include "heads/isa.h"
#include "heads/runtime.h"

namespace heads {
namespace {

using ::testing::HasSubstr;
using testing::error_of;
using testing::randn;

// Positive inputs (|x| + 0.1), which keep the denominators of the relu and identity maps away from 0.
Tensor shifted(const Shape& s) {
  Tensor t = randn(s);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = std::fabs(t.data<float>()[i]) + 0.1f;
  return t;
}

std::string name(FeatureMap fm) {
  return fm == FeatureMap::EluPlusOne ? "elu" : fm == FeatureMap::Relu ? "relu" : "identity";
}

// Padded keys (key_padding_mask) add nothing: forward against the definition on every path and across
// chunks; non-causal, the call equals one on the kept keys alone, gradients included (zero for the
// padded keys).
TEST(LinearAttention, KeyPaddingMask) {
  testing::IsaGuard guard;
  for (auto [B, H, L, D, Dv] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>>{
           {2, 2, 7, 5, 9}, {2, 3, 300, 16, 8}, {1, 1, 1, 4, 4}}) {
    Tensor mask = testing::rand_bool({B, L}, 0.3);
    auto* mp = static_cast<uint8_t*>(mask.raw_data());
    if (L > 1) mp[0] = 0, mp[L - 1] = 1;  // the first key kept, the last one padded
    for (FeatureMap fm : {FeatureMap::EluPlusOne, FeatureMap::Relu}) {
      for (bool causal : {false, true}) {
        LinearAttentionOptions o;
        o.feature_map = fm;
        o.causal = causal;
        o.key_padding_mask = mask;
        const Tensor q = shifted({B, H, L, D}), k = shifted({B, H, L, D}), v = randn({B, H, L, Dv});
        const Tensor want = ref::linear_attention_f64(q, k, v, o);
        for (Isa isa : supported_isas()) {
          set_isa(isa);
          const std::string where = name(fm) + (causal ? " causal" : "") + " L=" + std::to_string(L) + " " + isa_name(isa);
          const auto e = testing::compare(linear_attention(q, k, v, o), want);
          EXPECT_TRUE(e.within(1e-5, 1e-6)) << where << ": max err " << e.max_abs;
          if (causal) continue;
          // Non-causal: the same as the kept keys alone, per batch entry.
          const Tensor dout = randn({B, H, L, Dv});
          const LinearAttentionGrads g = linear_attention_backward(dout, q, k, v, o);
          for (int64_t b = 0; b < B; ++b) {
            std::vector<int64_t> kept;
            for (int64_t j = 0; j < L; ++j) {
              if (!mp[b * L + j]) kept.push_back(j);
            }
            const int64_t n = static_cast<int64_t>(kept.size());
            Tensor kb = Tensor::empty({1, H, n, D}, DType::F32), vb = Tensor::empty({1, H, n, Dv}, DType::F32);
            for (int64_t x = 0; x < n; ++x) {
              kb.slice(2, x, x + 1).copy_from(k.slice(0, b, b + 1).slice(2, kept[static_cast<size_t>(x)], kept[static_cast<size_t>(x)] + 1));
              vb.slice(2, x, x + 1).copy_from(v.slice(0, b, b + 1).slice(2, kept[static_cast<size_t>(x)], kept[static_cast<size_t>(x)] + 1));
            }
            LinearAttentionOptions plain = o;
            plain.key_padding_mask = Tensor();
            const Tensor qb = q.slice(0, b, b + 1).contiguous(), gb = dout.slice(0, b, b + 1).contiguous();
            const LinearAttentionGrads gk = linear_attention_backward(gb, qb, kb, vb, plain);
            EXPECT_TRUE(testing::compare(g.dq.slice(0, b, b + 1), gk.dq.to(DType::F64)).within(1e-5, 1e-6)) << where;
            for (int64_t j = 0, x = 0; j < L; ++j) {
              const Tensor dk = g.dk.slice(0, b, b + 1).slice(2, j, j + 1), dv = g.dv.slice(0, b, b + 1).slice(2, j, j + 1);
              if (mp[b * L + j]) {
                EXPECT_TRUE(testing::bitwise_equal(dk, Tensor::zeros(dk.shape(), DType::F32))) << where << " j=" << j;
                EXPECT_TRUE(testing::bitwise_equal(dv, Tensor::zeros(dv.shape(), DType::F32))) << where << " j=" << j;
              } else {
                EXPECT_TRUE(testing::compare(dk, gk.dk.slice(2, x, x + 1).to(DType::F64)).within(1e-5, 1e-6)) << where;
                EXPECT_TRUE(testing::compare(dv, gk.dv.slice(2, x, x + 1).to(DType::F64)).within(1e-5, 1e-6)) << where;
                ++x;
              }
            }
          }
        }
      }
    }
  }
  // Padded keys holding inf and NaN (in k and v) change nothing: forward and backward equal the call
  // on clean values, and their dk, dv are zero.
  for (bool causal : {false, true}) {
    const int64_t B = 2, H = 2, L = 150, D = 8, Dv = 6;
    Tensor mask = testing::rand_bool({B, L}, 0.25);
    auto* mp = static_cast<uint8_t*>(mask.raw_data());
    mp[0] = 0, mp[L] = 0, mp[7] = 1, mp[L + 130] = 1;
    LinearAttentionOptions o;
    o.causal = causal;
    o.key_padding_mask = mask;
    const Tensor q = randn({B, H, L, D}), k = randn({B, H, L, D}), v = randn({B, H, L, Dv}), dout = randn({B, H, L, Dv});
    Tensor k_bad = k.clone(), v_bad = v.clone();
    const float bad[3] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()};
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < L; ++j) {
        if (!mp[b * L + j]) continue;
        for (int64_t h = 0; h < H; ++h) {
          k_bad.data<float>()[((b * H + h) * L + j) * D + j % D] = bad[j % 3];
          v_bad.data<float>()[((b * H + h) * L + j) * Dv + j % Dv] = bad[(j + 1) % 3];
        }
      }
    }
    for (Isa isa : supported_isas()) {
      set_isa(isa);
      const std::string where = std::string(causal ? "causal " : "") + isa_name(isa);
      EXPECT_TRUE(testing::bitwise_equal(linear_attention(q, k_bad, v_bad, o), linear_attention(q, k, v, o))) << where;
      const LinearAttentionGrads g = linear_attention_backward(dout, q, k_bad, v_bad, o);
      const LinearAttentionGrads clean = linear_attention_backward(dout, q, k, v, o);
      EXPECT_TRUE(testing::bitwise_equal(g.dq, clean.dq)) << where;
      EXPECT_TRUE(testing::bitwise_equal(g.dk, clean.dk)) << where;
      EXPECT_TRUE(testing::bitwise_equal(g.dv, clean.dv)) << where;
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t j = 0; j < L; ++j) {
          if (!mp[b * L + j]) continue;
          const Tensor dk = g.dk.slice(0, b, b + 1).slice(2, j, j + 1), dv = g.dv.slice(0, b, b + 1).slice(2, j, j + 1);
          ASSERT_TRUE(testing::bitwise_equal(dk, Tensor::zeros(dk.shape(), DType::F32))) << where;
          ASSERT_TRUE(testing::bitwise_equal(dv, Tensor::zeros(dv.shape(), DType::F32))) << where;
        }
      }
    }
  }
  LinearAttentionOptions o;
  o.key_padding_mask = Tensor::zeros({2, 3}, DType::Bool);
  EXPECT_THAT(error_of([&] { linear_attention(randn({1, 1, 3, 4}), randn({1, 1, 3, 4}), randn({1, 1, 3, 4}), o); }),
              HasSubstr("key_padding_mask: expected bool [B, Lk] = [1, 3] (true = ignore the key), got bool [2, 3]"));
}

TEST(LinearAttention, MatchesDefinition) {
  testing::IsaGuard guard;
  for (auto [B, H, Lq, Lk, D, Dv] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>>{
           {1, 1, 1, 1, 1, 1}, {2, 3, 7, 7, 5, 9}, {1, 2, 129, 129, 63, 17}, {2, 1, 40, 200, 16, 16}, {1, 2, 7, 1, 8, 8}}) {
    for (FeatureMap fm : {FeatureMap::EluPlusOne, FeatureMap::Relu, FeatureMap::Identity}) {
      for (bool causal : {false, true}) {
        if (causal && Lq != Lk) continue;
        LinearAttentionOptions o;
        o.feature_map = fm;
        o.causal = causal;
        const bool pos = fm != FeatureMap::EluPlusOne;
        // q as a strided view (a projection's layout), k and v contiguous
        const Tensor qbuf = pos ? shifted({B, Lq, H, D + 3}) : randn({B, Lq, H, D + 3});
        const Tensor q = qbuf.slice(3, 0, D).permute({0, 2, 1, 3});
        const Tensor k = pos ? shifted({B, H, Lk, D}) : randn({B, H, Lk, D}), v = randn({B, H, Lk, Dv});
        const Tensor want = ref::linear_attention_f64(q, k, v, o);
        for (Isa isa : supported_isas()) {  // the chunks' products: each path's micro-kernels
          set_isa(isa);
          const auto e = testing::compare(linear_attention(q, k, v, o), want);
          EXPECT_TRUE(e.within(1e-5, 1e-6)) << name(fm) << (causal ? " causal" : "") << " Lq=" << Lq << " Lk=" << Lk
                                            << " D=" << D << " isa=" << isa_name(isa) << ": max err " << e.max_abs
                                            << " (ref max " << e.max_ref << ")";
        }
      }
    }
  }
}

double loss(const Tensor& q, const Tensor& k, const Tensor& v, const LinearAttentionOptions& o, const Tensor& G) {
  const Tensor out = ref::linear_attention_f64(q, k, v, o);
  double s = 0;
  for (int64_t i = 0; i < out.numel(); ++i) s += out.data<double>()[i] * G.data<double>()[i];
  return s;
}

TEST(LinearAttention, BackwardMatchesFiniteDifferences) {
  for (FeatureMap fm : {FeatureMap::EluPlusOne, FeatureMap::Relu, FeatureMap::Identity}) {
    for (bool causal : {false, true}) {
      LinearAttentionOptions o;
      o.feature_map = fm;
      o.causal = causal;
      const int64_t Lq = 5, Lk = causal ? 5 : 6;
      const bool pos = fm != FeatureMap::EluPlusOne;
      const Tensor q = (pos ? shifted({2, 2, Lq, 4}) : randn({2, 2, Lq, 4})).to(DType::F64).clone();
      const Tensor k = (pos ? shifted({2, 2, Lk, 4}) : randn({2, 2, Lk, 4})).to(DType::F64).clone();
      const Tensor v = randn({2, 2, Lk, 3}).to(DType::F64).clone();
      const Tensor G = randn({2, 2, Lq, 3}).to(DType::F64);
      const LinearAttentionGrads g = linear_attention_backward(G.to(DType::F32), q, k, v, o);
      for (const auto& [x, grad, what] : {std::tuple{&q, &g.dq, "dq"}, {&k, &g.dk, "dk"}, {&v, &g.dv, "dv"}}) {
        for (int64_t i = 0; i < x->numel(); ++i) {
          double* p = const_cast<Tensor*>(x)->data<double>() + i;
          const double save = *p, eps = 1e-6;
          *p = save + eps;
          const double up = loss(q, k, v, o, G);
          *p = save - eps;
          const double down = loss(q, k, v, o, G);
          *p = save;
          const double fd = (up - down) / (2 * eps);
          ASSERT_NEAR(grad->data<float>()[i], fd, 2e-4 * (1 + std::fabs(fd)))
              << name(fm) << (causal ? " causal " : " ") << what << "[" << i << "]";
        }
      }
    }
  }
}

TEST(LinearAttention, ChunkedBackwardOnLongSequences) {
  // Several chunks of 128 rows (and a ragged last one): random elements of each gradient against
  // central differences of the definition.
  std::mt19937_64 pick(7);
  const testing::Sample sample;  // under HEADS_TEST_SAMPLE, a share of the 72 probes (each two f64 losses)
  int n = 0;
  for (bool causal : {false, true}) {
    LinearAttentionOptions o;
    o.causal = causal;
    const int64_t L = 300;
    const Tensor q = randn({1, 2, L, 8}).to(DType::F64).clone(), k = randn({1, 2, L, 8}).to(DType::F64).clone(),
                 v = randn({1, 2, L, 6}).to(DType::F64).clone(), G = randn({1, 2, L, 6}).to(DType::F64);
    const LinearAttentionGrads g = linear_attention_backward(G.to(DType::F32), q, k, v, o);
    for (const auto& [x, grad, what] : {std::tuple{&q, &g.dq, "dq"}, {&k, &g.dk, "dk"}, {&v, &g.dv, "dv"}}) {
      for (int probe = 0; probe < 12; ++probe) {
        const int64_t i = static_cast<int64_t>(pick() % static_cast<uint64_t>(x->numel()));
        if (!sample(n++)) continue;
        double* p = const_cast<Tensor*>(x)->data<double>() + i;
        const double save = *p, eps = 1e-5;
        *p = save + eps;
        const double up = loss(q, k, v, o, G);
        *p = save - eps;
        const double down = loss(q, k, v, o, G);
        *p = save;
        const double fd = (up - down) / (2 * eps);
        ASSERT_NEAR(grad->data<float>()[i], fd, 2e-4 * (1 + std::fabs(fd))) << (causal ? "causal " : "") << what << "[" << i << "]";
      }
    }
  }
}

TEST(LinearAttention, RecurrentStateEqualsCausalRows) {
  const int64_t B = 2, H = 3, L = 300, D = 6, Dv = 5;  // across three chunks of the causal call
  const Tensor q = randn({B, H, L, D}), k = randn({B, H, L, D}), v = randn({B, H, L, Dv});
  LinearAttentionOptions o;
  o.causal = true;
  const Tensor full = linear_attention(q, k, v, o);
  LinearAttentionState st(B, H, D, Dv, FeatureMap::EluPlusOne);
  for (int64_t t = 0; t < L; ++t) {
    const Tensor out = st.step(q.select(2, t), k.select(2, t), v.select(2, t));
    EXPECT_TRUE(testing::compare(out, full.select(2, t).to(DType::F64)).within(1e-5, 1e-6)) << "step " << t;
  }
  EXPECT_EQ(st.length(), L);
}

TEST(LinearAttention, IndependentOfThreadCount) {
  const Tensor q = randn({3, 4, 50, 16}), k = randn({3, 4, 50, 16}), v = randn({3, 4, 50, 16}), g = randn({3, 4, 50, 16});
  LinearAttentionOptions o;
  o.causal = true;
  const int saved = get_num_threads();
  set_num_threads(1);
  const Tensor a = linear_attention(q, k, v, o);
  const LinearAttentionGrads ga = linear_attention_backward(g, q, k, v, o);
  set_num_threads(2);
  EXPECT_TRUE(testing::bitwise_equal(a, linear_attention(q, k, v, o)));
  const LinearAttentionGrads gb = linear_attention_backward(g, q, k, v, o);
  EXPECT_TRUE(testing::bitwise_equal(ga.dq, gb.dq) && testing::bitwise_equal(ga.dk, gb.dk) &&
              testing::bitwise_equal(ga.dv, gb.dv));
  set_num_threads(saved);
}

TEST(LinearAttention, NonFiniteValuesRespectCausality) {
  // inf in value row t: causal rows before t stay finite (forward, and dq in the backward), on every path
  testing::IsaGuard guard;
  const Tensor q = randn({1, 1, 200, 8}), k = randn({1, 1, 200, 8}), v = randn({1, 1, 200, 8}), g = randn({1, 1, 200, 8});
  v.data<float>()[150 * 8 + 3] = std::numeric_limits<float>::infinity();
  LinearAttentionOptions o;
  o.causal = true;
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    const Tensor out = linear_attention(q, k, v, o);
    const LinearAttentionGrads gr = linear_attention_backward(g, q, k, v, o);
    for (int64_t e = 0; e < 150 * 8; ++e) {
      ASSERT_TRUE(std::isfinite(out.data<float>()[e]) && std::isfinite(gr.dq.data<float>()[e]))
          << isa_name(isa) << " element " << e;
    }
    EXPECT_FALSE(std::isfinite(out.data<float>()[150 * 8 + 3])) << isa_name(isa);
  }
}

TEST(LinearAttention, BackwardOnEveryPath) {
  testing::IsaGuard guard;
  LinearAttentionOptions o;
  o.causal = true;
  const Tensor q = randn({1, 2, 260, 16}), k = randn({1, 2, 260, 16}), v = randn({1, 2, 260, 12}), g = randn({1, 2, 260, 12});
  set_isa(Isa::Scalar);
  const LinearAttentionGrads want = linear_attention_backward(g, q, k, v, o);
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    const LinearAttentionGrads got = linear_attention_backward(g, q, k, v, o);
    for (const auto& [a, b, name] : {std::tuple{&got.dq, &want.dq, "dq"}, {&got.dk, &want.dk, "dk"}, {&got.dv, &want.dv, "dv"}}) {
      EXPECT_TRUE(testing::compare(*a, b->to(DType::F64)).within(1e-5, 1e-5)) << isa_name(isa) << " " << name;
    }
  }
}

TEST(LinearAttention, Errors) {
  const Tensor q = randn({1, 2, 5, 8}), k = randn({1, 2, 6, 8}), v = randn({1, 2, 6, 4});
  LinearAttentionOptions o;
  o.causal = true;
  EXPECT_THAT(error_of([&] { linear_attention(q, k, v, o); }),
              HasSubstr("linear_attention: causal needs as many queries as keys, got Lq 5 and Lk 6"));
  EXPECT_THAT(error_of([&] { linear_attention(q, randn({1, 2, 6, 7}), v); }),
              HasSubstr("linear_attention: key: expected [B, H, Lk, D] = [1, 2, Lk, 8]"));
  EXPECT_THAT(error_of([] { feature_map_from_name("softmax"); }),
              HasSubstr("feature_map must be \"elu\", \"relu\" or \"identity\", got \"softmax\""));
  LinearAttentionState st(1, 2, 8, 4, FeatureMap::Relu);
  EXPECT_THAT(error_of([&] { st.step(randn({1, 2, 7}), randn({1, 2, 8}), randn({1, 2, 4})); }),
              HasSubstr("LinearAttentionState::step: query: expected [B, H, D] = [1, 2, 8], got [1, 2, 7]"));
}

}  // namespace
}  // namespace heads
