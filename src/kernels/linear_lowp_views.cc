// linear_lowp_views.cc — a PackedLinear's value in f32 (dequantize) and its slices of output rows
// (PackedLinear::rows), the residual rows and outlier columns in range with them (include/heads/precision.h).
// Built without fused multiply-adds, as linear_lowp_pack.cc is: the same bits with any -march.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "heads/error.h"
#include "heads/precision.h"

namespace heads {

Tensor dequantize(const PackedLinear& w) {
  HEADS_CHECK(w.defined(), "dequantize: the packed weight is empty");
  if (w.precision() != Precision::Int8) return w.data().dtype() == DType::F32 ? w.data().clone() : w.data().to(DType::F32);
  const int64_t N = w.out_features(), K = w.in_features();
  Tensor out = Tensor::empty({N, K}, DType::F32);
  const auto* q = static_cast<const int8_t*>(w.data().raw_data());
  const float* s = w.scales().data<float>();
  float* y = out.data<float>();
  const int64_t Nr = w.residual_rows().defined() ? w.residual_rows().numel() : 0;
  const auto* rq = Nr ? static_cast<const int8_t*>(w.residual_data().raw_data()) : nullptr;
  int64_t j = 0;
  for (int64_t n = 0; n < N; ++n) {
    const bool res = j < Nr && w.residual_rows().data<int64_t>()[j] == n;
    for (int64_t k = 0; k < K; ++k) {
      double v = static_cast<double>(q[n * K + k]) * s[n];
      if (res) v += static_cast<double>(rq[j * K + k]) * w.residual_scales().data<float>()[j];
      y[n * K + k] = static_cast<float>(v);
    }
    j += res;
  }
  if (w.outlier_channels().defined()) {  // their columns (zero in the int8 term) as stored
    const int64_t O = w.outlier_channels().numel();
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t o = 0; o < O; ++o) y[n * K + w.outlier_channels().data<int64_t>()[o]] = w.outlier_weight().data<float>()[n * O + o];
    }
  }
  return out;
}

PackedLinear PackedLinear::rows(int64_t n0, int64_t n1) const {
  HEADS_CHECK(defined() && 0 <= n0 && n0 <= n1 && n1 <= out_features(), "PackedLinear::rows: [", n0, ", ", n1,
              ") is not a range of the ", defined() ? out_features() : 0, " output channels");
  PackedLinear p = *this;
  p.data_ = data_.slice(0, n0, n1);
  if (scales_.defined()) p.scales_ = scales_.slice(0, n0, n1);
  if (wide_.defined()) p.wide_ = wide_.slice(0, n0, n1);
  if (sums_.defined()) p.sums_ = sums_.slice(0, n0, n1);
  if (res_rows_.defined()) {  // the residual rows in range, renumbered from n0
    const int64_t* r = res_rows_.data<int64_t>();
    const int64_t Nr = res_rows_.numel();
    const int64_t j0 = std::lower_bound(r, r + Nr, n0) - r, j1 = std::lower_bound(r, r + Nr, n1) - r;
    p.res_rows_ = p.res_data_ = p.res_scales_ = p.res_sums_ = Tensor();
    if (j1 > j0) {
      std::vector<int64_t> rows(r + j0, r + j1);
      for (int64_t& v : rows) v -= n0;
      p.res_rows_ = Tensor::from_vector(rows, {j1 - j0});
      p.res_data_ = res_data_.slice(0, j0, j1);
      p.res_scales_ = res_scales_.slice(0, j0, j1);
      p.res_sums_ = res_sums_.slice(0, j0, j1);
    }
  }
  if (out_w_.defined()) {  // the outlier columns of the rows in range, and their transposed copy
    p.out_w_ = out_w_.slice(0, n0, n1).clone();
    p.finish();  // also the layouts below (the sums and the f32 copy again, of the same rows)
    return p;
  }
  p.make_gemm_layouts();  // other weights: their own layouts
  return p;
}

}  // namespace heads
