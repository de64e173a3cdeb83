// t5.h — the T5 encoder (transformers' T5EncoderModel) from a save_pretrained directory: RMS layer
// norms, unscaled scores with the bucketed relative position bias of block 0 shared by every layer
// (computed inside the fused SDPA kernel from its [num_buckets, H] table), ReLU or gated-GELU/SiLU
// feed-forward.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "heads/ops.h"
#include "heads/precision.h"
#include "heads/tensor.h"

namespace heads {

class T5Encoder {
 public:
  T5Encoder() = default;
  static T5Encoder load(const std::string& dir);

  // ids [B, L] (i64); attention_mask [B, L] (non-zero = a real token) or undefined. Returns the last
  // hidden state [B, L, d_model] (f32).
  Tensor forward(const Tensor& ids, const Tensor& attention_mask = {}) const;
  int64_t d_model() const { return d_model_; }

 private:
  struct Block {
    Tensor ln1, ln2;
    // f32, read through the GEMM's own layout (PackedLinear::f32_shared); wi: [d_ff, d] or
    // [2 d_ff, d] (gate | up) when gated
    PackedLinear wqkv, wo, wi, wo_ff;
  };
  int64_t vocab_ = 0, d_model_ = 0, d_kv_ = 0, heads_ = 0, d_ff_ = 0, max_distance_ = 128;
  double eps_ = 1e-6;
  bool gated_ = false;
  GatedAct gated_act_ = GatedAct::GeluTanh;
  Tensor embed_, rel_bias_, final_ln_;
  std::vector<Block> blocks_;
};

}  // namespace heads
