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
#include "kernels/score_mods.h"

namespace heads::kernels {

struct SdpaProblem {
  int64_t B, H, Hkv, Lq, Lk, D, Dv;
  double scale;
  // The visible band: key j is visible to query i iff i + left_offset <= j (when has_left) and
  // j <= i + causal_offset (when causal, which is also set by window_right).
  bool causal;
  int64_t causal_offset;
  bool has_left = false;
  int64_t left_offset = 0;
  int64_t align_offset = 0;  // a: query i sits at key position i + a (0 or Lk - Lq)
  ScoreMods mods;    // softcap, position bias, attn_mask, block layout (score_mods.h)
  double dropout_p;  // 0 = no dropout
  uint64_t seed;
  bool need_weights;
  Tensor sinks;  // f32 [H] contiguous, natural-log units
  Tensor head_mask;        // u8 [B, H] contiguous (1 = computed), undefined: every head
  bool partial_keys = false;  // backward: lse and out are of a longer key sequence (SdpaOptions)
  // int8 k / v: their f32 [B, Hkv, Lk] scales (SdpaOptions::k_scale, v_scale); undefined otherwise.
  Tensor k_scale, v_scale;

  int64_t group() const { return H / Hkv; }
  // Head (b, h) is computed (head_mask); a head that is off is skipped by every kernel.
  bool head_on(int64_t b, int64_t h) const {
    return !head_mask.defined() || static_cast<const uint8_t*>(head_mask.raw_data())[b * H + h] != 0;
  }
  // Some query head of key/value head hk in batch entry b is computed.
  bool group_on(int64_t b, int64_t hk) const {
    for (int64_t h = hk * group(); h < (hk + 1) * group(); ++h) {
      if (head_on(b, h)) return true;
    }
    return false;
  }
  bool visible(int64_t i, int64_t j) const {
    return (!causal || j <= i + causal_offset) && (!has_left || j >= i + left_offset);
  }
  // Keys [key_begin(i), key_end(i)) can be visible to query i under the band.
  int64_t key_end(int64_t i) const {
    if (!causal) return Lk;
    const int64_t e = i + causal_offset + 1;
    return e < 0 ? 0 : (e > Lk ? Lk : e);
  }
  int64_t key_begin(int64_t i) const {
    if (!has_left) return 0;
    const int64_t e = i + left_offset;
    return e < 0 ? 0 : (e > Lk ? Lk : e);
  }
  // Keys may be skipped by whole blocks (a left limit or a block layout), not only at the right end.
  bool may_skip_left() const { return has_left || mods.blocked(); }
  // The sink of head h in log2 units (-inf: none, an empty term of the denominator).
  float sink_log2(int64_t h) const {
    return sinks.defined() ? static_cast<float>(sinks.data<float>()[h] * 1.4426950408889634)
                           : -std::numeric_limits<float>::infinity();
  }
};

// The score of query i against key j of head (b, h) in log2 units, from the scaled product s2
// (q·k · scale · log2 e): -inf outside the band, else the score modifiers (ScoreMods::apply). With
// softcap, *dcap (when given) receives d(capped)/d(s2) = 1 - tanh², 0 for a hidden key.
inline float mod_score_log2(const SdpaProblem& pb, int64_t b, int64_t h, int64_t i, int64_t j, float s2,
                            float* dcap = nullptr) {
  if (!pb.visible(i, j)) {
    if (dcap != nullptr) *dcap = 0.0f;  // a hidden key's dS is 0 and must stay 0
    return -std::numeric_limits<float>::infinity();
  }
  const ScoreMods& m = pb.mods;
  return m.apply<float>(s2, 1.44269504088896340736f, m.biased() ? m.rel_log2(h, i, j) : 0.0f, b, h, i, j, dcap);
}

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
