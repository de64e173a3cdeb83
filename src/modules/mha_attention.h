// mha_attention.h — the attention inside MultiheadAttention, chosen once when the module is built
// (AttentionVariant::kind): softmax SDPA (torch's causal hint, the merged masks, windows, block
// layouts, dropout) or linear attention. Each refuses the call options its kind cannot take, writes
// the heads' output, keeps in the tape what its backward needs, and runs that backward.
// (mha_attention.cc; the module around it: mha.cc, mha_backward.cc.)
#pragma once

#include <memory>

#include "heads/mha.h"
#include "heads/precision.h"
#include "heads/sdpa.h"

namespace heads::modules {

// The name errors of nn.MultiheadAttention's calls begin with.
constexpr const char* kMhaOp = "MultiheadAttention";

// A module call's inputs after _mha_shape_check: [d0, d1, width] f32 views in the inputs' own row
// order ([L, N] or [N, L]; unbatched [L, 1]), their sizes, and the masks as additive f32 tensors.
struct MhaInputs {
  bool batched, batch_first, self_attn;
  Tensor xq, xk, xv;
  int64_t N, L, S;
  Tensor kpm, am;  // key_padding_mask [N|-, S], attn_mask [L, S] or [N·H, L, S]; 0 / -inf for bool
  // [N, T, width] view of a [d0, d1, width] tensor.
  Tensor nle(const Tensor& x3) const { return batch_first ? x3 : x3.transpose(0, 1); }
};

// One call's heads: q4 [N, H, L, hd], k4 / v4 [N, H, S2, hd] (with the keys add_bias_kv /
// add_zero_attn append), out4 [N, H, L, hd] to write; head_mask [N, H] bool (false: the head is
// skipped, its output zero) or undefined.
struct MhaHeads {
  Tensor q4, k4, v4, out4, head_mask;
};

class MhaAttention {
 public:
  virtual ~MhaAttention() = default;
  // Checks the call's options against what this kind takes, before any work.
  virtual void check_call(const MhaForwardArgs& args) const = 0;
  // The dtype of q, k, v and the attention output in a module of precision p.
  virtual DType activations(Precision p) const = 0;
  // Attention into h.out4, with dropout p `dropout`; the weights [N, H, L, S2] when args ask for
  // them. `tape` (training), when given, receives this kind's part (its fields start at defaults).
  virtual SdpaResult attend(const MhaInputs& in, const MhaForwardArgs& args, const MhaHeads& h, double dropout,
                            MhaTape* tape) const = 0;
  // From d(out4) of a call whose tape is `t`: d(q4), d(k4), d(v4) written into dq4, dk4, dv4
  // (S2 keys each).
  virtual void backward(const MhaTape& t, const Tensor& dout4, const Tensor& dq4, const Tensor& dk4,
                        const Tensor& dv4) const = 0;
};

// The attention of a module with variant `v` (v.kind chooses it).
std::shared_ptr<const MhaAttention> make_attention(const AttentionVariant& v);

}  // namespace heads::modules
