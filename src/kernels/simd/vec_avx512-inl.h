// vec_avx512-inl.h — the vector layer for AVX-512 (16 f32 lanes). Included by isa_avx512.cc
// inside namespace heads::kernels::avx512, after `#pragma GCC target` enables the ISA.
// Interface shared by every vec_*-inl.h: see vec_scalar-inl.h.

#include "kernels/simd/unfused-inl.h"

struct Vec {
  using R = __m512;
  static constexpr int W = 16;
  static constexpr int kRowsQK = 12;  // broadcast rows per micro-kernel step (2 x 12 accumulators)
  static constexpr int kRowsPV = 12;

  HEADS_INLINE static R zero() { return _mm512_setzero_ps(); }
  HEADS_INLINE static R set1(float x) { return _mm512_set1_ps(x); }
  HEADS_INLINE static R load(const float* p) { return _mm512_load_ps(p); }
  HEADS_INLINE static void store(float* p, R x) { _mm512_store_ps(p, x); }
  HEADS_INLINE static R loadu(const float* p) { return _mm512_loadu_ps(p); }
  HEADS_INLINE static void storeu(float* p, R x) { _mm512_storeu_ps(p, x); }
  // Aligned store that bypasses the caches (for large outputs written once); stream_fence() orders
  // a thread's streamed stores before later ones.
  HEADS_INLINE static void stream(float* p, R x) { _mm512_stream_ps(p, x); }
  HEADS_INLINE static void stream_fence() { _mm_sfence(); }
  HEADS_INLINE static R load_partial(const float* p, int64_t n) {  // lanes >= n are 0
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
  }
  HEADS_INLINE static void store_partial(float* p, R x, int64_t n) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), x);
  }
  HEADS_INLINE static R loadu_bf16(const uint16_t* p) {  // W bf16 values, widened exactly
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  HEADS_INLINE static void loadu_bf16_split(const uint16_t* p, R& even, R& odd) {  // as in vec_avx2-inl.h
    const __m512i v = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  HEADS_INLINE static R load_partial_bf16(const uint16_t* p, int64_t n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p)), 16));
  }

  HEADS_INLINE static R loadu_i8(const int8_t* p) {  // W int8 values as f32 (exact)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  HEADS_INLINE static R load_partial_i8(const int8_t* p, int64_t n) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << n) - 1u), p)));
  }
  HEADS_INLINE static float reduce_add(R x) { return _mm512_reduce_add_ps(x); }
  HEADS_INLINE static float reduce_max(R x) { return _mm512_reduce_max_ps(x); }
  HEADS_INLINE static R round_even(R x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // Lanes holding integers in [-128, 127], stored as int8 (the first n of them).
  // base[idx[i]] of W lanes; scatter stores lane i to base[idx[i]] (the indices distinct).
  HEADS_INLINE static R gather(const float* base, const int32_t* idx) {
    return _mm512_i32gather_ps(_mm512_loadu_si512(idx), base, 4);
  }
  HEADS_INLINE static void scatter(float* base, const int32_t* idx, R x) {
    _mm512_i32scatter_ps(base, _mm512_loadu_si512(idx), x, 4);
  }
  HEADS_INLINE static void store_partial_u8(uint8_t* p, R x, int64_t n) {
    _mm_mask_storeu_epi8(p, static_cast<__mmask16>((1u << n) - 1u), _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(x)));
  }
  // dst row c (stride ds) = column c of the W x W block at src (row stride ss), each source row
  // multiplied lane-wise by `scale` first.
  HEADS_INLINE static void transpose_scaled(const float* src, int64_t ss, float* dst, int64_t ds, R scale) {
    R r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_mul_ps(_mm512_loadu_ps(src + i * ss), scale);
    transpose_regs(r, dst, ds);
  }
  // The same without arithmetic: moves 32-bit words bit for bit (e.g. pairs of bf16).
  HEADS_INLINE static void transpose_bits(const float* src, int64_t ss, float* dst, int64_t ds) {
    R r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ss);
    transpose_regs(r, dst, ds);
  }
  HEADS_INLINE static void transpose_regs(const R* r, float* dst, int64_t ds) {
    R a[16], b[16];
    for (int i = 0; i < 8; ++i) {
      a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // b[4i + k], 128-bit lane L: column 4L + k of rows 4i..4i+3
      b[4 * i + 0] = _mm512_shuffle_ps(a[4 * i], a[4 * i + 2], 0x44);
      b[4 * i + 1] = _mm512_shuffle_ps(a[4 * i], a[4 * i + 2], 0xEE);
      b[4 * i + 2] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0x44);
      b[4 * i + 3] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) {
      const R c0 = _mm512_shuffle_f32x4(b[k], b[4 + k], 0x88), c1 = _mm512_shuffle_f32x4(b[k], b[4 + k], 0xDD);
      const R d0 = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0x88), d1 = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0xDD);
      _mm512_storeu_ps(dst + k * ds, _mm512_shuffle_f32x4(c0, d0, 0x88));
      _mm512_storeu_ps(dst + (4 + k) * ds, _mm512_shuffle_f32x4(c1, d1, 0x88));
      _mm512_storeu_ps(dst + (8 + k) * ds, _mm512_shuffle_f32x4(c0, d0, 0xDD));
      _mm512_storeu_ps(dst + (12 + k) * ds, _mm512_shuffle_f32x4(c1, d1, 0xDD));
    }
  }
  // Lane i of the result = sum of the lanes of a[i] (a transpose-and-add tree).
  HEADS_INLINE static R reduce_lanes(const R* a) {
    R s[8], t[4], w[2];
    for (int p = 0; p < 8; ++p) {  // lanes 0-7: partials of a[2p], lanes 8-15: of a[2p+1]
      s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                           _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
    }
    for (int r = 0; r < 4; ++r) {  // quarter c: 4 partials of a[4r + c]
      t[r] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * r], s[2 * r + 1], 0x88),
                           _mm512_shuffle_f32x4(s[2 * r], s[2 * r + 1], 0xDD));
    }
    for (int m = 0; m < 2; ++m) {  // quarter c: 2 partials of a[8m + c], 2 of a[8m + 4 + c]
      w[m] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * m], t[2 * m + 1], 0x44),
                           _mm512_shuffle_ps(t[2 * m], t[2 * m + 1], 0xEE));
    }
    // lane 4c + k holds the sum of a[4k + c]
    const R z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
  }
  HEADS_INLINE static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  HEADS_INLINE static R add(R a, R b) { return _mm512_add_ps(a, b); }
  HEADS_INLINE static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  HEADS_INLINE static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  HEADS_INLINE static R max(R a, R b) { return _mm512_max_ps(a, b); }
  HEADS_INLINE static R div(R a, R b) { return _mm512_div_ps(a, b); }
  HEADS_INLINE static R min(R a, R b) { return _mm512_min_ps(a, b); }
  HEADS_INLINE static void add_squares_f64(double* acc, R x) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x)), hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
    _mm512_storeu_pd(acc, _mm512_add_pd(_mm512_loadu_pd(acc), unfused(_mm512_mul_pd(lo, lo))));
    _mm512_storeu_pd(acc + 8, _mm512_add_pd(_mm512_loadu_pd(acc + 8), unfused(_mm512_mul_pd(hi, hi))));
  }
  HEADS_INLINE static R abs(R a) { return _mm512_abs_ps(a); }
  // (x < 0) ? a : b, per lane
  HEADS_INLINE static R select_neg(R x, R a, R b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), b, a);
  }
  HEADS_INLINE static R iota() {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  // (a > b) ? fill : x, per lane
  HEADS_INLINE static R fill_if_gt(R x, R a, R b, float fill) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), x, _mm512_set1_ps(fill));
  }
  // (x == v) ? fill : x, per lane
  HEADS_INLINE static R fill_if_eq(R x, float v, float fill) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(v), _CMP_EQ_OQ), x,
                                _mm512_set1_ps(fill));
  }
  // 2^x; exactly 0 for x < -126 (and -inf), never a denormal.
  HEADS_INLINE static R exp2(R x) {
    // NaN stays NaN: it is "live" (not less than -126) and max_ps returns its second operand
    // when either is NaN.
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    x = _mm512_max_ps(_mm512_set1_ps(-127.0f), x);
    const R n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const R f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
    R p = _mm512_set1_ps(kExp2C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(live, p, n);
  }
};

#ifdef HEADS_NATIVE_BF16
// Pairs of bf16 for the bf16 dot product (sdpa_flash_bf16-inl.h): a P holds W dwords, each two bf16
// (the low half first); dot(acc, a, b) adds a[2i]·b[2i] + a[2i+1]·b[2i+1] to f32 lane i
// (vdpbf16ps: products and sum in f32, denormal inputs read as zero, round to nearest even).
struct Bf16Pairs {
  using P = __m512bh;
  HEADS_INLINE static P load(const uint32_t* p) { return reinterpret_cast<P>(_mm512_load_si512(p)); }  // 64-byte aligned
  HEADS_INLINE static P set1(uint32_t pair) { return reinterpret_cast<P>(_mm512_set1_epi32(static_cast<int>(pair))); }
  HEADS_INLINE static P loadu(const uint16_t* p) { return reinterpret_cast<P>(_mm512_loadu_si512(p)); }  // 2·W values
  HEADS_INLINE static Vec::R dot(Vec::R acc, P a, P b) { return _mm512_dpbf16_ps(acc, a, b); }
  // dst[i] = (a[i], b[i]) for i < n (b null: (a[i], 0)); dst is 64-byte aligned with room for n
  // rounded up to 32 dwords (written, zero past n).
  HEADS_INLINE static void pair_rows(const uint16_t* a, const uint16_t* b, int64_t n, uint32_t* dst) {
    const __m512i pair_lo = _mm512_load_si512(kBf16PairLo), pair_hi = _mm512_load_si512(kBf16PairHi);
    for (int64_t d0 = 0; d0 < n; d0 += 32) {
      const int64_t m = std::min<int64_t>(32, n - d0);
      const __mmask32 k = m == 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << m) - 1u);
      const __m512i A = _mm512_maskz_loadu_epi16(k, a + d0);
      const __m512i B = b ? _mm512_maskz_loadu_epi16(k, b + d0) : _mm512_setzero_si512();
      _mm512_store_si512(dst + d0, _mm512_permutex2var_epi16(A, pair_lo, B));
      _mm512_store_si512(dst + d0 + 16, _mm512_permutex2var_epi16(A, pair_hi, B));
    }
  }
  // dst[i] = (bf16(lo[i]), bf16(hi[i])) for the W lanes (vcvtne2ps2bf16); dst 64-byte aligned.
  HEADS_INLINE static void round_pairs(Vec::R lo, Vec::R hi, uint32_t* dst) {
    alignas(64) static constexpr uint16_t kInterleave[32] = {
        0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i x = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
    _mm512_store_si512(dst, _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), x));
  }
  // The first n lanes of x rounded to bf16 (vcvtneps2bf16) into dst[0, n).
  HEADS_INLINE static void store_rounded(uint16_t* dst, Vec::R x, int64_t n) {
    const __mmask16 m = n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
    _mm256_mask_storeu_epi16(dst, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
  }
};
#endif

// 16-bit integer pairs for heads' own int8 GEMM (gemm_i8-inl.h), as in vec_avx2-inl.h: 16 lanes of
// pairs, vpmaddwd then vpaddd (CPUs with AVX-512 but no VNNI, such as Skylake-SP, where oneDNN has
// no native int8 matmul).
#define HEADS_I16_PAIRS 1
struct I16Pairs {
  using P = __m512i;
  static constexpr int kRows = 6;  // 6 x 1 sums (not measured: no AVX-512 CPU without VNNI was at hand)
  static constexpr Int8Layout kLayout = Int8Layout::Pairs16;
  HEADS_INLINE static P zero() { return _mm512_setzero_si512(); }
  HEADS_INLINE static P load(const uint8_t* p) { return _mm512_load_si512(p); }
  HEADS_INLINE static P set1(const uint32_t* pair) { return _mm512_set1_epi32(static_cast<int>(*pair)); }
  HEADS_INLINE static P dot(P acc, P a, P b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
  HEADS_INLINE static P add(P a, P b) { return _mm512_add_epi32(a, b); }
  HEADS_INLINE static P shl8(P a) { return _mm512_slli_epi32(a, 8); }  // (gemm_i8-inl.h names it for every layout)
  HEADS_INLINE static Vec::R sub_mul_f32(P a, int32_t z, P w) {
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(a, _mm512_mullo_epi32(_mm512_set1_epi32(z), w)));
  }
  HEADS_INLINE static __mmask16 lanes(int64_t n) {
    return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
  }
  HEADS_INLINE static P load_partial(const int32_t* p, int64_t n) { return _mm512_maskz_loadu_epi32(lanes(n), p); }
  HEADS_INLINE static void store(int32_t* p, P x, int64_t n) { _mm512_mask_storeu_epi32(p, lanes(n), x); }
  // The first `groups` pairs of a row of A into dst: dst[i] = src[i] for i < n, 0 for n ≤ i < 2·groups.
  HEADS_INLINE static void groups_of(const uint8_t* src, int64_t n, uint16_t* dst, int64_t groups) {
    const int64_t np = 2 * groups;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      _mm512_storeu_si512(dst + i, _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
    }
    for (; i < n; ++i) dst[i] = src[i];
    for (; i < np; ++i) dst[i] = 0;
  }
};
