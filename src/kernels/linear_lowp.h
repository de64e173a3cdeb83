// linear_lowp.h — what the reduced-precision linear layers' two files share: the packing of weights
// (linear_lowp_pack.cc) and the calls (linear_lowp.cc).
#pragma once

#include <cstdint>

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

}  // namespace heads::lowp
