// gemv-inl.h — linear layers of a few rows (a decoder's step) on the weight as stored, f32 or bf16.
// Included by isa_table-inl.h inside namespace heads::kernels::<isa>.
//
//   y[m·ys + n] = Σ_k x[m·xs + k]·W[n·K + k] (+ b[n])    m < M ≤ kGemvRows, W [N, K] rows as stored
//
// Why: a decoder's step multiplies one activation row by every weight once, so its time is the
// weight's bytes. oneDNN's matmul ran those calls at 12–18 GB/s on an AMD Zen 4 whose two cores read
// 28 (its brgemm reads the weight in its own blocked layout, a 64-column panel at a time, and a call
// of a few hundred KB to a few MB is as much set-up as streaming): f32 decoding ran at half the
// memory's speed. Here each thread reads one contiguous range of weight rows front to back, a row at
// a time, each weight vector loaded once for the M rows of x.
// Sums: per (m, n) kChains vectors of partial sums over k (row() below), added in order, then
// Vec::reduce_add, then + b[n]. bf16 weights are widened exactly and multiplied by x as
// the caller gives it (rounded to bf16 already for Precision::BF16: the products are then exact in f32).
// Where the path has no bf16 dot product (AVX2, AVX-512 before AVX512_BF16, NEON without BF16, the
// portable build) a weight row is read 2W values at a time, split by Vec::loadu_bf16_split into its
// even and its odd values (a shift and a mask), against x widened once per call into the same order
// (split_x): widening each vector of W and of x with a shuffle had made bf16 decoding compute-bound
// on AMD Zen 3 (18–20 GB/s on 2 threads of 32).
// Parallel over contiguous ranges of rows (static: each output is computed alike whoever runs it).

namespace gemv {

// Independent sums per (row of x, weight row), each over every U-th vector of k, so that a row's
// multiply-adds do not wait on one another: U·M of them stay in registers beside M vectors of x
// (AVX2: 16 registers).
template <int M>
constexpr int kChains = M <= 2 ? 4 : 2;

// Vectors of x and W (T: float, or uint16_t for bf16, widened exactly), all W lanes or the first n.
HEADS_INLINE Vec::R load(const float* p) { return Vec::loadu(p); }
HEADS_INLINE Vec::R load(const uint16_t* p) { return Vec::loadu_bf16(p); }
HEADS_INLINE Vec::R load_partial(const float* p, int64_t n) { return Vec::load_partial(p, n); }
HEADS_INLINE Vec::R load_partial(const uint16_t* p, int64_t n) { return Vec::load_partial_bf16(p, n); }

// Output n of the M rows: weight row n read front to back once (one row at a time: four rows read
// side by side, short interleaved streams, drew 19–25 GB/s from memory where one stream draws 28–33,
// AMD Zen 4, 2 threads). Chain u sums the vectors k = (U·i + u)·W (bf16 pairs: 2W values each);
// then the tail's vectors into chain 0, the chains added in order, Vec::reduce_add, + b[n].
// X: the type of x (T, or float for bf16 weights against x in split_x's order).
template <int M, class X, class T>
HEADS_INLINE void row(const X* x, int64_t xs, const T* w, int64_t K, int64_t n, const float* b, float* y, int64_t ys) {
  constexpr int U = kChains<M>;
  Vec::R acc[M][U];
  for (int m = 0; m < M; ++m) {
    for (int u = 0; u < U; ++u) acc[m][u] = Vec::zero();
  }
  int64_t k = 0;
  if constexpr (!std::is_same_v<X, T>) {  // bf16 weights split 2W values at a time, x in split_x's order
    constexpr int64_t kStep = 2 * Vec::W;
    const auto step = [&](int64_t k0, int u, Vec::R we, Vec::R wo) {
      for (int m = 0; m < M; ++m) {
        const float* xm = x + m * xs + k0;
        acc[m][u] = Vec::fma(Vec::loadu(xm + Vec::W), wo, Vec::fma(Vec::loadu(xm), we, acc[m][u]));
      }
    };
    for (; k + U * kStep <= K; k += U * kStep) {
      for (int u = 0; u < U; ++u) {
        Vec::R we, wo;
        Vec::loadu_bf16_split(w + k + u * kStep, we, wo);
        step(k + u * kStep, u, we, wo);
      }
    }
    for (; k < K; k += kStep) {  // the rest a block at a time, the last one's values past K zero
      alignas(64) uint16_t tail[kStep] = {};
      const uint16_t* wk = w + k;
      if (K - k < kStep) wk = static_cast<const uint16_t*>(std::memcpy(tail, w + k, sizeof(uint16_t) * (K - k)));
      Vec::R we, wo;
      Vec::loadu_bf16_split(wk, we, wo);
      step(k, 0, we, wo);
    }
  }
#ifdef HEADS_NATIVE_BF16
  if constexpr (std::is_same_v<X, uint16_t> && std::is_same_v<T, uint16_t>) {  // pairs of bf16 into each f32 lane (vdpbf16ps, BFDOT)
    constexpr int64_t kStep = 2 * Vec::W;
    for (; k + U * kStep <= K; k += U * kStep) {
      for (int u = 0; u < U; ++u) {
        const Bf16Pairs::P wv = Bf16Pairs::loadu(w + k + u * kStep);
        for (int m = 0; m < M; ++m) acc[m][u] = Bf16Pairs::dot(acc[m][u], Bf16Pairs::loadu(x + m * xs + k + u * kStep), wv);
      }
    }
    for (; k + kStep <= K; k += kStep) {
      const Bf16Pairs::P wv = Bf16Pairs::loadu(w + k);
      for (int m = 0; m < M; ++m) acc[m][0] = Bf16Pairs::dot(acc[m][0], Bf16Pairs::loadu(x + m * xs + k), wv);
    }
  }
#endif
  for (; k + U * Vec::W <= K; k += U * Vec::W) {
    for (int u = 0; u < U; ++u) {
      const Vec::R wv = load(w + k + u * Vec::W);
      for (int m = 0; m < M; ++m) acc[m][u] = Vec::fma(load(x + m * xs + k + u * Vec::W), wv, acc[m][u]);
    }
  }
  for (; k < K; k += Vec::W) {  // the rest a vector at a time, the last one's lanes past K zero
    const int64_t t = std::min<int64_t>(Vec::W, K - k);
    const Vec::R wv = t == Vec::W ? load(w + k) : load_partial(w + k, t);
    for (int m = 0; m < M; ++m) {
      acc[m][0] = Vec::fma(t == Vec::W ? load(x + m * xs + k) : load_partial(x + m * xs + k, t), wv, acc[m][0]);
    }
  }
  for (int m = 0; m < M; ++m) {
    Vec::R sum = acc[m][0];
    for (int u = 1; u < U; ++u) sum = Vec::add(sum, acc[m][u]);
    const float s = Vec::reduce_add(sum);
    y[m * ys + n] = b != nullptr ? s + b[n] : s;
  }
}

// Rows [n0, n1) of the output.
template <int M, class X, class T>
void range(const X* x, int64_t xs, const T* W, int64_t K, int64_t n0, int64_t n1, const float* b, float* y,
           int64_t ys) {
  for (int64_t n = n0; n < n1; ++n) row<M>(x, xs, W + n * K, K, n, b, y, ys);
}

// x's M rows of K bf16 values widened into rows of K rounded up to 2W (the rest 0), each block of 2W
// values as its W even values, then its W odd ones: the order of Vec::loadu_bf16_split, which makes
// it a block at a time. Into the calling thread's buffer of its own (kept from call to call: a
// decoder's every step needs one), valid until the thread's next call; the row stride is returned.
inline const float* split_x(const uint16_t* x, int64_t M, int64_t K, int64_t xs, int64_t& row_stride) {
  constexpr int64_t kStep = 2 * Vec::W;
  row_stride = (K + kStep - 1) / kStep * kStep;
  thread_local std::vector<float> buffer;
  if (buffer.size() < static_cast<size_t>(M * row_stride)) buffer.resize(static_cast<size_t>(M * row_stride));
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xm = x + m * xs;
    float* o = buffer.data() + m * row_stride;
    const auto block = [&](const uint16_t* from, int64_t k) {
      Vec::R even, odd;
      Vec::loadu_bf16_split(from, even, odd);
      Vec::storeu(o + k, even);
      Vec::storeu(o + k + Vec::W, odd);
    };
    int64_t k = 0;
    for (; k + kStep <= K; k += kStep) block(xm + k, k);
    if (k < K) {  // the last block's values past K zero
      alignas(64) uint16_t tail[kStep] = {};
      std::memcpy(tail, xm + k, sizeof(uint16_t) * (K - k));
      block(tail, k);
    }
  }
  return buffer.data();
}

// pass(m, rows, n0, n1) for each thread's contiguous range [n0, n1) of weight rows (a multiple of 4
// rows; threads at most one per 4) and each pass of up to kGemvRows rows of x from row m: the split
// of this file's kernels (static: each output is computed alike whoever runs it).
template <class Pass>
inline void over_ranges(int64_t M, int64_t N, int threads, Pass pass) {
  threads = static_cast<int>(std::clamp<int64_t>(threads, 1, (N + 3) / 4));
  const int64_t step = ((N + threads - 1) / threads + 3) / 4 * 4;
  const auto part = [&](int64_t t) {
    const int64_t n0 = std::min(N, t * step), n1 = std::min(N, n0 + step);
    for (int64_t m = 0; m < M; m += 4) pass(m, static_cast<int>(std::min<int64_t>(4, M - m)), n0, n1);
  };
  if (threads == 1) {
    part(0);
    return;
  }
#pragma omp parallel for schedule(static, 1) num_threads(threads)
  for (int64_t t = 0; t < threads; ++t) part(t);
}

template <class X, class T>
void run(const X* x, int64_t M, int64_t K, int64_t xs, const T* W, const float* b, int64_t N, float* y, int64_t ys) {
  // Threads by the weight's bytes (the work is reading them).
  constexpr double kMinBytesPerThread = 64.0 * 1024;
  const double bytes = static_cast<double>(N) * static_cast<double>(K) * sizeof(T);
  const int threads = threads_for(bytes / kMinBytesPerThread * kMinFlopsPerThread, (N + 3) / 4);
  over_ranges(M, N, threads, [&](int64_t m, int rows, int64_t n0, int64_t n1) {
    const X* xm = x + m * xs;
    float* ym = y + m * ys;
    switch (rows) {
      case 1: range<1>(xm, xs, W, K, n0, n1, b, ym, ys); break;
      case 2: range<2>(xm, xs, W, K, n0, n1, b, ym, ys); break;
      case 3: range<3>(xm, xs, W, K, n0, n1, b, ym, ys); break;
      default: range<4>(xm, xs, W, K, n0, n1, b, ym, ys); break;
    }
  });
}

}  // namespace gemv

inline void gemv_f32(const float* x, int64_t M, int64_t K, int64_t xs, const float* W, const float* b, int64_t N,
                     float* y, int64_t ys) {
  gemv::run(x, M, K, xs, W, b, N, y, ys);
}

inline void gemv_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t xs, const uint16_t* W, const float* b, int64_t N,
                      float* y, int64_t ys) {
#ifdef HEADS_NATIVE_BF16
  gemv::run(x, M, K, xs, W, b, N, y, ys);
#else
  int64_t stride = 0;
  const float* xw = gemv::split_x(x, M, K, xs, stride);
  gemv::run(xw, M, K, stride, W, b, N, y, ys);
#endif
}

#ifdef HEADS_VNNI
// The int8 GEMM of a few rows (a decoder's step) on the weight as stored, through vpdpbusd, where the
// build (HEADS_VNNI: the avx512bf16 and amx paths) and the CPU (AVX512_VNNI, checked at the call)
// have it: C [M, N] (row stride ldc) = A [M, K] (uint8, row stride lda) · B [N, K]ᵀ (int8 rows), the
// exact int32 sums (|Σ| < 2^31 as for every int8 GEMM here: heads/precision.h), so the bits of
// oneDNN's u8s8 matmul and of gemm_u8s8_rows, which it replaces where it can: oneDNN's matmul read a
// decode step's weights at 13–29 GB/s by shape (AMD Zen 4, 2 threads, 28 GB/s to be had). Rows of A
// in groups of up to 4, each weight row's 64 bytes loaded once per group; a contiguous range of
// weight rows per thread.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace gemv {

// C rows [0, G) (of A from A, stride lda) for weight row n, read front to back once (as row() above;
// four rows side by side drew 12–16 GB/s where one stream draws 29), in U independent sums per row
// of A, each over every U-th 64 bytes (the tail's, zero past K, into the first).
template <int G>
__attribute__((always_inline)) inline void u8s8_row(const uint8_t* A, int64_t lda, const int8_t* w, int64_t K,
                                                    int64_t n, int32_t* C, int64_t ldc) {
  constexpr int U = G <= 2 ? 4 : 2;
  __m512i acc[G][U];
  for (int g = 0; g < G; ++g) {
    for (int u = 0; u < U; ++u) acc[g][u] = _mm512_setzero_si512();
  }
  int64_t k = 0;
  for (; k + U * 64 <= K; k += U * 64) {
    for (int u = 0; u < U; ++u) {
      const __m512i wv = _mm512_loadu_si512(w + k + u * 64);
      for (int g = 0; g < G; ++g) acc[g][u] = _mm512_dpbusd_epi32(acc[g][u], _mm512_loadu_si512(A + g * lda + k + u * 64), wv);
    }
  }
  for (; k < K; k += 64) {
    const __mmask64 mask = K - k >= 64 ? ~__mmask64{0} : (__mmask64{1} << (K - k)) - 1;
    const __m512i wv = _mm512_maskz_loadu_epi8(mask, w + k);
    for (int g = 0; g < G; ++g) acc[g][0] = _mm512_dpbusd_epi32(acc[g][0], _mm512_maskz_loadu_epi8(mask, A + g * lda + k), wv);
  }
  for (int g = 0; g < G; ++g) {
    __m512i sum = acc[g][0];
    for (int u = 1; u < U; ++u) sum = _mm512_add_epi32(sum, acc[g][u]);
    C[g * ldc + n] = _mm512_reduce_add_epi32(sum);
  }
}

template <int G>
void u8s8_range(const uint8_t* A, int64_t lda, const int8_t* B, int64_t K, int64_t n0, int64_t n1, int32_t* C,
                int64_t ldc) {
  for (int64_t n = n0; n < n1; ++n) u8s8_row<G>(A, lda, B + n * K, K, n, C, ldc);
}

}  // namespace gemv

// The VNNI part of gemv_u8s8 below (not inlined into it: its caller's fallback for CPUs without
// AVX512_VNNI must not be compiled for them).
__attribute__((noinline)) inline void gemv_u8s8_vnni(const uint8_t* A, int64_t M, int64_t K, int64_t lda,
                                                     const int8_t* B, int64_t N, int32_t* C, int64_t ldc, int threads) {
  gemv::over_ranges(M, N, threads, [&](int64_t m, int rows, int64_t n0, int64_t n1) {
    const uint8_t* a = A + m * lda;
    int32_t* c = C + m * ldc;
    switch (rows) {
      case 1: gemv::u8s8_range<1>(a, lda, B, K, n0, n1, c, ldc); break;
      case 2: gemv::u8s8_range<2>(a, lda, B, K, n0, n1, c, ldc); break;
      case 3: gemv::u8s8_range<3>(a, lda, B, K, n0, n1, c, ldc); break;
      default: gemv::u8s8_range<4>(a, lda, B, K, n0, n1, c, ldc); break;
    }
  });
}
#pragma GCC pop_options

inline void gemv_u8s8(const uint8_t* A, int64_t M, int64_t K, int64_t lda, const int8_t* B, int64_t N, int32_t* C,
                      int64_t ldc, int threads) {
  if (M <= 0 || N <= 0) return;
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  if (!vnni) return gemm_u8s8_rows(A, M, K, lda, B, N, C, ldc, threads);
  gemv_u8s8_vnni(A, M, K, lda, B, N, C, ldc, threads);
}
#endif  // HEADS_VNNI
