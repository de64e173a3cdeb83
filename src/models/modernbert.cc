// modernbert.cc — ModernBERT (transformers' ModernBertModel) in the BERT encoder (include/heads/bert.h).
//
// config.json (model_type "modernbert"): hidden_size, num_attention_heads, num_hidden_layers,
// intermediate_size, vocab_size, max_position_embeddings, norm_eps, norm_bias, attention_bias,
// mlp_bias, hidden_activation, local_attention (the full width of a local window: a query sees keys
// within local_attention / 2 on either side), layer_types or global_attn_every_n_layers (layer i
// global when i % n == 0), and rope_parameters per layer type (transformers 5) or global_rope_theta
// / local_rope_theta (4.x).
//
// Weights (optionally under "model.", as ModernBertForMaskedLM / ForSequenceClassification store
// them): embeddings.tok_embeddings.weight, embeddings.norm.{weight,bias}; per layer i under
// layers.<i>.: attn_norm (none in layer 0), attn.Wqkv (q, k, v stacked by rows), attn.Wo, mlp_norm,
// mlp.Wi (the activated half, then the gate), mlp.Wo; final_norm. Biases only where the config has
// them.
//
// A layer: x += Wo · attention(rope(q), rope(k), v) of attn_norm(x) (masked to the window on local
// layers, padding keys ignored); x += Wo · (act(a) · g) with [a | g] = Wi · mlp_norm(x). The output
// is final_norm(x).
#include <algorithm>
#include <filesystem>

#include "checkpoint.h"
#include "config_json.h"
#include "heads/bert.h"
#include "heads/sdpa.h"
#include "modules/attention_block.h"
#include "modules/common.h"

namespace heads {

namespace fs = std::filesystem;
using models::json_bool;
using models::json_int;
using models::json_real;
using models::json_string;

namespace {

constexpr int64_t kMaxCount = int64_t{1} << 24;

// The gated feed-forward's activation by hidden_activation's name (transformers' ACT2FN).
GatedAct gated_act(const std::string& name, const fs::path& file) {
  if (name == "gelu") return GatedAct::Gelu;
  if (name == "gelu_pytorch_tanh" || name == "gelu_new") return GatedAct::GeluTanh;
  if (name == "silu" || name == "swish") return GatedAct::Silu;
  fail(file.string(), ": hidden_activation \"", name,
       "\" is not supported (gelu, gelu_pytorch_tanh, gelu_new, silu, swish)");
}

// Which layers are global: layer_types when given, else every global_attn_every_n_layers-th from 0.
std::vector<bool> global_layers(const nlohmann::json& j, int64_t layers, const fs::path& file) {
  std::vector<bool> global(static_cast<size_t>(layers));
  if (j.contains("layer_types")) {
    const nlohmann::json& lt = j.at("layer_types");
    HEADS_CHECK(lt.is_array() && static_cast<int64_t>(lt.size()) == layers, file.string(),
                ": \"layer_types\" must list one type per layer (", layers, "), got ", lt.dump());
    for (size_t i = 0; i < lt.size(); ++i) {
      HEADS_CHECK(lt[i] == "full_attention" || lt[i] == "sliding_attention", file.string(), ": layer_types[", i, "] ",
                  lt[i].dump(), " is not supported (full_attention, sliding_attention)");
      global[i] = lt[i] == "full_attention";
    }
    return global;
  }
  const int64_t every = json_int(j, "global_attn_every_n_layers", 3, file, 1, kMaxCount);
  for (int64_t i = 0; i < layers; ++i) global[static_cast<size_t>(i)] = i % every == 0;
  return global;
}

// The rotary settings of global ("full_attention") or local ("sliding_attention") layers:
// rope_parameters[type] (transformers 5), else global_rope_theta / local_rope_theta with rope_scaling.
RopeOptions layer_rope(const nlohmann::json& j, bool global, const fs::path& file) {
  const char* type = global ? "full_attention" : "sliding_attention";
  nlohmann::json part = nlohmann::json::object();
  if (j.contains("rope_parameters")) {
    const nlohmann::json& rp = j.at("rope_parameters");
    HEADS_CHECK(rp.is_object(), file.string(), ": \"rope_parameters\" must be an object, got ", rp.dump());
    HEADS_CHECK(rp.contains(type), file.string(), ": \"rope_parameters\" has no \"", type, "\" entry");
    part["rope_parameters"] = rp.at(type);
  } else {
    part["rope_theta"] =
        json_real(j, global ? "global_rope_theta" : "local_rope_theta", global ? 160000.0 : 10000.0, file, 1e-6, 1e30);
    if (j.contains("rope_scaling")) part["rope_scaling"] = j.at("rope_scaling");
  }
  return models::read_rope(part, file);
}

}  // namespace

BertModel BertModel::load_modernbert(const std::string& dir) {
  const fs::path d(dir);
  const fs::path cp = d / "config.json";
  const nlohmann::json j = models::without_nulls(models::read_json(cp, true));
  BertModel m;
  BertConfig& c = m.cfg_;
  c.model_type = "modernbert";
  c.hidden_size = json_int(j, "hidden_size", 768, cp, 1, kMaxWidth);
  c.num_heads = json_int(j, "num_attention_heads", 12, cp, 1, kMaxWidth);
  c.num_layers = json_int(j, "num_hidden_layers", 22, cp, 1, kMaxCount);
  c.intermediate_size = json_int(j, "intermediate_size", 1152, cp, 1, kMaxWidth);
  c.vocab_size = json_int(j, "vocab_size", 50368, cp, 1, kMaxCount);
  c.max_position_embeddings = json_int(j, "max_position_embeddings", 8192, cp, 1, kMaxCount);
  c.layer_norm_eps = json_real(j, "norm_eps", 1e-5, cp, 0.0, 1.0);
  c.type_vocab_size = 1;  // no token types
  const GatedAct act = gated_act(json_string(j, "hidden_activation", "gelu", cp), cp);
  c.hidden_act = act == GatedAct::Gelu ? Activation::Gelu : Activation::GeluTanh;  // advisory (silu has none)
  HEADS_CHECK(c.hidden_size % c.num_heads == 0, cp.string(), ": hidden_size ", c.hidden_size,
              " is not divisible by num_attention_heads ", c.num_heads);
  const int64_t E = c.hidden_size, F = c.intermediate_size, hd = E / c.num_heads;
  HEADS_CHECK(hd % 2 == 0, cp.string(), ": the head dimension hidden_size / num_attention_heads = ", hd,
              " is odd; rotary positions need an even one");
  const bool norm_bias = json_bool(j, "norm_bias", false, cp);
  const bool attn_bias = json_bool(j, "attention_bias", false, cp);
  const bool mlp_bias = json_bool(j, "mlp_bias", false, cp);
  const int64_t local = json_int(j, "local_attention", 128, cp, 0, kMaxCount);
  const std::vector<bool> global = global_layers(j, c.num_layers, cp);
  const RopeOptions rope_global = layer_rope(j, true, cp), rope_local = layer_rope(j, false, cp);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const bool g = global[static_cast<size_t>(i)];
    c.layer_window.push_back(g ? -1 : local / 2);
    c.layer_rope.push_back(g ? rope_global : rope_local);
  }

  const models::Checkpoint w(d);
  const std::string p = w.has("embeddings.tok_embeddings.weight") || !w.has("model.embeddings.tok_embeddings.weight")
                            ? ""
                            : "model.";
  const auto get = [&](const std::string& name, const Shape& shape, bool want = true) {
    return w.get_if(p + name, shape, want);
  };
  m.word_ = get("embeddings.tok_embeddings.weight", {c.vocab_size, E});
  m.emb_ln_w_ = get("embeddings.norm.weight", {E});
  m.emb_ln_b_ = get("embeddings.norm.bias", {E}, norm_bias);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string l = "layers." + std::to_string(i) + ".";
    BertModel::PreNormLayer& L = m.prenorm_.emplace_back();
    L.attn_norm_w = get(l + "attn_norm.weight", {E}, i > 0);
    L.attn_norm_b = get(l + "attn_norm.bias", {E}, i > 0 && norm_bias);
    L.wqkv = get(l + "attn.Wqkv.weight", {3 * E, E});
    L.bqkv = get(l + "attn.Wqkv.bias", {3 * E}, attn_bias);
    L.wo = get(l + "attn.Wo.weight", {E, E});
    L.bo = get(l + "attn.Wo.bias", {E}, attn_bias);
    L.mlp_norm_w = get(l + "mlp_norm.weight", {E});
    L.mlp_norm_b = get(l + "mlp_norm.bias", {E}, norm_bias);
    L.wi = get(l + "mlp.Wi.weight", {2 * F, E});
    L.bi = get(l + "mlp.Wi.bias", {2 * F}, mlp_bias);
    L.wf = get(l + "mlp.Wo.weight", {E, F});
    L.bf = get(l + "mlp.Wo.bias", {E}, mlp_bias);
  }
  m.final_norm_w_ = get("final_norm.weight", {E});
  m.final_norm_b_ = get("final_norm.bias", {E}, norm_bias);
  m.prenorm_act_ = act;
  m.set_prenorm_precision(Precision::F32, {});
  return m;
}

void BertModel::set_prenorm_precision(Precision p, const std::vector<InputRanges>& ranges) {
  // Calibrated int8 as the BERT layers have it (modules::PackedWeights::pack): outlier channels in f32,
  // one activation term, the weight-row residual only for the feed-forward output.
  const auto pack = [&](const Tensor& w, size_t layer, const char* name, double residual_error) {
    if (p == Precision::F32) {  // the weight as loaded, read through the GEMM's own layout (it stays as it is)
      return w.dtype() == DType::F32 && w.is_contiguous() ? PackedLinear::f32_shared(w) : PackedLinear();
    }
    if (p != Precision::Int8 || ranges.empty()) return PackedLinear(w, p);
    return PackedLinear(w, p, kInt8OutlierActivationError, ranges.at(layer).at(name), residual_error);
  };
  for (size_t i = 0; i < prenorm_.size(); ++i) {
    PreNormLayer& l = prenorm_[i];
    l.pk_qkv = pack(l.wqkv, i, "attn.Wqkv.weight", kInt8ModelWidthResidualError);
    l.pk_o = pack(l.wo, i, "attn.Wo.weight", kInt8ModelWidthResidualError);
    l.pk_i = pack(l.wi, i, "mlp.Wi.weight", kInt8ModelWidthResidualError);
    l.pk_f = pack(l.wf, i, "mlp.Wo.weight", kInt8ResidualError);
  }
  prenorm_precision_ = p;
}

Tensor BertModel::run_prenorm_layers(Tensor x, const Tensor& pad, bool any_pad, std::vector<Tensor>* attn_weights,
                                     std::vector<InputRanges>* ranges) const {
  const int64_t N = x.size(0), L = x.size(1), E = cfg_.hidden_size, H = cfg_.num_heads, hd = E / H;
  const float eps = static_cast<float>(cfg_.layer_norm_eps);
  const auto proj = [&](const Tensor& in, const Tensor& w, const PackedLinear& pk, const Tensor& b,
                        InputRanges* r, const char* name) {
    if (r != nullptr) modules::record_absmax(*r, name, in);
    return pk.defined() ? linear(in, pk, b) : linear(in, w, b);
  };
  // Padding keys are not seen: a bool mask [N, 1, 1, L], true = may attend.
  Tensor keep;
  if (any_pad) {
    keep = Tensor::empty({N, 1, 1, L}, DType::Bool);
    const auto* pd = static_cast<const uint8_t*>(pad.raw_data());
    auto* kp = static_cast<uint8_t*>(keep.raw_data());
    for (int64_t i = 0; i < N * L; ++i) kp[i] = pd[i] == 0;
  }
  if (attn_weights) attn_weights->clear();
  // A bf16 model keeps q, k, v and the attention output in bf16, as the BERT layers do: the QKV
  // projection rounds its f32 sums once, RoPE turns the bf16 rows (in f32, rounded once), attention
  // runs the bf16 kernel (AMX tiles where present) and the output projection reads bf16 as it is.
  const bool bf16 = prenorm_precision_ == Precision::BF16;
  Tensor attn = Tensor::empty({N, L, E}, bf16 ? DType::BF16 : DType::F32);  // SDPA writes it through `out`
  const Tensor out = modules::split_heads(attn, H);
  for (size_t i = 0; i < prenorm_.size(); ++i) {
    const PreNormLayer& l = prenorm_[i];
    InputRanges* r = ranges != nullptr ? &(*ranges)[i] : nullptr;
    const Tensor h = l.attn_norm_w.defined() ? layer_norm(x, l.attn_norm_w, l.attn_norm_b, eps) : x;
    const Tensor qkv = bf16 ? linear(h, l.pk_qkv, l.bqkv, DType::BF16)
                            : proj(h, l.wqkv, l.pk_qkv, l.bqkv, r, "attn.Wqkv.weight");  // [N, L, 3E]
    const auto [q, k, v] = modules::fused_qkv_views(qkv, H, H, hd);
    rope_(q, 0, cfg_.layer_rope[i]);
    rope_(k, 0, cfg_.layer_rope[i]);
    SdpaOptions o;
    o.attn_mask = keep;
    o.window_left = o.window_right = cfg_.layer_window[i];
    o.need_weights = attn_weights != nullptr;
    const SdpaResult s = sdpa_out(out, q, k, v, o);
    if (attn_weights) attn_weights->push_back(s.weights);
    x = add(x, proj(attn, l.wo, l.pk_o, l.bo, r, "attn.Wo.weight"));
    const Tensor h2 = layer_norm(x, l.mlp_norm_w, l.mlp_norm_b, eps);
    const Tensor a = gated_activation(proj(h2, l.wi, l.pk_i, l.bi, r, "mlp.Wi.weight"), prenorm_act_);
    x = add(x, proj(a, l.wf, l.pk_f, l.bf, r, "mlp.Wo.weight"));
  }
  return layer_norm(x, final_norm_w_, final_norm_b_, eps);
}

}  // namespace heads
