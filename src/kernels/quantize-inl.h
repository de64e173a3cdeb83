// quantize-inl.h — dynamic int8 of activation rows for the int8 linear layers (linear_lowp.cc,
// heads/precision.h), over the vector layer. Included by isa_table-inl.h.
//
// Row r of x in two int8 terms: q[r] = round(x · (1/s1)) with s1 = max|x| / 127, then q[rows + r] =
// round(e · (1/s2)) of the residual e = x − q[r]·s1 (one fused rounding) with s2 = max|e| / 127; a
// maximum below 127·FLT_MIN (zero, or too small to invert) gives the scale 1. Rounding to nearest
// even; every path computes the same bits.

namespace qz {

using VR = Vec::R;
constexpr int kW = Vec::W;
constexpr float kLevels = 127.0f;

// Max |v| over the row, v = x (kResidual false) or the residual of the first term; NaN when the row
// holds NaN or ±inf (x·0 is NaN only for those).
template <bool kResidual>
HEADS_INLINE float row_amax(const float* x, int64_t n, float inv1, float s1) {
  VR mx = Vec::zero(), probe = Vec::zero();
  const VR vinv = Vec::set1(inv1), vneg = Vec::set1(-s1), lo = Vec::set1(-kLevels), hi = Vec::set1(kLevels);
  for (int64_t i = 0; i < n; i += kW) {
    const VR v = i + kW <= n ? Vec::loadu(x + i) : Vec::load_partial(x + i, n - i);
    probe = Vec::add(probe, Vec::mul(v, Vec::zero()));
    VR e = v;
    if constexpr (kResidual) e = Vec::fma(Vec::min(Vec::max(Vec::round_even(Vec::mul(v, vinv)), lo), hi), vneg, v);
    mx = Vec::max(mx, Vec::abs(e));
  }
  return Vec::reduce_add(probe) == 0.0f ? Vec::reduce_max(mx) : std::numeric_limits<float>::quiet_NaN();
}

// q = round(v · inv) clamped to ±127, v as in row_amax.
template <bool kResidual>
HEADS_INLINE void row_quantize(const float* x, int64_t n, float inv1, float s1, float inv, int8_t* q) {
  const VR vinv1 = Vec::set1(inv1), vneg = Vec::set1(-s1), vinv = Vec::set1(inv);
  const VR lo = Vec::set1(-kLevels), hi = Vec::set1(kLevels);
  for (int64_t i = 0; i < n; i += kW) {
    const int64_t m = std::min<int64_t>(kW, n - i);
    const VR v = m == kW ? Vec::loadu(x + i) : Vec::load_partial(x + i, m);
    VR e = v;
    if constexpr (kResidual) e = Vec::fma(Vec::min(Vec::max(Vec::round_even(Vec::mul(v, vinv1)), lo), hi), vneg, v);
    Vec::store_partial_i8(q + i, Vec::min(Vec::max(Vec::round_even(Vec::mul(e, vinv)), lo), hi), m);
  }
}

// max/127; below 127 · FLT_MIN (where 1/scale would overflow) the row counts as zero, scale 1.
HEADS_INLINE float scale_of(float amax) {
  return amax >= kLevels * std::numeric_limits<float>::min() ? amax / kLevels : 1.0f;
}

}  // namespace qz

// x [rows, n] (row stride xs) -> q [2·rows, n] int8 and s [2·rows] (above). A row holding NaN or
// ±inf gets q = 0 in both terms, s[r] = NaN and s[rows + r] = 0, so its outputs come out NaN.
inline void quantize_rows_i8(const float* x, int64_t rows, int64_t n, int64_t xs, int8_t* q, float* s) {
  ew::for_rows(rows, n, 8192, [&](int64_t r) {
    const float* xr = x + r * xs;
    int8_t* q1 = q + r * n;
    int8_t* q2 = q + (rows + r) * n;
    const float a1 = qz::row_amax<false>(xr, n, 0.0f, 0.0f);
    if (!std::isfinite(a1)) {
      std::fill(q1, q1 + n, int8_t{0});
      std::fill(q2, q2 + n, int8_t{0});
      s[r] = std::numeric_limits<float>::quiet_NaN();
      s[rows + r] = 0.0f;
      return;
    }
    const float s1 = qz::scale_of(a1), inv1 = 1.0f / s1;
    qz::row_quantize<false>(xr, n, inv1, s1, inv1, q1);
    const float s2 = qz::scale_of(qz::row_amax<true>(xr, n, inv1, s1));
    qz::row_quantize<true>(xr, n, inv1, s1, 1.0f / s2, q2);
    s[r] = s1;
    s[rows + r] = s2;
  });
}
