// tensor.cc — Tensor views, copies and dtype conversions.
#include "heads/tensor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "heads/runtime.h"

namespace heads {

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::Bool: return 1;
    case DType::U8: return 1;
    case DType::I64: return 8;
    case DType::I8: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dt) {
  switch (dt) {
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::Bool: return "bool";
    case DType::U8: return "u8";
    case DType::I64: return "i64";
    case DType::I8: return "i8";
  }
  return "?";
}

bool is_floating(DType dt) {
  return dt == DType::F32 || dt == DType::F64 || dt == DType::F16 || dt == DType::BF16;
}

std::string shape_str(const Shape& s) { return detail::concat(s); }

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | ((112u - static_cast<uint32_t>(e)) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // overflow (incl. rounding up) -> inf
  if (abs < 0x38800000u) {                        // result is subnormal or zero
    if (abs < 0x33000000u) return sign;           // below half the smallest subnormal
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = ((abs >> 13) - (112u << 10));
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

namespace {

// Every shape a Tensor holds passes this: sizes >= 0 and the product of the sizes, an empty
// dimension counted as 1, at most kMaxElements — so that strides, element counts and byte sizes
// of the tensor and of any view of it fit int64_t, zero-size tensors included.
constexpr int64_t kMaxElements = int64_t{1} << 60;

int64_t checked_numel(const Shape& shape) {
  int64_t n = 1, span = 1;
  for (int64_t s : shape) {
    HEADS_CHECK(s >= 0, "Tensor: negative size in shape ", shape);
    const int64_t f = std::max<int64_t>(s, 1);
    HEADS_CHECK(span <= kMaxElements / f, "Tensor: shape ", shape,
                " is too large (the product of its sizes, empty ones counted as 1, exceeds 2^60)");
    span *= f;
    n *= s;
  }
  return n;
}

int64_t wrap_dim(int64_t d, int64_t ndim, const char* op) {
  if (d < 0) d += ndim;
  HEADS_CHECK(d >= 0 && d < ndim, "Tensor::", op, ": dimension ", d, " out of range for ", ndim,
              "-D tensor");
  return d;
}

// dst[j·ds] = f(src[j·ss]) for j < n.
template <class S, class D, class F>
void convert_row(const S* src, int64_t ss, D* dst, int64_t ds, int64_t n, F f) {
  if (ss == 1 && ds == 1) {  // its own loop, so that it vectorizes
    for (int64_t j = 0; j < n; ++j) dst[j] = f(src[j]);
    return;
  }
  for (int64_t j = 0; j < n; ++j) dst[j * ds] = f(src[j * ss]);
}

// The conversions common enough for typed loops (the rest go through double).
bool typed_pair(DType from, DType to) {
  return (from == DType::BF16 && to == DType::F32) || (from == DType::F32 && to == DType::BF16);
}

// n elements (strides in elements) of a typed pair; false, doing nothing, for any other pair.
bool convert_typed(const std::byte* s, int64_t ss, DType from, std::byte* d, int64_t ds, DType to, int64_t n) {
  if (from == DType::BF16 && to == DType::F32) {
    convert_row(reinterpret_cast<const uint16_t*>(s), ss, reinterpret_cast<float*>(d), ds, n,
                [](uint16_t h) { return bf16_to_f32(h); });
  } else if (from == DType::F32 && to == DType::BF16) {
    convert_row(reinterpret_cast<const float*>(s), ss, reinterpret_cast<uint16_t*>(d), ds, n,
                [](float f) { return f32_to_bf16(f); });
  } else {
    return false;
  }
  return true;
}

double load_as_double(const std::byte* p, DType dt) {
  switch (dt) {
    case DType::F32: { float v; std::memcpy(&v, p, 4); return v; }
    case DType::F64: { double v; std::memcpy(&v, p, 8); return v; }
    case DType::F16: { uint16_t v; std::memcpy(&v, p, 2); return f16_to_f32(v); }
    case DType::BF16: { uint16_t v; std::memcpy(&v, p, 2); return bf16_to_f32(v); }
    case DType::Bool: return *reinterpret_cast<const uint8_t*>(p) != 0 ? 1.0 : 0.0;
    case DType::U8: return *reinterpret_cast<const uint8_t*>(p);
    case DType::I64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
    case DType::I8: return *reinterpret_cast<const int8_t*>(p);
  }
  return 0.0;
}

void store_from_double(std::byte* p, DType dt, double x) {
  switch (dt) {
    case DType::F32: { float v = static_cast<float>(x); std::memcpy(p, &v, 4); return; }
    case DType::F64: { std::memcpy(p, &x, 8); return; }
    case DType::F16: { uint16_t v = f32_to_f16(static_cast<float>(x)); std::memcpy(p, &v, 2); return; }
    case DType::BF16: { uint16_t v = f32_to_bf16(static_cast<float>(x)); std::memcpy(p, &v, 2); return; }
    case DType::Bool: { *reinterpret_cast<uint8_t*>(p) = x != 0.0; return; }
    case DType::U8: { *reinterpret_cast<uint8_t*>(p) = static_cast<uint8_t>(x >= 0 ? std::min(x, 255.0) : 0.0); return; }
    case DType::I64: { int64_t v = static_cast<int64_t>(x); std::memcpy(p, &v, 8); return; }
    case DType::I8: {  // saturating, NaN -> 0 (as U8): a cast out of range is undefined
      *reinterpret_cast<int8_t*>(p) = static_cast<int8_t>(x == x ? std::clamp(x, -128.0, 127.0) : 0.0);
      return;
    }
  }
}

}  // namespace

Shape contiguous_strides(const Shape& shape) {
  checked_numel(shape);
  Shape st(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    st[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return st;
}

Tensor Tensor::empty(const Shape& shape, DType dtype) {
  const int64_t n = checked_numel(shape);
  const size_t bytes = static_cast<size_t>(n) * dtype_size(dtype);
  const size_t alloc = std::max<size_t>(64, (bytes + 63) / 64 * 64);
  void* p = std::aligned_alloc(64, alloc);
  if (p == nullptr) fail("Tensor::empty: cannot allocate ", bytes, " bytes for shape ", shape);
  Tensor t;
  t.storage_ = std::shared_ptr<void>(p, std::free);
  t.data_ = static_cast<std::byte*>(p);
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  std::memset(t.data_, 0, static_cast<size_t>(t.numel()) * dtype_size(dtype));
  return t;
}

Tensor Tensor::from_blob(void* data, const Shape& shape, const Shape& strides, DType dtype,
                         std::shared_ptr<void> owner) {
  HEADS_CHECK(shape.size() == strides.size(), "Tensor::from_blob: shape ", shape, " and strides ",
              strides, " differ in rank");
  checked_numel(shape);
  static std::byte empty_marker[64];
  Tensor t;
  t.storage_ = std::move(owner);
  t.data_ = data != nullptr ? static_cast<std::byte*>(data) : empty_marker;
  t.shape_ = shape;
  t.strides_ = strides;
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::from_blob(void* data, const Shape& shape, DType dtype, std::shared_ptr<void> owner) {
  return from_blob(data, shape, contiguous_strides(shape), dtype, std::move(owner));
}

int64_t Tensor::size(int64_t d) const { return shape_[wrap_dim(d, dim(), "size")]; }
int64_t Tensor::stride(int64_t d) const { return strides_[wrap_dim(d, dim(), "stride")]; }

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

bool Tensor::is_contiguous() const {
  int64_t expect = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != expect) return false;
    expect *= shape_[i];
  }
  return true;
}

double Tensor::item_as_double(const Shape& index) const {
  HEADS_CHECK(static_cast<int64_t>(index.size()) == dim(), "Tensor::item: index ", index,
              " does not fit shape ", shape_);
  int64_t off = 0;
  for (size_t i = 0; i < index.size(); ++i) {
    HEADS_CHECK(index[i] >= 0 && index[i] < shape_[i], "Tensor::item: index ", index,
                " out of bounds for shape ", shape_);
    off += index[i] * strides_[i];
  }
  return load_as_double(data_ + off * static_cast<int64_t>(itemsize()), dtype_);
}

Tensor Tensor::permute(const std::vector<int64_t>& order) const {
  HEADS_CHECK(static_cast<int64_t>(order.size()) == dim(), "Tensor::permute: order ", order,
              " does not match rank of ", shape_);
  Tensor t = *this;
  std::vector<bool> seen(order.size(), false);
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t d = wrap_dim(order[i], dim(), "permute");
    HEADS_CHECK(!seen[d], "Tensor::permute: repeated dimension in ", order);
    seen[d] = true;
    t.shape_[i] = shape_[d];
    t.strides_[i] = strides_[d];
  }
  return t;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  d0 = wrap_dim(d0, dim(), "transpose");
  d1 = wrap_dim(d1, dim(), "transpose");
  Tensor t = *this;
  std::swap(t.shape_[d0], t.shape_[d1]);
  std::swap(t.strides_[d0], t.strides_[d1]);
  return t;
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = wrap_dim(d, dim(), "select");
  HEADS_CHECK(index >= 0 && index < shape_[d], "Tensor::select: index ", index,
              " out of range for dimension ", d, " of ", shape_);
  Tensor t = *this;
  t.data_ += index * strides_[d] * static_cast<int64_t>(itemsize());
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end) const {
  d = wrap_dim(d, dim(), "slice");
  HEADS_CHECK(0 <= start && start <= end && end <= shape_[d], "Tensor::slice: range [", start,
              ", ", end, ") out of bounds for dimension ", d, " of ", shape_);
  Tensor t = *this;
  if (end > start) t.data_ += start * strides_[d] * static_cast<int64_t>(itemsize());
  t.shape_[d] = end - start;
  return t;
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = wrap_dim(d, dim() + 1, "unsqueeze");
  Tensor t = *this;
  const int64_t st = d < dim() ? strides_[d] * shape_[d] : 1;
  t.shape_.insert(t.shape_.begin() + d, 1);
  t.strides_.insert(t.strides_.begin() + d, st);
  return t;
}

Tensor Tensor::squeeze(int64_t d) const {
  d = wrap_dim(d, dim(), "squeeze");
  HEADS_CHECK(shape_[d] == 1, "Tensor::squeeze: dimension ", d, " of ", shape_, " is not 1");
  Tensor t = *this;
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

Tensor Tensor::expand(const Shape& shape) const {
  HEADS_CHECK(shape.size() >= shape_.size(), "Tensor::expand: cannot expand ", shape_, " to ",
              shape);
  checked_numel(shape);
  Tensor t = *this;
  const size_t lead = shape.size() - shape_.size();
  t.shape_ = shape;
  t.strides_.assign(shape.size(), 0);
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i < lead) continue;
    const int64_t have = shape_[i - lead];
    if (have == shape[i]) {
      t.strides_[i] = strides_[i - lead];
    } else {
      HEADS_CHECK(have == 1, "Tensor::expand: cannot expand ", shape_, " to ", shape);
    }
  }
  return t;
}

Tensor Tensor::as_strided(const Shape& shape, const Shape& strides, int64_t offset) const {
  HEADS_CHECK(shape.size() == strides.size(), "Tensor::as_strided: shape ", shape,
              " and strides ", strides, " differ in rank");
  checked_numel(shape);
  Tensor t = *this;
  t.data_ += offset * static_cast<int64_t>(itemsize());
  t.shape_ = shape;
  t.strides_ = strides;
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  Shape target = shape;
  int64_t infer = -1;
  for (size_t i = 0; i < target.size(); ++i) {
    HEADS_CHECK(target[i] >= -1, "Tensor::reshape: invalid size ", target[i], " in ", shape);
    if (target[i] == -1) {
      HEADS_CHECK(infer < 0, "Tensor::reshape: more than one -1 in ", shape);
      infer = static_cast<int64_t>(i);
      target[i] = 1;
    }
  }
  const int64_t known = checked_numel(target);
  if (infer >= 0) {
    HEADS_CHECK(known != 0 && numel() % known == 0, "Tensor::reshape: cannot reshape ", shape_,
                " to ", shape);
    target[infer] = numel() / known;
  }
  HEADS_CHECK(checked_numel(target) == numel(), "Tensor::reshape: cannot reshape ", shape_, " to ",
              shape);
  Tensor t = contiguous();
  t.shape_ = target;
  t.strides_ = contiguous_strides(target);
  return t;
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return contiguous();
  Tensor t = empty(shape_, dtype);
  t.copy_from(*this);
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  HEADS_CHECK(src.shape_ == shape_, "Tensor::copy_from: source ", src.shape_,
              " does not match destination ", shape_);
  const int64_t n = numel();
  if (n == 0) return;
  const int64_t nd = dim();
  const auto sbytes = static_cast<int64_t>(src.itemsize());
  const auto dbytes = static_cast<int64_t>(itemsize());
  if (src.dtype_ == dtype_ && is_contiguous() && src.is_contiguous()) {
    std::memmove(data_, src.data_, static_cast<size_t>(n * dbytes));
    return;
  }
  constexpr int64_t kChunk = int64_t{1} << 16;
  if (is_contiguous() && src.is_contiguous() && n >= kChunk && typed_pair(src.dtype_, dtype_)) {
    // Whole tensors of a typed pair (bf16 <-> f32): chunks over the threads.
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    const int threads = static_cast<int>(std::min<int64_t>(get_num_threads(), chunks));
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < chunks; ++c) {
      convert_typed(src.data_ + c * kChunk * sbytes, 1, src.dtype_, data_ + c * kChunk * dbytes, 1, dtype_,
                    std::min(kChunk, n - c * kChunk));
    }
    return;
  }
  // Walk every index with a counter; the innermost dimension is a plain strided loop.
  const int64_t inner = nd == 0 ? 1 : shape_[nd - 1];
  const int64_t s_in = nd == 0 ? 0 : src.strides_[nd - 1];
  const int64_t d_in = nd == 0 ? 0 : strides_[nd - 1];
  Shape idx(std::max<int64_t>(nd - 1, 0), 0);
  const int64_t outer = n / inner;
  for (int64_t o = 0; o < outer; ++o) {
    int64_t soff = 0, doff = 0;
    for (int64_t i = 0; i + 1 < nd; ++i) {
      soff += idx[i] * src.strides_[i];
      doff += idx[i] * strides_[i];
    }
    const std::byte* sp = src.data_ + soff * sbytes;
    std::byte* dp = data_ + doff * dbytes;
    if (src.dtype_ == dtype_) {
      for (int64_t j = 0; j < inner; ++j) {
        std::memcpy(dp + j * d_in * dbytes, sp + j * s_in * sbytes, static_cast<size_t>(dbytes));
      }
    } else if (!convert_typed(sp, s_in, src.dtype_, dp, d_in, dtype_, inner)) {
      for (int64_t j = 0; j < inner; ++j) {
        store_from_double(dp + j * d_in * dbytes, dtype_,
                          load_as_double(sp + j * s_in * sbytes, src.dtype_));
      }
    }
    for (int64_t i = nd - 2; i >= 0; --i) {
      if (++idx[i] < shape_[i]) break;
      idx[i] = 0;
    }
  }
}

}  // namespace heads
