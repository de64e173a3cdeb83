// main.cc — the heads command-line tool.
//
// Exit codes (DESIGN.md): 0 success, 2 usage error, 1 any other error; errors are one line on
// stderr. Commands write outputs to a temporary name and rename at the end.
#include "commands.h"

#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include "heads/error.h"
#include "heads/runtime.h"

namespace heads::cli {

void apply_threads(int threads) {
  if (threads != 0) set_num_threads(threads);
}

void check_batch_invariance(Precision p) {
  HEADS_CHECK(!batch_invariant() || batch_invariance_holds(p), "--batch-invariant: ", precision_name(p),
              " on this CPU runs oneDNN's native ", precision_name(p),
              " matmul, whose sums depend on the batch; use --dtype f32 or int8 for batch invariance");
}

std::vector<std::string> read_lines(const std::string& path) {
  std::error_code ec;
  HEADS_CHECK(!std::filesystem::is_directory(path, ec), path, ": is a directory, expected a text file");
  std::ifstream in(path, std::ios::binary);
  HEADS_CHECK(in.good(), path, ": cannot open");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(line);
  }
  HEADS_CHECK(in.eof(), path, ": read error");
  return lines;
}

}  // namespace heads::cli

namespace {

// libgomp's idle workers spin about 300,000 iterations (milliseconds) before they sleep; on a machine
// whose cores are busy with other work they starve the threads that have work (a one-sentence
// `heads embed` took 280 ms instead of 5). libgomp reads its settings once, as it loads, so unless
// the user chose a wait policy the tool runs itself again, once, with GOMP_SPINCOUNT=1000 (tens of
// microseconds), as `import heads` does (python/heads/__init__.py).
void settle_openmp_wait_policy(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr) return;
  if (setenv("GOMP_SPINCOUNT", "1000", 1) != 0) return;
  execv("/proc/self/exe", argv);  // returns only on failure: carry on with libgomp's defaults
}

}  // namespace

int main(int argc, char** argv) {
  settle_openmp_wait_policy(argv);
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
  heads::cli::add_rerank_command(app, &action);
  heads::cli::add_viz_command(app, &action);
  heads::cli::add_train_demo_command(app, &action);
  heads::cli::add_generate_command(app, &action);
  heads::cli::add_study_command(app, &action);
  heads::cli::add_quantize_command(app, &action);
#ifdef HEADS_WITH_SERVE
  heads::cli::add_serve_command(app, &action);
  heads::cli::add_client_command(app, &action);
#endif
  // "heads foo": CLI11 would only say that a subcommand is required.
  CLI::App* level = &app;
  for (int argi = 1; argi < argc && argv[argi][0] != '-' && !level->get_subcommands({}).empty(); ++argi) {
    CLI::App* sub = nullptr;
    std::string names;
    for (CLI::App* c : level->get_subcommands({})) {
      names += (names.empty() ? "" : ", ") + c->get_name();
      if (c->check_name(argv[argi])) sub = c;
    }
    if (sub == nullptr) {
      std::cerr << "heads: unknown command '" << argv[argi] << "' (commands: " << names
                << ")\n(run `heads --help` for usage)\n";
      return 2;
    }
    level = sub;
  }
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
