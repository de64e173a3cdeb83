// avx512_on_avx2-inl.h — the AVX-512 intrinsics the AMX kernels' vector code uses (vec_avx512-inl.h,
// bf16_round_avx512-inl.h, sdpa_amx*-inl.h), written over AVX2 and plain C++ with each instruction's
// result as the Intel SDM defines it, so that the emulated AMX build (isa_amx_emu.cc) runs on every
// x86-64 CPU with AVX2 and FMA. Included inside that build's namespace, before vec_avx512-inl.h:
// these functions take the intrinsics' names there, and unqualified calls in the kernels find them
// before the global ones (which would need AVX-512 to inline). Not a general emulation: only what
// the build uses, each with the argument types and lane semantics of the real one; the masked loads
// and stores touch only the lanes their mask selects, as the instructions do (no fault there).
// Lane-wise arithmetic runs on two 256-bit halves through the AVX2 instruction of the same definition
// (add, mul, div, fmadd, max/min, unpack, integer add/mullo/madd, conversions: NaN, rounding and
// saturation follow the hardware); compares, masks, permutes, shuffles, shifts, gathers, vroundscaleps
// and vscalefps are per-lane loops. tests/kernels/avx512_on_avx2_test.cc
// compares every function with the instruction itself on CPUs with AVX-512.

// GCC defines some of these as macros (immediate operands without optimisation): use the functions.
#undef _mm512_shuffle_ps
#undef _mm512_shuffle_f32x4
#undef _mm512_slli_epi32
#undef _mm512_srli_epi32
#undef _mm512_roundscale_ps
#undef _mm512_cmp_ps_mask
#undef _mm512_extractf32x8_ps
#undef _mm512_inserti64x4
#undef _mm512_i32gather_ps
#undef _mm512_i32scatter_ps
#undef _mm512_scalef_ps
#undef _mm512_maskz_scalef_ps

// The per-lane loops are functions of their own: inlined into every kernel they would multiply the
// build's compile time (minutes) for a build that is slow by design.
#define HEADS_SHIM inline __attribute__((noinline))

namespace avx512_on_avx2 {

template <class T, class V>
struct Lanes {
  static constexpr int N = static_cast<int>(sizeof(V) / sizeof(T));
  T v[N];
};
template <class T, class V>
HEADS_INLINE Lanes<T, V> lanes(V x) {
  Lanes<T, V> a;
  std::memcpy(a.v, &x, sizeof x);
  return a;
}
template <class V, class T>
HEADS_INLINE V vec(const Lanes<T, V>& a) {
  V x;
  std::memcpy(&x, a.v, sizeof x);
  return x;
}
// 256-bit half i of a 512-bit vector, and a 512-bit vector of two halves.
template <class H, class V>
HEADS_INLINE H half(V x, int i) {
  H h;
  std::memcpy(&h, reinterpret_cast<const char*>(&x) + 32 * i, 32);
  return h;
}
template <class V, class H>
HEADS_INLINE V join(H lo, H hi) {
  V x;
  std::memcpy(&x, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&x) + 32, &hi, 32);
  return x;
}
HEADS_INLINE bool bit(unsigned mask, int i) { return ((mask >> i) & 1u) != 0; }
HEADS_INLINE uint32_t bits_of(float x) { return std::bit_cast<uint32_t>(x); }
HEADS_INLINE float float_of(uint32_t u) { return std::bit_cast<float>(u); }

// VSCALEFPS on one lane (SDM, "Special Cases" table of VSCALEFPS; MXCSR.DAZ clear): a quiet NaN
// scaled by +inf is +inf and by -inf +0 (a signalling one is quieted), as the instruction has it.
HEADS_INLINE float scalef(float a, float b) {
  constexpr uint32_t kQuiet = 0x00400000u, kIndefinite = 0xffc00000u;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  if (std::isnan(a)) {
    const bool quiet = (bits_of(a) & kQuiet) != 0;
    if (quiet && std::isinf(b)) return b > 0 ? kInf : 0.0f;
    return float_of(bits_of(a) | kQuiet);
  }
  if (std::isnan(b)) return float_of(bits_of(b) | kQuiet);
  if (std::isinf(b)) {
    const bool zero = a == 0.0f, inf = std::isinf(a);
    if (b > 0) return zero ? float_of(kIndefinite) : std::copysign(kInf, a);
    return inf ? float_of(kIndefinite) : std::copysign(0.0f, a);
  }
  if (a == 0.0f || std::isinf(a)) return a;
  const float e = std::floor(b);  // |e| past 400 gives the same result as 400: clamped before the int
  return std::ldexp(a, static_cast<int>(std::fmax(-400.0f, std::fmin(400.0f, e))));
}

// One lane of VCMPPS with predicate imm (its low 4 bits; bit 4 only chooses signalling, not the result).
HEADS_INLINE bool compare(float a, float b, int imm) {
  const bool un = std::isnan(a) || std::isnan(b);
  switch (imm & 15) {
    case 0: return !un && a == b;    // EQ_OQ
    case 1: return !un && a < b;     // LT_OS
    case 2: return !un && a <= b;    // LE_OS
    case 3: return un;               // UNORD_Q
    case 4: return un || a != b;     // NEQ_UQ
    case 5: return un || !(a < b);   // NLT_US
    case 6: return un || !(a <= b);  // NLE_US
    case 7: return !un;              // ORD_Q
    case 8: return un || a == b;     // EQ_UQ
    case 9: return un || a < b;      // NGE_US
    case 10: return un || a <= b;    // NGT_US
    case 11: return false;           // FALSE_OQ
    case 12: return !un && a != b;   // NEQ_OQ
    case 13: return !un && a >= b;   // GE_OS
    case 14: return !un && a > b;    // GT_OS
    default: return true;            // TRUE_UQ
  }
}

// Lane i: mask bit set ? the operation's lane : src's lane (mask_) or zero (maskz_).
template <class T, class V, class Op>
HEADS_INLINE V masked(V src, unsigned k, V a, V b, Op op) {
  auto r = lanes<T>(src);
  const auto x = lanes<T>(a), y = lanes<T>(b);
  for (int i = 0; i < r.N; ++i) {
    if (bit(k, i)) r.v[i] = op(x.v[i], y.v[i]);
  }
  return vec<V>(r);
}
}  // namespace avx512_on_avx2

// ---- loads, stores, constants, casts ----
HEADS_INLINE __m512i _mm512_castps_si512(__m512 a) { return reinterpret_cast<__m512i>(a); }
HEADS_INLINE __m512 _mm512_castsi512_ps(__m512i a) { return reinterpret_cast<__m512>(a); }
HEADS_INLINE __m512 _mm512_setzero_ps() { return __m512{}; }
HEADS_INLINE __m512i _mm512_setzero_si512() { return __m512i{}; }
HEADS_INLINE __m512 _mm512_set1_ps(float x) {
  const __m256 h = _mm256_set1_ps(x);
  return avx512_on_avx2::join<__m512>(h, h);
}
HEADS_INLINE __m512i _mm512_set1_epi32(int x) {
  const __m256i h = _mm256_set1_epi32(x);
  return avx512_on_avx2::join<__m512i>(h, h);
}
HEADS_INLINE __m512 _mm512_set_ps(float e15, float e14, float e13, float e12, float e11, float e10, float e9,
                                  float e8, float e7, float e6, float e5, float e4, float e3, float e2, float e1,
                                  float e0) {
  return avx512_on_avx2::join<__m512>(_mm256_set_ps(e7, e6, e5, e4, e3, e2, e1, e0),
                                      _mm256_set_ps(e15, e14, e13, e12, e11, e10, e9, e8));
}
HEADS_INLINE __m512i _mm512_set_epi32(int e15, int e14, int e13, int e12, int e11, int e10, int e9, int e8,
                                      int e7, int e6, int e5, int e4, int e3, int e2, int e1, int e0) {
  return avx512_on_avx2::join<__m512i>(_mm256_set_epi32(e7, e6, e5, e4, e3, e2, e1, e0),
                                       _mm256_set_epi32(e15, e14, e13, e12, e11, e10, e9, e8));
}
HEADS_INLINE __m512 _mm512_load_ps(const void* p) {
  __m512 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
HEADS_INLINE __m512 _mm512_loadu_ps(const void* p) { return _mm512_load_ps(p); }
HEADS_INLINE __m512d _mm512_loadu_pd(const void* p) {
  __m512d x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
HEADS_INLINE __m512i _mm512_load_si512(const void* p) {
  __m512i x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
HEADS_INLINE __m512i _mm512_loadu_si512(const void* p) { return _mm512_load_si512(p); }
HEADS_INLINE void _mm512_store_ps(void* p, __m512 x) { std::memcpy(p, &x, sizeof x); }
HEADS_INLINE void _mm512_storeu_ps(void* p, __m512 x) { std::memcpy(p, &x, sizeof x); }
HEADS_INLINE void _mm512_stream_ps(void* p, __m512 x) { std::memcpy(p, &x, sizeof x); }
HEADS_INLINE void _mm512_storeu_pd(void* p, __m512d x) { std::memcpy(p, &x, sizeof x); }
HEADS_INLINE void _mm512_store_si512(void* p, __m512i x) { std::memcpy(p, &x, sizeof x); }
HEADS_INLINE void _mm512_storeu_si512(void* p, __m512i x) { std::memcpy(p, &x, sizeof x); }

// Masked loads and stores: element i is read or written only where bit i of the mask is set.
#define HEADS_MASKZ_LOAD(name, Ret, Mask, T)                                     \
  HEADS_SHIM Ret name(Mask k, const void* p) {                                 \
    avx512_on_avx2::Lanes<T, Ret> a{};                                           \
    for (int i = 0; i < a.N; ++i) {                                              \
      if (avx512_on_avx2::bit(k, i)) std::memcpy(&a.v[i], static_cast<const char*>(p) + i * sizeof(T), sizeof(T)); \
    }                                                                            \
    return avx512_on_avx2::vec<Ret>(a);                                          \
  }
#define HEADS_MASK_STORE(name, Arg, Mask, T)                                     \
  HEADS_SHIM void name(void* p, Mask k, Arg x) {                               \
    const auto a = avx512_on_avx2::lanes<T>(x);                                  \
    for (int i = 0; i < a.N; ++i) {                                              \
      if (avx512_on_avx2::bit(k, i)) std::memcpy(static_cast<char*>(p) + i * sizeof(T), &a.v[i], sizeof(T)); \
    }                                                                            \
  }
HEADS_MASKZ_LOAD(_mm512_maskz_loadu_ps, __m512, __mmask16, float)
HEADS_MASKZ_LOAD(_mm512_maskz_loadu_epi32, __m512i, __mmask16, int32_t)
HEADS_MASKZ_LOAD(_mm512_maskz_loadu_epi16, __m512i, __mmask32, int16_t)
HEADS_MASKZ_LOAD(_mm256_maskz_loadu_epi16, __m256i, __mmask16, int16_t)
HEADS_MASKZ_LOAD(_mm_maskz_loadu_epi8, __m128i, __mmask16, int8_t)
HEADS_MASK_STORE(_mm512_mask_storeu_ps, __m512, __mmask16, float)
HEADS_MASK_STORE(_mm512_mask_storeu_epi32, __m512i, __mmask16, int32_t)
HEADS_MASK_STORE(_mm256_mask_storeu_epi16, __m256i, __mmask16, int16_t)
HEADS_MASK_STORE(_mm_mask_storeu_epi8, __m128i, __mmask16, int8_t)
#undef HEADS_MASKZ_LOAD
#undef HEADS_MASK_STORE

// ---- lane-wise arithmetic on two halves, by the AVX2 instruction of the same definition ----
#define HEADS_BY_HALVES(name, V, H, op256)                                                       \
  HEADS_INLINE V name(V a, V b) {                                                                \
    using namespace avx512_on_avx2;                                                              \
    return join<V>(op256(half<H>(a, 0), half<H>(b, 0)), op256(half<H>(a, 1), half<H>(b, 1))); \
  }
HEADS_BY_HALVES(_mm512_add_ps, __m512, __m256, _mm256_add_ps)
HEADS_BY_HALVES(_mm512_sub_ps, __m512, __m256, _mm256_sub_ps)
HEADS_BY_HALVES(_mm512_mul_ps, __m512, __m256, _mm256_mul_ps)
HEADS_BY_HALVES(_mm512_div_ps, __m512, __m256, _mm256_div_ps)
HEADS_BY_HALVES(_mm512_max_ps, __m512, __m256, _mm256_max_ps)
HEADS_BY_HALVES(_mm512_min_ps, __m512, __m256, _mm256_min_ps)
HEADS_BY_HALVES(_mm512_unpacklo_ps, __m512, __m256, _mm256_unpacklo_ps)
HEADS_BY_HALVES(_mm512_unpackhi_ps, __m512, __m256, _mm256_unpackhi_ps)
HEADS_BY_HALVES(_mm512_add_pd, __m512d, __m256d, _mm256_add_pd)
HEADS_BY_HALVES(_mm512_mul_pd, __m512d, __m256d, _mm256_mul_pd)
HEADS_BY_HALVES(_mm512_add_epi32, __m512i, __m256i, _mm256_add_epi32)
HEADS_BY_HALVES(_mm512_sub_epi32, __m512i, __m256i, _mm256_sub_epi32)
HEADS_BY_HALVES(_mm512_mullo_epi32, __m512i, __m256i, _mm256_mullo_epi32)
HEADS_BY_HALVES(_mm512_madd_epi16, __m512i, __m256i, _mm256_madd_epi16)
HEADS_BY_HALVES(_mm512_and_si512, __m512i, __m256i, _mm256_and_si256)
#undef HEADS_BY_HALVES

HEADS_INLINE __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
  using namespace avx512_on_avx2;
  return join<__m512>(_mm256_fmadd_ps(half<__m256>(a, 0), half<__m256>(b, 0), half<__m256>(c, 0)),
                      _mm256_fmadd_ps(half<__m256>(a, 1), half<__m256>(b, 1), half<__m256>(c, 1)));
}
HEADS_INLINE __m512 _mm512_abs_ps(__m512 a) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
}
HEADS_SHIM __m512i _mm512_slli_epi32(__m512i a, unsigned n) {
  auto x = avx512_on_avx2::lanes<uint32_t>(a);
  for (uint32_t& e : x.v) e = n > 31 ? 0 : e << n;
  return avx512_on_avx2::vec<__m512i>(x);
}
HEADS_SHIM __m512i _mm512_srli_epi32(__m512i a, unsigned n) {
  auto x = avx512_on_avx2::lanes<uint32_t>(a);
  for (uint32_t& e : x.v) e = n > 31 ? 0 : e >> n;
  return avx512_on_avx2::vec<__m512i>(x);
}
HEADS_SHIM __m512 _mm512_roundscale_ps(__m512 a, int imm) {  // imm[1:0] the rounding, imm[7:4] the scale M
  auto x = avx512_on_avx2::lanes<float>(a);
  const int m = (imm >> 4) & 15;
  for (float& e : x.v) {
    if (std::isnan(e)) {
      e = avx512_on_avx2::float_of(avx512_on_avx2::bits_of(e) | 0x00400000u);
      continue;
    }
    const float s = std::ldexp(e, m);
    const float r = (imm & 4) != 0 || (imm & 3) == 0 ? std::nearbyint(s)  // MXCSR's mode: nearest even here
                    : (imm & 3) == 1                 ? std::floor(s)
                    : (imm & 3) == 2                 ? std::ceil(s)
                                                     : std::trunc(s);
    e = std::ldexp(r, -m);
  }
  return avx512_on_avx2::vec<__m512>(x);
}
HEADS_SHIM __m512 _mm512_scalef_ps(__m512 a, __m512 b) {
  auto x = avx512_on_avx2::lanes<float>(a);
  const auto y = avx512_on_avx2::lanes<float>(b);
  for (int i = 0; i < 16; ++i) x.v[i] = avx512_on_avx2::scalef(x.v[i], y.v[i]);
  return avx512_on_avx2::vec<__m512>(x);
}
HEADS_SHIM __m512 _mm512_maskz_scalef_ps(__mmask16 k, __m512 a, __m512 b) {
  auto x = avx512_on_avx2::lanes<float>(_mm512_scalef_ps(a, b));
  for (int i = 0; i < 16; ++i) {
    if (!avx512_on_avx2::bit(k, i)) x.v[i] = 0.0f;
  }
  return avx512_on_avx2::vec<__m512>(x);
}
HEADS_INLINE float _mm512_reduce_add_ps(__m512 a) {  // in GCC's order (avx512fintrin.h): halves, quarters, pairs
  const __m256 h = _mm256_add_ps(avx512_on_avx2::half<__m256>(a, 1), avx512_on_avx2::half<__m256>(a, 0));
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_extractf128_ps(h, 0));
  const __m128 p = _mm_add_ps(q, _mm_shuffle_ps(q, q, 0x4e));
  return _mm_cvtss_f32(p) + _mm_cvtss_f32(_mm_shuffle_ps(p, p, 0x55));
}
HEADS_INLINE float _mm512_reduce_max_ps(__m512 a) {
  const __m256 h = _mm256_max_ps(avx512_on_avx2::half<__m256>(a, 1), avx512_on_avx2::half<__m256>(a, 0));
  const __m128 q = _mm_max_ps(_mm256_extractf128_ps(h, 1), _mm256_extractf128_ps(h, 0));
  const __m128 p = _mm_max_ps(q, _mm_shuffle_ps(q, q, 0x4e));
  return _mm_cvtss_f32(_mm_max_ps(p, _mm_shuffle_ps(p, p, 0x11)));
}

// ---- masks and compares ----
HEADS_SHIM __mmask16 _mm512_cmp_ps_mask(__m512 a, __m512 b, int imm) {
  const auto x = avx512_on_avx2::lanes<float>(a), y = avx512_on_avx2::lanes<float>(b);
  unsigned k = 0;
  for (int i = 0; i < 16; ++i) k |= unsigned{avx512_on_avx2::compare(x.v[i], y.v[i], imm)} << i;
  return static_cast<__mmask16>(k);
}
HEADS_SHIM __mmask16 _mm512_cmpgt_epu32_mask(__m512i a, __m512i b) {
  const auto x = avx512_on_avx2::lanes<uint32_t>(a), y = avx512_on_avx2::lanes<uint32_t>(b);
  unsigned k = 0;
  for (int i = 0; i < 16; ++i) k |= unsigned{x.v[i] > y.v[i]} << i;
  return static_cast<__mmask16>(k);
}
HEADS_INLINE __mmask16 _mm512_cmplt_epu32_mask(__m512i a, __m512i b) { return _mm512_cmpgt_epu32_mask(b, a); }
HEADS_SHIM __mmask16 _mm_test_epi8_mask(__m128i a, __m128i b) {
  const auto x = avx512_on_avx2::lanes<uint8_t>(a), y = avx512_on_avx2::lanes<uint8_t>(b);
  unsigned k = 0;
  for (int i = 0; i < 16; ++i) k |= unsigned{(x.v[i] & y.v[i]) != 0} << i;
  return static_cast<__mmask16>(k);
}
HEADS_SHIM __m512 _mm512_mask_blend_ps(__mmask16 k, __m512 a, __m512 b) {
  return avx512_on_avx2::masked<float>(a, k, a, b, [](float, float y) { return y; });
}
HEADS_SHIM __m512 _mm512_mask_mov_ps(__m512 src, __mmask16 k, __m512 a) {
  return avx512_on_avx2::masked<float>(src, k, a, a, [](float x, float) { return x; });
}
HEADS_SHIM __m512i _mm512_mask_or_epi32(__m512i src, __mmask16 k, __m512i a, __m512i b) {
  return avx512_on_avx2::masked<uint32_t>(src, k, a, b, [](uint32_t x, uint32_t y) { return x | y; });
}
HEADS_SHIM __m512i _mm512_mask_and_epi32(__m512i src, __mmask16 k, __m512i a, __m512i b) {
  return avx512_on_avx2::masked<uint32_t>(src, k, a, b, [](uint32_t x, uint32_t y) { return x & y; });
}
HEADS_SHIM __m512i _mm512_maskz_add_epi32(__mmask16 k, __m512i a, __m512i b) {
  return avx512_on_avx2::masked<uint32_t>(__m512i{}, k, a, b, [](uint32_t x, uint32_t y) { return x + y; });
}

// ---- casts, conversions, halves ----
HEADS_INLINE __m256 _mm512_castps512_ps256(__m512 a) { return avx512_on_avx2::half<__m256>(a, 0); }
HEADS_INLINE __m256 _mm512_extractf32x8_ps(__m512 a, int imm) { return avx512_on_avx2::half<__m256>(a, imm & 1); }
// The upper half is undefined for the instruction; zero here.
HEADS_INLINE __m512i _mm512_castsi256_si512(__m256i a) { return avx512_on_avx2::join<__m512i>(a, __m256i{}); }
HEADS_INLINE __m512i _mm512_inserti64x4(__m512i a, __m256i b, int imm) {
  using namespace avx512_on_avx2;
  return (imm & 1) != 0 ? join<__m512i>(half<__m256i>(a, 0), b) : join<__m512i>(b, half<__m256i>(a, 1));
}
HEADS_INLINE float _mm512_cvtss_f32(__m512 a) { return avx512_on_avx2::lanes<float>(a).v[0]; }
HEADS_INLINE __m512 _mm512_cvtepi32_ps(__m512i a) {
  using namespace avx512_on_avx2;
  return join<__m512>(_mm256_cvtepi32_ps(half<__m256i>(a, 0)), _mm256_cvtepi32_ps(half<__m256i>(a, 1)));
}
HEADS_INLINE __m512i _mm512_cvtps_epi32(__m512 a) {  // MXCSR's rounding; 0x80000000 out of range
  using namespace avx512_on_avx2;
  return join<__m512i>(_mm256_cvtps_epi32(half<__m256>(a, 0)), _mm256_cvtps_epi32(half<__m256>(a, 1)));
}
HEADS_INLINE __m512d _mm512_cvtps_pd(__m256 a) {
  return avx512_on_avx2::join<__m512d>(_mm256_cvtps_pd(_mm256_castps256_ps128(a)),
                                       _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
}
HEADS_INLINE __m512i _mm512_cvtepi8_epi32(__m128i a) {
  return avx512_on_avx2::join<__m512i>(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(a, a)));
}
HEADS_INLINE __m512i _mm512_cvtepu16_epi32(__m256i a) {
  return avx512_on_avx2::join<__m512i>(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)),
                                       _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)));
}
HEADS_INLINE __m512i _mm512_cvtepu8_epi16(__m256i a) {
  return avx512_on_avx2::join<__m512i>(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(a)),
                                       _mm256_cvtepu8_epi16(_mm256_extracti128_si256(a, 1)));
}
HEADS_SHIM __m256i _mm512_cvtepi32_epi16(__m512i a) {  // truncation
  const auto x = avx512_on_avx2::lanes<uint32_t>(a);
  avx512_on_avx2::Lanes<uint16_t, __m256i> r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<uint16_t>(x.v[i]);
  return avx512_on_avx2::vec<__m256i>(r);
}
HEADS_SHIM __m128i _mm512_cvtusepi32_epi8(__m512i a) {  // unsigned saturation
  const auto x = avx512_on_avx2::lanes<uint32_t>(a);
  avx512_on_avx2::Lanes<uint8_t, __m128i> r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<uint8_t>(std::min<uint32_t>(x.v[i], 255));
  return avx512_on_avx2::vec<__m128i>(r);
}

// ---- permutes, gathers ----
HEADS_SHIM __m512 _mm512_shuffle_ps(__m512 a, __m512 b, int imm) {  // within each 128-bit lane
  const auto x = avx512_on_avx2::lanes<float>(a), y = avx512_on_avx2::lanes<float>(b);
  avx512_on_avx2::Lanes<float, __m512> r;
  for (int l = 0; l < 16; l += 4) {
    r.v[l + 0] = x.v[l + (imm & 3)];
    r.v[l + 1] = x.v[l + ((imm >> 2) & 3)];
    r.v[l + 2] = y.v[l + ((imm >> 4) & 3)];
    r.v[l + 3] = y.v[l + ((imm >> 6) & 3)];
  }
  return avx512_on_avx2::vec<__m512>(r);
}
HEADS_SHIM __m512 _mm512_shuffle_f32x4(__m512 a, __m512 b, int imm) {  // 128-bit lanes: two of a, two of b
  const auto x = avx512_on_avx2::lanes<float>(a), y = avx512_on_avx2::lanes<float>(b);
  avx512_on_avx2::Lanes<float, __m512> r;
  for (int l = 0; l < 4; ++l) {
    const float* from = (l < 2 ? x.v : y.v) + 4 * ((imm >> (2 * l)) & 3);
    for (int j = 0; j < 4; ++j) r.v[4 * l + j] = from[j];
  }
  return avx512_on_avx2::vec<__m512>(r);
}
HEADS_SHIM __m512 _mm512_permutexvar_ps(__m512i idx, __m512 a) {
  const auto x = avx512_on_avx2::lanes<float>(a);
  const auto n = avx512_on_avx2::lanes<uint32_t>(idx);
  avx512_on_avx2::Lanes<float, __m512> r;
  for (int i = 0; i < 16; ++i) r.v[i] = x.v[n.v[i] & 15];
  return avx512_on_avx2::vec<__m512>(r);
}
HEADS_SHIM __m512i _mm512_permutex2var_epi16(__m512i a, __m512i idx, __m512i b) {
  const auto x = avx512_on_avx2::lanes<uint16_t>(a), y = avx512_on_avx2::lanes<uint16_t>(b);
  const auto n = avx512_on_avx2::lanes<uint16_t>(idx);
  avx512_on_avx2::Lanes<uint16_t, __m512i> r;
  for (int i = 0; i < 32; ++i) {
    const int j = n.v[i] & 31;
    r.v[i] = (n.v[i] & 32) != 0 ? y.v[j] : x.v[j];
  }
  return avx512_on_avx2::vec<__m512i>(r);
}
HEADS_SHIM __m512 _mm512_i32gather_ps(__m512i idx, const void* base, int scale) {
  const auto n = avx512_on_avx2::lanes<int32_t>(idx);
  avx512_on_avx2::Lanes<float, __m512> r;
  for (int i = 0; i < 16; ++i) {
    std::memcpy(&r.v[i], static_cast<const char*>(base) + int64_t{n.v[i]} * scale, sizeof(float));
  }
  return avx512_on_avx2::vec<__m512>(r);
}
HEADS_SHIM void _mm512_i32scatter_ps(void* base, __m512i idx, __m512 a, int scale) {  // lane order
  const auto n = avx512_on_avx2::lanes<int32_t>(idx);
  const auto x = avx512_on_avx2::lanes<float>(a);
  for (int i = 0; i < 16; ++i) {
    std::memcpy(static_cast<char*>(base) + int64_t{n.v[i]} * scale, &x.v[i], sizeof(float));
  }
}
#undef HEADS_SHIM
