// gemm_i8_rows-inl.h — the int8 GEMM on the weight as stored, for calls of few rows (a decoder's
// step) on heads' route (heads/precision.h, linear_lowp_int8.cc). Included by isa_table-inl.h inside
// namespace heads::kernels::<isa>.
//
//   C[m][n] = Σ_k A[m][k]·B[n][k]    A uint8 [M, K] (row stride lda), B int8 [N, K] (rows as stored:
//   PackedLinear's int8 data, its residual rows stacked under it), C int32 [M, N] (row stride ldc)
//
// Why: a decoder's step has one activation row (two with its second term) and reads every weight
// once, so its time is the weight's bytes. heads' own GEMM (gemm_i8-inl.h) reads 16-bit pairs, two
// bytes a weight, which made int8 weights decode no faster than bf16 ones on CPUs without VNNI;
// here each weight row is read as stored, a byte a weight, once for up to kGroup rows of A.
// How: plain loops that the SIMD builds' compiler (-O3) vectorizes (x86: 16 weights at a time
// sign-extended to 16 bits by vpmovsxbw and multiplied with A's row, widened to 16 bits once per
// call, into 32-bit pairs by vpmaddwd; AArch64: widening multiply-adds). The portable build (-O2,
// where GCC leaves these loops scalar) keeps its own loops (linear_lowp_int8.cc). The sums are exact
// in int32 (|a·b| ≤ 255·128, K below 65,793), so any order gives the bits of oneDNN's u8s8 matmul
// and of heads' own GEMM.
// Parallel over blocks of kColumns outputs (static: every output is computed alike whoever runs it).

namespace gemm_i8_rows {

constexpr int kGroup = 4;         // rows of A per pass over a weight row
constexpr int64_t kColumns = 32;  // outputs per task

// c[r·ldc] = Σ_k a[r·lda + k]·b[k] for r < R.
template <int R>
HEADS_INLINE void dots(const int16_t* a, int64_t lda, const int8_t* b, int64_t K, int32_t* c, int64_t ldc) {
  int32_t s[R] = {};
  for (int64_t k = 0; k < K; ++k) {
    const int32_t w = b[k];
    for (int r = 0; r < R; ++r) s[r] += static_cast<int32_t>(a[r * lda + k]) * w;
  }
  for (int r = 0; r < R; ++r) c[r * ldc] = s[r];
}

}  // namespace gemm_i8_rows

inline void gemm_u8s8_rows(const uint8_t* A, int64_t M, int64_t K, int64_t lda, const int8_t* B, int64_t N,
                           int32_t* C, int64_t ldc, int threads) {
  using namespace gemm_i8_rows;
  if (M <= 0 || N <= 0) return;
  std::vector<int16_t> a16(static_cast<size_t>(M * K));  // A widened once, rows of K
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) a16[static_cast<size_t>(m * K + k)] = A[m * lda + k];
  }
  const int16_t* a = a16.data();
  const int64_t tasks = (N + kColumns - 1) / kColumns;
  threads = static_cast<int>(std::clamp<int64_t>(threads, 1, tasks));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    for (int64_t n = t * kColumns; n < std::min(N, (t + 1) * kColumns); ++n) {
      const int8_t* b = B + n * K;
      int64_t m = 0;
      for (; m + kGroup <= M; m += kGroup) dots<kGroup>(a + m * K, K, b, K, C + m * ldc + n, ldc);
      switch (M - m) {
        case 3: dots<3>(a + m * K, K, b, K, C + m * ldc + n, ldc); break;
        case 2: dots<2>(a + m * K, K, b, K, C + m * ldc + n, ldc); break;
        case 1: dots<1>(a + m * K, K, b, K, C + m * ldc + n, ldc); break;
        default: break;
      }
    }
  }
}
