// cross_encoder.cc — a BERT-family encoder with a sequence-classification head scoring text pairs
// (include/heads/cross_encoder.h).
#include "heads/cross_encoder.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "checkpoint.h"
#include "config_json.h"
#include "heads/error.h"
#include "heads/ops.h"
#include "length_batches.h"

namespace heads {

namespace fs = std::filesystem;
using models::json_int;
using models::read_json;

ScoreActivation score_activation_from_name(const std::string& name) {
  if (name == "identity" || name == "none") return ScoreActivation::Identity;
  if (name == "sigmoid") return ScoreActivation::Sigmoid;
  if (name == "softmax") return ScoreActivation::Softmax;
  ::heads::fail("activation \"", name, "\" is not one of identity, sigmoid, softmax");
}

namespace {

// The model's length for a pair: sentence_bert_config.json's max_seq_length, else
// tokenizer_config.json's model_max_length (transformers writes about 1e30 for "no limit"), capped
// at the positions the encoder holds.
int64_t pair_max_length(const fs::path& d, int64_t positions) {
  const fs::path sbp = d / "sentence_bert_config.json";
  const nlohmann::json sb = read_json(sbp, false);
  if (sb.contains("max_seq_length")) {
    return std::min(json_int(sb, "max_seq_length", positions, sbp, 2, int64_t{1} << 24), positions);
  }
  const fs::path tcp = d / "tokenizer_config.json";
  const nlohmann::json tc = read_json(tcp, false);
  if (tc.contains("model_max_length") && !tc.at("model_max_length").is_null()) {
    const nlohmann::json& v = tc.at("model_max_length");
    HEADS_CHECK(v.is_number() && v.get<double>() >= 2, tcp.string(),
                ": \"model_max_length\" must be a number of at least 2, got ", v.dump());
    if (v.get<double>() < static_cast<double>(positions)) return static_cast<int64_t>(v.get<double>());
  }
  return positions;
}

}  // namespace

CrossEncoder CrossEncoder::load(const std::string& model_dir, std::optional<Precision> precision) {
  CrossEncoder c;
  c.dir_ = model_dir;
  c.bert_ = BertModel::load(model_dir, precision);
  c.tok_ = Tokenizer::from_directory(model_dir);
  const fs::path d(c.dir_);

  // transformers: num_labels = len(id2label), 2 when config.json has none.
  const fs::path cfg_path = d / "config.json";
  const nlohmann::json cfg = read_json(cfg_path, true);
  int64_t labels = 2;
  if (cfg.contains("id2label") && !cfg.at("id2label").is_null()) {
    HEADS_CHECK(cfg.at("id2label").is_object() && !cfg.at("id2label").empty(), cfg_path.string(),
                ": \"id2label\" must be a non-empty object, got ", cfg.at("id2label").dump());
    labels = static_cast<int64_t>(cfg.at("id2label").size());
  }
  const int64_t E = c.bert_.config().hidden_size;
  const models::Checkpoint w(d);
  // The RoBERTa family and MPNet (bert.h) share the classification head's names.
  const bool roberta = c.bert_.config().position_offset > 0;
  const std::string dense = roberta ? "classifier.dense." : "bert.pooler.dense.";
  const std::string out = roberta ? "classifier.out_proj." : "classifier.";
  HEADS_CHECK(w.has(out + "weight"), c.dir_, ": tensor \"", out,
              "weight\" missing: not a sequence-classification model (",
              roberta ? "RobertaForSequenceClassification, XLMRobertaForSequenceClassification or "
                        "MPNetForSequenceClassification"
                      : "BertForSequenceClassification",
              ")");
  c.dense_w_ = w.get(dense + "weight", {E, E});
  c.dense_b_ = w.get(dense + "bias", {E});
  c.out_w_ = w.get(out + "weight", {labels, E});
  c.out_b_ = w.get(out + "bias", {labels});

  const int64_t special = static_cast<int64_t>(c.tok_.encode_pair("", "", 0).ids.size());
  c.max_length_ = pair_max_length(d, c.bert_.config().max_tokens());
  HEADS_CHECK(c.max_length_ > special, c.dir_, ": the model's length ", c.max_length_, " leaves no room past the ",
              special, " special tokens of a pair");
  return c;
}

Tensor CrossEncoder::predict(const std::vector<Pair>& pairs, ScoreActivation activation, int64_t batch_size,
                             const std::function<void(int64_t, int64_t)>& progress, int64_t* truncated) const {
  HEADS_CHECK(batch_size >= 1, "predict: batch_size must be positive, got ", batch_size);
  const auto N = static_cast<int64_t>(pairs.size());
  const int64_t E = bert_.config().hidden_size, K = num_labels();
  std::vector<Tokenizer::Encoding> enc(static_cast<size_t>(N));
  std::vector<int64_t> lengths(static_cast<size_t>(N));
  int64_t cut = 0;
  for (size_t i = 0; i < enc.size(); ++i) {
    enc[i] = tok_.encode_pair(pairs[i].first, pairs[i].second, max_length_);
    cut += enc[i].truncated;
    lengths[i] = static_cast<int64_t>(enc[i].ids.size());
  }
  if (truncated) *truncated = cut;
  Tensor scores = Tensor::empty({N, K}, DType::F32);
  models::for_each_length_batch(lengths, batch_size, [&](const std::vector<int64_t>& batch, int64_t done) {
    std::vector<std::vector<int64_t>> ids, types;
    for (int64_t i : batch) {
      ids.push_back(enc[static_cast<size_t>(i)].ids);
      types.push_back(enc[static_cast<size_t>(i)].type_ids);
    }
    const Tensor h = bert_.forward(ids, types);  // [nb, L, E]
    const auto nb = static_cast<int64_t>(batch.size());
    const int64_t L = h.size(1);
    Tensor first = Tensor::empty({nb, E}, DType::F32);
    for (int64_t k = 0; k < nb; ++k) {
      std::copy_n(h.data<float>() + k * L * E, E, first.data<float>() + k * E);
    }
    Tensor pooled = linear(first, dense_w_, dense_b_);
    float* p = pooled.data<float>();
    for (int64_t j = 0; j < nb * E; ++j) p[j] = std::tanh(p[j]);
    const Tensor logits = linear(pooled, out_w_, out_b_);  // [nb, K]
    for (int64_t k = 0; k < nb; ++k) {
      const float* z = logits.data<float>() + k * K;
      float* o = scores.data<float>() + batch[static_cast<size_t>(k)] * K;
      if (activation == ScoreActivation::Sigmoid) {
        for (int64_t j = 0; j < K; ++j) o[j] = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(z[j]))));
      } else if (activation == ScoreActivation::Softmax) {
        const float m = *std::max_element(z, z + K);
        double s = 0;
        for (int64_t j = 0; j < K; ++j) s += std::exp(static_cast<double>(z[j] - m));
        for (int64_t j = 0; j < K; ++j) o[j] = static_cast<float>(std::exp(static_cast<double>(z[j] - m)) / s);
      } else {
        std::copy_n(z, K, o);
      }
    }
    if (progress) progress(done, N);
  });
  return scores;
}

}  // namespace heads
