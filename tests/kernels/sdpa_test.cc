// sdpa_test.cc — the fused SDPA forward against the float64 reference: the shape grid, masks, causal
// alignments, non-finite inputs, dropout, and the work splits (key sweeps, key chunks, thread counts).
// Precisions, paths and edges: sdpa_paths_test.cc.
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
#include "kernels/sdpa_case.h"
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
  const testing::Sample pick;
  int64_t n = 0;
  for (int64_t B : {1, 3}) {
    for (auto [H, Hkv] : {std::pair<int64_t, int64_t>{1, 1}, {4, 4}, {4, 1}, {4, 2}}) {
      for (int64_t Lq : {1, 7, 64, 129}) {
        for (int64_t Lk : {1, 7, 64, 129}) {
          for (int64_t D : {1, 8, 63, 64, 80, 128}) {
            if (!pick(++n)) continue;
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
  // Lq = 3: the decode path (Lk = 1300: keys split in chunks); Lq = 40: the tiled path (Lk = 256:
  // the poisoned key in a whole block of 128 keys, which the AMX kernel's plain rows take).
  for (auto [Lq, Lk] : {std::pair<int64_t, int64_t>{3, 70}, {3, 1300}, {40, 70}, {40, 300}, {40, 256}}) {
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

// Long key ranges put several query tiles into one sweep of the keys (forward_tiles_per_sweep):
// those groups (a ragged last group; causal in both alignments, masks, dropout, GQA, padded
// layouts, weights; f32 and bf16) against the reference, and the same bits as tiles run one by
// one (64 threads leave too few tasks to group).
TEST(Sdpa, TilesSharingAKeySweep) {
  IsaGuard guard;
  const int saved = get_num_threads();
  const uint64_t seed = testing::rng()();
  constexpr int kCases = 7;
  const testing::Sample pick(kCases);
  for (int n = 0; n < kCases; ++n) {
    if (!pick(n)) continue;
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

// Few query tiles against long keys: the forward cuts the keys into chunks whose partial outputs
// are merged after (forward_key_chunks). Against the float64 reference, bitwise independent of the
// thread count, the output unchanged by need_weights, for the options that touch a chunk's edges
// (causal limits inside and past chunks, a left window, sinks counted once, dropout, masks, GQA).
TEST(Sdpa, KeyChunksOfFewTilesMergeExactly) {
  IsaGuard guard;
  const int saved = get_num_threads();
  const uint64_t seed = testing::rng()();
  constexpr int kCases = 10;
  const testing::Sample pick(kCases);
  for (int n = 0; n < kCases; ++n) {
    if (!pick(n)) continue;
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

}  // namespace
}  // namespace heads
