// linear.h — the GEMMs: y = x Wᵀ + b in f32 (torch.nn.functional.linear, W stored [N, K] as torch
// does) and a strided C = A·B. Both go through the kernel table (dispatch.h): oneDNN's matmul on the
// SIMD paths, the plain loops below on the portable (scalar) path, so HEADS_ISA=scalar runs whole
// models without oneDNN and the tests can hold one against the other.
#pragma once

#include <cstdint>

namespace heads::kernels {

// x: M rows of K (row stride x_stride, unit inner stride); W: [N, K] contiguous; bias: N or null;
// y: M rows of N (row stride y_stride). Empty sizes handled here; then the active path.
// packed (optional): W in oneDNN's own layout, made at its first use (onednn.h's PackedB), read in
// place of W by oneDNN's route, which then need not lay W out again at every call.
class PackedB;
void linear_f32(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W,
                const float* bias, int64_t N, float* y, int64_t y_stride, PackedB* packed = nullptr);

// C [M, N] = A [M, K] · B [K, N] with element strides (row, column) for A and B (any layout,
// e.g. a transposed view, without a copy); C rows of stride c_stride.
void matmul_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs,
                const float* B, int64_t b_rs, int64_t b_cs, float* C, int64_t c_stride);

// The table entries (M, N, K >= 1). oneDNN (JIT GEMM with its own ISA dispatch; threads by
// threads_for) for the SIMD paths, reading W through `packed` where given:
void linear_f32_onednn(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W,
                       const float* bias, int64_t N, float* y, int64_t y_stride, PackedB* packed);
void matmul_f32_onednn(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs,
                       const float* B, int64_t b_rs, int64_t b_cs, float* C, int64_t c_stride);
// The obvious loops (one f32 dot product per output, k in order) for the portable path (W as it
// is; `packed`, oneDNN's layout, unused):
void linear_f32_plain(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W,
                      const float* bias, int64_t N, float* y, int64_t y_stride, PackedB* packed);
void matmul_f32_plain(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs,
                      const float* B, int64_t b_rs, int64_t b_cs, float* C, int64_t c_stride);

}  // namespace heads::kernels
