// cmd_mha.cc — `heads mha`: torch.nn.MultiheadAttention (eval) forward on safetensors files.
#include "commands.h"

#include <string>

#include "options.h"
#include "heads/mha.h"
#include "heads/safetensors.h"

namespace heads::cli {

namespace {

struct MhaArgs {
  std::string state, input, output;
  int64_t num_heads = 0;
  bool batch_first = false, causal = false, need_weights = false, no_average = false;
  bool add_zero_attn = false;
  int threads = 0;
};

// Masks may come as BOOL, U8 or I64 (non-zero = masked out) or as floats (added).
Tensor read_mask(const SafeTensors& f, const std::string& name) {
  if (!f.contains(name)) return {};
  Tensor m = f.get(name);
  if (m.dtype() == DType::U8 || m.dtype() == DType::I64) return m.to(DType::Bool);
  return m;
}

void run(const MhaArgs& a) {
  apply_threads(a.threads);
  const SafeTensors state = SafeTensors::open(a.state);
  StateDict sd;
  for (const auto& n : state.names()) sd.emplace_back(n, state.get(n));
  MultiheadAttention mha = [&] {
    try {
      return MultiheadAttention::from_state_dict(sd, a.num_heads, a.batch_first, a.add_zero_attn);
    } catch (const Error& e) {
      fail(e.what(), " (state ", a.state, ")");
    }
  }();
  mha.eval();

  const SafeTensors in = SafeTensors::open(a.input);
  HEADS_CHECK(in.contains("query"), a.input, ": tensor \"query\" missing (have: ",
              [&] {
                std::string s;
                for (const auto& n : in.names()) s += (s.empty() ? "" : ", ") + n;
                return s.empty() ? std::string("none") : s;
              }(),
              ")");
  const Tensor query = in.get("query");
  const Tensor key = in.contains("key") ? in.get("key") : query;
  const Tensor value = in.contains("value") ? in.get("value") : (in.contains("key") ? key : query);
  MhaForwardArgs fa;
  fa.key_padding_mask = read_mask(in, "key_padding_mask");
  fa.attn_mask = read_mask(in, "attn_mask");
  fa.need_weights = a.need_weights;
  fa.average_attn_weights = !a.no_average;
  fa.is_causal = a.causal;
  auto [out, weights] = mha.forward(query, key, value, fa);

  std::vector<std::pair<std::string, Tensor>> tensors{{"output", out}};
  if (a.need_weights) tensors.emplace_back("attn_weights", weights);
  save_safetensors(a.output, tensors, {{"producer", "heads mha"}});
}

}  // namespace

void add_mha_command(CLI::App& app, Action* action) {
  auto args = std::make_shared<MhaArgs>();
  CLI::App* c = app.add_subcommand(
      "mha",
      "torch.nn.MultiheadAttention forward (eval, float32) on tensors from safetensors files.\n"
      "STATE holds the module's state dict under PyTorch's names (in_proj_weight or\n"
      "q/k/v_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias, bias_k, bias_v);\n"
      "INPUT holds `query` and optionally `key`, `value` (default: query), `key_padding_mask`,\n"
      "`attn_mask` (bool/u8/i64: non-zero = masked out; float: added). OUTPUT receives\n"
      "`output` and, with --need-weights, `attn_weights`.");
  c->add_option("--state", args->state, "state dict (.safetensors)")->required();
  c->add_option("--input", args->input, "inputs (.safetensors)")->required();
  c->add_option("--output", args->output, "where to write the results (.safetensors)")->required();
  c->add_option("--num-heads", args->num_heads, "number of heads")->required()->check(int_in(1, kMaxCount));
  c->add_flag("--batch-first", args->batch_first, "inputs are [N, L, E] instead of [L, N, E]");
  c->add_flag("--causal", args->causal,
              "causal attention (is_causal; with an attn_mask it is torch's hint)");
  c->add_flag("--need-weights", args->need_weights, "also write attn_weights");
  c->add_flag("--no-average-weights", args->no_average,
              "attn_weights per head [N, H, L, S] instead of averaged [N, L, S]");
  c->add_flag("--add-zero-attn", args->add_zero_attn,
              "the module was built with add_zero_attn=True (not visible in a state dict)");
  add_threads_option(c, &args->threads);
  c->callback([args, action] { *action = [args] { run(*args); }; });
}

}  // namespace heads::cli
