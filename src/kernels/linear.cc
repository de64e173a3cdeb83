// linear.cc — the GEMMs (linear.h): oneDNN's matmul (JIT GEMM with runtime ISA dispatch) for the
// SIMD paths, the plain loops for the portable one, and the entry points that pick by the kernel table.
//
// W is stored [N, K] as torch stores it; oneDNN reads it as a [K, N] matrix with strides {1, K},
// so no copy is made. Primitives are created once per shape and kept (the GEMM's JIT code is
// also cached by oneDNN itself). oneDNN runs on the same OpenMP runtime and thread count as
// heads' own kernels.
#include "kernels/linear.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <unordered_map>

#include "heads/error.h"
#include "heads/runtime.h"
#include "kernels/dispatch.h"

namespace heads::kernels {

namespace {

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// (M, K, N, A strides, B strides, C row stride, bias, threads)
using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, int>;

// oneDNN sizes a primitive's parallel work for the OpenMP thread count of the thread creating it
// and keeps that count: primitives are created and run with omp_set_num_threads(n) in force on the
// calling thread, and n is part of their key.
class OmpThreads {
 public:
  explicit OmpThreads(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~OmpThreads() { omp_set_num_threads(saved_); }
  OmpThreads(const OmpThreads&) = delete;
  OmpThreads& operator=(const OmpThreads&) = delete;

 private:
  int saved_;
};

struct Entry {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
};

// Matmul primitives by shape and strides; bounded. Callers hold a shared reference, so another
// thread clearing the full cache never frees a primitive in use.
std::shared_ptr<const Entry> primitive_for(const Key& key) {
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<const Entry>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (cache.size() >= 256) cache.clear();
  const auto [M, K, N, a_rs, a_cs, b_rs, b_cs, ys, has_bias, threads] = key;
  using dt = dnnl::memory::data_type;
  const dnnl::memory::desc src({M, K}, dt::f32, {a_rs, a_cs});
  const dnnl::memory::desc wei({K, N}, dt::f32, {b_rs, b_cs});
  const dnnl::memory::desc dst({M, N}, dt::f32, {ys, 1});
  const dnnl::memory::desc bias({1, N}, dt::f32, {N, 1});
  const auto desc = has_bias ? dnnl::matmul::desc(src, wei, bias, dst) : dnnl::matmul::desc(src, wei, dst);
  // oneDNN's library-managed scratchpad is not for concurrent execution unless the library is built
  // with DNNL_ENABLE_CONCURRENT_EXEC (Debian's is not): MHA calls from several Python threads at once
  // gave wrong results. Each call passes its thread's own scratchpad (run_matmul).
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::matmul::primitive_desc pd(desc, attr, cpu_engine());
  return cache.emplace(key, std::make_shared<const Entry>(Entry{pd, dnnl::matmul(pd)})).first->second;
}

void run_matmul(const Key& key, const float* a, const float* b, const float* bias, float* c) {
  const OmpThreads threads(std::get<9>(key));
  const std::shared_ptr<const Entry> entry = primitive_for(key);
  const Entry& e = *entry;
  const auto& pd = e.pd;
  dnnl::engine& eng = cpu_engine();
  dnnl::stream stream(eng);
  dnnl::memory src(pd.src_desc(), eng, const_cast<float*>(a));
  dnnl::memory wei(pd.weights_desc(), eng, const_cast<float*>(b));
  dnnl::memory dst(pd.dst_desc(), eng, c);
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}};
  if (bias) args.emplace(DNNL_ARG_BIAS, dnnl::memory(pd.bias_desc(), eng, const_cast<float*>(bias)));
  // This thread's scratchpad, kept across calls (grown to the largest a primitive asked for).
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<void, Free> scratch;
  thread_local size_t scratch_size = 0;
  const dnnl::memory::desc sd = pd.scratchpad_desc();
  if (sd.get_size() > 0) {
    if (scratch_size < sd.get_size()) {
      const size_t n = (sd.get_size() + 63) / 64 * 64;
      scratch.reset(std::aligned_alloc(64, n));
      HEADS_CHECK(scratch != nullptr, "linear: cannot allocate a ", n, "-byte oneDNN scratchpad");
      scratch_size = n;
    }
    args.emplace(DNNL_ARG_SCRATCHPAD, dnnl::memory(sd, eng, scratch.get()));
  }
  e.prim.execute(stream, args);
  stream.wait();
}

int gemm_threads(int64_t M, int64_t N, int64_t K) {
  return threads_for(2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K),
                     std::max<int64_t>(M, N));
}

}  // namespace

void linear_f32(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W,
                const float* bias, int64_t N, float* y, int64_t y_stride) {
  HEADS_DCHECK(M >= 0 && K >= 0 && N >= 0);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) y[m * y_stride + n] = bias ? bias[n] : 0.0f;
    }
    return;
  }
  active().linear_f32(x, M, K, x_stride, W, bias, N, y, y_stride);
}

void matmul_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs,
                const float* B, int64_t b_rs, int64_t b_cs, float* C, int64_t c_stride) {
  HEADS_DCHECK(M >= 0 && K >= 0 && N >= 0);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t m = 0; m < M; ++m) std::fill(C + m * c_stride, C + m * c_stride + N, 0.0f);
    return;
  }
  active().matmul_f32(M, N, K, A, a_rs, a_cs, B, b_rs, b_cs, C, c_stride);
}

void linear_f32_onednn(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W,
                       const float* bias, int64_t N, float* y, int64_t y_stride) {
  try {
    // W [N, K] read as the [K, N] matrix Wᵀ: strides {1, K}.
    run_matmul({M, K, N, x_stride, 1, 1, K, y_stride, bias != nullptr, gemm_threads(M, N, K)}, x, W, bias, y);
  } catch (const dnnl::error& e) {
    fail("linear: oneDNN matmul failed for x [", M, ", ", K, "] and weight [", N, ", ", K,
         "]: ", e.what());
  }
}

void matmul_f32_onednn(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs,
                       const float* B, int64_t b_rs, int64_t b_cs, float* C, int64_t c_stride) {
  try {
    run_matmul({M, K, N, a_rs, a_cs, b_rs, b_cs, c_stride, false, gemm_threads(M, N, K)}, A, B, nullptr, C);
  } catch (const dnnl::error& e) {
    fail("matmul: oneDNN matmul failed for [", M, ", ", K, "] x [", K, ", ", N, "]: ", e.what());
  }
}

void matmul_f32_plain(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs,
                      const float* B, int64_t b_rs, int64_t b_cs, float* C, int64_t c_stride) {
  const int threads = gemm_threads(M, N, K);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += A[m * a_rs + k * a_cs] * B[k * b_rs + n * b_cs];
      C[m * c_stride + n] = acc;
    }
  }
}

void linear_f32_plain(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W,
                      const float* bias, int64_t N, float* y, int64_t y_stride) {
  matmul_f32_plain(M, N, K, x, x_stride, 1, W, 1, K, y, y_stride);  // W [N, K] read as Wᵀ [K, N]
  if (bias == nullptr) return;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) y[m * y_stride + n] += bias[n];
  }
}

}  // namespace heads::kernels
