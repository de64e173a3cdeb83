// cmd_generate.cc — `heads generate`: greedy decoding with a transformers decoder checkpoint and a
// KV cache (llama, mistral, qwen2, gemma2, gpt2, bloom; include/heads/causal_lm.h).
#include "commands.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "options.h"
#include "heads/causal_lm.h"
#include "heads/tokenizer.h"

namespace heads::cli {

namespace {

struct GenerateArgs {
  std::string model, input_ids, prompt, cache_dtype = "f32", dtype = "f32";
  bool has_prompt = false;
  int64_t max_new_tokens = 16, eos = -2;  // -2: not given
  bool json = false;
  int threads = 0;
  double activation_error = 0;
};

void run(const GenerateArgs& a) {
  apply_threads(a.threads);
  HEADS_CHECK(a.cache_dtype == "f32" || a.cache_dtype == "bf16" || a.cache_dtype == "int8",
              "generate: --cache-dtype must be f32, bf16 or int8, got ", a.cache_dtype);
  const DType cache_dtype = a.cache_dtype == "bf16" ? DType::BF16 : a.cache_dtype == "int8" ? DType::I8 : DType::F32;
  HEADS_CHECK(a.has_prompt != !a.input_ids.empty(), "generate: give the prompt as --prompt TEXT or as --input-ids");
  HEADS_CHECK(a.activation_error == 0 || a.dtype == "int8", "generate: --activation-error is for --dtype int8, not ",
              a.dtype);
  CausalLM lm = CausalLM::load(a.model);
  lm.set_precision(precision_from_name(a.dtype), a.activation_error);
  // Text in: the directory's tokenizer (its special tokens added, as transformers' tokenizer(prompt)),
  // and by default its end-of-sequence id; ids in: no end unless given.
  Tokenizer tok;
  std::vector<int64_t> prompt;
  int64_t eos = a.eos >= 0 ? a.eos : -1;
  if (a.has_prompt) {
    tok = Tokenizer::from_directory(a.model);
    prompt = tok.encode(a.prompt).ids;
    HEADS_CHECK(!prompt.empty(), "generate: --prompt gives no tokens");
    if (a.eos == -2) eos = CausalLM::eos_token_id(a.model);
  } else {
    prompt = int_list(a.input_ids);
  }
  // On a terminal the text is printed as it grows: the new ids decoded so far, less what is already
  // shown, held back while it ends in an incomplete character (U+FFFD).
  const bool stream = a.has_prompt && !a.json && isatty(STDOUT_FILENO);
  std::vector<int64_t> so_far;
  std::string shown;
  const auto on_token = [&](int64_t id) {
    so_far.push_back(id);
    const std::string text = tok.decode(so_far);
    if (text.size() < shown.size() || text.compare(0, shown.size(), shown) != 0) return;  // rewritten: wait
    if (text.size() >= 3 && text.compare(text.size() - 3, 3, "\xef\xbf\xbd") == 0) return;
    std::fwrite(text.data() + shown.size(), 1, text.size() - shown.size(), stdout);
    std::fflush(stdout);
    shown = text;
  };
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int64_t> ids =
      lm.generate(prompt, a.max_new_tokens, eos, cache_dtype, stream ? std::function<void(int64_t)>(on_token) : nullptr);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (a.has_prompt) {
    const std::string text = tok.decode(ids);
    if (a.json) {
      std::printf("%s\n", nlohmann::json({{"ids", ids}, {"text", text}}).dump(-1, ' ', false,
                                                                            nlohmann::json::error_handler_t::replace)
                                .c_str());
    } else if (stream) {
      std::printf("%s\n", text.size() >= shown.size() && text.compare(0, shown.size(), shown) == 0
                              ? text.substr(shown.size()).c_str()
                              : ("\n" + text).c_str());
    } else {
      std::printf("%s\n", text.c_str());
    }
  } else {
    std::string list;
    for (int64_t id : ids) list += (list.empty() ? "" : a.json ? "," : " ") + std::to_string(id);
    std::printf(a.json ? "{\"ids\": [%s]}\n" : "%s\n", list.c_str());
  }
  std::fprintf(stderr, "generate: %zu tokens in %.1f ms (%s, %s weights, %s cache)\n", ids.size(), ms,
               lm.config().model_type.c_str(), a.dtype.c_str(), a.cache_dtype.c_str());
}

}  // namespace

void add_generate_command(CLI::App& app, Action* action) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* c = app.add_subcommand(
      "generate",
      "Greedy decoding with a decoder checkpoint written by transformers' save_pretrained (config.json +\n"
      "model.safetensors or its shards; model_type llama, mistral, qwen2, gemma2, gpt2, bloom), using a KV\n"
      "cache. --prompt TEXT: tokenized with the directory's tokenizer.json, the continuation printed as text\n"
      "(streamed on a terminal), stopping at the directory's eos_token_id; --input-ids: the new ids printed\n"
      "(--json: {\"ids\": [...]}, with \"text\" for a prompt).");
  c->add_option("--model", args->model, "model directory")->required();
  auto* text = c->add_option("--prompt", args->prompt, "the prompt as text");
  auto* ids = c->add_option("--input-ids", args->input_ids, "the prompt as token ids, comma-separated")
                  ->check(int_list_in(0, kMaxCount));
  text->excludes(ids);
  text->each([args](const std::string&) { args->has_prompt = true; });
  c->add_option("--max-new-tokens", args->max_new_tokens, "new tokens at most")
      ->capture_default_str()
      ->check(int_in(0, kMaxCount));
  c->add_option("--eos-token-id", args->eos, "stop after this id (default: the directory's with --prompt, else none)")
      ->check(int_in(0, kMaxCount));
  c->add_option("--dtype", args->dtype, "weights of the projections, MLP and head: f32, bf16 or int8")
      ->capture_default_str();
  c->add_option("--cache-dtype", args->cache_dtype, "KV cache storage: f32, bf16 or int8 (a scale per position and kv head; "
                "the decode reads it in place)")->capture_default_str();
  c->add_option("--activation-error", args->activation_error,
                "int8: 0 gives every activation row two int8 terms, inf one (prompts about 1.6x faster, about 1.5x "
                "the logits' error)")
      ->capture_default_str()
      ->check(nonnegative_or_inf());
  c->add_flag("--json", args->json, "one JSON line");
  add_threads_option(c, &args->threads);
  c->callback([args, action] { *action = [args] { run(*args); }; });
}

}  // namespace heads::cli
