// sdpa_bwd_test.cc — SDPA backward: the float64 reference against central finite differences,
// the fast kernel against the reference on the forward's shape grid, every ISA path.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "common/testing.h"
#include "heads/runtime.h"
#include "heads/sdpa.h"
#include "kernels/sdpa_case.h"

namespace heads {
namespace {

using testing::randn;

using testing::IsaGuard;

// L = sum(out ∘ G) for a fixed random G, so dL/dout = G.
double loss_f64(const Tensor& q, const Tensor& k, const Tensor& v, const SdpaOptions& o, const Tensor& G) {
  const Tensor out = ref::sdpa_fwd_f64(q, k, v, o).out;
  double s = 0;
  for (int64_t i = 0; i < out.numel(); ++i) s += out.data<double>()[i] * G.data<double>()[i];
  return s;
}

// Central differences of the float64 forward, as torch.autograd.gradcheck does.
void expect_matches_finite_differences(const Tensor& q, const Tensor& k, const Tensor& v, SdpaOptions o,
                                       const std::string& what) {
  const Tensor G = randn({q.size(0), q.size(1), q.size(2), v.size(3)}).to(DType::F64);
  const Tensor q64 = q.to(DType::F64).clone(), k64 = k.to(DType::F64).clone(), v64 = v.to(DType::F64).clone();
  const bool float_mask = o.attn_mask.defined() && is_floating(o.attn_mask.dtype());
  Tensor m64 = float_mask ? o.attn_mask.to(DType::F64).clone() : Tensor();
  if (float_mask) o.attn_mask = m64;
  const SdpaGrads g = ref::sdpa_bwd_f64(G, q64, k64, v64, o, float_mask);
  auto check = [&](Tensor& x, const Tensor& grad, const char* name) {
    // The kernels hold a float mask in f32: probe it with a step f32 resolves.
    const bool mask = std::string(name) == "mask";
    const double eps = mask ? 1e-2 : 1e-6, tol = mask ? 1e-4 : 1e-6;
    for (int64_t i = 0; i < x.numel(); ++i) {
      double* p = x.data<double>() + i;
      const double save = *p;
      *p = save + eps;
      const double up = loss_f64(q64, k64, v64, o, G);
      *p = save - eps;
      const double down = loss_f64(q64, k64, v64, o, G);
      *p = save;
      const double fd = (up - down) / (2 * eps), an = grad.data<double>()[i];
      ASSERT_NEAR(an, fd, tol * (1 + std::fabs(fd))) << what << " d" << name << "[" << i << "]";
    }
  };
  check(const_cast<Tensor&>(q64), g.dq, "q");
  check(const_cast<Tensor&>(k64), g.dk, "k");
  check(const_cast<Tensor&>(v64), g.dv, "v");
  if (float_mask) check(m64, g.dmask, "mask");
}

TEST(SdpaBackward, ReferenceMatchesFiniteDifferences) {
  const Tensor q = randn({1, 2, 3, 4}), k = randn({1, 2, 5, 4}), v = randn({1, 2, 5, 3});
  SdpaOptions o;
  expect_matches_finite_differences(q, k, v, o, "plain");
  o.scale = 0.7;
  expect_matches_finite_differences(q, k, v, o, "scale");
  o = {};
  o.is_causal = true;
  expect_matches_finite_differences(q, k, v, o, "causal");
  o.causal_align = CausalAlign::BottomRight;
  expect_matches_finite_differences(q, k, v, o, "causal-br");
  o = {};
  Tensor bm = testing::rand_bool({3, 5}, 0.6);
  for (int j = 0; j < 5; ++j) static_cast<uint8_t*>(bm.raw_data())[2 * 5 + j] = 0;  // row 2 fully masked
  o.attn_mask = bm;
  expect_matches_finite_differences(q, k, v, o, "bool mask with a fully masked row");
  o.attn_mask = randn({1, 1, 3, 5});
  expect_matches_finite_differences(q, k, v, o, "float mask (and its gradient)");
  o = {};
  o.dropout_p = 0.3;
  o.dropout_seed = 9;
  expect_matches_finite_differences(q, k, v, o, "dropout");
  o = {};
  o.enable_gqa = true;
  expect_matches_finite_differences(randn({1, 4, 3, 4}), k, v, o, "gqa");
}

Tensor filled(const Shape& shape, float value) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::fill(t.data<float>(), t.data<float>() + t.numel(), value);
  return t;
}

// The active path's forward + backward against the float64 reference gradients. The gradients go
// into NaN-filled tensors: every element must be written (the kernel sets, not adds, its first
// contribution, and zeroes rows no score reaches).
void expect_fast_matches(const SdpaGrads& ref, const Tensor& dout, const Tensor& q, const Tensor& k,
                         const Tensor& v, const SdpaOptions& o, bool mask_grad, const std::string& what) {
  const SdpaResult f = sdpa(q, k, v, o);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const SdpaGrads g = sdpa_backward_out(filled(q.shape(), nan), filled(k.shape(), nan), filled(v.shape(), nan),
                                        dout, q, k, v, f, o, mask_grad);
  for (const auto& [got, want, name] : {std::tuple{&g.dq, &ref.dq, "dq"}, {&g.dk, &ref.dk, "dk"},
                                        {&g.dv, &ref.dv, "dv"}, {&g.dmask, &ref.dmask, "dmask"}}) {
    if (!want->defined()) continue;
    const auto e = testing::compare(*got, *want);
    ASSERT_TRUE(e.within(1e-5, 1e-5)) << what << ": " << name << " max err " << e.max_abs << " (ref max "
                                      << e.max_ref << ")";
  }
}

// The same on every ISA path (the caller holds an IsaGuard), against one float64 reference.
void expect_every_path_matches(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                               const SdpaOptions& o, bool mask_grad, const std::string& what) {
  const SdpaGrads ref = ref::sdpa_bwd_f64(dout, q, k, v, o, mask_grad);
  for (Isa isa : testing::test_isas()) {
    set_isa(isa);
    expect_fast_matches(ref, dout, q, k, v, o, mask_grad, what + " isa=" + std::string(isa_name(isa)));
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(SdpaBackward, FastMatchesReferenceOnTheGrid) {
  IsaGuard guard;
  const testing::Sample pick;
  int64_t n = 0;
  for (int64_t B : {1, 2}) {
    for (auto [H, Hkv] : {std::pair<int64_t, int64_t>{1, 1}, {4, 4}, {4, 1}, {4, 2}}) {
      for (auto [Lq, Lk] : {std::pair<int64_t, int64_t>{1, 7}, {7, 1}, {64, 129}, {129, 64}, {33, 33}}) {
        for (int64_t D : {1, 8, 63, 64, 80}) {
          if (!pick(++n)) continue;
          SdpaCase c{.B = B, .H = H, .Hkv = Hkv, .Lq = Lq, .Lk = Lk, .D = D, .Dv = n % 3 == 0 ? D + 5 : D};
          c.pad = n % 4 == 0 ? 3 : 0;
          switch (n % 6) {
            case 1: c.mask = SdpaMask::Bool; break;
            case 2: c.mask = SdpaMask::Float; break;  // and its gradient
            case 3: c.causal = true; break;
            case 4: c.causal = true; c.causal_align = CausalAlign::BottomRight; break;
            case 5: c.dropout_p = 0.2; break;
            default: c.scale = 0.3; break;
          }
          c.seed = testing::rng()();
          const SdpaCase::Inputs in = c.draw();
          expect_every_path_matches(in.dout, in.q, in.k, in.v, in.options, c.mask == SdpaMask::Float, c.str());
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST(SdpaBackward, IndependentOfThreadCount) {
  const SdpaCase c{.B = 2, .H = 4, .Hkv = 2, .Lq = 70, .Lk = 90, .D = 24, .Dv = 16, .causal = true,
                   .mask = SdpaMask::Float, .dropout_p = 0.1, .pad = 2, .seed = testing::rng()()};
  const SdpaCase::Inputs in = c.draw();
  const Tensor &q = in.q, &k = in.k, &v = in.v, &dout = in.dout;
  const SdpaOptions& o = in.options;
  const int saved = get_num_threads();
  set_num_threads(1);
  const SdpaResult f = sdpa(q, k, v, o);
  const SdpaGrads g1 = sdpa_backward(dout, q, k, v, f, o);
  for (int t : {2, 3}) {
    set_num_threads(t);
    const SdpaGrads gt = sdpa_backward(dout, q, k, v, f, o);
    EXPECT_TRUE(testing::bitwise_equal(g1.dq, gt.dq) && testing::bitwise_equal(g1.dk, gt.dk) &&
                testing::bitwise_equal(g1.dv, gt.dv)) << c.str() << " threads=" << t;
  }
  set_num_threads(saved);
  EXPECT_THROW(sdpa_backward(randn({2, 4, 70, 15}), q, k, v, f, o), Error);
}

TEST(SdpaBackward, LongKeyRangesSpanSeveralKeyGroups) {
  // Key ranges longer than one key group (1024 keys for every head size up to D + Dv = 256, 128 keys
  // at D + Dv = 2048), with ragged ends, every option that depends on the key position. One (b, kv
  // head) pair: the keys are also cut into splits (sdpa_split.h), of 260 keys at Lk = 1300, so the
  // D = 1024 case is the one whose tasks run several key groups each. 150 queries: steps of several
  // query tiles (128 queries on AVX-512) and a ragged last one.
  IsaGuard guard;
  const testing::Sample pick;
  int n = 0;
  for (auto [Lq, Lk, D] :
       {std::tuple<int64_t, int64_t, int64_t>{37, 1100, 16}, {150, 1300, 128}, {3, 2100, 40}, {37, 1300, 1024}}) {
    for (int variant = 0; variant < 4; ++variant) {
      if (!pick(n++)) continue;
      SdpaCase c{.H = 2, .Hkv = 1, .Lq = Lq, .Lk = Lk, .D = D, .seed = testing::rng()()};
      switch (variant) {
        case 0: c.causal = true; c.causal_align = CausalAlign::BottomRight; break;
        case 1: c.mask = SdpaMask::Float; break;
        case 2: c.dropout_p = 0.3; break;
        default: c.mask = SdpaMask::Bool; break;
      }
      const SdpaCase::Inputs in = c.draw();
      expect_every_path_matches(in.dout, in.q, in.k, in.v, in.options, c.mask == SdpaMask::Float, c.str());
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(SdpaBackward, OutVariantWritesIntoStridedViews) {
  // Gradients written into head views of [B, L, H, D] buffers (as MultiheadAttention does) equal
  // the contiguous ones; rows the views do not cover stay untouched.
  const Tensor q = randn({2, 3, 33, 20}), k = randn({2, 3, 41, 20}), v = randn({2, 3, 41, 12});
  const Tensor dout = randn({2, 3, 33, 12});
  SdpaOptions o;
  o.attn_mask = randn({33, 41});
  o.dropout_p = 0.2;
  IsaGuard guard;
  for (Isa isa : testing::test_isas()) {
    set_isa(isa);
    const SdpaResult f = sdpa(q, k, v, o);
    const SdpaGrads want = sdpa_backward(dout, q, k, v, f, o);
    Tensor bq = filled({2, 33, 3, 21}, 7.0f), bk = filled({2, 41, 3, 20}, 7.0f);
    Tensor bv = filled({2, 41, 3, 12}, 7.0f);
    const Tensor dq = bq.slice(3, 0, 20).permute({0, 2, 1, 3}), dk = bk.permute({0, 2, 1, 3});
    const Tensor dv = bv.permute({0, 2, 1, 3});
    const SdpaGrads got = sdpa_backward_out(dq, dk, dv, dout, q, k, v, f, o);
    EXPECT_TRUE(testing::bitwise_equal(got.dq.contiguous(), want.dq)) << isa_name(isa);
    EXPECT_TRUE(testing::bitwise_equal(got.dk.contiguous(), want.dk)) << isa_name(isa);
    EXPECT_TRUE(testing::bitwise_equal(got.dv.contiguous(), want.dv)) << isa_name(isa);
    const Tensor pad = bq.slice(3, 20, 21).contiguous();
    for (int64_t i = 0; i < pad.numel(); ++i) ASSERT_EQ(pad.data<float>()[i], 7.0f);
    EXPECT_THROW(sdpa_backward_out(dk, dk, dv, dout, q, k, v, f, o), Error);  // dq of k's shape
    EXPECT_THROW(sdpa_backward_out(dq, dk, bv.permute({0, 2, 3, 1}), dout, q, k, v, f, o), Error);
  }
}

TEST(SdpaBackward, LargeWriteOnceGradientsAreStreamed) {
  // One query head per kv head and one step of queries, dK + dV past 16 MB: the kernel streams dK
  // and dV past the caches (whole aligned vectors; D = 63 mixes them with ordinary stores).
  IsaGuard guard;
  const int64_t Lk = 32768;
  const testing::Sample pick(3);  // the three shapes below
  int n = 0;
  for (auto [Lq, D] : {std::pair<int64_t, int64_t>{1, 64}, {3, 63}, {9, 64}}) {
    if (!pick(n++)) continue;
    const Tensor q = randn({1, 2, Lq, D}), k = randn({1, 2, Lk, D}), v = randn({1, 2, Lk, D});
    // Gradients with 32768 keys are small: scale dout so the 1e-5 bound is a relative one.
    Tensor dout = randn({1, 2, Lq, D});
    for (int64_t i = 0; i < dout.numel(); ++i) dout.data<float>()[i] *= 1000.0f;
    SdpaOptions o;
    if (Lq == 3) o.attn_mask = testing::rand_bool({Lq, Lk}, 0.9);
    std::ostringstream os;
    os << "Lq=" << Lq << " Lk=" << Lk << " D=" << D;
    expect_every_path_matches(dout, q, k, v, o, false, os.str());
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(SdpaBackward, OneVisibleKeyGivesNoQueryGradient) {
  // With one visible key a row's softmax is constant, so dq = 0. The kernels get P = 1 and D = dP
  // (up to a rounding), so dS and dq vanish; an error of ~1e-7 here (e.g. D = dO · O rounded
  // differently from dP) is what MultiheadAttention's input gradients amplify past 1e-4.
  IsaGuard guard;
  for (auto [Lq, causal] : {std::pair<int64_t, bool>{1, false}, {37, false}, {5, true}}) {
    const int64_t Lk = causal ? Lq : 1;
    const Tensor q = randn({2, 3, Lq, 64}), k = randn({2, 3, Lk, 64}), v = randn({2, 3, Lk, 64});
    const Tensor dout = randn({2, 3, Lq, 64});
    SdpaOptions o;
    o.is_causal = causal;
    for (Isa isa : testing::test_isas()) {
      set_isa(isa);
      const SdpaGrads g = sdpa_backward(dout, q, k, v, sdpa(q, k, v, o), o);
      double dv_max = 0, dq_max = 0;
      for (int64_t i = 0; i < g.dv.numel(); ++i) dv_max = std::max<double>(dv_max, std::fabs(g.dv.data<float>()[i]));
      // rows that see one key: all of them, or the first of each (b, h) under causal masking
      for (int64_t bh = 0; bh < 6; ++bh) {
        for (int64_t i = 0; i < (causal ? 1 : Lq); ++i) {
          for (int64_t d = 0; d < 64; ++d) {
            dq_max = std::max<double>(dq_max, std::fabs(g.dq.data<float>()[(bh * Lq + i) * 64 + d]));
          }
        }
      }
      EXPECT_LE(dq_max, 1e-8 * dv_max) << "Lq=" << Lq << (causal ? " causal" : "") << " isa=" << isa_name(isa);
    }
  }
}

// NaN in the inputs reaches the gradients of what it touches, as in the forward (docs/numerics.md).
TEST(SdpaBackward, NonFiniteInputsReachTheGradientsTheyTouch) {
  IsaGuard guard;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Lq = 3: the few-query steps; Lq = 40: the tiled steps; Lk = 200 spans two key blocks.
  for (auto [Lq, Lk] : {std::pair<int64_t, int64_t>{3, 70}, {40, 70}, {40, 200}}) {
    const std::string shape = "Lq=" + std::to_string(Lq) + " Lk=" + std::to_string(Lk);
    const Tensor k = randn({1, 2, Lk, 8}), v = randn({1, 2, Lk, 8}), dout = randn({1, 2, Lq, 8});
    {  // NaN in query row 1 of head 0: dq row 1, and dk/dv of head 0 (row 1 sees every key); not head 1
      Tensor q = randn({1, 2, Lq, 8});
      q.data<float>()[1 * 8 + 2] = nan;
      for (Isa isa : testing::test_isas()) {
        set_isa(isa);
        const std::string where = shape + " isa=" + isa_name(isa);
        const SdpaGrads g = sdpa_backward(dout, q, k, v, sdpa(q, k, v, {}), {});
        EXPECT_TRUE(std::isnan(g.dq.item_as_double({0, 0, 1, 0}))) << where;
        EXPECT_TRUE(std::isfinite(g.dq.item_as_double({0, 0, 0, 0}))) << where;
        EXPECT_TRUE(std::isnan(g.dk.item_as_double({0, 0, Lk - 1, 0})) && std::isnan(g.dv.item_as_double({0, 0, 0, 0})))
            << where;
        EXPECT_TRUE(std::isfinite(g.dk.item_as_double({0, 1, 0, 0})) && std::isfinite(g.dq.item_as_double({0, 1, 1, 0})))
            << where;
      }
      expect_every_path_matches(dout, q, k, v, {}, false, shape + " NaN query");
    }
    {  // NaN in a key row: every query gradient of that head (every row sees the key), that key's dk
      const Tensor q = randn({1, 2, Lq, 8});
      Tensor kn = k.clone();
      kn.data<float>()[5 * 8 + 1] = nan;
      for (Isa isa : testing::test_isas()) {
        set_isa(isa);
        const std::string where = shape + " isa=" + isa_name(isa);
        const SdpaGrads g = sdpa_backward(dout, q, kn, v, sdpa(q, kn, v, {}), {});
        EXPECT_TRUE(std::isnan(g.dq.item_as_double({0, 0, Lq - 1, 0})) && std::isnan(g.dk.item_as_double({0, 0, 5, 0})))
            << where;
        EXPECT_TRUE(std::isfinite(g.dq.item_as_double({0, 1, 0, 0}))) << where;
      }
      expect_every_path_matches(dout, q, kn, v, {}, false, shape + " NaN key");
    }
  }
}

// bf16 inputs: the gradients are the f32 backward's of the widened inputs, rounded once to bf16, on
// every path but AMX tiles; against the float64 reference they carry about one bf16 rounding.
TEST(SdpaBackward, Bf16GradientsAreTheF32OnesRoundedOnce) {
  IsaGuard guard;
  for (SdpaCase c : {SdpaCase{.B = 2, .H = 4, .Hkv = 2, .Lq = 129, .Lk = 77, .D = 63, .Dv = 40, .causal = true},
                     SdpaCase{.H = 2, .Lq = 3, .Lk = 300, .D = 64, .mask = SdpaMask::Float, .dropout_p = 0.2}}) {
    c.dtype = DType::BF16;
    c.seed = testing::rng()();
    const SdpaCase::Inputs in = c.draw();
    const Tensor dout = in.dout.to(DType::BF16);
    const SdpaGrads ref = ref::sdpa_bwd_f64(dout, in.q, in.k, in.v, in.options);
    for (Isa isa : testing::test_isas()) {
      set_isa(isa);
      const std::string what = c.str() + " isa=" + isa_name(isa);
      const SdpaResult f = sdpa(in.q, in.k, in.v, in.options);
      const SdpaGrads g = sdpa_backward(dout, in.q, in.k, in.v, f, in.options);
      SdpaResult f_wide = f;  // an f32 out with bf16 inputs (as sdpa_merge_ leaves it): the same gradients
      f_wide.out = f.out.to(DType::F32);
      const SdpaGrads g_wide = sdpa_backward(dout, in.q, in.k, in.v, f_wide, in.options);
      EXPECT_TRUE(testing::bitwise_equal(g.dq, g_wide.dq) && testing::bitwise_equal(g.dk, g_wide.dk) &&
                  testing::bitwise_equal(g.dv, g_wide.dv)) << what;
      SdpaResult f32 = f;
      f32.out = f.out.to(DType::F32);
      const SdpaGrads w = sdpa_backward(dout.to(DType::F32), in.q.to(DType::F32), in.k.to(DType::F32),
                                        in.v.to(DType::F32), f32, in.options);
      for (const auto& [got, f32_grad, want, name] :
           {std::tuple{&g.dq, &w.dq, &ref.dq, "dq"}, {&g.dk, &w.dk, &ref.dk, "dk"}, {&g.dv, &w.dv, &ref.dv, "dv"}}) {
        ASSERT_EQ(got->dtype(), DType::BF16) << what << " " << name;
        // (on AMX tiles P and dS are rounded to bf16 for the products: other sums than the f32 path's)
        if (isa != Isa::Amx) EXPECT_TRUE(testing::bitwise_equal(*got, f32_grad->to(DType::BF16))) << what << " " << name;
        const auto e = testing::compare(*got, *want);
        EXPECT_LE(e.max_abs, 1e-2 * e.max_ref) << what << " " << name;  // bf16 keeps 8 bits: 2^-8 = 0.4%
      }
    }
  }
}

// Blockwise attention, as ring attention runs it: the keys cut into blocks, each block attended on
// its own and the (out, lse) pairs merged by sdpa_merge_; then each block's backward from the merged
// out and lse (partial_keys), dq summed over the blocks. Equal to attention over all keys (the
// float64 reference), forward and backward, on every ISA path — also where a row sees nothing in
// some blocks (a bool mask with rows that are empty in a block, and one row empty everywhere).
TEST(SdpaBackward, KeyBlocksMergeToTheWholeRow) {
  IsaGuard guard;
  struct Case { int64_t B, H, Hkv, Lq, D, Dv; std::vector<int64_t> blocks; };
  for (const Case& c : {Case{1, 1, 1, 1, 8, 8, {1, 7}}, Case{2, 4, 2, 33, 63, 20, {5, 64, 1, 60}},
                        Case{1, 2, 1, 129, 64, 64, {129, 129}}, Case{2, 2, 2, 7, 80, 17, {300, 29}},
                        Case{1, 1, 1, 5, 16, 150, {40, 9, 3}}}) {  // Dv past the merge's 64-column blocks
    int64_t Lk = 0;
    for (int64_t n : c.blocks) Lk += n;
    const Tensor q = randn({c.B, c.H, c.Lq, c.D}), k = randn({c.B, c.Hkv, Lk, c.D}), v = randn({c.B, c.Hkv, Lk, c.Dv});
    const Tensor dout = randn({c.B, c.H, c.Lq, c.Dv});
    Tensor mask = testing::rand_bool({c.Lq, Lk}, 0.7);
    uint8_t* mb = static_cast<uint8_t*>(mask.raw_data());
    for (int64_t j = 0; j < c.blocks[0]; ++j) mb[j] = 0;      // row 0: nothing in the first block
    if (c.Lq > 1) std::fill(mb + Lk, mb + 2 * Lk, uint8_t{0});  // row 1: nothing at all
    SdpaOptions whole;
    whole.attn_mask = mask;
    whole.enable_gqa = c.H != c.Hkv;
    whole.scale = 0.2;
    const SdpaResult want = ref::sdpa_fwd_f64(q, k, v, whole);
    const SdpaGrads want_g = ref::sdpa_bwd_f64(dout, q, k, v, whole);
    for (Isa isa : testing::test_isas()) {
      set_isa(isa);
      const std::string what = "Lq=" + std::to_string(c.Lq) + " Lk=" + std::to_string(Lk) + " isa=" + isa_name(isa);
      SdpaResult acc;
      std::vector<SdpaOptions> opts;
      for (int64_t j0 = 0; const int64_t n : c.blocks) {
        SdpaOptions o = whole;
        o.attn_mask = mask.slice(1, j0, j0 + n);
        o.partial_keys = true;
        opts.push_back(o);
        const SdpaResult part = sdpa(q, k.slice(2, j0, j0 + n), v.slice(2, j0, j0 + n), o);
        if (!acc.out.defined()) {
          acc.out = part.out.clone();
          acc.lse = part.lse.clone();
        } else {
          sdpa_merge_(acc.out, acc.lse, part.out, part.lse);
        }
        j0 += n;
      }
      for (const auto& [got, ref, name] : {std::tuple{&acc.out, &want.out, "out"}, {&acc.lse, &want.lse, "lse"}}) {
        const auto e = testing::compare(*got, *ref);
        ASSERT_TRUE(e.within(1e-5, 1e-5)) << what << " " << name << " max err " << e.max_abs;
      }
      Tensor dq = Tensor::zeros(q.shape(), DType::F32);
      const Tensor dk = Tensor::empty(k.shape(), DType::F32), dv = Tensor::empty(v.shape(), DType::F32);
      for (size_t b = 0, j0 = 0; b < c.blocks.size(); j0 += c.blocks[b], ++b) {
        const int64_t j1 = static_cast<int64_t>(j0) + c.blocks[b];
        const Tensor dq_b = Tensor::empty(q.shape(), DType::F32);
        sdpa_backward_out(dq_b, dk.slice(2, j0, j1), dv.slice(2, j0, j1), dout, q, k.slice(2, j0, j1),
                          v.slice(2, j0, j1), acc, opts[b]);
        for (int64_t i = 0; i < dq.numel(); ++i) dq.data<float>()[i] += dq_b.data<float>()[i];
      }
      for (const auto& [got, ref, name] :
           {std::tuple<const Tensor*, const Tensor*, const char*>{&dq, &want_g.dq, "dq"}, {&dk, &want_g.dk, "dk"},
            {&dv, &want_g.dv, "dv"}}) {
        const auto e = testing::compare(*got, *ref);
        ASSERT_TRUE(e.within(1e-5, 1e-5)) << what << " " << name << " max err " << e.max_abs << " (ref max "
                                          << e.max_ref << ")";
      }
    }
  }
  // A sink belongs to the whole row: refused with partial_keys.
  SdpaOptions o;
  o.sinks = randn({2});
  o.partial_keys = true;
  const Tensor q = randn({1, 2, 3, 8}), k = randn({1, 2, 5, 8});
  EXPECT_NE(testing::error_of([&] { sdpa_backward(q, q, k, k, sdpa(q, k, k, o), o); }).find("partial_keys with sinks"),
            std::string::npos);
  // and so do options that see positions, which a block has only locally
  for (int which = 0; which < 3; ++which) {
    SdpaOptions p;
    p.partial_keys = true;
    if (which == 0) p.alibi_slopes = randn({2});
    if (which == 1) p.window_left = 2;
    if (which == 2) p.dropout_p = 0.1;
    EXPECT_NE(testing::error_of([&] { sdpa(q, k, k, p); }).find("the block's own positions"), std::string::npos)
        << which;
  }
}

TEST(SdpaMerge, RejectsMismatchedShapes) {
  const Tensor out = randn({1, 2, 3, 4}), lse = randn({1, 2, 3});
  EXPECT_NE(testing::error_of([&] { sdpa_merge_(out, lse, randn({1, 2, 3, 5}), lse); }).find("out_b"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] { sdpa_merge_(out, randn({1, 2, 4}), out, lse); }).find("lse: expected"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] { sdpa_merge_(out, lse, out, randn({2, 3})); }).find("lse_b"), std::string::npos);
  EXPECT_NE(testing::error_of([&] { sdpa_merge_(out.to(DType::BF16), lse, out, lse); }).find("out: expected f32"),
            std::string::npos);
}

}  // namespace
}  // namespace heads
