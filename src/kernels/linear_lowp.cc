// linear_lowp.cc — the reduced-precision linear layers of include/heads/precision.h: weights
// converted or quantized once (PackedLinear), activations at each call, the GEMM through oneDNN
// (bf16 and int8 matmul) on the SIMD paths and plain loops on the portable one.
#include "heads/precision.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>
#include <vector>

#include "heads/error.h"
#include "heads/ops.h"
#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/linear.h"
#include "kernels/onednn.h"

namespace heads {

namespace {

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

// Exact int32 sums: Σ (q − z)·w with |q − z| ≤ 255 and |w| ≤ 127.
// Blocks of rows for the GEMMs whose row count varies (the second terms, the weight's residual rows):
// one primitive shape for a range of counts instead of one per count (oneDNN creates each shape once,
// in milliseconds).
constexpr int64_t kRowBlock = 32;

constexpr int64_t kMaxInt8K = std::numeric_limits<int32_t>::max() / (255 * 127);

// The int8 weights are the same bits on every machine: this file's float arithmetic is evaluated as
// written (CMakeLists.txt compiles it with -ffp-contract=off: no fused multiply-adds), never
// reassociated.
#ifdef __FAST_MATH__
#error "linear_lowp.cc must not be compiled with -ffast-math: round_even() depends on IEEE rounding"
#endif

// std::nearbyint in the default rounding mode (to nearest, ties to even) for |x| < 2^22: past
// 1.5 * 2^23 a float's step is 1, so adding it rounds to an integer and subtracting it is exact. Inline,
// so that the loops below vectorize (nearbyint is a library call); their values stay below 255 steps.
inline float round_even(float x) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  return (x + kShift) - kShift;
}

// std::clamp(x, -127, 127) by value (its references put the operands in memory, which the
// sanitizers then check on every use).
inline float clamp127(float x) { return x < -127.0f ? -127.0f : (127.0f < x ? 127.0f : x); }

// Symmetric int8 of one weight row: q = round(x / s), s = max|x| / 127 (s = 1 for an all-zero row);
// NaN when the row holds NaN or ±inf. (Activations: the table's quantize_rows_i8.)
float quantize_row(const float* x, int64_t K, int8_t* q) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t k = 0; k < K; ++k) {
    finite = finite && std::isfinite(x[k]);
    amax = std::max(amax, std::fabs(x[k]));
  }
  if (!finite) {
    std::fill(q, q + K, int8_t{0});
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float s = amax >= 127.0f * std::numeric_limits<float>::min() ? amax / 127.0f : 1.0f;  // as quantize-inl.h
  const float inv = 1.0f / s;
  for (int64_t k = 0; k < K; ++k) {
    q[k] = static_cast<int8_t>(clamp127(round_even(x[k] * inv)));
  }
  return s;
}

// The weight rows' scale: of s·c for c in {1, 0.99, ..., 0.50} (values beyond 127 steps clipped),
// the one with the least squared error over the row (the first of equals), its int8 values left in q.
float clip_row(const float* w, int64_t K, float s, int8_t* q) {
  constexpr int kScales = 51;
  float t[kScales];
  double error[kScales] = {};
  for (int i = 0; i < kScales; ++i) t[i] = i == 0 ? s : s * static_cast<float>(100 - i) / 100.0f;
  // One pass over the row for all the scales: their sums are independent (the inner loop vectorizes)
  // and each is still summed in the row's order.
  for (int64_t k = 0; k < K; ++k) {
    const float x = w[k];
    for (int i = 0; i < kScales; ++i) {
      const double d = x - clamp127(round_even(x / t[i])) * t[i];
      error[i] += d * d;
    }
  }
  int best = 0;
  for (int i = 1; i < kScales; ++i) {
    if (error[i] < error[best]) best = i;
  }
  const float scale = t[best];
  for (int64_t k = 0; k < K; ++k) q[k] = static_cast<int8_t>(clamp127(round_even(w[k] / scale)));
  return scale;
}

// Whether oneDNN has a native matmul for the precision on this CPU (its own detection, which
// DNNL_MAX_CPU_ISA can lower). Without VNNI (vpdpbusd) its int8 GEMM sums pairs of u8·s8 products in
// saturating int16 (vpmaddubsw), which values of full 8-bit range overflow (measured with
// DNNL_MAX_CPU_ISA=AVX2: results off by 10%); without AVX512_BF16 its bf16 matmul is emulated or
// absent.
bool onednn_native(Precision p) {
  static const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto has = [](dnnl::cpu_isa i) { return (isa & static_cast<unsigned>(i)) == static_cast<unsigned>(i); };
  switch (p) {
    case Precision::BF16: return has(dnnl::cpu_isa::avx512_core_bf16);
    case Precision::Int8: return has(dnnl::cpu_isa::avx512_core_vnni) || has(dnnl::cpu_isa::avx2_vnni);
    case Precision::F32: return true;
  }
  return true;
}

enum class Route { Native, F32, Portable };  // linear_gemm_route's three answers

Route route_of(Precision p) {
  if (!kernels::active().onednn) return Route::Portable;
  return onednn_native(p) ? Route::Native : Route::F32;
}

// oneDNN's matmul for a bf16 / int8 call; false where oneDNN turns out to have none for this CPU after
// all (the caller's portable loops then run), any other failure an error naming the shapes.
bool native_matmul(const char* precision, const kernels::MatmulCall& call, const void* a, const void* b,
                   const float* bias, void* c, kernels::PackedB* packed) {
  try {
    kernels::onednn_matmul(call, a, b, bias, c, packed);
    return true;
  } catch (const dnnl::error& e) {
    if (e.status == dnnl_unimplemented) return false;
    fail("linear (", precision, "): oneDNN matmul failed for x [", call.M, ", ", call.K, "] and weight [", call.N,
         ", ", call.K, "]: ", e.what());
  }
}

// y [M, N] (stride ys; f32, or bf16 when y_bf16) = xf [M, K] (contiguous) Wfᵀ + bias through the f32
// GEMM: the route of a CPU without a native bf16 / int8 matmul.
void linear_wide(const float* xf, int64_t M, int64_t K, const float* Wf, const float* bias, int64_t N, void* y,
                 bool y_bf16, int64_t ys) {
  if (!y_bf16) {
    kernels::linear_f32(xf, M, K, K, Wf, bias, N, static_cast<float*>(y), ys);
    return;
  }
  const Buffer<float> yf(M * N);
  kernels::linear_f32(xf, M, K, K, Wf, bias, N, yf.data(), N);
  const int threads = kernels::gemm_threads(M, N, 1);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) static_cast<uint16_t*>(y)[m * ys + n] = f32_to_bf16(yf[m * N + n]);
  }
}

// y [M, N] (row stride ys; f32, or bf16 when y_bf16) from x [M, K] rows (stride xs; f32, or bf16 when
// x_bf16) through bf16 W [N, K] and bias; Wf: W widened to f32, for the f32 route.
void linear_bf16(const void* x, bool x_bf16, int64_t M, int64_t K, int64_t xs, const uint16_t* W, const float* Wf,
                 const float* bias, int64_t N, void* y, bool y_bf16, int64_t ys, kernels::PackedB* packed) {
  const Route route = route_of(Precision::BF16);
  if (route == Route::F32) {  // bf16(x) widened back: the products the native GEMM forms, exact in f32
    HEADS_CHECK(Wf != nullptr, "linear (bf16): the weight has no f32 copy for this CPU's f32 route");
    const Buffer<float> xf(M * K);
    const int threads = kernels::gemm_threads(M, K, 1);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k) {
        xf[m * K + k] = x_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[m * xs + k])
                               : bf16_to_f32(f32_to_bf16(static_cast<const float*>(x)[m * xs + k]));
      }
    }
    linear_wide(xf.data(), M, K, Wf, bias, N, y, y_bf16, ys);
    return;
  }
  const int threads = kernels::gemm_threads(M, N, K);
  const Buffer<uint16_t> converted(x_bf16 ? 1 : M * K);
  const uint16_t* xb = static_cast<const uint16_t*>(x);
  int64_t xbs = xs;
  if (!x_bf16) {
    const auto* xf = static_cast<const float*>(x);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k) converted[m * K + k] = f32_to_bf16(xf[m * xs + k]);
    }
    xb = converted.data();
    xbs = K;
  }
  if (route == Route::Native &&
      native_matmul("bf16", {M, K, N, xbs, 1, 1, K, ys, bias != nullptr, threads,
                             y_bf16 ? kernels::MatmulTypes::Bf16Out : kernels::MatmulTypes::Bf16},
                    xb, W, bias, y, packed)) {
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += bf16_to_f32(xb[m * xbs + k]) * bf16_to_f32(W[n * K + k]);
      acc += bias ? bias[n] : 0.0f;
      if (y_bf16) {
        static_cast<uint16_t*>(y)[m * ys + n] = f32_to_bf16(acc);
      } else {
        static_cast<float*>(y)[m * ys + n] = acc;
      }
    }
  }
}

// An int8 weight as linear_int8 reads it: W [N, K] with scales sw [N] and row sums ws [N] (Σ_k W[n, k],
// exact in f32), and the residual term's Nr rows Wr [Nr, K] with scales swr [Nr] and sums wrs [Nr],
// added to the outputs rrows[j].
struct Int8Weight {
  const int8_t* W;
  const float* sw;
  const float* ws;
  int64_t N;
  const int8_t* Wr = nullptr;
  const float* swr = nullptr;
  const float* wrs = nullptr;
  const int64_t* rrows = nullptr;
  int64_t Nr = 0;
  const float* wide = nullptr;  // the whole weight in f32 (dequantize), for the f32 route
  double act_error = 0;
  kernels::PackedB* packed = nullptr;      // W in oneDNN's layouts
  const int8_t* Wr_padded = nullptr;       // Wr with zero rows to a multiple of kRowBlock
  kernels::PackedB* packed_r = nullptr;    // Wr_padded in oneDNN's layouts
};

// The integer GEMM acc [M, N] = A [M, K] · B [N, K]ᵀ (int8 operands, exact int32 sums) on the native
// route, or plain loops (also where oneDNN turns out to have no int8 matmul for this CPU).
void gemm_s8(const int8_t* A, int64_t M, int64_t K, const int8_t* B, int64_t N, int32_t* acc, bool native,
             kernels::PackedB* packed) {
  const int threads = kernels::gemm_threads(M, N, K);
  if (native && native_matmul("int8", {M, K, N, K, 1, 1, K, N, false, threads, kernels::MatmulTypes::S8}, A, B,
                               nullptr, acc, packed)) {
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* a = A + m * K;
    for (int64_t n = 0; n < N; ++n) {
      const int8_t* b = B + n * K;
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += static_cast<int32_t>(a[k]) * static_cast<int32_t>(b[k]);
      acc[m * N + n] = sum;
    }
  }
}

// The same through an int8 weight. Rows of x are quantized by the kernel table's quantize_rows_i8: an
// asymmetric term x ≈ (q − z)·s for every row and a second term r·sr for the rows whose estimated
// error exceeds the weight's activation_error (0, the default: every row). The integer GEMMs: acc = q·Wᵀ over all rows with acc2 = r·Wᵀ over
// the rows with a second term in the same GEMM (packed after them, a multiple of kRowBlock rows at most
// M), acc3 = q·Wrᵀ for the
// weight's residual rows (a multiple of kRowBlock of them); then, with the zero point taken out
// exactly in int32 through the weight's row sums,
//   y[m, n] = ((acc − z·ws[n])·s (+ acc2·sr)) · sw[n] + b[n],  y[m, rrows[j]] += (acc3 − z·wrs[j])·s·swr[j]
// (the weight's residual meets the activations' first term only: their product with the second is
// below both terms' rounding). On the f32 route the terms are summed back into f32 rows, (q − z)·s
// (+ r·sr), and go through the f32 GEMM with the dequantized weight (both terms of residual rows).
void linear_int8(const float* x, int64_t M, int64_t K, int64_t xs, const Int8Weight& w, const float* bias, float* y,
                 int64_t ys) {
  // Rows [0, M) of xq: the first terms; rows [M, 2M): the second terms (where a row has one).
  const Buffer<int8_t> xq(2 * M * K);
  const int8_t* xr = xq.data() + M * K;
  const Buffer<float> sx(M), sr(M);
  const Buffer<int32_t> zx(M);
  kernels::active().quantize_rows_i8(x, M, K, xs, nullptr, 12.0 * w.act_error * w.act_error,
                                     xq.data(), sx.data(), zx.data(), xq.data() + M * K, sr.data());
  const Route route = route_of(Precision::Int8);
  const int threads = kernels::gemm_threads(M, w.N, K);
  if (route == Route::F32) {
    HEADS_CHECK(w.wide != nullptr, "linear (int8): the weight has no f32 copy for this CPU's f32 route");
    const Buffer<float> xf(M * K);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* q = xq.data() + m * K;
      const int8_t* r = xr + m * K;
      const float s = sx[m], s2 = sr[m];
      const int32_t z = zx[m];
      for (int64_t k = 0; k < K; ++k) {
        const float v = static_cast<float>(q[k] - z) * s;
        xf[m * K + k] = s2 != 0.0f ? v + static_cast<float>(r[k]) * s2 : v;
      }
    }
    linear_wide(xf.data(), M, K, w.wide, bias, w.N, y, false, ys);
    return;
  }
  const bool native = route == Route::Native;
  const int64_t N = w.N, Nr = w.Nr;
  // The rows with a second term, packed after the first terms (in order: a row never moves down), so
  // that one GEMM reads the weight once for both (a decoder's single row: 1 or 2 rows).
  std::vector<int64_t> two;
  for (int64_t m = 0; m < M; ++m) {
    if (sr[m] != 0.0f) two.push_back(m);
  }
  const auto M2 = static_cast<int64_t>(two.size());
  const int64_t Mt = M + std::min((M2 + kRowBlock - 1) / kRowBlock * kRowBlock, M);
  for (int64_t j = 0; j < M2; ++j) {
    if (two[j] != j) std::copy(xr + two[j] * K, xr + (two[j] + 1) * K, xq.data() + (M + j) * K);
  }
  std::fill(xq.data() + (M + M2) * K, xq.data() + Mt * K, int8_t{0});
  const Buffer<int32_t> acc(Mt * N);
  gemm_s8(xq.data(), Mt, K, w.W, N, acc.data(), native, w.packed);
  const int64_t Nrp = (Nr + kRowBlock - 1) / kRowBlock * kRowBlock;
  const Buffer<int32_t> acc3(Nrp > 0 ? M * Nrp : 1);
  if (Nr > 0) gemm_s8(xq.data(), M, K, w.Wr_padded, Nrp, acc3.data(), native, w.packed_r);
  std::vector<int64_t> second(static_cast<size_t>(M), -1);  // row m's index among the second terms
  for (int64_t j = 0; j < M2; ++j) second[static_cast<size_t>(two[j])] = j;
  const auto row_out = kernels::active().int8_row_out;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t m = 0; m < M; ++m) {
    const int64_t j2 = second[static_cast<size_t>(m)];
    row_out(acc.data() + m * N, j2 < 0 ? nullptr : acc.data() + (M + j2) * N, zx[m], sx[m], sr[m], w.ws, w.sw, bias, N,
            acc3.data() + m * Nrp, w.wrs, w.swr, w.rrows, Nr, y + m * ys);
  }
}

// Σ_k data[n, k] of each row of an int8 [N, K] tensor, as f32 [N] (exact: |sum| ≤ 127·K < 2^24).
Tensor int8_row_sums(const Tensor& data) {
  const int64_t N = data.size(0), K = data.size(1);
  Tensor out = Tensor::empty({N}, DType::F32);
  const auto* q = static_cast<const int8_t*>(data.raw_data());
  for (int64_t n = 0; n < N; ++n) {
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += q[n * K + k];
    out.data<float>()[n] = static_cast<float>(sum);
  }
  return out;
}

}  // namespace

std::string precision_name(Precision p) {
  switch (p) {
    case Precision::F32: return "f32";
    case Precision::BF16: return "bf16";
    case Precision::Int8: return "int8";
  }
  return "?";
}

Precision precision_from_name(const std::string& s) {
  for (Precision p : {Precision::F32, Precision::BF16, Precision::Int8}) {
    if (precision_name(p) == s) return p;
  }
  fail("precision must be f32, bf16 or int8, got \"", s, "\"");
}

PackedLinear::PackedLinear(const Tensor& weight, Precision precision, double activation_error)
    : precision_(precision), act_error_(activation_error) {
  HEADS_CHECK(std::isfinite(activation_error) && activation_error >= 0, "PackedLinear: activation_error must be finite and ",
              "at least 0, got ", activation_error);
  HEADS_CHECK(weight.defined() && weight.dim() == 2 && is_floating(weight.dtype()),
              "PackedLinear: weight: expected a floating [out, in] tensor, got ",
              weight.defined() ? std::string(dtype_name(weight.dtype())) + " " + shape_str(weight.shape())
                               : std::string("none"));
  // The packed weight owns its memory (the caller's may be a view of an array that goes away).
  if (precision == Precision::F32) {
    data_ = weight.dtype() == DType::F32 ? weight.clone() : weight.to(DType::F32);
  } else if (precision == Precision::BF16) {
    data_ = weight.dtype() == DType::BF16 ? weight.clone() : weight.to(DType::BF16);
  } else {
    const int64_t N = weight.size(0), K = weight.size(1);
    HEADS_CHECK(K <= kMaxInt8K, "PackedLinear: int8 weight ", weight.shape(), " has more than ", kMaxInt8K,
                " inputs (int32 sums would overflow)");
    const Tensor w = weight.to(DType::F32);
    data_ = Tensor::empty({N, K}, DType::I8);
    scales_ = Tensor::empty({N}, DType::F32);
    const float* rows = w.data<float>();
    auto* q = static_cast<int8_t*>(data_.raw_data());
    float* scales = scales_.data<float>();
    // A row's residual after its int8 term: row - q * scale.
    const auto residual = [&](int64_t n, int64_t k) {
      return rows[n * K + k] - static_cast<float>(q[n * K + k]) * scales[n];
    };
    // The rows are independent (a search over 51 scales each): in parallel, each row's result the same
    // on any number of threads. First the int8 terms, and which rows need a residual term. Nothing in
    // the parallel loops throws (buffers are allocated before them, errors reported after them).
    std::vector<uint8_t> needs_residual(static_cast<size_t>(N), 0);
    const int threads = static_cast<int>(std::clamp<int64_t>(N, 1, get_num_threads()));
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; ++n) {
      const float* row = rows + n * K;
      const float s = quantize_row(row, K, q + n * K);
      scales[n] = s;
      if (!std::isfinite(s)) continue;  // reported below
      scales[n] = clip_row(row, K, s, q + n * K);
      double err = 0, norm = 0;
      for (int64_t k = 0; k < K; ++k) {
        const float r = residual(n, k);
        err += static_cast<double>(r) * r;
        norm += static_cast<double>(row[k]) * row[k];
      }
      needs_residual[n] = err > kInt8ResidualError * kInt8ResidualError * norm;
    }
    for (int64_t n = 0; n < N; ++n) {
      HEADS_CHECK(std::isfinite(scales[n]), "PackedLinear: weight row ", n, " holds NaN or inf");
    }
    std::vector<int64_t> heavy;  // rows that get the residual term
    for (int64_t n = 0; n < N; ++n) {
      if (needs_residual[n]) heavy.push_back(n);
    }
    const auto Nr = static_cast<int64_t>(heavy.size());
    std::vector<int8_t> rq(static_cast<size_t>(Nr * K));
    std::vector<float> rs(static_cast<size_t>(Nr));
    const int res_threads = static_cast<int>(std::clamp<int64_t>(Nr, 1, get_num_threads()));
    std::vector<float> residuals(static_cast<size_t>(res_threads * K));  // a row per thread
#pragma omp parallel num_threads(res_threads) if (res_threads > 1)
    {
      float* r = residuals.data() + omp_get_thread_num() * K;
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < Nr; ++i) {
        for (int64_t k = 0; k < K; ++k) r[k] = residual(heavy[i], k);
        int8_t* rqi = rq.data() + i * K;
        rs[i] = clip_row(r, K, quantize_row(r, K, rqi), rqi);
      }
    }
    if (Nr > 0) {
      res_rows_ = Tensor::from_vector(heavy, {Nr});
      res_data_ = Tensor::from_vector(rq, {Nr, K});
      res_scales_ = Tensor::from_vector(rs, {Nr});
    }
  }
  finish();
}

void PackedLinear::make_gemm_layouts() {
  gemm_b_ = gemm_res_b_ = nullptr;
  res_padded_ = Tensor();
  if (precision_ == Precision::F32) return;
  gemm_b_ = std::make_shared<kernels::PackedB>();
  if (!res_data_.defined()) return;
  const int64_t Nr = res_data_.size(0), K = res_data_.size(1), Nrp = (Nr + kRowBlock - 1) / kRowBlock * kRowBlock;
  res_padded_ = Tensor::zeros({Nrp, K}, DType::I8);
  res_padded_.slice(0, 0, Nr).copy_from(res_data_);
  gemm_res_b_ = std::make_shared<kernels::PackedB>();
}

void PackedLinear::finish() {
  if (precision_ == Precision::Int8) {
    sums_ = int8_row_sums(data_);
    res_sums_ = res_data_.defined() ? int8_row_sums(res_data_) : Tensor();
  }
  make_gemm_layouts();
  if (precision_ != Precision::F32 && !onednn_native(precision_)) wide_ = dequantize(*this);
}

std::string linear_gemm_route(Precision p) {
  switch (route_of(p)) {
    case Route::Native: return "native";
    case Route::F32: return "f32";
    case Route::Portable: return "portable";
  }
  return "?";
}

bool batch_invariance_holds(Precision p) { return p != Precision::BF16 || route_of(p) != Route::Native; }

PackedLinear PackedLinear::from_int8(const Tensor& data, const Tensor& scales, const std::string& name,
                                     const Tensor& residual_rows, const Tensor& residual_data,
                                     const Tensor& residual_scales) {
  HEADS_CHECK(data.defined() && data.dtype() == DType::I8 && data.dim() == 2, name,
              ": expected int8 [out, in] data, got ",
              data.defined() ? std::string(dtype_name(data.dtype())) + " " + shape_str(data.shape()) : "none");
  HEADS_CHECK(data.size(1) <= kMaxInt8K, name, ": ", data.size(1), " inputs is more than ", kMaxInt8K);
  HEADS_CHECK(scales.defined() && scales.dtype() == DType::F32 && scales.shape() == Shape({data.size(0)}), name,
              ": scales: expected f32 [", data.size(0), "], got ",
              scales.defined() ? std::string(dtype_name(scales.dtype())) + " " + shape_str(scales.shape()) : "none");
  PackedLinear p;
  p.precision_ = Precision::Int8;
  p.data_ = data.clone();  // owned, as the constructor's
  p.scales_ = scales.clone();
  for (int64_t n = 0; n < p.scales_.numel(); ++n) {
    const float s = p.scales_.data<float>()[n];
    HEADS_CHECK(std::isfinite(s) && s > 0.0f, name, ": scale ", n, " must be finite and positive, got ", s);
  }
  const int given = residual_rows.defined() + residual_data.defined() + residual_scales.defined();
  HEADS_CHECK(given == 0 || given == 3, name, ": the residual term needs its rows, data and scales together");
  if (given == 0) {
    p.finish();
    return p;
  }
  const int64_t N = data.size(0), K = data.size(1);
  HEADS_CHECK(residual_rows.dtype() == DType::I64 && residual_rows.dim() == 1, name,
              ": residual rows: expected i64 [rows], got ", dtype_name(residual_rows.dtype()), " ",
              residual_rows.shape());
  const int64_t Nr = residual_rows.size(0);
  HEADS_CHECK(residual_data.dtype() == DType::I8 && residual_data.shape() == Shape({Nr, K}), name,
              ": residual data: expected i8 [", Nr, ", ", K, "], got ", dtype_name(residual_data.dtype()), " ",
              residual_data.shape());
  HEADS_CHECK(residual_scales.dtype() == DType::F32 && residual_scales.shape() == Shape({Nr}), name,
              ": residual scales: expected f32 [", Nr, "], got ", dtype_name(residual_scales.dtype()), " ",
              residual_scales.shape());
  p.res_rows_ = residual_rows.clone();
  p.res_data_ = residual_data.clone();
  p.res_scales_ = residual_scales.clone();
  for (int64_t j = 0; j < Nr; ++j) {
    const int64_t r = p.res_rows_.data<int64_t>()[j];
    HEADS_CHECK(r >= 0 && r < N && (j == 0 || r > p.res_rows_.data<int64_t>()[j - 1]), name, ": residual row ", j,
                " is ", r, ": rows must increase within [0, ", N, ")");
    const float s = p.res_scales_.data<float>()[j];
    HEADS_CHECK(std::isfinite(s) && s > 0.0f, name, ": residual scale ", j, " must be finite and positive, got ", s);
  }
  if (Nr == 0) p.res_rows_ = p.res_data_ = p.res_scales_ = Tensor();
  p.finish();
  return p;
}

Tensor dequantize(const PackedLinear& w) {
  HEADS_CHECK(w.defined(), "dequantize: the packed weight is empty");
  if (w.precision() != Precision::Int8) return w.data().dtype() == DType::F32 ? w.data().clone() : w.data().to(DType::F32);
  const int64_t N = w.out_features(), K = w.in_features();
  Tensor out = Tensor::empty({N, K}, DType::F32);
  const auto* q = static_cast<const int8_t*>(w.data().raw_data());
  const float* s = w.scales().data<float>();
  float* y = out.data<float>();
  const int64_t Nr = w.residual_rows().defined() ? w.residual_rows().numel() : 0;
  const auto* rq = Nr ? static_cast<const int8_t*>(w.residual_data().raw_data()) : nullptr;
  int64_t j = 0;
  for (int64_t n = 0; n < N; ++n) {
    const bool res = j < Nr && w.residual_rows().data<int64_t>()[j] == n;
    for (int64_t k = 0; k < K; ++k) {
      double v = static_cast<double>(q[n * K + k]) * s[n];
      if (res) v += static_cast<double>(rq[j * K + k]) * w.residual_scales().data<float>()[j];
      y[n * K + k] = static_cast<float>(v);
    }
    j += res;
  }
  return out;
}

PackedLinear PackedLinear::rows(int64_t n0, int64_t n1) const {
  HEADS_CHECK(defined() && 0 <= n0 && n0 <= n1 && n1 <= out_features(), "PackedLinear::rows: [", n0, ", ", n1,
              ") is not a range of the ", defined() ? out_features() : 0, " output channels");
  PackedLinear p = *this;
  p.data_ = data_.slice(0, n0, n1);
  if (scales_.defined()) p.scales_ = scales_.slice(0, n0, n1);
  if (wide_.defined()) p.wide_ = wide_.slice(0, n0, n1);
  if (sums_.defined()) p.sums_ = sums_.slice(0, n0, n1);
  if (res_rows_.defined()) {  // the residual rows in range, renumbered from n0
    const int64_t* r = res_rows_.data<int64_t>();
    const int64_t Nr = res_rows_.numel();
    const int64_t j0 = std::lower_bound(r, r + Nr, n0) - r, j1 = std::lower_bound(r, r + Nr, n1) - r;
    p.res_rows_ = p.res_data_ = p.res_scales_ = p.res_sums_ = Tensor();
    if (j1 > j0) {
      std::vector<int64_t> rows(r + j0, r + j1);
      for (int64_t& v : rows) v -= n0;
      p.res_rows_ = Tensor::from_vector(rows, {j1 - j0});
      p.res_data_ = res_data_.slice(0, j0, j1);
      p.res_scales_ = res_scales_.slice(0, j0, j1);
      p.res_sums_ = res_sums_.slice(0, j0, j1);
    }
  }
  p.make_gemm_layouts();  // other weights: their own layouts
  return p;
}

PackedLinear cat_rows(const std::vector<PackedLinear>& parts) {
  HEADS_CHECK(!parts.empty(), "cat_rows: no weights");
  const int64_t K = parts[0].in_features();
  int64_t N = 0, Nr = 0;
  for (const auto& p : parts) {
    HEADS_CHECK(p.defined() && p.precision() == Precision::Int8 && p.in_features() == K,
                "cat_rows: expected int8 weights of ", K, " inputs");
    N += p.out_features();
    Nr += p.residual_rows().defined() ? p.residual_rows().numel() : 0;
  }
  Tensor data = Tensor::empty({N, K}, DType::I8), scales = Tensor::empty({N}, DType::F32);
  Tensor rrows, rdata, rscales;
  if (Nr > 0) {
    rrows = Tensor::empty({Nr}, DType::I64);
    rdata = Tensor::empty({Nr, K}, DType::I8);
    rscales = Tensor::empty({Nr}, DType::F32);
  }
  int64_t n = 0, j = 0;
  for (const auto& p : parts) {
    const int64_t pn = p.out_features();
    data.slice(0, n, n + pn).copy_from(p.data());
    scales.slice(0, n, n + pn).copy_from(p.scales());
    if (p.residual_rows().defined()) {
      const int64_t pr = p.residual_rows().numel();
      rdata.slice(0, j, j + pr).copy_from(p.residual_data());
      rscales.slice(0, j, j + pr).copy_from(p.residual_scales());
      for (int64_t i = 0; i < pr; ++i) rrows.data<int64_t>()[j + i] = p.residual_rows().data<int64_t>()[i] + n;
      j += pr;
    }
    n += pn;
  }
  PackedLinear out = PackedLinear::from_int8(data, scales, "cat_rows", rrows, rdata, rscales);
  out.act_error_ = parts[0].act_error_;  // the parts' (the q, k, v projections of one module: all the same)
  return out;
}

std::vector<std::string> int8_part_names(const std::string& name) {
  return {name + "_scale", name + "_residual", name + "_residual_scale", name + "_residual_rows"};
}

std::vector<std::pair<std::string, Tensor>> int8_tensors(const std::string& name, const PackedLinear& w) {
  HEADS_CHECK(w.defined() && w.precision() == Precision::Int8, "int8_tensors: \"", name, "\" is not an int8 weight");
  const auto parts = int8_part_names(name);
  std::vector<std::pair<std::string, Tensor>> out = {{name, w.data()}, {parts[0], w.scales()}};
  if (w.residual_rows().defined()) {
    out.emplace_back(parts[1], w.residual_data());
    out.emplace_back(parts[2], w.residual_scales());
    out.emplace_back(parts[3], w.residual_rows());
  }
  return out;
}

PackedLinear int8_from_tensors(const std::string& name, const std::function<const Tensor*(const std::string&)>& get,
                               const std::string& label) {
  const auto parts = int8_part_names(name);
  const Tensor* q = get(name);
  HEADS_CHECK(q != nullptr && q->defined() && q->dtype() == DType::I8 && q->dim() == 2, label, ": \"", name,
              "\": expected int8 [out, in]", q ? std::string(", got ") + std::string(dtype_name(q->dtype())) + " " +
                                                     shape_str(q->shape())
                                               : std::string(", missing"));
  const Tensor* s = get(parts[0]);
  HEADS_CHECK(s != nullptr, label, ": \"", name, "\" is int8 ", q->shape(), " but its scales \"", parts[0],
              "\" are missing");
  HEADS_CHECK(s->defined() && s->dtype() == DType::F32 && s->shape() == Shape({q->size(0)}), label, ": \"", parts[0],
              "\": expected f32 [", q->size(0), "] (one scale per row of \"", name, "\" ", q->shape(), "), got ",
              s->defined() ? std::string(dtype_name(s->dtype())) : "none", " ", s->defined() ? s->shape() : Shape{});
  const Tensor* rd = get(parts[1]);
  const Tensor* rs = get(parts[2]);
  const Tensor* rr = get(parts[3]);
  const int given = (rd != nullptr) + (rs != nullptr) + (rr != nullptr);
  HEADS_CHECK(given == 0 || given == 3, label, ": \"", name, "\": its residual term needs \"", parts[1], "\", \"",
              parts[2], "\" and \"", parts[3], "\" together (", given, " of 3 present)");
  const std::string what = label + ": \"" + name + "\"";
  if (given == 0) return PackedLinear::from_int8(*q, *s, what);
  return PackedLinear::from_int8(*q, *s, what, *rr, *rd, *rs);
}

Tensor linear(const Tensor& x_in, const PackedLinear& w, const Tensor& b_in, DType out) {
  const char* op = "linear";
  HEADS_CHECK(w.defined(), op, ": the packed weight is empty");
  HEADS_CHECK(out == DType::F32 || (out == DType::BF16 && w.precision() == Precision::BF16), op, ": output dtype ",
              dtype_name(out), " with a ", precision_name(w.precision()),
              " weight (expected f32, or bf16 with a bf16 weight)");
  if (w.precision() == Precision::F32) return linear(x_in, w.data(), b_in);
  const int64_t N = w.out_features(), K = w.in_features();
  HEADS_CHECK(x_in.defined() && x_in.dim() >= 1 && x_in.size(-1) == K && is_floating(x_in.dtype()), op, ": input ",
              x_in.defined() ? x_in.shape() : Shape{}, " does not match the ", precision_name(w.precision()),
              " weight [", N, ", ", K, "] (expected a floating tensor with last dim ", K, ")");
  HEADS_CHECK(!b_in.defined() || b_in.shape() == Shape({N}), op, ": bias: expected [", N, "], got ",
              b_in.defined() ? b_in.shape() : Shape{});
  // bf16 input to a bf16 weight is read as it is (no rounding to do); anything else as f32.
  const bool x_bf16 = w.precision() == Precision::BF16 && x_in.dtype() == DType::BF16;
  const Tensor x = x_bf16 ? x_in.contiguous() : x_in.to(DType::F32);
  const Tensor b = b_in.defined() ? b_in.to(DType::F32) : Tensor();
  Shape ys = x.shape();
  ys.back() = N;
  int64_t rows_of_x = 1;
  for (size_t d = 0; d + 1 < ys.size(); ++d) rows_of_x *= ys[d];
  const int64_t M = rows_of_x;
  const float* bias = b.defined() ? b.data<float>() : nullptr;
  if (M == 0 || N == 0) return Tensor::empty(ys, out);
  if (K == 0) {
    Tensor y = Tensor::empty(ys, DType::F32);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) y.data<float>()[m * N + n] = bias ? bias[n] : 0.0f;
    }
    return y.to(out);
  }
  Tensor y = Tensor::empty(ys, out);
  if (w.precision() == Precision::BF16) {
    linear_bf16(x.raw_data(), x_bf16, M, K, K, static_cast<const uint16_t*>(w.data().raw_data()),
                w.wide().defined() ? w.wide().data<float>() : nullptr, bias, N, y.raw_data(), out == DType::BF16, N,
                w.gemm_b_.get());
  } else {
    Int8Weight iw{static_cast<const int8_t*>(w.data().raw_data()), w.scales().data<float>(),
                  w.row_sums().data<float>(), N};
    iw.wide = w.wide().defined() ? w.wide().data<float>() : nullptr;
    iw.act_error = w.activation_error();
    iw.packed = w.gemm_b_.get();
    if (w.residual_rows().defined()) {
      iw.Wr = static_cast<const int8_t*>(w.residual_data().raw_data());
      iw.swr = w.residual_scales().data<float>();
      iw.wrs = w.residual_row_sums().data<float>();
      iw.Wr_padded = static_cast<const int8_t*>(w.res_padded_.raw_data());
      iw.packed_r = w.gemm_res_b_.get();
      iw.rrows = w.residual_rows().data<int64_t>();
      iw.Nr = w.residual_rows().numel();
    }
    linear_int8(x.data<float>(), M, K, K, iw, bias, y.data<float>(), N);
  }
  return y;
}

}  // namespace heads
