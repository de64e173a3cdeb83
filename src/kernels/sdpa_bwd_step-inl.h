// sdpa_bwd_step-inl.h — the backward's work on one step of queries against a block of keys, in the
// order of FlashAttention-2's Alg. 2: P from the scores (1), dP and dS (2, 4), then the three
// products into dV, dK and dQ (3, 5). Included by sdpa_bwd-inl.h inside its namespace bwd, after
// Call, Step and Scratch.

// 1. S^T = K_j · (Q_i · c)^T, masked; P = 2^(S - lse2)                     (forward 1-3)
// Tile u of the step against keys [j0, j0 + nk), P into s (stride kLd).
HEADS_INLINE void scores_to_p(const Call& C, const Step& st, const fwd::Tile& t, int64_t j0, int64_t nk, int64_t u,
                              const Scratch& scr, float* s) {
  const SdpaProblem& pb = C.pb;
  const float* l2 = st.lse2 + u * kTQ;
  const VR l2v[kNQ] = {Vec::load(l2), Vec::load(l2 + kW)};
  const bool causal_here = pb.causal && j0 + nk - 1 > t.i0 + pb.causal_offset;
  const float* kj = st.k_row(j0);
  if (C.tiles) {  // S^T already in s, in log2 units (tiles::step_scores)
    VR mx[kNQ] = {Vec::zero(), Vec::zero()};
    if (fwd::needs_masks(t, j0, nk, causal_here)) fwd::apply_masks(t, j0, nk, causal_here, s, mx, kLd, scr.tg + u * kTQ);
    for (int64_t r = 0; r < nk; ++r) {
      for (int vv = 0; vv < kNQ; ++vv) {
        float* sp = s + r * kLd + vv * kW;
        Vec::store(sp, Vec::exp2(Vec::sub(Vec::load(sp), l2v[vv])));
      }
    }
    return;
  }
  if (!fwd::needs_masks(t, j0, nk, causal_here)) {  // P straight from the accumulators
    fwd::qk_block_with(nk, kj, st.ks2, scr.qt + u * pb.D * kTQ, pb.D, [&](int64_t r, VR a0, VR a1) {
      Vec::store(s + r * kLd, Vec::exp2(Vec::sub(a0, l2v[0])));
      Vec::store(s + r * kLd + kW, Vec::exp2(Vec::sub(a1, l2v[1])));
    });
    return;
  }
  fwd::qk_block(nk, kj, st.ks2, scr.qt + u * pb.D * kTQ, pb.D, s, nullptr, kLd);
  VR mx[kNQ] = {Vec::zero(), Vec::zero()};
  fwd::apply_masks(t, j0, nk, causal_here, s, mx, kLd, scr.tg + u * kTQ);
  for (int64_t r = 0; r < nk; ++r) {
    for (int vv = 0; vv < kNQ; ++vv) {
      float* sp = s + r * kLd + vv * kW;
      Vec::store(sp, Vec::exp2(Vec::sub(Vec::load(sp), l2v[vv])));
    }
  }
}

// 2. dP^T = V_j · dO_i^T; with dropout Pd = P ∘ Z/(1-p) and dP = dP ∘ Z/(1-p)   (forward 4)
// 4. dS = P ∘ (dP - D_i), dS into dp; with one block, D_i = sum P ∘ dP / sum P over the block.
HEADS_INLINE void dp_to_ds(const Call& C, const Step& st, const fwd::Tile& t, int64_t j0, int64_t nk, int64_t u,
                           const Scratch& scr, const float* s, float* dp, float* pd) {
  const SdpaProblem& pb = C.pb;
  const float* ds = st.dsum + u * kTQ;
  VR dsv[kNQ] = {Vec::load(ds), Vec::load(ds + kW)};
  const float* vj = st.v_row(j0);
  const float* dot = scr.dot + u * pb.Dv * kTQ;
  // dP^T row by row: from the K·Qt micro-kernel's accumulators, or on tiles already in dp
  // (tiles::step_scores)
  const auto each_dp = [&](auto&& fn) {
    if (C.tiles) {
      for (int64_t r = 0; r < nk; ++r) fn(r, Vec::load(dp + r * kLd), Vec::load(dp + r * kLd + kW));
    } else {
      fwd::qk_block_with(nk, vj, st.vs2, dot, pb.Dv, fn);
    }
  };
  if (pb.dropout_p == 0.0 && !C.one_block) {  // dS straight from the accumulators
    each_dp([&](int64_t r, VR a0, VR a1) {
      Vec::store(dp + r * kLd, Vec::mul(Vec::load(s + r * kLd), Vec::sub(a0, dsv[0])));
      Vec::store(dp + r * kLd + kW, Vec::mul(Vec::load(s + r * kLd + kW), Vec::sub(a1, dsv[1])));
    });
    return;
  }
  VR num[kNQ] = {Vec::zero(), Vec::zero()}, den[kNQ] = {Vec::zero(), Vec::zero()};
  const auto gather = [&](int64_t r, VR d0, VR d1) {  // key r's P ∘ dP and P, for the one-block D
    const VR p0 = Vec::load(s + r * kLd), p1 = Vec::load(s + r * kLd + kW);
    num[0] = Vec::fma(p0, d0, num[0]);
    num[1] = Vec::fma(p1, d1, num[1]);
    den[0] = Vec::add(den[0], p0);
    den[1] = Vec::add(den[1], p1);
  };
  if (pb.dropout_p == 0.0) {  // one block: the sums straight from the accumulators
    each_dp([&](int64_t r, VR a0, VR a1) {
      gather(r, a0, a1);
      Vec::store(dp + r * kLd, a0);
      Vec::store(dp + r * kLd + kW, a1);
    });
  } else {
    if (!C.tiles) fwd::qk_block(nk, vj, st.vs2, dot, pb.Dv, dp, nullptr, kLd);
    for (int64_t r = 0; r < nk; ++r) {
      for (int64_t l = 0; l < kTQ; ++l) {
        const bool keep =
            l < t.nq && dropout_keep(pb.seed, dropout_index(pb, t.b, t.h, t.i0 + l, j0 + r), pb.dropout_p);
        const float z = keep ? C.keep_scale : 0.0f;
        dp[r * kLd + l] *= z;
        pd[r * kLd + l] = s[r * kLd + l] * z;
      }
    }
    if (C.one_block) {
      for (int64_t r = 0; r < nk; ++r) gather(r, Vec::load(dp + r * kLd), Vec::load(dp + r * kLd + kW));
    }
  }
  if (C.one_block) {
    alignas(64) float nums[kTQ], dens[kTQ];
    for (int vv = 0; vv < kNQ; ++vv) {
      Vec::store(nums + vv * kW, num[vv]);
      Vec::store(dens + vv * kW, den[vv]);
    }
    for (int64_t l = 0; l < kTQ; ++l) nums[l] = normalized_d(nums[l], dens[l]);
    dsv[0] = Vec::load(nums);
    dsv[1] = Vec::load(nums + kW);
  }
  for (int64_t r = 0; r < nk; ++r) {
    for (int vv = 0; vv < kNQ; ++vv) {
      const VR pv = Vec::load(s + r * kLd + vv * kW);
      const VR d = Vec::sub(Vec::load(dp + r * kLd + vv * kW), dsv[vv]);
      Vec::store(dp + r * kLd + vv * kW, Vec::mul(pv, d));
    }
  }
}

// P, dS (and Pd) of tile u against keys [j0, j0 + nk), and dS into the mask gradient when asked.
HEADS_INLINE void tile_ds(const Call& C, Step& st, int64_t j0, int64_t nk, int64_t u, const Scratch& scr) {
  const SdpaProblem& pb = C.pb;
  const int64_t i0 = st.I0 + u * kTQ, nq = std::min(st.nqs - u * kTQ, kTQ);
  const fwd::Tile t{pb, st.b, st.h, st.hk, i0, nq};
  float* const mrow =
      C.dmask_full == nullptr ? nullptr : C.dmask_full + ((st.b * pb.H + st.h) * pb.Lq + i0) * pb.Lk + j0;
  if (st.few) {
    few_block(t, j0, nk, st.k_row(j0), st.ks2, st.v_row(j0), st.vs2, st.q0, st.qs2, st.g0, st.gs2, st.lse2, C.one_block ? nullptr : st.dsum, C.c, scr.s, scr.dp, scr.pd, scr.tg);
    for (int64_t l = 0; mrow != nullptr && l < nq; ++l) std::copy_n(scr.dp + l * kTK, nk, mrow + l * pb.Lk);
    for (int64_t l = 0; scr.drel != nullptr && l < nq; ++l) {  // dS of (i, j) into drel[i - j + Lk - 1]
      float* dr = scr.drel + st.h * pb.mods.rel_len + (i0 + l - j0 + pb.Lk - 1);
      for (int64_t r = 0; r < nk; ++r) dr[-r] += scr.dp[l * kTK + r];
    }
    if (pb.mods.capped()) {  // dS through the softcap for dQ and dK
      for (int64_t l = 0; l < nq; ++l) {
        for (int64_t r = 0; r < nk; ++r) scr.dp[l * kTK + r] *= scr.tg[l * kTK + r];
      }
    }
    return;
  }
  float* s = scr.s + u * kTQ;
  float* dp = scr.dp + u * kTQ;
  float* pd = scr.pd + u * kTQ;
  if ((pb.causal && j0 > i0 + nq - 1 + pb.causal_offset) || (pb.has_left && j0 + nk - 1 < i0 + pb.left_offset) ||
      !pb.mods.blocks_any(st.h, i0, i0 + nq, j0, j0 + nk)) {  // the tile sees none of these keys
    for (int64_t r = 0; r < nk; ++r) {
      std::fill(s + r * kLd, s + r * kLd + kTQ, 0.0f);
      std::fill(dp + r * kLd, dp + r * kLd + kTQ, 0.0f);
      if (pb.dropout_p > 0.0) std::fill(pd + r * kLd, pd + r * kLd + kTQ, 0.0f);
    }
    return;
  }
  scores_to_p(C, st, t, j0, nk, u, scr, s);
  dp_to_ds(C, st, t, j0, nk, u, scr, s, dp, pd);
  for (int64_t l = 0; mrow != nullptr && l < nq; ++l) {
    for (int64_t r = 0; r < nk; ++r) mrow[l * pb.Lk + r] = dp[r * kLd + l];
  }
  if (scr.drel != nullptr) {  // dS of (i0 + lane, j0 + r) into drel[lane - r + i0 - j0 + Lk - 1], lanes < nq
    float* dr = scr.drel + st.h * pb.mods.rel_len + (i0 - j0 + pb.Lk - 1);
    for (int64_t r = 0; r < nk; ++r) {
      for (int vv = 0; vv < kNQ; ++vv) {
        const int64_t n = std::min<int64_t>(kW, nq - vv * kW);
        if (n <= 0) break;
        float* x = dr - r + vv * kW;
        Vec::store_partial(x, Vec::add(Vec::load_partial(x, n), Vec::load_partial(dp + r * kLd + vv * kW, n)), n);
      }
    }
  }
  if (pb.mods.capped()) {  // dS through the softcap for dQ and dK
    const float* tg = scr.tg + u * kTQ;
    for (int64_t r = 0; r < nk; ++r) {
      for (int vv = 0; vv < kNQ; ++vv) {
        const int64_t o = r * kLd + vv * kW;
        Vec::store(dp + o, Vec::mul(Vec::load(dp + o), Vec::load(tg + o)));
      }
    }
  }
}

// 3. dV_j += Pd^T dO;  5. dK_j += scale · dS^T Q;  dQ += scale · dS K_j, over the step's queries. A key
// block's first contribution sets dK/dV (or streams them), later ones add; the step's dQ rows are set
// by the first key block of the task's first group and added to after.
HEADS_INLINE void block_products(const Call& C, Step& st, int64_t jg, int64_t j0, int64_t nk, bool& written,
                                 const Scratch& scr) {
  const SdpaProblem& pb = C.pb;
  const bool acc = C.dkb != nullptr;  // bf16 dK, dV: into the group's f32 sums
  float* dkj = acc ? scr.kacc + (j0 - jg) * pb.D : C.dkp + st.b * C.dks[0] + st.hk * C.dks[1] + j0 * C.dks[2];
  float* dvj = acc ? scr.vacc + (j0 - jg) * pb.Dv : C.dvp + st.b * C.dvs[0] + st.hk * C.dvs[1] + j0 * C.dvs[2];
  const int64_t dks2 = acc ? pb.D : C.dks[2], dvs2 = acc ? pb.Dv : C.dvs[2];
  const Out kv_out = written ? Out::Add : C.stream_kv ? Out::Stream : Out::Set;
#ifdef HEADS_AMX
  if (C.tiles && !st.few) {
    tiles::block_products(C, st, jg, j0, nk, dkj, dks2, dvj, dvs2, kv_out, st.dq_unset ? Out::Set : Out::Add, scr);
    written = true;
    st.dq_unset = false;
    return;
  }
#endif
  const int64_t key_stride = st.few ? 1 : kLd, query_stride = st.few ? kTK : 1;  // of P, dS
  gemm_acc(nk, pb.Dv, st.nqs, pb.dropout_p > 0.0 ? scr.pd : scr.s, key_stride, query_stride, st.g0, st.gs2, dvj,
           dvs2, 1.0f, kv_out);
  gemm_acc(nk, pb.D, st.nqs, scr.dp, key_stride, query_stride, st.q0, st.qs2, dkj, dks2, C.scale, kv_out);
  written = true;
  gemm_acc(st.nqs, pb.D, nk, scr.dp, query_stride, key_stride, st.k_row(j0), st.ks2, st.dq0, st.dq_ld,
           C.scale, st.dq_unset ? Out::Set : Out::Add);
  st.dq_unset = false;
}
