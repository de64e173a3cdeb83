// encoder.h — TransformerEncoderLayer and TransformerEncoder, mirroring torch.nn.
//
// State-dict names are torch's: self_attn.{in_proj_weight, in_proj_bias, out_proj.weight,
// out_proj.bias}, linear1.{weight, bias}, linear2.{weight, bias}, norm1.{weight, bias},
// norm2.{weight, bias}; an encoder prefixes them with layers.<i>. and adds norm.{weight, bias}
// when built with a final norm.
// forward(src, src_mask, src_key_padding_mask, is_causal) takes [L, N, E] ([N, L, E] with
// batch_first, or unbatched [L, E]); masks as torch.nn.MultiheadAttention (bool true = masked).
// Padded positions are computed like every other position (torch's nested-tensor fast path
// returns zeros there instead).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "heads/mha.h"
#include "heads/ops.h"
#include "heads/tensor.h"

namespace heads {

struct TransformerEncoderLayerOptions {
  int64_t d_model = 0;
  int64_t nhead = 1;
  int64_t dim_feedforward = 2048;
  double dropout = 0.1;
  Activation activation = Activation::Relu;
  double layer_norm_eps = 1e-5;
  bool batch_first = false;
  bool norm_first = false;
  bool bias = true;
  // The self-attention's mechanism (heads/mha.h: softmax, linear, local window, block-sparse, head
  // gates); the default is torch's layer.
  AttentionVariant attention;
};

// What TransformerEncoderLayer::forward keeps for backward (EncoderForwardArgs::tape): the
// inputs of every step (norms, linears, activation), the attention's tape and dropout seeds.
struct EncoderLayerTape {
  MhaTape attn;
  Tensor sa_in;          // self-attention input (pre-norm: norm1(x); post-norm: x)
  Tensor norm1_in, norm2_in, ff_in;
  Tensor hidden;         // linear1 output (the activation's input)
  Tensor hidden_out;     // dropout(activation(hidden)), linear2's input
  double p = 0.0;        // dropout probability in effect
  uint64_t seed_attn = 0, seed_hidden = 0, seed_out = 0;
  bool defined() const { return attn.defined(); }
};

struct EncoderGrads {
  Tensor dsrc;       // shape of src
  StateDict params;  // by parameter name, in state_dict() order
};

struct EncoderTape {
  std::vector<EncoderLayerTape> layers;
  Tensor norm_in;  // input of the final norm (when the encoder has one)
  bool defined() const { return !layers.empty() && layers.back().defined(); }
};

struct EncoderForwardArgs {
  Tensor src_mask;              // [L, L] or [N * nhead, L, L]
  Tensor src_key_padding_mask;  // [N, L] (unbatched: [L])
  bool is_causal = false;
  // The self-attention's relative position bias (MhaForwardArgs::relative_attention_bias).
  Tensor relative_attention_bias;
  int64_t relative_attention_max_distance = 128;
  // When set, receives the attention weights [N, nhead, L, L] (unbatched: [nhead, L, L]).
  Tensor* attn_weights = nullptr;
  // When set, receives what backward() needs (training). Gradients flow from the output only.
  EncoderLayerTape* tape = nullptr;
};

class TransformerEncoderLayer {
 public:
  // Parameters initialised as torch does (see MultiheadAttention; linear layers Kaiming-uniform
  // with a = √5, norms 1 and 0) from `seed` (default: heads::next_seed()).
  explicit TransformerEncoderLayer(const TransformerEncoderLayerOptions& options,
                                   std::optional<uint64_t> seed = std::nullopt);
  // The same layer with linear weights and biases zero, norms 1 and 0 (load_state_dict next).
  TransformerEncoderLayer(const TransformerEncoderLayerOptions& options, SkipInit);

  Tensor forward(const Tensor& src, const EncoderForwardArgs& args = {}) const;
  // Gradients for dL/d(output) `dout` from the tape of a forward (parameters unchanged since).
  EncoderGrads backward(const EncoderLayerTape& tape, const Tensor& dout) const;

  void train(bool on = true);
  void eval() { train(false); }
  bool training() const { return training_; }
  const TransformerEncoderLayerOptions& options() const { return opt_; }
  const MultiheadAttention& self_attn() const { return self_attn_; }
  // MultiheadAttention::prune_heads on the self-attention (self_attn.* weights shrink).
  void prune_heads(const std::vector<int64_t>& heads) { self_attn_.prune_heads(heads); }

  StateDict state_dict() const;
  // A copy with parameters of its own (a plain copy shares them).
  TransformerEncoderLayer clone() const;
  // state_dict() with an int8 layer's linear weights in heads::int8_tensors' form (as
  // MultiheadAttention::quantized_state_dict); load_state_dict reads them back as they are and
  // switches the layer to int8.
  StateDict quantized_state_dict() const;
  void load_state_dict(const StateDict& sd, bool strict = true);

  // Reduced precision for the linear layers of forward() (heads/precision.h): the weights are
  // packed now, and again at every load_state_dict; a forward that records a tape runs in f32.
  // Parameters changed in place afterwards (an optimizer step) are not re-packed: call it again.
  // input_ranges (int8): as MultiheadAttention::set_precision's, by state_dict() name.
  void set_precision(Precision p, const InputRanges& input_ranges = {});
  Precision precision() const;
  // In f32 (else nothing), the linear weights also in the GEMM's own layout, made at first use beside
  // them (as much memory again; heads/precision.h's PackedLinear::f32_shared), so that inference
  // does not lay them out again at every call: for weights that no longer change (a loaded model's).
  // load_state_dict lays the new weights out again (as set_precision's packing; a load of int8
  // weights switches to int8), set_precision replaces it (set_precision(F32): the plain weights), and
  // parameters changed in place afterwards (an optimizer step) are not seen by it: call it again.
  void pack_f32();
  // Merges into `ranges` the largest |x| per input channel of each linear weight ("self_attn.*",
  // "linear1.weight", "linear2.weight") in the forward that recorded `tape`.
  void record_input_ranges(const EncoderLayerTape& tape, InputRanges& ranges) const;

 private:
  TransformerEncoderLayerOptions opt_;
  MultiheadAttention self_attn_;
  std::vector<std::pair<std::string, Tensor>> params_;  // linear1/2, norm1/2
  const Tensor* param(const std::string& name) const;
  Tensor opt_param(const std::string& name) const;  // undefined when built with bias=False
  bool training_ = true;
  std::shared_ptr<const modules::PackedWeights> packed_;  // linear1, linear2; null: f32
};

// set_precision on every layer, all or none: when a layer's weights cannot be packed, the layers
// already switched go back to the precision they had, and the error is rethrown. input_ranges: none,
// or one set per layer (TransformerEncoderLayer::set_precision).
void set_layers_precision(std::vector<TransformerEncoderLayer>& layers, Precision p,
                          const std::vector<InputRanges>& input_ranges = {});

class TransformerEncoder {
 public:
  // num_layers copies of a layer built from `layer` (identical initial parameters, as torch's
  // deep copies); a final LayerNorm(d_model, layer_norm_eps) when final_norm.
  TransformerEncoder(const TransformerEncoderLayerOptions& layer, int64_t num_layers,
                     bool final_norm = false, std::optional<uint64_t> seed = std::nullopt);

  // attn_weights, when set, receives one [N, nhead, L, L] tensor per layer.
  Tensor forward(const Tensor& src, const Tensor& mask = {}, const Tensor& src_key_padding_mask = {},
                 bool is_causal = false, std::vector<Tensor>* attn_weights = nullptr,
                 EncoderTape* tape = nullptr) const;
  // Gradients for dL/d(output) from the tape of a forward; names as state_dict().
  EncoderGrads backward(const EncoderTape& tape, const Tensor& dout) const;

  void train(bool on = true);
  void eval() { train(false); }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  const TransformerEncoderLayer& layer(int64_t i) const { return layers_.at(static_cast<size_t>(i)); }
  // Hugging Face's prune_heads: {layer index: heads to remove from its self-attention}.
  void prune_heads(const std::map<int64_t, std::vector<int64_t>>& heads_by_layer);

  StateDict state_dict() const;
  StateDict quantized_state_dict() const;  // the layers' quantized_state_dict()
  // int8 weights (quantized_state_dict()) are used as stored; when any layer gets them, every
  // layer runs in int8. A failed load (any layer, any tensor) leaves the encoder as it was.
  void load_state_dict(const StateDict& sd, bool strict = true);
  void load(const std::string& safetensors_path, bool strict = true);
  void save(const std::string& safetensors_path) const;  // quantized_state_dict()

  // Every layer's set_precision (the final norm stays f32).
  void set_precision(Precision p);
  Precision precision() const;
  // Every layer's pack_f32 (in f32, else nothing): TransformerEncoderLayer::pack_f32.
  void pack_f32();

 private:
  StateDict collect(bool quantized) const;
  std::vector<TransformerEncoderLayer> layers_;
  Tensor norm_w_, norm_b_;
  double eps_;
};

}  // namespace heads
