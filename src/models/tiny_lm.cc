// tiny_lm.cc — the small causal language model of include/heads/tiny_lm.h.
#include "heads/tiny_lm.h"

#include <cmath>
#include <random>

#include "heads/error.h"
#include "heads/ops.h"

namespace heads {

namespace {

TransformerEncoderLayerOptions layer_options(const TinyLMOptions& o) {
  HEADS_CHECK(o.vocab >= 1 && o.max_len >= 1, "TinyCausalLM: vocab and max_len must be positive, got ", o.vocab,
              " and ", o.max_len);
  TransformerEncoderLayerOptions l;
  l.d_model = o.d_model;
  l.nhead = o.nhead;
  l.dim_feedforward = o.dim_feedforward;
  l.dropout = o.dropout;
  l.activation = Activation::Gelu;
  l.batch_first = true;
  l.norm_first = true;
  l.attention = o.attention;
  return l;
}

template <class Draw>
Tensor filled(const Shape& shape, Draw&& draw) {
  Tensor t = Tensor::empty(shape, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(draw());
  return t;
}

}  // namespace

TinyCausalLM::TinyCausalLM(const TinyLMOptions& options, uint64_t seed)
    : opt_(options), encoder_(layer_options(options), options.num_layers, /*final_norm=*/true, seed) {
  std::mt19937_64 gen(seed + 101);
  std::normal_distribution<double> normal(0.0, 0.02);
  const double bound = 1.0 / std::sqrt(static_cast<double>(opt_.d_model));
  std::uniform_real_distribution<double> uniform(-bound, bound);
  tok_ = filled({opt_.vocab, opt_.d_model}, [&] { return normal(gen); });
  pos_ = filled({opt_.max_len, opt_.d_model}, [&] { return normal(gen); });
  head_w_ = filled({opt_.vocab, opt_.d_model}, [&] { return uniform(gen); });
  head_b_ = filled({opt_.vocab}, [&] { return uniform(gen); });
}

StateDict TinyCausalLM::state_dict() const {
  StateDict sd{{"tok_emb.weight", tok_}, {"pos_emb.weight", pos_}};
  for (const auto& [n, t] : encoder_.state_dict()) sd.emplace_back("encoder." + n, t);
  sd.emplace_back("head.weight", head_w_);
  sd.emplace_back("head.bias", head_b_);
  return sd;
}

Tensor TinyCausalLM::forward(const Tensor& ids, Tape* tape) const {
  HEADS_CHECK(ids.defined() && ids.dim() == 2, "TinyCausalLM: ids: expected [B, L], got ",
              ids.defined() ? ids.shape() : Shape{});
  const int64_t B = ids.size(0), L = ids.size(1);
  HEADS_CHECK(L <= opt_.max_len, "TinyCausalLM: ids ", ids.shape(), " are longer than max_len ", opt_.max_len);
  Tensor positions = Tensor::empty({B, L}, DType::I64);
  for (int64_t i = 0; i < B * L; ++i) positions.data<int64_t>()[i] = i % L;
  const Tensor x = add(embedding(tok_, ids), embedding(pos_, positions));
  const Tensor h = encoder_.forward(x, {}, {}, /*is_causal=*/true, nullptr, tape ? &tape->encoder : nullptr);
  if (tape) {
    tape->ids = ids;
    tape->positions = positions;
    tape->hidden = h;
  }
  return linear(h, head_w_, head_b_).reshape({B * L, opt_.vocab});
}

StateDict TinyCausalLM::backward(const Tape& t, const Tensor& dlogits) const {
  const int64_t B = t.ids.size(0), L = t.ids.size(1);
  HEADS_CHECK(dlogits.defined() && dlogits.numel() == B * L * opt_.vocab, "TinyCausalLM::backward: dlogits: expected [",
              B * L, ", ", opt_.vocab, "], got ", dlogits.defined() ? dlogits.shape() : Shape{});
  const LinearGrads gh = linear_backward(dlogits.reshape({B, L, opt_.vocab}), t.hidden, head_w_, true);
  const EncoderGrads ge = encoder_.backward(t.encoder, gh.dx);
  StateDict g{{"tok_emb.weight", embedding_backward(ge.dsrc, t.ids, opt_.vocab)},
              {"pos_emb.weight", embedding_backward(ge.dsrc, t.positions, opt_.max_len)}};
  for (const auto& [n, d] : ge.params) g.emplace_back("encoder." + n, d);
  g.emplace_back("head.weight", gh.dweight);
  g.emplace_back("head.bias", gh.dbias);
  return g;
}

}  // namespace heads
