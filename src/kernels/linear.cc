// linear.cc — plain f32 linear layer: blocked dot products, OpenMP over output blocks.
#include "kernels/linear.h"

#include <algorithm>

#include "heads/runtime.h"
#include "kernels/vec.h"

namespace heads::kernels {

namespace {

constexpr int64_t kRows = 16;  // x rows per task: W block is reused from cache across them
constexpr int64_t kCols = 64;  // W rows per task

}  // namespace

void linear_f32(const float* x, int64_t M, int64_t K, int64_t x_stride, const float* W,
                const float* bias, int64_t N, float* y, int64_t y_stride) {
  const int64_t mb = (M + kRows - 1) / kRows, nb = (N + kCols - 1) / kCols;
  const int64_t tasks = mb * nb;
  if (tasks == 0) return;
  const int threads = static_cast<int>(std::min<int64_t>(get_num_threads(), tasks));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t m0 = (t / nb) * kRows, n0 = (t % nb) * kCols;
    const int64_t m1 = std::min(M, m0 + kRows), n1 = std::min(N, n0 + kCols);
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * x_stride;
      float* yr = y + m * y_stride;
      for (int64_t n = n0; n < n1; ++n) {
        yr[n] = dot_f32(xr, W + n * K, K) + (bias ? bias[n] : 0.0f);
      }
    }
  }
}

}  // namespace heads::kernels
