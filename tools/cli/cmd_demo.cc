// cmd_demo.cc — `heads demo`: self-attention over "The cat sat on the mat" with 2 heads.
//
// Tokens are embedded by a fixed pseudo-random table keyed by the lower-cased word (so "The" and
// "the" share a vector) plus sinusoidal positions; a seeded MultiheadAttention attends over them
// and each head's attention weights are printed as a table.
#include <cmath>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "heads/mha.h"
#include "heads/runtime.h"

namespace heads::cli {

namespace {

struct DemoArgs {
  std::string sentence = "The cat sat on the mat";
  int64_t embed = 16;
  int64_t num_heads = 2;
  uint64_t seed = 0;
  int threads = 0;
};

std::vector<std::string> words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> w;
  for (std::string x; in >> x;) w.push_back(x);
  return w;
}

Tensor embed(const std::vector<std::string>& tokens, int64_t E, uint64_t seed) {
  const auto L = static_cast<int64_t>(tokens.size());
  Tensor x = Tensor::empty({L, E}, DType::F32);
  float* p = x.data<float>();
  for (int64_t t = 0; t < L; ++t) {
    std::string lower = tokens[t];
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    std::mt19937_64 gen(std::hash<std::string>{}(lower) ^ seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (int64_t e = 0; e < E; ++e) {
      const double freq = std::pow(10000.0, -static_cast<double>(e / 2 * 2) / static_cast<double>(E));
      const double pos = e % 2 == 0 ? std::sin(t * freq) : std::cos(t * freq);
      p[t * E + e] = dist(gen) + static_cast<float>(0.5 * pos);
    }
  }
  return x;
}

void print_table(const std::vector<std::string>& tokens, const float* w, int64_t L) {
  size_t width = 6;
  for (const auto& t : tokens) width = std::max(width, t.size() + 1);
  std::printf("%*s", static_cast<int>(width), "");
  for (const auto& t : tokens) std::printf("%*s", static_cast<int>(width), t.c_str());
  std::printf("\n");
  for (int64_t i = 0; i < L; ++i) {
    std::printf("%*s", static_cast<int>(width), tokens[i].c_str());
    for (int64_t j = 0; j < L; ++j) std::printf("%*.3f", static_cast<int>(width), w[i * L + j]);
    std::printf("\n");
  }
}

void run(const DemoArgs& a) {
  apply_threads(a.threads);
  const std::vector<std::string> tokens = words(a.sentence);
  HEADS_CHECK(!tokens.empty(), "demo: --sentence has no words");
  const auto L = static_cast<int64_t>(tokens.size());
  MultiheadAttentionOptions o;
  o.embed_dim = a.embed;
  o.num_heads = a.num_heads;
  MultiheadAttention mha(o, a.seed);
  mha.eval();
  const Tensor x = embed(tokens, a.embed, a.seed);  // unbatched [L, E]
  MhaForwardArgs fa;
  fa.need_weights = true;
  fa.average_attn_weights = false;
  auto [out, weights] = mha.forward(x, x, x, fa);  // weights [H, L, L]
  std::printf("Self-attention over \"%s\": %lld tokens, embed_dim %lld, %lld heads\n",
              a.sentence.c_str(), static_cast<long long>(L), static_cast<long long>(a.embed),
              static_cast<long long>(a.num_heads));
  std::printf("(rows: query token, columns: key token; each row sums to 1)\n");
  for (int64_t h = 0; h < a.num_heads; ++h) {
    std::printf("\nhead %lld\n", static_cast<long long>(h));
    print_table(tokens, weights.data<float>() + h * L * L, L);
  }
  std::printf("\noutput shape: %s (tokens x embed_dim)\n", shape_str(out.shape()).c_str());
}

}  // namespace

void add_demo_command(CLI::App& app, Action* action) {
  auto args = std::make_shared<DemoArgs>();
  CLI::App* c = app.add_subcommand(
      "demo", "Self-attention over a sentence; prints every head's attention weights.");
  c->add_option("--sentence", args->sentence, "the sentence (split on spaces)")->capture_default_str();
  c->add_option("--embed", args->embed, "embedding size")->capture_default_str()->check(CLI::PositiveNumber);
  c->add_option("--num-heads", args->num_heads, "heads")->capture_default_str()->check(CLI::PositiveNumber);
  c->add_option("--seed", args->seed, "seed of the weights and embeddings")->capture_default_str();
  c->add_option("--threads", args->threads, "worker threads (default: all cores)")
      ->check(CLI::NonNegativeNumber);
  c->callback([args, action] { *action = [args] { run(*args); }; });
}

}  // namespace heads::cli
