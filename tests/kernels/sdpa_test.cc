// sdpa_test.cc — the fused SDPA forward against the float64 reference.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <iterator>
#include <sstream>
#include <string>

#include "common/testing.h"
#include "heads/runtime.h"
#include "heads/sdpa.h"
#include "heads/sdpa_case.h"
#include "kernels/sdpa_problem.h"
#include "kernels/sdpa_split.h"

namespace heads {
namespace {

using testing::compare;
using testing::randn;

constexpr double kRtol = 1e-5, kAtol = 1e-6;

using testing::error_of;
using testing::IsaGuard;

// Every ISA path this CPU runs, with and without weights, against the float64 reference.
void expect_matches_ref(const Tensor& q, const Tensor& k, const Tensor& v, SdpaOptions o,
                        const std::string& what) {
  IsaGuard guard;
  o.need_weights = true;
  if (o.dropout_p > 0 && !o.dropout_seed) o.dropout_seed = 1234;
  const SdpaResult ref = ref::sdpa_fwd_f64(q, k, v, o);
  for (Isa isa : testing::test_isas()) {
    set_isa(isa);
    const std::string where = what + " isa=" + isa_name(isa);
    o.need_weights = true;
    const SdpaResult r = sdpa(q, k, v, o);
    const auto e = compare(r.out, ref.out);
    EXPECT_TRUE(e.within(kRtol, kAtol)) << where << ": out max err " << e.max_abs << " (ref max "
                                        << e.max_ref << ")";
    const auto ew = compare(r.weights, ref.weights);
    EXPECT_TRUE(ew.within(kRtol, kAtol)) << where << ": weights max err " << ew.max_abs;
    const auto el = compare(r.lse, ref.lse);
    EXPECT_TRUE(el.within(kRtol, kAtol) || el.max_abs == 0) << where << ": lse max err " << el.max_abs;
    // Without weights the output must be the same bits (the weights pass is separate).
    o.need_weights = false;
    const SdpaResult r2 = sdpa(q, k, v, o);
    EXPECT_TRUE(testing::bitwise_equal(r.out, r2.out)) << where << ": need_weights changed output";
    EXPECT_FALSE(r2.weights.defined());
  }
}

// A case's drawn inputs on every path against the reference.
void expect_case_matches_ref(const SdpaCase& c) {
  const SdpaCase::Inputs in = c.draw();
  expect_matches_ref(in.q, in.k, in.v, in.options, c.str() + " threads=" + std::to_string(get_num_threads()));
}

// The grid: B, H/Hkv, Lq x Lk, D; every other case with inputs laid out as a projection's output
// (pad 1 to 7); masks, causal alignments and scale cycle through the cases.
TEST(Sdpa, GridMatchesReference) {
  int64_t n = 0;
  for (int64_t B : {1, 3}) {
    for (auto [H, Hkv] : {std::pair<int64_t, int64_t>{1, 1}, {4, 4}, {4, 1}, {4, 2}}) {
      for (int64_t Lq : {1, 7, 64, 129}) {
        for (int64_t Lk : {1, 7, 64, 129}) {
          for (int64_t D : {1, 8, 63, 64, 80, 128}) {
            ++n;
            SdpaCase c{.B = B, .H = H, .Hkv = Hkv, .Lq = Lq, .Lk = Lk, .D = D, .Dv = n % 5 == 0 ? D + 3 : D};
            c.pad = n % 2 == 0 ? n % 7 + 1 : 0;
            switch (n % 6) {
              case 1: c.mask = SdpaMask::Bool; break;
              case 2: c.mask = SdpaMask::Float; break;
              case 3: c.causal = true; break;
              case 4: c.causal = true; c.causal_align = CausalAlign::BottomRight; break;
              case 5: c.scale = 0.37; break;
              default: break;
            }
            c.seed = testing::rng()();
            expect_case_matches_ref(c);
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

TEST(Sdpa, EveryMaskKind) {
  const int64_t B = 2, H = 3, Lq = 17, Lk = 33, D = 24;
  const Tensor q = randn({B, H, Lq, D}), k = randn({B, H, Lk, D}), v = randn({B, H, Lk, D});
  const std::vector<std::pair<std::string, Tensor>> masks = {
      {"bool [Lq, Lk]", testing::rand_bool({Lq, Lk}, 0.7)},
      {"bool [B, H, Lq, Lk]", testing::rand_bool({B, H, Lq, Lk}, 0.7)},
      {"bool [B, 1, 1, Lk]", testing::rand_bool({B, 1, 1, Lk}, 0.7)},
      {"bool [1, H, Lq, 1]", testing::rand_bool({1, H, Lq, 1}, 0.9)},
      {"bool [Lk]", testing::rand_bool({Lk}, 0.7)},
      {"float [Lq, Lk]", randn({Lq, Lk}, 2.0)},
      {"float [B, H, Lq, Lk]", randn({B, H, Lq, Lk}, 2.0)},
      {"float [H, 1, Lk]", randn({H, 1, Lk}, 2.0)},
      {"float64 [Lq, Lk]", randn({Lq, Lk}).to(DType::F64)},
      {"float with -inf", [&] {
         Tensor m = randn({Lq, Lk});
         float* p = m.data<float>();
         for (int64_t i = 0; i < m.numel(); i += 3) p[i] = -std::numeric_limits<float>::infinity();
         return m;
       }()},
      {"strided bool [Lq, Lk] (transposed)", testing::rand_bool({Lk, Lq}, 0.7).transpose(0, 1)},
  };
  for (const auto& [name, m] : masks) {
    for (bool causal : {false, true}) {
      SdpaOptions o;
      o.attn_mask = m;
      o.is_causal = causal;
      expect_matches_ref(q, k, v, o, name + (causal ? " + causal" : ""));
    }
  }
}

// Few queries against many keys: the decode kernel, whose keys are split into chunks and merged
// when B·Hkv is small (Lk past 512), with GQA rows sharing a head.
TEST(Sdpa, DecodeShapesWithSplitKeys) {
  for (SdpaCase c : {SdpaCase{.Lq = 1, .Lk = 1500, .D = 80}, SdpaCase{.H = 4, .Hkv = 1, .Lq = 3, .Lk = 2111, .D = 64, .Dv = 33},
                     SdpaCase{.B = 2, .H = 2, .Lq = 1, .Lk = 700, .D = 128}, SdpaCase{.H = 8, .Hkv = 2, .Lq = 4, .Lk = 1025, .D = 17, .Dv = 300},
                     SdpaCase{.B = 3, .Lq = 2, .Lk = 4100, .D = 8}}) {
    c.seed = testing::rng()();
    expect_case_matches_ref(c);
    c.mask = SdpaMask::Bool;
    expect_case_matches_ref(c);
    c.mask = SdpaMask::Float;
    c.causal = true;
    c.causal_align = CausalAlign::BottomRight;
    expect_case_matches_ref(c);
    c.mask = SdpaMask::None;
    c.causal_align = CausalAlign::TopLeft;  // hides all but the first Lq keys
    c.dropout_p = 0.2;
    expect_case_matches_ref(c);
  }
}

TEST(Sdpa, CausalAlignments) {
  for (auto [Lq, Lk] : {std::pair<int64_t, int64_t>{5, 12}, {12, 5}, {9, 9}, {1, 40}, {40, 1}}) {
    const Tensor q = randn({1, 2, Lq, 16}), k = randn({1, 2, Lk, 16}), v = randn({1, 2, Lk, 16});
    for (auto align : {CausalAlign::TopLeft, CausalAlign::BottomRight}) {
      SdpaOptions o;
      o.is_causal = true;
      o.causal_align = align;
      o.need_weights = true;
      const SdpaResult r = sdpa(q, k, v, o);
      // Check the visibility pattern directly: weight (i, j) is zero iff j is hidden.
      const int64_t off = align == CausalAlign::BottomRight ? Lk - Lq : 0;
      for (int64_t i = 0; i < Lq; ++i) {
        for (int64_t j = 0; j < Lk; ++j) {
          const double w = r.weights.item_as_double({0, 1, i, j});
          if (j > i + off) EXPECT_EQ(w, 0.0) << "Lq=" << Lq << " Lk=" << Lk << " i=" << i << " j=" << j;
          else EXPECT_GT(w, 0.0) << "Lq=" << Lq << " Lk=" << Lk << " i=" << i << " j=" << j;
        }
      }
      expect_matches_ref(q, k, v, o, "causal Lq=" + std::to_string(Lq) + " Lk=" + std::to_string(Lk));
    }
  }
}

TEST(Sdpa, FullyMaskedRowsGiveZeros) {
  const int64_t Lq = 9, Lk = 70;
  const Tensor q = randn({2, 2, Lq, 8}), k = randn({2, 2, Lk, 8}), v = randn({2, 2, Lk, 8});
  Tensor m = testing::rand_bool({Lq, Lk}, 0.8);
  auto* p = static_cast<uint8_t*>(m.raw_data());
  for (int64_t j = 0; j < Lk; ++j) p[3 * Lk + j] = 0;  // row 3 sees nothing
  SdpaOptions o;
  o.attn_mask = m;
  o.need_weights = true;
  const SdpaResult r = sdpa(q, k, v, o);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t d = 0; d < 8; ++d) EXPECT_EQ(r.out.item_as_double({b, h, 3, d}), 0.0);
      for (int64_t j = 0; j < Lk; ++j) EXPECT_EQ(r.weights.item_as_double({b, h, 3, j}), 0.0);
      EXPECT_EQ(r.lse.item_as_double({b, h, 3}), -std::numeric_limits<double>::infinity());
      EXPECT_NE(r.out.item_as_double({b, h, 2, 0}), 0.0);
    }
  }
  expect_matches_ref(q, k, v, o, "fully masked row");
  // Bottom-right causal with Lq > Lk hides every key from the first Lq - Lk rows.
  SdpaOptions c;
  c.is_causal = true;
  c.causal_align = CausalAlign::BottomRight;
  const Tensor q2 = randn({1, 1, 12, 8}), k2 = randn({1, 1, 4, 8}), v2 = randn({1, 1, 4, 8});
  const SdpaResult r2 = sdpa(q2, k2, v2, c);
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(r2.out.item_as_double({0, 0, i, 0}), 0.0) << i;
  EXPECT_NE(r2.out.item_as_double({0, 0, 8, 0}), 0.0);
  // The decode kernel (few queries, keys split into chunks) follows the same rule.
  {
    const Tensor qd = randn({1, 2, 2, 8}), kd = randn({1, 1, 1300, 8}), vd = randn({1, 1, 1300, 8});
    Tensor md = testing::rand_bool({2, 1300}, 0.5);
    for (int64_t j = 0; j < 1300; ++j) static_cast<uint8_t*>(md.raw_data())[1300 + j] = 0;
    SdpaOptions od;
    od.attn_mask = md;
    od.enable_gqa = true;
    IsaGuard guard;
    for (Isa isa : testing::test_isas()) {
      set_isa(isa);
      const SdpaResult rd = sdpa(qd, kd, vd, od);
      for (int64_t h = 0; h < 2; ++h) {
        for (int64_t d = 0; d < 8; ++d) EXPECT_EQ(rd.out.item_as_double({0, h, 1, d}), 0.0) << isa_name(isa);
        EXPECT_NE(rd.out.item_as_double({0, h, 0, 0}), 0.0);
      }
    }
    expect_matches_ref(qd, kd, vd, od, "decode fully masked row");
  }
  // A float mask of -inf everywhere on a row behaves the same.
  Tensor fm = randn({Lq, Lk});
  for (int64_t j = 0; j < Lk; ++j) fm.data<float>()[5 * Lk + j] = -std::numeric_limits<float>::infinity();
  SdpaOptions f;
  f.attn_mask = fm;
  const SdpaResult r3 = sdpa(q, k, v, f);
  for (int64_t d = 0; d < 8; ++d) EXPECT_EQ(r3.out.item_as_double({1, 1, 5, d}), 0.0);
}

// No keys at all (Lk = 0): every row is fully masked, on the decode path (Lq <= 4, which once divided
// by a chunk size of 0) and the tiled one, in f32 and bf16, with and without weights.
TEST(Sdpa, ZeroKeysGiveZeroRowsOnEveryPath) {
  IsaGuard guard;
  for (const testing::KernelPath& path : testing::kernel_paths()) {
    path.select();
    for (int64_t Lq : {1, 3, 4, 5, 40}) {
      for (DType dt : {DType::F32, DType::BF16}) {
        const std::string where = "Lq=" + std::to_string(Lq) + " " + std::string(dtype_name(dt)) + " isa=" + path.name();
        const Tensor q = randn({2, 2, Lq, 8}).to(dt), k = Tensor::empty({2, 2, 0, 8}, dt), v = Tensor::empty({2, 2, 0, 6}, dt);
        SdpaOptions o;
        o.need_weights = true;
        const SdpaResult r = sdpa(q, k, v, o);
        ASSERT_EQ(r.out.shape(), Shape({2, 2, Lq, 6})) << where;
        ASSERT_EQ(r.weights.shape(), Shape({2, 2, Lq, 0})) << where;
        testing::for_each_index(r.out.shape(), [&](const Shape& i) { ASSERT_EQ(r.out.item_as_double(i), 0.0) << where; });
        testing::for_each_index(r.lse.shape(), [&](const Shape& i) {
          ASSERT_EQ(r.lse.item_as_double(i), -std::numeric_limits<double>::infinity()) << where;
        });
      }
    }
  }
  const SdpaResult empty_q = sdpa(randn({1, 2, 0, 8}), randn({1, 2, 5, 8}), randn({1, 2, 5, 8}));
  EXPECT_EQ(empty_q.out.shape(), Shape({1, 2, 0, 8}));
}

// Non-finite inputs (docs/numerics.md): IEEE arithmetic on the rows they reach, the same rows on
// every path and in the float64 reference — never hidden as a masked key or a zero row.
TEST(Sdpa, NonFiniteInputsReachTheRowsTheyTouch) {
  IsaGuard guard;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  auto row_is_nan = [](const Tensor& out, int64_t h, int64_t i) {
    bool all = true;
    for (int64_t d = 0; d < out.size(3); ++d) all = all && std::isnan(out.item_as_double({0, h, i, d}));
    return all;
  };
  auto row_is_finite = [](const Tensor& out, int64_t h, int64_t i) {
    bool all = true;
    for (int64_t d = 0; d < out.size(3); ++d) all = all && std::isfinite(out.item_as_double({0, h, i, d}));
    return all;
  };
  // Lq = 3: the decode path (Lk = 1300: keys split in chunks); Lq = 40: the tiled path.
  for (auto [Lq, Lk] : {std::pair<int64_t, int64_t>{3, 70}, {3, 1300}, {40, 70}, {40, 300}}) {
    const int64_t nk = Lk - 5;  // the poisoned key
    const std::vector<testing::KernelPath> paths = testing::kernel_paths();
    for (const testing::KernelPath& path : paths) {
      path.select();
      for (DType dt : {DType::F32, DType::BF16}) {
        const std::string where = "Lq=" + std::to_string(Lq) + " Lk=" + std::to_string(Lk) + " " +
                                  std::string(dtype_name(dt)) + " isa=" + path.name();
        const Tensor q0 = randn({1, 2, Lq, 8}), k0 = randn({1, 2, Lk, 8}), v0 = randn({1, 2, Lk, 8});
        auto set = [](Tensor t, Shape i, float x) {
          t.data<float>()[((i[0] * t.size(1) + i[1]) * t.size(2) + i[2]) * t.size(3) + i[3]] = x;
          return t;
        };
        auto run = [&](const Tensor& q, const Tensor& k, const Tensor& v, SdpaOptions o, const std::string& what) {
          o.need_weights = true;
          const SdpaResult r = sdpa(q.to(dt), k.to(dt), v.to(dt), o);
          // The reference check visits every path itself: once, from the first path's loop.
          if (dt == DType::F32 && &path == &paths.front()) {
            expect_matches_ref(q, k, v, o, where + " " + what);
            path.select();
          }
          return r;
        };
        {  // NaN in one query row: that row (out, lse, every weight), nothing else
          const SdpaResult r = run(set(q0.clone(), {0, 1, 1, 3}, nan), k0, v0, {}, "NaN query");
          EXPECT_TRUE(row_is_nan(r.out, 1, 1)) << where << " NaN query";
          EXPECT_TRUE(std::isnan(r.lse.item_as_double({0, 1, 1}))) << where;
          EXPECT_TRUE(std::isnan(r.weights.item_as_double({0, 1, 1, 0}))) << where;
          EXPECT_TRUE(row_is_finite(r.out, 1, 0) && row_is_finite(r.out, 0, 1)) << where;
        }
        {  // NaN in a key row: every row that sees it, not the rows a bool mask or causality hides it from
          const Tensor k = set(k0.clone(), {0, 0, nk, 2}, nan);
          EXPECT_TRUE(row_is_nan(run(q0, k, v0, {}, "NaN key").out, 0, Lq - 1)) << where << " NaN key";
          Tensor m = testing::rand_bool({Lq, Lk}, 0.8);
          for (int64_t j = 0; j < Lk; ++j) static_cast<uint8_t*>(m.raw_data())[j] = 1;
          static_cast<uint8_t*>(m.raw_data())[nk] = 0;  // row 0 does not see the NaN key
          static_cast<uint8_t*>(m.raw_data())[Lk + nk] = 1;  // row 1 does
          SdpaOptions o;
          o.attn_mask = m;
          const SdpaResult r = run(q0, k, v0, o, "NaN key, bool mask");
          EXPECT_TRUE(row_is_finite(r.out, 0, 0)) << where << " NaN key hidden by a bool mask";
          EXPECT_TRUE(row_is_nan(r.out, 0, 1)) << where;
          EXPECT_TRUE(row_is_finite(r.out, 1, 1)) << where << " other head";
          SdpaOptions c;
          c.is_causal = true;
          c.causal_align = CausalAlign::BottomRight;  // row i sees keys j <= i + Lk - Lq
          const SdpaResult rc = run(q0, k, v0, c, "NaN key, causal");
          for (int64_t i = 0; i < Lq; ++i) {
            EXPECT_EQ(row_is_nan(rc.out, 0, i), i + Lk - Lq >= nk) << where << " causal row " << i;
            EXPECT_EQ(row_is_finite(rc.out, 0, i), i + Lk - Lq < nk) << where << " causal row " << i;
          }
        }
        {  // NaN in a value row reaches the rows that weigh it
          const SdpaResult r = run(q0, k0, set(v0.clone(), {0, 1, nk, 0}, nan), {}, "NaN value");
          EXPECT_TRUE(std::isnan(r.out.item_as_double({0, 1, 0, 0}))) << where << " NaN value";
          EXPECT_TRUE(std::isfinite(r.out.item_as_double({0, 1, 0, 1})) && row_is_finite(r.out, 0, 0)) << where;
        }
        {  // a +inf score (the query's +inf times positive keys): softmax takes inf - inf, the row is NaN
          Tensor k = k0.clone();
          for (int64_t j = 0; j < Lk; ++j) set(k, {0, 0, j, 0}, 0.5f + std::fabs(k.item_as_double({0, 0, j, 0})));
          const SdpaResult r = run(set(q0.clone(), {0, 0, 1, 0}, inf), k, v0, {}, "+inf score");
          EXPECT_TRUE(row_is_nan(r.out, 0, 1)) << where << " +inf score";
          EXPECT_TRUE(row_is_finite(r.out, 0, 0)) << where;
        }
        {  // NaN in a float mask entry: that row, whatever the NaN's payload bits
          for (const uint32_t bits : {0x7fc00000u, 0x7fc00001u, 0x7fc000ffu, 0xffc12345u}) {
            Tensor fm = randn({Lq, Lk});
            std::memcpy(fm.data<float>() + Lk + 3, &bits, 4);
            SdpaOptions o;
            o.attn_mask = fm;
            const SdpaResult r = run(q0, k0, v0, o, "NaN float mask");
            EXPECT_TRUE(row_is_nan(r.out, 0, 1) && row_is_nan(r.out, 1, 1)) << where << " NaN float mask " << bits;
            EXPECT_TRUE(std::isnan(r.lse.item_as_double({0, 0, 1}))) << where << " " << bits;
            EXPECT_TRUE(row_is_finite(r.out, 0, 0)) << where;
          }
        }
        {  // a row the bool mask hides entirely stays zero, even with NaN in its (hidden) keys
          Tensor m = testing::rand_bool({Lq, Lk}, 0.8);
          for (int64_t j = 0; j < Lk; ++j) static_cast<uint8_t*>(m.raw_data())[j] = 0;
          SdpaOptions o;
          o.attn_mask = m;
          const SdpaResult r = run(q0, set(k0.clone(), {0, 0, nk, 1}, nan), v0, o, "fully masked row");
          for (int64_t d = 0; d < 8; ++d) EXPECT_EQ(r.out.item_as_double({0, 0, 0, d}), 0.0) << where;
          EXPECT_EQ(r.lse.item_as_double({0, 0, 0}), -std::numeric_limits<double>::infinity()) << where;
        }
      }
    }
  }
}

TEST(Sdpa, DropoutOfOneDropsEverything) {
  IsaGuard guard;
  for (Isa isa : testing::test_isas()) {
    set_isa(isa);
    for (int64_t Lq : {2, 40}) {
      SdpaOptions o;
      o.dropout_p = 1.0;
      o.need_weights = true;
      const SdpaResult r = sdpa(randn({1, 2, Lq, 8}), randn({1, 2, 30, 8}), randn({1, 2, 30, 8}), o);
      testing::for_each_index(r.out.shape(), [&](const Shape& i) { ASSERT_EQ(r.out.item_as_double(i), 0.0); });
      testing::for_each_index(r.weights.shape(), [&](const Shape& i) { ASSERT_EQ(r.weights.item_as_double(i), 0.0); });
    }
  }
}

TEST(Sdpa, DropoutStatistics) {
  const int64_t B = 2, H = 4, Lq = 64, Lk = 96, D = 16;
  const Tensor q = randn({B, H, Lq, D}), k = randn({B, H, Lk, D}), v = randn({B, H, Lk, D});
  const double p = 0.3;
  SdpaOptions o;
  o.need_weights = true;
  const SdpaResult plain = sdpa(q, k, v, o);
  o.dropout_p = p;
  o.dropout_seed = 42;
  const SdpaResult a = sdpa(q, k, v, o);
  const SdpaResult b = sdpa(q, k, v, o);
  EXPECT_TRUE(testing::bitwise_equal(a.out, b.out)) << "same seed, different output";
  EXPECT_TRUE(testing::bitwise_equal(a.weights, b.weights));
  // Keep rate and scaling: every kept weight is the plain weight / (1 - p).
  int64_t kept = 0, total = 0;
  double worst = 0;
  testing::for_each_index(a.weights.shape(), [&](const Shape& i) {
    const double w = a.weights.item_as_double(i), w0 = plain.weights.item_as_double(i);
    ++total;
    if (w != 0.0) {
      ++kept;
      worst = std::max(worst, std::fabs(w - w0 / (1.0 - p)) / (w0 / (1.0 - p)));
    }
  });
  const double rate = static_cast<double>(kept) / static_cast<double>(total);
  const double sigma = std::sqrt(p * (1 - p) / static_cast<double>(total));
  EXPECT_NEAR(rate, 1.0 - p, 5 * sigma) << "keep rate " << rate << " over " << total;
  EXPECT_LT(worst, 1e-5) << "kept weights not scaled by 1/(1-p)";
  // The reference draws the same mask, so the output matches it.
  expect_matches_ref(q, k, v, o, "dropout p=0.3");
  // Another seed gives another mask; the mean over many seeds approaches the plain output.
  o.dropout_seed = 43;
  EXPECT_FALSE(testing::bitwise_equal(sdpa(q, k, v, o).out, a.out));
  // Default seeds come from the global generator: manual_seed makes them reproducible.
  o.dropout_seed.reset();
  manual_seed(7);
  const Tensor g1 = sdpa(q, k, v, o).out;
  manual_seed(7);
  const Tensor g2 = sdpa(q, k, v, o).out;
  EXPECT_TRUE(testing::bitwise_equal(g1, g2));
}

// Keys that no query may see (past the last row's causal limit: a preallocated cache's unused end)
// never reach the output, even holding NaN or inf, on every path.
TEST(Sdpa, KeysNoQuerySeesNeverReachTheOutput) {
  IsaGuard guard;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const int64_t Lq : {3, 5, 40}) {  // 3: the decode kernel
    const int64_t Lk = 64;
    Tensor k = randn({1, 2, Lk, 24}), v = randn({1, 2, Lk, 20});
    for (const int64_t j : {Lq, Lq + 5, Lk - 1}) {  // top-left causal: key j is seen by rows i >= j
      for (int64_t d = 0; d < 24; ++d) k.data<float>()[j * 24 + d] = nan;
      for (int64_t d = 0; d < 20; ++d) v.data<float>()[(Lk + j) * 20 + d] = d % 2 ? inf : nan;
    }
    const Tensor q = randn({1, 2, Lq, 24});
    SdpaOptions o;
    o.is_causal = true;
    for (const testing::KernelPath& path : testing::kernel_paths()) {
      path.select();
      for (DType dt : {DType::F32, DType::BF16}) {
        const SdpaResult r = sdpa(q.to(dt), k.to(dt), v.to(dt), o);
        const Tensor out = r.out.to(DType::F32);
        for (int64_t i = 0; i < out.numel(); ++i) {
          ASSERT_TRUE(std::isfinite(out.data<float>()[i])) << "Lq=" << Lq << " " << dtype_name(dt) << " isa=" << path.name();
        }
      }
    }
  }
}

// Long key ranges put several query tiles into one sweep of the keys (forward_tiles_per_sweep):
// those groups (a ragged last group; causal in both alignments, masks, dropout, GQA, padded
// layouts, weights; f32 and bf16) against the reference, and the same bits as tiles run one by
// one (64 threads leave too few tasks to group).
TEST(Sdpa, TilesSharingAKeySweep) {
  IsaGuard guard;
  const int saved = get_num_threads();
  const uint64_t seed = testing::rng()();
  for (int n = 0; n < 7; ++n) {
    SdpaCase c{.B = 1, .H = 4, .Hkv = 2, .Lq = 150, .Lk = 1100, .D = 40, .Dv = 33, .seed = seed + n};
    switch (n) {
      case 1: c.causal = true; break;
      case 2: c.causal = true; c.causal_align = CausalAlign::BottomRight; break;
      case 3: c.mask = SdpaMask::Bool; break;
      case 4: c.mask = SdpaMask::Float; c.pad = 3; break;
      case 5: c.dropout_p = 0.2; break;
      case 6: c.dtype = DType::BF16; c.Lk = 2200; c.causal = true; c.causal_align = CausalAlign::BottomRight; break;
      default: break;
    }
    const SdpaCase::Inputs in = c.draw();
    SdpaOptions o = in.options;
    o.need_weights = true;
    // Groups form on 1 thread and not on 64, for AVX2's and AVX-512's tiles (16 and 32 queries).
    const kernels::SdpaProblem pb = kernels::make_sdpa_problem("sdpa", in.q, in.k, in.v, o);
    for (int64_t tile : {16, 32}) {
      const auto bytes = static_cast<int64_t>(dtype_size(c.dtype));
      ASSERT_GT(kernels::forward_tiles_per_sweep(pb, tile, bytes, 1), 1) << c.str();
      ASSERT_EQ(kernels::forward_tiles_per_sweep(pb, tile, bytes, 64), 1) << c.str();
    }
    set_num_threads(1);
    if (c.dtype == DType::F32) expect_case_matches_ref(c);
    for (const testing::KernelPath& path : testing::kernel_paths()) {
      if (c.dtype == DType::F32 && std::string(path.bf16_products) == "dot") continue;  // f32: the same kernel
      path.select();
      set_num_threads(1);
      const SdpaResult grouped = sdpa(in.q, in.k, in.v, o);
      set_num_threads(64);
      const SdpaResult single = sdpa(in.q, in.k, in.v, o);
      const std::string where = c.str() + " isa=" + path.name();
      EXPECT_TRUE(testing::bitwise_equal(grouped.out, single.out)) << where;
      EXPECT_TRUE(testing::bitwise_equal(grouped.lse, single.lse)) << where;
      EXPECT_TRUE(testing::bitwise_equal(grouped.weights, single.weights)) << where;
    }
    set_num_threads(saved);
    if (HasFailure()) return;
  }
}

// bf16 on paths that widen (bf16_attention_products() == "widen"): K and V are widened to f32 in
// the thread's cache (a whole head when it fits, else block by block) and the f32 micro-kernels
// run on them, so out is the f32 kernel's on the widened inputs rounded once, and lse and the
// weights are its bits. Heads of several batch entries and kv heads interleave across 1 to 3
// threads, so a stale staged head would show.
TEST(Sdpa, Bf16WideningIsTheF32KernelRoundedOnce) {
  IsaGuard guard;
  const int saved = get_num_threads();
  const uint64_t seed = testing::rng()();
  const SdpaCase cases[] = {
      {.B = 3, .H = 4, .Hkv = 2, .Lq = 129, .Lk = 77, .D = 63, .Dv = 40, .mask = SdpaMask::Bool, .pad = 2},  // whole heads
      {.B = 2, .H = 2, .Lq = 40, .Lk = 300, .D = 24, .Dv = 20, .causal = true, .causal_align = CausalAlign::BottomRight},
      {.B = 2, .H = 3, .Hkv = 1, .Lq = 33, .Lk = 1100, .D = 64, .Dv = 72, .mask = SdpaMask::Float, .dropout_p = 0.2},  // by block
      {.H = 4, .Hkv = 2, .Lq = 150, .Lk = 2200, .D = 40, .Dv = 33, .causal = true},  // by block; grouped (16-query tiles) or chunked (32)
  };
  int checked = 0;
  for (int n = 0; n < static_cast<int>(std::size(cases)); ++n) {
    SdpaCase c = cases[n];
    c.dtype = DType::BF16;
    c.seed = seed + n;
    const SdpaCase::Inputs in = c.draw();
    const Tensor q32 = in.q.to(DType::F32), k32 = in.k.to(DType::F32), v32 = in.v.to(DType::F32);
    for (const bool window : {false, true}) {
      SdpaOptions o = in.options;
      o.need_weights = true;
      if (window) o.window_left = 50, o.window_right = c.causal ? -1 : 9;  // tiles start past key 0
      for (const testing::KernelPath& path : testing::kernel_paths()) {
        path.select();
        if (std::string(bf16_attention_products()) != "widen") continue;
        for (int threads : {1, 2, 3}) {
          set_num_threads(threads);
          const SdpaResult rb = sdpa(in.q, in.k, in.v, o), rf = sdpa(q32, k32, v32, o);
          const std::string where = c.str() + (window ? " window" : "") + " isa=" + path.name() +
                                    " threads=" + std::to_string(threads);
          ASSERT_EQ(rb.out.dtype(), DType::BF16) << where;
          EXPECT_TRUE(testing::bitwise_equal(rb.out, rf.out.to(DType::BF16))) << where;
          EXPECT_TRUE(testing::bitwise_equal(rb.lse, rf.lse)) << where;
          EXPECT_TRUE(testing::bitwise_equal(rb.weights, rf.weights)) << where;
          ++checked;
        }
      }
      if (HasFailure()) break;
    }
  }
  set_num_threads(saved);
  // Every ISA below AVX-512-BF16 widens, and the scalar path runs everywhere.
  EXPECT_GT(checked, 0);
}

// Few query tiles against long keys: the forward cuts the keys into chunks whose partial outputs
// are merged after (forward_key_chunks). Against the float64 reference, bitwise independent of the
// thread count, the output unchanged by need_weights, for the options that touch a chunk's edges
// (causal limits inside and past chunks, a left window, sinks counted once, dropout, masks, GQA).
TEST(Sdpa, KeyChunksOfFewTilesMergeExactly) {
  IsaGuard guard;
  const int saved = get_num_threads();
  const uint64_t seed = testing::rng()();
  for (int n = 0; n < 10; ++n) {
    SdpaCase c{.B = 1, .H = 2, .Hkv = 1, .Lq = 20, .Lk = 3000, .D = 40, .Dv = 33, .seed = seed + n};
    switch (n) {
      case 1: c.causal = true; break;  // top-left: every row within the first chunk, the others see nothing
      case 2: c.causal = true; c.causal_align = CausalAlign::BottomRight; break;
      case 3: c.mask = SdpaMask::Bool; c.pad = 3; break;
      case 4: c.mask = SdpaMask::Float; c.dropout_p = 0.2; break;
      case 5: c.dtype = DType::BF16; break;
      case 6: c.dtype = DType::BF16; c.causal = true; c.causal_align = CausalAlign::BottomRight; c.D = 64; c.Dv = 64; break;
      case 9: c.Dv = 150; c.mask = SdpaMask::Bool; break;  // merged in blocks of 64 columns
      default: break;
    }
    const SdpaCase::Inputs in = c.draw();
    SdpaOptions o = in.options;
    if (n == 7) o.sinks = randn({c.H}, 2.0);
    if (n == 8) o.window_left = 700, o.window_right = 100;
    o.need_weights = true;
    const kernels::SdpaProblem pb = kernels::make_sdpa_problem("sdpa", in.q, in.k, in.v, o);
    for (int64_t tile : {16, 32}) ASSERT_GT(kernels::forward_key_chunks(pb, tile, 128).n, 1) << c.str();
    const SdpaResult ref = ref::sdpa_fwd_f64(in.q, in.k, in.v, o);
    const double tol = c.dtype == DType::BF16 ? 8e-3 : kRtol;
    for (const testing::KernelPath& path : testing::kernel_paths()) {
      if (c.dtype == DType::F32 && std::string(path.bf16_products) == "dot") continue;  // f32: the same kernel
      path.select();
      const std::string where = c.str() + " case " + std::to_string(n) + " isa=" + path.name();
      set_num_threads(1);
      const SdpaResult r1 = sdpa(in.q, in.k, in.v, o);
      set_num_threads(3);
      const SdpaResult r3 = sdpa(in.q, in.k, in.v, o);
      SdpaOptions no_weights = o;
      no_weights.need_weights = false;
      const SdpaResult rn = sdpa(in.q, in.k, in.v, no_weights);
      EXPECT_TRUE(compare(r1.out, ref.out).within(tol, tol * 0.1)) << where << ": out max err " << compare(r1.out, ref.out).max_abs;
      EXPECT_TRUE(compare(r1.lse, ref.lse).within(kRtol, kAtol) || compare(r1.lse, ref.lse).max_abs == 0) << where << ": lse";
      EXPECT_TRUE(compare(r1.weights, ref.weights).within(kRtol, kAtol)) << where << ": weights max err "
                                                                         << compare(r1.weights, ref.weights).max_abs;
      EXPECT_TRUE(testing::bitwise_equal(r1.out, r3.out) && testing::bitwise_equal(r1.lse, r3.lse) &&
                  testing::bitwise_equal(r1.weights, r3.weights)) << where << ": thread count changed the bits";
      EXPECT_TRUE(testing::bitwise_equal(r1.out, rn.out)) << where << ": need_weights changed the output";
    }
    if (HasFailure()) break;
  }
  set_num_threads(saved);
}

TEST(Sdpa, ResultIndependentOfThreadCount) {
  const SdpaCase c{.B = 3, .H = 4, .Hkv = 2, .Lq = 129, .Lk = 77, .D = 63, .Dv = 40, .causal = true,
                   .mask = SdpaMask::Float, .dropout_p = 0.1, .pad = 2, .seed = testing::rng()()};
  const SdpaCase::Inputs in = c.draw();
  const Tensor &q = in.q, &k = in.k, &v = in.v;
  SdpaOptions o = in.options;
  o.need_weights = true;
  IsaGuard guard;
  const int saved = get_num_threads();
  for (Isa isa : testing::test_isas()) {
    set_isa(isa);
    set_num_threads(1);
    const SdpaResult r1 = sdpa(q, k, v, o);
    for (int t : {2, 3}) {
      set_num_threads(t);
      const SdpaResult rt = sdpa(q, k, v, o);
      EXPECT_TRUE(testing::bitwise_equal(r1.out, rt.out)) << "isa=" << isa_name(isa) << " threads=" << t;
      EXPECT_TRUE(testing::bitwise_equal(r1.weights, rt.weights)) << "isa=" << isa_name(isa) << " threads=" << t;
    }
  }
  set_num_threads(saved);
}

// Under set_batch_invariant(true) a sequence's rows are the same bits alone (any length, the
// decode kernel's shapes included) and padded into a batch beside other sequences (bool key mask),
// in f32 and bf16, on every path: which kernel runs no longer depends on the padded length.
TEST(Sdpa, BatchInvariantSequenceAloneOrPadded) {
  IsaGuard guard;
  const bool saved = batch_invariant();
  set_batch_invariant(true);
  constexpr int64_t H = 3, D = 20, B = 3;
  for (const testing::KernelPath& path : testing::kernel_paths()) {
    path.select();
    for (DType dt : {DType::F32, DType::BF16}) {
      if (dt == DType::F32 && std::string(path.bf16_products) == "dot") continue;  // f32: the same kernel
      for (int64_t L : {1, 2, 4, 5, 9}) {
        for (int64_t Lp : {L, L + 1, int64_t{7}, int64_t{133}}) {
          if (Lp < L) continue;
          const Tensor q = testing::randn({1, H, L, D}).to(dt), k = testing::randn({1, H, L, D}).to(dt),
                       v = testing::randn({1, H, L, D}).to(dt);
          const Tensor alone = sdpa(q, k, v).out;
          // batch item 1 holds the sequence, padded to Lp; items 0 and 2 are other sequences
          Tensor qb = testing::randn({B, H, Lp, D}).to(dt), kb = testing::randn({B, H, Lp, D}).to(dt),
                 vb = testing::randn({B, H, Lp, D}).to(dt);
          for (auto [dst, src] : {std::pair<Tensor*, const Tensor*>{&qb, &q}, {&kb, &k}, {&vb, &v}}) {
            dst->select(0, 1).slice(1, 0, L).copy_from(src->select(0, 0));
          }
          Tensor mask = Tensor::zeros({B, 1, 1, Lp}, DType::Bool);  // true = may attend
          auto* m = static_cast<uint8_t*>(mask.raw_data());
          for (int64_t b = 0; b < B; ++b) {
            for (int64_t j = 0; j < Lp; ++j) m[b * Lp + j] = b != 1 || j < L;
          }
          SdpaOptions o;
          o.attn_mask = mask;
          const Tensor batched = sdpa(qb, kb, vb, o).out.select(0, 1).slice(1, 0, L).contiguous();
          EXPECT_TRUE(testing::bitwise_equal(alone.select(0, 0), batched))
              << "isa=" << path.name() << " dtype=" << dtype_name(dt) << " L=" << L << " padded to " << Lp;
        }
      }
    }
  }
  set_batch_invariant(saved);
}

// Cross-attention of few queries against long keys: the forward would cut the keys into a number
// of chunks that depends on B and H; under set_batch_invariant(true) it does not cut them, and a
// sequence's rows are the same bits alone and in a batch.
TEST(Sdpa, BatchInvariantCrossAttentionOfLongKeys) {
  IsaGuard guard;
  const bool saved = batch_invariant();
  constexpr int64_t H = 3, Lq = 16, Lk = 4100, D = 20, B = 3;
  for (DType dt : {DType::F32, DType::BF16}) {
    const Tensor q = testing::randn({1, H, Lq, D}).to(dt), k = testing::randn({1, H, Lk, D}).to(dt),
                 v = testing::randn({1, H, Lk, D}).to(dt);
    Tensor qb = testing::randn({B, H, Lq, D}).to(dt), kb = testing::randn({B, H, Lk, D}).to(dt),
           vb = testing::randn({B, H, Lk, D}).to(dt);
    for (auto [dst, src] : {std::pair<Tensor*, const Tensor*>{&qb, &q}, {&kb, &k}, {&vb, &v}}) {
      dst->select(0, 1).copy_from(src->select(0, 0));
    }
    // Without invariance the two calls cut their keys differently (on both tile sizes).
    const kernels::SdpaProblem alone_pb = kernels::make_sdpa_problem("sdpa", q, k, v, {});
    const kernels::SdpaProblem batch_pb = kernels::make_sdpa_problem("sdpa", qb, kb, vb, {});
    for (int64_t tile : {16, 32}) {
      ASSERT_NE(kernels::forward_key_chunks(alone_pb, tile, 128).n, kernels::forward_key_chunks(batch_pb, tile, 128).n);
    }
    set_batch_invariant(true);
    for (const testing::KernelPath& path : testing::kernel_paths()) {
      if (dt == DType::F32 && std::string(path.bf16_products) == "dot") continue;  // f32: the same kernel
      path.select();
      const Tensor alone = sdpa(q, k, v).out, batched = sdpa(qb, kb, vb).out.select(0, 1).contiguous();
      EXPECT_TRUE(testing::bitwise_equal(alone.select(0, 0), batched)) << "isa=" << path.name() << " " << dtype_name(dt);
    }
    set_batch_invariant(saved);
  }
}

// bf16 inputs, f32 accumulation: within twice the error of a plain bf16 computation (P and the
// output rounded to bf16), both measured against float64 on the same bf16 inputs (STYLE.md).
double naive_bf16_error(const Tensor& q, const Tensor& k, const Tensor& v, const SdpaOptions& o,
                        const SdpaResult& ref) {
  // Naive: exact softmax weights rounded to bf16, products summed in f32, output rounded.
  const Tensor w = ref.weights;  // f64 [B, H, Lq, Lk]
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2), Dv = v.size(3);
  const int64_t group = H / k.size(1);
  double err = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Lq; ++i)
        for (int64_t d = 0; d < Dv; ++d) {
          float acc = 0;
          for (int64_t j = 0; j < Lk; ++j) {
            const float p = bf16_to_f32(f32_to_bf16(static_cast<float>(w.item_as_double({b, h, i, j}))));
            acc += p * static_cast<float>(v.item_as_double({b, h / group, j, d}));
          }
          const double naive = bf16_to_f32(f32_to_bf16(acc));
          err = std::max(err, std::fabs(naive - ref.out.item_as_double({b, h, i, d})));
        }
  (void)o;
  return err;
}

// f64 and f16 inputs run in f32 and come back in their dtype, forward and backward.
TEST(Sdpa, F64AndF16AreComputedInF32) {
  for (int64_t Lq : {3, 40}) {
    const Tensor q = randn({2, 2, Lq, 24}), k = randn({2, 2, 50, 24}), v = randn({2, 2, 50, 16});
    const Tensor dout = randn({2, 2, Lq, 16});
    SdpaOptions o;
    o.is_causal = true;
    o.causal_align = CausalAlign::BottomRight;
    const SdpaResult ref = ref::sdpa_fwd_f64(q, k, v, o);
    const SdpaGrads gref = ref::sdpa_bwd_f64(dout, q, k, v, o);
    for (auto [dt, tol] : {std::pair{DType::F64, 1e-5}, {DType::F16, 2e-3}}) {
      const Tensor qd = q.to(dt), kd = k.to(dt), vd = v.to(dt), gd = dout.to(dt);
      const SdpaResult r = sdpa(qd, kd, vd, o);
      ASSERT_EQ(r.out.dtype(), dt);
      EXPECT_TRUE(compare(r.out, ref.out).within(tol, tol)) << dtype_name(dt) << " Lq=" << Lq;
      const SdpaGrads g = sdpa_backward(gd, qd, kd, vd, r, o);
      for (const auto& [got, want] : {std::pair{&g.dq, &gref.dq}, {&g.dk, &gref.dk}, {&g.dv, &gref.dv}}) {
        ASSERT_EQ(got->dtype(), dt);
        EXPECT_TRUE(compare(*got, *want).within(tol, tol)) << dtype_name(dt) << " Lq=" << Lq;
      }
    }
  }
}

// Every path this CPU runs (the AMX tiles included: odd D and Dv, key blocks with tails, GQA, masks,
// both causal alignments with Lq > Lk, dropout), with and without weights (the same output bits).
TEST(Sdpa, Bf16WithinTwiceNaiveBf16Error) {
  IsaGuard guard;
  for (const SdpaCase& shape : {SdpaCase{.H = 2, .Lq = 7, .Lk = 129, .D = 64}, SdpaCase{.B = 2, .H = 4, .Hkv = 2, .Lq = 129, .Lk = 64, .D = 63, .Dv = 80},
                                SdpaCase{.Lq = 64, .Lk = 7, .D = 128}, SdpaCase{.H = 4, .Hkv = 1, .Lq = 1, .Lk = 1100, .D = 80},
                                SdpaCase{.H = 2, .Lq = 33, .Lk = 200, .D = 1, .Dv = 8}, SdpaCase{.B = 2, .H = 2, .Hkv = 1, .Lq = 3, .Lk = 77, .D = 32, .Dv = 17},
                                SdpaCase{.H = 3, .Hkv = 1, .Lq = 70, .Lk = 300, .D = 96, .Dv = 48}, SdpaCase{.Lq = 50, .Lk = 20, .D = 40, .Dv = 33}}) {
    for (int variant = 0; variant < 5; ++variant) {
      SdpaCase c = shape;
      c.dtype = DType::BF16;
      c.seed = testing::rng()();
      if (variant == 1) c.mask = SdpaMask::Bool;
      if (variant == 2) {
        c.causal = true;
        c.causal_align = CausalAlign::BottomRight;
        c.mask = SdpaMask::Float;
      }
      if (variant == 3) c.causal = true;  // top-left
      if (variant == 4) c.dropout_p = 0.25;
      const SdpaCase::Inputs in = c.draw();
      SdpaOptions o = in.options;
      o.need_weights = true;
      const SdpaResult ref = ref::sdpa_fwd_f64(in.q, in.k, in.v, o);  // float64 on the bf16 inputs
      const double naive = naive_bf16_error(in.q, in.k, in.v, o, ref);
      const double scale = testing::compare(ref.out, ref.out).max_ref;
      for (const testing::KernelPath& path : testing::kernel_paths()) {
        path.select();
        const std::string what = c.str() + " isa=" + path.name();
        const SdpaResult r = sdpa(in.q, in.k, in.v, o);
        ASSERT_EQ(r.out.dtype(), DType::BF16);
        const auto e = testing::compare(r.out, ref.out);
        EXPECT_TRUE(!e.nan && e.max_abs <= 2 * naive + 1e-6 * scale)
            << what << ": error " << e.max_abs << " vs naive bf16 " << naive;
        // weights stay f32: as tight as the f32 kernel
        const auto ew = testing::compare(r.weights, ref.weights);
        EXPECT_TRUE(ew.within(kRtol, kAtol)) << what << ": weights max err " << ew.max_abs;
        SdpaOptions no_weights = o;
        no_weights.need_weights = false;
        EXPECT_TRUE(testing::bitwise_equal(sdpa(in.q, in.k, in.v, no_weights).out, r.out))
            << what << ": need_weights changed the output";
      }
    }
  }
}

TEST(Dispatch, EveryPathIsSelectableAndNamed) {
  IsaGuard guard;
  const auto isas = supported_isas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), Isa::Scalar);
  for (Isa isa : isas) {
    set_isa(isa);
    EXPECT_EQ(active_isa(), isa);
    EXPECT_EQ(isa_from_name(isa_name(isa)), isa);
  }
  EXPECT_THROW(isa_from_name("sse9"), Error);
  // The bf16 forward's paths: avx512bf16 under both of its products, each named as it runs.
  std::vector<std::string> names;
  for (const testing::KernelPath& path : testing::kernel_paths()) {
    path.select();
    names.push_back(path.name());
    EXPECT_EQ(active_isa(), path.isa);
    const std::string products = bf16_attention_products();
    if (path.isa == Isa::Avx512Bf16) {
      EXPECT_EQ(products, path.bf16_products);
    } else {
      EXPECT_EQ(products, path.isa == Isa::Amx ? "amx" : "widen") << path.name();
    }
  }
  EXPECT_EQ(names.size(), isas.size() + (isa_supported(Isa::Avx512Bf16) ? 1 : 0));
  EXPECT_THAT(error_of([] { set_bf16_attention_products("fast"); }),
              ::testing::HasSubstr("set_bf16_attention_products: how must be \"auto\", \"dot\" or \"widen\", got \"fast\""));
}

TEST(Sdpa, WritesIntoStridedOutput) {
  const int64_t B = 2, H = 3, L = 11, D = 10;
  const Tensor q = randn({B, H, L, D}), k = randn({B, H, L, D}), v = randn({B, H, L, D});
  Tensor buf = Tensor::zeros({B, L, H, D}, DType::F32);  // [B, L, H, D] as a projection expects
  sdpa_out(buf.permute({0, 2, 1, 3}), q, k, v);
  const SdpaResult ref = ref::sdpa_fwd_f64(q, k, v);
  EXPECT_TRUE(compare(buf.permute({0, 2, 1, 3}), ref.out).within(kRtol, kAtol));
}

TEST(Sdpa, BadInputNamesArgumentAndShapes) {
  const Tensor q = randn({2, 4, 7, 16}), k = randn({2, 4, 5, 16}), v = randn({2, 4, 5, 16});
  using ::testing::HasSubstr;
  EXPECT_THAT(error_of([&] { sdpa(q, randn({2, 4, 5, 8}), v); }),
              HasSubstr("key: expected head dim 16 to match query [2, 4, 7, 16], got [2, 4, 5, 8]"));
  EXPECT_THAT(error_of([&] { sdpa(q, k, randn({2, 4, 6, 16})); }), HasSubstr("value: expected"));
  EXPECT_THAT(error_of([&] { sdpa(q, randn({3, 4, 5, 16}), v); }), HasSubstr("key: expected batch 2"));
  EXPECT_THAT(error_of([&] { sdpa(q, randn({2, 3, 5, 16}), randn({2, 3, 5, 16})); }),
              HasSubstr("not a multiple of key/value heads 3"));
  EXPECT_THAT(error_of([&] { sdpa(q, randn({2, 2, 5, 16}), randn({2, 2, 5, 16})); }),
              HasSubstr("enable_gqa"));
  EXPECT_THAT(error_of([&] { sdpa(randn({4, 7, 16}), k, v); }), HasSubstr("query: expected 4-D"));
  SdpaOptions o;
  o.attn_mask = testing::rand_bool({7, 6}, 0.5);
  EXPECT_THAT(error_of([&] { sdpa(q, k, v, o); }),
              HasSubstr("attn_mask: shape [7, 6] does not broadcast to [B, H, Lq, Lk] = [2, 4, 7, 5]"));
  o.attn_mask = Tensor::zeros({7, 5}, DType::I64);
  EXPECT_THAT(error_of([&] { sdpa(q, k, v, o); }), HasSubstr("attn_mask: expected bool or floating dtype, got i64"));
  o.attn_mask = Tensor();
  o.dropout_p = 1.5;
  EXPECT_THAT(error_of([&] { sdpa(q, k, v, o); }), HasSubstr("dropout_p must be in [0, 1], got 1.5"));
  o.dropout_p = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THAT(error_of([&] { sdpa(q, k, v, o); }), HasSubstr("dropout_p must be in [0, 1], got nan"));
  EXPECT_THAT(error_of([&] { sdpa(q.to(DType::F64), k, v); }), HasSubstr("key: expected f64 like query, got f32"));
  EXPECT_THAT(error_of([&] { sdpa(q.to(DType::I64), k, v); }), HasSubstr("query: expected f32 or bf16, got i64"));
  // k and v may be stored in another dtype than q (a KV cache: sdpa_kv_test.cc), both alike
  EXPECT_THAT(error_of([&] { sdpa(q.to(DType::BF16), k, v.to(DType::BF16)); }),
              HasSubstr("key and value: expected both f32, bf16 or int8 (with k_scale, v_scale), got f32 and bf16"));
  EXPECT_THAT(error_of([&] { sdpa_out(Tensor::zeros({2, 4, 7, 15}, DType::F32), q, k, v); }),
              HasSubstr("out: expected f32 [B, H, Lq, Dv] = [2, 4, 7, 16]"));
}

}  // namespace
}  // namespace heads
