// linear_lowp_pack.cc — PackedLinear (include/heads/precision.h): weights converted to bf16 or
// quantised to int8 once (per output channel, with a residual term for the rows that lose too much),
// the calibrated outlier channels kept in f32, their oneDNN layouts, stored parts read back
// (from_int8). The f32 value and slices of rows: linear_lowp_views.cc; stacking and storing by name:
// linear_lowp_store.cc; heads' own int8 GEMM's weight layout: linear_lowp_pairs.cc; the calls that use
// them: linear_lowp.cc.
#include "heads/precision.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <omp.h>
#include <vector>

#include "heads/error.h"
#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/linear_lowp.h"
#include "kernels/onednn.h"

namespace heads {

using lowp::kRowBlock;
using lowp::onednn_native;

namespace {

constexpr int64_t kMaxInt8K = std::numeric_limits<int32_t>::max() / (255 * 127);

// The int8 weights are the same bits on every machine: this file's float arithmetic is evaluated as
// written (CMakeLists.txt compiles it with -ffp-contract=off: no fused multiply-adds), never
// reassociated.
#ifdef __FAST_MATH__
#error "linear_lowp_pack.cc must not be compiled with -ffast-math: round_even() depends on IEEE rounding"
#endif

// std::nearbyint in the default rounding mode (to nearest, ties to even) for |x| < 2^22: past
// 1.5 * 2^23 a float's step is 1, so adding it rounds to an integer and subtracting it is exact. Inline,
// so that the loops below vectorize (nearbyint is a library call); their values stay below 255 steps.
inline float round_even(float x) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  return (x + kShift) - kShift;
}

// std::clamp(x, -127, 127) by value (its references put the operands in memory, which the
// sanitizers then check on every use).
inline float clamp127(float x) { return x < -127.0f ? -127.0f : (127.0f < x ? 127.0f : x); }

// Symmetric int8 of one weight row: q = round(x / s), s = max|x| / 127 (s = 1 for an all-zero row);
// NaN when the row holds NaN or ±inf. (Activations: the table's quantize_rows_u8.)
float quantize_row(const float* x, int64_t K, int8_t* q) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t k = 0; k < K; ++k) {
    finite = finite && std::isfinite(x[k]);
    amax = std::max(amax, std::fabs(x[k]));
  }
  if (!finite) {
    std::fill(q, q + K, int8_t{0});
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float s = amax >= 127.0f * std::numeric_limits<float>::min() ? amax / 127.0f : 1.0f;  // as quantize-inl.h
  const float inv = 1.0f / s;
  for (int64_t k = 0; k < K; ++k) {
    q[k] = static_cast<int8_t>(clamp127(round_even(x[k] * inv)));
  }
  return s;
}

// The weight rows' scale: of s·c for c in {1, 0.99, ..., 0.50} (values beyond 127 steps clipped),
// the one with the least squared error over the row (the first of equals), its int8 values left in q.
// The errors, Σ (w − clamp(round_even(w / t), ±127)·t)² in double in the row's order, come from the
// kernel table (all the candidates of a row value at once, across the vector lanes).
float clip_row(const float* w, int64_t K, float s, int8_t* q) {
  constexpr int kScales = kernels::kInt8ScaleCandidates;
  float t[kScales];
  double error[kScales];
  for (int i = 0; i < kScales; ++i) t[i] = i == 0 ? s : s * static_cast<float>(100 - i) / 100.0f;
  kernels::active().int8_scale_errors(w, K, t, error);
  int best = 0;
  for (int i = 1; i < kScales; ++i) {
    if (error[i] < error[best]) best = i;
  }
  const float scale = t[best];
  for (int64_t k = 0; k < K; ++k) q[k] = static_cast<int8_t>(clamp127(round_even(w[k] / scale)));
  return scale;
}

// The residual r of a weight row q (int8) of scale sw (heads/precision.h): of the steps sw / 2^p for
// p = 8, ..., 0 whose row C = 2^p·q + clamp(round(r / step), ±127) is 16-bit and keeps 255·Σ|C| within
// int32 (int8_residual_fits), the one with the least squared error (values beyond 127 steps clipped; the finest of
// equals), its int8 values left in out; 0 when none fits (K past 33,025 only). The errors come from
// the kernel table's scale search (the candidates past the ninth unused).
float residual_row(const float* r, const int8_t* q, int64_t K, float sw, int8_t* out) {
  constexpr int kScales = kernels::kInt8ScaleCandidates, kShifts = kInt8MaxResidualShift + 1;
  float t[kScales];
  double error[kScales];
  for (int i = 0; i < kScales; ++i) t[i] = i < kShifts ? std::ldexp(sw, i - kInt8MaxResidualShift) : sw;
  kernels::active().int8_scale_errors(r, K, t, error);
  const auto values = [&](int i) {
    for (int64_t k = 0; k < K; ++k) out[k] = static_cast<int8_t>(clamp127(round_even(r[k] / t[i])));
  };
  int best = -1;
  for (int i = 0; i < kShifts; ++i) {
    if (best >= 0 && !(error[i] < error[best])) continue;
    values(i);
    if (int8_residual_fits(q, out, K, kInt8MaxResidualShift - i)) best = i;
  }
  if (best < 0) return 0.0f;
  values(best);
  return t[best];
}

// p when swr is sw / 2^p with 0 ≤ p ≤ kInt8MaxResidualShift, else -1.
int shift_of(float sw, float swr) {
  for (int p = 0; p <= kInt8MaxResidualShift; ++p) {
    if (std::ldexp(sw, -p) == swr) return p;
  }
  return -1;
}

// Σ_k data[n, k] of each row of an int8 [N, K] tensor, as f32 [N] (exact: |sum| ≤ 127·K < 2^24).
Tensor int8_row_sums(const Tensor& data) {
  const int64_t N = data.size(0), K = data.size(1);
  Tensor out = Tensor::empty({N}, DType::F32);
  const auto* q = static_cast<const int8_t*>(data.raw_data());
  for (int64_t n = 0; n < N; ++n) {
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += q[n * K + k];
    out.data<float>()[n] = static_cast<float>(sum);
  }
  return out;
}

}  // namespace

bool int8_residual_fits(const int8_t* q, const int8_t* r, int64_t K, int p) {
  int64_t sum = 0;  // 255·Σ|C| at most 2^31 − 1: every partial sum of u8 × C products fits int32
  for (int64_t k = 0; k < K; ++k) {
    const int64_t c = int64_t{q[k]} * (int64_t{1} << p) + r[k];
    sum += std::abs(c);
    if (c < std::numeric_limits<int16_t>::min() || c > std::numeric_limits<int16_t>::max() ||
        255 * sum > std::numeric_limits<int32_t>::max()) {
      return false;
    }
  }
  return true;
}

std::string precision_name(Precision p) {
  switch (p) {
    case Precision::F32: return "f32";
    case Precision::BF16: return "bf16";
    case Precision::Int8: return "int8";
  }
  return "?";
}

Precision precision_from_name(const std::string& s) {
  for (Precision p : {Precision::F32, Precision::BF16, Precision::Int8}) {
    if (precision_name(p) == s) return p;
  }
  fail("precision must be f32, bf16 or int8, got \"", s, "\"");
}

namespace {

// int8's outlier channels (heads/precision.h) among K inputs with calibrated largest |x| `absmax`:
// those past kInt8OutlierRatio times the median channel's, at most K/16 (the largest; the lower
// channel first among equals), increasing.
std::vector<int64_t> outlier_channels_of(const Tensor& absmax, int64_t K) {
  HEADS_CHECK(absmax.dim() == 1 && absmax.size(0) == K && is_floating(absmax.dtype()),
              "PackedLinear: input_absmax: expected a floating [", K, "] tensor (one per input channel), got ",
              dtype_name(absmax.dtype()), " ", absmax.shape());
  const Tensor a = absmax.to(DType::F32).contiguous();
  std::vector<float> v(a.data<float>(), a.data<float>() + K);
  for (int64_t k = 0; k < K; ++k) {
    HEADS_CHECK(std::isfinite(v[k]) && v[k] >= 0, "PackedLinear: input_absmax[", k, "] must be finite and at least 0, got ",
                v[k]);
  }
  std::vector<float> sorted = v;
  std::nth_element(sorted.begin(), sorted.begin() + K / 2, sorted.end());
  const double limit = kInt8OutlierRatio * sorted[static_cast<size_t>(K / 2)];
  std::vector<int64_t> out;
  for (int64_t k = 0; k < K; ++k) {
    if (v[k] > limit) out.push_back(k);
  }
  const auto most = static_cast<size_t>(K / 16);
  if (out.size() > most) {  // keep the largest
    std::stable_sort(out.begin(), out.end(), [&](int64_t x, int64_t y) { return v[x] > v[y]; });
    out.resize(most);
    std::sort(out.begin(), out.end());
  }
  return out;
}

}  // namespace

PackedLinear::PackedLinear(const Tensor& weight, Precision precision, double activation_error,
                           const Tensor& input_absmax, double residual_error)
    : precision_(precision), act_error_(activation_error) {
  HEADS_CHECK(activation_error >= 0, "PackedLinear: activation_error must be at least 0 (+inf: no second term), got ",
              activation_error);
  HEADS_CHECK(residual_error >= 0, "PackedLinear: residual_error must be at least 0 (+inf: no residual rows), got ",
              residual_error);
  HEADS_CHECK(weight.defined() && weight.dim() == 2 && is_floating(weight.dtype()),
              "PackedLinear: weight: expected a floating [out, in] tensor, got ",
              weight.defined() ? std::string(dtype_name(weight.dtype())) + " " + shape_str(weight.shape())
                               : std::string("none"));
  HEADS_CHECK(!input_absmax.defined() || precision == Precision::Int8,
              "PackedLinear: input_absmax is for int8 weights (outlier channels), not ", precision_name(precision));
  // The packed weight owns its memory (the caller's may be a view of an array that goes away).
  if (precision == Precision::F32) {
    data_ = weight.dtype() == DType::F32 ? weight.clone() : weight.to(DType::F32);
  } else if (precision == Precision::BF16) {
    data_ = weight.dtype() == DType::BF16 ? weight.clone() : weight.to(DType::BF16);
  } else {
    const int64_t N = weight.size(0), K = weight.size(1);
    HEADS_CHECK(K <= kMaxInt8K, "PackedLinear: int8 weight ", weight.shape(), " has more than ", kMaxInt8K,
                " inputs (int32 sums would overflow)");
    Tensor w = weight.to(DType::F32).contiguous();
    const std::vector<int64_t> outliers =
        input_absmax.defined() ? outlier_channels_of(input_absmax, K) : std::vector<int64_t>{};
    if (!outliers.empty()) {  // their columns kept in f32, zero in the int8 term
      const auto O = static_cast<int64_t>(outliers.size());
      out_ch_ = Tensor::from_vector(outliers, {O});
      out_w_ = Tensor::empty({N, O}, DType::F32);
      w = w.clone();
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t o = 0; o < O; ++o) {
          float& x = w.data<float>()[n * K + outliers[o]];
          out_w_.data<float>()[n * O + o] = x;
          x = 0.0f;
        }
      }
    }
    data_ = Tensor::empty({N, K}, DType::I8);
    scales_ = Tensor::empty({N}, DType::F32);
    const float* rows = w.data<float>();
    auto* q = static_cast<int8_t*>(data_.raw_data());
    float* scales = scales_.data<float>();
    // A row's residual after its int8 term: row - q * scale.
    const auto residual = [&](int64_t n, int64_t k) {
      return rows[n * K + k] - static_cast<float>(q[n * K + k]) * scales[n];
    };
    // The rows are independent (a search over 51 scales each): in parallel, each row's result the same
    // on any number of threads. First the int8 terms, and which rows need a residual term. Nothing in
    // the parallel loops throws (buffers are allocated before them, errors reported after them).
    std::vector<uint8_t> needs_residual(static_cast<size_t>(N), 0);
    const int threads = static_cast<int>(std::clamp<int64_t>(N, 1, get_num_threads()));
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; ++n) {
      const float* row = rows + n * K;
      const float s = quantize_row(row, K, q + n * K);
      scales[n] = s;
      if (!std::isfinite(s)) continue;  // reported below
      scales[n] = clip_row(row, K, s, q + n * K);
      double err = 0, norm = 0;
      for (int64_t k = 0; k < K; ++k) {
        const float r = residual(n, k);
        err += static_cast<double>(r) * r;
        norm += static_cast<double>(row[k]) * row[k];
      }
      needs_residual[n] = err > residual_error * residual_error * norm;
    }
    for (int64_t n = 0; n < N; ++n) {
      HEADS_CHECK(std::isfinite(scales[n]), "PackedLinear: weight row ", n, " holds NaN or inf");
    }
    std::vector<int64_t> heavy;  // rows that get the residual term
    for (int64_t n = 0; n < N; ++n) {
      if (needs_residual[n]) heavy.push_back(n);
    }
    const auto Nr = static_cast<int64_t>(heavy.size());
    std::vector<int8_t> rq(static_cast<size_t>(Nr * K));
    std::vector<float> rs(static_cast<size_t>(Nr));
    const int res_threads = static_cast<int>(std::clamp<int64_t>(Nr, 1, get_num_threads()));
    std::vector<float> residuals(static_cast<size_t>(res_threads * K));  // a row per thread
#pragma omp parallel num_threads(res_threads) if (res_threads > 1)
    {
      float* r = residuals.data() + omp_get_thread_num() * K;
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < Nr; ++i) {
        for (int64_t k = 0; k < K; ++k) r[k] = residual(heavy[i], k);
        rs[i] = residual_row(r, q + heavy[i] * K, K, scales[heavy[i]], rq.data() + i * K);
      }
    }
    // Rows none of whose residual steps fits (K past 33,025) keep one term.
    int64_t kept = 0;
    for (int64_t i = 0; i < Nr; ++i) {
      if (rs[i] == 0.0f) continue;
      heavy[kept] = heavy[i];
      rs[kept] = rs[i];
      std::copy(rq.begin() + i * K, rq.begin() + (i + 1) * K, rq.begin() + kept * K);
      ++kept;
    }
    if (kept > 0) {
      heavy.resize(static_cast<size_t>(kept));
      rq.resize(static_cast<size_t>(kept * K));
      rs.resize(static_cast<size_t>(kept));
      res_rows_ = Tensor::from_vector(heavy, {kept});
      res_data_ = Tensor::from_vector(rq, {kept, K});
      res_scales_ = Tensor::from_vector(rs, {kept});
    }
  }
  finish();
}

void PackedLinear::make_gemm_layouts() {
  gemm_b_ = nullptr;
  pairs_b_ = precision_ == Precision::Int8 ? std::make_shared<lowp::PairsB>() : nullptr;
  stacked_ = Tensor();
  res_rows32_.clear();
  res_shift_.clear();
  sums32_.clear();
  fold_sums32_.clear();
  fold_scales_.clear();
  fold_shift32_.clear();
  fold_col32_.clear();
  fold_mask32_.clear();
  if (precision_ == Precision::Int8) {  // the sums are exact integers below 2^24
    sums32_.assign(sums_.data<float>(), sums_.data<float>() + sums_.numel());
    fold_sums32_ = sums32_;
    fold_scales_.assign(scales_.data<float>(), scales_.data<float>() + scales_.numel());
  }
  gemm_b_ = std::make_shared<kernels::PackedB>();
  if (precision_ == Precision::F32 || !res_data_.defined()) return;
  const int64_t Nr = res_data_.size(0), K = res_data_.size(1), Nrp = (Nr + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int64_t N0 = data_.size(0);
  stacked_ = Tensor::zeros({N0 + Nrp, K}, DType::I8);
  stacked_.slice(0, 0, N0).copy_from(data_);
  stacked_.slice(0, N0, N0 + Nr).copy_from(res_data_);
  data_ = stacked_.slice(0, 0, N0);  // the same values, stored once with the residual rows
  HEADS_CHECK(data_.size(0) <= std::numeric_limits<int32_t>::max(), "PackedLinear: ", data_.size(0),
              " output features with residual rows (at most 2^31 - 1)");
  res_rows32_.assign(res_rows_.data<int64_t>(), res_rows_.data<int64_t>() + Nr);
  res_shift_.resize(static_cast<size_t>(Nr));
  const auto N = static_cast<size_t>(data_.size(0));
  fold_shift32_.assign(N, 0);
  fold_col32_.assign(N, 0);
  fold_mask32_.assign(N, 0);
  for (int64_t j = 0; j < Nr; ++j) {  // residual scales are sw / 2^p (the constructor's, from_int8's)
    const int p = shift_of(scales_.data<float>()[res_rows32_[j]], res_scales_.data<float>()[j]);
    HEADS_CHECK(p >= 0, "PackedLinear: residual row ", j, ": its scale is not the row's / 2^p");
    res_shift_[static_cast<size_t>(j)] = p;
    // C's sum, 2^p·ws + wrs: |Σ C| ≤ Σ|C| < 2^31 / 255 (int8_residual_fits)
    const auto n = static_cast<size_t>(res_rows32_[j]);
    fold_sums32_[n] = static_cast<int32_t>(int64_t{sums32_[n]} * (int64_t{1} << p) +
                                           static_cast<int64_t>(res_sums_.data<float>()[j]));
    fold_scales_[n] = res_scales_.data<float>()[j];
    fold_shift32_[n] = p;
    fold_col32_[n] = static_cast<int32_t>(j);
    fold_mask32_[n] = ~uint32_t{0};
  }
}

void PackedLinear::finish() {
  keep_ = out_w_panels_ = Tensor();
  if (out_ch_.defined()) {
    const int64_t K = data_.size(1), N = data_.size(0), O = out_ch_.numel();
    keep_ = Tensor::empty({K}, DType::F32);
    std::fill(keep_.data<float>(), keep_.data<float>() + K, 1.0f);
    for (int64_t o = 0; o < O; ++o) keep_.data<float>()[out_ch_.data<int64_t>()[o]] = 0.0f;
    constexpr int64_t P = kernels::kOutlierPanel;
    const int64_t panels = (N + P - 1) / P;
    out_w_panels_ = Tensor::zeros({panels, O, P}, DType::F32);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t o = 0; o < O; ++o) out_w_panels_.data<float>()[((n / P) * O + o) * P + n % P] = out_w_.data<float>()[n * O + o];
    }
  }
  if (precision_ == Precision::Int8) {
    sums_ = int8_row_sums(data_);
    res_sums_ = res_data_.defined() ? int8_row_sums(res_data_) : Tensor();
  }
  make_gemm_layouts();
  if (lowp::needs_f32_copy(precision_)) wide_ = dequantize(*this);
}

PackedLinear PackedLinear::f32_shared(const Tensor& weight) {
  HEADS_CHECK(weight.defined() && weight.dim() == 2 && weight.dtype() == DType::F32 && weight.is_contiguous(),
              "PackedLinear::f32_shared: weight: expected a contiguous f32 [out, in] tensor, got ",
              weight.defined() ? std::string(dtype_name(weight.dtype())) + " " + shape_str(weight.shape())
                               : std::string("none"));
  PackedLinear p;
  p.precision_ = Precision::F32;
  p.data_ = weight;
  p.make_gemm_layouts();
  return p;
}

PackedLinear PackedLinear::from_int8(const Tensor& data, const Tensor& scales, const std::string& name,
                                     const Tensor& residual_rows, const Tensor& residual_data,
                                     const Tensor& residual_scales, const Tensor& outlier_channels,
                                     const Tensor& outlier_weight, double activation_error) {
  HEADS_CHECK(activation_error >= 0, name, ": activation error must be at least 0 (+inf: no second term), got ",
              activation_error);
  HEADS_CHECK(data.defined() && data.dtype() == DType::I8 && data.dim() == 2, name,
              ": expected int8 [out, in] data, got ",
              data.defined() ? std::string(dtype_name(data.dtype())) + " " + shape_str(data.shape()) : "none");
  HEADS_CHECK(data.size(1) <= kMaxInt8K, name, ": ", data.size(1), " inputs is more than ", kMaxInt8K);
  HEADS_CHECK(scales.defined() && scales.dtype() == DType::F32 && scales.shape() == Shape({data.size(0)}), name,
              ": scales: expected f32 [", data.size(0), "], got ",
              scales.defined() ? std::string(dtype_name(scales.dtype())) + " " + shape_str(scales.shape()) : "none");
  PackedLinear p;
  p.precision_ = Precision::Int8;
  p.act_error_ = activation_error;
  p.data_ = data.clone();  // owned, as the constructor's
  p.scales_ = scales.clone();
  for (int64_t n = 0; n < p.scales_.numel(); ++n) {
    const float s = p.scales_.data<float>()[n];
    HEADS_CHECK(std::isfinite(s) && s > 0.0f, name, ": scale ", n, " must be finite and positive, got ", s);
  }
  HEADS_CHECK(outlier_channels.defined() == outlier_weight.defined(), name,
              ": the outlier channels need their weight columns, and the columns their channels");
  if (outlier_channels.defined()) {
    const int64_t N = data.size(0), K = data.size(1);
    HEADS_CHECK(outlier_channels.dtype() == DType::I64 && outlier_channels.dim() == 1, name,
                ": outlier channels: expected i64 [channels], got ", dtype_name(outlier_channels.dtype()), " ",
                outlier_channels.shape());
    const int64_t O = outlier_channels.size(0);
    HEADS_CHECK(outlier_weight.dtype() == DType::F32 && outlier_weight.shape() == Shape({N, O}), name,
                ": outlier weight: expected f32 [", N, ", ", O, "], got ", dtype_name(outlier_weight.dtype()), " ",
                outlier_weight.shape());
    p.out_ch_ = outlier_channels.contiguous().clone();
    p.out_w_ = outlier_weight.contiguous().clone();
    const auto* q = static_cast<const int8_t*>(p.data_.raw_data());
    for (int64_t o = 0; o < O; ++o) {
      const int64_t c = p.out_ch_.data<int64_t>()[o];
      HEADS_CHECK(c >= 0 && c < K && (o == 0 || c > p.out_ch_.data<int64_t>()[o - 1]), name, ": outlier channel ", o,
                  " is ", c, ": channels must increase within [0, ", K, ")");
      for (int64_t n = 0; n < N; ++n) {
        HEADS_CHECK(q[n * K + c] == 0, name, ": outlier channel ", c, " holds int8 values (row ", n,
                    "): its columns are computed in f32 only");
        HEADS_CHECK(std::isfinite(p.out_w_.data<float>()[n * O + o]), name, ": outlier weight [", n, ", ", o,
                    "] is not finite");
      }
    }
    if (O == 0) p.out_ch_ = p.out_w_ = Tensor();
  }
  const int given = residual_rows.defined() + residual_data.defined() + residual_scales.defined();
  HEADS_CHECK(given == 0 || given == 3, name, ": the residual term needs its rows, data and scales together");
  if (given == 0) {
    p.finish();
    return p;
  }
  const int64_t N = data.size(0), K = data.size(1);
  HEADS_CHECK(residual_rows.dtype() == DType::I64 && residual_rows.dim() == 1, name,
              ": residual rows: expected i64 [rows], got ", dtype_name(residual_rows.dtype()), " ",
              residual_rows.shape());
  const int64_t Nr = residual_rows.size(0);
  HEADS_CHECK(residual_data.dtype() == DType::I8 && residual_data.shape() == Shape({Nr, K}), name,
              ": residual data: expected i8 [", Nr, ", ", K, "], got ", dtype_name(residual_data.dtype()), " ",
              residual_data.shape());
  HEADS_CHECK(residual_scales.dtype() == DType::F32 && residual_scales.shape() == Shape({Nr}), name,
              ": residual scales: expected f32 [", Nr, "], got ", dtype_name(residual_scales.dtype()), " ",
              residual_scales.shape());
  p.res_rows_ = residual_rows.clone();
  p.res_data_ = residual_data.contiguous().clone();
  p.res_scales_ = residual_scales.clone();
  std::vector<float> r(static_cast<size_t>(K));
  for (int64_t j = 0; j < Nr; ++j) {
    const int64_t row = p.res_rows_.data<int64_t>()[j];
    HEADS_CHECK(row >= 0 && row < N && (j == 0 || row > p.res_rows_.data<int64_t>()[j - 1]), name, ": residual row ",
                j, " is ", row, ": rows must increase within [0, ", N, ")");
    float& s = p.res_scales_.data<float>()[j];
    HEADS_CHECK(std::isfinite(s) && s > 0.0f, name, ": residual scale ", j, " must be finite and positive, got ", s);
    const float sw = p.scales_.data<float>()[row];
    auto* rq = static_cast<int8_t*>(p.res_data_.raw_data()) + j * K;
    const auto* q = static_cast<const int8_t*>(p.data_.raw_data()) + row * K;
    const int shift = shift_of(sw, s);
    if (shift >= 0 && int8_residual_fits(q, rq, K, shift)) continue;
    // Stored on another step (heads before 2026-12): the residual's values again on the row's steps.
    for (int64_t k = 0; k < K; ++k) r[static_cast<size_t>(k)] = static_cast<float>(rq[k]) * s;
    s = residual_row(r.data(), q, K, sw, rq);
    HEADS_CHECK(s > 0.0f, name, ": residual row ", j, ": no step of its row's fits heads' integer sums (", K,
                " inputs)");
  }
  if (Nr == 0) p.res_rows_ = p.res_data_ = p.res_scales_ = Tensor();
  p.finish();
  return p;
}

}  // namespace heads
