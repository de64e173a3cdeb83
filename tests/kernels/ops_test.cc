// ops_test.cc — layer_norm, activations, linear, dropout against float64, on every ISA path.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common/testing.h"
#include "heads/ops.h"
#include "heads/runtime.h"
#include "kernels/dispatch.h"

namespace heads {
namespace {

using testing::IsaGuard;

TEST(Ops, LayerNormMatchesFloat64) {
  IsaGuard guard;
  for (int64_t n : {1, 7, 16, 17, 384, 1001}) {
    const Tensor x = testing::randn({5, 3, n}, 3.0);
    // a large common offset stresses the two-pass variance
    Tensor xo = x.clone();
    for (int64_t i = 0; i < xo.numel(); ++i) xo.data<float>()[i] += 100.0f;
    const Tensor w = testing::randn({n}), b = testing::randn({n});
    for (Isa isa : supported_isas()) {
      set_isa(isa);
      for (bool affine : {true, false}) {
        for (const Tensor* in : {&x, static_cast<const Tensor*>(&xo)}) {
          const Tensor y = layer_norm(*in, affine ? w : Tensor(), affine ? b : Tensor(), 1e-5);
          const Tensor ref = ref::layer_norm_f64(*in, affine ? w : Tensor(), affine ? b : Tensor(), 1e-5);
          const auto e = testing::compare(y, ref);
          EXPECT_TRUE(e.within(1e-5, 1e-5)) << "n=" << n << " isa=" << isa_name(isa) << " err " << e.max_abs;
        }
      }
    }
  }
}

TEST(Ops, AddLayerNormIsLayerNormOfTheSum) {
  IsaGuard guard;
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    for (int64_t n : {1, 17, 384}) {
      const Tensor x = testing::randn({7, n}), r = testing::randn({7, n}), w = testing::randn({n}), b = testing::randn({n});
      const Tensor fused = add_layer_norm(x, r, w, b, 1e-12);
      const Tensor ref = ref::layer_norm_f64(add(x, r), w, b, 1e-12);
      EXPECT_TRUE(testing::compare(fused, ref).within(1e-5, 1e-5)) << "n=" << n << " isa=" << isa_name(isa);
      const Tensor s = add(x, r);
      for (int64_t i = 0; i < s.numel(); ++i) ASSERT_EQ(s.data<float>()[i], x.data<float>()[i] + r.data<float>()[i]);
    }
  }
}

TEST(Ops, ActivationsMatchFloat64) {
  IsaGuard guard;
  // a sweep over [-12, 12] plus random values, odd length for the vector tails
  Tensor x = Tensor::empty({4801}, DType::F32);
  for (int64_t i = 0; i < 2401; ++i) x.data<float>()[i] = -12.0f + 0.01f * static_cast<float>(i);
  const Tensor r = testing::randn({2400}, 3.0);
  for (int64_t i = 0; i < 2400; ++i) x.data<float>()[2401 + i] = r.data<float>()[i];
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    for (Activation act : {Activation::Relu, Activation::Gelu, Activation::GeluTanh}) {
      const Tensor y = activation(x, act);
      const Tensor ref = ref::activation_f64(x, act);
      double worst = 0;
      for (int64_t i = 0; i < x.numel(); ++i) {
        const double a = y.data<float>()[i], b = ref.data<double>()[i];
        worst = std::max(worst, std::fabs(a - b) / (std::fabs(b) + 1e-30));
        // In the negative tail exp(-x²/2) evaluated in f32 carries a relative error ~x²·6e-8.
        const double xv = x.data<float>()[i];
        const double rtol = 1e-6 + 2.5e-7 * xv * xv;
        if (std::fabs(b) > 1e-30) {
          ASSERT_LE(std::fabs(a - b), rtol * std::fabs(b) + 1e-37)
              << "x=" << x.data<float>()[i] << " act=" << static_cast<int>(act) << " isa=" << isa_name(isa);
        }
      }
    }
  }
}

TEST(Ops, ActivationBitsDoNotDependOnTheRowLength) {
  // GELU takes a row's vectors several at a time (ew::gelu_erf_n), the last ones and the partial one
  // as a group of their own: each value's bits must be those of the value in any other place.
  IsaGuard guard;
  const Tensor x = testing::randn({4 * 67}, 3.0);
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    for (Activation act : {Activation::Relu, Activation::Gelu, Activation::GeluTanh}) {
      const Tensor whole = activation(x, act);
      for (int64_t n : {1, 3, 7, 8, 9, 17, 31, 32, 33, 47, 63, 64, 65, 67}) {
        const int64_t rows = x.numel() / n;
        Tensor xr = Tensor::empty({rows, n}, DType::F32);
        std::memcpy(xr.data<float>(), x.data<float>(), sizeof(float) * rows * n);
        const Tensor y = activation(xr, act);
        for (int64_t i = 0; i < rows * n; ++i) {
          ASSERT_EQ(std::memcmp(y.data<float>() + i, whole.data<float>() + i, sizeof(float)), 0)
              << "n=" << n << " i=" << i << " act=" << static_cast<int>(act) << " isa=" << isa_name(isa);
        }
      }
    }
  }
}

TEST(Ops, Bf16RowsRoundAsF32ToBf16OnEveryPath) {
  // Ties both ways, NaN payloads, infinities, denormals (kept, not flushed), the largest finite value
  // (rounds to inf), random values; rows of odd length at a row stride past it.
  const float edge[] = {1.0f + 0x1p-8f, 1.0f + 0x3p-8f, -1.0f - 0x1p-8f, 0x1p-130f, -0x1.8p-140f, 0x1.fffffep-127f,
                        3.4028235e38f, -3.4028235e38f, std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity(), 0.0f, -0.0f};
  const int64_t rows = 37, n = 131, xs = 140, ys = 133;
  const Tensor r = testing::randn({rows * xs}, 5.0);
  std::vector<float> x(r.data<float>(), r.data<float>() + rows * xs);
  for (size_t i = 0; i < std::size(edge); ++i) x[i * 7] = edge[i];
  for (uint32_t payload : {0x7fc00000u, 0x7f800001u, 0xffa5a5a5u, 0x7fbfffffu}) {
    float nan;
    std::memcpy(&nan, &payload, 4);
    x[static_cast<size_t>(payload % 4000)] = nan;
  }
  IsaGuard guard;
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    std::vector<uint16_t> y(rows * ys, 0xabcd);
    kernels::active().f32_to_bf16_rows(x.data(), y.data(), rows, n, xs, ys);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < ys; ++j) {
        const uint16_t want = j < n ? f32_to_bf16(x[i * xs + j]) : uint16_t{0xabcd};  // nothing past n written
        ASSERT_EQ(y[i * ys + j], want) << "row " << i << " col " << j << " x=" << x[i * xs + j] << " isa=" << isa_name(isa);
      }
    }
  }
}

TEST(Ops, LinearAndErrors) {
  const Tensor x = testing::randn({2, 3, 7}), w = testing::randn({5, 7}), b = testing::randn({5});
  const Tensor y = linear(x, w, b);
  ASSERT_EQ(y.shape(), Shape({2, 3, 5}));
  for (int64_t i = 0; i < 6; ++i) {
    for (int64_t o = 0; o < 5; ++o) {
      double ref = b.data<float>()[o];
      for (int64_t k = 0; k < 7; ++k) ref += double(x.data<float>()[i * 7 + k]) * w.data<float>()[o * 7 + k];
      EXPECT_NEAR(y.data<float>()[i * 5 + o], ref, 1e-5 * (1 + std::fabs(ref)));
    }
  }
  EXPECT_THROW(linear(x, testing::randn({5, 6})), Error);
  EXPECT_THROW(linear(x, w, testing::randn({4})), Error);
  EXPECT_THROW(layer_norm(x, testing::randn({6}), Tensor()), Error);
  EXPECT_THROW(activation_from_name("swish"), Error);
  // dropout: keep rate and scaling, reproducible
  const Tensor z = testing::randn({100000});
  const Tensor d1 = dropout(z, 0.25, 9), d2 = dropout(z, 0.25, 9);
  int64_t kept = 0;
  for (int64_t i = 0; i < z.numel(); ++i) {
    const float v = d1.data<float>()[i];
    EXPECT_EQ(v, d2.data<float>()[i]);
    if (v != 0.0f) {
      ++kept;
      EXPECT_NEAR(v, z.data<float>()[i] / 0.75f, 1e-6f * std::fabs(v));
    }
  }
  EXPECT_NEAR(static_cast<double>(kept) / z.numel(), 0.75, 0.01);
}

}  // namespace
}  // namespace heads

namespace heads {
namespace {

// sum(f(x) ∘ G) for a float64 function f; its gradient by central differences, entry by entry.
template <class F>
Tensor numeric_grad(Tensor x64, const Tensor& G, F f) {
  Tensor g = Tensor::zeros(x64.shape(), DType::F64);
  auto loss = [&] {
    const Tensor y = f();
    double s = 0;
    for (int64_t i = 0; i < y.numel(); ++i) s += y.data<double>()[i] * G.data<double>()[i];
    return s;
  };
  for (int64_t i = 0; i < x64.numel(); ++i) {
    double* p = x64.data<double>() + i;
    const double save = *p, eps = 1e-5;
    *p = save + eps;
    const double up = loss();
    *p = save - eps;
    const double down = loss();
    *p = save;
    g.data<double>()[i] = (up - down) / (2 * eps);
  }
  return g;
}

TEST(OpsBackward, LayerNormMatchesFiniteDifferences) {
  for (int64_t n : {1, 7, 33}) {
    const Tensor x = testing::randn({4, n}, 2.0), w = testing::randn({n}), b = testing::randn({n});
    const Tensor dy = testing::randn({4, n});
    const LayerNormGrads g = layer_norm_backward(dy, x, w, b, 1e-5);
    Tensor x64 = x.to(DType::F64).clone(), w64 = w.to(DType::F64).clone(), b64 = b.to(DType::F64).clone();
    const Tensor G = dy.to(DType::F64);
    auto f = [&] { return ref::layer_norm_f64(x64, w64, b64, 1e-5); };
    EXPECT_TRUE(testing::compare(g.dx, numeric_grad(x64, G, f)).within(1e-4, 1e-5)) << "dx n=" << n;
    EXPECT_TRUE(testing::compare(g.dweight, numeric_grad(w64, G, f)).within(1e-4, 1e-5)) << "dw n=" << n;
    EXPECT_TRUE(testing::compare(g.dbias, numeric_grad(b64, G, f)).within(1e-4, 1e-5)) << "db n=" << n;
  }
}

TEST(OpsBackward, ActivationsMatchFiniteDifferences) {
  Tensor x = testing::randn({257}, 3.0);
  x.data<float>()[1] = -12.0f;
  x.data<float>()[2] = 12.0f;
  const Tensor dy = testing::randn({257});
  IsaGuard guard;
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    for (Activation act : {Activation::Relu, Activation::Gelu, Activation::GeluTanh}) {
      const Tensor g = activation_backward(dy, x, act);
      Tensor x64 = x.to(DType::F64).clone();
      const Tensor num = numeric_grad(x64, dy.to(DType::F64), [&] { return ref::activation_f64(x64, act); });
      EXPECT_TRUE(testing::compare(g, num).within(1e-5, 1e-6)) << isa_name(isa) << " act=" << static_cast<int>(act);
      if (act == Activation::Relu) {  // ReLU'(0) = 0, as torch
        const Tensor z = Tensor::zeros({3}, DType::F32);
        EXPECT_EQ(activation_backward(testing::randn({3}), z, act).data<float>()[1], 0.0f);
      }
    }
  }
}

TEST(OpsBackward, ActivationsAgreeAcrossChunksAndPaths) {
  // Many chunks (threads) and a ragged tail: every path gives the scalar path's values.
  const Tensor x = testing::randn({40003}, 3.0), dy = testing::randn({40003});
  IsaGuard guard;
  for (Activation act : {Activation::Relu, Activation::Gelu, Activation::GeluTanh}) {
    set_isa(Isa::Scalar);
    const Tensor want = activation_backward(dy, x, act);
    for (Isa isa : supported_isas()) {
      set_isa(isa);
      EXPECT_TRUE(testing::compare(activation_backward(dy, x, act), want).within(2e-6, 1e-7))
          << isa_name(isa) << " act=" << static_cast<int>(act);
    }
  }
}

TEST(OpsBackward, ReductionsIndependentOfThreadCount) {
  // dweight / dbias sum over rows in fixed blocks: the same bits on any number of threads.
  const Tensor x = testing::randn({3000, 37}), dy = testing::randn({3000, 37}), w = testing::randn({37});
  const Tensor b = testing::randn({37}), wl = testing::randn({19, 37}), dyl = testing::randn({3000, 19});
  const int saved = get_num_threads();
  set_num_threads(1);
  const LayerNormGrads g1 = layer_norm_backward(dy, x, w, b);
  const LinearGrads l1 = linear_backward(dyl, x, wl, true);
  for (int t : {2, 3}) {
    set_num_threads(t);
    const LayerNormGrads gt = layer_norm_backward(dy, x, w, b);
    EXPECT_TRUE(testing::bitwise_equal(g1.dx, gt.dx) && testing::bitwise_equal(g1.dweight, gt.dweight) &&
                testing::bitwise_equal(g1.dbias, gt.dbias)) << "threads=" << t;
    EXPECT_TRUE(testing::bitwise_equal(l1.dbias, linear_backward(dyl, x, wl, true).dbias)) << "threads=" << t;
  }
  set_num_threads(saved);
}

TEST(OpsBackward, LinearMatchesFloat64) {
  const Tensor x = testing::randn({3, 5, 7}), w = testing::randn({4, 7}), dy = testing::randn({3, 5, 4});
  const LinearGrads g = linear_backward(dy, x, w, true);
  ASSERT_EQ(g.dx.shape(), x.shape());
  ASSERT_EQ(g.dweight.shape(), w.shape());
  for (int64_t i = 0; i < 7; ++i) {
    for (int64_t o = 0; o < 4; ++o) {
      double dw = 0;
      for (int64_t m = 0; m < 15; ++m) dw += double(dy.data<float>()[m * 4 + o]) * x.data<float>()[m * 7 + i];
      EXPECT_NEAR(g.dweight.data<float>()[o * 7 + i], dw, 1e-5 * (1 + std::fabs(dw)));
    }
    for (int64_t m = 0; m < 15; ++m) {
      double dx = 0;
      for (int64_t o = 0; o < 4; ++o) dx += double(dy.data<float>()[m * 4 + o]) * w.data<float>()[o * 7 + i];
      EXPECT_NEAR(g.dx.data<float>()[m * 7 + i], dx, 1e-5 * (1 + std::fabs(dx)));
    }
  }
  for (int64_t o = 0; o < 4; ++o) {
    double db = 0;
    for (int64_t m = 0; m < 15; ++m) db += dy.data<float>()[m * 4 + o];
    EXPECT_NEAR(g.dbias.data<float>()[o], db, 1e-5 * (1 + std::fabs(db)));
  }
  EXPECT_THROW(linear_backward(testing::randn({3, 5, 3}), x, w, true), Error);
}

}  // namespace
}  // namespace heads
