// elementwise-inl.h — LayerNorm, RMSNorm, GELU (erf and tanh forms), SiLU-gated units and ReLU in f32, written once over
// `Vec`. Included by kernels/isa_table-inl.h inside namespace heads::kernels::<isa>.
//
// Rows are the last dimension; other dimensions are flattened into `rows` with a row stride.
// Parallel over rows (LayerNorm) or chunks (activations); every element is computed the same way
// whatever the thread count. References: ref::layer_norm_f64, ref::activation_f64 in ops_ref.cc.

namespace ew {

using VR = Vec::R;
constexpr int kW = Vec::W;

// e^x for vectors.
HEADS_INLINE VR exp(VR x) { return Vec::exp2(Vec::mul(x, Vec::set1(kLog2e))); }

// erfc(z) for z >= 0: t·exp(-z² + P(t)), t = 1/(1 + z/2), a Chebyshev fit with relative error
// below 1.2e-7 everywhere (Numerical Recipes' erfcc); relative accuracy holds for large z too.
// N vectors side by side, each step on all of them in turn (the same operations on each, so the
// same bits as one at a time): one vector's chain of dependent steps (a division, then ten
// multiply-adds, then exp's) is ~100 cycles long, and on its own its waiting steps fill the core's
// FP scheduler before the next vector's can issue (Zen 3: GELU 34 → 26 cycles a vector, 4 side by side).
template <int N>
HEADS_INLINE void erfc_pos_n(const VR (&z)[N], VR (&out)[N]) {
  constexpr float kC[10] = {0.17087277f, -0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f,
                            -0.18628806f, 0.09678418f, 0.37409196f, 1.00002368f, -1.26551223f};
  VR t[N], p[N];
#pragma GCC unroll 8
  for (int j = 0; j < N; ++j) t[j] = Vec::div(Vec::set1(1.0f), Vec::fma(z[j], Vec::set1(0.5f), Vec::set1(1.0f)));
#pragma GCC unroll 8
  for (int j = 0; j < N; ++j) p[j] = Vec::set1(kC[0]);
#pragma GCC unroll 10
  for (int k = 1; k < 10; ++k) {
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) p[j] = Vec::fma(p[j], t[j], Vec::set1(kC[k]));
  }
#pragma GCC unroll 8
  for (int j = 0; j < N; ++j) out[j] = Vec::mul(t[j], exp(Vec::sub(p[j], Vec::mul(z[j], z[j]))));
}

HEADS_INLINE VR erfc_pos(VR z) {
  const VR zs[1] = {z};
  VR e[1];
  erfc_pos_n(zs, e);
  return e[0];
}

// GELU(x) = x·Φ(x) = ½x·erfc(-x/√2), evaluated as ½x·(2 - erfc(|x|/√2)) for x >= 0 and
// ½x·erfc(|x|/√2) for x < 0, so the negative tail keeps its relative accuracy. N vectors in place,
// side by side as erfc_pos_n.
template <int N>
HEADS_INLINE void gelu_erf_n(VR (&x)[N]) {
  VR z[N], e[N];
#pragma GCC unroll 8
  for (int j = 0; j < N; ++j) z[j] = Vec::mul(Vec::abs(x[j]), Vec::set1(0.70710678118654752f));
  erfc_pos_n(z, e);
#pragma GCC unroll 8
  for (int j = 0; j < N; ++j) {
    const VR phi2 = Vec::select_neg(x[j], e[j], Vec::sub(Vec::set1(2.0f), e[j]));  // 2·Φ(x)
    x[j] = Vec::mul(Vec::mul(x[j], Vec::set1(0.5f)), phi2);
  }
}

HEADS_INLINE VR gelu_erf(VR x) {
  VR v[1] = {x};
  gelu_erf_n(v);
  return v[0];
}

// Vectors side by side in the N-vector forms above.
constexpr int kSideBySide = 4;

// GELU, tanh form: ½x·(1 + tanh(u)), u = √(2/π)·(x + 0.044715x³), evaluated as x / (1 + e^{-2u})
// (the same value, without the cancellation of 1 + tanh(u) for negative u).
HEADS_INLINE VR gelu_tanh(VR x) {
  const VR u = Vec::mul(Vec::set1(0.7978845608028654f),
                        Vec::fma(Vec::mul(Vec::mul(x, x), x), Vec::set1(0.044715f), x));
  return Vec::div(x, Vec::add(Vec::set1(1.0f), exp(Vec::mul(u, Vec::set1(-2.0f)))));
}

HEADS_INLINE VR relu(VR x) { return Vec::max(x, Vec::zero()); }

// SiLU(x) = x / (1 + e^{-x}) (-0 far below zero, x far above it).
HEADS_INLINE VR silu(VR x) { return Vec::div(x, Vec::add(Vec::set1(1.0f), exp(Vec::sub(Vec::zero(), x)))); }

// Runs body(r) for every row, rows grouped into tasks of about `elems` values, over the threads.
template <class Body>
inline void for_rows(int64_t rows, int64_t n, int64_t elems, Body body) {
  const int64_t per_task = std::max<int64_t>(1, elems / std::max<int64_t>(n, 1));
  const int64_t tasks = (rows + per_task - 1) / per_task;
  const int threads = static_cast<int>(std::min<int64_t>(get_num_threads(), tasks));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    for (int64_t r = t * per_task; r < std::min(rows, (t + 1) * per_task); ++r) body(r);
  }
}

template <class F>
inline void map_rows(const float* x, float* y, int64_t rows, int64_t n, int64_t xs, int64_t ys, F f) {
  for_rows(rows, n, 16384, [&](int64_t r) {
      const float* xr = x + r * xs;
      float* yr = y + r * ys;
      int64_t i = 0;
      for (; i + kW <= n; i += kW) Vec::storeu(yr + i, f(Vec::loadu(xr + i)));
      if (i < n) Vec::store_partial(yr + i, f(Vec::load_partial(xr + i, n - i)), n - i);
  });
}

// map_rows for a function of kSideBySide vectors in place (f(VR (&)[kSideBySide])): the row's
// vectors kSideBySide at a time, the last few (and the partial one) as one more group.
template <class F>
inline void map_rows_n(const float* x, float* y, int64_t rows, int64_t n, int64_t xs, int64_t ys, F f) {
  constexpr int kN = kSideBySide;
  for_rows(rows, n, 16384, [&](int64_t r) {
      const float* xr = x + r * xs;
      float* yr = y + r * ys;
      int64_t i = 0;
      for (; i + kN * kW <= n; i += kN * kW) {
        VR v[kN];
#pragma GCC unroll 8
        for (int j = 0; j < kN; ++j) v[j] = Vec::loadu(xr + i + j * kW);
        f(v);
#pragma GCC unroll 8
        for (int j = 0; j < kN; ++j) Vec::storeu(yr + i + j * kW, v[j]);
      }
      if (i < n) {
        VR v[kN];
        for (int j = 0; j < kN; ++j) v[j] = Vec::load_partial(xr + i + j * kW, std::clamp<int64_t>(n - i - j * kW, 0, kW));
        f(v);
        for (int j = 0; j < kN && i + j * kW < n; ++j) {
          Vec::store_partial(yr + i + j * kW, v[j], std::min<int64_t>(n - i - j * kW, kW));
        }
      }
  });
}

}  // namespace ew

inline void gelu_f32(const float* x, float* y, int64_t rows, int64_t n, int64_t xs, int64_t ys,
                     bool tanh_form) {
  if (tanh_form) {
    ew::map_rows(x, y, rows, n, xs, ys, [](ew::VR v) { return ew::gelu_tanh(v); });
  } else {
    ew::map_rows_n(x, y, rows, n, xs, ys, [](ew::VR (&v)[ew::kSideBySide]) { ew::gelu_erf_n(v); });
  }
}

inline void relu_f32(const float* x, float* y, int64_t rows, int64_t n, int64_t xs, int64_t ys) {
  ew::map_rows(x, y, rows, n, xs, ys, [](ew::VR v) { return ew::relu(v); });
}

// y[r, i] = act(gu[r, i]) · gu[r, F + i] over rows of 2F values (the gate, then the up projection):
// act 0 SiLU, 1 GELU (erf), 2 GELU (tanh form).
inline void gated_f32(const float* gu, float* y, int64_t rows, int64_t F, int act) {
  const auto run = [&](auto f) {
    ew::for_rows(rows, 2 * F, 16384, [&](int64_t r) {
      const float* g = gu + r * 2 * F;
      const float* u = g + F;
      float* yr = y + r * F;
      int64_t i = 0;
      for (; i + ew::kW <= F; i += ew::kW) Vec::storeu(yr + i, Vec::mul(f(Vec::loadu(g + i)), Vec::loadu(u + i)));
      if (i < F) {
        const int64_t m = F - i;
        Vec::store_partial(yr + i, Vec::mul(f(Vec::load_partial(g + i, m)), Vec::load_partial(u + i, m)), m);
      }
    });
  };
  if (act == 0) {
    run([](ew::VR v) { return ew::silu(v); });
  } else if (act == 1) {
    run([](ew::VR v) { return ew::gelu_erf(v); });
  } else {
    run([](ew::VR v) { return ew::gelu_tanh(v); });
  }
}

// y = x / sqrt(mean(x²) + eps) · (w + off) per row of n values. The squares are summed in double,
// element i into lane i mod 16 whatever the vector width, and the 16 lanes then in order: the same
// bits on every path (a double holds a float's square exactly, and the sums are plain additions).
inline void rms_norm_f32(const float* x, float* y, int64_t rows, int64_t n, int64_t xs, int64_t ys, const float* w,
                         float off, double eps) {
  using namespace ew;
  constexpr int kLanes = 16;
  static_assert(kLanes % kW == 0);
  for_rows(rows, n, 8192, [&](int64_t r) {
    const float* xr = x + r * xs;
    float* yr = y + r * ys;
    alignas(64) double acc[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      for (int j = 0; j < kLanes; j += kW) Vec::add_squares_f64(acc + j, Vec::loadu(xr + i + j));
    }
    for (int j = 0; i + j < n; j += kW) {  // a partial load's lanes past n are zeros: they add nothing
      Vec::add_squares_f64(acc + j, Vec::load_partial(xr + i + j, std::min<int64_t>(kW, n - i - j)));
    }
    double ss = 0.0;
    for (double a : acc) ss += a;
    const VR inv = Vec::set1(static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps)));
    const VR o = Vec::set1(off);
    for (i = 0; i + kW <= n; i += kW) {
      Vec::storeu(yr + i, Vec::mul(Vec::mul(Vec::loadu(xr + i), inv), Vec::add(Vec::loadu(w + i), o)));
    }
    if (i < n) {
      const int64_t m = n - i;
      Vec::store_partial(yr + i, Vec::mul(Vec::mul(Vec::load_partial(xr + i, m), inv), Vec::add(Vec::load_partial(w + i, m), o)), m);
    }
  });
}

// y = bf16(x), rows of n values: f32_to_bf16's rounding (to nearest even, a NaN quieted, denormals
// rounded as they are) on every lane; the loop is plain integer arithmetic the compiler vectorizes
// for the ISA build.
inline void f32_to_bf16_rows(const float* x, uint16_t* y, int64_t rows, int64_t n, int64_t xs, int64_t ys) {
  ew::for_rows(rows, n, 16384, [&](int64_t r) {
    const float* xr = x + r * xs;
    uint16_t* yr = y + r * ys;
    for (int64_t i = 0; i < n; ++i) yr[i] = f32_to_bf16(xr[i]);
  });
}

// x + 1 for x >= 0, e^x below (NaN stays NaN).
inline void elu_plus_one_f32(const float* x, float* y, int64_t rows, int64_t n, int64_t xs, int64_t ys) {
  ew::map_rows(x, y, rows, n, xs, ys,
               [](ew::VR v) { return Vec::select_neg(v, ew::exp(v), Vec::add(v, Vec::set1(1.0f))); });
}

// y = LN(x [+ res]): (v - mean) / sqrt(var + eps) · w + b per row, v = x + res (the residual
// connection fused in; res may be null), biased variance, two passes in f32. w and b may be null
// (elementwise_affine=False / bias=False). res has the row stride of x.
inline void layer_norm_f32(const float* x, const float* res, float* y, int64_t rows, int64_t n,
                           int64_t xs, int64_t ys, const float* w, const float* b, float eps) {
  using namespace ew;
  for_rows(rows, n, 8192, [&](int64_t r) {
      const float* xr = x + r * xs;
      float* yr = y + r * ys;
      if (res != nullptr) {  // v = x + res into y, then normalise y in place
        const float* rr = res + r * xs;
        int64_t i = 0;
        for (; i + kW <= n; i += kW) Vec::storeu(yr + i, Vec::add(Vec::loadu(xr + i), Vec::loadu(rr + i)));
        if (i < n) Vec::store_partial(yr + i, Vec::add(Vec::load_partial(xr + i, n - i), Vec::load_partial(rr + i, n - i)), n - i);
        xr = yr;
      }
      VR s0 = Vec::zero(), s1 = Vec::zero();
      int64_t i = 0;
      for (; i + 2 * kW <= n; i += 2 * kW) {
        s0 = Vec::add(s0, Vec::loadu(xr + i));
        s1 = Vec::add(s1, Vec::loadu(xr + i + kW));
      }
      for (; i < n; i += kW) s0 = Vec::add(s0, Vec::load_partial(xr + i, std::min<int64_t>(kW, n - i)));
      const float mean = Vec::reduce_add(Vec::add(s0, s1)) / static_cast<float>(n);
      const VR mv = Vec::set1(mean);
      s0 = s1 = Vec::zero();
      for (i = 0; i + kW <= n; i += kW) {
        const VR d = Vec::sub(Vec::loadu(xr + i), mv);
        s0 = Vec::fma(d, d, s0);
      }
      if (i < n) {  // lanes past n must not count: zero them through a partial load of ones
        alignas(64) static constexpr float kOnes[64] = {
            1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
            1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
        const VR d = Vec::mul(Vec::sub(Vec::load_partial(xr + i, n - i), mv), Vec::load_partial(kOnes, n - i));
        s1 = Vec::fma(d, d, s1);
      }
      const float var = Vec::reduce_add(Vec::add(s0, s1)) / static_cast<float>(n);
      const float rstd = 1.0f / std::sqrt(var + eps);
      const VR rv = Vec::set1(rstd);
      for (i = 0; i + kW <= n; i += kW) {
        VR v = Vec::mul(Vec::sub(Vec::loadu(xr + i), mv), rv);
        if (w != nullptr) v = Vec::mul(v, Vec::loadu(w + i));
        if (b != nullptr) v = Vec::add(v, Vec::loadu(b + i));
        Vec::storeu(yr + i, v);
      }
      if (i < n) {
        const int64_t m = n - i;
        VR v = Vec::mul(Vec::sub(Vec::load_partial(xr + i, m), mv), rv);
        if (w != nullptr) v = Vec::mul(v, Vec::load_partial(w + i, m));
        if (b != nullptr) v = Vec::add(v, Vec::load_partial(b + i, m));
        Vec::store_partial(yr + i, v, m);
      }
  });
}

namespace ew {

// Runs body(i0, i1) over [0, n) in chunks of 16384 values, over the threads.
template <class Body>
inline void for_chunks(int64_t n, Body body) {
  constexpr int64_t kChunk = 16384;
  const int64_t tasks = (n + kChunk - 1) / kChunk;
  const int threads = static_cast<int>(std::min<int64_t>(get_num_threads(), tasks));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < tasks; ++t) body(t * kChunk, std::min(n, (t + 1) * kChunk));
}

// Φ(x) + x·φ(x), the derivative of x·Φ(x); Φ as in gelu_erf.
HEADS_INLINE VR gelu_erf_grad(VR x) {
  const VR e = erfc_pos(Vec::mul(Vec::abs(x), Vec::set1(0.70710678118654752f)));
  const VR phi2 = Vec::select_neg(x, e, Vec::sub(Vec::set1(2.0f), e));  // 2·Φ(x)
  const VR pdf = Vec::mul(exp(Vec::mul(Vec::mul(x, x), Vec::set1(-0.5f))), Vec::set1(0.3989422804014327f));
  return Vec::fma(x, pdf, Vec::mul(phi2, Vec::set1(0.5f)));
}

// d/dx of x·s, s = 1/(1 + e^{-2u}), u = √(2/π)(x + 0.044715x³): s + x·2s(1 - s)·u'.
HEADS_INLINE VR gelu_tanh_grad(VR x) {
  const VR c = Vec::set1(0.7978845608028654f), x2 = Vec::mul(x, x);
  const VR u = Vec::mul(c, Vec::fma(Vec::mul(x2, x), Vec::set1(0.044715f), x));
  const VR sg = Vec::div(Vec::set1(1.0f), Vec::add(Vec::set1(1.0f), exp(Vec::mul(u, Vec::set1(-2.0f)))));
  const VR du = Vec::mul(c, Vec::fma(x2, Vec::set1(3.0f * 0.044715f), Vec::set1(1.0f)));
  const VR t = Vec::mul(Vec::mul(Vec::set1(2.0f), sg), Vec::sub(Vec::set1(1.0f), sg));
  return Vec::fma(Vec::mul(x, t), du, sg);
}

}  // namespace ew

// y = a + b elementwise (n values), parallel in chunks.
inline void add_f32(const float* a, const float* b, float* y, int64_t n) {
  ew::for_chunks(n, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + ew::kW <= i1; i += ew::kW) Vec::storeu(y + i, Vec::add(Vec::loadu(a + i), Vec::loadu(b + i)));
    if (i < i1) Vec::store_partial(y + i, Vec::add(Vec::load_partial(a + i, i1 - i), Vec::load_partial(b + i, i1 - i)), i1 - i);
  });
}

// dx = dy · act'(x) over n values; act 0 = ReLU (derivative 0 at 0, as torch), 1 = GELU (erf),
// 2 = GELU (tanh form).
inline void activation_bwd_f32(const float* x, const float* dy, float* dx, int64_t n, int act) {
  ew::for_chunks(n, [&](int64_t i0, int64_t i1) {
    if (act == 0) {
      for (int64_t i = i0; i < i1; ++i) dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
      return;
    }
    auto grad = [act](ew::VR v) { return act == 1 ? ew::gelu_erf_grad(v) : ew::gelu_tanh_grad(v); };
    int64_t i = i0;
    for (; i + ew::kW <= i1; i += ew::kW) Vec::storeu(dx + i, Vec::mul(Vec::loadu(dy + i), grad(Vec::loadu(x + i))));
    if (i < i1) {
      const int64_t m = i1 - i;
      Vec::store_partial(dx + i, Vec::mul(Vec::load_partial(dy + i, m), grad(Vec::load_partial(x + i, m))), m);
    }
  });
}
