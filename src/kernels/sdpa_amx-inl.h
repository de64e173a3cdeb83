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
// One task = one (b, h) and kBQ = 32 query rows; keys in blocks of kBK = 256 (a "unit": one task's
// block), online softmax per block (FlashAttention-2 order, as sdpa_flash_fwd-inl.h):
//   S  [32][256] f32 = Q · Kᵀ      A = Q rows (packed [32][Dp] bf16, zero past Lq and D),
//                                   B = K of the (b, kv head) packed by the thread: 16 keys x 32 dims
//                                   a tile, dword (K[j][2p], K[j][2p+1]) at row p, column j.
//   P  [32][256] bf16 = 2^(c·S + mask - m)   AVX-512, row by row (keys on lanes, a row's 256 scores
//                                   in registers); l and m in f32.
//   O  [32][Dvp] f32 = O·alpha + P · V      A = P, B = V packed by the thread: 32 keys x 16 columns
//                                   a tile, dword (V[2p][n], V[2p+1][n]) at row p.
// A thread runs its units as a pipeline (Worker): while the vector units exponentiate unit u, the
// tiles compute S of unit u + 1 and P · V of unit u - 1, their products handed out one by one
// between the vectors of the softmax (TileStream, sdpa_amx_tiles-inl.h), so that the TMUL and the
// AVX-512 units work side by side instead of in turn. S and P are kept twice; a task's Q, O, m and
// l live in a slot of the thread's while its units are in flight. Units come from a group of tasks
// (consecutive query blocks of one head) key block by key block (see kGroup): the group's tasks and
// the last two of the previous group are in flight at most.
// O lives in memory (f32, per thread) between blocks: loaded into the accumulators, P·V added, stored
// back; rows whose max did not move (alpha = 1, most of them after the first blocks) are not rescaled.
// q and k are exact bf16 inputs; the scale is applied in f32 to S; P is rounded to bf16 for its
// product (as every bf16 attention kernel does), its row sum l is taken in f32 before rounding.
// Rows of a block with nothing but the scale on their scores (no mask, window, modifier or dropout,
// every key visible) take a shorter path: c·S - m in one FMA, exp2 through vscalefps (exp2_plain).
// Masks, causal limits, the score modifiers (left windows, softcap, ALiBi / T5 biases, sinks, block
// layouts), dropout, fully masked rows, non-finite values and the weights on request follow
// sdpa_flash_fwd-inl.h exactly (the weights from a second sweep of S after the final lse).
// Padding (keys past Lk, dims past D or Dv, query rows past Lq) is zero in the packed operands and
// never reaches an output: padded keys are -inf in S, padded rows and columns are not stored.
// Parallel: (b, h, query block) tasks, heaviest first under causal, handed out in runs of one head
// from a shared counter (a thread's groups are cut from its runs), so that a thread packs the K and
// V it reads (into its own caches, one for K and one for V, as far as its units reach, once per
// head): no packing pass, no barrier, no packed data crossing cores. Each task is computed the same
// way whatever thread runs it and whatever runs beside it in the pipeline, so results do not depend
// on the thread count.
//
// Files: the tile instructions (or the emulator's), the tile configuration, the tdpbf16ps block,
// the packing of K and V and the tile stream are sdpa_amx_tiles-inl.h, included below; the
// softmax step, the rescale of O and a task's outputs are sdpa_amx_rows-inl.h; the pipeline of a
// thread (Call, Worker) is sdpa_amx_worker-inl.h; the backward's products on tiles are
// sdpa_amx_bwd-inl.h.

namespace amx {

constexpr int64_t kBQ = 32;   // query rows per task: two row tiles
// Keys per softmax block: a row's 256 scores are 16 vectors, held in registers through the row's
// max and exponentials. 256 rather than 128: O goes through memory (tile loads and stores) once
// per 256 keys, and a row's reductions and rescale are paid half as often (bert512, gpt2k, long4k
// in bf16 on a 2-core Xeon: 7-20% faster, bert128 the same).
constexpr int64_t kBK = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#include "kernels/sdpa_amx_tiles-inl.h"

// A thread runs the tasks of a group (up to kGroup consecutive query blocks of one head, as
// forward_tiles_per_sweep counts them: grouped when a head's K and V outgrow the cache) key block by
// key block: the units of every task of the group on one key block, then the next block. A K or V
// block is then read from the thread's caches kGroup times in a row, while it is close (L1, L2),
// instead of once per task: at 4096 keys of 128 dims a head's packed K and V are 2 MB, a core's L2,
// and the order of one task's blocks after the other streamed them from L3 for every 32 rows. Each
// task's arithmetic is the same in any order.
constexpr int kGroup = 4;
// The task states a thread holds: the group's, and the two tasks of the last group still in the
// pipeline (units u - 1 and u) when the next group is formed.
constexpr int kSlots = kGroup + 2;

HEADS_INLINE int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

// One thread's memory: per slot a task's packed Q, O and row statistics; S and P twice (the unit
// being exponentiated and the ones multiplied beside it); the packed K and V of one (b, kv head)
// each, filled lazily as far as the thread's units reach.
struct Scratch {
  uint16_t* qp[kSlots];   // [kBQ][Dp] bf16
  float* o[kSlots];       // [kBQ][Dvp]
  float* m[kSlots];       // [kBQ] running max (log2 units)
  float* l[kSlots];       // [kBQ] running sum
  float* alpha[kSlots];   // [kBQ] the last block's rescale factors
  float* s[2];            // [kBQ][kBK] raw scores
  uint16_t* p[2];         // [kBQ][kBK] bf16
  float* sw;              // [kBQ][kBK] scores of the weights' sweep
  float* tmp;             // [16]
  uint16_t* kc;           // packed K [Lkp][Dp] of (k_state[0], k_state[1]), keys [0, k_state[2])
  uint16_t* vc;           // packed V [Lkp][Dvp] of (v_state[0], v_state[1]), keys [0, v_state[2])
  int64_t* k_state;
  int64_t* v_state;
  static int64_t slot_floats(const Layout& lay) { return up16(kBQ * lay.Dp / 2) + kBQ * lay.Dvp + 3 * kBQ; }
  static int64_t floats(const Layout& lay) {
    return kSlots * slot_floats(lay) + 3 * kBQ * kBK + 2 * (kBQ * kBK / 2) + 16 + up16((lay.k_elems + 1) / 2) +
           up16((lay.v_elems + 1) / 2);
  }
  Scratch(float* base, const Layout& lay, int64_t* state) : k_state(state), v_state(state + 4) {
    for (int i = 0; i < kSlots; ++i) {
      qp[i] = reinterpret_cast<uint16_t*>(base);
      o[i] = base + up16(kBQ * lay.Dp / 2);
      m[i] = o[i] + kBQ * lay.Dvp;
      l[i] = m[i] + kBQ;
      alpha[i] = l[i] + kBQ;
      base += slot_floats(lay);
    }
    for (int i = 0; i < 2; ++i) {
      s[i] = base;
      base += kBQ * kBK;
      p[i] = reinterpret_cast<uint16_t*>(base);
      base += kBQ * kBK / 2;
    }
    sw = base;
    tmp = sw + kBQ * kBK;
    kc = reinterpret_cast<uint16_t*>(tmp + 16);
    vc = kc + 2 * up16((lay.k_elems + 1) / 2);
  }
};

// One (b, h, block of kBQ query rows): where its inputs and outputs are, and its key blocks.
struct Task {
  const SdpaProblem& pb;
  const Layout& lay;
  int64_t b, h, hk, i0, nq;
  bool mods;  // a left window or a score modifier (modify16; an attn_mask alone needs none of it)
  const uint16_t* kh;  // K of (b, hk) as given, row stride ks
  int64_t ks;
  const uint16_t* vh;  // V of (b, hk), row stride vs
  int64_t vs;
  const uint16_t* q;  // Q rows i0 .., stride qs
  int64_t qs;
  // Q as the tiles read it: the rows themselves where D is whole 32-value tiles and the task has
  // kBQ rows, else the slot's packed copy (zero past nq and D); row stride qa_stride.
  const uint16_t* qa;
  int64_t qa_stride;
  uint16_t* out;  // output rows i0 .., stride os
  int64_t os;
  float* lse;      // [nq]
  float* weights;  // [nq][Lk] or null
  // Its key blocks: kBK keys each from jstart (a multiple of 32, the packing's chunk), the last ending
  // at jend. Tasks of one group share jstart (0: groups form only without a left window).
  int64_t jstart, jend;
};

// Packs keys [0, jmax) of the task's (b, kv head) into a cache (K or V) unless it holds them.
template <typename Pack>
inline void ensure_packed(const Task& t, int64_t* state, int64_t jmax, uint16_t* dst, Pack pack) {
  if (state[0] != t.b || state[1] != t.hk) {
    state[0] = t.b;
    state[1] = t.hk;
    state[2] = 0;
  }
  for (; state[2] < jmax; state[2] += 32) pack(state[2] / 32, dst);
}
inline void ensure_k(const Task& t, const Scratch& scr, int64_t jmax) {
  ensure_packed(t, scr.k_state, jmax, scr.kc,
                [&](int64_t kc, uint16_t* d) { pack_k_chunk(t.kh, t.ks, t.pb, t.lay, kc, d); });
}
inline void ensure_v(const Task& t, const Scratch& scr, int64_t jmax) {
  ensure_packed(t, scr.v_state, jmax, scr.vc,
                [&](int64_t kc, uint16_t* d) { pack_v_chunk(t.vh, t.vs, t.pb, t.lay, kc, d); });
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

// One block of up to kBK keys of a task: the pipeline's unit of work.
struct Unit {
  int slot = -1;  // -1: none
  int64_t j0 = 0, nk = 0, nkp = 0;  // keys [j0, j0 + nk), nkp = nk rounded up to 32
  bool first = false, last = false;  // the task's first and last block
  explicit operator bool() const { return slot >= 0; }
};

// A unit's S jobs (its raw scores Q · Kᵀ into s) and PV jobs (O += P · V, P from p), added to a
// phase's tile stream.
inline void add_scores(TileStream& ts, const Task& t, const Scratch& scr, int64_t j0, int64_t nkp,
                       float* s) {
  ts.qp = t.qa;
  ts.kp = scr.kc;
  ts.s = s;
  ts.Dp = t.qa_stride;
  ts.n_dc = t.lay.n_dc;
  ts.j0s = j0;
  ts.s_jobs = nkp / 32;
  ts.s_stride = kBK;
}
inline void add_products(TileStream& ts, const Task& t, const Scratch& scr, const Unit& u, const uint16_t* p) {
  ts.p = p;
  ts.vp = scr.vc;
  ts.o = scr.o[u.slot];
  ts.Dvp = t.lay.Dvp;
  ts.n_ct = t.lay.n_ct;
  ts.j0v = u.j0;
  ts.v_keys = u.nkp / 32;
  ts.v_jobs = t.lay.n_ct / 2;
  ts.p_stride = kBK;
  ts.o_from_zero = u.first;  // O is zero before the task's first block
}

// Whether the tiles read the task's Q rows where they are (no padding needed).
inline bool q_in_place(const SdpaProblem& pb, int64_t nq) { return pb.D % 32 == 0 && nq == kBQ; }

// The task's Q rows packed where the tiles need them so (zero past nq and D) and its softmax
// started: a sink starts each row as a key of logit sink with no value (m = sink, l = 1).
inline void begin_task(const Task& t, const Scratch& scr, int slot) {
  const int64_t Dp = t.lay.Dp;
  for (int64_t r = 0; r < kBQ; ++r) {
    for (int64_t dc = 0; dc < t.lay.n_dc && t.qa == scr.qp[slot]; ++dc) {
      const __m512i x = r < t.nq ? _mm512_maskz_loadu_epi16(first_mask32(t.pb.D - 32 * dc), t.q + r * t.qs + 32 * dc)
                                 : _mm512_setzero_si512();
      _mm512_store_si512(scr.qp[slot] + r * Dp + 32 * dc, x);
    }
    scr.m[slot][r] = t.pb.sink_log2(t.h);
    scr.l[slot][r] = t.pb.sinks.defined() ? 1.0f : 0.0f;
  }
}

#include "kernels/sdpa_amx_rows-inl.h"

#include "kernels/sdpa_amx_worker-inl.h"

inline void sdpa_fwd(const SdpaProblem& pb, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                     const Tensor& lse, const Tensor& weights) {
  if (pb.B == 0 || pb.H == 0 || pb.Lq == 0 || pb.Lk == 0) return;
  const Layout lay(pb);
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
  std::atomic<int64_t> next{0};
  const Call call{pb, lay, q, k, v, out, lse.data<float>(), weights.defined() ? weights.data<float>() : nullptr,
                  n_qb, n_tasks, run,
                  // a group's tasks share their first key: no groups under a left window
                  pb.has_left ? 1 : std::min<int64_t>(kGroup, forward_tiles_per_sweep(pb, kBQ, 2, n_threads)), &next};

#pragma omp parallel num_threads(n_threads)
  {
    const int tid = omp_get_thread_num();
    const Scratch scr(arena + per * tid, lay, kv_state.data() + 16 * tid);
    configure_tiles();
    Worker(call, scr).run();
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
