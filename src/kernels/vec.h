// vec.h — small portable vector helpers shared by the f32 kernels.
#pragma once

#include <cstdint>

namespace heads::kernels {

// Dot product with eight independent partial sums, combined in a fixed tree: vectorises
// without reassociation flags and gives the same bits on every call.
inline float dot_f32(const float* a, const float* b, int64_t n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int u = 0; u < 8; ++u) s[u] += a[d + u] * b[d + u];
  }
  for (; d < n; ++d) s[0] += a[d] * b[d];
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

}  // namespace heads::kernels
