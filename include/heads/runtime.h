// runtime.h — process-wide settings: worker threads and the default random generator.
#pragma once

#include <cstdint>

namespace heads {

// Worker threads for every parallel kernel (default: all cores, or OMP_NUM_THREADS).
void set_num_threads(int n);
int get_num_threads();

// The default generator hands out one 64-bit seed per random op (dropout); manual_seed makes
// the sequence of those seeds, and so every dropout mask, reproducible — like torch.manual_seed.
void manual_seed(uint64_t seed);
uint64_t next_seed();

}  // namespace heads
