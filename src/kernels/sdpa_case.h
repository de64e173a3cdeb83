// sdpa_case.h — one SDPA call as a test or a benchmark states it: shapes, options, the memory
// layout of the inputs and the seed their values are drawn from. Printable, so a failing test or
// a benchmark line says exactly what ran; `heads bench sdpa` and the C++ SDPA tests build their
// calls from it. Not public API (the installed headers): the CLI and the tests read it from src/.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "heads/sdpa.h"
#include "heads/tensor.h"

namespace heads {

enum class SdpaMask { None, Bool, Float };

struct SdpaCase {
  int64_t B = 1, H = 1, Hkv = 0, Lq = 128, Lk = 0, D = 64, Dv = 0;  // Hkv, Lk, Dv: 0 = H, Lq, D
  DType dtype = DType::F32;  // of q, k, v (and dout)
  bool causal = false;
  CausalAlign causal_align = CausalAlign::TopLeft;
  SdpaMask mask = SdpaMask::None;  // [B, 1, Lq, Lk]: bool true with probability 0.8, or float N(0, 1)
  std::optional<double> scale;
  double dropout_p = 0.0;
  // > 0: q, k, v are [B, H, L, D] views of [B, L, H, D + pad] memory, the layout of a fused
  // projection's output; 0: contiguous [B, H, L, D].
  int64_t pad = 0;
  uint64_t seed = 1;  // q, k, v, dout, the mask and the dropout stream all follow from it

  int64_t kv_heads() const { return Hkv > 0 ? Hkv : H; }
  int64_t key_len() const { return Lk > 0 ? Lk : Lq; }
  int64_t value_dim() const { return Dv > 0 ? Dv : D; }

  struct Inputs {
    Tensor q, k, v, dout;  // dout: the gradient of out, [B, H, Lq, Dv] f32
    SdpaOptions options;   // mask, causal, scale, dropout (with its seed), enable_gqa
  };
  // Normal(0, 1) values from a generator seeded with `seed`: the same case gives the same inputs.
  Inputs draw() const;

  // Multiply-adds of the forward's two products, counted as 2 FLOPs each:
  // 2·B·H·Lq·Lk·(D + Dv), half of that when causal (the benchmark contract of DESIGN.md).
  double forward_flops() const;

  // "B=2 H=4 Hkv=1 Lq=129 Lk=64 D=63 Dv=66 f32 causal-br mask=bool dropout=0.2 pad=5 seed=7"
  // (options at their defaults are left out).
  std::string str() const;
};

}  // namespace heads
