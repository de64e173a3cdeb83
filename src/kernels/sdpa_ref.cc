// sdpa_ref.cc — the float64 specification of SDPA (forward). Plain loops, full score matrix.
//
//   S = q kᵀ · scale + mask (bool false / causal-hidden -> -inf);  W = softmax(S) (row with no
//   visible key -> 0);  W = dropout(W) (same keep rule as every kernel);  out = W v.
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/sdpa_problem.h"

namespace heads::ref {

SdpaResult sdpa_fwd_f64(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                        const SdpaOptions& opts) {
  using namespace kernels;
  const SdpaProblem P = make_sdpa_problem("ref::sdpa_fwd_f64", q_in, k_in, v_in, opts);
  for (const Tensor* t : {&q_in, &k_in, &v_in}) {
    HEADS_CHECK(is_floating(t->dtype()), "ref::sdpa_fwd_f64: inputs must be floating, got ",
                dtype_name(t->dtype()));
  }
  const Tensor q = q_in.to(DType::F64), k = k_in.to(DType::F64), v = v_in.to(DType::F64);
  const double* qp = q.data<double>();
  const double* kp = k.data<double>();
  const double* vp = v.data<double>();
  SdpaResult r;
  r.out = Tensor::zeros({P.B, P.H, P.Lq, P.Dv}, DType::F64);
  r.weights = Tensor::zeros({P.B, P.H, P.Lq, P.Lk}, DType::F64);
  r.lse = Tensor::empty({P.B, P.H, P.Lq}, DType::F64);
  double* op = r.out.data<double>();
  double* wp = r.weights.data<double>();
  double* lp = r.lse.data<double>();
  const double ninf = -std::numeric_limits<double>::infinity();
  std::vector<double> s(static_cast<size_t>(P.Lk));

  for (int64_t b = 0; b < P.B; ++b) {
    for (int64_t h = 0; h < P.H; ++h) {
      const int64_t hk = h / P.group();
      for (int64_t i = 0; i < P.Lq; ++i) {
        const double* qi = qp + ((b * P.H + h) * P.Lq + i) * P.D;
        double mx = ninf;
        for (int64_t j = 0; j < P.Lk; ++j) {
          const double* kj = kp + ((b * P.Hkv + hk) * P.Lk + j) * P.D;
          double acc = 0.0;
          for (int64_t d = 0; d < P.D; ++d) acc += qi[d] * kj[d];
          double x = acc * P.scale;
          if (!P.visible_causal(i, j)) x = ninf;
          if (P.mask_kind != MaskKind::None) {
            const int64_t off = P.mask_offset(b, h, i) + j * P.mask.stride(3);
            if (P.mask_kind == MaskKind::Bool) {
              if (!static_cast<const uint8_t*>(P.mask.raw_data())[off]) x = ninf;
            } else {
              x += static_cast<const float*>(P.mask.raw_data())[off];
            }
          }
          s[j] = x;
          mx = std::max(mx, x);
        }
        double* w = wp + ((b * P.H + h) * P.Lq + i) * P.Lk;
        double* o = op + ((b * P.H + h) * P.Lq + i) * P.Dv;
        lp[(b * P.H + h) * P.Lq + i] = ninf;
        if (mx == ninf) continue;  // no visible key: zero weights and output
        double sum = 0.0;
        for (int64_t j = 0; j < P.Lk; ++j) sum += std::exp(s[j] - mx);
        lp[(b * P.H + h) * P.Lq + i] = mx + std::log(sum);
        for (int64_t j = 0; j < P.Lk; ++j) {
          double p = std::exp(s[j] - mx) / sum;
          if (P.dropout_p > 0.0) {
            p = dropout_keep(P.seed, dropout_index(P, b, h, i, j), P.dropout_p)
                    ? p / (1.0 - P.dropout_p)
                    : 0.0;
          }
          w[j] = p;
          const double* vj = vp + ((b * P.Hkv + hk) * P.Lk + j) * P.Dv;
          for (int64_t d = 0; d < P.Dv; ++d) o[d] += p * vj[d];
        }
      }
    }
  }
  return r;
}

}  // namespace heads::ref
