#include "kernels/scratch.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>

namespace heads::kernels {

namespace {

bool poison() {
  static const bool on = [] {
    const char* e = std::getenv("HEADS_SCRATCH_POISON");
    return e != nullptr && *e != '\0' && *e != '0';
  }();
  return on;
}

float* aligned_floats(int64_t floats) {
  const int64_t n = (floats + 15) / 16 * 16;  // aligned_alloc wants a multiple of the alignment
  auto* p = static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(std::max<int64_t>(n, 16)) * sizeof(float)));
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace

float* thread_scratch(int64_t floats) {
  thread_local std::unique_ptr<float, FreeScratch> block;
  thread_local int64_t capacity = 0;
  if (floats > capacity) {
    const int64_t n = (floats + 15) / 16 * 16;
    block.reset();
    capacity = 0;
    float* p = aligned_floats(n);
    // NaN, so that a kernel reading scratch it has not written shows up in every test's output.
    std::fill(p, p + n, std::numeric_limits<float>::quiet_NaN());
    block.reset(p);
    capacity = n;
  }
  if (poison()) std::fill(block.get(), block.get() + floats, std::numeric_limits<float>::quiet_NaN());
  return block.get();
}

CallScratch call_scratch(int64_t floats) {
  CallScratch p(aligned_floats(floats));
  if (poison()) std::fill(p.get(), p.get() + floats, std::numeric_limits<float>::quiet_NaN());
  return p;
}

}  // namespace heads::kernels
