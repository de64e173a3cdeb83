// length_batches.h — the batching of the encoders' inputs (SentenceEncoder, CrossEncoder): sequences
// sorted longest first and cut into batches of at most `batch_size` sequences and about
// kTokenBudget padded tokens, so each batch pads only to its own longest and its activations stay
// cache-sized whatever the lengths.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace heads::models {

// Padded tokens per batch. Measured on bench/sentences.txt (2 threads): 512 → 585 sentences/s,
// 2048 → 508, 4096 → 485; a fixed 32 texts per batch → 520.
constexpr int64_t kTokenBudget = 512;

// Calls run(indices, done) for each batch: indices into `lengths` (the sequences' token counts),
// longest batch first, ties in input order; done counts the sequences run so far, this batch's included.
template <class Run>
void for_each_length_batch(const std::vector<int64_t>& lengths, int64_t batch_size, Run&& run) {
  const auto N = static_cast<int64_t>(lengths.size());
  std::vector<int64_t> order(static_cast<size_t>(N));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return lengths[static_cast<size_t>(a)] > lengths[static_cast<size_t>(b)];
  });
  std::vector<int64_t> batch;
  for (int64_t b0 = 0, nb = 0; b0 < N; b0 += nb) {
    const int64_t longest = lengths[static_cast<size_t>(order[static_cast<size_t>(b0)])];
    nb = std::clamp<int64_t>(kTokenBudget / std::max<int64_t>(longest, 1), 1, std::min(batch_size, N - b0));
    batch.assign(order.begin() + b0, order.begin() + b0 + nb);
    run(static_cast<const std::vector<int64_t>&>(batch), b0 + nb);
  }
}

}  // namespace heads::models
