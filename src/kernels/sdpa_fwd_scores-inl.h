// sdpa_fwd_scores-inl.h — what the tiled forward does to a query tile's scores between the two
// products: the score modifiers and masks (softcap, ALiBi / T5 bias, attn_mask, the band, block
// layouts) and dropout. Included by sdpa_flash_fwd-inl.h inside its namespace fwd.

struct Tile {
  const SdpaProblem& pb;
  int64_t b, h, hk, i0, nq;
};

// tanh(x): an odd Taylor polynomial below |x| = 0.3 (relative error < 1e-7 there), else
// sign(x) · (1 - e) / (1 + e) with e = e^{-2|x|} (no cancellation left at that size).
HEADS_INLINE VR tanh_v(VR x) {
  const VR ax = Vec::abs(x);
  const VR e = Vec::exp2(Vec::mul(ax, Vec::set1(-2.0f * kLog2e)));
  const VR one = Vec::set1(1.0f);
  const VR big = Vec::div(Vec::sub(one, e), Vec::add(one, e));
  const VR x2 = Vec::mul(x, x);
  VR p = Vec::set1(62.0f / 2835.0f);
  p = Vec::fma(p, x2, Vec::set1(-17.0f / 315.0f));
  p = Vec::fma(p, x2, Vec::set1(2.0f / 15.0f));
  p = Vec::fma(p, x2, Vec::set1(-1.0f / 3.0f));
  p = Vec::mul(Vec::fma(p, x2, one), x);
  const VR signed_big = Vec::select_neg(x, Vec::sub(Vec::zero(), big), big);
  return Vec::select_neg(Vec::sub(ax, Vec::set1(0.3f)), p, signed_big);
}

// ScoreMods' softcap on log2-unit scores x: cap2 · tanh(x / cap2) (inv_cap2 = 1 / cap2, both
// ScoreMods::cap2's); *grad (when given) receives d(capped)/dx = 1 - tanh². Both vector forms use it.
HEADS_INLINE VR softcap_v(VR x, VR cap2, VR inv_cap2, VR* grad = nullptr) {
  const VR th = tanh_v(Vec::mul(x, inv_cap2));
  if (grad != nullptr) *grad = Vec::sub(Vec::set1(1.0f), Vec::mul(th, th));
  return Vec::mul(cap2, th);
}

// Applies the score modifiers (score_mods.h, in its order; the vector form of ScoreMods::apply with
// queries across the lanes) and the band to S rows [0, nk) (keys j0 + r, row stride lds, log2
// units), folding in the running max: softcap, then the ALiBi / T5 bias and a float attn_mask
// added; a bool attn_mask's false, a block layout's hidden blocks and keys outside the band become
// -inf. causal_here: some key of the block lies past some row's upper limit. With softcap, tg (when
// given, stride lds) receives d(capped)/dS = 1 - tanh².
inline void apply_masks(const Tile& t, int64_t j0, int64_t nk, bool causal_here, float* s, VR* mx,
                        int64_t lds = kTQ, float* tg = nullptr) {
  const SdpaProblem& pb = t.pb;
  VR qlim[kNQ], qlo[kNQ];  // key j is hidden from query lane i iff j > i + causal_offset or j < i + left_offset
  for (int v = 0; v < kNQ; ++v) {
    const VR i = Vec::add(Vec::iota(), Vec::set1(static_cast<float>(t.i0 + v * kW)));
    qlim[v] = Vec::add(i, Vec::set1(static_cast<float>(pb.causal_offset)));
    qlo[v] = Vec::add(i, Vec::set1(static_cast<float>(pb.left_offset)));
  }
  const bool left_here = pb.has_left && j0 < t.i0 + t.nq - 1 + pb.left_offset;
  const bool cap = pb.mods.capped();
  const VR cap2 = Vec::set1(pb.mods.cap2);
  const VR inv_cap2 = Vec::set1(cap ? 1.0f / pb.mods.cap2 : 0.0f);
  // Bias of (i0 + lane, j0 + r) at rel[lane - r]: the table runs along i - j.
  const float* rel = pb.mods.biased() ? pb.mods.rel_row(t.h) + (t.i0 - j0 + pb.Lk - 1) : nullptr;
  const bool has_mask = pb.mods.masked();
  const bool bool_mask = pb.mods.mask_kind == MaskKind::Bool;
  const bool row_bcast = has_mask && pb.mods.mask.stride(2) == 0;  // same value for every query
  // Block-sparse layout: per lane, 0 where the lane's query block sees key block kb, else -inf
  // (rebuilt when the key block changes).
  VR blk[kNQ] = {Vec::zero(), Vec::zero()};
  int64_t blk_kb = -1;
  const bool blocks = pb.mods.blocked();
  const int64_t ms3 = has_mask ? pb.mods.mask.stride(3) : 0;
  const int64_t mrow0 = has_mask ? pb.mods.mask_offset(t.b, t.h, t.i0) : 0;
  const int64_t ms2 = has_mask ? pb.mods.mask.stride(2) : 0;
  auto value = [&](int64_t off) { return pb.mods.mask_term<float>(off, kLog2e); };  // log2 units
  // A mask with a row per query ([Lq, Lk] per head: nn.MultiheadAttention's attn_mask, a 4-D padding
  // mask expanded over the queries) is read along each query's row, where its keys lie, kMaskKeys
  // keys at a time, into `terms` [key][query] (the scores' layout): reading it one element at a
  // time down the queries was half of a short sequence's time.
  constexpr int64_t kMaskKeys = 16;
  alignas(64) float terms[kMaskKeys][kTQ];
  auto read_terms = [&](int64_t r0, int64_t n) {
    for (int64_t l = 0; l < kTQ; ++l) {
      const int64_t off = mrow0 + l * ms2 + (j0 + r0) * ms3;
      for (int64_t c = 0; c < n; ++c) terms[c][l] = l < t.nq ? value(off + c * ms3) : 0.0f;
    }
  };
  for (int64_t r = 0; r < nk; ++r) {
    const int64_t j = j0 + r;
    VR add[kNQ] = {Vec::zero(), Vec::zero()};
    if (row_bcast) {
      add[0] = add[1] = Vec::set1(value(mrow0 + j * ms3));
    } else if (has_mask) {
      if (r % kMaskKeys == 0) read_terms(r, std::min<int64_t>(kMaskKeys, nk - r));
      for (int v = 0; v < kNQ; ++v) add[v] = Vec::load(terms[r % kMaskKeys] + v * kW);
    }
    const VR jv = Vec::set1(static_cast<float>(j));
    if (blocks && j / pb.mods.block_size != blk_kb) {
      blk_kb = j / pb.mods.block_size;
      alignas(64) float lanes[kTQ];
      for (int64_t l = 0; l < kTQ; ++l) {
        lanes[l] = l >= t.nq || pb.mods.block_visible(t.h, (t.i0 + l) / pb.mods.block_size, blk_kb) ? 0.0f : -kInf;
      }
      blk[0] = Vec::load(lanes);
      blk[1] = Vec::load(lanes + kW);
    }
    for (int v = 0; v < kNQ; ++v) {
      VR x = Vec::load(s + r * lds + v * kW);
      if (cap) {
        VR grad;
        x = softcap_v(x, cap2, inv_cap2, &grad);
        if (tg != nullptr) Vec::store(tg + r * lds + v * kW, grad);
      }
      if (rel != nullptr) x = Vec::add(x, Vec::loadu(rel - r + v * kW));
      if (bool_mask) {
        x = Vec::fill_if_gt(x, Vec::zero(), add[v], -kInf);  // false (-inf term): hidden
      } else if (has_mask) {
        x = Vec::add(x, add[v]);
      }
      if (causal_here) x = Vec::fill_if_gt(x, jv, qlim[v], -kInf);
      if (left_here) x = Vec::fill_if_gt(x, qlo[v], jv, -kInf);
      if (blocks) x = Vec::fill_if_gt(x, Vec::zero(), blk[v], -kInf);
      mx[v] = Vec::max(mx[v], x);
      Vec::store(s + r * lds + v * kW, x);
    }
  }
}

// Whether S of keys [j0, j0 + nk) needs apply_masks for the tile (else it is used as computed): a
// score modifier, or the band cutting these keys for some row.
HEADS_INLINE bool needs_masks(const Tile& t, int64_t j0, int64_t nk, bool causal_here) {
  const SdpaProblem& pb = t.pb;
  return causal_here || pb.mods.any() || (pb.has_left && j0 < t.i0 + t.nq - 1 + pb.left_offset);
}

// Dropout of S's keys [j0, j0 + nk): kept values times `keep_scale`, the others 0.
inline void apply_dropout(const Tile& t, int64_t j0, int64_t nk, float* s, float keep_scale) {
  const SdpaProblem& pb = t.pb;
  for (int64_t r = 0; r < nk; ++r) {
    for (int64_t l = 0; l < t.nq; ++l) {
      const bool keep = dropout_keep(pb.seed, dropout_index(pb, t.b, t.h, t.i0 + l, j0 + r), pb.dropout_p);
      s[r * kTQ + l] = keep ? s[r * kTQ + l] * keep_scale : 0.0f;
    }
  }
}
