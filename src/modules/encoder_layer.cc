// encoder_layer.cc — TransformerEncoderLayer and TransformerEncoder, step by step as torch:
//   post-norm:  x = norm1(x + sa(x));  x = norm2(x + ff(x))
//   pre-norm:   x = x + sa(norm1(x));  x = x + ff(norm2(x))
//   sa(x) = dropout1(self_attn(x, x, x)),  ff(x) = dropout2(linear2(dropout(act(linear1(x)))))
#include "heads/encoder.h"

#include <cmath>
#include <random>

#include "heads/runtime.h"
#include "heads/safetensors.h"

namespace heads {

namespace {

constexpr const char* kOp = "TransformerEncoderLayer";

Tensor uniform(const Shape& shape, double bound, std::mt19937_64& gen) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::uniform_real_distribution<double> dist(-bound, bound);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(dist(gen));
  return t;
}

Tensor filled(const Shape& shape, float v) {
  Tensor t = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = v;
  return t;
}

// Entries of sd under `prefix`, with the prefix removed.
StateDict with_prefix_removed(const StateDict& sd, const std::string& prefix) {
  StateDict out;
  for (const auto& [n, t] : sd) {
    if (n.rfind(prefix, 0) == 0) out.emplace_back(n.substr(prefix.size()), t);
  }
  return out;
}

const Tensor* find(const StateDict& sd, const std::string& name) {
  for (const auto& [n, t] : sd) {
    if (n == name) return &t;
  }
  return nullptr;
}

}  // namespace

TransformerEncoderLayer::TransformerEncoderLayer(const TransformerEncoderLayerOptions& o,
                                                 std::optional<uint64_t> seed)
    : opt_(o),
      self_attn_([&] {
        HEADS_CHECK(o.d_model >= 1, kOp, ": d_model must be positive, got ", o.d_model);
        HEADS_CHECK(o.dim_feedforward >= 1, kOp, ": dim_feedforward must be positive, got ",
                    o.dim_feedforward);
        HEADS_CHECK(o.dropout >= 0.0 && o.dropout < 1.0, kOp, ": dropout must be in [0, 1), got ",
                    o.dropout);
        MultiheadAttentionOptions m;
        m.embed_dim = o.d_model;
        m.num_heads = o.nhead;
        m.dropout = o.dropout;
        m.bias = o.bias;
        m.batch_first = o.batch_first;
        return m;
      }(), seed) {
  std::mt19937_64 gen(seed ? *seed + 1 : next_seed());
  const int64_t E = o.d_model, F = o.dim_feedforward;
  const double b1 = 1.0 / std::sqrt(static_cast<double>(E)), b2 = 1.0 / std::sqrt(static_cast<double>(F));
  params_.emplace_back("linear1.weight", uniform({F, E}, b1, gen));
  if (o.bias) params_.emplace_back("linear1.bias", uniform({F}, b1, gen));
  params_.emplace_back("linear2.weight", uniform({E, F}, b2, gen));
  if (o.bias) params_.emplace_back("linear2.bias", uniform({E}, b2, gen));
  params_.emplace_back("norm1.weight", filled({E}, 1.0f));
  if (o.bias) params_.emplace_back("norm1.bias", filled({E}, 0.0f));
  params_.emplace_back("norm2.weight", filled({E}, 1.0f));
  if (o.bias) params_.emplace_back("norm2.bias", filled({E}, 0.0f));
}

const Tensor* TransformerEncoderLayer::param(const std::string& name) const {
  const Tensor* t = find(params_, name);
  return t;
}

void TransformerEncoderLayer::train(bool on) {
  training_ = on;
  self_attn_.train(on);
}

StateDict TransformerEncoderLayer::state_dict() const {
  StateDict sd;
  for (const auto& [n, t] : self_attn_.state_dict()) sd.emplace_back("self_attn." + n, t);
  for (const auto& [n, t] : params_) sd.emplace_back(n, t);
  return sd;
}

void TransformerEncoderLayer::load_state_dict(const StateDict& sd, bool strict) {
  // Check everything before copying anything.
  for (const auto& [n, t] : params_) {
    const Tensor* src = find(sd, n);
    HEADS_CHECK(src != nullptr || !strict, kOp, "::load_state_dict: tensor \"", n, "\" missing");
    if (src) {
      HEADS_CHECK(src->shape() == t.shape() && is_floating(src->dtype()), kOp,
                  "::load_state_dict: \"", n, "\": expected ", t.shape(), ", got ", src->shape(),
                  " ", dtype_name(src->dtype()));
    }
  }
  if (strict) {
    for (const auto& [n, t] : sd) {
      HEADS_CHECK(n.rfind("self_attn.", 0) == 0 || find(params_, n) != nullptr, kOp,
                  "::load_state_dict: unexpected tensor \"", n, "\"");
    }
  }
  // MultiheadAttention validates all of its tensors before it copies any.
  self_attn_.load_state_dict(with_prefix_removed(sd, "self_attn."), strict);
  for (auto& [n, t] : params_) {
    if (const Tensor* src = find(sd, n)) t.copy_from(*src);
  }
}

Tensor TransformerEncoderLayer::forward(const Tensor& src, const EncoderForwardArgs& a) const {
  HEADS_CHECK(src.defined() && (src.dim() == 2 || src.dim() == 3), kOp,
              ": src: expected [L, E], [L, N, E] or [N, L, E], got ", src.defined() ? src.shape() : Shape{});
  HEADS_CHECK(src.size(-1) == opt_.d_model, kOp, ": src: expected d_model ", opt_.d_model,
              " in the last dim, got ", src.shape());
  const double p = training_ ? opt_.dropout : 0.0;
  auto opt_param = [&](const std::string& n) {  // undefined when built with bias=False
    const Tensor* t = param(n);
    return t ? *t : Tensor();
  };
  const float eps = static_cast<float>(opt_.layer_norm_eps);
  auto norm = [&](const Tensor& x, int i) {
    const std::string w = "norm" + std::to_string(i) + ".weight", b = "norm" + std::to_string(i) + ".bias";
    return layer_norm(x, *param(w), opt_param(b), eps);
  };
  auto add_norm = [&](const Tensor& x, const Tensor& r, int i) {  // norm_i(x + r), one pass
    const std::string w = "norm" + std::to_string(i) + ".weight", b = "norm" + std::to_string(i) + ".bias";
    return add_layer_norm(x, r, *param(w), opt_param(b), eps);
  };
  auto sa = [&](const Tensor& x) {
    MhaForwardArgs m;
    m.attn_mask = a.src_mask;
    m.key_padding_mask = a.src_key_padding_mask;
    m.is_causal = a.is_causal;
    m.need_weights = a.attn_weights != nullptr;
    m.average_attn_weights = false;
    auto [out, w] = self_attn_.forward(x, x, x, m);
    if (a.attn_weights) *a.attn_weights = w;
    return dropout(out, p, p > 0 ? next_seed() : 0);
  };
  auto ff = [&](const Tensor& x) {
    Tensor h = activation(linear(x, *param("linear1.weight"), opt_param("linear1.bias")), opt_.activation);
    h = dropout(h, p, p > 0 ? next_seed() : 0);
    return dropout(linear(h, *param("linear2.weight"), opt_param("linear2.bias")), p, p > 0 ? next_seed() : 0);
  };
  Tensor x = src.to(DType::F32);
  if (opt_.norm_first) {
    x = add(x, sa(norm(x, 1)));
    x = add(x, ff(norm(x, 2)));
  } else {
    x = add_norm(x, sa(x), 1);
    x = add_norm(x, ff(x), 2);
  }
  return x;
}

TransformerEncoder::TransformerEncoder(const TransformerEncoderLayerOptions& layer, int64_t num_layers,
                                       bool final_norm, std::optional<uint64_t> seed)
    : eps_(layer.layer_norm_eps) {
  HEADS_CHECK(num_layers >= 1, "TransformerEncoder: num_layers must be positive, got ", num_layers);
  const TransformerEncoderLayer first(layer, seed);
  for (int64_t i = 0; i < num_layers; ++i) {
    layers_.emplace_back(layer, 0);
    layers_.back().load_state_dict(first.state_dict());  // deep copies, as torch
  }
  if (final_norm) {
    norm_w_ = filled({layer.d_model}, 1.0f);
    if (layer.bias) norm_b_ = filled({layer.d_model}, 0.0f);
  }
}

void TransformerEncoder::train(bool on) {
  for (auto& l : layers_) l.train(on);
}

Tensor TransformerEncoder::forward(const Tensor& src, const Tensor& mask, const Tensor& kpm,
                                   bool is_causal, std::vector<Tensor>* attn_weights) const {
  Tensor x = src;
  if (attn_weights) attn_weights->clear();
  for (const auto& l : layers_) {
    EncoderForwardArgs a;
    a.src_mask = mask;
    a.src_key_padding_mask = kpm;
    a.is_causal = is_causal;
    Tensor w;
    if (attn_weights) a.attn_weights = &w;
    x = l.forward(x, a);
    if (attn_weights) attn_weights->push_back(w);
  }
  if (norm_w_.defined()) x = layer_norm(x, norm_w_, norm_b_, eps_);
  return x;
}

StateDict TransformerEncoder::state_dict() const {
  StateDict sd;
  for (size_t i = 0; i < layers_.size(); ++i) {
    for (const auto& [n, t] : layers_[i].state_dict()) sd.emplace_back("layers." + std::to_string(i) + "." + n, t);
  }
  if (norm_w_.defined()) sd.emplace_back("norm.weight", norm_w_);
  if (norm_b_.defined()) sd.emplace_back("norm.bias", norm_b_);
  return sd;
}

void TransformerEncoder::load_state_dict(const StateDict& sd, bool strict) {
  if (strict) {
    for (const auto& [n, t] : sd) {
      bool known = n == "norm.weight" ? norm_w_.defined() : n == "norm.bias" ? norm_b_.defined() : false;
      for (size_t i = 0; !known && i < layers_.size(); ++i) known = n.rfind("layers." + std::to_string(i) + ".", 0) == 0;
      HEADS_CHECK(known, "TransformerEncoder::load_state_dict: unexpected tensor \"", n, "\"");
    }
    HEADS_CHECK(!norm_w_.defined() || find(sd, "norm.weight"), "TransformerEncoder::load_state_dict: tensor \"norm.weight\" missing");
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    layers_[i].load_state_dict(with_prefix_removed(sd, "layers." + std::to_string(i) + "."), strict);
  }
  for (auto [name, t] : {std::pair{"norm.weight", &norm_w_}, {"norm.bias", &norm_b_}}) {
    if (const Tensor* src = find(sd, name); src && t->defined()) {
      HEADS_CHECK(src->shape() == t->shape(), "TransformerEncoder::load_state_dict: \"", name,
                  "\": expected ", t->shape(), ", got ", src->shape());
      t->copy_from(*src);
    }
  }
}

void TransformerEncoder::load(const std::string& path, bool strict) {
  load_state_dict(load_safetensors(path), strict);
}

void TransformerEncoder::save(const std::string& path) const {
  save_safetensors(path, state_dict(), {{"format", "pt"}});
}

}  // namespace heads
