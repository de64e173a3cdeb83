// linear_lowp_store.cc — int8 PackedLinear weights stacked by rows (cat_rows: the q, k, v projections
// into one) and stored by name (int8_tensors, int8_from_tensors: state dicts and safetensors files);
// include/heads/precision.h. The weights themselves are packed by linear_lowp_pack.cc.
#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "heads/error.h"
#include "heads/precision.h"

namespace heads {

PackedLinear cat_rows(const std::vector<PackedLinear>& parts) {
  HEADS_CHECK(!parts.empty(), "cat_rows: no weights");
  const int64_t K = parts[0].in_features();
  int64_t N = 0, Nr = 0;
  for (const auto& p : parts) {
    HEADS_CHECK(p.defined() && p.precision() == Precision::Int8 && p.in_features() == K,
                "cat_rows: expected int8 weights of ", K, " inputs");
    N += p.out_features();
    Nr += p.residual_rows().defined() ? p.residual_rows().numel() : 0;
    const Tensor& c0 = parts[0].outlier_channels();
    const Tensor& c = p.outlier_channels();
    HEADS_CHECK(c.defined() == c0.defined() && (!c.defined() || (c.numel() == c0.numel() &&
                                                                   std::equal(c.data<int64_t>(), c.data<int64_t>() + c.numel(),
                                                                              c0.data<int64_t>()))),
                "cat_rows: the weights' outlier channels differ (stacked weights read one input: they share them)");
  }
  Tensor data = Tensor::empty({N, K}, DType::I8), scales = Tensor::empty({N}, DType::F32);
  Tensor rrows, rdata, rscales;
  if (Nr > 0) {
    rrows = Tensor::empty({Nr}, DType::I64);
    rdata = Tensor::empty({Nr, K}, DType::I8);
    rscales = Tensor::empty({Nr}, DType::F32);
  }
  const Tensor& channels = parts[0].outlier_channels();
  Tensor ow = channels.defined() ? Tensor::empty({N, channels.numel()}, DType::F32) : Tensor();
  int64_t n = 0, j = 0;
  for (const auto& p : parts) {
    const int64_t pn = p.out_features();
    data.slice(0, n, n + pn).copy_from(p.data());
    if (ow.defined()) ow.slice(0, n, n + pn).copy_from(p.outlier_weight());
    scales.slice(0, n, n + pn).copy_from(p.scales());
    if (p.residual_rows().defined()) {
      const int64_t pr = p.residual_rows().numel();
      rdata.slice(0, j, j + pr).copy_from(p.residual_data());
      rscales.slice(0, j, j + pr).copy_from(p.residual_scales());
      for (int64_t i = 0; i < pr; ++i) rrows.data<int64_t>()[j + i] = p.residual_rows().data<int64_t>()[i] + n;
      j += pr;
    }
    n += pn;
  }
  // The parts' activation error (the q, k, v projections of one module: all the same).
  return PackedLinear::from_int8(data, scales, "cat_rows", rrows, rdata, rscales, channels, ow, parts[0].act_error_);
}

std::vector<std::string> int8_part_names(const std::string& name) {
  return {name + "_scale", name + "_residual", name + "_residual_scale", name + "_residual_rows",
          name + "_outlier_channels", name + "_outlier_weight", name + "_activation_error"};
}

std::vector<std::pair<std::string, Tensor>> int8_tensors(const std::string& name, const PackedLinear& w) {
  HEADS_CHECK(w.defined() && w.precision() == Precision::Int8, "int8_tensors: \"", name, "\" is not an int8 weight");
  const auto parts = int8_part_names(name);
  std::vector<std::pair<std::string, Tensor>> out = {{name, w.data()}, {parts[0], w.scales()}};
  if (w.residual_rows().defined()) {
    out.emplace_back(parts[1], w.residual_data());
    out.emplace_back(parts[2], w.residual_scales());
    out.emplace_back(parts[3], w.residual_rows());
  }
  if (w.outlier_channels().defined()) {
    out.emplace_back(parts[4], w.outlier_channels());
    out.emplace_back(parts[5], w.outlier_weight());
  }
  if (w.activation_error() > 0) {
    out.emplace_back(parts[6], Tensor::from_vector(std::vector<double>{w.activation_error()}, {1}));
  }
  return out;
}

PackedLinear int8_from_tensors(const std::string& name, const std::function<const Tensor*(const std::string&)>& get,
                               const std::string& label) {
  const auto parts = int8_part_names(name);
  const Tensor* q = get(name);
  HEADS_CHECK(q != nullptr && q->defined() && q->dtype() == DType::I8 && q->dim() == 2, label, ": \"", name,
              "\": expected int8 [out, in]", q ? std::string(", got ") + std::string(dtype_name(q->dtype())) + " " +
                                                     shape_str(q->shape())
                                               : std::string(", missing"));
  const Tensor* s = get(parts[0]);
  HEADS_CHECK(s != nullptr, label, ": \"", name, "\" is int8 ", q->shape(), " but its scales \"", parts[0],
              "\" are missing");
  HEADS_CHECK(s->defined() && s->dtype() == DType::F32 && s->shape() == Shape({q->size(0)}), label, ": \"", parts[0],
              "\": expected f32 [", q->size(0), "] (one scale per row of \"", name, "\" ", q->shape(), "), got ",
              s->defined() ? std::string(dtype_name(s->dtype())) : "none", " ", s->defined() ? s->shape() : Shape{});
  const Tensor* rd = get(parts[1]);
  const Tensor* rs = get(parts[2]);
  const Tensor* rr = get(parts[3]);
  const int given = (rd != nullptr) + (rs != nullptr) + (rr != nullptr);
  HEADS_CHECK(given == 0 || given == 3, label, ": \"", name, "\": its residual term needs \"", parts[1], "\", \"",
              parts[2], "\" and \"", parts[3], "\" together (", given, " of 3 present)");
  const std::string what = label + ": \"" + name + "\"";
  const Tensor* oc = get(parts[4]);
  const Tensor* ow = get(parts[5]);
  HEADS_CHECK((oc == nullptr) == (ow == nullptr), label, ": \"", name, "\": its outlier channels need \"", parts[4],
              "\" and \"", parts[5], "\" together");
  const Tensor* tau = get(parts[6]);
  HEADS_CHECK(tau == nullptr || (tau->defined() && tau->dtype() == DType::F64 && tau->shape() == Shape({1})), label,
              ": \"", parts[6], "\": expected f64 [1], got ",
              tau && tau->defined() ? std::string(dtype_name(tau->dtype())) + " " + shape_str(tau->shape()) : "none");
  const double act_error = tau ? tau->data<double>()[0] : 0.0;
  const Tensor none;
  const Tensor& channels = oc ? *oc : none;
  const Tensor& columns = ow ? *ow : none;
  if (given == 0) return PackedLinear::from_int8(*q, *s, what, none, none, none, channels, columns, act_error);
  return PackedLinear::from_int8(*q, *s, what, *rr, *rd, *rs, channels, columns, act_error);
}

}  // namespace heads
