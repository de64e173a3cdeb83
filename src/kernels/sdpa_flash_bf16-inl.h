// sdpa_flash_bf16-inl.h — the tiled SDPA's products in bf16 with a bf16 dot product: vdpbf16ps
// (AVX512_BF16) or BFDOT (AArch64 FEAT_BF16). Included by the ISA builds with HEADS_NATIVE_BF16 after
// sdpa_flash_fwd-inl.h; plugs a policy into its tile loop. The instructions come from the vector
// layer's Bf16Pairs (vec_avx512-inl.h, vec_neon-inl.h).
//
// dot(acc, a, b): f32 lane i += a[2i]·b[2i] + a[2i+1]·b[2i+1] — the two bf16 of a dword are
// consecutive steps of the reduction. So both products keep pairs along their reduction:
//   S  = K · Qt:  Qt2 [D/2][kTQ] dwords (q[l][2p], q[l][2p+1]); the K pair (K[j][2p], K[j][2p+1])
//                 is adjacent in K as stored, so K is still broadcast in place.
//   O += V2ᵀ · P2: P2 [nk/2][kTQ] dwords (P[2p][l], P[2p+1][l]) from the f32 probabilities;
//                 V2 [Lk/2][Dv] dwords (V[2p][d], V[2p+1][d]), re-laid once per (b, kv head) and
//                 thread, and reused by every query tile of that head the thread runs.
// q and k stay exact (bf16 inputs); the scale is applied in f32 when S is stored. P is rounded
// to bf16 for the product (like every bf16 attention kernel); S, softmax, l and O stay f32.

namespace fwd {

using BP = Bf16Pairs::P;

HEADS_INLINE uint32_t load_pair(const uint16_t* p) {  // two adjacent bf16 as one dword
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// S rows r < R: S[r][:] = c · sum_p K[r][2p..2p+1] · Qt2[p][:];  mx = max(mx, S rows).
template <int R>
HEADS_INLINE void qk_rows_bf(const uint16_t* k, int64_t ks, const uint32_t* qt2, int64_t D, float c,
                             float* s, VR* mx) {
  VR acc[R][kNQ];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Vec::zero();
  const uint16_t* kr[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) kr[r] = k + r * ks;
  const int64_t D2 = D / 2;
  for (int64_t p = 0; p < D2; ++p) {
    const BP b0 = Bf16Pairs::load(qt2 + p * kTQ);
    const BP b1 = Bf16Pairs::load(qt2 + p * kTQ + kW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const BP a = Bf16Pairs::set1(load_pair(kr[r] + 2 * p));
      acc[r][0] = Bf16Pairs::dot(acc[r][0], a, b0);
      acc[r][1] = Bf16Pairs::dot(acc[r][1], a, b1);
    }
  }
  if (D & 1) {  // last pair (q, 0) against (k, 0)
    const BP b0 = Bf16Pairs::load(qt2 + D2 * kTQ);
    const BP b1 = Bf16Pairs::load(qt2 + D2 * kTQ + kW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const BP a = Bf16Pairs::set1(kr[r][D - 1]);
      acc[r][0] = Bf16Pairs::dot(acc[r][0], a, b0);
      acc[r][1] = Bf16Pairs::dot(acc[r][1], a, b1);
    }
  }
  const VR cv = Vec::set1(c);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kNQ; ++v) {
      const VR x = Vec::mul(acc[r][v], cv);
      Vec::store(s + r * kTQ + v * kW, x);
      if (mx != nullptr) mx[v] = Vec::max(mx[v], x);
    }
  }
}

// Ot rows r < R: Ot[r][:] = Ot[r][:] · alpha + sum_p V2[p][r] · P2[p][:].
template <int R>
HEADS_INLINE void pv_rows_bf(const uint32_t* v2, int64_t v2s, const uint32_t* p2, int64_t nk2,
                             float* ot, const VR* alpha) {
  VR acc[R][kNQ];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc[r][0] = Vec::mul(Vec::load(ot + r * kTQ), alpha[0]);
    acc[r][1] = Vec::mul(Vec::load(ot + r * kTQ + kW), alpha[1]);
  }
  for (int64_t p = 0; p < nk2; ++p) {
    const BP b0 = Bf16Pairs::load(p2 + p * kTQ);
    const BP b1 = Bf16Pairs::load(p2 + p * kTQ + kW);
    const uint32_t* vp = v2 + p * v2s;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const BP a = Bf16Pairs::set1(vp[r]);
      acc[r][0] = Bf16Pairs::dot(acc[r][0], a, b0);
      acc[r][1] = Bf16Pairs::dot(acc[r][1], a, b1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    Vec::store(ot + r * kTQ, acc[r][0]);
    Vec::store(ot + r * kTQ + kW, acc[r][1]);
  }
}

template <int R>
HEADS_INLINE void qk_tail_bf(int64_t n, const uint16_t* k, int64_t ks, const uint32_t* qt2, int64_t D,
                             float c, float* s, VR* mx) {
  if constexpr (R > 0) {
    if (n == R) return qk_rows_bf<R>(k, ks, qt2, D, c, s, mx);
    qk_tail_bf<R - 1>(n, k, ks, qt2, D, c, s, mx);
  }
}

template <int R>
HEADS_INLINE void pv_tail_bf(int64_t n, const uint32_t* v2, int64_t v2s, const uint32_t* p2,
                             int64_t nk2, float* ot, const VR* alpha) {
  if constexpr (R > 0) {
    if (n == R) return pv_rows_bf<R>(v2, v2s, p2, nk2, ot, alpha);
    pv_tail_bf<R - 1>(n, v2, v2s, p2, nk2, ot, alpha);
  }
}

struct Bf16Dot {
  using In = uint16_t;
  static constexpr int R = Vec::kRowsQK;

  HEADS_INLINE static VR exp2(VR x) { return Vec::exp2(x); }

  // Qt2[p][l] = (q[l][2p], q[l][2p+1]) as one dword, (q[l][D-1], 0) for odd D; 0 past nq.
  // q stays exact: the scale c is applied in f32 when S is stored (see qk).
  static void pack_q(const uint16_t* q0, int64_t qs2, int64_t nq, int64_t D, float /*c*/, float* space) {
    auto* qt2 = reinterpret_cast<uint32_t*>(space);
    const int64_t D2 = D / 2, Dh = (D + 1) / 2;
    const bool dwords = (qs2 % 2 == 0) && reinterpret_cast<uintptr_t>(q0) % 4 == 0;
    for (int v = 0; v < kNQ; ++v) {
      const int64_t l0 = v * kW;
      int64_t p0 = 0;
      if (dwords && l0 + kW <= nq) {  // W whole rows: transpose W x W blocks of dwords
        for (; p0 + kW <= D2; p0 += kW) {
          Vec::transpose_bits(reinterpret_cast<const float*>(q0 + l0 * qs2 + 2 * p0), qs2 / 2,
                              reinterpret_cast<float*>(qt2 + p0 * kTQ + l0), kTQ);
        }
      }
      for (int64_t l = l0; l < l0 + kW; ++l) {
        const uint16_t* row = q0 + l * qs2;
        for (int64_t p = p0; p < Dh; ++p) {
          uint32_t w = 0;
          if (l < nq) w = row[2 * p] | (2 * p + 1 < D ? static_cast<uint32_t>(row[2 * p + 1]) << 16 : 0u);
          qt2[p * kTQ + l] = w;
        }
      }
    }
  }

  static void qk(int64_t n, const uint16_t* k, int64_t ks, const float* space, int64_t D, float c,
                 float* s, VR* mx) {
    const auto* qt2 = reinterpret_cast<const uint32_t*>(space);
    int64_t r = 0;
    for (; r + R <= n; r += R) qk_rows_bf<R>(k + r * ks, ks, qt2, D, c, s + r * kTQ, mx);
    if (r < n) qk_tail_bf<R - 1>(n - r, k + r * ks, ks, qt2, D, c, s + r * kTQ, mx);
  }

  // V2 [ceil(Lk/2)][v2s] dwords for one (b, hk), kept per thread across that head's tiles.
  static int64_t v2_stride(int64_t Dv) { return (Dv + 31) / 32 * 32; }
  static int64_t cache_floats(const SdpaProblem& pb) { return (pb.Lk + 1) / 2 * v2_stride(pb.Dv); }

  // Pairs V rows [j_begin, j_end) (j_begin even) into the cache: V2[p][d] = (V[2p][d], V[2p+1][d]),
  // the missing partner of an odd end is 0.
  static void pack_v(const uint16_t* vh, int64_t vs, int64_t Dv, int64_t j_begin, int64_t j_end,
                     uint32_t* v2) {
    const int64_t v2s = v2_stride(Dv);
    for (int64_t j = j_begin; j < j_end; j += 2) {
      Bf16Pairs::pair_rows(vh + j * vs, j + 1 < j_end ? vh + (j + 1) * vs : nullptr, Dv, v2 + (j / 2) * v2s);
    }
  }

  static void pv(const Tile& t, const Scratch& scr, const uint16_t* vh, int64_t vs, int64_t j0,
                 int64_t nk, const VR* alpha) {
    const int64_t Dv = t.pb.Dv, v2s = v2_stride(Dv);
    const int64_t nk2 = (nk + 1) / 2;
    // V2 cache: state = {b, hk, keys paired so far (even)}.
    auto* v2 = reinterpret_cast<uint32_t*>(scr.cache);
    int64_t* st = scr.cache_state;
    if (st[0] != t.b || st[1] != t.hk) {
      st[0] = t.b;
      st[1] = t.hk;
      st[2] = 0;
    }
    if (st[2] < j0 + nk) {
      pack_v(vh, vs, Dv, st[2], j0 + nk, v2);
      st[2] = (j0 + nk) / 2 * 2;  // an odd end's half pair is packed again when extended
    }
    // P2: rows 2p and 2p+1 of P rounded to bf16 and interleaved.
    auto* p2 = reinterpret_cast<uint32_t*>(scr.aux);  // [kTK/2][kTQ]
    const float* p = scr.s;
    for (int64_t q2 = 0; q2 < nk2; ++q2) {
      for (int vv = 0; vv < kNQ; ++vv) {
        const VR r0 = Vec::load(p + 2 * q2 * kTQ + vv * kW);
        const VR r1 = 2 * q2 + 1 < nk ? Vec::load(p + (2 * q2 + 1) * kTQ + vv * kW) : Vec::zero();
        Bf16Pairs::round_pairs(r0, r1, p2 + q2 * kTQ + vv * kW);
      }
    }
    const uint32_t* vb = v2 + (j0 / 2) * v2s;
    int64_t d = 0;
    for (; d + R <= Dv; d += R) pv_rows_bf<R>(vb + d, v2s, p2, nk2, scr.ot + d * kTQ, alpha);
    if (d < Dv) pv_tail_bf<R - 1>(Dv - d, vb + d, v2s, p2, nk2, scr.ot + d * kTQ, alpha);
  }

  // out[l][d] = bf16(Ot[d][l] · inv_l[l]) for l < nq: W x W transposes, then rounded to bf16.
  static void store_out(const float* ot, const float* inv_l, int64_t nq, int64_t Dv, uint16_t* o0,
                        int64_t os2) {
    alignas(64) float tmp[kW * kW];
    for (int v = 0; v < kNQ; ++v) {
      const int64_t l0 = v * kW;
      if (l0 >= nq) break;
      const int64_t rows = std::min<int64_t>(kW, nq - l0);
      for (int64_t d0 = 0; d0 < Dv; d0 += kW) {
        const int64_t n = std::min<int64_t>(kW, Dv - d0);
        if (n == kW) {
          Vec::transpose_scaled(ot + d0 * kTQ + l0, kTQ, tmp, kW, Vec::load(inv_l + l0));
        } else {
          for (int64_t r = 0; r < kW; ++r) {
            for (int64_t c = 0; c < n; ++c) tmp[r * kW + c] = ot[(d0 + c) * kTQ + l0 + r] * inv_l[l0 + r];
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          Bf16Pairs::store_rounded(o0 + (l0 + r) * os2 + d0, Vec::load(tmp + r * kW), n);
        }
      }
    }
  }
};

}  // namespace fwd

inline void sdpa_tiled_bf16_dot(const SdpaProblem& pb, const Tensor& q, const Tensor& k,
                                const Tensor& v, const Tensor& out, const Tensor& lse,
                                const Tensor& weights) {
  fwd::sdpa_tiled<fwd::Bf16Dot>(pb, q, k, v, out, lse, weights);
}

// Throughput probe of the bf16 dot product, as fma_probe (peak-inl.h): flops per iteration =
// chains · W · 4.
inline float bf16_probe(int64_t iters) {
  constexpr int kChains = 2 * Vec::kRowsQK;
  Vec::R acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = Vec::set1(static_cast<float>(c));
  const fwd::BP a = Bf16Pairs::set1(0x3f803f80u), b = Bf16Pairs::set1(0x3f7f3f7fu);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 32
    for (int c = 0; c < kChains; ++c) acc[c] = Bf16Pairs::dot(acc[c], a, b);
  }
  Vec::R s = acc[0];
  for (int c = 1; c < kChains; ++c) s = Vec::add(s, acc[c]);
  return Vec::reduce_add(s);
}
inline int bf16_probe_flops_per_iter() { return 2 * Vec::kRowsQK * Vec::W * 4; }
