// bert.cc — the BERT encoder with Hugging Face weight names (include/heads/bert.h).
//
// Weight names (optionally prefixed "bert." or "roberta."): embeddings.{word,position,token_type}_embeddings
// .weight, embeddings.LayerNorm.{weight,bias}; per layer i under encoder.layer.<i>.:
// attention.self.{query,key,value}.{weight,bias} -> self_attn.in_proj_{weight,bias} (stacked),
// attention.output.dense -> self_attn.out_proj, attention.output.LayerNorm -> norm1,
// intermediate.dense -> linear1, output.dense -> linear2, output.LayerNorm -> norm2.
// LayerNorm.gamma / LayerNorm.beta are accepted for weight / bias. MPNet (model_type "mpnet", prefix
// "mpnet."): no token types; attention.attn.{q,k,v} -> in_proj, attention.attn.o -> out_proj,
// attention.LayerNorm -> norm1, the rest as BERT's; encoder.relative_attention_bias.weight
// [buckets, heads] the relative position bias of every layer.
#include "heads/bert.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>

#include "checkpoint.h"
#include "config_json.h"
#include "heads/ops.h"
#include "heads/safetensors.h"

namespace heads {

namespace fs = std::filesystem;
using models::json_int;
using models::json_real;
using models::json_string;
using models::cat_rows;
using models::read_json;

namespace {

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

  // A linear layer's weight [out, in]: f32, or int8 as `heads quantize` stores it
  // (heads::int8_tensors: "<name>" i8 with "<name>_scale" and the residual term's tensors).
  struct Linear {
    Tensor weight;        // floating: f32; int8: undefined
    PackedLinear packed;  // int8: what the file holds
  };
  Linear linear(const std::string& name, const Shape& shape) const {
    if (!has(name) || file.get(prefix + name).dtype() != DType::I8) return {get(name, shape), {}};
    const Shape stored = file.get(prefix + name).shape();
    HEADS_CHECK(stored == shape, file.label(), ": tensor \"", prefix + name, "\": expected shape ", shape, ", got ",
                stored);
    std::map<std::string, Tensor> held;
    const auto lookup = [&](const std::string& n) -> const Tensor* {
      if (!file.contains(n)) return nullptr;
      return &held.emplace(n, file.get(n)).first->second;
    };
    return {Tensor(), int8_from_tensors(prefix + name, lookup, file.label())};
  }
};

// The weight of the linear layers stacked by rows (q, k, v) under `name` in a layer's state dict:
// f32, or int8 with its parts (heads::int8_tensors); int8 and floating parts are not mixed.
void add_linear(StateDict& sd, const std::string& name, const std::vector<Weights::Linear>& parts,
                const std::string& what) {
  const bool int8 = parts.front().packed.defined();
  std::vector<Tensor> w;
  std::vector<PackedLinear> q;
  for (const auto& p : parts) {
    HEADS_CHECK(p.packed.defined() == int8, what, ": int8 and floating weights mixed in one projection");
    w.push_back(p.weight);
    q.push_back(p.packed);
  }
  if (!int8) {
    sd.emplace_back(name, cat_rows(w));
    return;
  }
  for (auto& t : int8_tensors(name, q.size() == 1 ? q.front() : heads::cat_rows(q))) sd.push_back(std::move(t));
}

}  // namespace

BertModel BertModel::load(const std::string& dir) {
  const fs::path d(dir);
  const fs::path cfg_path = d / "config.json";
  HEADS_CHECK(fs::is_directory(d), dir, ": model directory not found");
  const nlohmann::json j = read_json(cfg_path, true);
  if (json_string(j, "model_type", "bert", cfg_path) == "modernbert") return load_modernbert(dir);
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
  c.model_type = json_string(j, "model_type", "bert", cfg_path);
  const bool roberta = c.model_type == "roberta" || c.model_type == "xlm-roberta" || c.model_type == "camembert";
  const bool mpnet = c.model_type == "mpnet";
  HEADS_CHECK(c.model_type == "bert" || roberta || mpnet, cfg_path.string(), ": model_type \"", c.model_type,
              "\" is not supported by the BERT encoder (bert, roberta, xlm-roberta, camembert, mpnet, modernbert)");
  if (roberta || mpnet) c.position_offset = json_int(j, "pad_token_id", 1, cfg_path, 0, kMaxCount) + 1;
  if (mpnet) {
    c.type_vocab_size = 1;  // no token types: one zero row
    c.relative_attention_num_buckets = json_int(j, "relative_attention_num_buckets", 32, cfg_path, 2, kMaxCount);
  }
  const std::string pe = json_string(j, "position_embedding_type", "absolute", cfg_path);
  HEADS_CHECK(pe == "absolute", cfg_path.string(), ": position_embedding_type \"", pe,
              "\" is not supported (absolute)");
  HEADS_CHECK(c.hidden_size > 0 && c.num_heads > 0 && c.hidden_size % c.num_heads == 0,
              cfg_path.string(), ": hidden_size ", c.hidden_size, " is not divisible by num_attention_heads ",
              c.num_heads);
  HEADS_CHECK(c.num_layers > 0 && c.intermediate_size > 0 && c.vocab_size > 0 &&
                  c.max_position_embeddings > 0 && c.type_vocab_size > 0,
              cfg_path.string(), ": sizes must be positive");
  HEADS_CHECK(c.max_tokens() >= 1, cfg_path.string(), ": max_position_embeddings ", c.max_position_embeddings,
              " holds no position past pad_token_id + 1 = ", c.position_offset);

  const fs::path wpath = d / "model.safetensors";
  HEADS_CHECK(fs::exists(wpath), wpath.string(), ": not found",
              fs::exists(d / "pytorch_model.bin")
                  ? " (the directory has pytorch_model.bin: convert it once with `python3 -m heads.convert " + dir + "`)"
                  : std::string());
  Weights w{SafeTensors::open(wpath.string()), ""};
  for (const char* prefix : {"bert.", "roberta.", "mpnet."}) {
    if (!w.has("embeddings.word_embeddings.weight") &&
        w.file.contains(std::string(prefix) + "embeddings.word_embeddings.weight")) {
      w.prefix = prefix;
    }
  }
  const int64_t E = c.hidden_size, F = c.intermediate_size;
  m.word_ = w.get("embeddings.word_embeddings.weight", {c.vocab_size, E});
  m.position_ = w.get("embeddings.position_embeddings.weight", {c.max_position_embeddings, E});
  m.token_type_ = mpnet ? Tensor::zeros({1, E}, DType::F32)
                        : w.get("embeddings.token_type_embeddings.weight", {c.type_vocab_size, E});
  if (mpnet) {
    m.relative_bias_ = w.get("encoder.relative_attention_bias.weight", {c.relative_attention_num_buckets, c.num_heads});
  }
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
    // The attention's names: BERT's, or MPNet's.
    const std::string q = p + (mpnet ? "attention.attn.q" : "attention.self.query");
    const std::string k = p + (mpnet ? "attention.attn.k" : "attention.self.key");
    const std::string v = p + (mpnet ? "attention.attn.v" : "attention.self.value");
    const std::string o = p + (mpnet ? "attention.attn.o" : "attention.output.dense");
    const std::string n1 = p + (mpnet ? "attention.LayerNorm" : "attention.output.LayerNorm");
    StateDict sd;
    add_linear(sd, "self_attn.in_proj_weight",
               {w.linear(q + ".weight", {E, E}), w.linear(k + ".weight", {E, E}), w.linear(v + ".weight", {E, E})},
               w.file.label() + ": " + w.prefix + q + ", key and value weights");
    sd.emplace_back("self_attn.in_proj_bias", cat_rows({w.get(q + ".bias", {E}), w.get(k + ".bias", {E}),
                                                        w.get(v + ".bias", {E})}));
    add_linear(sd, "self_attn.out_proj.weight", {w.linear(o + ".weight", {E, E})}, "");
    sd.emplace_back("self_attn.out_proj.bias", w.get(o + ".bias", {E}));
    sd.emplace_back("norm1.weight", w.get(n1 + ".weight", {E}));
    sd.emplace_back("norm1.bias", w.get(n1 + ".bias", {E}));
    add_linear(sd, "linear1.weight", {w.linear(p + "intermediate.dense.weight", {F, E})}, "");
    sd.emplace_back("linear1.bias", w.get(p + "intermediate.dense.bias", {F}));
    add_linear(sd, "linear2.weight", {w.linear(p + "output.dense.weight", {E, F})}, "");
    sd.emplace_back("linear2.bias", w.get(p + "output.dense.bias", {E}));
    sd.emplace_back("norm2.weight", w.get(p + "output.LayerNorm.weight", {E}));
    sd.emplace_back("norm2.bias", w.get(p + "output.LayerNorm.bias", {E}));
    m.layers_.emplace_back(lo, SkipInit{});  // its weights are loaded next
    m.layers_.back().load_state_dict(sd);
    m.layers_.back().eval();
  }
  // Layers stored in int8 run in int8 as stored; any others are quantized to match.
  const bool any_int8 = std::any_of(m.layers_.begin(), m.layers_.end(),
                                    [](const TransformerEncoderLayer& l) { return l.precision() == Precision::Int8; });
  for (auto& layer : m.layers_) {
    if (any_int8 && layer.precision() != Precision::Int8) layer.set_precision(Precision::Int8);
    layer.pack_f32();  // f32 layers: their weights stay as loaded
  }
  return m;
}

BertModel BertModel::load(const std::string& dir, std::optional<Precision> precision) {
  HEADS_CHECK(!dir.empty(), "BertModel::load: model_dir is empty; pass a model directory");
  BertModel m = load(dir);
  // A model stored in int8 is already int8 (set_precision would quantize its dequantized weights again).
  if (precision && *precision != m.precision()) m.set_precision(*precision);
  return m;
}

void BertModel::set_precision(Precision p) {
  if (cfg_.modern()) {
    set_prenorm_precision(p, p == Precision::Int8 ? input_ranges() : std::vector<InputRanges>{});
    return;
  }
  set_layers_precision(layers_, p, p == Precision::Int8 ? input_ranges() : std::vector<InputRanges>{});
  for (auto& layer : layers_) layer.pack_f32();
}

std::vector<InputRanges> BertModel::input_ranges() const {
  constexpr uint64_t kSeed = 0x5eed;
  constexpr int64_t kBatch = 4;  // sequences per forward (the tapes of a few keep memory low)
  std::mt19937_64 gen(kSeed);
  const int64_t L = std::min(kCalibrationLength, cfg_.max_tokens());
  std::vector<InputRanges> ranges(cfg_.modern() ? prenorm_.size() : layers_.size());
  for (int64_t done = 0; done < kCalibrationSequences; done += kBatch) {
    std::vector<std::vector<int64_t>> ids(static_cast<size_t>(std::min(kBatch, kCalibrationSequences - done)),
                                          std::vector<int64_t>(static_cast<size_t>(L)));
    for (auto& s : ids) {
      for (auto& id : s) id = static_cast<int64_t>(gen() % static_cast<uint64_t>(cfg_.vocab_size));
    }
    Tensor pad;
    bool any_pad = false;
    Tensor x = embed(ids, nullptr, pad, any_pad);  // no padding: every sequence is L long
    if (cfg_.modern()) {
      (void)run_prenorm_layers(std::move(x), pad, false, nullptr, &ranges);
      continue;
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      EncoderLayerTape tape;
      EncoderForwardArgs a = layer_args();
      a.tape = &tape;
      x = layers_[i].forward(x, a);
      layers_[i].record_input_ranges(tape, ranges[i]);
    }
  }
  return ranges;
}

EncoderForwardArgs BertModel::layer_args() const {
  EncoderForwardArgs a;
  a.relative_attention_bias = relative_bias_;  // MPNet's (else undefined)
  return a;
}

Precision BertModel::precision() const {
  if (cfg_.modern()) return prenorm_precision_;
  return layers_.empty() ? Precision::F32 : layers_.front().precision();
}

Tensor BertModel::embed(const std::vector<std::vector<int64_t>>& ids, const std::vector<std::vector<int64_t>>* type_ids,
                        Tensor& pad, bool& any_pad) const {
  const auto N = static_cast<int64_t>(ids.size());
  int64_t L = 0;
  for (const auto& s : ids) L = std::max<int64_t>(L, static_cast<int64_t>(s.size()));
  if (type_ids) {
    HEADS_CHECK(type_ids->size() == ids.size(), "BertModel: ", type_ids->size(), " sequences of type ids for ",
                ids.size(), " sequences of token ids");
    for (size_t n = 0; n < ids.size(); ++n) {
      HEADS_CHECK((*type_ids)[n].size() == ids[n].size(), "BertModel: sequence ", n, " has ", ids[n].size(),
                  " token ids and ", (*type_ids)[n].size(), " type ids");
      for (int64_t t : (*type_ids)[n]) {
        HEADS_CHECK(t >= 0 && t < cfg_.type_vocab_size, "BertModel: token type id ", t, " in sequence ", n,
                    " outside the ", cfg_.type_vocab_size, " types of the model (type_vocab_size)");
      }
    }
  }
  HEADS_CHECK(L <= cfg_.max_tokens(), "BertModel: sequence of ", L, " tokens exceeds the ", cfg_.max_tokens(),
              " positions of the model (max_position_embeddings ", cfg_.max_position_embeddings,
              cfg_.position_offset > 0 ? ", counted from pad_token_id + 1" : "", ")");
  const int64_t E = cfg_.hidden_size;
  // 1. embeddings: word[id] + position[offset + l] + token_type[type], LayerNorm
  Tensor x = Tensor::empty({N, L, E}, DType::F32);
  pad = Tensor::zeros({N, L}, DType::Bool);
  any_pad = false;
  const float* wd = word_.data<float>();
  const float* ps = position_.defined() ? position_.data<float>() + cfg_.position_offset * E : nullptr;
  const float* tt = token_type_.defined() ? token_type_.data<float>() : nullptr;
  for (int64_t n = 0; n < N; ++n) {
    const auto len = static_cast<int64_t>(ids[static_cast<size_t>(n)].size());
    for (int64_t l = 0; l < L; ++l) {
      const int64_t id = l < len ? ids[static_cast<size_t>(n)][static_cast<size_t>(l)] : 0;
      HEADS_CHECK(id >= 0 && id < cfg_.vocab_size, "BertModel: token id ", id, " outside the vocabulary of ",
                  cfg_.vocab_size);
      const int64_t type = type_ids && l < len ? (*type_ids)[static_cast<size_t>(n)][static_cast<size_t>(l)] : 0;
      float* row = x.data<float>() + (n * L + l) * E;
      if (ps == nullptr) {  // ModernBERT: word embeddings only (rotary positions, no token types)
        std::copy_n(wd + id * E, E, row);
      } else {
        for (int64_t e = 0; e < E; ++e) row[e] = wd[id * E + e] + tt[type * E + e] + ps[l * E + e];
      }
      if (l >= len) {
        static_cast<uint8_t*>(pad.raw_data())[n * L + l] = 1;
        any_pad = true;
      }
    }
  }
  return layer_norm(x, emb_ln_w_, emb_ln_b_, cfg_.layer_norm_eps);
}

Tensor BertModel::forward(const std::vector<std::vector<int64_t>>& ids,
                          std::vector<Tensor>* attn_weights) const {
  Tensor pad;
  bool any_pad = false;
  Tensor x = embed(ids, nullptr, pad, any_pad);
  return run_layers(std::move(x), pad, any_pad, attn_weights);
}

Tensor BertModel::forward(const std::vector<std::vector<int64_t>>& ids,
                          const std::vector<std::vector<int64_t>>& type_ids, std::vector<Tensor>* attn_weights) const {
  Tensor pad;
  bool any_pad = false;
  Tensor x = embed(ids, &type_ids, pad, any_pad);
  return run_layers(std::move(x), pad, any_pad, attn_weights);
}

Tensor BertModel::run_layers(Tensor x, const Tensor& pad, bool any_pad, std::vector<Tensor>* attn_weights) const {
  // 2. layers; padded positions are masked out as keys only
  if (cfg_.modern()) return run_prenorm_layers(std::move(x), pad, any_pad, attn_weights, nullptr);
  if (attn_weights) attn_weights->clear();
  for (const auto& layer : layers_) {
    EncoderForwardArgs a = layer_args();
    if (any_pad) a.src_key_padding_mask = pad;
    Tensor w;
    if (attn_weights) a.attn_weights = &w;
    x = layer.forward(x, a);
    if (attn_weights) attn_weights->push_back(w);
  }
  return x;
}

}  // namespace heads
