// score_mods.h — the score modifiers of one SDPA call: what changes or hides a score q·k·scale
// between the two products, owned by one type that every path asks.
//
// The modifiers, in the one order every path applies them (the fast kernels in log2 units, the
// float64 reference in natural units):
//   1. softcap      t -> c · tanh(t / c)                                 (SdpaOptions::softcap)
//   2. bias         + the ALiBi / T5 bias of head h at distance i - j    (alibi_slopes, relative_attention_bias)
//   3. mask         + a float attn_mask's value; -inf where a bool attn_mask is false or a block
//                   layout hides (i, j)                                  (attn_mask, block_mask)
// A hidden score is -inf whatever the modifiers before made of it, even NaN. The band (is_causal,
// windows) is not a modifier: it is a range of keys, which the kernels skip by whole tiles
// (SdpaProblem::visible, key_begin, key_end). Sinks and dropout act on the softmax, not on scores.
//
// ScoreMods::apply is the scalar form (decode, the backward's few-query path, the reference); the
// vector forms, one per layout, are fwd::apply_masks (queries across lanes: the tiled forward and
// backward) and amx::modify16 / score16 (keys across lanes: the tile kernel). Adding a modifier:
// docs/architecture.md, "Adding a score modifier".
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "heads/tensor.h"

namespace heads::kernels {

enum class MaskKind { None, Bool, Float };

// Entries of ScoreMods::rel past the last (query - key) distance, so that a vector of queries
// starting at any row of a tile reads inside the table.
constexpr int64_t kRelPad = 64;

struct ScoreMods {
  // 1. softcap (> 0: on), and c in log2 units, the kernels' constant (0 when off).
  double softcap = 0.0;
  float cap2 = 0.0f;
  // 2. ALiBi and T5 biases, which depend on i - j only: f32 [H, rel_len] in log2 units, the bias of
  // (i, j) at h * rel_len + i - j + Lk - 1 (zero in the kRelPad entries past Lq + Lk - 1).
  Tensor rel;
  int64_t rel_len = 0;
  int64_t rel_buckets = 0;  // T5 table rows (0: no table)
  int64_t rel_max_distance = 128;
  bool rel_bidirectional = true;
  int64_t rel_lk = 0;  // Lk, where distance 0 sits in a row of the table (minus 1)
  // 3. attn_mask: [B, H, Lq, Lk] broadcast view, Bool (u8 bytes) or F32; the block layout: u8
  // [Hb, nQB, nKB] contiguous (Hb = 1 or H), undefined: dense.
  MaskKind mask_kind = MaskKind::None;
  Tensor mask;
  Tensor block_mask;
  int64_t block_size = 0;

  bool capped() const { return softcap > 0.0; }
  bool biased() const { return rel.defined(); }
  bool masked() const { return mask_kind != MaskKind::None; }
  bool blocked() const { return block_mask.defined(); }
  // The one question every path asks: does some modifier change or hide a score?
  bool any() const { return capped() || biased() || masked() || blocked(); }

  void set_softcap(double c) {
    softcap = c;
    cap2 = c > 0.0 ? static_cast<float>(c) * 1.44269504088896340736f : 0.0f;
  }

  const float* rel_row(int64_t h) const { return rel.data<float>() + h * rel_len; }
  float rel_log2(int64_t h, int64_t i, int64_t j) const { return rel_row(h)[i - j + rel_lk - 1]; }

  int64_t mask_offset(int64_t b, int64_t h, int64_t i) const {
    return b * mask.stride(0) + h * mask.stride(1) + i * mask.stride(2);
  }
  // attn_mask entry at element offset `off` as a term of the score: a bool mask's false is -inf,
  // a float mask's value times `unit` (log2 e in log2 units). The mask must be present.
  template <class T>
  T mask_term(int64_t off, T unit) const {
    if (mask_kind == MaskKind::Bool) {
      return static_cast<const uint8_t*>(mask.raw_data())[off] ? T(0) : -std::numeric_limits<T>::infinity();
    }
    return static_cast<T>(static_cast<const float*>(mask.raw_data())[off]) * unit;
  }

  // Block (qb, kb) of head h may be attended (true without a layout).
  bool block_visible(int64_t h, int64_t qb, int64_t kb) const {
    if (!blocked()) return true;
    const int64_t nq = block_mask.size(1), nk = block_mask.size(2);
    return static_cast<const uint8_t*>(block_mask.raw_data())[((block_mask.size(0) == 1 ? 0 : h) * nq + qb) * nk + kb] != 0;
  }
  bool pair_visible(int64_t h, int64_t i, int64_t j) const {
    return !blocked() || block_visible(h, i / block_size, j / block_size);
  }
  // Some block of queries [i0, i1) x keys [j0, j1) (non-empty ranges) may be attended.
  bool blocks_any(int64_t h, int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    if (!blocked()) return true;
    for (int64_t qb = i0 / block_size; qb <= (i1 - 1) / block_size; ++qb) {
      for (int64_t kb = j0 / block_size; kb <= (j1 - 1) / block_size; ++kb) {
        if (block_visible(h, qb, kb)) return true;
      }
    }
    return false;
  }

  // The modifiers on score t of query i and key j of head (b, h), in the order above. unit: 1 in
  // natural units, log2 e in log2 units (the softcap's c and a float mask's values are scaled by
  // it; c = cap2 exactly when T is float and unit is log2 e, the vector forms' constant). bias: the
  // position bias of (h, i - j) in the same units (the kernels read their table; the reference
  // computes it in float64 from the options). *dcap (when given): d(capped t)/dt, 0 where hidden.
  template <class T>
  T apply(T t, T unit, T bias, int64_t b, int64_t h, int64_t i, int64_t j, T* dcap = nullptr) const {
    constexpr T kInf = std::numeric_limits<T>::infinity();
    if (dcap != nullptr) *dcap = T(1);
    if (capped()) {
      const T c = static_cast<T>(softcap) * unit;
      const T th = std::tanh(t / c);
      t = c * th;
      if (dcap != nullptr) *dcap = T(1) - th * th;
    }
    if (biased()) t += bias;
    if (!pair_visible(h, i, j)) {
      if (dcap != nullptr) *dcap = T(0);
      return -kInf;
    }
    if (masked()) {
      const T term = mask_term<T>(mask_offset(b, h, i) + j * mask.stride(3), unit);
      if (mask_kind == MaskKind::Bool) {
        if (term != T(0)) {
          if (dcap != nullptr) *dcap = T(0);
          return -kInf;
        }
      } else {
        t += term;
      }
    }
    return t;
  }
};

}  // namespace heads::kernels
