// quantize-inl.h — dynamic int8 of activation rows for the int8 linear layers (linear_lowp.cc,
// heads/precision.h), over the vector layer. Included by isa_table-inl.h.

namespace qz {

using VR = Vec::R;
constexpr int kW = Vec::W;
constexpr float kLevels = 127.0f;

// max/127; below 127 · FLT_MIN (where 1/scale would overflow) the row counts as zero, scale 1.
HEADS_INLINE float scale_of(float amax) {
  return amax >= kLevels * std::numeric_limits<float>::min() ? amax / kLevels : 1.0f;
}

}  // namespace qz

// Activation rows for the int8 linear layers (heads/precision.h), as unsigned bytes: the u8 × s8
// product is the one VNNI and AMX multiply natively (a signed activation costs oneDNN a shift and
// a compensation per call). Row r of v = x (or x·c[k] per column when c is given; one rounding) as
// an asymmetric first term: lo = min(0, min v), hi = max(0, max v), s = hi/255 − lo/255 (below
// FLT_MIN the row counts as zero: s 1, z 0), zero point z = round(−lo/s) in [0, 255], q =
// clamp(round(v · (1/s)) + z, 0, 255), so that v ≈ (q − z)·s. Its relative error is estimated from
// the exact integer E = Σ (q − z)²: a uniform rounding loses s²/12 per value, so the estimate is
// sqrt(n / (12·E)); rows with E > 0 and n > 12·τ²·E (`tau2x12` = 12·τ²) also get a symmetric second
// term, the residual e = v − (q − z)·s (one fused rounding) as clamp(round(e · (1/sr)), ±127), sr =
// max|e| / 127 (scale_of), stored plus kSecondZero (128) in r, and sr = 0 marks the rows without one
// (r is not written there). A row holding NaN or ±inf gets q = 0, z = 0, s = NaN and no second term,
// so its outputs come out NaN. Rounding to nearest even; every path computes the same bits.
inline void quantize_rows_u8(const float* x, int64_t rows, int64_t n, int64_t xs, const float* c, double tau2x12,
                             uint8_t* q, float* s, int32_t* z, uint8_t* r, float* sr) {
  ew::for_rows(rows, n, 8192, [&](int64_t row) {
    const float* xr = x + row * xs;
    uint8_t* qr = q + row * n;
    const auto value = [&](int64_t i, int64_t m) {  // v at [i, i + m), lanes past m zero
      const qz::VR v = m == qz::kW ? Vec::loadu(xr + i) : Vec::load_partial(xr + i, m);
      if (c == nullptr) return v;
      return Vec::mul(v, m == qz::kW ? Vec::loadu(c + i) : Vec::load_partial(c + i, m));
    };
    qz::VR vmin = Vec::zero(), vmax = Vec::zero(), probe = Vec::zero();
    for (int64_t i = 0; i < n; i += qz::kW) {
      const qz::VR v = value(i, std::min<int64_t>(qz::kW, n - i));
      probe = Vec::fma(v, Vec::zero(), probe);  // NaN once an element is NaN or ±inf
      vmin = Vec::min(vmin, v);
      vmax = Vec::max(vmax, v);
    }
    sr[row] = 0.0f;
    if (Vec::reduce_add(probe) != 0.0f) {  // NaN or ±inf in the row
      std::fill(qr, qr + n, uint8_t{0});
      s[row] = std::numeric_limits<float>::quiet_NaN();
      z[row] = 0;
      return;
    }
    const float lo = -Vec::reduce_max(Vec::sub(Vec::zero(), vmin)), hi = Vec::reduce_max(vmax);
    const float span = hi / 255.0f - lo / 255.0f;
    const bool zero_row = !(span >= std::numeric_limits<float>::min());
    const float scale = zero_row ? 1.0f : span, inv = 1.0f / scale;
    const float zp = zero_row ? 0.0f : std::clamp(std::nearbyint(-lo * inv), 0.0f, 255.0f);
    const qz::VR vinv = Vec::set1(inv), vzp = Vec::set1(zp), top = Vec::set1(255.0f);
    const auto code = [&](qz::VR v) {  // q, an integer in [0, 255]
      return Vec::min(Vec::max(Vec::add(Vec::round_even(Vec::mul(v, vinv)), vzp), Vec::zero()), top);
    };
    const auto steps = [&](qz::VR v) { return Vec::sub(code(v), vzp); };  // q − z, in [−255, 255]
    for (int64_t i = 0; i < n; i += qz::kW) {
      const int64_t m = std::min<int64_t>(qz::kW, n - i);
      Vec::store_partial_u8(qr + i, code(value(i, m)), m);
    }
    const auto zq = static_cast<int32_t>(zp);
    s[row] = scale;
    z[row] = zq;
    if (zero_row || std::isinf(tau2x12)) return;  // E = 0, or τ = ∞: one term
    if (tau2x12 > 0) {  // (τ = 0: every row with E > 0, which is every row but the zero ones)
      int64_t e = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t d = static_cast<int64_t>(qr[i]) - zq;
        e += d * d;
      }
      if (e == 0 || static_cast<double>(n) <= tau2x12 * static_cast<double>(e)) return;
    }
    const qz::VR vneg = Vec::set1(-scale), lo127 = Vec::set1(-qz::kLevels), hi127 = Vec::set1(qz::kLevels),
                 second_zero = Vec::set1(static_cast<float>(kSecondZero));
    qz::VR emax = Vec::zero();
    for (int64_t i = 0; i < n; i += qz::kW) {
      const qz::VR v = value(i, std::min<int64_t>(qz::kW, n - i));
      emax = Vec::max(emax, Vec::abs(Vec::fma(steps(v), vneg, v)));
    }
    const float s2 = qz::scale_of(Vec::reduce_max(emax));
    const qz::VR vinv2 = Vec::set1(1.0f / s2);
    uint8_t* rr = r + row * n;
    for (int64_t i = 0; i < n; i += qz::kW) {
      const int64_t m = std::min<int64_t>(qz::kW, n - i);
      const qz::VR v = value(i, m);
      const qz::VR e2 = Vec::fma(steps(v), vneg, v);
      Vec::store_partial_u8(rr + i, Vec::add(Vec::min(Vec::max(Vec::round_even(Vec::mul(e2, vinv2)), lo127), hi127), second_zero), m);
    }
    sr[row] = s2;
  });
}

// Rows of an int8 linear layer's output (heads/precision.h, linear_lowp.cc) from their exact integer
// sums, rows[m] into y + m·ys: y[n] = fma(v, sw[n], b[n]) (b null: 0) with v = float(a[n] − z·ws[n])·s,
// or, with a second term (a2 given), v = fma(float(a2[n] − 128·ws[n]), s2, float(a[n] − z·ws[n])·s)
// (a2 sums the second term stored plus kSecondZero; the differences exact in int32). With the
// residual rows given (Int8Row::col), a residual row's sums are those of its row C, 2^p·a[n] +
// a3[col[n]] (and 2^p·a2[n] + a32[col[n]]), with C's row sums and scale in ws and sw, every output in
// one pass; each such sum is exact in 32 bits (|Σ (q − z)·C| ≤ 255·Σ|C| < 2^31,
// heads::int8_residual_fits), so that the products and sums may wrap on the way (unsigned
// arithmetic). Then for each outlier channel o in order y[n] = fma(x[oc[o]], wo_t[o, n], y[n]). Every
// multiply-add is fused explicitly, so that every path gives the same bits. The rows share one weight
// (its residual rows and outlier channels).
inline void int8_row_sums_out(const Int8Row& r, float* y) {
  const int32_t* a = r.a;
  const int32_t* a2 = r.a2;
  const auto z = static_cast<uint32_t>(r.z);
  const float s = r.s, s2 = r.s2;
  const int32_t* ws = r.ws;
  const float* sw = r.sw;
  const float* b = r.b;
  const int64_t n = r.n;
  // a − c·w in 32 bits: exact where it fits, as |Σ (q − z)·W| ≤ 255·Σ|W| does (wrapping, not
  // undefined, where K is past 65,793 and the weights are extreme)
  const auto diff = [](int32_t a, uint32_t c, int32_t w) {
    return static_cast<int32_t>(static_cast<uint32_t>(a) - c * static_cast<uint32_t>(w));
  };
  // b's test outside the loops: a null b read through `b ? b[i] : 0` became a masked load from
  // address 0 + 4i with every lane off, which AMD Zen 4 runs as a fault-suppression assist, hundreds of
  // cycles per vector (a bias-free decoder's int8 prompt spent 21% of its time on that one load).
  const auto rows_out = [&](auto with_bias) {
    const auto bias = [b](int64_t i) {
      if constexpr (decltype(with_bias)::value) {
        return b[i];
      } else {
        return 0.0f;
      }
    };
    if (r.col != nullptr) {  // residual rows: (a << p) + (a3[col] & mask) − c·ws, every output alike
      const int32_t* p = r.shift;
      const int32_t* col = r.col;
      const uint32_t* mask = r.mask;
      const auto c_sum = [&](const int32_t* acc, const int32_t* acc3, uint32_t c, int64_t i) {
        return static_cast<float>(static_cast<int32_t>((static_cast<uint32_t>(acc[i]) << p[i]) +
                                                       (static_cast<uint32_t>(acc3[col[i]]) & mask[i]) -
                                                       c * static_cast<uint32_t>(ws[i])));
      };
      if (a2 == nullptr) {
        for (int64_t i = 0; i < n; ++i) y[i] = std::fma(c_sum(a, r.a3, z, i) * s, sw[i], bias(i));
      } else {
        for (int64_t i = 0; i < n; ++i) {
          const float v = std::fma(c_sum(a2, r.a32, kSecondZero, i), s2, c_sum(a, r.a3, z, i) * s);
          y[i] = std::fma(v, sw[i], bias(i));
        }
      }
      return;
    }
    if (a2 == nullptr) {
      for (int64_t i = 0; i < n; ++i) {
        const float v = static_cast<float>(diff(a[i], z, ws[i])) * s;
        y[i] = std::fma(v, sw[i], bias(i));
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const float v = std::fma(static_cast<float>(diff(a2[i], kSecondZero, ws[i])), s2,
                                 static_cast<float>(diff(a[i], z, ws[i])) * s);
        y[i] = std::fma(v, sw[i], bias(i));
      }
    }
  };
  if (b != nullptr) {
    rows_out(std::true_type{});
  } else {
    rows_out(std::false_type{});
  }
}

// The outlier channels of R rows at once: each vector of W's panel is loaded once for the R rows
// (one row at a time read the whole panel, N · no floats, per row: 17% of an int8 embedding on a
// Cascade Lake), each row's vector of y in a register across the channels, in channel order.
// V full vectors of outputs from i at once (R·V sums in registers): each channel's R broadcasts then
// serve V vectors of W, so that loads no longer outnumber the multiply-adds (R + 1 loads for R of
// them with one vector: the outlier pass had been bound by loads).
template <int R, int V>
HEADS_INLINE void int8_outliers_block(const Int8Row* rows, float* y, int64_t ys, int64_t i) {
  const Int8Row& r0 = rows[0];
  qz::VR acc[R][V];
  const float* w[V];
  for (int v = 0; v < V; ++v) {
    const int64_t iv = i + v * qz::kW;
    w[v] = r0.wo + (iv / kOutlierPanel) * r0.no * kOutlierPanel + iv % kOutlierPanel;
    for (int u = 0; u < R; ++u) acc[u][v] = Vec::loadu(y + u * ys + iv);
  }
  for (int64_t o = 0; o < r0.no; ++o) {
    qz::VR wv[V];
    for (int v = 0; v < V; ++v) wv[v] = Vec::loadu(w[v] + o * kOutlierPanel);
    const int64_t c = r0.oc[o];
    for (int u = 0; u < R; ++u) {
      const qz::VR xb = Vec::set1(rows[u].x[c]);
      for (int v = 0; v < V; ++v) acc[u][v] = Vec::fma(xb, wv[v], acc[u][v]);
    }
  }
  for (int u = 0; u < R; ++u) {
    for (int v = 0; v < V; ++v) Vec::storeu(y + u * ys + i + v * qz::kW, acc[u][v]);
  }
}

template <int R>
HEADS_INLINE void int8_outliers_out(const Int8Row* rows, float* y, int64_t ys) {
  static_assert(kOutlierPanel % qz::kW == 0);
  const Int8Row& r0 = rows[0];
  const int64_t n = r0.n;
  constexpr int V = qz::kW >= 16 ? 4 : 2;  // R·V + V + 1 registers: within AVX2's 16 at V = 2
  int64_t i = 0;
  for (; i + V * qz::kW <= n; i += V * qz::kW) int8_outliers_block<R, V>(rows, y, ys, i);
  for (; i < n; i += qz::kW) {  // the rest a vector at a time
    const int64_t m = std::min<int64_t>(qz::kW, n - i);
    qz::VR acc[R];
    for (int u = 0; u < R; ++u) acc[u] = m == qz::kW ? Vec::loadu(y + u * ys + i) : Vec::load_partial(y + u * ys + i, m);
    const float* w = r0.wo + (i / kOutlierPanel) * r0.no * kOutlierPanel + i % kOutlierPanel;
    for (int64_t o = 0; o < r0.no; ++o) {
      const qz::VR wv = Vec::loadu(w + o * kOutlierPanel);
      const int64_t c = r0.oc[o];
      for (int u = 0; u < R; ++u) acc[u] = Vec::fma(Vec::set1(rows[u].x[c]), wv, acc[u]);
    }
    for (int u = 0; u < R; ++u) {
      if (m == qz::kW) {
        Vec::storeu(y + u * ys + i, acc[u]);
      } else {
        Vec::store_partial(y + u * ys + i, acc[u], m);
      }
    }
  }
}

inline void int8_rows_out(const Int8Row* rows, int64_t count, float* y, int64_t ys) {
  for (int64_t m = 0; m < count; ++m) int8_row_sums_out(rows[m], y + m * ys);
  if (count == 0 || rows[0].no == 0) return;
  constexpr int kRows = 4;
  int64_t m = 0;
  for (; m + kRows <= count; m += kRows) int8_outliers_out<kRows>(rows + m, y + m * ys, ys);
  switch (count - m) {
    case 3: int8_outliers_out<3>(rows + m, y + m * ys, ys); break;
    case 2: int8_outliers_out<2>(rows + m, y + m * ys, ys); break;
    case 1: int8_outliers_out<1>(rows + m, y + m * ys, ys); break;
    default: break;
  }
}

// The scale search of an int8 weight row (linear_lowp_pack.cc defines it): for each candidate scale
// t[i], err[i] = Σ_k (w[k] − clamp(round_even(w[k] / t[i]), ±127)·t[i])², the quotient, product and
// difference rounded in f32 as written (never fused), squared and summed in double in the row's
// order. The candidates lie across the lanes, a row value against all of them at once, so every
// path computes the same bits as the definition's scalar loop. Finite w and t > 0 (the caller's).
inline void int8_scale_errors(const float* w, int64_t K, const float* t, double* err) {
  constexpr int kRegs = (kInt8ScaleCandidates + qz::kW - 1) / qz::kW;
  alignas(64) float tt[kRegs * qz::kW];
  alignas(64) double acc[kRegs * qz::kW] = {};
  for (int i = 0; i < kRegs * qz::kW; ++i) tt[i] = i < kInt8ScaleCandidates ? t[i] : 1.0f;  // lanes past: unused
  qz::VR tv[kRegs];
  for (int j = 0; j < kRegs; ++j) tv[j] = Vec::load(tt + j * qz::kW);
  const qz::VR lo = Vec::set1(-qz::kLevels), hi = Vec::set1(qz::kLevels);
  for (int64_t k = 0; k < K; ++k) {
    const qz::VR x = Vec::set1(w[k]);
    for (int j = 0; j < kRegs; ++j) {
      const qz::VR q = Vec::min(Vec::max(Vec::round_even(Vec::div(x, tv[j])), lo), hi);
      Vec::add_squares_f64(acc + j * qz::kW, Vec::sub(x, unfused(Vec::mul(q, tv[j]))));
    }
  }
  std::copy(acc, acc + kInt8ScaleCandidates, err);
}
