// decoder_ops_test.cc — RoPE, RMSNorm, gated activations and the KV cache against plain float64
// formulas.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.h"
#include "heads/kv_cache.h"
#include "heads/ops.h"
#include "heads/sdpa.h"

namespace heads {
namespace {

using ::testing::HasSubstr;
using testing::error_of;
using testing::randn;

TEST(Rope, MatchesReferenceForEveryLayoutAndScaling) {
  for (bool interleaved : {false, true}) {
    for (int64_t D : {2, 8, 62, 128}) {
      for (auto scaling : {RopeOptions::Scaling::None, RopeOptions::Scaling::Linear, RopeOptions::Scaling::Llama3}) {
        RopeOptions o;
        o.interleaved = interleaved;
        o.scaling = scaling;
        o.factor = 4.0;
        o.original_max_position = 64;
        o.theta = 5000.0;
        o.rotary_dim = D >= 8 ? D - 2 * (D % 4 == 0) : 0;  // partial rotary where D allows
        // q as a strided view of a [B, L, H, D + 3] projection buffer
        const Tensor buf = randn({2, 7, 3, D + 3});
        const Tensor x = buf.slice(3, 0, D).permute({0, 2, 1, 3});
        const Tensor want = ref::rope_f64(x, 1000, o);
        const Tensor orig = x.clone(), pad = buf.slice(3, D, D + 3).clone();
        rope_(x, 1000, o);
        const auto e = testing::compare(x, want);
        EXPECT_TRUE(e.within(1e-5, 1e-5)) << "interleaved=" << interleaved << " D=" << D << " max err " << e.max_abs;
        const Tensor back = x.clone();
        rope_(back, 1000, o, /*inverse=*/true);  // the backward: turned back to the input
        EXPECT_TRUE(testing::compare(back, orig.to(DType::F64)).within(1e-5, 1e-5));
        // the buffer's other channels (past D) are not touched
        EXPECT_TRUE(testing::bitwise_equal(buf.slice(3, D, D + 3).contiguous(), pad));
      }
    }
  }
}

TEST(Rope, FrequenciesAsTransformers) {
  // 1 / theta^(2i / d), and linear scaling divides by the factor (independent of rope_inv_freq's code)
  RopeOptions o;
  o.theta = 500000.0;
  const Tensor f = rope_inv_freq(64, o);
  for (int64_t i = 0; i < 32; ++i) {
    const double want = 1.0 / std::pow(500000.0, 2.0 * i / 64.0);
    EXPECT_NEAR(f.data<float>()[i], want, 2e-7 * want) << i;
  }
  o.scaling = RopeOptions::Scaling::Linear;
  o.factor = 4.0;
  EXPECT_NEAR(rope_inv_freq(64, o).data<float>()[3], 1.0 / std::pow(500000.0, 6.0 / 64.0) / 4.0, 1e-7);
  // llama3: high frequencies (wavelength below original / high_freq_factor) kept, low ones divided
  o.scaling = RopeOptions::Scaling::Llama3;
  o.factor = 8.0, o.low_freq_factor = 1.0, o.high_freq_factor = 4.0, o.original_max_position = 8192;
  const Tensor l3 = rope_inv_freq(64, o);
  EXPECT_FLOAT_EQ(l3.data<float>()[0], 1.0f);
  const double low = 1.0 / std::pow(500000.0, 62.0 / 64.0);  // wavelength 2π/low far above 8192
  EXPECT_NEAR(l3.data<float>()[31], low / 8.0, 1e-6 * low);
}

TEST(Rope, Bf16InPlaceAndErrors) {
  const Tensor x = randn({1, 2, 5, 16});
  const Tensor xb = x.to(DType::BF16);
  RopeOptions o;
  rope_(xb, 3, o);
  const Tensor want = ref::rope_f64(x.to(DType::BF16), 3, o);
  EXPECT_TRUE(testing::compare(xb, want).within(1e-2, 1e-2));
  EXPECT_THAT(error_of([&] { rope_(randn({2, 5, 16}), 0, o); }), HasSubstr("rope: input: expected [B, H, L, D], got [2, 5, 16]"));
  o.rotary_dim = 7;
  EXPECT_THAT(error_of([&] { rope_(x, 0, o); }), HasSubstr("rotary_dim 7 must be even, at least 2 and at most D = 16"));
  o.rotary_dim = 0;
  EXPECT_THAT(error_of([&] { rope_(x, -1, o); }), HasSubstr("position_offset must be >= 0, got -1"));
}

TEST(RmsNorm, MatchesFloat64AndGivesTheSameBitsOnEveryPath) {
  testing::IsaGuard guard;
  for (int64_t n : {1, 7, 16, 37, 129, 768}) {
    Tensor x = randn({3, 5, n}, 3.0);
    x.data<float>()[n / 2] = 4e4f;  // a large channel in row 0 (as trained decoders' residual streams have)
    const Tensor w = randn({n});
    for (bool unit : {false, true}) {
      Tensor first;
      for (Isa isa : testing::test_isas()) {
        set_isa(isa);
        const Tensor y = rms_norm(x, w, 1e-6, unit);
        for (int64_t r = 0; r < 15; ++r) {
          double ss = 0;
          for (int64_t i = 0; i < n; ++i) ss += std::pow(static_cast<double>(x.data<float>()[r * n + i]), 2);
          const double inv = 1 / std::sqrt(ss / static_cast<double>(n) + 1e-6);
          for (int64_t i = 0; i < n; ++i) {
            const double want = x.data<float>()[r * n + i] * inv * (w.data<float>()[i] + (unit ? 1 : 0));
            ASSERT_NEAR(y.data<float>()[r * n + i], want, 1e-6 * (1 + std::fabs(want)))
                << "n " << n << " row " << r << " i " << i << " " << isa_name(isa);
          }
        }
        if (!first.defined()) {
          first = y;
        } else {
          ASSERT_EQ(std::memcmp(first.data<float>(), y.data<float>(), static_cast<size_t>(y.numel()) * 4), 0)
              << "n " << n << ": " << isa_name(isa) << " differs from " << isa_name(testing::test_isas().front());
        }
      }
    }
  }
  EXPECT_THAT(error_of([&] { rms_norm(randn({2, 37}), randn({36}), 1e-6); }), HasSubstr("rms_norm: weight: expected [37]"));
}

TEST(GatedActivation, SiluGeluAndTanhGeluMatchFloat64OnEveryPath) {
  testing::IsaGuard guard;
  // The tanh form's reference as ½x(1 + tanh(u)) = x / (1 + e^{-2u}): 1 + tanh(u) cancels in double too
  // far below zero (1% off at x = -6.8).
  for (int64_t F : {1, 7, 19, 129, 2048}) {
    Tensor gu = randn({4, 2 * F}, 3.0);
    float* g = gu.data<float>();
    const float extremes[] = {-200.0f, -88.0f, -30.0f, -1e-30f, 0.0f, -0.0f, 1e-30f, 30.0f, 88.0f, 200.0f};
    for (int64_t i = 0; i < std::min<int64_t>(F, 10); ++i) g[2 * F + i] = extremes[i];  // gates of row 1
    for (Isa isa : testing::test_isas()) {
      set_isa(isa);
      for (GatedAct act : {GatedAct::Silu, GatedAct::GeluTanh, GatedAct::Gelu}) {
        const Tensor y = gated_activation(gu, act);
        ASSERT_EQ(y.shape(), Shape({4, F}));
        for (int64_t r = 0; r < 4; ++r) {
          for (int64_t i = 0; i < F; ++i) {
            const double x = g[r * 2 * F + i], u = g[r * 2 * F + F + i];
            const double t = 2 * std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x);
            const double a = act == GatedAct::Silu   ? x / (1 + std::exp(-x))
                             : act == GatedAct::Gelu ? 0.5 * x * std::erfc(-x / std::sqrt(2.0))
                                                     : x / (1 + std::exp(-t));
            // e^v in f32 carries a relative error of a few epsilons of f32 times |v| (v's own rounding):
            // v = -x for SiLU, about -x²/2 for GELU's erf (Ops.ActivationsMatchFloat64's 2.5e-7·x²), -t
            // for its tanh form
            const double v = act == GatedAct::Silu ? x : act == GatedAct::Gelu ? x * x / 2 : t;
            ASSERT_NEAR(y.data<float>()[r * F + i], a * u, (2e-6 + 5e-7 * std::fabs(v)) * std::fabs(a * u) + 1e-37)
                << "F " << F << " row " << r << " i " << i << " gate " << x << " up " << u << " " << isa_name(isa)
                << " act " << static_cast<int>(act);
          }
        }
      }
    }
  }
  EXPECT_THAT(error_of([&] { gated_activation(randn({3, 5}), GatedAct::Silu); }), HasSubstr("expected [..., 2F]"));
}

TEST(KVCache, AppendGrowTruncateReorder) {
  KVCache c(2, 2, 3, 8, DType::F32);
  const Tensor k1 = randn({2, 3, 5, 8}), v1 = randn({2, 3, 5, 8});
  auto [K, V] = c.append(0, k1, v1);
  EXPECT_EQ(K.shape(), Shape({2, 3, 5, 8}));
  EXPECT_TRUE(testing::bitwise_equal(K.contiguous(), k1));
  // grow past the first capacity (16) in steps
  for (int s = 0; s < 20; ++s) c.append(0, randn({2, 3, 1, 8}), randn({2, 3, 1, 8}));
  EXPECT_EQ(c.length(), 25);
  EXPECT_GE(c.capacity(), 25);
  EXPECT_TRUE(testing::bitwise_equal(c.keys(0).slice(2, 0, 5).contiguous(), k1));  // kept across growth
  c.reorder({1, 0});
  EXPECT_TRUE(testing::bitwise_equal(c.values(0).slice(2, 0, 5).select(0, 0).contiguous(), v1.select(0, 1).contiguous()));
  c.truncate(4);
  EXPECT_EQ(c.length(), 4);
  EXPECT_EQ(c.length(1), 0);
  KVCache b(1, 1, 1, 4, DType::BF16);
  const Tensor kb = randn({1, 1, 3, 4});
  b.append(0, kb, kb);
  EXPECT_TRUE(testing::compare(b.keys(0).to(DType::F32), kb.to(DType::BF16).to(DType::F32)).within(0, 0));
  EXPECT_THAT(error_of([&] { c.append(2, k1, v1); }), HasSubstr("KVCache::append: layer 2 outside [0, 2)"));
  EXPECT_THAT(error_of([&] { KVCache(1, 1, 1, 4, DType::I64); }), HasSubstr("KVCache: dtype must be f32, bf16 or i8, got i64"));
  EXPECT_FALSE(c.key_scales(0).defined());
}

// int8: each appended row quantised with its own scale (quantize_kv), kept across growth, reorder
// and truncation with its scale; a row with a NaN fails the append and leaves the cache as it was.
TEST(KVCache, Int8RowsWithScales) {
  KVCache c(2, 2, 3, 9, DType::I8, 0, 5);
  const Tensor k1 = randn({2, 3, 4, 9}, 3.0), v1 = randn({2, 3, 4, 5});
  const auto [K, V] = c.append(1, k1, v1);
  ASSERT_EQ(K.dtype(), DType::I8);
  ASSERT_EQ(V.shape(), Shape({2, 3, 4, 5}));
  const Int8Rows qk = quantize_kv(k1), qv = quantize_kv(v1);
  EXPECT_TRUE(testing::bitwise_equal(K.contiguous(), qk.values));
  EXPECT_TRUE(testing::bitwise_equal(c.key_scales(1).contiguous(), qk.scales));
  EXPECT_TRUE(testing::bitwise_equal(c.value_scales(1).contiguous(), qv.scales));
  std::vector<Tensor> steps;
  for (int s = 0; s < 20; ++s) {  // past the first capacity (16)
    steps.push_back(randn({2, 3, 1, 9}));
    c.append(1, steps.back(), randn({2, 3, 1, 5}));
  }
  EXPECT_EQ(c.length(1), 24);
  EXPECT_TRUE(testing::bitwise_equal(c.keys(1).slice(2, 0, 4).contiguous(), qk.values));  // kept across growth
  EXPECT_TRUE(testing::bitwise_equal(c.key_scales(1).slice(2, 0, 4).contiguous(), qk.scales));
  EXPECT_TRUE(testing::bitwise_equal(c.key_scales(1).slice(2, 23, 24).contiguous(), quantize_kv(steps.back()).scales));
  c.reorder({1, 0});
  EXPECT_TRUE(testing::bitwise_equal(c.value_scales(1).slice(2, 0, 4).select(0, 0).contiguous(),
                                     qv.scales.select(0, 1).contiguous()));
  EXPECT_TRUE(testing::bitwise_equal(c.values(1).slice(2, 0, 4).select(0, 1).contiguous(), qv.values.select(0, 0).contiguous()));
  Tensor bad = randn({2, 3, 1, 9});
  bad.data<float>()[4] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(error_of([&] { c.append(1, bad, randn({2, 3, 1, 5})); }), HasSubstr("NaN"));
  EXPECT_EQ(c.length(1), 24);
  c.truncate(3);
  EXPECT_EQ(c.key_scales(1).shape(), Shape({2, 3, 3}));
  EXPECT_EQ(c.key_scales(0).shape(), Shape({2, 3, 0}));
}

}  // namespace
}  // namespace heads
