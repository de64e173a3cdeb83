// sdpa_flash_fwd.h — fused f32 SDPA forward (online softmax over key blocks).
#pragma once

#include "kernels/sdpa_problem.h"

namespace heads::kernels {

// q/k/v/out have unit innermost stride. lse [B, H, Lq] contiguous; weights [B, H, Lq, Lk]
// contiguous when P.need_weights, else undefined.
void sdpa_flash_fwd_f32(const SdpaProblem& P, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const Tensor& weights);

}  // namespace heads::kernels
