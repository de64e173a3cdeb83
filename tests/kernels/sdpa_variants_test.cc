// sdpa_variants_test.cc — sliding windows, softcap, ALiBi, T5 relative bias, attention sinks, block
// layouts and head masks in the fused forward and decode kernels (every ISA path; f32 and bf16)
// against the float64 reference. The variants are sdpa_variants.h's; their backward is
// sdpa_variants_bwd_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "common/testing.h"
#include "heads/runtime.h"
#include "heads/sdpa.h"
#include "common/sdpa_variants.h"

namespace heads {
namespace {

using ::testing::HasSubstr;
using testing::error_of;
using testing::IsaGuard;
using testing::nan_filled;
using testing::randn;
using testing::Shape4;
using testing::shapes;
using testing::Variant;
using testing::variants;

TEST(SdpaVariants, ForwardMatchesReferenceOnEveryPath) {
  IsaGuard guard;
  const testing::Sample pick;
  int n = 0;
  for (const Shape4& s : shapes()) {
    if (!s.forward) continue;
    const Tensor q = randn({s.B, s.H, s.Lq, s.D}), k = randn({s.B, s.Hkv, s.Lk, s.D}),
                 v = randn({s.B, s.Hkv, s.Lk, s.Dv});
    for (const Variant& var : variants()) {
      if (!pick(n++)) continue;
      SdpaOptions o;
      o.enable_gqa = s.H != s.Hkv;
      var.set(o, s.H, s.Lq, s.Lk);
      o.need_weights = true;
      const std::string what = var.name + " B=" + std::to_string(s.B) + " H=" + std::to_string(s.H) + "/" +
                               std::to_string(s.Hkv) + " Lq=" + std::to_string(s.Lq) + " Lk=" + std::to_string(s.Lk) +
                               " D=" + std::to_string(s.D) + " Dv=" + std::to_string(s.Dv);
      const SdpaResult ref = ref::sdpa_fwd_f64(q, k, v, o);
      // bf16: the same call on bf16-rounded inputs against float64 on those inputs.
      const Tensor qb = q.to(DType::BF16), kb = k.to(DType::BF16), vb = v.to(DType::BF16);
      const SdpaResult ref_b = ref::sdpa_fwd_f64(qb, kb, vb, o);
      for (const testing::KernelPath& path : testing::kernel_paths()) {
        path.select();
        const std::string where = what + " isa=" + path.name();
        if (std::string(path.bf16_products) != "dot") {  // f32: the same kernel on both bf16 products
          o.need_weights = true;
          const SdpaResult r = sdpa(q, k, v, o);
          const auto e = testing::compare(r.out, ref.out), ew = testing::compare(r.weights, ref.weights),
                     el = testing::compare(r.lse, ref.lse);
          ASSERT_TRUE(e.within(1e-5, 1e-6)) << where << ": out max err " << e.max_abs << " (ref max " << e.max_ref << ")";
          ASSERT_TRUE(ew.within(1e-5, 1e-6)) << where << ": weights max err " << ew.max_abs;
          ASSERT_TRUE(el.within(1e-5, 1e-6) || el.max_abs == 0) << where << ": lse max err " << el.max_abs;
          o.need_weights = false;
          const SdpaResult r2 = sdpa(q, k, v, o);
          ASSERT_TRUE(testing::bitwise_equal(r.out, r2.out)) << where << ": need_weights changed the output";
        }
        o.need_weights = false;
        const SdpaResult rb = sdpa(qb, kb, vb, o);
        const auto eb = testing::compare(rb.out, ref_b.out);
        ASSERT_TRUE(eb.within(8e-3, 4e-3)) << where << " bf16: out max err " << eb.max_abs << " (ref max "
                                           << eb.max_ref << ")";
        o.need_weights = true;
      }
    }
  }
}

// What the options mean, spelt out on a small case: the fused call equals a plain call with the
// equivalent explicit mask / bias (the way PyTorch users write them today).
TEST(SdpaVariants, EqualExplicitMasksAndBiases) {
  const int64_t H = 3, Lq = 9, Lk = 13;
  const Tensor q = randn({1, H, Lq, 8}), k = randn({1, H, Lk, 8}), v = randn({1, H, Lk, 8});
  const int64_t a = Lk - Lq;  // bottom-right
  // Sliding window of 4 keys, causal, bottom-right, as a bool mask.
  SdpaOptions w;
  w.window_left = 3, w.is_causal = true, w.causal_align = CausalAlign::BottomRight;
  Tensor band = Tensor::empty({Lq, Lk}, DType::Bool);
  for (int64_t i = 0; i < Lq; ++i) {
    for (int64_t j = 0; j < Lk; ++j) static_cast<uint8_t*>(band.raw_data())[i * Lk + j] = j <= i + a && j >= i + a - 3;
  }
  SdpaOptions m;
  m.attn_mask = band;
  EXPECT_TRUE(testing::compare(sdpa(q, k, v, w).out, sdpa(q, k, v, m).out).within(1e-6, 1e-7));
  // ALiBi and a T5 table as a float bias [H, Lq, Lk].
  SdpaOptions p;
  p.alibi_slopes = alibi_slopes(H);
  p.relative_attention_bias = randn({32, H});
  Tensor bias = Tensor::empty({H, Lq, Lk}, DType::F32);
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = 0; i < Lq; ++i) {
      for (int64_t j = 0; j < Lk; ++j) {
        const int64_t bk = t5_relative_bucket(j - i, true, 32, 128);
        bias.data<float>()[(h * Lq + i) * Lk + j] = -p.alibi_slopes.data<float>()[h] * static_cast<float>(std::abs(i - j)) +
                                                    p.relative_attention_bias.data<float>()[bk * H + h];
      }
    }
  }
  SdpaOptions pm;
  pm.attn_mask = bias;
  EXPECT_TRUE(testing::compare(sdpa(q, k, v, p).out, sdpa(q, k, v, pm).out).within(1e-5, 1e-6));
}

TEST(SdpaVariants, AlibiSlopesAndT5Buckets) {
  const Tensor s8 = alibi_slopes(8);
  for (int h = 0; h < 8; ++h) EXPECT_FLOAT_EQ(s8.data<float>()[h], std::exp2(-(h + 1.0f)));
  // 12 heads (BLOOM's rule for a count that is not a power of two): 8 slopes of base 2^-1, then
  // odd powers of 2^-0.5.
  const Tensor s12 = alibi_slopes(12);
  for (int h = 0; h < 8; ++h) EXPECT_FLOAT_EQ(s12.data<float>()[h], std::exp2(-(h + 1.0f)));
  for (int e = 0; e < 4; ++e) EXPECT_FLOAT_EQ(s12.data<float>()[8 + e], std::exp2(-0.5f * (2 * e + 1)));
  // T5 buckets (transformers' _relative_position_bucket, 32 buckets, max distance 128).
  const std::vector<std::tuple<int64_t, bool, int64_t>> want = {
      {0, true, 0},    {1, true, 17},   {-1, true, 1},   {7, true, 23},  {-8, true, 8},   {12, true, 25},
      {-20, true, 10}, {127, true, 31}, {500, true, 31}, {-3, false, 3}, {5, false, 0},   {-15, false, 15},
      {-16, false, 16}, {-40, false, 23}, {-1000, false, 31}};
  for (const auto& [rp, bidir, bucket] : want) {
    EXPECT_EQ(t5_relative_bucket(rp, bidir, 32, 128), bucket) << rp << (bidir ? " bidirectional" : " causal");
  }
}

TEST(SdpaVariants, LongWindowsSkipBlocksAndStayExact) {
  // Windows far shorter than the keys (blocks outside every row skipped), decode rows against a long
  // cache (split into chunks), and a window reaching past both ends.
  IsaGuard guard;
  for (auto [Lq, Lk, left, right] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>{
           {300, 1100, 40, 0}, {2, 2000, 100, -1}, {600, 600, 2000, 2000}, {130, 130, 0, -1}}) {
    const Tensor q = randn({1, 2, Lq, 24}), k = randn({1, 2, Lk, 24}), v = randn({1, 2, Lk, 24});
    SdpaOptions o;
    o.window_left = left, o.window_right = right, o.causal_align = CausalAlign::BottomRight;
    o.need_weights = true;
    const SdpaResult ref = ref::sdpa_fwd_f64(q, k, v, o);
    const Tensor dout = randn({1, 2, Lq, 24});
    const SdpaGrads gref = ref::sdpa_bwd_f64(dout, q, k, v, o);
    for (Isa isa : testing::test_isas()) {
      set_isa(isa);
      const std::string where = "Lq=" + std::to_string(Lq) + " Lk=" + std::to_string(Lk) + " window(" +
                                std::to_string(left) + "," + std::to_string(right) + ") isa=" + isa_name(isa);
      const SdpaResult r = sdpa(q, k, v, o);
      EXPECT_TRUE(testing::compare(r.out, ref.out).within(1e-5, 1e-6)) << where;
      EXPECT_TRUE(testing::compare(r.weights, ref.weights).within(1e-5, 1e-6)) << where;
      const SdpaGrads g = sdpa_backward(dout, q, k, v, r, o);
      for (const auto& [got, want, name] : {std::tuple{&g.dq, &gref.dq, "dq"}, {&g.dk, &gref.dk, "dk"},
                                            {&g.dv, &gref.dv, "dv"}}) {
        const auto e = testing::compare(*got, *want);
        EXPECT_TRUE(e.within(1e-5, 1e-5)) << where << ": " << name << " max err " << e.max_abs;
      }
    }
  }
}

TEST(SdpaVariants, SinkAloneGivesZerosAndItsLse) {
  // Every key hidden: the sink takes all the mass, the output is zero and lse is the sink.
  const Tensor q = randn({1, 2, 3, 4}), k = randn({1, 2, 5, 4}), v = randn({1, 2, 5, 4});
  SdpaOptions o;
  o.sinks = randn({2});
  o.attn_mask = Tensor::zeros({3, 5}, DType::Bool);
  const SdpaResult r = sdpa(q, k, v, o);
  for (int64_t i = 0; i < r.out.numel(); ++i) EXPECT_EQ(r.out.data<float>()[i], 0.0f);
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t i = 0; i < 3; ++i) EXPECT_FLOAT_EQ(r.lse.data<float>()[h * 3 + i], o.sinks.data<float>()[h]);
  }
}

// Block-sparse layouts of several block sizes (smaller and larger than the kernels' tiles), per
// head and shared, alone and with causal / windows / sinks: forward (with weights) and backward on
// every path against the reference, and equal to the same layout written as a bool mask.
TEST(SdpaVariants, BlockSparseLayouts) {
  IsaGuard guard;
  // 7 shapes x 4 variants, each against two float64 references and their backward: under
  // HEADS_TEST_SAMPLE a share of the 28 cases (the references were most of QEMU's time here).
  const testing::Sample pick(28);
  int n = 0;
  for (auto [Lq, Lk, bs] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {129, 129, 16}, {200, 300, 64}, {3, 700, 32}, {70, 50, 128}, {33, 33, 1}, {260, 260, 128}, {150, 600, 64}}) {
    const int64_t H = 3, nqb = (Lq + bs - 1) / bs, nkb = (Lk + bs - 1) / bs;
    const Tensor q = randn({2, H, Lq, 24}), k = randn({2, H, Lk, 24}), v = randn({2, H, Lk, 20}),
                 dout = randn({2, H, Lq, 20});
    for (int variant = 0; variant < 4; ++variant) {
      if (!pick(n++)) continue;
      SdpaOptions o;
      const bool per_head = variant % 2 == 0;
      o.block_mask = testing::rand_bool(per_head ? Shape{H, nqb, nkb} : Shape{nqb, nkb}, 0.5);
      o.block_size = bs;
      if (variant == 1) o.is_causal = true, o.causal_align = CausalAlign::BottomRight;
      if (variant == 2) o.window_left = 40, o.sinks = randn({H});
      if (variant == 3) o.softcap = 3.0, o.alibi_slopes = alibi_slopes(H);
      const std::string what = "Lq=" + std::to_string(Lq) + " Lk=" + std::to_string(Lk) + " bs=" + std::to_string(bs) +
                               " variant=" + std::to_string(variant);
      o.need_weights = true;
      const SdpaResult ref = ref::sdpa_fwd_f64(q, k, v, o);
      o.need_weights = false;
      const SdpaGrads gref = ref::sdpa_bwd_f64(dout, q, k, v, o);
      // the layout as an elementwise bool mask gives the same result
      Tensor dense = Tensor::empty({per_head ? H : 1, Lq, Lk}, DType::Bool);
      for (int64_t h = 0; h < dense.size(0); ++h) {
        for (int64_t i = 0; i < Lq; ++i) {
          for (int64_t j = 0; j < Lk; ++j) {
            const int64_t at = ((per_head ? h : 0) * nqb + i / bs) * nkb + j / bs;
            static_cast<uint8_t*>(dense.raw_data())[(h * Lq + i) * Lk + j] =
                static_cast<const uint8_t*>(o.block_mask.raw_data())[at];
          }
        }
      }
      SdpaOptions m = o;
      m.block_mask = Tensor();
      m.attn_mask = dense;
      EXPECT_TRUE(testing::compare(sdpa(q, k, v, m).out, ref.out).within(1e-5, 1e-6)) << what << " as a bool mask";
      const Tensor qb = q.to(DType::BF16), kb = k.to(DType::BF16), vb = v.to(DType::BF16);
      const SdpaResult ref_b = ref::sdpa_fwd_f64(qb, kb, vb, o);
      for (const testing::KernelPath& path : testing::kernel_paths()) {
        path.select();
        const std::string where = what + " isa=" + path.name();
        o.need_weights = false;
        const auto eb = testing::compare(sdpa(qb, kb, vb, o).out, ref_b.out);
        ASSERT_TRUE(eb.within(8e-3, 4e-3)) << where << " bf16 max err " << eb.max_abs;
        if (std::string(path.bf16_products) == "dot") continue;  // f32: the same kernel on both bf16 products
        o.need_weights = true;
        const SdpaResult r = sdpa(q, k, v, o);
        ASSERT_TRUE(testing::compare(r.out, ref.out).within(1e-5, 1e-6)) << where;
        ASSERT_TRUE(testing::compare(r.weights, ref.weights).within(1e-5, 1e-6)) << where << " weights";
        o.need_weights = false;
        const SdpaResult f = sdpa(q, k, v, o);
        ASSERT_TRUE(testing::bitwise_equal(f.out, r.out)) << where;
        const SdpaGrads gr =
            sdpa_backward_out(nan_filled(q.shape()), nan_filled(k.shape()), nan_filled(v.shape()), dout, q, k, v, f, o);
        for (const auto& [got, want, name] : {std::tuple{&gr.dq, &gref.dq, "dq"}, {&gr.dk, &gref.dk, "dk"},
                                              {&gr.dv, &gref.dv, "dv"}}) {
          const auto e = testing::compare(*got, *want);
          ASSERT_TRUE(e.within(1e-5, 1e-5)) << where << ": " << name << " max err " << e.max_abs;
        }
      }
    }
  }
}

TEST(SdpaVariants, EdgeCases) {
  IsaGuard guard;
  const Tensor q = randn({1, 2, 3, 8}), k = randn({1, 2, 5, 8}), v = randn({1, 2, 5, 8});
  // windows as wide as int64 allows are unbounded (no overflow in the offsets)
  SdpaOptions wide;
  wide.window_left = std::numeric_limits<int64_t>::max(), wide.window_right = std::numeric_limits<int64_t>::max();
  EXPECT_TRUE(testing::compare(sdpa(q, k, v, wide).out, ref::sdpa_fwd_f64(q, k, v, {}).out).within(1e-5, 1e-6));
  // no key at all with sinks: zeros, lse = sink
  SdpaOptions s;
  s.sinks = randn({2});
  const SdpaResult r0 = sdpa(q, randn({1, 2, 0, 8}), randn({1, 2, 0, 8}), s);
  EXPECT_FLOAT_EQ(r0.lse.data<float>()[0], s.sinks.data<float>()[0]);
  EXPECT_FLOAT_EQ(r0.lse.data<float>()[5], s.sinks.data<float>()[1]);
  // a -inf sink is no term: a row that sees nothing gives zeros and lse = -inf on every path
  s.sinks.data<float>()[0] = -std::numeric_limits<float>::infinity();
  s.attn_mask = Tensor::zeros({3, 5}, DType::Bool);
  for (Isa isa : testing::test_isas()) {
    set_isa(isa);
    for (int64_t Lq : {1, 9}) {  // decode and tiled kernels
      const SdpaResult r = sdpa(randn({1, 2, Lq, 8}), k, v, [&] {
        SdpaOptions o = s;
        o.attn_mask = Tensor::zeros({Lq, 5}, DType::Bool);
        return o;
      }());
      EXPECT_EQ(r.out.data<float>()[0], 0.0f) << isa_name(isa) << " Lq=" << Lq;
      EXPECT_EQ(r.lse.data<float>()[0], -std::numeric_limits<float>::infinity()) << isa_name(isa) << " Lq=" << Lq;
    }
  }
}

// A head that head_mask turns off: zero output, weights and dq, lse -inf, nothing into dk / dv; the
// other heads are bitwise those of the call without the mask (per batch entry, GQA groups whole or
// partly off, decode and tiled kernels, f32 and bf16).
TEST(SdpaVariants, HeadMaskSkipsHeads) {
  IsaGuard guard;
  for (const Shape4& s : {Shape4{3, 4, 2, 1, 300, 16, 16}, Shape4{3, 4, 2, 37, 70, 17, 9}, Shape4{2, 6, 6, 129, 129, 64, 64},
                          Shape4{3, 4, 2, 40, 600, 16, 16}}) {
    const Tensor q = randn({s.B, s.H, s.Lq, s.D}), k = randn({s.B, s.Hkv, s.Lk, s.D}),
                 v = randn({s.B, s.Hkv, s.Lk, s.Dv}), dout = randn({s.B, s.H, s.Lq, s.Dv});
    Tensor hm = Tensor::zeros({s.B, s.H}, DType::Bool);
    auto* on = static_cast<uint8_t*>(hm.raw_data());
    for (int64_t h = 0; h < s.H; ++h) on[h] = 1;               // batch 0: every head
    for (int64_t h = 0; h < s.H; h += 2) on[s.H + h] = 1;      // batch 1: every other head
    if (s.B > 2) on[3 * s.H - 1] = 1;                        // batch 2: the last head only
    for (const testing::KernelPath& path : testing::kernel_paths()) {
      path.select();
      for (DType dt : {DType::F32, DType::BF16}) {
        if (dt == DType::F32 && std::string(path.bf16_products) == "dot") continue;  // f32: the same kernel
        const std::string where = std::string("isa=") + path.name() + " " + std::string(dtype_name(dt)) + " Lq=" +
                                  std::to_string(s.Lq) + " H=" + std::to_string(s.H) + "/" + std::to_string(s.Hkv);
        SdpaOptions o;
        o.enable_gqa = s.H != s.Hkv;
        o.need_weights = true;
        const SdpaResult all = sdpa(q.to(dt), k.to(dt), v.to(dt), o);
        o.head_mask = hm;
        const SdpaResult r = sdpa(q.to(dt), k.to(dt), v.to(dt), o);
        for (int64_t b = 0; b < s.B; ++b) {
          for (int64_t h = 0; h < s.H; ++h) {
            const Tensor out = r.out.select(0, b).select(0, h), w = r.weights.select(0, b).select(0, h);
            if (on[b * s.H + h]) {
              ASSERT_TRUE(testing::bitwise_equal(out, all.out.select(0, b).select(0, h))) << where << " b=" << b << " h=" << h;
              ASSERT_TRUE(testing::bitwise_equal(w, all.weights.select(0, b).select(0, h))) << where;
            } else {
              ASSERT_TRUE(testing::bitwise_equal(out, Tensor::zeros(out.shape(), dt))) << where << " b=" << b << " h=" << h;
              ASSERT_TRUE(testing::bitwise_equal(w, Tensor::zeros(w.shape(), DType::F32))) << where;
              for (int64_t i = 0; i < s.Lq; ++i) {
                ASSERT_EQ(r.lse.data<float>()[(b * s.H + h) * s.Lq + i], -std::numeric_limits<float>::infinity());
              }
            }
          }
        }
        if (dt != DType::F32) continue;
        // Backward: the reference with the mask, and the off heads' dq exactly zero.
        o.need_weights = false;
        const SdpaResult f = sdpa(q, k, v, o);
        const SdpaGrads g = sdpa_backward_out(nan_filled(q.shape()), nan_filled(k.shape()), nan_filled(v.shape()),
                                              dout, q, k, v, f, o);
        const SdpaGrads ref = ref::sdpa_bwd_f64(dout, q, k, v, o);
        for (const auto& [got, want, name] : {std::tuple{&g.dq, &ref.dq, "dq"}, {&g.dk, &ref.dk, "dk"}, {&g.dv, &ref.dv, "dv"}}) {
          const auto e = testing::compare(*got, *want);
          ASSERT_TRUE(e.within(1e-5, 1e-5)) << where << ": " << name << " max err " << e.max_abs;
        }
        for (int64_t b = 0; b < s.B; ++b) {
          for (int64_t h = 0; h < s.H; ++h) {
            if (on[b * s.H + h]) continue;
            const Tensor dq = g.dq.select(0, b).select(0, h);
            ASSERT_TRUE(testing::bitwise_equal(dq, Tensor::zeros(dq.shape(), DType::F32))) << where;
          }
        }
      }
    }
  }
}

TEST(SdpaVariants, BadOptionsAreClearErrors) {
  const Tensor q = randn({1, 4, 5, 8}), k = randn({1, 4, 6, 8}), v = randn({1, 4, 6, 8});
  auto err = [&](const std::function<void(SdpaOptions&)>& set) {
    SdpaOptions o;
    set(o);
    return error_of([&] { sdpa(q, k, v, o); });
  };
  EXPECT_THAT(err([](SdpaOptions& o) { o.window_left = -2; }),
              HasSubstr("window_left and window_right must be -1 (unbounded) or >= 0, got (-2, -1)"));
  EXPECT_THAT(err([](SdpaOptions& o) { o.softcap = -1; }), HasSubstr("softcap must be finite and >= 0, got -1"));
  EXPECT_THAT(err([](SdpaOptions& o) { o.alibi_slopes = randn({3}); }),
              HasSubstr("alibi_slopes: expected a floating tensor [H] = [4], got f32 [3]"));
  EXPECT_THAT(err([](SdpaOptions& o) { o.sinks = randn({4, 1}); }),
              HasSubstr("sinks: expected a floating tensor [H] = [4], got f32 [4, 1]"));
  EXPECT_THAT(err([](SdpaOptions& o) { o.relative_attention_bias = randn({32, 3}); }),
              HasSubstr("relative_attention_bias: expected a floating table [num_buckets >= 2, H = 4], got f32 [32, 3]"));
  EXPECT_THAT(err([](SdpaOptions& o) {
                o.relative_attention_bias = randn({32, 4});
                o.relative_attention_max_distance = 8;
              }),
              HasSubstr("relative_attention_max_distance (8) above them"));
  EXPECT_THAT(error_of([] { alibi_slopes(0); }), HasSubstr("alibi_slopes: num_heads must be at least 1, got 0"));
  EXPECT_THAT(err([](SdpaOptions& o) {
                o.block_mask = testing::rand_bool({2, 2}, 0.5);
                o.block_size = 2;
              }),
              HasSubstr("block_mask: expected bool [nQB, nKB] or [H, nQB, nKB] = [4, 3, 3] for Lq 5, Lk 6 and "
                        "block_size 2, got bool [2, 2]"));
  EXPECT_THAT(err([](SdpaOptions& o) { o.head_mask = testing::rand_bool({1, 3}, 0.5); }),
              HasSubstr("head_mask: expected bool [H] = [4] or [B, H] = [1, 4], got bool [1, 3]"));
  EXPECT_THAT(err([](SdpaOptions& o) { o.head_mask = randn({4}); }),
              HasSubstr("head_mask: expected bool [H] = [4] or [B, H] = [1, 4], got f32 [4]"));
}

}  // namespace
}  // namespace heads
