// sdpa_amx-inl.h — bf16 SDPA forward on AMX tiles (tdpbf16ps), for CPUs with AMX-BF16.
// Included by isa_amx.cc (through sdpa_paths-inl.h) inside namespace heads::kernels::amx (its code
// in a nested namespace amx), after the AVX-512 vector layer and sdpa_flash_fwd-inl.h (for the mask
// helpers and the f32 conventions).
//
// Tiles: eight registers of up to 16 rows x 64 bytes; tdpbf16ps C[16][16] f32 += A[16][32 bf16] ·
// B[16 pairs][16 x 2 bf16], B in "VNNI" layout: row p of B holds, for each of 16 columns n, the two
// bf16 B(2p, n), B(2p + 1, n) of the reduction's steps 2p, 2p + 1. Every tile here is 16 x 64 bytes
// (one configuration); tiles 0-3 accumulate a 32 x 32 block C[rt][ct] (tile 2·rt + ct), 4-5 hold A
// (row tiles 0 and 1), 6-7 hold B (column tiles 0 and 1).
//
// One task = one (b, h) and kBQ = 32 query rows; keys in blocks of kBK = 128, online softmax per
// block (FlashAttention-2 order, as sdpa_flash_fwd-inl.h):
//   S  [32][128] f32 = Q · Kᵀ      A = Q rows (packed [32][Dp] bf16, zero past Lq and D),
//                                   B = K of the (b, kv head) packed by the thread: 16 keys x 32 dims
//                                   a tile, dword (K[j][2p], K[j][2p+1]) at row p, column j.
//   P  [32][128] bf16 = 2^(c·S + mask - m)   AVX-512, row by row (keys on lanes, a row's 128 scores
//                                   in registers); l and m in f32.
//   O  [32][Dvp] f32 = O·alpha + P · V      A = P, B = V packed by the thread: 32 keys x 16 columns
//                                   a tile, dword (V[2p][n], V[2p+1][n]) at row p.
// O lives in memory (f32, per thread) between blocks: loaded into the accumulators, P·V added, stored
// back; rows whose max did not move (alpha = 1, most of them after the first blocks) are not rescaled.
// q and k are exact bf16 inputs; the scale is applied in f32 to S; P is rounded to bf16 for its
// product (as every bf16 attention kernel does), its row sum l is taken in f32 before rounding.
// Masks, causal limits, the score modifiers (left windows, softcap, ALiBi / T5 biases, sinks, block
// layouts), dropout, fully masked rows, non-finite values and the weights on request follow
// sdpa_flash_fwd-inl.h exactly (the weights from a second sweep of S after the final lse).
// Padding (keys past Lk, dims past D or Dv, query rows past Lq) is zero in the packed operands and
// never reaches an output: padded keys are -inf in S, padded rows and columns are not stored.
// Parallel: (b, h, query block) tasks, heaviest first under causal, handed out in runs of one head,
// so that a thread packs the K and V it reads (into its own cache, as far as its tasks reach, once
// per head): no packing pass, no barrier, no packed data crossing cores. One task per row block, so
// results do not depend on the thread count.
//
// Files: the tile instructions (or the emulator's), the tile configuration, the tdpbf16ps block and
// the packing of K and V are sdpa_amx_tiles-inl.h, included below; the backward's products on
// tiles are sdpa_amx_bwd-inl.h.

namespace amx {

constexpr int64_t kBQ = 32;   // query rows per task: two row tiles
constexpr int64_t kBK = 128;  // keys per softmax block
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#include "kernels/sdpa_amx_tiles-inl.h"

struct Scratch {
  uint16_t* qp;  // [kBQ][Dp] bf16
  float* s;      // [kBQ][kBK]
  uint16_t* p;   // [kBQ][kBK] bf16
  float* o;      // [kBQ][Dvp]
  float* m;      // [kBQ] running max (log2 units)
  float* l;      // [kBQ] running sum
  float* alpha;  // [kBQ]
  float* tmp;    // [16]
  uint16_t* kv;  // the thread's packed K [Lkp][Dp] and V [Lkp][Dvp] of one (b, kv head), as tiles
  int64_t* kv_state;  // {b, kv head, keys packed so far (a multiple of 32)}, owned by the thread
  static int64_t floats(const Layout& lay) {
    auto up = [](int64_t n) { return (n + 15) / 16 * 16; };
    return up(kBQ * lay.Dp / 2) + kBQ * kBK + kBQ * kBK / 2 + kBQ * lay.Dvp + 3 * kBQ + 16 +
           (lay.k_elems + lay.v_elems) / 2;
  }
  Scratch(float* base, const Layout& lay, int64_t* state) : kv_state(state) {
    auto up = [](int64_t n) { return (n + 15) / 16 * 16; };
    qp = reinterpret_cast<uint16_t*>(base);
    s = base + up(kBQ * lay.Dp / 2);
    p = reinterpret_cast<uint16_t*>(s + kBQ * kBK);
    o = s + kBQ * kBK + kBQ * kBK / 2;
    m = o + kBQ * lay.Dvp;
    l = m + kBQ;
    alpha = l + kBQ;
    tmp = alpha + kBQ;
    kv = reinterpret_cast<uint16_t*>(tmp + 16);
  }
};

struct Task {
  const SdpaProblem& pb;
  const Layout& lay;
  int64_t b, h, hk, i0, nq;
  bool mods;  // a left window or a score modifier (modify16; an attn_mask alone needs none of it)
  const uint16_t* kh;  // K of (b, hk) as given, row stride ks
  int64_t ks;
  const uint16_t* vh;  // V of (b, hk), row stride vs
  int64_t vs;
  const uint16_t* kp;  // packed K of (b, hk): the thread's cache
  const uint16_t* vp;  // packed V
};

// Packs keys [0, jmax) of the task's (b, kv head) into the thread's cache, unless it holds them:
// tasks of one head run back to back on a thread, so each thread packs what it reads, once.
inline void ensure_packed(const Task& t, const Scratch& scr, int64_t jmax) {
  int64_t* st = scr.kv_state;
  if (st[0] != t.b || st[1] != t.hk) {
    st[0] = t.b;
    st[1] = t.hk;
    st[2] = 0;
  }
  for (; st[2] < jmax; st[2] += 32) {
    pack_k_chunk(t.kh, t.ks, t.pb, t.lay, st[2] / 32, scr.kv);
    pack_v_chunk(t.vh, t.vs, t.pb, t.lay, st[2] / 32, scr.kv + t.lay.k_elems);
  }
}

// S[0:32][0:nkp] = Q · K[j0 : j0 + nkp]ᵀ (raw products, f32), nkp a multiple of 32, j0 of 16.
inline void scores_block(const Task& t, const Scratch& scr, int64_t j0, int64_t nkp) {
  const int64_t Dp = t.lay.Dp, n_dc = t.lay.n_dc;
  for (int64_t kk = 0; kk < nkp; kk += 32) {
    HEADS_TILE_ZERO(0);
    HEADS_TILE_ZERO(1);
    HEADS_TILE_ZERO(2);
    HEADS_TILE_ZERO(3);
    const uint16_t* k0 = t.kp + ((j0 + kk) / 16) * n_dc * 512;
    const uint16_t* k1 = k0 + n_dc * 512;
    for (int64_t dc = 0; dc < n_dc; ++dc) {
      HEADS_TILE_LOAD(4, scr.qp + 32 * dc, Dp * 2);
      HEADS_TILE_LOAD(5, scr.qp + 16 * Dp + 32 * dc, Dp * 2);
      HEADS_TILE_LOAD(6, k0 + dc * 512, 64);
      HEADS_TILE_LOAD(7, k1 + dc * 512, 64);
      dp_2x2();
    }
    HEADS_TILE_STORE(0, scr.s + kk, kBK * 4);
    HEADS_TILE_STORE(1, scr.s + kk + 16, kBK * 4);
    HEADS_TILE_STORE(2, scr.s + 16 * kBK + kk, kBK * 4);
    HEADS_TILE_STORE(3, scr.s + 16 * kBK + kk + 16, kBK * 4);
  }
}

// Where row r's attn_mask entries for keys j0, j0 + 1, ... start, and their stride.
struct RowMask {
  const void* at = nullptr;
  int64_t stride = 0;
};
HEADS_INLINE RowMask row_mask(const Task& t, int64_t r, int64_t j0) {
  const SdpaProblem& pb = t.pb;
  if (!pb.mods.masked()) return {};
  const int64_t off = pb.mods.mask_offset(t.b, t.h, t.i0 + r) + j0 * pb.mods.mask.stride(3);
  const size_t bytes = pb.mods.mask_kind == MaskKind::Bool ? 1 : 4;
  return {static_cast<const char*>(pb.mods.mask.raw_data()) + off * bytes, pb.mods.mask.stride(3)};
}

// The score modifiers of query i on keys j .. j + 15 (the first n of them real), in log2 units, in
// score_mods.h's order (the vector form of ScoreMods::apply with keys across the lanes;
// fwd::apply_masks is the one with queries across them): softcap, then the ALiBi / T5 bias added;
// keys left of the row's window or outside the block layout leave `keep`. score16 then applies the
// attn_mask.
HEADS_INLINE __m512 modify16(const Task& t, __m512 x, int64_t i, int64_t j, int64_t n, __mmask16& keep) {
  const SdpaProblem& pb = t.pb;
  if (pb.mods.capped()) x = fwd::softcap_v(x, _mm512_set1_ps(pb.mods.cap2), _mm512_set1_ps(1.0f / pb.mods.cap2));
  if (pb.mods.biased()) {  // key j + e at rel[i - j - e + Lk - 1]: 16 floats read backwards
    const float* top = pb.mods.rel_row(t.h) + (i - j + pb.Lk - 1);
    const auto high = static_cast<__mmask16>(~first_mask16(16 - n));  // lane 15 - e for e < n
    const __m512 back = _mm512_maskz_loadu_ps(high, top - 15);
    const __m512i reverse = _mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    x = _mm512_add_ps(x, _mm512_permutexvar_ps(reverse, back));
  }
  if (pb.has_left && j < i + pb.left_offset) keep &= static_cast<__mmask16>(~first_mask16(i + pb.left_offset - j));
  if (pb.mods.blocked()) {
    uint32_t bits = 0;
    for (int64_t e = 0; e < n; ++e) bits |= (pb.mods.pair_visible(t.h, i, j + e) ? 1u : 0u) << e;
    keep &= static_cast<__mmask16>(bits);
  }
  return x;
}

// Scores of keys j0 + 16v .. j0 + 16v + 15 of query i (row r of the task): raw products `raw` -> log2
// units (times c = scale · log2 e), the score modifiers (modify16), attn_mask applied
// (ScoreMods::apply's rule: a bool mask's false is -inf whatever the score, a float mask is added),
// keys at or past `lim` (the row's causal limit or Lk, relative to the block) -inf.
HEADS_INLINE __m512 score16(const Task& t, const RowMask& rm, __m512 raw, int64_t i, int64_t j0, int64_t v,
                            int64_t lim, __m512 cv, float* tmp) {
  const SdpaProblem& pb = t.pb;
  const __mmask16 valid = first_mask16(lim - 16 * v);
  __m512 x = _mm512_mul_ps(raw, cv);
  __mmask16 keep = valid;
  if (t.mods && valid != 0) x = modify16(t, x, i, j0 + 16 * v, std::min<int64_t>(16, lim - 16 * v), keep);
  if (rm.at != nullptr && valid != 0) {
    const int64_t ms = rm.stride, n = lim - 16 * v;
    if (pb.mods.mask_kind == MaskKind::Bool) {
      const auto* mb = static_cast<const uint8_t*>(rm.at) + 16 * v * ms;
      if (ms == 1) {
        const __m128i bytes = _mm_maskz_loadu_epi8(valid, mb);
        keep &= _mm_test_epi8_mask(bytes, bytes);
      } else {
        uint32_t bits = 0;
        for (int64_t e = 0; e < 16 && e < n; ++e) bits |= (mb[e * ms] != 0 ? 1u : 0u) << e;
        keep &= static_cast<__mmask16>(bits);
      }
    } else {
      const float* mf = static_cast<const float*>(rm.at) + 16 * v * ms;
      __m512 add;
      if (ms == 1) {
        add = _mm512_maskz_loadu_ps(valid, mf);
      } else {
        for (int64_t e = 0; e < 16; ++e) tmp[e] = e < n ? mf[e * ms] : 0.0f;
        add = _mm512_load_ps(tmp);
      }
      x = _mm512_add_ps(x, _mm512_mul_ps(add, _mm512_set1_ps(kLog2e)));  // ScoreMods::mask_term's rounding
    }
  }
  return _mm512_mask_blend_ps(keep, _mm512_set1_ps(kNegInf), x);
}

// Dropout of the 16 values at key j (row i): kept ones times keep_scale, the others 0.
HEADS_INLINE __m512 drop16(const Task& t, const Scratch& scr, int64_t i, int64_t j, __m512 p, float keep_scale) {
  const SdpaProblem& pb = t.pb;
  _mm512_store_ps(scr.tmp, p);
  for (int64_t e = 0; e < 16; ++e) {
    const bool keep = j + e < pb.Lk && dropout_keep(pb.seed, dropout_index(pb, t.b, t.h, i, j + e), pb.dropout_p);
    scr.tmp[e] = keep ? scr.tmp[e] * keep_scale : 0.0f;
  }
  return _mm512_load_ps(scr.tmp);
}

// The row's causal (and Lk) limit relative to j0, clamped to [0, nk].
HEADS_INLINE int64_t row_limit(const Task& t, int64_t r, int64_t j0, int64_t nk) {
  return std::clamp<int64_t>(t.pb.key_end(t.i0 + r) - j0, 0, nk);
}

inline void run_task(const Task& t, const Scratch& scr, const uint16_t* q, int64_t qs2, uint16_t* out,
                     int64_t os2, float* lse, float* weights) {
  const SdpaProblem& pb = t.pb;
  const Layout& lay = t.lay;
  const float c = static_cast<float>(pb.scale) * kLog2e;
  const __m512 cv = _mm512_set1_ps(c);
  // Q rows (zero past nq and D); P rows past nq stay zero for the whole task.
  for (int64_t r = 0; r < kBQ; ++r) {
    for (int64_t dc = 0; dc < lay.n_dc; ++dc) {
      const __m512i x = r < t.nq ? _mm512_maskz_loadu_epi16(first_mask32(pb.D - 32 * dc), q + r * qs2 + 32 * dc)
                                 : _mm512_setzero_si512();
      _mm512_store_si512(scr.qp + r * lay.Dp + 32 * dc, x);
    }
    if (r >= t.nq) {
      for (int64_t kk = 0; kk < kBK; kk += 32) _mm512_store_si512(scr.p + r * kBK + kk, _mm512_setzero_si512());
    }
    // a sink starts the row's softmax as a key of logit sink with no value (m = sink, l = 1)
    scr.m[r] = pb.sink_log2(t.h);
    scr.l[r] = pb.sinks.defined() ? 1.0f : 0.0f;
  }
  const int64_t jend = pb.key_end(t.i0 + t.nq - 1);  // causal limit of the widest row
  // Blocks left of the first row's window are skipped (the band's limits only grow with i).
  const int64_t jstart = pb.key_begin(t.i0) / kBK * kBK;

  for (int64_t j0 = jstart; j0 < jend; j0 += kBK) {
    const int64_t nk = std::min(jend - j0, kBK), nkp = (nk + 31) / 32 * 32;
    ensure_packed(t, scr, j0 + nkp);
    scores_block(t, scr, j0, nkp);
    bool rescale = false;
    const int64_t n16 = nkp / 16;  // at most kBK / 16 = 8 vectors a row, kept in registers
    for (int64_t r = 0; r < t.nq; ++r) {
      const RowMask rm = row_mask(t, r, j0);
      const int64_t lim = row_limit(t, r, j0, nk);
      const float* sr = scr.s + r * kBK;
      __m512 x[kBK / 16];
      __m512 mxv = _mm512_set1_ps(kNegInf);
#pragma GCC unroll 8
      for (int64_t v = 0; v < kBK / 16; ++v) {
        if (v < n16) {
          x[v] = score16(t, rm, _mm512_load_ps(sr + 16 * v), t.i0 + r, j0, v, lim, cv, scr.tmp);
          mxv = _mm512_max_ps(mxv, x[v]);  // a NaN lane may be skipped: it reaches l through 2^NaN
        }
      }
      const float mx = _mm512_reduce_max_ps(mxv);
      const float m_old = scr.m[r];
      const float m_new = mx > m_old ? mx : m_old;
      const float m_safe = m_new == kNegInf ? 0.0f : m_new;  // nothing visible yet: P = 0
      const float alpha = std::exp2(m_old - m_safe);
      const __m512 ms = _mm512_set1_ps(m_safe);
      __m512 sum = _mm512_setzero_ps();
      uint16_t* pr = scr.p + r * kBK;
#pragma GCC unroll 4
      for (int64_t w = 0; w < kBK / 32; ++w) {
        if (2 * w < n16) {
          __m512 p0 = exp2_nonpos(_mm512_sub_ps(x[2 * w], ms));
          __m512 p1 = exp2_nonpos(_mm512_sub_ps(x[2 * w + 1], ms));
          sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
          if (pb.dropout_p > 0.0) {
            // kept values as they are: 1 / (1 - p) joins 1 / l at the end (as the f32 tiles do)
            p0 = drop16(t, scr, t.i0 + r, j0 + 32 * w, p0, 1.0f);
            p1 = drop16(t, scr, t.i0 + r, j0 + 32 * w + 16, p1, 1.0f);
          }
          _mm512_store_si512(pr + 32 * w, to_bf16_2(p1, p0));
        }
      }
      scr.l[r] = scr.l[r] * alpha + _mm512_reduce_add_ps(sum);
      scr.m[r] = m_new;
      scr.alpha[r] = alpha;
      rescale = rescale || alpha != 1.0f;
    }
    // O = O · alpha (O is zero before the first block: its accumulators start from tilezero)
    const bool first = j0 == jstart;
    if (rescale && !first) {
      for (int64_t r = 0; r < t.nq; ++r) {
        if (scr.alpha[r] == 1.0f) continue;
        const __m512 a = _mm512_set1_ps(scr.alpha[r]);
        float* orow = scr.o + r * lay.Dvp;
        for (int64_t d = 0; d < lay.Dvp; d += 16) _mm512_store_ps(orow + d, _mm512_mul_ps(_mm512_load_ps(orow + d), a));
      }
    }
    // O += P · V[j0 : j0 + nkp]
    const int64_t ost = lay.Dvp * 4;
    for (int64_t cp = 0; cp < lay.n_ct / 2; ++cp) {
      float* o0 = scr.o + 32 * cp;
      if (first) {
        HEADS_TILE_ZERO(0);
        HEADS_TILE_ZERO(1);
        HEADS_TILE_ZERO(2);
        HEADS_TILE_ZERO(3);
      } else {
        HEADS_TILE_LOAD(0, o0, ost);
        HEADS_TILE_LOAD(1, o0 + 16, ost);
        HEADS_TILE_LOAD(2, o0 + 16 * lay.Dvp, ost);
        HEADS_TILE_LOAD(3, o0 + 16 * lay.Dvp + 16, ost);
      }
      for (int64_t kk = 0; kk < nkp; kk += 32) {
        const uint16_t* vt = t.vp + (((j0 + kk) / 32) * lay.n_ct + 2 * cp) * 512;
        HEADS_TILE_LOAD(4, scr.p + kk, kBK * 2);
        HEADS_TILE_LOAD(5, scr.p + 16 * kBK + kk, kBK * 2);
        HEADS_TILE_LOAD(6, vt, 64);
        HEADS_TILE_LOAD(7, vt + 512, 64);
        dp_2x2();
      }
      HEADS_TILE_STORE(0, o0, ost);
      HEADS_TILE_STORE(1, o0 + 16, ost);
      HEADS_TILE_STORE(2, o0 + 16 * lay.Dvp, ost);
      HEADS_TILE_STORE(3, o0 + 16 * lay.Dvp + 16, ost);
    }
  }

  // O / l (O · (1 / (1 - p)) / l under dropout), rounded to bf16; lse = ln 2 · (m + log2 l); a row
  // with l = 0 saw no key: zeros, lse = -inf (with a sink, l >= 1: O is zero where no block ran).
  const bool any_block = jstart < jend;
  const float keep_scale = pb.dropout_p > 0.0 ? dropout_keep_scale(pb.dropout_p) : 1.0f;
  for (int64_t r = 0; r < t.nq; ++r) {
    const float lr = scr.l[r];
    const __m512 inv = _mm512_set1_ps(lr != 0.0f ? keep_scale / lr : 0.0f);
    const bool zero = lr == 0.0f || !any_block;  // zeros even where a V entry is NaN (0 · NaN in P · V)
    const float* orow = scr.o + r * lay.Dvp;
    uint16_t* dst = out + r * os2;
    for (int64_t d = 0; d < pb.Dv; d += 16) {
      const __m512 x = zero ? _mm512_setzero_ps() : _mm512_mul_ps(_mm512_load_ps(orow + d), inv);
      _mm256_mask_storeu_epi16(dst + d, first_mask16(pb.Dv - d), to_bf16(x));
    }
    lse[r] = lr != 0.0f ? (scr.m[r] + std::log2(lr)) * kLn2 : kNegInf;
  }

  // Weights on request: w = 2^(score - log2-lse) over every key, dropped like P; rows that saw
  // nothing get 0 (lse2 = +inf), NaN rows NaN.
  if (weights == nullptr) return;
  for (int64_t r = 0; r < t.nq; ++r) {
    const float lr = scr.l[r];
    scr.alpha[r] = lr != 0.0f ? scr.m[r] + std::log2(lr) : std::numeric_limits<float>::infinity();
  }
  for (int64_t j0 = 0; j0 < pb.Lk; j0 += kBK) {
    const int64_t nk = std::min(pb.Lk - j0, kBK), nkp = (nk + 31) / 32 * 32;
    const int64_t nv = std::max<int64_t>(0, std::min(nk, jend - j0));  // keys any row may see
    if (nv > 0) {
      ensure_packed(t, scr, j0 + (nv + 31) / 32 * 32);
      scores_block(t, scr, j0, (nv + 31) / 32 * 32);
    }
    for (int64_t r = 0; r < t.nq; ++r) {
      float* w = weights + r * pb.Lk + j0;
      const __m512 ls = _mm512_set1_ps(scr.alpha[r]);
      const float hidden = std::isnan(scr.alpha[r]) ? scr.alpha[r] : 0.0f;
      const RowMask rm = row_mask(t, r, j0);
      const int64_t lim = row_limit(t, r, j0, nv);
      for (int64_t kk = 0; kk < nkp; kk += 16) {
        __m512 x = _mm512_set1_ps(hidden);
        if (kk < nv) {
          x = score16(t, rm, _mm512_load_ps(scr.s + r * kBK + kk), t.i0 + r, j0, kk / 16, lim, cv, scr.tmp);
          x = exp2_nonpos(_mm512_sub_ps(x, ls));
          if (pb.dropout_p > 0.0) x = drop16(t, scr, t.i0 + r, j0 + kk, x, dropout_keep_scale(pb.dropout_p));
        }
        _mm512_mask_storeu_ps(w + kk, first_mask16(nk - kk), x);
      }
    }
  }
}

inline void sdpa_fwd(const SdpaProblem& pb, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                     const Tensor& lse, const Tensor& weights) {
  if (pb.B == 0 || pb.H == 0 || pb.Lq == 0 || pb.Lk == 0) return;
  const Layout lay(pb);
  const auto* qp = static_cast<const uint16_t*>(q.raw_data());
  const auto* kb = static_cast<const uint16_t*>(k.raw_data());
  const auto* vb = static_cast<const uint16_t*>(v.raw_data());
  auto* op = static_cast<uint16_t*>(out.raw_data());
  float* lp = lse.data<float>();
  float* wp = weights.defined() ? weights.data<float>() : nullptr;
  const int64_t n_qb = (pb.Lq + kBQ - 1) / kBQ;
  const int64_t n_tasks = pb.B * pb.H * n_qb;
  const double flops = 2.0 * static_cast<double>(pb.B * pb.H * pb.Lq) * static_cast<double>(pb.Lk) *
                       static_cast<double>(pb.D + pb.Dv);
  const int n_threads = threads_for(pb.causal ? flops / 2 : flops, n_tasks);
  // Runs of consecutive tasks share a (b, kv head) and so the thread's packed K and V; about four
  // runs per thread balance the load (causal tasks differ in size).
  const int64_t run = std::max<int64_t>(1, std::min(n_qb, n_tasks / (4 * n_threads)));
  const int64_t per = (Scratch::floats(lay) + 15) / 16 * 16;
  float* arena = thread_scratch(per * n_threads);
  std::vector<int64_t> kv_state(static_cast<size_t>(16 * n_threads), -1);  // a cache line per thread

#pragma omp parallel num_threads(n_threads)
  {
    const int tid = omp_get_thread_num();
    const Scratch scr(arena + per * tid, lay, kv_state.data() + 16 * tid);
    configure_tiles();
#pragma omp for schedule(dynamic, run)
    for (int64_t task = 0; task < n_tasks; ++task) {
      const int64_t bh = task / n_qb, b = bh / pb.H, h = bh % pb.H;
      if (!pb.head_on(b, h)) continue;  // a head turned off: cleared by the caller
      const int64_t qb = pb.causal ? n_qb - 1 - task % n_qb : task % n_qb;  // heaviest first
      const int64_t i0 = qb * kBQ, hk = h / pb.group();
      const Task t{pb, lay, b, h, hk, i0, std::min(pb.Lq - i0, kBQ),
                   pb.has_left || pb.mods.any(),
                   kb + b * k.stride(0) + hk * k.stride(1), k.stride(2),
                   vb + b * v.stride(0) + hk * v.stride(1), v.stride(2), scr.kv, scr.kv + lay.k_elems};
      run_task(t, scr, qp + b * q.stride(0) + h * q.stride(1) + i0 * q.stride(2), q.stride(2),
               op + b * out.stride(0) + h * out.stride(1) + i0 * out.stride(2), out.stride(2),
               lp + (b * pb.H + h) * pb.Lq + i0, wp ? wp + ((b * pb.H + h) * pb.Lq + i0) * pb.Lk : nullptr);
    }
    HEADS_TILE_RELEASE();
  }
}

// AMX throughput probe, as fma_probe (peak-inl.h): four independent accumulators, one 32 x 32 x 32
// block of tdpbf16ps per iteration; flops per iteration = 4 · 16 · 16 · 32 · 2.
inline float tile_probe(int64_t iters) {
  alignas(64) uint16_t ab[16 * 32];
  alignas(64) float c[16 * 16];
  for (int i = 0; i < 16 * 32; ++i) ab[i] = 0x3f80;  // 1.0
  configure_tiles();
  HEADS_TILE_ZERO(0);
  HEADS_TILE_ZERO(1);
  HEADS_TILE_ZERO(2);
  HEADS_TILE_ZERO(3);
  HEADS_TILE_LOAD(4, ab, 64);
  HEADS_TILE_LOAD(5, ab, 64);
  HEADS_TILE_LOAD(6, ab, 64);
  HEADS_TILE_LOAD(7, ab, 64);
  for (int64_t i = 0; i < iters; ++i) dp_2x2();
  HEADS_TILE_STORE(0, c, 64);
  HEADS_TILE_RELEASE();
  return c[0];
}
inline int tile_probe_flops_per_iter() { return 4 * 16 * 16 * 32 * 2; }

}  // namespace amx
