// isa_amx.cc — the AVX-512 + AVX512_BF16 kernels again, with AMX tiles (tdpbf16ps) for bf16 SDPA
// (sdpa_amx-inl.h). The best path on CPUs with AMX-BF16 whose OS grants the tile state
// (HEADS_ISA=amx); f32 kernels as in isa_avx512.cc. Where a bf16 product does not go through the
// tiles (decode shapes), bf16 is widened to f32: on these CPUs vdpbf16ps runs at half the f32 FMA
// rate per flop (`heads bench peak`), so the vdpbf16ps kernels would be slower than widening (the
// avx512bf16 path measures this: bf16_dot_pays()).
#include <immintrin.h>

#include "kernels/isa_build.h"

// GCC 12 warns about the intentionally undefined pass-through operand of _mm512_max_ps.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// ... and about the undefined operand _mm512_reduce_add_ps passes (_mm256_undefined_pd).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi2,amx-tile,amx-bf16,amx-int8")

#define HEADS_NATIVE_BF16 1  // compiled for the vdpbf16ps probe of `heads bench peak`
#define HEADS_AMX 1
#define HEADS_VNNI_KEYS 1  // int8 keys of the decode through vpdpbusd where the CPU has AVX512_VNNI
#define HEADS_VNNI 1  // the int8 GEMM of a few rows through vpdpbusd where the CPU has AVX512_VNNI
namespace heads::kernels::amx {
constexpr Isa kIsa = Isa::Amx;
#include "kernels/simd/vec_avx512-inl.h"
#include "kernels/isa_table-inl.h"
}  // namespace heads::kernels::amx
#undef HEADS_AMX
#undef HEADS_NATIVE_BF16
#undef HEADS_VNNI_KEYS
#undef HEADS_VNNI

#pragma GCC pop_options
