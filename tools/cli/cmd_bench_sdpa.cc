// cmd_bench_sdpa.cc — `heads bench sdpa`: one shape, or every combination of the size lists given (a
// grid), forward or forward + backward (--backward: the forward alone and forward + backward timed in
// alternating blocks, 8 rounds), queries in f32 or bf16 over K/V stored in f32, bf16 or int8
// (DESIGN.md's bench contract). flops = 4·B·H·Lq·Lk·D (half when causal; a window's visible pairs).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench.h"
#include "commands.h"
#include "options.h"
#include "heads/runtime.h"
#include "heads/sdpa.h"
#include "kernels/sdpa_case.h"

namespace heads::cli::bench {

namespace {

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

}  // namespace

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

}  // namespace heads::cli::bench
