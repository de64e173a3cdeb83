// sdpa_bwd_few-inl.h — the backward's steps of at most kSmallQ queries (a decode step's training, a
// short tail of queries): their scores and dP as dot products per key (small_dots), and P, dS (and
// Pd) stored query-major so that every pass runs along the keys (few_block). Included by
// sdpa_bwd-inl.h inside its namespace bwd, after normalized_d.

// out[r·ldr + l·ldl] = alpha · (A_r · B_l) for keys r < nk and queries l < nq (rows of n values,
// strides lda / ldb): a few queries' scores as nq dot products per key.
inline void small_dots(int64_t nk, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t nq,
                       int64_t n, float alpha, float* out, int64_t ldr, int64_t ldl) {
  const VR al = Vec::set1(alpha);
  for (int64_t r0 = 0; r0 < nk; r0 += kW) {
    const int64_t nr = std::min<int64_t>(kW, nk - r0);
    for (int64_t l = 0; l < nq; ++l) {
      const float* bl = b + l * ldb;
      VR part[kW];
      for (int u = 0; u < kW; ++u) part[u] = u < nr ? row_dot(a + (r0 + u) * lda, bl, n) : Vec::zero();
      alignas(64) float sums[kW];
      Vec::store(sums, Vec::mul(Vec::reduce_lanes(part), al));
      for (int64_t u = 0; u < nr; ++u) out[(r0 + u) * ldr + l * ldl] = sums[u];
    }
  }
}

// Steps of at most kSmallQ queries: P, dS (and Pd with dropout) of queries l < t.nq and keys
// j0 + r, r < nk, stored query-major (s[l·kTK + r]) so every pass runs along the keys. dsum null:
// these are all the keys, D_l = sum_r P ∘ dP is taken from the block.
inline void few_block(const fwd::Tile& t, int64_t j0, int64_t nk, const float* kr, int64_t ks2, const float* vr,
                      int64_t vs2, const float* q0, int64_t qs2, const float* g0, int64_t gs2, const float* lse2,
                      const float* dsum, float c, float* s, float* dp, float* pd, float* tg) {
  const SdpaProblem& pb = t.pb;
  const int64_t nq = t.nq;
  small_dots(nk, kr, ks2, q0, qs2, nq, pb.D, c, s, 1, kTK);
  small_dots(nk, vr, vs2, g0, gs2, nq, pb.Dv, 1.0f, dp, 1, kTK);
  const bool modified = pb.causal || pb.has_left || pb.mods.any();
  const float keep_scale = pb.dropout_p > 0 ? dropout_keep_scale(pb.dropout_p) : 1.0f;
  for (int64_t l = 0; l < nq; ++l) {
    const int64_t i = t.i0 + l;
    float* sl = s + l * kTK;
    float* dl = dp + l * kTK;
    if (modified) {
      for (int64_t r = 0; r < nk; ++r) sl[r] = mod_score_log2(pb, t.b, t.h, i, j0 + r, sl[r], tg + l * kTK + r);
    }
    const VR l2 = Vec::set1(lse2[l]);
    for (int64_t r = 0; r < nk; r += kW) {
      const int64_t m = std::min<int64_t>(kW, nk - r);
      Vec::store_partial(sl + r, Vec::exp2(Vec::sub(Vec::load_partial(sl + r, m), l2)), m);  // P
    }
    if (pb.dropout_p > 0.0) {  // Pd = P ∘ Z/(1-p), dP = dP ∘ Z/(1-p)
      for (int64_t r = 0; r < nk; ++r) {
        const float z = dropout_keep(pb.seed, dropout_index(pb, t.b, t.h, i, j0 + r), pb.dropout_p) ? keep_scale : 0.0f;
        dl[r] *= z;
        pd[l * kTK + r] = sl[r] * z;
      }
    }
    float dl_sum;
    if (dsum != nullptr) {
      dl_sum = dsum[l];
    } else {
      VR acc = Vec::zero(), mass = Vec::zero();
      for (int64_t r = 0; r < nk; r += kW) {
        const int64_t m = std::min<int64_t>(kW, nk - r);
        const VR pr = Vec::load_partial(sl + r, m);
        acc = Vec::fma(pr, Vec::load_partial(dl + r, m), acc);
        mass = Vec::add(mass, pr);
      }
      dl_sum = normalized_d(Vec::reduce_add(acc), Vec::reduce_add(mass));
    }
    const VR d = Vec::set1(dl_sum);
    for (int64_t r = 0; r < nk; r += kW) {  // dS = P ∘ (dP - D)
      const int64_t m = std::min<int64_t>(kW, nk - r);
      const VR x = Vec::mul(Vec::load_partial(sl + r, m), Vec::sub(Vec::load_partial(dl + r, m), d));
      Vec::store_partial(dl + r, x, m);
    }
  }
}
