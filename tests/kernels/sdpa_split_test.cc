// sdpa_split_test.cc — the work split of the SDPA backward, decode and forward kernels on many threads, by
// model: each task's work counted in visible (query, key) pairs (not modelled: tile granularity, the
// packing each split repeats, the dQ reduction), handed out in the kernels' task order to
// the first free thread as `schedule(dynamic, 1)` does, and the resulting makespan compared with a
// perfect split. The machines the tests run on have few cores; this is how a split that leaves
// most of 16 threads idle (8 tasks for 16 threads) shows up. Correctness of the split kernels is in
// sdpa_bwd_test.cc and sdpa_variants_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "heads/sdpa.h"
#include "kernels/sdpa_problem.h"
#include "kernels/sdpa_split.h"

namespace heads {
namespace {

using kernels::SdpaProblem;

struct Shape {
  std::string name;
  int64_t B, H, Hkv, Lq, Lk, D;
  bool causal;
  int64_t window_left = -1;  // sliding window (keys at most this far left of the diagonal)
  bool top_left = false;     // causal alignment (default: bottom-right)
};

// bench/shapes.json, and GQA prefill and decode as Llama-class models run them.
std::vector<Shape> split_shapes() {
  return {{"bert128", 8, 12, 12, 128, 128, 64, false}, {"bert512", 2, 12, 12, 512, 512, 64, false},
          {"gpt2k", 1, 16, 16, 2048, 2048, 64, true},  {"long4k", 1, 8, 8, 4096, 4096, 128, false},
          {"decode4k", 1, 32, 32, 1, 4096, 128, false}, {"gqa-prefill2k", 1, 32, 8, 2048, 2048, 128, true},
          {"gqa-decode8k", 1, 32, 8, 1, 8192, 128, false}, {"gqa-decode8k-b2", 2, 32, 8, 4, 8192, 128, false}};
}

// Other bands for the cut's invariants: windows, top-left causal with Lq != Lk, Lq > Lk, a short tail.
std::vector<Shape> band_shapes() {
  return {{"window256", 1, 8, 8, 4096, 4096, 64, true, 255},
          {"window64-bidirectional", 2, 4, 4, 1000, 1000, 64, false, 63},
          {"top-left-Lq<Lk", 1, 4, 4, 700, 3000, 64, true, -1, true},
          {"top-left-Lq>Lk", 1, 4, 4, 3000, 700, 64, true, -1, true},
          {"bottom-right-Lq>Lk", 1, 4, 2, 3000, 700, 64, true},
          {"ragged", 1, 2, 1, 50, 1537, 32, false},
          {"huge-dq", 1, 32, 4, 32768, 32768, 128, false}};
}

SdpaProblem problem(const Shape& s) {
  // Views with zero strides: the shapes are checked, no memory of their size is needed.
  const Tensor one = Tensor::zeros({1}, DType::F32);
  auto view = [&](int64_t b, int64_t h, int64_t l) { return one.as_strided({b, h, l, s.D}, {0, 0, 0, 0}); };
  SdpaOptions o;
  o.is_causal = s.causal;
  o.causal_align = s.top_left ? CausalAlign::TopLeft : CausalAlign::BottomRight;
  if (s.window_left >= 0) o.window_left = s.window_left;
  o.enable_gqa = s.H != s.Hkv;
  return kernels::make_sdpa_problem("sdpa", view(s.B, s.H, s.Lq), view(s.B, s.Hkv, s.Lk), view(s.B, s.Hkv, s.Lk), o);
}

// Visible (query, key) pairs of one query head with keys [j0, j1).
double pairs(const SdpaProblem& pb, int64_t j0, int64_t j1) {
  double n = 0;
  for (int64_t i = 0; i < pb.Lq; ++i) n += static_cast<double>(std::max<int64_t>(0, std::min(j1, pb.key_end(i)) - std::max(j0, pb.key_begin(i))));
  return n;
}

// Work done / (threads × the time the last thread finishes): tasks taken in index order, each by
// the thread that is free first.
double efficiency(const std::vector<double>& work, int threads) {
  std::vector<double> busy(static_cast<size_t>(threads), 0.0);
  double total = 0;
  for (double w : work) {
    *std::min_element(busy.begin(), busy.end()) += w;
    total += w;
  }
  return total / (threads * *std::max_element(busy.begin(), busy.end()));
}

// The backward's tasks: (key split, b, kv head), the splits in their order (heaviest first); a task
// runs every query head of its kv head's group.
std::vector<double> backward_tasks(const SdpaProblem& pb) {
  const kernels::KeySplits ks = kernels::backward_key_splits(pb);
  std::vector<double> work;
  for (int64_t r = 0; r < ks.n; ++r) {
    const int64_t s = ks.order[r];
    for (int64_t p = 0; p < pb.B * pb.Hkv; ++p) work.push_back(pb.group() * pairs(pb, ks.at[s], ks.at[s + 1]));
  }
  return work;
}

// The decode kernel's tasks: (b, kv head, key chunk).
std::vector<double> decode_tasks(const SdpaProblem& pb) {
  const kernels::DecodeChunks dc = kernels::decode_key_chunks(pb, 64);
  std::vector<double> work;
  for (int64_t p = 0; p < pb.B * pb.Hkv; ++p) {
    for (int64_t c = 0; c < dc.n; ++c) {
      work.push_back(pb.group() * pairs(pb, c * dc.chunk, std::min(pb.Lk, (c + 1) * dc.chunk)));
    }
  }
  return work;
}

TEST(SdpaSplit, BackwardKeySplitsCoverTheKeys) {
  std::vector<Shape> all = split_shapes();
  for (const Shape& s : band_shapes()) all.push_back(s);
  for (const Shape& s : all) {
    const SdpaProblem pb = problem(s);
    const kernels::KeySplits ks = kernels::backward_key_splits(pb);
    ASSERT_GE(ks.n, 1);
    ASSERT_LE(ks.n, kernels::kMaxKeySplits);
    EXPECT_EQ(ks.at[0], 0) << s.name;
    EXPECT_EQ(ks.at[ks.n], s.Lk) << s.name;
    std::vector<int64_t> order(ks.order.begin(), ks.order.begin() + ks.n);
    std::sort(order.begin(), order.end());
    for (int64_t i = 0; i < ks.n; ++i) {
      EXPECT_LT(ks.at[i], ks.at[i + 1]) << s.name;
      EXPECT_EQ(ks.at[i] % kernels::kKeySplitStep, 0) << s.name;
      if (ks.n > 1) EXPECT_EQ(ks.work[i], pairs(pb, ks.at[i], ks.at[i + 1])) << s.name << " split " << i;
      EXPECT_EQ(order[i], i) << s.name;  // every split once
      if (i > 0) EXPECT_GE(ks.work[ks.order[i - 1]], ks.work[ks.order[i]]) << s.name;
    }
    // Few pairs and long keys: cut; many pairs: left whole (the results of such shapes unchanged).
    const int64_t dq_bytes = 4 * s.B * s.H * s.Lq * s.D;
    const int64_t most = std::min(kernels::kMaxKeySplits, s.Lk / kernels::kMinSplitKeys);
    EXPECT_EQ(ks.n > 1, s.B * s.Hkv < kernels::kSplitTargetTasks && most > 1) << s.name;
    EXPECT_LE(ks.n, std::max<int64_t>(1, most)) << s.name;
    // The buffers of the splits past the first: at most kMaxSplitBuffers, or within kMaxSplitBytes.
    EXPECT_TRUE(ks.n - 1 <= kernels::kMaxSplitBuffers || (ks.n - 1) * dq_bytes <= kernels::kMaxSplitBytes) << s.name;
  }
}

TEST(SdpaSplit, BackwardCausalSplitsCarryAboutEqualWork) {
  // gpt2k: cut into equal key ranges, the first would carry 3x the second's work.
  for (const Shape& s : split_shapes()) {
    const SdpaProblem pb = problem(s);
    const kernels::KeySplits ks = kernels::backward_key_splits(pb);
    if (ks.n == 1) continue;
    std::vector<double> w;
    for (int64_t i = 0; i < ks.n; ++i) w.push_back(pairs(pb, ks.at[i], ks.at[i + 1]));
    const double mean = pairs(pb, 0, s.Lk) / static_cast<double>(ks.n);
    EXPECT_LT(*std::max_element(w.begin(), w.end()), 1.15 * mean) << s.name;
  }
}

TEST(SdpaSplit, BackwardAndDecodeFeedSixteenThreads) {
  std::ostringstream table;
  table << "modelled parallel efficiency (threads 2 / 4 / 8 / 16 / 32 / 64):\n";
  for (const Shape& s : split_shapes()) {
    const SdpaProblem pb = problem(s);
    const bool decode = s.Lq <= 4;
    const std::vector<double> work = decode ? decode_tasks(pb) : backward_tasks(pb);
    table << "  " << s.name << (decode ? " decode forward" : " backward") << ", " << work.size() << " tasks:";
    for (int threads : {2, 4, 8, 16, 32, 64}) {
      const double e = efficiency(work, threads);
      table << " " << e;
      if (threads <= 16) EXPECT_GE(e, 0.9) << s.name << " threads=" << threads;
    }
    table << "\n";
    if (decode) {
      const std::vector<double> bwd = backward_tasks(pb);  // the decode step's backward (training on one token)
      table << "  " << s.name << " backward, " << bwd.size() << " tasks: " << efficiency(bwd, 16) << " on 16\n";
    }
  }
  std::cout << table.str();
}

// The forward's query tiles per key sweep: groups form only where a head's K and V outgrow the cache
// budget and no left window is set, and they never leave 2 to 16 threads with too few tasks
// (modelled as above, a group's work being its queries' visible pairs).
TEST(SdpaSplit, ForwardGroupsTilesOnlyForLongKeys) {
  std::vector<Shape> all = split_shapes();
  for (const Shape& s : band_shapes()) all.push_back(s);
  bool grouped = false;
  for (const Shape& s : all) {
    const SdpaProblem pb = problem(s);
    const int64_t kv_bytes = 4 * pb.Lk * (pb.D + pb.Dv);
    for (int64_t tile : {16, 32}) {  // queries per tile: AVX2, AVX-512
      const int64_t n_qt = (pb.Lq + tile - 1) / tile;
      for (int threads : {1, 2, 4, 8, 16, 64}) {
        const int64_t g = kernels::forward_tiles_per_sweep(pb, tile, 4, threads);
        const std::string where = s.name + " tile=" + std::to_string(tile) + " threads=" + std::to_string(threads);
        ASSERT_GE(g, 1) << where;
        ASSERT_LE(g, std::min(kernels::kMaxSweepTiles, n_qt)) << where;
        if (g == 1) continue;
        grouped = true;
        EXPECT_GT(kv_bytes, kernels::kCachedKvBytes) << where;
        EXPECT_FALSE(pb.has_left) << where;
        if (threads < 2 || threads > 16) continue;
        // Tasks of g tiles each: heads in order, a head's heaviest group first (as the kernel).
        auto tasks = [&](int64_t per) {
          const int64_t groups = (n_qt + per - 1) / per;
          std::vector<double> work;
          for (int64_t bh = 0; bh < pb.B * pb.H; ++bh) {
            for (int64_t r = 0; r < groups; ++r) {
              const int64_t grp = pb.causal ? groups - 1 - r : r;
              double w = 0;
              for (int64_t i = grp * per * tile; i < std::min(pb.Lq, (grp + 1) * per * tile); ++i) {
                w += static_cast<double>(std::max<int64_t>(0, pb.key_end(i) - pb.key_begin(i)));
              }
              work.push_back(w);
            }
          }
          return work;
        };
        const double e = efficiency(tasks(g), threads), e1 = efficiency(tasks(1), threads);
        std::cout << where << ": " << g << " tiles per sweep, efficiency " << e << " (one tile per task: " << e1 << ")\n";
        EXPECT_GE(e, 0.9) << where;
      }
    }
  }
  EXPECT_TRUE(grouped);  // long4k and gpt2k group on every thread count up to 16
  EXPECT_EQ(kernels::forward_tiles_per_sweep(problem(split_shapes()[3]), 16, 4, 2), kernels::kMaxSweepTiles);  // long4k
  EXPECT_EQ(kernels::forward_tiles_per_sweep(problem(split_shapes()[0]), 16, 4, 2), 1);  // bert128: 64 KB of K and V
}

// A few query rows against long keys (a chunk of a long prompt, speculative decoding, one head):
// the forward's (batch, head, query tile) tasks are too few, and its key chunks make up for them.
TEST(SdpaSplit, ForwardKeyChunksFeedSixteenThreads) {
  const std::vector<Shape> few = {{"prefill-chunk16", 1, 8, 2, 16, 16384, 128, true},
                                  {"speculative8", 1, 32, 8, 8, 8192, 128, true},
                                  {"one-head", 1, 1, 1, 16, 16384, 128, false},
                                  {"four-heads-64q", 1, 4, 4, 64, 8192, 64, false},
                                  {"short-keys", 1, 2, 2, 16, 900, 64, false}};
  std::vector<Shape> all = few;
  for (const Shape& s : split_shapes()) all.push_back(s);
  for (const Shape& s : all) {
    const SdpaProblem pb = problem(s);
    for (int64_t tile : {16, 32}) {
      const kernels::ForwardKeyChunks kc = kernels::forward_key_chunks(pb, tile, 128);
      const int64_t n_qt = (pb.Lq + tile - 1) / tile, tasks = pb.B * pb.H * n_qt;
      const std::string where = s.name + " tile=" + std::to_string(tile);
      ASSERT_GE(kc.n, 1) << where;
      ASSERT_LE(kc.n, kernels::kMaxForwardChunks) << where;
      ASSERT_EQ(kc.chunk % 128, 0) << where;
      ASSERT_GE(kc.n * kc.chunk, pb.Lk) << where;          // the chunks cover the keys
      ASSERT_LT((kc.n - 1) * kc.chunk, pb.Lk) << where;    // and none is empty
      if (tasks >= kernels::kSplitTargetTasks || pb.Lk < 2 * kernels::kMinForwardChunk) {
        EXPECT_EQ(kc.n, 1) << where;  // enough tasks, or keys too short to cut
        continue;
      }
      EXPECT_GT(kc.n, 1) << where;
      // Tasks as the kernel hands them out: (b, h, tile), chunks innermost.
      auto work = [&](int64_t n, int64_t chunk) {
        std::vector<double> w;
        for (int64_t t = 0; t < tasks; ++t) {
          for (int64_t c = 0; c < n; ++c) {
            double x = 0;
            for (int64_t i = t % n_qt * tile; i < std::min(pb.Lq, (t % n_qt + 1) * tile); ++i) {
              x += static_cast<double>(std::max<int64_t>(
                  0, std::min(std::min(pb.Lk, (c + 1) * chunk), pb.key_end(i)) - std::max(c * chunk, pb.key_begin(i))));
            }
            w.push_back(x);
          }
        }
        return w;
      };
      const double e = efficiency(work(kc.n, kc.chunk), 16), e1 = efficiency(work(1, pb.Lk), 16);
      std::cout << where << ": " << kc.n << " chunks of " << kc.chunk << " keys, efficiency on 16 threads " << e
                << " (uncut: " << e1 << ")\n";
      // As good as the chunk cap allows: tasks × chunks of about equal work over 16 threads.
      EXPECT_GE(e, 0.9 * std::min(1.0, static_cast<double>(tasks * kc.n) / 16)) << where;
      EXPECT_GE(e, e1) << where;
    }
  }
}

}  // namespace
}  // namespace heads
