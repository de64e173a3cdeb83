// gemm_i8-inl.h — heads' own integer GEMM for the int8 linear layers (heads/precision.h,
// linear_lowp.cc) on CPUs where oneDNN has no native int8 matmul (no VNNI: AVX2 CPUs such as Zen 3
// and Haswell to Coffee Lake, AVX-512 CPUs before Cascade Lake). Included by isa_table-inl.h inside
// namespace heads::kernels::<isa> where the vector layer has I16Pairs.
//
//   C[m][n] = Σ_k A[m][k]·B[n][k]     A uint8 [M, K] (row stride lda), B int8 [N, K], C int32 [M, N]
//   (for each product of the call: its own B, C and rows M ≤ the call's, one A)
//
// Sums are exact in int32 (|A·B| ≤ 255·128 per product, K bounded by the caller), so the result is
// the bits of oneDNN's u8s8 matmul and of the portable loops, whatever the blocking or threads.
// Why 16-bit pairs: the u8 × s8 instruction of these CPUs (vpmaddubsw) sums two products in
// saturating int16, which full-range bytes overflow (255·127·2 > 32767; oneDNN's own AVX2 int8 GEMM
// is off by 10% on such values); vpmaddwd multiplies 16-bit pairs into exact 32-bit sums at the same
// rate per instruction, 16 multiply-adds per 256 bits: twice the f32 FMA's work per instruction.
//
// Layouts: B packed once (kernels/dispatch.h, kPairPanel): panel p holds columns [16p, 16p + 16)
// as [Kp][16][2] int16, Kp = ceil(K / 2). A packed at each call in groups of R rows, group g as
// [Kp][R] uint32: element [i][r] is the pair (A[gR + r][2i], A[gR + r][2i + 1]) as two uint16 (0
// past K and past M), so that a micro-kernel reads its rows' pairs from one stream.
// Micro-kernel: R rows x 16 columns of int32 sums in registers over a block of kKBlock pairs; per
// pair i, the panel's 16 column pairs (2 vectors on AVX2) loaded once, each row's pair broadcast
// (R + 2 loads per 2R vpmaddwd on AVX2, R = 6).
// Blocking (GotoBLAS's): a block of kRowBlock rows of A (in L2) meets every panel in turn; a panel's
// slice of kKBlock pairs (16 KB, in L1) meets the block's row groups in turn; blocks of K past the
// first add to C.
// Parallel: tasks (product, row block, panel), a row block's panels consecutive so that a thread's
// block of A stays in its L2; A is packed once per call, by all threads.

namespace gemm_i8 {

using P = I16Pairs::P;
constexpr int kR = I16Pairs::kRows;                     // rows per micro-kernel
constexpr int kW = Vec::W;                              // 32-bit lanes per register
constexpr int kNV = static_cast<int>(kPairPanel) / kW;  // registers per panel row
constexpr int64_t kPanelRow = 2 * kPairPanel;           // int16 values per pair of a panel
constexpr int64_t kRowBlock = 96;                       // rows per task (72 KB of A at K = 384)
static_assert(kRowBlock % kR == 0);
constexpr int64_t kKBlock = 256;                        // pairs per block of K (a 16 KB slice of a panel)

// C[r][0, cols) (+)= Σ_{i < kp} a[i][r] · panel pair i for r < RT ≤ kR rows; a: a group of packed
// A, panel: its slice of kp pairs.
// Not inlined: a function of its own keeps its RT·kNV sums in registers (inlined into the task loop,
// GCC 12 spilled some of them to the stack: 30% slower).
template <int RT>
__attribute__((noinline)) void group_rows(const uint32_t* a, const int16_t* panel, int64_t kp, int32_t* c, int64_t ldc,
                                          int64_t cols, bool add) {
  int64_t n[kNV];  // live lanes of each register of a row
#pragma GCC unroll 4
  for (int v = 0; v < kNV; ++v) n[v] = std::clamp<int64_t>(cols - v * kW, 0, kW);
  P acc[RT][kNV];
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) acc[r][v] = add ? I16Pairs::load_partial(c + r * ldc + v * kW, n[v]) : I16Pairs::zero();
  }
  for (int64_t i = 0; i < kp; ++i) {
    P w[kNV];
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) w[v] = I16Pairs::load(panel + i * kPanelRow + v * 2 * kW);
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      const P x = I16Pairs::set1(a + i * kR + r);
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) acc[r][v] = I16Pairs::dot(acc[r][v], x, w[v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) I16Pairs::store(c + r * ldc + v * kW, acc[r][v], n[v]);
  }
}

template <int RT>
HEADS_INLINE void group_tail(int64_t rows, const uint32_t* a, const int16_t* panel, int64_t kp, int32_t* c,
                             int64_t ldc, int64_t cols, bool add) {
  if constexpr (RT > 0) {
    if (rows == RT) return group_rows<RT>(a, panel, kp, c, ldc, cols, add);
    group_tail<RT - 1>(rows, a, panel, kp, c, ldc, cols, add);
  }
}

// Group g of A's packed layout (above) from rows [gR, gR + R) of A.
inline void pack_group(const uint8_t* A, int64_t M, int64_t K, int64_t lda, int64_t g, uint32_t* dst) {
  const int64_t Kp = (K + 1) / 2;
  alignas(64) uint16_t row[2 * kKBlock];
  for (int64_t i0 = 0; i0 < Kp; i0 += kKBlock) {  // a block of pairs at a time, through one row's buffer
    const int64_t np = std::min(kKBlock, Kp - i0);
    for (int r = 0; r < kR; ++r) {
      const int64_t m = g * kR + r;
      if (m < M) {
        I16Pairs::widen_u8(A + m * lda + 2 * i0, std::min(2 * np, K - 2 * i0), row, 2 * np);
      } else {
        std::fill(row, row + 2 * np, uint16_t{0});
      }
      for (int64_t i = 0; i < np; ++i) {
        uint32_t pair;
        std::memcpy(&pair, row + 2 * i, sizeof pair);
        dst[(i0 + i) * kR + r] = pair;
      }
    }
  }
}

}  // namespace gemm_i8

inline void gemm_u8s8_pairs(const uint8_t* A, int64_t M, int64_t K, int64_t lda, const PairsProduct* parts,
                            int count) {
  using namespace gemm_i8;
  const int64_t Kp = (K + 1) / 2;
  const int64_t groups = (M + kR - 1) / kR;
  // Tasks: for each product its row blocks, each block's panels in order. A product's row blocks
  // are of one size (a multiple of kR, at most kRowBlock; the last one shorter by less than kR per
  // block), so that the threads' equal shares of tasks are equal shares of work.
  const auto block_rows = [](const PairsProduct& p) {
    const int64_t n = (p.M + kRowBlock - 1) / kRowBlock;
    return ((p.M + n - 1) / n + kR - 1) / kR * kR;
  };
  const auto blocks = [&](const PairsProduct& p) { return (p.M + block_rows(p) - 1) / block_rows(p); };
  const auto panels = [](const PairsProduct& p) { return (p.N + kPairPanel - 1) / kPairPanel; };
  int64_t tasks = 0;
  double macs = 0;
  for (int p = 0; p < count; ++p) {
    tasks += blocks(parts[p]) * panels(parts[p]);
    macs += static_cast<double>(parts[p].M) * static_cast<double>(parts[p].N) * static_cast<double>(K);
  }
  if (tasks == 0) return;
  // A packed on the calling thread's buffer, by all threads.
  thread_local std::vector<uint32_t> packed;
  packed.resize(static_cast<size_t>(groups * Kp * kR));
  uint32_t* const a32 = packed.data();
  const int threads = threads_for(2.0 * macs, tasks);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) pack_group(A, M, K, lda, g, a32 + g * Kp * kR);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      int p = 0;
      int64_t local = t;  // the task within product p
      for (; local >= blocks(parts[p]) * panels(parts[p]); ++p) local -= blocks(parts[p]) * panels(parts[p]);
      const PairsProduct& pr = parts[p];
      const int64_t m0 = local / panels(pr) * block_rows(pr), panel = local % panels(pr);
      const int64_t rows = std::min(block_rows(pr), pr.M - m0), n0 = panel * kPairPanel;
      const int64_t cols = std::min(kPairPanel, pr.N - n0);
      for (int64_t i0 = 0; i0 < Kp; i0 += kKBlock) {
        const int64_t kp = std::min(kKBlock, Kp - i0);
        const int16_t* b = pr.b + (panel * Kp + i0) * kPanelRow;
        for (int64_t m = 0; m < rows; m += kR) {
          const uint32_t* a = a32 + ((m0 + m) / kR * Kp + i0) * kR;
          int32_t* c = pr.c + (m0 + m) * pr.ldc + n0;
          if (rows - m >= kR) {
            group_rows<kR>(a, b, kp, c, pr.ldc, cols, i0 > 0);
          } else {
            group_tail<kR - 1>(rows - m, a, b, kp, c, pr.ldc, cols, i0 > 0);
          }
        }
      }
    }
  }
  if (packed.size() > (size_t{1} << 22)) std::vector<uint32_t>().swap(packed);  // a thread keeps at most 16 MB
}
