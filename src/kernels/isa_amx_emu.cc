// isa_amx_emu.cc — isa_amx.cc again with the tile instructions replaced by amx_emulator.h and the
// AVX-512 ones by avx512_on_avx2-inl.h: the AMX kernels (sdpa_amx-inl.h, one text for both builds)
// run on a CPU without tiles, slowly and with the instructions' numerics, so that they are tested on
// any x86-64 CPU with AVX2 and FMA (Zen 3 and Haswell as well as every AVX-512 CPU). Its f32 -> bf16
// conversions are the integer operations of bf16_round_avx512-inl.h (no AVX512_BF16). Chosen as the
// `amx` ISA only with HEADS_AMX_EMULATE=1 on a CPU without usable AMX (dispatch.cc), and never by
// default: HEADS_ISA=amx, set_isa(Isa::Amx) or the tests' kernel_paths() select it.
#include <immintrin.h>

#include "kernels/amx_emulator.h"
#include "kernels/isa_build.h"

// The vector types' may_alias attribute is not part of a template argument (avx512_on_avx2-inl.h),
// and GCC 12 takes registers filled under a condition (sdpa_amx_rows-inl.h's x[]) for uninitialised
// once they are arrays in memory.
#pragma GCC diagnostic ignored "-Wignored-attributes"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")

#define HEADS_AMX 1
#define HEADS_AMX_EMULATED 1
#define HEADS_AVX512_ON_AVX2 1
namespace heads::kernels::amx_emu {
constexpr Isa kIsa = Isa::Amx;
#include "kernels/simd/avx512_on_avx2-inl.h"
#include "kernels/simd/vec_avx512-inl.h"
#include "kernels/isa_table-inl.h"
}  // namespace heads::kernels::amx_emu
#undef HEADS_AVX512_ON_AVX2
#undef HEADS_AMX_EMULATED
#undef HEADS_AMX

#pragma GCC pop_options
