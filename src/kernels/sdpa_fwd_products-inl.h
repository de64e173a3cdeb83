// sdpa_fwd_products-inl.h — the tiled forward's two products over the vector layer: S = K·Qt rows
// (qk_*) and Ot = Ot·α + Vᵀ·P rows (pv_*), register-blocked with smaller instantiations for the
// remainders. Included by sdpa_flash_fwd-inl.h inside its namespace fwd.

// S rows r < R:  S[r][:] = sum_d K[r][d] · Qt[d][:], handed to out(r, lanes 0..W-1, lanes W..2W-1)
// (which stores them, possibly transformed).
template <int R, class T, class Out>
HEADS_INLINE void qk_rows(const T* k, int64_t ks, const float* qt, int64_t D, Out& out) {
  VR acc[R][kNQ];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Vec::zero();
  const T* kr[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) kr[r] = k + r * ks;
  for (int64_t d = 0; d < D; ++d) {
    const VR b0 = Vec::load(qt + d * kTQ), b1 = Vec::load(qt + d * kTQ + kW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const VR x = Vec::set1(widen(kr[r][d]));
      acc[r][0] = Vec::fma(x, b0, acc[r][0]);
      acc[r][1] = Vec::fma(x, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) out(r, acc[r][0], acc[r][1]);
}

// Runs rows [0, n) in steps of R, the remainder through the smaller instantiations; out(r, ...)
// receives row r of the block.
template <int R, class T, class Out>
HEADS_INLINE void qk_tail(int64_t n, int64_t r0, const T* k, int64_t ks, const float* qt, int64_t D,
                          Out& out) {
  if constexpr (R > 0) {
    auto at = [&](int r, VR a0, VR a1) { out(r0 + r, a0, a1); };
    if (n == R) return qk_rows<R>(k, ks, qt, D, at);
    qk_tail<R - 1>(n, r0, k, ks, qt, D, out);
  }
}
template <class T, class Out>
HEADS_INLINE void qk_block_with(int64_t n, const T* k, int64_t ks, const float* qt, int64_t D, Out&& out) {
  constexpr int R = Vec::kRowsQK;
  int64_t r = 0;
  for (; r + R <= n; r += R) {
    auto at = [&](int i, VR a0, VR a1) { out(r + i, a0, a1); };
    qk_rows<R>(k + r * ks, ks, qt, D, at);
  }
  if (r < n) qk_tail<R - 1>(n - r, r, k + r * ks, ks, qt, D, out);
}
// S rows (stride lds) = K · Qt; mx = max(mx, S rows) when mx != nullptr.
template <class T>
inline void qk_block(int64_t n, const T* k, int64_t ks, const float* qt, int64_t D, float* s, VR* mx,
                     int64_t lds = kTQ) {
  qk_block_with(n, k, ks, qt, D, [&](int64_t r, VR a0, VR a1) {
    Vec::store(s + r * lds, a0);
    Vec::store(s + r * lds + kW, a1);
    if (mx != nullptr) {
      mx[0] = Vec::max(mx[0], a0);
      mx[1] = Vec::max(mx[1], a1);
    }
  });
}

// Ot rows r < R (head-dim entries d0 + r):  Ot[r][:] = Ot[r][:] · alpha + sum_j V[j][r] · P[j][:]
template <int R, class T>
HEADS_INLINE void pv_rows(const T* v, int64_t vs, const float* p, int64_t nk, float* ot,
                          const VR* alpha) {
  VR acc[R][kNQ];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc[r][0] = Vec::mul(Vec::load(ot + r * kTQ), alpha[0]);
    acc[r][1] = Vec::mul(Vec::load(ot + r * kTQ + kW), alpha[1]);
  }
  for (int64_t j = 0; j < nk; ++j) {
    const VR b0 = Vec::load(p + j * kTQ), b1 = Vec::load(p + j * kTQ + kW);
    const T* vj = v + j * vs;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const VR x = Vec::set1(widen(vj[r]));
      acc[r][0] = Vec::fma(x, b0, acc[r][0]);
      acc[r][1] = Vec::fma(x, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    Vec::store(ot + r * kTQ, acc[r][0]);
    Vec::store(ot + r * kTQ + kW, acc[r][1]);
  }
}

template <int R, class T>
HEADS_INLINE void pv_tail(int64_t n, const T* v, int64_t vs, const float* p, int64_t nk, float* ot,
                          const VR* alpha) {
  if constexpr (R > 0) {
    if (n == R) return pv_rows<R>(v, vs, p, nk, ot, alpha);
    pv_tail<R - 1>(n, v, vs, p, nk, ot, alpha);
  }
}
template <class T>
inline void pv_block(int64_t Dv, const T* v, int64_t vs, const float* p, int64_t nk, float* ot,
                     const VR* alpha) {
  constexpr int R = Vec::kRowsPV;
  int64_t d = 0;
  for (; d + R <= Dv; d += R) pv_rows<R>(v + d, vs, p, nk, ot + d * kTQ, alpha);
  if (d < Dv) pv_tail<R - 1>(Dv - d, v + d, vs, p, nk, ot + d * kTQ, alpha);
}
