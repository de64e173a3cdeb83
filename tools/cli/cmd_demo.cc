// cmd_demo.cc — `heads demo`: a real model end to end. Embeds a few sentences with
// all-MiniLM-L6-v2 (or --model), prints their cosine similarities, and draws the attention of
// "The cat sat on the mat" (every head of the last layer) to a PNG.
#include "commands.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "options.h"
#include "heads/runtime.h"
#include "heads/sentence_encoder.h"

namespace heads::cli {

namespace {

struct DemoArgs {
  std::string model, output = "attention.png", sentence = "The cat sat on the mat";
  int threads = 0;
};

void run(const DemoArgs& a) {
  apply_threads(a.threads);
  const SentenceEncoder enc = SentenceEncoder::load(model_dir(a.model));
  const std::vector<std::string> texts = {
      "The cat sat on the mat.", "A kitten is resting on a rug.", "The stock market fell sharply today.",
      "Shares dropped as investors worried.", "Attention lets every token look at every other token."};
  std::printf("Model: %s (%lld-dim embeddings, %s kernels, %d threads)\n\n", enc.model_dir().c_str(),
              static_cast<long long>(enc.dim()), isa_name(active_isa()).c_str(), get_num_threads());
  const Tensor e = enc.encode(texts);
  std::printf("Cosine similarity of the sentence embeddings:\n\n%4s", "");
  for (size_t j = 0; j < texts.size(); ++j) std::printf("%7s", ("[" + std::to_string(j) + "]").c_str());
  std::printf("\n");
  for (size_t i = 0; i < texts.size(); ++i) {
    std::printf("[%zu] ", i);
    for (size_t j = 0; j < texts.size(); ++j) {
      double dot = 0;
      for (int64_t k = 0; k < e.size(1); ++k) {
        dot += static_cast<double>(e.data<float>()[i * e.size(1) + k]) * e.data<float>()[j * e.size(1) + k];
      }
      std::printf(" %6.3f", dot);
    }
    std::printf("   %s\n", texts[i].c_str());
  }
  const auto ids = enc.tokenize(a.sentence);
  std::printf("\nTokens of \"%s\":", a.sentence.c_str());
  for (int64_t id : ids) std::printf(" %s", enc.tokenizer().token(id).c_str());
  std::printf("\n");
  render_sentence_attention(enc, a.sentence, -1, false, a.output);
  std::printf("Attention heatmap of every head of the last layer written to %s\n", a.output.c_str());
  std::printf("(more: heads viz --rollout, heads embed --help, heads bench --help)\n");
}

}  // namespace

void add_demo_command(CLI::App& app, Action* action) {
  auto args = std::make_shared<DemoArgs>();
  CLI::App* c = app.add_subcommand(
      "demo",
      "Embed a few sentences with all-MiniLM-L6-v2, print their similarities, and draw the attention\n"
      "of \"The cat sat on the mat\".");
  add_model_option(c, &args->model);
  c->add_option("--sentence", args->sentence, "the sentence whose attention is drawn")->capture_default_str();
  c->add_option("--output", args->output, "heatmap file (.png or .svg)")->capture_default_str();
  add_threads_option(c, &args->threads);
  c->callback([args, action] { *action = [args] { run(*args); }; });
}

}  // namespace heads::cli
