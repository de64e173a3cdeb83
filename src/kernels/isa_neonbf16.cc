// isa_neonbf16.cc — the NEON kernels again, with BFDOT (FEAT_BF16: Neoverse V1 / V2 / N2, Graviton 3
// and 4, Apple M2 on) for bf16 SDPA where it pays (bf16_dot_pays()); f32 kernels as in isa_neon.cc.
#include <arm_neon.h>

#include "kernels/isa_build.h"

#pragma GCC push_options
// +fp16 too: GCC 12 materialises some bf16 vector constants with FP16's `fmov v.8h, #imm` (every
// core with FEAT_BF16 has FEAT_FP16 as well; isa_supported checks both).
// +dotprod: FEAT_DotProd for the int8 GEMM (every core with FEAT_BF16, an Armv8.6 feature, has it: it
// is mandatory from Armv8.4).
#pragma GCC target("arch=armv8.2-a+fp16+bf16+dotprod")
#define HEADS_DOTPROD_PUSH _Pragma("GCC push_options")  // the whole file's target has it

#define HEADS_NATIVE_BF16 1
namespace heads::kernels::neonbf16 {
constexpr Isa kIsa = Isa::NeonBf16;
#include "kernels/simd/vec_neon-inl.h"
#include "kernels/isa_table-inl.h"
}  // namespace heads::kernels::neonbf16
#undef HEADS_NATIVE_BF16
#undef HEADS_DOTPROD_PUSH

#pragma GCC pop_options
