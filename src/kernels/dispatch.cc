// dispatch.cc — CPU detection, HEADS_ISA override, the active kernel table.
#include "kernels/dispatch.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>

#include "heads/error.h"

namespace heads {

std::string isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
    case Isa::Avx512Bf16: return "avx512bf16";
  }
  return "?";
}

Isa isa_from_name(const std::string& s) {
  for (Isa i : {Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16}) {
    if (isa_name(i) == s) return i;
  }
  fail("unknown ISA \"", s, "\" (expected scalar, avx2, avx512 or avx512bf16)");
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return true;
#if defined(__x86_64__) || defined(__i386__)
    case Isa::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::Avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma");
    case Isa::Avx512Bf16:
      return isa_supported(Isa::Avx512) && __builtin_cpu_supports("avx512bf16");
#else
    default: return false;
#endif
  }
  return false;
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa i : {Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16}) {
    if (isa_supported(i)) out.push_back(i);
  }
  return out;
}

namespace {

const kernels::KernelTable* table_of(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return &kernels::scalar::kTable;
    case Isa::Avx2: return &kernels::avx2::kTable;
    case Isa::Avx512: return &kernels::avx512::kTable;
    case Isa::Avx512Bf16: return &kernels::avx512bf16::kTable;
  }
  return &kernels::scalar::kTable;
}

Isa initial_isa() {
  if (const char* env = std::getenv("HEADS_ISA"); env != nullptr && *env != '\0') {
    const Isa isa = isa_from_name(env);
    HEADS_CHECK(isa_supported(isa), "HEADS_ISA=", env, ": this CPU cannot run the ", env,
                " kernels");
    return isa;
  }
  return supported_isas().back();
}

std::atomic<const kernels::KernelTable*> g_table{nullptr};

}  // namespace

Isa active_isa() { return kernels::active().isa; }

void set_isa(Isa isa) {
  HEADS_CHECK(isa_supported(isa), "set_isa: this CPU cannot run the ", isa_name(isa), " kernels");
  g_table.store(table_of(isa));
}

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

namespace kernels {

const KernelTable& active() {
  const KernelTable* t = g_table.load(std::memory_order_acquire);
  if (t == nullptr) {
    t = table_of(initial_isa());
    g_table.store(t, std::memory_order_release);
  }
  return *t;
}

}  // namespace kernels

}  // namespace heads
