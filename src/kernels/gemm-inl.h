// gemm-inl.h — register-blocked f32 GEMM micro-kernels, written once over `Vec`: the attention
// kernels' own products (the SDPA backward's dV, dK and dQ; linear attention's chunks), and the
// batch-invariant linear layer (linear_fixed_order, below). Included by kernels/sdpa_paths-inl.h
// inside namespace heads::kernels::<isa>, before sdpa_bwd-inl.h.
//
//   C[m][0:N] (+)= alpha · sum_k A(m, k) · B[k][0:N]
// A is read through two strides (either operand order of the attention tiles, without a copy), B
// rows are contiguous, C rows strided; the result overwrites C, is added to it, or is streamed past
// the caches (Out). Other large GEMMs on whole tensors go through oneDNN (linear.h).

namespace gemm {

using VR = Vec::R;
constexpr int kW = Vec::W;

// How a product meets its destination: overwrite it, add to it, or overwrite it with stores that
// bypass the caches (whole aligned vectors; the rest as Set).
enum class Out { Set, Add, Stream };

// acc[r][v] = Σ_k A(r, k)·B(k, v) for r < R, v < NV, each lane one chain of FMAs over k = 0..K−1
// from zero; A(r, k) = a[r·sam + k·sak] (broadcast), load(k, v) gives B's vector v of row k.
template <int R, int NV, class Load>
HEADS_INLINE void fma_chains(VR (&acc)[R][NV], const float* a, int64_t sam, int64_t sak, int64_t K, Load load) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec::zero();
  }
  for (int64_t k = 0; k < K; ++k) {
    VR bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = load(k, v);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const VR x = Vec::set1(a[r * sam + k * sak]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = Vec::fma(x, bv[v], acc[r][v]);
    }
  }
}

// C[m][0:N] (+)= alpha · sum_k A(m, k) · B[k][0:N] for m < M (C's old values added for Out::Add);
// A(m, k) = a[m·sam + k·sak] (broadcast), B rows contiguous (stride ldb), C rows stride ldc.
// Register block: R rows x NV vectors; nn[v] lanes of vector v are live (the last ones may be
// partial or empty).
template <int R, int NV>
HEADS_INLINE void gemm_rows(const float* a, int64_t sam, int64_t sak, const float* b, int64_t ldb,
                            int64_t K, float* c, int64_t ldc, const int64_t* nn, float alpha, Out mode) {
  VR acc[R][NV];
  fma_chains<R, NV>(acc, a, sam, sak, K,
                    [&](int64_t k, int v) __attribute__((always_inline)) { return Vec::load_partial(b + k * ldb + v * kW, nn[v]); });
  const VR al = Vec::set1(alpha);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* cp = c + r * ldc + v * kW;
      if (mode == Out::Add) {
        Vec::store_partial(cp, Vec::fma(acc[r][v], al, Vec::load_partial(cp, nn[v])), nn[v]);
      } else if (mode == Out::Stream && nn[v] == kW && reinterpret_cast<uintptr_t>(cp) % (4 * kW) == 0) {
        Vec::stream(cp, Vec::mul(acc[r][v], al));
      } else {
        Vec::store_partial(cp, Vec::mul(acc[r][v], al), nn[v]);
      }
    }
  }
}

template <int R, int NV>
HEADS_INLINE void gemm_tail(int64_t n, const float* a, int64_t sam, int64_t sak, const float* b, int64_t ldb,
                            int64_t K, float* c, int64_t ldc, const int64_t* nn, float alpha, Out mode) {
  if constexpr (R > 0) {
    if (n == R) return gemm_rows<R, NV>(a, sam, sak, b, ldb, K, c, ldc, nn, alpha, mode);
    gemm_tail<R - 1, NV>(n, a, sam, sak, b, ldb, K, c, ldc, nn, alpha, mode);
  }
}

// Column panels of NV vectors, row blocks of R.
template <int R, int NV>
inline void gemm_panels(int64_t M, int64_t N, int64_t K, const float* a, int64_t sam, int64_t sak,
                        const float* b, int64_t ldb, float* c, int64_t ldc, float alpha, Out mode) {
  for (int64_t j = 0; j < N; j += NV * kW) {
    int64_t nn[NV];
    for (int v = 0; v < NV; ++v) nn[v] = std::clamp<int64_t>(N - j - v * kW, 0, kW);
    int64_t m = 0;
    for (; m + R <= M; m += R) {
      gemm_rows<R, NV>(a + m * sam, sam, sak, b + j, ldb, K, c + m * ldc + j, ldc, nn, alpha, mode);
    }
    if (m < M) gemm_tail<R - 1, NV>(M - m, a + m * sam, sam, sak, b + j, ldb, K, c + m * ldc + j, ldc, nn, alpha, mode);
  }
}

// With 32 vector registers (AVX-512), rows that are a multiple of 4 vectors (head dims 64, 128)
// use 6 x 4-vector blocks: 10 loads per 24 FMAs instead of 8 per 12.
inline void gemm_acc(int64_t M, int64_t N, int64_t K, const float* a, int64_t sam, int64_t sak,
                     const float* b, int64_t ldb, float* c, int64_t ldc, float alpha, Out mode) {
  constexpr int R2 = Vec::kRowsPV / 2 > 0 ? Vec::kRowsPV / 2 : 1;
  if constexpr (Vec::kRowsPV >= 12) {
    if (N % (4 * kW) == 0) return gemm_panels<Vec::kRowsPV / 2, 4>(M, N, K, a, sam, sak, b, ldb, c, ldc, alpha, mode);
  }
  gemm_panels<R2, 2>(M, N, K, a, sam, sak, b, ldb, c, ldc, alpha, mode);
}

// The batch-invariant linear layer (heads/runtime.h: set_batch_invariant): y[m, n] = bias[n] +
// Σ_k x[m, k]·W[n, k] for W [N, K] as torch stores it. Every sum is one chain of FMAs over
// k = 0, 1, …, K−1 starting from zero, then the bias is added; which register block, row position,
// task or thread computes a row changes nothing in it, so a row's result depends on that row and W
// alone, never on M or on the rows beside it.
//
// R rows x NV vectors of one panel: the panel is [K][NV·W] contiguous (packed), `cols` of its
// columns are real (the rest are zeros in the panel and not stored).
template <int R, int NV>
HEADS_INLINE void fixed_order_rows(const float* a, int64_t lda, const float* panel, int64_t K, const float* bias,
                                   float* c, int64_t ldc, int64_t cols) {
  constexpr int64_t P = NV * kW;
  VR acc[R][NV];
  fma_chains<R, NV>(acc, a, lda, 1, K,
                    [&](int64_t k, int v) __attribute__((always_inline)) { return Vec::loadu(panel + k * P + v * kW); });
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const int64_t n = std::clamp<int64_t>(cols - v * kW, 0, kW);
      if (n == 0) continue;
      const VR y = bias != nullptr ? Vec::add(acc[r][v], Vec::load_partial(bias + v * kW, n)) : acc[r][v];
      if (n == kW) {
        Vec::storeu(c + r * ldc + v * kW, y);
      } else {
        Vec::store_partial(c + r * ldc + v * kW, y, n);
      }
    }
  }
}

template <int R, int NV>
HEADS_INLINE void fixed_order_tail(int64_t rows, const float* a, int64_t lda, const float* panel, int64_t K,
                                   const float* bias, float* c, int64_t ldc, int64_t cols) {
  if constexpr (R > 0) {
    if (rows == R) return fixed_order_rows<R, NV>(a, lda, panel, K, bias, c, ldc, cols);
    fixed_order_tail<R - 1, NV>(rows, a, lda, panel, K, bias, c, ldc, cols);
  }
}

// Panel p of W, columns [p·P, p·P + P) (zeros past N), as [K][P]: W x W blocks transposed in
// registers where whole, single values at the edges.
template <int64_t P>
inline void pack_panel(const float* W, int64_t N, int64_t K, int64_t p, float* dst) {
  const int64_t n0 = p * P;
  int64_t k = 0;
  if constexpr (kW > 1) {
    if (n0 + P <= N) {
      const VR one = Vec::set1(1.0f);  // the transpose multiplies by it: exact
      for (; k + kW <= K; k += kW) {
        for (int64_t j = 0; j < P; j += kW) Vec::transpose_scaled(W + (n0 + j) * K + k, K, dst + k * P + j, P, one);
      }
    }
  }
  for (int64_t j = 0; j < P; ++j) {
    const int64_t n = n0 + j;
    for (int64_t kk = k; kk < K; ++kk) dst[kk * P + j] = n < N ? W[n * K + kk] : 0.0f;
  }
}

template <int R, int NV>
inline void linear_fixed_order(const float* x, int64_t M, int64_t K, int64_t xs, const float* W,
                               const float* bias, int64_t N, float* y, int64_t ys) {
  constexpr int64_t P = NV * kW;         // columns per panel
  constexpr int64_t kBlockRows = 8 * R;  // rows per task
  const int64_t panels = (N + P - 1) / P;
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  // W packed once per call into panels [K][P] on the calling thread's buffer, by all threads
  thread_local std::vector<float> packed;
  packed.resize(static_cast<size_t>(panels * K * P));
  float* const pk = packed.data();
  const int threads = threads_for(2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K),
                                  blocks * panels);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) pack_panel<P>(W, N, K, p, pk + p * K * P);
    // tasks: (block of rows, panel), a block's rows staying in cache across its panels
#pragma omp for schedule(static) collapse(2)
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t m0 = b * kBlockRows, rows = std::min(kBlockRows, M - m0), n0 = p * P;
        const int64_t cols = std::min(P, N - n0);
        const float* a = x + m0 * xs;
        const float* panel = pk + p * K * P;
        const float* bp = bias != nullptr ? bias + n0 : nullptr;
        float* c = y + m0 * ys + n0;
        int64_t m = 0;
        for (; m + R <= rows; m += R) fixed_order_rows<R, NV>(a + m * xs, xs, panel, K, bp, c + m * ys, ys, cols);
        if (m < rows) fixed_order_tail<R - 1, NV>(rows - m, a + m * xs, xs, panel, K, bp, c + m * ys, ys, cols);
      }
    }
  }
  if (packed.size() > (size_t{1} << 24)) std::vector<float>().swap(packed);  // a thread keeps at most 64 MB
}

// Every ISA, the portable one included (its Vec::fma is std::fma per lane), computes the same
// chains, so the results are also the same bits on every path.
inline void linear_f32_fixed_order(const float* x, int64_t M, int64_t K, int64_t xs, const float* W,
                                   const float* bias, int64_t N, float* y, int64_t ys) {
  if constexpr (Vec::kRowsQK >= 12) {  // 32 vector registers: 6 x 4-vector blocks
    linear_fixed_order<6, 4>(x, M, K, xs, W, bias, N, y, ys);
  } else {
    linear_fixed_order<6, 2>(x, M, K, xs, W, bias, N, y, ys);
  }
}

// Partial sums (one vector) of the dot product of two rows of n values.
HEADS_INLINE VR row_dot(const float* a, const float* b, int64_t n) {
  VR acc = Vec::zero();
  int64_t d = 0;
  for (; d + kW <= n; d += kW) acc = Vec::fma(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  if (d < n) acc = Vec::fma(Vec::load_partial(a + d, n - d), Vec::load_partial(b + d, n - d), acc);
  return acc;
}

}  // namespace gemm

// C [M, N] = A [M, K] · B [K, N] on the calling thread, for small products inside the kernels'
// own parallel loops (linear attention's chunks), where a oneDNN call costs more than the work. B
// with column stride 1 is read in place; otherwise it is first copied into rows (K·N floats).
inline void small_matmul_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs,
                             const float* B, int64_t b_rs, int64_t b_cs, float* C, int64_t c_stride) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t m = 0; m < M; ++m) std::fill(C + m * c_stride, C + m * c_stride + N, 0.0f);
    return;
  }
  if (b_cs == 1) return gemm::gemm_acc(M, N, K, A, a_rs, a_cs, B, b_rs, C, c_stride, 1.0f, gemm::Out::Set);
  thread_local std::vector<float> rows;
  rows.resize(static_cast<size_t>(K * N));
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t n = 0; n < N; ++n) rows[static_cast<size_t>(k * N + n)] = B[k * b_rs + n * b_cs];
  }
  gemm::gemm_acc(M, N, K, A, a_rs, a_cs, rows.data(), N, C, c_stride, 1.0f, gemm::Out::Set);
  if (rows.size() > (size_t{1} << 20)) std::vector<float>().swap(rows);  // a thread keeps at most 4 MB
}
