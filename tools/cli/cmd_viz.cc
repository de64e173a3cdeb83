// cmd_viz.cc — `heads viz`: attention of a sentence as heatmaps (every head of one layer, or the
// rollout across layers), PNG or SVG.
#include "commands.h"

#include <cstdio>
#include <string>

#include "options.h"
#include "heads/sentence_encoder.h"
#include "heads/viz.h"

namespace heads::cli {

namespace {

struct VizArgs {
  std::string model, text = "The cat sat on the mat", output = "attention.png";
  int64_t layer = -1;
  bool rollout = false;
  int threads = 0;
};

}  // namespace

void render_sentence_attention(const SentenceEncoder& enc, const std::string& text, int64_t layer,
                               bool rollout, const std::string& output) {
  const SentenceEncoder::Attention a = enc.attention(text);
  const auto n_layers = static_cast<int64_t>(a.layers.size());
  if (rollout) {
    render_attention_matrix(a.tokens, attention_rollout(a.layers),
                            "Attention rollout over " + std::to_string(n_layers) + " layers: \"" + text + "\"", output);
    return;
  }
  const int64_t l = layer < 0 ? n_layers + layer : layer;
  HEADS_CHECK(l >= 0 && l < n_layers, "viz: --layer ", layer, " out of range for ", n_layers, " layers");
  render_attention_heads(a.tokens, a.layers[static_cast<size_t>(l)],
                         "Layer " + std::to_string(l) + " attention, every head: \"" + text + "\"", output);
}

void add_viz_command(CLI::App& app, Action* action) {
  auto args = std::make_shared<VizArgs>();
  CLI::App* c = app.add_subcommand(
      "viz",
      "Render a sentence's attention as heatmaps (rows: query token, columns: key token): every head\n"
      "of one layer in a grid, or with --rollout the attention rollout across all layers.\n"
      "PNG or SVG by the output's extension.");
  add_model_option(c, &args->model);
  c->add_option("--text", args->text, "the sentence")->capture_default_str();
  c->add_option("--layer", args->layer, "layer to show (negative counts from the last)")->capture_default_str()
      ->check(int_in(-kMaxCount, kMaxCount));
  c->add_flag("--rollout", args->rollout, "attention rollout across layers instead of one layer's heads");
  c->add_option("--output", args->output, "output .png or .svg")->capture_default_str();
  add_threads_option(c, &args->threads);
  c->callback([args, action] {
    *action = [args] {
      apply_threads(args->threads);
      const SentenceEncoder enc = SentenceEncoder::load(model_dir(args->model));
      render_sentence_attention(enc, args->text, args->layer, args->rollout, args->output);
      std::fprintf(stderr, "heads: wrote %s\n", args->output.c_str());
    };
  });
}

}  // namespace heads::cli
