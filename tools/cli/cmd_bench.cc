// cmd_bench.cc — `heads bench sdpa|mha|linear|embed|peak`: time one shape (or, for sdpa, a grid of shapes),
// report the median (DESIGN.md contract).
//
// Warm-up, then repeats until at least --min-time seconds (default 1) and 5 runs; reports the
// median. flops = 4·B·H·Lq·Lk·D for sdpa (half when causal); mha adds 2·B·L·E·E per projection.
// sdpa --backward: forward alone and forward + backward timed in alternating blocks (8 rounds).
#include "commands.h"

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
#include "kernels/sdpa_case.h"
#include "heads/sentence_encoder.h"

namespace heads::cli {

namespace {

struct BenchArgs {
  std::string model, input;
  int64_t batch_size = 32;
  int64_t B = 1, H = 1, Hkv = 0, Lq = 128, Lk = 0, D = 64, Dv = 0, L = 128, E = 768, pad = 0;
  int64_t M = 256, K = 384, N = 1536;  // bench linear
  double activation_error = 0.0;
  bool causal = false, json = false, backward = false;
  std::string dtype = "f32", mask = "none", window;
  std::string kv_dtype;  // bench sdpa: K/V storage (empty: --dtype's)
  std::string embed_dtype = "auto";  // bench embed: as the model directory stores it by default
  double dropout = 0.0, softcap = 0.0;
  bool alibi = false, sinks = false, batch_invariant = false;
  std::string block_sparse;  // DENSITY,BLOCK
  int64_t heads_off = 0;     // heads per batch entry turned off by head_mask (gated off)
  uint64_t seed = 1;
  int threads = 0;
  double min_time = 1.0;
  // bench sdpa: each size a comma-separated list; every combination is timed (a grid).
  std::string grid_B = "1", grid_H = "1", grid_Hkv, grid_Lq = "128", grid_Lk, grid_D = "64", grid_Dv;
};

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

// Runs of fn (at least min_runs) until `seconds` have passed, each run's milliseconds appended to ms.
template <class F>
void time_runs(F&& fn, double seconds, size_t min_runs, std::vector<double>& ms) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (size_t n = 0; n < min_runs || std::chrono::duration<double>(clock::now() - start).count() < seconds; ++n) {
    const auto t0 = clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
  }
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// Median milliseconds of fn over repeats lasting at least min_time seconds.
template <class F>
double median_ms(F&& fn, double min_time) {
  fn();  // warm-up
  std::vector<double> ms;
  time_runs(fn, min_time, 5, ms);
  return median(ms);
}

DType parse_dtype(const std::string& dtype) {
  if (dtype == "f32") return DType::F32;
  if (dtype == "bf16") return DType::BF16;
  fail("bench: --dtype must be f32 or bf16, got ", dtype);
}

// The case `heads bench sdpa` times, from its flags.
SdpaCase sdpa_case(const BenchArgs& a) {
  SdpaCase c;
  c.B = a.B;
  c.H = a.H;
  c.Hkv = a.Hkv;
  c.Lq = a.Lq;
  c.Lk = a.Lk;
  c.D = a.D;
  c.Dv = a.Dv;
  c.dtype = parse_dtype(a.dtype);
  c.causal = a.causal;
  c.mask = a.mask == "bool" ? SdpaMask::Bool : a.mask == "float" ? SdpaMask::Float : SdpaMask::None;
  c.dropout_p = a.dropout;
  c.pad = a.pad;
  c.seed = a.seed;
  return c;
}

struct SdpaTiming {
  SdpaCase c;
  double ms, gflops;
};

// --window LEFT,RIGHT as the two extents (-1: unbounded).
std::pair<int64_t, int64_t> window_extents(const std::string& w) {
  if (w.empty()) return {-1, -1};
  const size_t comma = w.find(',');
  HEADS_CHECK(comma != std::string::npos, "bench sdpa: --window: expected LEFT,RIGHT (-1 = unbounded), got '", w, "'");
  try {
    size_t n1 = 0, n2 = 0;
    const long long l = std::stoll(w.substr(0, comma), &n1), r = std::stoll(w.substr(comma + 1), &n2);
    HEADS_CHECK(n1 == comma && n2 == w.size() - comma - 1 && l >= -1 && r >= -1, "");
    return {l, r};
  } catch (const std::exception&) {
    fail("bench sdpa: --window: expected LEFT,RIGHT with each -1 (unbounded) or >= 0, got '", w, "'");
  }
}

// (query, key) pairs the band lets through, for the FLOP count of a windowed call.
double visible_pairs(const SdpaCase& c, int64_t left, int64_t right) {
  double n = 0;
  const int64_t Lk = c.key_len(), a = c.causal_align == CausalAlign::BottomRight ? Lk - c.Lq : 0;
  const int64_t r = c.causal ? 0 : right;
  for (int64_t i = 0; i < c.Lq; ++i) {
    const int64_t hi = r < 0 ? Lk : std::clamp<int64_t>(i + a + r + 1, 0, Lk);
    const int64_t lo = left < 0 ? 0 : std::clamp<int64_t>(i + a - left, 0, Lk);
    n += static_cast<double>(std::max<int64_t>(0, hi - lo));
  }
  return n;
}

SdpaTiming time_sdpa(const BenchArgs& a) {
  const SdpaCase c = sdpa_case(a);
  SdpaCase::Inputs in = c.draw();
  SdpaOptions o = in.options;
  // K and V stored as a cache stores them (the query keeps --dtype): bf16, or int8 with a scale per row
  const std::string kv_dtype = a.kv_dtype.empty() ? a.dtype : a.kv_dtype;
  if (kv_dtype != a.dtype) {
    HEADS_CHECK(!a.backward, "bench sdpa: --backward takes K/V of the query's dtype (--kv-dtype ", kv_dtype,
                " is for inference)");
    if (kv_dtype == "int8") {
      const Int8Rows qk = quantize_kv(in.k), qv = quantize_kv(in.v);
      in.k = qk.values;
      in.v = qv.values;
      o.k_scale = qk.scales;
      o.v_scale = qv.scales;
    } else {
      in.k = in.k.to(parse_dtype(kv_dtype));
      in.v = in.v.to(parse_dtype(kv_dtype));
    }
  }
  // bytes of K and V (and their scales) one forward reads at least once
  const double kv_bytes = static_cast<double>(in.k.numel()) * static_cast<double>(dtype_size(in.k.dtype())) +
                          static_cast<double>(in.v.numel()) * static_cast<double>(dtype_size(in.v.dtype())) +
                          (o.k_scale.defined() ? 4.0 * static_cast<double>(o.k_scale.numel() + o.v_scale.numel()) : 0.0);
  const auto [left, right] = window_extents(a.window);
  o.window_left = left;
  o.window_right = right;
  o.softcap = a.softcap;
  if (a.alibi) o.alibi_slopes = alibi_slopes(c.H);
  if (a.sinks) o.sinks = random_tensor({c.H}, a.seed + 1);
  double density = 1.0;
  if (!a.block_sparse.empty()) {  // a random per-head layout of that density
    const size_t comma = a.block_sparse.find(',');
    int64_t bs = 0;
    try {
      density = std::stod(a.block_sparse.substr(0, comma));
      bs = comma == std::string::npos ? 128 : std::stoll(a.block_sparse.substr(comma + 1));
    } catch (const std::exception&) {
      density = -1;
    }
    HEADS_CHECK(density > 0 && density <= 1 && bs >= 1, "bench sdpa: --block-sparse: expected DENSITY[,BLOCK] with ",
                "0 < DENSITY <= 1 and BLOCK >= 1, got '", a.block_sparse, "'");
    const int64_t nqb = (c.Lq + bs - 1) / bs, nkb = (c.key_len() + bs - 1) / bs;
    Tensor layout = Tensor::empty({c.H, nqb, nkb}, DType::Bool);
    std::mt19937_64 gen(a.seed + 2);
    std::bernoulli_distribution keep(density);
    for (int64_t x = 0; x < layout.numel(); ++x) static_cast<uint8_t*>(layout.raw_data())[x] = keep(gen);
    o.block_mask = layout;
    o.block_size = bs;
  }
  if (a.heads_off > 0) {  // that many heads of each batch entry off, chosen at random (seeded)
    HEADS_CHECK(a.heads_off < c.H, "bench sdpa: --heads-off: expected fewer than --heads (", c.H, "), got ", a.heads_off);
    Tensor hm = Tensor::empty({c.B, c.H}, DType::Bool);
    auto* on = static_cast<uint8_t*>(hm.raw_data());
    std::mt19937_64 gen(a.seed + 3);
    for (int64_t b = 0; b < c.B; ++b) {
      std::vector<int64_t> order(static_cast<size_t>(c.H));
      for (int64_t h = 0; h < c.H; ++h) order[static_cast<size_t>(h)] = h;
      std::shuffle(order.begin(), order.end(), gen);
      for (int64_t x = 0; x < c.H; ++x) on[b * c.H + order[static_cast<size_t>(x)]] = x >= a.heads_off;
    }
    o.head_mask = hm;
    density *= static_cast<double>(c.H - a.heads_off) / static_cast<double>(c.H);
  }
  const bool windowed = left >= 0 || right >= 0;
  std::string mods;  // the modifiers, as the case string shows them
  if (windowed) mods += " window=" + std::to_string(left) + "," + std::to_string(right);
  if (a.softcap > 0) {
    char buf[32];
    std::snprintf(buf, sizeof buf, " softcap=%g", a.softcap);
    mods += buf;
  }
  if (a.alibi) mods += " alibi";
  if (a.sinks) mods += " sinks";
  if (!a.block_sparse.empty()) mods += " block_sparse=" + a.block_sparse;
  if (a.heads_off > 0) mods += " heads_off=" + std::to_string(a.heads_off);
  Tensor out = Tensor::empty({c.B, c.H, c.Lq, c.value_dim()}, c.dtype);
  double ms = 0, bwd_ms = 0, bwd_call_ms = 0;
  if (!a.backward) {
    ms = median_ms([&] { sdpa_out(out, in.q, in.k, in.v, o); }, a.min_time);
  } else {  // forward + backward, as training runs them
    // Forward alone and forward + backward in alternating blocks, so that a slow spell of a shared
    // machine weighs on both medians alike; the backward call is also timed alone in its loop.
    constexpr int kRounds = 8;
    std::vector<double> fwd_runs, both_runs, calls;
    const auto forward = [&] { sdpa_out(out, in.q, in.k, in.v, o); };
    const Tensor dout = in.dout.to(c.dtype);
    const auto both = [&] {
      const SdpaResult f = sdpa(in.q, in.k, in.v, o);
      const auto t0 = std::chrono::steady_clock::now();
      sdpa_backward(dout, in.q, in.k, in.v, f, o);
      calls.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    };
    both();  // warm-up
    calls.clear();
    for (int r = 0; r < kRounds; ++r) {
      time_runs(forward, a.min_time / kRounds, 1, fwd_runs);
      time_runs(both, a.min_time / kRounds, 1, both_runs);
    }
    ms = median(both_runs);
    bwd_ms = ms - median(fwd_runs);
    bwd_call_ms = median(calls);
  }
  // The backward's five products are 2.5x the forward's two. A window counts only the pairs it lets through.
  // A block layout counts its density of the pairs (the expected share of blocks kept).
  const double fwd_flops = (windowed ? 2.0 * c.B * c.H * static_cast<double>(c.D + c.value_dim()) *
                                           visible_pairs(c, left, right)
                                     : c.forward_flops()) *
                           density;
  const double gflops = fwd_flops * (a.backward ? 3.5 : 1.0) / ms / 1e6;
  const std::string case_str = c.str() + mods;
  const std::string isa = isa_name(active_isa());
  if (a.json) {
    std::printf("{\"op\":\"sdpa\",\"B\":%lld,\"H\":%lld,\"Hkv\":%lld,\"Lq\":%lld,\"Lk\":%lld,\"D\":%lld,"
                "\"Dv\":%lld,\"causal\":%s,\"dtype\":\"%s\",\"kv_dtype\":\"%s\",\"isa\":\"%s\",\"threads\":%d,"
                "\"ms\":%.4f,\"gflops\":%.2f,\"kv_gbs\":%.2f,\"peak_rss_mb\":%.1f,\"case\":\"%s\"%s}\n",
                (long long)c.B, (long long)c.H, (long long)c.kv_heads(), (long long)c.Lq, (long long)c.key_len(),
                (long long)c.D, (long long)c.value_dim(), c.causal ? "true" : "false", a.dtype.c_str(),
                kv_dtype.c_str(), isa.c_str(), get_num_threads(), ms, gflops, kv_bytes / ms / 1e6, peak_rss_mb(),
                case_str.c_str(),
                a.backward ? (",\"backward\":true,\"backward_ms\":" + std::to_string(bwd_ms) +
                              ",\"backward_call_ms\":" + std::to_string(bwd_call_ms)).c_str()
                           : "");
  } else {
    if (a.backward) {
      std::printf("forward+backward (backward ~%.3f ms = this minus the forward alone; the backward call itself "
                  "%.3f ms): ",
                  bwd_ms, bwd_call_ms);
    }
    std::printf("sdpa %s%s %s threads=%d: %.3f ms, %.1f GFLOP/s, K/V read at %.1f GB/s, peak RSS %.1f MB\n",
                case_str.c_str(), kv_dtype != a.dtype ? (" kv=" + kv_dtype).c_str() : "", isa.c_str(), get_num_threads(),
                ms, gflops, kv_bytes / ms / 1e6, peak_rss_mb());
  }
  std::fflush(stdout);
  return {c, ms, gflops};
}

// Every combination of the size lists, in the order given (the last list varies fastest). One point
// prints as before; with --json, one line per point; otherwise a grid also prints one table.
void run_sdpa(const BenchArgs& a) {
  apply_threads(a.threads);
  std::vector<std::vector<int64_t>> lists;
  for (const std::string* s : {&a.grid_B, &a.grid_H, &a.grid_Hkv, &a.grid_Lq, &a.grid_Lk, &a.grid_D, &a.grid_Dv}) {
    lists.push_back(s->empty() ? std::vector<int64_t>{0} : int_list(*s));  // 0: "the default" (Hkv = H, ...)
  }
  size_t points = 1;
  for (const auto& l : lists) points *= l.size();
  std::vector<BenchArgs> grid;
  for (size_t p = 0; p < points; ++p) {
    BenchArgs one = a;
    int64_t* fields[] = {&one.B, &one.H, &one.Hkv, &one.Lq, &one.Lk, &one.D, &one.Dv};
    size_t rest = p;
    for (size_t f = lists.size(); f-- > 0;) {
      *fields[f] = lists[f][rest % lists[f].size()];
      rest /= lists[f].size();
    }
    // Every point is checked before any is timed.
    HEADS_CHECK(one.Hkv == 0 || one.H % one.Hkv == 0, "bench sdpa: --heads ", one.H,
                " is not a multiple of --kv-heads ", one.Hkv);
    grid.push_back(one);
  }
  std::vector<SdpaTiming> rows;
  for (const BenchArgs& one : grid) rows.push_back(time_sdpa(one));
  if (points == 1 || a.json) return;
  std::printf("\n| B | H | Hkv | Lq | Lk | D | Dv | ms | GFLOP/s |\n|---|---|---|---|---|---|---|---|---|\n");
  for (const SdpaTiming& r : rows) {
    std::printf("| %lld | %lld | %lld | %lld | %lld | %lld | %lld | %.3f | %.1f |\n", (long long)r.c.B, (long long)r.c.H,
                (long long)r.c.kv_heads(), (long long)r.c.Lq, (long long)r.c.key_len(), (long long)r.c.D,
                (long long)r.c.value_dim(), r.ms, r.gflops);
  }
}

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
// calibrated models run). flops = 2·M·N·K.
void run_linear(const BenchArgs& a) {
  apply_threads(a.threads);
  const Precision p = precision_from_name(a.dtype);
  const Tensor W = random_tensor({a.N, a.K}, 2), x = random_tensor({a.M, a.K}, 3), b = random_tensor({a.N}, 5);
  const PackedLinear w(W, p, p == Precision::Int8 ? a.activation_error : 0.0);
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

void add_bench_command(CLI::App& app, Action* action) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* bench = app.add_subcommand("bench", "Time an operation on random inputs (median of repeats).");
  bench->require_subcommand(1);

  CLI::App* s = bench->add_subcommand(
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
  s->callback([args, action] { *action = [args] { run_sdpa(*args); }; });

  CLI::App* m = bench->add_subcommand("mha", "MultiheadAttention forward (self-attention, batch_first, eval).");
  m->add_option("--batch", args->B, "B")->capture_default_str()->check(int_in(1, kMaxCount));
  m->add_option("--seq", args->L, "sequence length L")->capture_default_str()->check(int_in(1, kMaxCount));
  m->add_option("--embed", args->E, "embed_dim E")->capture_default_str()->check(int_in(1, kMaxCount));
  m->add_option("--heads", args->H, "heads H")->capture_default_str()->check(int_in(1, kMaxCount));
  add_precision_option(m, &args->dtype);
  add_threads_option(m, &args->threads);
  m->add_option("--min-time", args->min_time, "seconds of repeats")->capture_default_str()->check(real_in(0, 3600));
  m->add_flag("--json", args->json, "one JSON line");
  m->callback([args, action] { *action = [args] { run_mha(*args); }; });

  CLI::App* li = bench->add_subcommand(
      "linear", "One linear layer y = x W^T + b (random normal x [M, K], W [N, K]) through a weight packed for --dtype.");
  li->add_option("--rows", args->M, "rows of x, M")->capture_default_str()->check(int_in(1, kMaxCount));
  li->add_option("--in", args->K, "in_features K")->capture_default_str()->check(int_in(1, kMaxCount));
  li->add_option("--out", args->N, "out_features N")->capture_default_str()->check(int_in(1, kMaxCount));
  li->add_option("--dtype", args->dtype, "f32, bf16 or int8 (heads/precision.h)")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16", "int8"}));
  li->add_option("--activation-error", args->activation_error,
                 "int8: the weight's activation_error: 0 gives every activation row two terms, inf one (the "
                 "calibrated models' scheme)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            char* end = nullptr;
            const double x = v.empty() ? -1.0 : std::strtod(v.c_str(), &end);
            if (v.empty() || end != v.c_str() + v.size() || std::isnan(x) || x < 0) {
              return "expected a number from 0 to inf, got '" + v + "'";
            }
            return std::string();
          },
          "NUMBER in 0 to inf"));
  add_threads_option(li, &args->threads);
  li->add_option("--min-time", args->min_time, "seconds of repeats")->capture_default_str()->check(real_in(0, 3600));
  li->add_flag("--json", args->json, "one JSON line (with the GEMM route: native, heads, f32 or portable)");
  li->callback([args, action] { *action = [args] { run_linear(*args); }; });

  CLI::App* e = bench->add_subcommand(
      "embed", "Sentence embeddings per second (tokenize, encode, pool) on a file of one text per line.");
  e->add_option("--input", args->input, "texts, one per line (e.g. bench/sentences.txt)")->required();
  add_model_option(e, &args->model);
  add_precision_option(e, &args->embed_dtype, true);
  e->add_option("--batch-size", args->batch_size, "texts per batch")->capture_default_str()->check(int_in(1, kMaxCount));
  add_threads_option(e, &args->threads);
  add_batch_invariant_option(e, &args->batch_invariant);
  e->add_option("--min-time", args->min_time, "seconds of repeats")->capture_default_str()->check(real_in(0, 3600));
  e->add_flag("--json", args->json, "one JSON line");
  e->callback([args, action] { *action = [args] { run_embed(*args); }; });

  CLI::App* p = bench->add_subcommand("peak", "Measured f32 FMA throughput of this machine (and its bf16 dot product and AMX tiles, where the path has them), and its memory read bandwidth.");
  add_threads_option(p, &args->threads);
  p->add_option("--min-time", args->min_time, "seconds of measurement")->capture_default_str()->check(real_in(0, 3600));
  p->add_flag("--json", args->json, "one JSON line");
  p->callback([args, action] { *action = [args] { run_peak(*args); }; });
}

}  // namespace heads::cli
