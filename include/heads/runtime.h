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
// scheduler has set aside, costs more than the work. And at most the CPUs this process may run on
// (its affinity mask, omp_get_num_procs()): with OMP_NUM_THREADS above that, a larger team only
// waits for time slices at every join. Results never depend on the team's size.
constexpr double kMinFlopsPerThread = 1e6;
int threads_for(double flops, int64_t tasks);
// Lifts threads_for's cap at the CPUs (off by default): the C++ tests turn it on, to run the teams
// of large machines (3, 7, 64 threads) on small ones.
void set_oversubscribe(bool on);

// Batch invariance. On, the f32 GEMMs of linear layers (and so MultiheadAttention, the encoder
// layers and the models built on them) compute every output as one fixed-order sum over k, so a
// row's result depends on that row and the weights alone: a sentence embeds to the same bits alone
// or in any batch, padded to any length, on any number of threads; and SDPA takes its tiled kernel
// for every shape (the decode kernel, for up to 4 queries, sums in another order). The row-wise
// kernels are invariant already. Off, the default, the SIMD paths' linear layers run oneDNN's
// GEMM, which can be faster but changes the order of a row's sums with the number of rows around
// it (on AVX2: rows in a tail of 1 to 3 of its 6-row blocks), so two batchings can differ in the
// last bits (and calls of at most 4 rows, a decoder's step, read the weight as stored with an order
// of their own: linear_gemm_route in heads/precision.h). Results stay exact to the same tolerance
// either way. Holds for f32 and int8 (integer
// sums; the f32 route through this GEMM), and for bf16 where it takes the f32 route; not through
// oneDNN's native bf16 matmul (batch_invariance_holds in heads/precision.h says which).
// HEADS_BATCH_INVARIANT=1 in the environment turns it on at start-up.
void set_batch_invariant(bool on);
bool batch_invariant();

// The default generator hands out one 64-bit seed per random op (dropout); manual_seed makes
// the sequence of those seeds, and so every dropout mask, reproducible — like torch.manual_seed.
void manual_seed(uint64_t seed);
uint64_t next_seed();

}  // namespace heads
