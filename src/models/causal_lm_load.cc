// causal_lm_load.cc — CausalLM::load: one reader per architecture, chosen by config.json's
// model_type. Each reads its config fields (checked, with transformers' defaults) and its weights
// under the names transformers saves into the one layer shape of causal_lm.cc.
#include "heads/causal_lm.h"

#include <cmath>
#include <filesystem>
#include <map>

#include "checkpoint.h"
#include "config_json.h"
#include "heads/mha.h"  // kMaxWidth
#include "heads/ops.h"
#include "heads/sdpa.h"

namespace heads {

namespace fs = std::filesystem;
using models::json_bool;
using models::json_int;
using models::json_real;
using models::json_string;
using models::Checkpoint;
using models::cat_rows;
using models::read_rope;
using models::without_nulls;

namespace {

constexpr int64_t kMaxLmCount = int64_t{1} << 24;

void reject_true(const nlohmann::json& j, const char* key, const fs::path& file) {
  HEADS_CHECK(!json_bool(j, key, false, file), file.string(), ": \"", key, "\": true is not supported");
}

}  // namespace

// The readers: private members of CausalLM through this friend.
struct CausalLMReader {
  using Layer = CausalLM::Layer;
  using Mlp = CausalLM::Mlp;
  using Norm = CausalLM::Norm;
  using Pos = CausalLM::Pos;

  // llama, mistral, qwen2, gemma2: RMSNorm, RoPE, gated MLP, GQA, sliding windows
  static void llama_like(CausalLM& m, const nlohmann::json& j, const fs::path& cp, const Checkpoint& w) {
    CausalLMConfig& c = m.cfg_;
    const std::string& t = c.model_type;
    c.hidden_size = json_int(j, "hidden_size", 0, cp, 1, kMaxWidth);
    c.num_layers = json_int(j, "num_hidden_layers", 0, cp, 1, kMaxLmCount);
    c.num_heads = json_int(j, "num_attention_heads", 0, cp, 1, kMaxWidth);
    c.num_kv_heads = json_int(j, "num_key_value_heads", c.num_heads, cp, 1, c.num_heads);
    HEADS_CHECK(c.num_heads % c.num_kv_heads == 0, cp.string(), ": num_attention_heads ", c.num_heads,
                " is not a multiple of num_key_value_heads ", c.num_kv_heads);
    HEADS_CHECK(j.contains("head_dim") || c.hidden_size % c.num_heads == 0, cp.string(), ": hidden_size ",
                c.hidden_size, " is not divisible by num_attention_heads ", c.num_heads);
    c.head_dim = json_int(j, "head_dim", c.hidden_size / c.num_heads, cp, 2, kMaxWidth);
    c.intermediate_size = json_int(j, "intermediate_size", 0, cp, 1, kMaxWidth);
    c.max_positions = json_int(j, "max_position_embeddings", 4096, cp, 1, kMaxLmCount);
    c.norm_eps = json_real(j, "rms_norm_eps", 1e-6, cp, 0, 1);
    c.tie_word_embeddings = json_bool(j, "tie_word_embeddings", t == "gemma2", cp);
    c.rope = read_rope(j, cp);
    c.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
    reject_true(j, "use_bidirectional_attention", cp);
    const int64_t tp = json_int(j, "pretraining_tp", 1, cp, 1, kMaxLmCount);
    (void)tp;  // a training-time split of the same product: no effect on the result
    const std::string act = json_string(j, t == "gemma2" ? "hidden_activation" : "hidden_act",
                                        t == "gemma2" ? "gelu_pytorch_tanh" : "silu", cp);
    if (act == "silu") {
      m.mlp_ = Mlp::GatedSilu;
    } else if (act == "gelu_pytorch_tanh" || act == "gelu_tanh" || act == "gelu_new") {
      m.mlp_ = Mlp::GatedGeluTanh;
    } else {
      fail(cp.string(), ": activation \"", act, "\" is not supported (silu, gelu_pytorch_tanh)");
    }
    m.norm_ = t == "gemma2" ? Norm::RmsUnitOffset : Norm::Rms;
    m.pos_ = Pos::Rope;
    if (t == "gemma2") {
      c.scale = 1.0 / std::sqrt(json_real(j, "query_pre_attn_scalar", static_cast<double>(c.head_dim), cp, 1e-9, 1e30));
      c.attn_softcap = json_real(j, "attn_logit_softcapping", 0.0, cp, 0.0, 1e30);
      c.final_softcap = json_real(j, "final_logit_softcapping", 0.0, cp, 0.0, 1e30);
      m.embed_scale_ = static_cast<float>(std::sqrt(static_cast<double>(c.hidden_size)));
    }
    // Sliding windows: layer_types when given, else mistral's window on every layer and gemma2's on
    // every other layer (from the first).
    const int64_t window = json_int(j, "sliding_window", 0, cp, 0, kMaxLmCount);
    c.window_left.assign(static_cast<size_t>(c.num_layers), -1);
    if (j.contains("layer_types")) {
      const auto& lt = j.at("layer_types");
      HEADS_CHECK(lt.is_array() && static_cast<int64_t>(lt.size()) == c.num_layers, cp.string(),
                  ": \"layer_types\" must list one type per layer (", c.num_layers, ")");
      for (int64_t i = 0; i < c.num_layers; ++i) {
        const nlohmann::json& e = lt[static_cast<size_t>(i)];
        HEADS_CHECK(e.is_string() && (e == "full_attention" || e == "sliding_attention"), cp.string(),
                    ": layer_types[", i, "] ", e.dump(), " is not supported (full_attention, sliding_attention)");
        if (e == "sliding_attention") {
          HEADS_CHECK(window > 0, cp.string(), ": layer ", i, " is sliding_attention but \"sliding_window\" is not set");
          c.window_left[static_cast<size_t>(i)] = window - 1;
        }
      }
    } else if (window > 0 && (t == "mistral" || t == "gemma2" ||
                              (t == "qwen2" && json_bool(j, "use_sliding_window", false, cp)))) {
      HEADS_CHECK(t != "qwen2", cp.string(), ": qwen2 use_sliding_window without \"layer_types\" is not supported");
      for (int64_t i = 0; i < c.num_layers; ++i) {
        if (t == "mistral" || i % 2 == 0) c.window_left[static_cast<size_t>(i)] = window - 1;
      }
    }
    const bool attn_bias = json_bool(j, "attention_bias", false, cp);
    const bool qkv_bias = attn_bias || t == "qwen2";
    const bool mlp_bias = json_bool(j, "mlp_bias", false, cp);
    const int64_t E = c.hidden_size, Hd = c.num_heads * c.head_dim, Kd = c.num_kv_heads * c.head_dim,
                  F = c.intermediate_size;
    m.embed_ = w.get("model.embed_tokens.weight", {c.vocab_size, E});
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      Layer l;
      l.norm1_w = w.get(p + "input_layernorm.weight", {E});
      l.wqkv = cat_rows({w.get(p + "self_attn.q_proj.weight", {Hd, E}), w.get(p + "self_attn.k_proj.weight", {Kd, E}),
                         w.get(p + "self_attn.v_proj.weight", {Kd, E})});
      if (qkv_bias) {
        l.bqkv = cat_rows({w.get(p + "self_attn.q_proj.bias", {Hd}), w.get(p + "self_attn.k_proj.bias", {Kd}),
                           w.get(p + "self_attn.v_proj.bias", {Kd})});
      }
      l.wo = w.get(p + "self_attn.o_proj.weight", {E, Hd});
      l.bo = w.get_if(p + "self_attn.o_proj.bias", {E}, attn_bias);
      if (t == "gemma2") {
        l.post_attn_w = w.get(p + "post_attention_layernorm.weight", {E});
        l.norm2_w = w.get(p + "pre_feedforward_layernorm.weight", {E});
        l.post_ffn_w = w.get(p + "post_feedforward_layernorm.weight", {E});
      } else {
        l.norm2_w = w.get(p + "post_attention_layernorm.weight", {E});
      }
      l.w_in = cat_rows({w.get(p + "mlp.gate_proj.weight", {F, E}), w.get(p + "mlp.up_proj.weight", {F, E})});
      if (mlp_bias) l.b_in = cat_rows({w.get(p + "mlp.gate_proj.bias", {F}), w.get(p + "mlp.up_proj.bias", {F})});
      l.w_out = w.get(p + "mlp.down_proj.weight", {E, F});
      l.b_out = w.get_if(p + "mlp.down_proj.bias", {E}, mlp_bias);
      m.layers_.push_back(std::move(l));
    }
    m.final_w_ = w.get("model.norm.weight", {E});
    m.lm_head_ = c.tie_word_embeddings ? m.embed_ : w.get("lm_head.weight", {c.vocab_size, E});
  }

  // gpt2: LayerNorm, learned positions, Conv1D weights ([in, out]), gelu_new MLP
  static void gpt2(CausalLM& m, const nlohmann::json& j, const fs::path& cp, const Checkpoint& w) {
    CausalLMConfig& c = m.cfg_;
    c.hidden_size = json_int(j, "n_embd", 768, cp, 1, kMaxWidth);
    c.num_layers = json_int(j, "n_layer", 12, cp, 1, kMaxLmCount);
    c.num_heads = c.num_kv_heads = json_int(j, "n_head", 12, cp, 1, kMaxWidth);
    HEADS_CHECK(c.hidden_size % c.num_heads == 0, cp.string(), ": n_embd ", c.hidden_size,
                " is not divisible by n_head ", c.num_heads);
    c.head_dim = c.hidden_size / c.num_heads;
    c.intermediate_size = json_int(j, "n_inner", 4 * c.hidden_size, cp, 1, kMaxWidth);
    c.max_positions = json_int(j, "n_positions", 1024, cp, 1, kMaxLmCount);
    c.norm_eps = json_real(j, "layer_norm_epsilon", 1e-5, cp, 0, 1);
    c.tie_word_embeddings = true;
    c.scale = json_bool(j, "scale_attn_weights", true, cp) ? 1.0 / std::sqrt(static_cast<double>(c.head_dim)) : 1.0;
    reject_true(j, "scale_attn_by_inverse_layer_idx", cp);
    reject_true(j, "add_cross_attention", cp);
    const std::string act = json_string(j, "activation_function", "gelu_new", cp);
    HEADS_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh", cp.string(), ": activation_function \"", act,
                "\" is not supported (gelu_new)");
    m.mlp_ = Mlp::GeluTanh;
    m.norm_ = Norm::LayerNorm;
    m.pos_ = Pos::Learned;
    c.window_left.assign(static_cast<size_t>(c.num_layers), -1);
    const int64_t E = c.hidden_size, F = c.intermediate_size;
    const std::string pre = w.has("transformer.wte.weight") ? "transformer." : "";
    // Conv1D stores [in, out]: transposed once to [out, in].
    const auto conv = [&](const std::string& n, int64_t in, int64_t out) {
      return w.get(n, {in, out}).transpose(0, 1).contiguous();
    };
    m.embed_ = w.get(pre + "wte.weight", {c.vocab_size, E});
    m.positions_ = w.get(pre + "wpe.weight", {c.max_positions, E});
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = pre + "h." + std::to_string(i) + ".";
      Layer l;
      l.norm1_w = w.get(p + "ln_1.weight", {E});
      l.norm1_b = w.get(p + "ln_1.bias", {E});
      l.wqkv = conv(p + "attn.c_attn.weight", E, 3 * E);
      l.bqkv = w.get(p + "attn.c_attn.bias", {3 * E});
      l.wo = conv(p + "attn.c_proj.weight", E, E);
      l.bo = w.get(p + "attn.c_proj.bias", {E});
      l.norm2_w = w.get(p + "ln_2.weight", {E});
      l.norm2_b = w.get(p + "ln_2.bias", {E});
      l.w_in = conv(p + "mlp.c_fc.weight", E, F);
      l.b_in = w.get(p + "mlp.c_fc.bias", {F});
      l.w_out = conv(p + "mlp.c_proj.weight", F, E);
      l.b_out = w.get(p + "mlp.c_proj.bias", {E});
      m.layers_.push_back(std::move(l));
    }
    m.final_w_ = w.get(pre + "ln_f.weight", {E});
    m.final_b_ = w.get(pre + "ln_f.bias", {E});
    m.lm_head_ = w.has("lm_head.weight") ? w.get("lm_head.weight", {c.vocab_size, E}) : m.embed_;
  }

  // bloom: LayerNorm after the embeddings, ALiBi, query_key_value rows per head
  static void bloom(CausalLM& m, const nlohmann::json& j, const fs::path& cp, const Checkpoint& w) {
    CausalLMConfig& c = m.cfg_;
    c.hidden_size = json_int(j, "hidden_size", json_int(j, "n_embed", 64, cp, 1, kMaxWidth), cp, 1, kMaxWidth);
    c.num_layers = json_int(j, "n_layer", 2, cp, 1, kMaxLmCount);
    c.num_heads = c.num_kv_heads = json_int(j, "n_head", 8, cp, 1, kMaxWidth);
    HEADS_CHECK(c.hidden_size % c.num_heads == 0, cp.string(), ": hidden_size ", c.hidden_size,
                " is not divisible by n_head ", c.num_heads);
    c.head_dim = c.hidden_size / c.num_heads;
    c.intermediate_size = 4 * c.hidden_size;
    c.max_positions = kMaxLmCount;
    c.norm_eps = json_real(j, "layer_norm_epsilon", 1e-5, cp, 0, 1);
    c.tie_word_embeddings = true;
    c.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
    c.window_left.assign(static_cast<size_t>(c.num_layers), -1);
    m.residual_from_norm_ = json_bool(j, "apply_residual_connection_post_layernorm", false, cp);
    m.mlp_ = Mlp::GeluTanh;
    m.norm_ = Norm::LayerNorm;
    m.pos_ = Pos::Alibi;
    m.alibi_ = alibi_slopes(c.num_heads);
    const int64_t E = c.hidden_size, F = c.intermediate_size, H = c.num_heads, hd = c.head_dim;
    const std::string pre = w.has("transformer.word_embeddings.weight") ? "transformer." : "";
    m.embed_ = w.get(pre + "word_embeddings.weight", {c.vocab_size, E});
    m.embed_norm_w_ = w.get(pre + "word_embeddings_layernorm.weight", {E});
    m.embed_norm_b_ = w.get(pre + "word_embeddings_layernorm.bias", {E});
    // query_key_value rows are [H][q, k, v][hd]: regrouped as all q rows, then k, then v.
    const auto regroup = [&](const Tensor& x) {
      Shape s = x.shape();
      Tensor out = Tensor::empty(s, DType::F32);
      const int64_t row = x.numel() / (3 * E);
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t part = 0; part < 3; ++part) {
          out.slice(0, (part * H + h) * hd, (part * H + h + 1) * hd)
              .copy_from(x.slice(0, (h * 3 + part) * hd, (h * 3 + part + 1) * hd));
        }
      }
      (void)row;
      return out;
    };
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = pre + "h." + std::to_string(i) + ".";
      Layer l;
      l.norm1_w = w.get(p + "input_layernorm.weight", {E});
      l.norm1_b = w.get(p + "input_layernorm.bias", {E});
      l.wqkv = regroup(w.get(p + "self_attention.query_key_value.weight", {3 * E, E}));
      l.bqkv = regroup(w.get(p + "self_attention.query_key_value.bias", {3 * E}));
      l.wo = w.get(p + "self_attention.dense.weight", {E, E});
      l.bo = w.get(p + "self_attention.dense.bias", {E});
      l.norm2_w = w.get(p + "post_attention_layernorm.weight", {E});
      l.norm2_b = w.get(p + "post_attention_layernorm.bias", {E});
      l.w_in = w.get(p + "mlp.dense_h_to_4h.weight", {F, E});
      l.b_in = w.get(p + "mlp.dense_h_to_4h.bias", {F});
      l.w_out = w.get(p + "mlp.dense_4h_to_h.weight", {E, F});
      l.b_out = w.get(p + "mlp.dense_4h_to_h.bias", {E});
      m.layers_.push_back(std::move(l));
    }
    m.final_w_ = w.get(pre + "ln_f.weight", {E});
    m.final_b_ = w.get(pre + "ln_f.bias", {E});
    m.lm_head_ = w.has("lm_head.weight") ? w.get("lm_head.weight", {c.vocab_size, E}) : m.embed_;
  }
};

CausalLM CausalLM::load(const std::string& dir) {
  using Reader = void (*)(CausalLM&, const nlohmann::json&, const fs::path&, const Checkpoint&);
  static const std::map<std::string, Reader> kReaders = {
      {"llama", &CausalLMReader::llama_like}, {"mistral", &CausalLMReader::llama_like},
      {"qwen2", &CausalLMReader::llama_like}, {"gemma2", &CausalLMReader::llama_like},
      {"gpt2", &CausalLMReader::gpt2},        {"bloom", &CausalLMReader::bloom}};
  const fs::path d(dir);
  HEADS_CHECK(fs::is_directory(d), dir, ": model directory not found");
  const fs::path cp = d / "config.json";
  const nlohmann::json j = without_nulls(models::read_json(cp, true));
  CausalLM m;
  m.cfg_.model_type = json_string(j, "model_type", "", cp);
  const auto reader = kReaders.find(m.cfg_.model_type);
  HEADS_CHECK(reader != kReaders.end(), cp.string(), ": model_type \"", m.cfg_.model_type,
              "\" is not supported (llama, mistral, qwen2, gemma2, gpt2, bloom)");
  const Checkpoint w(d);
  m.cfg_.vocab_size = json_int(j, "vocab_size", 0, cp, 1, kMaxLmCount);
  reader->second(m, j, cp, w);
  m.set_precision(Precision::F32);  // the f32 weights' GEMM layouts (made at first use)
  return m;
}

}  // namespace heads

namespace heads {

int64_t CausalLM::eos_token_id(const std::string& dir) {
  for (const char* name : {"generation_config.json", "config.json"}) {
    const std::filesystem::path p = std::filesystem::path(dir) / name;
    const nlohmann::json j = models::read_json(p, false);
    if (!j.contains("eos_token_id") || j.at("eos_token_id").is_null()) continue;
    const nlohmann::json& v = j.at("eos_token_id");
    const nlohmann::json& first = v.is_array() && !v.empty() ? v.at(0) : v;
    HEADS_CHECK(first.is_number_integer() && first.get<int64_t>() >= 0, p.string(),
                ": \"eos_token_id\" must be a token id or a list of them, got ", v.dump());
    return first.get<int64_t>();
  }
  return -1;
}

}  // namespace heads
