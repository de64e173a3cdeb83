// t5.cc — the T5 encoder (include/heads/t5.h), weight names as transformers saves T5EncoderModel /
// T5Model: shared.weight (or encoder.embed_tokens.weight), encoder.block.<i>.layer.0.SelfAttention
// .{q,k,v,o}.weight (relative_attention_bias in block 0), .layer.0.layer_norm, .layer.1
// .DenseReluDense.{wi | wi_0, wi_1, wo}.weight, .layer.1.layer_norm, encoder.final_layer_norm.
#include "heads/t5.h"

#include <filesystem>

#include "checkpoint.h"
#include "config_json.h"
#include "heads/safetensors.h"
#include "heads/sdpa.h"
#include "modules/attention_block.h"

namespace heads {

namespace fs = std::filesystem;
using models::json_bool;
using models::json_int;
using models::json_real;
using models::json_string;

namespace {

constexpr int64_t kMax = int64_t{1} << 24;

}  // namespace

T5Encoder T5Encoder::load(const std::string& dir) {
  const fs::path d(dir), cp = d / "config.json";
  HEADS_CHECK(fs::is_directory(d), dir, ": model directory not found");
  const nlohmann::json j = models::without_nulls(models::read_json(cp, true));
  const std::string type = json_string(j, "model_type", "", cp);
  HEADS_CHECK(type == "t5", cp.string(), ": model_type \"", type, "\" is not supported (t5)");
  T5Encoder m;
  m.vocab_ = json_int(j, "vocab_size", 32128, cp, 1, kMax);
  m.d_model_ = json_int(j, "d_model", 512, cp, 1, kMax);
  m.d_kv_ = json_int(j, "d_kv", 64, cp, 1, kMax);
  m.heads_ = json_int(j, "num_heads", 8, cp, 1, kMax);
  m.d_ff_ = json_int(j, "d_ff", 2048, cp, 1, kMax);
  m.eps_ = json_real(j, "layer_norm_epsilon", 1e-6, cp, 0, 1);
  const int64_t layers = json_int(j, "num_layers", 6, cp, 1, kMax);
  const int64_t buckets = json_int(j, "relative_attention_num_buckets", 32, cp, 2, kMax);
  m.max_distance_ = json_int(j, "relative_attention_max_distance", 128, cp, 1, kMax);
  HEADS_CHECK(!json_bool(j, "is_decoder", false, cp), cp.string(), ": \"is_decoder\": true is not supported (an encoder)");
  const std::string ff = json_string(j, "feed_forward_proj", "relu", cp);
  if (ff == "relu") {
    m.gated_ = false;
  } else if (ff == "gated-gelu" || ff == "gated-gelu_new" || ff == "gated-silu") {
    m.gated_ = true;
    m.gated_act_ = ff == "gated-silu" ? GatedAct::Silu : GatedAct::GeluTanh;
  } else {
    fail(cp.string(), ": feed_forward_proj \"", ff, "\" is not supported (relu, gated-gelu, gated-silu)");
  }
  const models::Checkpoint w(d);
  const auto get = [&](const std::string& n, const Shape& s) { return w.get(n, s); };
  const auto& rows = models::cat_rows;
  const int64_t E = m.d_model_, I = m.heads_ * m.d_kv_, F = m.d_ff_;
  m.embed_ = get(w.has("shared.weight") ? "shared.weight" : "encoder.embed_tokens.weight", {m.vocab_, E});
  m.rel_bias_ = get("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", {buckets, m.heads_});
  for (int64_t i = 0; i < layers; ++i) {
    const std::string p = "encoder.block." + std::to_string(i) + ".layer.";
    Block b;
    b.ln1 = get(p + "0.layer_norm.weight", {E});
    const auto packed = [](const Tensor& t) { return PackedLinear::f32_shared(t.contiguous()); };
    b.wqkv = packed(rows({get(p + "0.SelfAttention.q.weight", {I, E}), get(p + "0.SelfAttention.k.weight", {I, E}),
                          get(p + "0.SelfAttention.v.weight", {I, E})}));
    b.wo = packed(get(p + "0.SelfAttention.o.weight", {E, I}));
    b.ln2 = get(p + "1.layer_norm.weight", {E});
    b.wi = packed(m.gated_ ? rows({get(p + "1.DenseReluDense.wi_0.weight", {F, E}),
                                   get(p + "1.DenseReluDense.wi_1.weight", {F, E})})
                           : get(p + "1.DenseReluDense.wi.weight", {F, E}));
    b.wo_ff = packed(get(p + "1.DenseReluDense.wo.weight", {E, F}));
    m.blocks_.push_back(std::move(b));
  }
  m.final_ln_ = get("encoder.final_layer_norm.weight", {E});
  return m;
}

Tensor T5Encoder::forward(const Tensor& ids, const Tensor& attention_mask) const {
  const char* op = "T5Encoder::forward";
  HEADS_CHECK(!blocks_.empty(), op, ": no model loaded");
  HEADS_CHECK(ids.defined() && ids.dim() == 2 && ids.dtype() == DType::I64, op, ": ids: expected i64 [B, L], got ",
              ids.defined() ? shape_str(ids.shape()) : std::string("none"));
  const int64_t B = ids.size(0), L = ids.size(1), H = heads_, dk = d_kv_, I = H * dk;
  HEADS_CHECK(!attention_mask.defined() || attention_mask.shape() == ids.shape(), op, ": attention_mask: expected ",
              ids.shape(), " like ids, got ", attention_mask.shape());
  const Tensor idc = ids.contiguous();
  for (int64_t i = 0; i < idc.numel(); ++i) {
    const int64_t id = idc.data<int64_t>()[i];
    HEADS_CHECK(id >= 0 && id < vocab_, op, ": ids: token id ", id, " outside the vocabulary [0, ", vocab_, ")");
  }
  Tensor x = embedding(embed_, idc);
  SdpaOptions o;
  o.scale = 1.0;  // T5 does not scale its scores
  o.relative_attention_bias = rel_bias_;
  o.relative_attention_max_distance = max_distance_;
  if (attention_mask.defined()) o.attn_mask = attention_mask.to(DType::Bool).reshape({B, 1, 1, L});
  Tensor attn = Tensor::empty({B, L, I}, DType::F32);  // SDPA writes it through `out`
  const Tensor out = modules::split_heads(attn, H);
  for (const Block& b : blocks_) {
    const Tensor h = rms_norm(x, b.ln1, eps_);
    const Tensor qkv = linear(h, b.wqkv);
    const auto [q, k, v] = modules::fused_qkv_views(qkv, H, H, dk);
    sdpa_out(out, q, k, v, o);
    x = add(x, linear(attn, b.wo));
    const Tensor h2 = rms_norm(x, b.ln2, eps_);
    const Tensor up = linear(h2, b.wi);
    const Tensor a = gated_ ? gated_activation(up, gated_act_) : activation(up, Activation::Relu);
    x = add(x, linear(a, b.wo_ff));
  }
  return rms_norm(x, final_ln_, eps_);
}

}  // namespace heads
