// cross_encoder.h — rerankers: a BERT-family encoder with a sequence-classification head
// (transformers' BertForSequenceClassification, RobertaForSequenceClassification,
// XLMRobertaForSequenceClassification, MPNetForSequenceClassification,
// ModernBertForSequenceClassification), scoring (query, text) pairs as sentence-transformers'
// CrossEncoder does.
//
// A model directory holds config.json (the encoder's fields, bert.h, and id2label: one label per
// entry, 2 when absent as in transformers), model.safetensors and the tokenizer (tokenizer.h). A pair
// is encoded as the tokenizer's pair template says ([CLS] a [SEP] b [SEP] with token types 0 and 1
// for BERT; <s> a </s></s> b </s> for RoBERTa; ModernBERT has no token types), truncated longest-first to the model's length:
// sentence_bert_config.json's max_seq_length, else tokenizer_config.json's model_max_length, capped
// at the positions the model holds.
//
// The head, on the first token's hidden state h:
//   BERT:      logits = classifier(tanh(bert.pooler.dense(h)))
//   RoBERTa:   logits = classifier.out_proj(tanh(classifier.dense(h)))   (MPNet too)
//   ModernBERT: logits = classifier(head.norm(act(head.dense(h))))      with h the first token's or,
//              with classifier_pooling "mean", the mean of the pair's tokens; act is
//              classifier_activation, biases where classifier_bias / norm_bias say.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "heads/bert.h"
#include "heads/tensor.h"
#include "heads/tokenizer.h"

namespace heads {

// What predict() applies to the logits: none (raw scores), the logistic sigmoid, or a softmax over
// the labels.
enum class ScoreActivation { Identity, Sigmoid, Softmax };
ScoreActivation score_activation_from_name(const std::string& name);  // "identity", "sigmoid", "softmax"

class CrossEncoder {
 public:
  // Loads `model_dir`; `precision` applies to the encoder's linear layers (BertModel::set_precision),
  // the head stays f32. Without it, the precision the directory stores.
  static CrossEncoder load(const std::string& model_dir, std::optional<Precision> precision = std::nullopt);

  using Pair = std::pair<std::string, std::string>;
  // [N, num_labels] f32 scores, row i for pairs[i]. Pairs are batched by length as
  // SentenceEncoder::encode batches texts (batch_size at most); progress(done, total) after each
  // batch; *truncated counts pairs cut to max_length().
  Tensor predict(const std::vector<Pair>& pairs, ScoreActivation activation = ScoreActivation::Identity,
                 int64_t batch_size = 32, const std::function<void(int64_t, int64_t)>& progress = {},
                 int64_t* truncated = nullptr) const;

  int64_t num_labels() const { return out_w_.size(0); }
  int64_t max_length() const { return max_length_; }
  const std::string& model_dir() const { return dir_; }
  const Tokenizer& tokenizer() const { return tok_; }
  const BertModel& bert() const { return bert_; }
  Precision precision() const { return bert_.precision(); }

 private:
  std::string dir_;
  BertModel bert_;
  Tokenizer tok_;
  int64_t max_length_ = 512;
  Tensor dense_w_, dense_b_, out_w_, out_b_;  // the head: [E, E], [E], [labels, E], [labels]
  // ModernBERT's head: a LayerNorm after the activation, and the pooling of the hidden states.
  Tensor norm_w_, norm_b_;
  Activation head_act_ = Activation::Gelu;  // BERT, RoBERTa: tanh (not an Activation)
  bool mean_pooling_ = false;
  double norm_eps_ = 1e-5;
};

}  // namespace heads
