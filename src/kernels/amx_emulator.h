// amx_emulator.h — the AMX tile operations the kernels use (ldtilecfg, tileloadd, tilestored,
// tilezero, tdpbf16ps, tdpbusd, tilerelease), in scalar C++, for isa_amx_emu.cc: sdpa_amx-inl.h and
// gemm_i8_amx-inl.h compiled over these instead of the instructions, from the same text, so that the
// AMX kernels run (slowly, with the instruction's numerics) on a CPU without tiles. HEADS_AMX_EMULATE=1 offers that build
// as the `amx` ISA where the CPU has AVX2 and FMA (the kernels' AVX-512 code written over AVX2,
// simd/avx512_on_avx2-inl.h) and no usable AMX.
//
// Numerics of tdpbf16ps, as the current Intel SDM's pseudo-code gives them (the older text's
// "tmp += even product; tmp += odd product" into the destination did not match the tiles of a
// Sapphire Rapids-class Xeon bit for bit): for each destination element, two f32 partial sums that
// start at zero, one over the even elements of the pairs and one over the odd elements, each step a
// fused multiply-add (the exact product added, one rounding to nearest even); then the two partial
// sums are added (one rounding), and that sum is added to the destination (one rounding). bf16
// inputs and destination values that are denormal read as zero (DAZ), every denormal result is
// flushed to a zero of its sign (FTZ), and MXCSR is neither read nor written: the host's FTZ / DAZ
// bits change nothing here (add_product never hands the FPU a denormal f32 operand, and flushes by
// hand).
// Tile state is per thread, as the hardware's is per logical CPU; using a tile before ldtilecfg, or
// a configuration other than palette 1 with rows <= 16 and colsb <= 64 (multiples of 4), is an error
// (the instruction would fault).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "heads/error.h"

namespace heads::kernels::amx_emulator {

struct Tiles {
  alignas(64) uint8_t reg[8][16 * 64];
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  bool configured = false;
};

inline Tiles& tiles() {
  thread_local Tiles t;
  return t;
}

// The 64-byte ldtilecfg operand: palette, start_row, 14 reserved, colsb[16], rows[16].
inline void configure(const void* cfg) {
  const auto* b = static_cast<const uint8_t*>(cfg);
  Tiles& t = tiles();
  HEADS_CHECK(b[0] == 1, "AMX emulator: ldtilecfg: palette ", int{b[0]}, " (only palette 1 exists)");
  for (int i = 0; i < 8; ++i) {
    uint16_t colsb;
    std::memcpy(&colsb, b + 16 + 2 * i, 2);
    const uint8_t rows = b[48 + i];
    HEADS_CHECK(rows <= 16 && colsb <= 64 && colsb % 4 == 0 && (rows == 0) == (colsb == 0),
                "AMX emulator: ldtilecfg: tile ", i, " of ", int{rows}, " rows x ", colsb,
                " bytes (palette 1: at most 16 x 64, a multiple of 4 bytes)");
    t.rows[i] = rows;
    t.colsb[i] = colsb;
  }
  std::memset(t.reg, 0, sizeof t.reg);  // ldtilecfg zeroes the tiles
  t.configured = true;
}

inline Tiles& configured(int tile) {
  Tiles& t = tiles();
  HEADS_CHECK(t.configured && tile >= 0 && tile < 8 && t.rows[tile] > 0,
              "AMX emulator: tile ", tile, " used without a configuration that gives it rows");
  return t;
}

inline void load(int tile, const void* base, int64_t stride) {
  Tiles& t = configured(tile);
  const auto* p = static_cast<const uint8_t*>(base);
  std::memset(t.reg[tile], 0, sizeof t.reg[tile]);
  for (int r = 0; r < t.rows[tile]; ++r) std::memcpy(t.reg[tile] + r * 64, p + r * stride, t.colsb[tile]);
}

inline void store(int tile, void* base, int64_t stride) {
  const Tiles& t = configured(tile);
  auto* p = static_cast<uint8_t*>(base);
  for (int r = 0; r < t.rows[tile]; ++r) std::memcpy(p + r * stride, t.reg[tile] + r * 64, t.colsb[tile]);
}

inline void zero(int tile) { std::memset(configured(tile).reg[tile], 0, sizeof(Tiles::reg[0])); }

inline void release() { tiles() = Tiles{}; }

// bf16 (its 16 bits) as f32, a denormal as a zero of its sign.
inline float bf16_in(uint16_t h) {
  if ((h & 0x7f80u) == 0) h &= 0x8000u;
  const uint32_t bits = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float flush(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }

// acc + a·b rounded once to f32, then flushed. The product of two bf16 is exact in double (and may
// lie below f32's range, where f32 arithmetic under the host's FTZ would flush it before the
// addition); the double sum rounded to f32 is the correctly rounded sum (53 >= 2·24 + 2 bits).
inline float add_product(float acc, uint16_t a, uint16_t b) {
  const double s = static_cast<double>(acc) + static_cast<double>(bf16_in(a)) * static_cast<double>(bf16_in(b));
  return flush(static_cast<float>(s));
}

// x + y rounded once to f32 (exact in double), inputs read as DAZ does, the result flushed.
inline float add_flushed(float x, float y) {
  return flush(static_cast<float>(static_cast<double>(flush(x)) + static_cast<double>(flush(y))));
}

// The shapes of C += A·B on tiles c, a, b, 32-bit lanes: M rows, N lanes of C, K lanes of A (rows of
// B); a configuration where they do not chain is an error (the instruction would fault).
struct Chain {
  int M, N, K;
};
inline Chain chain(const char* op, int c, int a, int b) {
  const Tiles& t = configured(c);
  configured(a);
  configured(b);
  const int M = t.rows[c], N = t.colsb[c] / 4, K = t.colsb[a] / 4;
  HEADS_CHECK(t.rows[a] == M && t.rows[b] == K && t.colsb[b] == t.colsb[c], "AMX emulator: ", op,
              ": shapes do not chain (C ", M, " x ", N, ", A ", int{t.rows[a]}, " x ", K, ", B ", int{t.rows[b]},
              " x ", t.colsb[b] / 4, ")");
  return {M, N, K};
}

// C[m][n] += (sum over k of A[m][2k] B[k][2n]) + (sum over k of A[m][2k+1] B[k][2n+1]) (bf16 pairs,
// f32 C): the even and the odd partial sums apart, then added, then added to C.
inline void dpbf16ps(int c, int a, int b) {
  Tiles& t = configured(c);
  const auto [M, N, K] = chain("tdpbf16ps", c, a, b);
  for (int m = 0; m < M; ++m) {
    float* crow = reinterpret_cast<float*>(t.reg[c] + m * 64);
    const auto* arow = reinterpret_cast<const uint16_t*>(t.reg[a] + m * 64);
    for (int n = 0; n < N; ++n) {
      float even = 0.0f, odd = 0.0f;
      for (int k = 0; k < K; ++k) {
        const auto* brow = reinterpret_cast<const uint16_t*>(t.reg[b] + k * 64);
        even = add_product(even, arow[2 * k], brow[2 * n]);
        odd = add_product(odd, arow[2 * k + 1], brow[2 * n + 1]);
      }
      crow[n] = add_flushed(crow[n], add_flushed(even, odd));
    }
  }
}

// C[m][n] += Σ_k Σ_{i<4} A[m][4k + i]·B[k][4n + i], A unsigned bytes, B signed bytes, C int32: the SDM's
// pseudo-code for tdpbusd sums the four products of each 32-bit lane in 32 bits and adds them to C,
// without saturation (wrapping modulo 2^32, done here in unsigned arithmetic).
inline void dpbusd(int c, int a, int b) {
  Tiles& t = configured(c);
  const auto [M, N, K] = chain("tdpbusd", c, a, b);
  for (int m = 0; m < M; ++m) {
    auto* crow = reinterpret_cast<int32_t*>(t.reg[c] + m * 64);
    const uint8_t* arow = t.reg[a] + m * 64;
    for (int n = 0; n < N; ++n) {
      uint32_t sum = static_cast<uint32_t>(crow[n]);
      for (int k = 0; k < K; ++k) {
        const auto* brow = reinterpret_cast<const int8_t*>(t.reg[b] + k * 64);
        for (int i = 0; i < 4; ++i) {
          sum += static_cast<uint32_t>(int32_t{arow[4 * k + i]} * int32_t{brow[4 * n + i]});
        }
      }
      crow[n] = static_cast<int32_t>(sum);
    }
  }
}

}  // namespace heads::kernels::amx_emulator
