// sdpa_case.cc — inputs and descriptions of SDPA cases (sdpa_case.h).
#include "kernels/sdpa_case.h"

#include <random>
#include <sstream>

#include "heads/error.h"

namespace heads {

namespace {

// [B, H, L, D] of Normal(0, 1): contiguous, or a view of [B, L, H, D + pad] memory.
Tensor normal(std::mt19937_64& gen, int64_t B, int64_t H, int64_t L, int64_t D, int64_t pad, DType dtype) {
  Tensor t = Tensor::empty(pad > 0 ? Shape{B, L, H, D + pad} : Shape{B, H, L, D}, DType::F32);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = d(gen);
  if (dtype != DType::F32) t = t.to(dtype);
  return pad > 0 ? t.slice(3, 0, D).permute({0, 2, 1, 3}) : t;
}

}  // namespace

SdpaCase::Inputs SdpaCase::draw() const {
  HEADS_CHECK(B >= 1 && H >= 1 && Lq >= 0 && D >= 1 && kv_heads() >= 1 && key_len() >= 0 && value_dim() >= 1 &&
                  pad >= 0,
              "SdpaCase: sizes must be positive, got ", str());
  std::mt19937_64 gen(seed);
  Inputs in;
  in.q = normal(gen, B, H, Lq, D, pad, dtype);
  in.k = normal(gen, B, kv_heads(), key_len(), D, pad, dtype);
  in.v = normal(gen, B, kv_heads(), key_len(), value_dim(), pad, dtype);
  in.dout = normal(gen, B, H, Lq, value_dim(), 0, DType::F32);
  SdpaOptions& o = in.options;
  o.is_causal = causal;
  o.causal_align = causal_align;
  o.scale = scale;
  o.enable_gqa = kv_heads() != H;
  o.dropout_p = dropout_p;
  if (dropout_p > 0) o.dropout_seed = gen();
  if (mask != SdpaMask::None) {
    Tensor m = Tensor::empty({B, 1, Lq, key_len()}, mask == SdpaMask::Bool ? DType::Bool : DType::F32);
    if (mask == SdpaMask::Bool) {
      std::bernoulli_distribution keep(0.8);
      auto* p = static_cast<uint8_t*>(m.raw_data());
      for (int64_t i = 0; i < m.numel(); ++i) p[i] = keep(gen);
    } else {
      std::normal_distribution<float> d(0.0f, 1.0f);
      for (int64_t i = 0; i < m.numel(); ++i) m.data<float>()[i] = d(gen);
    }
    o.attn_mask = m;
  }
  return in;
}

double SdpaCase::forward_flops() const {
  const double f = 2.0 * static_cast<double>(B) * static_cast<double>(H) * static_cast<double>(Lq) *
                   static_cast<double>(key_len()) * static_cast<double>(D + value_dim());
  return causal ? f / 2 : f;
}

std::string SdpaCase::str() const {
  std::ostringstream os;
  os << "B=" << B << " H=" << H;
  if (kv_heads() != H) os << " Hkv=" << kv_heads();
  os << " Lq=" << Lq << " Lk=" << key_len() << " D=" << D;
  if (value_dim() != D) os << " Dv=" << value_dim();
  os << " " << dtype_name(dtype);
  if (causal) os << (causal_align == CausalAlign::BottomRight ? " causal-br" : " causal");
  if (mask != SdpaMask::None) os << " mask=" << (mask == SdpaMask::Bool ? "bool" : "float");
  if (scale) os << " scale=" << *scale;
  if (dropout_p > 0) os << " dropout=" << dropout_p;
  if (pad > 0) os << " pad=" << pad;
  os << " seed=" << seed;
  return os.str();
}

}  // namespace heads
