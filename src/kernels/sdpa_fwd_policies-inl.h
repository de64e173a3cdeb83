// sdpa_fwd_policies-inl.h — the tiled forward's precision policies: how a tile packs Q and runs its
// two products on f32 or widened bf16 inputs (Widen), or on bf16 staged key blocks (Bf16Staged);
// sdpa_flash_bf16-inl.h adds the vdpbf16ps ones. Included by sdpa_flash_fwd-inl.h inside its
// namespace fwd.

// f32 and widened-bf16 inputs: the f32 micro-kernels, reading K and V in place.
template <class T>
struct Widen {
  using In = T;
  HEADS_INLINE static VR exp2(VR x) { return Vec::exp2(x); }
  // Qt[d][l] = q[l][d] · c for l < nq, else 0 (q0: first query row, row stride qs2).
  static void pack_q(const T* q0, int64_t qs2, int64_t nq, int64_t D, float c, float* qt) {
    for (int v = 0; v < kNQ; ++v) {
      const int64_t l0 = v * kW, rows = std::clamp<int64_t>(nq - l0, 0, kW);
      int64_t d0 = 0;
      if constexpr (std::is_same_v<T, float>) {  // W whole query rows: transpose W x W blocks in place
        if (rows == kW) {
          for (; d0 + kW <= D; d0 += kW) {
            Vec::transpose_scaled(q0 + l0 * qs2 + d0, qs2, qt + d0 * kTQ + l0, kTQ, Vec::set1(c));
          }
        }
      }
      if (rows > 0) {  // bf16 rows widened, or a tile's last rows: W x W blocks through a copy, its rows
        for (; d0 + kW <= D; d0 += kW) {  // past nq zero (a short sequence's tile is mostly this)
          alignas(64) float block[kW * kW];
          for (int64_t r = 0; r < kW; ++r) Vec::store(block + r * kW, r < rows ? load_row(q0 + (l0 + r) * qs2 + d0) : Vec::zero());
          Vec::transpose_scaled(block, kW, qt + d0 * kTQ + l0, kTQ, Vec::set1(c));
          if (rows < kW) {  // 0 · c is not 0 for every c (−0, NaN): the lanes past nq are 0
            for (int64_t d = d0; d < d0 + kW; ++d) std::fill(qt + d * kTQ + l0 + rows, qt + d * kTQ + l0 + kW, 0.0f);
          }
        }
      }
      for (int64_t l = l0; l < l0 + kW; ++l) {
        for (int64_t d = d0; d < D; ++d) qt[d * kTQ + l] = l < nq ? widen(q0[l * qs2 + d]) * c : 0.0f;
      }
    }
  }
  // S = K · Qt; the scale c is already folded into Qt.
  static void qk(int64_t n, const T* k, int64_t ks, const float* qt, int64_t D, float /*c*/, float* s,
                 VR* mx) {
    qk_block(n, k, ks, qt, D, s, mx);
  }
  static int64_t cache_floats(const SdpaProblem&) { return 0; }
  // Ot = Ot · alpha + P · V[j0 : j0 + nk] (V rows read in place).
  static void pv(const Tile& t, const Scratch& scr, const T* vh, int64_t vs, int64_t j0, int64_t nk,
                 const VR* alpha) {
    pv_block(t.pb.Dv, vh + j0 * vs, vs, scr.s, nk, scr.ot, alpha);
  }
  // out[l][d] = Ot[d][l] · inv_l[l] for l < nq.
  static void store_out(const float* ot, const float* inv_l, int64_t nq, int64_t Dv, T* o0,
                        int64_t os2) {
    for (int v = 0; v < kNQ; ++v) {
      const int64_t l0 = v * kW;
      if (l0 >= nq) break;
      const int64_t rows = std::min<int64_t>(kW, nq - l0);
      int64_t d0 = 0;
      for (; d0 + kW <= Dv; d0 += kW) {  // W x W blocks of Ot / l (bf16, or a tile's last rows: through a copy)
        if constexpr (std::is_same_v<T, float>) {
          if (rows == kW) {
            Vec::transpose_scaled(ot + d0 * kTQ + l0, kTQ, o0 + l0 * os2 + d0, os2, Vec::load(inv_l + l0));
            continue;
          }
        }
        alignas(64) float block[kW * kW];
        Vec::transpose_scaled(ot + d0 * kTQ + l0, kTQ, block, kW, Vec::load(inv_l + l0));
        for (int64_t r = 0; r < rows; ++r) {
          T* row = o0 + (l0 + r) * os2 + d0;
          if constexpr (std::is_same_v<T, float>) {
            Vec::storeu(row, Vec::load(block + r * kW));
          } else {
            for (int64_t e = 0; e < kW; ++e) row[e] = f32_to_bf16(block[r * kW + e]);
          }
        }
      }
      for (int64_t r = l0; r < l0 + rows; ++r) {
        for (int64_t d = d0; d < Dv; ++d) {
          const float x = ot[d * kTQ + r] * inv_l[r];
          if constexpr (std::is_same_v<T, float>) {
            o0[r * os2 + d] = x;
          } else {
            o0[r * os2 + d] = f32_to_bf16(x);
          }
        }
      }
    }
  }
  // One row of W query values from q, widened to f32.
  HEADS_INLINE static VR load_row(const T* p) {
    if constexpr (std::is_same_v<T, float>) {
      return Vec::loadu(p);
    } else {
      return Vec::loadu_bf16(p);
    }
  }
};

// Rows [j0, j0 + n) of bf16 x (row stride xs, width w) widened into f32 dst (row stride w).
inline void widen_rows(const uint16_t* x, int64_t xs, int64_t j0, int64_t n, int64_t w, float* dst) {
  for (int64_t r = 0; r < n; ++r) {
    const uint16_t* src = x + (j0 + r) * xs;
    float* row = dst + r * w;
    int64_t d = 0;
    for (; d + kW <= w; d += kW) Vec::storeu(row + d, Vec::loadu_bf16(src + d));
    if (d < w) Vec::store_partial(row + d, Vec::load_partial_bf16(src + d, w - d), w - d);
  }
}

// bf16 inputs on CPUs without a bf16 product that pays: K and V rows are widened to f32 once into
// the thread's policy cache, then the f32 micro-kernels run on them. Widening is exact, so the
// results are those of Widen<uint16_t> (which widens every element as the micro-kernel broadcasts
// it: at half the f32 speed). A head whose widened K and V fit in kStagedHeadBytes is staged
// whole, once per thread, and kept across that head's tiles (cache_state: b, hk and the staged
// key range [lo, hi)); a longer one block by block, once per group of tiles.
struct Bf16Staged : Widen<uint16_t> {
  static constexpr bool kStaged = true;
  static constexpr int64_t kStagedHeadBytes = 2 * kCachedKvBytes;
  static bool whole_head(const SdpaProblem& pb) { return pb.Lk * (pb.D + pb.Dv) * 4 <= kStagedHeadBytes; }
  static int64_t staged_rows(const SdpaProblem& pb) { return whole_head(pb) ? pb.Lk : kTK; }
  static int64_t cache_floats(const SdpaProblem& pb) { return staged_rows(pb) * (pb.D + pb.Dv); }
  // Makes K rows [j0, j0 + nk) of kv head (b, hk) readable through k_rows, and V rows through
  // v_rows when need_v (block by block; a whole head always stages both).
  static void stage(const SdpaProblem& pb, const Scratch& scr, int64_t b, int64_t hk, const uint16_t* kh,
                    int64_t ks2, const uint16_t* vh, int64_t vs2, int64_t j0, int64_t nk, bool need_v = true) {
    float* cache = scr.cache;
    int64_t* st = scr.cache_state;
    if (!whole_head(pb)) {
      widen_rows(kh, ks2, j0, nk, pb.D, cache);
      if (need_v) widen_rows(vh, vs2, j0, nk, pb.Dv, cache + kTK * pb.D);
      return;
    }
    if (st[0] != b || st[1] != hk) {
      st[0] = b;
      st[1] = hk;
      st[2] = st[3] = j0;
    }
    auto widen_range = [&](int64_t a, int64_t e) {  // rows [a, e), at their own index
      widen_rows(kh, ks2, a, e - a, pb.D, cache + a * pb.D);
      widen_rows(vh, vs2, a, e - a, pb.Dv, cache + pb.Lk * pb.D + a * pb.Dv);
    };
    if (j0 < st[2]) widen_range(j0, st[2]);  // (a gap up to the staged range is staged too)
    if (j0 + nk > st[3]) widen_range(st[3], j0 + nk);
    st[2] = std::min(st[2], j0);
    st[3] = std::max(st[3], j0 + nk);
  }
  // The staged K row j0 (block by block: the block last staged, which starts at j0).
  static const float* k_rows(const SdpaProblem& pb, const Scratch& scr, int64_t j0) {
    return whole_head(pb) ? scr.cache + j0 * pb.D : scr.cache;
  }
  static const float* v_rows(const SdpaProblem& pb, const Scratch& scr, int64_t j0) {
    return whole_head(pb) ? scr.cache + pb.Lk * pb.D + j0 * pb.Dv : scr.cache + kTK * pb.D;
  }
  // S = K · Qt from the staged rows.
  static void qk_staged(const SdpaProblem& pb, const Scratch& scr, int64_t j0, int64_t n, const float* qt, float* s,
                        VR* mx) {
    qk_block(n, k_rows(pb, scr, j0), pb.D, qt, pb.D, s, mx);
  }
  // Ot = Ot · alpha + P · V from the staged rows.
  static void pv(const Tile& t, const Scratch& scr, const uint16_t* /*vh*/, int64_t /*vs*/, int64_t j0,
                 int64_t nk, const VR* alpha) {
    pv_block(t.pb.Dv, v_rows(t.pb, scr, j0), t.pb.Dv, scr.s, nk, scr.ot, alpha);
  }
};

// Whether a policy stages its key blocks (Bf16Staged).
template <class Pol>
constexpr bool kStages = requires { Pol::kStaged; };
