// sdpa_problem.h — one validated SDPA call, shared by the reference and the fast kernels.
//
// make_sdpa_problem() checks every argument (ranks, shapes, dtypes, GQA, mask broadcast,
// dropout range) and resolves defaults, so that kernels receive a problem that cannot fail.
// Kernels call it `pb`; `P` is kept for the probabilities, as the comments' formulas write them.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "heads/sdpa.h"

namespace heads::kernels {

enum class MaskKind { None, Bool, Float };

struct SdpaProblem {
  int64_t B, H, Hkv, Lq, Lk, D, Dv;
  double scale;
  bool causal;
  int64_t causal_offset;  // key j visible to query i iff j <= i + causal_offset
  MaskKind mask_kind = MaskKind::None;
  Tensor mask;       // [B, H, Lq, Lk] broadcast view: Bool (u8 bytes) or F32
  double dropout_p;  // 0 = no dropout
  uint64_t seed;
  bool need_weights;

  int64_t group() const { return H / Hkv; }
  bool visible_causal(int64_t i, int64_t j) const { return !causal || j <= i + causal_offset; }
  // Keys [0, key_end(i)) can be visible to query i under the causal rule.
  int64_t key_end(int64_t i) const {
    if (!causal) return Lk;
    const int64_t e = i + causal_offset + 1;
    return e < 0 ? 0 : (e > Lk ? Lk : e);
  }
  int64_t mask_offset(int64_t b, int64_t h, int64_t i) const {
    return b * mask.stride(0) + h * mask.stride(1) + i * mask.stride(2);
  }
};

SdpaProblem make_sdpa_problem(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                              const SdpaOptions& opts);

// Dropout: a pure function of (seed, position), so every kernel, thread count and tiling (and
// the backward) agrees on which weights are dropped. Keeps with probability 1 - p.
inline bool dropout_keep(uint64_t seed, uint64_t index, double p) {
  uint64_t x = index * 0x9e3779b97f4a7c15ull + seed;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  const double u = static_cast<double>(x >> 11) * 0x1.0p-53;  // uniform in [0, 1)
  return u >= p;
}

// Sums a [B, H, Lq, Lk] gradient over the dimensions `shape` broadcasts (f64 result in `shape`).
Tensor reduce_to_shape(const Tensor& full, const Shape& shape);

// The factor a kept weight is scaled by, 1 / (1 - p); p = 1 drops everything (factor unused, 0).
inline float dropout_keep_scale(double p) { return p < 1.0 ? static_cast<float>(1.0 / (1.0 - p)) : 0.0f; }

inline uint64_t dropout_index(const SdpaProblem& pb, int64_t b, int64_t h, int64_t i, int64_t j) {
  return static_cast<uint64_t>(((b * pb.H + h) * pb.Lq + i) * pb.Lk + j);
}

}  // namespace heads::kernels
