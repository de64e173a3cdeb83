// attention_block.h — the decoders' attention layout, shared by CausalLM and T5Encoder: one fused
// projection's output [B, L, (H + 2 Hk) · hd] (rows: q heads, then k heads, then v heads) read as
// SDPA's q [B, H, L, hd] and k, v [B, Hk, L, hd] without copies, and SDPA's output written into a
// [B, L, H, hd] buffer through its [B, H, L, hd] view, so that the out-projection reads [B, L, H · hd].
#pragma once

#include <cstdint>

#include "heads/tensor.h"

namespace heads::models {

struct QkvViews {
  Tensor q, k, v;
};

// qkv: a contiguous [B, L, (H + 2 Hk) · hd] tensor.
inline QkvViews fused_qkv_views(const Tensor& qkv, int64_t H, int64_t Hk, int64_t hd) {
  const int64_t B = qkv.size(0), L = qkv.size(1), W = (H + 2 * Hk) * hd;
  const Shape strides{L * W, hd, W, 1};
  return {qkv.as_strided({B, H, L, hd}, strides, 0), qkv.as_strided({B, Hk, L, hd}, strides, H * hd),
          qkv.as_strided({B, Hk, L, hd}, strides, (H + Hk) * hd)};
}

// The [B, H, L, hd] view SDPA writes of a [B, L, H, hd] buffer.
inline Tensor heads_view(const Tensor& attn) { return attn.permute({0, 2, 1, 3}); }

}  // namespace heads::models
