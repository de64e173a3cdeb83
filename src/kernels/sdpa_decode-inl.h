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

#include "kernels/sdpa_decode_products-inl.h"  // the q·k and P·V of a block: dot products, VNNI digits, rows together

// Scores (log2 units) of query row (h, i) against keys [j0, j0 + nk), nk <= kBlock, into
// sr[0, kBlock): masked and causal-hidden keys and the entries past nk are -inf. NV: D in vectors
// when it is one of the unrolled sizes, else 0. qd: the row's digits for int8 keys (QDigits), or none.
// sr[pre[0], pre[1]) (whole groups, visible to the row) already holds q·k (rows_dots). `ahead`: rows
// fetched into L2 beside each group of keys computed (the block's values), or none.
template <int NV, class T>
inline void row_scores_n(const Setup& S, const T* kh, const float* ksc, const float* qr, int64_t b, int64_t h,
                         int64_t i, int64_t j0, int64_t nk, float* sr, const QDigits& qd, const int64_t* pre,
                         const Ahead& ahead) {
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
    for (int u = 0; u < kW; ++u) ahead.fetch(g + u);
    VR x;
    if (g >= pre[0] && g + kW <= pre[1]) {  // q·k already there (rows_dots)
      x = Vec::load(sr + g);
    } else if (!digit_group(kg, kst, qd, pb.D, whole, x)) {
      VR part[kW];
      if (whole && std::is_same_v<T, float>) {  // f32 rows stream from memory faster a key at a time
#pragma GCC unroll 1
        for (int u = 0; u < kW; ++u) part[u] = dot_fixed<NV>(kg + u * kst, qr, pb.D);
      } else if (whole) {  // widened rows: the 16 keys' loads and conversions unrolled together
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

template <class T>
inline void row_scores(const Setup& S, const T* kh, const float* ksc, const float* qr, int64_t b, int64_t h,
                       int64_t i, int64_t j0, int64_t nk, float* sr, const QDigits& qd, const int64_t* pre,
                       const Ahead& ahead) {
  const int64_t nvec = S.pb.D % kW == 0 ? S.pb.D / kW : 0;
  switch (nvec) {  // unrolled for the head dims of the usual models: D 64 and 128 (and 32 on AVX-512)
    case 2: return row_scores_n<2>(S, kh, ksc, qr, b, h, i, j0, nk, sr, qd, pre, ahead);
    case 4: return row_scores_n<4>(S, kh, ksc, qr, b, h, i, j0, nk, sr, qd, pre, ahead);
    case 8: return row_scores_n<8>(S, kh, ksc, qr, b, h, i, j0, nk, sr, qd, pre, ahead);
    case 16: return row_scores_n<16>(S, kh, ksc, qr, b, h, i, j0, nk, sr, qd, pre, ahead);
    default: return row_scores_n<0>(S, kh, ksc, qr, b, h, i, j0, nk, sr, qd, pre, ahead);
  }
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
    // (this block's values fetched into L2 meanwhile, by the first row's pass over the keys)
    const Ahead values{reinterpret_cast<const char*>(vh + b0 * S.vs[2]), static_cast<int64_t>(S.vs[2] * sizeof(T)),
                       static_cast<int64_t>(pb.Dv * sizeof(T)), nk};
    for (int64_t r = 0; r < S.rows; ++r) {
      const int64_t h = hk * pb.group() + S.head(r);
      row_scores(S, kh, ksc, qp + r * S.Dp, b, h, S.pos(r), b0, nk, s + r * kBlock,
                 digits != nullptr ? digits[r] : none, pre, r == 0 ? values : Ahead{});
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
    // (the next block's keys fetched into L2 meanwhile, by the first pass over the values)
    const int64_t b1 = b0 + kBlock;
    Ahead ahead;
    if (b1 < j1 && b1 < pb.key_end(pb.Lq - 1)) {
      ahead = {reinterpret_cast<const char*>(kh + b1 * S.ks[2]), static_cast<int64_t>(S.ks[2] * sizeof(T)),
               static_cast<int64_t>(pb.D * sizeof(T)), std::min(kBlock, j1 - b1)};
    }
    for (int64_t r = 0; r < S.rows;) {
      const int64_t n = std::min<int64_t>(kPvRows, S.rows - r);
      if (n == 1) {
        pv_row(vh + b0 * S.vs[2], S.vs[2], s + r * kBlock, nk, pb.Dv, o + r * S.Dvp, r == 0 ? ahead : Ahead{});
      } else {
        pv_rows_n(n, vh + b0 * S.vs[2], S.vs[2], s + r * kBlock, nk, pb.Dv, o + r * S.Dvp, S.Dvp, r == 0 ? ahead : Ahead{});
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
