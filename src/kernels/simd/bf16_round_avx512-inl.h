// bf16_round_avx512-inl.h — f32 -> bf16 in AVX-512 registers, as vcvtneps2bf16 / vcvtne2ps2bf16
// round (the Intel SDM's convert_fp32_to_bfloat16): to nearest even, a NaN quieted (sign and top
// payload kept), a denormal input read as a zero of its sign. With HEADS_NATIVE_BF16 (a build with
// AVX512_BF16) the instructions; otherwise the same bits from AVX-512F integer operations, which the
// emulated AMX build (isa_amx_emu.cc) compiles over AVX2 (avx512_on_avx2-inl.h). Included inside an
// ISA build's namespace; tests/kernels/amx_emulator_test.cc checks both against the definition.

// The bf16 of each lane in its low 16 bits.
HEADS_INLINE __m512i bf16_bits_in_dwords(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7f800000));
  const __mmask16 denormal = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(0x00800000));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_or_epi32(r, nan, bits, _mm512_set1_epi32(0x00400000));
  r = _mm512_mask_and_epi32(r, denormal, bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_srli_epi32(r, 16);
}

// 16 f32 -> 16 bf16.
HEADS_INLINE __m256i to_bf16(__m512 x) {
#ifdef HEADS_NATIVE_BF16
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
  return _mm512_cvtepi32_epi16(bf16_bits_in_dwords(x));
#endif
}

// 32 bf16: lo's 16 values, then hi's (vcvtne2ps2bf16 hi, lo).
HEADS_INLINE __m512i to_bf16_2(__m512 hi, __m512 lo) {
#ifdef HEADS_NATIVE_BF16
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
#else
  return _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(lo)), to_bf16(hi), 1);
#endif
}
