// common.h — definitions shared by every ISA build of the kernels (included before the
// per-ISA `#pragma GCC target`, so nothing here is compiled for a specific ISA).
#pragma once

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

}  // namespace heads::kernels
