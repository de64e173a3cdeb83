// onednn.h — one road to oneDNN's matmul for the GEMM entry points (linear.cc, linear_lowp.cc):
// C [M, N] = A [M, K] · B [K, N] (+ bias [N]) with element strides, in one of three type sets.
#pragma once

#include <cstdint>
#include <memory>

namespace heads::kernels {

enum class MatmulTypes {
  F32,   // A, B, C, bias f32
  Bf16,  // A, B bf16; C, bias f32 (f32 accumulation)
  Bf16Out,  // A, B, C bf16; bias f32 (f32 accumulation, C rounded once)
  U8S8,  // A uint8, B int8; C int32 (exact integer sums); no bias
};

struct MatmulCall {
  int64_t M, K, N;
  int64_t a_rs, a_cs, b_rs, b_cs, c_rs;  // element strides: A (row, column), B (row, column), C rows
  bool bias;
  int threads;
  MatmulTypes types;
};

// B in the layouts oneDNN's matmul picks for itself, made once from one constant B and kept: with B
// given in a plain layout, oneDNN copies it into its own layout at every call, which at a decoder's
// one or two rows costs several times the product (int8 [2048, 6144]: 0.65 against 0.10 ms).
// Shared by the copies of a weight (heads::PackedLinear); thread-safe.
class PackedB {
 public:
  PackedB();
  ~PackedB();
  PackedB(const PackedB&) = delete;
  PackedB& operator=(const PackedB&) = delete;
  struct Impl;

 private:
  friend void onednn_matmul(const MatmulCall&, const void*, const void*, const float*, void*, PackedB*);
  std::unique_ptr<Impl> impl_;
};

// Runs the call (M, N, K >= 1); throws dnnl::error when oneDNN refuses it. With `packed` (for a B
// that never changes while it lives), B is read through its layouts there.
void onednn_matmul(const MatmulCall& call, const void* a, const void* b, const float* bias, void* c,
                   PackedB* packed = nullptr);

// Threads a GEMM of these sizes is worth (threads_for on its FLOPs, M and N the tasks).
int gemm_threads(int64_t M, int64_t N, int64_t K);

}  // namespace heads::kernels
