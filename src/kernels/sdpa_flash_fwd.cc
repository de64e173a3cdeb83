// sdpa_flash_fwd.cc — SDPA forward, tiled online softmax (FlashAttention-2, arXiv:2307.08691, Alg. 1).
//
// Shapes (elements; innermost stride 1, other strides free):
//   q [B, H, Lq, D]   k [B, Hkv, Lk, D]   v [B, Hkv, Lk, Dv]  ->  out [B, H, Lq, Dv], lse [B, H, Lq]
//   H % Hkv == 0; query head h reads kv head h / (H / Hkv).
// Masks: bool attn_mask true = may attend; float mask added; both broadcast to [B, H, Lq, Lk]
//   through zero strides; causal: key j visible iff j <= i + causal_offset. Key blocks past the
//   causal limit of a query tile are never visited.
// Numerics: f32 accumulation; masked logits are -inf; a fully masked row gives out = 0,
//   lse = -inf (no NaN: exp is never taken of -inf - -inf).
// Memory: per thread one kTileQ x kTileK score tile and a kTileQ x Dv accumulator; the
//   Lq x Lk weights exist only when requested (written in a second sweep from the final lse).
// Parallel: over (B, H, Lq tile); each row is computed by one task in a fixed order, so the
//   output is bitwise independent of the thread count.
// Reference: ref::sdpa_fwd_f64 in sdpa_ref.cc.
#include "kernels/sdpa_flash_fwd.h"

#include <omp.h>

#include <algorithm>
#include <vector>

#include "heads/runtime.h"
#include "kernels/vec.h"

namespace heads::kernels {

namespace {

constexpr int64_t kTileQ = 32;
constexpr int64_t kTileK = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Views {
  const float *q, *k, *v;
  float* out;
  int64_t qs[3], ks[3], vs[3], os[3];  // strides of dims 0..2
};

// Scaled, masked score of query i against key j (-inf when not visible).
inline float score(const SdpaProblem& P, const Views& V, const float* qrow, int64_t b, int64_t h,
                   int64_t hk, int64_t i, int64_t j) {
  if (!P.visible_causal(i, j)) return kNegInf;
  const float* krow = V.k + b * V.ks[0] + hk * V.ks[1] + j * V.ks[2];
  float s = dot_f32(qrow, krow, P.D) * static_cast<float>(P.scale);
  if (P.mask_kind == MaskKind::Bool) {
    const auto* m = static_cast<const uint8_t*>(P.mask.raw_data());
    if (!m[P.mask_offset(b, h, i) + j * P.mask.stride(3)]) s = kNegInf;
  } else if (P.mask_kind == MaskKind::Float) {
    const auto* m = static_cast<const float*>(P.mask.raw_data());
    s += m[P.mask_offset(b, h, i) + j * P.mask.stride(3)];
  }
  return s;
}

struct Scratch {
  float* s;    // [kTileQ][kTileK] scores, then probabilities
  float* acc;  // [kTileQ][Dv]
  float* m;    // [kTileQ] running max
  float* l;    // [kTileQ] running sum
};

void forward_tile(const SdpaProblem& P, const Views& V, int64_t b, int64_t h, int64_t qt,
                  const Scratch& W, float* lse, float* weights) {
  const int64_t hk = h / P.group();
  const int64_t i0 = qt * kTileQ, i1 = std::min(P.Lq, i0 + kTileQ), nq = i1 - i0;
  const int64_t jend = P.key_end(i1 - 1);  // causal limit of the tile's last (widest) row
  const float keep_scale = static_cast<float>(1.0 / (1.0 - P.dropout_p));
  std::fill(W.m, W.m + nq, kNegInf);
  std::fill(W.l, W.l + nq, 0.0f);
  std::fill(W.acc, W.acc + nq * P.Dv, 0.0f);

  for (int64_t j0 = 0; j0 < jend; j0 += kTileK) {
    const int64_t nk = std::min(jend, j0 + kTileK) - j0;
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t i = i0 + r;
      const float* qrow = V.q + b * V.qs[0] + h * V.qs[1] + i * V.qs[2];
      float* srow = W.s + r * kTileK;
      // 1. S = Q_i K_j^T * scale (+ mask); 2. m_new = max(m, rowmax(S))
      float rowmax = kNegInf;
      for (int64_t c = 0; c < nk; ++c) {
        srow[c] = score(P, V, qrow, b, h, hk, i, j0 + c);
        rowmax = std::max(rowmax, srow[c]);
      }
      const float m_new = std::max(W.m[r], rowmax);
      if (m_new == kNegInf) continue;  // nothing visible yet: P = 0, O and l stay 0
      // 3. P = exp(S - m_new); l = l * exp(m - m_new) + rowsum(P)
      const float alpha = std::exp(W.m[r] - m_new);  // exp(-inf) = 0 on the first visible block
      float sum = 0.0f;
      for (int64_t c = 0; c < nk; ++c) {
        const float p = std::exp(srow[c] - m_new);
        sum += p;
        srow[c] = p;
      }
      W.l[r] = W.l[r] * alpha + sum;
      W.m[r] = m_new;
      if (P.dropout_p > 0.0) {
        for (int64_t c = 0; c < nk; ++c) {
          const bool keep = dropout_keep(P.seed, dropout_index(P, b, h, i, j0 + c), P.dropout_p);
          srow[c] = keep ? srow[c] * keep_scale : 0.0f;
        }
      }
      // 4. O = O * exp(m - m_new) + P V_j
      float* o = W.acc + r * P.Dv;
      if (alpha != 1.0f) {
        for (int64_t d = 0; d < P.Dv; ++d) o[d] *= alpha;
      }
      for (int64_t c = 0; c < nk; ++c) {
        const float p = srow[c];
        if (p == 0.0f) continue;
        const float* vrow = V.v + b * V.vs[0] + hk * V.vs[1] + (j0 + c) * V.vs[2];
        for (int64_t d = 0; d < P.Dv; ++d) o[d] += p * vrow[d];
      }
    }
  }
  // 5. O /= l; lse = m + log(l); a row with l = 0 saw no key: zeros, lse = -inf.
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t i = i0 + r;
    float* orow = V.out + b * V.os[0] + h * V.os[1] + i * V.os[2];
    const float* o = W.acc + r * P.Dv;
    const float l = W.l[r];
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int64_t d = 0; d < P.Dv; ++d) orow[d] = o[d] * inv;
    lse[(b * P.H + h) * P.Lq + i] = l > 0.0f ? W.m[r] + std::log(l) : kNegInf;
  }
  // 6. Weights on request: w = exp(S - lse), dropped like P above.
  if (weights == nullptr) return;
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t i = i0 + r;
    const float* qrow = V.q + b * V.qs[0] + h * V.qs[1] + i * V.qs[2];
    const float row_lse = lse[(b * P.H + h) * P.Lq + i];
    float* wrow = weights + ((b * P.H + h) * P.Lq + i) * P.Lk;
    for (int64_t j = 0; j < P.Lk; ++j) {
      if (row_lse == kNegInf || j >= jend) {
        wrow[j] = 0.0f;
        continue;
      }
      float w = std::exp(score(P, V, qrow, b, h, hk, i, j) - row_lse);
      if (P.dropout_p > 0.0) {
        w = dropout_keep(P.seed, dropout_index(P, b, h, i, j), P.dropout_p) ? w * keep_scale : 0.0f;
      }
      wrow[j] = w;
    }
  }
}

}  // namespace

void sdpa_flash_fwd_f32(const SdpaProblem& P, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const Tensor& weights) {
  Views V{q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(), {}, {}, {}, {}};
  for (int d = 0; d < 3; ++d) {
    V.qs[d] = q.stride(d);
    V.ks[d] = k.stride(d);
    V.vs[d] = v.stride(d);
    V.os[d] = out.stride(d);
  }
  if (P.B == 0 || P.H == 0 || P.Lq == 0) return;
  const int64_t n_qt = (P.Lq + kTileQ - 1) / kTileQ;
  const int64_t n_tasks = P.B * P.H * n_qt;
  const int n_threads = static_cast<int>(std::min<int64_t>(get_num_threads(), n_tasks));
  // Per-thread scratch, padded to a cache line: S tile, O accumulator, m, l.
  const int64_t per = ((kTileQ * kTileK + kTileQ * P.Dv + 2 * kTileQ) + 15) / 16 * 16;
  std::vector<float> arena(static_cast<size_t>(per * n_threads));
  float* lse_p = lse.data<float>();
  float* w_p = weights.defined() ? weights.data<float>() : nullptr;

#pragma omp parallel num_threads(n_threads)
  {
    float* base = arena.data() + per * omp_get_thread_num();
    const Scratch W{base, base + kTileQ * kTileK, base + kTileQ * kTileK + kTileQ * P.Dv,
                    base + kTileQ * kTileK + kTileQ * P.Dv + kTileQ};
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_tasks; ++t) {
      const int64_t qt = t % n_qt, bh = t / n_qt;
      forward_tile(P, V, bh / P.H, bh % P.H, qt, W, lse_p, w_p);
    }
  }
}

}  // namespace heads::kernels
