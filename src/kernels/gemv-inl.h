// gemv-inl.h — linear layers of a few rows (a decoder's step) on the weight as stored, f32 or bf16.
// Included by isa_table-inl.h inside namespace heads::kernels::<isa>.
//
//   y[m·ys + n] = Σ_k x[m·xs + k]·W[n·K + k] (+ b[n])    m < M ≤ kGemvRows, W [N, K] rows as stored
//
// Why: a decoder's step multiplies one activation row by every weight once, so its time is the
// weight's bytes. oneDNN's matmul ran those calls at 12–18 GB/s on an AMD Zen 4 whose two cores read
// 28 (its brgemm reads the weight in its own blocked layout, a 64-column panel at a time, and a call
// of a few hundred KB to a few MB is as much set-up as streaming): f32 decoding ran at half the
// memory's speed. Here each thread reads one contiguous range of weight rows front to back, kOut rows
// at a time (kOut sequential streams the prefetchers follow), each weight vector loaded once for
// the M rows of x.
// Sums: per (m, n) one vector of partial sums over k in steps of Vec::W (the tail's lanes past K
// zero), then Vec::reduce_add, then + b[n]. bf16 weights are widened exactly and multiplied by x as
// the caller gives it (rounded to bf16 already for Precision::BF16: the products are then exact in f32).
// Parallel over contiguous ranges of rows (static: each output is computed alike whoever runs it).

namespace gemv {

// Weight rows per pass: their M·kOut sums stay in registers beside M vectors of x (AVX2: 16 registers).
template <int M>
constexpr int kOut = M <= 2 ? 4 : 2;

// Vectors of x and W (T: float, or uint16_t for bf16, widened exactly), all W lanes or the first n.
HEADS_INLINE Vec::R load(const float* p) { return Vec::loadu(p); }
HEADS_INLINE Vec::R load(const uint16_t* p) { return Vec::loadu_bf16(p); }
HEADS_INLINE Vec::R load_partial(const float* p, int64_t n) { return Vec::load_partial(p, n); }
HEADS_INLINE Vec::R load_partial(const uint16_t* p, int64_t n) { return Vec::load_partial_bf16(p, n); }

// acc[m][r] += the products of x and W over [k, K) a vector at a time (the last one's lanes past K zero).
template <int M, int R, class T>
HEADS_INLINE void widened(const T* x, int64_t xs, const T* w, int64_t K, int64_t k, Vec::R (&acc)[M][R]) {
  for (; k < K; k += Vec::W) {
    const int64_t t = std::min<int64_t>(Vec::W, K - k);
    Vec::R xv[M];
    for (int m = 0; m < M; ++m) xv[m] = t == Vec::W ? load(x + m * xs + k) : load_partial(x + m * xs + k, t);
    for (int r = 0; r < R; ++r) {
      const Vec::R wv = t == Vec::W ? load(w + r * K + k) : load_partial(w + r * K + k, t);
      for (int m = 0; m < M; ++m) acc[m][r] = Vec::fma(xv[m], wv, acc[m][r]);
    }
  }
}

// Outputs [n0, n0 + R) of the M rows.
template <int M, int R, class T>
HEADS_INLINE void block(const T* x, int64_t xs, const T* W, int64_t K, int64_t n0, const float* b, float* y,
                        int64_t ys) {
  Vec::R acc[M][R];
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) acc[m][r] = Vec::zero();
  }
  const T* w = W + n0 * K;
  int64_t k = 0;
#ifdef HEADS_NATIVE_BF16
  if constexpr (std::is_same_v<T, uint16_t>) {  // pairs of bf16 into each f32 lane (vdpbf16ps, BFDOT)
    for (; k + 2 * Vec::W <= K; k += 2 * Vec::W) {
      Bf16Pairs::P xv[M];
      for (int m = 0; m < M; ++m) xv[m] = Bf16Pairs::loadu(x + m * xs + k);
      for (int r = 0; r < R; ++r) {
        const Bf16Pairs::P wv = Bf16Pairs::loadu(w + r * K + k);
        for (int m = 0; m < M; ++m) acc[m][r] = Bf16Pairs::dot(acc[m][r], xv[m], wv);
      }
    }
  }
#endif
  widened<M, R>(x, xs, w, K, k, acc);
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      const float s = Vec::reduce_add(acc[m][r]);
      y[m * ys + n0 + r] = b != nullptr ? s + b[n0 + r] : s;
    }
  }
}

// Rows [n0, n1) of the output.
template <int M, class T>
void range(const T* x, int64_t xs, const T* W, int64_t K, int64_t n0, int64_t n1, const float* b, float* y,
           int64_t ys) {
  constexpr int R = kOut<M>;
  int64_t n = n0;
  for (; n + R <= n1; n += R) block<M, R>(x, xs, W, K, n, b, y, ys);
  for (; n < n1; ++n) block<M, 1>(x, xs, W, K, n, b, y, ys);
}

template <class T>
void run(const T* x, int64_t M, int64_t K, int64_t xs, const T* W, const float* b, int64_t N, float* y, int64_t ys) {
  // Threads by the weight's bytes (the work is reading them): a range of rows per thread, a multiple of 4.
  constexpr double kMinBytesPerThread = 64.0 * 1024;
  const double bytes = static_cast<double>(N) * static_cast<double>(K) * sizeof(T);
  const int threads = threads_for(bytes / kMinBytesPerThread * kMinFlopsPerThread, (N + 3) / 4);
  const int64_t step = ((N + threads - 1) / threads + 3) / 4 * 4;
  const auto part = [&](int64_t t) {
    const int64_t n0 = std::min(N, t * step), n1 = std::min(N, n0 + step);
    switch (M) {
      case 1: range<1>(x, xs, W, K, n0, n1, b, y, ys); break;
      case 2: range<2>(x, xs, W, K, n0, n1, b, y, ys); break;
      case 3: range<3>(x, xs, W, K, n0, n1, b, y, ys); break;
      default: range<4>(x, xs, W, K, n0, n1, b, y, ys); break;
    }
  };
  if (threads == 1) {
    part(0);
    return;
  }
#pragma omp parallel for schedule(static, 1) num_threads(threads)
  for (int64_t t = 0; t < threads; ++t) part(t);
}

}  // namespace gemv

inline void gemv_f32(const float* x, int64_t M, int64_t K, int64_t xs, const float* W, const float* b, int64_t N,
                     float* y, int64_t ys) {
  gemv::run(x, M, K, xs, W, b, N, y, ys);
}

inline void gemv_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t xs, const uint16_t* W, const float* b, int64_t N,
                      float* y, int64_t ys) {
  gemv::run(x, M, K, xs, W, b, N, y, ys);
}
