// isa_avx512bf16.cc — the AVX-512 kernels again, with AVX512_BF16 (vdpbf16ps) for bf16 SDPA.
// The best path on CPUs with AVX512_BF16 (HEADS_ISA=avx512bf16); f32 kernels as in isa_avx512.cc.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/scratch.h"
#include "kernels/simd/common.h"

// GCC 12 warns about the intentionally undefined pass-through operand of _mm512_max_ps.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// Vector arguments of the lambdas inside these kernels never cross an ABI boundary.
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi2")

#define HEADS_NATIVE_BF16 1
namespace heads::kernels::avx512bf16 {
#include "kernels/simd/vec_avx512-inl.h"
#include "kernels/sdpa_fwd-inl.h"
#include "kernels/elementwise-inl.h"
#include "kernels/peak-inl.h"

const KernelTable kTable{Isa::Avx512Bf16, &sdpa_fwd_f32, &sdpa_fwd_bf16, &sdpa_bwd_f32, &gelu_f32, &relu_f32, &layer_norm_f32, &add_f32, &activation_bwd_f32,
                        &fma_probe, &fma_probe_flops_per_iter,
                        &bf16_probe, &bf16_probe_flops_per_iter};
}  // namespace heads::kernels::avx512bf16
#undef HEADS_NATIVE_BF16

#pragma GCC pop_options
