// tensor.h — Tensor: a strided view of typed memory, optionally owning it.
//
// Row-major with explicit strides in elements (not bytes), like torch.Tensor. Views (permute,
// slice, select, unsqueeze, expand) share storage; contiguous()/to()/clone() copy. Sizes and
// offsets are int64_t throughout. A default-constructed Tensor is "undefined" (no data), which
// the APIs use for "argument not given".
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "heads/error.h"

namespace heads {

enum class DType : uint8_t { F32, F64, F16, BF16, Bool, U8, I64, I8 };

using Shape = std::vector<int64_t>;

size_t dtype_size(DType dt);
std::string_view dtype_name(DType dt);  // "f32", "f64", "f16", "bf16", "bool", "u8", "i64", "i8"
bool is_floating(DType dt);
std::string shape_str(const Shape& s);  // "[2, 7, 64]"

// Scalar conversions used by the storage formats (round to nearest even). The bf16 pair is inline
// and branch-free so that loops over arrays vectorize.
inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;           // quiet it, keep sign and payload's top
  return static_cast<uint16_t>((nan ? bits | 0x400000u : rounded) >> 16);
}
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() { return DType::F32; }
template <>
constexpr DType dtype_of<double>() { return DType::F64; }
template <>
constexpr DType dtype_of<bool>() { return DType::Bool; }
template <>
constexpr DType dtype_of<uint8_t>() { return DType::U8; }
template <>
constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <>
constexpr DType dtype_of<int8_t>() { return DType::I8; }

class Tensor {
 public:
  Tensor() = default;

  // A new contiguous tensor (64-byte aligned); empty() leaves the contents uninitialised.
  static Tensor empty(const Shape& shape, DType dtype);
  static Tensor zeros(const Shape& shape, DType dtype);
  // A view of memory owned elsewhere; `owner` keeps that memory alive (may be null).
  static Tensor from_blob(void* data, const Shape& shape, const Shape& strides, DType dtype,
                          std::shared_ptr<void> owner = {});
  static Tensor from_blob(void* data, const Shape& shape, DType dtype,
                          std::shared_ptr<void> owner = {});
  // A contiguous copy of `values` with the given shape (numel must match).
  template <class T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape);

  bool defined() const { return data_ != nullptr; }
  DType dtype() const { return dtype_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t size(int64_t d) const;    // d may be negative (from the end)
  int64_t stride(int64_t d) const;  // d may be negative (from the end)
  int64_t numel() const;
  bool is_contiguous() const;
  size_t itemsize() const { return dtype_size(dtype_); }

  void* raw_data() const { return data_; }
  // Typed pointer to element [0, ..., 0]; throws if T does not match dtype().
  template <class T>
  T* data() const;
  // Element at a full index (slow; for tests, tooling and scalar fallbacks), converted to double.
  double item_as_double(const Shape& index) const;

  // Views (no copy).
  Tensor permute(const std::vector<int64_t>& order) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor select(int64_t d, int64_t index) const;  // removes dimension d
  Tensor slice(int64_t d, int64_t start, int64_t end) const;
  Tensor unsqueeze(int64_t d) const;
  Tensor squeeze(int64_t d) const;  // d must have size 1
  Tensor expand(const Shape& shape) const;  // size-1 dims -> stride 0; new leading dims allowed
  // A view of the same storage with explicit shape, strides and element offset from data().
  Tensor as_strided(const Shape& shape, const Shape& strides, int64_t offset = 0) const;
  // Reshape: a view when the layout allows (contiguous), else a contiguous copy reshaped.
  Tensor reshape(const Shape& shape) const;

  // Copies.
  Tensor contiguous() const;  // returns *this when already contiguous
  Tensor clone() const;       // always a new contiguous tensor
  Tensor to(DType dtype) const;  // converted contiguous copy (returns contiguous() if same dtype)
  void copy_from(const Tensor& src);  // same shape, any dtypes; converts

 private:
  std::shared_ptr<void> storage_;
  std::byte* data_ = nullptr;
  Shape shape_;
  Shape strides_;
  DType dtype_ = DType::F32;
};

Shape contiguous_strides(const Shape& shape);

template <class T>
T* Tensor::data() const {
  if (dtype_ != dtype_of<T>()) {
    fail("Tensor::data: requested ", dtype_name(dtype_of<T>()), " from a ", dtype_name(dtype_),
         " tensor");
  }
  return reinterpret_cast<T*>(data_);
}

template <class T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape) {
  Tensor t = empty(shape, dtype_of<T>());
  if (static_cast<int64_t>(values.size()) != t.numel()) {
    fail("Tensor::from_vector: ", values.size(), " values do not fill shape ", shape);
  }
  T* p = t.data<T>();
  for (size_t i = 0; i < values.size(); ++i) p[i] = values[i];
  return t;
}

}  // namespace heads
