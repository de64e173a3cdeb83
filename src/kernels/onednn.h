// onednn.h — one road to oneDNN's matmul for the GEMM entry points (linear.cc, linear_lowp.cc):
// C [M, N] = A [M, K] · B [K, N] (+ bias [N]) with element strides, in one of three type sets.
#pragma once

#include <cstdint>

namespace heads::kernels {

enum class MatmulTypes {
  F32,   // A, B, C, bias f32
  Bf16,  // A, B bf16; C, bias f32 (f32 accumulation)
  Bf16Out,  // A, B, C bf16; bias f32 (f32 accumulation, C rounded once)
  S8,    // A, B int8; C int32 (exact integer sums); no bias
};

struct MatmulCall {
  int64_t M, K, N;
  int64_t a_rs, a_cs, b_rs, b_cs, c_rs;  // element strides: A (row, column), B (row, column), C rows
  bool bias;
  int threads;
  MatmulTypes types;
};

// Runs the call (M, N, K >= 1); throws dnnl::error when oneDNN refuses it.
void onednn_matmul(const MatmulCall& call, const void* a, const void* b, const float* bias, void* c);

// Threads a GEMM of these sizes is worth (threads_for on its FLOPs, M and N the tasks).
int gemm_threads(int64_t M, int64_t N, int64_t K);

}  // namespace heads::kernels
