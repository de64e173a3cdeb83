// isa_avx512bf16.cc — the AVX-512 kernels again, with AVX512_BF16 (vdpbf16ps) for bf16 SDPA.
// The best path on CPUs with AVX512_BF16 (HEADS_ISA=avx512bf16); f32 kernels as in isa_avx512.cc.
#include <immintrin.h>

#include "kernels/isa_build.h"

// GCC 12 warns about the intentionally undefined pass-through operand of _mm512_max_ps.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// ... and about the undefined operand _mm512_reduce_add_ps passes (_mm256_undefined_pd).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi2")

#define HEADS_NATIVE_BF16 1
#define HEADS_VNNI_KEYS 1  // int8 keys of the decode through vpdpbusd where the CPU has AVX512_VNNI
#define HEADS_VNNI 1  // the int8 GEMM of a few rows through vpdpbusd where the CPU has AVX512_VNNI
namespace heads::kernels::avx512bf16 {
constexpr Isa kIsa = Isa::Avx512Bf16;
#include "kernels/simd/vec_avx512-inl.h"
#include "kernels/isa_table-inl.h"
}  // namespace heads::kernels::avx512bf16
#undef HEADS_NATIVE_BF16
#undef HEADS_VNNI_KEYS
#undef HEADS_VNNI

#pragma GCC pop_options
