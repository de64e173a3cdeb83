// isa_neon.cc — the kernels compiled for AArch64 Advanced SIMD (NEON, part of every AArch64 CPU).
#include <arm_neon.h>

#include "kernels/isa_build.h"

// The int8 GEMM's target (isa_table-inl.h): Armv8.2 with FEAT_DotProd, which only Armv8.2 cores on have.
// (GCC 12 takes no "+dotprod" alone in a target pragma.)
#define HEADS_DOTPROD_PUSH _Pragma("GCC push_options") _Pragma("GCC target(\"arch=armv8.2-a+dotprod\")")
namespace heads::kernels::neon {
constexpr Isa kIsa = Isa::Neon;
#include "kernels/simd/vec_neon-inl.h"
#include "kernels/isa_table-inl.h"
}  // namespace heads::kernels::neon
#undef HEADS_DOTPROD_PUSH
