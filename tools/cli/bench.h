// bench.h — what `heads bench`'s subcommands share (cmd_bench.cc; cmd_bench_sdpa.cc, `heads bench
// sdpa`): the parsed flags, random inputs, and the rule of DESIGN.md's bench contract: a warm-up, then
// repeats until at least --min-time seconds and 5 runs, their median.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "heads/precision.h"
#include "heads/tensor.h"

namespace heads::cli::bench {

struct BenchArgs {
  std::string model, input;
  int64_t batch_size = 32;
  int64_t B = 1, H = 1, Hkv = 0, Lq = 128, Lk = 0, D = 64, Dv = 0, L = 128, E = 768, pad = 0;
  int64_t M = 256, K = 384, N = 1536;  // bench linear
  double activation_error = 0.0;
  double residual_error = kInt8ResidualError;  // bench linear (int8)
  bool causal = false, json = false, backward = false;
  std::string dtype = "f32", mask = "none", window;
  std::string kv_dtype;  // bench sdpa: K/V storage (empty: --dtype's)
  std::string embed_dtype = "auto";  // bench embed: as the model directory stores it by default
  double dropout = 0.0, softcap = 0.0;
  bool alibi = false, sinks = false, batch_invariant = false;
  std::string block_sparse;  // DENSITY,BLOCK
  int64_t heads_off = 0;     // heads per batch entry turned off by head_mask (gated off)
  uint64_t seed = 1;
  int threads = 0;
  double min_time = 1.0;
  // bench sdpa: each size a comma-separated list; every combination is timed (a grid).
  std::string grid_B = "1", grid_H = "1", grid_Hkv, grid_Lq = "128", grid_Lk, grid_D = "64", grid_Dv;
};

// A tensor of standard normal values drawn from `seed`.
Tensor random_tensor(const Shape& shape, uint64_t seed);

// The process's resident-set high-water mark, MB.
double peak_rss_mb();

// Runs of fn (at least min_runs) until `seconds` have passed, each run's milliseconds appended to ms.
template <class F>
void time_runs(F&& fn, double seconds, size_t min_runs, std::vector<double>& ms) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (size_t n = 0; n < min_runs || std::chrono::duration<double>(clock::now() - start).count() < seconds; ++n) {
    const auto t0 = clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
  }
}

double median(std::vector<double> v);

// Median milliseconds of fn over repeats lasting at least min_time seconds.
template <class F>
double median_ms(F&& fn, double min_time) {
  fn();  // warm-up
  std::vector<double> ms;
  time_runs(fn, min_time, 5, ms);
  return median(ms);
}

// --dtype f32 or bf16.
DType parse_dtype(const std::string& dtype);

// `heads bench sdpa` (cmd_bench_sdpa.cc).
void run_sdpa(const BenchArgs& a);

}  // namespace heads::cli::bench
