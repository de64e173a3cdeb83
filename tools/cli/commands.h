// commands.h — the subcommands of the heads CLI; each registers itself on the app.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace heads::cli {

// A subcommand's body; runs after parsing, may throw heads::Error (exit 1).
using Action = std::function<void()>;

void add_mha_command(CLI::App& app, Action* action);
void add_demo_command(CLI::App& app, Action* action);
void add_bench_command(CLI::App& app, Action* action);

// --threads N shared by the commands (0 = default).
void apply_threads(int threads);

}  // namespace heads::cli
