// convert.cc — arrays in and out of the extension (convert.h).

#include "convert.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "heads/error.h"

namespace heads::py {

namespace {

DType to_dtype(const nb::dlpack::dtype& dt, const char* name) {
  using nb::dlpack::dtype_code;
  const auto code = static_cast<dtype_code>(dt.code);
  if (dt.lanes == 1) {
    if (code == dtype_code::Float && dt.bits == 32) return DType::F32;
    if (code == dtype_code::Float && dt.bits == 64) return DType::F64;
    if (code == dtype_code::Float && dt.bits == 16) return DType::F16;
    if (code == dtype_code::Bfloat && dt.bits == 16) return DType::BF16;
    if (code == dtype_code::Bool && dt.bits == 8) return DType::Bool;
    if (code == dtype_code::UInt && dt.bits == 8) return DType::U8;
    if (code == dtype_code::Int && dt.bits == 64) return DType::I64;
    if (code == dtype_code::Int && dt.bits == 8) return DType::I8;
  }
  fail(name, ": unsupported array dtype (code ", static_cast<int>(dt.code), ", ", static_cast<int>(dt.bits),
       " bits); use float32, float64, float16, bfloat16, bool, uint8, int8 or int64");
}

nb::dlpack::dtype dl_dtype(DType dt) {
  switch (dt) {
    case DType::F32: return nb::dtype<float>();
    case DType::F64: return nb::dtype<double>();
    case DType::Bool: return nb::dtype<bool>();
    case DType::U8: return nb::dtype<uint8_t>();
    case DType::I64: return nb::dtype<int64_t>();
    case DType::I8: return nb::dtype<int8_t>();
    case DType::F16: return {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::BF16: return {static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
  }
  return nb::dtype<float>();
}

}  // namespace

Tensor view_of(const InArray& a, const char* name) {
  Shape shape(a.ndim()), strides(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) {
    shape[i] = static_cast<int64_t>(a.shape(i));
    strides[i] = static_cast<int64_t>(a.stride(i));
  }
  return Tensor::from_blob(const_cast<void*>(a.data()), shape, strides, to_dtype(a.dtype(), name));
}

Tensor opt_view(const std::optional<InArray>& a, const char* name) {
  return a ? view_of(*a, name) : Tensor();
}

void own_for_tape(std::initializer_list<Tensor*> tensors) {
  std::vector<std::pair<Tensor, Tensor>> done;  // (view, its copy)
  for (Tensor* t : tensors) {
    if (!t->defined()) continue;
    const auto same = std::find_if(done.begin(), done.end(), [&](const auto& d) {
      return d.first.raw_data() == t->raw_data() && d.first.shape() == t->shape() &&
             d.first.strides() == t->strides() && d.first.dtype() == t->dtype();
    });
    if (same != done.end()) {
      *t = same->second;
    } else {
      Tensor copy = t->clone();
      done.emplace_back(*t, copy);
      *t = copy;
    }
  }
}

nb::object to_array(const Tensor& t, bool torch) {
  if (!t.defined()) return nb::none();
  auto* keep = new Tensor(t);
  nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  std::vector<size_t> shape(t.shape().begin(), t.shape().end());
  std::vector<int64_t> strides(t.strides().begin(), t.strides().end());
  if (torch) {
    return nb::ndarray<nb::pytorch>(t.raw_data(), shape.size(), shape.data(), owner, strides.data(),
                                    dl_dtype(t.dtype()))
        .cast();
  }
  HEADS_CHECK(t.dtype() != DType::BF16,
              "numpy has no bfloat16: pass torch tensors for bf16 attention");
  return nb::ndarray<nb::numpy>(t.raw_data(), shape.size(), shape.data(), owner, strides.data(),
                                dl_dtype(t.dtype()))
      .cast();
}

Tensor to_4d(Tensor t, const char* name, const char* op) {
  HEADS_CHECK(t.dim() >= 2 && t.dim() <= 4, op, ": ", name, ": expected 2-D to 4-D [..., L, E], got ",
              t.shape());
  while (t.dim() < 4) t = t.unsqueeze(0);
  return t;
}

nb::dict to_dict(const StateDict& sd, bool torch) {
  nb::dict d;
  for (const auto& [name, t] : sd) d[name.c_str()] = to_array(t, torch);
  return d;
}

StateDict from_items(const Items& items) {
  StateDict sd;
  for (const auto& [name, a] : items) sd.emplace_back(name, view_of(a, name.c_str()));
  return sd;
}

}  // namespace heads::py
