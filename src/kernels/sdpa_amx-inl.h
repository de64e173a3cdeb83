// sdpa_amx-inl.h — bf16 SDPA forward on AMX tiles (tdpbf16ps), for CPUs with AMX-BF16.
// Included by isa_amx.cc (through sdpa_paths-inl.h) inside namespace heads::kernels::amx, after the
// AVX-512 vector layer and sdpa_flash_fwd-inl.h (for the mask helpers and the f32 conventions).
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
//                                   B = K of the (b, kv head) packed once per call: 16 keys x 32 dims
//                                   a tile, dword (K[j][2p], K[j][2p+1]) at row p, column j.
//   P  [32][128] bf16 = 2^(c·S + mask - m)   AVX-512, row by row (keys on lanes); l and m in f32.
//   O  [32][Dvp] f32 = O·alpha + P · V      A = P, B = V packed once per call: 32 keys x 16 columns
//                                   a tile, dword (V[2p][n], V[2p+1][n]) at row p.
// O lives in memory (f32, per thread) between blocks: loaded into the accumulators, P·V added, stored
// back; rows whose max did not move (alpha = 1, most of them after the first blocks) are not rescaled.
// q and k are exact bf16 inputs; the scale is applied in f32 to S; P is rounded to bf16 for its
// product (as every bf16 attention kernel does), its row sum l is taken in f32 before rounding.
// Masks, causal limits, dropout, fully masked rows, non-finite values and the weights on request
// follow sdpa_flash_fwd-inl.h exactly (the weights from a second sweep of S after the final lse).
// Padding (keys past Lk, dims past D or Dv, query rows past Lq) is zero in the packed operands and
// never reaches an output: padded keys are -inf in S, padded rows and columns are not stored.
// Parallel: K and V are packed by all threads (one 32-key chunk per task), then the (b, h, query
// block) tasks run heaviest first under causal; one task per row block, so results do not depend
// on the thread count.
//
// GCC's tileloadd asm declares no memory input, so the loads below use their own asm with a memory
// clobber: the compiler may not move the vector stores that fill P (or O) past them.

namespace amx {

constexpr int64_t kBQ = 32;   // query rows per task: two row tiles
constexpr int64_t kBK = 128;  // keys per softmax block
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#define HEADS_TILE_LOAD(t, base, stride)                                                   \
  __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm" #t "|tileloadd\t%%tmm" #t ", [%0+%1*1]}" \
                   : : "r"(static_cast<const void*>(base)), "r"(static_cast<int64_t>(stride)) : "memory")
#define HEADS_TILE_STORE(t, base, stride) _tile_stored(t, base, static_cast<int64_t>(stride))
#define HEADS_TILE_ZERO(t) _tile_zero(t)
#define HEADS_TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)

// Palette 1, tiles 0-7 all 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// The four tdpbf16ps of a 32 x 32 block: C[rt][ct] += A[rt] · B[ct].
HEADS_INLINE void dp_2x2() {
  HEADS_TILE_DP(0, 4, 6);
  HEADS_TILE_DP(1, 4, 7);
  HEADS_TILE_DP(2, 5, 6);
  HEADS_TILE_DP(3, 5, 7);
}

HEADS_INLINE __mmask32 first_mask32(int64_t n) {
  return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint32_t{1} << n) - 1u);
}
HEADS_INLINE __mmask16 first_mask16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1u);
}

// Shapes of the packed operands of one call.
struct Layout {
  int64_t Dp, Dvp, Lkp;  // D and Dv rounded up to 32, Lk to 32
  int64_t n_dc, n_ct;    // 32-dim chunks of D; 16-column tiles of Dv (even)
  int64_t k_elems, v_elems;  // bf16 per (b, kv head)
  explicit Layout(const SdpaProblem& pb)
      : Dp((pb.D + 31) / 32 * 32), Dvp((pb.Dv + 31) / 32 * 32), Lkp((pb.Lk + 31) / 32 * 32),
        n_dc(Dp / 32), n_ct(Dvp / 16), k_elems(Lkp * Dp), v_elems(Lkp * Dvp) {}
};

// K tiles of keys [32 kc, 32 kc + 32) of one (b, hk): tile (kt, dc) at dst + (kt · n_dc + dc) · 512,
// row p = dims 32 dc + 2p, 2p + 1 of keys 16 kt .. 16 kt + 15 (16 dwords).
inline void pack_k_chunk(const uint16_t* kh, int64_t ks, const SdpaProblem& pb, const Layout& lay, int64_t kc,
                         uint16_t* dst) {
  alignas(64) uint32_t rows[16 * 16];
  for (int64_t kt = 2 * kc; kt < 2 * kc + 2; ++kt) {
    for (int64_t dc = 0; dc < lay.n_dc; ++dc) {
      const __mmask32 m = first_mask32(pb.D - 32 * dc);
      for (int64_t n = 0; n < 16; ++n) {
        const int64_t j = 16 * kt + n;
        const __m512i r = j < pb.Lk ? _mm512_maskz_loadu_epi16(m, kh + j * ks + 32 * dc) : _mm512_setzero_si512();
        _mm512_store_si512(rows + 16 * n, r);
      }
      Vec::transpose_bits(reinterpret_cast<const float*>(rows), 16,
                          reinterpret_cast<float*>(dst + (kt * lay.n_dc + dc) * 512), 16);
    }
  }
}

// V tiles of keys [32 kc, 32 kc + 32): tile (kc, ct) at dst + (kc · n_ct + ct) · 512, row p = the
// pairs (V[32 kc + 2p][16 ct + n], V[32 kc + 2p + 1][16 ct + n]) for n < 16.
inline void pack_v_chunk(const uint16_t* vh, int64_t vs, const SdpaProblem& pb, const Layout& lay, int64_t kc,
                         uint16_t* dst) {
  alignas(64) static constexpr uint16_t kPairLo[32] = {
      0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kPairHi[32] = {
      16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kPairLo), hi = _mm512_load_si512(kPairHi);
  for (int64_t cp = 0; cp < lay.n_ct / 2; ++cp) {
    const __mmask32 m = first_mask32(pb.Dv - 32 * cp);
    uint16_t* t0 = dst + (kc * lay.n_ct + 2 * cp) * 512;
    uint16_t* t1 = t0 + 512;
    for (int64_t p = 0; p < 16; ++p) {
      const int64_t j = 32 * kc + 2 * p;
      const __m512i a = j < pb.Lk ? _mm512_maskz_loadu_epi16(m, vh + j * vs + 32 * cp) : _mm512_setzero_si512();
      const __m512i b = j + 1 < pb.Lk ? _mm512_maskz_loadu_epi16(m, vh + (j + 1) * vs + 32 * cp)
                                      : _mm512_setzero_si512();
      _mm512_store_si512(t0 + 32 * p, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(t1 + 32 * p, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

struct Scratch {
  uint16_t* qp;  // [kBQ][Dp] bf16
  float* s;      // [kBQ][kBK]
  uint16_t* p;   // [kBQ][kBK] bf16
  float* o;      // [kBQ][Dvp]
  float* m;      // [kBQ] running max (log2 units)
  float* l;      // [kBQ] running sum
  float* alpha;  // [kBQ]
  float* tmp;    // [16]
  static int64_t floats(const Layout& lay) {
    auto up = [](int64_t n) { return (n + 15) / 16 * 16; };
    return up(kBQ * lay.Dp / 2) + kBQ * kBK + kBQ * kBK / 2 + kBQ * lay.Dvp + 3 * kBQ + 16;
  }
  Scratch(float* base, const Layout& lay) {
    auto up = [](int64_t n) { return (n + 15) / 16 * 16; };
    qp = reinterpret_cast<uint16_t*>(base);
    s = base + up(kBQ * lay.Dp / 2);
    p = reinterpret_cast<uint16_t*>(s + kBQ * kBK);
    o = s + kBQ * kBK + kBQ * kBK / 2;
    m = o + kBQ * lay.Dvp;
    l = m + kBQ;
    alpha = l + kBQ;
    tmp = alpha + kBQ;
  }
};

struct Task {
  const SdpaProblem& pb;
  const Layout& lay;
  int64_t b, h, i0, nq;
  const uint16_t* kp;  // packed K of (b, h's kv head)
  const uint16_t* vp;  // packed V
};

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

// Row r of S (keys j0 .. j0 + nkp): raw products -> scores in log2 units (times c = scale · log2 e),
// attn_mask applied (fwd::masked_score's rule), keys at or past `lim` (relative to j0: the row's causal
// limit or Lk) -inf. Returns the row's max (NaN lanes may be skipped: they reach l through 2^NaN).
inline float score_row(const Task& t, const Scratch& scr, int64_t r, int64_t j0, int64_t nkp, int64_t lim, float c) {
  const SdpaProblem& pb = t.pb;
  float* sr = scr.s + r * kBK;
  const __m512 cv = _mm512_set1_ps(c), ninf = _mm512_set1_ps(kNegInf);
  __m512 mx = ninf;
  const bool has_mask = pb.mask_kind != MaskKind::None;
  int64_t moff = 0, ms3 = 0;
  if (has_mask) {
    moff = pb.mask_offset(t.b, t.h, t.i0 + r) + j0 * pb.mask.stride(3);
    ms3 = pb.mask.stride(3);
  }
  for (int64_t v = 0; v < nkp / 16; ++v) {
    const __mmask16 valid = first_mask16(lim - 16 * v);
    __m512 x = _mm512_mul_ps(_mm512_load_ps(sr + 16 * v), cv);
    __mmask16 keep = valid;
    if (has_mask && valid != 0) {
      if (pb.mask_kind == MaskKind::Bool) {
        const auto* mb = static_cast<const uint8_t*>(pb.mask.raw_data()) + moff + 16 * v * ms3;
        if (ms3 == 1) {
          const __m128i bytes = _mm_maskz_loadu_epi8(valid, mb);
          keep = _mm_test_epi8_mask(bytes, bytes) & valid;
        } else {
          uint32_t bits = 0;
          for (int64_t e = 0; e < 16 && e < lim - 16 * v; ++e) bits |= (mb[e * ms3] != 0 ? 1u : 0u) << e;
          keep = static_cast<__mmask16>(bits);
        }
      } else {
        const float* mf = static_cast<const float*>(pb.mask.raw_data()) + moff + 16 * v * ms3;
        __m512 add;
        if (ms3 == 1) {
          add = _mm512_maskz_loadu_ps(valid, mf);
        } else {
          for (int64_t e = 0; e < 16; ++e) scr.tmp[e] = e < lim - 16 * v ? mf[e * ms3] : 0.0f;
          add = _mm512_load_ps(scr.tmp);
        }
        x = _mm512_fmadd_ps(add, _mm512_set1_ps(kLog2e), x);
      }
    }
    x = _mm512_mask_blend_ps(keep, ninf, x);
    _mm512_store_ps(sr + 16 * v, x);
    mx = _mm512_max_ps(mx, x);
  }
  return _mm512_reduce_max_ps(mx);
}

// Dropout of the 16 values at key j (row i): kept ones times 1 / (1 - p), the others 0.
HEADS_INLINE __m512 drop16(const Task& t, const Scratch& scr, int64_t i, int64_t j, __m512 p) {
  const SdpaProblem& pb = t.pb;
  const float keep_scale = dropout_keep_scale(pb.dropout_p);
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
    scr.m[r] = kNegInf;
    scr.l[r] = 0.0f;
  }
  std::fill(scr.o, scr.o + kBQ * lay.Dvp, 0.0f);
  const int64_t jend = pb.key_end(t.i0 + t.nq - 1);  // causal limit of the widest row

  for (int64_t j0 = 0; j0 < jend; j0 += kBK) {
    const int64_t nk = std::min(jend - j0, kBK), nkp = (nk + 31) / 32 * 32;
    scores_block(t, scr, j0, nkp);
    bool rescale = false;
    for (int64_t r = 0; r < t.nq; ++r) {
      const float mx = score_row(t, scr, r, j0, nkp, row_limit(t, r, j0, nk), c);
      const float m_old = scr.m[r];
      const float m_new = mx > m_old ? mx : m_old;
      const float m_safe = m_new == kNegInf ? 0.0f : m_new;  // nothing visible yet: P = 0
      const float alpha = std::exp2(m_old - m_safe);
      const __m512 ms = _mm512_set1_ps(m_safe);
      __m512 sum = _mm512_setzero_ps();
      const float* sr = scr.s + r * kBK;
      uint16_t* pr = scr.p + r * kBK;
      for (int64_t kk = 0; kk < nkp; kk += 32) {
        __m512 p0 = Vec::exp2(_mm512_sub_ps(_mm512_load_ps(sr + kk), ms));
        __m512 p1 = Vec::exp2(_mm512_sub_ps(_mm512_load_ps(sr + kk + 16), ms));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        if (pb.dropout_p > 0.0) {
          p0 = drop16(t, scr, t.i0 + r, j0 + kk, p0);
          p1 = drop16(t, scr, t.i0 + r, j0 + kk + 16, p1);
        }
        _mm512_store_si512(pr + kk, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
      }
      scr.l[r] = scr.l[r] * alpha + _mm512_reduce_add_ps(sum);
      scr.m[r] = m_new;
      scr.alpha[r] = alpha;
      rescale = rescale || alpha != 1.0f;
    }
    if (rescale) {
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
      HEADS_TILE_LOAD(0, o0, ost);
      HEADS_TILE_LOAD(1, o0 + 16, ost);
      HEADS_TILE_LOAD(2, o0 + 16 * lay.Dvp, ost);
      HEADS_TILE_LOAD(3, o0 + 16 * lay.Dvp + 16, ost);
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

  // O / l, rounded to bf16; lse = ln 2 · (m + log2 l); a row with l = 0 saw no key: zeros, lse = -inf.
  for (int64_t r = 0; r < t.nq; ++r) {
    const float lr = scr.l[r];
    const __m512 inv = _mm512_set1_ps(lr != 0.0f ? 1.0f / lr : 0.0f);
    const bool zero = lr == 0.0f;  // zeros even where a V entry is NaN (0 · NaN in P · V)
    const float* orow = scr.o + r * lay.Dvp;
    uint16_t* dst = out + r * os2;
    for (int64_t d = 0; d < pb.Dv; d += 16) {
      const __m512 x = zero ? _mm512_setzero_ps() : _mm512_mul_ps(_mm512_load_ps(orow + d), inv);
      _mm256_mask_storeu_epi16(dst + d, first_mask16(pb.Dv - d), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
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
    if (nv > 0) scores_block(t, scr, j0, (nv + 31) / 32 * 32);
    for (int64_t r = 0; r < t.nq; ++r) {
      float* w = weights + r * pb.Lk + j0;
      const float lse2 = scr.alpha[r];
      if (nv > 0) {
        score_row(t, scr, r, j0, (nv + 31) / 32 * 32, row_limit(t, r, j0, nv), c);
      }
      const __m512 ls = _mm512_set1_ps(lse2);
      const float hidden = std::isnan(lse2) ? lse2 : 0.0f;
      for (int64_t kk = 0; kk < nkp; kk += 16) {
        __m512 x = kk < nv ? Vec::exp2(_mm512_sub_ps(_mm512_load_ps(scr.s + r * kBK + kk), ls)) : _mm512_set1_ps(hidden);
        if (pb.dropout_p > 0.0 && kk < nv) x = drop16(t, scr, t.i0 + r, j0 + kk, x);
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
  const int64_t n_qb = (pb.Lq + kBQ - 1) / kBQ, n_kc = lay.Lkp / 32;
  const int64_t n_tasks = pb.B * pb.H * n_qb;
  const double flops = 2.0 * static_cast<double>(pb.B * pb.H * pb.Lq) * static_cast<double>(pb.Lk) *
                       static_cast<double>(pb.D + pb.Dv);
  const int n_threads = threads_for(pb.causal ? flops / 2 : flops, n_tasks);
  // Packed K and V for every (b, kv head), then each thread's slice; all 64-byte aligned.
  const int64_t kv_floats = pb.B * pb.Hkv * (lay.k_elems + lay.v_elems) / 2;
  const int64_t per = (Scratch::floats(lay) + 15) / 16 * 16;
  float* arena = thread_scratch(kv_floats + per * n_threads);
  auto* packed = reinterpret_cast<uint16_t*>(arena);
  auto k_of = [&](int64_t b, int64_t hk) { return packed + (b * pb.Hkv + hk) * (lay.k_elems + lay.v_elems); };

#pragma omp parallel num_threads(n_threads)
  {
    const Scratch scr(arena + kv_floats + per * omp_get_thread_num(), lay);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < pb.B * pb.Hkv * n_kc; ++task) {
      const int64_t bk = task / n_kc, kc = task % n_kc, b = bk / pb.Hkv, hk = bk % pb.Hkv;
      uint16_t* kdst = k_of(b, hk);
      pack_k_chunk(kb + b * k.stride(0) + hk * k.stride(1), k.stride(2), pb, lay, kc, kdst);
      pack_v_chunk(vb + b * v.stride(0) + hk * v.stride(1), v.stride(2), pb, lay, kc, kdst + lay.k_elems);
    }
    configure_tiles();
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n_tasks; ++task) {
      const int64_t bh = task / n_qb, b = bh / pb.H, h = bh % pb.H;
      const int64_t qb = pb.causal ? n_qb - 1 - task % n_qb : task % n_qb;
      const int64_t i0 = qb * kBQ, hk = h / pb.group();
      const Task t{pb, lay, b, h, i0, std::min(pb.Lq - i0, kBQ), k_of(b, hk), k_of(b, hk) + lay.k_elems};
      run_task(t, scr, qp + b * q.stride(0) + h * q.stride(1) + i0 * q.stride(2), q.stride(2),
               op + b * out.stride(0) + h * out.stride(1) + i0 * out.stride(2), out.stride(2),
               lp + (b * pb.H + h) * pb.Lq + i0, wp ? wp + ((b * pb.H + h) * pb.Lq + i0) * pb.Lk : nullptr);
    }
    _tile_release();
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
  _tile_release();
  return c[0];
}
inline int tile_probe_flops_per_iter() { return 4 * 16 * 16 * 32 * 2; }

#undef HEADS_TILE_LOAD
#undef HEADS_TILE_STORE
#undef HEADS_TILE_ZERO
#undef HEADS_TILE_DP

}  // namespace amx
