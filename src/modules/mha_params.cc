// mha_params.cc — MultiheadAttention's parameters: construction and initialisation as torch's,
// state dicts (float and int8), precision, files, and head pruning. The forward is mha.cc.
#include "heads/mha.h"

#include <cmath>
#include <random>

#include "heads/runtime.h"
#include "heads/safetensors.h"
#include "modules/common.h"
#include "modules/mha_attention.h"

namespace heads {

using modules::find;
using modules::names_of;
using modules::PackedWeights;
using modules::normal;
using modules::uniform;
using modules::xavier_uniform;
using modules::kMhaOp;

namespace {

// The weights a reduced precision packs (those present: in_proj_weight or q/k/v_proj_weight).
const std::vector<std::string> kPackedNames = {"in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                                               "out_proj.weight"};

void check_variant(const MultiheadAttentionOptions& o) {
  const AttentionVariant& v = o.variant;
  HEADS_CHECK(v.window >= -1, kMhaOp, ": window must be -1 (every key) or >= 0, got ", v.window);
  HEADS_CHECK(v.sparse_block >= 0, kMhaOp, ": sparse_block must be >= 0 (0: dense), got ", v.sparse_block);
  HEADS_CHECK(v.sparse_stride >= 1, kMhaOp, ": sparse_stride must be at least 1, got ", v.sparse_stride);
  HEADS_CHECK(v.gate_threshold >= 0.0 && v.gate_threshold <= 1.0, kMhaOp, ": gate_threshold must be in [0, 1], got ",
              v.gate_threshold);
  HEADS_CHECK((v.window == -1 && v.sparse_block == 0) || (!o.add_bias_kv && !o.add_zero_attn), kMhaOp,
              ": window and sparse_block place keys by position; the keys add_bias_kv / add_zero_attn append have "
              "none: use one or the other");
  if (v.kind == AttentionKind::Linear) {
    HEADS_CHECK(v.window == -1 && v.sparse_block == 0, kMhaOp,
                ": window and sparse_block select softmax attention's keys; linear attention takes neither");
    HEADS_CHECK(o.dropout == 0.0, kMhaOp, ": dropout (", o.dropout,
                ") drops softmax attention weights; linear attention has none to drop: use 0");
  }
}


}  // namespace

AttentionKind attention_kind_from_name(const std::string& name) {
  if (name == "softmax") return AttentionKind::Softmax;
  if (name == "linear") return AttentionKind::Linear;
  fail("attention must be \"softmax\" or \"linear\", got \"", name, "\"");
}

HeadGate head_gate_from_name(const std::string& name) {
  if (name == "none") return HeadGate::None;
  if (name == "first") return HeadGate::FirstToken;
  if (name == "mean") return HeadGate::MeanPool;
  fail("head_gate must be \"none\", \"first\" or \"mean\", got \"", name, "\"");
}

MultiheadAttention::MultiheadAttention(const MultiheadAttentionOptions& options, SkipInit) : opt_(options) {
  const int64_t E = opt_.embed_dim;
  HEADS_CHECK(E >= 1 && E <= kMaxWidth, kMhaOp, ": embed_dim must be in [1, ", kMaxWidth, "], got ", E);
  HEADS_CHECK(opt_.num_heads >= 1 && opt_.num_heads <= kMaxWidth, kMhaOp, ": num_heads must be in [1, ", kMaxWidth,
              "], got ", opt_.num_heads);
  HEADS_CHECK(opt_.head_dim >= 0 && opt_.head_dim <= kMaxWidth, kMhaOp, ": head_dim must be in [1, ", kMaxWidth,
              "] (0: embed_dim / num_heads), got ", opt_.head_dim);
  if (opt_.head_dim == 0) {
    HEADS_CHECK(E % opt_.num_heads == 0, kMhaOp, ": embed_dim ", E, " is not divisible by num_heads ",
                opt_.num_heads);
    opt_.head_dim = E / opt_.num_heads;
  }
  HEADS_CHECK(opt_.num_heads * opt_.head_dim <= kMaxWidth, kMhaOp, ": num_heads ", opt_.num_heads, " x head_dim ",
              opt_.head_dim, " exceeds ", kMaxWidth);
  check_variant(opt_);
  attention_ = modules::make_attention(opt_.variant);
  const int64_t Ei = opt_.num_heads * opt_.head_dim;  // the heads' total width (E unless pruned)
  HEADS_CHECK(opt_.dropout >= 0.0 && opt_.dropout <= 1.0, kMhaOp, ": dropout must be in [0, 1], got ",
              opt_.dropout);
  HEADS_CHECK(opt_.kdim >= 0 && opt_.vdim >= 0 && opt_.kdim <= kMaxWidth && opt_.vdim <= kMaxWidth, kMhaOp,
              ": kdim and vdim must be in [1, ", kMaxWidth, "] (0: embed_dim), got ", opt_.kdim, " and ", opt_.vdim);
  if (opt_.kdim == 0) opt_.kdim = E;
  if (opt_.vdim == 0) opt_.vdim = E;
  // Registration order of torch's state_dict.
  const auto add = [&](const char* name, const Shape& shape) {
    params_.push_back({name, Tensor::zeros(shape, DType::F32)});
  };
  if (opt_.kdim == E && opt_.vdim == E) {
    add("in_proj_weight", {3 * Ei, E});
  } else {
    add("q_proj_weight", {Ei, E});
    add("k_proj_weight", {Ei, opt_.kdim});
    add("v_proj_weight", {Ei, opt_.vdim});
  }
  if (opt_.bias) add("in_proj_bias", {3 * Ei});
  if (opt_.add_bias_kv) {
    add("bias_k", {1, 1, Ei});
    add("bias_v", {1, 1, Ei});
  }
  add("out_proj.weight", {E, Ei});
  if (opt_.bias) add("out_proj.bias", {E});
  if (opt_.variant.head_gate != HeadGate::None) {
    add("head_gate.weight", {opt_.num_heads, E});
    add("head_gate.bias", {opt_.num_heads});
  }
}

MultiheadAttention::MultiheadAttention(const MultiheadAttentionOptions& options, std::optional<uint64_t> seed)
    : MultiheadAttention(options, SkipInit{}) {
  std::mt19937_64 gen(seed ? *seed : next_seed());
  const int64_t E = opt_.embed_dim, Ei = opt_.num_heads * opt_.head_dim;
  const double head_gate_bound = 1.0 / std::sqrt(static_cast<double>(E));
  // Drawn in registration order; the in- and out-projection biases stay zero (torch zeroes them).
  for (Param& p : params_) {
    const std::string& n = p.name;
    if (n == "in_proj_weight") {
      p.value = xavier_uniform(3 * Ei, E, gen);
    } else if (n == "q_proj_weight" || n == "k_proj_weight" || n == "v_proj_weight") {
      p.value = xavier_uniform(Ei, p.value.size(1), gen);
    } else if (n == "bias_k" || n == "bias_v") {  // xavier_normal_ on [1, 1, Ei]: fan_in = fan_out = Ei
      p.value = normal({1, 1, Ei}, std::sqrt(1.0 / static_cast<double>(Ei)), gen);
    } else if (n == "out_proj.weight") {  // nn.Linear's kaiming_uniform_(a=sqrt(5)): bound 1/sqrt(fan_in)
      p.value = uniform({E, Ei}, 1.0 / std::sqrt(static_cast<double>(Ei)), gen);
    } else if (n == "head_gate.weight" || n == "head_gate.bias") {  // an nn.Linear(E, H): U(±1/√E)
      p.value = uniform(p.value.shape(), head_gate_bound, gen);
    }
  }
}

Tensor* MultiheadAttention::param(const std::string& name) {
  for (auto& p : params_) {
    if (p.name == name) return &p.value;
  }
  return nullptr;
}

const Tensor* MultiheadAttention::param(const std::string& name) const {
  for (const auto& p : params_) {
    if (p.name == name) return &p.value;
  }
  return nullptr;
}

StateDict MultiheadAttention::state_dict() const {
  StateDict sd;
  for (const auto& p : params_) sd.emplace_back(p.name, p.value);
  return sd;
}

void MultiheadAttention::load_state_dict(const StateDict& stored, bool strict) {
  // int8 weights (with their scales) are used as they are stored and switch the module to int8.
  const modules::LoadedWeights loaded = modules::read_int8_weights(stored, kPackedNames, kMhaOp);
  const StateDict& sd = loaded.floating;
  // Validate everything first, then copy: a failed load leaves the module unchanged.
  for (const auto& p : params_) {
    const Tensor* t = find(sd, p.name);
    if (t == nullptr) {
      HEADS_CHECK(!strict, kMhaOp, "::load_state_dict: tensor \"", p.name, "\" missing (have: ",
                  names_of(sd), ")");
      continue;
    }
    HEADS_CHECK(t->defined() && t->shape() == p.value.shape(), kMhaOp, "::load_state_dict: \"",
                p.name, "\": expected shape ", p.value.shape(), ", got ",
                t->defined() ? t->shape() : Shape{});
    HEADS_CHECK(is_floating(t->dtype()), kMhaOp, "::load_state_dict: \"", p.name,
                "\": expected a floating dtype, got ", dtype_name(t->dtype()));
  }
  if (strict) {
    for (const auto& [n, t] : sd) {
      HEADS_CHECK(param(n) != nullptr, kMhaOp, "::load_state_dict: unexpected tensor \"", n,
                  "\" for a module with ", [&] {
                    std::string s;
                    for (const auto& p : params_) s += (s.empty() ? "" : ", ") + p.name;
                    return s;
                  }());
    }
  }
  // The new weights packed in the precision in force before anything is copied (packing can fail).
  const Precision target = loaded.int8.empty() ? precision() : Precision::Int8;
  auto packed = PackedWeights::make(target, state_dict(), sd, kPackedNames, loaded.int8, packed_.get());
  const bool f32_packed = packed_ != nullptr && packed_->precision == Precision::F32;  // pack_f32's: kept
  for (auto& p : params_) {
    if (const Tensor* t = find(sd, p.name)) p.value.copy_from(*t);
  }
  packed_ = f32_packed && target == Precision::F32 ? PackedWeights::f32_shared(state_dict(), kPackedNames)
                                                   : std::move(packed);
}

MultiheadAttention MultiheadAttention::clone() const {
  MultiheadAttention c = *this;
  for (auto& p : c.params_) p.value = p.value.clone();
  return c;
}

StateDict MultiheadAttention::quantized_state_dict() const {
  return modules::with_int8_weights(state_dict(), packed_.get());
}

void MultiheadAttention::set_precision(Precision p, const InputRanges& input_ranges) {
  // Calibrated, every projection reads d_model-wide rows: no residual rows (heads/precision.h).
  std::map<std::string, double> residual_errors;
  for (const std::string& n : kPackedNames) residual_errors[n] = kInt8ModelWidthResidualError;
  packed_ = PackedWeights::make(p, state_dict(), {}, kPackedNames, {}, nullptr, input_ranges, residual_errors);
}

void MultiheadAttention::record_input_ranges(const MhaTape& t, InputRanges& ranges) const {
  HEADS_CHECK(t.defined(), "MultiheadAttention::record_input_ranges: empty tape; run forward with a tape");
  if (param("in_proj_weight") != nullptr) {  // one weight reads query, key and value
    modules::record_absmax(ranges, "in_proj_weight", t.xq);
    if (!t.self_attn) {
      modules::record_absmax(ranges, "in_proj_weight", t.xk);
      modules::record_absmax(ranges, "in_proj_weight", t.xv);
    }
  } else {
    modules::record_absmax(ranges, "q_proj_weight", t.xq);
    modules::record_absmax(ranges, "k_proj_weight", t.self_attn ? t.xq : t.xk);
    modules::record_absmax(ranges, "v_proj_weight", t.self_attn ? t.xq : t.xv);
  }
  modules::record_absmax(ranges, "out_proj.weight", t.gated.defined() ? t.gated : t.attn3);
}

void MultiheadAttention::pack_f32() {
  if (precision() == Precision::F32) packed_ = PackedWeights::f32_shared(state_dict(), kPackedNames);
}

Precision MultiheadAttention::precision() const { return packed_ ? packed_->precision : Precision::F32; }

void MultiheadAttention::load(const std::string& path, bool strict) {
  modules::load_file(path, [&](const StateDict& sd) { load_state_dict(sd, strict); });
}

void MultiheadAttention::save(const std::string& path) const {
  save_safetensors(path, quantized_state_dict(), {{"format", "pt"}});
}

MultiheadAttention MultiheadAttention::from_state_dict(const StateDict& sd, int64_t num_heads,
                                                       bool batch_first, bool add_zero_attn,
                                                       const AttentionVariant& variant) {
  const Tensor* wo = find(sd, "out_proj.weight");
  HEADS_CHECK(wo != nullptr, kMhaOp, ": tensor \"out_proj.weight\" missing (have: ", names_of(sd), ")");
  HEADS_CHECK(wo->dim() == 2, kMhaOp, ": out_proj.weight: expected [E, num_heads * head_dim], got ", wo->shape());
  MultiheadAttentionOptions o;
  o.embed_dim = wo->size(0);
  o.num_heads = num_heads;
  if (wo->size(1) != wo->size(0)) {  // heads of their own width (e.g. pruned); square: torch's E / H
    HEADS_CHECK(num_heads >= 1 && wo->size(1) % num_heads == 0, kMhaOp, ": out_proj.weight ", wo->shape(),
                ": its ", wo->size(1), " input features do not split into ", num_heads, " heads");
    o.head_dim = wo->size(1) / num_heads;
  }
  o.variant = variant;
  HEADS_CHECK((find(sd, "head_gate.weight") != nullptr) == (variant.head_gate != HeadGate::None), kMhaOp,
              find(sd, "head_gate.weight") != nullptr
                  ? ": the state dict has head gates (head_gate.weight): pass the variant's head_gate (first or mean)"
                  : ": the variant has head gates, the state dict no head_gate.weight");
  o.batch_first = batch_first;
  o.add_zero_attn = add_zero_attn;
  o.bias = find(sd, "in_proj_bias") != nullptr;
  o.add_bias_kv = find(sd, "bias_k") != nullptr;
  if (find(sd, "in_proj_weight") == nullptr) {
    const Tensor* wk = find(sd, "k_proj_weight");
    const Tensor* wv = find(sd, "v_proj_weight");
    HEADS_CHECK(wk != nullptr && wv != nullptr && find(sd, "q_proj_weight") != nullptr, kMhaOp,
                ": tensor \"in_proj_weight\" missing, and no q_proj_weight/k_proj_weight/"
                "v_proj_weight either (have: ", names_of(sd), ")");
    HEADS_CHECK(wk->dim() == 2 && wv->dim() == 2, kMhaOp,
                ": k_proj_weight/v_proj_weight must be 2-D, got ", wk->shape(), " and ",
                wv->shape());
    o.kdim = wk->size(1);
    o.vdim = wv->size(1);
    // A module with kdim == vdim == E still stores separate weights when built with kdim/vdim.
    HEADS_CHECK(!(o.kdim == o.embed_dim && o.vdim == o.embed_dim), kMhaOp,
                ": separate q/k/v projection weights with kdim == vdim == embed_dim are not "
                "supported; store them as in_proj_weight [3E, E]");
  }
  MultiheadAttention m(o, SkipInit{});
  m.load_state_dict(sd, true);
  m.eval();
  return m;
}
void MultiheadAttention::prune_heads(const std::vector<int64_t>& heads) {
  const int64_t H = opt_.num_heads, hd = opt_.head_dim, Ei = H * hd;
  std::vector<bool> drop(static_cast<size_t>(H), false);
  for (int64_t h : heads) {
    HEADS_CHECK(h >= 0 && h < H, kMhaOp, "::prune_heads: head ", h, " is out of range for ", H, " heads");
    drop[static_cast<size_t>(h)] = true;
  }
  std::vector<int64_t> keep;
  for (int64_t h = 0; h < H; ++h) {
    if (!drop[static_cast<size_t>(h)]) keep.push_back(h);
  }
  HEADS_CHECK(!keep.empty(), kMhaOp, "::prune_heads: removing all ", H, " heads would leave no attention");
  if (static_cast<int64_t>(keep.size()) == H) return;
  const int64_t K = static_cast<int64_t>(keep.size());
  // Rows (dim 0) or columns (dim 1) of the kept heads, for each of `parts` consecutive H·hd blocks
  // (hd = 1 for the gates).
  auto gather = [&](const Tensor& t, int64_t dim, int64_t parts, int64_t width) {
    Shape shape = t.shape();
    shape[static_cast<size_t>(dim)] = parts * K * width;
    Tensor y = Tensor::empty(shape, DType::F32);
    for (int64_t p = 0; p < parts; ++p) {
      for (int64_t x = 0; x < K; ++x) {
        const int64_t src = p * H * width + keep[static_cast<size_t>(x)] * width, dst = (p * K + x) * width;
        y.slice(dim, dst, dst + width).copy_from(t.slice(dim, src, src + width));
      }
    }
    return y;
  };
  std::vector<Param> next;
  for (const Param& p : params_) {
    Tensor v = p.value;
    if (p.name == "in_proj_weight" || p.name == "in_proj_bias") {
      v = gather(v, 0, 3, hd);
    } else if (p.name == "q_proj_weight" || p.name == "k_proj_weight" || p.name == "v_proj_weight") {
      v = gather(v, 0, 1, hd);
    } else if (p.name == "bias_k" || p.name == "bias_v") {
      v = gather(v, 2, 1, hd);
    } else if (p.name == "out_proj.weight") {
      v = gather(v, 1, 1, hd);
    } else if (p.name == "head_gate.weight" || p.name == "head_gate.bias") {
      v = gather(v, 0, 1, 1);
    }
    next.push_back({p.name, v});
  }
  (void)Ei;
  // Re-pack the new weights in the precision in force (can fail: then nothing has changed).
  StateDict sd;
  for (const Param& p : next) sd.emplace_back(p.name, p.value);
  auto packed = PackedWeights::make(precision(), sd, {}, kPackedNames);
  params_ = std::move(next);
  opt_.num_heads = K;
  packed_ = std::move(packed);
}

}  // namespace heads
