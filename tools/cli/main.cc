// main.cc — the heads command-line tool.
//
// Exit codes (DESIGN.md): 0 success, 2 usage error, 1 any other error; errors are one line on
// stderr. Commands write outputs to a temporary name and rename at the end.
#include <malloc.h>

#include <cstdio>
#include <exception>
#include <iostream>

#include "commands.h"
#include "heads/error.h"
#include "heads/runtime.h"

namespace heads::cli {

void apply_threads(int threads) {
  if (threads != 0) set_num_threads(threads);
}

}  // namespace heads::cli

int main(int argc, char** argv) {
  // Keep freed tensor buffers in the heap for reuse instead of returning them to the kernel:
  // layer after layer allocates the same sizes, and fresh pages cost a fault each.
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  CLI::App app{"heads — multi-head attention for CPUs.\n"
               "Tensors travel in safetensors files; see `heads COMMAND --help`."};
  app.name("heads");
  app.require_subcommand(1);
  heads::cli::Action action;
  heads::cli::add_mha_command(app, &action);
  heads::cli::add_demo_command(app, &action);
  heads::cli::add_bench_command(app, &action);
  heads::cli::add_embed_command(app, &action);
  heads::cli::add_viz_command(app, &action);
  heads::cli::add_train_demo_command(app, &action);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "heads: " << e.what() << "\n(run `heads --help` for usage)\n";
    return 2;
  }
  try {
    if (action) action();
  } catch (const heads::Error& e) {
    std::cerr << "heads: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "heads: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
