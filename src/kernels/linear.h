// linear.h — y = x Wᵀ + b in f32 (torch.nn.functional.linear), W stored [N, K] as torch does.
#pragma once

#include <cstdint>

namespace heads::kernels {

// x: M rows of K (row stride x_stride, unit inner stride); W: [N, K] contiguous; bias: N or null;
// y: M rows of N (row stride y_stride). Runs oneDNN's matmul on all threads.
void linear_f32(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W,
                const float* bias, int64_t N, float* y, int64_t y_stride);

// C [M, N] = A [M, K] · B [K, N] with element strides (row, column) for A and B (any layout,
// e.g. a transposed view, without a copy); C rows of stride c_stride. oneDNN matmul, all threads.
void matmul_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs,
                const float* B, int64_t b_rs, int64_t b_cs, float* C, int64_t c_stride);

}  // namespace heads::kernels

namespace heads::kernels {
// The obvious version (one dot product per output), for tests and as the specification.
void linear_f32_plain(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W,
                      const float* bias, int64_t N, float* y, int64_t y_stride);
}  // namespace heads::kernels
