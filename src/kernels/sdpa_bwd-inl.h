// sdpa_bwd-inl.h — SDPA backward (FlashAttention-2, arXiv:2307.08691, Alg. 2), written once over
// `Vec`. Included by kernels/sdpa_paths-inl.h after sdpa_flash_fwd-inl.h, whose tile pieces it
// reuses (Q packing, the K·Qt micro-kernel, masks, dropout).
//
// Shapes as the forward; dout [B, H, Lq, Dv], lse [B, H, Lq] from the forward.
//   D_i = rowsum(dO_i ∘ O_i)    (the softmax Jacobian's diagonal; = rowsum(P_i ∘ dP_i), which is
//                                how it is taken when all keys fit one block, sparing the read of O)
// per group of key blocks (about 1 MB of K/V rows) of a task's keys, per step of kSub query
// tiles i of every head in the group (Q_i and dO_i packed once per group), per key block j:
//   1. S = Q_i K_j^T (recomputed, log2 units, masked);  P = 2^(S - lse2_i)      (forward 1-3)
//   2. dP = dO_i V_j^T; with dropout Pd = P∘Z/(1-p), dP = dP∘Z/(1-p)            (forward 4)
//   3. dV_j += Pd^T dO_i
//   4. dS = P ∘ (dP - D_i)                                       (softmax backward)
//   5. dK_j += scale · dS^T Q_i;  dQ_i += scale · dS K_j          (S = scale · Q K^T)
// Layout: scores transposed as in the forward ([keys][queries on lanes]), P and dS of the step's
// tiles side by side, so S and dP come from the forward's K·Qt micro-kernel (P and dS computed from
// its accumulators when no mask or dropout intervenes); dV_j, dK_j and the step's dQ rows from a
// register-blocked GEMM over the step's queries (dK, dV) or the block's keys (dQ). The gradients
// are written in place: a block's first contribution sets it, later ones add, rows no score
// reaches are zeroed (large dK/dV written once are streamed past the caches: see stream_kv). Steps
// of at most kSmallQ queries use dot products and keep P and dS query-major instead.
// bf16 inputs: each key group's K and V rows, and each query step's Q, dO (and O) rows, are widened
// into the thread's scratch as they are first read, and the f32 code runs on them: the results
// are the f32 kernel's on the widened values, bit for bit. bf16 gradients: dK and dV summed per key
// group in the thread's scratch and rounded at the group's end, dQ summed in an f32 buffer of the
// call and rounded at the end.
// Memory: per thread a few tiles and the D_i of its (b, kv head), reused across calls (with bf16
// inputs also a key group's widened K and V rows and a step's Q, dO and O rows; with bf16
// gradients a key group's dK and dV sums); with key splits, a dQ-sized buffer per split past the
// first for the call (sdpa_split.h bounds them), and one more for bf16 dq's sums; no Lq x Lk
// buffer (unless the mask gradient is requested, which receives dS).
// Parallel over (b, kv head): each task owns its dK, dV rows and the dQ rows of its query heads,
// in a fixed order, so results do not depend on the thread count. When there are too few (b, kv
// head) pairs to feed many threads (long4k: 8), each is also cut along its keys (sdpa_split.h): a
// split owns its dK, dV rows and writes its dQ contributions to a buffer of its own, added to dQ
// after, split by split. The cut depends on the shape alone.

// Files: the steps' kernels (P, dS and the products of one query step against a key block) are
// sdpa_bwd_step-inl.h, the few-query steps sdpa_bwd_few-inl.h, and on AMX the products on tiles
// sdpa_amx_bwd-inl.h, all included below inside namespace bwd.

namespace bwd {

using fwd::kNQ;
using fwd::kTK;
using fwd::kTQ;
using fwd::kW;
using fwd::VR;
constexpr float kInf = std::numeric_limits<float>::infinity();

using gemm::gemm_acc;
using gemm::Out;
using gemm::row_dot;

// rows [0, n) of n_cols values (stride ld) = 0
inline void zero_rows(float* x, int64_t ld, int64_t n, int64_t n_cols) {
  for (int64_t r = 0; r < n; ++r) std::fill(x + r * ld, x + r * ld + n_cols, 0.0f);
}

// bf16 rows [0, n) of n_cols values (stride ld) = f32 rows of src (stride ss) rounded, or 0 if src is null.
inline void round_rows(const float* src, int64_t ss, int64_t n, int64_t n_cols, uint16_t* dst, int64_t ld) {
  for (int64_t r = 0; r < n; ++r) {
    uint16_t* d = dst + r * ld;
    if (src == nullptr) {
      std::fill(d, d + n_cols, uint16_t{0});
      continue;
    }
    const float* x = src + r * ss;
    for (int64_t c = 0; c < n_cols; ++c) d[c] = f32_to_bf16(x[c]);
  }
}

// out[i] = a_i · b_i for rows i < n of `len` values (strides lda, ldb): D_i = dO_i · O_i.
inline void row_dots(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t n, int64_t len, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = Vec::reduce_add(row_dot(a + i * lda, b + i * ldb, len));
}

// D_i from one block: sum_j P_ij dP_ij over sum_j P_ij. The recomputed P sums to 1 only up to the
// rounding of lse and exp2, an error common to the row that this division removes (one visible key:
// D = dP up to one rounding, so dS is about 1e-7 of dP rather than of the scores). A row that sees
// no key has D = 0.
inline float normalized_d(float num, float den) { return den != 0.0f ? num / den : 0.0f; }

#include "kernels/sdpa_bwd_few-inl.h"

// Up to this many queries in a tile, scores and dP come from small_dots.
constexpr int64_t kSmallQ = 4;
// Query tiles per step: P, dP and dS of kSub tiles side by side ([keys][kSub·kTQ]) feed the dK/dV
// products, whose accumulators then make one trip through the cache per kSub·kTQ queries.
constexpr int64_t kSub = 4;
constexpr int64_t kLd = kSub * kTQ;
constexpr int64_t kMaxBlocks = 8;  // key blocks per key group
constexpr int64_t kStreamBytes = int64_t{16} << 20;  // half the L3 of the machines this is tuned on

struct Scratch {
  float *qt, *dot, *s, *dp, *pd, *tg, *drow;
  float* drel;  // [H][rel_len] this thread's dS sums along i - j (T5 table gradient), or null
  // bf16 inputs widened: a key group's K [span][D] and V [span][Dv] rows, a step's Q [kLd][D],
  // dO and O [kLd][Dv] rows (null for f32 inputs, read in place)
  float *kin, *vin, *qin, *gin, *oin;
  // bf16 dK and dV: a key group's sums [span][D] and [span][Dv], rounded into them at its end
  float *kacc, *vacc;
  // AMX tiles (Call::tiles, sdpa_amx_bwd-inl.h): a key group's K, V as A rows and K as B pairs, a
  // step's Q, dO as B columns and B pairs, one A operand of P or dS (hi, then lo terms), a 32 x 32 f32 block
  uint16_t *ka, *va, *kpairs, *qcols, *gcols, *qpairs, *gpairs, *pa;
  float* ctmp;
  // rows: G·Lq values of D_i
  static int64_t floats(int64_t D, int64_t Dv, int64_t rows) {
    return kSub * (D + Dv) * kTQ + 4 * kTK * kLd + rows + 64;
  }
  // The widened rows of bf16 inputs, for key groups of `span` keys.
  static int64_t widened_floats(int64_t D, int64_t Dv, int64_t span) { return span * (D + Dv) + kLd * (D + 2 * Dv); }
};

// One backward call: the tensors as pointers and strides, and what is decided once per call.
struct Call {
  const SdpaProblem& pb;
  int64_t G;  // query heads per key/value head
  std::array<int64_t, 3> qs, ks, vs, os, gs, dqs, dks, dvs;
  const float *qp, *kp, *vp, *op, *gp, *lp;  // f32 inputs; null for bf16 ones
  const uint16_t *qb, *kb, *vb, *ob, *gb;     // bf16 inputs (widened as staged); null for f32 ones
  float *dqp, *dkp, *dvp;  // f32 gradients (dqp: also bf16 dq's sums, a call buffer); dkp, dvp null for bf16
  uint16_t *dqb, *dkb, *dvb;  // bf16 gradients (strides dqbs, dks, dvs), or null
  std::array<int64_t, 3> dqbs;
  float* dmask_full;  // [B, H, Lq, Lk] or null
  float scale, c, keep_scale;  // c = scale · log2(e), folded into the packed Q
  int64_t span;                // keys per group
  bool one_block;              // all keys in one block: D_i from the block, O not read
  bool stream_kv;              // dK/dV written once and streamed past the caches
  bool tiles;                  // bf16 inputs on AMX: the products on tiles (sdpa_amx_bwd-inl.h)
};

// One step of queries [I0, I0 + nqs) of head h (tiles u < n_sub of kTQ queries) against a key group.
struct Step {
  int64_t b, h, hk, I0, nqs, n_sub;
  bool few;          // at most kSmallQ queries: the query-major few_block path
  bool first_group;  // dQ rows and D_i are set up in the first key group of the task's keys
  bool dq_unset;     // the step's dQ rows not written yet (the next product sets them)
  // The step's Q and dO rows (strides qs2, gs2), and its key group's K and V rows from key j_base
  // (strides ks2, vs2): the inputs in place, or bf16 ones widened into scratch.
  const float *q0, *g0, *kh, *vh;
  int64_t qs2, gs2, ks2, vs2, j_base;
  const float* k_row(int64_t j) const { return kh + (j - j_base) * ks2; }
  const float* v_row(int64_t j) const { return vh + (j - j_base) * vs2; }
  float* dq0;       // the step's dQ rows (stride dq_ld): dq's, or a key split's own buffer
  int64_t dq_ld;
  alignas(64) float lse2[kLd];  // lse in log2 units; +inf where the row sees nothing (P = 0)
  alignas(64) float dsum[kLd];  // D_i, unless one_block
};
#ifdef HEADS_AMX
#include "kernels/sdpa_amx_bwd-inl.h"
#endif
#include "kernels/sdpa_bwd_step-inl.h"

// One task: keys [j_begin, j_end) of (b, kv head hk), its dQ contributions into dq (strides dqs):
// the gradient itself, or for a key split past the first, a buffer of its own.
struct Task {
  int64_t b, hk, j_begin, j_end;
  float* dq;
  std::array<int64_t, 3> dqs;
};

// A key group's K and V rows, row j at kh + (j - j_base) · ks2: the inputs in place, or bf16 ones
// widened into scratch.
struct KeyRows {
  const float *kh, *vh;
  int64_t ks2, vs2, j_base;
};

// Queries [I0, I0 + kLd) of head h against the key group [jg, jg + ng): lse and D_i of the rows, Q and
// dO packed once, then every key block — its tiles' dS, then its three products.
inline void query_step(const Call& C, const Task& task, const KeyRows& kv, int64_t h, int64_t I0, int64_t jg,
                       int64_t ng, bool* written, const Scratch& scr) {
  const SdpaProblem& pb = C.pb;
  const int64_t b = task.b, hk = task.hk;
  Step st;
  st.b = b, st.h = h, st.hk = hk, st.I0 = I0;
  st.nqs = std::min(pb.Lq - I0, kLd);
  st.n_sub = (st.nqs + kTQ - 1) / kTQ;
  st.few = st.nqs <= kSmallQ;
  st.first_group = jg == task.j_begin;
  st.dq0 = task.dq + b * task.dqs[0] + h * task.dqs[1] + I0 * task.dqs[2];
  st.dq_ld = task.dqs[2];
  // With a left limit or a block layout, a step may see no block of the first group: its dQ rows
  // start at zero.
  st.dq_unset = st.first_group && !pb.may_skip_left();
  if (st.first_group && pb.may_skip_left()) zero_rows(st.dq0, st.dq_ld, st.nqs, pb.D);
  st.kh = kv.kh, st.vh = kv.vh, st.ks2 = kv.ks2, st.vs2 = kv.vs2, st.j_base = kv.j_base;
  const int64_t q_off = b * C.qs[0] + h * C.qs[1] + I0 * C.qs[2], g_off = b * C.gs[0] + h * C.gs[1] + I0 * C.gs[2];
  const bool widen = C.qb != nullptr;  // bf16 Q and dO rows: widened when first needed
  bool g_widened = false;
  auto widen_g = [&] {
    if (widen && !g_widened) fwd::widen_rows(C.gb + g_off, C.gs[2], 0, st.nqs, pb.Dv, scr.gin);
    g_widened = true;
  };
  if (widen) {
    st.q0 = scr.qin, st.qs2 = pb.D, st.g0 = scr.gin, st.gs2 = pb.Dv;
  } else {
    st.q0 = C.qp + q_off, st.qs2 = C.qs[2], st.g0 = C.gp + g_off, st.gs2 = C.gs[2];
  }
  // D_i = dO_i · O_i, once per row (first group, even one the rows cannot see); kept per thread
  // for the later groups
  float* drow = scr.drow + (h - hk * C.G) * pb.Lq + I0;
  if (st.first_group && !C.one_block) {
    const int64_t o_off = b * C.os[0] + h * C.os[1] + I0 * C.os[2];
    widen_g();
    const bool o16 = C.ob != nullptr;  // (a bf16 call's out may be f32: sdpa_merge_ writes f32)
    if (o16) fwd::widen_rows(C.ob + o_off, C.os[2], 0, st.nqs, pb.Dv, scr.oin);
    row_dots(st.g0, st.gs2, o16 ? scr.oin : C.op + o_off, o16 ? pb.Dv : C.os[2], st.nqs, pb.Dv, drow);
  }
  if ((pb.causal && jg > I0 + st.nqs - 1 + pb.causal_offset) ||
      (pb.has_left && jg + ng - 1 < I0 + pb.left_offset)) {  // every key of the group hidden
    if (st.dq_unset) zero_rows(st.dq0, st.dq_ld, st.nqs, pb.D);
    return;
  }
  widen_g();
  if (widen && (!C.tiles || st.few)) fwd::widen_rows(C.qb + q_off, C.qs[2], 0, st.nqs, pb.D, scr.qin);
  for (int64_t l = 0; l < kLd; ++l) {
    const float x = l < st.nqs ? C.lp[(b * pb.H + h) * pb.Lq + I0 + l] : -kInf;
    st.lse2[l] = x == -kInf ? kInf : x * kLog2e;  // +inf: the row sees nothing, P = 0
    st.dsum[l] = l < st.nqs && !C.one_block ? drow[l] : 0.0f;
  }
  if (!st.few && C.tiles) {
#ifdef HEADS_AMX
    tiles::pack_step(C, st, scr);
#endif
  } else if (!st.few) {
    for (int64_t u = 0; u < st.n_sub; ++u) {
      const int64_t nq = std::min(st.nqs - u * kTQ, kTQ);
      fwd::Widen<float>::pack_q(st.q0 + u * kTQ * st.qs2, st.qs2, nq, pb.D, C.c, scr.qt + u * pb.D * kTQ);
      fwd::Widen<float>::pack_q(st.g0 + u * kTQ * st.gs2, st.gs2, nq, pb.Dv, 1.0f, scr.dot + u * pb.Dv * kTQ);
    }
  }
  for (int64_t j0 = jg; j0 < jg + ng; j0 += kTK) {
    const int64_t nk = std::min(jg + ng - j0, kTK);
    if (pb.causal && j0 > I0 + st.nqs - 1 + pb.causal_offset) break;  // this and later keys hidden
    if (pb.has_left && j0 + nk - 1 < I0 + pb.left_offset) continue;  // left of every row's window
    if (!pb.mods.blocks_any(h, I0, I0 + st.nqs, j0, j0 + nk)) continue;  // no block of the layout
#ifdef HEADS_AMX
    if (C.tiles && !st.few) tiles::step_scores(C, st, jg, j0, nk, scr);
#endif
    for (int64_t u = 0; u < st.n_sub; ++u) tile_ds(C, st, j0, nk, u, scr);
    block_products(C, st, jg, j0, nk, written[(j0 - jg) / kTK], scr);
  }
}

// Key group [jg, jg + ng) of the task's keys: every query step of every head in the kv head's group,
// then zeros for the key blocks no query sees. The group's K, V rows and dK, dV stay in cache while
// the query steps stream past once per group.
inline void key_group(const Call& C, const Task& task, int64_t jg, const Scratch& scr) {
  const SdpaProblem& pb = C.pb;
  const int64_t b = task.b, hk = task.hk;
  const int64_t ng = std::min(task.j_end - jg, C.span);
  bool written[kMaxBlocks] = {};  // key block of the group written (later steps add to it)
  KeyRows kv;
  if (C.kb != nullptr) {  // bf16: the group's rows widened once for all its query steps
    fwd::widen_rows(C.kb + b * C.ks[0] + hk * C.ks[1], C.ks[2], jg, ng, pb.D, scr.kin);
    fwd::widen_rows(C.vb + b * C.vs[0] + hk * C.vs[1], C.vs[2], jg, ng, pb.Dv, scr.vin);
    kv = {scr.kin, scr.vin, pb.D, pb.Dv, jg};
#ifdef HEADS_AMX
    if (C.tiles) tiles::pack_group(C, b, hk, jg, ng, scr);
#endif
  } else {
    kv = {C.kp + b * C.ks[0] + hk * C.ks[1], C.vp + b * C.vs[0] + hk * C.vs[1], C.ks[2], C.vs[2], 0};
  }
  for (int64_t h = hk * C.G; h < (hk + 1) * C.G; ++h) {
    if (!pb.head_on(b, h)) {  // a head turned off: zero dq, nothing into dk, dv
      if (jg == task.j_begin) zero_rows(task.dq + b * task.dqs[0] + h * task.dqs[1], task.dqs[2], pb.Lq, pb.D);
      continue;
    }
    for (int64_t I0 = 0; I0 < pb.Lq; I0 += kLd) query_step(C, task, kv, h, I0, jg, ng, written, scr);
  }
  for (int64_t j0 = jg; j0 < jg + ng; j0 += kTK) {
    const bool w = written[(j0 - jg) / kTK];
    const int64_t nk = std::min(jg + ng - j0, kTK);
    if (C.dkb != nullptr) {  // bf16: the block's sums rounded once, or zeros
      round_rows(w ? scr.kacc + (j0 - jg) * pb.D : nullptr, pb.D, nk, pb.D,
                 C.dkb + b * C.dks[0] + hk * C.dks[1] + j0 * C.dks[2], C.dks[2]);
      round_rows(w ? scr.vacc + (j0 - jg) * pb.Dv : nullptr, pb.Dv, nk, pb.Dv,
                 C.dvb + b * C.dvs[0] + hk * C.dvs[1] + j0 * C.dvs[2], C.dvs[2]);
      continue;
    }
    if (w) continue;
    zero_rows(C.dkp + b * C.dks[0] + hk * C.dks[1] + j0 * C.dks[2], C.dks[2], nk, pb.D);
    zero_rows(C.dvp + b * C.dvs[0] + hk * C.dvs[1] + j0 * C.dvs[2], C.dvs[2], nk, pb.Dv);
  }
}

}  // namespace bwd

// q, k and v and dout all f32, or all bf16 (widened block by block into scratch as they are read:
// the f32 kernel's results on the widened values), out f32 or bf16; dq, dk, dv all f32 or all bf16
// (f32 sums rounded once).
inline void sdpa_bwd(const SdpaProblem& pb, const Tensor& dout, const Tensor& q, const Tensor& k,
                     const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dq,
                     const Tensor& dk, const Tensor& dv, float* dmask_full, float* drel) {
  using namespace bwd;
  if (pb.B == 0 || pb.H == 0 || pb.Lq == 0 || pb.Lk == 0) return;
  auto str = [](const Tensor& t) { return std::array<int64_t, 3>{t.stride(0), t.stride(1), t.stride(2)}; };
  const float scale = static_cast<float>(pb.scale);
  const int64_t G = pb.group();
  const bool bf16 = q.dtype() == DType::BF16;
  auto f32_in = [&](const Tensor& t) { return t.dtype() == DType::BF16 ? nullptr : t.data<float>(); };
  auto bf16_in = [&](const Tensor& t) {
    HEADS_CHECK(&t == &out || t.dtype() == q.dtype(), "sdpa_bwd: inputs of mixed dtypes");
    return t.dtype() == DType::BF16 ? static_cast<const uint16_t*>(t.raw_data()) : nullptr;
  };
  // bf16 gradients: dK and dV rounded from each key group's sums; dQ summed in a call buffer of
  // f32 (with the key splits' buffers) and rounded at the end.
  const bool grad16 = dq.dtype() == DType::BF16;
  HEADS_CHECK(dk.dtype() == dq.dtype() && dv.dtype() == dq.dtype(), "sdpa_bwd: gradients of mixed dtypes");
  const KeySplits splits = backward_key_splits(pb);
  const int64_t dq_floats = pb.B * pb.H * pb.Lq * pb.D;
  const int64_t n_dq_buffers = splits.n - 1 + (grad16 ? 1 : 0);
  // The dQ contributions of key splits 1.. (contiguous [B, H, Lq, D] each), then bf16 dq's f32 sums,
  // for this call only.
  const CallScratch dq_buffers = n_dq_buffers > 0 ? call_scratch(n_dq_buffers * dq_floats) : CallScratch();
  float* dq_split = dq_buffers.get();
  const std::array<int64_t, 3> split_dqs = {pb.H * pb.Lq * pb.D, pb.Lq * pb.D, pb.D};
  auto grad_f32 = [&](const Tensor& t) { return grad16 ? nullptr : t.data<float>(); };
  auto grad_bf16 = [&](const Tensor& t) { return grad16 ? static_cast<uint16_t*>(t.raw_data()) : nullptr; };
  const Call C{
      .pb = pb, .G = G,
      .qs = str(q), .ks = str(k), .vs = str(v), .os = str(out), .gs = str(dout),
      // outputs: any strides with a unit inner one (e.g. views into a projection's gradient buffer)
      .dqs = grad16 ? split_dqs : str(dq), .dks = str(dk), .dvs = str(dv),
      .qp = f32_in(q), .kp = f32_in(k), .vp = f32_in(v), .op = f32_in(out), .gp = f32_in(dout),
      .lp = lse.data<float>(),
      .qb = bf16_in(q), .kb = bf16_in(k), .vb = bf16_in(v), .ob = bf16_in(out), .gb = bf16_in(dout),
      .dqp = grad16 ? dq_split + (splits.n - 1) * dq_floats : dq.data<float>(), .dkp = grad_f32(dk), .dvp = grad_f32(dv),
      .dqb = grad_bf16(dq), .dkb = grad_bf16(dk), .dvb = grad_bf16(dv), .dqbs = str(dq),
      .dmask_full = dmask_full,
      .scale = scale, .c = scale * kLog2e, .keep_scale = pb.dropout_p > 0 ? dropout_keep_scale(pb.dropout_p) : 1.0f,
      // Keys per group: about 1 MB of K/V rows (and as much dK/dV), a multiple of kTK. Every group
      // re-reads Q and dO and adds into dQ, so fewer, larger groups save those passes as long as the
      // groups of all threads stay well inside the last-level cache (long4k, 2 threads: 256 KB -> 1 MB
      // cut the backward by 9%; 2 MB and more were slower, gpt2k unchanged up to 1 MB).
      .span = kTK * std::clamp<int64_t>((1024 * 1024 / 4) / (kTK * (pb.D + pb.Dv)), 1, kMaxBlocks),
      // (a sink takes part of each row's mass, so sum P over the keys is not the normaliser: D from O;
      // so do the keys of the other blocks when these are one block of a longer sequence)
      .one_block = pb.Lk <= kTK && !pb.sinks.defined() && !pb.partial_keys,
      // dK/dV written once each (one query head, one step of queries, e.g. decoding one token) and too
      // large to stay in the last-level cache: streamed past it (no reads for ownership, no eviction
      // of the K and V rows still to come).
      .stream_kv = !grad16 && G == 1 && pb.Lq <= kLd && 4 * pb.B * pb.Hkv * pb.Lk * (pb.D + pb.Dv) >= kStreamBytes,
      .tiles = kIsa == Isa::Amx && bf16,
  };
  const int64_t n_tasks = pb.B * pb.Hkv * splits.n;
  // five products of the forward's size: S and dP, then dV, dK, dQ
  const int n_threads = threads_for(5.0 * static_cast<double>(pb.B * pb.H * pb.Lq) * static_cast<double>(pb.Lk) *
                                        static_cast<double>(pb.D + pb.Dv), n_tasks);
  const int64_t own = (Scratch::floats(pb.D, pb.Dv, G * pb.Lq) + 15) / 16 * 16;
  const int64_t widened = bf16 ? (Scratch::widened_floats(pb.D, pb.Dv, C.span) + 15) / 16 * 16 : 0;
  const int64_t summed = grad16 ? C.span * (pb.D + pb.Dv) : 0;
#ifdef HEADS_AMX
  const int64_t tiled = C.tiles ? 32 * 32 + tiles::operand_elems(pb.D, pb.Dv, C.span) / 2 : 0;
#else
  const int64_t tiled = 0;
#endif
  const int64_t per = own + widened + summed + tiled;
  float* arena = thread_scratch(per * n_threads);
  // dS sums per key split and batch entry (each task writes the rows of its own heads), added in a
  // fixed order after.
  std::vector<float> drel_b(drel != nullptr ? static_cast<size_t>(splits.n * pb.B * pb.H * pb.mods.rel_len) : 0);

#pragma omp parallel num_threads(n_threads)
  {
    float* base = arena + per * omp_get_thread_num();
    Scratch scr;
    scr.qt = base;
    scr.dot = scr.qt + kSub * pb.D * kTQ;
    scr.s = scr.dot + kSub * pb.Dv * kTQ;
    scr.dp = scr.s + kTK * kLd;
    scr.pd = scr.dp + kTK * kLd;
    scr.tg = scr.pd + kTK * kLd;
    scr.drel = nullptr;
    scr.drow = scr.tg + kTK * kLd;
    scr.kin = scr.vin = scr.qin = scr.gin = scr.oin = nullptr;
    if (bf16) {
      scr.kin = base + own;
      scr.vin = scr.kin + C.span * pb.D;
      scr.qin = scr.vin + C.span * pb.Dv;
      scr.gin = scr.qin + kLd * pb.D;
      scr.oin = scr.gin + kLd * pb.Dv;
    }
    scr.kacc = scr.vacc = nullptr;
    if (grad16) {
      scr.kacc = base + own + widened;
      scr.vacc = scr.kacc + C.span * pb.D;
    }
    scr.ka = scr.va = scr.kpairs = scr.qcols = scr.gcols = scr.qpairs = scr.gpairs = scr.pa = nullptr;
    scr.ctmp = nullptr;
#ifdef HEADS_AMX
    if (C.tiles) {
      tiles::place_operands(C, base + own + widened + summed, scr);
      amx::configure_tiles();
    }
#endif
    // Parallel over (b, kv head, key split): each task owns its dK, dV rows and the dQ rows (or the
    // split's buffer rows) of its query heads.
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_tasks; ++t) {
      // heaviest splits first (causal ones differ), then (b, kv head)
      const int64_t s = splits.order[static_cast<size_t>(t / (pb.B * pb.Hkv))], pair = t % (pb.B * pb.Hkv);
      const int64_t b = pair / pb.Hkv;
      const Task task{b, pair % pb.Hkv, splits.at[static_cast<size_t>(s)], splits.at[static_cast<size_t>(s + 1)],
                      s == 0 ? C.dqp : dq_split + (s - 1) * dq_floats, s == 0 ? C.dqs : split_dqs};
      if (drel != nullptr) scr.drel = drel_b.data() + (s * pb.B + b) * pb.H * pb.mods.rel_len;
      for (int64_t jg = task.j_begin; jg < task.j_end; jg += C.span) key_group(C, task, jg, scr);
    }
    // dQ += the later splits' contributions, in split order, row by row.
    if (splits.n > 1) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < pb.B * pb.H * pb.Lq; ++r) {
        const int64_t b = r / (pb.H * pb.Lq), h = r / pb.Lq % pb.H, i = r % pb.Lq;
        float* row = C.dqp + b * C.dqs[0] + h * C.dqs[1] + i * C.dqs[2];
        for (int64_t s = 1; s < splits.n; ++s) {
          const float* add = dq_split + (s - 1) * dq_floats + r * pb.D;
          for (int64_t d = 0; d < pb.D; ++d) row[d] += add[d];
        }
      }
    }
    if (grad16) {  // bf16 dq: its f32 sums rounded once
#pragma omp for schedule(static)
      for (int64_t r = 0; r < pb.B * pb.H * pb.Lq; ++r) {
        const int64_t b = r / (pb.H * pb.Lq), h = r / pb.Lq % pb.H, i = r % pb.Lq;
        round_rows(C.dqp + r * pb.D, pb.D, 1, pb.D, C.dqb + b * C.dqbs[0] + h * C.dqbs[1] + i * C.dqbs[2], 0);
      }
    }
    if (C.stream_kv) Vec::stream_fence();  // this thread's streamed rows land before the caller reads them
#ifdef HEADS_AMX
    if (C.tiles) HEADS_TILE_RELEASE();
#endif
  }
  for (int64_t x = 0; drel != nullptr && x < splits.n * pb.B; ++x) {  // split by split, batch entry by entry
    const float* src = drel_b.data() + x * pb.H * pb.mods.rel_len;
    for (int64_t y = 0; y < pb.H * pb.mods.rel_len; ++y) drel[y] += src[y];
  }
}
