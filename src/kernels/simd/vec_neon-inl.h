// vec_neon-inl.h — the vector layer for AArch64 Advanced SIMD (NEON): 8 f32 lanes held as two
// 128-bit registers. Included by isa_neon.cc inside namespace heads::kernels::neon. Interface: see
// vec_scalar-inl.h.
//
// Why two registers per vector (W = 8) and 6 rows per micro-kernel step: the products
// (sdpa_fwd_products-inl.h) keep 2 x kRowsQK vector accumulators, 24 registers of NEON's 32, and per
// step of d load 2 query vectors (4 registers) and broadcast kRowsQK values: 10 loads for 24 FMAs
// (0.42 per FMA). A Neoverse V1 / V2 core issues 4 128-bit FMAs and 3 loads per cycle (Arm's
// software optimization guides), so the step is 6 cycles of FMAs against 3.3 of loads; a Neoverse
// N1 (2 FMAs, 2 loads) 12 against 5. Four lanes (W = 4, 12 rows) would need 14 loads for 24 FMAs.
//
// Semantics follow the x86 layers where they differ from NEON's own instructions: max / min return
// their second operand when either is NaN (as maxps / minps), reduce_max ignores NaN lanes but the
// first, as the scalar loop does.

#include "kernels/simd/unfused-inl.h"

struct Vec {
  struct R {
    float32x4_t lo, hi;
  };
  static constexpr int W = 8;
  static constexpr int kRowsQK = 6;  // 2 x 6 accumulators of two registers each: 24 of 32
  static constexpr int kRowsPV = 6;

  HEADS_INLINE static R zero() { return set1(0.0f); }
  HEADS_INLINE static R set1(float x) { return R{vdupq_n_f32(x), vdupq_n_f32(x)}; }
  HEADS_INLINE static R load(const float* p) { return R{vld1q_f32(p), vld1q_f32(p + 4)}; }
  HEADS_INLINE static void store(float* p, R x) {
    vst1q_f32(p, x.lo);
    vst1q_f32(p + 4, x.hi);
  }
  HEADS_INLINE static R loadu(const float* p) { return load(p); }
  HEADS_INLINE static void storeu(float* p, R x) { store(p, x); }
  // No cache-bypassing store here: a plain one (stream_fence has nothing to order).
  HEADS_INLINE static void stream(float* p, R x) { store(p, x); }
  HEADS_INLINE static void stream_fence() {}
  HEADS_INLINE static R load_partial(const float* p, int64_t n) {  // lanes >= n are 0
    alignas(16) float t[8] = {};
    for (int64_t i = 0; i < n; ++i) t[i] = p[i];
    return load(t);
  }
  HEADS_INLINE static void store_partial(float* p, R x, int64_t n) {
    alignas(16) float t[8];
    store(t, x);
    for (int64_t i = 0; i < n; ++i) p[i] = t[i];
  }
  // The 4 x 4 transpose of rows r0..r3 in place: columns become rows.
  HEADS_INLINE static void transpose4(float32x4_t& r0, float32x4_t& r1, float32x4_t& r2, float32x4_t& r3) {
    const float32x4_t t0 = vtrn1q_f32(r0, r1), t1 = vtrn2q_f32(r0, r1);  // a0 b0 a2 b2, a1 b1 a3 b3
    const float32x4_t t2 = vtrn1q_f32(r2, r3), t3 = vtrn2q_f32(r2, r3);
    r0 = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r1 = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
    r2 = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r3 = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
  }
  // dst row c (stride ds) = column c of the W x W block at src (row stride ss), each source row
  // multiplied lane-wise by `scale` first: four 4 x 4 transposes.
  HEADS_INLINE static void transpose_scaled(const float* src, int64_t ss, float* dst, int64_t ds, R scale) {
    float32x4_t lo[8], hi[8];  // lo[i]: columns 0-3 of row i, hi[i]: columns 4-7
    for (int i = 0; i < 8; ++i) {
      lo[i] = vmulq_f32(vld1q_f32(src + i * ss), scale.lo);
      hi[i] = vmulq_f32(vld1q_f32(src + i * ss + 4), scale.hi);
    }
    transpose_regs(lo, hi, dst, ds);
  }
  // The same without arithmetic: moves 32-bit words bit for bit (e.g. pairs of bf16).
  HEADS_INLINE static void transpose_bits(const float* src, int64_t ss, float* dst, int64_t ds) {
    float32x4_t lo[8], hi[8];
    for (int i = 0; i < 8; ++i) {
      lo[i] = vld1q_f32(src + i * ss);
      hi[i] = vld1q_f32(src + i * ss + 4);
    }
    transpose_regs(lo, hi, dst, ds);
  }
  HEADS_INLINE static void transpose_regs(float32x4_t* lo, float32x4_t* hi, float* dst, int64_t ds) {
    transpose4(lo[0], lo[1], lo[2], lo[3]);  // rows 0-3 of columns 0-3
    transpose4(lo[4], lo[5], lo[6], lo[7]);  // rows 4-7 of columns 0-3
    transpose4(hi[0], hi[1], hi[2], hi[3]);
    transpose4(hi[4], hi[5], hi[6], hi[7]);
    for (int c = 0; c < 4; ++c) {
      vst1q_f32(dst + c * ds, lo[c]);
      vst1q_f32(dst + c * ds + 4, lo[4 + c]);
      vst1q_f32(dst + (4 + c) * ds, hi[c]);
      vst1q_f32(dst + (4 + c) * ds + 4, hi[4 + c]);
    }
  }
  // Lane i of the result = sum of the lanes of a[i] (pairwise adds).
  HEADS_INLINE static R reduce_lanes(const R* a) {
    float32x4_t s[8];
    for (int i = 0; i < 8; ++i) s[i] = vaddq_f32(a[i].lo, a[i].hi);
    const float32x4_t p01 = vpaddq_f32(s[0], s[1]), p23 = vpaddq_f32(s[2], s[3]);
    const float32x4_t p45 = vpaddq_f32(s[4], s[5]), p67 = vpaddq_f32(s[6], s[7]);
    return R{vpaddq_f32(p01, p23), vpaddq_f32(p45, p67)};
  }
  HEADS_INLINE static R loadu_bf16(const uint16_t* p) {  // W bf16 values, widened exactly
    const uint16x8_t v = vld1q_u16(p);
    return R{vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16)),
             vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(v), 16))};
  }
  HEADS_INLINE static void loadu_bf16_split(const uint16_t* p, R& even, R& odd) {  // as in vec_avx2-inl.h
    const uint32x4_t lo = vreinterpretq_u32_u16(vld1q_u16(p)), hi = vreinterpretq_u32_u16(vld1q_u16(p + 8));
    const uint32x4_t mask = vdupq_n_u32(0xFFFF0000u);
    even = R{vreinterpretq_f32_u32(vshlq_n_u32(lo, 16)), vreinterpretq_f32_u32(vshlq_n_u32(hi, 16))};
    odd = R{vreinterpretq_f32_u32(vandq_u32(lo, mask)), vreinterpretq_f32_u32(vandq_u32(hi, mask))};
  }
  HEADS_INLINE static R load_partial_bf16(const uint16_t* p, int64_t n) {
    alignas(16) uint16_t t[8] = {};
    for (int64_t i = 0; i < n; ++i) t[i] = p[i];
    return loadu_bf16(t);
  }
  HEADS_INLINE static R loadu_i8(const int8_t* p) {  // W int8 values as f32 (exact)
    const int16x8_t w = vmovl_s8(vld1_s8(p));
    return R{vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(w)))};
  }
  HEADS_INLINE static R load_partial_i8(const int8_t* p, int64_t n) {
    alignas(8) int8_t t[8] = {};
    for (int64_t i = 0; i < n; ++i) t[i] = p[i];
    return loadu_i8(t);
  }
  HEADS_INLINE static float reduce_add(R x) { return vaddvq_f32(vaddq_f32(x.lo, x.hi)); }
  HEADS_INLINE static float reduce_max(R x) {
    alignas(16) float t[8];
    store(t, x);
    return max_of_lanes(t, 8);
  }
  HEADS_INLINE static R round_even(R x) { return R{vrndnq_f32(x.lo), vrndnq_f32(x.hi)}; }
  HEADS_INLINE static R gather(const float* base, const int32_t* idx) {
    alignas(16) float t[8];
    for (int i = 0; i < 8; ++i) t[i] = base[idx[i]];
    return load(t);
  }
  HEADS_INLINE static void scatter(float* base, const int32_t* idx, R x) {
    alignas(16) float t[8];
    store(t, x);
    for (int i = 0; i < 8; ++i) base[idx[i]] = t[i];
  }
  // Lanes holding integers in [0, 255], stored as uint8 (the first n of them).
  HEADS_INLINE static void store_partial_u8(uint8_t* p, R x, int64_t n) {
    const uint16x8_t w = vcombine_u16(vqmovn_u32(vcvtnq_u32_f32(x.lo)), vqmovn_u32(vcvtnq_u32_f32(x.hi)));
    alignas(8) uint8_t t[8];
    vst1_u8(t, vqmovn_u16(w));
    for (int64_t i = 0; i < n; ++i) p[i] = t[i];
  }
  HEADS_INLINE static R fma(R a, R b, R c) { return R{vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
  HEADS_INLINE static R add(R a, R b) { return R{vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
  HEADS_INLINE static R sub(R a, R b) { return R{vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)}; }
  HEADS_INLINE static R mul(R a, R b) { return R{vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
  HEADS_INLINE static R div(R a, R b) { return R{vdivq_f32(a.lo, b.lo), vdivq_f32(a.hi, b.hi)}; }
  // a > b ? a : b and a < b ? a : b: the second operand when either is NaN (x86's maxps / minps).
  HEADS_INLINE static R max(R a, R b) {
    return R{vbslq_f32(vcgtq_f32(a.lo, b.lo), a.lo, b.lo), vbslq_f32(vcgtq_f32(a.hi, b.hi), a.hi, b.hi)};
  }
  HEADS_INLINE static R min(R a, R b) {
    return R{vbslq_f32(vcltq_f32(a.lo, b.lo), a.lo, b.lo), vbslq_f32(vcltq_f32(a.hi, b.hi), a.hi, b.hi)};
  }
  HEADS_INLINE static void add_squares_f64(double* acc, R x) {
    const float32x4_t h[2] = {x.lo, x.hi};
    for (int j = 0; j < 2; ++j) {
      const float64x2_t a = vcvt_f64_f32(vget_low_f32(h[j])), b = vcvt_high_f64_f32(h[j]);
      vst1q_f64(acc + 4 * j, vaddq_f64(vld1q_f64(acc + 4 * j), unfused(vmulq_f64(a, a))));
      vst1q_f64(acc + 4 * j + 2, vaddq_f64(vld1q_f64(acc + 4 * j + 2), unfused(vmulq_f64(b, b))));
    }
  }
  HEADS_INLINE static R abs(R a) { return R{vabsq_f32(a.lo), vabsq_f32(a.hi)}; }
  HEADS_INLINE static R select_neg(R x, R a, R b) {  // x < 0 ? a : b (NaN: b)
    return R{vbslq_f32(vcltzq_f32(x.lo), a.lo, b.lo), vbslq_f32(vcltzq_f32(x.hi), a.hi, b.hi)};
  }
  HEADS_INLINE static R iota() {
    alignas(16) static constexpr float t[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    return load(t);
  }
  HEADS_INLINE static R fill_if_gt(R x, R a, R b, float fill) {  // a > b ? fill : x
    const float32x4_t f = vdupq_n_f32(fill);
    return R{vbslq_f32(vcgtq_f32(a.lo, b.lo), f, x.lo), vbslq_f32(vcgtq_f32(a.hi, b.hi), f, x.hi)};
  }
  HEADS_INLINE static R fill_if_eq(R x, float v, float fill) {  // x == v ? fill : x
    const float32x4_t f = vdupq_n_f32(fill), vv = vdupq_n_f32(v);
    return R{vbslq_f32(vceqq_f32(x.lo, vv), f, x.lo), vbslq_f32(vceqq_f32(x.hi, vv), f, x.hi)};
  }
  // 2^x as the x86 layers compute it: exactly 0 below -126 and for -inf, NaN stays NaN.
  HEADS_INLINE static float32x4_t exp2_half(float32x4_t x) {
    const uint32x4_t live = vmvnq_u32(vcltq_f32(x, vdupq_n_f32(-126.0f)));  // not below -126 (NaN: live)
    const float32x4_t lo = vdupq_n_f32(-127.0f), hi = vdupq_n_f32(128.0f);
    x = vbslq_f32(vcgtq_f32(lo, x), lo, x);  // max(-127, x), NaN kept
    x = vbslq_f32(vcltq_f32(hi, x), hi, x);  // min(128, x), NaN kept
    const float32x4_t n = vrndnq_f32(x);
    const float32x4_t f = vsubq_f32(x, n);
    float32x4_t p = vdupq_n_f32(kExp2C6);
    p = vfmaq_f32(vdupq_n_f32(kExp2C5), p, f);
    p = vfmaq_f32(vdupq_n_f32(kExp2C4), p, f);
    p = vfmaq_f32(vdupq_n_f32(kExp2C3), p, f);
    p = vfmaq_f32(vdupq_n_f32(kExp2C2), p, f);
    p = vfmaq_f32(vdupq_n_f32(kExp2C1), p, f);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, f);
    // 2^n for n in [-127, 128] from the exponent field (n = -127 gives +0, n = 128 gives inf).
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
    const float32x4_t r = vmulq_f32(p, vreinterpretq_f32_s32(e));
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(r), live));
  }
  HEADS_INLINE static R exp2(R x) { return R{exp2_half(x.lo), exp2_half(x.hi)}; }
};

#ifdef HEADS_NATIVE_BF16
// Pairs of bf16 for the bf16 dot product (sdpa_flash_bf16-inl.h): a P holds W dwords, each two bf16
// (the low half first), in two registers; dot(acc, a, b) adds a[2i]·b[2i] + a[2i+1]·b[2i+1] to f32
// lane i (BFDOT, FEAT_BF16; as Arm's manual gives it where FEAT_EBF16 is absent or FPCR.EBF is 0,
// Linux's default: the two products, their sum and the accumulation each rounded to f32 with
// round-to-odd, denormal inputs and results flushed to zero, a NaN result the default NaN).
// Rounding to bf16 is BFCVTN's: to nearest even under Linux's default FPCR, a NaN quieted.
struct Bf16Pairs {
  struct P {
    bfloat16x8_t lo, hi;
  };
  HEADS_INLINE static P load(const uint32_t* p) {
    return P{vreinterpretq_bf16_u32(vld1q_u32(p)), vreinterpretq_bf16_u32(vld1q_u32(p + 4))};
  }
  HEADS_INLINE static P loadu(const uint16_t* p) {  // 2·W values
    return P{vreinterpretq_bf16_u16(vld1q_u16(p)), vreinterpretq_bf16_u16(vld1q_u16(p + 8))};
  }
  HEADS_INLINE static P set1(uint32_t pair) {
    const bfloat16x8_t x = vreinterpretq_bf16_u32(vdupq_n_u32(pair));
    return P{x, x};
  }
  HEADS_INLINE static Vec::R dot(Vec::R acc, P a, P b) {
    return Vec::R{vbfdotq_f32(acc.lo, a.lo, b.lo), vbfdotq_f32(acc.hi, a.hi, b.hi)};
  }
  // dst[i] = (a[i], b[i]) for i < n (b null: (a[i], 0)).
  HEADS_INLINE static void pair_rows(const uint16_t* a, const uint16_t* b, int64_t n, uint32_t* dst) {
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) {
      const uint16x8_t x = vld1q_u16(a + d), y = b ? vld1q_u16(b + d) : vdupq_n_u16(0);
      vst1q_u16(reinterpret_cast<uint16_t*>(dst + d), vzip1q_u16(x, y));
      vst1q_u16(reinterpret_cast<uint16_t*>(dst + d + 4), vzip2q_u16(x, y));
    }
    for (; d < n; ++d) dst[d] = a[d] | (b ? static_cast<uint32_t>(b[d]) << 16 : 0u);
  }
  // dst[i] = (bf16(lo[i]), bf16(hi[i])) for the W lanes.
  HEADS_INLINE static void round_pairs(Vec::R lo, Vec::R hi, uint32_t* dst) {
    const bfloat16x8_t a = vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(lo.lo), lo.hi);  // 8 bf16 of lo
    const bfloat16x8_t b = vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(hi.lo), hi.hi);
    const uint16x8_t x = vreinterpretq_u16_bf16(a), y = vreinterpretq_u16_bf16(b);
    vst1q_u16(reinterpret_cast<uint16_t*>(dst), vzip1q_u16(x, y));
    vst1q_u16(reinterpret_cast<uint16_t*>(dst + 4), vzip2q_u16(x, y));
  }
  // The first n lanes of x rounded to bf16 into dst[0, n).
  HEADS_INLINE static void store_rounded(uint16_t* dst, Vec::R x, int64_t n) {
    const bfloat16x8_t h = vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(x.lo), x.hi);
    if (n >= 8) {
      vst1q_bf16(reinterpret_cast<bfloat16_t*>(dst), h);
      return;
    }
    alignas(16) uint16_t t[8];
    vst1q_u16(t, vreinterpretq_u16_bf16(h));
    for (int64_t i = 0; i < n; ++i) dst[i] = t[i];
  }
};
#endif

// Quads of signed bytes for heads' own int8 GEMM (gemm_i8-inl.h) on cores with FEAT_DotProd (SDOT:
// Neoverse N1 / V1 / V2 / N2, Graviton 2 on, Ampere Altra): a P holds W 32-bit lanes in two
// registers; dot adds Σ_h a[4i + h]·b[4i + h] (signed bytes) to lane i, exact and wrapping in 32
// bits. The row of A enters as a − 128 (kernels/dispatch.h: Int8Layout::Quads8). Compiled for
// FEAT_DotProd, as gemm_i8-inl.h is (isa_table-inl.h), its only user.
// Micro-kernel rows: 6 x 4 registers of sums, 4 of weights and a broadcast: 29 of the 32. Per group
// of K a row costs 4 SDOT for one broadcast load, the 4 weight loads shared by the 6 rows: 24 SDOT
// against 10 loads. The model (no ARM hardware has measured it): SDOT issuing on the vector pipes at
// FMLA's rate and 2-3 loads a cycle (Neoverse N1 / V1 / V2), so SDOT-bound at 16 multiply-adds per
// instruction against FMLA's 4 f32 ones: 4x the f32 GEMM's rate per core.
#define HEADS_I8_QUADS 1
HEADS_DOTPROD_PUSH  // the ISA file's target with FEAT_DotProd
struct I8Quads {
  struct P {
    int32x4_t lo, hi;
  };
  static constexpr int kRows = 6;
  static constexpr Int8Layout kLayout = Int8Layout::Quads8;
  HEADS_INLINE static P zero() { return P{vdupq_n_s32(0), vdupq_n_s32(0)}; }
  HEADS_INLINE static P load(const uint8_t* p) {
    return P{vreinterpretq_s32_u8(vld1q_u8(p)), vreinterpretq_s32_u8(vld1q_u8(p + 16))};
  }
  HEADS_INLINE static P set1(const uint32_t* quad) {  // the 4 bytes at quad in every lane
    const int32x4_t x = vreinterpretq_s32_u32(vld1q_dup_u32(quad));
    return P{x, x};
  }
  HEADS_INLINE static P dot(P acc, P a, P b) {
    return P{vdotq_s32(acc.lo, vreinterpretq_s8_s32(a.lo), vreinterpretq_s8_s32(b.lo)),
             vdotq_s32(acc.hi, vreinterpretq_s8_s32(a.hi), vreinterpretq_s8_s32(b.hi))};
  }
  HEADS_INLINE static P add(P a, P b) { return P{vaddq_s32(a.lo, b.lo), vaddq_s32(a.hi, b.hi)}; }
  HEADS_INLINE static P shl8(P a) { return P{vshlq_n_s32(a.lo, 8), vshlq_n_s32(a.hi, 8)}; }
  // float(a − z·w) per lane, the difference wrapping around in 32 bits
  HEADS_INLINE static Vec::R sub_mul_f32(P a, int32_t z, P w) {
    return Vec::R{vcvtq_f32_s32(vmlsq_n_s32(a.lo, w.lo, z)), vcvtq_f32_s32(vmlsq_n_s32(a.hi, w.hi, z))};
  }
  HEADS_INLINE static P load_partial(const int32_t* p, int64_t n) {  // the first n lanes (the rest 0)
    if (n >= 8) return P{vld1q_s32(p), vld1q_s32(p + 4)};
    alignas(16) int32_t t[8] = {};
    for (int64_t i = 0; i < n; ++i) t[i] = p[i];
    return P{vld1q_s32(t), vld1q_s32(t + 4)};
  }
  HEADS_INLINE static void store(int32_t* p, P x, int64_t n) {  // the first n lanes
    if (n >= 8) {
      vst1q_s32(p, x.lo);
      vst1q_s32(p + 4, x.hi);
      return;
    }
    alignas(16) int32_t t[8];
    vst1q_s32(t, x.lo);
    vst1q_s32(t + 4, x.hi);
    for (int64_t i = 0; i < n; ++i) p[i] = t[i];
  }
  // The first `groups` quads of a row of A into dst (4 bytes a group): src[i] − 128 as signed bytes
  // for i < n, 0 for n ≤ i < 4·groups.
  HEADS_INLINE static void groups_of(const uint8_t* src, int64_t n, uint16_t* dst, int64_t groups) {
    auto* d = reinterpret_cast<uint8_t*>(dst);
    const int64_t nb = 4 * groups;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) vst1q_u8(d + i, veorq_u8(vld1q_u8(src + i), vdupq_n_u8(0x80)));
    for (; i < n; ++i) d[i] = static_cast<uint8_t>(src[i] ^ 0x80u);
    for (; i < nb; ++i) d[i] = 0;
  }
};
#pragma GCC pop_options
