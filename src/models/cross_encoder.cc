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
  if (c.bert_.config().modern()) {
    const std::string pool = models::json_string(cfg, "classifier_pooling", "cls", cfg_path);
    HEADS_CHECK(pool == "cls" || pool == "mean", cfg_path.string(), ": classifier_pooling \"", pool,
                "\" is not supported (cls, mean)");
    c.mean_pooling_ = pool == "mean";
    c.head_act_ = activation_from_name(models::json_string(cfg, "classifier_activation", "gelu", cfg_path));
    c.norm_eps_ = c.bert_.config().layer_norm_eps;
    const bool dense_bias = models::json_bool(cfg, "classifier_bias", false, cfg_path);
    const bool norm_bias = models::json_bool(cfg, "norm_bias", false, cfg_path);
    HEADS_CHECK(w.has("classifier.weight"), c.dir_,
                ": tensor \"classifier.weight\" missing: not a sequence-classification model "
                "(ModernBertForSequenceClassification)");
    c.dense_w_ = w.get("head.dense.weight", {E, E});
    c.dense_b_ = w.get_if("head.dense.bias", {E}, dense_bias);
    c.norm_w_ = w.get("head.norm.weight", {E});
    c.norm_b_ = w.get_if("head.norm.bias", {E}, norm_bias);
    c.out_w_ = w.get("classifier.weight", {labels, E});
    c.out_b_ = w.get("classifier.bias", {labels});
  } else {
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
  }

  const int64_t special = static_cast<int64_t>(c.tok_.encode_pair("", "", 0).ids.size());
  c.max_length_ = models::max_sequence_length(d, c.bert_.config().max_tokens());
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
    const bool modern = bert_.config().modern();  // no token types
    const Tensor h = modern ? bert_.forward(ids) : bert_.forward(ids, types);  // [nb, L, E]
    const auto nb = static_cast<int64_t>(batch.size());
    const int64_t L = h.size(1);
    Tensor first = Tensor::empty({nb, E}, DType::F32);  // the first token's state, or the mean
    for (int64_t k = 0; k < nb; ++k) {
      const float* hk = h.data<float>() + k * L * E;
      float* o = first.data<float>() + k * E;
      if (!mean_pooling_) {
        std::copy_n(hk, E, o);
        continue;
      }
      const auto len = static_cast<int64_t>(ids[static_cast<size_t>(k)].size());
      for (int64_t e = 0; e < E; ++e) {
        double sum = 0;
        for (int64_t l = 0; l < len; ++l) sum += hk[l * E + e];
        o[e] = static_cast<float>(sum / static_cast<double>(len));
      }
    }
    Tensor pooled = linear(first, dense_w_, dense_b_);
    if (modern) {
      pooled = layer_norm(heads::activation(pooled, head_act_), norm_w_, norm_b_, norm_eps_);
    } else {
      float* p = pooled.data<float>();
      for (int64_t j = 0; j < nb * E; ++j) p[j] = std::tanh(p[j]);
    }
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
