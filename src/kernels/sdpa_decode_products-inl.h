// sdpa_decode_products-inl.h — the decode kernel's products of one block: q·k of a key row
// (dot_partial, dot_fixed), of int8 keys through VNNI (QDigits, key_digit_scores), of the rows of a
// kv head's group at once (rows_dots16, group_dots), and P·V (pv_row for one row, pv_rows for up to
// four). Included by sdpa_decode-inl.h inside its namespace dec, after Setup and the row loaders.

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

// Rows fetched into L2 (prefetcht1) ahead of their use, so that the memory never waits for a phase
// of the block: the block's values while q·k reads its keys (a group of 16 value rows per group of
// 16 keys), the next block's keys while P·V reads the values (a row per value row read). Without
// them each phase started its stream cold, and the softmax between them had no load in flight.
// decode4k on an AMD Zen 4 (134 MB of f32 K/V a call), 2 threads: 5.39 -> 4.37 ms with the keys
// alone in a quiet spell; the values too, on a busy host: f32 5.54 -> 4.94, bf16 2.68 -> 2.30.
struct Ahead {
  const char* base = nullptr;  // row j at base + j·stride, `bytes` long; rows [0, rows)
  int64_t stride = 0, bytes = 0, rows = 0;
  HEADS_INLINE void fetch(int64_t j) const {
    if (j >= rows) return;
    const char* r = base + j * stride;
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(r + c, 0, 2);
  }
};

// O row += sum_j p[j] · V[j] for nk keys, the row held in NV registers.
template <int NV, class T>
HEADS_INLINE void pv_row_regs(const T* vh, int64_t vs, const float* p, int64_t nk, int64_t Dv,
                              float* orow, const Ahead& ahead) {
  VR acc[NV];
#pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) acc[c] = Vec::load(orow + c * kW);
  const int64_t tail = Dv - (NV - 1) * kW;  // lanes used in the last vector
  for (int64_t j = 0; j < nk; ++j) {
    ahead.fetch(j);
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
                                  int64_t nk, int64_t Dv, float* orow, const Ahead& ahead) {
  if constexpr (NV > 0) {
    if (nv == NV) {
      pv_row_regs<NV>(vh, vs, p, nk, Dv, orow, ahead);
      return true;
    }
    return pv_row_dispatch<NV - 1>(nv, vh, vs, p, nk, Dv, orow, ahead);
  }
  return false;
}

template <class T>
inline void pv_row(const T* vh, int64_t vs, const float* p, int64_t nk, int64_t Dv, float* orow, const Ahead& ahead) {
  const int64_t nv = (Dv + kW - 1) / kW;
  if (pv_row_dispatch<256 / kW>(nv, vh, vs, p, nk, Dv, orow, ahead)) return;
  for (int64_t j = 0; j < nk; ++j) {  // wide heads: accumulate through memory
    ahead.fetch(j);
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
                                float* o, int64_t Dvp, const Ahead& ahead) {
  VR acc[R][NC];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) acc[r][c] = Vec::load(o + r * Dvp + d0 + c * kW);
  }
  for (int64_t j = 0; j < nk; ++j) {
    ahead.fetch(j);
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

// (the next block's keys fetched during the first chunk of Dv)
template <int R, class T>
inline void pv_rows(const T* vh, int64_t vs, const float* p, int64_t nk, int64_t Dv, float* o, int64_t Dvp,
                    const Ahead& ahead) {
  int64_t d0 = 0;
  for (; d0 + 4 * kW <= Dv; d0 += 4 * kW) pv_rows_chunk<R, 4>(vh, vs, p, nk, d0, kW, o, Dvp, d0 == 0 ? ahead : Ahead{});
  for (; d0 < Dv; d0 += kW) {
    pv_rows_chunk<R, 1>(vh, vs, p, nk, d0, std::min<int64_t>(kW, Dv - d0), o, Dvp, d0 == 0 ? ahead : Ahead{});
  }
}

// rows (2 <= rows <= kPvRows) of P·V at once.
template <class T>
inline void pv_rows_n(int64_t rows, const T* vh, int64_t vs, const float* p, int64_t nk, int64_t Dv, float* o, int64_t Dvp,
                      const Ahead& ahead) {
  if constexpr (kPvRows >= 4) {
    if (rows == 4) return pv_rows<4>(vh, vs, p, nk, Dv, o, Dvp, ahead);
    if (rows == 3) return pv_rows<3>(vh, vs, p, nk, Dv, o, Dvp, ahead);
  }
  pv_rows<2>(vh, vs, p, nk, Dv, o, Dvp, ahead);
}
