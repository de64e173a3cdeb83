#include "kernels/scratch.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>

namespace heads::kernels {

float* thread_scratch(int64_t floats) {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<float, Free> block;
  thread_local int64_t capacity = 0;
  if (floats > capacity) {
    const int64_t n = (floats + 15) / 16 * 16;  // aligned_alloc wants a multiple of the alignment
    block.reset();
    capacity = 0;
    auto* p = static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(n) * sizeof(float)));
    if (p == nullptr) throw std::bad_alloc();
    // NaN, so that a kernel reading scratch it has not written shows up in every test's output.
    std::fill(p, p + n, std::numeric_limits<float>::quiet_NaN());
    block.reset(p);
    capacity = n;
  }
  static const bool poison = [] {
    const char* e = std::getenv("HEADS_SCRATCH_POISON");
    return e != nullptr && *e != '\0' && *e != '0';
  }();
  if (poison) std::fill(block.get(), block.get() + floats, std::numeric_limits<float>::quiet_NaN());
  return block.get();
}

}  // namespace heads::kernels
