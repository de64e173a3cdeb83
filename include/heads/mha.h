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
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "heads/linear_attention.h"
#include "heads/precision.h"
#include "heads/sdpa.h"
#include "heads/tensor.h"

namespace heads {

namespace modules {
struct PackedWeights;
class MhaAttention;
}

using StateDict = std::vector<std::pair<std::string, Tensor>>;

// What a forward keeps for MultiheadAttention::backward (set MhaForwardArgs::tape). It holds
// the f32 inputs, the projected heads, the SDPA statistics (log-sum-exp, dropout seed) and the
// attention output: O(L·E) memory, never an L×S matrix.
struct MhaTape {
  bool batched = true, self_attn = false;
  Shape query_shape, key_shape, value_shape, out_shape;
  Tensor xq, xk, xv;      // f32 inputs as [d0, d1, width] in the caller's dimension order
  Tensor q4, k4, v4;      // SDPA operands [N, H, L | S + extra, head_dim]
  SdpaOptions sdpa;       // merged mask, causal flag, dropout (seed fixed to the forward's)
  SdpaResult attention;   // output, lse and dropout seed of the SDPA call
  Tensor attn3;           // attention output [d0, d1, H·head_dim] (before any head gates)
  // Head gates (HeadGate != None): the pooled query [N, E], the gates [N, H] and the out-projection's
  // input attn3 · gates.
  Tensor gate_in, gates, gated;
  bool linear = false;               // linear attention ran (its options are in `linear_options`)
  LinearAttentionOptions linear_options;
  bool defined() const { return attn3.defined(); }
};

// Gradients of a loss with respect to the inputs and parameters of one forward call.
struct MhaGrads {
  // Shapes of query, key and value. When the forward saw self-attention (the same tensor passed
  // as query, key and value) dquery is the whole gradient of that tensor and dkey/dvalue are
  // undefined; otherwise each is the gradient through its own argument.
  Tensor dquery, dkey, dvalue;
  StateDict params;  // by parameter name, in state_dict() order (f32)
};

// Largest width a module accepts (embed_dim, kdim, vdim, d_model, dim_feedforward): every weight
// shape and size product then fits int64 with room to spare.
constexpr int64_t kMaxWidth = int64_t{1} << 24;

// What a MultiheadAttention computes between its projections: extensions of torch's module, whose
// behaviour the defaults give exactly.
enum class AttentionKind { Softmax, Linear };
// Per-head gates g = sigmoid(head_gate.weight · pool(query) + head_gate.bias) scale each head's
// output before the out-projection; pool is the query's first token or its mean over the sequence.
enum class HeadGate { None, FirstToken, MeanPool };

struct AttentionVariant {
  AttentionKind kind = AttentionKind::Softmax;
  FeatureMap feature_map = FeatureMap::EluPlusOne;  // linear attention's φ (heads/linear_attention.h)
  // Local attention: query i sees keys j with |i - j| <= window (with is_causal: i - window <= j <= i);
  // -1 = every key. Blocks outside the band are never computed.
  int64_t window = -1;
  // > 0: block-sparse attention in blocks of sparse_block queries and keys with Sparse Transformer's
  // "fixed" pattern (Child et al. 2019) at block granularity: a query block sees its own key block and
  // every summary block (key block kb with kb % sparse_stride == sparse_stride - 1); a summary block also
  // sees its group's blocks (kb / sparse_stride == qb / sparse_stride). Key blocks not in the pattern are
  // skipped.
  int64_t sparse_block = 0;
  int64_t sparse_stride = 4;
  HeadGate head_gate = HeadGate::None;
  // In eval mode without a tape, heads whose gate is below this are skipped by the kernel (their output
  // is exactly zero); 0 keeps every head. Training (a tape) always uses the soft gates.
  double gate_threshold = 0.0;
};

// Parses "softmax" / "linear" and "none" / "first" / "mean" (CLI and Python).
AttentionKind attention_kind_from_name(const std::string& name);
HeadGate head_gate_from_name(const std::string& name);

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
  // Width of each head; 0 = embed_dim / num_heads (torch). Otherwise the heads' total width
  // num_heads · head_dim may differ from embed_dim (as after prune_heads): in_proj_weight is then
  // [3 · num_heads · head_dim, E] and out_proj.weight [E, num_heads · head_dim].
  int64_t head_dim = 0;
  AttentionVariant variant;
};

struct MhaForwardArgs {
  Tensor key_padding_mask;  // [N, S] (unbatched: [S]); bool (true = ignore) or float (added)
  bool need_weights = true;
  Tensor attn_mask;  // [L, S] or [N * num_heads, L, S]; bool (true = masked) or float (added)
  bool average_attn_weights = true;
  bool is_causal = false;
  // [num_buckets, num_heads] floating: a relative position bias added to the scaled scores, the
  // table's entry of the bidirectional T5 bucket of key − query position (MPNet's, and T5's encoder:
  // heads/sdpa.h); softmax attention only. A given term, as attn_mask: no gradient flows into it.
  Tensor relative_attention_bias;
  int64_t relative_attention_max_distance = 128;
  // When set, receives what backward() needs (training). Gradients flow from the output only
  // (not from the returned weights, nor into the masks).
  MhaTape* tape = nullptr;
};

// Constructor tag: a module's parameters zero-filled (norm weights 1) instead of drawn at random,
// for a module whose weights are loaded right after (torch.nn.utils.skip_init): the draws cost more
// than reading a model's weights.
struct SkipInit {};

class MultiheadAttention {
 public:
  // Parameters initialised as torch does (Xavier-uniform in-projection, zero biases,
  // Kaiming-uniform out-projection, Xavier-normal bias_k/bias_v) from `seed`
  // (default: heads::next_seed()).
  explicit MultiheadAttention(const MultiheadAttentionOptions& options,
                              std::optional<uint64_t> seed = std::nullopt);
  // The same module with every parameter zero (load_state_dict next).
  MultiheadAttention(const MultiheadAttentionOptions& options, SkipInit);

  // Builds a module whose dimensions are read from a state dict (as `heads mha` does):
  // embed_dim from out_proj.weight, kdim/vdim from the projection weights, bias and
  // add_bias_kv from the presence of the bias tensors.
  // head_dim comes from out_proj.weight [E, num_heads · head_dim]. The variant (not visible in a state
  // dict) is the caller's; head gates must be named there when the state dict has them.
  static MultiheadAttention from_state_dict(const StateDict& sd, int64_t num_heads,
                                            bool batch_first = false, bool add_zero_attn = false,
                                            const AttentionVariant& variant = {});

  // Returns (output, weights). weights is undefined unless need_weights; it is [N, L, S]
  // averaged over heads, or [N, H, L, S] (unbatched: without N).
  std::pair<Tensor, Tensor> forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                    const MhaForwardArgs& args = {}) const;

  // Gradients for dL/d(output) `dout` (the shape of the forward's output), from the tape of that
  // forward. The module's parameters must not have changed in between.
  MhaGrads backward(const MhaTape& tape, const Tensor& dout) const;

  // Removes the given heads (indices into the current heads; duplicates ignored) from every weight,
  // as Hugging Face's prune_heads: num_heads shrinks, head_dim stays. The packed precision is re-made.
  void prune_heads(const std::vector<int64_t>& heads);

  // The per-head gates [N, H] (unbatched: [H]) the forward would use for `query`; undefined without
  // head gates.
  Tensor head_gates(const Tensor& query) const;

  void train(bool on = true) { training_ = on; }
  void eval() { training_ = false; }
  bool training() const { return training_; }
  const MultiheadAttentionOptions& options() const { return opt_; }

  // Reduced precision for the linear layers of forward() (heads/precision.h): the weights are
  // packed now, and again at every load_state_dict; a forward that records a tape runs in f32.
  // In bf16, q, k, v and the attention output are bf16 too (the bf16 attention kernel).
  // Parameters changed in place afterwards (an optimizer step) are not re-packed: call it again.
  // input_ranges (int8): per weight name, the inputs' largest |x| per channel from calibration
  // (record_input_ranges), whose outlier channels are then computed in f32 (heads/precision.h).
  void set_precision(Precision p, const InputRanges& input_ranges = {});
  Precision precision() const;
  // In f32 (else nothing), the linear weights also in the GEMM's own layout (TransformerEncoderLayer::
  // pack_f32 says when and what it costs).
  void pack_f32();
  // Merges into `ranges` the largest |x| per input channel of each linear weight ("in_proj_weight"
  // or "q_proj_weight", "k_proj_weight", "v_proj_weight"; "out_proj.weight") in the forward that
  // recorded `tape`: calibration for set_precision(Int8, ranges).
  void record_input_ranges(const MhaTape& tape, InputRanges& ranges) const;

  StateDict state_dict() const;  // in torch's order, sharing storage with the module
  // A copy with parameters of its own (a plain copy shares them; packed weights, immutable, are shared).
  MultiheadAttention clone() const;
  // state_dict() as an int8 module stores it: each packed linear weight in heads::int8_tensors'
  // form (int8 [N, K], "<name>_scale" f32 [N], and the residual term's tensors of the rows that
  // lose most); in f32 and bf16, state_dict().
  StateDict quantized_state_dict() const;
  // Copies values in (converting dtype); with strict, missing or unexpected names are errors.
  // Linear weights given in int8 (quantized_state_dict()'s form) are used as they are, without
  // re-quantizing, and switch the module to int8 (other linear weights are quantized then); the
  // parameters hold their values. Packed weights the state dict does not replace are kept.
  void load_state_dict(const StateDict& sd, bool strict = true);
  void load(const std::string& safetensors_path, bool strict = true);
  // Writes quantized_state_dict() (an int8 module loads back as the same int8 module).
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
  std::shared_ptr<const modules::PackedWeights> packed_;  // null: f32
  std::shared_ptr<const modules::MhaAttention> attention_;  // softmax or linear (the variant's kind)
};

}  // namespace heads
