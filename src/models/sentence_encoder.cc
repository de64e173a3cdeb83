// sentence_encoder.cc — the sentence-transformers pipeline around BertModel: tokenize, batch by
// length, encode, pool, normalise (include/heads/sentence_encoder.h).
#include "heads/sentence_encoder.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "config_json.h"
#include "heads/error.h"
#include "length_batches.h"

namespace heads {

namespace fs = std::filesystem;
using models::json_bool;
using models::json_int;
using models::json_string;
using models::read_json;

namespace {

// One text's embedding from its hidden states h [len(+padding), E]: the pooled real tokens, then
// L2-normalised when the model says so; sums in double.
void pool(const float* h, int64_t len, int64_t E, Pooling pooling, bool normalize, float* o) {
  if (pooling == Pooling::Cls || pooling == Pooling::LastToken) {
    const float* t = pooling == Pooling::Cls ? h : h + std::max<int64_t>(len - 1, 0) * E;
    for (int64_t e = 0; e < E; ++e) o[e] = t[e];
  } else if (pooling == Pooling::Max) {
    for (int64_t e = 0; e < E; ++e) {
      float m = h[e];
      for (int64_t l = 1; l < len; ++l) m = std::max(m, h[l * E + e]);
      o[e] = m;
    }
  } else {  // mean over real tokens
    for (int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (int64_t l = 0; l < len; ++l) s += h[l * E + e];
      o[e] = static_cast<float>(s / static_cast<double>(std::max<int64_t>(len, 1)));
    }
  }
  if (normalize) {
    double nrm = 0;
    for (int64_t e = 0; e < E; ++e) nrm += static_cast<double>(o[e]) * o[e];
    const double inv = 1.0 / std::max(std::sqrt(nrm), 1e-12);
    for (int64_t e = 0; e < E; ++e) o[e] = static_cast<float>(o[e] * inv);
  }
}

}  // namespace

SentenceEncoder SentenceEncoder::load(const std::string& model_dir, std::optional<Precision> precision) {
  SentenceEncoder s;
  s.dir_ = model_dir;
  s.bert_ = BertModel::load(model_dir, precision);
  s.tok_ = Tokenizer::from_directory(model_dir);
  const fs::path d(s.dir_);
  s.max_seq_length_ = models::max_sequence_length(d, s.bert_.config().max_tokens());
  const int64_t special = static_cast<int64_t>(s.tok_.encode("", 0).ids.size());
  HEADS_CHECK(s.max_seq_length_ >= std::max<int64_t>(special, 1), (d / "sentence_bert_config.json").string(),
              ": max_seq_length ", s.max_seq_length_, " leaves no room past the ", special, " special tokens");
  const fs::path mpath = d / "modules.json";
  const nlohmann::json mods = read_json(mpath, false, /*array=*/true);
  std::string pooling_dir = "1_Pooling";
  for (const auto& mod : mods) {
    HEADS_CHECK(mod.is_object(), mpath.string(), ": expected objects in the array, got ", mod.dump());
    const std::string type = json_string(mod, "type", "", mpath);
    if (type.find("Normalize") != std::string::npos) s.normalize_ = true;
    if (type.find("Pooling") != std::string::npos) pooling_dir = json_string(mod, "path", pooling_dir, mpath);
  }
  const fs::path pcp = d / pooling_dir / "config.json";
  const nlohmann::json pc = read_json(pcp, false);
  // sentence-transformers 5+ writes "pooling_mode": "mean" | "cls" | "max" | "lasttoken" | ...; earlier
  // versions one pooling_mode_<mode> flag per mode.
  std::string mode = json_string(pc, "pooling_mode", "", pcp);
  for (const char* m : {"cls_token", "max_tokens", "lasttoken", "mean_sqrt_len_tokens", "weightedmean"}) {
    if (mode.empty() && json_bool(pc, ("pooling_mode_" + std::string(m)).c_str(), false, pcp)) mode = m;
  }
  if (mode.empty() || mode == "mean" || mode == "mean_tokens") s.pooling_ = Pooling::Mean;
  else if (mode == "cls" || mode == "cls_token") s.pooling_ = Pooling::Cls;
  else if (mode == "max" || mode == "max_tokens") s.pooling_ = Pooling::Max;
  else if (mode == "lasttoken") s.pooling_ = Pooling::LastToken;
  else ::heads::fail(pcp.string(), ": pooling mode \"", mode, "\" is not supported (mean, cls, max, lasttoken)");
  return s;
}

std::vector<int64_t> SentenceEncoder::tokenize(std::string_view text) const {
  return tok_.encode(text, max_seq_length_).ids;
}

Tensor SentenceEncoder::encode(const std::vector<std::string>& texts, int64_t batch_size,
                               const std::function<void(int64_t, int64_t)>& progress,
                               int64_t* truncated) const {
  HEADS_CHECK(batch_size >= 1, "encode: batch_size must be positive, got ", batch_size);
  const auto N = static_cast<int64_t>(texts.size());
  const int64_t E = dim();
  Tensor out = Tensor::zeros({N, E}, DType::F32);
  std::vector<std::vector<int64_t>> ids(static_cast<size_t>(N));
  int64_t cut = 0;
  for (int64_t i = 0; i < N; ++i) {
    auto e = tok_.encode(texts[static_cast<size_t>(i)], max_seq_length_);
    cut += e.truncated;
    ids[static_cast<size_t>(i)] = std::move(e.ids);
  }
  if (truncated) *truncated = cut;
  std::vector<int64_t> lengths(static_cast<size_t>(N));
  for (size_t i = 0; i < ids.size(); ++i) lengths[i] = static_cast<int64_t>(ids[i].size());
  models::for_each_length_batch(lengths, batch_size, [&](const std::vector<int64_t>& order, int64_t done) {
    std::vector<std::vector<int64_t>> batch;
    for (int64_t i : order) batch.push_back(ids[static_cast<size_t>(i)]);
    const Tensor h = bert_.forward(batch);  // [nb, L, E]
    const int64_t L = h.size(1);
    for (size_t k = 0; k < order.size(); ++k) {
      const auto len = static_cast<int64_t>(batch[k].size());
      float* row = out.data<float>() + order[k] * E;
      pool(h.data<float>() + static_cast<int64_t>(k) * L * E, len, E, pooling_, normalize_, row);
    }
    if (progress) progress(done, N);
  });
  return out;
}

SentenceEncoder::Attention SentenceEncoder::attention(std::string_view text) const {
  Attention a;
  const std::vector<int64_t> ids = tokenize(text);
  for (int64_t id : ids) a.tokens.push_back(tok_.token(id));
  std::vector<Tensor> w;
  bert_.forward({ids}, &w);
  for (auto& t : w) a.layers.push_back(t.squeeze(0));  // [H, L, L]
  return a;
}

}  // namespace heads
