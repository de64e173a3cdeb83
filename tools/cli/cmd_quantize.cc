// cmd_quantize.cc — `heads quantize MODEL_DIR OUT_DIR`: a model directory written again with int8
// linear weights (BERT encoders) or with every weight in bf16 / f16 (include/heads/quantize.h).
#include "commands.h"

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "heads/quantize.h"

namespace heads::cli {

namespace {

struct QuantizeArgs {
  std::string model, out, dtype = "int8";
  bool quiet = false;
};

void run(const QuantizeArgs& a) {
  const auto t0 = std::chrono::steady_clock::now();
  const QuantizeResult r = quantize_model_dir(a.model, a.out, storage_dtype_from_name(a.dtype));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!a.quiet) {
    std::fprintf(stderr, "heads: wrote %s: %lld tensors, %lld in %s, %.1f MB -> %.1f MB of weights, %.2f s\n",
                 a.out.c_str(), static_cast<long long>(r.tensors), static_cast<long long>(r.converted),
                 a.dtype.c_str(), static_cast<double>(r.bytes_in) / 1e6, static_cast<double>(r.bytes_out) / 1e6, s);
  }
}

}  // namespace

void add_quantize_command(CLI::App& app, Action* action) {
  auto args = std::make_shared<QuantizeArgs>();
  CLI::App* c = app.add_subcommand(
      "quantize",
      "Write MODEL_DIR again into OUT_DIR with smaller weights. int8: a BERT encoder's linear weights\n"
      "as int8 with one f32 scale per output channel (\"<name>\" I8 [out, in], \"<name>_scale\" F32 [out];\n"
      "heavy-tailed rows add \"<name>_residual\", \"<name>_residual_scale\", \"<name>_residual_rows\"; the\n"
      "model is calibrated first, and the inputs' outlier channels are kept in f32: \"<name>_outlier_channels\",\n"
      "\"<name>_outlier_weight\"); `heads embed --model OUT_DIR` then runs in int8 on these weights as stored,\n"
      "bit for bit what `--dtype int8` gives on the original. bf16 / f16: every\n"
      "floating tensor of any model, widened to f32 when loaded. Other files are copied; OUT_DIR must\n"
      "be absent or empty, and appears whole or not at all.");
  c->add_option("model_dir", args->model, "model directory (model.safetensors, config.json, ...)")->required();
  c->add_option("out_dir", args->out, "output directory (absent or empty)")->required();
  c->add_option("--dtype", args->dtype, "int8 (linear weights of a BERT encoder), bf16 or f16 (every weight)")
      ->capture_default_str()
      ->check(CLI::IsMember({"int8", "bf16", "f16"}));
  c->add_flag("--quiet", args->quiet, "no summary on stderr");
  c->callback([args, action] { *action = [args] { run(*args); }; });
}

}  // namespace heads::cli
