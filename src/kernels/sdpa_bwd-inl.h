// sdpa_bwd-inl.h — SDPA backward (FlashAttention-2, arXiv:2307.08691, Alg. 2), written once over
// `Vec`. Included by src/kernels/isa_<isa>.cc after sdpa_flash_fwd-inl.h, whose tile pieces it
// reuses (Q packing, the K·Qt micro-kernel, masks, dropout).
//
// Shapes as the forward; dout [B, H, Lq, Dv], lse [B, H, Lq] from the forward.
//   D_i = rowsum(dO_i ∘ O_i)                                   (the softmax Jacobian's diagonal)
// per group of key blocks (about 256 KB of K/V rows) of one (b, kv head), per query tile i of every
// head in the group (Q_i and dO_i packed once per group), per key block j of the group:
//   1. S = Q_i K_j^T (recomputed, log2 units, masked);  P = 2^(S - lse2_i)      (forward 1-3)
//   2. dP = dO_i V_j^T; with dropout Pd = P∘Z/(1-p), dP = dP∘Z/(1-p)            (forward 4)
//   3. dV_j += Pd^T dO_i
//   4. dS = P ∘ (dP - D_i)                                       (softmax backward)
//   5. dK_j += scale · dS^T Q_i;  dQ_i += scale · dS K_j          (S = scale · Q K^T)
// Layout: scores transposed as in the forward ([keys][queries on lanes]); tiles of at most
// kSmallQ queries use dot products instead. Memory: per thread a few tiles, the dK/dV
// accumulators of one key group and the D_i of its (b, kv head); no Lq x Lk buffer (unless the
// mask gradient is requested, which receives dS). Parallel over (b, kv head): each task owns its
// dK, dV rows and the dQ rows of its query heads, in a fixed order, so results do not depend on
// the thread count.

namespace bwd {

using fwd::kNQ;
using fwd::kTK;
using fwd::kTQ;
using fwd::kW;
using fwd::VR;
constexpr float kInf = std::numeric_limits<float>::infinity();

// C[m][0:N] += alpha · sum_k A(m, k) · B[k][0:N] for m < M; A(m, k) = a[m·sam + k·sak] (broadcast),
// B rows contiguous (stride ldb), C rows stride ldc. Register block: R rows x NV vectors; nn[v] lanes
// of vector v are live (the last ones may be partial or empty).
template <int R, int NV>
HEADS_INLINE void gemm_rows(const float* a, int64_t sam, int64_t sak, const float* b, int64_t ldb,
                            int64_t K, float* c, int64_t ldc, const int64_t* nn, float alpha) {
  VR acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec::zero();
  }
  for (int64_t k = 0; k < K; ++k) {
    VR bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = Vec::load_partial(b + k * ldb + v * kW, nn[v]);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const VR x = Vec::set1(a[r * sam + k * sak]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = Vec::fma(x, bv[v], acc[r][v]);
    }
  }
  const VR al = Vec::set1(alpha);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* cp = c + r * ldc + v * kW;
      Vec::store_partial(cp, Vec::fma(acc[r][v], al, Vec::load_partial(cp, nn[v])), nn[v]);
    }
  }
}

template <int R, int NV>
HEADS_INLINE void gemm_tail(int64_t n, const float* a, int64_t sam, int64_t sak, const float* b, int64_t ldb,
                            int64_t K, float* c, int64_t ldc, const int64_t* nn, float alpha) {
  if constexpr (R > 0) {
    if (n == R) return gemm_rows<R, NV>(a, sam, sak, b, ldb, K, c, ldc, nn, alpha);
    gemm_tail<R - 1, NV>(n, a, sam, sak, b, ldb, K, c, ldc, nn, alpha);
  }
}

// Column panels of NV vectors, row blocks of R.
template <int R, int NV>
inline void gemm_panels(int64_t M, int64_t N, int64_t K, const float* a, int64_t sam, int64_t sak,
                        const float* b, int64_t ldb, float* c, int64_t ldc, float alpha) {
  for (int64_t j = 0; j < N; j += NV * kW) {
    int64_t nn[NV];
    for (int v = 0; v < NV; ++v) nn[v] = std::clamp<int64_t>(N - j - v * kW, 0, kW);
    int64_t m = 0;
    for (; m + R <= M; m += R) gemm_rows<R, NV>(a + m * sam, sam, sak, b + j, ldb, K, c + m * ldc + j, ldc, nn, alpha);
    if (m < M) gemm_tail<R - 1, NV>(M - m, a + m * sam, sam, sak, b + j, ldb, K, c + m * ldc + j, ldc, nn, alpha);
  }
}

// Wide rows (N a multiple of 4 vectors, e.g. head dim 128 on AVX-512) use 4-vector panels, which
// load each broadcast A value once per 4 FMAs instead of 2.
inline void gemm_acc(int64_t M, int64_t N, int64_t K, const float* a, int64_t sam, int64_t sak,
                     const float* b, int64_t ldb, float* c, int64_t ldc, float alpha) {
  constexpr int R2 = Vec::kRowsPV / 2 > 0 ? Vec::kRowsPV / 2 : 1;
  constexpr int R4 = Vec::kRowsPV / 3 > 0 ? Vec::kRowsPV / 3 : 1;
  if (N >= 8 * kW && N % (4 * kW) == 0) return gemm_panels<R4, 4>(M, N, K, a, sam, sak, b, ldb, c, ldc, alpha);
  gemm_panels<R2, 2>(M, N, K, a, sam, sak, b, ldb, c, ldc, alpha);
}

// Few-query tiles: out[r·kTQ + l] = alpha · (A_r · B_l) for keys r < nk and queries l < nq (rows of
// n values, strides lda / ldb), lanes nq..kTQ-1 zero — the layout qk_block writes, at the cost of
// nq dot products per key instead of a full tile of kTQ lanes.
inline void small_dots(int64_t nk, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t nq,
                       int64_t n, float alpha, float* out) {
  for (int64_t r = 0; r < nk; ++r) std::fill(out + r * kTQ + nq, out + (r + 1) * kTQ, 0.0f);
  const VR al = Vec::set1(alpha);
  for (int64_t r0 = 0; r0 < nk; r0 += kW) {
    const int64_t nr = std::min<int64_t>(kW, nk - r0);
    for (int64_t l = 0; l < nq; ++l) {
      const float* bl = b + l * ldb;
      VR part[kW];
      for (int u = 0; u < kW; ++u) {
        VR acc = Vec::zero();
        if (u < nr) {
          const float* ar = a + (r0 + u) * lda;
          int64_t d = 0;
          for (; d + kW <= n; d += kW) acc = Vec::fma(Vec::loadu(ar + d), Vec::loadu(bl + d), acc);
          if (d < n) acc = Vec::fma(Vec::load_partial(ar + d, n - d), Vec::load_partial(bl + d, n - d), acc);
        }
        part[u] = acc;
      }
      alignas(64) float sums[kW];
      Vec::store(sums, Vec::mul(Vec::reduce_lanes(part), al));
      for (int64_t u = 0; u < nr; ++u) out[(r0 + u) * kTQ + l] = sums[u];
    }
  }
}

// Up to this many queries in a tile, scores and dP come from small_dots.
constexpr int64_t kSmallQ = 4;

struct Scratch {
  float *qt, *dot, *s, *dp, *dk, *dv, *tmp, *dcol, *drow;
  // span: keys per group (dK, dV accumulators); rows: G·Lq values of D_i
  static int64_t floats(int64_t D, int64_t Dv, int64_t span, int64_t rows) {
    return (D + Dv + 2 * kTK) * kTQ + span * (D + Dv) + 2 * kTQ + rows + 64;
  }
};

}  // namespace bwd

inline void sdpa_bwd_f32(const SdpaProblem& P, const Tensor& dout, const Tensor& q, const Tensor& k,
                         const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dq,
                         const Tensor& dk, const Tensor& dv, float* dmask_full) {
  using namespace bwd;
  if (P.B == 0 || P.H == 0 || P.Lq == 0 || P.Lk == 0) return;
  const int64_t G = P.group();
  auto str = [](const Tensor& t) { return std::array<int64_t, 3>{t.stride(0), t.stride(1), t.stride(2)}; };
  const auto qs = str(q), ks = str(k), vs = str(v), os = str(out), gs = str(dout);
  const float *qp = q.data<float>(), *kp = k.data<float>(), *vp = v.data<float>();
  const float *op = out.data<float>(), *gp = dout.data<float>(), *lp = lse.data<float>();
  // Outputs: any strides with a unit inner one (e.g. views into a projection's gradient buffer).
  const auto dqs = str(dq), dks = str(dk), dvs = str(dv);
  float *dqp = dq.data<float>(), *dkp = dk.data<float>(), *dvp = dv.data<float>();
  const float scale = static_cast<float>(P.scale);
  const float c = scale * kLog2e;
  const float keep_scale = P.dropout_p > 0 ? static_cast<float>(1.0 / (1.0 - P.dropout_p)) : 1.0f;
  const int64_t n_tasks = P.B * P.Hkv;
  const int n_threads = static_cast<int>(std::min<int64_t>(get_num_threads(), n_tasks));
  // Keys per group: about 256 KB of dK/dV accumulators (and as much K/V), a multiple of kTK.
  const int64_t span = kTK * std::clamp<int64_t>((256 * 1024 / 4) / (kTK * (P.D + P.Dv)), 1, 4);
  const int64_t per = (Scratch::floats(P.D, P.Dv, span, G * P.Lq) + 15) / 16 * 16;
  std::vector<float> arena_storage(static_cast<size_t>(per * n_threads + 16));
  float* arena = arena_storage.data() + (16 - (reinterpret_cast<uintptr_t>(arena_storage.data()) / 4) % 16) % 16;
  const int64_t n_qt = (P.Lq + kTQ - 1) / kTQ;

#pragma omp parallel num_threads(n_threads)
  {
    float* base = arena + per * omp_get_thread_num();
    Scratch W;
    W.qt = base;
    W.dot = W.qt + P.D * kTQ;
    W.s = W.dot + P.Dv * kTQ;
    W.dp = W.s + kTK * kTQ;
    W.dk = W.dp + kTK * kTQ;
    W.dv = W.dk + span * P.D;
    W.tmp = W.dv + span * P.Dv;
    W.dcol = W.tmp + kTQ;
    W.drow = W.dcol + kTQ;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n_tasks; ++task) {
      const int64_t b = task / P.Hkv, hk = task % P.Hkv;
      const float* kh = kp + b * ks[0] + hk * ks[1];
      const float* vh = vp + b * vs[0] + hk * vs[1];
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {  // this task's dQ rows start at zero
        for (int64_t i = 0; i < P.Lq; ++i) {
          float* row = dqp + b * dqs[0] + h * dqs[1] + i * dqs[2];
          std::fill(row, row + P.D, 0.0f);
        }
      }
      // D_i = dO_i · O_i for every query row of the group's heads, once per task.
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
        for (int64_t i = 0; i < P.Lq; ++i) {
          const float* g = gp + b * gs[0] + h * gs[1] + i * gs[2];
          const float* o = op + b * os[0] + h * os[1] + i * os[2];
          VR acc = Vec::zero();
          for (int64_t e = 0; e < P.Dv; e += kW) {
            const int64_t n = std::min<int64_t>(kW, P.Dv - e);
            acc = Vec::fma(Vec::load_partial(g + e, n), Vec::load_partial(o + e, n), acc);
          }
          alignas(64) float lanes[kW];
          Vec::store(lanes, acc);
          float sum = 0.0f;
          for (int l = 0; l < kW; ++l) sum += lanes[l];
          W.drow[(h - hk * G) * P.Lq + i] = sum;
        }
      }
      // Key groups of `span` keys: their K, V rows and dK, dV accumulators stay in L2 while every
      // query tile streams past once per group (not once per key block).
      for (int64_t jg = 0; jg < P.Lk; jg += span) {
        const int64_t ng = std::min(P.Lk - jg, span);
        std::fill(W.dk, W.dk + ng * P.D, 0.0f);
        std::fill(W.dv, W.dv + ng * P.Dv, 0.0f);
        for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
          for (int64_t it = 0; it < n_qt; ++it) {
            const int64_t i0 = it * kTQ, nq = std::min(P.Lq - i0, kTQ);
            if (P.causal && jg > i0 + nq - 1 + P.causal_offset) continue;  // every key hidden
            const fwd::Tile t{P, b, h, hk, i0, nq, W.tmp};
            const float* q0 = qp + b * qs[0] + h * qs[1] + i0 * qs[2];
            const float* g0 = gp + b * gs[0] + h * gs[1] + i0 * gs[2];
            const bool few = nq <= kSmallQ;
            if (!few) {
              fwd::Widen<float>::pack_q(q0, qs[2], nq, P.D, c, W.qt);
              fwd::Widen<float>::pack_q(g0, gs[2], nq, P.Dv, 1.0f, W.dot);
            }
            alignas(64) float lse2[kTQ], dsum[kTQ];
            for (int64_t l = 0; l < kTQ; ++l) {
              const float x = l < nq ? lp[(b * P.H + h) * P.Lq + i0 + l] : -kInf;
              lse2[l] = x == -kInf ? kInf : x * kLog2e;  // +inf: the row sees nothing, P = 0
              dsum[l] = l < nq ? W.drow[(h - hk * G) * P.Lq + i0 + l] : 0.0f;
            }
            for (int64_t j0 = jg; j0 < jg + ng; j0 += kTK) {
              const int64_t nk = std::min(jg + ng - j0, kTK);
              if (P.causal && j0 > i0 + nq - 1 + P.causal_offset) break;  // this and later keys hidden
              float* dkj = W.dk + (j0 - jg) * P.D;
              float* dvj = W.dv + (j0 - jg) * P.Dv;
              // 1. S^T = K_j · (Q_i · c)^T, masked; P = 2^(S - lse2)
              if (few) {
                small_dots(nk, kh + j0 * ks[2], ks[2], q0, qs[2], nq, P.D, c, W.s);
              } else {
                fwd::qk_block(nk, kh + j0 * ks[2], ks[2], W.qt, P.D, W.s, nullptr);
              }
              VR mx[kNQ] = {Vec::zero(), Vec::zero()};
              const bool causal_here = P.causal && j0 + nk - 1 > i0 + P.causal_offset;
              if (causal_here || P.mask_kind != MaskKind::None) fwd::apply_masks(t, j0, nk, causal_here, W.s, mx);
              for (int64_t r = 0; r < nk; ++r) {
                for (int vv = 0; vv < kNQ; ++vv) {
                  float* sp = W.s + r * kTQ + vv * kW;
                  Vec::store(sp, Vec::exp2(Vec::sub(Vec::load(sp), Vec::load(lse2 + vv * kW))));
                }
              }
              // 2. dP^T = V_j · dO_i^T
              if (few) {
                small_dots(nk, vh + j0 * vs[2], vs[2], g0, gs[2], nq, P.Dv, 1.0f, W.dp);
              } else {
                fwd::qk_block(nk, vh + j0 * vs[2], vs[2], W.dot, P.Dv, W.dp, nullptr);
              }
              // 3. dV_j += Pd^T dO_i
              if (P.dropout_p > 0.0) {
                for (int64_t r = 0; r < nk; ++r) {
                  for (int64_t l = 0; l < nq; ++l) {
                    const float z = dropout_keep(P.seed, dropout_index(P, b, h, i0 + l, j0 + r), P.dropout_p) ? keep_scale : 0.0f;
                    W.dp[r * kTQ + l] *= z;       // dP = dP ∘ Z/(1-p)
                    W.dcol[l] = z;
                  }
                  // dV_j[r] += sum_l P[r][l] z[r][l] dO[l]
                  for (int64_t l = 0; l < nq; ++l) W.dcol[l] *= W.s[r * kTQ + l];  // Pd = P z
                  gemm_acc(1, P.Dv, nq, W.dcol, 0, 1, g0, gs[2], dvj + r * P.Dv, P.Dv, 1.0f);
                }
              } else {
                gemm_acc(nk, P.Dv, nq, W.s, kTQ, 1, g0, gs[2], dvj, P.Dv, 1.0f);
              }
              // 4. dS = P ∘ (dP - D)
              for (int64_t r = 0; r < nk; ++r) {
                for (int vv = 0; vv < kNQ; ++vv) {
                  const VR pv = Vec::load(W.s + r * kTQ + vv * kW);
                  const VR d = Vec::sub(Vec::load(W.dp + r * kTQ + vv * kW), Vec::load(dsum + vv * kW));
                  Vec::store(W.dp + r * kTQ + vv * kW, Vec::mul(pv, d));
                }
                if (nq < kTQ) std::fill(W.dp + r * kTQ + nq, W.dp + (r + 1) * kTQ, 0.0f);
              }
              if (dmask_full != nullptr) {
                for (int64_t l = 0; l < nq; ++l) {
                  float* row = dmask_full + ((b * P.H + h) * P.Lq + i0 + l) * P.Lk + j0;
                  for (int64_t r = 0; r < nk; ++r) row[r] = W.dp[r * kTQ + l];
                }
              }
              // 5. dK_j += scale · dS^T Q_i;  dQ_i += scale · dS K_j
              gemm_acc(nk, P.D, nq, W.dp, kTQ, 1, q0, qs[2], dkj, P.D, scale);
              gemm_acc(nq, P.D, nk, W.dp, 1, kTQ, kh + j0 * ks[2], ks[2], dqp + b * dqs[0] + h * dqs[1] + i0 * dqs[2],
                       dqs[2], scale);
            }
          }
        }
        for (int64_t r = 0; r < ng; ++r) {
          std::copy_n(W.dk + r * P.D, P.D, dkp + b * dks[0] + hk * dks[1] + (jg + r) * dks[2]);
          std::copy_n(W.dv + r * P.Dv, P.Dv, dvp + b * dvs[0] + hk * dvs[1] + (jg + r) * dvs[2]);
        }
      }
    }
  }
}
