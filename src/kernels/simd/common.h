// common.h — definitions shared by every ISA build of the kernels (included before the
// per-ISA `#pragma GCC target`, so nothing here is compiled for a specific ISA).
#pragma once

#include <cstdint>

#define HEADS_INLINE inline __attribute__((always_inline))

namespace heads::kernels {

// 2^f ≈ 1 + C1 f + ... + C6 f^6 on [-1/2, 1/2] (Taylor; relative error <= 1.2e-7).
inline constexpr float kExp2C1 = 0.693147180559945309f;
inline constexpr float kExp2C2 = 0.240226506959100712f;
inline constexpr float kExp2C3 = 0.0555041086648215800f;
inline constexpr float kExp2C4 = 0.00961812910762847716f;
inline constexpr float kExp2C5 = 0.00133335581464284434f;
inline constexpr float kExp2C6 = 0.000154035303933816100f;

inline constexpr float kLog2e = 1.44269504088896340736f;
inline constexpr float kLn2 = 0.693147180559945309417f;

// The largest of n lanes stored at t, as the vector layers' reduce_max defines it: from the first
// lane, each later one taken only where it is greater (NaN lanes but the first are skipped).
HEADS_INLINE float max_of_lanes(const float* t, int n) {
  float m = t[0];
  for (int i = 1; i < n; ++i) m = t[i] > m ? t[i] : m;
  return m;
}

// vpermt2w indices that interleave two rows of 32 bf16, a and b: kBf16PairLo gives the dwords
// (a[n], b[n]) for n < 16, kBf16PairHi for 16 <= n < 32 (pairs of V rows for the bf16 products).
alignas(64) inline constexpr uint16_t kBf16PairLo[32] = {
    0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) inline constexpr uint16_t kBf16PairHi[32] = {
    16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

}  // namespace heads::kernels
