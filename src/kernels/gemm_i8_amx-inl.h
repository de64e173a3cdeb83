// gemm_i8_amx-inl.h — heads' integer GEMM on AMX-INT8 tiles (tdpbusd), for the int8 linear layers
// (heads/precision.h, linear_lowp_int8.cc) on CPUs with AMX. Included by isa_table-inl.h inside
// namespace heads::kernels::<isa> of the AMX builds (isa_amx.cc; isa_amx_emu.cc over the tile
// emulator), after gemm_i8-inl.h, whose output pass (out_rows) it shares.
//
//   C[m][n] = Σ_k A[m][k]·B[n][k]     A uint8 [M, K] (row stride lda), B int8 [N, K] (or 16-bit rows
//   folded in), C int32 [M, N] (for each product of the call: its own B, C and rows M ≤ the call's)
//
// Why its own GEMM where oneDNN has one (brgemm on AMX-INT8): oneDNN's int8 matmul stores the int32
// sums, and the int8 layer's output (the zero points taken out, scales, bias, outlier channels, the
// residual rows' second GEMM, GELU) was a pass of its own over them: on an Intel Xeon with AMX (2
// threads, heads bench embed --dtype int8) oneDNN's GEMMs were 29% of the samples and the output
// passes 14% more. Here each 32 x 32 block of sums is made into outputs while it is in L1 (GELU
// applied in registers), and a folded 16-bit weight row costs a second tile product over the H plane
// of its panel (the pair's first only, where the second has none). Side by side on that CPU:
// embeddings 1,015 against 900 sentences/s (medians of 11 interleaved runs; in five other runs of 5
// to 9 the ratio went from 0.99 to 1.16, the host being noisy); one layer of 864 rows, K 384, N 1536,
// one activation term: 1.01 against 1.24 ms. Used where every activation row has one term (linear_lowp_int8.cc): with second terms
// the sums are stored and made into outputs apart, and oneDNN's GEMM is faster there.
// In all-MiniLM-L6-v2 (calibrated) the layers of K = 384 have no folded rows, and 93% of the
// feed-forward output's pairs of panels (K = 1536) have them in both panels: the H planes double that
// layer's tile work. (Reordering each pair's columns so that the 16-bit rows share one panel halved
// the H planes of Gaussian weights, 21% of whose rows are folded at K = 1536, and changed no time
// measured, within noise: not kept.)
//
// Layout: B packed once as Int8Layout::Quads8 (kernels/dispatch.h), which is the tiles' own: a
// panel's plane [Kq][16][4] is 16 columns of 4-byte groups of K, so 16 consecutive groups (1 KB) are
// one B tile of tdpbusd, read in place. tdpbusd multiplies unsigned by signed bytes, so A's codes
// enter as they are and the panel header's 128·Σ_k B (the SDOT route's) is not used, only its "H
// plane present" flag: a panel with folded rows (B = 256·H + L) adds 256 times its H plane's sums.
// All sums are int32 modulo 2^32 (the instruction's), exact where the true sum fits, as in the other
// routes: the same bits.
// A is packed at each call into rows of Kp = K rounded up to 64 bytes, zero past K and past M up to a
// multiple of 16 rows (by all threads; the outlier channels' values gathered in the same pass), so that
// every A tile is 16 full rows of 64 bytes. The last tile of a plane whose groups end inside it is
// copied, zero past the plane's groups, once per task: a tile read in place would run into the next
// panel (or past the weight).
// Blocking: tasks of kBlockRows rows x one pair of panels (32 columns), handed out as threads come
// free; a task runs its rows 32 at a time (two A tiles), four C tiles of sums over all of K, then
// stores them (1 KB each, in L1) for the output pass. Each task writes its own outputs: the bits do
// not depend on who runs it.

namespace gemm_i8_amx {

constexpr int64_t kT = 16;                    // rows of a tile; columns of a panel
constexpr int64_t kTileK = 64;                // values of K per tile (16 groups of 4 bytes)
constexpr int64_t kTileBytes = kT * kTileK;   // one tile, 1 KB
constexpr int64_t kBlockRows = 64;            // rows per task (4 row tiles)
static_assert(kPairPanel == kT);

// The shapes of one call's operands.
struct Shape {
  int64_t K, Kp;  // K, K rounded up to kTileK (A's packed row)
  int64_t Kq;     // groups of 4 in a plane
  int64_t tiles;  // tiles along K
  int64_t full;   // tiles whose 16 groups are all in the plane (the rest: the zero-padded tail copy)
  int64_t panel;  // bytes of a packed panel
  explicit Shape(int64_t k)
      : K(k), Kp((k + kTileK - 1) / kTileK * kTileK), Kq((k + 3) / 4), tiles(Kp / kTileK), full(Kq / kT),
        panel(int8_panel_bytes(Int8Layout::Quads8, k)) {}
};

// The panels of one task (1 or 2 of a product's weight, a pair's) and the tails of their planes: the
// last tile of each plane, zero past its groups ([plane][panel]; copied at the task's start).
struct Panels {
  const uint8_t* p[2];
  int count;
  int h;  // the H planes to multiply: none, the first panel's or both
  alignas(64) uint8_t tail[2][2][kTileBytes];
};

inline bool has_h_plane(const uint8_t* panel) { return reinterpret_cast<const int32_t*>(panel)[kPairPanel] != 0; }

inline void start_panels(Panels& ps, const void* b, int64_t p0, int count, const Shape& s) {
  ps.count = count;
  for (int i = 0; i < count; ++i) ps.p[i] = static_cast<const uint8_t*>(b) + (p0 + i) * s.panel;
  ps.h = count == 2 && has_h_plane(ps.p[1]) ? 2 : has_h_plane(ps.p[0]) ? 1 : 0;
  if (count == 1) ps.p[1] = ps.p[0];
  if (s.full == s.tiles) return;
  const int64_t plane = s.Kq * kTileK, groups = s.Kq - s.full * kT;
  for (int pl = 0; pl < (ps.h > 0 ? 2 : 1); ++pl) {
    for (int i = 0; i < count; ++i) {
      uint8_t* dst = ps.tail[pl][i];
      std::memcpy(dst, ps.p[i] + kQuadsHeader + pl * plane + s.full * kTileBytes, static_cast<size_t>(groups * kTileK));
      std::memset(dst + groups * kTileK, 0, static_cast<size_t>(kTileBytes - groups * kTileK));
    }
  }
}

// One block of sums: rows [m, m + rows) (rows ≤ 32: one or two row tiles) against a task's panels, in the
// C tiles (tile rt·2 + ct: row tile rt, panel ct), then in sums[plane][tile] (the H plane's apart).
struct Block {
  const uint8_t* a = nullptr;  // its rows of packed A
  int64_t m = 0, rows = 0;
  int64_t p0 = 0;  // the first panel's index in its product
  int64_t N = 0;   // the product's columns
  int rt = 0, ct = 0;
  int h = 0;  // panels whose H plane runs (the first h)
};

// A block's sums as stored from the C tiles: [plane][tile].
struct Sums {
  alignas(64) int32_t c[2][4][kT * kT];
};

// The tile work of a block, in steps: the L plane's tiles of K, then (h > 0) the H plane's of its first
// h panels, the L sums stored and the C tiles zeroed before the first of those. Tile numbers are the
// instructions' immediates: 0-3 C (tile rt·2 + ct), 4-5 A (row tiles), 6-7 B (panels).
inline void zero_c(int rt, int ct) {
  HEADS_TILE_ZERO(0);
  if (ct == 2) HEADS_TILE_ZERO(1);
  if (rt == 2) HEADS_TILE_ZERO(2);
  if (rt == 2 && ct == 2) HEADS_TILE_ZERO(3);
}

inline void store_c(int rt, int ct, int32_t (*sums)[kT * kT]) {
  HEADS_TILE_STORE(0, sums[0], kTileK);
  if (ct == 2) HEADS_TILE_STORE(1, sums[1], kTileK);
  if (rt == 2) HEADS_TILE_STORE(2, sums[2], kTileK);
  if (rt == 2 && ct == 2) HEADS_TILE_STORE(3, sums[3], kTileK);
}

inline int64_t steps_of(const Block& b, const Shape& s) { return b.h > 0 ? 2 * s.tiles : s.tiles; }

inline void tile_step(const Block& b, const Panels& ps, const Shape& s, int64_t j, int32_t (*l_sums)[kT * kT]) {
  const int pl = j < s.tiles ? 0 : 1;
  const int64_t t = j - pl * s.tiles;
  const int ct = pl == 0 ? b.ct : b.h;
  if (pl == 1 && t == 0) {
    store_c(b.rt, b.ct, l_sums);
    zero_c(b.rt, ct);
  }
  const int64_t off = kQuadsHeader + pl * s.Kq * kTileK + t * kTileBytes;
  const bool in_place = t < s.full;
  HEADS_TILE_LOAD(4, b.a + t * kTileK, s.Kp);
  if (b.rt == 2) HEADS_TILE_LOAD(5, b.a + kT * s.Kp + t * kTileK, s.Kp);
  HEADS_TILE_LOAD(6, in_place ? ps.p[0] + off : ps.tail[pl][0], kTileK);
  if (ct == 2) HEADS_TILE_LOAD(7, in_place ? ps.p[1] + off : ps.tail[pl][1], kTileK);
  HEADS_TILE_DP_I8(0, 4, 6);
  if (ct == 2) HEADS_TILE_DP_I8(1, 4, 7);
  if (b.rt == 2) HEADS_TILE_DP_I8(2, 5, 6);
  if (b.rt == 2 && ct == 2) HEADS_TILE_DP_I8(3, 5, 7);
}

// What a task does with a block's sums, 8 rows of one tile at a time (sums: row stride kT): the
// output pass (PairsOut) or storing them (PairsProduct).
struct ToOutput {
  const PairsOut* o;
  const float* xo;
  void operator()(const int32_t* sums, int64_t m, int64_t rows, int64_t panel, int64_t cols) const {
    if (rows == 8) return gemm_i8::out_rows<8, true>(sums, kT, *o, xo, m, panel * kT, cols, panel);
    tail<7>(rows, sums, m, panel, cols);
  }
  template <int RT>
  void tail(int64_t rows, const int32_t* sums, int64_t m, int64_t panel, int64_t cols) const {
    if constexpr (RT > 0) {
      if (rows == RT) return gemm_i8::out_rows<RT, true>(sums, kT, *o, xo, m, panel * kT, cols, panel);
      tail<RT - 1>(rows, sums, m, panel, cols);
    }
  }
};

struct ToSums {
  int32_t* c;
  int64_t ldc;
  void operator()(const int32_t* sums, int64_t m, int64_t rows, int64_t panel, int64_t cols) const {
    for (int64_t r = 0; r < rows; ++r) {
      I16Pairs::store(c + (m + r) * ldc + panel * kT, I16Pairs::load_partial(sums + r * kT, kT), cols);
    }
  }
};

// Block b's sums (its tiles' steps, then the C tiles stored), then its outputs from them, 8 rows of
// one tile at a time, the H planes' sums added (256 times theirs, modulo 2^32). (The output pass run between the next block's tile steps, so that the vector units
// would make outputs while the tiles multiply, was no faster on an Intel Xeon with AMX: the vector
// multiply-adds and tdpbusd slowed each other, and both were done in the time of one after the other,
// within noise.)
template <class Sink>
inline void block(const Block& b, const Panels& ps, const Shape& s, const Sink& sink) {
  thread_local Sums sums;
  zero_c(b.rt, b.ct);
  for (int64_t j = 0, steps = steps_of(b, s); j < steps; ++j) tile_step(b, ps, s, j, sums.c[0]);
  if (b.h > 0) {
    store_c(b.rt, b.h, sums.c[1]);
  } else {
    store_c(b.rt, b.ct, sums.c[0]);
  }
  using P = I16Pairs;
  for (int rt = 0; rt < b.rt; ++rt) {
    const int64_t rows = std::min<int64_t>(kT, b.rows - rt * kT);
    for (int ct = 0; ct < b.h; ++ct) {
      int32_t* lo = sums.c[0][rt * 2 + ct];
      const int32_t* hi = sums.c[1][rt * 2 + ct];
      for (int64_t j = 0; j < rows * kT; j += kT) {
        P::store(lo + j, P::add(P::load_partial(lo + j, kT), P::shl8(P::load_partial(hi + j, kT))), kT);
      }
    }
    for (int ct = 0; ct < b.ct; ++ct) {
      const int64_t panel = b.p0 + ct;
      for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        sink(sums.c[0][rt * 2 + ct] + r0 * kT, b.m + rt * kT + r0, std::min<int64_t>(8, rows - r0), panel,
             std::min(kT, b.N - panel * kT));
      }
    }
  }
}

// Rows [m0, m0 + rows) of one product against its panels [p0, p0 + count), 32 rows at a time.
template <class Sink>
inline void task(const uint8_t* a, const Shape& s, const PairsProduct& pr, int64_t m0, int64_t rows, int64_t p0,
                 int count, Panels& ps, const Sink& sink) {
  start_panels(ps, pr.b, p0, count, s);
  for (int64_t m = 0; m < rows; m += 2 * kT) {
    Block b;
    b.a = a + (m0 + m) * s.Kp;
    b.m = m0 + m;
    b.rows = std::min(2 * kT, rows - m);
    b.p0 = p0;
    b.N = pr.N;
    b.rt = b.rows > kT ? 2 : 1;
    b.ct = count;
    b.h = ps.h;
    block(b, ps, s, sink);
  }
}

// One call: A packed (and gather(m0, m1) run on its rows) by all threads, then the tasks of every
// product; sink_of(product) gives the product's sink.
template <class SinkOf, class Gather>
inline void run(const uint8_t* A, int64_t M, int64_t K, int64_t lda, const PairsProduct* parts, int count,
                SinkOf sink_of, Gather gather) {
  const Shape s(K);
  const auto grid = gemm_i8::task_grid(
      parts, count, [](const PairsProduct& p) { return (p.M + kBlockRows - 1) / kBlockRows; },
      [](const PairsProduct& p) { return (p.N + 2 * kT - 1) / (2 * kT); });  // pairs of panels
  const int64_t tasks = grid.size();
  if (tasks == 0) return;
  const int64_t row_tiles = (M + kT - 1) / kT;
  thread_local std::vector<uint8_t> packed;  // 64 bytes more, for the rows to start on cache lines
  packed.resize(static_cast<size_t>(row_tiles * kT * s.Kp + 64));
  uint8_t* const a = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(packed.data()) + 63) & ~uintptr_t{63});
  const int threads = threads_for(2.0 * grid.macs(K), tasks);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < row_tiles; ++g) {
      for (int64_t m = g * kT; m < (g + 1) * kT; ++m) {
        uint8_t* dst = a + m * s.Kp;
        const int64_t n = m < M ? K : 0;
        if (n > 0) std::memcpy(dst, A + m * lda, static_cast<size_t>(n));
        std::memset(dst + n, 0, static_cast<size_t>(s.Kp - n));
      }
      gather(g * kT, std::min(M, (g + 1) * kT));
    }
    thread_local Panels panels;
    amx::configure_tiles();
#pragma omp for schedule(dynamic, 2)
    for (int64_t t = 0; t < tasks; ++t) {
      const auto at = grid[t];
      const PairsProduct& pr = at.pr;
      const int64_t m0 = at.block * kBlockRows, p0 = at.col * 2;
      const int n = static_cast<int>(std::min<int64_t>(2, (pr.N + kT - 1) / kT - p0));
      task(a, s, pr, m0, std::min(kBlockRows, pr.M - m0), p0, n, panels, sink_of(pr));
    }
    HEADS_TILE_RELEASE();
  }
  if (packed.size() > (size_t{1} << 24)) decltype(packed)().swap(packed);  // a thread keeps at most 16 MB
}

}  // namespace gemm_i8_amx

inline void gemm_u8s8_tiles(const uint8_t* A, int64_t M, int64_t K, int64_t lda, const PairsProduct* parts,
                            int count) {
  gemm_i8_amx::run(A, M, K, lda, parts, count,
                   [](const PairsProduct& pr) { return gemm_i8_amx::ToSums{pr.c, pr.ldc}; },
                   [](int64_t, int64_t) {});
}

inline void gemm_u8s8_tiles_out(const uint8_t* A, int64_t M, int64_t K, int64_t lda, const void* B, int64_t N,
                                const PairsOut& out) {
  const PairsProduct part{B, N, M, nullptr, 0};
  // The outlier channels' values, gathered once into rows of no (as gemm_u8s8_pairs_out does).
  thread_local std::vector<float> gathered;
  gathered.resize(static_cast<size_t>(M * out.no));
  float* const xo = gathered.data();
  gemm_i8_amx::run(A, M, K, lda, &part, 1,
                   [&out, xo](const PairsProduct&) { return gemm_i8_amx::ToOutput{&out, xo}; },
                   [&out, xo](int64_t m0, int64_t m1) {
                     for (int64_t m = m0; m < m1; ++m) {
                       for (int64_t c = 0; c < out.no; ++c) xo[m * out.no + c] = out.x[m * out.xs + out.oc[c]];
                     }
                   });
  if (gathered.size() > (size_t{1} << 20)) std::vector<float>().swap(gathered);  // at most 4 MB kept
}
