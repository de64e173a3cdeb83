// isa_avx512.cc — the kernels compiled for AVX-512 (F, BW, VL, DQ) + FMA.
#include <immintrin.h>

#include "kernels/isa_build.h"

// GCC 12 warns about the intentionally undefined pass-through operand of _mm512_max_ps.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// ... and about the undefined operand _mm512_reduce_add_ps passes (_mm256_undefined_pd).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")

namespace heads::kernels::avx512 {
constexpr Isa kIsa = Isa::Avx512;
#include "kernels/simd/vec_avx512-inl.h"
#include "kernels/isa_table-inl.h"
}  // namespace heads::kernels::avx512

#pragma GCC pop_options
