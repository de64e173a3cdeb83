// study.cc — the tasks, training loop and measurements of include/heads/study.h.
#include "heads/study.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "heads/error.h"
#include "heads/ops.h"
#include "heads/optim.h"
#include "heads/runtime.h"
#include "heads/tiny_lm.h"

namespace heads {

namespace {

constexpr int64_t kIgnore = -100;  // cross_entropy's ignore_index

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void check_config(const StudyConfig& c) {
  HEADS_CHECK(c.seq_len >= 16 && c.seq_len <= (int64_t{1} << 20), "study: seq_len must be in [16, 2^20], got ", c.seq_len);
  HEADS_CHECK(c.vocab >= 2 && c.vocab <= (int64_t{1} << 20), "study: vocab must be in [2, 2^20], got ", c.vocab);
  HEADS_CHECK(c.batch >= 1 && c.steps >= 1 && c.eval_size >= 1 && c.warmup >= 0, "study: batch, steps and eval_size must be "
              "positive and warmup >= 0, got ", c.batch, ", ", c.steps, ", ", c.eval_size, ", ", c.warmup);
  HEADS_CHECK(c.lr > 0 && std::isfinite(c.lr), "study: lr must be positive, got ", c.lr);
}

// Recall's sizes: pairs P, queries Q, key symbols K.
struct RecallSizes {
  int64_t P, Q, K;
};
RecallSizes recall_sizes(const StudyConfig& c) {
  const int64_t Q = std::max<int64_t>(1, c.seq_len / 16), P = c.seq_len / 2 - Q;
  return {P, Q, std::max(c.vocab, P)};
}

}  // namespace

StudyTask study_task_from_name(const std::string& name) {
  if (name == "copy") return StudyTask::Copy;
  if (name == "recall") return StudyTask::Recall;
  fail("study: task must be \"copy\" or \"recall\", got \"", name, "\"");
}

std::string study_task_name(StudyTask t) { return t == StudyTask::Copy ? "copy" : "recall"; }

int64_t study_vocab_size(const StudyConfig& c) {
  if (c.task == StudyTask::Copy) return c.vocab + 1;  // symbols and SEP
  const RecallSizes r = recall_sizes(c);
  return r.K + c.vocab + 1;  // keys, values, padding
}

StudyBatch make_study_batch(const StudyConfig& c, int64_t count, std::mt19937_64& gen) {
  check_config(c);
  const int64_t T = c.seq_len;
  StudyBatch b{Tensor::empty({count, T}, DType::I64), Tensor::empty({count * T}, DType::I64)};
  int64_t* ids = b.ids.data<int64_t>();
  int64_t* tg = b.targets.data<int64_t>();
  std::fill(tg, tg + count * T, kIgnore);
  if (c.task == StudyTask::Copy) {
    const int64_t m = (T - 1) / 2, sep = c.vocab;
    std::uniform_int_distribution<int64_t> sym(0, c.vocab - 1);
    for (int64_t n = 0; n < count; ++n) {
      int64_t* s = ids + n * T;
      for (int64_t i = 0; i < m; ++i) s[i] = sym(gen);
      s[m] = sep;
      for (int64_t i = 0; i < m; ++i) s[m + 1 + i] = s[i];
      for (int64_t i = 2 * m + 1; i < T; ++i) s[i] = sep;  // an even length leaves one unscored SEP
      // position p predicts token p + 1: the copy's tokens m + 1 .. 2m
      for (int64_t p = m; p < 2 * m; ++p) tg[n * T + p] = s[p + 1];
    }
  } else {
    const RecallSizes r = recall_sizes(c);
    const int64_t pad = r.K + c.vocab;
    std::vector<int64_t> keys(static_cast<size_t>(r.K));
    std::uniform_int_distribution<int64_t> val(0, c.vocab - 1), pick(0, r.P - 1);
    for (int64_t n = 0; n < count; ++n) {
      int64_t* s = ids + n * T;
      std::iota(keys.begin(), keys.end(), 0);
      for (int64_t i = 0; i < r.P; ++i) {  // the first P of a partial shuffle: distinct keys
        std::uniform_int_distribution<int64_t> rest(i, r.K - 1);
        std::swap(keys[static_cast<size_t>(i)], keys[static_cast<size_t>(rest(gen))]);
      }
      std::vector<int64_t> values(static_cast<size_t>(r.P));
      for (int64_t i = 0; i < r.P; ++i) {
        values[static_cast<size_t>(i)] = r.K + val(gen);
        s[2 * i] = keys[static_cast<size_t>(i)];
        s[2 * i + 1] = values[static_cast<size_t>(i)];
      }
      for (int64_t q = 0; q < r.Q; ++q) {
        const int64_t i = pick(gen), p = 2 * r.P + 2 * q;
        s[p] = keys[static_cast<size_t>(i)];
        s[p + 1] = values[static_cast<size_t>(i)];
        tg[n * T + p] = s[p + 1];
      }
      for (int64_t p = 2 * (r.P + r.Q); p < T; ++p) s[p] = pad;
    }
  }
  return b;
}

namespace {

struct Scores {
  double token = 0, sequence = 0;
};

// Teacher-forced argmax accuracy on the scored positions, in batches of `batch`.
Scores evaluate(const TinyCausalLM& model, const StudyBatch& data, int64_t batch) {
  const int64_t count = data.ids.size(0), T = data.ids.size(1), V = model.options().vocab;
  int64_t right = 0, scored = 0, seq_right = 0;
  for (int64_t b0 = 0; b0 < count; b0 += batch) {
    const int64_t nb = std::min(batch, count - b0);
    const Tensor logits = model.forward(data.ids.slice(0, b0, b0 + nb).contiguous());  // [nb·T, V]
    for (int64_t n = 0; n < nb; ++n) {
      bool all = true;
      for (int64_t p = 0; p < T; ++p) {
        const int64_t want = data.targets.data<int64_t>()[(b0 + n) * T + p];
        if (want == kIgnore) continue;
        const float* row = logits.data<float>() + (n * T + p) * V;
        const int64_t best = std::max_element(row, row + V) - row;
        right += best == want;
        ++scored;
        all = all && best == want;
      }
      seq_right += all;
    }
  }
  return {static_cast<double>(right) / static_cast<double>(std::max<int64_t>(scored, 1)),
          static_cast<double>(seq_right) / static_cast<double>(count)};
}

}  // namespace

StudyResult run_study(const StudyConfig& c) {
  check_config(c);
  TinyLMOptions o;
  o.vocab = study_vocab_size(c);
  o.max_len = c.seq_len;
  o.d_model = c.d_model;
  o.nhead = c.nhead;
  o.dim_feedforward = c.dim_feedforward;
  o.num_layers = c.num_layers;
  o.attention = c.attention;
  TinyCausalLM model(o, c.seed);
  model.train(true);
  AdamWOptions ao;
  ao.lr = c.lr;
  ao.beta2 = 0.98;
  ao.weight_decay = 0.01;
  AdamW opt(model.state_dict(), ao);

  StudyResult r;
  for (const auto& [n, t] : model.state_dict()) r.parameters += t.numel();
  r.chance = 1.0 / static_cast<double>(c.vocab);
  std::mt19937_64 train_gen(c.seed * 2 + 1), eval_gen(c.seed * 2 + 2);
  const StudyBatch held_out = make_study_batch(c, c.eval_size, eval_gen);
  StudyBatch curve_set = make_study_batch(c, std::min<int64_t>(c.eval_size, 64), eval_gen);
  const int64_t curve_every = std::max<int64_t>(1, c.steps / 10);
  double loss_sum = 0;
  int64_t loss_n = 0;
  const int64_t tail = std::max<int64_t>(1, c.steps / 10);
  for (int64_t step = 1; step <= c.steps; ++step) {
    const StudyBatch b = make_study_batch(c, c.batch, train_gen);
    const auto t0 = Clock::now();
    // Linear warmup, then cosine decay to a tenth.
    const double s = static_cast<double>(step);
    double lr = c.lr;
    if (step <= c.warmup) {
      lr *= s / static_cast<double>(std::max<int64_t>(c.warmup, 1));
    } else {
      const double t = (s - static_cast<double>(c.warmup)) / static_cast<double>(std::max<int64_t>(c.steps - c.warmup, 1));
      lr *= 0.1 + 0.9 * 0.5 * (1.0 + std::cos(3.141592653589793 * t));
    }
    opt.set_lr(lr);
    TinyCausalLM::Tape tape;
    const Tensor logits = model.forward(b.ids, &tape);
    const double loss = cross_entropy(logits, b.targets, kIgnore);
    HEADS_CHECK(std::isfinite(loss), "study: the loss became ", loss, " at step ", step);
    opt.step(model.backward(tape, cross_entropy_backward(logits, b.targets, kIgnore)));
    r.train_seconds += seconds_since(t0);
    if (step > c.steps - tail) {
      loss_sum += loss;
      ++loss_n;
    }
    if (step % curve_every == 0 || step == c.steps) {  // not timed
      model.train(false);
      r.curve_seconds.push_back(r.train_seconds);
      r.curve_accuracy.push_back(evaluate(model, curve_set, c.batch).token);
      model.train(true);
    }
  }
  r.final_loss = loss_sum / static_cast<double>(std::max<int64_t>(loss_n, 1));
  model.train(false);
  const Scores sc = evaluate(model, held_out, c.batch);
  r.token_accuracy = sc.token;
  r.sequence_accuracy = sc.sequence;
  // Inference: forwards over the held-out set, the median of three passes.
  std::vector<double> rates;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    for (int64_t b0 = 0; b0 < c.eval_size; b0 += c.batch) {
      const int64_t nb = std::min(c.batch, c.eval_size - b0);
      model.forward(held_out.ids.slice(0, b0, b0 + nb).contiguous());
    }
    rates.push_back(static_cast<double>(c.eval_size) / seconds_since(t0));
  }
  std::sort(rates.begin(), rates.end());
  r.infer_samples_per_s = rates[1];
  return r;
}

}  // namespace heads
