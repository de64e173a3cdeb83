// linear_lowp.h — what the reduced-precision linear layers' files share: the packing of weights
// (linear_lowp_pack.cc), the calls (linear_lowp.cc) and the int8 call (linear_lowp_int8.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>

#include "heads/ops.h"
#include "heads/precision.h"
#include "kernels/dispatch.h"
#include "kernels/onednn.h"

namespace heads::lowp {

// Blocks of rows for the GEMMs whose row count varies (the second terms, the weight's residual rows):
// one primitive shape for a range of counts instead of one per count (oneDNN creates each shape once,
// in milliseconds). The weight's residual rows are padded to a multiple of it once, when packed.
constexpr int64_t kRowBlock = 32;
// The int8 GEMMs' rows are padded to a multiple of this (linear_lowp.cc: fewer shapes to compile).
constexpr int64_t kShapeStep = 8;

// Whether oneDNN has a native matmul for the precision on this CPU (its own detection, which
// DNNL_MAX_CPU_ISA can lower). Without VNNI (vpdpbusd) its int8 GEMM sums pairs of u8·s8 products in
// saturating int16 (vpmaddubsw), which values of full 8-bit range overflow (measured with
// DNNL_MAX_CPU_ISA=AVX2: results off by 10%); without AVX512_BF16 its bf16 matmul is emulated or
// absent.
bool onednn_native(Precision p);

// Whether a weight of this precision must keep its value in f32 for the f32 route
// (heads/precision.h) on some kernel path this CPU runs: bf16 without a native matmul; int8 without
// one where some SIMD path lacks heads' integer GEMM.
bool needs_f32_copy(Precision p);

// An int8 weight in a layout of heads' own integer GEMM (kernels/dispatch.h: Int8Layout): W [N, K]
// with its residual rows folded in (heads/precision.h: row rows[j] is C = 2^shift[j]·W[rows[j]] +
// Wr[j], 16 bits), packed at the first call of get() for that layout and kept: shared by the copies
// of a PackedLinear, thread-safe.
class PairsB {
 public:
  const void* get(kernels::Int8Layout layout, const int8_t* W, int64_t N, int64_t K, const int8_t* Wr,
                  const int32_t* rows, const int32_t* shift, int64_t Nr);

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::once_flag once_[2];
  std::unique_ptr<void, Free> w_[2];
};

// B [N, K] (int8, or 16-bit values: at most 256·127 + 127 in Quads8) into dst in the layout
// (kernels::int8_packed_bytes(layout, N, K) bytes, 64-byte aligned).
void pack_int8_gemm(kernels::Int8Layout layout, const int8_t* B, int64_t N, int64_t K, void* dst);
void pack_int8_gemm(kernels::Int8Layout layout, const int16_t* B, int64_t N, int64_t K, void* dst);

// Working memory of one call, left uninitialised (every element is written before it is read).
template <class T>
class Buffer {
 public:
  explicit Buffer(int64_t n) : p_(new T[static_cast<size_t>(n)]) {}
  T* data() const { return p_.get(); }
  T& operator[](int64_t i) const { return p_[static_cast<size_t>(i)]; }

 private:
  std::unique_ptr<T[]> p_;
};

enum class Route { Native, Heads, F32, Portable };  // linear_gemm_route's answers
Route route_of(Precision p);
// The route of an int8 call through a weight of this activation_error: route_of's, but heads' tile
// GEMM on the amx path for one-term rows (activation_error ∞; linear_lowp.cc says why).
Route int8_route(double activation_error);

// oneDNN's matmul for a bf16 / int8 call; false where oneDNN turns out to have none for this CPU after
// all (the caller's portable loops then run), any other failure an error naming the shapes.
bool native_matmul(const char* precision, const kernels::MatmulCall& call, const void* a, const void* b,
                   const float* bias, void* c, kernels::PackedB* packed);

// y [M, N] (stride ys; f32, or bf16 when y_bf16) = xf [M, K] (contiguous) Wfᵀ + bias through the f32
// GEMM: the route of a CPU without a native bf16 / int8 matmul.
void linear_wide(const float* xf, int64_t M, int64_t K, const float* Wf, const float* bias, int64_t N, void* y,
                 bool y_bf16, int64_t ys);

// act (when given) on `rows` rows of n values (row stride ys) in place, by the kernel table's
// elementwise ops: each value's bits as activation() gives them.
void apply_activation(std::optional<Activation> act, float* y, int64_t rows, int64_t n, int64_t ys);

// An int8 weight as linear_int8 reads it: W [N, K] with scales sw [N] and row sums ws [N] (Σ_k W[n, k],
// exact), and the residual term's Nr rows Wr [Nr, K] with scales swr [Nr] = sw / 2^rshift and sums
// wrs [Nr], for the outputs rrows[j] (heads/precision.h).
struct Int8Weight {
  const int8_t* W;
  const float* sw;
  const int32_t* ws;
  int64_t N;
  // sw and ws with the residual rows folded in (C's scales and sums there): heads' own GEMM's
  const float* fold_sw = nullptr;
  const int32_t* fold_ws = nullptr;
  const int8_t* Wr = nullptr;
  const float* swr = nullptr;
  const float* wrs = nullptr;
  const int32_t* rrows = nullptr;
  const int32_t* rshift = nullptr;  // p of each residual row (its scale is the row's / 2^p)
  int64_t Nr = 0;
  // Per output, for the output pass of oneDNN's GEMM and the portable loops (kernels::Int8Row): p on a
  // residual row, else 0; its index among them, else 0; ~0 on one, else 0.
  const int32_t* fold_shift = nullptr;
  const int32_t* fold_col = nullptr;
  const uint32_t* fold_mask = nullptr;
  const float* wide = nullptr;  // the whole weight in f32 (dequantize), for the f32 route
  // The outlier channels oc [no] (heads/precision.h), W's columns there in panels (kernels::Int8Row), and
  // keep [K]: 0 on them, 1 elsewhere (the int8 term's view of x).
  const int64_t* oc = nullptr;
  const float* wo = nullptr;
  const float* keep = nullptr;
  int64_t no = 0;
  double act_error = 0;
  // With residual rows, W's rows followed by Wr's and zero rows to a multiple of kRowBlock (Nrp in all):
  // [N + Nrp, K], W its first N rows (oneDNN's route and the portable loops run one GEMM over it).
  const int8_t* W_stacked = nullptr;
  kernels::PackedB* packed = nullptr;      // W (W_stacked with residual rows) in oneDNN's layouts
  lowp::PairsB* pairs = nullptr;           // W and Wr in heads' GEMM's layout
};

// y [M, N] (row stride ys) = x [M, K] (row stride xs) through the int8 weight w, bias and act
// (linear_lowp_int8.cc).
void linear_int8(const float* x, int64_t M, int64_t K, int64_t xs, const Int8Weight& w, const float* bias, float* y,
                 int64_t ys, std::optional<Activation> act);

}  // namespace heads::lowp
