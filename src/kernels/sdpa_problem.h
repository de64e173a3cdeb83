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

// Entries of SdpaProblem::rel past the last (query - key) distance, so that a vector of queries
// starting at any row of a tile reads inside the table.
constexpr int64_t kRelPad = 64;

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
  MaskKind mask_kind = MaskKind::None;
  Tensor mask;       // [B, H, Lq, Lk] broadcast view: Bool (u8 bytes) or F32
  double dropout_p;  // 0 = no dropout
  uint64_t seed;
  bool need_weights;
  double softcap = 0.0;  // > 0: t -> softcap · tanh(t / softcap) on the scaled score
  // ALiBi and T5 biases, which depend on i - j only: f32 [H, rel_len] in log2 units, the bias of
  // (i, j) at h * rel_len + i - j + Lk - 1 (zero in the kRelPad entries past Lq + Lk - 1).
  Tensor rel;
  int64_t rel_len = 0;
  int64_t rel_buckets = 0;  // T5 table rows (0: no table)
  int64_t rel_max_distance = 128;
  bool rel_bidirectional = true;
  Tensor sinks;  // f32 [H] contiguous, natural-log units
  Tensor block_mask;       // u8 [Hb, nQB, nKB] contiguous (Hb = 1 or H), undefined: dense
  int64_t block_size = 0;  // queries and keys per block of block_mask
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
  // Block (qb, kb) of head h may be attended (block-sparse layout; true without one).
  bool block_visible(int64_t h, int64_t qb, int64_t kb) const {
    if (!block_mask.defined()) return true;
    const int64_t nq = block_mask.size(1), nk = block_mask.size(2);
    return static_cast<const uint8_t*>(block_mask.raw_data())[((block_mask.size(0) == 1 ? 0 : h) * nq + qb) * nk + kb] != 0;
  }
  // Some block of queries [i0, i1) x keys [j0, j1) (non-empty ranges) may be attended.
  bool blocks_any(int64_t h, int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    if (!block_mask.defined()) return true;
    for (int64_t qb = i0 / block_size; qb <= (i1 - 1) / block_size; ++qb) {
      for (int64_t kb = j0 / block_size; kb <= (j1 - 1) / block_size; ++kb) {
        if (block_visible(h, qb, kb)) return true;
      }
    }
    return false;
  }
  // Keys may be skipped by whole blocks (a left limit or a block layout), not only at the right end.
  bool may_skip_left() const { return has_left || block_mask.defined(); }
  const float* rel_row(int64_t h) const { return rel.data<float>() + h * rel_len; }
  float rel_log2(int64_t h, int64_t i, int64_t j) const { return rel_row(h)[i - j + Lk - 1]; }
  // The sink of head h in log2 units (-inf: none, an empty term of the denominator).
  float sink_log2(int64_t h) const {
    return sinks.defined() ? static_cast<float>(sinks.data<float>()[h] * 1.4426950408889634)
                           : -std::numeric_limits<float>::infinity();
  }
  int64_t mask_offset(int64_t b, int64_t h, int64_t i) const {
    return b * mask.stride(0) + h * mask.stride(1) + i * mask.stride(2);
  }
};

// The score of query i against key j of head (b, h) in log2 units, from the scaled product s2
// (q·k · scale · log2 e): softcap, then the ALiBi / T5 bias and a float attn_mask added; -inf
// outside the band or where a bool attn_mask is false (whatever s2 is, even NaN). With softcap,
// *dcap (when given) receives d(capped)/d(s2) = 1 - tanh².
inline float mod_score_log2(const SdpaProblem& pb, int64_t b, int64_t h, int64_t i, int64_t j, float s2,
                            float* dcap = nullptr) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  if (dcap != nullptr) *dcap = 0.0f;  // a hidden key's (its dS is 0 and must stay 0)
  if (!pb.visible(i, j) || !pb.block_visible(h, i / (pb.block_size > 0 ? pb.block_size : 1),
                                              j / (pb.block_size > 0 ? pb.block_size : 1))) {
    return -kInf;
  }
  if (pb.softcap > 0.0) {
    const float cap2 = static_cast<float>(pb.softcap * 1.4426950408889634);
    const float t = std::tanh(s2 / cap2);
    s2 = cap2 * t;
    if (dcap != nullptr) *dcap = 1.0f - t * t;
  }
  if (pb.rel.defined()) s2 += pb.rel_log2(h, i, j);
  if (pb.mask_kind == MaskKind::Bool) {
    if (!static_cast<const uint8_t*>(pb.mask.raw_data())[pb.mask_offset(b, h, i) + j * pb.mask.stride(3)]) return -kInf;
  } else if (pb.mask_kind == MaskKind::Float) {
    s2 += static_cast<const float*>(pb.mask.raw_data())[pb.mask_offset(b, h, i) + j * pb.mask.stride(3)] *
          1.4426950408889634f;
  }
  return s2;
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
