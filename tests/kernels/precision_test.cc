// precision_test.cc — the reduced-precision linear layers (heads/precision.h) against float64 loops
// that follow their definitions, on every ISA path, and against the exact product within the bound
// their error model gives. Modules and the sentence encoder in bf16 and int8:
// precision_modules_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>
#include <vector>

#include "common/testing.h"
#include "heads/encoder.h"
#include "heads/mha.h"
#include "heads/ops.h"
#include "heads/precision.h"
#include "heads/sentence_encoder.h"
#include "kernels/dispatch.h"

namespace heads {
namespace {

using ::testing::HasSubstr;
using testing::randn;

// Row-wise symmetric int8 of the definition, in double: q = round_even(x / s), s = max|x| / 127.
std::vector<double> quantize(const float* x, int64_t K, double* scale) {
  double amax = 0;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<double>(x[k])));
  const float s = amax > 0 ? static_cast<float>(amax) / 127.0f : 1.0f;  // computed in f32, as specified
  *scale = s;
  std::vector<double> q(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) q[static_cast<size_t>(k)] = std::nearbyint(x[k] * (1.0f / s));
  return q;
}

// A row of activations as the definition quantizes it (heads/precision.h), in the f32 steps it
// specifies, for a weight's activation_error tau: t = q − z, the first term's steps (x ≈ t·s), and
// the second term's rq·sr (sr 0: none).
struct ActivationRow {
  std::vector<double> t, rq;
  double s = 0, sr = 0;
};

ActivationRow quantize_activations(const float* x, int64_t K, double tau) {
  ActivationRow a;
  float lo = 0.0f, hi = 0.0f;
  for (int64_t k = 0; k < K; ++k) lo = std::min(lo, x[k]), hi = std::max(hi, x[k]);
  const float span = hi / 255.0f - lo / 255.0f;
  const bool zero = !(span >= std::numeric_limits<float>::min());
  const float s = zero ? 1.0f : span, inv = 1.0f / s;
  const float zp = zero ? 0.0f : std::clamp(std::nearbyint(-lo * inv), 0.0f, 255.0f);
  a.s = s;
  double e2 = 0;
  for (int64_t k = 0; k < K; ++k) {
    const double t = std::clamp(std::nearbyint(x[k] * inv) + zp, 0.0f, 255.0f) - zp;
    a.t.push_back(t);
    e2 += t * t;
  }
  a.rq.assign(static_cast<size_t>(K), 0.0);
  if (e2 == 0 || static_cast<double>(K) <= 12.0 * tau * tau * e2) return a;
  std::vector<float> r(static_cast<size_t>(K));  // the residual, in f32 as specified
  for (int64_t k = 0; k < K; ++k) r[static_cast<size_t>(k)] = std::fma(static_cast<float>(a.t[static_cast<size_t>(k)]), -s, x[k]);
  a.rq = quantize(r.data(), K, &a.sr);
  return a;
}

struct Shapes {
  int64_t M, K, N;
};

// set_int8_gemm's choice for a scope ("auto" again at its end).
struct Int8GemmGuard {
  explicit Int8GemmGuard(const char* how) { set_int8_gemm(how); }
  ~Int8GemmGuard() { set_int8_gemm("auto"); }
  Int8GemmGuard(const Int8GemmGuard&) = delete;
  Int8GemmGuard& operator=(const Int8GemmGuard&) = delete;
};

// A residual row's scale as defined: of sw / 2^p for p = 8, ..., 0 whose row C = 2^p·q + Wr is 16-bit
// (-32768 to 32767) and keeps 255·Σ|C| within int32, the first with the least squared error of
// r - clamp(round_even(r / t), ±127)·t.
float reference_residual_scale(const float* r, const int8_t* q, int64_t K, float sw) {
  float best = 0.0f;
  double best_error = std::numeric_limits<double>::infinity();
  for (int p = kInt8MaxResidualShift; p >= 0; --p) {
    const float t = std::ldexp(sw, -p);
    double e = 0, c = 0;
    bool fits = true;
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::clamp(std::nearbyint(r[k] / t), -127.0f, 127.0f);
      const double d = r[k] - v * t, ck = std::ldexp(q[k], p) + v;
      e += d * d;
      c += std::fabs(ck);
      fits = fits && ck >= -32768 && ck <= 32767;
    }
    fits = fits && 255 * c <= std::numeric_limits<int32_t>::max();
    if (fits && e < best_error) best = t, best_error = e;
  }
  return best;
}

// The route of a weight: its precision's, but heads' tile GEMM on the amx path for int8 weights whose
// rows take one term (where oneDNN's native route would otherwise run; HEADS_INT8_GEMM=heads gives
// heads' GEMM to both).
TEST(Precision, RouteOfAWeight) {
  testing::IsaGuard guard;
  const Tensor W = randn({20, 30});
  const double inf = std::numeric_limits<double>::infinity();
  const PackedLinear one(W, Precision::Int8, inf), two(W, Precision::Int8), bf(W, Precision::BF16);
  int tiles = 0;
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    EXPECT_EQ(linear_gemm_route(two), linear_gemm_route(Precision::Int8)) << isa_name(isa);
    EXPECT_EQ(linear_gemm_route(bf), linear_gemm_route(Precision::BF16)) << isa_name(isa);
    const bool amx = isa == Isa::Amx && kernels::int8_gemm_usable(kernels::active()) &&
                     linear_gemm_route(Precision::Int8) == "native";
    tiles += amx;
    EXPECT_EQ(linear_gemm_route(one), amx ? "heads" : linear_gemm_route(Precision::Int8)) << isa_name(isa);
  }
  if (std::string(cpu_features()).find("amx-int8") != std::string::npos && amx_status() == "tiles") {
    EXPECT_EQ(tiles, 1) << "a CPU with AMX-INT8 tiles: the amx path's int8 takes them";
  }
  EXPECT_THAT(testing::error_of([] { linear_gemm_route(PackedLinear()); }), HasSubstr("the packed weight is empty"));
}

TEST(Precision, Int8FollowsItsDefinitionExactlyAndItsErrorBound) {
  testing::IsaGuard guard;
  if (const char* cap = std::getenv("DNNL_MAX_CPU_ISA"); cap != nullptr && std::string(cap) == "AVX2") {
    // the precision_without_vnni run: oneDNN capped below VNNI and AVX512_BF16 must send every SIMD
    // path's bf16 down the f32 route, and its int8 to heads' own GEMM (x86) or the f32 route
    for (Isa isa : supported_isas()) {
      set_isa(isa);
      const std::string want = isa == Isa::Scalar ? "portable" : "f32";
      const bool pairs = kernels::int8_gemm_usable(kernels::active());
      EXPECT_EQ(linear_gemm_route(Precision::Int8), isa == Isa::Scalar ? "portable" : pairs ? "heads" : "f32")
          << isa_name(isa);
      EXPECT_EQ(linear_gemm_route(Precision::BF16), want) << isa_name(isa);
    }
  }
  EXPECT_THAT(testing::error_of([] { set_int8_gemm("fast"); }), HasSubstr("set_int8_gemm: expected \"auto\" or \"heads\""));
  // activation_error 0 (the default): two terms on every row; 0.8%: only on the rows estimated to lose
  // more; infinity: one term on every row. oneDNN's route works in tasks of 64 rows (M = 70: a ragged
  // second one; 300: five), and makes the residual rows' outputs 64 at a time (N = 160: more than 64 of
  // them). The weight rows' residual_error: the default, and 0.5% with τ = 0.8%. M = 20 at K = 200, N =
  // 300: one task whose GEMM oneDNN's route runs on several threads (a decoder's step). M ≤ 4 (1, 3):
  // heads' route runs them on the weight as stored (gemm_u8s8_rows, K 133 past its vectors). Some
  // shapes have no bias (decoders' projections), whose outputs take another loop.
  const double inf = std::numeric_limits<double>::infinity();
  for (const double tau : {0.0, 0.008, inf})
  for (const auto& [s, with_bias] : {std::pair{Shapes{1, 1, 1}, true}, std::pair{Shapes{7, 3, 5}, false},
                                     std::pair{Shapes{37, 70, 45}, true}, std::pair{Shapes{129, 384, 17}, false},
                                     std::pair{Shapes{300, 40, 24}, true}, std::pair{Shapes{70, 64, 160}, false},
                                     std::pair{Shapes{20, 200, 300}, false}, std::pair{Shapes{3, 133, 77}, true}}) {
    Tensor x = randn({s.M, s.K}, 2.0);
    const Tensor b = with_bias ? randn({s.N}) : Tensor();
    const auto bias = [&](int64_t n) { return with_bias ? b.data<float>()[n] : 0.0f; };
    for (int64_t m = 0; m < s.M; m += 3) {  // an outlier on every third row: its rounding loses more
      x.data<float>()[m * s.K + (m * 5) % s.K] *= 30.0f;
    }
    Tensor W = randn({s.N, s.K}, 0.1);
    for (int64_t n = 0; n < s.N; n += 2) {  // heavy tails on every other row: one large weight
      W.data<float>()[n * s.K + (n * 7) % s.K] *= 25.0f;
    }
    const double rho = tau == 0.008 ? 0.005 : kInt8ResidualError;
    const PackedLinear pw(W, Precision::Int8, tau, {}, rho);
    ASSERT_EQ(pw.data().dtype(), DType::I8);
    EXPECT_EQ(pw.activation_error(), tau);
    if (s.K >= 45) EXPECT_TRUE(pw.residual_rows().defined());  // the heavy rows need it
    if (s.N >= 160) EXPECT_GT(pw.residual_rows().numel(), 64);  // more than one block of residual outputs
    // Rows with the residual term: exactly those whose rounding loses more than rho.
    std::vector<int64_t> res_index(static_cast<size_t>(s.N), -1);
    for (int64_t j = 0; pw.residual_rows().defined() && j < pw.residual_rows().numel(); ++j) {
      res_index[static_cast<size_t>(pw.residual_rows().data<int64_t>()[j])] = j;
    }
    // The exact int32 sums make every integer path give the same bits (oneDNN's GEMM, heads' own, the
    // portable loops: on every path, and with heads' own GEMM asked for where oneDNN's would run); a
    // path without an integer GEMM ("f32" route) sums the dequantized products in f32 (checked below).
    Tensor first;
    std::vector<std::pair<Isa, Tensor>> widened;
    for (Isa isa : supported_isas()) {
      set_isa(isa);
      for (const char* gemm : {"auto", "heads"}) {
        Int8GemmGuard choice(gemm);
        const Tensor y = linear(x, pw, b);
        if (linear_gemm_route(Precision::Int8) == "f32") {
          widened.emplace_back(isa, y);
          continue;
        }
        if (first.defined()) {
          EXPECT_TRUE(testing::bitwise_equal(first, y))
              << "isa " << isa_name(isa) << ", " << linear_gemm_route(Precision::Int8) << " GEMM";
        }
        first = y;
      }
    }
    ASSERT_TRUE(first.defined());  // the scalar path is always integer
    int64_t second_terms = 0;
    for (int64_t m = 0; m < s.M; ++m) {
      const float* xm = x.data<float>() + m * s.K;
      const ActivationRow row = quantize_activations(xm, s.K, tau);
      const std::vector<double>& xq = row.t;  // x ≈ xq·sx + rq·sr
      const std::vector<double>& rq = row.rq;
      const double sx = row.s, sr = row.sr;
      second_terms += sr != 0;
      double sum_x = 0;
      for (int64_t k = 0; k < s.K; ++k) sum_x += std::fabs(x.data<float>()[m * s.K + k]);
      for (int64_t n = 0; n < s.N; ++n) {
        // The weight row as packed: a scale of c·max|W[n]|/127 with c in [0.5, 1] (the least squared
        // error), its values round(W / scale) clipped to ±127.
        const float sw = pw.scales().data<float>()[n];
        const int8_t* wp = static_cast<const int8_t*>(pw.data().raw_data()) + n * s.K;
        std::vector<double> wq(static_cast<size_t>(s.K));
        float wmax = 0;
        for (int64_t k = 0; k < s.K; ++k) wmax = std::max(wmax, std::fabs(W.data<float>()[n * s.K + k]));
        EXPECT_TRUE(sw >= 0.5f * wmax / 127 * (1 - 1e-6f) && sw <= wmax / 127 * (1 + 1e-6f)) << "n=" << n;
        for (int64_t k = 0; k < s.K; ++k) {
          wq[static_cast<size_t>(k)] = wp[k];
          EXPECT_EQ(wp[k], std::clamp(std::nearbyint(W.data<float>()[n * s.K + k] / sw), -127.0f, 127.0f));
        }
        // The residual term of a heavy row: the rounding residual of the first term on the step sw / 2^p
        // of least squared error among those whose 16-bit row fits (the finest of equals).
        double err2 = 0, norm2 = 0;
        std::vector<double> wr(static_cast<size_t>(s.K), 0.0);
        for (int64_t k = 0; k < s.K; ++k) {
          const float d = W.data<float>()[n * s.K + k] - static_cast<float>(wq[static_cast<size_t>(k)]) * sw;
          err2 += static_cast<double>(d) * d;
          norm2 += static_cast<double>(W.data<float>()[n * s.K + k]) * W.data<float>()[n * s.K + k];
        }
        const int64_t j = res_index[static_cast<size_t>(n)];
        EXPECT_EQ(j >= 0, err2 > rho * rho * norm2) << "n=" << n;
        double swr = 0;
        int shift = 0;
        if (j >= 0) {
          swr = pw.residual_scales().data<float>()[j];
          std::vector<float> d(static_cast<size_t>(s.K));
          for (int64_t k = 0; k < s.K; ++k) {
            d[static_cast<size_t>(k)] = W.data<float>()[n * s.K + k] - static_cast<float>(wq[static_cast<size_t>(k)]) * sw;
          }
          shift = static_cast<int>(std::lround(std::log2(sw / swr)));
          EXPECT_EQ(swr, reference_residual_scale(d.data(), wp, s.K, sw)) << "n=" << n;
          EXPECT_EQ(swr, std::ldexp(sw, -shift)) << "n=" << n;
          const int8_t* rp = static_cast<const int8_t*>(pw.residual_data().raw_data()) + j * s.K;
          for (int64_t k = 0; k < s.K; ++k) {
            const float d = W.data<float>()[n * s.K + k] - static_cast<float>(wq[static_cast<size_t>(k)]) * sw;
            EXPECT_EQ(rp[k], std::clamp(std::nearbyint(d / static_cast<float>(swr)), -127.0f, 127.0f));
            wr[static_cast<size_t>(k)] = rp[k];
          }
        }
        // A residual row is the 16-bit row C = 2^p·Wq + Wr with scale swr; others are Wq with scale sw.
        const double row_scale = j >= 0 ? swr : sw;
        std::vector<double> c(static_cast<size_t>(s.K));
        for (int64_t k = 0; k < s.K; ++k) {
          c[static_cast<size_t>(k)] = j >= 0 ? std::ldexp(wq[static_cast<size_t>(k)], shift) + wr[static_cast<size_t>(k)]
                                             : wq[static_cast<size_t>(k)];
        }
        double acc = 0, acc_r = 0, exact = bias(n), sum_w = 0;
        for (int64_t k = 0; k < s.K; ++k) {
          acc += xq[static_cast<size_t>(k)] * c[static_cast<size_t>(k)];
          acc_r += rq[static_cast<size_t>(k)] * c[static_cast<size_t>(k)];
          exact += static_cast<double>(x.data<float>()[m * s.K + k]) * W.data<float>()[n * s.K + k];
          sum_w += std::fabs(W.data<float>()[n * s.K + k]);
        }
        const double defined = (acc * sx + acc_r * sr) * row_scale + bias(n);
        const double got = first.data<float>()[m * s.N + n];
        EXPECT_NEAR(got, defined,
                    1e-6 * (std::fabs(acc * sx * row_scale) + std::fabs(acc_r * sr * row_scale) +
                            std::fabs(bias(n))))
            << "m=" << m << " n=" << n;
        // The f32 route: the rows xq·sx + rq·sr (3 roundings) and the weight Wq·sw + Wr·swr (1), in
        // f32, multiplied in f32 (1), summed in f32 with the bias (K): within K + 6 roundings of 2^-24
        // of the sum of |products| of the definition.
        for (const auto& [isa, y] : widened) {
          double mag = std::fabs(bias(n));
          for (int64_t k = 0; k < s.K; ++k) {
            const size_t i = static_cast<size_t>(k);
            mag += std::fabs((xq[i] * sx + rq[i] * sr) * (wq[i] * sw + wr[i] * swr));
          }
          EXPECT_NEAR(y.data<float>()[m * s.N + n], defined, (s.K + 6) * 6e-8 * mag)
              << isa_name(isa) << " m=" << m << " n=" << n;
        }
        // x is off by at most half a step of its last term (h; the clamp of the asymmetric first term
        // to [0, 255] adds at most a rounding of its bounds), W by |W - Wq·sw - Wr·swr| (half a step of
        // the last term, or what clipping cut off), so |y - exact| <= h·Σ|W| + Σ|x|·|ΔW| + h·Σ|ΔW|,
        // plus the f32 rounding.
        double dw = 0, xdw = 0;
        for (int64_t k = 0; k < s.K; ++k) {
          const double d = std::fabs(W.data<float>()[n * s.K + k] - wq[static_cast<size_t>(k)] * sw -
                                     wr[static_cast<size_t>(k)] * swr);
          dw += d;
          xdw += std::fabs(x.data<float>()[m * s.K + k]) * d;
        }
        const double h = (sr != 0 ? sr : sx) / 2 * (1 + 1e-5);
        const double bound = h * sum_w + xdw + h * dw + 1e-6 * sum_x * sw * 127;
        EXPECT_LE(std::fabs(got - exact), bound * (1 + 1e-6) + 1e-6) << "m=" << m << " n=" << n;
      }
    }
    // Gaussian rows keep one term at 0.8% (their estimated loss is about 0.7%), rows with an outlier get two.
    if (tau == 0) EXPECT_EQ(second_terms, s.M);
    if (tau == inf) EXPECT_EQ(second_terms, 0);
    if (tau > 0 && tau < inf && s.K >= 70) EXPECT_TRUE(second_terms > 0 && second_terms < s.M) << second_terms << " of " << s.M;
  }
}

// A weight row's int8 scale as defined, one pass per candidate in f32 as specified: of s·c for
// c = 1, 0.99, ..., 0.50 (s = max|w| / 127, or 1 for a row below 127 of the smallest normal), the
// first with the least squared error of w - clamp(round_even(w / t), ±127)·t, summed in double.
float reference_scale(const float* w, int64_t K) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(w[k]));
  const float s = amax >= 127.0f * std::numeric_limits<float>::min() ? amax / 127.0f : 1.0f;
  float best = s;
  double best_error = std::numeric_limits<double>::infinity();
  for (int c = 100; c >= 50; --c) {
    const float t = c == 100 ? s : s * static_cast<float>(c) / 100.0f;
    double e = 0;
    for (int64_t k = 0; k < K; ++k) {
      const float step = std::clamp(std::nearbyint(w[k] / t), -127.0f, 127.0f) * t;
      const double d = w[k] - step;
      e += d * d;
    }
    if (e < best_error) best = t, best_error = e;
  }
  return best;
}

struct ThreadsGuard {
  int saved = get_num_threads();
  ~ThreadsGuard() { set_num_threads(saved); }
};

TEST(Precision, Int8ScaleSearchFollowsItsDefinitionOnAnyThreadCount) {
  // Rows of every kind the search meets: ordinary, all zero, below 127 of the smallest normal (scale 1),
  // candidate scales past the smallest normal, ±FLT_MAX beside 1e30s, heavy tails; K = 37 (not a
  // multiple of any vector width), 41 rows (several chunks of rows per thread).
  constexpr int64_t N = 41, K = 37;
  const float tiny = std::numeric_limits<float>::min(), huge = std::numeric_limits<float>::max();
  Tensor W = randn({N, K});
  float* w = W.data<float>();
  for (int64_t k = 0; k < K; ++k) {
    w[1 * K + k] = 0.0f;
    w[2 * K + k] *= 1e-3f * tiny;
    w[3 * K + k] *= 60.0f * tiny;
    w[4 * K + k] *= 1e30f;
  }
  w[4 * K + 5] = huge;
  w[4 * K + 9] = -huge;
  for (int64_t n = 5; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) w[n * K + k] *= std::ldexp(1.0f, static_cast<int>(n % 9) - 4);
    if (n % 3 == 0) w[n * K + (n * 5) % K] *= 30.0f;  // a heavy tail: the residual term
  }
  ThreadsGuard threads;
  testing::IsaGuard guard;
  for (Isa isa : supported_isas()) {  // the errors of the candidates come from the kernel table
    set_isa(isa);
    SCOPED_TRACE(isa_name(isa));
    set_num_threads(3);
    const PackedLinear pw(W, Precision::Int8);
    set_num_threads(1);
    const PackedLinear serial(W, Precision::Int8);
    set_num_threads(3);
    for (const PackedLinear* p : {&pw, &serial}) {
      const auto* q = static_cast<const int8_t*>(p->data().raw_data());
      for (int64_t n = 0; n < N; ++n) {
        const float sw = p->scales().data<float>()[n];
        ASSERT_EQ(sw, reference_scale(w + n * K, K)) << "row " << n;
        for (int64_t k = 0; k < K; ++k) {
          ASSERT_EQ(q[n * K + k], std::clamp(std::nearbyint(w[n * K + k] / sw), -127.0f, 127.0f)) << n << ", " << k;
        }
      }
      // The residual rows: their residual w - q·scale (f32) on the steps scale / 2^p.
      ASSERT_TRUE(p->residual_rows().defined());
      const auto* rq = static_cast<const int8_t*>(p->residual_data().raw_data());
      for (int64_t j = 0; j < p->residual_rows().numel(); ++j) {
        const int64_t n = p->residual_rows().data<int64_t>()[j];
        std::vector<float> r(static_cast<size_t>(K));
        for (int64_t k = 0; k < K; ++k) {
          r[static_cast<size_t>(k)] = w[n * K + k] - static_cast<float>(q[n * K + k]) * p->scales().data<float>()[n];
        }
        const float sr = p->residual_scales().data<float>()[j];
        ASSERT_EQ(sr, reference_residual_scale(r.data(), q + n * K, K, p->scales().data<float>()[n]))
            << "residual of row " << n;
        for (int64_t k = 0; k < K; ++k) {
          ASSERT_EQ(rq[j * K + k], std::clamp(std::nearbyint(r[static_cast<size_t>(k)] / sr), -127.0f, 127.0f));
        }
      }
    }
    EXPECT_TRUE(testing::bitwise_equal(pw.residual_rows(), serial.residual_rows()));
  }
  // Rows 1 and 9 not finite: the error names the first, on any thread count.
  w[1 * K + 3] = std::numeric_limits<float>::quiet_NaN();
  w[9 * K + 0] = -std::numeric_limits<float>::infinity();
  for (int t : {1, 3}) {
    set_num_threads(t);
    EXPECT_THAT(testing::error_of([&] { PackedLinear bad(W, Precision::Int8); }),
                HasSubstr("PackedLinear: weight row 1 holds NaN or inf"))
        << t << " threads";
  }
}

TEST(Precision, Bf16IsTheF32ProductOfRoundedValues) {
  testing::IsaGuard guard;
  // activation_error 0 (the default): two terms on every row; 0.8%: only on the rows estimated to lose more.
  for (const double tau : {0.0, 0.008})
  for (const Shapes& s : {Shapes{1, 1, 1}, Shapes{7, 3, 5}, Shapes{37, 70, 45}, Shapes{129, 384, 17}}) {
    const Tensor x = randn({s.M, s.K}), W = randn({s.N, s.K}), b = randn({s.N});
    const PackedLinear pw(W, Precision::BF16);
    ASSERT_EQ(pw.data().dtype(), DType::BF16);
    const Tensor xr = x.to(DType::BF16).to(DType::F32), wr = W.to(DType::BF16).to(DType::F32);
    for (Isa isa : supported_isas()) {
      set_isa(isa);
      const Tensor y = linear(x, pw, b);
      for (int64_t m = 0; m < s.M; ++m) {
        for (int64_t n = 0; n < s.N; ++n) {
          double ref = b.data<float>()[n], mag = std::fabs(ref);
          for (int64_t k = 0; k < s.K; ++k) {
            const double p = static_cast<double>(xr.data<float>()[m * s.K + k]) * wr.data<float>()[n * s.K + k];
            ref += p;
            mag += std::fabs(p);
          }
          // f32 sums of exact products: each addition rounds by at most 2^-24 of the running magnitude.
          EXPECT_NEAR(y.data<float>()[m * s.N + n], ref, (s.K + 1) * 6e-8 * mag) << isa_name(isa) << " m=" << m;
        }
      }
    }
  }
}

// bf16 out: the same f32 sums rounded once; bf16 in: read as it is (the f32 input rounded first
// gives the same bits), strided views too. f32 and int8 weights refuse a bf16 output.
TEST(Precision, Bf16ActivationsInAndOut) {
  testing::IsaGuard guard;
  const Tensor x = randn({37, 70}), W = randn({45, 70}), b = randn({45});
  const PackedLinear pw(W, Precision::BF16);
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    const Tensor y = linear(x, pw, b);
    const Tensor yb = linear(x, pw, b, DType::BF16);
    ASSERT_EQ(yb.dtype(), DType::BF16);
    EXPECT_TRUE(testing::bitwise_equal(yb, y.to(DType::BF16))) << isa_name(isa);
    EXPECT_TRUE(testing::bitwise_equal(linear(x.to(DType::BF16), pw, b, DType::BF16), yb)) << isa_name(isa);
    const Tensor wide = randn({37, 90}).to(DType::BF16);
    const Tensor view = wide.slice(1, 10, 80);  // [37, 70], row stride 90
    ASSERT_FALSE(view.is_contiguous());
    EXPECT_TRUE(testing::bitwise_equal(linear(view, pw, b), linear(view.to(DType::F32), pw, b)))
        << isa_name(isa) << ": a strided bf16 view";
  }
  EXPECT_THAT(testing::error_of([&] { linear(x, PackedLinear(W, Precision::Int8), b, DType::BF16); }),
              HasSubstr("output dtype bf16 with a int8 weight"));
  EXPECT_THAT(testing::error_of([&] { linear(x, PackedLinear(W, Precision::F32), b, DType::BF16); }),
              HasSubstr("output dtype bf16 with a f32 weight"));
}

TEST(Precision, RowsNonFiniteInputsAndStoredParts) {
  const Tensor W = randn({6, 5}), b = randn({6});
  const PackedLinear pw(W, Precision::Int8);
  const PackedLinear part = pw.rows(2, 5);
  const Tensor x = randn({3, 5});
  const Tensor full = linear(x, pw, b), some = linear(x, part, b.slice(0, 2, 5));
  if (linear_gemm_route(Precision::Int8) == "f32") {  // f32 sums of another width: within K + 1 roundings
    double mag = 0;
    const Tensor d = dequantize(pw);
    for (int64_t m = 0; m < 3; ++m) {
      for (int64_t n = 0; n < 6; ++n) {
        double a = std::fabs(b.data<float>()[n]);
        for (int64_t k = 0; k < 5; ++k) a += std::fabs(x.data<float>()[m * 5 + k] * d.data<float>()[n * 5 + k]);
        mag = std::max(mag, a);
      }
    }
    EXPECT_TRUE(testing::compare(some, full.slice(1, 2, 5)).within(0, 2 * 6 * 6e-8 * mag));
  } else {  // integer sums
    EXPECT_TRUE(testing::bitwise_equal(full.slice(1, 2, 5).contiguous(), some));
  }
  Tensor bad = x.clone();
  bad.data<float>()[5 + 2] = std::numeric_limits<float>::infinity();  // row 1
  const Tensor y = linear(bad, pw, b);
  for (int64_t n = 0; n < 6; ++n) {
    EXPECT_TRUE(std::isnan(y.data<float>()[6 + n]));
    EXPECT_EQ(y.data<float>()[n], full.data<float>()[n]);
  }
  const PackedLinear back = PackedLinear::from_int8(pw.data(), pw.scales(), "w");
  EXPECT_TRUE(testing::bitwise_equal(linear(x, back, b), full));
  EXPECT_THAT(testing::error_of([&] { PackedLinear::from_int8(pw.data(), Tensor::zeros({5}, DType::F32), "w"); }),
              HasSubstr("w: scales: expected f32 [6], got f32 [5]"));
  EXPECT_THAT(testing::error_of([&] { PackedLinear::from_int8(pw.data(), Tensor::zeros({6}, DType::F32), "w"); }),
              HasSubstr("w: scale 0 must be finite and positive, got 0"));
  EXPECT_THAT(testing::error_of([&] { PackedLinear::from_int8(W, pw.scales(), "w"); }),
              HasSubstr("w: expected int8 [out, in] data, got f32 [6, 5]"));
  EXPECT_THAT(testing::error_of([&] { linear(randn({2, 4}), pw); }), HasSubstr("does not match the int8 weight [6, 5]"));
  EXPECT_THAT(testing::error_of([] { precision_from_name("fp8"); }), HasSubstr("f32, bf16 or int8, got \"fp8\""));
}

// residual_error: +inf gives no residual rows (one int8 term per weight row, the rest as the
// default's: same rows, scales and outputs of the rows without one); 0 gives every row that loses
// anything; a negative one is an error naming the argument.
TEST(Precision, Int8ResidualErrorChoosesTheWeightRowsWithASecondTerm) {
  const int64_t N = 41, K = 129;
  Tensor W = randn({N, K}, 0.2);
  for (int64_t n = 0; n < N; n += 3) W.data<float>()[n * K + (n * 11) % K] *= 20.0f;  // heavy rows
  const Tensor x = randn({9, K}), b = randn({N});
  const double inf = std::numeric_limits<double>::infinity();
  const PackedLinear dflt(W, Precision::Int8), none(W, Precision::Int8, 0, {}, inf), all(W, Precision::Int8, 0, {}, 0);
  ASSERT_TRUE(dflt.residual_rows().defined());
  EXPECT_FALSE(none.residual_rows().defined());
  EXPECT_FALSE(none.residual_data().defined());
  ASSERT_TRUE(all.residual_rows().defined());
  EXPECT_EQ(all.residual_rows().numel(), N);  // random values: no row rounds exactly
  EXPECT_TRUE(testing::bitwise_equal(none.data(), dflt.data()));
  EXPECT_TRUE(testing::bitwise_equal(none.scales(), dflt.scales()));
  const Tensor y_none = linear(x, none, b), y_dflt = linear(x, dflt, b);
  std::vector<bool> has_residual(static_cast<size_t>(N), false);
  for (int64_t j = 0; j < dflt.residual_rows().numel(); ++j) {
    has_residual[static_cast<size_t>(dflt.residual_rows().data<int64_t>()[j])] = true;
  }
  const bool integer = linear_gemm_route(Precision::Int8) != "f32";
  int64_t differ = 0;
  for (int64_t n = 0; n < N; ++n) {
    const Tensor a = y_none.slice(1, n, n + 1).contiguous(), d = y_dflt.slice(1, n, n + 1).contiguous();
    if (!has_residual[static_cast<size_t>(n)]) {
      if (integer) EXPECT_TRUE(testing::bitwise_equal(a, d)) << "n=" << n;
    } else {
      differ += !testing::bitwise_equal(a, d);
    }
  }
  EXPECT_GT(differ, 0);  // the second term changes the rows that have it
  EXPECT_THAT(testing::error_of([&] { PackedLinear(W, Precision::Int8, 0, {}, -0.01); }),
              HasSubstr("residual_error must be at least 0"));
}

// Stored residual parts: those heads writes load as they are (the same outputs, bit for bit); a
// residual of a scale of its own (as heads stored it before 2026-12) is quantized again as the
// constructor quantizes a residual: on the step sw / 2^p of least squared error that fits.
TEST(Precision, StoredResidualRowsLoadAsWrittenOrOnTheRowsSteps) {
  const int64_t N = 37, K = 129;
  Tensor W = randn({N, K}, 51);
  for (int64_t n = 0; n < N; n += 2) W.data<float>()[n * K + (n * 7) % K] *= 25.0f;  // heavy rows: residual terms
  const PackedLinear pw(W, Precision::Int8);
  ASSERT_TRUE(pw.residual_rows().defined());
  const Tensor x = randn({7, K}, 52), b = randn({N}, 53);
  const PackedLinear back = PackedLinear::from_int8(pw.data(), pw.scales(), "w", pw.residual_rows(),
                                                    pw.residual_data(), pw.residual_scales());
  EXPECT_TRUE(testing::bitwise_equal(back.residual_data(), pw.residual_data()));
  EXPECT_TRUE(testing::bitwise_equal(back.residual_scales(), pw.residual_scales()));
  EXPECT_TRUE(testing::bitwise_equal(linear(x, back, b), linear(x, pw, b)));

  // The legacy form: the residual r = W − q·sw on the step max|r| / 127 of its own.
  const int64_t Nr = pw.residual_rows().numel();
  Tensor rdata = Tensor::empty({Nr, K}, DType::I8), rscale = Tensor::empty({Nr}, DType::F32);
  const auto* q = static_cast<const int8_t*>(pw.data().raw_data());
  std::vector<double> legacy(static_cast<size_t>(Nr * K));
  for (int64_t j = 0; j < Nr; ++j) {
    const int64_t n = pw.residual_rows().data<int64_t>()[j];
    const float sw = pw.scales().data<float>()[n];
    float amax = 0;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(W.data<float>()[n * K + k] - q[n * K + k] * sw));
    const float s = amax / 127.0f;
    rscale.data<float>()[j] = s;
    for (int64_t k = 0; k < K; ++k) {
      const auto v = static_cast<int8_t>(std::lround((W.data<float>()[n * K + k] - q[n * K + k] * sw) / s));
      static_cast<int8_t*>(rdata.raw_data())[j * K + k] = v;
      legacy[static_cast<size_t>(j * K + k)] = static_cast<double>(v) * s;
    }
  }
  const PackedLinear old = PackedLinear::from_int8(pw.data(), pw.scales(), "w", pw.residual_rows(), rdata, rscale);
  ASSERT_EQ(old.residual_rows().numel(), Nr);
  const auto* rq = static_cast<const int8_t*>(old.residual_data().raw_data());
  std::vector<float> r(static_cast<size_t>(K));
  for (int64_t j = 0; j < Nr; ++j) {
    const int64_t n = pw.residual_rows().data<int64_t>()[j];
    for (int64_t k = 0; k < K; ++k) r[static_cast<size_t>(k)] = static_cast<float>(legacy[static_cast<size_t>(j * K + k)]);
    const float sr = old.residual_scales().data<float>()[j];
    ASSERT_EQ(sr, reference_residual_scale(r.data(), q + n * K, K, pw.scales().data<float>()[n])) << "row " << n;
    for (int64_t k = 0; k < K; ++k) {
      ASSERT_EQ(rq[j * K + k], std::clamp(std::nearbyint(r[static_cast<size_t>(k)] / sr), -127.0f, 127.0f))
          << "row " << n << ", k " << k;
    }
  }
  // and the layer stays within int8's rounding of the stored weight: outputs near the original's
  const Tensor y = linear(x, old, b), y0 = linear(x, pw, b);
  double e = 0, m = 0;
  for (int64_t i = 0; i < y.numel(); ++i) {
    e = std::max(e, static_cast<double>(std::abs(y.data<float>()[i] - y0.data<float>()[i])));
    m = std::max(m, static_cast<double>(std::abs(y0.data<float>()[i])));
  }
  EXPECT_LT(e, 1e-2 * m);
}

// Rows far below 1 (down to subnormals) quantize without NaN: the product stays within the bound.
TEST(Precision, TinyRowsQuantizeWithoutNaN) {
  testing::IsaGuard guard;
  const PackedLinear pw(randn({4, 20}), Precision::Int8);
  Tensor x = randn({3, 20});
  for (int64_t k = 0; k < 20; ++k) {
    x.data<float>()[k] *= 1e-39f;        // subnormal row
    x.data<float>()[20 + k] *= 1e-30f;   // small normal row
  }
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    const Tensor y = linear(x, pw);
    for (int64_t i = 0; i < y.numel(); ++i) EXPECT_TRUE(std::isfinite(y.data<float>()[i])) << isa_name(isa) << " " << i;
    for (int64_t n = 0; n < 4; ++n) EXPECT_LT(std::fabs(y.data<float>()[n]), 1e-36) << isa_name(isa);
    for (int64_t n = 0; n < 4; ++n) EXPECT_LT(std::fabs(y.data<float>()[4 + n]), 1e-27) << isa_name(isa);
  }
}

}  // namespace
}  // namespace heads
