// sdpa_amx_bwd-inl.h — the bf16 backward's five products on AMX tiles (tdpbf16ps, f32 accumulation):
//   S^T  = K_j · Q_i^T        dP^T = V_j · dO_i^T       (the forward's scores again, and dP)
//   dV_j += Pd^T · dO_i       dK_j += scale · dS^T · Q_i     dQ_i += scale · dS · K_j
// (the last three with P, Pd and dS as two bf16 terms each: below)
// Included by sdpa_bwd-inl.h inside its namespace bwd in the AMX builds (isa_amx.cc, and over the
// tile emulator isa_amx_emu.cc), after Call, Step and Scratch; the tile instructions, the tile
// configuration and the 32 x 32 block dp_2x2 are sdpa_amx_tiles-inl.h's (namespace amx).
//
// Everything between the products is the AVX-512 backward's, unchanged (sdpa_bwd_step-inl.h): the
// tiles write S^T and dP^T where its kernels would ([keys][queries on lanes], s and dp of the step),
// the masks, exp2, dropout and dS = P ∘ (dP - D) run on them, and the three products then read P
// (or Pd) and dS as two bf16 terms each, x = hi + lo with hi = bf16(x) and lo = bf16(x - hi) (16
// bits of x, a relative 2^-17): rounding them once to bf16, as PyTorch's bf16 flash backward does
// for its GEMMs, made dq's error equal to PyTorch bf16's and past it with a mask, where the f32
// path's is 0.8x; the second term costs three more tile products (8 in all, not 5), which on
// tiles (16x the f32 FMA rate) still leaves the f32 path far behind. Gradients accumulate in f32 (a
// step's whole product in the tiles, then added to dK, dV, dQ in f32) and are rounded once, as on
// the other paths.
//
// Operands: A (rows x reduction) is bf16 rows of a multiple of 32 values; B is 16 x 16-dword tiles
// in VNNI layout (row p: the pairs (B[2p][n], B[2p+1][n]) of 16 columns n), tile (kc, ct) of
// reduction chunk kc and column tile ct at b + kc·bkc + ct·bct. Per key group the thread packs K
// and V as A rows (for S^T, dP^T) and K as B pairs (for dQ); per query step Q and dO as B columns
// (for S^T, dP^T) and as B pairs (for dK, dV). Padding (rows past a group or step, dims past D or
// Dv, queries past the step) is zero in every packed operand, and the P and dS operands are zero
// past the step's queries and the block's keys, so no padded value (however large) reaches a
// gradient. Steps of at most kSmallQ queries keep the AVX-512 path (few_block).

namespace tiles {

using amx::dp_2x2;
using amx::to_bf16;
using amx::to_bf16_2;

constexpr int64_t kTileElems = 512;  // bf16 in one 16 x 64-byte tile

HEADS_INLINE int64_t up32(int64_t n) { return (n + 31) / 32 * 32; }
HEADS_INLINE __mmask32 lanes32(int64_t n) {  // the first n of 32 bf16 lanes (n may be <= 0 or >= 32)
  return n >= 32 ? ~__mmask32{0} : n <= 0 ? 0 : static_cast<__mmask32>((uint32_t{1} << n) - 1u);
}
HEADS_INLINE __mmask16 lanes16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1u);
}

// A rows: dst[r][0 : wp) = src row r's first w values, zero past them and for rows n <= r < n_pad.
inline void pack_rows(const uint16_t* src, int64_t ss, int64_t n, int64_t w, int64_t n_pad, uint16_t* dst) {
  const int64_t wp = up32(w);
  for (int64_t r = 0; r < n_pad; ++r) {
    for (int64_t c = 0; c < wp; c += 32) {
      const __m512i x = r < n ? _mm512_maskz_loadu_epi16(lanes32(w - c), src + r * ss + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + r * wp + c, x);
    }
  }
}

// B whose columns are src's rows and whose reduction runs along them (B = Xᵀ for X = src, n rows of
// w values): tile (kc, ct) at dst + (kc · n_ct + ct) · 512 holds dwords (X[16 ct + n][32 kc + 2p],
// X[16 ct + n][32 kc + 2p + 1]) at row p, column n, for the tiles ct < up32(n_rows) / 16 (<= n_ct);
// rows past n_rows are zero.
inline void pack_cols(const uint16_t* src, int64_t ss, int64_t n_rows, int64_t w, int64_t n_ct, uint16_t* dst) {
  alignas(64) uint32_t rows[16 * 16];
  for (int64_t kc = 0; kc < up32(w) / 32; ++kc) {
    const __mmask32 m = lanes32(w - 32 * kc);
    for (int64_t ct = 0; ct < up32(n_rows) / 16; ++ct) {
      for (int64_t n = 0; n < 16; ++n) {
        const int64_t j = 16 * ct + n;
        const __m512i r = j < n_rows ? _mm512_maskz_loadu_epi16(m, src + j * ss + 32 * kc) : _mm512_setzero_si512();
        _mm512_store_si512(rows + 16 * n, r);
      }
      Vec::transpose_bits(reinterpret_cast<const float*>(rows), 16,
                          reinterpret_cast<float*>(dst + (kc * n_ct + ct) * kTileElems), 16);
    }
  }
}

// B whose reduction runs down src's rows (B = X, n rows of w values) in pairs of rows: tile (kc, ct)
// at dst + (kc · up32(w) / 16 + ct) · 512 holds dwords (X[32 kc + 2p][16 ct + n], X[32 kc + 2p + 1][16 ct + n])
// at row p, column n; rows n_rows <= r < n_pad (a multiple of 32) are zero.
inline void pack_pairs(const uint16_t* src, int64_t ss, int64_t n_rows, int64_t w, int64_t n_pad, uint16_t* dst) {
  const int64_t n_ct = up32(w) / 16;
  const __m512i lo = _mm512_load_si512(kBf16PairLo), hi = _mm512_load_si512(kBf16PairHi);
  auto row = [&](int64_t r, int64_t c) {
    return r < n_rows ? _mm512_maskz_loadu_epi16(lanes32(w - c), src + r * ss + c) : _mm512_setzero_si512();
  };
  for (int64_t kc = 0; kc < n_pad / 32; ++kc) {
    for (int64_t c = 0; c < up32(w); c += 32) {
      uint16_t* t0 = dst + (kc * n_ct + c / 16) * kTileElems;
      for (int64_t p = 0; p < 16; ++p) {
        const __m512i a = row(32 * kc + 2 * p, c), b = row(32 * kc + 2 * p + 1, c);
        _mm512_store_si512(t0 + 32 * p, _mm512_permutex2var_epi16(a, lo, b));
        _mm512_store_si512(t0 + kTileElems + 32 * p, _mm512_permutex2var_epi16(a, hi, b));
      }
    }
  }
}

// x as two bf16 terms, hi = bf16(x) and lo = bf16(x - hi), 16 lanes each.
HEADS_INLINE void split_bf16(__m512 x, __m256i& hi, __m256i& lo) {
  hi = to_bf16(x);
  const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
  lo = to_bf16(_mm512_sub_ps(x, back));
}

// A rows from f32 rows, as hi and lo terms: row r of src for r < n, zero for lanes c >= live and
// for rows n <= r < n_pad; n_cols a multiple of 16.
inline void split_rows_a(const float* src, int64_t ss, int64_t n, int64_t n_pad, int64_t n_cols, int64_t live,
                         uint16_t* hi, uint16_t* lo, int64_t ds) {
  for (int64_t r = 0; r < n_pad; ++r) {
    for (int64_t c = 0; c < n_cols; c += 16) {
      const __m512 x = r < n ? _mm512_maskz_loadu_ps(lanes16(live - c), src + r * ss + c) : _mm512_setzero_ps();
      __m256i h, l;
      split_bf16(x, h, l);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + r * ds + c), h);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + r * ds + c), l);
    }
  }
}

// A rows of the transpose, as hi and lo terms: row l holds src[r][l] for r < n, zero for
// n <= r < n_pad (a multiple of 32), for l < n_cols (a multiple of 16); row stride ds.
inline void split_cols_a(const float* src, int64_t ss, int64_t n, int64_t n_pad, int64_t n_cols, uint16_t* hi,
                         uint16_t* lo, int64_t ds) {
  alignas(64) float blk[16 * 16];
  for (int64_t r0 = 0; r0 < n_pad; r0 += 16) {
    for (int64_t l0 = 0; l0 < n_cols; l0 += 16) {
      __m512 rows[16];
      for (int64_t e = 0; e < 16; ++e) rows[e] = r0 + e < n ? _mm512_loadu_ps(src + (r0 + e) * ss + l0) : _mm512_setzero_ps();
      Vec::transpose_regs(rows, blk, 16);
      for (int64_t l = 0; l < 16; ++l) {
        __m256i h, w;
        split_bf16(_mm512_load_ps(blk + 16 * l), h, w);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + (l0 + l) * ds + r0), h);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + (l0 + l) * ds + r0), w);
      }
    }
  }
}

// C (M x N f32, row stride ldc) = or += alpha · A · B: A bf16 rows of Kp (a multiple of 32) values,
// stride lda, readable for up32(M) rows, and when a_lo is given A = a + a_lo (two bf16 terms in the
// same layout); B tiles as above, readable for up32(N) columns. Each 32 x 32 block of C is summed
// over the whole reduction in tiles 0-3, then written through tmp (32 x 32 f32).
inline void tile_gemm(int64_t M, int64_t N, int64_t Kp, const uint16_t* a, const uint16_t* a_lo, int64_t lda,
                      const uint16_t* b, int64_t bkc, int64_t bct, float* c, int64_t ldc, float alpha, gemm::Out mode,
                      float* tmp) {
  const __m512 al = _mm512_set1_ps(alpha);
  for (int64_t rb = 0; rb < M; rb += 32) {
    for (int64_t cb = 0; cb < N; cb += 32) {
      HEADS_TILE_ZERO(0);
      HEADS_TILE_ZERO(1);
      HEADS_TILE_ZERO(2);
      HEADS_TILE_ZERO(3);
      const uint16_t* bt = b + (cb / 16) * bct;
      for (int64_t kc = 0; kc < Kp / 32; ++kc) {
        HEADS_TILE_LOAD(4, a + rb * lda + 32 * kc, lda * 2);
        HEADS_TILE_LOAD(5, a + (rb + 16) * lda + 32 * kc, lda * 2);
        HEADS_TILE_LOAD(6, bt + kc * bkc, 64);
        HEADS_TILE_LOAD(7, bt + kc * bkc + bct, 64);
        dp_2x2();
        if (a_lo != nullptr) {
          HEADS_TILE_LOAD(4, a_lo + rb * lda + 32 * kc, lda * 2);
          HEADS_TILE_LOAD(5, a_lo + (rb + 16) * lda + 32 * kc, lda * 2);
          dp_2x2();
        }
      }
      HEADS_TILE_STORE(0, tmp, 128);
      HEADS_TILE_STORE(1, tmp + 16, 128);
      HEADS_TILE_STORE(2, tmp + 16 * 32, 128);
      HEADS_TILE_STORE(3, tmp + 16 * 32 + 16, 128);
      for (int64_t r = 0; r < std::min<int64_t>(32, M - rb); ++r) {
        for (int64_t h = 0; h < 32 && cb + h < N; h += 16) {
          const __mmask16 m = lanes16(N - cb - h);
          float* dst = c + (rb + r) * ldc + cb + h;
          __m512 x = _mm512_mul_ps(_mm512_load_ps(tmp + 32 * r + h), al);
          if (mode == gemm::Out::Add) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, dst));
          _mm512_mask_storeu_ps(dst, m, x);
        }
      }
    }
  }
}

// The key group's operands: K and V as A rows, K as B pairs (keys [jg, jg + ng) of (b, hk)).
inline void pack_group(const Call& C, int64_t b, int64_t hk, int64_t jg, int64_t ng, const Scratch& scr) {
  const SdpaProblem& pb = C.pb;
  const uint16_t* kh = C.kb + b * C.ks[0] + hk * C.ks[1] + jg * C.ks[2];
  const uint16_t* vh = C.vb + b * C.vs[0] + hk * C.vs[1] + jg * C.vs[2];
  pack_rows(kh, C.ks[2], ng, pb.D, up32(ng), scr.ka);
  pack_rows(vh, C.vs[2], ng, pb.Dv, up32(ng), scr.va);
  pack_pairs(kh, C.ks[2], ng, pb.D, up32(ng), scr.kpairs);
}

// The step's operands (queries [I0, I0 + nqs) of head h): Q and dO as B columns and as B pairs.
inline void pack_step(const Call& C, const Step& st, const Scratch& scr) {
  const SdpaProblem& pb = C.pb;
  const uint16_t* q = C.qb + st.b * C.qs[0] + st.h * C.qs[1] + st.I0 * C.qs[2];
  const uint16_t* g = C.gb + st.b * C.gs[0] + st.h * C.gs[1] + st.I0 * C.gs[2];
  pack_cols(q, C.qs[2], st.nqs, pb.D, kLd / 16, scr.qcols);
  pack_cols(g, C.gs[2], st.nqs, pb.Dv, kLd / 16, scr.gcols);
  pack_pairs(q, C.qs[2], st.nqs, pb.D, up32(st.nqs), scr.qpairs);
  pack_pairs(g, C.gs[2], st.nqs, pb.Dv, up32(st.nqs), scr.gpairs);
}

// S^T (times c: log2 units, unmasked) and dP^T of the step's tiles against keys [j0, j0 + nk), into
// s and dp ([keys][kLd]); sdpa_bwd_step-inl.h takes them from there (C.tiles).
inline void step_scores(const Call& C, const Step& st, int64_t jg, int64_t j0, int64_t nk, const Scratch& scr) {
  const SdpaProblem& pb = C.pb;
  const int64_t Dp = up32(pb.D), Dvp = up32(pb.Dv), nq = st.n_sub * kTQ;
  tile_gemm(nk, nq, Dp, scr.ka + (j0 - jg) * Dp, nullptr, Dp, scr.qcols, (kLd / 16) * kTileElems, kTileElems, scr.s, kLd,
            C.c, gemm::Out::Set, scr.ctmp);
  tile_gemm(nk, nq, Dvp, scr.va + (j0 - jg) * Dvp, nullptr, Dvp, scr.gcols, (kLd / 16) * kTileElems, kTileElems, scr.dp,
            kLd, 1.0f, gemm::Out::Set, scr.ctmp);
}

// dV_j += Pd^T dO;  dK_j += scale · dS^T Q;  dQ += scale · dS K_j (block_products' work on tiles).
inline void block_products(const Call& C, const Step& st, int64_t jg, int64_t j0, int64_t nk, float* dkj,
                           int64_t dks2, float* dvj, int64_t dvs2, gemm::Out kv_out, gemm::Out dq_out,
                           const Scratch& scr) {
  const SdpaProblem& pb = C.pb;
  const int64_t Dp = up32(pb.D), Dvp = up32(pb.Dv), nq = st.n_sub * kTQ, nkp = up32(nk);
  uint16_t* lo = scr.pa + kTK * kLd;
  split_rows_a(pb.dropout_p > 0.0 ? scr.pd : scr.s, kLd, nk, nkp, nq, st.nqs, scr.pa, lo, kLd);
  tile_gemm(nk, pb.Dv, nq, scr.pa, lo, kLd, scr.gpairs, (Dvp / 16) * kTileElems, kTileElems, dvj, dvs2, 1.0f, kv_out,
            scr.ctmp);
  split_rows_a(scr.dp, kLd, nk, nkp, nq, st.nqs, scr.pa, lo, kLd);
  tile_gemm(nk, pb.D, nq, scr.pa, lo, kLd, scr.qpairs, (Dp / 16) * kTileElems, kTileElems, dkj, dks2, C.scale,
            kv_out, scr.ctmp);
  split_cols_a(scr.dp, kLd, nk, nkp, nq, scr.pa, lo, kTK);
  tile_gemm(st.nqs, pb.D, nkp, scr.pa, lo, kTK, scr.kpairs + ((j0 - jg) / 32) * (Dp / 16) * kTileElems,
            (Dp / 16) * kTileElems, kTileElems, st.dq0, st.dq_ld, C.scale, dq_out, scr.ctmp);
}

// bf16 per thread for the tiles' operands (see sdpa_bwd's arena), each part a multiple of 32.
inline int64_t operand_elems(int64_t D, int64_t Dv, int64_t span) {
  return span * (2 * up32(D) + up32(Dv)) + kLd * (2 * up32(D) + 2 * up32(Dv)) + 2 * kTK * kLd;
}

// The thread's tile operands from `at` (sdpa_bwd's arena, 64-byte aligned): the 32 x 32 f32 block,
// then operand_elems bf16, every part a multiple of 32 bf16, so each stays aligned.
inline void place_operands(const Call& C, float* at, Scratch& scr) {
  const int64_t Dp = up32(C.pb.D), Dvp = up32(C.pb.Dv);
  scr.ctmp = at;
  scr.ka = reinterpret_cast<uint16_t*>(scr.ctmp + 32 * 32);
  scr.kpairs = scr.ka + C.span * Dp;
  scr.va = scr.kpairs + C.span * Dp;
  scr.qcols = scr.va + C.span * Dvp;
  scr.qpairs = scr.qcols + kLd * Dp;
  scr.gcols = scr.qpairs + kLd * Dp;
  scr.gpairs = scr.gcols + kLd * Dvp;
  scr.pa = scr.gpairs + kLd * Dvp;
}

}  // namespace tiles
