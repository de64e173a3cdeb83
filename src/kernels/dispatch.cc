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
#if defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

#include "heads/error.h"

namespace heads {

namespace {

// Best last within each architecture (a CPU supports the paths of one of them).
constexpr Isa kAllIsas[] = {Isa::Scalar, Isa::Neon, Isa::NeonBf16, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16, Isa::Amx};

#if defined(__x86_64__) && defined(__linux__)
// Whether the AMX kernels can run on the tiles, or the first reason they cannot: AMX-TILE and
// AMX-BF16 in CPUID; the OS enabling the tile state (XSAVE enabled, XCR0 bits 17 and 18); palette 1
// of CPUID leaf 0x1D offering the 8 tiles of 16 rows x 64 bytes the kernels configure (a VM can
// advertise AMX and give no usable palette); and Linux granting this process the 8 KB tile data
// (ARCH_REQ_XCOMP_PERM, asked once). An empty string: usable.
const std::string& amx_unusable_reason() {
  static const std::string reason = []() -> std::string {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "no CPUID leaf 7";
    if (!((d >> 24) & 1u) || !((d >> 22) & 1u)) return "no AMX-TILE / AMX-BF16 in CPUID";
    if (!__builtin_cpu_supports("osxsave")) return "the OS has not enabled XSAVE";
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3u) != 3u) return "the OS has not enabled the tile state (XCR0 bits 17, 18)";
    if (__get_cpuid_max(0, nullptr) < 0x1d || !__get_cpuid_count(0x1d, 0, &a, &b, &c, &d) || a < 1) {
      return "no tile palette in CPUID leaf 0x1D";
    }
    __get_cpuid_count(0x1d, 1, &a, &b, &c, &d);
    const unsigned bytes_per_row = b & 0xffffu, names = b >> 16, rows = c & 0xffffu;
    if (bytes_per_row < 64 || names < 8 || rows < 16) {
      return "palette 1 has " + std::to_string(names) + " tiles of " + std::to_string(rows) + " rows x " +
             std::to_string(bytes_per_row) + " bytes (the kernels use 8 of 16 x 64)";
    }
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
      return "Linux refused the tile state (ARCH_REQ_XCOMP_PERM)";
    }
    return "";
  }();
  return reason;
}
#else
const std::string& amx_unusable_reason() {
  static const std::string reason = "AMX is an x86-64 extension (not this architecture)";
  return reason;
}
#endif

bool amx_usable() { return amx_unusable_reason().empty(); }

// HEADS_AMX_EMULATE=1 on a CPU without usable AMX: the `amx` ISA runs over the tile emulator
// (isa_amx_emu.cc: the tiles in scalar C++, the kernels' AVX-512 vector code written over AVX2). Tests may force
// it on or off (kernels::set_amx_emulation): -1 reads the environment.
std::atomic<int> g_amx_emulation{-1};

bool amx_emulated() {
  static const bool from_env = [] {
    const char* e = std::getenv("HEADS_AMX_EMULATE");
    return e != nullptr && std::string(e) == "1" && !amx_usable();
  }();
  const int forced = g_amx_emulation.load(std::memory_order_relaxed);
  return forced < 0 ? from_env : forced == 1;
}

const kernels::KernelTable* table_of(Isa isa);  // below; null where this build left the ISA out

}  // namespace

std::string isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
    case Isa::Avx512Bf16: return "avx512bf16";
    case Isa::Amx: return "amx";
    case Isa::Neon: return "neon";
    case Isa::NeonBf16: return "neonbf16";
  }
  return "?";
}

Isa isa_from_name(const std::string& s) {
  for (Isa i : kAllIsas) {
    if (isa_name(i) == s) return i;
  }
  fail("unknown ISA \"", s, "\" (expected scalar, avx2, avx512, avx512bf16, amx, neon or neonbf16)");
}

bool kernels::cpu_runs(Isa isa) {
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
      return cpu_runs(Isa::Avx512) && __builtin_cpu_supports("avx512bf16");
    case Isa::Amx:
      // every CPU with tiles has AVX512_BF16; the emulated build needs AVX2 and FMA alone
      return amx_usable() ? cpu_runs(Isa::Avx512Bf16) : amx_emulated() && cpu_runs(Isa::Avx2);
#elif defined(__aarch64__)
    case Isa::Neon: return true;  // Advanced SIMD is part of every AArch64 CPU
#if defined(__linux__)
    case Isa::NeonBf16:  // BFDOT, BFCVTN (FEAT_BF16); FP16 for the build's constants, DotProd for its int8
                         // GEMM (isa_neonbf16.cc: its target has both, as every FEAT_BF16 core does)
      return (getauxval(AT_HWCAP2) & HWCAP2_BF16) != 0 && (getauxval(AT_HWCAP) & HWCAP_ASIMDHP) != 0 &&
             (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#endif
#endif
    default: return false;
  }
  return false;
}

// The CPU runs the ISA and this build has its kernels (HEADS_KERNEL_ISAS may leave some out: CI's
// sanitizer build keeps avx512bf16 without avx512 where the CPU has both).
bool isa_supported(Isa isa) { return table_of(isa) != nullptr && kernels::cpu_runs(isa); }

std::string cpu_features() {
  std::string out;
  const auto add = [&](bool has, const char* name) {
    if (has) out += std::string(" ") + name;
  };
#if defined(__x86_64__)
  out = "x86-64:";
  add(__builtin_cpu_supports("avx2"), "avx2");
  add(__builtin_cpu_supports("fma"), "fma");
  add(__builtin_cpu_supports("avx512f"), "avx512f");
  add(__builtin_cpu_supports("avx512bw"), "avx512bw");
  add(__builtin_cpu_supports("avx512vl"), "avx512vl");
  add(__builtin_cpu_supports("avx512dq"), "avx512dq");
  add(__builtin_cpu_supports("avx512vnni"), "avx512vnni");
  add(__builtin_cpu_supports("avx512bf16"), "avx512bf16");
#if defined(__linux__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    add((d >> 22) & 1u, "amx-bf16");
    add((d >> 24) & 1u, "amx-tile");
    add((d >> 25) & 1u, "amx-int8");
  }
#endif
#elif defined(__aarch64__) && defined(__linux__)
  out = "aarch64:";
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  add(hw & HWCAP_ASIMD, "asimd");
  add(hw & HWCAP_ASIMDDP, "dotprod");
  add(hw2 & HWCAP2_BF16, "bf16");
  add(hw2 & HWCAP2_I8MM, "i8mm");
  add(hw & HWCAP_SVE, "sve");
  add(hw2 & HWCAP2_SVE2, "sve2");
#else
  out = "this architecture: no vector paths (scalar kernels)";
#endif
  return out;
}

std::string amx_status() {
  if (amx_usable()) return "tiles";
  if (amx_emulated()) {
    if (isa_supported(Isa::Amx)) return "emulated (HEADS_AMX_EMULATE=1)";
    return kernels::cpu_runs(Isa::Avx2) ? "HEADS_AMX_EMULATE=1, but this build left the emulated kernels out"
                                        : "HEADS_AMX_EMULATE=1, but the CPU lacks AVX2 and FMA";
  }
  return "unusable: " + amx_unusable_reason();
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa i : kAllIsas) {
    if (isa_supported(i)) out.push_back(i);
  }
  return out;
}

namespace {

// The table of an ISA's kernels, or null where this build left them out (HEADS_KERNEL_ISAS).
const kernels::KernelTable* table_of(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return &kernels::scalar::kTable;
#ifndef HEADS_WITHOUT_ISA_AVX2
    case Isa::Avx2: return &kernels::avx2::kTable;
#endif
#ifndef HEADS_WITHOUT_ISA_NEON
    case Isa::Neon: return &kernels::neon::kTable;
#endif
#ifndef HEADS_WITHOUT_ISA_NEONBF16
    case Isa::NeonBf16: return &kernels::neonbf16::kTable;
#endif
#ifndef HEADS_WITHOUT_ISA_AVX512
    case Isa::Avx512: return &kernels::avx512::kTable;
#endif
#ifndef HEADS_WITHOUT_ISA_AVX512BF16
    case Isa::Avx512Bf16: return &kernels::avx512bf16::kTable;
#endif
    case Isa::Amx:
      if (amx_emulated()) {
#ifndef HEADS_WITHOUT_ISA_AMX_EMU
        return &kernels::amx_emu::kTable;
#endif
      } else {
#ifndef HEADS_WITHOUT_ISA_AMX
        return &kernels::amx::kTable;
#endif
      }
      return nullptr;
    default: return nullptr;
  }
}

Isa initial_isa() {
  if (const char* env = std::getenv("HEADS_ISA"); env != nullptr && *env != '\0') {
    const Isa isa = isa_from_name(env);
    HEADS_CHECK(isa_supported(isa), "HEADS_ISA=", env, ": this CPU cannot run the ", env,
                " kernels");
    return isa;
  }
  // The best the CPU runs natively: the emulated tiles only when asked for by name.
  const std::vector<Isa> isas = supported_isas();
  return isas.back() == Isa::Amx && amx_emulated() ? isas[isas.size() - 2] : isas.back();
}

std::atomic<const kernels::KernelTable*> g_table{nullptr};

}  // namespace

Isa active_isa() { return kernels::active().isa; }

void set_isa(Isa isa) {
  HEADS_CHECK(isa_supported(isa), "set_isa: this CPU cannot run the ", isa_name(isa), " kernels");
  g_table.store(table_of(isa));
}

namespace kernels {

const KernelTable* table_for(Isa isa) { return isa_supported(isa) ? table_of(isa) : nullptr; }

bool int8_gemm_usable(const KernelTable& t) {
  if (t.gemm_u8s8_pairs == nullptr) return false;
  if (t.int8_layout == Int8Layout::Pairs16) return true;
#if defined(__aarch64__) && defined(__linux__)
  return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__x86_64__) && defined(__linux__)
  // the AMX builds' tile GEMM (tdpbusd): AMX-INT8 beside the tiles amx_usable checked, or the emulator
  if (t.isa != Isa::Amx) return false;
  if (amx_emulated()) return true;
  unsigned a = 0, b = 0, c = 0, d = 0;
  return amx_usable() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 25) & 1u) != 0;
#else
  return false;
#endif
}

void set_amx_emulation(int mode) { g_amx_emulation.store(mode < 0 ? -1 : mode > 0 ? 1 : 0); }

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
