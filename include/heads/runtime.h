// runtime.h — process-wide settings: the kernels' instruction-set path (heads/isa.h), worker
// threads and the default random generator.
#pragma once

#include <cstdint>

#include "heads/isa.h"

namespace heads {

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
