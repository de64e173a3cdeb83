// dispatch.cc — CPU detection, HEADS_ISA override, the active kernel table.
#include "kernels/dispatch.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "heads/error.h"

namespace heads {

namespace {

constexpr Isa kAllIsas[] = {Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16, Isa::Amx};

#if defined(__x86_64__) && defined(__linux__)
// AMX-TILE and AMX-BF16 in CPUID, the tile state enabled by the OS (XCR0 bits 17, 18), and this
// process granted it (Linux keeps the 8 KB tile data out of a process until it asks, once).
bool amx_usable() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
    if (!tile || !bf16 || !__builtin_cpu_supports("osxsave")) return false;
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3u) != 3u) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
#else
[[maybe_unused]] bool amx_usable() { return false; }  // the tile state is requested from Linux
#endif

}  // namespace

std::string isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
    case Isa::Avx512Bf16: return "avx512bf16";
    case Isa::Amx: return "amx";
  }
  return "?";
}

Isa isa_from_name(const std::string& s) {
  for (Isa i : kAllIsas) {
    if (isa_name(i) == s) return i;
  }
  fail("unknown ISA \"", s, "\" (expected scalar, avx2, avx512, avx512bf16 or amx)");
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
    case Isa::Amx:
      return isa_supported(Isa::Avx512Bf16) && amx_usable();
#else
    default: return false;
#endif
  }
  return false;
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa i : kAllIsas) {
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
    case Isa::Amx: return &kernels::amx::kTable;
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
