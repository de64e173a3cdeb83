// vec_avx2-inl.h — the vector layer for AVX2 + FMA (8 f32 lanes). Included by isa_avx2.cc inside
// namespace heads::kernels::avx2. Interface: see vec_scalar-inl.h.

#include "kernels/simd/unfused-inl.h"

struct Vec {
  using R = __m256;
  static constexpr int W = 8;
  static constexpr int kRowsQK = 6;  // 16 ymm registers: 2 x 6 accumulators + operands
  static constexpr int kRowsPV = 6;

  HEADS_INLINE static R zero() { return _mm256_setzero_ps(); }
  HEADS_INLINE static R set1(float x) { return _mm256_set1_ps(x); }
  HEADS_INLINE static R load(const float* p) { return _mm256_load_ps(p); }
  HEADS_INLINE static void store(float* p, R x) { _mm256_store_ps(p, x); }
  HEADS_INLINE static R loadu(const float* p) { return _mm256_loadu_ps(p); }
  HEADS_INLINE static void storeu(float* p, R x) { _mm256_storeu_ps(p, x); }
  // Aligned store that bypasses the caches (for large outputs written once); stream_fence() orders
  // a thread's streamed stores before later ones.
  HEADS_INLINE static void stream(float* p, R x) { _mm256_stream_ps(p, x); }
  HEADS_INLINE static void stream_fence() { _mm_sfence(); }
  HEADS_INLINE static __m256i lanes_below(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  HEADS_INLINE static R load_partial(const float* p, int64_t n) {  // lanes >= n are 0
    return _mm256_maskload_ps(p, lanes_below(n));
  }
  HEADS_INLINE static void store_partial(float* p, R x, int64_t n) {
    _mm256_maskstore_ps(p, lanes_below(n), x);
  }
  // dst row c (stride ds) = column c of the W x W block at src (row stride ss), each source row
  // multiplied lane-wise by `scale` first.
  HEADS_INLINE static void transpose_scaled(const float* src, int64_t ss, float* dst, int64_t ds, R scale) {
    R r[8], a[8], b[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_mul_ps(_mm256_loadu_ps(src + i * ss), scale);
    for (int i = 0; i < 4; ++i) {
      a[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      a[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {  // b[4i + k], 128-bit lane L: column 4L + k of rows 4i..4i+3
      b[4 * i + 0] = _mm256_shuffle_ps(a[4 * i], a[4 * i + 2], 0x44);
      b[4 * i + 1] = _mm256_shuffle_ps(a[4 * i], a[4 * i + 2], 0xEE);
      b[4 * i + 2] = _mm256_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0x44);
      b[4 * i + 3] = _mm256_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) {
      _mm256_storeu_ps(dst + k * ds, _mm256_permute2f128_ps(b[k], b[4 + k], 0x20));
      _mm256_storeu_ps(dst + (4 + k) * ds, _mm256_permute2f128_ps(b[k], b[4 + k], 0x31));
    }
  }
  // Lane i of the result = sum of the lanes of a[i] (a transpose-and-add tree).
  HEADS_INLINE static R reduce_lanes(const R* a) {
    R s[4], t[2];
    for (int p = 0; p < 4; ++p) {  // lanes 0-3: partials of a[2p], lanes 4-7: of a[2p+1]
      s[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                           _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));
    }
    for (int r = 0; r < 2; ++r) {  // half h: 2 partials of a[4r + h], 2 of a[4r + 2 + h]
      t[r] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * r], s[2 * r + 1], 0x44),
                           _mm256_shuffle_ps(s[2 * r], s[2 * r + 1], 0xEE));
    }
    // lane 4h + k holds the sum of a[2k + h]
    const R z = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x88), _mm256_shuffle_ps(t[0], t[1], 0xDD));
    return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  HEADS_INLINE static R loadu_bf16(const uint16_t* p) {  // W bf16 values, widened exactly
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  HEADS_INLINE static R load_partial_bf16(const uint16_t* p, int64_t n) {
    alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < n; ++i) tmp[i] = p[i];
    return loadu_bf16(tmp);
  }
  // 2W bf16 values: the even ones into `even` and the odd ones into `odd`, widened exactly (a 32-bit
  // lane's low half shifted up, its high half masked: no widening shuffle)
  HEADS_INLINE static void loadu_bf16_split(const uint16_t* p, R& even, R& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  HEADS_INLINE static R loadu_i8(const int8_t* p) {  // W int8 values as f32 (exact)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  HEADS_INLINE static R load_partial_i8(const int8_t* p, int64_t n) {
    alignas(16) int8_t tmp[16] = {};
    for (int64_t i = 0; i < n; ++i) tmp[i] = p[i];
    return loadu_i8(tmp);
  }
  HEADS_INLINE static float reduce_add(R x) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  HEADS_INLINE static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  HEADS_INLINE static float reduce_max(R x) {
    alignas(32) float t[8];
    _mm256_store_ps(t, x);
    return max_of_lanes(t, 8);
  }
  HEADS_INLINE static R round_even(R x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // Lanes holding integers in [-128, 127], stored as int8 (the first n of them).
  HEADS_INLINE static R gather(const float* base, const int32_t* idx) {
    return _mm256_i32gather_ps(base, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx)), 4);
  }
  HEADS_INLINE static void scatter(float* base, const int32_t* idx, R x) {  // AVX2 has no scatter
    alignas(32) float t[8];
    _mm256_store_ps(t, x);
    for (int i = 0; i < 8; ++i) base[idx[i]] = t[i];
  }
  HEADS_INLINE static void store_partial_u8(uint8_t* p, R x, int64_t n) {  // lanes holding integers in [0, 255]
    const __m256i v = _mm256_cvtps_epi32(x);
    if (n == 8) {
      const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
      return;
    }
    alignas(32) int32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), v);
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(t[i]);
  }
  HEADS_INLINE static R add(R a, R b) { return _mm256_add_ps(a, b); }
  HEADS_INLINE static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  HEADS_INLINE static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  HEADS_INLINE static R max(R a, R b) { return _mm256_max_ps(a, b); }
  HEADS_INLINE static R div(R a, R b) { return _mm256_div_ps(a, b); }
  HEADS_INLINE static R min(R a, R b) { return _mm256_min_ps(a, b); }
  HEADS_INLINE static void add_squares_f64(double* acc, R x) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    _mm256_storeu_pd(acc, _mm256_add_pd(_mm256_loadu_pd(acc), unfused(_mm256_mul_pd(lo, lo))));
    _mm256_storeu_pd(acc + 4, _mm256_add_pd(_mm256_loadu_pd(acc + 4), unfused(_mm256_mul_pd(hi, hi))));
  }
  HEADS_INLINE static R abs(R a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  HEADS_INLINE static R select_neg(R x, R a, R b) {
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
  }
  HEADS_INLINE static R iota() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
  HEADS_INLINE static R fill_if_gt(R x, R a, R b, float fill) {
    return _mm256_blendv_ps(x, _mm256_set1_ps(fill), _mm256_cmp_ps(a, b, _CMP_GT_OQ));
  }
  HEADS_INLINE static R fill_if_eq(R x, float v, float fill) {
    return _mm256_blendv_ps(x, _mm256_set1_ps(fill), _mm256_cmp_ps(x, _mm256_set1_ps(v), _CMP_EQ_OQ));
  }
  HEADS_INLINE static R exp2(R x) {
    // NaN stays NaN: it is "live" (not less than -126) and min/max_ps return their second operand
    // when either is NaN.
    const R live = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_NLT_UQ);
    x = _mm256_min_ps(_mm256_set1_ps(128.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), x));
    const R n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const R f = _mm256_sub_ps(x, n);
    R p = _mm256_set1_ps(kExp2C6);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    // 2^n for n in [-127, 128] from the exponent field (n = -127 gives +0, n = 128 gives inf).
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
  }
};

// 16-bit integer pairs for heads' own int8 GEMM (gemm_i8-inl.h): a register holds W 32-bit lanes,
// each a pair of int16 values; dot adds a0·b0 + a1·b1 of each lane to a 32-bit sum (vpmaddwd, then
// vpaddd), exact for the u8 × s8 products it is given. Zen 3, one core: 2 vpmaddwd per cycle, 32
// multiply-adds against the FMA's 16.
#define HEADS_I16_PAIRS 1
struct I16Pairs {
  using P = __m256i;
  // Micro-kernel rows: 6 x 2 sums, 2 weight vectors, a broadcast and a product in the 16 registers.
  // Zen 3, one core, the whole GEMM (M 256, K 384, N 1536): 142 G integer ops per second with 6 rows,
  // 133 with 3 (vpmaddwd + vpaddd alone reach 150).
  static constexpr int kRows = 6;
  static constexpr Int8Layout kLayout = Int8Layout::Pairs16;
  // The micro-kernel of 6 rows (gemm_i8-inl.h: accumulate) in assembly, one pair of K per step:
  // GCC 12 compiles the intrinsics' loop with all 16 registers live into register moves and
  // accumulators on the stack. Zen 3, one core, the kernel alone on a 192-pair slice in L1, 1.57x
  // (131 against 83 G integer ops per second, the same sums).
#define HEADS_I16_PAIRS_ACCUMULATE6 1
  HEADS_INLINE static void accumulate6(P (&acc)[6][2], const uint32_t* a, const uint8_t* panel, int64_t kp) {
    // the sums in 12 variables, not in acc: operands of an array stay in memory
    P c00 = zero(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00, c40 = c00, c41 = c00,
      c50 = c00, c51 = c00;
    for (int64_t i = 0; i < kp; ++i, a += 6, panel += 64) {
      P w0, w1, x, t;
      asm("vmovdqa (%[b]), %[w0]\n\t"
          "vmovdqa 32(%[b]), %[w1]\n\t"
#define HEADS_PAIR_ROW(off, c0, c1)                                               \
  "vpbroadcastd " #off "(%[a]), %[x]\n\t"                                        \
  "vpmaddwd %[w0], %[x], %[t]\n\tvpaddd %[t], %[" #c0 "], %[" #c0 "]\n\t"       \
  "vpmaddwd %[w1], %[x], %[t]\n\tvpaddd %[t], %[" #c1 "], %[" #c1 "]\n\t"
          HEADS_PAIR_ROW(0, c00, c01) HEADS_PAIR_ROW(4, c10, c11) HEADS_PAIR_ROW(8, c20, c21)
          HEADS_PAIR_ROW(12, c30, c31) HEADS_PAIR_ROW(16, c40, c41) HEADS_PAIR_ROW(20, c50, c51)
#undef HEADS_PAIR_ROW
          : [c00] "+x"(c00), [c01] "+x"(c01), [c10] "+x"(c10), [c11] "+x"(c11),
            [c20] "+x"(c20), [c21] "+x"(c21), [c30] "+x"(c30), [c31] "+x"(c31),
            [c40] "+x"(c40), [c41] "+x"(c41), [c50] "+x"(c50), [c51] "+x"(c51),
            [w0] "=&x"(w0), [w1] "=&x"(w1), [x] "=&x"(x), [t] "=&x"(t)
          : [a] "r"(a), [b] "r"(panel)
          : "memory");
    }
    acc[0][0] = c00, acc[0][1] = c01, acc[1][0] = c10, acc[1][1] = c11, acc[2][0] = c20, acc[2][1] = c21;
    acc[3][0] = c30, acc[3][1] = c31, acc[4][0] = c40, acc[4][1] = c41, acc[5][0] = c50, acc[5][1] = c51;
  }
  HEADS_INLINE static P zero() { return _mm256_setzero_si256(); }
  HEADS_INLINE static P load(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
  HEADS_INLINE static P set1(const uint32_t* pair) {  // the pair at p in every lane
    return _mm256_set1_epi32(static_cast<int>(*pair));
  }
  HEADS_INLINE static P dot(P acc, P a, P b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
  HEADS_INLINE static P add(P a, P b) { return _mm256_add_epi32(a, b); }
  HEADS_INLINE static P shl8(P a) { return _mm256_slli_epi32(a, 8); }  // (gemm_i8-inl.h names it for every layout)
  // float(a − z·w) per lane, the difference wrapping around in 32 bits
  HEADS_INLINE static Vec::R sub_mul_f32(P a, int32_t z, P w) {
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(a, _mm256_mullo_epi32(_mm256_set1_epi32(z), w)));
  }
  HEADS_INLINE static P load_partial(const int32_t* p, int64_t n) {  // the first n lanes (the rest 0)
    if (n == Vec::W) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return n > 0 ? _mm256_maskload_epi32(p, Vec::lanes_below(n)) : zero();
  }
  HEADS_INLINE static void store(int32_t* p, P x, int64_t n) {  // the first n lanes
    if (n == Vec::W) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
    } else if (n > 0) {
      _mm256_maskstore_epi32(p, Vec::lanes_below(n), x);
    }
  }
  // The first `groups` pairs of a row of A into dst: dst[i] = src[i] for i < n, 0 for n ≤ i < 2·groups.
  HEADS_INLINE static void groups_of(const uint8_t* src, int64_t n, uint16_t* dst, int64_t groups) {
    const int64_t np = 2 * groups;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    }
    for (; i < n; ++i) dst[i] = src[i];
    for (; i < np; ++i) dst[i] = 0;
  }
};
