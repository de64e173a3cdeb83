// precision.h — reduced-precision inference for the linear layers (projections and feed-forward):
// a weight prepared once for a precision, and the linear op that runs it.
//
//   F32   y = x Wᵀ + b                                           (as torch.nn.functional.linear)
//   BF16  y = bf16(x) bf16(W)ᵀ + b, products summed in f32, y in f32 (or rounded once to bf16)
//   Int8  dynamic quantization, integer products: W row n ≈ Wq[n]·sw[n] once (symmetric, per output
//         channel; sw[n] = c·max|W[n,:]| / 127 with c in {1, 0.99, ..., 0.5} the least squared
//         error, values past ±127 steps clipped); at every call each row of x asymmetric,
//         x[m] ≈ (xq[m] − z[m])·sx[m] with sx = (max(0, max x) − min(0, min x)) / 255 and the zero
//         point z chosen so that 0 is exact (xq, z int8: 255 steps over the row's range; 1 for a row
//         whose range is below 255·FLT_MIN), and a second symmetric term of the residual r = x −
//         (xq − z)·sx: x[m] ≈ (xq − z)·sx + rq·sr, sr = max|r| / 127 (about 15 bits in all), on every
//         row, or, with a weight's activation_error τ > 0, on the rows whose rounding is estimated to
//         lose more than τ of their norm (sqrt(K / (12·Σ (xq − z)²)), from the exact integer sum). Then
//         y[m, n] = (Σ_k (xq − z)·Wq · sx + Σ_k rq·Wq · sr) · sw[n] + b[n], sums exact in int32
//         (K ≤ 2^31 / (255·127) = 66,313). A row of x holding NaN or ±inf gives a NaN row.
//         Weight rows whose rounding loses more than kInt8ResidualError of the row's norm
//         (heavy-tailed rows, where a few large weights set a coarse step, and the upper tail of
//         ordinary ones) carry a second int8 term, the residual of the first on the finer step
//         swr[j] = sw[n] / 2^p: W[n] ≈ Wq[n]·sw[n] + Wr[j]·swr[j] = C·swr[j] for n = residual_rows[j],
//         with the integer row C = 2^p·Wq[n] + Wr[j], Wr = clamp(round(r / swr), ±127): of
//         p = 8, ..., 0 (kInt8MaxResidualShift) those whose C is 16-bit with 255·Σ_k |C_k| < 2^31
//         (int8_residual_fits: every sum of u8·C products then fits int32), the one of least squared
//         error (the finest of equals). Such a row's output is that of the row C with scale swr: y[m, n] = (Σ_k (xq − z)·C
//         · sx + Σ_k rq·C · sr) · swr[j] + b[n], its sums exact. In all-MiniLM-L6-v2 these are 62–90%
//         of the feed-forward output rows and 5–26% of the others (docs/numerics.md). The threshold
//         is the weight's residual_error (kInt8ResidualError unless given; a calibrated model's
//         d_model-wide layers take none: kInt8ModelWidthResidualError).
//         Outlier channels: given the largest |x| of each input channel on calibration inputs, the
//         channels whose largest exceeds kInt8OutlierRatio times the median channel's (at most K/16
//         of them, the largest) are taken out of the int8 product and computed in f32:
//         y[m, n] += Σ_o x[m, o]·W[n, o] over them, W's columns as they are. Neither the activation
//         rows' ranges nor the weight rows' scales then see them (activations carry a few such
//         channels: LayerNorm outputs and the feed-forward's hidden units), so that one int8 term per
//         row mostly suffices: the calibrated encoders' weights take activation_error
//         kInt8OutlierActivationError; calibrated decoders (CausalLM) keep two terms and the residual
//         rows unless asked otherwise (docs/decoders.md).
// Rounding is to nearest even everywhere. In a bf16 MultiheadAttention q, k, v and the attention
// output are bf16 and attention runs its bf16 kernel (f32 softmax and sums, P rounded to bf16);
// otherwise attention, LayerNorm, softmax and activations stay f32.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "heads/ops.h"
#include "heads/tensor.h"

namespace heads {

namespace kernels {
class PackedB;
}
namespace lowp {
class PairsB;
}

enum class Precision { F32, BF16, Int8 };

// A weight row whose int8 rounding loses more than this fraction of its norm gets the residual term.
// Rows of Gaussian weights lose 0.6–1.0% (K from 384 to 4096; all-MiniLM-L6-v2's median row 0.76%):
// the upper tail of those gets it too, which the worst embeddings need (docs/numerics.md).
constexpr double kInt8ResidualError = 0.009;
// The residual term's step is the row's step / 2^p, p ≤ this (above).
constexpr int kInt8MaxResidualShift = 8;
// Whether the row C = 2^p·q + r of a weight row q and its residual r (K values each) is 16-bit and
// keeps 255·Σ_k |C_k| within int32 (above).
bool int8_residual_fits(const int8_t* q, const int8_t* r, int64_t K, int p);

// int8's outlier channels (above): an input channel whose calibrated largest |x| exceeds this many
// times the median channel's is computed in f32; and the activation_error τ of weights calibrated so:
// infinite, one int8 term per activation row (docs/numerics.md has how both were chosen).
constexpr double kInt8OutlierRatio = 3.0;
constexpr double kInt8OutlierActivationError = std::numeric_limits<double>::infinity();
// The residual_error of calibrated weights (outlier channels, one activation term) by what they read:
// an encoder's feed-forward output (the activation function's output, K = 4·d_model) keeps
// kInt8ResidualError; the weights that read d_model-wide rows (q/k/v, attention output, feed-forward
// input) take none: on all-MiniLM-L6-v2 their residual rows bought no accuracy that counts and cost a
// tenth of the embedding's time on VNNI (docs/numerics.md).
constexpr double kInt8ModelWidthResidualError = std::numeric_limits<double>::infinity();

// Per linear layer, by the weight's parameter name, the largest |x| seen in each input channel on
// calibration inputs (f32 [in]): what int8's outlier channels need (BertModel::input_ranges gathers them).
using InputRanges = std::map<std::string, Tensor>;

std::string precision_name(Precision p);            // "f32", "bf16", "int8"
Precision precision_from_name(const std::string& s);  // throws heads::Error naming the choices

// A linear layer's weight [N, K] prepared for a precision: F32 an f32 copy, BF16 a bf16 copy, Int8
// the int8 rows and their f32 scales, always in memory of its own (never a view of the caller's).
// Immutable once made; copies share storage.
// On a CPU where oneDNN has no native int8 matmul (no VNNI: its int8 GEMM there sums u8·s8 pairs in
// saturating int16, which full-range values overflow), int8 runs heads' own integer GEMM on the x86
// SIMD paths (16-bit pairs, exact int32 sums: the same bits as oneDNN's native one). Where oneDNN
// has no native matmul for bf16 (no AVX512_BF16 or AMX: emulated), or for int8 on a path without
// heads' GEMM (AArch64 today), the weight also keeps its value in f32 and linear() runs the f32 GEMM
// on the same rounded operands: bf16 gives the native products summed in another order; int8
// multiplies x's two terms summed back, xq·sx + rq·sr, by the dequantized weight, so it also keeps
// the product of the activations' and the weight's residuals that the integer GEMM drops (smaller
// than either rounding). Results stay within the error model above, at about f32's speed
// (linear_gemm_route says which route runs).
class PackedLinear {
 public:
  PackedLinear() = default;
  // weight: a floating [N, K] tensor (any strides). activation_error (Int8): the estimated loss of an
  // activation row's first term past which the row gets the second (above); 0, the default: every
  // row gets both; +inf: none does (docs/numerics.md has what larger values cost and gain).
  // input_absmax (Int8; optional): the largest |x| of each input channel on calibration inputs, a
  // floating [K] tensor of finite values ≥ 0; when given, the outlier channels it shows are computed
  // in f32 (above). residual_error (Int8): the fraction of a weight row's norm its rounding may lose
  // before the row gets the residual term (above); +inf: no row does.
  PackedLinear(const Tensor& weight, Precision precision, double activation_error = 0,
               const Tensor& input_absmax = {}, double residual_error = kInt8ResidualError);
  // Int8 from stored parts (e.g. weights saved from data() and scales()): data i8 [N, K], scales f32 [N],
  // finite and positive; the residual term, when given: residual_rows i64 [N'] increasing in [0, N),
  // residual_data i8 [N', K] and residual_scales f32 [N'] finite and positive, each sw[row] / 2^p as
  // above (a residual of another scale, as heads before 2026-12 stored it, is quantized again as the
  // constructor quantizes one: on the step sw / 2^p of least squared error that fits); the outlier channels, when
  // given: outlier_channels i64 [O] increasing in [0, K) (data's columns there are zero) and
  // outlier_weight f32 [N, O] finite; activation_error as the constructor's. Errors name `name`.
  static PackedLinear from_int8(const Tensor& data, const Tensor& scales, const std::string& name,
                                const Tensor& residual_rows = {}, const Tensor& residual_data = {},
                                const Tensor& residual_scales = {}, const Tensor& outlier_channels = {},
                                const Tensor& outlier_weight = {}, double activation_error = 0);

  // An f32 weight [N, K] (contiguous) as it is, sharing its storage: the GEMM reads it through its own
  // layout (made at first use, beside it: as much memory again), instead of laying it out again at
  // every call (oneDNN's route; 6% of an f32 sentence embedding on an AMD Zen 4). For weights that
  // no longer change (a loaded model's): a change to its values afterwards is not seen by that layout.
  static PackedLinear f32_shared(const Tensor& weight);

  bool defined() const { return data_.defined(); }
  double activation_error() const { return act_error_; }
  Precision precision() const { return precision_; }
  int64_t out_features() const { return data_.size(0); }
  int64_t in_features() const { return data_.size(1); }
  const Tensor& data() const { return data_; }      // f32, bf16 or i8 [N, K], contiguous
  const Tensor& scales() const { return scales_; }  // Int8: f32 [N]; otherwise undefined
  // Int8's second term (above); undefined when no row has one.
  const Tensor& residual_rows() const { return res_rows_; }      // i64 [N'], increasing
  const Tensor& residual_data() const { return res_data_; }      // i8 [N', K]
  const Tensor& residual_scales() const { return res_scales_; }  // f32 [N']
  // Int8's outlier channels (above), computed in f32: i64 [O], increasing, and W's columns there,
  // f32 [N, O]; undefined when there are none.
  const Tensor& outlier_channels() const { return out_ch_; }
  const Tensor& outlier_weight() const { return out_w_; }
  // Int8: Σ_k of each row of data() and residual_data(), f32 [N] and [N'] (exact), with which the
  // activations' zero points are taken out of the integer sums.
  const Tensor& row_sums() const { return sums_; }
  const Tensor& residual_row_sums() const { return res_sums_; }
  // The weight's value in f32 where this CPU may take the f32 route (above) for the precision (on
  // whichever kernel path is active: set_isa may pick another later); undefined elsewhere.
  const Tensor& wide() const { return wide_; }
  // Output channels [n0, n1): a view sharing storage (e.g. the q, k, v parts of in_proj_weight).
  PackedLinear rows(int64_t n0, int64_t n1) const;

 private:
  void finish();  // the derived members below
  void make_gemm_layouts();
  friend PackedLinear cat_rows(const std::vector<PackedLinear>& parts);
  friend Tensor linear(const Tensor& x, const PackedLinear& w, const Tensor& bias, DType out,
                       std::optional<Activation> act);

  Precision precision_ = Precision::F32;
  double act_error_ = 0;
  Tensor data_, scales_;
  Tensor res_rows_, res_data_, res_scales_;
  Tensor out_ch_, out_w_;
  Tensor keep_;        // f32 [K]: 0 on the outlier channels, 1 elsewhere (what the int8 term sees of x)
  Tensor out_w_panels_;  // outlier_weight in int8_row_out's panels (kernels/dispatch.h's Int8Row::wo)
  Tensor wide_;  // f32 [N, K], dequantize(*this), where this CPU has no native GEMM for the precision
  Tensor sums_, res_sums_;
  // The GEMM's weight in oneDNN's own layouts, made at first use (kernels/onednn.h): data_, or with
  // residual rows stacked_ (the int8 linear layer's one GEMM over both).
  std::shared_ptr<kernels::PackedB> gemm_b_;
  std::shared_ptr<lowp::PairsB> pairs_b_;  // data_ and res_data_ for heads' own int8 GEMM, made at first use
  // Int8 with residual rows: data_'s rows, then the residual rows with zero rows to a multiple of 32
  // (one GEMM shape for most layers' few rows), in one tensor; data_ is a view of its first rows, so
  // the weight is stored once.
  Tensor stacked_;
  std::vector<int32_t> res_rows32_;  // residual_rows as the output pass indexes y with them
  std::vector<int32_t> res_shift_;   // p of each residual row: its scale is the row's / 2^p
  // Int8: the row sums as int32, and with the residual rows folded in (C's sums and scales there, as
  // heads' own GEMM reads the weight: kernels/dispatch.h's Int8Row)
  std::vector<int32_t> sums32_, fold_sums32_;
  std::vector<float> fold_scales_;
  std::vector<int32_t> fold_shift32_, fold_col32_;  // per output: p and the index of a residual row, else 0
  std::vector<uint32_t> fold_mask32_;               // per output: ~0 on a residual row, else 0
};

// How linear() computes with a weight of this precision on the active kernel path: "native"
// (oneDNN's bf16 / int8 matmul), "heads" (int8: heads' own integer GEMM, on a CPU without a native
// one or where set_int8_gemm asks for it), "f32" (the operands widened to f32, oneDNN's f32 matmul:
// a CPU without native bf16, or int8 on a path without heads' GEMM) or "portable" (plain loops: the
// scalar path). Whatever the route, a call of at most 4 rows (a decoder's step) reads the weight as
// stored: f32 and bf16 weights on the SIMD paths (f32 sums of the same products, in another order;
// bf16 pairs through vdpbf16ps / BFDOT where the path has them: denormal inputs read as zero, and
// BFDOT rounds its pair sums to odd; not under set_batch_invariant, whose fixed order stays), int8 ones
// through vpdpbusd on the avx512bf16 path and the amx one on its hardware (not the emulated one): the
// same exact sums.
std::string linear_gemm_route(Precision p);
// The route linear() takes with this weight: linear_gemm_route(w.precision()), but for an int8 weight
// whose activation rows take one term (activation_error ∞) on the amx path "heads" (heads' AMX-INT8 tile
// GEMM, which "auto" prefers there; set_int8_gemm below).
std::string linear_gemm_route(const PackedLinear& w);

// Which integer GEMM the int8 linear layers run: "auto" (oneDNN's native u8s8 matmul where the CPU
// has VNNI or AMX-INT8 — but on the amx path heads' tile GEMM for weights whose activation rows take
// one term, activation_error ∞ — else heads' own where the active path has it) or "heads" (heads'
// own wherever the active path has it, VNNI or not: to compare the two, which give the same bits).
// HEADS_INT8_GEMM=auto|heads sets it at start-up. Throws heads::Error for another name.
void set_int8_gemm(const std::string& how);

// Whether set_batch_invariant(true) (heads/runtime.h) holds for linear layers of this precision on
// the active path: always for f32 and int8 (integer sums are exact), and for bf16 unless it takes
// oneDNN's native bf16 matmul (CPUs with AVX512_BF16 or AMX), whose sums depend on the batch.
bool batch_invariance_holds(Precision p);

// The int8 weights [N0, K], [N1, K], ... stacked by rows into one [N0 + N1 + ..., K] (the q, k, v
// projections into in_proj_weight), residual rows renumbered.
PackedLinear cat_rows(const std::vector<PackedLinear>& parts);

// An int8 weight as a state dict or a safetensors file stores it: "<name>" i8 [N, K] and
// "<name>_scale" f32 [N]; when some rows have the residual term, also "<name>_residual" i8 [N', K],
// "<name>_residual_scale" f32 [N'] and "<name>_residual_rows" i64 [N']; with outlier channels
// "<name>_outlier_channels" i64 [O] and "<name>_outlier_weight" f32 [N, O]; with an activation_error
// τ > 0, "<name>_activation_error" f64 [1].
std::vector<std::pair<std::string, Tensor>> int8_tensors(const std::string& name, const PackedLinear& w);
// The names int8_tensors writes besides "<name>".
std::vector<std::string> int8_part_names(const std::string& name);
// The int8 weight stored under `name`, reading tensors through `get` (null: absent); errors start
// with `label` and name the tensor.
PackedLinear int8_from_tensors(const std::string& name, const std::function<const Tensor*(const std::string&)>& get,
                               const std::string& label);

// The weight as f32 [N, K]: F32 as it is, BF16 widened, Int8 data[n, k] · scales[n] (plus the
// residual term's residual_data[j, k] · residual_scales[j] on its rows), computed in double, rounded
// once; the outlier channels' columns as stored.
Tensor dequantize(const PackedLinear& w);

// y [..., N] = x [..., K] through w (above) + bias [N]; x floating, read as f32 (bf16 x with a bf16
// weight is read as it is). y is f32, or bf16 (`out`, with a bf16 weight only: the f32 sums rounded
// once, as a bf16 model's activations are). `act`, when given, is applied to y (f32 out only): the
// bits of activation(linear(...)), computed while each block of int8 output rows is in cache.
Tensor linear(const Tensor& x, const PackedLinear& w, const Tensor& bias = {}, DType out = DType::F32,
              std::optional<Activation> act = std::nullopt);

}  // namespace heads
