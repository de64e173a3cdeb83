// precision_outliers_test.cc — int8's outlier channels (heads/precision.h): chosen from calibrated
// input ranges, their columns computed in f32 beside the int8 product of the rest, on every ISA
// path; stored, sliced and stacked without change; malformed parts are clear errors. And the
// activation a linear layer applies as it writes its output: the bits of activation(linear(...)).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/testing.h"
#include "heads/precision.h"

namespace heads {
namespace {

using ::testing::HasSubstr;
using testing::randn;

struct Shapes {
  int64_t M, K, N;
};

// Column maxima of |x| [M, K].
Tensor column_absmax(const Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  Tensor a = Tensor::zeros({K}, DType::F32);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      a.data<float>()[k] = std::max(a.data<float>()[k], std::fabs(x.data<float>()[m * K + k]));
    }
  }
  return a;
}

// x [M, K] with `channels` scaled up 40x: the outliers a LayerNorm output carries.
Tensor with_outliers(const Shapes& s, const std::vector<int64_t>& channels) {
  Tensor x = randn({s.M, s.K});
  for (int64_t m = 0; m < s.M; ++m) {
    for (int64_t c : channels) x.data<float>()[m * s.K + c] *= 40.0f;
  }
  return x;
}

TEST(PrecisionOutliers, TheyAreTheF32PartOfTheDefinitionOnEveryPath) {
  testing::IsaGuard guard;
  // N = 150: blocks of 4 (AVX-512) or 2 (AVX2) vectors of outputs per channel sweep, then the rest
  for (const Shapes& s : {Shapes{1, 33, 5}, Shapes{7, 70, 45}, Shapes{129, 384, 17}, Shapes{9, 70, 150}}) {
    const std::vector<int64_t> channels = {0, 3, s.K - 2};  // K / 16 ≥ 2: at most 2 for K = 33 (the largest)
    const Tensor x = with_outliers(s, channels), b = randn({s.N});
    Tensor W = randn({s.N, s.K}, 0.1);
    W.data<float>()[3] *= 25.0f;  // a heavy row: the residual term too
    const Tensor absmax = column_absmax(x);
    const double inf = std::numeric_limits<double>::infinity();
    const PackedLinear pw(W, Precision::Int8, inf, absmax);
    // The channels past kInt8OutlierRatio times the median, at most K/16 of them, the largest.
    std::vector<float> sorted(absmax.data<float>(), absmax.data<float>() + s.K);
    std::nth_element(sorted.begin(), sorted.begin() + s.K / 2, sorted.end());
    std::vector<int64_t> want;
    for (int64_t k = 0; k < s.K; ++k) {
      if (absmax.data<float>()[k] > kInt8OutlierRatio * sorted[static_cast<size_t>(s.K / 2)]) want.push_back(k);
    }
    ASSERT_EQ(want, channels) << "the test's outliers";
    if (static_cast<int64_t>(want.size()) > s.K / 16) {  // the largest K / 16
      std::vector<int64_t> by_size = want;
      std::stable_sort(by_size.begin(), by_size.end(),
                       [&](int64_t a, int64_t c) { return absmax.data<float>()[a] > absmax.data<float>()[c]; });
      by_size.resize(static_cast<size_t>(s.K / 16));
      std::sort(by_size.begin(), by_size.end());
      want = by_size;
    }
    ASSERT_TRUE(pw.outlier_channels().defined());
    const auto O = static_cast<int64_t>(want.size());
    ASSERT_EQ(pw.outlier_channels().shape(), Shape({O}));
    ASSERT_EQ(pw.outlier_weight().shape(), Shape({s.N, O}));
    EXPECT_EQ(pw.activation_error(), inf);
    // The int8 part is the int8 weight of W with those columns zero, bit for bit.
    Tensor Wz = W.clone();
    Tensor xz = x.clone();
    for (int64_t o = 0; o < O; ++o) {
      const int64_t c = want[static_cast<size_t>(o)];
      EXPECT_EQ(pw.outlier_channels().data<int64_t>()[o], c);
      for (int64_t n = 0; n < s.N; ++n) {
        EXPECT_EQ(pw.outlier_weight().data<float>()[n * O + o], W.data<float>()[n * s.K + c]);
        Wz.data<float>()[n * s.K + c] = 0.0f;
      }
      for (int64_t m = 0; m < s.M; ++m) xz.data<float>()[m * s.K + c] = 0.0f;
    }
    const PackedLinear plain(Wz, Precision::Int8, inf);
    EXPECT_TRUE(testing::bitwise_equal(pw.data(), plain.data()));
    EXPECT_TRUE(testing::bitwise_equal(pw.scales(), plain.scales()));
    EXPECT_TRUE(testing::bitwise_equal(dequantize(pw).slice(1, 1, 2).contiguous(), dequantize(plain).slice(1, 1, 2).contiguous()));
    for (int64_t o = 0; o < O; ++o) {  // dequantize gives the outlier columns as they are
      const int64_t c = want[static_cast<size_t>(o)];
      EXPECT_TRUE(testing::bitwise_equal(dequantize(pw).slice(1, c, c + 1).contiguous(), W.slice(1, c, c + 1).contiguous()));
    }
    // y = (the int8 layer on x without those channels) + x[:, o]·W[:, o] added in order, fused: the
    // same bits on every integer path; the f32 route within its rounding.
    for (Isa isa : supported_isas()) {
      set_isa(isa);
      const Tensor y = linear(x, pw, b);
      Tensor want_y = linear(xz, plain, b);
      for (int64_t m = 0; m < s.M; ++m) {
        for (int64_t o = 0; o < O; ++o) {
          const int64_t c = want[static_cast<size_t>(o)];
          for (int64_t n = 0; n < s.N; ++n) {
            float& v = want_y.data<float>()[m * s.N + n];
            v = std::fma(x.data<float>()[m * s.K + c], W.data<float>()[n * s.K + c], v);
          }
        }
      }
      if (linear_gemm_route(Precision::Int8) != "f32") {
        EXPECT_TRUE(testing::bitwise_equal(y, want_y)) << isa_name(isa) << " K=" << s.K;
      } else {
        double mag = 0;
        for (int64_t i = 0; i < x.numel(); ++i) mag = std::max<double>(mag, std::fabs(x.data<float>()[i]));
        EXPECT_TRUE(testing::compare(y, want_y).within(0, (s.K + 8) * 6e-8 * mag * 3 * s.K)) << isa_name(isa);
      }
      // The outliers are far more accurate than one int8 term over them: the error against float64 is
      // that of the rows without them.
      double worst = 0, scale = 0;
      for (int64_t m = 0; m < s.M; ++m) {
        for (int64_t n = 0; n < s.N; ++n) {
          double exact = b.data<float>()[n];
          for (int64_t k = 0; k < s.K; ++k) exact += static_cast<double>(x.data<float>()[m * s.K + k]) * W.data<float>()[n * s.K + k];
          worst = std::max(worst, std::fabs(y.data<float>()[m * s.N + n] - exact));
          scale = std::max(scale, std::fabs(exact));
        }
      }
      if (O == static_cast<int64_t>(channels.size())) EXPECT_LT(worst, 0.02 * scale) << isa_name(isa) << " K=" << s.K;
    }
    // Stored, sliced and stacked: the same bits.
    const PackedLinear back = int8_from_tensors("w", [&, t = int8_tensors("w", pw)](const std::string& n) -> const Tensor* {
      for (const auto& [name, v] : t) {
        if (name == n) return &v;
      }
      return nullptr;
    }, "test");
    EXPECT_EQ(back.activation_error(), inf);
    EXPECT_TRUE(testing::bitwise_equal(linear(x, back, b), linear(x, pw, b)));
    const int64_t half = s.N / 2;
    const PackedLinear stacked = cat_rows({pw.rows(0, half), pw.rows(half, s.N)});
    EXPECT_TRUE(testing::bitwise_equal(linear(x, stacked, b), linear(x, pw, b)));
    const Tensor part = linear(x, pw.rows(half, s.N), b.slice(0, half, s.N));
    const Tensor whole = linear(x, pw, b).slice(1, half, s.N).contiguous();
    if (linear_gemm_route(Precision::Int8) != "f32") {
      EXPECT_TRUE(testing::bitwise_equal(part, whole));
    } else {  // f32 sums of another width
      EXPECT_TRUE(testing::compare(part, whole).within(1e-5, 1e-5));
    }
  }
}

TEST(PrecisionOutliers, NoneWithoutCalibrationAndMalformedPartsAreErrors) {
  const Shapes s{4, 40, 6};
  const Tensor x = with_outliers(s, {5}), W = randn({s.N, s.K});
  EXPECT_FALSE(PackedLinear(W, Precision::Int8).outlier_channels().defined());
  // Inputs without outliers: none chosen.
  EXPECT_FALSE(PackedLinear(W, Precision::Int8, 0, column_absmax(randn({64, s.K}))).outlier_channels().defined());
  const PackedLinear pw(W, Precision::Int8, 0, column_absmax(x));
  ASSERT_EQ(pw.outlier_channels().numel(), 1);
  EXPECT_THAT(testing::error_of([&] { PackedLinear(W, Precision::Int8, 0, Tensor::zeros({s.K + 1}, DType::F32)); }),
              HasSubstr("input_absmax: expected a floating [40] tensor"));
  Tensor nan = column_absmax(x);
  nan.data<float>()[7] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(testing::error_of([&] { PackedLinear(W, Precision::Int8, 0, nan); }),
              HasSubstr("input_absmax[7] must be finite and at least 0"));
  EXPECT_THAT(testing::error_of([&] { PackedLinear(W, Precision::BF16, 0, column_absmax(x)); }),
              HasSubstr("input_absmax is for int8 weights"));
  EXPECT_THAT(testing::error_of([&] { PackedLinear(W, Precision::Int8, -1); }), HasSubstr("activation_error must be at least 0"));
  const Tensor none;
  // The int8 data must be zero on an outlier channel; channels increase within K; the columns match.
  EXPECT_THAT(testing::error_of([&] {
                PackedLinear::from_int8(PackedLinear(W, Precision::Int8).data(), pw.scales(), "w", none, none, none,
                                        pw.outlier_channels(), pw.outlier_weight());
              }),
              HasSubstr("w: outlier channel 5 holds int8 values"));
  EXPECT_THAT(testing::error_of([&] {
                PackedLinear::from_int8(pw.data(), pw.scales(), "w", none, none, none,
                                        Tensor::from_vector(std::vector<int64_t>{40}, {1}), pw.outlier_weight());
              }),
              HasSubstr("w: outlier channel 0 is 40: channels must increase within [0, 40)"));
  EXPECT_THAT(testing::error_of([&] {
                PackedLinear::from_int8(pw.data(), pw.scales(), "w", none, none, none, pw.outlier_channels(),
                                        Tensor::zeros({s.N, 2}, DType::F32));
              }),
              HasSubstr("w: outlier weight: expected f32 [6, 1], got f32 [6, 2]"));
  EXPECT_THAT(testing::error_of([&] {
                PackedLinear::from_int8(pw.data(), pw.scales(), "w", none, none, none, pw.outlier_channels(), none);
              }),
              HasSubstr("the outlier channels need their weight columns"));
  // Stacked weights read one input: their channels must agree.
  EXPECT_THAT(testing::error_of([&] { cat_rows({pw, PackedLinear(W, Precision::Int8)}); }),
              HasSubstr("outlier channels differ"));
  // A file missing one of the two parts.
  auto t = int8_tensors("w", pw);
  t.erase(std::remove_if(t.begin(), t.end(), [](const auto& p) { return p.first == "w_outlier_weight"; }), t.end());
  EXPECT_THAT(testing::error_of([&] {
                int8_from_tensors("w", [&](const std::string& n) -> const Tensor* {
                  for (const auto& [name, v] : t) {
                    if (name == n) return &v;
                  }
                  return nullptr;
                }, "file");
              }),
              HasSubstr("file: \"w\": its outlier channels need \"w_outlier_channels\" and \"w_outlier_weight\" together"));
}

TEST(PrecisionOutliers, ActivationAppliedAsTheOutputIsWrittenIsTheSeparateOne) {
  testing::IsaGuard guard;
  const Tensor x = with_outliers({37, 70, 45}, {3}), W = randn({45, 70}), b = randn({45});
  const double inf = std::numeric_limits<double>::infinity();
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    for (const PackedLinear& w : {PackedLinear(W, Precision::Int8), PackedLinear(W, Precision::Int8, inf, column_absmax(x)),
                                  PackedLinear(W, Precision::BF16), PackedLinear(W, Precision::F32)}) {
      for (Activation act : {Activation::Relu, Activation::Gelu, Activation::GeluTanh}) {
        EXPECT_TRUE(testing::bitwise_equal(linear(x, w, b, DType::F32, act), activation(linear(x, w, b), act)))
            << isa_name(isa) << " " << precision_name(w.precision());
      }
    }
  }
  EXPECT_THAT(testing::error_of([&] { linear(x, PackedLinear(W, Precision::BF16), b, DType::BF16, Activation::Gelu); }),
              HasSubstr("an activation is applied to f32 outputs only"));
}

}  // namespace
}  // namespace heads
