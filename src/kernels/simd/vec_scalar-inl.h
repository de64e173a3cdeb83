// vec_scalar-inl.h — the portable vector layer: 8 f32 lanes as a plain array, no intrinsics.
// Included by isa_scalar.cc inside namespace heads::kernels::scalar.
//
// Interface of every Vec (vec_avx2-inl.h, vec_avx512-inl.h follow it):
//   R                    register type; W lanes; kRowsQK / kRowsPV micro-kernel rows
//   zero, set1, load/store (64-byte aligned), div, min, abs, select_neg(x, a, b) = x < 0 ? a : b, loadu/storeu, load_partial/store_partial (first n
//   lanes; loads zero the rest), loadu_bf16/load_partial_bf16 (bf16 bits widened),
//   loadu_bf16_split(p, even, odd) (2W bf16 values: the even ones, the odd ones, widened), loadu_i8/load_partial_i8 (int8 as f32), reduce_add, reduce_max, round_even (to nearest even),
//   gather(base, idx) / scatter(base, idx, x) (lane i at base[idx[i]]; scatter's indices distinct),
//   store_partial_u8 (integral lanes in [0, 255] as uint8), reduce_lanes(a[W]) (lane i = sum of a[i]),
//   transpose_scaled(src, ss, dst, ds, scale) (W x W block, source rows times scale), fma(a, b, c) = a*b + c, add, sub, mul, max
//   iota() = {0, 1, ..., W-1}
//   add_squares_f64(acc, x): acc[i] += double(x[i])² for the W lanes (the square rounded, then the sum)
//   fill_if_gt(x, a, b, fill) = a > b ? fill : x;  fill_if_eq(x, v, fill) = x == v ? fill : x
//   exp2(x): 2^x with degree-6 polynomial on [-1/2, 1/2]; exactly 0 for x < -126 and -inf; NaN for NaN

#include "kernels/simd/unfused-inl.h"

struct Vec {
  struct R {
    float v[8];
  };
  static constexpr int W = 8;
  static constexpr int kRowsQK = 4;
  static constexpr int kRowsPV = 4;

  static R zero() { return set1(0.0f); }
  static R set1(float x) {
    R r;
    for (float& e : r.v) e = x;
    return r;
  }
  static R load(const float* p) {
    R r;
    for (int i = 0; i < W; ++i) r.v[i] = p[i];
    return r;
  }
  static void store(float* p, R x) {
    for (int i = 0; i < W; ++i) p[i] = x.v[i];
  }
  static R loadu(const float* p) { return load(p); }
  static void storeu(float* p, R x) { store(p, x); }
  static void stream(float* p, R x) { store(p, x); }
  static void stream_fence() {}
  static R load_partial(const float* p, int64_t n) {
    R r = zero();
    for (int64_t i = 0; i < n; ++i) r.v[i] = p[i];
    return r;
  }
  static void store_partial(float* p, R x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) p[i] = x.v[i];
  }
  static R loadu_bf16(const uint16_t* p) { return load_partial_bf16(p, W); }
  static void loadu_bf16_split(const uint16_t* p, R& even, R& odd) {  // 2W values: even ones, odd ones
    for (int i = 0; i < W; ++i) even.v[i] = bf16_to_f32(p[2 * i]), odd.v[i] = bf16_to_f32(p[2 * i + 1]);
  }
  static R load_partial_bf16(const uint16_t* p, int64_t n) {
    R r = zero();
    for (int64_t i = 0; i < n; ++i) r.v[i] = bf16_to_f32(p[i]);
    return r;
  }
  static R loadu_i8(const int8_t* p) { return load_partial_i8(p, W); }
  static R load_partial_i8(const int8_t* p, int64_t n) {
    R r = zero();
    for (int64_t i = 0; i < n; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  static float reduce_add(R x) {  // pairwise, like the SIMD paths
    for (int w = W / 2; w > 0; w /= 2) {
      for (int i = 0; i < w; ++i) x.v[i] += x.v[i + w];
    }
    return x.v[0];
  }
  static void transpose_scaled(const float* src, int64_t ss, float* dst, int64_t ds, R scale) {
    for (int r = 0; r < W; ++r) {
      for (int c = 0; c < W; ++c) dst[c * ds + r] = src[r * ss + c] * scale.v[c];
    }
  }
  static R reduce_lanes(const R* a) {
    R r;
    for (int i = 0; i < W; ++i) r.v[i] = reduce_add(a[i]);
    return r;
  }
  static float reduce_max(R x) { return max_of_lanes(x.v, W); }
  static R round_even(R x) {
    for (float& e : x.v) e = std::nearbyint(e);
    return x;
  }
  static R gather(const float* base, const int32_t* idx) {
    R r;
    for (int i = 0; i < W; ++i) r.v[i] = base[idx[i]];
    return r;
  }
  static void scatter(float* base, const int32_t* idx, R x) {
    for (int i = 0; i < W; ++i) base[idx[i]] = x.v[i];
  }
  static void store_partial_u8(uint8_t* p, R x, int64_t n) {  // lanes hold integers in [0, 255]
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(x.v[i]);
  }
  static R fma(R a, R b, R c) {
    for (int i = 0; i < W; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return c;
  }
  static R add(R a, R b) {
    for (int i = 0; i < W; ++i) a.v[i] += b.v[i];
    return a;
  }
  static R sub(R a, R b) {
    for (int i = 0; i < W; ++i) a.v[i] -= b.v[i];
    return a;
  }
  static R mul(R a, R b) {
    for (int i = 0; i < W; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static R max(R a, R b) {
    for (int i = 0; i < W; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
    return a;
  }
  static R div(R a, R b) {
    for (int i = 0; i < W; ++i) a.v[i] /= b.v[i];
    return a;
  }
  static R min(R a, R b) {
    for (int i = 0; i < W; ++i) a.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i];
    return a;
  }
  static void add_squares_f64(double* acc, R x) {
    for (int i = 0; i < W; ++i) acc[i] += unfused(static_cast<double>(x.v[i]) * x.v[i]);
  }
  static R abs(R a) {
    for (int i = 0; i < W; ++i) a.v[i] = std::fabs(a.v[i]);
    return a;
  }
  static R select_neg(R x, R a, R b) {
    for (int i = 0; i < W; ++i) b.v[i] = x.v[i] < 0.0f ? a.v[i] : b.v[i];
    return b;
  }
  static R iota() {
    R r;
    for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(i);
    return r;
  }
  static R fill_if_gt(R x, R a, R b, float fill) {
    for (int i = 0; i < W; ++i) x.v[i] = a.v[i] > b.v[i] ? fill : x.v[i];
    return x;
  }
  static R fill_if_eq(R x, float v, float fill) {
    for (int i = 0; i < W; ++i) x.v[i] = x.v[i] == v ? fill : x.v[i];
    return x;
  }
  static R exp2(R x) {
    for (int i = 0; i < W; ++i) {
      const float a = std::min(x.v[i], 128.0f);  // 2^128 = inf, as the SIMD paths
      if (std::isnan(x.v[i])) continue;          // NaN stays NaN
      if (a < -126.0f) {
        x.v[i] = 0.0f;
        continue;
      }
      const float n = std::nearbyint(a);
      const float f = a - n;
      float p = kExp2C6;
      p = std::fma(p, f, kExp2C5);
      p = std::fma(p, f, kExp2C4);
      p = std::fma(p, f, kExp2C3);
      p = std::fma(p, f, kExp2C2);
      p = std::fma(p, f, kExp2C1);
      p = std::fma(p, f, 1.0f);
      x.v[i] = std::ldexp(p, static_cast<int>(n));
    }
    return x;
  }
};
