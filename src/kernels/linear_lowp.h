// linear_lowp.h — what the reduced-precision linear layers' two files share: the packing of weights
// (linear_lowp_pack.cc) and the calls (linear_lowp.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>

#include "heads/precision.h"

namespace heads::lowp {

// Blocks of rows for the GEMMs whose row count varies (the second terms, the weight's residual rows):
// one primitive shape for a range of counts instead of one per count (oneDNN creates each shape once,
// in milliseconds). The weight's residual rows are padded to a multiple of it once, when packed.
constexpr int64_t kRowBlock = 32;
// The int8 GEMMs' rows are padded to a multiple of this (linear_lowp.cc: fewer shapes to compile).
constexpr int64_t kShapeStep = 8;

// Whether oneDNN has a native matmul for the precision on this CPU (its own detection, which
// DNNL_MAX_CPU_ISA can lower). Without VNNI (vpdpbusd) its int8 GEMM sums pairs of u8·s8 products in
// saturating int16 (vpmaddubsw), which values of full 8-bit range overflow (measured with
// DNNL_MAX_CPU_ISA=AVX2: results off by 10%); without AVX512_BF16 its bf16 matmul is emulated or
// absent.
bool onednn_native(Precision p);

// Whether a weight of this precision must keep its value in f32 for the f32 route
// (heads/precision.h) on some kernel path this CPU runs: bf16 without a native matmul; int8 without
// one where some SIMD path lacks heads' integer GEMM.
bool needs_f32_copy(Precision p);

// An int8 weight in the layout of heads' own integer GEMM (kernels/dispatch.h: kPairPanel): W [N, K]
// with its residual rows folded in (heads/precision.h: row rows[j] is C = 2^shift[j]·W[rows[j]] +
// Wr[j], 16 bits), packed at the first call of get() and kept: shared by the copies of a
// PackedLinear, thread-safe.
class PairsB {
 public:
  const int16_t* get(const int8_t* W, int64_t N, int64_t K, const int8_t* Wr, const int32_t* rows,
                     const int32_t* shift, int64_t Nr);

 private:
  struct Free {
    void operator()(int16_t* p) const;
  };
  std::once_flag once_;
  std::unique_ptr<int16_t[], Free> w_;
};

// B [N, K] (int8, or int16 values) into dst, kernels::kPairPanel's layout (pairs_size(N, K) values,
// 64-byte aligned).
int64_t pairs_size(int64_t N, int64_t K);
void pack_pairs(const int8_t* B, int64_t N, int64_t K, int16_t* dst);
void pack_pairs(const int16_t* B, int64_t N, int64_t K, int16_t* dst);

}  // namespace heads::lowp
