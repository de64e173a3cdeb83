// peak.cc — the machine's measured peak on the active path (`heads bench peak`): the table's probe
// kernels (peak-inl.h) run on every thread at once and timed.
#include "heads/isa.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <omp.h>
#include <string>

#include "heads/error.h"
#include "kernels/dispatch.h"

namespace heads {

namespace {

// Runs `probe` on `threads` threads at once; best GFLOP/s of a few runs of about `seconds`.
double measure_probe(float (*probe)(int64_t), int flops_per_iter, int threads, double seconds) {
  using clock = std::chrono::steady_clock;
  int64_t iters = 1 << 16;
  float sink = 0;  // consumed below, so the probe's result is live
  double best = 0;
  for (int round = 0; round < 8; ++round) {
    const auto t0 = clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += probe(iters);
    const double s = std::chrono::duration<double>(clock::now() - t0).count();
    if (s < seconds / 4) {  // too short to time: grow and retry
      iters *= 4;
      continue;
    }
    best = std::max(best, static_cast<double>(iters) * flops_per_iter * threads / s / 1e9);
    if (round >= 4) break;
  }
  return std::isnan(sink) ? 0.0 : best;
}

}  // namespace

namespace kernels {

namespace {
// set_bf16_attention_products: -1 auto, 0 widen, 1 dot.
std::atomic<int> forced_bf16_dot{-1};

// The table of the path that chooses between the bf16 dot product and widening (avx512bf16 or
// neonbf16) where this CPU runs it, else null.
const KernelTable* dot_table() {
#ifndef HEADS_WITHOUT_ISA_AVX512BF16
  if (isa_supported(Isa::Avx512Bf16)) return &avx512bf16::kTable;
#endif
#ifndef HEADS_WITHOUT_ISA_NEONBF16
  if (isa_supported(Isa::NeonBf16)) return &neonbf16::kTable;
#endif
  return nullptr;
}
}  // namespace

bool bf16_dot_pays() {
  if (const int forced = forced_bf16_dot.load(std::memory_order_relaxed); forced >= 0) return forced == 1;
  static const bool pays = [] {
    if (const char* env = std::getenv("HEADS_BF16_DOT"); env != nullptr && *env != '\0') {
      const std::string v = env;
      HEADS_CHECK(v == "0" || v == "1", "HEADS_BF16_DOT must be 0 or 1, got \"", v, "\"");
      return v == "1";
    }
    const KernelTable* t = dot_table();
    if (t == nullptr) return false;
    const double dot = measure_probe(t->bf16_probe, t->bf16_probe_flops_per_iter(), 1, 0.004);
    const double fma = measure_probe(t->fma_probe, t->fma_probe_flops_per_iter(), 1, 0.004);
    return dot > fma;
  }();
  return pays;
}

}  // namespace kernels

const char* bf16_attention_products() {
  switch (active_isa()) {
    case Isa::Amx: return "amx";
    case Isa::Avx512Bf16:
    case Isa::NeonBf16: return kernels::bf16_dot_pays() ? "dot" : "widen";
    default: return "widen";
  }
}

void set_bf16_attention_products(const std::string& how) {
  HEADS_CHECK(how == "auto" || how == "dot" || how == "widen",
              "set_bf16_attention_products: how must be \"auto\", \"dot\" or \"widen\", got \"", how, "\"");
  kernels::forced_bf16_dot.store(how == "auto" ? -1 : how == "dot" ? 1 : 0, std::memory_order_relaxed);
}

double measure_fma_peak_gflops(int threads, double seconds) {
  HEADS_CHECK(threads >= 1, "measure_fma_peak_gflops: threads must be positive, got ", threads);
  const kernels::KernelTable& k = kernels::active();
  return measure_probe(k.fma_probe, k.fma_probe_flops_per_iter(), threads, seconds);
}

double measure_bf16_peak_gflops(int threads, double seconds) {
  HEADS_CHECK(threads >= 1, "measure_bf16_peak_gflops: threads must be positive, got ", threads);
  const kernels::KernelTable& k = kernels::active();
  if (k.bf16_probe == nullptr) return 0.0;
  return measure_probe(k.bf16_probe, k.bf16_probe_flops_per_iter(), threads, seconds);
}

double measure_amx_peak_gflops(int threads, double seconds) {
  HEADS_CHECK(threads >= 1, "measure_amx_peak_gflops: threads must be positive, got ", threads);
  const kernels::KernelTable& k = kernels::active();
  if (k.tile_probe == nullptr) return 0.0;
  return measure_probe(k.tile_probe, k.tile_probe_flops_per_iter(), threads, seconds);
}

double measure_read_bandwidth_gbs(int threads, double seconds, int64_t bytes) {
  HEADS_CHECK(threads >= 1, "measure_read_bandwidth_gbs: threads must be positive, got ", threads);
  HEADS_CHECK(bytes >= (int64_t{1} << 20), "measure_read_bandwidth_gbs: bytes must be at least 1 MiB, got ", bytes);
  using clock = std::chrono::steady_clock;
  const kernels::KernelTable& k = kernels::active();
  // One slice per thread, each a multiple of 4 KiB (so 64-byte aligned and whole 4·W blocks).
  const int64_t slice = bytes / threads / 4096 * 4096 / static_cast<int64_t>(sizeof(float));
  HEADS_CHECK(slice > 0, "measure_read_bandwidth_gbs: ", bytes, " bytes are too few for ", threads, " threads");
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  const size_t total = static_cast<size_t>(slice * threads) * sizeof(float);
  std::unique_ptr<float, Free> buf(static_cast<float*>(std::aligned_alloc(4096, total)));
  HEADS_CHECK(buf != nullptr, "measure_read_bandwidth_gbs: cannot allocate ", total, " bytes");
  float* x = buf.get();
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int t = 0; t < threads; ++t) {  // each thread touches its own slice first (its pages near it)
    std::fill(x + t * slice, x + (t + 1) * slice, 1.0f);
  }
  float sink = 0;
  double best = 0, spent = 0;
  for (int round = 0; round < 16 && (round < 3 || spent < seconds); ++round) {
    const auto t0 = clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += k.read_probe(x + static_cast<int64_t>(omp_get_thread_num()) * slice, slice);
    const double s = std::chrono::duration<double>(clock::now() - t0).count();
    spent += s;
    best = std::max(best, static_cast<double>(total) / s / 1e9);
  }
  return std::isnan(sink) ? 0.0 : best;
}

}  // namespace heads
