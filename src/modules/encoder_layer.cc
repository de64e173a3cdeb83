// encoder_layer.cc — TransformerEncoderLayer and TransformerEncoder, step by step as torch:
//   post-norm:  x = norm1(x + sa(x));  x = norm2(x + ff(x))
//   pre-norm:   x = x + sa(norm1(x));  x = x + ff(norm2(x))
//   sa(x) = dropout1(self_attn(x, x, x)),  ff(x) = dropout2(linear2(dropout(act(linear1(x)))))
#include "heads/encoder.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "heads/runtime.h"
#include "heads/safetensors.h"
#include "modules/common.h"

namespace heads {

using modules::filled;
using modules::find;
using modules::project;
using modules::uniform;

namespace {

constexpr const char* kEncoderOp = "TransformerEncoderLayer";
const std::vector<std::string> kLinearNames = {"linear1.weight", "linear2.weight"};  // packed in reduced precision

// Entries of sd under `prefix`, with the prefix removed.
StateDict with_prefix_removed(const StateDict& sd, const std::string& prefix) {
  StateDict out;
  for (const auto& [n, t] : sd) {
    if (n.rfind(prefix, 0) == 0) out.emplace_back(n.substr(prefix.size()), t);
  }
  return out;
}

std::string norm_name(int i, const char* what) { return "norm" + std::to_string(i) + "." + what; }

}  // namespace

TransformerEncoderLayer::TransformerEncoderLayer(const TransformerEncoderLayerOptions& o, SkipInit)
    : opt_(o),
      self_attn_([&] {
        HEADS_CHECK(o.d_model >= 1 && o.d_model <= kMaxWidth, kEncoderOp, ": d_model must be in [1, ", kMaxWidth,
                    "], got ", o.d_model);
        HEADS_CHECK(o.dim_feedforward >= 1 && o.dim_feedforward <= kMaxWidth, kEncoderOp,
                    ": dim_feedforward must be in [1, ", kMaxWidth, "], got ", o.dim_feedforward);
        HEADS_CHECK(o.dropout >= 0.0 && o.dropout <= 1.0, kEncoderOp, ": dropout must be in [0, 1], got ",
                    o.dropout);
        MultiheadAttentionOptions m;
        m.embed_dim = o.d_model;
        m.num_heads = o.nhead;
        // Linear attention has no weights to drop: the layer's dropout stays on its residual branches.
        m.dropout = o.attention.kind == AttentionKind::Linear ? 0.0 : o.dropout;
        m.bias = o.bias;
        m.batch_first = o.batch_first;
        m.variant = o.attention;
        return m;
      }(), SkipInit{}) {
  const int64_t E = o.d_model, F = o.dim_feedforward;
  params_.emplace_back("linear1.weight", Tensor::zeros({F, E}, DType::F32));
  if (o.bias) params_.emplace_back("linear1.bias", Tensor::zeros({F}, DType::F32));
  params_.emplace_back("linear2.weight", Tensor::zeros({E, F}, DType::F32));
  if (o.bias) params_.emplace_back("linear2.bias", Tensor::zeros({E}, DType::F32));
  params_.emplace_back("norm1.weight", filled({E}, 1.0f));
  if (o.bias) params_.emplace_back("norm1.bias", filled({E}, 0.0f));
  params_.emplace_back("norm2.weight", filled({E}, 1.0f));
  if (o.bias) params_.emplace_back("norm2.bias", filled({E}, 0.0f));
}

TransformerEncoderLayer::TransformerEncoderLayer(const TransformerEncoderLayerOptions& o, std::optional<uint64_t> seed)
    : TransformerEncoderLayer(o, SkipInit{}) {
  self_attn_ = MultiheadAttention(self_attn_.options(), seed);
  std::mt19937_64 gen(seed ? *seed + 1 : next_seed());
  const int64_t E = o.d_model, F = o.dim_feedforward;
  const double b1 = 1.0 / std::sqrt(static_cast<double>(E)), b2 = 1.0 / std::sqrt(static_cast<double>(F));
  // nn.Linear's kaiming_uniform_(a=sqrt(5)) and bias bound 1/sqrt(fan_in), drawn in registration order.
  for (auto& [n, t] : params_) {
    if (n == "linear1.weight" || n == "linear1.bias") t = uniform(t.shape(), b1, gen);
    if (n == "linear2.weight" || n == "linear2.bias") t = uniform(t.shape(), b2, gen);
  }
}

const Tensor* TransformerEncoderLayer::param(const std::string& name) const {
  const Tensor* t = find(params_, name);
  return t;
}

Tensor TransformerEncoderLayer::opt_param(const std::string& name) const {
  const Tensor* t = param(name);
  return t ? *t : Tensor();
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

void TransformerEncoderLayer::load_state_dict(const StateDict& stored, bool strict) {
  // int8 linear weights (with their scales) are used as stored and switch the whole layer to int8.
  const modules::LoadedWeights loaded = modules::read_int8_weights(stored, kLinearNames, kEncoderOp);
  const StateDict& sd = loaded.floating;
  bool any_int8 = !loaded.int8.empty();
  for (const auto& [n, t] : sd) any_int8 = any_int8 || (n.rfind("self_attn.", 0) == 0 && t.dtype() == DType::I8);
  const Precision target = any_int8 ? Precision::Int8 : precision();
  // Check everything before copying anything.
  for (const auto& [n, t] : params_) {
    const Tensor* src = find(sd, n);
    HEADS_CHECK(src != nullptr || !strict, kEncoderOp, "::load_state_dict: tensor \"", n, "\" missing");
    if (src) {
      HEADS_CHECK(src->shape() == t.shape() && is_floating(src->dtype()), kEncoderOp,
                  "::load_state_dict: \"", n, "\": expected ", t.shape(), ", got ", src->shape(),
                  " ", dtype_name(src->dtype()));
    }
  }
  if (strict) {
    for (const auto& [n, t] : sd) {
      HEADS_CHECK(n.rfind("self_attn.", 0) == 0 || find(params_, n) != nullptr, kEncoderOp,
                  "::load_state_dict: unexpected tensor \"", n, "\"");
    }
  }
  // The feed-forward weights packed before anything is copied (packing can fail); then
  // MultiheadAttention, which validates and packs all of its tensors before it copies any.
  auto packed = modules::PackedWeights::make(target, params_, sd, kLinearNames, loaded.int8, packed_.get());
  const Precision attn_before = self_attn_.precision();
  if (attn_before != target) self_attn_.set_precision(target);  // changes no value; undone on failure below
  try {
    self_attn_.load_state_dict(with_prefix_removed(sd, "self_attn."), strict);
  } catch (const Error& e) {
    self_attn_.set_precision(attn_before);
    fail("self_attn.: ", e.what());  // the names in the message are under self_attn.
  } catch (...) {
    self_attn_.set_precision(attn_before);
    throw;
  }
  const bool f32_packed = packed_ != nullptr && packed_->precision == Precision::F32;  // pack_f32's: kept
  for (auto& [n, t] : params_) {
    if (const Tensor* src = find(sd, n)) t.copy_from(*src);
  }
  packed_ = f32_packed && target == Precision::F32 ? modules::PackedWeights::f32_shared(params_, kLinearNames)
                                                   : std::move(packed);
}

TransformerEncoderLayer TransformerEncoderLayer::clone() const {
  TransformerEncoderLayer c = *this;
  c.self_attn_ = self_attn_.clone();
  for (auto& [n, t] : c.params_) t = t.clone();
  return c;
}

StateDict TransformerEncoderLayer::quantized_state_dict() const {
  StateDict sd;
  for (const auto& [n, t] : self_attn_.quantized_state_dict()) sd.emplace_back("self_attn." + n, t);
  for (const auto& [n, t] : modules::with_int8_weights(params_, packed_.get())) sd.emplace_back(n, t);
  return sd;
}

void TransformerEncoderLayer::set_precision(Precision p, const InputRanges& input_ranges) {
  // Calibrated, the feed-forward input reads d_model-wide rows: no residual rows (heads/precision.h).
  auto packed = modules::PackedWeights::make(p, params_, {}, kLinearNames, {}, nullptr, input_ranges,
                                             {{"linear1.weight", kInt8ModelWidthResidualError}});
  self_attn_.set_precision(p, modules::ranges_under(input_ranges, "self_attn."));  // after the step that can fail alone
  packed_ = std::move(packed);
}

void TransformerEncoderLayer::record_input_ranges(const EncoderLayerTape& t, InputRanges& ranges) const {
  HEADS_CHECK(t.defined(), kEncoderOp, "::record_input_ranges: empty tape; run forward with a tape");
  InputRanges attn;
  self_attn_.record_input_ranges(t.attn, attn);
  for (const auto& [n, a] : attn) modules::record_absmax(ranges, "self_attn." + n, a);  // a max of maxima
  modules::record_absmax(ranges, "linear1.weight", t.ff_in);
  modules::record_absmax(ranges, "linear2.weight", t.hidden_out);
}

void TransformerEncoderLayer::pack_f32() {
  if (precision() != Precision::F32) return;
  auto packed = modules::PackedWeights::f32_shared(params_, kLinearNames);
  self_attn_.pack_f32();
  packed_ = std::move(packed);
}

Precision TransformerEncoderLayer::precision() const { return packed_ ? packed_->precision : Precision::F32; }

Tensor TransformerEncoderLayer::forward(const Tensor& src, const EncoderForwardArgs& a) const {
  HEADS_CHECK(src.defined() && (src.dim() == 2 || src.dim() == 3), kEncoderOp,
              ": src: expected [L, E], [L, N, E] or [N, L, E], got ", src.defined() ? src.shape() : Shape{});
  HEADS_CHECK(src.size(-1) == opt_.d_model, kEncoderOp, ": src: expected d_model ", opt_.d_model,
              " in the last dim, got ", src.shape());
  const double p = training_ ? opt_.dropout : 0.0;
  const uint64_t seed_attn = p > 0 ? next_seed() : 0;
  const uint64_t seed_hidden = p > 0 ? next_seed() : 0;
  const uint64_t seed_out = p > 0 ? next_seed() : 0;
  EncoderLayerTape* tape = a.tape;
  const float eps = static_cast<float>(opt_.layer_norm_eps);
  auto norm = [&](const Tensor& x, int i) {
    if (tape) (i == 1 ? tape->norm1_in : tape->norm2_in) = x;
    return layer_norm(x, *param(norm_name(i, "weight")), opt_param(norm_name(i, "bias")), eps);
  };
  auto add_norm = [&](const Tensor& x, const Tensor& r, int i) {  // norm_i(x + r)
    if (tape) return norm(add(x, r), i);  // the sum is kept for the backward
    return add_layer_norm(x, r, *param(norm_name(i, "weight")), opt_param(norm_name(i, "bias")), eps);
  };
  auto sa = [&](const Tensor& x) {
    MhaForwardArgs m;
    m.attn_mask = a.src_mask;
    m.key_padding_mask = a.src_key_padding_mask;
    m.is_causal = a.is_causal;
    m.relative_attention_bias = a.relative_attention_bias;
    m.relative_attention_max_distance = a.relative_attention_max_distance;
    m.need_weights = a.attn_weights != nullptr;
    m.average_attn_weights = false;
    if (tape) {
      m.tape = &tape->attn;
      tape->sa_in = x;
    }
    auto [out, w] = self_attn_.forward(x, x, x, m);
    if (a.attn_weights) *a.attn_weights = w;
    return dropout(out, p, seed_attn);
  };
  // Reduced-precision weights for inference; a forward that records a tape runs in f32.
  const auto packed = [&](const char* name) { return packed_ && !tape ? packed_->find(name) : nullptr; };
  auto ff = [&](const Tensor& x) {
    const PackedLinear* p1 = packed("linear1.weight");
    // Packed (inference, no tape): the activation applied as the linear layer writes its output.
    const Tensor hidden = p1 != nullptr ? linear(x, *p1, opt_param("linear1.bias"), DType::F32, opt_.activation)
                                        : project(x, *param("linear1.weight"), opt_param("linear1.bias"), nullptr);
    const Tensor h = dropout(p1 != nullptr ? hidden : activation(hidden, opt_.activation), p, seed_hidden);
    if (tape) {
      tape->ff_in = x;
      tape->hidden = hidden;
      tape->hidden_out = h;
    }
    return dropout(project(h, *param("linear2.weight"), opt_param("linear2.bias"), packed("linear2.weight")), p,
                   seed_out);
  };
  if (tape) {
    *tape = EncoderLayerTape{};
    tape->p = p;
    tape->seed_attn = seed_attn;
    tape->seed_hidden = seed_hidden;
    tape->seed_out = seed_out;
  }
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

EncoderGrads TransformerEncoderLayer::backward(const EncoderLayerTape& t, const Tensor& dout_in) const {
  HEADS_CHECK(t.defined(), kEncoderOp, "::backward: empty tape; run forward with EncoderForwardArgs::tape set");
  HEADS_CHECK(dout_in.defined() && dout_in.shape() == t.norm1_in.shape(), kEncoderOp, "::backward: dout: expected ",
              t.norm1_in.shape(), " (the forward's output), got ", dout_in.defined() ? dout_in.shape() : Shape{});
  HEADS_CHECK(is_floating(dout_in.dtype()), kEncoderOp, "::backward: dout: expected a floating dtype, got ",
              dtype_name(dout_in.dtype()));
  const double eps = opt_.layer_norm_eps;
  StateDict pg;  // parameter gradients, collected by name
  auto keep = [&](const std::string& name, const Tensor& g) {
    if (g.defined()) pg.emplace_back(name, g);
  };
  auto norm_back = [&](const Tensor& dy, int i) {  // -> d(norm input)
    const LayerNormGrads g = layer_norm_backward(dy, i == 1 ? t.norm1_in : t.norm2_in,
                                                 *param(norm_name(i, "weight")),
                                                 opt_param(norm_name(i, "bias")), eps);
    keep(norm_name(i, "weight"), g.dweight);
    keep(norm_name(i, "bias"), g.dbias);
    return g.dx;
  };
  auto ff_back = [&](const Tensor& dy) {  // -> d(ff input)
    const LinearGrads g2 = linear_backward(dropout(dy, t.p, t.seed_out), t.hidden_out,
                                           *param("linear2.weight"), opt_.bias);
    keep("linear2.weight", g2.dweight);
    keep("linear2.bias", g2.dbias);
    const Tensor dh = activation_backward(dropout(g2.dx, t.p, t.seed_hidden), t.hidden, opt_.activation);
    const LinearGrads g1 = linear_backward(dh, t.ff_in, *param("linear1.weight"), opt_.bias);
    keep("linear1.weight", g1.dweight);
    keep("linear1.bias", g1.dbias);
    return g1.dx;
  };
  auto sa_back = [&](const Tensor& dy) {  // -> d(self-attention input)
    MhaGrads g = self_attn_.backward(t.attn, dropout(dy, t.p, t.seed_attn));
    for (auto& [n, d] : g.params) pg.emplace_back("self_attn." + n, d);
    return g.dquery;
  };
  const Tensor dout = dout_in.to(DType::F32);
  Tensor dx;
  if (opt_.norm_first) {  // x1 = x + sa(norm1(x)); y = x1 + ff(norm2(x1))
    const Tensor dx1 = add(dout, norm_back(ff_back(dout), 2));
    dx = add(dx1, norm_back(sa_back(dx1), 1));
  } else {  // x1 = norm1(x + sa(x)); y = norm2(x1 + ff(x1))
    const Tensor dz2 = norm_back(dout, 2);
    const Tensor dz1 = norm_back(add(dz2, ff_back(dz2)), 1);
    dx = add(dz1, sa_back(dz1));
  }
  EncoderGrads out;
  out.dsrc = dx;
  for (const auto& [n, v] : state_dict()) {
    const Tensor* g = find(pg, n);
    HEADS_CHECK(g != nullptr, kEncoderOp, "::backward: no gradient for \"", n, "\"");
    out.params.emplace_back(n, *g);
  }
  return out;
}

TransformerEncoder::TransformerEncoder(const TransformerEncoderLayerOptions& layer, int64_t num_layers,
                                       bool final_norm, std::optional<uint64_t> seed)
    : eps_(layer.layer_norm_eps) {
  HEADS_CHECK(num_layers >= 1, "TransformerEncoder: num_layers must be positive, got ", num_layers);
  const TransformerEncoderLayer first(layer, seed);
  for (int64_t i = 0; i < num_layers; ++i) {
    layers_.emplace_back(layer, SkipInit{});
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
                                   bool is_causal, std::vector<Tensor>* attn_weights,
                                   EncoderTape* tape) const {
  Tensor x = src;
  if (attn_weights) attn_weights->clear();
  if (tape) *tape = EncoderTape{std::vector<EncoderLayerTape>(layers_.size()), Tensor()};
  for (size_t i = 0; i < layers_.size(); ++i) {
    EncoderForwardArgs a;
    a.src_mask = mask;
    a.src_key_padding_mask = kpm;
    a.is_causal = is_causal;
    Tensor w;
    if (attn_weights) a.attn_weights = &w;
    if (tape) a.tape = &tape->layers[i];
    x = layers_[i].forward(x, a);
    if (attn_weights) attn_weights->push_back(w);
  }
  if (norm_w_.defined()) {
    if (tape) tape->norm_in = x;
    x = layer_norm(x, norm_w_, norm_b_, eps_);
  }
  return x;
}

EncoderGrads TransformerEncoder::backward(const EncoderTape& t, const Tensor& dout) const {
  HEADS_CHECK(t.defined() && t.layers.size() == layers_.size(),
              "TransformerEncoder::backward: empty tape or one from another encoder; run forward with a tape");
  EncoderGrads out;
  LayerNormGrads norm_g;  // of the final norm
  Tensor dx = dout;
  if (norm_w_.defined()) {
    HEADS_CHECK(dout.defined() && dout.shape() == t.norm_in.shape(), "TransformerEncoder::backward: dout: expected ",
                t.norm_in.shape(), ", got ", dout.defined() ? dout.shape() : Shape{});
    norm_g = layer_norm_backward(dout, t.norm_in, norm_w_, norm_b_, eps_);
    dx = norm_g.dx;
  }
  std::vector<StateDict> per_layer(layers_.size());
  for (size_t i = layers_.size(); i-- > 0;) {
    EncoderGrads g = layers_[i].backward(t.layers[i], dx);
    dx = g.dsrc;
    per_layer[i] = std::move(g.params);
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    for (auto& [n, g] : per_layer[i]) out.params.emplace_back("layers." + std::to_string(i) + "." + n, g);
  }
  if (norm_g.dweight.defined()) out.params.emplace_back(std::string("norm.weight"), norm_g.dweight);
  if (norm_g.dbias.defined()) out.params.emplace_back(std::string("norm.bias"), norm_g.dbias);
  out.dsrc = dx;
  return out;
}

StateDict TransformerEncoder::state_dict() const { return collect(false); }

StateDict TransformerEncoder::quantized_state_dict() const { return collect(true); }

StateDict TransformerEncoder::collect(bool quantized) const {
  StateDict sd;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const StateDict layer = quantized ? layers_[i].quantized_state_dict() : layers_[i].state_dict();
    for (const auto& [n, t] : layer) sd.emplace_back("layers." + std::to_string(i) + "." + n, t);
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
  for (auto [name, t] : {std::pair{"norm.weight", &norm_w_}, {"norm.bias", &norm_b_}}) {
    if (const Tensor* src = find(sd, name); src && t->defined()) {
      HEADS_CHECK(src->shape() == t->shape(), "TransformerEncoder::load_state_dict: \"", name,
                  "\": expected ", t->shape(), ", got ", src->shape());
    }
  }
  const auto load_into = [&](std::vector<TransformerEncoderLayer>& layers) {
    for (size_t i = 0; i < layers.size(); ++i) {
      try {
        layers[i].load_state_dict(with_prefix_removed(sd, "layers." + std::to_string(i) + "."), strict);
      } catch (const Error& e) {
        fail("layers.", i, ".: ", e.what());  // the names in the message are under layers.<i>.
      }
    }
    // A layer given int8 weights went int8: the others follow (all layers share one precision).
    const bool any_int8 = std::any_of(layers.begin(), layers.end(),
                                      [](const TransformerEncoderLayer& l) { return l.precision() == Precision::Int8; });
    for (auto& layer : layers) {
      if (any_int8 && layer.precision() != Precision::Int8) layer.set_precision(Precision::Int8);
    }
  };
  // First on copies with parameters of their own: a failure in any layer leaves every layer as it was.
  // Then on the layers themselves, which keep their storage (views from state_dict() stay valid).
  std::vector<TransformerEncoderLayer> staged;
  staged.reserve(layers_.size());
  for (const auto& layer : layers_) staged.push_back(layer.clone());
  load_into(staged);
  load_into(layers_);
  for (auto [name, t] : {std::pair{"norm.weight", &norm_w_}, {"norm.bias", &norm_b_}}) {
    if (const Tensor* src = find(sd, name); src && t->defined()) t->copy_from(*src);
  }
}

void set_layers_precision(std::vector<TransformerEncoderLayer>& layers, Precision p,
                          const std::vector<InputRanges>& input_ranges) {
  HEADS_CHECK(input_ranges.empty() || input_ranges.size() == layers.size(), "set_layers_precision: ",
              input_ranges.size(), " input ranges for ", layers.size(), " layers");
  const Precision before = layers.empty() ? Precision::F32 : layers.front().precision();
  try {
    for (size_t i = 0; i < layers.size(); ++i) layers[i].set_precision(p, input_ranges.empty() ? InputRanges{} : input_ranges[i]);
  } catch (...) {
    for (auto& layer : layers) layer.set_precision(before);
    throw;
  }
}

void TransformerEncoder::set_precision(Precision p) {
  set_layers_precision(layers_, p);
}

void TransformerEncoder::pack_f32() {
  for (auto& layer : layers_) layer.pack_f32();
}

Precision TransformerEncoder::precision() const {
  return layers_.empty() ? Precision::F32 : layers_.front().precision();
}

void TransformerEncoder::load(const std::string& path, bool strict) {
  modules::load_file(path, [&](const StateDict& sd) { load_state_dict(sd, strict); });
}

void TransformerEncoder::save(const std::string& path) const {
  save_safetensors(path, quantized_state_dict(), {{"format", "pt"}});
}

void TransformerEncoder::prune_heads(const std::map<int64_t, std::vector<int64_t>>& heads_by_layer) {
  for (const auto& [i, heads] : heads_by_layer) {
    HEADS_CHECK(i >= 0 && i < num_layers(), "TransformerEncoder::prune_heads: layer ", i, " is out of range for ",
                num_layers(), " layers");
    // Check every layer's list before the first one changes.
    const int64_t H = layers_[static_cast<size_t>(i)].self_attn().options().num_heads;
    std::vector<bool> seen(static_cast<size_t>(H), false);
    int64_t n = 0;
    for (int64_t h : heads) {
      HEADS_CHECK(h >= 0 && h < H, "TransformerEncoder::prune_heads: layer ", i, ": head ", h,
                  " is out of range for ", H, " heads");
      n += seen[static_cast<size_t>(h)] ? 0 : 1;
      seen[static_cast<size_t>(h)] = true;
    }
    HEADS_CHECK(n < H, "TransformerEncoder::prune_heads: layer ", i, ": removing all ", H,
                " heads would leave no attention");
  }
  // On copies (sharing the parameters, which pruning does not modify), committed together: a layer whose
  // weights cannot be packed leaves the encoder as it was.
  std::vector<TransformerEncoderLayer> next = layers_;
  for (const auto& [i, heads] : heads_by_layer) next[static_cast<size_t>(i)].prune_heads(heads);
  layers_ = std::move(next);
}

}  // namespace heads
