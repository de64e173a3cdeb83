// The tile emulator (src/kernels/amx_emulator.h) against the definition of the instructions it
// stands for, and, on a CPU with AMX tiles, the AMX kernels over it against the same kernels on the
// tiles, bit for bit. The AMX kernels themselves run over it in the suite's bf16 SDPA tests under
// HEADS_AMX_EMULATE=1 (ctest: sdpa_amx_emulated).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>

#include "common/testing.h"
#include "heads/isa.h"
#include "heads/sdpa.h"
#include "kernels/sdpa_case.h"
#include "kernels/amx_emulator.h"
#include "kernels/dispatch.h"

#include <immintrin.h>

#include <random>
#include <vector>

#include "kernels/simd/common.h"

// The f32 -> bf16 rounding of the AMX kernels, built as the tile build has it (the AVX512_BF16
// instructions) and as the emulated build has it (AVX-512F integer operations written over AVX2 by
// avx512_on_avx2-inl.h; the native one first, while GCC's macro forms of intrinsics are defined).
#pragma GCC diagnostic ignored "-Wignored-attributes"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace round_native {
#define HEADS_NATIVE_BF16 1
#include "kernels/simd/bf16_round_avx512-inl.h"
#undef HEADS_NATIVE_BF16
void convert(const uint32_t* in, uint16_t* out) {
  __m512 lo, hi;
  std::memcpy(&lo, in, 64);
  std::memcpy(&hi, in + 16, 64);
  const __m512i r = to_bf16_2(hi, lo);
  std::memcpy(out, &r, 64);
}
}  // namespace round_native
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
namespace round_emulated {
#include "kernels/simd/avx512_on_avx2-inl.h"
#include "kernels/simd/bf16_round_avx512-inl.h"
void convert(const uint32_t* in, uint16_t* out) {  // 32 values
  __m512 lo, hi;
  std::memcpy(&lo, in, 64);
  std::memcpy(&hi, in + 16, 64);
  const __m512i r = to_bf16_2(hi, lo);
  std::memcpy(out, &r, 64);
}
}  // namespace round_emulated
#pragma GCC pop_options

namespace heads {
namespace {

namespace emu = kernels::amx_emulator;
using ::testing::HasSubstr;
using testing::error_of;

uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);  // the values below are exact in bf16
}

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 (C: rows x n f32), 1 (A: rows x k bf16 pairs), 2 (B: k x n bf16 pairs).
Config dp_config(int rows, int n, int k) {
  Config cfg;
  cfg.rows[0] = static_cast<uint8_t>(rows), cfg.colsb[0] = static_cast<uint16_t>(4 * n);
  cfg.rows[1] = static_cast<uint8_t>(rows), cfg.colsb[1] = static_cast<uint16_t>(4 * k);
  cfg.rows[2] = static_cast<uint8_t>(k), cfg.colsb[2] = static_cast<uint16_t>(4 * n);
  return cfg;
}

// C (rows x n f32) += A (rows x 2k bf16) · B (k pairs x n), through the emulator's tiles 0, 1, 2.
std::vector<float> dp(const std::vector<float>& c, const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                      int rows, int n, int k) {
  const Config cfg = dp_config(rows, n, k);
  emu::configure(&cfg);
  emu::load(0, c.data(), 4 * n);
  emu::load(1, a.data(), 4 * k);
  emu::load(2, b.data(), 4 * n);
  emu::dpbf16ps(0, 1, 2);
  std::vector<float> out(static_cast<size_t>(rows * n));
  emu::store(0, out.data(), 4 * n);
  emu::release();
  return out;
}

// The same C += A·B on the tiles themselves (tiles 0, 1, 2 as `dp` configures them); call only
// where amx_status() is "tiles".
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
void dp_on_tiles(const Config& cfg, float* c, const uint16_t* a, const uint16_t* b, int n, int k) {
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm0" : : "r"(static_cast<void*>(c)), "r"(int64_t{4} * n) : "memory");
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm1" : : "r"(a), "r"(int64_t{4} * k) : "memory");
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm2" : : "r"(b), "r"(int64_t{4} * n) : "memory");
  __asm__ volatile("tdpbf16ps %%tmm2, %%tmm1, %%tmm0" : : : "memory");
  __asm__ volatile("tilestored %%tmm0, (%0,%1,1)" : : "r"(static_cast<void*>(c)), "r"(int64_t{4} * n) : "memory");
  __asm__ volatile("tilerelease" : : : "memory");
}
#pragma GCC pop_options

TEST(AmxEmulator, DotProductGivesTheTilesBits) {
  // One tdpbf16ps on the tiles against the emulator: the probes of OrderDenormalsAndErrors, then
  // random tiles whose values span 2^-40 .. 2^40 (sums that round, cancel and flush).
  if (amx_status() != "tiles") GTEST_SKIP() << "needs AMX tiles to compare with: " << amx_status();
  const auto check = [](const std::vector<float>& c, const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                        int rows, int n, int k) {
    const Config cfg = dp_config(rows, n, k);
    std::vector<float> hw = c;
    dp_on_tiles(cfg, hw.data(), a.data(), b.data(), n, k);
    const std::vector<float> em = dp(c, a, b, rows, n, k);
    for (size_t i = 0; i < hw.size(); ++i) {
      uint32_t h, e;
      std::memcpy(&h, &hw[i], 4);
      std::memcpy(&e, &em[i], 4);
      if (h != e) {
        ADD_FAILURE() << "element " << i << " (row " << i / n << ", column " << i % n << ") of " << rows << " x " << n
                      << " (k = " << k << "): tiles " << hw[i] << " (0x" << std::hex << h << "), emulator " << em[i]
                      << " (0x" << e << std::dec << "), destination before " << c[i];
        return;
      }
    }
  };
  const uint16_t one = bf16_bits(1.0f);
  check({0.0f}, {bf16_bits(0x1p25f), one, bf16_bits(-0x1p25f), 0}, {one, one, one, one}, 1, 1, 2);
  check({0x1p25f}, std::vector<uint16_t>(6, one), {one, 0, one, 0, one, 0}, 1, 1, 3);
  check({0x1p-140f}, {bf16_bits(0x1p-60f), 0}, {bf16_bits(0x1p-60f), 0}, 1, 1, 1);
  check({0x1p-125f}, {bf16_bits(-0x1.8p-63f), 0}, {bf16_bits(0x1p-63f), 0}, 1, 1, 1);
  auto& g = testing::rng();
  std::uniform_real_distribution<float> mant(-2, 2);
  std::uniform_int_distribution<int> expo(-40, 40);
  for (int trial = 0; trial < 200; ++trial) {
    const int rows = 16, n = 16, k = 16;
    std::vector<float> c(rows * n);
    std::vector<uint16_t> a(rows * 2 * k), b(k * 2 * n);
    for (auto& x : c) x = std::ldexp(mant(g), expo(g));
    for (auto& x : a) x = bf16_bits(std::ldexp(mant(g), expo(g) / 2));
    for (auto& x : b) x = bf16_bits(std::ldexp(mant(g), expo(g) / 2));
    check(c, a, b, rows, n, k);
    if (HasFailure()) break;
  }
}

TEST(AmxEmulator, DotProductFollowsTheInstructionsDefinition) {
  // Random bf16 pairs against the SDM's definition written out in double: per destination element an
  // even and an odd partial sum from zero, each step the exact product added with one rounding to
  // f32; then the two sums added, then the destination plus that (products of bf16 are exact).
  auto& g = testing::rng();
  std::uniform_real_distribution<float> u(-4, 4);
  const int rows = 13, n = 11, k = 7;  // not the kernels' 16 x 16 x 16: every size is read from the config
  std::vector<float> c(rows * n);
  std::vector<uint16_t> a(rows * 2 * k), b(k * 2 * n);
  for (auto& x : c) x = u(g);
  for (auto& x : a) x = bf16_bits(u(g));
  for (auto& x : b) x = bf16_bits(u(g));
  const auto got = dp(c, a, b, rows, n, k);
  const auto add = [](float x, double y) { return static_cast<float>(static_cast<double>(x) + y); };
  for (int m = 0; m < rows; ++m) {
    for (int j = 0; j < n; ++j) {
      float part[2] = {0.0f, 0.0f};
      for (int p = 0; p < k; ++p) {
        for (int e = 0; e < 2; ++e) {
          part[e] = add(part[e], static_cast<double>(emu::bf16_in(a[m * 2 * k + 2 * p + e])) *
                                     static_cast<double>(emu::bf16_in(b[p * 2 * n + 2 * j + e])));
        }
      }
      ASSERT_EQ(got[m * n + j], add(c[m * n + j], add(part[0], part[1]))) << m << "," << j;
    }
  }
}

TEST(AmxEmulator, OrderDenormalsAndErrors) {
  // The even and the odd elements sum apart: 2^25 (even) + 1 (odd) - 2^25 (even) is 1, where one
  // running sum would round 2^25 + 1 back to 2^25 and end at 0.
  std::vector<uint16_t> a = {bf16_bits(0x1p25f), bf16_bits(1.0f), bf16_bits(-0x1p25f), bf16_bits(0.0f)};
  std::vector<uint16_t> b = {bf16_bits(1.0f), bf16_bits(1.0f), bf16_bits(1.0f), bf16_bits(1.0f)};
  EXPECT_EQ(dp({0.0f}, a, b, 1, 1, 2)[0], 1.0f);
  // The destination comes last: 2^25 + (1 + 1 + 1) is 2^25 + 4 (ulp 4, 3 rounds up), where adding
  // the ones to 2^25 one by one would lose each of them.
  EXPECT_EQ(dp({0x1p25f}, std::vector<uint16_t>(6, bf16_bits(1.0f)),
               {bf16_bits(1.0f), 0, bf16_bits(1.0f), 0, bf16_bits(1.0f), 0}, 1, 1, 3)[0],
            0x1p25f + 4.0f);
  // A denormal bf16 input is read as zero; a denormal result is flushed to zero (with its sign).
  const uint16_t denormal = 0x0001;  // 2^-133
  EXPECT_EQ(dp({1.0f}, {denormal, 0}, {bf16_bits(0x1p100f), 0}, 1, 1, 1)[0], 1.0f);
  // -2^-140 flushes to -0 in the even sum; -0 + (+0 from the odd sum) is +0.
  const float tiny = dp({0.0f}, {bf16_bits(-0x1p-70f), 0}, {bf16_bits(0x1p-70f), 0}, 1, 1, 1)[0];
  EXPECT_EQ(tiny, 0.0f);
  // A denormal destination reads as zero, and a sum that lands below f32's normal range is flushed.
  EXPECT_EQ(dp({0x1p-140f}, {bf16_bits(0x1p-60f), 0}, {bf16_bits(0x1p-60f), 0}, 1, 1, 1)[0], 0x1p-120f);
  // (2^-125 - 1.5·2^-126 = 2^-127, a denormal)
  EXPECT_EQ(dp({0x1p-125f}, {bf16_bits(-0x1.8p-63f), 0}, {bf16_bits(0x1p-63f), 0}, 1, 1, 1)[0], 0.0f);
  // Faults of the instructions are errors.
  Config bad;
  bad.palette = 2;
  EXPECT_THAT(error_of([&] { emu::configure(&bad); }), HasSubstr("palette 2"));
  Config wide;
  wide.rows[0] = 16, wide.colsb[0] = 128;
  EXPECT_THAT(error_of([&] { emu::configure(&wide); }), HasSubstr("tile 0 of 16 rows x 128 bytes"));
  emu::release();
  EXPECT_THAT(error_of([] { emu::zero(3); }), HasSubstr("tile 3 used without a configuration"));
}

// vcvtneps2bf16 as the Intel SDM defines it (convert_fp32_to_bfloat16).
uint16_t bf16_by_definition(uint32_t u) {
  const uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return static_cast<uint16_t>((u | 0x00400000u) >> 16);  // NaN: quieted
  if (mag < 0x00800000u) return static_cast<uint16_t>((u >> 16) & 0x8000u);     // zero, denormal: +-0
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);         // nearest even
}

TEST(AmxEmulator, Bf16RoundingFollowsTheInstructionsDefinition) {
  if (!kernels::cpu_runs(Isa::Avx2)) GTEST_SKIP() << "the emulated AMX build needs AVX2 and FMA";
  std::vector<uint32_t> in = {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x00800000u, 0x80800000u,
                              0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u, 0x7f7fffffu, 0xff7fffffu,
                              0x7f800000u, 0xff800000u, 0x7f800001u, 0xffc00000u, 0x7fbfffffu, 0x7f7f8000u};
  std::uniform_int_distribution<uint32_t> bits;
  while (in.size() % 32 != 0 || in.size() < 32 * 2048) {
    uint32_t u = bits(testing::rng());
    if (in.size() % 3 == 0) u = (u & 0xffff0000u) | 0x8000u;     // ties
    if (in.size() % 7 == 0) u &= 0x807fffffu;                     // denormals
    in.push_back(u);
  }
  const bool native = kernels::cpu_runs(Isa::Avx512Bf16);
  std::vector<uint16_t> emulated(in.size()), instruction(in.size());
  for (size_t i = 0; i < in.size(); i += 32) {
    round_emulated::convert(in.data() + i, emulated.data() + i);
    if (native) round_native::convert(in.data() + i, instruction.data() + i);
  }
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(emulated[i], bf16_by_definition(in[i])) << std::hex << "f32 bits 0x" << in[i];
    if (native) ASSERT_EQ(instruction[i], emulated[i]) << std::hex << "f32 bits 0x" << in[i];
  }
  if (!native) std::cout << "(no AVX512_BF16 here: the instruction itself was not compared)\n";
}

TEST(AmxEmulator, OfferedAsAmxOnlyWhenAskedFor) {
  const testing::IsaGuard guard;
  const bool tiles = amx_status() == "tiles";
  kernels::set_amx_emulation(0);
  EXPECT_EQ(isa_supported(Isa::Amx), tiles);
  kernels::set_amx_emulation(1);
  EXPECT_EQ(isa_supported(Isa::Amx), tiles || kernels::cpu_runs(Isa::Avx2));  // AVX2 and FMA are enough
  if (isa_supported(Isa::Amx)) {
    set_isa(Isa::Amx);
    EXPECT_EQ(active_isa(), Isa::Amx);
    EXPECT_STREQ(bf16_attention_products(), "amx");
  }
  if (!tiles) {
    EXPECT_THAT(amx_status(), HasSubstr(kernels::cpu_runs(Isa::Avx2) ? "emulated" : "lacks AVX2"));
  }
  kernels::set_amx_emulation(-1);
}

TEST(AmxEmulator, KernelsOverTheEmulatorGiveTheTilesBits) {
  if (amx_status() != "tiles") GTEST_SKIP() << "needs AMX tiles to compare with: " << amx_status();
  const testing::IsaGuard guard;
  std::vector<SdpaCase> cases(2);
  cases[0].H = 2, cases[0].Lq = 129, cases[0].causal = true;
  cases[1].B = 2, cases[1].H = 4, cases[1].Hkv = 2, cases[1].Lq = 7, cases[1].Lk = 300, cases[1].D = 80,
  cases[1].Dv = 48, cases[1].mask = SdpaMask::Bool;
  for (SdpaCase& c : cases) {
    c.dtype = DType::BF16;
    c.seed = testing::rng()();
    SdpaCase::Inputs in = c.draw();
    in.options.need_weights = true;
    kernels::set_amx_emulation(0);
    set_isa(Isa::Amx);
    const SdpaResult tiles = sdpa(in.q, in.k, in.v, in.options);
    kernels::set_amx_emulation(1);
    set_isa(Isa::Amx);
    const SdpaResult emulated = sdpa(in.q, in.k, in.v, in.options);
    kernels::set_amx_emulation(-1);
    set_isa(Isa::Amx);
    EXPECT_TRUE(testing::bitwise_equal(tiles.out, emulated.out))
        << c.str() << ": max |tiles - emulator| " << testing::compare(tiles.out, emulated.out).max_abs;
    EXPECT_TRUE(testing::bitwise_equal(tiles.weights, emulated.weights))
        << c.str() << ": max |tiles - emulator| " << testing::compare(tiles.weights, emulated.weights).max_abs;
  }
}

}  // namespace
}  // namespace heads
