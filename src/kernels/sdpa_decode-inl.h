// sdpa_decode-inl.h — SDPA forward for few queries against many keys (decode), written once over
// `Vec`. Included by kernels/sdpa_paths-inl.h after sdpa_flash_fwd-inl.h.
//
// Shapes as sdpa_flash_fwd-inl.h. Used when Lq <= kMaxDecodeLq, where a queries-on-lanes tile
// would leave most lanes idle and the work is bound by reading K and V once.
// Layout: every query row that shares a key/value head (H/Hkv heads x Lq rows) is processed
//   together, so K and V stream through once per (b, hk); dot products run along D (keys on the
//   outer loop), P·V accumulates into per-row O in f32. A key or value vector is widened once for
//   up to 4 rows (rows_dots16, pv_rows): a GQA group's rows cost the arithmetic, not the widening,
//   of one row each. int8 keys on CPUs with VNNI skip the widening altogether (QDigits).
// Parallel: tasks are (b, hk, key chunk). When B·Hkv alone cannot feed many threads, the keys are
//   split into chunks (sdpa_split.h) whose partial softmax states (m, l, O) are merged afterwards
//   (flash-decoding): m = max m_c, l = Σ l_c 2^(m_c - m), O = Σ O_c 2^(m_c - m). The split depends
//   only on the problem shape, never on the thread count, so results are thread-independent.
// Masks, dropout and the fully-masked-row rule are those of the tiled kernel; weights, when
//   requested, are a second sweep from the final lse.
// K and V may be stored apart from q's dtype (a KV cache): f32, bf16, or int8 with a scale per
//   (b, hk, key) (pb.k_scale, pb.v_scale). They are widened in registers as they are read, never
//   copied: an int8 key's scale multiplies its score (q·k_j · s_j), a value's its probability
//   (p_j · s_j) before P·V, so the int8 rows feed the same f32 FMAs.

namespace dec {

using VR = Vec::R;
constexpr int kW = Vec::W;
constexpr int64_t kBlock = 64;  // keys per online-softmax step
constexpr float kInf = std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Rows of f32 or bf16 (uint16_t bits) as f32 vectors.
HEADS_INLINE VR load_row(const float* p) { return Vec::loadu(p); }
HEADS_INLINE VR load_row(const uint16_t* p) { return Vec::loadu_bf16(p); }
HEADS_INLINE VR load_row_partial(const float* p, int64_t n) { return Vec::load_partial(p, n); }
HEADS_INLINE VR load_row_partial(const uint16_t* p, int64_t n) { return Vec::load_partial_bf16(p, n); }
HEADS_INLINE VR load_row(const int8_t* p) { return Vec::loadu_i8(p); }
HEADS_INLINE VR load_row_partial(const int8_t* p, int64_t n) { return Vec::load_partial_i8(p, n); }
HEADS_INLINE float to_f32(float x) { return x; }
HEADS_INLINE float to_f32(uint16_t x) { return bf16_to_f32(x); }
HEADS_INLINE void from_f32(float x, float* p) { *p = x; }
HEADS_INLINE void from_f32(float x, uint16_t* p) { *p = f32_to_bf16(x); }

struct Setup {
  const SdpaProblem& pb;
  const void *q, *k, *v;
  int64_t qs[3], ks[3], vs[3];
  const float *k_scale, *v_scale;  // int8 K / V: f32 [B, Hkv, Lk] (strides kss, vss); else null
  int64_t kss[3], vss[3];
  int64_t rows, Dp, Dvp;  // query rows per kv head; D and Dv padded to whole vectors
  int64_t chunk, n_chunks;
  int64_t head(int64_t r) const { return r / pb.Lq; }  // within the group
  int64_t pos(int64_t r) const { return r % pb.Lq; }
  // The scales of (b, hk)'s keys / values (stride kss[2] / vss[2] along the keys); null when not int8.
  const float* key_scales(int64_t b, int64_t hk) const { return k_scale ? k_scale + b * kss[0] + hk * kss[1] : nullptr; }
  const float* value_scales(int64_t b, int64_t hk) const {
    return v_scale ? v_scale + b * vss[0] + hk * vss[1] : nullptr;
  }
};

// Partial sums (one vector) of the dot product of a K row with a padded, pre-scaled query row.
template <class T>
HEADS_INLINE VR dot_partial(const T* kj, const float* qr, int64_t D) {
  VR a0 = Vec::zero(), a1 = Vec::zero();
  int64_t d = 0;
  for (; d + 2 * kW <= D; d += 2 * kW) {
    a0 = Vec::fma(load_row(kj + d), Vec::load(qr + d), a0);
    a1 = Vec::fma(load_row(kj + d + kW), Vec::load(qr + d + kW), a1);
  }
  if (d + kW <= D) {
    a0 = Vec::fma(load_row(kj + d), Vec::load(qr + d), a0);
    d += kW;
  }
  if (d < D) a1 = Vec::fma(load_row_partial(kj + d, D - d), Vec::load(qr + d), a1);
  return Vec::add(a0, a1);
}

// dot_partial for D = NV vectors exactly, unrolled (no loop or tail per key), with the same sums
// in the same order (the same bits): the common head dims. NV = 0: any D (dot_partial itself).
template <int NV, class T>
HEADS_INLINE VR dot_fixed(const T* kj, const float* qr, int64_t D) {
  if constexpr (NV == 0) {
    return dot_partial(kj, qr, D);
  } else {
    VR a0 = Vec::fma(load_row(kj), Vec::load(qr), Vec::zero());
    VR a1 = NV > 1 ? Vec::fma(load_row(kj + kW), Vec::load(qr + kW), Vec::zero()) : Vec::zero();
#pragma GCC unroll 16
    for (int c = 2; c + 1 < NV; c += 2) {
      a0 = Vec::fma(load_row(kj + c * kW), Vec::load(qr + c * kW), a0);
      a1 = Vec::fma(load_row(kj + (c + 1) * kW), Vec::load(qr + (c + 1) * kW), a1);
    }
    if constexpr (NV > 2 && NV % 2 == 1) a0 = Vec::fma(load_row(kj + (NV - 1) * kW), Vec::load(qr + (NV - 1) * kW), a0);
    return Vec::add(a0, a1);
  }
}

// A query row for int8 keys through VNNI (vpdpbusd), where the build has it (HEADS_VNNI_KEYS) and
// the CPU too: the row, scaled as pack_queries leaves it, rounded to 24-bit integers q24 = q / s
// (s = max |q| / kQ24Max, to nearest even: 2^-24 of the row's largest element, f32's precision)
// and cut into three signed bytes, q24 = hi·2^16 + mid·2^8 + lo. vpdpbusd multiplies unsigned by
// signed bytes, so a key's bytes enter as k + 128 (k xor 0x80) and the bias's share, 128·Σ digit,
// is taken off. Every sum is exact in int32 for D <= 128; q·k = ((H·2^16) + ML)·s in f32 (two
// roundings), H = Σ k·hi, ML = 256·Σ k·mid + Σ k·lo. Three vpdpbusd per 64 bytes of a key take
// the place of 3 · 4 f32 vector operations (widen, convert, FMA).
struct QDigits {
  const int8_t* d = nullptr;  // [3][128] bytes: hi, mid, lo, zero past D; null: f32 dot products
  int32_t corr_hi = 0, corr_ml = 0;  // 128·Σ hi, 128·(256·Σ mid + Σ lo)
  float scale = 0.0f;                // s
};
constexpr int32_t kQ24Max = 127 * 65536 + 127 * 256 + 127;  // the largest q24 whose digits all fit a signed byte
constexpr int64_t kDigitsMaxD = 128;                         // beyond it the sums may leave int32

// Digits of the row q [D] (D <= kDigitsMaxD) into dst [3][128].
inline QDigits pack_digits(const float* q, int64_t D, int8_t* dst) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(q[d]));
  const float inv = amax > 0.0f ? static_cast<float>(kQ24Max) / amax : 0.0f;
  std::memset(dst, 0, 3 * kDigitsMaxD);
  int32_t sum[3] = {};
  for (int64_t d = 0; d < D; ++d) {
    const auto x = static_cast<int32_t>(std::clamp(std::nearbyint(q[d] * inv), -float{kQ24Max}, float{kQ24Max}));
    const int32_t lo = ((x + 128) & 255) - 128, x1 = (x - lo) / 256;
    const int32_t mid = ((x1 + 128) & 255) - 128, hi = (x1 - mid) / 256;
    dst[d] = static_cast<int8_t>(hi);
    dst[kDigitsMaxD + d] = static_cast<int8_t>(mid);
    dst[2 * kDigitsMaxD + d] = static_cast<int8_t>(lo);
    sum[0] += hi;
    sum[1] += mid;
    sum[2] += lo;
  }
  return QDigits{dst, 128 * sum[0], 128 * (256 * sum[1] + sum[2]), amax / static_cast<float>(kQ24Max)};
}

#ifdef HEADS_VNNI_KEYS
inline bool digits_usable(const SdpaProblem& pb) {
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  return vnni && pb.D <= kDigitsMaxD;
}

// The 16 lanes' sums of a[0..15] (lane u: Σ a[u]), exact int32; Vec::reduce_lanes's network.
HEADS_INLINE __m512i reduce_lanes_i32(const __m512i* a) {
  const auto sh = [](__m512i x, __m512i y, auto imm) {
    return _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(y), decltype(imm)::value));
  };
  __m512i s[8], t[4], w[2];
  for (int p = 0; p < 8; ++p) {
    s[p] = _mm512_add_epi32(_mm512_shuffle_i32x4(a[2 * p], a[2 * p + 1], 0x44), _mm512_shuffle_i32x4(a[2 * p], a[2 * p + 1], 0xEE));
  }
  for (int r = 0; r < 4; ++r) {
    t[r] = _mm512_add_epi32(_mm512_shuffle_i32x4(s[2 * r], s[2 * r + 1], 0x88), _mm512_shuffle_i32x4(s[2 * r], s[2 * r + 1], 0xDD));
  }
  for (int m = 0; m < 2; ++m) {
    w[m] = _mm512_add_epi32(sh(t[2 * m], t[2 * m + 1], std::integral_constant<int, 0x44>{}),
                            sh(t[2 * m], t[2 * m + 1], std::integral_constant<int, 0xEE>{}));
  }
  const __m512i z = _mm512_add_epi32(sh(w[0], w[1], std::integral_constant<int, 0x88>{}),
                                     sh(w[0], w[1], std::integral_constant<int, 0xDD>{}));
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
// q·k (log2 units, before the keys' scales) of 16 int8 keys at kg (stride kst) against q's digits.
__attribute__((noinline)) inline __m512 key_digit_scores(const int8_t* kg, int64_t kst, const QDigits& q, int64_t D) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const __mmask64 m0 = D >= 64 ? ~__mmask64{0} : (__mmask64{1} << D) - 1;
  __m512i H[16], ML[16];
  const __m512i h0 = _mm512_load_si512(q.d), mi0 = _mm512_load_si512(q.d + kDigitsMaxD),
                l0 = _mm512_load_si512(q.d + 2 * kDigitsMaxD);
  if (D > 64) {
    const __mmask64 m1 = D >= 128 ? ~__mmask64{0} : (__mmask64{1} << (D - 64)) - 1;
    const __m512i h1 = _mm512_load_si512(q.d + 64), mi1 = _mm512_load_si512(q.d + kDigitsMaxD + 64),
                  l1 = _mm512_load_si512(q.d + 2 * kDigitsMaxD + 64);
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) {
      const int8_t* kj = kg + u * kst;
      const __m512i k0 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m0, kj), bias);
      const __m512i k1 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m1, kj + 64), bias);
      const __m512i z = _mm512_setzero_si512();
      const __m512i h = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, k0, h0), k1, h1);
      const __m512i mi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, k0, mi0), k1, mi1);
      const __m512i l = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, k0, l0), k1, l1);
      H[u] = h;
      ML[u] = _mm512_add_epi32(_mm512_slli_epi32(mi, 8), l);
    }
  } else {
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) {
      const __m512i k0 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m0, kg + u * kst), bias);
      const __m512i z = _mm512_setzero_si512();
      H[u] = _mm512_dpbusd_epi32(z, k0, h0);
      ML[u] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(z, k0, mi0), 8), _mm512_dpbusd_epi32(z, k0, l0));
    }
  }
  // (the bias's 128·(k + 128) products past D are 128·0: the digits are zero there)
  const __m512i hs = _mm512_sub_epi32(reduce_lanes_i32(H), _mm512_set1_epi32(q.corr_hi));
  const __m512i ms = _mm512_sub_epi32(reduce_lanes_i32(ML), _mm512_set1_epi32(q.corr_ml));
  const __m512 x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hs), _mm512_set1_ps(65536.0f), _mm512_cvtepi32_ps(ms));
  return _mm512_mul_ps(x, _mm512_set1_ps(q.scale));
}
#pragma GCC pop_options
#endif  // HEADS_VNNI_KEYS

// x = q·k of a group of 16 visible int8 keys by their digits, where the build, the CPU and the row
// have them (qd.d); else false, and the caller takes the f32 dot products.
template <class T>
HEADS_INLINE bool digit_group([[maybe_unused]] const T* kg, [[maybe_unused]] int64_t kst,
                              [[maybe_unused]] const QDigits& qd, [[maybe_unused]] int64_t D, [[maybe_unused]] bool whole,
                              [[maybe_unused]] VR& x) {
#ifdef HEADS_VNNI_KEYS
  if constexpr (std::is_same_v<T, int8_t>) {
    if (whole && qd.d != nullptr) {
      x = key_digit_scores(kg, kst, qd, D);
      return true;
    }
  }
#endif
  return false;
}

// Scores (log2 units) of query row (h, i) against keys [j0, j0 + nk), nk <= kBlock, into
// sr[0, kBlock): masked and causal-hidden keys and the entries past nk are -inf. NV: D in vectors
// when it is one of the unrolled sizes, else 0. qd: the row's digits for int8 keys (QDigits), or none.
// sr[pre[0], pre[1]) (whole groups, visible to the row) already holds q·k (rows_dots).
template <int NV, class T>
inline void row_scores_n(const Setup& S, const T* kh, const float* ksc, const float* qr, int64_t b, int64_t h,
                         int64_t i, int64_t j0, int64_t nk, float* sr, const QDigits& qd, const int64_t* pre) {
  const SdpaProblem& pb = S.pb;
  // The band hides a prefix and a suffix of the block: only keys [j0 + nb, j0 + nv) are computed.
  const int64_t nv = std::clamp<int64_t>(pb.key_end(i) - j0, 0, nk);
  const int64_t nb = std::clamp<int64_t>(pb.key_begin(i) - j0, 0, nv);
  const int64_t kst = S.ks[2];
  for (int64_t g = 0; g < kBlock; g += kW) {
    if (g >= nv || g + kW <= nb) {
      Vec::store(sr + g, Vec::set1(-kInf));
      continue;
    }
    const bool whole = g >= nb && g + kW <= nv;  // every key of the group visible
    const T* kg = kh + (j0 + g) * kst;
    VR x;
    if (g >= pre[0] && g + kW <= pre[1]) {  // q·k already there (rows_dots)
      x = Vec::load(sr + g);
    } else if (!digit_group(kg, kst, qd, pb.D, whole, x)) {
      VR part[kW];
      if (whole) {
#pragma GCC unroll 16
        for (int u = 0; u < kW; ++u) part[u] = dot_fixed<NV>(kg + u * kst, qr, pb.D);
      } else {
        for (int u = 0; u < kW; ++u) {
          part[u] = g + u < nv && g + u >= nb ? dot_fixed<NV>(kg + u * kst, qr, pb.D) : Vec::zero();
        }
      }
      x = Vec::reduce_lanes(part);
    }
    if (whole) {
      if (ksc != nullptr && S.kss[2] == 1) x = Vec::mul(x, Vec::loadu(ksc + j0 + g));  // int8: times the scales
      Vec::store(sr + g, x);
      if (ksc != nullptr && S.kss[2] != 1) {
        for (int64_t u = g; u < g + kW; ++u) sr[u] *= ksc[(j0 + u) * S.kss[2]];
      }
      continue;
    }
    Vec::store(sr + g, x);
    for (int64_t u = g; u < std::min(nb, g + kW); ++u) sr[u] = -kInf;  // before nb
    for (int64_t u = std::max(g, nv); u < g + kW; ++u) sr[u] = -kInf;  // past nv
    if (ksc != nullptr) {  // int8 keys: q·k_j times the key's scale
      for (int64_t u = std::max(g, nb); u < std::min(nv, g + kW); ++u) sr[u] *= ksc[(j0 + u) * S.kss[2]];
    }
  }
  if (pb.mods.any()) {
    for (int64_t u = nb; u < nv; ++u) sr[u] = mod_score_log2(pb, b, h, i, j0 + u, sr[u]);
  }
}

// q·k (log2 units, before int8 key scales) of R query rows (qr, stride Dp) against the 16 keys at kg,
// into s[r·kBlock, + kW): each key vector widened once for the R rows, each row's sums those of
// dot_fixed (the same bits).
template <int R, int NV, class T>
HEADS_INLINE void rows_dots16(const T* kg, int64_t kst, const float* qr, int64_t Dp, float* s) {
  VR part[R][kW];
#pragma GCC unroll 16
  for (int u = 0; u < kW; ++u) {
    const T* kj = kg + u * kst;
    VR kv[NV];
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) kv[c] = load_row(kj + c * kW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float* q = qr + r * Dp;
      VR a0 = Vec::fma(kv[0], Vec::load(q), Vec::zero());
      VR a1 = Vec::fma(kv[1], Vec::load(q + kW), Vec::zero());
#pragma GCC unroll 16
      for (int c = 2; c + 1 < NV; c += 2) {
        a0 = Vec::fma(kv[c], Vec::load(q + c * kW), a0);
        a1 = Vec::fma(kv[c + 1], Vec::load(q + (c + 1) * kW), a1);
      }
      part[r][u] = Vec::add(a0, a1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) Vec::store(s + r * kBlock, Vec::reduce_lanes(part[r]));
}

// rows_dots16 over the groups [g0, g1) of a block, rows [0, rows) in passes of up to kDotRows.
constexpr int kDotRows = kW >= 16 ? 4 : 2;
template <int NV, class T>
inline void rows_dots(const T* kh, int64_t kst, const float* qp, int64_t Dp, int64_t rows, int64_t g0, int64_t g1, float* s) {
  static_assert(NV % 2 == 0);
  for (int64_t r = 0; r < rows; r += kDotRows) {
    for (int64_t g = g0; g < g1; g += kW) {
      const T* kg = kh + g * kst;
      float* sg = s + r * kBlock + g;
      const float* q = qp + r * Dp;
      if constexpr (kDotRows >= 4) {
        if (rows - r >= 4) {
          rows_dots16<4, NV>(kg, kst, q, Dp, sg);
          continue;
        }
        if (rows - r == 3) {
          rows_dots16<3, NV>(kg, kst, q, Dp, sg);
          continue;
        }
      }
      if (rows - r >= 2) {
        rows_dots16<2, NV>(kg, kst, q, Dp, sg);
      } else {
        rows_dots16<1, NV>(kg, kst, q, Dp, sg);
      }
    }
  }
}

// The groups of a block's keys [j0, j0 + nk) visible to every row of (b, hk) (the intersection of
// their bands, in whole groups of kW) get their q·k for all rows at once; returns them as
// [pre[0], pre[1]) (empty where D is not unrolled, or a single row).
template <class T>
inline void group_dots(const Setup& S, const T* kh, const float* qp, int64_t j0, int64_t nk, float* s, int64_t* pre) {
  const SdpaProblem& pb = S.pb;
  pre[0] = pre[1] = 0;
  const int64_t nvec = pb.D % kW == 0 ? pb.D / kW : 0;
  if (S.rows < 2 || (nvec != 2 && nvec != 4 && nvec != 8 && nvec != 16)) return;
  int64_t lo = 0, hi = nk;
  for (int64_t i = 0; i < pb.Lq; ++i) {
    lo = std::max(lo, std::clamp<int64_t>(pb.key_begin(i) - j0, 0, nk));
    hi = std::min(hi, std::clamp<int64_t>(pb.key_end(i) - j0, 0, nk));
  }
  const int64_t g0 = round_up(lo, kW), g1 = hi / kW * kW;
  if (g0 >= g1) return;
  const T* kb = kh + j0 * S.ks[2];
  switch (nvec) {
    case 2: rows_dots<2>(kb, S.ks[2], qp, S.Dp, S.rows, g0, g1, s); break;
    case 4: rows_dots<4>(kb, S.ks[2], qp, S.Dp, S.rows, g0, g1, s); break;
    case 8: rows_dots<8>(kb, S.ks[2], qp, S.Dp, S.rows, g0, g1, s); break;
    default: rows_dots<16>(kb, S.ks[2], qp, S.Dp, S.rows, g0, g1, s); break;
  }
  pre[0] = g0;
  pre[1] = g1;
}

template <class T>
inline void row_scores(const Setup& S, const T* kh, const float* ksc, const float* qr, int64_t b, int64_t h,
                       int64_t i, int64_t j0, int64_t nk, float* sr, const QDigits& qd, const int64_t* pre) {
  const int64_t nvec = S.pb.D % kW == 0 ? S.pb.D / kW : 0;
  switch (nvec) {  // unrolled for the head dims of the usual models: D 64 and 128 (and 32 on AVX-512)
    case 2: return row_scores_n<2>(S, kh, ksc, qr, b, h, i, j0, nk, sr, qd, pre);
    case 4: return row_scores_n<4>(S, kh, ksc, qr, b, h, i, j0, nk, sr, qd, pre);
    case 8: return row_scores_n<8>(S, kh, ksc, qr, b, h, i, j0, nk, sr, qd, pre);
    case 16: return row_scores_n<16>(S, kh, ksc, qr, b, h, i, j0, nk, sr, qd, pre);
    default: return row_scores_n<0>(S, kh, ksc, qr, b, h, i, j0, nk, sr, qd, pre);
  }
}

// O row += sum_j p[j] · V[j] for nk keys, the row held in NV registers.
template <int NV, class T>
HEADS_INLINE void pv_row_regs(const T* vh, int64_t vs, const float* p, int64_t nk, int64_t Dv,
                              float* orow) {
  VR acc[NV];
#pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) acc[c] = Vec::load(orow + c * kW);
  const int64_t tail = Dv - (NV - 1) * kW;  // lanes used in the last vector
  for (int64_t j = 0; j < nk; ++j) {
    // Hidden keys (p = 0) are skipped: a value there may be inf or NaN. int8 values are finite, and
    // without the test the broadcast reads p[j] from memory instead of taking a shuffle port.
    if constexpr (!std::is_same_v<T, int8_t>) {
      if (p[j] == 0.0f) continue;
    }
    const VR pv = Vec::set1(p[j]);
    const T* vj = vh + j * vs;
#pragma GCC unroll 16
    for (int c = 0; c < NV - 1; ++c) acc[c] = Vec::fma(pv, load_row(vj + c * kW), acc[c]);
    const T* vl = vj + (NV - 1) * kW;
    acc[NV - 1] = Vec::fma(pv, tail == kW ? load_row(vl) : load_row_partial(vl, tail), acc[NV - 1]);
  }
#pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) Vec::store(orow + c * kW, acc[c]);
}

template <int NV, class T>
HEADS_INLINE bool pv_row_dispatch(int64_t nv, const T* vh, int64_t vs, const float* p,
                                  int64_t nk, int64_t Dv, float* orow) {
  if constexpr (NV > 0) {
    if (nv == NV) {
      pv_row_regs<NV>(vh, vs, p, nk, Dv, orow);
      return true;
    }
    return pv_row_dispatch<NV - 1>(nv, vh, vs, p, nk, Dv, orow);
  }
  return false;
}

template <class T>
inline void pv_row(const T* vh, int64_t vs, const float* p, int64_t nk, int64_t Dv, float* orow) {
  const int64_t nv = (Dv + kW - 1) / kW;
  if (pv_row_dispatch<256 / kW>(nv, vh, vs, p, nk, Dv, orow)) return;
  for (int64_t j = 0; j < nk; ++j) {  // wide heads: accumulate through memory
    if (p[j] == 0.0f) continue;
    const VR pv = Vec::set1(p[j]);
    const T* vj = vh + j * vs;
    int64_t d = 0;
    for (; d + kW <= Dv; d += kW) Vec::store(orow + d, Vec::fma(pv, load_row(vj + d), Vec::load(orow + d)));
    if (d < Dv) Vec::store(orow + d, Vec::fma(pv, load_row_partial(vj + d, Dv - d), Vec::load(orow + d)));
  }
}

// O rows += sum_j p_r[j] · V[j] for R query rows at once (a GQA group's, or a few positions'),
// Dv in chunks of NC vectors: each value vector is widened once for the R rows instead of once per
// row. Rows r: p + r·kBlock, o + r·Dvp. Per row and element the FMAs of pv_row in its order (the
// same bits). lanes_last: lanes of the chunk's last vector (kW if whole).
template <int R, int NC, class T>
HEADS_INLINE void pv_rows_chunk(const T* vh, int64_t vs, const float* p, int64_t nk, int64_t d0, int64_t lanes_last,
                                float* o, int64_t Dvp) {
  VR acc[R][NC];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) acc[r][c] = Vec::load(o + r * Dvp + d0 + c * kW);
  }
  for (int64_t j = 0; j < nk; ++j) {
    const T* vj = vh + j * vs + d0;
    VR v[NC];
#pragma GCC unroll 16
    for (int c = 0; c < NC - 1; ++c) v[c] = load_row(vj + c * kW);
    v[NC - 1] = lanes_last == kW ? load_row(vj + (NC - 1) * kW) : load_row_partial(vj + (NC - 1) * kW, lanes_last);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if constexpr (!std::is_same_v<T, int8_t>) {  // as pv_row: hidden keys' values may be inf or NaN
        if (p[r * kBlock + j] == 0.0f) continue;
      }
      const VR pv = Vec::set1(p[r * kBlock + j]);
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) acc[r][c] = Vec::fma(pv, v[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) Vec::store(o + r * Dvp + d0 + c * kW, acc[r][c]);
  }
}

constexpr int kPvRows = kW >= 16 ? 4 : 2;  // rows per pass: R·4 accumulators + 4 values in the registers

template <int R, class T>
inline void pv_rows(const T* vh, int64_t vs, const float* p, int64_t nk, int64_t Dv, float* o, int64_t Dvp) {
  int64_t d0 = 0;
  for (; d0 + 4 * kW <= Dv; d0 += 4 * kW) pv_rows_chunk<R, 4>(vh, vs, p, nk, d0, kW, o, Dvp);
  for (; d0 < Dv; d0 += kW) pv_rows_chunk<R, 1>(vh, vs, p, nk, d0, std::min<int64_t>(kW, Dv - d0), o, Dvp);
}

// rows (2 <= rows <= kPvRows) of P·V at once.
template <class T>
inline void pv_rows_n(int64_t rows, const T* vh, int64_t vs, const float* p, int64_t nk, int64_t Dv, float* o, int64_t Dvp) {
  if constexpr (kPvRows >= 4) {
    if (rows == 4) return pv_rows<4>(vh, vs, p, nk, Dv, o, Dvp);
    if (rows == 3) return pv_rows<3>(vh, vs, p, nk, Dv, o, Dvp);
  }
  pv_rows<2>(vh, vs, p, nk, Dv, o, Dvp);
}

// Scaled (log2 units), masked score of row r against key j (the weights sweep).
template <class T>
HEADS_INLINE float score(const Setup& S, const T* kh, const float* ksc, const float* qrow, int64_t b, int64_t h,
                         int64_t i, int64_t j) {
  const SdpaProblem& pb = S.pb;
  if (!pb.visible(i, j)) return -kInf;
  float t = Vec::reduce_add(dot_partial(kh + j * S.ks[2], qrow, pb.D));
  if (ksc != nullptr) t *= ksc[j * S.kss[2]];
  return mod_score_log2(pb, b, h, i, j, t);
}

// Packs the query rows of (b, hk) as [rows][Dp], times scale·log2(e), zero padded.
template <class T>
inline void pack_queries(const Setup& S, int64_t b, int64_t hk, float* qp) {
  const SdpaProblem& pb = S.pb;
  const float c = static_cast<float>(pb.scale) * kLog2e;
  for (int64_t r = 0; r < S.rows; ++r) {
    const int64_t h = hk * pb.group() + S.head(r);
    const T* src = static_cast<const T*>(S.q) + b * S.qs[0] + h * S.qs[1] + S.pos(r) * S.qs[2];
    for (int64_t d = 0; d < S.Dp; ++d) qp[r * S.Dp + d] = d < pb.D ? to_f32(src[d]) * c : 0.0f;
  }
}

// Partial attention of every row of (b, hk) over keys [j0, j1): m, l, O (unnormalised).
// digits: [rows] QDigits and [rows][3][128] bytes of scratch where int8 keys go through VNNI, else null.
template <class TQ, class T>
inline void chunk(const Setup& S, int64_t b, int64_t hk, int64_t j0, int64_t j1, float* qp,
                  float* s, float* m, float* l, float* o, QDigits* digits) {
  const SdpaProblem& pb = S.pb;
  const T* kh = static_cast<const T*>(S.k) + b * S.ks[0] + hk * S.ks[1];
  const T* vh = static_cast<const T*>(S.v) + b * S.vs[0] + hk * S.vs[1];
  const float* ksc = S.key_scales(b, hk);
  const float* vsc = S.value_scales(b, hk);
  const float keep_scale = dropout_keep_scale(pb.dropout_p);
  pack_queries<TQ>(S, b, hk, qp);
  const QDigits none;
  if (digits != nullptr) {
    auto* bytes = reinterpret_cast<int8_t*>(reinterpret_cast<float*>(digits) + round_up(S.rows * 6, 16));
    for (int64_t r = 0; r < S.rows; ++r) digits[r] = pack_digits(qp + r * S.Dp, pb.D, bytes + r * 3 * kDigitsMaxD);
  }
  for (int64_t r = 0; r < S.rows; ++r) {
    m[r] = -kInf;
    l[r] = 0.0f;
  }
  std::fill(o, o + S.rows * S.Dvp, 0.0f);
  for (int64_t b0 = j0; b0 < j1; b0 += kBlock) {
    const int64_t nk = std::min(kBlock, j1 - b0);
    if (b0 + nk <= pb.key_begin(0) || b0 >= pb.key_end(pb.Lq - 1)) continue;  // outside every row's band
    if (pb.mods.blocked()) {  // no row's block of the layout reaches these keys
      bool any = false;
      for (int64_t h = hk * pb.group(); h < (hk + 1) * pb.group() && !any; ++h) {
        any = pb.mods.blocks_any(h, 0, pb.Lq, b0, b0 + nk);
      }
      if (!any) continue;
    }
    // 1. S = q K_j^T (+ mask), one row per query; the keys every row sees for all rows at once,
    // where int8 keys do not go through VNNI digits
    int64_t pre[2] = {0, 0};
    if (digits == nullptr) group_dots(S, kh, qp, b0, nk, s, pre);
    for (int64_t r = 0; r < S.rows; ++r) {
      const int64_t h = hk * pb.group() + S.head(r);
      row_scores(S, kh, ksc, qp + r * S.Dp, b, h, S.pos(r), b0, nk, s + r * kBlock,
                 digits != nullptr ? digits[r] : none, pre);
    }
    // 2-3. online softmax per row
    for (int64_t r = 0; r < S.rows; ++r) {
      float* sr = s + r * kBlock;
      VR mxv = Vec::set1(-kInf);
      // max(x, m) is m where x is NaN: m stays free of NaN (a NaN score reaches l and O through its
      // P), and the lanes' maximum is a tree, not a chain of 16 dependent scalar maxima.
      for (int64_t jj = 0; jj < kBlock; jj += kW) mxv = Vec::max(Vec::load(sr + jj), mxv);
      const float mx = Vec::reduce_max(mxv);
      const float m_new = std::max(m[r], mx);
      const float m_safe = m_new == -kInf ? 0.0f : m_new;  // nothing visible yet: P = 0
      VR sum = Vec::zero();
      const VR mv = Vec::set1(m_safe);
      for (int64_t jj = 0; jj < kBlock; jj += kW) {
        const VR p = Vec::exp2(Vec::sub(Vec::load(sr + jj), mv));
        sum = Vec::add(sum, p);
        Vec::store(sr + jj, p);
      }
      const float alpha = m[r] == -kInf ? 0.0f : std::exp2(m[r] - m_safe);
      l[r] = l[r] * alpha + Vec::reduce_add(sum);
      m[r] = m_new;
      if (alpha != 1.0f) {
        const VR av = Vec::set1(alpha);
        float* orow = o + r * S.Dvp;
        for (int64_t d = 0; d < S.Dvp; d += kW) Vec::store(orow + d, Vec::mul(Vec::load(orow + d), av));
      }
      if (pb.dropout_p > 0.0) {
        const int64_t h = hk * pb.group() + S.head(r);
        for (int64_t jj = 0; jj < nk; ++jj) {
          const bool keep = dropout_keep(pb.seed, dropout_index(pb, b, h, S.pos(r), b0 + jj), pb.dropout_p);
          sr[jj] = keep ? sr[jj] * keep_scale : 0.0f;
        }
      }
    }
    // 4. O += P V_j (int8 values: P times each value's scale, in place), up to kPvRows rows at once
    if (vsc != nullptr) {
      for (int64_t r = 0; r < S.rows; ++r) {
        float* pr = s + r * kBlock;
        int64_t jj = 0;
        if (S.vss[2] == 1) {
          for (; jj + kW <= nk; jj += kW) Vec::store(pr + jj, Vec::mul(Vec::load(pr + jj), Vec::loadu(vsc + b0 + jj)));
        }
        for (; jj < nk; ++jj) pr[jj] *= vsc[(b0 + jj) * S.vss[2]];
      }
    }
    for (int64_t r = 0; r < S.rows;) {
      const int64_t n = std::min<int64_t>(kPvRows, S.rows - r);
      if (n == 1) {
        pv_row(vh + b0 * S.vs[2], S.vs[2], s + r * kBlock, nk, pb.Dv, o + r * S.Dvp);
      } else {
        pv_rows_n(n, vh + b0 * S.vs[2], S.vs[2], s + r * kBlock, nk, pb.Dv, o + r * S.Dvp, S.Dvp);
      }
      r += n;
    }
  }
}

// Weights of every row of (b, hk) for keys [j0, j1), from the final lse (log2 units, +inf for
// rows that see nothing).
template <class TQ, class T>
inline void weights_chunk(const Setup& S, int64_t b, int64_t hk, int64_t j0, int64_t j1, float* qp,
                          const float* lse2, float* w) {
  const SdpaProblem& pb = S.pb;
  const T* kh = static_cast<const T*>(S.k) + b * S.ks[0] + hk * S.ks[1];
  const float* ksc = S.key_scales(b, hk);
  const float keep_scale = dropout_keep_scale(pb.dropout_p);
  pack_queries<TQ>(S, b, hk, qp);
  for (int64_t r = 0; r < S.rows; ++r) {
    const int64_t h = hk * pb.group() + S.head(r), i = S.pos(r);
    float* wrow = w + ((b * pb.H + h) * pb.Lq + i) * pb.Lk;
    for (int64_t j = j0; j < j1; ++j) {
      float x = std::exp2(score(S, kh, ksc, qp + r * S.Dp, b, h, i, j) - lse2[r]);
      if (pb.dropout_p > 0.0) {
        x = dropout_keep(pb.seed, dropout_index(pb, b, h, i, j), pb.dropout_p) ? x * keep_scale : 0.0f;
      }
      wrow[j] = x;
    }
  }
}

// The partial states of the chunks of one (b, hk): m, l [chunk][rows] and O [chunk][rows][Dvp].
struct Partials {
  const float *m, *l, *o;
};

// Merges the chunks' states of every row of (b, hk) into out and lse: m = max m_c,
// l = sum l_c 2^(m_c - m), O = sum O_c 2^(m_c - m); O /= l; lse = ln 2 · (m + log2 l). A chunk that saw
// no key has l = 0; one with a NaN score has l = NaN, which spreads to l and O here. No key seen at
// all: zeros, lse = -inf. acc: [Dv] floats of this thread's scratch.
template <class T>
inline void merge_chunks(const Setup& S, int64_t b, int64_t hk, const Partials& part, float* acc, T* out_p,
                         const int64_t* os, float* lse_p) {
  const SdpaProblem& pb = S.pb;
  for (int64_t r = 0; r < S.rows; ++r) {
    const int64_t h = hk * pb.group() + S.head(r), i = S.pos(r);
    // A sink is one more partial state: m = sink, l = 1, O = 0.
    const float sink2 = pb.sink_log2(h);
    float m = sink2;
    for (int64_t c = 0; c < S.n_chunks; ++c) m = std::max(m, part.m[c * S.rows + r]);
    for (int64_t d = 0; d < pb.Dv; ++d) acc[d] = 0.0f;
    float l = sink2 != -kInf ? std::exp2(sink2 - m) : 0.0f;  // (a -inf sink is no term at all)
    for (int64_t c = 0; c < S.n_chunks; ++c) {
      if (part.l[c * S.rows + r] == 0.0f) continue;
      const float f = std::exp2(part.m[c * S.rows + r] - m);
      l += part.l[c * S.rows + r] * f;
      const float* oc = part.o + (c * S.rows + r) * S.Dvp;
      for (int64_t d = 0; d < pb.Dv; ++d) acc[d] += oc[d] * f;
    }
    const float inv = l != 0.0f ? 1.0f / l : 0.0f;
    T* orow = out_p + b * os[0] + h * os[1] + i * os[2];
    for (int64_t d = 0; d < pb.Dv; ++d) from_f32(acc[d] * inv, orow + d);
    lse_p[(b * pb.H + h) * pb.Lq + i] = l != 0.0f ? (m + std::log2(l)) * kLn2 : -kInf;
  }
}

}  // namespace dec

// T: q and out (float or bf16 bits); TKV: k and v (float, bf16 bits or int8 with pb's scales).
template <class T, class TKV = T>
inline void sdpa_decode(const SdpaProblem& pb, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const Tensor& weights) {
  using namespace dec;
  if (pb.B == 0 || pb.H == 0 || pb.Lq == 0) return;
  Setup S{pb, q.raw_data(), k.raw_data(), v.raw_data(), {}, {}, {}, nullptr, nullptr, {}, {}, 0, 0, 0, 0, 0};
  for (int d = 0; d < 3; ++d) {
    S.qs[d] = q.stride(d);
    S.ks[d] = k.stride(d);
    S.vs[d] = v.stride(d);
  }
  if constexpr (std::is_same_v<TKV, int8_t>) {
    S.k_scale = pb.k_scale.data<float>();
    S.v_scale = pb.v_scale.data<float>();
    for (int d = 0; d < 3; ++d) {
      S.kss[d] = pb.k_scale.stride(d);
      S.vss[d] = pb.v_scale.stride(d);
    }
  }
  S.rows = pb.group() * pb.Lq;
  S.Dp = round_up(pb.D, kW);
  S.Dvp = round_up(pb.Dv, kW);
  const int64_t heads = pb.B * pb.Hkv;
  // Split keys only while there are too few (b, hk) pairs; a function of the shape alone.
  const DecodeChunks chunks = decode_key_chunks(pb, kBlock);
  S.chunk = chunks.chunk;
  S.n_chunks = chunks.n;
  const int64_t n_tasks = heads * S.n_chunks;
  // Partial states per task: m, l [rows], O [rows][Dvp].
  std::vector<float> pm(static_cast<size_t>(n_tasks * S.rows)), pl(pm.size());
  std::vector<float> po(static_cast<size_t>(n_tasks * S.rows * S.Dvp + 16));
  float* po_base = po.data() + (16 - (reinterpret_cast<uintptr_t>(po.data()) / 4) % 16) % 16;
  const int n_threads = threads_for(2.0 * static_cast<double>(pb.B * pb.H * pb.Lq) * static_cast<double>(pb.Lk) *
                                        static_cast<double>(pb.D + pb.Dv), n_tasks);
  bool use_digits = false;  // int8 keys through VNNI (QDigits)
#ifdef HEADS_VNNI_KEYS
  if constexpr (std::is_same_v<TKV, int8_t>) use_digits = digits_usable(pb);
#endif
  static_assert(sizeof(QDigits) == 24 && alignof(QDigits) <= 8);
  // QDigits [rows] (24 bytes each) and their bytes [rows][3][128], 64-byte aligned after them
  const int64_t digit_floats = use_digits ? round_up(S.rows * 6, 16) + S.rows * 96 : 0;
  const int64_t per = round_up(S.rows * S.Dp + S.rows * kBlock + S.Dvp, 16) + digit_floats;
  float* arena = thread_scratch(per * n_threads);
  float* lse_p = lse.data<float>();
  T* out_p = static_cast<T*>(out.raw_data());
  const int64_t os[3] = {out.stride(0), out.stride(1), out.stride(2)};

#pragma omp parallel num_threads(n_threads)
  {
    float* qp = arena + per * omp_get_thread_num();
    float* sc = qp + S.rows * S.Dp;
    auto* digits = use_digits ? reinterpret_cast<QDigits*>(qp + per - digit_floats) : nullptr;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_tasks; ++t) {
      const int64_t bh = t / S.n_chunks, c = t % S.n_chunks;
      if (!pb.group_on(bh / pb.Hkv, bh % pb.Hkv)) continue;  // every head of the group off
      const int64_t j0 = c * S.chunk, j1 = std::min(pb.Lk, j0 + S.chunk);
      chunk<T, TKV>(S, bh / pb.Hkv, bh % pb.Hkv, j0, j1, qp, sc, pm.data() + t * S.rows,
            pl.data() + t * S.rows, po_base + t * S.rows * S.Dvp, digits);
    }
    // Merge the chunks of each (b, hk): O /= l; lse = ln 2 · (m + log2 l).
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < heads; ++bh) {
      if (!pb.group_on(bh / pb.Hkv, bh % pb.Hkv)) continue;
      const Partials part{pm.data() + bh * S.n_chunks * S.rows, pl.data() + bh * S.n_chunks * S.rows,
                          po_base + bh * S.n_chunks * S.rows * S.Dvp};
      merge_chunks<T>(S, bh / pb.Hkv, bh % pb.Hkv, part, sc + S.rows * kBlock, out_p, os, lse_p);
    }
    if (weights.defined()) {
      float* w = weights.data<float>();
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < n_tasks; ++t) {
        const int64_t bh = t / S.n_chunks, c = t % S.n_chunks;
        const int64_t b = bh / pb.Hkv, hk = bh % pb.Hkv;
        if (!pb.group_on(b, hk)) continue;
        float* lse2 = sc;  // [rows] in log2 units; +inf -> weight 0
        for (int64_t r = 0; r < S.rows; ++r) {
          const float x = lse_p[(b * pb.H + hk * pb.group() + S.head(r)) * pb.Lq + S.pos(r)];
          lse2[r] = x == -kInf ? kInf : x * kLog2e;
        }
        const int64_t j0 = c * S.chunk, j1 = std::min(pb.Lk, j0 + S.chunk);
        weights_chunk<T, TKV>(S, b, hk, j0, j1, qp, lse2, w);
      }
    }
  }
}
