// isa_scalar.cc — the portable kernels: plain C++ over an 8-lane array type, no intrinsics.
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

namespace heads::kernels::scalar {
#include "kernels/simd/vec_scalar-inl.h"
#include "kernels/sdpa_fwd-inl.h"
#include "kernels/elementwise-inl.h"
#include "kernels/peak-inl.h"

const KernelTable kTable{Isa::Scalar, &sdpa_fwd_f32, &sdpa_fwd_bf16, &sdpa_bwd_f32, &gelu_f32, &relu_f32, &layer_norm_f32, &add_f32, &activation_bwd_f32,
                        &fma_probe, &fma_probe_flops_per_iter};
}  // namespace heads::kernels::scalar
