// isa_amx_emu.cc — isa_amx.cc again with the tile instructions replaced by amx_emulator.h: the
// AMX kernels (sdpa_amx-inl.h, one text for both builds) run on a CPU without tiles, slowly and
// with the instructions' numerics, so that they are tested on any CPU with AVX-512 (F, BW, VL, DQ):
// this build leaves out AVX512_BF16 (its f32 -> bf16 conversions are integer operations with the
// instruction's bits, sdpa_amx_tiles-inl.h), so Skylake-SP and Cascade Lake run it too. Chosen as
// the `amx` ISA only with HEADS_AMX_EMULATE=1 on a CPU without usable AMX (dispatch.cc), and never
// by default: HEADS_ISA=amx, set_isa(Isa::Amx) or the tests' kernel_paths() select it.
#include <immintrin.h>

#include "kernels/amx_emulator.h"
#include "kernels/isa_build.h"

// GCC 12 warns about the intentionally undefined pass-through operand of _mm512_max_ps.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// ... and about the undefined operand _mm512_reduce_add_ps passes (_mm256_undefined_pd).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")

#define HEADS_AMX 1
#define HEADS_AMX_EMULATED 1
namespace heads::kernels::amx_emu {
constexpr Isa kIsa = Isa::Amx;
#include "kernels/simd/vec_avx512-inl.h"
#include "kernels/isa_table-inl.h"
}  // namespace heads::kernels::amx_emu
#undef HEADS_AMX_EMULATED
#undef HEADS_AMX

#pragma GCC pop_options
