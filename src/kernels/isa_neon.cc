// isa_neon.cc — the kernels compiled for AArch64 Advanced SIMD (NEON, part of every AArch64 CPU).
#include <arm_neon.h>

#include "kernels/isa_build.h"

namespace heads::kernels::neon {
constexpr Isa kIsa = Isa::Neon;
#include "kernels/simd/vec_neon-inl.h"
#include "kernels/isa_table-inl.h"
}  // namespace heads::kernels::neon
