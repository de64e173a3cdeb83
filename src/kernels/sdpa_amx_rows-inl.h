// sdpa_amx_rows-inl.h — the AMX forward's vector work on rows (AVX-512): a unit's softmax step
// (softmax_unit, with the tile stream's products spread between its vectors), the rescale of O, and a
// task's outputs (finish_task: O / l, lse, the weights on request). Included by sdpa_amx-inl.h inside
// its namespace amx, after the Task, Scratch, Unit and score helpers it uses.

// Unit u's softmax step on its raw scores s, row by row: P = 2^(c·S + mods - m_new) rounded to
// bf16 into p (rows past nq zero), l and m updated, alpha = 2^(m_old - m_new) kept for O. The tile
// stream's products go out between the row's vectors (every 32 keys) by their share, so that the
// tile unit works beside the vector units; all of them are done on return. Returns whether some
// row's alpha is not 1.
inline bool softmax_unit(const Task& t, const Scratch& scr, const Unit& u, const float* s, uint16_t* p,
                         TileStream ts) {
  const SdpaProblem& pb = t.pb;
  const __m512 cv = _mm512_set1_ps(static_cast<float>(pb.scale) * kLog2e);
  float* m = scr.m[u.slot];
  float* l = scr.l[u.slot];
  float* alpha_row = scr.alpha[u.slot];
  for (int64_t r = t.nq; r < kBQ; ++r) {
    for (int64_t kk = 0; kk < kBK; kk += 32) _mm512_store_si512(p + r * kBK + kk, _mm512_setzero_si512());
  }
  // The stream's ops go out evenly over the unit's nq · n32 ticks (one per 32 keys of a row):
  // acc gains `total` a tick and pays `ticks` an op. (The stream is taken by value: its state stays
  // in registers across the tile instructions' memory clobbers.)
  const int64_t total = ts.total();
  const int64_t n16 = u.nkp / 16;  // at most kBK / 16 = 16 vectors a row, kept in registers
  const int64_t n32 = n16 / 2;
  const int64_t ticks = t.nq * n32;
  int64_t acc = 0;
  auto tick = [&](int64_t k) __attribute__((always_inline)) {
    for (acc += k * total; acc >= ticks; acc -= ticks) ts.op();
  };
  // Plain rows: nothing but the scale between the products and the softmax, every key of the
  // block visible and a positive scale (so max(c · s) = c · max(s)): the scores stay raw and the
  // scale joins the exponent's argument in one FMA.
  const bool plain_block = !t.mods && !pb.mods.masked() && pb.dropout_p == 0.0 && pb.scale > 0.0 && u.nk == u.nkp;
  bool rescale = false;
  for (int64_t r = 0; r < t.nq; ++r) {
    const float* sr = s + r * kBK;
    uint16_t* pr = p + r * kBK;
    const float m_old = m[r];
    float m_new, alpha;
    __m512 sum = _mm512_setzero_ps();
    const bool plain_row = plain_block && row_limit(t, r, u.j0, u.nk) == u.nk;
    if (plain_row) {
      __m512 x[kBK / 16];
      __m512 mxv = _mm512_set1_ps(kNegInf);
#pragma GCC unroll 16
      for (int64_t v = 0; v < kBK / 16; ++v) {
        if (v < n16) {
          x[v] = _mm512_load_ps(sr + 16 * v);
          mxv = _mm512_max_ps(mxv, x[v]);
        }
      }
      const float mx = _mm512_reduce_max_ps(mxv) * _mm512_cvtss_f32(cv);
      m_new = mx > m_old ? mx : m_old;
      const float m_safe = m_new == kNegInf ? 0.0f : m_new;
      alpha = m_new == m_old && m_old != kNegInf ? 1.0f : std::exp2(m_old - m_safe);
      const __m512 neg_m = _mm512_set1_ps(-m_safe);
#pragma GCC unroll 16
      for (int64_t w = 0; w < kBK / 32; ++w) {
        if (2 * w < n16) {
          const __m512 p0 = exp2_plain(_mm512_fmadd_ps(x[2 * w], cv, neg_m));
          const __m512 p1 = exp2_plain(_mm512_fmadd_ps(x[2 * w + 1], cv, neg_m));
          sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
          _mm512_store_si512(pr + 32 * w, to_bf16_2(p1, p0));
          tick(1);
        }
      }
    } else {
      const RowMask rm = row_mask(t, r, u.j0);
      const int64_t lim = row_limit(t, r, u.j0, u.nk);
      __m512 x[kBK / 16];
      __m512 mxv = _mm512_set1_ps(kNegInf);
#pragma GCC unroll 16
      for (int64_t v = 0; v < kBK / 16; ++v) {
        if (v < n16) {
          x[v] = score16(t, rm, _mm512_load_ps(sr + 16 * v), t.i0 + r, u.j0, v, lim, cv, scr.tmp);
          mxv = _mm512_max_ps(mxv, x[v]);  // a NaN lane may be skipped: it reaches l through 2^NaN
        }
      }
      const float mx = _mm512_reduce_max_ps(mxv);
      m_new = mx > m_old ? mx : m_old;
      const float m_safe = m_new == kNegInf ? 0.0f : m_new;  // nothing visible yet: P = 0
      // 2^0 = 1 exactly: exp2 only where the maximum moved (or nothing is visible yet)
      alpha = m_new == m_old && m_old != kNegInf ? 1.0f : std::exp2(m_old - m_safe);
      const __m512 ms = _mm512_set1_ps(m_safe);
#pragma GCC unroll 16
      for (int64_t w = 0; w < kBK / 32; ++w) {
        if (2 * w < n16) {
          __m512 p0 = exp2_nonpos(_mm512_sub_ps(x[2 * w], ms));
          __m512 p1 = exp2_nonpos(_mm512_sub_ps(x[2 * w + 1], ms));
          sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
          if (pb.dropout_p > 0.0) {
            // kept values as they are: 1 / (1 - p) joins 1 / l at the end (as the f32 tiles do)
            p0 = drop16(t, scr, t.i0 + r, u.j0 + 32 * w, p0, 1.0f);
            p1 = drop16(t, scr, t.i0 + r, u.j0 + 32 * w + 16, p1, 1.0f);
          }
          _mm512_store_si512(pr + 32 * w, to_bf16_2(p1, p0));
        }
      }
    }
    l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
    m[r] = m_new;
    alpha_row[r] = alpha;
    rescale = rescale || alpha != 1.0f;
    if (!plain_row) tick(n32);
  }
  ts.finish();
  return rescale;
}

// O = O · alpha, row by row (rows whose maximum did not move are left alone).
inline void rescale_o(const Task& t, const Scratch& scr, int slot) {
  for (int64_t r = 0; r < t.nq; ++r) {
    if (scr.alpha[slot][r] == 1.0f) continue;
    const __m512 a = _mm512_set1_ps(scr.alpha[slot][r]);
    float* orow = scr.o[slot] + r * t.lay.Dvp;
    for (int64_t d = 0; d < t.lay.Dvp; d += 16) _mm512_store_ps(orow + d, _mm512_mul_ps(_mm512_load_ps(orow + d), a));
  }
}

// The task's outputs once its last block is in O: O / l (O · (1 / (1 - p)) / l under dropout)
// rounded to bf16; lse = ln 2 · (m + log2 l); a row with l = 0 saw no key: zeros, lse = -inf (with
// a sink, l >= 1: O is zero where no block ran). Then the weights on request: w = 2^(score -
// log2-lse) over every key, dropped like P; rows that saw nothing get 0 (lse2 = +inf), NaN rows
// NaN. Uses the tiles (no job may be in flight) and the K cache.
inline void finish_task(const Task& t, const Scratch& scr, int slot) {
  const SdpaProblem& pb = t.pb;
  const float* m = scr.m[slot];
  const float* l = scr.l[slot];
  const bool any_block = t.jstart < t.jend;
  const float keep_scale = pb.dropout_p > 0.0 ? dropout_keep_scale(pb.dropout_p) : 1.0f;
  for (int64_t r = 0; r < t.nq; ++r) {
    const float lr = l[r];
    const __m512 inv = _mm512_set1_ps(lr != 0.0f ? keep_scale / lr : 0.0f);
    const bool zero = lr == 0.0f || !any_block;  // zeros even where a V entry is NaN (0 · NaN in P · V)
    const float* orow = scr.o[slot] + r * t.lay.Dvp;
    uint16_t* dst = t.out + r * t.os;
    for (int64_t d = 0; d < pb.Dv; d += 16) {
      const __m512 x = zero ? _mm512_setzero_ps() : _mm512_mul_ps(_mm512_load_ps(orow + d), inv);
      _mm256_mask_storeu_epi16(dst + d, first_mask16(pb.Dv - d), to_bf16(x));
    }
    t.lse[r] = lr != 0.0f ? (m[r] + std::log2(lr)) * kLn2 : kNegInf;
  }
  if (t.weights == nullptr) return;
  float* lse2 = scr.alpha[slot];
  for (int64_t r = 0; r < t.nq; ++r) lse2[r] = l[r] != 0.0f ? m[r] + std::log2(l[r]) : std::numeric_limits<float>::infinity();
  const __m512 cv = _mm512_set1_ps(static_cast<float>(pb.scale) * kLog2e);
  for (int64_t j0 = 0; j0 < pb.Lk; j0 += kBK) {
    const int64_t nk = std::min(pb.Lk - j0, kBK), nkp = (nk + 31) / 32 * 32;
    const int64_t nv = std::max<int64_t>(0, std::min(nk, t.jend - j0));  // keys any row may see
    if (nv > 0) {
      ensure_k(t, scr, j0 + (nv + 31) / 32 * 32);
      TileStream ts;
      add_scores(ts, t, scr, j0, (nv + 31) / 32 * 32, scr.sw);
      ts.finish();
    }
    for (int64_t r = 0; r < t.nq; ++r) {
      float* w = t.weights + r * pb.Lk + j0;
      const __m512 ls = _mm512_set1_ps(lse2[r]);
      const float hidden = std::isnan(lse2[r]) ? lse2[r] : 0.0f;
      const RowMask rm = row_mask(t, r, j0);
      const int64_t lim = row_limit(t, r, j0, nv);
      for (int64_t kk = 0; kk < nkp; kk += 16) {
        __m512 x = _mm512_set1_ps(hidden);
        if (kk < nv) {
          x = score16(t, rm, _mm512_load_ps(scr.sw + r * kBK + kk), t.i0 + r, j0, kk / 16, lim, cv, scr.tmp);
          x = exp2_nonpos(_mm512_sub_ps(x, ls));
          if (pb.dropout_p > 0.0) x = drop16(t, scr, t.i0 + r, j0 + kk, x, keep_scale);
        }
        _mm512_mask_storeu_ps(w + kk, first_mask16(nk - kk), x);
      }
    }
  }
}
