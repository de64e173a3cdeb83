// isa.h — the kernels' instruction-set paths: which this CPU runs, which is in use (detected at
// start-up, HEADS_ISA overrides), and the measured peak of the one in use (`heads bench peak`).
#pragma once

#include <string>
#include <vector>

namespace heads {

// Instruction-set paths of the kernels. `scalar` is portable C++ (no intrinsics); every SIMD
// path is tested against it and against the float64 references.
// avx512bf16 is avx512 plus AVX512_BF16 (vdpbf16ps) for bf16 attention; amx is avx512bf16 plus AMX
// tiles (AMX-TILE, AMX-BF16) for bf16 attention, where the OS grants the tile state. neon is
// AArch64's Advanced SIMD (every AArch64 CPU); neonbf16 is neon plus FEAT_BF16 (BFDOT) for bf16
// attention. The x86 paths exist on x86-64 only, the neon ones on AArch64 only.
enum class Isa { Scalar, Avx2, Avx512, Avx512Bf16, Amx, Neon, NeonBf16 };

// "scalar", "avx2", "avx512", "avx512bf16", "amx", "neon", "neonbf16"
std::string isa_name(Isa isa);
Isa isa_from_name(const std::string& s);  // throws heads::Error for an unknown name
bool isa_supported(Isa isa);              // can this CPU run it, and has this build its kernels?
std::vector<Isa> supported_isas();        // best last
// The path in use: the best supported one, or HEADS_ISA from the environment.
Isa active_isa();
// Forces a path (throws heads::Error if this CPU cannot run it).
void set_isa(Isa isa);
// Why the amx path is or is not offered, in words (`heads bench peak` prints it): "tiles" when the
// CPU, the OS and Linux's permission all allow them; "emulated (HEADS_AMX_EMULATE=1)" when the
// kernels run over the scalar tile emulator; otherwise the first check that failed.
std::string amx_status();
// The CPU's architecture and the features the kernels look at, in words (`heads bench peak` prints
// it): on x86-64 e.g. "x86-64: avx2 fma avx512f ... amx-bf16"; on AArch64 "aarch64: asimd dotprod
// bf16 i8mm sve" (from the kernel's hardware capabilities, getauxval).
std::string cpu_features();

// Measured f32 FMA throughput of the active path on `threads` threads (GFLOP/s): independent
// FMA chains on every thread at once, best of a few runs of about `seconds` each.
double measure_fma_peak_gflops(int threads, double seconds = 0.2);
// The same for the bf16 dot product (vdpbf16ps, BFDOT); 0 when the active path has none.
double measure_bf16_peak_gflops(int threads, double seconds = 0.2);
// The same for AMX tiles (tdpbf16ps); 0 when the active path is not amx.
double measure_amx_peak_gflops(int threads, double seconds = 0.2);
// Measured memory read bandwidth of the active path on `threads` threads (GB/s, 10^9 bytes): each
// thread sums its slice of a `bytes` buffer (far past the caches) with vector loads; best of the
// passes made in about `seconds` (at least 3).
double measure_read_bandwidth_gbs(int threads, double seconds = 0.2, int64_t bytes = int64_t{1} << 30);
// How the active path computes bf16 attention's products: "amx" (tiles), "dot" (vdpbf16ps on
// avx512bf16, BFDOT on neonbf16) or "widen" (bf16 widened to f32, f32 FMAs). avx512bf16 and neonbf16
// pick dot or widen by measuring both rates once (HEADS_BF16_DOT=1|0 forces one).
const char* bf16_attention_products();
// Forces that choice for the whole process: "dot" or "widen"; "auto" returns to the
// measured choice (or HEADS_BF16_DOT's). Both give results within bf16's rounding of P of each
// other; the tests run their bf16 cases under both. Throws heads::Error for another name.
void set_bf16_attention_products(const std::string& how);

}  // namespace heads
