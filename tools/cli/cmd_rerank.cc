// cmd_rerank.cc — `heads rerank`: texts scored against a query by a cross-encoder (a BERT-family
// *ForSequenceClassification directory) and printed best first.
#include "commands.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "heads/cross_encoder.h"
#include "heads/error.h"
#include "options.h"

namespace heads::cli {

namespace {

struct RerankArgs {
  std::string model, query, input, dtype = "auto", activation = "identity";
  std::vector<std::string> texts;
  int64_t batch_size = 32, top = 0;
  bool json = false;
  int threads = 0;
};

void run(const RerankArgs& a) {
  apply_threads(a.threads);
  const std::vector<std::string> texts = a.input.empty() ? a.texts : read_lines(a.input);
  HEADS_CHECK(!texts.empty(), "rerank: no texts (give TEXT arguments or an --input file with lines)");
  const CrossEncoder ce = CrossEncoder::load(a.model, precision_choice(a.dtype));
  HEADS_CHECK(ce.num_labels() == 1, "rerank: ", a.model, " has a head of ", ce.num_labels(),
              " labels; ranking needs a one-label head (a reranker)");
  std::vector<CrossEncoder::Pair> pairs;
  for (const auto& t : texts) pairs.emplace_back(a.query, t);
  int64_t truncated = 0;
  const Tensor s = ce.predict(pairs, score_activation_from_name(a.activation), a.batch_size, {}, &truncated);
  std::vector<int64_t> order(texts.size());
  std::iota(order.begin(), order.end(), 0);
  const float* score = s.data<float>();
  std::stable_sort(order.begin(), order.end(), [&](int64_t i, int64_t j) { return score[i] > score[j]; });
  if (a.top > 0 && static_cast<size_t>(a.top) < order.size()) order.resize(static_cast<size_t>(a.top));
  if (a.json) {
    nlohmann::json out = nlohmann::json::array();
    for (int64_t i : order) out.push_back({{"index", i}, {"score", score[i]}});
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("%4s %10s %5s  %s\n", "rank", "score", "index", "text");
    for (size_t r = 0; r < order.size(); ++r) {
      std::string t = texts[static_cast<size_t>(order[r])];
      if (t.size() > 60) t = t.substr(0, 57) + "...";
      std::printf("%4zu %10.5f %5lld  %s\n", r + 1, static_cast<double>(score[order[r]]),
                  static_cast<long long>(order[r]), t.c_str());
    }
  }
  if (truncated > 0) {
    std::fprintf(stderr, "heads: note: %lld pair(s) longer than %lld tokens were truncated, as the model does\n",
                 static_cast<long long>(truncated), static_cast<long long>(ce.max_length()));
  }
}

}  // namespace

void add_rerank_command(CLI::App& app, Action* action) {
  auto args = std::make_shared<RerankArgs>();
  CLI::App* c = app.add_subcommand(
      "rerank",
      "Texts scored against a query by a cross-encoder (a BERT, XLM-RoBERTa, MPNet or ModernBERT\n"
      "*ForSequenceClassification directory with one label, as sentence-transformers' CrossEncoder\n"
      "runs it), printed best first: rank, score, index, text; --json prints [{\"index\", \"score\"}]\n"
      "as /rerank answers.");
  c->add_option("--model", args->model, "the cross-encoder's model directory")->required();
  c->add_option("--query", args->query, "the query the texts are scored against")->required();
  auto* in = c->add_option("--input", args->input, "file with one text per line");
  auto* txt = c->add_option("texts", args->texts, "texts to score");
  in->excludes(txt);
  c->add_option("--activation", args->activation, "on the logits: identity (raw scores) or sigmoid")
      ->capture_default_str()
      ->check(CLI::IsMember({"identity", "sigmoid"}));
  c->add_option("--top", args->top, "print the best N only (0: all)")->check(int_in(0, kMaxCount));
  c->add_option("--batch-size", args->batch_size, "pairs per batch (batched by length)")
      ->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_flag("--json", args->json, "print [{\"index\", \"score\"}] sorted by score");
  add_precision_option(c, &args->dtype, true);
  add_threads_option(c, &args->threads);
  c->callback([args, action] { *action = [args] { run(*args); }; });
}

}  // namespace heads::cli
