// bert.h — the BERT encoder with Hugging Face weight names (BertModel), as all-MiniLM-L6-v2 and
// models shaped like it ship it: config.json (model_type, hidden_size, num_attention_heads,
// num_hidden_layers, intermediate_size, hidden_act, layer_norm_eps, max_position_embeddings,
// type_vocab_size, vocab_size, pad_token_id) and model.safetensors (embeddings.*, encoder.layer.<i>.*,
// optionally under "bert." or "roberta.").
//
// model_type "bert" (or none) and the RoBERTa family ("roberta", "xlm-roberta", "camembert":
// multilingual-e5, bge-m3, paraphrase-multilingual-*), which is BERT with position ids counted from
// pad_token_id + 1 (the first pad_token_id + 1 rows of the position table are never used by a
// right-padded batch); MPNet ("mpnet"); and ModernBERT ("modernbert": modernbert.cc has its weight
// names). Other model types are an error naming the field.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "heads/encoder.h"
#include "heads/ops.h"
#include "heads/precision.h"
#include "heads/tensor.h"

namespace heads {

struct BertConfig {
  int64_t hidden_size = 768, num_heads = 12, num_layers = 12, intermediate_size = 3072;
  int64_t max_position_embeddings = 512, type_vocab_size = 2, vocab_size = 30522;
  Activation hidden_act = Activation::Gelu;
  double layer_norm_eps = 1e-12;
  std::string model_type = "bert";
  int64_t position_offset = 0;  // the first token's position id: 0 (BERT), pad_token_id + 1 (RoBERTa, MPNet)
  // MPNet: the buckets of the relative position bias every layer adds to its scores (one table for all
  // layers, T5's bidirectional bucketing up to distance 128); 0: none (BERT, RoBERTa).
  int64_t relative_attention_num_buckets = 0;
  // ModernBERT: pre-norm layers (the first without its attention norm) with rotary positions, a
  // gated feed-forward (hidden_act of the first half times the second), no token types and a final
  // norm. Per layer: the half width of its local attention (query i sees keys j with |i - j| <=
  // window; -1: global attention) and its rotary settings (global and local layers have their own
  // theta). Empty for the other types.
  std::vector<int64_t> layer_window;
  std::vector<RopeOptions> layer_rope;
  bool modern() const { return model_type == "modernbert"; }
  // The longest sequence the position table holds (ModernBERT: max_position_embeddings).
  int64_t max_tokens() const { return max_position_embeddings - position_offset; }
};

// The BERT encoder: embeddings (word + position + token type, LayerNorm) and post-norm
// layers; returns the last hidden state. The RoBERTa family (position ids from pad_token_id + 1) and
// MPNet (no token types; a relative position bias shared by the layers) load into it too (bert.cc), and
// ModernBERT, whose layers are not TransformerEncoderLayer's (modernbert.cc).
class BertModel {
 public:
  // Loads config.json and model.safetensors from `dir`; errors name the file and the tensor.
  BertModel() = default;
  static BertModel load(const std::string& dir);
  // Then in `precision` when given (set_precision); a directory stored in int8 asked for int8 runs
  // as stored. An empty `dir` is an error.
  static BertModel load(const std::string& dir, std::optional<Precision> precision);
  const BertConfig& config() const { return cfg_; }
  // Linear weights stored in int8 (`heads quantize`: "<name>" I8 [out, in] with "<name>_scale" F32
  // [out]) are loaded as they are and the model runs in int8; set_precision changes that.
  // Reduced precision for every layer's linear layers (heads/precision.h); embeddings, LayerNorm,
  // attention and the activations stay f32. Int8 calibrates first (input_ranges()): the
  // activations' outlier channels are computed in f32.
  void set_precision(Precision p);
  Precision precision() const;
  // Per layer, the largest |x| of each input channel of its linear layers (names as
  // TransformerEncoderLayer::state_dict()) over kCalibrationSequences sequences of
  // kCalibrationLength token ids (or max_position_embeddings, if fewer) drawn uniformly from the
  // vocabulary with a fixed seed, through the f32 weights: the calibration of int8's outlier channels.
  static constexpr int64_t kCalibrationSequences = 32, kCalibrationLength = 128;
  std::vector<InputRanges> input_ranges() const;

  // ids: N sequences (ragged); returns [N, L, hidden] with L the longest, rows past a
  // sequence's end computed as padding (masked out as keys). attn_weights, when set, receives
  // one [N, H, L, L] tensor per layer.
  Tensor forward(const std::vector<std::vector<int64_t>>& ids,
                 std::vector<Tensor>* attn_weights = nullptr) const;
  // The same with each token's type id (the segment of a pair: 0 for the first text, 1 for the
  // second) in place of 0: type_ids[i] as long as ids[i], each in [0, type_vocab_size).
  Tensor forward(const std::vector<std::vector<int64_t>>& ids, const std::vector<std::vector<int64_t>>& type_ids,
                 std::vector<Tensor>* attn_weights = nullptr) const;

  // The encoder layers (batch first), e.g. to run one layer's self-attention on other inputs; empty
  // for ModernBERT, whose layers take rotary positions and a gated feed-forward.
  const std::vector<TransformerEncoderLayer>& layers() const { return layers_; }

 private:
  // Embeddings (word + position + token type, LayerNorm) of ids as [N, L, hidden], L the longest,
  // and `pad` [N, L] true past each sequence's end (`any_pad` when some entry is); type_ids null
  // for type 0 throughout.
  Tensor embed(const std::vector<std::vector<int64_t>>& ids, const std::vector<std::vector<int64_t>>* type_ids,
               Tensor& pad, bool& any_pad) const;
  Tensor run_layers(Tensor x, const Tensor& pad, bool any_pad, std::vector<Tensor>* attn_weights) const;

  // ModernBERT (modernbert.cc): its config and weights, its layers (the input ranges of their linear
  // layers gathered into `ranges` when given), its precision.
  static BertModel load_modernbert(const std::string& dir);
  struct PreNormLayer {
    Tensor attn_norm_w, attn_norm_b;  // attn_norm_w undefined: no norm (the first layer)
    Tensor wqkv, bqkv, wo, bo, mlp_norm_w, mlp_norm_b, wi, bi, wf, bf;  // wi: [2F, E], wf: [E, F]
    PackedLinear pk_qkv, pk_o, pk_i, pk_f;  // reduced-precision copies (set_precision)
  };
  Tensor run_prenorm_layers(Tensor x, const Tensor& pad, bool any_pad, std::vector<Tensor>* attn_weights,
                            std::vector<InputRanges>* ranges) const;
  void set_prenorm_precision(Precision p, const std::vector<InputRanges>& ranges);

  // The arguments every layer runs with (MPNet's relative position bias).
  EncoderForwardArgs layer_args() const;

  BertConfig cfg_;
  Tensor word_, position_, token_type_, emb_ln_w_, emb_ln_b_;
  Tensor relative_bias_;  // MPNet: [relative_attention_num_buckets, num_heads]
  std::vector<TransformerEncoderLayer> layers_;
  std::vector<PreNormLayer> prenorm_;  // ModernBERT's
  Tensor final_norm_w_, final_norm_b_;
  GatedAct prenorm_act_ = GatedAct::Gelu;
  Precision prenorm_precision_ = Precision::F32;
};

}  // namespace heads
