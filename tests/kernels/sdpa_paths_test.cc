// sdpa_paths_test.cc — the SDPA forward's precisions and paths: bf16 (widened to f32, or within
// twice a plain bf16 computation's error on the products' paths, AMX tiles included), f64 and f16
// through f32, batch invariance, every ISA path selectable by name; and its edges on every path (no
// keys, dropout of 1, keys no query sees, strided outputs, bad input). The f32 forward against the
// float64 reference, masks, dropout and work splits are sdpa_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
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

constexpr double kPathRtol = 1e-5, kPathAtol = 1e-6;

using testing::error_of;
using testing::IsaGuard;

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
  const testing::Sample pick(std::size(cases));
  for (int n = 0; n < static_cast<int>(std::size(cases)); ++n) {
    if (!pick(n)) continue;
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
  // Every ISA below AVX-512-BF16 widens, and the scalar path runs everywhere: only a run limited to
  // one path (HEADS_TEST_ISA=amx, whose bf16 products are always tiles) may have none to check.
  const char* only = std::getenv("HEADS_TEST_ISA");
  if (checked == 0 && only != nullptr && *only != '\0') GTEST_SKIP() << "HEADS_TEST_ISA=" << only << " does not widen bf16";
  EXPECT_GT(checked, 0);
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
// The largest f(b, h, i, d, hk) over the attention output's elements [B, H, Lq, Dv] of values v
// (hk: the kv head of head h).
template <class F>
double max_over_outputs(const Tensor& v, const SdpaResult& ref, F f) {
  const int64_t B = ref.out.size(0), H = ref.out.size(1), Lq = ref.out.size(2), Dv = ref.out.size(3);
  const int64_t group = H / v.size(1);
  double worst = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Lq; ++i)
        for (int64_t d = 0; d < Dv; ++d) worst = std::max(worst, f(b, h, i, d, h / group));
  return worst;
}

double naive_bf16_error(const Tensor& v, const SdpaResult& ref) {
  // Naive: exact softmax weights rounded to bf16, products summed in f32, output rounded.
  const Tensor& w = ref.weights;  // f64 [B, H, Lq, Lk]
  return max_over_outputs(v, ref, [&](int64_t b, int64_t h, int64_t i, int64_t d, int64_t hk) {
    float acc = 0;
    for (int64_t j = 0; j < v.size(2); ++j) {
      const float p = bf16_to_f32(f32_to_bf16(static_cast<float>(w.item_as_double({b, h, i, j}))));
      acc += p * static_cast<float>(v.item_as_double({b, hk, j, d}));
    }
    const double naive = bf16_to_f32(f32_to_bf16(acc));
    return std::fabs(naive - ref.out.item_as_double({b, h, i, d}));
  });
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

// The largest ratio, over the output's elements, of |out − ref| to the error that rounding the
// probabilities and the output to bf16 can reach at most (any kernel whose P·V product takes P in
// bf16 and sums in f32): with e = (u + Lk·2⁻²⁴)·Σ_j w_j·|v_j| (u = 2⁻⁸, bf16's unit roundoff; w the
// exact weights, dropout included), |out − ref| ≤ e + u·(|ref| + e). A ratio ≤ 1 everywhere is
// a rounding outcome, not a defect.
double ratio_to_bf16_rounding_bound(const Tensor& out, const Tensor& v, const SdpaResult& ref) {
  constexpr double u = 1.0 / 256;
  const Tensor& w = ref.weights;  // f64 [B, H, Lq, Lk]
  const int64_t Lk = v.size(2);
  return max_over_outputs(v, ref, [&](int64_t b, int64_t h, int64_t i, int64_t d, int64_t hk) {
    double wv = 0;
    for (int64_t j = 0; j < Lk; ++j) wv += std::fabs(w.item_as_double({b, h, i, j}) * v.item_as_double({b, hk, j, d}));
    const double y = ref.out.item_as_double({b, h, i, d});
    const double e = (u + static_cast<double>(Lk) * std::ldexp(1.0, -24)) * wv;
    const double bound = e + u * (std::fabs(y) + e) + 1e-12;
    return std::fabs(out.item_as_double({b, h, i, d}) - y) / bound;
  });
}

// Every path this CPU runs (the AMX tiles included: odd D and Dv, key blocks with tails, GQA, masks,
// both causal alignments with Lq > Lk, dropout), with and without weights (the same output bits).
TEST(Sdpa, Bf16WithinTwiceNaiveBf16Error) {
  IsaGuard guard;
  const testing::Sample pick;
  int n = 0;
  for (const SdpaCase& shape : {SdpaCase{.H = 2, .Lq = 7, .Lk = 129, .D = 64}, SdpaCase{.B = 2, .H = 4, .Hkv = 2, .Lq = 129, .Lk = 64, .D = 63, .Dv = 80},
                                SdpaCase{.Lq = 64, .Lk = 7, .D = 128}, SdpaCase{.H = 4, .Hkv = 1, .Lq = 1, .Lk = 1100, .D = 80},
                                SdpaCase{.H = 2, .Lq = 33, .Lk = 200, .D = 1, .Dv = 8}, SdpaCase{.B = 2, .H = 2, .Hkv = 1, .Lq = 3, .Lk = 77, .D = 32, .Dv = 17},
                                SdpaCase{.H = 3, .Hkv = 1, .Lq = 70, .Lk = 300, .D = 96, .Dv = 48}, SdpaCase{.Lq = 50, .Lk = 20, .D = 40, .Dv = 33}}) {
    for (int variant = 0; variant < 5; ++variant) {
      if (!pick(n++)) continue;
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
      const double naive = naive_bf16_error(in.v, ref);
      const double scale = testing::compare(ref.out, ref.out).max_ref;
      for (const testing::KernelPath& path : testing::kernel_paths()) {
        path.select();
        const std::string what = c.str() + " isa=" + path.name();
        const SdpaResult r = sdpa(in.q, in.k, in.v, o);
        ASSERT_EQ(r.out.dtype(), DType::BF16);
        const auto e = testing::compare(r.out, ref.out);
        // Within twice the naive error; a small case whose few outputs each see one or two keys
        // (D = 1, a peaked softmax) can pass that by rounding alone (1 in ~150 draws of
        // B=1 H=2 Lq=33 Lk=200 D=1 Dv=8: 2.7x): there every element must lie within the bound
        // that rounding P and the output to bf16 gives.
        const bool within_naive = !e.nan && e.max_abs <= 2 * naive + 1e-6 * scale;
        const double ratio = within_naive ? 0.0 : ratio_to_bf16_rounding_bound(r.out, in.v, ref);
        EXPECT_TRUE(!e.nan && (within_naive || ratio <= 1.0))
            << what << ": error " << e.max_abs << " vs naive bf16 " << naive
            << "; largest share of the bf16 rounding bound " << ratio;
        // weights stay f32: as tight as the f32 kernel
        const auto ew = testing::compare(r.weights, ref.weights);
        EXPECT_TRUE(ew.within(kPathRtol, kPathAtol)) << what << ": weights max err " << ew.max_abs;
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
  // The bf16 forward's paths: avx512bf16 and neonbf16 under both of their products, each named as it runs.
  std::vector<std::string> names;
  for (const testing::KernelPath& path : testing::kernel_paths()) {
    path.select();
    names.push_back(path.name());
    EXPECT_EQ(active_isa(), path.isa);
    const std::string products = bf16_attention_products();
    if (testing::has_bf16_dot(path.isa)) {
      EXPECT_EQ(products, path.bf16_products);
    } else {
      EXPECT_EQ(products, path.isa == Isa::Amx ? "amx" : "widen") << path.name();
    }
  }
  const auto dots = std::count_if(isas.begin(), isas.end(), testing::has_bf16_dot);
  EXPECT_EQ(names.size(), isas.size() + static_cast<size_t>(dots));
  EXPECT_THAT(error_of([] { set_bf16_attention_products("fast"); }),
              ::testing::HasSubstr("set_bf16_attention_products: how must be \"auto\", \"dot\" or \"widen\", got \"fast\""));
}

// The paths offered follow the CPU's features as cpu_features() names them. On AArch64 (the
// cross build of scripts/test-aarch64.sh compiles every AArch64 path; it runs this under QEMU's
// `-cpu max`, which has BF16, and `-cpu neoverse-n1`, which lacks it): neonbf16 exactly where the
// hardware capabilities list bf16. Everywhere: no path of the other architecture.
TEST(Dispatch, PathsFollowTheCpuFeatures) {
  const std::string features = cpu_features() + " ";
  const auto has = [&](const char* name) { return features.find(std::string(" ") + name + " ") != std::string::npos; };
#if defined(__aarch64__)
  EXPECT_TRUE(isa_supported(Isa::Neon));
  EXPECT_EQ(isa_supported(Isa::NeonBf16), has("bf16")) << features;
  for (Isa isa : {Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16, Isa::Amx}) EXPECT_FALSE(isa_supported(isa)) << isa_name(isa);
#else
  EXPECT_FALSE(isa_supported(Isa::Neon));
  EXPECT_FALSE(isa_supported(Isa::NeonBf16));
  if (isa_supported(Isa::Avx512Bf16)) EXPECT_TRUE(has("avx512bf16")) << features;
#endif
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


TEST(Sdpa, WritesIntoStridedOutput) {
  const int64_t B = 2, H = 3, L = 11, D = 10;
  const Tensor q = randn({B, H, L, D}), k = randn({B, H, L, D}), v = randn({B, H, L, D});
  Tensor buf = Tensor::zeros({B, L, H, D}, DType::F32);  // [B, L, H, D] as a projection expects
  sdpa_out(buf.permute({0, 2, 1, 3}), q, k, v);
  const SdpaResult ref = ref::sdpa_fwd_f64(q, k, v);
  EXPECT_TRUE(compare(buf.permute({0, 2, 1, 3}), ref.out).within(kPathRtol, kPathAtol));
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
