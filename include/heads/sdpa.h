// sdpa.h — scaled dot-product attention, as torch.nn.functional.scaled_dot_product_attention.
//
//   out = softmax(q kᵀ · scale + mask) v,   scale = 1/√D unless given
//
// Shapes (strided views; the innermost stride of q, k, v should be 1, others are free):
//   q [B, H, Lq, D]   k [B, Hkv, Lk, D]   v [B, Hkv, Lk, Dv]   ->   out [B, H, Lq, Dv]
//   H % Hkv == 0 (grouped-query attention: query head h reads key/value head h / (H / Hkv));
//   Hkv != H needs enable_gqa, as in torch.
// Masks (torch SDPA semantics):
//   attn_mask bool: true = may attend.  attn_mask float: added to the scaled scores.
//   Either broadcasts from its trailing dims to [B, H, Lq, Lk] (e.g. [Lq, Lk], [B, 1, Lq, Lk]).
//   is_causal: key j is visible to query i iff j <= i (top-left, as torch) or
//   j <= i + Lk - Lq (bottom-right, CausalAlign::BottomRight). May be combined with attn_mask.
// A query row that can see no key gives a zero output row and zero weights (torch gives NaN).
// Dropout (dropout_p > 0) drops attention weights with probability p and scales the kept ones
// by 1/(1-p); the mask is a pure function of (seed, b, h, i, j), so results do not depend on
// threads or tiling and the same seed gives the same result.
// Position and score modifiers, computed inside the fused kernels (never an Lq x Lk tensor). With
// a = 0 (top-left) or Lk - Lq (bottom-right, causal_align), query i sits at key position i + a:
//   window_left / window_right (-1 = unbounded): key j is visible iff i + a - window_left <= j <=
//     i + a + window_right (flash-attn's window_size, which always aligns bottom-right: use
//     CausalAlign::BottomRight for its meaning when Lq != Lk); is_causal is window_right = 0. A sliding
//     window of W keys as Mistral / Gemma 2 / transformers' sliding_window is window_left = W - 1
//     with is_causal. Blocks of keys outside every row's window are skipped, not computed.
//   softcap > 0: the scaled score t becomes softcap · tanh(t / softcap) (Gemma 2), before masks
//     and biases are added.
//   alibi_slopes [H]: adds -slope_h · |i + a - j| (ALiBi; flash-attn's alibi_slopes with bottom-right
//     alignment; for causal
//     rows the same softmax as BLOOM's slope · j). heads::alibi_slopes(H) gives the standard ones.
//   relative_attention_bias [num_buckets, H]: adds table[bucket(j - i - a), h], T5's bucketing
//     (bidirectional or causal, relative_attention_max_distance), as transformers' T5Attention.
//     T5 does not scale its scores: pass scale = 1.
//   block_mask [nQB, nKB] or [H, nQB, nKB] bool, with block_size: query i may see key j only if
//     block (i / block_size, j / block_size) is true (block-sparse attention, as FlexAttention's
//     BlockMask); nQB = ceil(Lq / block_size), nKB = ceil(Lk / block_size). Key blocks a query
//     tile cannot see are skipped.
//   sinks [H]: a learned logit per head (in the units of the scaled scores) that joins every
//     row's softmax denominator with no value (gpt-oss): rows sum to less than 1, lse includes it,
//     and a row that sees no key gives zeros with lse = sink.
// head_mask [B, H] or [H] bool (true = computed): a head that is off is not computed at all (no
//   work in any kernel); its output and weights are exactly zero and its lse is -inf. Its backward
//   gives zero dq and adds nothing to dk, dv (dynamic head gating / pruning at inference).
#pragma once

#include <cstdint>
#include <optional>

#include "heads/tensor.h"

namespace heads {

enum class CausalAlign { TopLeft, BottomRight };

struct SdpaOptions {
  Tensor attn_mask;  // undefined = no mask; bool or floating dtype
  bool is_causal = false;
  CausalAlign causal_align = CausalAlign::TopLeft;
  std::optional<double> scale;  // default 1/sqrt(D)
  double dropout_p = 0.0;
  std::optional<uint64_t> dropout_seed;  // default: heads::next_seed()
  bool need_weights = false;             // also return the [B, H, Lq, Lk] attention weights
  bool enable_gqa = false;               // allow Hkv != H
  int64_t window_left = -1;              // keys left of the diagonal a row sees (-1: all)
  int64_t window_right = -1;             // keys right of the diagonal a row sees (-1: all)
  double softcap = 0.0;                  // > 0: scores become softcap · tanh(score / softcap)
  Tensor alibi_slopes;                   // [H] floating: ALiBi bias -slope_h · distance
  Tensor relative_attention_bias;        // [num_buckets, H] floating: T5 relative position bias
  int64_t relative_attention_max_distance = 128;
  bool relative_attention_bidirectional = true;  // false: T5 decoder (causal) bucketing
  Tensor sinks;                          // [H] floating: attention-sink logits
  Tensor block_mask;                     // [nQB, nKB] or [H, nQB, nKB] bool: block-sparse layout
  int64_t block_size = 128;              // queries and keys per block of block_mask
  Tensor head_mask;                      // [B, H] or [H] bool: heads computed (false: skipped, zero)
  // For the backward: k and v are one block of a longer key sequence, and fwd.out / fwd.lse passed to
  // the backward are those of the whole sequence (as sdpa_merge_ builds them). The gradients are
  // then this block's share: dk, dv of its keys, and a dq to be summed over the blocks (ring and
  // blockwise attention). Positions are the block's own: is_causal, attn_mask and block_mask apply
  // as given (slice them for the block); sinks, ALiBi, a relative bias, windows and dropout are refused.
  bool partial_keys = false;
  // int8 keys and values (a quantised KV cache, forward only): with k and v int8, key j of (b, hk) is
  // k[b, hk, j, :] · k_scale[b, hk, j], and likewise for v (f32 [B, Hkv, Lk], any strides).
  // heads::quantize_kv makes both from floats. k and v of a dtype other than q's (bf16 or int8 with
  // an f32 or bf16 q) are read in place by the decode kernel (few queries); more queries attend
  // their values widened to q's dtype. The output has q's dtype.
  Tensor k_scale, v_scale;
};

// Rows quantised for an int8 KV cache: x [..., n] floating -> values int8 [..., n] and scales f32
// [...], scale = max |x_row| / 127 (0 for a row of zeros), values = round-to-nearest-even(x / scale),
// so that values · scale is within scale / 2 of x. One scale per row (per token and key/value head
// for a [B, Hkv, L, D] tensor). NaN or infinite input is an error.
struct Int8Rows {
  Tensor values, scales;
};
Int8Rows quantize_kv(const Tensor& x);
// values [..., n] int8 times scales [...] (f32, any strides): f32 [..., n].
Tensor dequantize_kv(const Tensor& values, const Tensor& scales);

// The ALiBi slopes of an H-head model (Press et al.; BLOOM's build_alibi_tensor, also for H not a
// power of two), f32 [H].
Tensor alibi_slopes(int64_t num_heads);

// T5's relative position bucket of relative_position = key position - query position.
int64_t t5_relative_bucket(int64_t relative_position, bool bidirectional, int64_t num_buckets,
                           int64_t max_distance);

struct SdpaResult {
  Tensor out;      // [B, H, Lq, Dv], dtype of q
  Tensor weights;  // [B, H, Lq, Lk] f32 (after dropout), only with need_weights
  Tensor lse;      // [B, H, Lq] f32 log-sum-exp of the masked, scaled scores (-inf: fully masked)
  uint64_t dropout_seed = 0;  // the dropout stream used (pass it to the backward)
};

// Attention over the union of two disjoint key sets, from attention over each: with a = (out,
// lse) and b = (out_b, lse_b) as sdpa returns them,
//   lse <- log(e^lse + e^lse_b),  out <- (e^lse · out + e^lse_b · out_b) / (e^lse + e^lse_b),
// row by row, in place (out: f32 [B, H, Lq, Dv] with a unit inner stride; lse: f32 [B, H, Lq]
// contiguous). A row that neither part saw (lse = -inf in both) stays zeros with lse = -inf. out_b
// may be f32 or bf16. This is how blockwise and ring attention combine the blocks of keys.
void sdpa_merge_(const Tensor& out, const Tensor& lse, const Tensor& out_b, const Tensor& lse_b);

struct SdpaGrads {
  Tensor dq, dk, dv;  // f32, shapes of q, k, v (dk/dv summed over the query heads of a group)
  Tensor dmask;       // gradient of a float attn_mask, in the mask's shape (when requested)
  Tensor dsinks;                   // f32 [H], when the options have sinks
  Tensor drelative_attention_bias;  // f32 [num_buckets, H], when they have a relative bias table
};

// Fused forward: online softmax over key blocks; allocates no Lq x Lk buffer unless
// need_weights. Inputs f32 or bf16 (bf16 products, f32 softmax and accumulation); f16 and f64
// inputs are converted to f32, computed there, and the output converted back to their dtype (so
// f64 results carry f32 precision, about 1e-7 relative). Throws heads::Error on bad input,
// naming argument and shapes.
SdpaResult sdpa(const Tensor& q, const Tensor& k, const Tensor& v, const SdpaOptions& opts = {});

// As sdpa, writing the output into `out` ([B, H, Lq, Dv] f32, any strides with innermost 1),
// e.g. a [B, Lq, H, Dv] buffer viewed with permute(0, 2, 1, 3). result.out aliases `out`.
SdpaResult sdpa_out(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v,
                    const SdpaOptions& opts = {});

// Backward of sdpa (FlashAttention-2, arXiv:2307.08691, Alg. 2): scores and probabilities are
// recomputed block by block from q, k and fwd.lse, so no Lq x Lk buffer exists unless the mask
// gradient is requested. `fwd` is the forward's result for the same inputs and options (its lse
// and dropout seed are used). f32 inputs; bf16, f16 and f64 (q, k, v and dout alike) are computed in
// f32 — gradients accumulated in f32 and rounded once — and returned in that dtype.
SdpaGrads sdpa_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const SdpaResult& fwd, const SdpaOptions& opts = {}, bool mask_grad = false);

// As sdpa_backward for f32 inputs, or bf16 ones (q, k, v, dout and fwd.out all bf16, read widened),
// writing the gradients into dq, dk, dv (f32, or for bf16 inputs also bf16, all three alike: f32
// sums rounded once; the shapes of q, k, v, any strides with innermost 1, not overlapping each
// other or the inputs), e.g. views into the gradient buffer of a fused projection. The result's
// tensors alias them.
SdpaGrads sdpa_backward_out(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                            const Tensor& q, const Tensor& k, const Tensor& v, const SdpaResult& fwd,
                            const SdpaOptions& opts = {}, bool mask_grad = false);

namespace ref {
// Backward specification in float64 (recomputes the forward; dropout_seed must be set when
// dropout_p > 0).
SdpaGrads sdpa_bwd_f64(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                       const SdpaOptions& opts = {}, bool mask_grad = false);

// The specification: float64 throughout, full score matrix, plain softmax. Accepts any floating
// dtype; returns out, weights (always) and lse as f64 tensors.
SdpaResult sdpa_fwd_f64(const Tensor& q, const Tensor& k, const Tensor& v,
                        const SdpaOptions& opts = {});
}  // namespace ref

}  // namespace heads
