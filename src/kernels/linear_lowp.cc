// linear_lowp.cc — the reduced-precision linear layers of include/heads/precision.h at each call:
// routes, the bf16 call (activations converted, oneDNN's bf16 matmul on the SIMD paths and plain
// loops on the portable one) and linear() for both precisions; the int8 call is linear_lowp_int8.cc.
// The weights are packed once by linear_lowp_pack.cc.
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

using lowp::Buffer;
using lowp::Int8Weight;
using lowp::Route;
using lowp::apply_activation;
using lowp::kRowBlock;
using lowp::linear_wide;
using lowp::native_matmul;
using lowp::onednn_native;
using lowp::route_of;

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


}  // namespace

lowp::Route lowp::route_of(Precision p) {
  const auto& k = kernels::active();
  if (!k.onednn) return Route::Portable;
  if (p == Precision::Int8 && kernels::int8_gemm_usable(k) && (int8_gemm_forced() || !onednn_native(p))) {
    return Route::Heads;
  }
  return onednn_native(p) ? Route::Native : Route::F32;
}

// On AMX, heads' tile GEMM (gemm_i8_amx-inl.h), whose output pass runs on each block of sums while it
// is in L1, where every activation row has one term (a weight with activation_error ∞: the calibrated
// models); with second terms its sums are stored and made into outputs after, as oneDNN's are, and
// oneDNN's GEMM is faster there (Intel Xeon with AMX, 2 threads, heads bench linear --rows 864 --dtype
// int8: one term 1.01 against 1.24 ms at K 384, N 1536; two terms 3.3 against 2.2 ms).
lowp::Route lowp::int8_route(double activation_error) {
  const Route route = route_of(Precision::Int8);
  const auto& k = kernels::active();
  if (route == Route::Native && std::isinf(activation_error) && k.isa == Isa::Amx && kernels::int8_gemm_usable(k)) {
    return Route::Heads;
  }
  return route;
}

bool lowp::needs_f32_copy(Precision p) {
  if (p == Precision::F32 || onednn_native(p)) return false;
  if (p == Precision::BF16) return true;
  for (Isa isa : supported_isas()) {  // int8: a SIMD path without heads' GEMM takes the f32 route
    const kernels::KernelTable* t = kernels::table_for(isa);
    if (t != nullptr && t->onednn && !kernels::int8_gemm_usable(*t)) return true;
  }
  return false;
}

void set_int8_gemm(const std::string& how) {
  HEADS_CHECK(how == "auto" || how == "heads", "set_int8_gemm: expected \"auto\" or \"heads\", got \"", how, "\"");
  g_int8_gemm.store(how == "heads" ? 1 : 0, std::memory_order_relaxed);
}

// oneDNN's matmul for a bf16 / int8 call; false where oneDNN turns out to have none for this CPU after
// all (the caller's portable loops then run), any other failure an error naming the shapes.
bool lowp::native_matmul(const char* precision, const kernels::MatmulCall& call, const void* a, const void* b,
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
void lowp::linear_wide(const float* xf, int64_t M, int64_t K, const float* Wf, const float* bias, int64_t N, void* y,
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

namespace {

// y [M, N] (row stride ys; f32, or bf16 when y_bf16) from x [M, K] rows (stride xs; f32, or bf16 when
// x_bf16) through bf16 W [N, K] and bias; Wf: W widened to f32, for the f32 route.
void linear_bf16(const void* x, bool x_bf16, int64_t M, int64_t K, int64_t xs, const uint16_t* W, const float* Wf,
                 const float* bias, int64_t N, void* y, bool y_bf16, int64_t ys, kernels::PackedB* packed) {
  const auto& k = kernels::active();
  if (M <= kernels::kGemvRows && k.gemv_bf16 != nullptr && !batch_invariant()) {
    // A few rows (a decoder's step) on W as stored, on every route: bf16(x) times W, the products
    // exact in f32 and summed in f32, as the native GEMM forms them.
    const Buffer<uint16_t> xb(x_bf16 ? 1 : M * K);
    const Buffer<float> yf(y_bf16 ? M * N : 1);
    if (!x_bf16) k.f32_to_bf16_rows(static_cast<const float*>(x), xb.data(), M, K, xs, K);
    float* yo = y_bf16 ? yf.data() : static_cast<float*>(y);
    const int64_t yos = y_bf16 ? N : ys;
    k.gemv_bf16(x_bf16 ? static_cast<const uint16_t*>(x) : xb.data(), M, K, x_bf16 ? xs : K, W, bias, N, yo, yos);
    if (y_bf16) k.f32_to_bf16_rows(yf.data(), static_cast<uint16_t*>(y), M, N, N, ys);
    return;
  }
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
    k.f32_to_bf16_rows(static_cast<const float*>(x), converted.data(), M, K, xs, K);
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

}  // namespace

// act (when given) on `rows` rows of n values (row stride ys) in place, by the kernel table's
// elementwise ops: each value's bits as activation() gives them.
void lowp::apply_activation(std::optional<Activation> act, float* y, int64_t rows, int64_t n, int64_t ys) {
  if (!act || rows == 0) return;
  const auto& k = kernels::active();
  if (*act == Activation::Relu) {
    k.relu_f32(y, y, rows, n, ys, ys);
  } else {
    k.gelu_f32(y, y, rows, n, ys, ys, *act == Activation::GeluTanh);
  }
}


namespace {

std::string route_name(Route r) {
  switch (r) {
    case Route::Native: return "native";
    case Route::Heads: return "heads";
    case Route::F32: return "f32";
    case Route::Portable: return "portable";
  }
  return "?";
}

}  // namespace

std::string linear_gemm_route(Precision p) { return route_name(route_of(p)); }

std::string linear_gemm_route(const PackedLinear& w) {
  HEADS_CHECK(w.defined(), "linear_gemm_route: the packed weight is empty");
  return w.precision() == Precision::Int8 ? route_name(lowp::int8_route(w.activation_error()))
                                          : linear_gemm_route(w.precision());
}

bool batch_invariance_holds(Precision p) { return p != Precision::BF16 || route_of(p) != Route::Native; }

Tensor linear(const Tensor& x_in, const PackedLinear& w, const Tensor& b_in, DType out, std::optional<Activation> act) {
  const char* op = "linear";
  HEADS_CHECK(w.defined(), op, ": the packed weight is empty");
  HEADS_CHECK(out == DType::F32 || (out == DType::BF16 && w.precision() == Precision::BF16), op, ": output dtype ",
              dtype_name(out), " with a ", precision_name(w.precision()),
              " weight (expected f32, or bf16 with a bf16 weight)");
  HEADS_CHECK(!act || out == DType::F32, op, ": an activation is applied to f32 outputs only, not ", dtype_name(out));
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
  if (w.precision() == Precision::F32) {  // the f32 GEMM, reading W through its own layout where it has one
    kernels::linear_f32(x.data<float>(), M, K, K, w.data().data<float>(), bias, N, y.data<float>(), N, w.gemm_b_.get());
    apply_activation(act, y.data<float>(), M, N, N);
    return y;
  }
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
      iw.W_stacked = static_cast<const int8_t*>(w.stacked_.raw_data());
      iw.rrows = w.res_rows32_.data();
      iw.rshift = w.res_shift_.data();
      iw.Nr = w.residual_rows().numel();
      iw.fold_shift = w.fold_shift32_.data();
      iw.fold_col = w.fold_col32_.data();
      iw.fold_mask = w.fold_mask32_.data();
    }
    lowp::linear_int8(x.data<float>(), M, K, K, iw, bias, y.data<float>(), N, act);
  }
  return y;
}

}  // namespace heads
