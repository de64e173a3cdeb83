// gemm_i8-inl.h — heads' own integer GEMM for the int8 linear layers (heads/precision.h,
// linear_lowp.cc) on CPUs where oneDNN has no native int8 matmul (no VNNI: AVX2 CPUs such as Zen 3
// and Haswell to Coffee Lake, AVX-512 CPUs before Cascade Lake; AArch64, where Debian's oneDNN has
// none). Included by isa_table-inl.h inside namespace heads::kernels::<isa> where the vector layer
// has I16Pairs (x86-64) or I8Quads (AArch64 with DOTPROD): Dots below.
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
// Why 8-bit quads on AArch64: SDOT (FEAT_DotProd) sums four s8·s8 products into each 32-bit lane, 16
// multiply-adds per 128-bit instruction against FMLA's 4 (no u8 × s8 form before FEAT_I8MM's USDOT):
// the activations enter as a − 128 (signed bytes), the weight's 128·Σ_k B starts the sums (the
// packed panel's header), and a folded 16-bit row B = 256·H + L is two planes of bytes, the H plane's
// sums shifted by 8 and added; all in 32-bit arithmetic modulo 2^32, exact since the true sum fits.
// Layouts: B packed once (kernels/dispatch.h, kPairPanel, Int8Layout): panel p holds columns [16p,
// 16p + 16) as groups of K of kG values (pairs: [Kg][16][2] int16; quads: [Kg][16][4] int8 after a
// header, an H plane after the L plane), 64 bytes per group, Kg = ceil(K / kG). A packed at each call
// in groups of R rows, group g as [Kg][R] uint32: element [i][r] holds A[gR + r][kG·i, kG·i + kG)
// (pairs: two uint16; quads: four bytes a − 128; 0 past K and past M), so that a micro-kernel reads
// its rows' groups from one stream.
// Micro-kernel: R rows x 16 columns of int32 sums in registers over a block of kKBlock pairs; per
// pair i, the panel's 16 column pairs (2 vectors on AVX2) loaded once, each row's pair broadcast
// (R + 2 loads per 2R vpmaddwd on AVX2, R = 6).
// Blocking (GotoBLAS's): a block of kRowBlock rows of A (in L2) meets every panel in turn; a panel's
// slice of kKBlock pairs (16 KB, in L1) meets the block's row groups in turn; blocks of K past the
// first add to C.
// Parallel: tasks (product, row block, panel), a row block's panels consecutive, handed out 4 at a
// time as threads come free (a thread's block of A mostly stays in its L2; on a shared 2-core Zen 3,
// heads bench embed --dtype int8 201 against 171 sentences/s with a static split, medians of 5
// interleaved rounds: a core slowed by its neighbour no longer holds the other back); A is packed
// once per call, by all threads (and the outlier channels' values of its rows gathered). Each task
// writes its own outputs: the bits do not depend on who runs it.
// gemm_u8s8_pairs_out makes the int8 layer's output (kernels/dispatch.h: PairsOut) from the sums
// while they are in registers, a tile of R rows x 16 columns at a time (the sums of earlier blocks
// of K in a tile of the thread's own), instead of storing them.

namespace gemm_i8 {

#ifdef HEADS_I8_QUADS
using Dots = I8Quads;
#else
using Dots = I16Pairs;
#endif
using P = Dots::P;
using VR = Vec::R;
constexpr int kR = Dots::kRows;                         // rows per micro-kernel
constexpr int kW = Vec::W;                              // 32-bit lanes per register
constexpr int kNV = static_cast<int>(kPairPanel) / kW;  // registers per panel row
constexpr int64_t kG = int8_group(Dots::kLayout);       // values of K per 32-bit lane
constexpr bool kQuads = Dots::kLayout == Int8Layout::Quads8;
constexpr int64_t kGroupRow = 64;                       // bytes of a panel per group of K (16 lanes)
static_assert(kGroupRow == kPairPanel * 4);
constexpr int64_t kHeader = kQuads ? kQuadsHeader : 0;  // bytes before a panel's planes
constexpr int64_t kRowBlock = 96;                       // rows per task (72 KB of A at K = 384)
static_assert(kRowBlock % kR == 0);
static_assert(kPairPanel == kOutlierPanel);  // PairsOut reads the outlier columns of a panel's 16 outputs
constexpr int64_t kKBlock = 256;                        // groups per block of K (a 16 KB slice of a plane)

// Bytes of one packed panel of Kg groups.
constexpr int64_t panel_bytes(int64_t Kg) { return int8_panel_bytes(Dots::kLayout, Kg * kG); }

// acc[r][v] = Σ_{i < kp} a[i][r] · plane group i (lanes v·W to v·W + W of the panel's 16 columns)
// for r < RT ≤ kR rows; a: a group of packed A, plane: its slice of kp groups.
template <int RT>
HEADS_INLINE void accumulate(P (&acc)[RT][kNV], const uint32_t* a, const uint8_t* plane, int64_t kp) {
#ifdef HEADS_I16_PAIRS_ACCUMULATE6  // the vector layer's own kernel of 6 rows, where it has one
  if constexpr (RT == 6 && kNV == 2) return Dots::accumulate6(acc, a, plane, kp);
#endif
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) acc[r][v] = Dots::zero();
  }
  for (int64_t i = 0; i < kp; ++i) {
    P w[kNV];
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) w[v] = Dots::load(plane + i * kGroupRow + v * 4 * kW);
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      const P x = Dots::set1(a + i * kR + r);
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) acc[r][v] = Dots::dot(acc[r][v], x, w[v]);
    }
  }
}

// C[r][0, cols) (+)= the sums above over groups [i0, i0 + kp) of the panel (of Kg groups; quads: its
// header's sums start them, its H plane's are added). Not inlined: a function of its own keeps its
// RT·kNV sums in registers (inlined into the task loop, GCC 12 spilled some of them to the stack: 30%
// slower).
template <int RT>
__attribute__((noinline)) void group_rows(const uint32_t* a, const uint8_t* panel, int64_t i0, int64_t kp, int64_t Kg,
                                          int32_t* c, int64_t ldc, int64_t cols, bool add) {
  int64_t n[kNV];  // live lanes of each register of a row
#pragma GCC unroll 4
  for (int v = 0; v < kNV; ++v) n[v] = std::clamp<int64_t>(cols - v * kW, 0, kW);
  const uint8_t* plane = panel + kHeader + i0 * kGroupRow;
  P acc[RT][kNV];
  accumulate<RT>(acc, a, plane, kp);
  const auto* header = reinterpret_cast<const int32_t*>(panel);
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) {
      int32_t* cr = c + r * ldc + v * kW;
      P sum = acc[r][v];
      if (add) {
        sum = Dots::add(sum, Dots::load_partial(cr, n[v]));
      } else if constexpr (kQuads) {
        sum = Dots::add(sum, Dots::load_partial(header + v * kW, kW));
      }
      Dots::store(cr, sum, n[v]);
    }
  }
  if constexpr (kQuads) {
    if (header[kPairPanel] == 0) return;  // no H plane to add
    accumulate<RT>(acc, a, plane + Kg * kGroupRow, kp);
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) {
        int32_t* cr = c + r * ldc + v * kW;
        Dots::store(cr, Dots::add(Dots::load_partial(cr, n[v]), Dots::shl8(acc[r][v])), n[v]);
      }
    }
  }
}

// The activation of a tile of outputs just stored (in L1), in a loop of its own, apart from the
// tile's twelve live registers (no faster on Zen 3 than applying it to them, within noise, and a
// function of its own in profiles). GELU (erf) takes the tile's vectors ew::kSideBySide at a time
// (ew::gelu_erf_n: the same bits; Zen 3, 34 → 26 cycles a vector, where GELU had been ~8% of heads
// bench embed --dtype int8's samples).
__attribute__((noinline)) inline void activate_tile(float* y, int64_t ys, int rows, int64_t cols, int act) {
  if (act == 2) {
    constexpr int kN = ew::kSideBySide;
    const int64_t per_row = (cols + kW - 1) / kW, count = rows * per_row;
    const auto at = [&](int64_t v) { return y + v / per_row * ys + v % per_row * kW; };
    const auto lanes = [&](int64_t v) { return std::min<int64_t>(kW, cols - v % per_row * kW); };
    for (int64_t v0 = 0; v0 < count; v0 += kN) {
      VR x[kN];
#pragma GCC unroll 8
      for (int j = 0; j < kN; ++j) {
        const int64_t v = std::min(v0 + j, count - 1);  // past the tile: its last vector again, not stored
        x[j] = lanes(v) == kW ? Vec::loadu(at(v)) : Vec::load_partial(at(v), lanes(v));
      }
      ew::gelu_erf_n(x);
      for (int j = 0; j < kN && v0 + j < count; ++j) {
        const int64_t v = v0 + j;
        if (lanes(v) == kW) {
          Vec::storeu(at(v), x[j]);
        } else {
          Vec::store_partial(at(v), x[j], lanes(v));
        }
      }
    }
    return;
  }
  for (int r = 0; r < rows; ++r) {
    float* yr = y + r * ys;
    const auto f = [act](VR x) { return act == 1 ? ew::relu(x) : ew::gelu_tanh(x); };
    int64_t i = 0;
    for (; i + kW <= cols; i += kW) Vec::storeu(yr + i, f(Vec::loadu(yr + i)));
    if (i < cols) Vec::store_partial(yr + i, f(Vec::load_partial(yr + i, cols - i)), cols - i);
  }
}

// Rows [m, m + RT) x columns [n0, n0 + cols) of the output (PairsOut) from their int32 sums in part
// (row stride ldp; heads' vector GEMM and the tile GEMM, gemm_i8_amx-inl.h, store them there), panel
// index p0 (the outlier columns').
// kActInRegisters: the activation applied to the sums in registers before they are stored (AVX-512's 32
// registers hold RT = 8 rows and GELU's temporaries) rather than by activate_tile after.
template <int RT, bool kActInRegisters = false>
HEADS_INLINE void out_rows(const int32_t* part, int64_t ldp, const PairsOut& o, const float* xo, int64_t m, int64_t n0,
                           int64_t cols, int64_t p0) {
  int64_t n[kNV];
#pragma GCC unroll 4
  for (int v = 0; v < kNV; ++v) n[v] = std::clamp<int64_t>(cols - v * kW, 0, kW);
  P ws[kNV];
  VR sw[kNV], b[kNV];
#pragma GCC unroll 4
  for (int v = 0; v < kNV; ++v) {
    ws[v] = Dots::load_partial(o.ws + n0 + v * kW, n[v]);
    sw[v] = Vec::load_partial(o.sw + n0 + v * kW, n[v]);
    b[v] = o.b != nullptr ? Vec::load_partial(o.b + n0 + v * kW, n[v]) : Vec::zero();
  }
  // dequantized sums, then the outlier channels' f32 products, one channel at a time for every row
  // and register (RT·kNV independent sums: one sum per row would wait on each FMA's latency)
  VR out[RT][kNV];
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r) {
    const VR s = Vec::set1(o.s[m + r]);
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) {
      const P sum = Dots::load_partial(part + r * ldp + v * kW, kW);
      out[r][v] = Vec::fma(Vec::mul(Dots::sub_mul_f32(sum, o.z[m + r], ws[v]), s), sw[v], b[v]);
    }
  }
  const float* wo = o.wo + p0 * o.no * kPairPanel;
  for (int64_t c = 0; c < o.no; ++c) {
    VR w[kNV];
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) w[v] = Vec::loadu(wo + c * kPairPanel + v * kW);
    const float* xc = xo + m * o.no + c;
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      const VR xv = Vec::set1(xc[r * o.no]);
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) out[r][v] = Vec::fma(xv, w[v], out[r][v]);
    }
  }
  if constexpr (kActInRegisters) {
    const auto apply = [&out](auto f) {
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) {
#pragma GCC unroll 4
        for (int v = 0; v < kNV; ++v) out[r][v] = f(out[r][v]);
      }
    };
    if (o.act == 1) apply([](VR x) { return ew::relu(x); });
    if (o.act == 2) apply([](VR x) { return ew::gelu_erf(x); });
    if (o.act == 3) apply([](VR x) { return ew::gelu_tanh(x); });
  }
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r) {
    float* y = o.y + (m + r) * o.ys + n0;
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) {
      if (n[v] == kW) {
        Vec::storeu(y + v * kW, out[r][v]);
      } else if (n[v] > 0) {
        Vec::store_partial(y + v * kW, out[r][v], n[v]);
      }
    }
  }
  if (!kActInRegisters && o.act != 0) activate_tile(o.y + m * o.ys + n0, o.ys, RT, cols, o.act);
}

// Rows [m, m + RT) x columns [n0, n0 + cols) of the output: the sums above into part [RT][16] (added
// to the sums of earlier blocks of K there if add), then the output from part. The epilogue reads the
// sums back from the tile rather than from registers: sharing a function with it, GCC 12 spilled the
// micro-kernel's sums (2.5x slower), and one store and load per output is nothing beside its K
// multiply-adds.
template <int RT>
HEADS_INLINE void group_out(const uint32_t* a, const uint8_t* panel, int64_t i0, int64_t kp, int64_t Kg, int32_t* part,
                            bool add, const PairsOut& o, const float* xo, int64_t m, int64_t n0, int64_t cols,
                            int64_t p0) {
  group_rows<RT>(a, panel, i0, kp, Kg, part, kPairPanel, kPairPanel, add);
  out_rows<RT>(part, kPairPanel, o, xo, m, n0, cols, p0);
}

// The tail groups of RT < kR rows, as above.
template <int RT>
HEADS_INLINE void group_tail(int64_t rows, const uint32_t* a, const uint8_t* panel, int64_t i0, int64_t kp, int64_t Kg,
                             int32_t* c, int64_t ldc, int64_t cols, bool add) {
  if constexpr (RT > 0) {
    if (rows == RT) return group_rows<RT>(a, panel, i0, kp, Kg, c, ldc, cols, add);
    group_tail<RT - 1>(rows, a, panel, i0, kp, Kg, c, ldc, cols, add);
  }
}

template <int RT>
HEADS_INLINE void group_out_tail(int64_t rows, const uint32_t* a, const uint8_t* panel, int64_t i0, int64_t kp,
                                 int64_t Kg, int32_t* part, bool add, const PairsOut& o, const float* xo, int64_t m,
                                 int64_t n0, int64_t cols, int64_t p0) {
  if constexpr (RT > 0) {
    if (rows == RT) return group_out<RT>(a, panel, i0, kp, Kg, part, add, o, xo, m, n0, cols, p0);
    group_out_tail<RT - 1>(rows, a, panel, i0, kp, Kg, part, add, o, xo, m, n0, cols, p0);
  }
}

// Group g of A's packed layout (above) from rows [gR, gR + R) of A.
inline void pack_group(const uint8_t* A, int64_t M, int64_t K, int64_t lda, int64_t g, uint32_t* dst) {
  const int64_t Kg = (K + kG - 1) / kG;
  alignas(64) uint16_t row[2 * kKBlock];  // 4 bytes a group
  for (int64_t i0 = 0; i0 < Kg; i0 += kKBlock) {  // a block of groups at a time, through one row's buffer
    const int64_t np = std::min(kKBlock, Kg - i0);
    for (int r = 0; r < kR; ++r) {
      const int64_t m = g * kR + r;
      if (m < M) {
        Dots::groups_of(A + m * lda + kG * i0, std::min(kG * np, K - kG * i0), row, np);
      } else {
        std::fill(row, row + 2 * np, uint16_t{0});
      }
      for (int64_t i = 0; i < np; ++i) {
        uint32_t group;
        std::memcpy(&group, row + 2 * i, sizeof group);
        dst[(i0 + i) * kR + r] = group;
      }
    }
  }
}

// Rows per block of a product of M rows: of one size (a multiple of kR, at most kRowBlock; the last
// block shorter by less than kR per block), so that the threads' equal shares of tasks are equal
// shares of work.
inline int64_t block_rows(int64_t M) {
  const int64_t n = (M + kRowBlock - 1) / kRowBlock;
  return ((M + n - 1) / n + kR - 1) / kR * kR;
}

// The tasks of one call, shared by this GEMM and the tile GEMM (gemm_i8_amx-inl.h): for each product
// in turn blocks(product) row blocks, each of cols(product) column blocks in order.
template <class Blocks, class Cols>
struct TaskGrid {
  const PairsProduct* parts;
  int count;
  Blocks blocks;
  Cols cols;
  int64_t of(const PairsProduct& p) const { return blocks(p) * cols(p); }
  int64_t size() const {
    int64_t n = 0;
    for (int i = 0; i < count; ++i) n += of(parts[i]);
    return n;
  }
  double macs(int64_t K) const {  // of every product
    double n = 0;
    for (int i = 0; i < count; ++i) n += static_cast<double>(parts[i].M) * static_cast<double>(parts[i].N) * K;
    return n;
  }
  struct Task {
    const PairsProduct& pr;
    int64_t block, col;
  };
  Task operator[](int64_t t) const {  // t: the task within product i
    int i = 0;
    for (; t >= of(parts[i]); ++i) t -= of(parts[i]);
    return {parts[i], t / cols(parts[i]), t % cols(parts[i])};
  }
};
template <class Blocks, class Cols>
TaskGrid<Blocks, Cols> task_grid(const PairsProduct* parts, int count, Blocks blocks, Cols cols) {
  return {parts, count, blocks, cols};
}

// The tasks of one call: for each product its row blocks, each block's panels in order; A packed on
// the calling thread's buffer first, by all threads; task(p, m0, rows, panel, a32, Kg) runs one.
template <class Task, class Gather>
inline void run_tasks(const uint8_t* A, int64_t M, int64_t K, int64_t lda, const PairsProduct* parts, int count,
                      Task task, Gather gather) {
  const int64_t Kg = (K + kG - 1) / kG;
  const int64_t groups = (M + kR - 1) / kR;
  const auto grid = task_grid(
      parts, count, [](const PairsProduct& p) { return (p.M + block_rows(p.M) - 1) / block_rows(p.M); },
      [](const PairsProduct& p) { return (p.N + kPairPanel - 1) / kPairPanel; });
  const int64_t tasks = grid.size();
  if (tasks == 0) return;
  thread_local std::vector<uint32_t> packed;
  packed.resize(static_cast<size_t>(groups * Kg * kR));
  uint32_t* const a32 = packed.data();
  const int threads = threads_for(2.0 * grid.macs(K), tasks);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      pack_group(A, M, K, lda, g, a32 + g * Kg * kR);
      gather(g * kR, std::min(M, g * kR + kR));
    }
#pragma omp for schedule(dynamic, 4)
    for (int64_t t = 0; t < tasks; ++t) {
      const auto at = grid[t];
      const int64_t br = block_rows(at.pr.M), m0 = at.block * br;
      task(at.pr, m0, std::min(br, at.pr.M - m0), at.col, a32, Kg);
    }
  }
  if (packed.size() > (size_t{1} << 22)) std::vector<uint32_t>().swap(packed);  // a thread keeps at most 16 MB
}

}  // namespace gemm_i8

inline void gemm_u8s8_pairs(const uint8_t* A, int64_t M, int64_t K, int64_t lda, const PairsProduct* parts,
                            int count) {
  using namespace gemm_i8;
  run_tasks(A, M, K, lda, parts, count,
            [](const PairsProduct& pr, int64_t m0, int64_t rows, int64_t panel, const uint32_t* a32, int64_t Kg) {
              const int64_t n0 = panel * kPairPanel, cols = std::min(kPairPanel, pr.N - n0);
              const uint8_t* b = static_cast<const uint8_t*>(pr.b) + panel * panel_bytes(Kg);
              for (int64_t i0 = 0; i0 < Kg; i0 += kKBlock) {
                const int64_t kp = std::min(kKBlock, Kg - i0);
                for (int64_t m = 0; m < rows; m += kR) {
                  const uint32_t* a = a32 + ((m0 + m) / kR * Kg + i0) * kR;
                  int32_t* c = pr.c + (m0 + m) * pr.ldc + n0;
                  if (rows - m >= kR) {
                    group_rows<kR>(a, b, i0, kp, Kg, c, pr.ldc, cols, i0 > 0);
                  } else {
                    group_tail<kR - 1>(rows - m, a, b, i0, kp, Kg, c, pr.ldc, cols, i0 > 0);
                  }
                }
              }
            },
            [](int64_t, int64_t) {});
}

inline void gemm_u8s8_pairs_out(const uint8_t* A, int64_t M, int64_t K, int64_t lda, const void* B, int64_t N,
                                const PairsOut& out) {
  using namespace gemm_i8;
  const PairsProduct part{B, N, M, nullptr, 0};
  // The outlier channels' values, gathered once into rows of no (the tiles read them from L1, where
  // x's rows, 6 KB apart at K = 1536, had each tile reach past L2 for them).
  thread_local std::vector<float> gathered;
  gathered.resize(static_cast<size_t>(M * out.no));
  float* const xo = gathered.data();
  run_tasks(A, M, K, lda, &part, 1,
            [&out, xo](const PairsProduct& pr, int64_t m0, int64_t rows, int64_t panel, const uint32_t* a32,
                       int64_t Kg) {
              // the sums of the blocks of K before the last, rows x 16 (at most kRowBlock rows)
              alignas(64) int32_t partial[kRowBlock * kPairPanel];
              const int64_t n0 = panel * kPairPanel, cols = std::min(kPairPanel, pr.N - n0);
              const uint8_t* b = static_cast<const uint8_t*>(pr.b) + panel * panel_bytes(Kg);
              for (int64_t i0 = 0; i0 < Kg; i0 += kKBlock) {
                const int64_t kp = std::min(kKBlock, Kg - i0);
                const bool last = i0 + kp == Kg;
                for (int64_t m = 0; m < rows; m += kR) {
                  const uint32_t* a = a32 + ((m0 + m) / kR * Kg + i0) * kR;
                  const int64_t rt = std::min<int64_t>(kR, rows - m);
                  int32_t* part = partial + m * kPairPanel;
                  if (!last) {  // all 16 columns: the panel's past N are zero
                    if (rt == kR) {
                      group_rows<kR>(a, b, i0, kp, Kg, part, kPairPanel, kPairPanel, i0 > 0);
                    } else {
                      group_tail<kR - 1>(rt, a, b, i0, kp, Kg, part, kPairPanel, kPairPanel, i0 > 0);
                    }
                  } else if (rt == kR) {
                    group_out<kR>(a, b, i0, kp, Kg, part, i0 > 0, out, xo, m0 + m, n0, cols, panel);
                  } else {
                    group_out_tail<kR - 1>(rt, a, b, i0, kp, Kg, part, i0 > 0, out, xo, m0 + m, n0, cols, panel);
                  }
                }
              }
            },
            [&out, xo](int64_t m0, int64_t m1) {
              for (int64_t m = m0; m < m1; ++m) {
                for (int64_t c = 0; c < out.no; ++c) xo[m * out.no + c] = out.x[m * out.xs + out.oc[c]];
              }
            });
  if (gathered.size() > (size_t{1} << 20)) std::vector<float>().swap(gathered);  // at most 4 MB kept
}
