// kv_cache.cc — include/heads/kv_cache.h.
#include "heads/kv_cache.h"

#include <algorithm>
#include <string>

#include "heads/error.h"
#include "heads/sdpa.h"

namespace heads {

KVCache::KVCache(int64_t num_layers, int64_t batch, int64_t kv_heads, int64_t head_dim, DType dtype,
                 int64_t capacity, int64_t value_dim)
    : B_(batch), Hkv_(kv_heads), D_(head_dim), Dv_(value_dim > 0 ? value_dim : head_dim), dtype_(dtype) {
  HEADS_CHECK(num_layers >= 1 && batch >= 1 && kv_heads >= 1 && head_dim >= 1 && value_dim >= 0, "KVCache: layers ",
              num_layers, ", batch ", batch, ", kv_heads ", kv_heads, ", head_dim ", head_dim,
              " must be positive (value_dim ", value_dim, ": positive or 0 for head_dim)");
  HEADS_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::I8,
              "KVCache: dtype must be f32, bf16 or i8, got ", dtype_name(dtype));
  HEADS_CHECK(capacity >= 0, "KVCache: capacity must be >= 0, got ", capacity);
  // Bounds that no model reaches, checked before anything is allocated (2^26 layers once took 11 GB).
  HEADS_CHECK(num_layers <= (1 << 16) && batch <= (1 << 24) && kv_heads <= (1 << 16) && head_dim <= (1 << 16) &&
                  value_dim <= (1 << 16),
              "KVCache: layers ", num_layers, " (at most 65536), batch ", batch, " (at most 2^24), kv_heads ", kv_heads,
              " (at most 65536), head_dim ", head_dim, " and value_dim ", value_dim, " (at most 65536)");
  const double row_bytes = static_cast<double>(head_dim + (value_dim > 0 ? value_dim : head_dim)) *
                              static_cast<double>(dtype_size(dtype)) + (dtype == DType::I8 ? 8.0 : 0.0);  // + scales
  const double bytes = static_cast<double>(num_layers) * static_cast<double>(batch) * static_cast<double>(kv_heads) *
                       row_bytes * static_cast<double>(capacity);
  HEADS_CHECK(bytes <= 0x1p40, "KVCache: capacity ", capacity, " would reserve ", bytes / 0x1p30,
              " GiB up front (at most 1 TiB); reserve less, the cache grows on demand");
  layers_.resize(static_cast<size_t>(num_layers));
  if (capacity > 0) {
    for (Layer& l : layers_) reserve(l, capacity);
  }
}

int64_t KVCache::length(int64_t layer) const {
  HEADS_CHECK(layer >= 0 && layer < num_layers(), "KVCache: layer ", layer, " outside [0, ", num_layers(), ")");
  return layers_[static_cast<size_t>(layer)].len;
}

int64_t KVCache::capacity() const {
  return layers_.empty() || !layers_.front().k.defined() ? 0 : layers_.front().k.size(2);
}

void KVCache::reserve(Layer& l, int64_t need) {
  const int64_t cap = l.k.defined() ? l.k.size(2) : 0;
  if (need <= cap) return;
  const int64_t grown = std::max({need, 2 * cap, int64_t{16}});
  Tensor k = Tensor::empty({B_, Hkv_, grown, D_}, dtype_), v = Tensor::empty({B_, Hkv_, grown, Dv_}, dtype_);
  Tensor ks, vs;
  if (dtype_ == DType::I8) {
    ks = Tensor::empty({B_, Hkv_, grown}, DType::F32);
    vs = Tensor::empty({B_, Hkv_, grown}, DType::F32);
  }
  if (l.len > 0) {
    k.slice(2, 0, l.len).copy_from(l.k.slice(2, 0, l.len));
    v.slice(2, 0, l.len).copy_from(l.v.slice(2, 0, l.len));
    if (ks.defined()) {
      ks.slice(2, 0, l.len).copy_from(l.ks.slice(2, 0, l.len));
      vs.slice(2, 0, l.len).copy_from(l.vs.slice(2, 0, l.len));
    }
  }
  l.k = k;
  l.v = v;
  l.ks = ks;
  l.vs = vs;
}

std::pair<Tensor, Tensor> KVCache::append(int64_t layer, const Tensor& k, const Tensor& v) {
  HEADS_CHECK(layer >= 0 && layer < num_layers(), "KVCache::append: layer ", layer, " outside [0, ", num_layers(),
              ")");
  HEADS_CHECK(k.defined() && k.dim() == 4 && k.size(0) == B_ && k.size(1) == Hkv_ && k.size(3) == D_,
              "KVCache::append: key: expected [B, Hkv, n, D] = [", B_, ", ", Hkv_, ", n, ", D_, "], got ",
              k.defined() ? k.shape() : Shape{});
  HEADS_CHECK(v.defined() && v.dim() == 4 && v.size(0) == B_ && v.size(1) == Hkv_ && v.size(2) == k.size(2) &&
                  v.size(3) == Dv_,
              "KVCache::append: value: expected [B, Hkv, n, Dv] = [", B_, ", ", Hkv_, ", ", k.size(2), ", ", Dv_,
              "], got ", v.defined() ? v.shape() : Shape{});
  HEADS_CHECK(is_floating(k.dtype()) && is_floating(v.dtype()), "KVCache::append: key and value must be floating, got ",
              dtype_name(k.dtype()), " and ", dtype_name(v.dtype()));
  Layer& l = layers_[static_cast<size_t>(layer)];
  const int64_t n = k.size(2);
  reserve(l, l.len + n);
  if (n > 0 && dtype_ == DType::I8) {  // quantised first: a NaN or infinity fails before anything is written
    const Int8Rows qk = quantize_kv(k), qv = quantize_kv(v);
    l.k.slice(2, l.len, l.len + n).copy_from(qk.values);
    l.v.slice(2, l.len, l.len + n).copy_from(qv.values);
    l.ks.slice(2, l.len, l.len + n).copy_from(qk.scales);
    l.vs.slice(2, l.len, l.len + n).copy_from(qv.scales);
  } else if (n > 0) {
    l.k.slice(2, l.len, l.len + n).copy_from(k.dtype() == dtype_ ? k : k.to(dtype_));
    l.v.slice(2, l.len, l.len + n).copy_from(v.dtype() == dtype_ ? v : v.to(dtype_));
  }
  l.len += n;
  return {keys(layer), values(layer)};
}

Tensor KVCache::keys(int64_t layer) const {
  const Layer& l = layers_[static_cast<size_t>(length(layer) >= 0 ? layer : 0)];
  return l.k.defined() ? l.k.slice(2, 0, l.len) : Tensor::empty({B_, Hkv_, 0, D_}, dtype_);
}

Tensor KVCache::values(int64_t layer) const {
  const Layer& l = layers_[static_cast<size_t>(length(layer) >= 0 ? layer : 0)];
  return l.v.defined() ? l.v.slice(2, 0, l.len) : Tensor::empty({B_, Hkv_, 0, Dv_}, dtype_);
}

Tensor KVCache::key_scales(int64_t layer) const {
  if (dtype_ != DType::I8) return Tensor();
  const Layer& l = layers_[static_cast<size_t>(length(layer) >= 0 ? layer : 0)];
  return l.ks.defined() ? l.ks.slice(2, 0, l.len) : Tensor::empty({B_, Hkv_, 0}, DType::F32);
}

Tensor KVCache::value_scales(int64_t layer) const {
  if (dtype_ != DType::I8) return Tensor();
  const Layer& l = layers_[static_cast<size_t>(length(layer) >= 0 ? layer : 0)];
  return l.vs.defined() ? l.vs.slice(2, 0, l.len) : Tensor::empty({B_, Hkv_, 0}, DType::F32);
}

void KVCache::truncate(int64_t length) {
  HEADS_CHECK(length >= 0, "KVCache::truncate: length must be >= 0, got ", length);
  for (Layer& l : layers_) l.len = std::min(l.len, length);
}

void KVCache::reorder(const std::vector<int64_t>& index) {
  HEADS_CHECK(static_cast<int64_t>(index.size()) == B_, "KVCache::reorder: expected ", B_, " indices, got ",
              index.size());
  for (int64_t i : index) {
    HEADS_CHECK(i >= 0 && i < B_, "KVCache::reorder: index ", i, " outside the batch [0, ", B_, ")");
  }
  for (Layer& l : layers_) {
    if (l.len == 0) continue;
    const Tensor k = l.k.slice(2, 0, l.len).clone(), v = l.v.slice(2, 0, l.len).clone();
    const Tensor ks = l.ks.defined() ? l.ks.slice(2, 0, l.len).clone() : Tensor();
    const Tensor vs = l.vs.defined() ? l.vs.slice(2, 0, l.len).clone() : Tensor();
    for (int64_t b = 0; b < B_; ++b) {
      const int64_t from = index[static_cast<size_t>(b)];
      l.k.select(0, b).slice(1, 0, l.len).copy_from(k.select(0, from));
      l.v.select(0, b).slice(1, 0, l.len).copy_from(v.select(0, from));
      if (ks.defined()) {
        l.ks.select(0, b).slice(1, 0, l.len).copy_from(ks.select(0, from));
        l.vs.select(0, b).slice(1, 0, l.len).copy_from(vs.select(0, from));
      }
    }
  }
}

}  // namespace heads
