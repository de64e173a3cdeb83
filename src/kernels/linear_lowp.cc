// linear_lowp.cc — the reduced-precision linear layers of include/heads/precision.h at each call:
// activations converted or quantized, the GEMM through oneDNN (bf16 and int8 matmul) on the SIMD
// paths and plain loops on the portable one. The weights are packed once by linear_lowp_pack.cc.
#include "heads/precision.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>
#include <optional>
#include <vector>

#include "heads/error.h"
#include "heads/isa.h"
#include "heads/ops.h"
#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/linear.h"
#include "kernels/linear_lowp.h"
#include "kernels/onednn.h"

namespace heads {

using lowp::kRowBlock;
using lowp::onednn_native;

bool lowp::onednn_native(Precision p) {
  static const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto has = [](dnnl::cpu_isa i) { return (isa & static_cast<unsigned>(i)) == static_cast<unsigned>(i); };
  switch (p) {
    case Precision::BF16: return has(dnnl::cpu_isa::avx512_core_bf16);
    case Precision::Int8: return has(dnnl::cpu_isa::avx512_core_vnni) || has(dnnl::cpu_isa::avx2_vnni);
    case Precision::F32: return true;
  }
  return true;
}

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

enum class Route { Native, Heads, F32, Portable };  // linear_gemm_route's answers

// set_int8_gemm's choice: false "auto", true "heads"; HEADS_INT8_GEMM's until set.
std::atomic<int> g_int8_gemm{-1};

bool int8_gemm_forced() {
  int v = g_int8_gemm.load(std::memory_order_relaxed);
  if (v < 0) {
    static const int from_env = [] {
      const char* env = std::getenv("HEADS_INT8_GEMM");
      if (env == nullptr || *env == '\0') return 0;
      const std::string how = env;
      HEADS_CHECK(how == "auto" || how == "heads", "HEADS_INT8_GEMM must be auto or heads, got \"", how, "\"");
      return how == "heads" ? 1 : 0;
    }();
    v = from_env;
  }
  return v == 1;
}

Route route_of(Precision p) {
  const auto& k = kernels::active();
  if (!k.onednn) return Route::Portable;
  if (p == Precision::Int8 && k.gemm_u8s8_pairs != nullptr && (int8_gemm_forced() || !onednn_native(p))) {
    return Route::Heads;
  }
  return onednn_native(p) ? Route::Native : Route::F32;
}

}  // namespace

bool lowp::needs_f32_copy(Precision p) {
  if (p == Precision::F32 || onednn_native(p)) return false;
  if (p == Precision::BF16) return true;
  for (Isa isa : supported_isas()) {  // int8: a SIMD path without heads' GEMM takes the f32 route
    const kernels::KernelTable* t = kernels::table_for(isa);
    if (t != nullptr && t->onednn && t->gemm_u8s8_pairs == nullptr) return true;
  }
  return false;
}

void set_int8_gemm(const std::string& how) {
  HEADS_CHECK(how == "auto" || how == "heads", "set_int8_gemm: expected \"auto\" or \"heads\", got \"", how, "\"");
  g_int8_gemm.store(how == "heads" ? 1 : 0, std::memory_order_relaxed);
}

namespace {

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

// act (when given) on `rows` rows of n values (row stride ys) in place, by the kernel table's
// elementwise ops: each value's bits as activation() gives them.
void apply_activation(std::optional<Activation> act, float* y, int64_t rows, int64_t n, int64_t ys) {
  if (!act || rows == 0) return;
  const auto& k = kernels::active();
  if (*act == Activation::Relu) {
    k.relu_f32(y, y, rows, n, ys, ys);
  } else {
    k.gelu_f32(y, y, rows, n, ys, ys, *act == Activation::GeluTanh);
  }
}

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
  const float* wide = nullptr;  // the whole weight in f32 (dequantize), for the f32 route
  // The outlier channels oc [no] (heads/precision.h), W's columns there in panels (kernels::Int8Row), and
  // keep [K]: 0 on them, 1 elsewhere (the int8 term's view of x).
  const int64_t* oc = nullptr;
  const float* wo = nullptr;
  const float* keep = nullptr;
  int64_t no = 0;
  double act_error = 0;
  kernels::PackedB* packed = nullptr;      // W in oneDNN's layouts
  const int8_t* Wr_padded = nullptr;       // Wr with zero rows to a multiple of kRowBlock
  kernels::PackedB* packed_r = nullptr;    // Wr_padded in oneDNN's layouts
  lowp::PairsB* pairs = nullptr;           // W and Wr in heads' GEMM's layout
};

// The integer GEMM acc [M, N] = A [M, K] · B [N, K]ᵀ (uint8 A, int8 B, exact int32 sums) on the native
// route, or plain loops (also where oneDNN turns out to have no int8 matmul for this CPU).
void gemm_u8s8(const uint8_t* A, int64_t M, int64_t K, const int8_t* B, int64_t N, int32_t* acc, bool native,
               kernels::PackedB* packed, int threads) {
  if (native && native_matmul("int8", {M, K, N, K, 1, 1, K, N, false, threads, kernels::MatmulTypes::U8S8}, A, B,
                               nullptr, acc, packed)) {
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t m = 0; m < M; ++m) {
    const uint8_t* a = A + m * K;
    for (int64_t n = 0; n < N; ++n) {
      const int8_t* b = B + n * K;
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += static_cast<int32_t>(a[k]) * static_cast<int32_t>(b[k]);
      acc[m * N + n] = sum;
    }
  }
}

// The same through an int8 weight. Rows of x are quantized by the kernel table's quantize_rows_u8: an
// asymmetric term x ≈ (q − z)·s for every row (unsigned bytes) and a second term r·sr (stored as
// r + kSecondZero, taken out through the row sums as z is) for the rows whose estimated error exceeds
// the weight's activation_error (0, the default: every row). The integer GEMMs: acc = q·Wᵀ over all
// rows with acc2 = r·Wᵀ over the rows with a second term in the same GEMM (packed after them), and
// for the weight's residual rows (heads/precision.h) the sums of their 16-bit rows C = 2^p·W + Wr:
// heads' own GEMM reads C in place of W there; oneDNN's and the portable loops run Wr in a GEMM of
// its own (acc3, over the same rows, a multiple of kRowBlock of them) and the output pass makes
// 2^p·acc + acc3 in int64. Then, with the zero points taken out exactly through the row sums,
//   y[m, n] = ((acc − z·ws[n])·s (+ (acc2 − 128·ws[n])·sr)) · sw[n] + b[n]
// (with C's sums and row sums, and scale swr, on the residual rows). The weight's outlier channels are
// zero in the rows quantized (x times `keep`) and added in f32 by each output row: y[m, n] +=
// x[m, o]·W[n, o]. On the f32 route the terms are summed back into f32 rows, (q − z)·s (+ r·sr), and
// go through the f32 GEMM with the dequantized weight (C·swr on residual rows).

// Output row m of x as int8_rows_out reads it, from one GEMM call's sums: the first term's at row i of
// acc (stride N), the second term's at row i2 (−1: the row has none), and on oneDNN's route and the
// portable loops (heads == false) the residual GEMM's at the same rows of acc3 (stride Nrp).
kernels::Int8Row int8_out_row(const Int8Weight& w, bool heads, const float* x, int64_t xs, int64_t m,
                              const int32_t* zx, const float* sx, const float* sr, const float* bias,
                              const int32_t* acc, const int32_t* acc3, int64_t Nrp, int64_t i, int64_t i2) {
  const int64_t N = w.N;
  kernels::Int8Row r{acc + i * N, i2 < 0 ? nullptr : acc + i2 * N, zx[m], sx[m], sr[m],
                     heads ? w.fold_ws : w.ws, heads ? w.fold_sw : w.sw, bias, N};
  if (!heads) {
    r.a3 = acc3 + i * Nrp;
    r.a32 = i2 < 0 ? nullptr : acc3 + i2 * Nrp;
  }
  r.wrs = w.wrs;
  r.swr = w.swr;
  r.rows = w.rrows;
  r.shift = w.rshift;
  r.nr = heads ? 0 : w.Nr;
  r.x = x + m * xs;
  r.oc = w.oc;
  r.wo = w.wo;
  r.no = w.no;
  return r;
}

// Output rows are made (and their activation applied) this many at a time, while they are in cache.
constexpr int64_t kOutBlock = 16;

// Rows per task of oneDNN's route and the portable loops (a multiple of kShapeStep and of kOutBlock).
// Each task quantizes its rows, runs its GEMMs on one thread and makes its outputs from the sums while
// they are in L2 (64 x N int32), and the threads take tasks as they come free, all in one parallel
// region: a layer had been a dozen regions (the quantization, then per 256 rows a GEMM, the residual
// GEMM and the output pass), and on a 2-vCPU VM each fork/join woke a sleeping thread (libgomp's
// spin is cut to 1,000 iterations: tools/cli/main.cc) — 20% of an int8 embedding's samples were in
// the kernel's futex wake-ups (Intel Xeon, AVX-512 VNNI, 2 threads).
constexpr int64_t kTaskRows = 64;

void linear_int8_tasks(const float* x, int64_t M, int64_t K, int64_t xs, const Int8Weight& w, const float* bias,
                       float* y, int64_t ys, std::optional<Activation> act, bool native) {
  using lowp::kShapeStep;
  const int64_t N = w.N, Nr = w.Nr;
  const int64_t Nrp = (Nr + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int64_t T = std::min(kTaskRows, (M + kShapeStep - 1) / kShapeStep * kShapeStep);
  const int64_t tasks = (M + T - 1) / T;
  const int threads = static_cast<int>(std::min<int64_t>(kernels::gemm_threads(M, N, K), tasks));
  // Each thread's working memory: a task's codes (rows [0, cm) the first terms, zero past its rows,
  // then the second terms packed, zero rows up to a multiple of kRowBlock), and its GEMMs' sums.
  const int64_t q_size = 2 * T * K, acc_size = 2 * T * N, acc3_size = 2 * T * Nrp;
  const Buffer<uint8_t> codes(threads * q_size);
  const Buffer<int32_t> sums(threads * acc_size), sums3(std::max<int64_t>(1, threads * acc3_size));
  const Buffer<float> sx(M), sr(M);
  const Buffer<int32_t> zx(M);
  const auto& k = kernels::active();
  const double tau2x12 = 12.0 * w.act_error * w.act_error;
  std::atomic<bool> failed{false};
  std::exception_ptr error;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int t = threads > 1 ? omp_get_thread_num() : 0;
    uint8_t* q = codes.data() + t * q_size;
    int32_t* acc = sums.data() + t * acc_size;
    int32_t* acc3 = sums3.data() + (Nrp > 0 ? t * acc3_size : 0);
    int64_t slot[kTaskRows];  // row i's index among the task's second terms, or −1
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < tasks; ++ti) {
      if (failed.load(std::memory_order_relaxed)) continue;
      try {
        const int64_t c0 = ti * T, n = std::min(M, c0 + T) - c0;
        const int64_t cm = (n + kShapeStep - 1) / kShapeStep * kShapeStep;
        uint8_t* r = q + cm * K;
        k.quantize_rows_u8(x + c0 * xs, n, K, xs, w.keep, tau2x12, q, sx.data() + c0, zx.data() + c0, r,
                           sr.data() + c0);
        std::fill(q + n * K, q + cm * K, uint8_t{0});
        int64_t m2 = 0;
        for (int64_t i = 0; i < n; ++i) {  // second terms packed in order: row i moves to row m2 ≤ i
          if (sr[c0 + i] == 0.0f) {
            slot[i] = -1;
            continue;
          }
          if (m2 != i) std::memmove(r + m2 * K, r + i * K, static_cast<size_t>(K));
          slot[i] = cm + m2++;
        }
        const int64_t mt = cm + std::min((m2 + kRowBlock - 1) / kRowBlock * kRowBlock, cm);
        std::fill(r + m2 * K, q + mt * K, uint8_t{0});
        gemm_u8s8(q, mt, K, w.W, N, acc, native, w.packed, 1);
        if (Nr > 0) gemm_u8s8(q, mt, K, w.Wr_padded, Nrp, acc3, native, w.packed_r, 1);
        for (int64_t b0 = 0; b0 < n; b0 += kOutBlock) {
          const int64_t b1 = std::min(n, b0 + kOutBlock);
          kernels::Int8Row rows[kOutBlock];
          for (int64_t i = b0; i < b1; ++i) {
            rows[i - b0] = int8_out_row(w, false, x, xs, c0 + i, zx.data(), sx.data(), sr.data(), bias, acc, acc3,
                                        Nrp, i, slot[i]);
          }
          k.int8_rows_out(rows, b1 - b0, y + (c0 + b0) * ys, ys);
          apply_activation(act, y + (c0 + b0) * ys, b1 - b0, N, ys);
        }
      } catch (...) {
#pragma omp critical(heads_linear_int8_error)
        if (!error) error = std::current_exception();
        failed.store(true, std::memory_order_relaxed);
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

void linear_int8(const float* x, int64_t M, int64_t K, int64_t xs, const Int8Weight& w, const float* bias, float* y,
                 int64_t ys, std::optional<Activation> act) {
  const Route route = route_of(Precision::Int8);
  if (route == Route::Native || route == Route::Portable) {
    linear_int8_tasks(x, M, K, xs, w, bias, y, ys, act, route == Route::Native);
    return;
  }
  // The f32 route and heads' own GEMM from here.
  // Rows [0, M) of xq: the first terms, zero rows up to Mp; rows [Mp, Mp + M): the second terms
  // (where a row has one). The GEMMs run Mp rows, a multiple of kShapeStep: a model fed texts of
  // every length then meets kShapeStep times fewer GEMM shapes, each a oneDNN primitive made once
  // (the int8 layers have a dozen shapes per length: onednn.cc caches a few hundred).
  const int64_t Mp = (M + lowp::kShapeStep - 1) / lowp::kShapeStep * lowp::kShapeStep;
  const Buffer<uint8_t> xq(2 * Mp * K);
  uint8_t* xr = xq.data() + Mp * K;
  const Buffer<float> sx(M), sr(M);
  const Buffer<int32_t> zx(M);
  kernels::active().quantize_rows_u8(x, M, K, xs, w.keep, 12.0 * w.act_error * w.act_error,
                                     xq.data(), sx.data(), zx.data(), xr, sr.data());
  const int threads = kernels::gemm_threads(M, w.N, K);
  if (route == Route::F32) {
    HEADS_CHECK(w.wide != nullptr, "linear (int8): the weight has no f32 copy for this CPU's f32 route");
    const Buffer<float> xf(M * K);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t m = 0; m < M; ++m) {
      const uint8_t* q = xq.data() + m * K;
      const uint8_t* r = xr + m * K;
      const float s = sx[m], s2 = sr[m];
      const int32_t z = zx[m];
      for (int64_t k = 0; k < K; ++k) {
        if (w.keep != nullptr && w.keep[k] == 0.0f) {  // an outlier channel: x as it is (wide holds W's column)
          xf[m * K + k] = x[m * xs + k];
          continue;
        }
        const float v = static_cast<float>(q[k] - z) * s;
        xf[m * K + k] = s2 != 0.0f ? v + static_cast<float>(r[k] - kernels::kSecondZero) * s2 : v;
      }
    }
    linear_wide(xf.data(), M, K, w.wide, bias, w.N, y, false, ys);
    apply_activation(act, y, M, w.N, ys);
    return;
  }
  // heads' own GEMM (CPUs without VNNI): the rows with a second term follow the M first terms
  // directly (in order: a row never moves down), so that one GEMM reads the weight once for both (a
  // decoder's single row: 1 or 2 rows), and the residual rows are folded into the weight (C = 2^p·W +
  // Wr there).
  const int64_t N = w.N, Nr = w.Nr;
  std::vector<int64_t> two;
  for (int64_t m = 0; m < M; ++m) {
    if (sr[m] != 0.0f) two.push_back(m);
  }
  const auto M2 = static_cast<int64_t>(two.size());
  for (int64_t j = 0; j < M2; ++j) {  // row two[j] of xr to row M + j of xq: never past it (two[j] ≥ j)
    if (M + j != Mp + two[j]) std::memmove(xq.data() + (M + j) * K, xr + two[j] * K, static_cast<size_t>(K));
  }
  const int16_t* pairs = w.pairs->get(w.W, N, K, w.Wr, w.rrows, w.rshift, Nr);
  if (M2 == 0) {  // one term per row: the output made from the sums in registers, every row in one call
    const int act_code = !act ? 0 : *act == Activation::Relu ? 1 : *act == Activation::Gelu ? 2 : 3;
    const kernels::PairsOut out{y, ys, zx.data(), sx.data(), w.fold_ws, w.fold_sw, bias, x, xs, w.oc, w.wo, w.no,
                                act_code};
    kernels::active().gemm_u8s8_pairs_out(xq.data(), M, K, K, pairs, N, out);
    return;
  }
  // With second terms one GEMM over them all, then the outputs a block of rows at a time.
  const int64_t Mt = M + M2;
  const Buffer<int32_t> acc(Mt * N);
  std::vector<int64_t> second(static_cast<size_t>(M), -1);  // row m's row among the sums' second terms
  for (int64_t j = 0; j < M2; ++j) second[static_cast<size_t>(two[j])] = M + j;
  const kernels::PairsProduct part{pairs, N, Mt, acc.data(), N};
  kernels::active().gemm_u8s8_pairs(xq.data(), Mt, K, K, &part, 1);
  const int64_t blocks = (M + kOutBlock - 1) / kOutBlock;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t bi = 0; bi < blocks; ++bi) {
    const int64_t m0 = bi * kOutBlock, m1 = std::min(M, m0 + kOutBlock);
    kernels::Int8Row rows[kOutBlock];
    for (int64_t m = m0; m < m1; ++m) {
      rows[m - m0] = int8_out_row(w, true, x, xs, m, zx.data(), sx.data(), sr.data(), bias, acc.data(), nullptr, 0, m,
                                  second[static_cast<size_t>(m)]);
    }
    kernels::active().int8_rows_out(rows, m1 - m0, y + m0 * ys, ys);
    apply_activation(act, y + m0 * ys, m1 - m0, N, ys);
  }
}

}  // namespace

std::string linear_gemm_route(Precision p) {
  switch (route_of(p)) {
    case Route::Native: return "native";
    case Route::Heads: return "heads";
    case Route::F32: return "f32";
    case Route::Portable: return "portable";
  }
  return "?";
}

bool batch_invariance_holds(Precision p) { return p != Precision::BF16 || route_of(p) != Route::Native; }

Tensor linear(const Tensor& x_in, const PackedLinear& w, const Tensor& b_in, DType out, std::optional<Activation> act) {
  const char* op = "linear";
  HEADS_CHECK(w.defined(), op, ": the packed weight is empty");
  HEADS_CHECK(out == DType::F32 || (out == DType::BF16 && w.precision() == Precision::BF16), op, ": output dtype ",
              dtype_name(out), " with a ", precision_name(w.precision()),
              " weight (expected f32, or bf16 with a bf16 weight)");
  HEADS_CHECK(!act || out == DType::F32, op, ": an activation is applied to f32 outputs only, not ", dtype_name(out));
  if (w.precision() == Precision::F32) return act ? activation(linear(x_in, w.data(), b_in), *act) : linear(x_in, w.data(), b_in);
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
    apply_activation(act, y.data<float>(), M, N, N);
    return y.to(out);
  }
  Tensor y = Tensor::empty(ys, out);
  if (w.precision() == Precision::BF16) {
    linear_bf16(x.raw_data(), x_bf16, M, K, K, static_cast<const uint16_t*>(w.data().raw_data()),
                w.wide().defined() ? w.wide().data<float>() : nullptr, bias, N, y.raw_data(), out == DType::BF16, N,
                w.gemm_b_.get());
    if (out == DType::F32) apply_activation(act, y.data<float>(), M, N, N);
  } else {
    Int8Weight iw{static_cast<const int8_t*>(w.data().raw_data()), w.scales().data<float>(), w.sums32_.data(), N};
    iw.fold_sw = w.fold_scales_.data();
    iw.fold_ws = w.fold_sums32_.data();
    iw.wide = w.wide().defined() ? w.wide().data<float>() : nullptr;
    iw.act_error = w.activation_error();
    if (w.outlier_channels().defined()) {
      iw.oc = w.outlier_channels().data<int64_t>();
      iw.wo = w.out_w_panels_.data<float>();
      iw.keep = w.keep_.data<float>();
      iw.no = w.outlier_channels().numel();
    }
    iw.packed = w.gemm_b_.get();
    iw.pairs = w.pairs_b_.get();
    if (w.residual_rows().defined()) {
      iw.Wr = static_cast<const int8_t*>(w.residual_data().raw_data());
      iw.swr = w.residual_scales().data<float>();
      iw.wrs = w.residual_row_sums().data<float>();
      iw.Wr_padded = static_cast<const int8_t*>(w.res_padded_.raw_data());
      iw.packed_r = w.gemm_res_b_.get();
      iw.rrows = w.res_rows32_.data();
      iw.rshift = w.res_shift_.data();
      iw.Nr = w.residual_rows().numel();
    }
    linear_int8(x.data<float>(), M, K, K, iw, bias, y.data<float>(), N, act);
  }
  return y;
}

}  // namespace heads
