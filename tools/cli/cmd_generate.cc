// cmd_generate.cc — `heads generate`: greedy decoding with a transformers decoder checkpoint and a
// KV cache (llama, mistral, qwen2, gemma2, gpt2, bloom; include/heads/causal_lm.h).
#include "commands.h"

#include <chrono>
#include <cstdio>
#include <string>

#include "options.h"
#include "heads/causal_lm.h"

namespace heads::cli {

namespace {

struct GenerateArgs {
  std::string model, input_ids, cache_dtype = "f32", dtype = "f32";
  int64_t max_new_tokens = 16, eos = -1;
  bool json = false;
  int threads = 0;
};

void run(const GenerateArgs& a) {
  apply_threads(a.threads);
  HEADS_CHECK(a.cache_dtype == "f32" || a.cache_dtype == "bf16" || a.cache_dtype == "int8",
              "generate: --cache-dtype must be f32, bf16 or int8, got ", a.cache_dtype);
  const DType cache_dtype = a.cache_dtype == "bf16" ? DType::BF16 : a.cache_dtype == "int8" ? DType::I8 : DType::F32;
  const std::vector<int64_t> prompt = int_list(a.input_ids);
  CausalLM lm = CausalLM::load(a.model);
  lm.set_precision(precision_from_name(a.dtype));
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int64_t> ids =
      lm.generate(prompt, a.max_new_tokens, a.eos, cache_dtype);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::string list;
  for (int64_t id : ids) list += (list.empty() ? "" : a.json ? "," : " ") + std::to_string(id);
  std::printf(a.json ? "{\"ids\": [%s]}\n" : "%s\n", list.c_str());
  std::fprintf(stderr, "generate: %zu tokens in %.1f ms (%s, %s weights, %s cache)\n", ids.size(), ms,
               lm.config().model_type.c_str(), a.dtype.c_str(), a.cache_dtype.c_str());
}

}  // namespace

void add_generate_command(CLI::App& app, Action* action) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* c = app.add_subcommand(
      "generate",
      "Greedy decoding from token ids with a decoder checkpoint written by transformers' save_pretrained\n"
      "(config.json + model.safetensors or its shards; model_type llama, mistral, qwen2, gemma2, gpt2, bloom),\n"
      "using a KV cache. Prints the new ids (--json: {\"ids\": [...]}).");
  c->add_option("--model", args->model, "model directory")->required();
  c->add_option("--input-ids", args->input_ids, "prompt token ids, comma-separated")
      ->required()
      ->check(int_list_in(0, kMaxCount));
  c->add_option("--max-new-tokens", args->max_new_tokens, "new tokens at most")
      ->capture_default_str()
      ->check(int_in(0, kMaxCount));
  c->add_option("--eos-token-id", args->eos, "stop after this id (default: none)")->check(int_in(0, kMaxCount));
  c->add_option("--dtype", args->dtype, "weights of the projections, MLP and head: f32, bf16 or int8")
      ->capture_default_str();
  c->add_option("--cache-dtype", args->cache_dtype, "KV cache storage: f32, bf16 or int8 (a scale per position and kv head; "
                "the decode reads it in place)")->capture_default_str();
  c->add_flag("--json", args->json, "one JSON line");
  add_threads_option(c, &args->threads);
  c->callback([args, action] { *action = [args] { run(*args); }; });
}

}  // namespace heads::cli
