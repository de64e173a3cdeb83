// sdpa_kv_test.cc — keys and values stored apart from the query's dtype (a KV cache): bf16 and int8
// K/V read by the decode kernel in place, widened for more queries, against the float64 reference.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "common/testing.h"
#include "heads/runtime.h"
#include "heads/sdpa.h"

namespace heads {
namespace {

using ::testing::HasSubstr;
using testing::compare;
using testing::error_of;
using testing::IsaGuard;
using testing::randn;

// Quantised rows: scale = max|x| / 127, values = round(x / scale), so |values · scale - x| <= scale / 2
// and the largest |value| of a non-zero row is 127; a row of zeros has scale 0 and zero values.
TEST(QuantizeKv, DefinitionOnOddRows) {
  for (const int64_t n : {1, 7, 64, 129}) {
    Tensor x = randn({2, 3, 5, n}, 3.0);
    for (int64_t d = 0; d < n; ++d) x.data<float>()[(1 * 3 + 2) * 5 * n + 4 * n + d] = 0.0f;  // row (1, 2, 4)
    x.data<float>()[7 % x.numel()] = 1e-30f;  // a tiny value beside normal ones
    const Int8Rows q = quantize_kv(x);
    ASSERT_EQ(q.values.shape(), x.shape());
    ASSERT_EQ(q.scales.shape(), (Shape{2, 3, 5}));
    const Tensor back = dequantize_kv(q.values, q.scales);
    for (int64_t r = 0; r < 30; ++r) {
      const float* xr = x.data<float>() + r * n;
      const int8_t* vr = q.values.data<int8_t>() + r * n;
      float amax = 0;
      int vmax = 0;
      for (int64_t d = 0; d < n; ++d) {
        amax = std::max(amax, std::fabs(xr[d]));
        vmax = std::max(vmax, std::abs(static_cast<int>(vr[d])));
      }
      const float s = q.scales.data<float>()[r];
      EXPECT_EQ(s, amax / 127.0f) << "n=" << n << " row " << r;
      EXPECT_EQ(vmax, amax > 0 ? 127 : 0) << "n=" << n << " row " << r;
      for (int64_t d = 0; d < n; ++d) {
        EXPECT_LE(std::fabs(static_cast<double>(vr[d]) * s - xr[d]), 0.5 * s * (1 + 1e-6)) << "n=" << n << " row " << r;
        EXPECT_EQ(back.data<float>()[r * n + d], static_cast<float>(vr[d]) * s);
      }
    }
  }
  Tensor bad = randn({2, 4});
  bad.data<float>()[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(error_of([&] { quantize_kv(bad); }), HasSubstr("quantize_kv: x [2, 4]: row 1 holds a NaN or an infinity"));
  bad.data<float>()[5] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(error_of([&] { quantize_kv(bad); }), HasSubstr("row 1 holds a NaN or an infinity"));
  EXPECT_THAT(error_of([&] { quantize_kv(Tensor::zeros({3}, DType::I64)); }), HasSubstr("quantize_kv: x: expected a floating"));
  EXPECT_THAT(error_of([&] { dequantize_kv(Tensor::zeros({2, 3}, DType::I8), Tensor::zeros({3}, DType::F32)); }),
              HasSubstr("dequantize_kv: scales: expected f32 [2] for values [2, 3], got f32 [3]"));
}

// K and V as a cache holds them: views of the first Lk positions of [B, Hkv, cap, D] storage,
// int8 with their scales, or bf16.
struct StoredKV {
  Tensor k, v, k_scale, v_scale;
};

StoredKV store(const Tensor& k, const Tensor& v, DType dt, int64_t extra) {
  const int64_t B = k.size(0), Hkv = k.size(1), Lk = k.size(2);
  const auto widen = [&](const Tensor& t, DType d) {  // inside a longer buffer, as a cache's slice
    Tensor buf = Tensor::empty({B, Hkv, Lk + extra, t.size(3)}, d);
    Tensor view = buf.slice(2, 0, Lk);
    view.copy_from(t.to(d));
    return view;
  };
  StoredKV s;
  if (dt != DType::I8) {
    s.k = widen(k, dt);
    s.v = widen(v, dt);
    return s;
  }
  const Int8Rows qk = quantize_kv(k), qv = quantize_kv(v);
  const auto scales = [&](const Tensor& sc) {
    Tensor buf = Tensor::empty({B, Hkv, Lk + extra}, DType::F32);
    Tensor view = buf.slice(2, 0, Lk);
    view.copy_from(sc);
    return view;
  };
  s.k = widen(qk.values, DType::I8);
  s.v = widen(qv.values, DType::I8);
  s.k_scale = scales(qk.scales);
  s.v_scale = scales(qv.scales);
  return s;
}

struct KvCase {
  int64_t B, H, Hkv, Lq, Lk, D, Dv;
  bool causal;
  double softcap;
  bool mask;
};

// The kernel on int8 or bf16 K/V equals the float64 reference on the same stored values (int8
// dequantised exactly there) to f32 rounding (bf16 q: to the bf16 rounding of q and out), on every
// path: decode shapes (Lq <= 4, read in place) and a prefill (widened), GQA, odd head dims,
// bottom-right causal, softcap, a bool mask, weights.
TEST(SdpaKv, StoredKeysAndValuesMatchReferenceOnEveryPath) {
  IsaGuard guard;
  const KvCase cases[] = {
      {1, 4, 4, 1, 700, 128, 128, false, 0.0, false}, {2, 6, 2, 3, 1030, 63, 17, true, 0.0, true},
      {1, 8, 1, 1, 129, 7, 9, false, 30.0, false},    {2, 2, 2, 4, 1, 16, 16, true, 0.0, false},
      {1, 4, 2, 9, 300, 40, 24, true, 0.0, true},     {1, 2, 2, 33, 33, 64, 64, true, 0.0, false},
  };
  for (const KvCase& c : cases) {
    const Tensor q = randn({c.B, c.H, c.Lq, c.D}), k = randn({c.B, c.Hkv, c.Lk, c.D}, 2.0),
                 v = randn({c.B, c.Hkv, c.Lk, c.Dv});
    SdpaOptions o;
    o.enable_gqa = c.H != c.Hkv;
    o.is_causal = c.causal;
    o.causal_align = CausalAlign::BottomRight;
    o.softcap = c.softcap;
    if (c.mask) o.attn_mask = testing::rand_bool({c.B, 1, c.Lq, c.Lk}, 0.8);
    for (const DType kv : {DType::I8, DType::BF16, DType::F32}) {
      for (const DType qd : {DType::F32, DType::BF16}) {
        if (kv == qd) continue;  // the plain kernels: sdpa_test.cc
        const StoredKV s = store(k, v, kv, 5);
        o.k_scale = s.k_scale;
        o.v_scale = s.v_scale;
        const Tensor qq = q.to(qd);
        o.need_weights = true;
        const SdpaResult ref = ref::sdpa_fwd_f64(qq, s.k, s.v, o);
        // bf16 q: the output is rounded to bf16 (2^-9 relative), the rest is f32
        const double rtol = qd == DType::BF16 ? 1.0 / 256 : 1e-5;
        for (Isa isa : testing::test_isas()) {
          set_isa(isa);
          const std::string where = "B=" + std::to_string(c.B) + " H=" + std::to_string(c.H) + " Hkv=" +
                                    std::to_string(c.Hkv) + " Lq=" + std::to_string(c.Lq) + " Lk=" +
                                    std::to_string(c.Lk) + " D=" + std::to_string(c.D) + " q " +
                                    std::string(dtype_name(qd)) + " kv " + std::string(dtype_name(kv)) + " isa " +
                                    isa_name(isa);
          o.need_weights = true;
          const SdpaResult r = sdpa(qq, s.k, s.v, o);
          ASSERT_EQ(r.out.dtype(), qd) << where;
          const auto e = compare(r.out, ref.out);
          EXPECT_TRUE(e.within(rtol, 1e-6)) << where << ": out max err " << e.max_abs << " (ref max " << e.max_ref << ")";
          const auto ew = compare(r.weights, ref.weights);
          EXPECT_TRUE(ew.within(1e-5, 1e-6)) << where << ": weights max err " << ew.max_abs;
          const auto el = compare(r.lse, ref.lse);
          EXPECT_TRUE(el.within(1e-5, 1e-6) || el.max_abs == 0) << where << ": lse max err " << el.max_abs;
          o.need_weights = false;
          const SdpaResult r2 = sdpa(qq, s.k, s.v, o);
          EXPECT_TRUE(testing::bitwise_equal(r.out, r2.out)) << where << ": need_weights changed the output";
        }
      }
    }
    o.k_scale = o.v_scale = Tensor();
  }
}

// The decode over int8 keys and values keeps f32's precision on every path (the VNNI one sums
// 24-bit digits of q and of P exactly): with large scores, the log-sum-exp (about the largest score)
// and the output against the float64 reference on the same stored keys and values, relative to
// their size. 24-bit digits: ~1e-7 (lse), <= 1e-6 (out); q's or P's lowest digit lost: ~4e-5.
TEST(SdpaKv, Int8DecodeScoresKeepF32Precision) {
  IsaGuard guard;
  for (const auto& [Hkv, Lk, D] : {std::tuple<int64_t, int64_t, int64_t>{2, 300, 128}, {1, 129, 80}, {3, 64, 32}, {1, 50, 7}}) {
    const int64_t H = 2 * Hkv;
    const Tensor q = randn({1, H, 1, D}, 6.0), k = randn({1, Hkv, Lk, D}), v = randn({1, Hkv, Lk, D});
    const Int8Rows qk = quantize_kv(k), qv = quantize_kv(v);
    SdpaOptions o;
    o.enable_gqa = true;
    o.k_scale = qk.scales;
    o.v_scale = qv.scales;
    const SdpaResult ref = ref::sdpa_fwd_f64(q, qk.values, qv.values, o);
    for (Isa isa : testing::test_isas()) {
      set_isa(isa);
      const SdpaResult r = sdpa(q, qk.values, qv.values, o);
      const auto e = compare(r.lse, ref.lse);
      EXPECT_LT(e.max_abs / e.max_ref, 1e-6) << "Hkv=" << Hkv << " Lk=" << Lk << " D=" << D << " isa "
                                             << isa_name(isa) << ": lse err " << e.max_abs << " of " << e.max_ref;
      const auto eo = compare(r.out, ref.out);  // f32 products: up to 1e-6 here; a lost lowest digit of P: 3e-5
      EXPECT_LT(eo.max_abs / eo.max_ref, 4e-6) << "Hkv=" << Hkv << " Lk=" << Lk << " D=" << D << " isa "
                                               << isa_name(isa) << ": out err " << eo.max_abs << " of " << eo.max_ref;
    }
  }
}

// How much a cache loses: attention of an f32 query over keys and values stored as int8 or bf16,
// against float64 attention over the original f32 keys and values. Printed for the record; int8 is
// held to a bound of its own (one scale per 127 steps of a row: its values carry about 6 bits where bf16
// carries 8) and to a multiple of bf16's error.
TEST(SdpaKv, Int8CacheErrorAgainstBf16) {
  double worst_i8 = 0, worst_bf16 = 0;
  for (const auto& [H, Hkv, Lk, D] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{8, 2, 4096, 128},
                                      {4, 4, 1000, 64}, {2, 1, 333, 80}, {4, 2, 77, 17}}) {
    const Tensor q = randn({1, H, 1, D}), k = randn({1, Hkv, Lk, D}), v = randn({1, Hkv, Lk, D});
    SdpaOptions o;
    o.enable_gqa = H != Hkv;
    const SdpaResult ref = ref::sdpa_fwd_f64(q, k, v, o);
    double err[2] = {};
    int x = 0;
    for (const DType kv : {DType::I8, DType::BF16}) {
      const StoredKV s = store(k, v, kv, 0);
      o.k_scale = s.k_scale;
      o.v_scale = s.v_scale;
      const auto e = compare(sdpa(q, s.k, s.v, o).out, ref.out);
      err[x++] = e.max_abs / e.max_ref;
    }
    std::printf("H=%lld Hkv=%lld Lk=%lld D=%lld: int8 K/V %.3g, bf16 K/V %.3g (max |out - f64| / max |out|)\n",
                (long long)H, (long long)Hkv, (long long)Lk, (long long)D, err[0], err[1]);
    worst_i8 = std::max(worst_i8, err[0]);
    worst_bf16 = std::max(worst_bf16, err[1]);
  }
  EXPECT_LT(worst_i8, 0.03);
  EXPECT_LT(worst_bf16, 0.005);
}

TEST(SdpaKv, Errors) {
  const Tensor q = randn({1, 2, 1, 8}), k = randn({1, 2, 5, 8}), v = randn({1, 2, 5, 8});
  const Int8Rows qk = quantize_kv(k), qv = quantize_kv(v);
  SdpaOptions o;
  EXPECT_THAT(error_of([&] { sdpa(q, qk.values, qv.values, o); }),
              HasSubstr("sdpa: k_scale: an int8 key [1, 2, 5, 8] needs its f32 scales [B, Hkv, Lk] = [1, 2, 5], got none"));
  o.k_scale = qk.scales;
  o.v_scale = qv.scales.slice(2, 0, 4);
  EXPECT_THAT(error_of([&] { sdpa(q, qk.values, qv.values, o); }),
              HasSubstr("sdpa: v_scale: an int8 value [1, 2, 5, 8] needs its f32 scales [B, Hkv, Lk] = [1, 2, 5], got f32 [1, 2, 4]"));
  o.v_scale = qv.scales;
  EXPECT_THAT(error_of([&] { sdpa(q, k, v, o); }), HasSubstr("sdpa: k_scale: given with a f32 key (scales are for int8"));
  o.v_scale = Tensor();
  EXPECT_THAT(error_of([&] { sdpa(q, qk.values, v.to(DType::BF16), o); }),
              HasSubstr("sdpa: key and value: expected both f32, bf16 or int8 (with k_scale, v_scale), got i8 and bf16"));
  o.k_scale = Tensor();
  EXPECT_THAT(error_of([&] { sdpa(q, k.to(DType::F64), v.to(DType::F64), o); }),
              HasSubstr("sdpa: key and value: expected both f32, bf16 or int8 (with k_scale, v_scale), got f64 and f64"));
  // int8 keys are for inference: the backward names what it takes
  o.k_scale = qk.scales;
  o.v_scale = qv.scales;
  const SdpaResult f = sdpa(q, qk.values, qv.values, o);
  EXPECT_THAT(error_of([&] { sdpa_backward(f.out, q, qk.values, qv.values, f, o); }), HasSubstr("sdpa_backward"));
}

}  // namespace
}  // namespace heads
