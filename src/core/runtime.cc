// runtime.cc — thread count and the default seed generator.
#include "heads/runtime.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string_view>
#include <random>
#include <thread>

#include "heads/error.h"

namespace heads {

namespace {
std::atomic<uint64_t> g_state{[] {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}()};

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

namespace {
std::atomic<bool> g_batch_invariant{[] {
  const char* env = std::getenv("HEADS_BATCH_INVARIANT");
  return env != nullptr && std::string_view(env) == "1";
}()};
}  // namespace

void set_batch_invariant(bool on) { g_batch_invariant.store(on); }

bool batch_invariant() { return g_batch_invariant.load(std::memory_order_relaxed); }

void set_num_threads(int n) {
  HEADS_CHECK(n >= 1 && n <= kMaxThreads, "set_num_threads: expected 1 to ", kMaxThreads, " threads, got ", n,
              " (this machine has ", std::thread::hardware_concurrency(), " hardware threads)");
  omp_set_num_threads(n);
}

int get_num_threads() { return std::min(omp_get_max_threads(), kMaxThreads); }

namespace {
std::atomic<bool> g_oversubscribe{false};
}  // namespace

void set_oversubscribe(bool on) { g_oversubscribe.store(on); }

int threads_for(double flops, int64_t tasks) {
  const double by_work = std::max(1.0, flops / kMinFlopsPerThread);
  const int64_t n = std::min<int64_t>(tasks, by_work < 1e9 ? static_cast<int64_t>(by_work) : int64_t{1} << 30);
  int cap = get_num_threads();
  if (!g_oversubscribe.load(std::memory_order_relaxed)) {
    static const int cpus = std::max(1, omp_get_num_procs());  // the affinity mask at start-up
    cap = std::min(cap, cpus);
  }
  return static_cast<int>(std::clamp<int64_t>(n, 1, cap));
}

void manual_seed(uint64_t seed) { g_state.store(seed); }

uint64_t next_seed() { return splitmix64(g_state.fetch_add(1)); }

}  // namespace heads
