// kv_quant.cc — the int8 rows of a quantised KV cache (heads/sdpa.h: quantize_kv, dequantize_kv),
// which KVCache writes as it appends and sdpa widens for shapes past the decode kernel's.
#include <algorithm>
#include <cmath>
#include <string>

#include "heads/error.h"
#include "heads/sdpa.h"

namespace heads {

Int8Rows quantize_kv(const Tensor& x) {
  HEADS_CHECK(x.defined() && is_floating(x.dtype()) && x.dim() >= 1, "quantize_kv: x: expected a floating tensor [..., n], got ",
              x.defined() ? std::string(dtype_name(x.dtype())) + " " + shape_str(x.shape()) : std::string("none"));
  const Tensor xf = x.dtype() == DType::F32 ? x.contiguous() : x.to(DType::F32);
  const Shape& shape = x.shape();
  const Shape rows_shape(shape.begin(), shape.end() - 1);
  Int8Rows r{Tensor::empty(shape, DType::I8), Tensor::empty(rows_shape, DType::F32)};
  const int64_t n = shape.back(), rows = n == 0 ? 0 : xf.numel() / n;
  if (n == 0) std::fill_n(r.scales.data<float>(), r.scales.numel(), 0.0f);
  const float* src = xf.data<float>();
  int8_t* dst = r.values.data<int8_t>();
  float* sp = r.scales.data<float>();
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = src + i * n;
    float amax = 0.0f;
    for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(row[d]));  // (NaN is dropped by max: checked below)
    bool finite = std::isfinite(amax);
    for (int64_t d = 0; d < n && finite; ++d) finite = !std::isnan(row[d]);
    HEADS_CHECK(finite, "quantize_kv: x ", shape, ": row ", i, " holds a NaN or an infinity");
    const float scale = amax / 127.0f;
    sp[i] = scale;
    for (int64_t d = 0; d < n; ++d) {
      const float t = scale > 0.0f ? std::nearbyint(row[d] / scale) : 0.0f;
      dst[i * n + d] = static_cast<int8_t>(std::clamp(t, -127.0f, 127.0f));
    }
  }
  return r;
}

Tensor dequantize_kv(const Tensor& values, const Tensor& scales) {
  HEADS_CHECK(values.defined() && values.dtype() == DType::I8 && values.dim() >= 1, "dequantize_kv: values: expected int8 [..., n], got ",
              values.defined() ? std::string(dtype_name(values.dtype())) + " " + shape_str(values.shape()) : "none");
  const Shape rows_shape(values.shape().begin(), values.shape().end() - 1);
  HEADS_CHECK(scales.defined() && scales.dtype() == DType::F32 && scales.shape() == rows_shape,
              "dequantize_kv: scales: expected f32 ", rows_shape, " for values ", values.shape(), ", got ",
              scales.defined() ? std::string(dtype_name(scales.dtype())) + " " + shape_str(scales.shape()) : "none");
  const Tensor vc = values.contiguous(), sc = scales.contiguous();
  Tensor out = Tensor::empty(values.shape(), DType::F32);
  const int64_t n = values.size(-1), rows = n == 0 ? 0 : values.numel() / n;
  const int8_t* vp = vc.data<int8_t>();
  const float* sp = sc.data<float>();
  float* op = out.data<float>();
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t d = 0; d < n; ++d) op[i * n + d] = static_cast<float>(vp[i * n + d]) * sp[i];
  }
  return out;
}

}  // namespace heads
