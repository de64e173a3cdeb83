// mha.h — MultiheadAttention, mirroring torch.nn.MultiheadAttention.
//
// Parameters carry PyTorch's names and layouts ([out, in] weights):
//   in_proj_weight [3E, E] (kdim == vdim == E) or q_proj_weight [E, E], k_proj_weight [E, kdim],
//   v_proj_weight [E, vdim]; in_proj_bias [3E]; bias_k, bias_v [1, 1, E]; out_proj.weight [E, E],
//   out_proj.bias [E].
// forward(query, key, value) takes [L, N, E] (or [N, L, E] with batch_first) or unbatched
// [L, E] inputs; masks follow torch.nn.MultiheadAttention: bool true = masked out, float added.
// One extension: is_causal without attn_mask means causal attention (torch raises there).
// A query row whose keys are all masked gives zeros (torch gives NaN).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "heads/tensor.h"

namespace heads {

struct MultiheadAttentionOptions {
  int64_t embed_dim = 0;
  int64_t num_heads = 1;
  double dropout = 0.0;
  bool bias = true;
  bool add_bias_kv = false;
  bool add_zero_attn = false;
  int64_t kdim = 0;  // 0 = embed_dim
  int64_t vdim = 0;  // 0 = embed_dim
  bool batch_first = false;
};

struct MhaForwardArgs {
  Tensor key_padding_mask;  // [N, S] (unbatched: [S]); bool (true = ignore) or float (added)
  bool need_weights = true;
  Tensor attn_mask;  // [L, S] or [N * num_heads, L, S]; bool (true = masked) or float (added)
  bool average_attn_weights = true;
  bool is_causal = false;
};

using StateDict = std::vector<std::pair<std::string, Tensor>>;

class MultiheadAttention {
 public:
  // Parameters initialised as torch does (Xavier-uniform in-projection, zero biases,
  // Kaiming-uniform out-projection, Xavier-normal bias_k/bias_v) from `seed`
  // (default: heads::next_seed()).
  explicit MultiheadAttention(const MultiheadAttentionOptions& options,
                              std::optional<uint64_t> seed = std::nullopt);

  // Builds a module whose dimensions are read from a state dict (as `heads mha` does):
  // embed_dim from out_proj.weight, kdim/vdim from the projection weights, bias and
  // add_bias_kv from the presence of the bias tensors.
  static MultiheadAttention from_state_dict(const StateDict& sd, int64_t num_heads,
                                            bool batch_first = false, bool add_zero_attn = false);

  // Returns (output, weights). weights is undefined unless need_weights; it is [N, L, S]
  // averaged over heads, or [N, H, L, S] (unbatched: without N).
  std::pair<Tensor, Tensor> forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                    const MhaForwardArgs& args = {}) const;

  void train(bool on = true) { training_ = on; }
  void eval() { training_ = false; }
  bool training() const { return training_; }
  const MultiheadAttentionOptions& options() const { return opt_; }

  StateDict state_dict() const;  // in torch's order, sharing storage with the module
  // Copies values in (converting dtype); with strict, missing or unexpected names are errors.
  void load_state_dict(const StateDict& sd, bool strict = true);
  void load(const std::string& safetensors_path, bool strict = true);
  void save(const std::string& safetensors_path) const;

 private:
  struct Param {
    std::string name;
    Tensor value;
  };
  std::vector<Param> params_;
  Tensor* param(const std::string& name);
  const Tensor* param(const std::string& name) const;

  MultiheadAttentionOptions opt_;
  bool training_ = true;
};

}  // namespace heads
