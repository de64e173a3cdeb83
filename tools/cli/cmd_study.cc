// cmd_study.cc — `heads study mechanisms | heads`: small causal models trained from scratch in C++ on
// a synthetic long-range task (heads/study.h), one per attention mechanism or per head count, each in
// its own process (so that its peak memory is its own); held-out accuracy, training time, peak memory
// and inference speed as a table (--markdown, --json) and a plot (--plot PNG|SVG). The mechanisms
// study also measures one forward's memory against the sequence length.
#include "commands.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "options.h"
#include "heads/encoder.h"
#include "heads/error.h"
#include "heads/runtime.h"
#include "heads/study.h"
#include "heads/viz.h"

extern char** environ;

namespace heads::cli {

namespace {

using json = nlohmann::json;

struct StudyArgs {
  std::string task = "copy";
  int64_t len = 256, vocab = 16, d_model = 64, layers = 2, ff = 128, heads = 4, batch = 32, steps = 300;
  int64_t eval_size = 256;
  double lr = 3e-3;
  uint64_t seed = 0;
  int threads = 0;
  std::string heads_list = "1,2,4,8,16", mem_lens = "256,512,1024,2048,4096";
  bool json_out = false, markdown = false;
  std::string plot;
  // one child's work
  std::string mechanism = "multi-head";
  int64_t mem_len = 0;
};

const std::vector<std::string> kMechanisms = {"basic", "multi-head", "sparse", "linear", "local"};

// A mechanism's head count and attention variant at sequence length `len`.
std::pair<int64_t, AttentionVariant> mechanism(const std::string& name, int64_t heads, int64_t len) {
  AttentionVariant v;
  if (name == "basic") return {1, v};
  if (name == "multi-head" || name == "softmax+weights") return {heads, v};
  if (name == "sparse") {
    v.sparse_block = std::max<int64_t>(8, len / 16);
    v.sparse_stride = 4;
  } else if (name == "linear") {
    v.kind = AttentionKind::Linear;
  } else if (name == "local") {
    v.window = std::max<int64_t>(1, len / 8);
  } else {
    fail("study: mechanism must be basic, multi-head, sparse, linear or local, got \"", name, "\"");
  }
  return {heads, v};
}

std::string complexity(const std::string& name) {
  if (name == "sparse") return "O(L·L/s)";
  if (name == "linear") return "O(L·d²)";
  if (name == "local") return "O(L·w)";
  return "O(L²·d)";
}

// Starts the peak-RSS count (VmHWM) afresh from the current resident set (Linux >= 4.0).
void reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
}

// kB from a /proc/self/status line ("VmRSS:", "VmHWM:").
double status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(std::strlen(key)));
  }
  return 0;
}

StudyConfig config_of(const StudyArgs& a, const std::string& mech, int64_t heads) {
  StudyConfig c;
  c.task = study_task_from_name(a.task);
  c.seq_len = a.len;
  c.vocab = a.vocab;
  c.d_model = a.d_model;
  c.num_layers = a.layers;
  c.dim_feedforward = a.ff;
  const auto [h, v] = mechanism(mech, heads, a.len);
  HEADS_CHECK(a.d_model % h == 0, "study: --d-model ", a.d_model, " is not divisible by ", h, " heads");
  c.nhead = h;
  c.attention = v;
  c.batch = a.batch;
  c.steps = a.steps;
  c.warmup = std::max<int64_t>(1, a.steps / 10);
  c.eval_size = a.eval_size;
  c.lr = a.lr;
  c.seed = a.seed;
  return c;
}

// Child: train and measure one model, print one JSON line.
void run_one(const StudyArgs& a) {
  apply_threads(a.threads);
  const double base_kb = status_kb("VmRSS:");
  reset_peak_rss();
  const StudyConfig c = config_of(a, a.mechanism, a.heads);
  const StudyResult r = run_study(c);
  const json j = {{"mechanism", a.mechanism},
                  {"heads", c.nhead},
                  {"task", a.task},
                  {"seq_len", a.len},
                  {"parameters", r.parameters},
                  {"train_s", r.train_seconds},
                  {"steps", c.steps},
                  {"final_loss", r.final_loss},
                  {"token_accuracy", r.token_accuracy},
                  {"sequence_accuracy", r.sequence_accuracy},
                  {"chance", r.chance},
                  {"infer_samples_per_s", r.infer_samples_per_s},
                  {"peak_mb", (status_kb("VmHWM:") - base_kb) / 1024.0},
                  {"curve_s", r.curve_seconds},
                  {"curve_accuracy", r.curve_accuracy},
                  {"threads", get_num_threads()}};
  std::printf("%s\n", j.dump().c_str());
}

// Child: one inference forward of the model's encoder at --mem-len, batch 1; its peak memory above
// the process's resident set before the inputs exist. "softmax+weights" also returns every layer's
// attention weights (the L×L matrices a naive implementation forms).
void run_memory(const StudyArgs& a) {
  apply_threads(a.threads);
  const auto [h, v] = mechanism(a.mechanism, a.heads, a.mem_len);
  TransformerEncoderLayerOptions lo;
  lo.d_model = a.d_model;
  lo.nhead = h;
  lo.dim_feedforward = a.ff;
  lo.dropout = 0.0;
  lo.activation = Activation::Gelu;
  lo.batch_first = true;
  lo.norm_first = true;
  lo.attention = v;
  TransformerEncoder enc(lo, a.layers, true, a.seed);
  enc.eval();
  const double base_kb = status_kb("VmRSS:");
  reset_peak_rss();
  Tensor x = Tensor::empty({1, a.mem_len, a.d_model}, DType::F32);
  std::mt19937_64 gen(a.seed);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = nd(gen);
  std::vector<Tensor> weights;
  const Tensor y = enc.forward(x, {}, {}, true, a.mechanism == "softmax+weights" ? &weights : nullptr);
  const json j = {{"mechanism", a.mechanism}, {"seq_len", a.mem_len}, {"peak_mb", (status_kb("VmHWM:") - base_kb) / 1024.0},
                  {"checksum", static_cast<double>(y.data<float>()[0])}};
  std::printf("%s\n", j.dump().c_str());
}

// Runs `heads study <args>` in a child process and returns the JSON line it printed.
json spawn_child(const std::vector<std::string>& args) {
  std::vector<std::string> argv_s = {"/proc/self/exe", "study"};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  int fds[2];
  HEADS_CHECK(pipe(fds) == 0, "study: pipe failed: ", std::strerror(errno));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    fail("study: cannot start a measuring process: ", std::strerror(rc));
  }
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  pid_t waited = 0;
  while ((waited = waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
  }
  HEADS_CHECK(waited == pid, "study: waiting for a measuring process failed: ", std::strerror(errno));
  std::string what;
  for (const auto& s : args) what += " " + s;
  HEADS_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "study: the run 'heads study", what, "' failed (",
              WIFEXITED(status) ? "exit " + std::to_string(WEXITSTATUS(status))
                                : "signal " + std::to_string(WTERMSIG(status)),
              ")");
  try {
    return json::parse(out.substr(0, out.find('\n')));
  } catch (const std::exception& e) {
    fail("study: the run 'heads study", what, "' printed no result (", e.what(), ")");
  }
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::vector<std::string> common_args(const StudyArgs& a) {
  return {"--task", a.task, "--len", std::to_string(a.len), "--vocab", std::to_string(a.vocab), "--d-model",
          std::to_string(a.d_model), "--layers", std::to_string(a.layers), "--ff", std::to_string(a.ff), "--batch",
          std::to_string(a.batch), "--steps", std::to_string(a.steps), "--eval-size", std::to_string(a.eval_size),
          "--lr", fmt("%.17g", a.lr), "--seed", std::to_string(a.seed), "--threads", std::to_string(a.threads)};
}

void print_table(const std::vector<json>& rows, bool by_heads, bool markdown) {
  std::vector<std::string> head = by_heads ? std::vector<std::string>{"heads", "head dim", "parameters", "train s",
                                                                      "held-out token acc", "sequence acc", "peak MB",
                                                                      "inference samples/s"}
                                           : std::vector<std::string>{"mechanism", "heads", "complexity", "parameters",
                                                                      "train s", "held-out token acc", "sequence acc",
                                                                      "peak MB", "inference samples/s"};
  std::vector<std::vector<std::string>> cells;
  for (const json& r : rows) {
    std::vector<std::string> c;
    const std::string mech = r["mechanism"];
    if (by_heads) {
      c = {std::to_string(r["heads"].get<int64_t>()), std::to_string(r["head_dim"].get<int64_t>())};
    } else {
      c = {mech, std::to_string(r["heads"].get<int64_t>()), complexity(mech)};
    }
    c.push_back(std::to_string(r["parameters"].get<int64_t>()));
    c.push_back(fmt("%.1f", r["train_s"].get<double>()));
    c.push_back(fmt("%.3f", r["token_accuracy"].get<double>()));
    c.push_back(fmt("%.3f", r["sequence_accuracy"].get<double>()));
    c.push_back(fmt("%.1f", r["peak_mb"].get<double>()));
    c.push_back(fmt("%.0f", r["infer_samples_per_s"].get<double>()));
    cells.push_back(c);
  }
  if (markdown) {
    std::string line = "|", sep = "|";
    for (const auto& h : head) line += " " + h + " |", sep += "---|";
    std::printf("%s\n%s\n", line.c_str(), sep.c_str());
    for (const auto& c : cells) {
      std::string l = "|";
      for (const auto& x : c) l += " " + x + " |";
      std::printf("%s\n", l.c_str());
    }
    return;
  }
  std::vector<size_t> w(head.size());
  for (size_t i = 0; i < head.size(); ++i) {
    w[i] = head[i].size();
    for (const auto& c : cells) w[i] = std::max(w[i], c[i].size());
  }
  auto print_row = [&](const std::vector<std::string>& c) {
    for (size_t i = 0; i < c.size(); ++i) std::printf("%-*s%s", static_cast<int>(w[i]), c[i].c_str(), i + 1 < c.size() ? "  " : "\n");
  };
  print_row(head);
  for (const auto& c : cells) print_row(c);
}

void run_study_command(const StudyArgs& a, bool by_heads) {
  study_task_from_name(a.task);  // a bad name or plot path fails here, before any child starts
  if (!a.plot.empty()) {
    const std::string ext = std::filesystem::path(a.plot).extension().string();
    HEADS_CHECK(ext == ".png" || ext == ".svg", a.plot, ": output must end in .png or .svg");
  }
  std::vector<json> rows;
  const std::vector<int64_t> head_counts = by_heads ? int_list(a.heads_list) : std::vector<int64_t>{};
  const size_t n_runs = by_heads ? head_counts.size() : kMechanisms.size();
  for (size_t i = 0; i < n_runs; ++i) {  // every run's settings checked before the first one starts
    config_of(a, by_heads ? "multi-head" : kMechanisms[i], by_heads ? head_counts[i] : a.heads);
  }
  if (!by_heads) {
    for (int64_t L : int_list(a.mem_lens)) {
      HEADS_CHECK(L >= 1 && L <= (1 << 22), "study: --mem-lens: each length must be in [1, 4194304], got ", L);
    }
  }
  for (size_t i = 0; i < n_runs; ++i) {
    const std::string mech = by_heads ? "multi-head" : kMechanisms[i];
    const int64_t h = by_heads ? head_counts[i] : a.heads;
    const StudyConfig cfg = config_of(a, mech, h);
    if (!a.json_out) {
      std::fprintf(stderr, "study: training %s, heads %lld...\n", mech.c_str(), static_cast<long long>(cfg.nhead));
    }
    std::vector<std::string> args = {"run", "--mechanism", mech, "--heads", std::to_string(h)};
    const auto common = common_args(a);
    args.insert(args.end(), common.begin(), common.end());
    json r = spawn_child(args);
    r["head_dim"] = a.d_model / r["heads"].get<int64_t>();
    if (a.json_out) std::printf("%s\n", r.dump().c_str());
    rows.push_back(r);
  }
  std::vector<json> mem;
  if (!by_heads && !a.mem_lens.empty()) {
    for (const std::string& mech : {std::string("softmax+weights"), std::string("multi-head"), std::string("sparse"),
                                    std::string("linear"), std::string("local")}) {
      for (int64_t L : int_list(a.mem_lens)) {
        if (!a.json_out) std::fprintf(stderr, "study: memory of %s at L = %lld...\n", mech.c_str(), static_cast<long long>(L));
        std::vector<std::string> args = {"memory", "--mechanism", mech, "--heads", std::to_string(a.heads), "--mem-len",
                                         std::to_string(L)};
        const auto common = common_args(a);
        args.insert(args.end(), common.begin(), common.end());
        const json r = spawn_child(args);
        if (a.json_out) std::printf("%s\n", r.dump().c_str());
        mem.push_back(r);
      }
    }
  }
  if (!a.json_out) {
    std::printf("%s task, L = %lld, %lld layers, d_model %lld, %lld steps of batch %lld, %d threads; chance %.3f\n",
                a.task.c_str(), static_cast<long long>(a.len), static_cast<long long>(a.layers),
                static_cast<long long>(a.d_model), static_cast<long long>(a.steps), static_cast<long long>(a.batch),
                rows.empty() ? 0 : rows[0]["threads"].get<int>(), rows.empty() ? 0.0 : rows[0]["chance"].get<double>());
    print_table(rows, by_heads, a.markdown);
    if (!mem.empty()) {
      std::printf("\none forward's peak memory (MB above the model), batch 1, %lld layers, d_model %lld:\n",
                  static_cast<long long>(a.layers), static_cast<long long>(a.d_model));
      const std::vector<int64_t> lens = int_list(a.mem_lens);
      auto right = [](const std::string& x, size_t w) { return std::string(w > x.size() ? w - x.size() : 0, ' ') + x; };
      auto left = [](std::string x, size_t w) {
        x.resize(std::max(w, x.size()), ' ');
        return x;
      };
      std::string line = a.markdown ? "| mechanism |" : left("mechanism", 16), sep = "|---|";
      for (int64_t L : lens) {
        line += a.markdown ? " L " + std::to_string(L) + " |" : right("L " + std::to_string(L), 10);
        sep += "---|";
      }
      std::printf("%s\n", line.c_str());
      if (a.markdown) std::printf("%s\n", sep.c_str());
      for (size_t m = 0; m < mem.size(); m += lens.size()) {
        const std::string name = mem[m]["mechanism"];
        std::string l = a.markdown ? "| " + name + " |" : left(name, 16);
        for (size_t i = 0; i < lens.size(); ++i) {
          const std::string v = fmt("%.1f", mem[m + i]["peak_mb"].get<double>());
          l += a.markdown ? " " + v + " |" : right(v, 10);
        }
        std::printf("%s\n", l.c_str());
      }
    }
  }
  if (!a.plot.empty()) {
    std::vector<ChartPanel> panels;
    if (!by_heads) {
      ChartPanel acc{"held-out accuracy while training", "training time (s)", "token accuracy", false, false, {}, 0.0, 1.0};
      for (const json& r : rows) {
        acc.series.push_back({r["mechanism"], r["curve_s"].get<std::vector<double>>(), r["curve_accuracy"].get<std::vector<double>>()});
      }
      panels.push_back(acc);
      if (!mem.empty()) {
        ChartPanel mp{"one forward's peak memory", "sequence length L", "MB", true, true, {}, NAN, NAN};
        const size_t nl = int_list(a.mem_lens).size();
        for (size_t m = 0; m < mem.size(); m += nl) {
          ChartSeries s{mem[m]["mechanism"], {}, {}};
          for (size_t i = 0; i < nl; ++i) {
            s.x.push_back(mem[m + i]["seq_len"].get<double>());
            s.y.push_back(std::max(0.1, mem[m + i]["peak_mb"].get<double>()));
          }
          mp.series.push_back(s);
        }
        panels.push_back(mp);
      }
    } else {
      ChartPanel acc{"held-out accuracy against heads", "heads", "token accuracy", true, false, {}, 0.0, 1.0};
      ChartPanel speed{"inference against heads", "heads", "samples/s", true, false, {}, 0.0, NAN};
      ChartSeries sa{"accuracy", {}, {}}, ss{"inference", {}, {}};
      for (const json& r : rows) {
        sa.x.push_back(r["heads"].get<double>());
        sa.y.push_back(r["token_accuracy"].get<double>());
        ss.x.push_back(r["heads"].get<double>());
        ss.y.push_back(r["infer_samples_per_s"].get<double>());
      }
      acc.series.push_back(sa);
      speed.series.push_back(ss);
      panels = {acc, speed};
    }
    render_charts(panels,
                  "heads study " + std::string(by_heads ? "heads" : "mechanisms") + ": " + a.task + ", L = " +
                      std::to_string(a.len) + ", " + std::to_string(a.steps) + " steps",
                  a.plot);
    if (!a.json_out) std::printf("wrote %s\n", a.plot.c_str());
  }
}

void add_common(CLI::App* c, StudyArgs* a) {
  c->add_option("--task", a->task, "copy or recall (heads/study.h)")->capture_default_str();
  c->add_option("--len", a->len, "tokens per sequence")->capture_default_str()->check(int_in(16, 1 << 20));
  c->add_option("--vocab", a->vocab, "symbols (copy) or values (recall)")->capture_default_str()->check(int_in(2, 1 << 20));
  c->add_option("--d-model", a->d_model, "model width")->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_option("--layers", a->layers, "layers")->capture_default_str()->check(int_in(1, 64));
  c->add_option("--ff", a->ff, "feed-forward width")->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_option("--batch", a->batch, "sequences per step")->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_option("--steps", a->steps, "optimizer steps per model")->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_option("--eval-size", a->eval_size, "held-out sequences")->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_option("--lr", a->lr, "AdamW peak learning rate (warmup, cosine decay)")->capture_default_str()
      ->check(real_in(1e-9, 10.0));
  c->add_option("--seed", a->seed, "seed of data and weights")->capture_default_str()->check(int_in(0, INT64_MAX));
  add_threads_option(c, &a->threads);
}

}  // namespace

void add_study_command(CLI::App& app, Action* action) {
  auto a = std::make_shared<StudyArgs>();
  CLI::App* study = app.add_subcommand(
      "study",
      "Train small causal models from scratch on a synthetic long-range task (copy or associative\n"
      "recall) and compare attention mechanisms or head counts: held-out accuracy, training time,\n"
      "peak memory, inference speed. Each model trains in its own process.");
  study->require_subcommand(1);
  CLI::App* mech = study->add_subcommand(
      "mechanisms",
      "basic (1 head), multi-head, sparse (fixed block pattern), linear and local (window L/8)\n"
      "attention on the same task; also one forward's memory against L (--mem-lens).");
  add_common(mech, a.get());
  mech->add_option("--heads", a->heads, "heads of the multi-head mechanisms")->capture_default_str()
      ->check(int_in(1, kMaxCount));
  mech->add_option("--mem-lens", a->mem_lens, "sequence lengths of the memory measurement ('' to skip)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& s) { return s.empty() ? std::string() : int_list_in(1, 1 << 22)(s); }, "INT[,INT...]"));
  mech->add_flag("--json", a->json_out, "one JSON line per model and per memory point");
  mech->add_flag("--markdown", a->markdown, "tables as Markdown");
  mech->add_option("--plot", a->plot, "draw accuracy against training time and memory against L (.png or .svg)");
  mech->callback([a, action] { *action = [a] { run_study_command(*a, false); }; });

  CLI::App* hs = study->add_subcommand("heads", "Softmax attention with each head count of --heads-list at the same width.");
  add_common(hs, a.get());
  hs->add_option("--heads-list", a->heads_list, "head counts")->capture_default_str()->check(int_list_in(1, kMaxCount));
  hs->add_flag("--json", a->json_out, "one JSON line per model");
  hs->add_flag("--markdown", a->markdown, "tables as Markdown");
  hs->add_option("--plot", a->plot, "draw accuracy and inference speed against heads (.png or .svg)");
  hs->callback([a, action] { *action = [a] { run_study_command(*a, true); }; });

  // The measuring processes the two studies start (one model each).
  CLI::App* one = study->add_subcommand("run", "(internal) train and measure one model, print one JSON line");
  add_common(one, a.get());
  one->add_option("--mechanism", a->mechanism, "basic, multi-head, sparse, linear or local")->capture_default_str();
  one->add_option("--heads", a->heads, "heads")->capture_default_str()->check(int_in(1, kMaxCount));
  one->group("");
  one->callback([a, action] { *action = [a] { run_one(*a); }; });
  CLI::App* mem = study->add_subcommand("memory", "(internal) one forward's peak memory at --mem-len, one JSON line");
  add_common(mem, a.get());
  mem->add_option("--mechanism", a->mechanism, "a mechanism, or softmax+weights")->capture_default_str();
  mem->add_option("--heads", a->heads, "heads")->capture_default_str()->check(int_in(1, kMaxCount));
  mem->add_option("--mem-len", a->mem_len, "sequence length")->required()->check(int_in(1, 1 << 22));
  mem->group("");
  mem->callback([a, action] { *action = [a] { run_memory(*a); }; });
}

}  // namespace heads::cli
