// isa_table-inl.h — the kernels of one ISA build and its KernelTable, written once.
//
// Included by src/kernels/isa_<isa>.cc inside namespace heads::kernels::<isa>, after that ISA's
// vector layer (kernels/simd/vec_<isa>-inl.h) and a `constexpr Isa kIsa`; HEADS_NATIVE_BF16 adds
// the vdpbf16ps kernels, HEADS_AMX the AMX-tile bf16 attention. Adding an ISA is one such file (see docs/architecture.md).

#include "kernels/sdpa_paths-inl.h"
#include "kernels/elementwise-inl.h"
#include "kernels/peak-inl.h"
#include "kernels/quantize-inl.h"
#include "kernels/gemm_i8_rows-inl.h"
#include "kernels/gemv-inl.h"
#if defined(HEADS_I16_PAIRS)
#include "kernels/gemm_i8-inl.h"
#ifdef HEADS_AMX
#include "kernels/gemm_i8_amx-inl.h"  // the tiles' integer GEMM in place of the 16-bit pairs' (tdpbusd)
#endif
#elif defined(HEADS_I8_QUADS)
// SDOT is FEAT_DotProd's (optional from Armv8.2): only this GEMM is compiled for it (HEADS_DOTPROD_PUSH,
// the ISA file's), and it runs only where the CPU has it (kernels::int8_gemm_usable); the rest of the
// build keeps its own target.
HEADS_DOTPROD_PUSH
#include "kernels/gemm_i8-inl.h"
#pragma GCC pop_options
#endif

const KernelTable kTable{
    .isa = kIsa,
    .onednn = kIsa != Isa::Scalar,
    .sdpa_fwd_f32 = &sdpa_fwd_f32,
    .sdpa_fwd_bf16 = &sdpa_fwd_bf16,
    .sdpa_decode_kv = &sdpa_decode_kv,
    .sdpa_bwd = &sdpa_bwd,
    // The portable path is portable C++ throughout, its GEMMs included.
    .linear_f32 = kIsa == Isa::Scalar ? &linear_f32_plain : &linear_f32_onednn,
    .matmul_f32 = kIsa == Isa::Scalar ? &matmul_f32_plain : &matmul_f32_onednn,
    .gemv_f32 = kIsa == Isa::Scalar ? nullptr : &gemv_f32,  // (the portable path's -O2 leaves it scalar)
    .gemv_bf16 = kIsa == Isa::Scalar ? nullptr : &gemv_bf16,
    .small_matmul_f32 = &small_matmul_f32,
    .linear_f32_fixed_order = &gemm::linear_f32_fixed_order,
    .gelu_f32 = &gelu_f32,
    .relu_f32 = &relu_f32,
    .elu_plus_one_f32 = &elu_plus_one_f32,
    .layer_norm_f32 = &layer_norm_f32,
    .add_f32 = &add_f32,
    .gated_f32 = &gated_f32,
    .rms_norm_f32 = &rms_norm_f32,
    .f32_to_bf16_rows = &f32_to_bf16_rows,
    .activation_bwd_f32 = &activation_bwd_f32,
    .quantize_rows_u8 = &quantize_rows_u8,
    .int8_scale_errors = &int8_scale_errors,
#if defined(HEADS_AMX)
    .gemm_u8s8_pairs = &gemm_u8s8_tiles,
    .gemm_u8s8_pairs_out = &gemm_u8s8_tiles_out,
    .int8_layout = Int8Layout::Quads8,
#elif defined(HEADS_I16_PAIRS) || defined(HEADS_I8_QUADS)
    .gemm_u8s8_pairs = &gemm_u8s8_pairs,
    .gemm_u8s8_pairs_out = &gemm_u8s8_pairs_out,
    .int8_layout = gemm_i8::Dots::kLayout,
#endif
    .gemm_u8s8_rows = kIsa == Isa::Scalar ? nullptr : &gemm_u8s8_rows,  // -O2 there: see linear_lowp_int8.cc
#ifdef HEADS_VNNI
    .gemv_u8s8 = &gemv_u8s8,
#endif
    .int8_rows_out = &int8_rows_out,
    .fma_probe = &fma_probe,
    .fma_probe_flops_per_iter = &fma_probe_flops_per_iter,
    .read_probe = &read_probe,
#ifdef HEADS_NATIVE_BF16
    .bf16_probe = &bf16_probe,
    .bf16_probe_flops_per_iter = &bf16_probe_flops_per_iter,
#endif
#if defined(HEADS_AMX) && !defined(HEADS_AMX_EMULATED)  // no throughput to measure in the emulator
    .tile_probe = &amx::tile_probe,
    .tile_probe_flops_per_iter = &amx::tile_probe_flops_per_iter,
#endif
};
#undef HEADS_I16_PAIRS
#undef HEADS_I16_PAIRS_ACCUMULATE6
#undef HEADS_I8_QUADS
