// causal_lm.cc — decoder-only models from transformers checkpoints (include/heads/causal_lm.h).
//
// Every architecture is read into one layer shape: norm1 -> fused QKV projection -> RoPE (in place,
// on the projection's output) -> KV cache -> fused SDPA (causal bottom-right, window, softcap,
// ALiBi, GQA) -> output projection [-> post-attention norm] -> residual -> norm2 -> MLP
// [-> post-MLP norm] -> residual. The readers of each model_type's config and weights are
// causal_lm_load.cc.
#include "heads/causal_lm.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "heads/mha.h"
#include "heads/ops.h"
#include "heads/safetensors.h"
#include "heads/sdpa.h"
#include "modules/attention_block.h"
#include "modules/common.h"

namespace heads {

KVCache CausalLM::new_cache(int64_t batch, DType dtype, int64_t capacity) const {
  return KVCache(cfg_.num_layers, batch, cfg_.num_kv_heads, cfg_.head_dim, dtype, capacity);
}

Tensor CausalLM::norm(const Tensor& x, const Tensor& w, const Tensor& b) const {
  switch (norm_) {
    case Norm::LayerNorm: return layer_norm(x, w, b, cfg_.norm_eps);
    case Norm::Rms: return rms_norm(x, w, cfg_.norm_eps);
    case Norm::RmsUnitOffset: return rms_norm(x, w, cfg_.norm_eps, true);
  }
  return x;
}

void CausalLM::set_precision(Precision p, double activation_error) {
  HEADS_CHECK(activation_error == 0 || p == Precision::Int8, "CausalLM::set_precision: activation_error (",
              activation_error, ") is for int8 weights, not ", precision_name(p));
  HEADS_CHECK(activation_error >= 0, "CausalLM::set_precision: activation_error must be at least 0 (+inf: one int8 ",
              "term per activation row), got ", activation_error);
  if (p != Precision::Int8) return pack(p, {}, 0);
  pack(p, input_ranges(), activation_error);
}

void CausalLM::pack(Precision p, const std::vector<InputRanges>& ranges, double activation_error) {
  const auto one = [&](const Tensor& w, const InputRanges* r, const char* name) {
    if (p == Precision::Int8) {
      const auto it = r->find(name);
      HEADS_CHECK(it != r->end(), "CausalLM::set_precision: calibration recorded no input of \"", name, "\"");
      return PackedLinear(w, p, activation_error, it->second);
    }
    if (p != Precision::F32) return PackedLinear(w, p);
    // f32: the loaded weight itself, read through the GEMM's own layout (a decode step's single row
    // had oneDNN lay the whole weight out again at every call: 3.4x the time of a 768 x 3072 layer)
    return w.dtype() == DType::F32 && w.is_contiguous() ? PackedLinear::f32_shared(w) : PackedLinear();
  };
  HEADS_CHECK(p != Precision::Int8 || ranges.size() == layers_.size() + 1, "CausalLM::set_precision: ",
              ranges.size(), " input ranges for ", layers_.size(), " layers and the head");
  // Every weight first, then the model changes: a failure (out of memory) leaves it as it was.
  std::vector<PackedLinear> packed;
  packed.reserve(4 * layers_.size() + 1);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    const InputRanges* r = ranges.empty() ? nullptr : &ranges[i];
    packed.push_back(one(l.wqkv, r, "qkv"));
    packed.push_back(one(l.wo, r, "o"));
    packed.push_back(one(l.w_in, r, "in"));
    packed.push_back(one(l.w_out, r, "out"));
  }
  packed.push_back(one(lm_head_, ranges.empty() ? nullptr : &ranges.back(), "head"));
  for (size_t i = 0; i < layers_.size(); ++i) {
    Layer& l = layers_[i];
    l.pk_qkv = std::move(packed[4 * i]);
    l.pk_o = std::move(packed[4 * i + 1]);
    l.pk_in = std::move(packed[4 * i + 2]);
    l.pk_out = std::move(packed[4 * i + 3]);
  }
  pk_head_ = std::move(packed.back());
  precision_ = p;
}

std::vector<InputRanges> CausalLM::input_ranges() const {
  HEADS_CHECK(!layers_.empty(), "CausalLM::input_ranges: no model loaded");
  constexpr uint64_t kSeed = 0x5eed;
  std::mt19937_64 gen(kSeed);
  const int64_t L = pos_ == Pos::Learned ? std::min(kCalibrationLength, cfg_.max_positions) : kCalibrationLength;
  std::vector<InputRanges> ranges(layers_.size() + 1);
  std::vector<int64_t> ids(static_cast<size_t>(L));
  for (int64_t s = 0; s < kCalibrationSequences; ++s) {  // one at a time: one sequence's KV cache
    for (auto& id : ids) id = static_cast<int64_t>(gen() % static_cast<uint64_t>(cfg_.vocab_size));
    try {
      (void)run(Tensor::from_vector(ids, {1, L}), nullptr, false, &ranges);
    } catch (const Error& e) {
      HEADS_CHECK(false, "CausalLM: int8 calibration (random token ids through the f32 weights), sequence ", s,
                  ": ", e.what());
    }
  }
  return ranges;
}

Tensor CausalLM::proj(const Tensor& x, const Tensor& w, const PackedLinear& pk, const Tensor& b, InputRanges* ranges,
                      const char* name) const {
  if (ranges) {  // calibration: the input's ranges, through the f32 weights as loaded (not the shared f32
    // packs, whose GEMM layout, once made, would hold the weights twice for as long as they live)
    modules::record_absmax(*ranges, name, x);
    return linear(x, w, b);
  }
  return pk.defined() ? linear(x, pk, b) : linear(x, w, b);
}

Tensor CausalLM::mlp(const Layer& l, const Tensor& h, InputRanges* ranges) const {
  const Tensor up = proj(h, l.w_in, l.pk_in, l.b_in, ranges, "in");
  const Tensor a = mlp_ == Mlp::GeluTanh ? activation(up, Activation::GeluTanh)
                                         : gated_activation(up, mlp_ == Mlp::GatedSilu ? GatedAct::Silu : GatedAct::GeluTanh);
  return proj(a, l.w_out, l.pk_out, l.b_out, ranges, "out");
}

namespace {

// cap · tanh(x / cap), in place.
void softcap_(Tensor& x, double cap) {
  float* p = x.data<float>();
  const float c = static_cast<float>(cap);
#pragma omp parallel for schedule(static) if (x.numel() > 65536)
  for (int64_t i = 0; i < x.numel(); ++i) p[i] = c * std::tanh(p[i] / c);
}

}  // namespace

Tensor CausalLM::forward(const Tensor& ids, KVCache* cache, bool last_only) const {
  return run(ids, cache, last_only, nullptr);
}

Tensor CausalLM::run(const Tensor& ids, KVCache* cache, bool last_only, std::vector<InputRanges>* ranges) const {
  const char* op = "CausalLM::forward";
  HEADS_CHECK(!layers_.empty(), op, ": no model loaded");
  HEADS_CHECK(ids.defined() && ids.dim() == 2 && ids.dtype() == DType::I64 && ids.size(1) >= 1, op,
              ": ids: expected i64 [B, L] with L >= 1, got ",
              ids.defined() ? std::string(dtype_name(ids.dtype())) + " " + shape_str(ids.shape()) : std::string("none"));
  const int64_t B = ids.size(0), L = ids.size(1);
  const CausalLMConfig& c = cfg_;
  KVCache local;
  std::unique_lock<std::mutex> held;  // a caller's cache: one call at a time
  if (cache == nullptr) {
    local = new_cache(B, DType::F32, L);
    cache = &local;
  } else {
    held = cache->hold();
  }
  HEADS_CHECK(cache->num_layers() == c.num_layers && cache->batch() == B && cache->kv_heads() == c.num_kv_heads &&
                  cache->head_dim() == c.head_dim,
              op, ": cache: expected ", c.num_layers, " layers, batch ", B, ", ", c.num_kv_heads, " kv heads of dim ",
              c.head_dim, "; got ", cache->num_layers(), ", ", cache->batch(), ", ", cache->kv_heads(), ", ",
              cache->head_dim());
  const int64_t past = cache->length();
  for (int64_t i = 1; i < c.num_layers; ++i) {
    HEADS_CHECK(cache->length(i) == past, op, ": cache: layer ", i, " holds ", cache->length(i),
                " positions but layer 0 holds ", past, " (a step that did not reach every layer; truncate it)");
  }
  HEADS_CHECK(pos_ != Pos::Learned || past + L <= c.max_positions, op, ": positions ", past, " + ", L,
              " exceed the model's ", c.max_positions, " learned positions");
  // A step that fails part-way (out of memory, a bad id found late) leaves the cache as it was.
  struct Rollback {
    KVCache* cache;
    int64_t length;
    bool done = false;
    ~Rollback() {
      if (!done) cache->truncate(length);
    }
  } rollback{cache, past};
  const Tensor idc = ids.contiguous();
  for (int64_t i = 0; i < idc.numel(); ++i) {
    const int64_t id = idc.data<int64_t>()[i];
    HEADS_CHECK(id >= 0 && id < c.vocab_size, op, ": ids: token id ", id, " outside the vocabulary [0, ",
                c.vocab_size, ")");
  }
  // 1. embeddings
  const int64_t E = c.hidden_size, H = c.num_heads, Hk = c.num_kv_heads, hd = c.head_dim;
  Tensor x = embedding(embed_, idc);
  if (embed_scale_ != 1.0f || positions_.defined()) {
    float* xp = x.data<float>();
    const float* pp = positions_.defined() ? positions_.data<float>() : nullptr;
    for (int64_t r = 0; r < B * L; ++r) {
      for (int64_t e = 0; e < E; ++e) {
        float v = xp[r * E + e] * embed_scale_;
        if (pp != nullptr) v += pp[(past + r % L) * E + e];
        xp[r * E + e] = v;
      }
    }
  }
  if (embed_norm_w_.defined()) x = layer_norm(x, embed_norm_w_, embed_norm_b_, c.norm_eps);
  // 2. layers
  Tensor attn = Tensor::empty({B, L, H * hd}, DType::F32);  // SDPA writes it through `out`
  const Tensor out = modules::split_heads(attn, H);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    InputRanges* r = ranges ? &(*ranges)[i] : nullptr;
    const Tensor h = norm(x, l.norm1_w, l.norm1_b);
    const Tensor qkv = proj(h, l.wqkv, l.pk_qkv, l.bqkv, r, "qkv");  // [B, L, W]
    const auto [q, k, v] = modules::fused_qkv_views(qkv, H, Hk, hd);
    if (pos_ == Pos::Rope) {
      rope_(q, past, c.rope);
      rope_(k, past, c.rope);
    }
    const auto [K, V] = cache->append(static_cast<int64_t>(i), k, v);
    SdpaOptions o;
    o.is_causal = true;
    o.causal_align = CausalAlign::BottomRight;
    o.scale = c.scale;
    o.enable_gqa = H != Hk;
    o.window_left = c.window_left[i];
    o.softcap = c.attn_softcap;
    if (pos_ == Pos::Alibi) o.alibi_slopes = alibi_;
    if (K.dtype() == DType::F32) {
      sdpa_out(out, q, K, V, o);
    } else if (K.dtype() == DType::I8) {  // read in place by the decode kernel, f32 queries and output
      o.k_scale = cache->key_scales(static_cast<int64_t>(i));
      o.v_scale = cache->value_scales(static_cast<int64_t>(i));
      sdpa_out(out, q, K, V, o);
    } else {
      Tensor(out).copy_from(sdpa(q.to(K.dtype()), K, V, o).out);
    }
    Tensor a = proj(attn, l.wo, l.pk_o, l.bo, r, "o");
    if (l.post_attn_w.defined()) a = norm(a, l.post_attn_w, Tensor());
    x = add(residual_from_norm_ ? h : x, a);
    const Tensor h2 = norm(x, l.norm2_w, l.norm2_b);
    Tensor f = mlp(l, h2, r);
    if (l.post_ffn_w.defined()) f = norm(f, l.post_ffn_w, Tensor());
    x = add(residual_from_norm_ ? h2 : x, f);
  }
  // 3. final norm and the head
  if (ranges) {  // calibration: the head's input is all it needs (every row; no logits)
    modules::record_absmax(ranges->back(), "head", norm(x, final_w_, final_b_));
    rollback.done = true;
    return Tensor();
  }
  if (last_only) x = x.slice(1, L - 1, L);
  x = norm(x, final_w_, final_b_);
  Tensor logits = proj(x, lm_head_, pk_head_, Tensor(), nullptr, "head");
  if (c.final_softcap > 0) softcap_(logits, c.final_softcap);
  rollback.done = true;
  return logits;
}

std::vector<int64_t> CausalLM::generate(const std::vector<int64_t>& prompt, int64_t max_new_tokens,
                                        int64_t eos_token_id, DType cache_dtype,
                                        const std::function<void(int64_t)>& on_token) const {
  HEADS_CHECK(!prompt.empty(), "CausalLM::generate: the prompt is empty");
  HEADS_CHECK(max_new_tokens >= 0, "CausalLM::generate: max_new_tokens must be >= 0, got ", max_new_tokens);
  // Room for the prompt and the first 512 new tokens; past that the cache grows by doubling, so a
  // generous max_new_tokens that ends early at eos reserves nothing it does not use.
  KVCache cache = new_cache(1, cache_dtype, static_cast<int64_t>(prompt.size()) + std::min<int64_t>(max_new_tokens, 512));
  std::vector<int64_t> out;
  Tensor ids = Tensor::from_vector(prompt, {1, static_cast<int64_t>(prompt.size())});
  for (int64_t n = 0; n < max_new_tokens; ++n) {
    const Tensor logits = forward(ids, &cache, true);  // [1, 1, vocab]
    const float* p = logits.data<float>();
    int64_t best = 0;
    for (int64_t v = 1; v < cfg_.vocab_size; ++v) {
      if (p[v] > p[best]) best = v;  // the first of equal maxima, as torch.argmax
    }
    out.push_back(best);
    if (on_token) on_token(best);
    if (best == eos_token_id) break;
    ids = Tensor::from_vector(std::vector<int64_t>{best}, {1, 1});
  }
  return out;
}

}  // namespace heads
