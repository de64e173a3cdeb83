// sdpa_variants_bwd_test.cc — the score modifiers' backward (sdpa_variants.h's variants): the float64
// reference against finite differences, and the fused kernels (every ISA path; f32 and bf16 inputs,
// f32 and bf16 gradients; AMX tiles) against it; the bias table's gradient on any thread count.
#include <gtest/gtest.h>

#include <cmath>
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

using testing::IsaGuard;
using testing::nan_filled;
using testing::randn;
using testing::Shape4;
using testing::shapes;
using testing::Variant;
using testing::variants;


// L = sum(out ∘ G) in float64, for finite differences.
double loss(const Tensor& q, const Tensor& k, const Tensor& v, const SdpaOptions& o, const Tensor& G) {
  const Tensor out = ref::sdpa_fwd_f64(q, k, v, o).out;
  double s = 0;
  for (int64_t i = 0; i < out.numel(); ++i) s += out.data<double>()[i] * G.data<double>()[i];
  return s;
}

TEST(SdpaVariants, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t H = 2;
  const Tensor q = randn({1, H, 4, 3}).to(DType::F64).clone(), k = randn({1, H, 6, 3}).to(DType::F64).clone(),
               v = randn({1, H, 6, 2}).to(DType::F64).clone();
  const Tensor G = randn({1, H, 4, 2}).to(DType::F64);
  for (const Variant& var : variants()) {
    SdpaOptions o;
    var.set(o, H, 4, 6);
    if (o.sinks.defined()) o.sinks = o.sinks.to(DType::F64).clone();
    if (o.relative_attention_bias.defined()) o.relative_attention_bias = o.relative_attention_bias.to(DType::F64).clone();
    if (o.alibi_slopes.defined()) o.alibi_slopes = o.alibi_slopes.to(DType::F64).clone();
    const SdpaGrads g = ref::sdpa_bwd_f64(G, q, k, v, o);
    auto check = [&](const Tensor& x, const Tensor& grad, const std::string& name) {
      ASSERT_TRUE(grad.defined()) << var.name << ": no gradient for " << name;
      for (int64_t i = 0; i < x.numel(); ++i) {
        double* p = const_cast<Tensor&>(x).data<double>() + i;
        const double save = *p, eps = 1e-6;
        *p = save + eps;
        const double up = loss(q, k, v, o, G);
        *p = save - eps;
        const double down = loss(q, k, v, o, G);
        *p = save;
        const double fd = (up - down) / (2 * eps);
        ASSERT_NEAR(grad.to(DType::F64).data<double>()[i], fd, 1e-6 * (1 + std::fabs(fd)))
            << var.name << " d" << name << "[" << i << "]";
      }
    };
    check(q, g.dq, "q");
    check(k, g.dk, "k");
    check(v, g.dv, "v");
    if (o.sinks.defined()) check(o.sinks, g.dsinks, "sinks");
    if (o.relative_attention_bias.defined()) check(o.relative_attention_bias, g.drelative_attention_bias, "table");
  }
}

TEST(SdpaVariants, BackwardMatchesReferenceOnEveryPath) {
  IsaGuard guard;
  const testing::Sample pick;
  int n = 0;
  for (const Shape4& s : shapes()) {
    if (!s.backward) continue;
    const Tensor q = randn({s.B, s.H, s.Lq, s.D}), k = randn({s.B, s.Hkv, s.Lk, s.D}),
                 v = randn({s.B, s.Hkv, s.Lk, s.Dv}), dout = randn({s.B, s.H, s.Lq, s.Dv});
    for (const Variant& var : variants()) {
      if (!pick(n++)) continue;
      SdpaOptions o;
      o.enable_gqa = s.H != s.Hkv;
      var.set(o, s.H, s.Lq, s.Lk);
      const bool mask_grad = o.attn_mask.defined() && is_floating(o.attn_mask.dtype());
      const SdpaGrads ref = ref::sdpa_bwd_f64(dout, q, k, v, o, mask_grad);
      for (Isa isa : testing::test_isas()) {
        set_isa(isa);
        const std::string where = var.name + " Lq=" + std::to_string(s.Lq) + " Lk=" + std::to_string(s.Lk) +
                                  " H=" + std::to_string(s.H) + "/" + std::to_string(s.Hkv) + " D=" +
                                  std::to_string(s.D) + " isa=" + isa_name(isa);
        const SdpaResult f = sdpa(q, k, v, o);
        const SdpaGrads g =
            sdpa_backward_out(nan_filled(q.shape()), nan_filled(k.shape()), nan_filled(v.shape()), dout, q, k, v, f, o,
                              mask_grad);
        for (const auto& [got, want, name] :
             {std::tuple{&g.dq, &ref.dq, "dq"}, {&g.dk, &ref.dk, "dk"}, {&g.dv, &ref.dv, "dv"},
              {&g.dmask, &ref.dmask, "dmask"},
              {&g.dsinks, &ref.dsinks, "dsinks"}, {&g.drelative_attention_bias, &ref.drelative_attention_bias, "dtable"}}) {
          ASSERT_EQ(got->defined(), want->defined()) << where << ": " << name;
          if (!want->defined()) continue;
          const auto e = testing::compare(*got, *want);
          ASSERT_TRUE(e.within(1e-5, 1e-5)) << where << ": " << name << " max err " << e.max_abs << " (ref max "
                                            << e.max_ref << ")";
        }
        // bf16 inputs are read widened: the f32 backward's bits on the widened values, f32 gradients.
        // On AMX tiles the products take P and dS as two bf16 terms (sdpa_amx_bwd-inl.h): there, the
        // same within what that rounding costs.
        const Tensor qb = q.to(DType::BF16), kb = k.to(DType::BF16), vb = v.to(DType::BF16),
                     gb = dout.to(DType::BF16);
        const Tensor qw = qb.to(DType::F32), kw = kb.to(DType::F32), vw = vb.to(DType::F32), gw = gb.to(DType::F32);
        const SdpaResult fb = sdpa(qb, kb, vb, o);
        SdpaResult fw = fb;
        fw.out = fb.out.to(DType::F32);
        const SdpaGrads gbf = sdpa_backward_out(nan_filled(q.shape()), nan_filled(k.shape()), nan_filled(v.shape()), gb,
                                                qb, kb, vb, fb, o, mask_grad);
        const bool tiles = isa == Isa::Amx;
        const SdpaGrads gwf = sdpa_backward_out(nan_filled(q.shape()), nan_filled(k.shape()), nan_filled(v.shape()), gw,
                                                qw, kw, vw, fw, o, mask_grad);
        for (const auto& [got, want, name] :
             {std::tuple{&gbf.dq, &gwf.dq, "dq"}, {&gbf.dk, &gwf.dk, "dk"}, {&gbf.dv, &gwf.dv, "dv"},
              {&gbf.dmask, &gwf.dmask, "dmask"}, {&gbf.dsinks, &gwf.dsinks, "dsinks"},
              {&gbf.drelative_attention_bias, &gwf.drelative_attention_bias, "dtable"}}) {
          ASSERT_EQ(got->defined(), want->defined()) << where << " bf16: " << name;
          if (!want->defined()) continue;
          if (!tiles) {
            ASSERT_TRUE(testing::bitwise_equal(*got, *want)) << where << " bf16: " << name;
            continue;
          }
          // (P and dS as two bf16 terms, 16 bits: measured at most 1e-5 of the largest gradient,
          // as far as the f32 path's own sums differ from float64. Relative to the largest of dq,
          // dk, dv: a gradient that cancels to rounding noise, dq where a row sees one key, has no
          // scale of its own.)
          double scale = 0;
          for (const Tensor* t : {&gwf.dq, &gwf.dk, &gwf.dv}) scale = std::max(scale, testing::compare(*t, *t).max_ref);
          const auto e = testing::compare(*got, *want);
          ASSERT_TRUE(e.within(5e-5, 5e-5 * scale))
              << where << " bf16 on tiles: " << name << " max err " << e.max_abs << " (ref max " << e.max_ref << ")";
        }
        // and bf16 gradients: those f32 sums rounded once
        auto nan16 = [](const Shape& shape) { return nan_filled(shape).to(DType::BF16); };
        const SdpaGrads g16 =
            sdpa_backward_out(nan16(q.shape()), nan16(k.shape()), nan16(v.shape()), gb, qb, kb, vb, fb, o, mask_grad);
        const SdpaGrads& sums = tiles ? gbf : gwf;
        for (const auto& [got, want, name] :
             {std::tuple{&g16.dq, &sums.dq, "dq"}, {&g16.dk, &sums.dk, "dk"}, {&g16.dv, &sums.dv, "dv"}}) {
          ASSERT_EQ(got->dtype(), DType::BF16) << where << " bf16 grads: " << name;
          ASSERT_TRUE(testing::bitwise_equal(*got, want->to(DType::BF16))) << where << " bf16 grads: " << name;
        }
      }
    }
  }
}

TEST(SdpaVariants, TableGradientIndependentOfThreadCount) {
  // The second shape has few (b, kv head) pairs and long keys: the backward cuts its keys, and the
  // splits' table sums and dQ contributions are added in a fixed order.
  const int64_t H = 4;
  for (auto [B, Lq, Lk] : {std::tuple<int64_t, int64_t, int64_t>{3, 70, 90}, {1, 100, 1100}}) {
    const Tensor q = randn({B, H, Lq, 16}), k = randn({B, H, Lk, 16}), v = randn({B, H, Lk, 16}),
                 dout = randn({B, H, Lq, 16});
    SdpaOptions o;
    o.relative_attention_bias = randn({32, H});
    o.sinks = randn({H});
    o.softcap = 4.0;
    o.is_causal = Lk > 1000;
    o.causal_align = CausalAlign::BottomRight;
    const int saved = get_num_threads();
    set_num_threads(1);
    const SdpaResult f = sdpa(q, k, v, o);
    const SdpaGrads g1 = sdpa_backward(dout, q, k, v, f, o);
    for (int t : {2, 3, 7}) {
      set_num_threads(t);
      const SdpaGrads gt = sdpa_backward(dout, q, k, v, f, o);
      EXPECT_TRUE(testing::bitwise_equal(g1.drelative_attention_bias, gt.drelative_attention_bias) &&
                  testing::bitwise_equal(g1.dsinks, gt.dsinks) && testing::bitwise_equal(g1.dq, gt.dq) &&
                  testing::bitwise_equal(g1.dk, gt.dk) && testing::bitwise_equal(g1.dv, gt.dv))
          << "Lk=" << Lk << " threads=" << t;
    }
    set_num_threads(saved);
  }
}

}  // namespace
}  // namespace heads
