// study.h — what `heads study` measures: small causal language models (heads::TinyCausalLM) trained
// from scratch on synthetic tasks that need long-range attention, one attention mechanism or head
// count each; held-out accuracy, training time and inference speed.
//
// Tasks (sequences of seq_len tokens; the model reads them causally and is scored only where the
// next token is determined by earlier ones):
//   copy:   x_1..x_m SEP x_1..x_m with m = (seq_len - 1) / 2 random symbols of `vocab`: the second copy
//           is scored, each token m positions after its source.
//   recall: multi-query associative recall: P key-value pairs k v (distinct keys out of max(vocab, P),
//           values out of `vocab`), then Q = seq_len / 16 queries, each a key seen before followed by its
//           value (scored). P = seq_len / 2 - Q.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "heads/mha.h"
#include "heads/tensor.h"

namespace heads {

enum class StudyTask { Copy, Recall };
StudyTask study_task_from_name(const std::string& name);  // "copy", "recall"
std::string study_task_name(StudyTask t);

struct StudyConfig {
  StudyTask task = StudyTask::Copy;
  int64_t seq_len = 128;
  int64_t vocab = 16;
  int64_t d_model = 64, nhead = 4, num_layers = 2, dim_feedforward = 128;
  AttentionVariant attention;
  int64_t batch = 32, steps = 300, warmup = 30, eval_size = 256;
  double lr = 3e-3;
  uint64_t seed = 0;
};

// Token ids [count, seq_len] (i64) and the next-token targets [count · seq_len] (-100 where not
// scored), drawn from `gen`.
struct StudyBatch {
  Tensor ids, targets;
};
StudyBatch make_study_batch(const StudyConfig& c, int64_t count, std::mt19937_64& gen);
int64_t study_vocab_size(const StudyConfig& c);  // the model's vocabulary (symbols and separators)

struct StudyResult {
  int64_t parameters = 0;
  double train_seconds = 0;
  double final_loss = 0;         // mean cross-entropy over the last tenth of the steps
  double token_accuracy = 0;     // held-out: argmax of every scored position (teacher forcing)
  double sequence_accuracy = 0;  // held-out: every scored position of a sequence right
  double chance = 0;             // token accuracy of guessing
  double infer_samples_per_s = 0;  // forward passes over held-out sequences (eval mode)
  std::vector<double> curve_seconds, curve_accuracy;  // held-out token accuracy during training
};

// Trains one model (AdamW, linear warmup then cosine decay) and measures it. Deterministic for a
// given config (up to floating-point reduction order across thread counts).
StudyResult run_study(const StudyConfig& c);

}  // namespace heads
