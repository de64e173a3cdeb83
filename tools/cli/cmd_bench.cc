// cmd_bench.cc — `heads bench sdpa|mha|linear|embed|peak`: time one shape (or, for sdpa, a grid of shapes),
// report the median (DESIGN.md contract). `heads bench sdpa` itself is cmd_bench_sdpa.cc; what the
// subcommands share, bench.h.
//
// Warm-up, then repeats until at least --min-time seconds (default 1) and 5 runs; reports the
// median. flops = 4·B·H·Lq·Lk·D for sdpa (half when causal); mha adds 2·B·L·E·E per projection.
#include "commands.h"
#include "bench.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "options.h"
#include "heads/mha.h"
#include "heads/precision.h"
#include "heads/runtime.h"
#include "heads/sdpa.h"
#include "heads/sentence_encoder.h"

namespace heads::cli {

namespace bench {

Tensor random_tensor(const Shape& shape, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = d(gen);
  return t;
}

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

DType parse_dtype(const std::string& dtype) {
  if (dtype == "f32") return DType::F32;
  if (dtype == "bf16") return DType::BF16;
  fail("bench: --dtype must be f32 or bf16, got ", dtype);
}

namespace {

void run_mha(const BenchArgs& a) {
  apply_threads(a.threads);
  MultiheadAttentionOptions o;
  o.embed_dim = a.E;
  o.num_heads = a.H;
  o.batch_first = true;
  MultiheadAttention m(o, 1);
  m.eval();
  m.set_precision(precision_from_name(a.dtype));
  const Tensor x = random_tensor({a.B, a.L, a.E}, 4);
  MhaForwardArgs fa;
  fa.need_weights = false;
  const double ms = median_ms([&] { m.forward(x, x, x, fa); }, a.min_time);
  const double flops = 4.0 * a.B * a.L * a.L * a.E + 4 * 2.0 * a.B * a.L * a.E * a.E;
  const double gflops = flops / ms / 1e6;
  if (a.json) {
    std::printf("{\"op\":\"mha\",\"B\":%lld,\"L\":%lld,\"E\":%lld,\"H\":%lld,\"dtype\":\"%s\",\"isa\":\"%s\","
                "\"threads\":%d,\"ms\":%.4f,\"gflops\":%.2f,\"peak_rss_mb\":%.1f}\n",
                (long long)a.B, (long long)a.L, (long long)a.E, (long long)a.H, a.dtype.c_str(),
                isa_name(active_isa()).c_str(), get_num_threads(), ms, gflops, peak_rss_mb());
  } else {
    std::printf("mha B=%lld L=%lld E=%lld H=%lld %s %s threads=%d: %.3f ms, %.1f GFLOP/s, "
                "peak RSS %.1f MB\n",
                (long long)a.B, (long long)a.L, (long long)a.E, (long long)a.H, a.dtype.c_str(),
                isa_name(active_isa()).c_str(), get_num_threads(), ms, gflops, peak_rss_mb());
  }
}

// One linear layer y = x Wᵀ + b through a packed weight (heads/precision.h): W [N, K] and x [M, K]
// normal, int8 with --activation-error (0: two activation terms on every row; inf: one, as the
// calibrated models run) and --residual-error (the weight rows' residual term: inf, none, as the
// calibrated encoders' d_model-wide layers). flops = 2·M·N·K.
void run_linear(const BenchArgs& a) {
  apply_threads(a.threads);
  const Precision p = precision_from_name(a.dtype);
  const Tensor W = random_tensor({a.N, a.K}, 2), x = random_tensor({a.M, a.K}, 3), b = random_tensor({a.N}, 5);
  const PackedLinear w(W, p, p == Precision::Int8 ? a.activation_error : 0.0, Tensor{}, a.residual_error);
  const double ms = median_ms([&] { linear(x, w, b); }, a.min_time);
  const double gflops = 2.0 * a.M * a.N * a.K / ms / 1e6;
  const std::string route = linear_gemm_route(w);
  if (a.json) {
    std::printf("{\"op\":\"linear\",\"M\":%lld,\"K\":%lld,\"N\":%lld,\"dtype\":\"%s\",\"route\":\"%s\",\"isa\":\"%s\","
                "\"threads\":%d,\"ms\":%.4f,\"gflops\":%.2f}\n",
                (long long)a.M, (long long)a.K, (long long)a.N, a.dtype.c_str(), route.c_str(),
                isa_name(active_isa()).c_str(), get_num_threads(), ms, gflops);
  } else {
    std::printf("linear M=%lld K=%lld N=%lld %s (%s GEMM) %s threads=%d: %.3f ms, %.1f GFLOP/s\n", (long long)a.M,
                (long long)a.K, (long long)a.N, a.dtype.c_str(), route.c_str(), isa_name(active_isa()).c_str(),
                get_num_threads(), ms, gflops);
  }
}

void run_embed(const BenchArgs& a) {
  apply_threads(a.threads);
  if (a.batch_invariant) set_batch_invariant(true);
  const std::vector<std::string> texts = read_lines(a.input);
  HEADS_CHECK(!texts.empty(), a.input, ": no lines");
  const SentenceEncoder enc = SentenceEncoder::load(model_dir(a.model), precision_choice(a.embed_dtype));
  check_batch_invariance(enc.precision());
  const std::string dtype = precision_name(enc.precision());
  int64_t tokens = 0;
  for (const auto& t : texts) tokens += static_cast<int64_t>(enc.tokenize(t).size());
  const double ms = median_ms([&] { enc.encode(texts, a.batch_size); }, a.min_time);
  const double per_s = static_cast<double>(texts.size()) / ms * 1e3;
  if (a.json) {
    std::printf("{\"op\":\"embed\",\"dtype\":\"%s\",\"sentences\":%zu,\"tokens\":%lld,\"batch_size\":%lld,\"isa\":\"%s\","
                "\"threads\":%d,\"ms\":%.3f,\"sentences_per_s\":%.1f,\"tokens_per_s\":%.0f,\"peak_rss_mb\":%.1f}\n",
                dtype.c_str(), texts.size(), static_cast<long long>(tokens), static_cast<long long>(a.batch_size),
                isa_name(active_isa()).c_str(), get_num_threads(), ms, per_s,
                static_cast<double>(tokens) / ms * 1e3, peak_rss_mb());
  } else {
    std::printf("embed %zu sentences (%lld tokens), %s, batch %lld, %s threads=%d: %.1f ms, %.1f sentences/s, "
                "%.0f tokens/s\n",
                texts.size(), static_cast<long long>(tokens), dtype.c_str(), static_cast<long long>(a.batch_size),
                isa_name(active_isa()).c_str(), get_num_threads(), ms, per_s,
                static_cast<double>(tokens) / ms * 1e3);
  }
}

void run_peak(const BenchArgs& a) {
  apply_threads(a.threads);
  const int threads = get_num_threads();
  const double g1 = measure_fma_peak_gflops(1, a.min_time / 5);
  const double gn = threads > 1 ? measure_fma_peak_gflops(threads, a.min_time / 5) : g1;
  const double bf = measure_bf16_peak_gflops(threads, a.min_time / 5);
  const double tiles = measure_amx_peak_gflops(threads, a.min_time / 5);
  const double read = measure_read_bandwidth_gbs(threads, a.min_time / 5);
  const char* products = bf16_attention_products();
  if (a.json) {
    std::printf("{\"op\":\"peak\",\"isa\":\"%s\",\"gflops_1\":%.1f,\"threads\":%d,\"gflops\":%.1f,"
                "\"bf16_gflops\":%.1f,\"amx_bf16_gflops\":%.1f,\"read_gbs\":%.1f,\"bf16_attention\":\"%s\",\"amx\":%s,"
                "\"cpu\":%s}\n",
                isa_name(active_isa()).c_str(), g1, threads, gn, bf, tiles, read, products,
                nlohmann::json(amx_status()).dump().c_str(), nlohmann::json(cpu_features()).dump().c_str());
  } else {
    std::printf("f32 FMA peak (%s): %.1f GFLOP/s on 1 thread, %.1f on %d threads\n",
                isa_name(active_isa()).c_str(), g1, gn, threads);
    if (bf > 0) {
      std::printf("bf16 dot peak (%s): %.1f GFLOP/s on %d threads\n",
                  active_isa() == Isa::NeonBf16 ? "BFDOT" : "vdpbf16ps", bf, threads);
    }
    if (tiles > 0) std::printf("bf16 AMX tile peak (tdpbf16ps): %.1f GFLOP/s on %d threads\n", tiles, threads);
    std::printf("memory read bandwidth: %.1f GB/s on %d threads (1 GiB buffer)\n", read, threads);
    std::printf("bf16 attention products: %s\n", products);
    std::printf("AMX: %s\n", amx_status().c_str());
    std::printf("CPU features: %s\n", cpu_features().c_str());
  }
}

}  // namespace

}  // namespace bench

void add_bench_command(CLI::App& app, Action* action) {
  auto args = std::make_shared<bench::BenchArgs>();
  CLI::App* group = app.add_subcommand("bench", "Time an operation on random inputs (median of repeats).");
  group->require_subcommand(1);

  CLI::App* s = group->add_subcommand(
      "sdpa", "Scaled dot-product attention forward. Each size takes a comma-separated list "
              "(--heads 1,4,8,16 --q-len 128,512,2048): every combination is timed, one JSON line each with "
              "--json, else one line each and a table.");
  auto sizes = [&](const char* flag, std::string* v, const char* what) {
    CLI::Option* o = s->add_option(flag, *v, what)->check(int_list_in(1, kMaxCount));
    if (!v->empty()) o->capture_default_str();
  };
  sizes("--batch", &args->grid_B, "B");
  sizes("--heads", &args->grid_H, "query heads H");
  sizes("--kv-heads", &args->grid_Hkv, "key/value heads Hkv (default H)");
  sizes("--q-len", &args->grid_Lq, "query length Lq");
  sizes("--kv-len", &args->grid_Lk, "key length Lk (default Lq)");
  sizes("--head-dim", &args->grid_D, "head dim D");
  sizes("--v-dim", &args->grid_Dv, "value head dim Dv (default D)");
  s->add_flag("--causal", args->causal, "causal mask (flops counted half)");
  s->add_option("--window", args->window,
                "LEFT,RIGHT: sliding-window extents around the diagonal (-1 = unbounded; flops count the visible "
                "pairs only)");
  s->add_option("--softcap", args->softcap, "logit softcap (0 = none)")->check(real_in(0.0, 1e30));
  s->add_flag("--alibi", args->alibi, "ALiBi bias with the standard slopes of --heads");
  s->add_flag("--sinks", args->sinks, "a random attention-sink logit per head");
  s->add_option("--block-sparse", args->block_sparse,
                "DENSITY[,BLOCK]: a random per-head block layout keeping that share of BLOCK x BLOCK blocks "
                "(default 128; flops count that share)");
  s->add_option("--heads-off", args->heads_off,
                "N: head_mask turns N random heads of each batch entry off (gated-off heads are skipped; flops "
                "count the heads computed)")
      ->check(int_in(0, kMaxCount));
  s->add_option("--mask", args->mask, "attn_mask [B, 1, Lq, Lk]: none, bool (80% visible) or float")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "bool", "float"}));
  s->add_option("--dropout", args->dropout, "dropout_p")->capture_default_str()->check(real_in(0.0, 1.0));
  s->add_option("--pad", args->pad, "q, k, v as views of [B, L, H, D + PAD] memory (a projection's layout)")
      ->capture_default_str()->check(int_in(0, kMaxCount));
  s->add_option("--seed", args->seed, "seed of the random inputs")->capture_default_str()->check(int_in(0, INT64_MAX));
  s->add_flag("--backward", args->backward,
              "time forward + backward (flops: 3.5x the forward's); JSON adds backward_ms (that time minus "
              "the forward alone) and backward_call_ms (the backward call itself, timed in the same loop)");
  s->add_option("--dtype", args->dtype, "f32 or bf16 (q, k, v and out in bf16, f32 accumulation)")->capture_default_str();
  s->add_option("--kv-dtype", args->kv_dtype,
                "K/V storage, as a KV cache holds them: f32, bf16 or int8 (a scale per position and kv head); "
                "default --dtype's. The query and output keep --dtype. JSON adds kv_dtype and kv_gbs (bytes of K, V "
                "and scales / time)")
      ->check(CLI::IsMember({"f32", "bf16", "int8"}));
  add_threads_option(s, &args->threads);
  s->add_option("--min-time", args->min_time, "seconds of repeats")->capture_default_str()->check(real_in(0, 3600));
  s->add_flag("--json", args->json, "one JSON line (per point of a grid)");
  s->callback([args, action] { *action = [args] { bench::run_sdpa(*args); }; });

  CLI::App* m = group->add_subcommand("mha", "MultiheadAttention forward (self-attention, batch_first, eval).");
  m->add_option("--batch", args->B, "B")->capture_default_str()->check(int_in(1, kMaxCount));
  m->add_option("--seq", args->L, "sequence length L")->capture_default_str()->check(int_in(1, kMaxCount));
  m->add_option("--embed", args->E, "embed_dim E")->capture_default_str()->check(int_in(1, kMaxCount));
  m->add_option("--heads", args->H, "heads H")->capture_default_str()->check(int_in(1, kMaxCount));
  add_precision_option(m, &args->dtype);
  add_threads_option(m, &args->threads);
  m->add_option("--min-time", args->min_time, "seconds of repeats")->capture_default_str()->check(real_in(0, 3600));
  m->add_flag("--json", args->json, "one JSON line");
  m->callback([args, action] { *action = [args] { bench::run_mha(*args); }; });

  CLI::App* li = group->add_subcommand(
      "linear", "One linear layer y = x W^T + b (random normal x [M, K], W [N, K]) through a weight packed for --dtype.");
  li->add_option("--rows", args->M, "rows of x, M")->capture_default_str()->check(int_in(1, kMaxCount));
  li->add_option("--in", args->K, "in_features K")->capture_default_str()->check(int_in(1, kMaxCount));
  li->add_option("--out", args->N, "out_features N")->capture_default_str()->check(int_in(1, kMaxCount));
  li->add_option("--dtype", args->dtype, "f32, bf16 or int8 (heads/precision.h)")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16", "int8"}));
  li->add_option("--activation-error", args->activation_error,
                 "int8: the weight's activation_error: 0 gives every activation row two terms, inf one (the "
                 "calibrated encoders' scheme)")
      ->capture_default_str()
      ->check(nonnegative_or_inf());
  li->add_option("--residual-error", args->residual_error,
                 "int8: the weight's residual_error: the fraction of a weight row's norm its rounding may lose "
                 "before the row gets a residual term; inf: no row does (the calibrated encoders' d_model-wide "
                 "layers)")
      ->capture_default_str()
      ->check(nonnegative_or_inf());
  add_threads_option(li, &args->threads);
  li->add_option("--min-time", args->min_time, "seconds of repeats")->capture_default_str()->check(real_in(0, 3600));
  li->add_flag("--json", args->json, "one JSON line (with the GEMM route: native, heads, f32 or portable)");
  li->callback([args, action] { *action = [args] { bench::run_linear(*args); }; });

  CLI::App* e = group->add_subcommand(
      "embed", "Sentence embeddings per second (tokenize, encode, pool) on a file of one text per line.");
  e->add_option("--input", args->input, "texts, one per line (e.g. bench/sentences.txt)")->required();
  add_model_option(e, &args->model);
  add_precision_option(e, &args->embed_dtype, true);
  e->add_option("--batch-size", args->batch_size, "texts per batch")->capture_default_str()->check(int_in(1, kMaxCount));
  add_threads_option(e, &args->threads);
  add_batch_invariant_option(e, &args->batch_invariant);
  e->add_option("--min-time", args->min_time, "seconds of repeats")->capture_default_str()->check(real_in(0, 3600));
  e->add_flag("--json", args->json, "one JSON line");
  e->callback([args, action] { *action = [args] { bench::run_embed(*args); }; });

  CLI::App* p = group->add_subcommand("peak", "Measured f32 FMA throughput of this machine (and its bf16 dot product and AMX tiles, where the path has them), and its memory read bandwidth.");
  add_threads_option(p, &args->threads);
  p->add_option("--min-time", args->min_time, "seconds of measurement")->capture_default_str()->check(real_in(0, 3600));
  p->add_flag("--json", args->json, "one JSON line");
  p->callback([args, action] { *action = [args] { bench::run_peak(*args); }; });
}

}  // namespace heads::cli
