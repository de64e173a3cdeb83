// precision.h — reduced-precision inference for the linear layers (projections and feed-forward):
// a weight prepared once for a precision, and the linear op that runs it.
//
//   F32   y = x Wᵀ + b                                           (as torch.nn.functional.linear)
//   BF16  y = bf16(x) bf16(W)ᵀ + b, products summed in f32, y in f32 (or rounded once to bf16)
//   Int8  dynamic quantization, symmetric, integer products: W row n ≈ Wq[n]·sw[n] once (per output
//         channel; sw[n] = c·max|W[n,:]| / 127 with c in {1, 0.99, ..., 0.5} the least squared
//         error, values past ±127 steps clipped); at every call each row of x in two int8 terms,
//         x[m] ≈ xq[m]·sx[m] + rq[m]·sr[m]: q(v) = round(v · (1/s)), s = max|v| / 127 (1 when that is
//         below 127·FLT_MIN), first of x, then of
//         its residual r = x − xq·sx (one fused multiply-add; about 15 bits in all: one int8 step on activations lost 0.3%
//         of cosine on all-MiniLM-L6-v2, the residual term wins it back);
//         y[m, n] = (Σ_k xq·Wq · sx + Σ_k rq·Wq · sr) · sw[n] + b[n], sums exact in int32
//         (K ≤ 2^31 / 127² = 133,144). A row of x holding NaN or ±inf gives a NaN row.
// Rounding is to nearest even everywhere. In a bf16 MultiheadAttention q, k, v and the attention
// output are bf16 and attention runs its bf16 kernel (f32 softmax and sums, P rounded to bf16);
// otherwise attention, LayerNorm, softmax and activations stay f32.
#pragma once

#include <cstdint>
#include <string>

#include "heads/tensor.h"

namespace heads {

enum class Precision { F32, BF16, Int8 };

std::string precision_name(Precision p);            // "f32", "bf16", "int8"
Precision precision_from_name(const std::string& s);  // throws heads::Error naming the choices

// A linear layer's weight [N, K] prepared for a precision: F32 an f32 copy, BF16 a bf16 copy, Int8
// the int8 rows and their f32 scales, always in memory of its own (never a view of the caller's).
// Immutable once made; copies share storage.
class PackedLinear {
 public:
  PackedLinear() = default;
  // weight: a floating [N, K] tensor (any strides).
  PackedLinear(const Tensor& weight, Precision precision);
  // Int8 from stored parts (e.g. weights saved from data() and scales()): data i8 [N, K], scales f32 [N],
  // finite and positive; errors name `name`.
  static PackedLinear from_int8(const Tensor& data, const Tensor& scales, const std::string& name);

  bool defined() const { return data_.defined(); }
  Precision precision() const { return precision_; }
  int64_t out_features() const { return data_.size(0); }
  int64_t in_features() const { return data_.size(1); }
  const Tensor& data() const { return data_; }      // f32, bf16 or i8 [N, K], contiguous
  const Tensor& scales() const { return scales_; }  // Int8: f32 [N]; otherwise undefined
  // Output channels [n0, n1): a view sharing storage (e.g. the q, k, v parts of in_proj_weight).
  PackedLinear rows(int64_t n0, int64_t n1) const;

 private:
  Precision precision_ = Precision::F32;
  Tensor data_, scales_;
};

// The weight as f32 [N, K]: F32 as it is, BF16 widened, Int8 data[n, k] · scales[n] (rounded once).
Tensor dequantize(const PackedLinear& w);

// y [..., N] = x [..., K] through w (above) + bias [N]; x floating, read as f32 (bf16 x with a bf16
// weight is read as it is). y is f32, or bf16 (`out`, with a bf16 weight only: the f32 sums rounded
// once, as a bf16 model's activations are).
Tensor linear(const Tensor& x, const PackedLinear& w, const Tensor& bias = {}, DType out = DType::F32);

}  // namespace heads
