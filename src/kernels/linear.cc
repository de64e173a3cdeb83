// linear.cc — the GEMMs (linear.h): oneDNN's matmul (JIT GEMM with runtime ISA dispatch) for the
// SIMD paths, the plain loops for the portable one, and the entry points that pick by the kernel table.
//
// W is stored [N, K] as torch stores it; oneDNN reads it as a [K, N] matrix with strides {1, K},
// so no copy is made. The primitives live in onednn.cc.
#include "kernels/linear.h"

#include <algorithm>
#include <oneapi/dnnl/dnnl.hpp>

#include "heads/error.h"
#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/onednn.h"

namespace heads::kernels {

void linear_f32(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W,
                const float* bias, int64_t N, float* y, int64_t y_stride, PackedB* packed) {
  HEADS_DCHECK(M >= 0 && K >= 0 && N >= 0);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) y[m * y_stride + n] = bias ? bias[n] : 0.0f;
    }
    return;
  }
  if (batch_invariant()) return active().linear_f32_fixed_order(x, M, K, x_stride, W, bias, N, y, y_stride);
  // A few rows (a decoder's step): the weight as stored, its bytes read once (gemv-inl.h); oneDNN's
  // matmul had read them at half the memory's speed.
  if (M <= kGemvRows && active().gemv_f32 != nullptr) return active().gemv_f32(x, M, K, x_stride, W, bias, N, y, y_stride);
  active().linear_f32(x, M, K, x_stride, W, bias, N, y, y_stride, packed);
}

void matmul_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs,
                const float* B, int64_t b_rs, int64_t b_cs, float* C, int64_t c_stride) {
  HEADS_DCHECK(M >= 0 && K >= 0 && N >= 0);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t m = 0; m < M; ++m) std::fill(C + m * c_stride, C + m * c_stride + N, 0.0f);
    return;
  }
  active().matmul_f32(M, N, K, A, a_rs, a_cs, B, b_rs, b_cs, C, c_stride);
}

void linear_f32_onednn(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W,
                       const float* bias, int64_t N, float* y, int64_t y_stride, PackedB* packed) {
  try {
    // W [N, K] read as the [K, N] matrix Wᵀ: strides {1, K}.
    onednn_matmul({M, K, N, x_stride, 1, 1, K, y_stride, bias != nullptr, gemm_threads(M, N, K), MatmulTypes::F32}, x, W,
                  bias, y, packed);
  } catch (const dnnl::error& e) {
    fail("linear: oneDNN matmul failed for x [", M, ", ", K, "] and weight [", N, ", ", K,
         "]: ", e.what());
  }
}

void matmul_f32_onednn(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs,
                       const float* B, int64_t b_rs, int64_t b_cs, float* C, int64_t c_stride) {
  try {
    onednn_matmul({M, K, N, a_rs, a_cs, b_rs, b_cs, c_stride, false, gemm_threads(M, N, K), MatmulTypes::F32}, A, B,
                  nullptr, C);
  } catch (const dnnl::error& e) {
    fail("matmul: oneDNN matmul failed for [", M, ", ", K, "] x [", K, ", ", N, "]: ", e.what());
  }
}

void matmul_f32_plain(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs,
                      const float* B, int64_t b_rs, int64_t b_cs, float* C, int64_t c_stride) {
  const int threads = gemm_threads(M, N, K);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += A[m * a_rs + k * a_cs] * B[k * b_rs + n * b_cs];
      C[m * c_stride + n] = acc;
    }
  }
}

void linear_f32_plain(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W,
                      const float* bias, int64_t N, float* y, int64_t y_stride, PackedB* /*packed: oneDNN's*/) {
  matmul_f32_plain(M, N, K, x, x_stride, 1, W, 1, K, y, y_stride);  // W [N, K] read as Wᵀ [K, N]
  if (bias == nullptr) return;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) y[m * y_stride + n] += bias[n];
  }
}

}  // namespace heads::kernels
