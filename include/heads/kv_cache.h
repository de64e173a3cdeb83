// kv_cache.h — the keys and values a decoder has seen, per layer, for incremental decoding.
//
// Per layer: K and V [B, Hkv, capacity, D] in f32, bf16 or int8; the first length() positions are
// filled. int8 keeps one f32 scale per (batch entry, kv head, position) beside each (heads::quantize_kv:
// scale = max |row| / 127), which sdpa reads through SdpaOptions::k_scale / v_scale
// (key_scales(), value_scales()); the decode kernel reads the int8 rows in place.
// append() writes a step's new keys and values after them (growing the storage by doubling) and
// returns views of everything seen, which heads::sdpa reads in place (bottom-right causal
// alignment puts the new queries after the cached keys). truncate() drops the last positions
// (speculative decoding, re-prompting); reorder() permutes the batch (beam search).
//
// Threads: a cache holds one sequence of steps, taken one call at a time. CausalLM::forward holds
// hold() for its whole step (a failed step leaves the cache as it was), so threads that share a
// cache take turns; the Python binding holds it in every method. Copies share the lock.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "heads/tensor.h"

namespace heads {

class KVCache {
 public:
  KVCache() = default;
  // dtype f32, bf16 or i8; capacity: positions reserved up front (0: grown on demand).
  KVCache(int64_t num_layers, int64_t batch, int64_t kv_heads, int64_t head_dim, DType dtype = DType::F32,
          int64_t capacity = 0, int64_t value_dim = 0);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t batch() const { return B_; }
  int64_t kv_heads() const { return Hkv_; }
  int64_t head_dim() const { return D_; }
  int64_t value_dim() const { return Dv_; }
  DType dtype() const { return dtype_; }
  // Positions held by layer 0 (every layer holds as many once a step has gone through all of them).
  int64_t length() const { return layers_.empty() ? 0 : layers_.front().len; }
  int64_t length(int64_t layer) const;
  int64_t capacity() const;

  // Appends k [B, Hkv, n, D] and v [B, Hkv, n, Dv] (any float dtype, any strides) to `layer`, rounded
  // to the cache's dtype (int8: quantised row by row); returns views of its keys and values [B, Hkv,
  // length + n, D / Dv] in the cache's dtype.
  std::pair<Tensor, Tensor> append(int64_t layer, const Tensor& k, const Tensor& v);
  Tensor keys(int64_t layer) const;    // [B, Hkv, length(layer), D] view
  Tensor values(int64_t layer) const;  // [B, Hkv, length(layer), Dv] view
  // int8 caches: the f32 scales [B, Hkv, length(layer)] (views) of keys(layer) and values(layer);
  // undefined tensors for f32 and bf16 caches.
  Tensor key_scales(int64_t layer) const;
  Tensor value_scales(int64_t layer) const;
  void truncate(int64_t length);       // keep the first `length` positions of every layer
  // Batch entry b becomes the old entry index[b] (index has B entries in [0, B)).
  void reorder(const std::vector<int64_t>& index);

  // Waits until no other call uses the cache; the caller has it while the lock lives.
  std::unique_lock<std::mutex> hold() const { return std::unique_lock<std::mutex>(*use_); }

 private:
  struct Layer {
    Tensor k, v;    // [B, Hkv, cap, D]
    Tensor ks, vs;  // int8: f32 [B, Hkv, cap]
    int64_t len = 0;
  };
  void reserve(Layer& l, int64_t need);
  int64_t B_ = 0, Hkv_ = 0, D_ = 0, Dv_ = 0;
  DType dtype_ = DType::F32;
  std::vector<Layer> layers_;
  std::shared_ptr<std::mutex> use_ = std::make_shared<std::mutex>();
};

}  // namespace heads
