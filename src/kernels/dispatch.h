// dispatch.h — CPU detection and the per-ISA kernel table.
//
// Each ISA build of the kernels (src/kernels/isa_<name>.cc: scalar, avx2, avx512, avx512bf16, amx on
// x86-64; neon, neonbf16 on AArch64) fills one table; the active table is chosen once from CPUID (the
// hardware capabilities on AArch64), or forced by HEADS_ISA=<name>
// (an error if this CPU cannot run it), or by heads::set_isa().
#pragma once

#include <cstdint>

#include "heads/runtime.h"
#include "kernels/sdpa_problem.h"

namespace heads::kernels {

class PackedB;  // onednn.h: a weight in oneDNN's own layout

// The most rows of x a call of KernelTable::gemv_f32 / gemv_bf16 takes.
constexpr int64_t kGemvRows = 4;

// One output row of an int8 linear layer (heads/precision.h) as quantize-inl.h's int8_rows_out reads it.
struct Int8Row {
  const int32_t* a;   // [n] Σ_k (first term)·W of the row
  const int32_t* a2;  // [n] Σ_k (second term)·W, or null when the row has none
  int32_t z;          // the first term's zero point
  float s, s2;        // the two terms' scales
  const int32_t* ws;  // [n] the weight rows' sums (exact)
  const float* sw;    // [n] the weight rows' scales
  const float* b;     // [n] bias, or null
  int64_t n;
  // The weight's residual rows (heads/precision.h) on oneDNN's GEMM and the portable loops, where a
  // and a2 are W's sums alone (heads' own GEMM reads the rows C in place of W: these stay null): the
  // sums of Wr with the first term a3 [Nr] and with the second a32 (null without one), and per
  // output shift [n] (p on a residual row, else 0), col [n] (its index in a3, else 0) and mask [n]
  // (~0 on a residual row, else 0), so that output n is that of the row 2^shift·W[n] + Wr[col] with
  // a3[col] & mask; ws and sw are then C's sums and scales on those rows (fold_ws, fold_sw).
  const int32_t* a3 = nullptr;
  const int32_t* a32 = nullptr;
  const int32_t* shift = nullptr;
  const int32_t* col = nullptr;
  const uint32_t* mask = nullptr;
  // The outlier channels oc [no] of the row x (f32) and W's columns there in panels of
  // kOutlierPanel outputs: wo[p, o, j] = W[p·kOutlierPanel + j, oc[o]] (zero past n).
  const float* x = nullptr;
  const int64_t* oc = nullptr;
  const float* wo = nullptr;
  int64_t no = 0;
};
constexpr int64_t kOutlierPanel = 16;  // a multiple of every vector width
// The second activation term's values are stored plus this, as unsigned bytes (quantize_rows_u8).
constexpr int32_t kSecondZero = 128;
// heads' own integer GEMM (gemm_i8-inl.h): a weight B [N, K] (int8, or the 16-bit rows of residual
// rows folded in: linear_lowp.h) packed in panels of kPairPanel output columns, panel p (columns
// [16p, 16p + 16), zeros past N), 64-byte aligned, in one of two layouts (KernelTable::int8_layout):
// - Int8Layout::Pairs16 (x86-64: vpmaddwd): [Kp][16][2] int16 with Kp = ceil(K / 2): element
//   [i][j][h] = B[16p + j][2i + h] (0 past K).
// - Int8Layout::Quads8 (AArch64 DOTPROD: SDOT multiplies signed bytes): a header of 128 bytes, then
//   two planes [Kq][16][4] int8 with Kq = ceil(K / 4): B = 256·H + L, L[i][j][h] the low byte of
//   B[16p + j][4i + h] as a signed byte and H the rest (0 unless the row is a folded 16-bit one).
//   The header: int32 [16] 128·Σ_k B[16p + j][k] (mod 2^32), the sums SDOT's signed activations
//   (a − 128) leave out, then int32 1 where the panel has an H plane to add (0: all zero). x86-64
//   AMX reads the same panels (gemm_i8_amx-inl.h: 16 groups of a plane are one tdpbusd B tile; u8
//   activations as they are, so the header's sums are not used there).
enum class Int8Layout : uint8_t { Pairs16, Quads8 };
constexpr int64_t kPairPanel = 16;
constexpr int64_t kQuadsHeader = 128;  // bytes before a Quads8 panel's planes
// Values of K per 32-bit lane of a panel (2 or 4); bytes of one panel of a weight of K columns (a
// group of K is 64 bytes: 16 lanes); bytes of a packed weight [N, K].
constexpr int64_t int8_group(Int8Layout layout) { return layout == Int8Layout::Pairs16 ? 2 : 4; }
constexpr int64_t int8_panel_bytes(Int8Layout layout, int64_t K) {
  const int64_t groups = (K + int8_group(layout) - 1) / int8_group(layout), plane = groups * 4 * kPairPanel;
  return layout == Int8Layout::Pairs16 ? plane : kQuadsHeader + 2 * plane;
}
constexpr int64_t int8_packed_bytes(Int8Layout layout, int64_t N, int64_t K) {
  return (N + kPairPanel - 1) / kPairPanel * int8_panel_bytes(layout, K);
}
// One product of that GEMM: C [M, N] (int32, row stride ldc) = A[0, M) · Bᵀ, B packed as above.
struct PairsProduct {
  const void* b;
  int64_t N;
  int64_t M;  // rows of A (at most the call's)
  int32_t* c;
  int64_t ldc;
};
// The output pass of an int8 linear layer fused into heads' own GEMM, for activation rows of one
// term (quantize-inl.h's int8_row_sums_out and int8_outliers_out, then the activation): y [M, N]
// (row stride ys) from the sums of row m and column n, y = fma(float(sum − z[m]·ws[n])·s[m], sw[n],
// b[n]), then y = fma(x[m, oc[o]], W[n, oc[o]], y) for the outlier channels in order (wo in
// Int8Row's panels), then act (0 none, 1 ReLU, 2 GELU, 3 GELU's tanh form).
struct PairsOut {
  float* y;
  int64_t ys;
  const int32_t* z;
  const float* s;
  const int32_t* ws;
  const float* sw;
  const float* b;  // or null
  const float* x;  // the rows of x (f32, row stride xs), read at the outlier channels
  int64_t xs;
  const int64_t* oc;
  const float* wo;
  int64_t no;
  int act;
};
// The candidate scales of an int8 weight row (int8_scale_errors): s·c for c = 1, 0.99, ..., 0.50.
constexpr int kInt8ScaleCandidates = 51;

struct KernelTable {
  Isa isa;
  // GEMMs through oneDNN (the SIMD paths) or portable loops (scalar): linear.cc, linear_lowp.cc.
  bool onednn;
  // Fused SDPA forward, f32: see sdpa_flash_fwd-inl.h.
  void (*sdpa_fwd_f32)(const SdpaProblem& pb, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& out, const Tensor& lse, const Tensor& weights);
  // The same with bf16 q, k, v, out (f32 accumulation).
  void (*sdpa_fwd_bf16)(const SdpaProblem& pb, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const Tensor& weights);
  // The decode kernel with k and v stored in another dtype than q (f32 or bf16): f32, bf16, or int8
  // with pb.k_scale / v_scale. Returns false, doing nothing, when the shape is not the decode
  // kernel's (too many queries); the caller then widens k and v.
  bool (*sdpa_decode_kv)(const SdpaProblem& pb, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& out, const Tensor& lse, const Tensor& weights);
  // SDPA backward (sdpa_bwd-inl.h): dout, q, k, v all f32 or all bf16 (out f32 or bf16); dq, dk, dv
  // all f32 or all bf16, any strides with a unit inner one, every element written (when B, H, Lq and Lk are positive);
  // dmask_full [B, H, Lq, Lk] or null; drel [H, pb.mods.rel_len] (zeroed by the caller) or null
  // receives dS summed along each i - j.
  void (*sdpa_bwd)(const SdpaProblem& pb, const Tensor& dout, const Tensor& q, const Tensor& k,
                   const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dq,
                   const Tensor& dk, const Tensor& dv, float* dmask_full, float* drel);
  // GEMMs (linear.h), M, N, K >= 1: oneDNN on the SIMD paths, the plain loops on the portable one.
  // linear_f32's packed: W in oneDNN's own layout (made at its first use), or null.
  void (*linear_f32)(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W,
                     const float* bias, int64_t N, float* y, int64_t y_stride, PackedB* packed);
  void (*matmul_f32)(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs,
                     const float* B, int64_t b_rs, int64_t b_cs, float* C, int64_t c_stride);
  // linear_f32 for a few rows on W [N, K] as stored, f32 or bf16 (widened exactly; x as given), 1 ≤ M ≤
  // kGemvRows (gemv-inl.h): the linear layers of a decoder's step, whose time is the weight's bytes;
  // null on the portable path.
  void (*gemv_f32)(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W, const float* bias,
                   int64_t N, float* y, int64_t y_stride) = nullptr;
  void (*gemv_bf16)(const uint16_t* x, int64_t M, int64_t K, int64_t x_stride, const uint16_t* W, const float* bias,
                    int64_t N, float* y, int64_t y_stride) = nullptr;
  // The same product on the calling thread with the register-blocked micro-kernels (gemm-inl.h), for
  // small products inside a kernel's own parallel loop (M, N, K >= 0).
  void (*small_matmul_f32)(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs,
                           const float* B, int64_t b_rs, int64_t b_cs, float* C, int64_t c_stride);
  // linear_f32 with every output a fixed-order sum over k, whatever the batch (gemm-inl.h): the
  // linear layers' GEMM under set_batch_invariant(true).
  void (*linear_f32_fixed_order)(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W,
                                 const float* bias, int64_t N, float* y, int64_t y_stride);
  // Elementwise (elementwise-inl.h): rows of n values, row strides xs / ys.
  void (*gelu_f32)(const float* x, float* y, int64_t rows, int64_t n, int64_t xs, int64_t ys,
                   bool tanh_form);
  void (*relu_f32)(const float* x, float* y, int64_t rows, int64_t n, int64_t xs, int64_t ys);
  // elu(x) + 1 (linear attention's feature map)
  void (*elu_plus_one_f32)(const float* x, float* y, int64_t rows, int64_t n, int64_t xs, int64_t ys);
  void (*layer_norm_f32)(const float* x, const float* res, float* y, int64_t rows, int64_t n,
                         int64_t xs, int64_t ys, const float* w, const float* b, float eps);
  void (*add_f32)(const float* a, const float* b, float* y, int64_t n);
  // y = act(gate) · up over rows of 2F values [gate | up] into rows of F; act 0 SiLU, 1 GELU (erf), 2 GELU (tanh).
  void (*gated_f32)(const float* gu, float* y, int64_t rows, int64_t F, int act);
  // y = x · rsqrt(mean(x²) + eps) · (w + off), rows of n values (the same bits on every path).
  void (*rms_norm_f32)(const float* x, float* y, int64_t rows, int64_t n, int64_t xs, int64_t ys, const float* w,
                       float off, double eps);
  // y = bf16(x) (f32_to_bf16's rounding), rows of n values, row strides xs / ys.
  void (*f32_to_bf16_rows)(const float* x, uint16_t* y, int64_t rows, int64_t n, int64_t xs, int64_t ys);
  // dx = dy · act'(x), n values; act 0 ReLU, 1 GELU (erf), 2 GELU (tanh form).
  void (*activation_bwd_f32)(const float* x, const float* dy, float* dx, int64_t n, int act);
  // Rows of x (times c per column, when given) as an asymmetric 8-bit term q [rows, n] (unsigned) with
  // scales s and zero points z [rows], and a second term r [rows, n] (signed, stored plus kSecondZero)
  // with scales sr [rows] (0: none) on the rows whose estimated error exceeds τ, tau2x12 = 12·τ²
  // (quantize-inl.h).
  void (*quantize_rows_u8)(const float* x, int64_t rows, int64_t n, int64_t xs, const float* c, double tau2x12,
                           uint8_t* q, float* s, int32_t* z, uint8_t* r, float* sr);
  // The scale search of an int8 weight row of K values w (linear_lowp_pack.cc), for the
  // kInt8ScaleCandidates scales t: err[i] = Σ_k (w[k] − clamp(round_even(w[k] / t[i]), ±127)·t[i])²
  // (quantize-inl.h).
  void (*int8_scale_errors)(const float* w, int64_t K, const float* t, double* err);
  // heads' own integer GEMM (gemm_i8-inl.h), for CPUs where oneDNN has no native int8 matmul: the
  // products parts[0, count) of one A [M, K] (uint8, row stride lda) with weights packed in
  // int8_layout, exact int32 sums (the bits of oneDNN's u8s8 matmul), M, K >= 1; null where the path
  // has none, and unusable where int8_gemm_usable says so (a CPU feature the path's build assumes).
  void (*gemm_u8s8_pairs)(const uint8_t* A, int64_t M, int64_t K, int64_t lda, const PairsProduct* parts,
                          int count) = nullptr;
  // The same for one product B [N, K] (packed) with the output pass fused in (PairsOut): its bits.
  void (*gemm_u8s8_pairs_out)(const uint8_t* A, int64_t M, int64_t K, int64_t lda, const void* B, int64_t N,
                              const PairsOut& out) = nullptr;
  Int8Layout int8_layout = Int8Layout::Pairs16;
  // C [M, N] (row stride ldc) = A [M, K] (uint8, row stride lda) · B [N, K]ᵀ with B int8 rows as stored,
  // exact int32 sums (the bits of the GEMMs above), the columns split among `threads`
  // (gemm_i8_rows-inl.h): the GEMM of a decoder's step on heads' route (a byte a weight read, not a
  // 16-bit pair); null on the portable path (its plain loops in linear_lowp_int8.cc).
  void (*gemm_u8s8_rows)(const uint8_t* A, int64_t M, int64_t K, int64_t lda, const int8_t* B, int64_t N,
                         int32_t* C, int64_t ldc, int threads) = nullptr;
  // The same through vpdpbusd (gemv-inl.h), where the path's build has it (the avx512bf16 and amx
  // paths; a CPU without AVX512_VNNI gets gemm_u8s8_rows): the int8 GEMM of calls of at most 4 rows
  // (8 with their second terms) on every route; null elsewhere.
  void (*gemv_u8s8)(const uint8_t* A, int64_t M, int64_t K, int64_t lda, const int8_t* B, int64_t N, int32_t* C,
                    int64_t ldc, int threads) = nullptr;
  // One output row of an int8 linear layer from its integer sums (quantize-inl.h).
  void (*int8_rows_out)(const Int8Row* rows, int64_t count, float* y, int64_t ys);  // row m into y + m·ys
  // FMA throughput probe (peak-inl.h): runs `iters` iterations of independent FMA chains.
  float (*fma_probe)(int64_t iters);
  int (*fma_probe_flops_per_iter)();
  // Memory read probe (peak-inl.h): the sum of n floats.
  float (*read_probe)(const float* x, int64_t n);
  // The same for the bf16 dot product (vdpbf16ps); null where the path has none.
  float (*bf16_probe)(int64_t iters) = nullptr;
  int (*bf16_probe_flops_per_iter)() = nullptr;
  // The same for AMX tiles (tdpbf16ps); null where the path has none.
  float (*tile_probe)(int64_t iters) = nullptr;
  int (*tile_probe_flops_per_iter)() = nullptr;
};

namespace scalar { extern const KernelTable kTable; }
namespace avx2 { extern const KernelTable kTable; }
namespace avx512 { extern const KernelTable kTable; }
namespace avx512bf16 { extern const KernelTable kTable; }  // avx512 + AVX512_BF16
namespace amx { extern const KernelTable kTable; }         // avx512bf16 + AMX-TILE, AMX-BF16
namespace amx_emu { extern const KernelTable kTable; }     // amx over the tile emulator (amx_emulator.h)
namespace neon { extern const KernelTable kTable; }        // AArch64 Advanced SIMD
namespace neonbf16 { extern const KernelTable kTable; }    // neon + FEAT_BF16 (BFDOT)

// Whether the CPU (and the OS, for AMX tiles; HEADS_AMX_EMULATE for the emulated amx) can run the
// ISA, whether or not this build has its kernels (isa_supported asks both).
bool cpu_runs(Isa isa);

// For tests: 1 runs the amx ISA over the tile emulator even where the tiles exist (so that the two
// can be compared), 0 never, -1 as HEADS_AMX_EMULATE says. Takes effect at the next set_isa().
void set_amx_emulation(int mode);

const KernelTable& active();
// The table of a path this CPU runs (null for one it cannot, or that this build left out).
const KernelTable* table_for(Isa isa);
// Whether path t's own int8 GEMM (gemm_u8s8_pairs) runs on this CPU: it exists, and the AArch64
// builds' (Int8Layout::Quads8: SDOT, compiled for FEAT_DotProd, optional before Armv8.4) find the
// feature in the kernel's hardware capabilities; the amx path's (tdpbusd) needs AMX-INT8 beside the
// tiles, or the tile emulator.
bool int8_gemm_usable(const KernelTable& t);

// Whether the avx512bf16 (neonbf16) path's bf16 attention uses vdpbf16ps (BFDOT) (true) or widens
// bf16 to f32 and runs the f32 products (false): set_bf16_attention_products's choice when forced,
// else HEADS_BF16_DOT=1|0 when set, else measured once (first call) on one thread: the dot product
// pays where its flops per second beat the f32 FMA's (Zen 4: about 2x; Intel Xeons: about 0.5x,
// where the amx path covers bf16 anyway; on AArch64 cores BFDOT's rate against FMLA's is measured
// the same way, none being at hand to state it). The two give the same results within
// bf16's rounding of P (docs/numerics.md).
bool bf16_dot_pays();

}  // namespace heads::kernels
