// linear_attention_backward.cc — the backward of include/heads/linear_attention.h: the state
// recomputed chunk by chunk, the causal sums run in reverse.
#include "heads/linear_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <vector>

#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/linear.h"
#include "kernels/linear_attention_common.h"
#include "kernels/ops_common.h"

namespace heads {

using kernels::f32;
using namespace linattn;

LinearAttentionGrads linear_attention_backward(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in,
                                               const Tensor& v_in, const LinearAttentionOptions& o) {
  const char* op = "linear_attention_backward";
  const Dims d = check(op, q_in, k_in, v_in, o);
  HEADS_CHECK(dout_in.defined() && dout_in.shape() == Shape({d.B, d.H, d.Lq, d.Dv}), op, ": dout: expected ",
              Shape({d.B, d.H, d.Lq, d.Dv}), ", got ", dout_in.defined() ? dout_in.shape() : Shape{});
  const Tensor q = f32(q_in, op, "query"), k = f32(k_in, op, "key");
  const Tensor kpm = o.key_padding_mask.defined() ? o.key_padding_mask.contiguous() : Tensor();
  const auto* mask = kpm.defined() ? static_cast<const uint8_t*>(kpm.raw_data()) : nullptr;
  const Tensor v = values_of(v_in, op, mask);
  const Tensor g = f32(dout_in, op, "dout");
  LinearAttentionGrads r{Tensor::empty(q.shape(), DType::F32), Tensor::empty(k.shape(), DType::F32),
                         Tensor::empty(v.shape(), DType::F32)};
  const float eps = static_cast<float>(o.eps);
  const FeatureMap fm = o.feature_map;
  const int64_t C = kChunk, D = d.D, Dv = d.Dv;
  const int n_threads = threads_for_tasks(d.B * d.H, 6.0 * static_cast<double>(d.B * d.H) *
                                                         static_cast<double>(d.Lq + d.Lk) * D * Dv);
  const auto mm = kernels::active().small_matmul_f32;
  FirstError error;
#pragma omp parallel num_threads(n_threads)
  {
    std::vector<float> S, z, dS, dz, fq, fk, num, den, A, M, tmp, t2, dA, dn;
    bool ready = false;
    try {
      zeroed(S, D * Dv), zeroed(z, D), zeroed(dS, D * Dv), zeroed(dz, D), zeroed(fq, C * D), zeroed(fk, C * D), zeroed(num, C * Dv);
      zeroed(den, C), zeroed(A, C * C), zeroed(M, C * C), zeroed(tmp, std::max({C * D, C * Dv, D * Dv}));
      zeroed(t2, std::max(C * D, C * Dv)), zeroed(dA, (o.causal ? d.Lq : C) * Dv), zeroed(dn, o.causal ? d.Lq : C);
      ready = true;
    } catch (...) {
      error.capture();
    }
    const auto features = [&](const float* x, int64_t n, float* f) { linattn::features(fm, x, n, D, f); };
    const uint8_t* km = nullptr;  // the task's key_padding_mask row (nonzero = ignored key), or null
    const auto key_features = [&](const float* kh, int64_t j0, int64_t n) {  // into fk
      linattn::key_features(fm, km, kh, j0, n, D, fk.data());
    };
    const auto zero_masked = [&](float* rows, int64_t j0, int64_t n, int64_t width) { zero_ignored(km, rows, j0, n, width); };
    const auto add_to = [](float* y, const float* x, int64_t n) {
      for (int64_t e = 0; e < n; ++e) y[e] += x[e];
    };
    // S += φ(K_c)ᵀ V_c, z += Σ φ(K_c) rows (fk holds φ(K_c)).
    const auto absorb = [&](const float* vc, int64_t n) {
      mm(D, Dv, n, fk.data(), 1, D, vc, Dv, 1, tmp.data(), Dv);
      add_to(S.data(), tmp.data(), D * Dv);
      for (int64_t rr = 0; rr < n; ++rr) add_to(z.data(), fk.data() + rr * D, D);
    };
    // dS += φ(Q_c)ᵀ dA_c, dz += Σ φ(Q_c) dn (fq holds φ(Q_c)).
    const auto absorb_grad = [&](const float* dAc, const float* dnc, int64_t n) {
      mm(D, Dv, n, fq.data(), 1, D, dAc, Dv, 1, tmp.data(), Dv);
      add_to(dS.data(), tmp.data(), D * Dv);
      for (int64_t rr = 0; rr < n; ++rr) {
        for (int64_t x = 0; x < D; ++x) dz[static_cast<size_t>(x)] += fq[static_cast<size_t>(rr * D + x)] * dnc[rr];
      }
    };
    // From num, den of rows [i0, i0 + n): dA = dO / den, dn = -(dO · out) / den.
    const auto row_grads = [&](const float* gh, int64_t i0, int64_t n, float* dAc, float* dnc) {
      for (int64_t rr = 0; rr < n; ++rr) {
        const float inv = 1.0f / den[static_cast<size_t>(rr)];
        float go = 0.0f;
        for (int64_t c = 0; c < Dv; ++c) {
          const float gc = gh[(i0 + rr) * Dv + c];
          dAc[rr * Dv + c] = gc * inv;
          go += gc * num[static_cast<size_t>(rr * Dv + c)] * inv;
        }
        dnc[rr] = -go * inv;
      }
    };
    // dx = (dφ + bias) ∘ φ'(x) for rows of D, dφ in tmp, φ(x) in f.
    const auto through_phi = [&](const float* f, int64_t n, const float* bias_rows, const float* bias_vec, float* dx) {
      for (int64_t rr = 0; rr < n; ++rr) {
        for (int64_t e = 0; e < D; ++e) {
          float t = tmp[static_cast<size_t>(rr * D + e)];
          if (bias_rows != nullptr) t += bias_rows[rr] * bias_vec[e];
          else if (bias_vec != nullptr) t += bias_vec[e];
          dx[rr * D + e] = t * dphi_of_phi(fm, f[rr * D + e]);
        }
      }
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
      if (!ready) continue;
      km = mask != nullptr ? mask + bh / d.H * d.Lk : nullptr;
      try {
        const float* qh = q.data<float>() + bh * d.Lq * D;
        const float* kh = k.data<float>() + bh * d.Lk * D;
        const float* vh = v.data<float>() + bh * d.Lk * Dv;
        const float* gh = g.data<float>() + bh * d.Lq * Dv;
        float* dqh = r.dq.data<float>() + bh * d.Lq * D;
        float* dkh = r.dk.data<float>() + bh * d.Lk * D;
        float* dvh = r.dv.data<float>() + bh * d.Lk * Dv;
        for (auto* x : {&S, &z, &dS, &dz}) std::fill(x->begin(), x->end(), 0.0f);
        if (!o.causal) {
          for (int64_t j0 = 0; j0 < d.Lk; j0 += C) {
            const int64_t n = std::min(C, d.Lk - j0);
            key_features(kh, j0, n);
            absorb(vh + j0 * Dv, n);
          }
          for (int64_t i0 = 0; i0 < d.Lq; i0 += C) {
            const int64_t n = std::min(C, d.Lq - i0);
            features(qh + i0 * D, n, fq.data());
            mm(n, Dv, D, fq.data(), D, 1, S.data(), Dv, 1, num.data(), Dv);
            for (int64_t rr = 0; rr < n; ++rr) {
              float sden = eps;
              for (int64_t x = 0; x < D; ++x) sden += fq[static_cast<size_t>(rr * D + x)] * z[static_cast<size_t>(x)];
              den[static_cast<size_t>(rr)] = sden;
            }
            row_grads(gh, i0, n, dA.data(), dn.data());
            mm(n, D, Dv, dA.data(), Dv, 1, S.data(), 1, Dv, tmp.data(), D);  // dA Sᵀ
            through_phi(fq.data(), n, dn.data(), z.data(), dqh + i0 * D);
            absorb_grad(dA.data(), dn.data(), n);
          }
          for (int64_t j0 = 0; j0 < d.Lk; j0 += C) {
            const int64_t n = std::min(C, d.Lk - j0);
            key_features(kh, j0, n);
            mm(n, D, Dv, vh + j0 * Dv, Dv, 1, dS.data(), 1, Dv, tmp.data(), D);  // V dSᵀ
            through_phi(fk.data(), n, nullptr, dz.data(), dkh + j0 * D);
            zero_masked(dkh + j0 * D, j0, n, D);
            mm(n, Dv, D, fk.data(), D, 1, dS.data(), Dv, 1, dvh + j0 * Dv, Dv);  // φ(K) dS
            zero_masked(dvh + j0 * Dv, j0, n, Dv);
          }
        } else {
          // Causal, forward in chunks: out's pieces, dA and dn of every row, and dq from the state of the
          // keys before the chunk plus the chunk's own lower triangle.
          for (int64_t i0 = 0; i0 < d.Lq; i0 += C) {
            const int64_t n = std::min(C, d.Lq - i0);
            const float* vc = vh + i0 * Dv;
            features(qh + i0 * D, n, fq.data());
            key_features(kh, i0, n);
            mm(n, Dv, D, fq.data(), D, 1, S.data(), Dv, 1, num.data(), Dv);
            mm(n, n, D, fq.data(), D, 1, fk.data(), 1, D, A.data(), n);
            for (int64_t rr = 0; rr < n; ++rr) {
              float* ar = A.data() + rr * n;
              std::fill(ar + rr + 1, ar + n, 0.0f);
              float sden = eps;
              for (int64_t x = 0; x < D; ++x) sden += fq[static_cast<size_t>(rr * D + x)] * z[static_cast<size_t>(x)];
              for (int64_t c = 0; c <= rr; ++c) sden += ar[c];
              den[static_cast<size_t>(rr)] = sden;
            }
            add_lower_times(n, Dv, A.data(), vc, Dv, num.data(), t2.data());
            float* dAc = dA.data() + i0 * Dv;
            float* dnc = dn.data() + i0;
            row_grads(gh, i0, n, dAc, dnc);
            // M = dA V_cᵀ + dn (keys j <= i), dφQ = dA Sᵀ + dn zᵀ + M φ(K_c)
            mm(n, n, Dv, dAc, Dv, 1, vc, 1, Dv, M.data(), n);
            for (int64_t rr = 0; rr < n; ++rr) {
              float* mr = M.data() + rr * n;
              for (int64_t c = 0; c <= rr; ++c) mr[c] += dnc[rr];
              std::fill(mr + rr + 1, mr + n, 0.0f);
            }
            mm(n, D, Dv, dAc, Dv, 1, S.data(), 1, Dv, tmp.data(), D);
            for (int64_t rr = 0; rr < n; ++rr) {
              for (int64_t x = 0; x < D; ++x) tmp[static_cast<size_t>(rr * D + x)] += dnc[rr] * z[static_cast<size_t>(x)];
            }
            add_lower_times(n, D, M.data(), fk.data(), D, tmp.data(), t2.data());
            through_phi(fq.data(), n, nullptr, nullptr, dqh + i0 * D);
            absorb(vc, n);
          }
          // Causal, keys in reverse chunks: the suffix sums dS, dz of the queries after the chunk plus
          // the chunk's own upper triangle (queries i >= j).
          const int64_t last = (d.Lq - 1) / C * C;
          for (int64_t i0 = last; i0 >= 0; i0 -= C) {
            const int64_t n = std::min(C, d.Lq - i0);
            const float* vc = vh + i0 * Dv;
            const float* dAc = dA.data() + i0 * Dv;
            const float* dnc = dn.data() + i0;
            features(qh + i0 * D, n, fq.data());
            key_features(kh, i0, n);
            // M[i][j] = dA_i · v_j + dn_i for i >= j
            mm(n, n, Dv, dAc, Dv, 1, vc, 1, Dv, M.data(), n);
            mm(n, n, D, fq.data(), D, 1, fk.data(), 1, D, A.data(), n);
            for (int64_t rr = 0; rr < n; ++rr) {
              float* mr = M.data() + rr * n;
              float* ar = A.data() + rr * n;
              for (int64_t c = 0; c <= rr; ++c) mr[c] += dnc[rr];
              std::fill(mr + rr + 1, mr + n, 0.0f);
              std::fill(ar + rr + 1, ar + n, 0.0f);
            }
            // dφK = V dSᵀ + dz + Mᵀ φ(Q_c)
            mm(n, D, Dv, vc, Dv, 1, dS.data(), 1, Dv, tmp.data(), D);
            add_lower_t_times(n, D, M.data(), fq.data(), D, tmp.data(), t2.data());
            through_phi(fk.data(), n, nullptr, dz.data(), dkh + i0 * D);
            zero_masked(dkh + i0 * D, i0, n, D);
            // dV = φ(K_c) dS + Aᵀ dA_c
            mm(n, Dv, D, fk.data(), D, 1, dS.data(), Dv, 1, dvh + i0 * Dv, Dv);
            add_lower_t_times(n, Dv, A.data(), dAc, Dv, dvh + i0 * Dv, t2.data());
            zero_masked(dvh + i0 * Dv, i0, n, Dv);
            absorb_grad(dAc, dnc, n);
          }
        }
      } catch (...) {
        error.capture();
      }
    }
  }
  error.rethrow();
  return r;
}

}  // namespace heads
