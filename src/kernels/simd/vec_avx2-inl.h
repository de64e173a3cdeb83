// vec_avx2-inl.h — the vector layer for AVX2 + FMA (8 f32 lanes). Included by isa_avx2.cc inside
// namespace heads::kernels::avx2. Interface: see vec_scalar-inl.h.

struct Vec {
  using R = __m256;
  static constexpr int W = 8;
  static constexpr int kRowsQK = 6;  // 16 ymm registers: 2 x 6 accumulators + operands
  static constexpr int kRowsPV = 6;

  HEADS_INLINE static R zero() { return _mm256_setzero_ps(); }
  HEADS_INLINE static R set1(float x) { return _mm256_set1_ps(x); }
  HEADS_INLINE static R load(const float* p) { return _mm256_load_ps(p); }
  HEADS_INLINE static void store(float* p, R x) { _mm256_store_ps(p, x); }
  HEADS_INLINE static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  HEADS_INLINE static R add(R a, R b) { return _mm256_add_ps(a, b); }
  HEADS_INLINE static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  HEADS_INLINE static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  HEADS_INLINE static R max(R a, R b) { return _mm256_max_ps(a, b); }
  HEADS_INLINE static R iota() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
  HEADS_INLINE static R fill_if_gt(R x, R a, R b, float fill) {
    return _mm256_blendv_ps(x, _mm256_set1_ps(fill), _mm256_cmp_ps(a, b, _CMP_GT_OQ));
  }
  HEADS_INLINE static R fill_if_eq(R x, float v, float fill) {
    return _mm256_blendv_ps(x, _mm256_set1_ps(fill), _mm256_cmp_ps(x, _mm256_set1_ps(v), _CMP_EQ_OQ));
  }
  HEADS_INLINE static R exp2(R x) {
    const R live = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));
    const R n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const R f = _mm256_sub_ps(x, n);
    R p = _mm256_set1_ps(kExp2C6);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    // 2^n for n in [-127, 127] from the exponent field (n = -127 gives +0).
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
  }
};
