// isa_avx2.cc — the kernels compiled for AVX2 + FMA.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/scratch.h"
#include "kernels/simd/common.h"

// Vector arguments of the lambdas inside these kernels never cross an ABI boundary.
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")

namespace heads::kernels::avx2 {
#include "kernels/simd/vec_avx2-inl.h"
#include "kernels/sdpa_fwd-inl.h"
#include "kernels/elementwise-inl.h"
#include "kernels/peak-inl.h"

const KernelTable kTable{Isa::Avx2, &sdpa_fwd_f32, &sdpa_fwd_bf16, &sdpa_bwd_f32, &gelu_f32, &relu_f32, &layer_norm_f32, &add_f32, &activation_bwd_f32,
                        &fma_probe, &fma_probe_flops_per_iter};
}  // namespace heads::kernels::avx2

#pragma GCC pop_options
