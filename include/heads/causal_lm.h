// causal_lm.h — decoder-only language models read from a transformers save_pretrained directory
// (config.json + model.safetensors, or sharded with model.safetensors.index.json), run with heads'
// kernels and a KV cache.
//
// model_type and what it brings:
//   llama    RoPE (default, linear, llama3 scaling), GQA, RMSNorm, SwiGLU, attention_bias / mlp_bias
//   mistral  as llama, sliding_window on every layer
//   qwen2    as llama with q/k/v biases; sliding windows where layer_types says so
//   gemma2   RMSNorm (1 + w) before and after attention and MLP, GeGLU (tanh), embeddings times
//            sqrt(hidden), query_pre_attn_scalar, attention and final logit softcap, sliding and
//            global layers alternating (layer_types)
//   gpt2     learned positions, LayerNorm, Conv1D weights, gelu_new MLP, tied head
//   bloom    ALiBi, LayerNorm after the embeddings, fused per-head query_key_value, gelu MLP
// A config field heads does not implement (another rope_type, a partial rotary factor, ...) is an
// error naming the field, never ignored. Weights: f32 (f16 / bf16 files are widened once).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "heads/kv_cache.h"
#include "heads/ops.h"
#include "heads/precision.h"
#include "heads/tensor.h"

namespace heads {

struct CausalLMConfig {
  std::string model_type;
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t intermediate_size = 0, max_positions = 0;  // max_positions: learned positions (gpt2), else advisory
  double norm_eps = 1e-6;
  double scale = 0;           // attention score scale
  double attn_softcap = 0;    // 0: none
  double final_softcap = 0;   // 0: none
  std::vector<int64_t> window_left;  // per layer: -1 full attention, else keys left of the diagonal
  bool tie_word_embeddings = false;
  RopeOptions rope;           // for the RoPE models
};

class CausalLM {
 public:
  CausalLM() = default;
  static CausalLM load(const std::string& dir);
  const CausalLMConfig& config() const { return cfg_; }

  // Weights of the projections, MLP and head in bf16 or int8 (heads/precision.h); embeddings, norms,
  // RoPE, attention and the residual stream stay f32. F32 restores the loaded weights. Int8
  // calibrates first (input_ranges()): the activations' outlier channels (the "massive" channels of
  // trained decoders) are computed in f32. activation_error (int8 only) is PackedLinear's: 0, every
  // activation row takes two int8 terms; +inf, one (about 1.6x faster prompts, about 1.5x the
  // logits' error: docs/decoders.md). The new weights are all made before the old ones are let go:
  // for a moment both are held.
  void set_precision(Precision p, double activation_error = 0);
  Precision precision() const { return precision_; }

  // Per layer, then the head (num_layers + 1 entries), the largest |x| of each input channel of its
  // projections ("qkv", "o", "in", "out"; the head's "head") over kCalibrationSequences sequences of
  // kCalibrationLength token ids (at most max_positions with learned positions) drawn uniformly from
  // the vocabulary with a fixed seed, one sequence at a time through the f32 weights: the calibration
  // of int8's outlier channels (about the time of a prompt of 4 × 128 tokens in f32).
  static constexpr int64_t kCalibrationSequences = 4, kCalibrationLength = 128;
  std::vector<InputRanges> input_ranges() const;

  // An empty cache for `batch` sequences (f32 or bf16 storage).
  KVCache new_cache(int64_t batch = 1, DType dtype = DType::F32, int64_t capacity = 0) const;

  // ids [B, L] (i64) continuing the sequences in `cache` (positions cache->length() ...; a
  // temporary cache when null); appends their keys and values to it. Returns logits [B, L, vocab],
  // or [B, 1, vocab] for the last position only with last_only.
  Tensor forward(const Tensor& ids, KVCache* cache = nullptr, bool last_only = false) const;

  // Greedy decoding of one prompt: up to max_new_tokens new ids (stopping after eos_token_id when
  // >= 0), with a KV cache of `cache_dtype`; on_token, when set, sees each new id as it is chosen
  // (to stream the text).
  std::vector<int64_t> generate(const std::vector<int64_t>& prompt, int64_t max_new_tokens,
                                int64_t eos_token_id = -1, DType cache_dtype = DType::F32,
                                const std::function<void(int64_t)>& on_token = {}) const;
  // The directory's end-of-sequence id: generation_config.json's eos_token_id, else config.json's
  // (the first of a list); -1 when neither names one.
  static int64_t eos_token_id(const std::string& dir);

 private:
  friend struct CausalLMReader;  // the readers of each model_type (causal_lm_load.cc)
  enum class Norm { LayerNorm, Rms, RmsUnitOffset };
  enum class Mlp { GatedSilu, GatedGeluTanh, GeluTanh };
  enum class Pos { Rope, Learned, Alibi };
  struct Layer {
    Tensor norm1_w, norm1_b, wqkv, bqkv, wo, bo, post_attn_w;  // post_attn_w: gemma2
    Tensor norm2_w, norm2_b, w_in, b_in, w_out, b_out, post_ffn_w;
    PackedLinear pk_qkv, pk_o, pk_in, pk_out;  // reduced-precision copies (set_precision)
  };
  // forward(); with `ranges` (input_ranges()), each projection's input ranges recorded into it through
  // the f32 weights, and no logits (an empty tensor).
  Tensor run(const Tensor& ids, KVCache* cache, bool last_only, std::vector<InputRanges>* ranges) const;
  void pack(Precision p, const std::vector<InputRanges>& ranges, double activation_error);
  // x·wᵀ + b through pk (else w); with ranges (calibration), through w, x's ranges recorded as `name`.
  Tensor proj(const Tensor& x, const Tensor& w, const PackedLinear& pk, const Tensor& b, InputRanges* ranges,
              const char* name) const;
  Tensor norm(const Tensor& x, const Tensor& w, const Tensor& b) const;
  Tensor mlp(const Layer& l, const Tensor& h, InputRanges* ranges) const;

  CausalLMConfig cfg_;
  Norm norm_ = Norm::Rms;
  Mlp mlp_ = Mlp::GatedSilu;
  Pos pos_ = Pos::Rope;
  bool residual_from_norm_ = false;  // bloom's apply_residual_connection_post_layernorm
  float embed_scale_ = 1.0f;
  Tensor embed_, positions_, embed_norm_w_, embed_norm_b_, final_w_, final_b_, lm_head_, alibi_;
  PackedLinear pk_head_;
  Precision precision_ = Precision::F32;
  std::vector<Layer> layers_;
};

}  // namespace heads
