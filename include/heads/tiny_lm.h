// tiny_lm.h — a small causal language model built from the library's modules, trainable in C++
// (forward, backward, AdamW): what `heads train-demo` trains.
//
//   ids [B, L] -> token embedding + learned position embedding -> TransformerEncoder (pre-norm,
//   causal mask, final LayerNorm, GELU) -> linear head -> logits [B·L, vocab]
//
// Parameter names (state_dict): tok_emb.weight, pos_emb.weight, encoder.<TransformerEncoder's>,
// head.weight, head.bias. Embeddings start as N(0, 0.02), the head as U(±1/√d_model).
#pragma once

#include <cstdint>

#include "heads/encoder.h"
#include "heads/mha.h"  // StateDict
#include "heads/tensor.h"

namespace heads {

struct TinyLMOptions {
  int64_t vocab = 0, max_len = 0;  // token ids in [0, vocab); sequences of at most max_len
  int64_t d_model = 64, nhead = 4, dim_feedforward = 256, num_layers = 2;
  double dropout = 0.0;
  AttentionVariant attention;  // the layers' self-attention (heads/mha.h); default: softmax
};

class TinyCausalLM {
 public:
  // Initial weights drawn from generators seeded by `seed` (the same seed gives the same model).
  TinyCausalLM(const TinyLMOptions& options, uint64_t seed);

  void train(bool on = true) { encoder_.train(on); }
  const TinyLMOptions& options() const { return opt_; }

  // Names and tensors sharing the model's storage (for the optimizer and for saving).
  StateDict state_dict() const;

  // What the backward needs from a forward.
  struct Tape {
    Tensor ids, positions, hidden;
    EncoderTape encoder;
  };

  // logits [B·L, vocab] for ids [B, L] (int64, each in [0, vocab), L ≤ max_len).
  Tensor forward(const Tensor& ids, Tape* tape = nullptr) const;
  // Gradients by parameter name for dL/d(logits) from the tape of a forward.
  StateDict backward(const Tape& tape, const Tensor& dlogits) const;

 private:
  TinyLMOptions opt_;
  TransformerEncoder encoder_;
  Tensor tok_, pos_, head_w_, head_b_;
};

}  // namespace heads
