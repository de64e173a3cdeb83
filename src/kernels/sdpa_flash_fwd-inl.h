// sdpa_flash_fwd-inl.h — SDPA forward, tiled online softmax (FlashAttention-2, arXiv:2307.08691,
// Alg. 1), written once over the vector layer `Vec`. Included by kernels/sdpa_paths-inl.h inside
// namespace heads::kernels::<isa>, after that ISA's Vec.
//
// Shapes (elements; innermost stride 1, other strides free):
//   q [B, H, Lq, D]   k [B, Hkv, Lk, D]   v [B, Hkv, Lk, Dv]  ->  out [B, H, Lq, Dv], lse [B, H, Lq]
//   H % Hkv == 0; query head h reads kv head h / (H / Hkv).
// Layout: queries on lanes. A tile of kTQ = 2·W queries is packed once as Qt [D][kTQ] with
//   scale·log2(e) folded in, so scores are in log2 units and softmax uses exp2. Both products are
//   one register-blocked micro-kernel C[r][kTQ] += A(r, t) · B[t][kTQ] with A broadcast:
//     S [keys][kTQ]  = K (rows as stored) · Qt      (r = key, t = d)
//     Ot [Dv][kTQ]  += Vᵀ (rows as stored) · P      (r = d,   t = key)
//   so K and V are read in place (no packing) and max/sum are vertical (no horizontal reductions).
// Masks: bool attn_mask true = may attend; float mask added (times log2 e); causal by comparing
//   key index and query-index vectors, only on blocks that cross the diagonal. Blocks wholly
//   past a tile's causal limit are never visited.
// Numerics: f32 accumulation; masked logits are -inf; exp2 is exactly 0 below 2^-126; a fully
//   masked row gives out = 0, lse = -inf (m_safe = 0 keeps exp2(-inf - m) from making NaN).
// Memory: per thread S [kTK][kTQ], and Qt [D][kTQ] and Ot [Dv][kTQ] per tile of its group, and a
//   policy's cache (Bf16Staged: up to 512 KB of widened K and V); with key chunks, partial outputs
//   and lse [chunks][B, H, Lq] for the call; the Lq x Lk weights exist only when requested (a
//   second sweep from the final lse).
// Parallel: over (B, H, group of query tiles), heaviest causal groups first; when those tasks are
//   too few for many threads, also over chunks of the keys (forward_key_chunks in sdpa_split.h),
//   whose partial outputs and lse are merged after (merge_key_chunks). A group's tiles
//   sweep the keys together, block by block, so a long head's K and V come from memory once per
//   group, not once per tile (forward_tiles_per_sweep in sdpa_split.h). Each row's sums run in a
//   fixed order (its key chunks, if any, merged in chunk order), so the output is bitwise
//   independent of the thread count and of the grouping.
// Precision: the tile loop is a template over a policy that packs Q, runs the two products and
//   stores O: F32; Bf16Staged (bf16 K and V widened to f32 rows once per thread and head when
//   they fit, else once per key block and group, for every ISA); and, in isa_avx512bf16.cc, Bf16Dot (vdpbf16ps, see sdpa_flash_bf16-inl.h). S,
//   softmax and O stay f32 in all of them.
// Reference: ref::sdpa_fwd_f64 in sdpa_ref.cc.
// Files: this one holds the scratch, the tile loop, the key chunks and the entry points; the
//   products are sdpa_fwd_products-inl.h, the masks and modifiers sdpa_fwd_scores-inl.h, the
//   precision policies sdpa_fwd_policies-inl.h (all included below, inside namespace fwd).

namespace fwd {

using VR = Vec::R;
constexpr int kW = Vec::W;
constexpr int kNQ = 2;               // query vectors per tile
constexpr int64_t kTQ = kNQ * kW;    // queries per tile
constexpr int64_t kTK = 128;         // keys per block
constexpr float kInf = std::numeric_limits<float>::infinity();

// Inputs are f32 or bf16 (uint16_t bits); widen() gives the f32 value.
HEADS_INLINE float widen(float x) { return x; }
HEADS_INLINE float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The two products, then what happens to the scores between them (masks, modifiers, dropout).
#include "kernels/sdpa_fwd_products-inl.h"
#include "kernels/sdpa_fwd_scores-inl.h"

// A thread's scratch, viewed by one tile of its group (qt and ot are the tile's own; s, aux and
// the cache are shared by the group, whose tiles take turns).
struct Scratch {
  float* qt;   // [D][kTQ] (a policy may store another layout in the same space)
  float* s;    // [kTK][kTQ]
  float* ot;   // [Dv][kTQ]
  float* aux;  // policy scratch: [kTK][kTQ + Dv + W] floats
  float* cache;          // policy's per-thread cache across tiles (Pol::cache_floats)
  int64_t* cache_state;  // its key and fill level (4 integers), owned by the thread
  // Floats for a group of n_tiles: n_tiles x (qt, ot), then s, aux.
  static int64_t floats(int64_t D, int64_t Dv, int64_t n_tiles) {
    return n_tiles * (D + Dv) * kTQ + kTK * kTQ + kTK * (kTQ + Dv + kW);
  }
  // Tile g's view of the group scratch at base.
  static Scratch view(float* base, int64_t D, int64_t Dv, int64_t n_tiles, int64_t g, float* cache,
                      int64_t* cache_state) {
    float* shared = base + n_tiles * (D + Dv) * kTQ;
    float* own = base + g * (D + Dv) * kTQ;
    return Scratch{own, shared, own + D * kTQ, shared + kTK * kTQ, cache, cache_state};
  }
};

#include "kernels/sdpa_fwd_policies-inl.h"

// 6. of forward_tile: the tile's weights rows w[r][j] = 2^(S - lse2[r]) for every key (rows of Lk,
// first row at w), dropped like P; keys past the causal limit jend get 0 (NaN in a NaN row, as
// 2^(-inf - NaN) gives elsewhere). lse2: the rows' lse in log2 units, +inf for rows that saw nothing.
template <class Pol>
inline void weights_pass(const Tile& t, const typename Pol::In* kh, int64_t ks2, const typename Pol::In* vh,
                         int64_t vs2, int64_t jend, const float* lse2_l,
                         float c, const Scratch& scr, float* w) {
  const SdpaProblem& pb = t.pb;
  VR lse2[kNQ];
  for (int v = 0; v < kNQ; ++v) lse2[v] = Vec::load(lse2_l + v * kW);
  for (int64_t j0 = 0; j0 < pb.Lk; j0 += kTK) {
    const int64_t nk = std::min(pb.Lk - j0, kTK);
    // visible under the band: before the upper limit jend, not wholly left of the first row's window
    int64_t nv = j0 + nk <= pb.key_begin(t.i0) ? 0 : std::max<int64_t>(0, std::min(nk, jend - j0));
    if (nv > 0 && !pb.mods.blocks_any(t.h, t.i0, t.i0 + t.nq, j0, j0 + nv)) nv = 0;  // no block of the layout
    if (nv > 0) {
      const bool causal_here = pb.causal && j0 + nv - 1 > t.i0 + pb.causal_offset;
      VR mx[kNQ] = {Vec::zero(), Vec::zero()};
      if constexpr (kStages<Pol>) {
        Pol::stage(pb, scr, t.b, t.hk, kh, ks2, vh, vs2, j0, nv, /*need_v=*/false);
        Pol::qk_staged(pb, scr, j0, nv, scr.qt, scr.s, nullptr);
      } else {
        Pol::qk(nv, kh + j0 * ks2, ks2, scr.qt, pb.D, c, scr.s, nullptr);
      }
      if (needs_masks(t, j0, nv, causal_here)) apply_masks(t, j0, nv, causal_here, scr.s, mx);
      for (int64_t r = 0; r < nv; ++r) {
        for (int v = 0; v < kNQ; ++v) {
          float* sp = scr.s + r * kTQ + v * kW;
          Vec::store(sp, Vec::exp2(Vec::sub(Vec::load(sp), lse2[v])));
        }
      }
      if (pb.dropout_p > 0.0) apply_dropout(t, j0, nv, scr.s, dropout_keep_scale(pb.dropout_p));
    }
    for (int64_t r = 0; r < t.nq; ++r) {
      float* wrow = w + r * pb.Lk + j0;
      const float hidden = std::isnan(lse2_l[r]) ? lse2_l[r] : 0.0f;  // a NaN row's weights are all NaN
      for (int64_t c2 = 0; c2 < nk; ++c2) wrow[c2] = c2 < nv ? scr.s[c2 * kTQ + r] : hidden;
    }
  }
}

// One query tile's state across its sweep of the keys: its Qt and Ot (in its own scratch view),
// the running max m and sum l, and the keys [jbeg, jend) its rows can see.
struct TileRun {
  Tile t;
  Scratch scr;
  int64_t jbeg, jend;
  VR m[kNQ], l[kNQ];
};

// Packs the tile's queries and starts its softmax (with the head's sink unless with_sink is false:
// a key chunk past the first).
template <class Pol>
inline void begin_tile(TileRun& run, const typename Pol::In* q0, int64_t qs2, float c, bool with_sink) {
  const SdpaProblem& pb = run.t.pb;
  // Qt = Q_i^T (· c where the policy folds it in), zero lanes past the last query.
  Pol::pack_q(q0, qs2, run.t.nq, pb.D, c, run.scr.qt);
  std::fill(run.scr.ot, run.scr.ot + pb.Dv * kTQ, 0.0f);
  // A sink starts the row's softmax as a key of logit sink with no value (m = sink, l = 1).
  const bool sink = with_sink && pb.sinks.defined();
  const float sink2 = sink ? pb.sink_log2(run.t.h) : -kInf;
  for (int v = 0; v < kNQ; ++v) {
    run.m[v] = Vec::set1(sink2);
    run.l[v] = Vec::set1(sink ? 1.0f : 0.0f);
  }
}

// Keys [j0, j0 + kTK) ∩ [.., jend) of the tile: steps 1-4 of FlashAttention-2's inner loop.
template <class Pol>
inline void tile_block(TileRun& run, const typename Pol::In* kh, int64_t ks2, const typename Pol::In* vh,
                       int64_t vs2, int64_t j0, float c) {
  const Tile& t = run.t;
  const SdpaProblem& pb = t.pb;
  const Scratch& scr = run.scr;
  const int64_t nk = std::min(run.jend - j0, kTK);
  const bool causal_here = pb.causal && j0 + nk - 1 > t.i0 + pb.causal_offset;
  if (!pb.mods.blocks_any(t.h, t.i0, t.i0 + t.nq, j0, j0 + nk)) return;  // block-sparse: nothing to see here
  const bool masked = needs_masks(t, j0, nk, causal_here);
  // 1. S = Q_i K_j^T (scaled, log2 units) (+ mask); 2. mx = rowmax(S)
  VR mx[kNQ] = {Vec::set1(-kInf), Vec::set1(-kInf)};
  if constexpr (kStages<Pol>) {
    Pol::qk_staged(pb, scr, j0, nk, scr.qt, scr.s, masked ? nullptr : mx);
  } else {
    Pol::qk(nk, kh + j0 * ks2, ks2, scr.qt, pb.D, c, scr.s, masked ? nullptr : mx);
  }
  if (masked) apply_masks(t, j0, nk, causal_here, scr.s, mx);
  // 3. m_new = max(m, mx); P = 2^(S - m_new); l = l·2^(m - m_new) + rowsum(P)
  VR m_safe[kNQ], alpha[kNQ], sum[kNQ];
  for (int v = 0; v < kNQ; ++v) {
    const VR m_new = Vec::max(run.m[v], mx[v]);
    m_safe[v] = Vec::fill_if_eq(m_new, -kInf, 0.0f);  // nothing visible yet: P = 0, alpha = 0
    alpha[v] = Pol::exp2(Vec::sub(run.m[v], m_safe[v]));
    sum[v] = Vec::zero();
    run.m[v] = m_new;
  }
  for (int64_t r = 0; r < nk; ++r) {
    for (int v = 0; v < kNQ; ++v) {
      const VR p = Pol::exp2(Vec::sub(Vec::load(scr.s + r * kTQ + v * kW), m_safe[v]));
      sum[v] = Vec::add(sum[v], p);
      Vec::store(scr.s + r * kTQ + v * kW, p);
    }
  }
  for (int v = 0; v < kNQ; ++v) run.l[v] = Vec::fma(run.l[v], alpha[v], sum[v]);
  // Dropout zeroes P's dropped values here; the kept ones' 1 / (1 - p) joins 1 / l in step 5, so P
  // reaches the product as computed (a bf16 product then rounds 2^(s - m) ≤ 1 alone: the running
  // maximum's value, 1, stays exact instead of becoming 4/3, which bf16 rounds by 0.2% on every row).
  if (pb.dropout_p > 0.0) apply_dropout(t, j0, nk, scr.s, 1.0f);
  // 4. O = O·2^(m - m_new) + P V_j
  Pol::pv(t, scr, vh, vs2, j0, nk, alpha);
}

// 5. O /= l and the lse; 6. the weights on request. A key chunk's tile (part != nullptr) stores its
// partial O in f32 there instead (rows of Dv), for merge_key_chunks.
template <class Pol>
inline void finish_tile(TileRun& run, const typename Pol::In* kh, int64_t ks2, const typename Pol::In* vh,
                        int64_t vs2, typename Pol::In* o0, int64_t os2, float* part, float* lse_row, float* weights,
                        float c) {
  const Tile& t = run.t;
  const SdpaProblem& pb = t.pb;
  const Scratch& scr = run.scr;
  const int64_t nq = t.nq;
  // O /= l (O · (1 / (1 - p)) / l under dropout); lse = ln 2 · (m + log2 l); a row with l = 0 saw
  // no key: zeros, lse = -inf. A NaN score (or a +inf one: 2^(inf - inf)) made l NaN, and the row is NaN.
  alignas(64) float m_l[kTQ], l_l[kTQ], inv_l[kTQ];
  const float keep_scale = pb.dropout_p > 0.0 ? dropout_keep_scale(pb.dropout_p) : 1.0f;
  for (int v = 0; v < kNQ; ++v) {
    Vec::store(m_l + v * kW, run.m[v]);
    Vec::store(l_l + v * kW, run.l[v]);
  }
  for (int64_t r = 0; r < kTQ; ++r) {
    inv_l[r] = keep_scale / l_l[r];
    if (l_l[r] == 0.0f) {  // zeros even where a V entry is NaN (0 · NaN in the P·V product)
      inv_l[r] = 0.0f;
      if (r >= nq) continue;  // a lane past the tile's rows: never stored
      for (int64_t d = 0; d < pb.Dv; ++d) scr.ot[d * kTQ + r] = 0.0f;
    }
  }
  if (part != nullptr) {
    Widen<float>::store_out(scr.ot, inv_l, nq, pb.Dv, part, pb.Dv);
  } else {
    Pol::store_out(scr.ot, inv_l, nq, pb.Dv, o0, os2);
  }
  for (int64_t r = 0; r < nq; ++r) lse_row[r] = l_l[r] != 0.0f ? (m_l[r] + std::log2(l_l[r])) * kLn2 : -kInf;

  // Weights on request: w = 2^(S - log2-lse), dropped like P above.
  if (weights == nullptr) return;
  for (int64_t r = 0; r < kTQ; ++r) {
    m_l[r] = r < nq && l_l[r] != 0.0f ? m_l[r] + std::log2(l_l[r]) : kInf;  // +inf -> weight 0
  }
  weights_pass<Pol>(t, kh, ks2, vh, vs2, run.jend, m_l, c, scr, weights);
}

// Query tiles [qt_first, qt_first + n_tiles) of head (b, h) sweep the keys together: each key
// block is run for every tile of the group in turn, so the block's K and V are read from memory
// once for the group and then from cache (a head's K and V outgrow L2 at long Lk). Each tile
// still sees the same blocks in the same order as alone, so the bits do not depend on the group.
// Tiles of a group share their first key (no left window: see forward_tiles_per_sweep); scr_of(g)
// gives tile g its scratch view. Keys are those of [key_lo, key_hi) (a key chunk, or all); for a
// chunk, part_o and part_l receive the partial output [B, H, Lq, Dv] and lse [B, H, Lq] (f32) in
// place of out and lse.
struct KeyChunk {
  int64_t lo, hi;
  float *part_o, *part_l;  // null: the whole row, into out and lse
};

template <class Pol, class ScratchOf>
inline void forward_tiles(const SdpaProblem& pb, const typename Pol::In* q, const int64_t* qs,
                          const typename Pol::In* kb, const int64_t* ks, const typename Pol::In* vb,
                          const int64_t* vs, typename Pol::In* out, const int64_t* os, float* lse,
                          float* weights, int64_t b, int64_t h, int64_t qt_first, int64_t n_tiles,
                          const KeyChunk& keys, const ScratchOf& scr_of) {
  using T = typename Pol::In;
  std::optional<TileRun> group[kMaxSweepTiles];  // (Tile holds a reference: no default state)
  const int64_t hk = h / pb.group();
  const T* kh = kb + b * ks[0] + hk * ks[1];
  const T* vh = vb + b * vs[0] + hk * vs[1];
  const float c = static_cast<float>(pb.scale) * kLog2e;
  int64_t jbeg = 0, jend = 0;
  for (int64_t g = 0; g < n_tiles; ++g) {
    const int64_t i0 = (qt_first + g) * kTQ, nq = std::min(pb.Lq - i0, kTQ);
    const Scratch scr = scr_of(g);
    TileRun& run = group[g].emplace(
        TileRun{Tile{pb, b, h, hk, i0, nq}, scr,
                std::max(keys.lo, pb.key_begin(i0) / 2 * 2),  // left limit of its first row (even: bf16 pairs)
                std::min(keys.hi, pb.key_end(i0 + nq - 1)),   // causal limit of its widest row
                {}, {}});
    begin_tile<Pol>(run, q + b * qs[0] + h * qs[1] + i0 * qs[2], qs[2], c, keys.lo == 0);
    jbeg = g == 0 ? run.jbeg : std::min(jbeg, run.jbeg);
    jend = std::max(jend, run.jend);
  }
  for (int64_t j0 = jbeg; j0 < jend; j0 += kTK) {
    if constexpr (kStages<Pol>) {  // the rows any tile of the group reads (block-sparse skips aside)
      Pol::stage(pb, group[0]->scr, b, hk, kh, ks[2], vh, vs[2], j0, std::min(jend - j0, kTK));
    }
    for (int64_t g = 0; g < n_tiles; ++g) {
      if (j0 < group[g]->jend) tile_block<Pol>(*group[g], kh, ks[2], vh, vs[2], j0, c);
    }
  }
  for (int64_t g = 0; g < n_tiles; ++g) {
    const int64_t i0 = group[g]->t.i0, row = (b * pb.H + h) * pb.Lq + i0;
    finish_tile<Pol>(*group[g], kh, ks[2], vh, vs[2], out + b * os[0] + h * os[1] + i0 * os[2], os[2],
                     keys.part_o ? keys.part_o + row * pb.Dv : nullptr, (keys.part_l ? keys.part_l : lse) + row,
                     weights ? weights + row * pb.Lk : nullptr, c);
  }
}

// Rows [r_begin, r_end) of [B, H, Lq] from n key chunks' partial outputs (part_o, chunk by chunk,
// each [B·H·Lq][Dv]) and lse (part_l), merged by merge_normalized_row (sdpa_split.h) into out
// (rounded once for bf16) and lse. Rows of heads turned off are left alone.
template <class T>
inline void merge_key_chunks(const SdpaProblem& pb, int64_t n, const float* part_o, const float* part_l, T* out,
                             const int64_t* os, float* lse, int64_t r_begin, int64_t r_end) {
  const int64_t rows = pb.B * pb.H * pb.Lq;
  for (int64_t r = r_begin; r < r_end; ++r) {
    const int64_t b = r / (pb.H * pb.Lq), h = r / pb.Lq % pb.H, i = r % pb.Lq;
    if (!pb.head_on(b, h)) continue;
    T* orow = out + b * os[0] + h * os[1] + i * os[2];
    lse[r] = merge_normalized_row(
        n, [&](int64_t c) { return part_o + (c * rows + r) * pb.Dv; }, [&](int64_t c) { return part_l[c * rows + r]; },
        pb.Dv, [&](int64_t d0, const float* vals, int64_t nd) {
          for (int64_t d = 0; d < nd; ++d) {
            if constexpr (std::is_same_v<T, float>) {
              orow[d0 + d] = vals[d];
            } else {
              orow[d0 + d] = f32_to_bf16(vals[d]);
            }
          }
        });
  }
}

template <class Pol>
inline void sdpa_tiled(const SdpaProblem& pb, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& out, const Tensor& lse, const Tensor& weights) {
  using T = typename Pol::In;
  if (pb.B == 0 || pb.H == 0 || pb.Lq == 0) return;
  const int64_t qs[3] = {q.stride(0), q.stride(1), q.stride(2)};
  const int64_t ks[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t vs[3] = {v.stride(0), v.stride(1), v.stride(2)};
  const int64_t os[3] = {out.stride(0), out.stride(1), out.stride(2)};
  const T* qp = static_cast<const T*>(q.raw_data());
  const T* kp = static_cast<const T*>(k.raw_data());
  const T* vp = static_cast<const T*>(v.raw_data());
  T* op = static_cast<T*>(out.raw_data());
  float* lp = lse.data<float>();
  float* wp = weights.defined() ? weights.data<float>() : nullptr;
  const int64_t n_qt = (pb.Lq + kTQ - 1) / kTQ;
  const double flops = 4.0 * static_cast<double>(pb.B * pb.H * pb.Lq) * static_cast<double>(pb.Lk) *
                       static_cast<double>(pb.D + pb.Dv) / 2;
  // Key chunks when the tiles are too few for the threads (then no groups: each tile alone). Not
  // under set_batch_invariant: the cut depends on B and H, so a row's bits would depend on its batch.
  const ForwardKeyChunks kc =
      batch_invariant() ? ForwardKeyChunks{std::max<int64_t>(1, pb.Lk), 1} : forward_key_chunks(pb, kTQ, kTK);
  const int64_t G = kc.n > 1 ? 1 : forward_tiles_per_sweep(pb, kTQ, static_cast<int64_t>(sizeof(T)), get_num_threads());
  const int64_t n_groups = (n_qt + G - 1) / G;
  const int64_t n_tasks = pb.B * pb.H * n_groups * kc.n;
  const int64_t rows = pb.B * pb.H * pb.Lq;
  const CallScratch parts = kc.n > 1 ? call_scratch(kc.n * rows * (pb.Dv + 1)) : CallScratch();
  float* part_o = parts.get();
  float* part_l = kc.n > 1 ? part_o + kc.n * rows * pb.Dv : nullptr;
  const int n_threads = threads_for(pb.causal ? flops / 2 : flops, n_tasks);
  // Per-thread scratch, each slice a multiple of 64 bytes.
  const int64_t cache = (Pol::cache_floats(pb) + 15) / 16 * 16;
  const int64_t per = (Scratch::floats(pb.D, pb.Dv, G) + 15) / 16 * 16 + cache;
  float* arena = thread_scratch(per * n_threads);
  std::vector<int64_t> cache_state(static_cast<size_t>(16 * n_threads), -1);  // a line per thread

#pragma omp parallel num_threads(n_threads)
  {
    const int tid = omp_get_thread_num();
    float* base = arena + per * tid;
    float* cache_base = base + per - cache;
    int64_t* state = cache_state.data() + 16 * tid;
    // Head by head (a policy's per-head cache stays warm); causal tiles grow with the query
    // index, so within a head the heaviest groups go first and the run ends on light ones.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n_tasks; ++task) {
      const int64_t chunk = task % kc.n, tile_task = task / kc.n;
      const int64_t bh = tile_task / n_groups;
      const int64_t grp = pb.causal ? n_groups - 1 - tile_task % n_groups : tile_task % n_groups;
      if (!pb.head_on(bh / pb.H, bh % pb.H)) continue;  // a head turned off: cleared by the caller
      const int64_t first = grp * G, n = std::min(G, n_qt - first);
      const KeyChunk keys = kc.n > 1 ? KeyChunk{chunk * kc.chunk, std::min(pb.Lk, (chunk + 1) * kc.chunk),
                                                part_o + chunk * rows * pb.Dv, part_l + chunk * rows}
                                     : KeyChunk{0, pb.Lk, nullptr, nullptr};
      forward_tiles<Pol>(pb, qp, qs, kp, ks, vp, vs, op, os, lp, kc.n > 1 ? nullptr : wp, bh / pb.H, bh % pb.H,
                         first, n, keys,
                         [&](int64_t g) { return Scratch::view(base, pb.D, pb.Dv, G, g, cache_base, state); });
    }
    if (kc.n > 1) {  // (after the loop's barrier: every chunk's partials are in)
#pragma omp for schedule(static)
      for (int64_t r0 = 0; r0 < rows; r0 += kTQ) {
        merge_key_chunks(pb, kc.n, part_o, part_l, op, os, lp, r0, std::min(rows, r0 + kTQ));
      }
      if (wp != nullptr) {  // the weights from the merged lse, tile by tile
        const float c = static_cast<float>(pb.scale) * kLog2e;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < pb.B * pb.H * n_qt; ++task) {
          const int64_t b = task / (pb.H * n_qt), h = task / n_qt % pb.H, i0 = task % n_qt * kTQ;
          if (!pb.head_on(b, h)) continue;
          const int64_t nq = std::min(pb.Lq - i0, kTQ), hk = h / pb.group(), row = (b * pb.H + h) * pb.Lq + i0;
          const Scratch scr = Scratch::view(base, pb.D, pb.Dv, G, 0, cache_base, state);
          const Tile t{pb, b, h, hk, i0, nq};
          Pol::pack_q(qp + b * qs[0] + h * qs[1] + i0 * qs[2], qs[2], nq, pb.D, c, scr.qt);
          alignas(64) float lse2[kTQ];  // +inf for rows that saw nothing (weight 0), as finish_tile
          for (int64_t r = 0; r < kTQ; ++r) lse2[r] = r < nq && lp[row + r] != -kInf ? lp[row + r] * kLog2e : kInf;
          weights_pass<Pol>(t, kp + b * ks[0] + hk * ks[1], ks[2], vp + b * vs[0] + hk * vs[1], vs[2],
                            pb.key_end(i0 + nq - 1), lse2, c, scr, wp + row * pb.Lk);
        }
      }
    }
  }
}

}  // namespace fwd

inline void sdpa_tiled_f32(const SdpaProblem& pb, const Tensor& q, const Tensor& k, const Tensor& v,
                           const Tensor& out, const Tensor& lse, const Tensor& weights) {
  fwd::sdpa_tiled<fwd::Widen<float>>(pb, q, k, v, out, lse, weights);
}

inline void sdpa_tiled_bf16_widen(const SdpaProblem& pb, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse,
                                  const Tensor& weights) {
  fwd::sdpa_tiled<fwd::Bf16Staged>(pb, q, k, v, out, lse, weights);
}
