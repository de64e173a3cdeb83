// src/kernels/simd/avx512_on_avx2-inl.h (the AVX-512 intrinsics of the emulated AMX build, written
// over AVX2) against the AVX-512 instructions themselves, bit for bit, on random operands and the
// special values (signed zeros, infinities, quiet and signalling NaNs, denormals, the largest and
// smallest exponents), for every function with the immediates the kernels pass. Needs a CPU with
// AVX-512 (F, BW, VL, DQ) to compare with; elsewhere only the emulated side runs, checked for its
// determinism. Built outside the unity batches: the header undefines GCC's macro forms of some
// intrinsics for the rest of its translation unit.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/testing.h"
#include "heads/isa.h"
#include "kernels/dispatch.h"
#include "kernels/simd/common.h"

#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wignored-attributes"

namespace {

// Operands: three 64-byte vectors (a, b, c), a mask, and 256 bytes of memory that loads read and
// stores write. Result: up to 64 bytes, and the memory after the call.
struct Operands {
  alignas(64) uint8_t a[64], b[64], c[64];
  alignas(64) uint8_t mem[256];
  uint32_t k;
};
struct Result {
  alignas(64) uint8_t bytes[64] = {};
  alignas(64) uint8_t mem[256] = {};
};

// Each case: a name and one expression over the operands, whose value is the result (void for the
// stores, whose result is the memory). The same text is compiled twice: with the instructions, and
// over avx512_on_avx2-inl.h.
#define PS(x) get<__m512>(in.x)
#define PD(x) get<__m512d>(in.x)
#define PI(x) get<__m512i>(in.x)
#define H(x) get<__m256>(in.x)
#define HI(x) get<__m256i>(in.x)
#define Q(x) get<__m128i>(in.x)
#define K16 static_cast<__mmask16>(in.k)
#define K32 static_cast<__mmask32>(in.k)
#define IDX63 _mm512_and_si512(PI(c), _mm512_set1_epi32(63))  // in range of mem's 64 floats
#define HEADS_SHIM_CASES(X)                                                          \
  X(setzero_ps, _mm512_setzero_ps())                                                 \
  X(setzero_si512, _mm512_setzero_si512())                                           \
  X(set1_ps, _mm512_set1_ps(get<float>(in.a + 4)))                                   \
  X(set1_epi32, _mm512_set1_epi32(get<int>(in.a + 8)))                               \
  X(setr_ps, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))   \
  X(set_epi32, _mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)) \
  X(setr_epi32, _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)) \
  X(load_ps, _mm512_load_ps(in.mem + 64))                                            \
  X(loadu_ps, _mm512_loadu_ps(in.mem + 4))                                           \
  X(loadu_pd, _mm512_loadu_pd(in.mem + 8))                                           \
  X(load_si512, _mm512_load_si512(in.mem + 128))                                     \
  X(loadu_si512, _mm512_loadu_si512(in.mem + 12))                                    \
  X(store_ps, _mm512_store_ps(out.mem + 64, PS(a)))                                  \
  X(storeu_ps, _mm512_storeu_ps(out.mem + 4, PS(a)))                                 \
  X(stream_ps, _mm512_stream_ps(reinterpret_cast<float*>(out.mem + 128), PS(a)))                               \
  X(storeu_pd, _mm512_storeu_pd(out.mem + 8, PD(a)))                                 \
  X(store_si512, _mm512_store_si512(out.mem + 192, PI(a)))                           \
  X(storeu_si512, _mm512_storeu_si512(out.mem + 20, PI(a)))                          \
  X(maskz_loadu_ps, _mm512_maskz_loadu_ps(K16, in.mem + 4))                          \
  X(maskz_loadu_epi32, _mm512_maskz_loadu_epi32(K16, in.mem + 8))                    \
  X(maskz_loadu_epi16, _mm512_maskz_loadu_epi16(K32, in.mem + 2))                    \
  X(maskz_loadu_epi16_256, _mm256_maskz_loadu_epi16(K16, in.mem + 6))                \
  X(maskz_loadu_epi8, _mm_maskz_loadu_epi8(K16, in.mem + 1))                         \
  X(mask_storeu_ps, _mm512_mask_storeu_ps(out.mem + 4, K16, PS(a)))                  \
  X(mask_storeu_epi32, _mm512_mask_storeu_epi32(out.mem + 8, K16, PI(a)))            \
  X(mask_storeu_epi16_256, _mm256_mask_storeu_epi16(out.mem + 2, K16, HI(a)))        \
  X(mask_storeu_epi8, _mm_mask_storeu_epi8(out.mem + 3, K16, Q(a)))                  \
  X(add_ps, _mm512_add_ps(PS(a), PS(b)))                                             \
  X(sub_ps, _mm512_sub_ps(PS(a), PS(b)))                                             \
  X(mul_ps, _mm512_mul_ps(PS(a), PS(b)))                                             \
  X(div_ps, _mm512_div_ps(PS(a), PS(b)))                                             \
  X(max_ps, _mm512_max_ps(PS(a), PS(b)))                                             \
  X(min_ps, _mm512_min_ps(PS(a), PS(b)))                                             \
  X(fmadd_ps, _mm512_fmadd_ps(PS(a), PS(b), PS(c)))                                  \
  X(abs_ps, _mm512_abs_ps(PS(a)))                                                    \
  X(unpacklo_ps, _mm512_unpacklo_ps(PS(a), PS(b)))                                   \
  X(unpackhi_ps, _mm512_unpackhi_ps(PS(a), PS(b)))                                   \
  X(add_pd, _mm512_add_pd(PD(a), PD(b)))                                             \
  X(mul_pd, _mm512_mul_pd(PD(a), PD(b)))                                             \
  X(add_epi32, _mm512_add_epi32(PI(a), PI(b)))                                       \
  X(sub_epi32, _mm512_sub_epi32(PI(a), PI(b)))                                       \
  X(mullo_epi32, _mm512_mullo_epi32(PI(a), PI(b)))                                   \
  X(madd_epi16, _mm512_madd_epi16(PI(a), PI(b)))                                     \
  X(and_si512, _mm512_and_si512(PI(a), PI(b)))                                       \
  X(slli_epi32_8, _mm512_slli_epi32(PI(a), 8))                                       \
  X(slli_epi32_16, _mm512_slli_epi32(PI(a), 16))                                     \
  X(srli_epi32_16, _mm512_srli_epi32(PI(a), 16))                                     \
  X(roundscale_ps, _mm512_roundscale_ps(PS(a), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)) \
  X(scalef_ps, _mm512_scalef_ps(PS(a), PS(b)))                                       \
  X(maskz_scalef_ps, _mm512_maskz_scalef_ps(K16, PS(a), PS(b)))                      \
  X(reduce_add_ps, _mm512_reduce_add_ps(PS(a)))                                      \
  X(reduce_max_ps, _mm512_reduce_max_ps(PS(a)))                                      \
  X(cmp_lt_oq, _mm512_cmp_ps_mask(PS(a), PS(b), _CMP_LT_OQ))                         \
  X(cmp_gt_oq, _mm512_cmp_ps_mask(PS(a), PS(b), _CMP_GT_OQ))                         \
  X(cmp_eq_oq, _mm512_cmp_ps_mask(PS(a), PS(b), _CMP_EQ_OQ))                         \
  X(cmp_nlt_uq, _mm512_cmp_ps_mask(PS(a), PS(b), _CMP_NLT_UQ))                       \
  X(cmp_unord_q, _mm512_cmp_ps_mask(PS(a), PS(b), _CMP_UNORD_Q))                     \
  X(cmp_self_unord_q, _mm512_cmp_ps_mask(PS(a), PS(a), _CMP_UNORD_Q))                \
  X(cmpgt_epu32, _mm512_cmpgt_epu32_mask(PI(a), PI(b)))                              \
  X(cmplt_epu32, _mm512_cmplt_epu32_mask(PI(a), PI(b)))                              \
  X(test_epi8, _mm_test_epi8_mask(Q(a), Q(b)))                                       \
  X(mask_blend_ps, _mm512_mask_blend_ps(K16, PS(a), PS(b)))                          \
  X(mask_mov_ps, _mm512_mask_mov_ps(PS(c), K16, PS(a)))                              \
  X(mask_or_epi32, _mm512_mask_or_epi32(PI(c), K16, PI(a), PI(b)))                   \
  X(mask_and_epi32, _mm512_mask_and_epi32(PI(c), K16, PI(a), PI(b)))                 \
  X(maskz_add_epi32, _mm512_maskz_add_epi32(K16, PI(a), PI(b)))                      \
  X(castps_si512, _mm512_castps_si512(PS(a)))                                        \
  X(castsi512_ps, _mm512_castsi512_ps(PI(a)))                                        \
  X(castps512_ps256, _mm512_castps512_ps256(PS(a)))                                  \
  X(extractf32x8_0, _mm512_extractf32x8_ps(PS(a), 0))                                \
  X(extractf32x8_1, _mm512_extractf32x8_ps(PS(a), 1))                                \
  X(inserti64x4_0, _mm512_inserti64x4(PI(a), HI(b), 0))                              \
  X(inserti64x4_1, _mm512_inserti64x4(PI(a), HI(b), 1))                              \
  X(castsi256_inserti64x4, _mm512_inserti64x4(_mm512_castsi256_si512(HI(a)), HI(b), 1)) \
  X(cvtss_f32, _mm512_cvtss_f32(PS(a)))                                              \
  X(cvtepi32_ps, _mm512_cvtepi32_ps(PI(a)))                                          \
  X(cvtps_epi32, _mm512_cvtps_epi32(PS(a)))                                          \
  X(cvtps_pd, _mm512_cvtps_pd(H(a)))                                                 \
  X(cvtepi8_epi32, _mm512_cvtepi8_epi32(Q(a)))                                       \
  X(cvtepu16_epi32, _mm512_cvtepu16_epi32(HI(a)))                                    \
  X(cvtepu8_epi16, _mm512_cvtepu8_epi16(HI(a)))                                      \
  X(cvtepi32_epi16, _mm512_cvtepi32_epi16(PI(a)))                                    \
  X(cvtusepi32_epi8, _mm512_cvtusepi32_epi8(PI(a)))                                  \
  X(shuffle_ps_44, _mm512_shuffle_ps(PS(a), PS(b), 0x44))                            \
  X(shuffle_ps_ee, _mm512_shuffle_ps(PS(a), PS(b), 0xEE))                            \
  X(shuffle_ps_88, _mm512_shuffle_ps(PS(a), PS(b), 0x88))                            \
  X(shuffle_ps_dd, _mm512_shuffle_ps(PS(a), PS(b), 0xDD))                            \
  X(shuffle_f32x4_44, _mm512_shuffle_f32x4(PS(a), PS(b), 0x44))                      \
  X(shuffle_f32x4_ee, _mm512_shuffle_f32x4(PS(a), PS(b), 0xEE))                      \
  X(shuffle_f32x4_88, _mm512_shuffle_f32x4(PS(a), PS(b), 0x88))                      \
  X(shuffle_f32x4_dd, _mm512_shuffle_f32x4(PS(a), PS(b), 0xDD))                      \
  X(permutexvar_ps, _mm512_permutexvar_ps(PI(c), PS(a)))                             \
  X(permutex2var_epi16, _mm512_permutex2var_epi16(PI(a), PI(c), PI(b)))              \
  X(i32gather_ps, _mm512_i32gather_ps(IDX63, in.mem, 4))                             \
  X(i32scatter_ps, _mm512_i32scatter_ps(out.mem, IDX63, PS(a), 4))

template <class F>
inline void run(F f, const Operands& in, Result& out) {
  std::memcpy(out.mem, in.mem, sizeof out.mem);
  f(in, out);
}
// One function per case: computes it into `out` (a value: its bytes; a store: the memory).
// The helpers the cases call, defined inside each namespace so that they take its target: a 64-byte
// vector crosses a call in zmm0 with AVX-512 and in memory without (unoptimised builds call them).
#define HEADS_CASE_HELPERS                                   \
  template <class V>                                         \
  inline V get(const uint8_t* p) {                           \
    V v;                                                     \
    std::memcpy(&v, p, sizeof v);                            \
    return v;                                                \
  }                                                          \
  template <class V>                                         \
  inline void put(Result& r, V v) {                          \
    static_assert(sizeof v <= sizeof r.bytes);               \
    std::memcpy(r.bytes, &v, sizeof v);                      \
  }                                                          \
  template <class F>                                         \
  inline void eval(Result& out, F f) {                       \
    if constexpr (std::is_void_v<decltype(f())>) {          \
      f();                                                   \
    } else {                                                 \
      put(out, f());                                         \
    }                                                        \
  }
#define HEADS_CASE_FN(name, expr) \
  inline void name(const Operands& in, Result& out) { eval(out, [&] { return expr; }); }
#define HEADS_CASE_ENTRY(name, expr) {#name, [](const Operands& in, Result& out) { run(name, in, out); }},

struct Case {
  const char* name;
  void (*fn)(const Operands&, Result&);
};

// With the instructions (defined first, while GCC's macro forms are still defined).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
namespace instruction {
HEADS_CASE_HELPERS
HEADS_SHIM_CASES(HEADS_CASE_FN)
}  // namespace instruction
#pragma GCC pop_options
// The table outside the AVX-512 target (it runs on every CPU; only the cases need AVX-512): inside
// it, the sanitizers' build poisoned the table's stack with zmm stores, which an AVX2-only CPU (Zen 3)
// stopped at (SIGILL) before the test could skip the comparison.
namespace instruction {
const std::vector<Case>& cases() {
  static const std::vector<Case> c = {HEADS_SHIM_CASES(HEADS_CASE_ENTRY)};
  return c;
}
}  // namespace instruction

// Over the header, as isa_amx_emu.cc compiles it.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
namespace emulated {
#include "kernels/simd/avx512_on_avx2-inl.h"
HEADS_CASE_HELPERS
HEADS_SHIM_CASES(HEADS_CASE_FN)
const std::vector<Case>& cases() {
  static const std::vector<Case> c = {HEADS_SHIM_CASES(HEADS_CASE_ENTRY)};
  return c;
}
}  // namespace emulated
#pragma GCC pop_options

// 32-bit words that are floats of every kind: ordinary values of both signs and many magnitudes,
// integers and halves (the rounding ties), signed zeros, infinities, NaNs with payloads (quiet and
// signalling), denormals, the extremes; or raw bits.
uint32_t draw_word(std::mt19937_64& g) {
  static const uint32_t kSpecial[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u,
                                      0x7f800001u, 0xff8abcdeu, 0x00000001u, 0x807fffffu, 0x00400000u, 0x7f7fffffu,
                                      0xff7fffffu, 0x00800000u, 0x3f800000u, 0xbf000000u, 0x4b000000u, 0xc2fe0000u,
                                      0xc2fc0000u, 0x43000000u, 0xc3000000u, 0x4f000000u, 0xcf000000u};
  const uint64_t r = g();
  switch (r % 8) {
    case 0: return kSpecial[(r >> 8) % std::size(kSpecial)];
    case 1: return static_cast<uint32_t>(r >> 32);  // raw bits
    case 2: {                                         // integers and halves in [-300, 300]
      const float v = static_cast<float>(static_cast<int>((r >> 8) % 1201) - 600) * 0.5f;
      return std::bit_cast<uint32_t>(v);
    }
    case 3: {  // small integers as int32 (indices, shifts, int8 and int16 pieces)
      return static_cast<uint32_t>(static_cast<int32_t>((r >> 8) % 600) - 300);
    }
    default: {  // ordinary floats of exponent -140 .. 140 (denormals to near overflow)
      std::uniform_real_distribution<float> m(1.0f, 2.0f);
      const int e = static_cast<int>((r >> 8) % 281) - 140;
      const float v = std::ldexp(m(g), e);
      return std::bit_cast<uint32_t>((r >> 40) & 1 ? -v : v);
    }
  }
}

void draw(std::mt19937_64& g, Operands& in) {
  for (uint8_t* v : {in.a, in.b, in.c}) {
    for (int i = 0; i < 64; i += 4) {
      const uint32_t w = draw_word(g);
      std::memcpy(v + i, &w, 4);
    }
  }
  for (int i = 0; i < 256; i += 4) {
    const uint32_t w = draw_word(g);
    std::memcpy(in.mem + i, &w, 4);
  }
  const uint64_t r = g();
  in.k = r % 4 == 0 ? 0xffffffffu : r % 4 == 1 ? 0u : static_cast<uint32_t>(r >> 32);
}

// The float arithmetic whose NaN payload is not defined even with the instructions: GCC writes these
// intrinsics as vector operators and may swap the operands of a commutative one (x86 returns the
// first operand's NaN), as it does in _mm512_reduce_add_ps's tree. There any NaN equals any NaN.
bool any_nan_is_equal(const std::string& name) {
  return name == "add_ps" || name == "mul_ps" || name == "fmadd_ps" || name == "reduce_add_ps";
}
void forget_nan_payloads(uint8_t* bytes) {
  for (int i = 0; i < 64; i += 4) {
    uint32_t w;
    std::memcpy(&w, bytes + i, 4);
    if ((w & 0x7fffffffu) > 0x7f800000u) w = 0x7fc00000u;
    std::memcpy(bytes + i, &w, 4);
  }
}

std::string hex(const uint8_t* p, int n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < n; ++i) {
    if (i > 0 && i % 4 == 0) s += ' ';
    s += d[p[i] >> 4];
    s += d[p[i] & 15];
  }
  return s;
}

TEST(Avx512OnAvx2, EveryFunctionGivesTheInstructionsBits) {
  if (!heads::kernels::cpu_runs(heads::Isa::Avx2)) GTEST_SKIP() << "needs AVX2 and FMA";
  const bool native = heads::kernels::cpu_runs(heads::Isa::Avx512);
  // Set by the ctest that runs the emulated AMX build under qemu-x86_64 -cpu Haswell-v4: that run
  // proves nothing if the CPU it sees has AVX-512 after all.
  if (const char* e = std::getenv("HEADS_REQUIRE_NO_AVX512"); e != nullptr && std::string(e) == "1") {
    ASSERT_FALSE(native) << "HEADS_REQUIRE_NO_AVX512=1, but this CPU has AVX-512";
  }
  const std::vector<Case>& want = instruction::cases();
  const std::vector<Case>& got = emulated::cases();
  ASSERT_EQ(want.size(), got.size());
  std::mt19937_64& g = heads::testing::rng();
  Operands in;
  for (int trial = 0; trial < 3000; ++trial) {
    draw(g, in);
    for (size_t c = 0; c < got.size(); ++c) {
      Result e, e2, w;
      got[c].fn(in, e);
      got[c].fn(in, e2);  // no state, nothing undefined: the same bits twice
      ASSERT_EQ(std::memcmp(&e, &e2, sizeof e), 0) << got[c].name;
      if (!native) continue;
      want[c].fn(in, w);
      if (any_nan_is_equal(got[c].name)) {
        forget_nan_payloads(e.bytes);
        forget_nan_payloads(w.bytes);
      }
      ASSERT_EQ(hex(e.bytes, 64), hex(w.bytes, 64))
          << got[c].name << ", trial " << trial << "\n a " << hex(in.a, 64) << "\n b " << hex(in.b, 64)
          << "\n c " << hex(in.c, 64) << "\n k " << std::hex << in.k;
      ASSERT_EQ(hex(e.mem, 256), hex(w.mem, 256)) << got[c].name << " (memory), trial " << trial;
    }
  }
  if (!native) std::cout << "(no AVX-512 here: the instructions themselves were not compared)\n";
}

}  // namespace
