// sdpa_amx_tiles-inl.h — the AMX kernel's building blocks: the tile configuration, the 32 x 32
// tdpbf16ps block, exp2 and lane masks, and the packing of K and V chunks into tiles (B in VNNI
// layout). Included by sdpa_amx-inl.h inside its namespace amx.

// The tile instructions, as the kernels reach them: the real ones, or in the emulated build
// (isa_amx_emu.cc) amx_emulator.h's. GCC's tileloadd asm declares no memory input, so loads use
// their own asm with a memory clobber: the compiler may not move the vector stores that fill an
// operand (P, O, packed rows) past them. Defined for the rest of the ISA build (the backward's
// tiles, sdpa_amx_bwd-inl.h, use them too).
#ifdef HEADS_AMX_EMULATED  // isa_amx_emu.cc: the same kernel over amx_emulator.h
#define HEADS_TILE_LOAD(t, base, stride) amx_emulator::load(t, base, static_cast<int64_t>(stride))
#define HEADS_TILE_STORE(t, base, stride) amx_emulator::store(t, base, static_cast<int64_t>(stride))
#define HEADS_TILE_ZERO(t) amx_emulator::zero(t)
#define HEADS_TILE_DP(c, a, b) amx_emulator::dpbf16ps(c, a, b)
#define HEADS_TILE_DP_I8(c, a, b) amx_emulator::dpbusd(c, a, b)
#define HEADS_TILE_CONFIG(cfg) amx_emulator::configure(&(cfg))
#define HEADS_TILE_RELEASE() amx_emulator::release()
#else
#define HEADS_TILE_LOAD(t, base, stride)                                                   \
  __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm" #t "|tileloadd\t%%tmm" #t ", [%0+%1*1]}" \
                   : : "r"(static_cast<const void*>(base)), "r"(static_cast<int64_t>(stride)) : "memory")
#define HEADS_TILE_STORE(t, base, stride) _tile_stored(t, base, static_cast<int64_t>(stride))
#define HEADS_TILE_ZERO(t) _tile_zero(t)
#define HEADS_TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define HEADS_TILE_DP_I8(c, a, b) _tile_dpbusd(c, a, b)
// ldtilecfg reads all 64 bytes (GCC's _tile_loadconfig declares an 8-byte operand).
#define HEADS_TILE_CONFIG(cfg) __asm__ volatile("ldtilecfg %0" : : "m"(cfg) : "memory")
#define HEADS_TILE_RELEASE() _tile_release()
#endif

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
  HEADS_TILE_CONFIG(cfg);
}

// The four tdpbf16ps of a 32 x 32 block: C[rt][ct] += A[rt] · B[ct].
HEADS_INLINE void dp_2x2() {
  HEADS_TILE_DP(0, 4, 6);
  HEADS_TILE_DP(1, 4, 7);
  HEADS_TILE_DP(2, 5, 6);
  HEADS_TILE_DP(3, 5, 7);
}

// 2^x for x <= 0 (or NaN): exactly 0 below -126 (and for -inf), NaN stays NaN (whatever its
// payload). The integer part n comes from the 1.5 · 2^23 rounding trick and is added to the
// exponent of 2^f (f in [-1/2, 1/2], degree-5 Taylor: relative error at most 3.3e-6, far under
// bf16's 2^-9) as an integer: no round-to-integer or scalef instructions, which compete for one
// port with the FMAs.
HEADS_INLINE __m512 exp2_nonpos(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512 x_in = x;
  x = _mm512_max_ps(_mm512_set1_ps(-126.0f), x);  // max_ps returns its second operand for NaN
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 t = _mm512_add_ps(x, magic);  // low mantissa bits: round(x)
  const __m512 f = _mm512_sub_ps(x, _mm512_sub_ps(t, magic));
  __m512 p = _mm512_set1_ps(kExp2C5);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2C4));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2C3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2C2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2C1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_castps_si512(t), 23);
  const __m512 r = _mm512_castsi512_ps(_mm512_maskz_add_epi32(live, _mm512_castps_si512(p), e));
  return _mm512_mask_mov_ps(r, nan, x_in);  // a NaN's payload bits would have reached the exponent
}

// 2^x for the rows without masks or score modifiers (softmax_unit's plain rows), in 10 vector
// operations where exp2_nonpos takes 15: x clamped at -125 (so 2^x stays a normal number: an
// underflowed weight is about 2^-125 instead of 0, far below anything a bf16 P or an f32 row sum
// can hold beside the row's largest weight of 1), 2^f on [-1/2, 1/2] by a degree-4 polynomial fitted
// for the least largest relative error (2.7e-6 in f32 arithmetic, below exp2_nonpos's Taylor
// polynomial of degree 5), and the exponent applied by vscalefps, which keeps NaN (as does the
// clamp: max_ps returns its second operand for NaN).
HEADS_INLINE __m512 exp2_plain(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-125.0f), x);
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(x, magic), magic);  // round(x)
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.009569867514073849f), f, _mm512_set1_ps(0.0559171698987484f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240247443318367f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931219100952148f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999992847442627f));
  return _mm512_scalef_ps(p, n);
}

#include "kernels/simd/bf16_round_avx512-inl.h"

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
  // Keys some query may see (all but those past the last row's causal limit). Later keys are packed
  // as 0, so values there (a preallocated cache's garbage, NaN) never reach P · V, as in the f32 kernel.
  int64_t Lk_seen;
  explicit Layout(const SdpaProblem& pb)
      : Dp((pb.D + 31) / 32 * 32), Dvp((pb.Dv + 31) / 32 * 32), Lkp((pb.Lk + 31) / 32 * 32),
        n_dc(Dp / 32), n_ct(Dvp / 16), k_elems(Lkp * Dp), v_elems(Lkp * Dvp), Lk_seen(pb.key_end(pb.Lq - 1)) {}
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
        const __m512i r = j < lay.Lk_seen ? _mm512_maskz_loadu_epi16(m, kh + j * ks + 32 * dc) : _mm512_setzero_si512();
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
  const __m512i lo = _mm512_load_si512(kBf16PairLo), hi = _mm512_load_si512(kBf16PairHi);
  for (int64_t cp = 0; cp < lay.n_ct / 2; ++cp) {
    const __mmask32 m = first_mask32(pb.Dv - 32 * cp);
    uint16_t* t0 = dst + (kc * lay.n_ct + 2 * cp) * 512;
    uint16_t* t1 = t0 + 512;
    for (int64_t p = 0; p < 16; ++p) {
      const int64_t j = 32 * kc + 2 * p;
      const __m512i a = j < lay.Lk_seen ? _mm512_maskz_loadu_epi16(m, vh + j * vs + 32 * cp) : _mm512_setzero_si512();
      const __m512i b = j + 1 < lay.Lk_seen ? _mm512_maskz_loadu_epi16(m, vh + (j + 1) * vs + 32 * cp)
                                            : _mm512_setzero_si512();
      _mm512_store_si512(t0 + 32 * p, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(t1 + 32 * p, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// The tile work of one phase of the forward's pipeline (sdpa_amx-inl.h), as a stream of single
// tdpbf16ps (an "op"; four make the 32 x 32 block of a step, whose operands the first one loads),
// so that the caller can spread them between the vectors of its softmax: the tile unit then
// multiplies while the vector units exponentiate. (Measured on a Xeon with AMX: a tile product and
// the vector work between two of them overlap while that work is short; handing the tiles whole
// steps of four products between rows of the softmax overlapped far less.)
//   S jobs:  S[0:32][32 kk, 32 kk + 32) = Q · K[j0s + 32 kk ...]ᵀ, a job per 32 keys, a step per 32
//            dims (n_dc steps), C from tilezero, stored to s (row stride s_stride floats).
//   PV jobs: O[0:32][32 cp, 32 cp + 32) += P · V[j0v ...], a job per 32 output columns, a step per
//            32 keys, C loaded from O (or tilezero for the task's first block), stored back.
// A job holds the accumulator tiles 0-3 from its first step to its last; nothing else touches tiles
// between ops, so vector code may run anywhere between them.
struct TileStream {
  // S part (s_jobs = 0: none)
  const uint16_t* qp = nullptr;  // [32][D] bf16, row stride Dp elements
  const uint16_t* kp = nullptr;  // packed K of the head (tiles of 16 keys x 32 dims)
  float* s = nullptr;            // [32][s_stride]
  int64_t Dp = 0, n_dc = 0, j0s = 0, s_jobs = 0, s_stride = 0;  // Dp: Q's row stride
  // PV part (v_jobs = 0: none)
  const uint16_t* p = nullptr;  // [32][p_stride] bf16
  const uint16_t* vp = nullptr;  // packed V of the head (tiles of 32 keys x 16 columns)
  float* o = nullptr;            // [32][Dvp]
  int64_t Dvp = 0, n_ct = 0, j0v = 0, v_keys = 0, v_jobs = 0, p_stride = 0;  // v_keys: keys / 32 a job
  bool o_from_zero = false;
  int64_t done = 0;          // ops issued
  int64_t job = 0, sub = 0;  // the current step: job (kk of S, then cp of PV) and step within it

  int64_t total() const { return 4 * (s_jobs * n_dc + v_jobs * v_keys); }

  // The next op: tdpbf16ps number done % 4 of the current step.
  HEADS_INLINE void op() {
    switch (done++ % 4) {
      case 0:
        load_step();
        HEADS_TILE_DP(0, 4, 6);
        return;
      case 1:
        HEADS_TILE_DP(1, 4, 7);
        return;
      case 2:
        HEADS_TILE_DP(2, 5, 6);
        return;
      default:
        HEADS_TILE_DP(3, 5, 7);
        end_step();
    }
  }
  // Ops until `target` of them are done (at most total()).
  HEADS_INLINE void advance_to(int64_t target) {
    while (done < target) op();
  }
  void finish() { advance_to(total()); }

 private:
  // The step's operands into tiles 4-7 (and, at a job's first step, its accumulators into 0-3).
  HEADS_INLINE void load_step() {
    if (job < s_jobs) {
      const int64_t kk = job, dc = sub;
      if (dc == 0) {
        HEADS_TILE_ZERO(0);
        HEADS_TILE_ZERO(1);
        HEADS_TILE_ZERO(2);
        HEADS_TILE_ZERO(3);
      }
      const uint16_t* k0 = kp + ((j0s + 32 * kk) / 16 * n_dc + dc) * 512;
      HEADS_TILE_LOAD(4, qp + 32 * dc, Dp * 2);
      HEADS_TILE_LOAD(5, qp + 16 * Dp + 32 * dc, Dp * 2);
      HEADS_TILE_LOAD(6, k0, 64);
      HEADS_TILE_LOAD(7, k0 + n_dc * 512, 64);
      return;
    }
    const int64_t cp = job - s_jobs, kk = sub;
    if (kk == 0) {
      float* o0 = o + 32 * cp;
      if (o_from_zero) {
        HEADS_TILE_ZERO(0);
        HEADS_TILE_ZERO(1);
        HEADS_TILE_ZERO(2);
        HEADS_TILE_ZERO(3);
      } else {
        HEADS_TILE_LOAD(0, o0, Dvp * 4);
        HEADS_TILE_LOAD(1, o0 + 16, Dvp * 4);
        HEADS_TILE_LOAD(2, o0 + 16 * Dvp, Dvp * 4);
        HEADS_TILE_LOAD(3, o0 + 16 * Dvp + 16, Dvp * 4);
      }
    }
    const uint16_t* vt = vp + ((j0v / 32 + kk) * n_ct + 2 * cp) * 512;
    HEADS_TILE_LOAD(4, p + 32 * kk, p_stride * 2);
    HEADS_TILE_LOAD(5, p + 16 * p_stride + 32 * kk, p_stride * 2);
    HEADS_TILE_LOAD(6, vt, 64);
    HEADS_TILE_LOAD(7, vt + 512, 64);
  }
  // After a step's fourth product: at a job's last step, its accumulators stored.
  HEADS_INLINE void end_step() {
    if (job < s_jobs) {
      if (++sub < n_dc) return;
      float* d = s + 32 * job;
      HEADS_TILE_STORE(0, d, s_stride * 4);
      HEADS_TILE_STORE(1, d + 16, s_stride * 4);
      HEADS_TILE_STORE(2, d + 16 * s_stride, s_stride * 4);
      HEADS_TILE_STORE(3, d + 16 * s_stride + 16, s_stride * 4);
    } else {
      if (++sub < v_keys) return;
      float* o0 = o + 32 * (job - s_jobs);
      HEADS_TILE_STORE(0, o0, Dvp * 4);
      HEADS_TILE_STORE(1, o0 + 16, Dvp * 4);
      HEADS_TILE_STORE(2, o0 + 16 * Dvp, Dvp * 4);
      HEADS_TILE_STORE(3, o0 + 16 * Dvp + 16, Dvp * 4);
    }
    sub = 0;
    ++job;
  }
};
