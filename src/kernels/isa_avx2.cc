// isa_avx2.cc — the kernels compiled for AVX2 + FMA.
#include <immintrin.h>

#include "kernels/isa_build.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")

namespace heads::kernels::avx2 {
constexpr Isa kIsa = Isa::Avx2;
#include "kernels/simd/vec_avx2-inl.h"
#include "kernels/isa_table-inl.h"
}  // namespace heads::kernels::avx2

#pragma GCC pop_options
