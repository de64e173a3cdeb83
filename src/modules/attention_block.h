// attention_block.h — the attention block's layouts, one set of views for every module that runs
// one (MultiheadAttention, CausalLM, T5Encoder): projections [d0, d1, width] (rows in either order,
// [N, L] or [L, N]; the width contiguous) read as SDPA's heads [d0, H, d1, hd] by strides, and the
// [d0, d1, H · hd] buffer the out-projection reads written by SDPA through the same head view. No
// transposes are copied on the way in or out.
#pragma once

#include <cstdint>

#include "heads/tensor.h"

namespace heads::modules {

// t3 [d0, d1, H · hd] as heads [d0, H, d1, hd] (a view: t3's last dim must be contiguous).
inline Tensor split_heads(const Tensor& t3, int64_t H) {
  const int64_t hd = t3.size(2) / H;
  return t3.as_strided({t3.size(0), H, t3.size(1), hd}, {t3.stride(0), hd, t3.stride(1), 1});
}

struct QkvViews {
  Tensor q, k, v;
};

// One fused projection's output qkv [d0, d1, (H + 2 Hk) · hd] (its width: the q heads, then the k
// heads, then the v heads) as q [d0, H, d1, hd] and k, v [d0, Hk, d1, hd].
inline QkvViews fused_qkv_views(const Tensor& qkv, int64_t H, int64_t Hk, int64_t hd) {
  const int64_t q_end = H * hd, k_end = (H + Hk) * hd;
  return {split_heads(qkv.slice(2, 0, q_end), H), split_heads(qkv.slice(2, q_end, k_end), Hk),
          split_heads(qkv.slice(2, k_end, k_end + Hk * hd), Hk)};
}

}  // namespace heads::modules
