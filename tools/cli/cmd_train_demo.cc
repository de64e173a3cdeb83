// cmd_train_demo.cc — `heads train-demo`: trains a small causal transformer from scratch in C++
// (forward, backward and AdamW all from the library) on a synthetic sequence task, printing the
// loss and the accuracy of greedy decoding on held-out sequences until the target is reached.
//
// Model: heads::TinyCausalLM (include/heads/tiny_lm.h) over the ten digits and a separator. A
// sequence is  x_1..x_n SEP y_1..y_n  with digits x and y = reverse(x) (or sort(x)); the loss counts
// the predictions of y only.
#include "commands.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "options.h"
#include "heads/ops.h"
#include "heads/optim.h"
#include "heads/runtime.h"
#include "heads/safetensors.h"
#include "heads/tiny_lm.h"

namespace heads::cli {

namespace {

constexpr int64_t kDigits = 10;      // token ids 0..9
constexpr int64_t kSep = kDigits;    // separator token
constexpr int64_t kVocab = kDigits + 1;
constexpr int64_t kIgnore = -100;    // cross_entropy's ignore_index

struct TrainArgs {
  std::string task = "reverse", save;
  int64_t length = 8, layers = 2, d_model = 64, heads = 4, ff = 256, batch = 64, steps = 3000;
  int64_t eval_every = 10, eval_size = 256, warmup = 100;
  double lr = 3e-3, weight_decay = 0.01, dropout = 0.0, target = 0.99;
  uint64_t seed = 0;
  int threads = 0;
};

// A batch of token sequences [B, 2n+1] (row-major), drawn from `gen`.
std::vector<int64_t> make_sequences(const TrainArgs& a, int64_t count, std::mt19937_64& gen) {
  const int64_t n = a.length, width = 2 * n + 1;
  std::vector<int64_t> seq(static_cast<size_t>(count * width));
  std::uniform_int_distribution<int64_t> digit(0, kDigits - 1);
  for (int64_t b = 0; b < count; ++b) {
    int64_t* s = seq.data() + b * width;
    for (int64_t i = 0; i < n; ++i) s[i] = digit(gen);
    s[n] = kSep;
    std::vector<int64_t> y(s, s + n);
    if (a.task == "reverse") {
      std::reverse(y.begin(), y.end());
    } else {
      std::sort(y.begin(), y.end());
    }
    std::copy(y.begin(), y.end(), s + n + 1);
  }
  return seq;
}

Tensor ids_tensor(const std::vector<int64_t>& v, int64_t rows, int64_t cols) {
  Tensor t = Tensor::empty({rows, cols}, DType::I64);
  std::copy(v.begin(), v.end(), t.data<int64_t>());
  return t;
}

TinyCausalLM make_model(const TrainArgs& a) {
  TinyLMOptions o;
  o.vocab = kVocab;
  o.max_len = 2 * a.length;
  o.d_model = a.d_model;
  o.nhead = a.heads;
  o.dim_feedforward = a.ff;
  o.num_layers = a.layers;
  o.dropout = a.dropout;
  return TinyCausalLM(o, a.seed);
}

struct Accuracy {
  double token = 0, sequence = 0;
};

// Greedy decoding of y from x SEP, one token at a time, on held-out sequences.
Accuracy evaluate(TinyCausalLM& model, const TrainArgs& a, const std::vector<int64_t>& seq) {
  const int64_t n = a.length, width = 2 * n + 1, count = a.eval_size;
  model.train(false);
  std::vector<int64_t> prefix(static_cast<size_t>(count * width));
  for (int64_t b = 0; b < count; ++b) {
    std::copy_n(seq.begin() + b * width, n + 1, prefix.begin() + b * width);
  }
  for (int64_t step = 0; step < n; ++step) {
    const int64_t len = n + 1 + step;
    std::vector<int64_t> cur(static_cast<size_t>(count * len));
    for (int64_t b = 0; b < count; ++b) std::copy_n(prefix.begin() + b * width, len, cur.begin() + b * len);
    const Tensor logits = model.forward(ids_tensor(cur, count, len));
    for (int64_t b = 0; b < count; ++b) {
      const float* row = logits.data<float>() + ((b * len) + len - 1) * kVocab;
      int64_t best = 0;
      for (int64_t c = 1; c < kVocab; ++c) best = row[c] > row[best] ? c : best;
      prefix[static_cast<size_t>(b * width + len)] = best;
    }
  }
  model.train(true);
  Accuracy acc;
  for (int64_t b = 0; b < count; ++b) {
    bool all = true;
    for (int64_t i = n + 1; i < width; ++i) {
      const bool ok = prefix[static_cast<size_t>(b * width + i)] == seq[static_cast<size_t>(b * width + i)];
      acc.token += ok;
      all = all && ok;
    }
    acc.sequence += all;
  }
  acc.token /= static_cast<double>(count * n);
  acc.sequence /= static_cast<double>(count);
  return acc;
}

void run(const TrainArgs& a) {
  apply_threads(a.threads);
  HEADS_CHECK(a.task == "reverse" || a.task == "sort", "train-demo: --task must be reverse or sort, got ", a.task);
  HEADS_CHECK(a.d_model % a.heads == 0, "train-demo: --d-model ", a.d_model, " is not divisible by --heads ", a.heads);
  manual_seed(a.seed);  // dropout streams
  TinyCausalLM model = make_model(a);
  model.train(true);
  AdamWOptions oo;
  oo.lr = a.lr;
  oo.weight_decay = a.weight_decay;
  oo.beta2 = 0.98;
  AdamW opt(model.state_dict(), oo);
  int64_t n_params = 0;
  for (const auto& [n, t] : model.state_dict()) n_params += t.numel();

  std::mt19937_64 train_gen(a.seed * 2 + 1), eval_gen(a.seed * 2 + 2);
  const std::vector<int64_t> held_out = make_sequences(a, a.eval_size, eval_gen);
  const int64_t n = a.length, width = 2 * n + 1, L = 2 * n;
  std::printf("train-demo: %s %lld digits; %lld layers, d_model %lld, %lld heads, %lld parameters; "
              "batch %lld, AdamW lr %g\n",
              a.task.c_str(), static_cast<long long>(n), static_cast<long long>(a.layers),
              static_cast<long long>(a.d_model), static_cast<long long>(a.heads), static_cast<long long>(n_params),
              static_cast<long long>(a.batch), a.lr);
  const auto t0 = std::chrono::steady_clock::now();
  double loss_sum = 0;
  int64_t loss_count = 0;
  for (int64_t step = 1; step <= a.steps; ++step) {
    opt.set_lr(a.lr * std::min(1.0, static_cast<double>(step) / static_cast<double>(std::max<int64_t>(a.warmup, 1))));
    const std::vector<int64_t> seq = make_sequences(a, a.batch, train_gen);
    std::vector<int64_t> inputs(static_cast<size_t>(a.batch * L)), targets(static_cast<size_t>(a.batch * L));
    for (int64_t b = 0; b < a.batch; ++b) {
      for (int64_t i = 0; i < L; ++i) {
        inputs[static_cast<size_t>(b * L + i)] = seq[static_cast<size_t>(b * width + i)];
        // Position i predicts token i + 1; only the answer (after SEP) is scored.
        targets[static_cast<size_t>(b * L + i)] = i >= n ? seq[static_cast<size_t>(b * width + i + 1)] : kIgnore;
      }
    }
    const Tensor target = ids_tensor(targets, a.batch * L, 1).reshape({a.batch * L});
    TinyCausalLM::Tape tape;
    const Tensor logits = model.forward(ids_tensor(inputs, a.batch, L), &tape);
    const double loss = cross_entropy(logits, target, kIgnore);
    HEADS_CHECK(std::isfinite(loss), "train-demo: the loss became ", loss, " at step ", step);
    opt.step(model.backward(tape, cross_entropy_backward(logits, target, kIgnore)));
    loss_sum += loss;
    ++loss_count;
    if (step % a.eval_every == 0 || step == a.steps) {
      const Accuracy acc = evaluate(model, a, held_out);
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("step %5lld  loss %.4f  token accuracy %.3f  sequence accuracy %.3f  (%.1f s)\n",
                  static_cast<long long>(step), loss_sum / static_cast<double>(loss_count), acc.token, acc.sequence,
                  secs);
      std::fflush(stdout);
      loss_sum = 0;
      loss_count = 0;
      if (acc.sequence >= a.target) {
        std::printf("reached sequence accuracy %.3f >= %.3f on %lld held-out sequences at step %lld\n", acc.sequence,
                    a.target, static_cast<long long>(a.eval_size), static_cast<long long>(step));
        if (!a.save.empty()) {
          save_safetensors(a.save, model.state_dict(), {{"producer", "heads train-demo"}, {"task", a.task}});
          std::printf("saved %s\n", a.save.c_str());
        }
        return;
      }
    }
  }
  fail("train-demo: sequence accuracy stayed below ", a.target, " after ", a.steps, " steps");
}

}  // namespace

void add_train_demo_command(CLI::App& app, Action* action) {
  auto a = std::make_shared<TrainArgs>();
  CLI::App* c = app.add_subcommand(
      "train-demo",
      "Train a small causal transformer from scratch (heads' backward passes and AdamW) to\n"
      "reverse or sort sequences of digits: x_1..x_n SEP -> the answer, one token at a time.\n"
      "Prints the mean training loss and the greedy-decoding accuracy on held-out sequences\n"
      "every --eval-every steps; stops (exit 0) once the sequence accuracy reaches --target,\n"
      "fails (exit 1) if --steps pass first. Runs are reproducible for a given --seed.");
  c->add_option("--task", a->task, "reverse or sort")->capture_default_str();
  c->add_option("--length", a->length, "digits per sequence")->capture_default_str()->check(int_in(1, 64));
  c->add_option("--layers", a->layers, "encoder layers")->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_option("--d-model", a->d_model, "model width")->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_option("--heads", a->heads, "attention heads")->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_option("--ff", a->ff, "feed-forward width")->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_option("--dropout", a->dropout, "dropout probability")->capture_default_str()->check(real_in(0.0, 0.9));
  c->add_option("--batch", a->batch, "sequences per step")->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_option("--steps", a->steps, "maximum optimizer steps")->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_option("--lr", a->lr, "AdamW learning rate (after a linear warmup)")->capture_default_str()
      ->check(real_in(1e-12, 1e3));
  c->add_option("--warmup", a->warmup, "warmup steps")->capture_default_str()->check(int_in(0, kMaxCount));
  c->add_option("--weight-decay", a->weight_decay, "AdamW weight decay")->capture_default_str()
      ->check(real_in(0, 1e3));
  c->add_option("--eval-every", a->eval_every, "steps between evaluations")->capture_default_str()
      ->check(int_in(1, kMaxCount));
  c->add_option("--eval-size", a->eval_size, "held-out sequences")->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_option("--target", a->target, "sequence accuracy to stop at")->capture_default_str()
      ->check(real_in(0.0, 1.0));
  c->add_option("--seed", a->seed, "random seed (data, initial weights, dropout)")->capture_default_str()
      ->check(int_in(0, INT64_MAX));
  c->add_option("--save", a->save, "write the trained weights here (.safetensors)");
  add_threads_option(c, &a->threads);
  c->callback([a, action] { *action = [a] { run(*a); }; });
}

}  // namespace heads::cli
