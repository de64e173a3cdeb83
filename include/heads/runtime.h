// runtime.h — process-wide settings: worker threads and the default random generator.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace heads {

// Instruction-set paths of the kernels. `scalar` is portable C++ (no intrinsics); every SIMD
// path is tested against it and against the float64 references.
// avx512bf16 is avx512 plus AVX512_BF16 (vdpbf16ps) for bf16 attention.
enum class Isa { Scalar, Avx2, Avx512, Avx512Bf16 };

std::string isa_name(Isa isa);            // "scalar", "avx2", "avx512", "avx512bf16"
Isa isa_from_name(const std::string& s);  // throws heads::Error for an unknown name
bool isa_supported(Isa isa);              // can this CPU run it?
std::vector<Isa> supported_isas();        // best last
// The path in use: the best supported one, or HEADS_ISA from the environment.
Isa active_isa();
// Forces a path (throws heads::Error if this CPU cannot run it).
void set_isa(Isa isa);

// Measured f32 FMA throughput of the active path on `threads` threads (GFLOP/s): independent
// FMA chains on every thread at once, best of a few runs of about `seconds` each.
double measure_fma_peak_gflops(int threads, double seconds = 0.2);
// The same for the bf16 dot product (vdpbf16ps); 0 when the active path has none.
double measure_bf16_peak_gflops(int threads, double seconds = 0.2);

// Worker threads for every parallel kernel (default: all cores, or OMP_NUM_THREADS).
// n must be in [1, kMaxThreads]; anything else is an error (never a silent clamp). A value of
// OMP_NUM_THREADS above the limit is read as the limit.
constexpr int kMaxThreads = 1024;
void set_num_threads(int n);
int get_num_threads();

// Threads a parallel region of `flops` of work in `tasks` independent pieces is worth: at most
// get_num_threads() and `tasks`, and one per kMinFlopsPerThread of work, so that a small call runs
// on the calling thread alone — waking another thread, and on a busy machine waiting for one the
// scheduler has set aside, costs more than the work.
constexpr double kMinFlopsPerThread = 1e6;
int threads_for(double flops, int64_t tasks);

// The default generator hands out one 64-bit seed per random op (dropout); manual_seed makes
// the sequence of those seeds, and so every dropout mask, reproducible — like torch.manual_seed.
void manual_seed(uint64_t seed);
uint64_t next_seed();

}  // namespace heads
