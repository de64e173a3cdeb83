// mha_attention.cc — MultiheadAttention's two attentions (mha_attention.h): softmax SDPA and linear
// attention, each with its checks, its tape and its backward.
#include "modules/mha_attention.h"

#include "heads/linear_attention.h"

namespace heads::modules {

namespace {


// key_padding_mask merged into attn_mask as one additive mask [N|1, H|1, L|1, S2] (keys appended by
// add_bias_kv / add_zero_attn get 0, as torch's pad(mask, (0, 1))); undefined when neither is given.
Tensor merge_masks(const MhaInputs& in, const Tensor& am, int64_t H, int64_t S2) {
  const Tensor& kpm = in.kpm;
  if (!am.defined() && !kpm.defined()) return Tensor();
  const int64_t N = in.N, L = in.L, S = in.S;
  const bool am3 = am.defined() && am.dim() == 3;
  const int64_t Nm = (am3 || kpm.defined()) ? N : 1, Hm = am3 ? H : 1, Lm = am.defined() ? L : 1;
  Tensor mask = Tensor::zeros({Nm, Hm, Lm, S2}, DType::F32);
  float* mp = mask.data<float>();
  const float* ap = am.defined() ? am.data<float>() : nullptr;
  const float* kp = kpm.defined() ? kpm.data<float>() : nullptr;
  for (int64_t n = 0; n < Nm; ++n) {
    for (int64_t h = 0; h < Hm; ++h) {
      for (int64_t i = 0; i < Lm; ++i) {
        float* row = mp + ((n * Hm + h) * Lm + i) * S2;
        const float* arow = ap ? ap + ((am3 ? n * H + h : 0) * L + i) * S : nullptr;
        for (int64_t j = 0; j < S; ++j) row[j] = (arow ? arow[j] : 0.0f) + (kp ? kp[n * S + j] : 0.0f);
      }
    }
  }
  return mask;
}

// Sparse Transformer's fixed pattern [nQB, nKB] at block granularity: a query block sees its own key
// block and every summary block (kb % stride == stride - 1), and a summary block also sees the blocks
// of its group (kb / stride == qb / stride), so that what a group holds reaches every query in two layers.
Tensor fixed_sparse_layout(int64_t L, int64_t S, int64_t block, int64_t stride) {
  const int64_t nq = (L + block - 1) / block, nk = (S + block - 1) / block;
  Tensor m = Tensor::zeros({nq, nk}, DType::Bool);
  auto* p = static_cast<uint8_t*>(m.raw_data());
  for (int64_t qb = 0; qb < nq; ++qb) {
    for (int64_t kb = 0; kb < nk; ++kb) p[qb * nk + kb] = kb == qb || kb % stride == stride - 1 ||
                                                                (qb % stride == stride - 1 && kb / stride == qb / stride);
  }
  return m;
}

class SoftmaxAttn final : public MhaAttention {
 public:
  explicit SoftmaxAttn(const AttentionVariant& v) : var_(v) {}

  void check_call(const MhaForwardArgs&) const override {}  // every mask; check_inputs checked their shapes

  DType activations(Precision p) const override {
    // A bf16 model keeps q, k, v and the attention output in bf16 (its bf16 kernel: AMX tiles where present).
    return p == Precision::BF16 ? DType::BF16 : DType::F32;
  }

  SdpaResult attend(const MhaInputs& in, const MhaForwardArgs& args, const MhaHeads& h, double dropout,
                    MhaTape* tape) const override {
    // Causal hint, as torch: is_causal with no key_padding_mask and no weights runs causal SDPA
    // and ignores attn_mask; otherwise attn_mask is used as given. Without attn_mask it means
    // causal attention (an extension: torch raises there).
    Tensor am = in.am;
    bool causal = false;
    if (args.is_causal) {
      if (!am.defined()) {
        causal = true;
      } else if (!in.kpm.defined() && !args.need_weights) {
        causal = true;
        am = Tensor();
      }
    }
    const int64_t H = h.q4.size(1), S2 = h.k4.size(2);
    SdpaOptions so;
    so.attn_mask = merge_masks(in, am, H, S2);
    so.is_causal = causal;
    so.relative_attention_bias = args.relative_attention_bias;
    so.relative_attention_max_distance = args.relative_attention_max_distance;
    so.dropout_p = dropout;
    so.need_weights = args.need_weights;
    if (var_.window >= 0) {
      so.window_left = var_.window;
      if (!causal) so.window_right = var_.window;
    }
    if (var_.sparse_block > 0) {
      so.block_mask = fixed_sparse_layout(in.L, S2, var_.sparse_block, var_.sparse_stride);
      so.block_size = var_.sparse_block;
    }
    so.head_mask = h.head_mask;
    SdpaResult r = sdpa_out(h.out4, h.q4, h.k4, h.v4, so);
    if (tape != nullptr) {  // the backward replays the same masks and dropout
      tape->sdpa = so;
      tape->sdpa.need_weights = false;
      tape->sdpa.dropout_seed = r.dropout_seed;
      tape->attention = r;
      tape->attention.weights = Tensor();
    }
    return r;
  }

  void backward(const MhaTape& t, const Tensor& dout4, const Tensor& dq4, const Tensor& dk4,
                const Tensor& dv4) const override {
    sdpa_backward_out(dq4, dk4, dv4, dout4, t.q4, t.k4, t.v4, t.attention, t.sdpa);
  }

 private:
  AttentionVariant var_;
};

class LinearAttn final : public MhaAttention {
 public:
  explicit LinearAttn(const AttentionVariant& v) : var_(v) {}

  void check_call(const MhaForwardArgs& args) const override {
    HEADS_CHECK(!args.attn_mask.defined(), kMhaOp,
                ": linear attention takes no attn_mask (is_causal selects its causal form; key_padding_mask ignores keys)");
    HEADS_CHECK(!args.key_padding_mask.defined() || args.key_padding_mask.dtype() == DType::Bool, kMhaOp,
                ": key_padding_mask: linear attention takes a bool mask (true = ignore the key); a float mask adds to "
                "softmax scores, which linear attention has none of");
    HEADS_CHECK(!args.relative_attention_bias.defined(), kMhaOp,
                ": linear attention takes no relative_attention_bias (it adds to softmax scores)");
  }

  DType activations(Precision) const override { return DType::F32; }

  // The gated-off heads of h.head_mask are computed (the linear kernel has no head mask), then their
  // weights zeroed as the softmax path's are. Linear attention has no dropout (the layer's stays on
  // its residual branches).
  SdpaResult attend(const MhaInputs& in, const MhaForwardArgs& args, const MhaHeads& h, double,
                    MhaTape* tape) const override {
    const int64_t H = h.q4.size(1), S2 = h.k4.size(2);
    HEADS_CHECK(!(args.is_causal && S2 != in.L), kMhaOp, ": causal linear attention needs as many keys as ",
                "queries, got ", in.L, " queries and ", S2, " keys",
                S2 != in.S ? " (with the appended bias_k / zero keys)" : "");
    LinearAttentionOptions lo;
    lo.feature_map = var_.feature_map;
    lo.causal = args.is_causal;
    if (args.key_padding_mask.defined()) {  // [N, S], the appended keys kept
      const Tensor kpm = in.batched ? args.key_padding_mask : args.key_padding_mask.unsqueeze(0);
      lo.key_padding_mask = Tensor::zeros({in.N, S2}, DType::Bool);
      lo.key_padding_mask.slice(1, 0, in.S).copy_from(kpm);
    }
    Tensor(h.out4).copy_from(heads::linear_attention(h.q4, h.k4, h.v4, lo));
    SdpaResult r;
    if (args.need_weights) r.weights = linear_attention_weights(h.q4, h.k4, lo);
    if (h.head_mask.defined() && args.need_weights) {
      const auto* on = static_cast<const uint8_t*>(h.head_mask.raw_data());
      for (int64_t n = 0; n < in.N; ++n) {
        for (int64_t hh = 0; hh < H; ++hh) {
          if (!on[n * H + hh]) r.weights.select(0, n).select(0, hh).copy_from(Tensor::zeros({in.L, S2}, DType::F32));
        }
      }
    }
    if (tape != nullptr) {
      tape->linear = true;
      tape->linear_options = lo;
    }
    return r;
  }

  void backward(const MhaTape& t, const Tensor& dout4, const Tensor& dq4, const Tensor& dk4,
                const Tensor& dv4) const override {
    const LinearAttentionGrads g = linear_attention_backward(dout4, t.q4, t.k4, t.v4, t.linear_options);
    Tensor(dq4).copy_from(g.dq);
    Tensor(dk4).copy_from(g.dk);
    Tensor(dv4).copy_from(g.dv);
  }

 private:
  AttentionVariant var_;
};

}  // namespace

std::shared_ptr<const MhaAttention> make_attention(const AttentionVariant& v) {
  if (v.kind == AttentionKind::Linear) return std::make_shared<const LinearAttn>(v);
  return std::make_shared<const SoftmaxAttn>(v);
}

}  // namespace heads::modules
