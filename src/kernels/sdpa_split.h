// sdpa_split.h — how the SDPA kernels cut a problem into tasks finer than (batch, head) when there
// are too few of those to feed many threads, and how the forward groups its query tiles. Each cut is a function of the problem's shape alone
// (never of the thread count), so results stay bitwise independent of the thread count; it changes
// only which partial sums are added in which order. Also the merge of normalized partial rows
// (merge_normalized_row) that the forward's key chunks and sdpa_merge_ share.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/sdpa_problem.h"
#include "kernels/simd/common.h"

namespace heads::kernels {

// Cut until (batch, kv head) pairs × pieces reach this: 16 threads get 2 tasks each, 32 get one.
constexpr int64_t kSplitTargetTasks = 32;

// Backward: at most Lk / kMinSplitKeys splits and kMaxKeySplits, cut on multiples of kKeySplitStep
// keys (half a key block: finer cuts balance causal work better; a split's key blocks start at its
// cut). Each split past the first holds a dQ-sized buffer of its own for the call: at most
// kMaxSplitBuffers of them, or more while they stay within kMaxSplitBytes together.
constexpr int64_t kMinSplitKeys = 256;
constexpr int64_t kMaxKeySplits = 8;
constexpr int64_t kKeySplitStep = 64;
constexpr int64_t kMaxSplitBuffers = 3;
constexpr int64_t kMaxSplitBytes = int64_t{64} << 20;

// Key split s covers keys [at[s], at[s + 1]) and carries work[s] visible (query, key) pairs of
// each query head (counted when the keys are cut); order[r] is the r-th heaviest split (ties by position), the order its tasks are
// handed out in, so that no heavy task starts last.
struct KeySplits {
  int64_t n = 1;
  std::array<int64_t, kMaxKeySplits + 1> at{};
  std::array<int64_t, kMaxKeySplits> work{};
  std::array<int64_t, kMaxKeySplits> order{};
};

// The backward's key splits of each (b, kv head), cut into about equal work: a key weighs the
// number of queries the band lets see it, so causal and sliding-window problems are not cut into
// equal key ranges (whose work differs up to 3x under a causal mask). Each cut is the step
// boundary nearest to its share of the work.
inline KeySplits backward_key_splits(const SdpaProblem& pb) {
  KeySplits ks;
  ks.at[1] = pb.Lk;
  const int64_t pairs = std::max<int64_t>(1, pb.B * pb.Hkv);
  const int64_t dq_bytes = 4 * pb.B * pb.H * pb.Lq * pb.D;
  const int64_t by_memory = 1 + std::max(kMaxSplitBuffers, kMaxSplitBytes / std::max<int64_t>(1, dq_bytes));
  const int64_t want =
      std::min({(kSplitTargetTasks + pairs - 1) / pairs, pb.Lk / kMinSplitKeys, kMaxKeySplits, by_memory});
  if (want <= 1) return ks;  // one split: its work is not counted (0)
  // Queries that see key j: +1 at each row's band start, -1 at its end.
  std::vector<int64_t> seen(static_cast<size_t>(pb.Lk + 1), 0);
  for (int64_t i = 0; i < pb.Lq; ++i) {
    const int64_t j0 = pb.key_begin(i), j1 = pb.key_end(i);
    if (j0 < j1) {
      ++seen[static_cast<size_t>(j0)];
      --seen[static_cast<size_t>(j1)];
    }
  }
  const int64_t n_steps = (pb.Lk + kKeySplitStep - 1) / kKeySplitStep;
  std::vector<int64_t> upto(static_cast<size_t>(n_steps + 1), 0);  // visible pairs of keys [0, k·step)
  int64_t rows = 0, total = 0;
  for (int64_t k = 0; k < n_steps; ++k) {
    for (int64_t j = k * kKeySplitStep; j < std::min(pb.Lk, (k + 1) * kKeySplitStep); ++j) {
      rows += seen[static_cast<size_t>(j)];
      total += rows;
    }
    upto[static_cast<size_t>(k + 1)] = total;
  }
  auto prefix = [&](int64_t key) { return key == pb.Lk ? total : upto[static_cast<size_t>(key / kKeySplitStep)]; };
  int64_t n = 0;
  if (total > 0) {
    int64_t k = 0;
    for (int64_t s = 1; s < want; ++s) {
      const int64_t goal = total * s;  // cut at the step whose prefix · want is nearest to this
      while (k < n_steps && upto[static_cast<size_t>(k)] * want < goal) ++k;
      // Candidates: steps k - 1 and k, each past the previous cut and before the end.
      const int64_t prev = ks.at[static_cast<size_t>(n)] / kKeySplitStep;
      const bool lo_ok = k - 1 > prev, hi_ok = k < n_steps && k > prev;
      int64_t cut = -1;
      if (lo_ok && hi_ok) {
        cut = goal - upto[static_cast<size_t>(k - 1)] * want < upto[static_cast<size_t>(k)] * want - goal ? k - 1 : k;
      } else if (lo_ok || hi_ok) {
        cut = lo_ok ? k - 1 : k;
      }
      if (cut > 0) ks.at[static_cast<size_t>(++n)] = cut * kKeySplitStep;
    }
  }
  ks.n = n + 1;
  ks.at[static_cast<size_t>(ks.n)] = pb.Lk;
  for (int64_t s = 0; s < ks.n; ++s) {
    ks.work[static_cast<size_t>(s)] = prefix(ks.at[static_cast<size_t>(s + 1)]) - prefix(ks.at[static_cast<size_t>(s)]);
    ks.order[static_cast<size_t>(s)] = s;
  }
  std::stable_sort(ks.order.begin(), ks.order.begin() + ks.n,
                   [&](int64_t a, int64_t b) { return ks.work[static_cast<size_t>(a)] > ks.work[static_cast<size_t>(b)]; });
  return ks;
}

// Decode (few queries, many keys): at most about Lk / kMinDecodeChunk chunks, each a multiple of
// `block` keys, whose partial softmax states are merged after (flash-decoding).
constexpr int64_t kMinDecodeChunk = 512;

struct DecodeChunks {
  int64_t chunk, n;  // keys per chunk, chunks per (b, kv head)
};

inline DecodeChunks decode_key_chunks(const SdpaProblem& pb, int64_t block) {
  const int64_t pairs = std::max<int64_t>(1, pb.B * pb.Hkv);
  int64_t n = 1;
  if (pairs < kSplitTargetTasks && pb.Lk > kMinDecodeChunk) {
    n = std::min((kSplitTargetTasks + pairs - 1) / pairs, (pb.Lk + kMinDecodeChunk - 1) / kMinDecodeChunk);
  }
  const int64_t per = (pb.Lk + n - 1) / n;
  const int64_t chunk = std::max<int64_t>(1, (per + block - 1) / block) * block;
  return {chunk, std::max<int64_t>(1, (pb.Lk + chunk - 1) / chunk)};
}

// Forward: query tiles of tile_rows queries that sweep the keys together (fwd::forward_tiles), so
// that a key block read from memory serves the whole group from cache. One while a head's K and V
// fit in kCachedKvBytes (half of a modest L2: they stay cached from one tile to the next anyway)
// or a left window gives each tile its own first key; else up to kMaxSweepTiles, as long as that
// leaves at least kSweepTasksPerThread tasks with work per thread (tiles whose rows see no key,
// as under a bottom-right causal mask with Lq > Lk, do not count). The grouping only changes the
// order in which tiles run, never their arithmetic, so it may depend on the thread count: the
// result does not.
constexpr int64_t kMaxSweepTiles = 4;
constexpr int64_t kCachedKvBytes = int64_t{256} << 10;
constexpr int64_t kSweepTasksPerThread = 8;

inline int64_t forward_tiles_per_sweep(const SdpaProblem& pb, int64_t tile_rows, int64_t elem_bytes, int threads) {
  const int64_t kv_bytes = pb.Lk * (pb.D + pb.Dv) * elem_bytes;
  if (pb.has_left || kv_bytes <= kCachedKvBytes || pb.Lq <= tile_rows) return 1;
  // Tiles with work sit at the end (bands only grow with the query index): count from the first.
  const int64_t n_tiles = (pb.Lq + tile_rows - 1) / tile_rows;
  int64_t idle = 0;
  while (idle < n_tiles && pb.key_end(std::min(pb.Lq, (idle + 1) * tile_rows) - 1) <= 0) ++idle;
  const int64_t busy = n_tiles - idle;
  const int64_t want = kSweepTasksPerThread * std::max(1, threads);
  int64_t g = std::clamp<int64_t>(busy, 1, kMaxSweepTiles);
  while (g > 1 && pb.B * pb.H * ((busy + g - 1) / g) < want) --g;
  return g;
}

// Forward (tiled kernel): when the (batch, head, query tile) tasks are too few to feed many threads
// (fewer than kSplitTargetTasks) and the keys are long, the keys are also cut into chunks: at most
// kMaxForwardChunks, of at least kMinForwardChunk keys, each a multiple of `block` keys. A chunk's
// task leaves a normalized partial output and its lse, merged after in chunk order (as
// sdpa_merge_ merges two); weights asked for are then written tile by tile from the merged lse.
// A function of the shape alone, like the cuts above.
constexpr int64_t kMinForwardChunk = 512;
constexpr int64_t kMaxForwardChunks = 8;

struct ForwardKeyChunks {
  int64_t chunk, n;  // keys per chunk, chunks per (b, head, query tile)
};

inline ForwardKeyChunks forward_key_chunks(const SdpaProblem& pb, int64_t tile_rows, int64_t block) {
  const int64_t tasks = std::max<int64_t>(1, pb.B * pb.H * ((pb.Lq + tile_rows - 1) / tile_rows));
  int64_t n = 1;
  if (tasks < kSplitTargetTasks && pb.Lk >= 2 * kMinForwardChunk) {
    n = std::min({(kSplitTargetTasks + tasks - 1) / tasks, pb.Lk / kMinForwardChunk, kMaxForwardChunks});
  }
  const int64_t per = (pb.Lk + n - 1) / n;
  const int64_t chunk = std::max<int64_t>(1, (per + block - 1) / block) * block;
  return {chunk, std::max<int64_t>(1, (pb.Lk + chunk - 1) / chunk)};
}

// One query row from n normalized partial results of disjoint key sets: part c has the output row
// o(c) (Dv floats) and the log-sum-exp l(c) of its scores (natural log). The row is
//   out = sum_c e^(l_c - M) o_c / sum_c e^(l_c - M),   lse = M + ln(sum_c e^(l_c - M)),   M = max_c l_c,
// summed part by part in order c = 0, 1, ..., so a row's bits depend on its parts alone. A part that
// saw no key (l = -inf) adds nothing; a row no part saw gives zeros and returns -inf; a NaN l makes
// the row NaN. store(d0, vals, nd) receives columns [d0, d0 + nd) when all parts have been read for
// them, so out may be one of the parts (sdpa_merge_ merges into its first operand). Used by the
// forward's key chunks (merge_key_chunks) and by sdpa_merge_.
constexpr int64_t kMergeColumns = 64;  // columns summed at a time (a stack buffer)

// (always inlined: compiled for the caller's ISA, as the code it replaced was)
template <class PartRow, class PartLse, class Store>
HEADS_INLINE float merge_normalized_row(int64_t n, PartRow o, PartLse l, int64_t Dv, Store store) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float m = kNegInf;
  bool nan = false;
  for (int64_t c = 0; c < n; ++c) {
    nan = nan || std::isnan(l(c));
    m = std::max(m, l(c));
  }
  const bool live = !nan && m != kNegInf;
  float sum = 0.0f;
  for (int64_t c = 0; live && c < n; ++c) sum += std::exp(l(c) - m);
  const float inv = nan ? std::numeric_limits<float>::quiet_NaN() : sum > 0.0f ? 1.0f / sum : 0.0f;
  float acc[kMergeColumns];
  for (int64_t d0 = 0; d0 < Dv; d0 += kMergeColumns) {
    const int64_t nd = std::min(Dv - d0, kMergeColumns);
    std::fill(acc, acc + nd, 0.0f);
    for (int64_t c = 0; live && c < n; ++c) {
      const float w = std::exp(l(c) - m);  // 0 for a part that saw nothing
      if (w == 0.0f) continue;
      const float* pr = o(c) + d0;
      for (int64_t d = 0; d < nd; ++d) acc[d] += w * pr[d];
    }
    for (int64_t d = 0; d < nd; ++d) acc[d] *= inv;
    store(d0, acc, nd);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m == kNegInf ? kNegInf : m + std::log(sum);
}

}  // namespace heads::kernels
