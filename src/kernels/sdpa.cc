// sdpa.cc — SDPA entry: validation shared by every kernel, then dispatch.
#include "heads/sdpa.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/sdpa_problem.h"
#include "kernels/sdpa_split.h"

namespace heads::kernels {

namespace {

// A per-head vector option ([H] floating) as contiguous f32.
Tensor per_head(const char* op, const char* name, const Tensor& t, int64_t H) {
  HEADS_CHECK(t.dim() == 1 && t.size(0) == H && is_floating(t.dtype()), op, ": ", name,
              ": expected a floating tensor [H] = [", H, "], got ", dtype_name(t.dtype()), " ", t.shape());
  return t.to(DType::F32).contiguous();
}

// ALiBi and T5 biases as the [H, Lq + Lk - 1 + kRelPad] table of pb.mods.rel (log2 units), and sinks.
void set_position_terms(const char* op, const SdpaOptions& opts, SdpaProblem& pb) {
  if (opts.sinks.defined()) pb.sinks = per_head(op, "sinks", opts.sinks, pb.H);
  const bool alibi = opts.alibi_slopes.defined();
  const Tensor& table_in = opts.relative_attention_bias;
  if (!alibi && !table_in.defined()) return;
  Tensor slopes, table;
  if (alibi) slopes = per_head(op, "alibi_slopes", opts.alibi_slopes, pb.H);
  if (table_in.defined()) {
    HEADS_CHECK(table_in.dim() == 2 && table_in.size(1) == pb.H && table_in.size(0) >= 2 &&
                    is_floating(table_in.dtype()),
                op, ": relative_attention_bias: expected a floating table [num_buckets >= 2, H = ", pb.H, "], got ",
                dtype_name(table_in.dtype()), " ", table_in.shape());
    HEADS_CHECK(opts.relative_attention_max_distance >= 1, op,
                ": relative_attention_max_distance must be at least 1, got ", opts.relative_attention_max_distance);
    const int64_t exact = (opts.relative_attention_bidirectional ? table_in.size(0) / 2 : table_in.size(0)) / 2;
    HEADS_CHECK(exact >= 1 && opts.relative_attention_max_distance > exact, op,
                ": relative_attention_bias: ", table_in.size(0), " buckets (",
                opts.relative_attention_bidirectional ? "bidirectional" : "causal",
                ") leave ", exact, " exact distances; need at least 1 and relative_attention_max_distance (",
                opts.relative_attention_max_distance, ") above them");
    table = table_in.to(DType::F32).contiguous();
    pb.mods.rel_buckets = table.size(0);
    pb.mods.rel_max_distance = opts.relative_attention_max_distance;
    pb.mods.rel_bidirectional = opts.relative_attention_bidirectional;
  }
  pb.mods.rel_len = pb.Lq + pb.Lk - 1 + kRelPad;
  pb.mods.rel_lk = pb.Lk;
  pb.mods.rel = Tensor::zeros({pb.H, pb.mods.rel_len}, DType::F32);
  float* rp = pb.mods.rel.data<float>();
  // Bucket of each distance once (shared by the heads).
  std::vector<int64_t> bucket;
  if (table.defined()) {
    bucket.resize(static_cast<size_t>(pb.Lq + pb.Lk - 1));
    for (int64_t x = 0; x < pb.Lq + pb.Lk - 1; ++x) {  // x = i - j + Lk - 1
      const int64_t rel_pos = -(x - (pb.Lk - 1) + pb.align_offset);  // j - (i + a)
      bucket[static_cast<size_t>(x)] =
          t5_relative_bucket(rel_pos, pb.mods.rel_bidirectional, pb.mods.rel_buckets, pb.mods.rel_max_distance);
    }
  }
  for (int64_t h = 0; h < pb.H; ++h) {
    for (int64_t x = 0; x < pb.Lq + pb.Lk - 1; ++x) {
      const int64_t dist = x - (pb.Lk - 1) + pb.align_offset;  // i + a - j
      float bias = 0.0f;
      if (alibi) bias -= slopes.data<float>()[h] * static_cast<float>(dist < 0 ? -dist : dist);
      if (table.defined()) bias += table.data<float>()[bucket[static_cast<size_t>(x)] * pb.H + h];
      rp[h * pb.mods.rel_len + x] = bias * 1.44269504088896340736f;  // log2 e
    }
  }
}

}  // namespace

SdpaProblem make_sdpa_problem(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                              const SdpaOptions& opts) {
  HEADS_CHECK(q.defined() && k.defined() && v.defined(), op, ": query, key and value are required");
  HEADS_CHECK(q.dim() == 4, op, ": query: expected 4-D [B, H, Lq, D], got ", q.shape());
  HEADS_CHECK(k.dim() == 4, op, ": key: expected 4-D [B, Hkv, Lk, D], got ", k.shape());
  HEADS_CHECK(v.dim() == 4, op, ": value: expected 4-D [B, Hkv, Lk, Dv], got ", v.shape());
  SdpaProblem pb{};
  pb.B = q.size(0);
  pb.H = q.size(1);
  pb.Lq = q.size(2);
  pb.D = q.size(3);
  pb.Hkv = k.size(1);
  pb.Lk = k.size(2);
  pb.Dv = v.size(3);
  HEADS_CHECK(k.size(0) == pb.B, op, ": key: expected batch ", pb.B, " to match query ", q.shape(),
              ", got ", k.shape());
  HEADS_CHECK(v.size(0) == pb.B, op, ": value: expected batch ", pb.B, " to match query ",
              q.shape(), ", got ", v.shape());
  HEADS_CHECK(k.size(3) == pb.D, op, ": key: expected head dim ", pb.D, " to match query ",
              q.shape(), ", got ", k.shape());
  HEADS_CHECK(v.size(1) == pb.Hkv && v.size(2) == pb.Lk, op, ": value: expected [B, Hkv, Lk] = [",
              pb.B, ", ", pb.Hkv, ", ", pb.Lk, "] to match key ", k.shape(), ", got ", v.shape());
  HEADS_CHECK(pb.Hkv >= 1 && pb.H % pb.Hkv == 0, op, ": key: query heads ", pb.H,
              " are not a multiple of key/value heads ", pb.Hkv, " (query ", q.shape(), ", key ",
              k.shape(), ")");
  HEADS_CHECK(pb.Hkv == pb.H || opts.enable_gqa, op, ": key: ", pb.Hkv,
              " key/value heads differ from ", pb.H,
              " query heads; pass enable_gqa for grouped-query attention (query ", q.shape(),
              ", key ", k.shape(), ")");
  HEADS_CHECK(pb.D >= 1 && pb.Dv >= 1, op, ": head dims must be at least 1 (query ", q.shape(),
              ", value ", v.shape(), ")");
  pb.scale = opts.scale.has_value() ? *opts.scale : 1.0 / std::sqrt(static_cast<double>(pb.D));
  HEADS_CHECK(std::isfinite(pb.scale), op, ": scale must be finite, got ", pb.scale);
  HEADS_CHECK(opts.window_left >= -1 && opts.window_right >= -1, op,
              ": window_left and window_right must be -1 (unbounded) or >= 0, got (", opts.window_left, ", ",
              opts.window_right, ")");
  pb.align_offset = opts.causal_align == CausalAlign::BottomRight ? pb.Lk - pb.Lq : 0;
  // Extents past Lq + Lk reach every key: clamped there, so the offsets cannot overflow.
  const int64_t reach = pb.Lq + pb.Lk;
  const int64_t wl = std::min(opts.window_left, reach), wr = std::min(opts.window_right, reach);
  pb.causal = opts.is_causal || wr >= 0;
  pb.causal_offset = pb.align_offset + (opts.is_causal ? 0 : wr);
  pb.has_left = wl >= 0;
  pb.left_offset = pb.align_offset - (pb.has_left ? wl : 0);
  HEADS_CHECK(opts.softcap >= 0.0 && std::isfinite(opts.softcap), op, ": softcap must be finite and >= 0, got ",
              opts.softcap);
  pb.mods.set_softcap(opts.softcap);
  set_position_terms(op, opts, pb);
  if (opts.block_mask.defined()) {
    const Tensor& bm = opts.block_mask;
    HEADS_CHECK(opts.block_size >= 1, op, ": block_size must be at least 1, got ", opts.block_size);
    const int64_t bs = opts.block_size, nqb = (pb.Lq + bs - 1) / bs, nkb = (pb.Lk + bs - 1) / bs;
    HEADS_CHECK(bm.dtype() == DType::Bool && (bm.dim() == 2 || bm.dim() == 3) &&
                    (bm.dim() == 2 || bm.size(0) == 1 || bm.size(0) == pb.H) && bm.size(-2) == nqb &&
                    bm.size(-1) == nkb,
                op, ": block_mask: expected bool [nQB, nKB] or [H, nQB, nKB] = [", pb.H, ", ", nqb, ", ", nkb,
                "] for Lq ", pb.Lq, ", Lk ", pb.Lk, " and block_size ", bs, ", got ", dtype_name(bm.dtype()), " ",
                bm.shape());
    pb.mods.block_mask = (bm.dim() == 2 ? bm.unsqueeze(0) : bm).contiguous();
    pb.mods.block_size = bs;
  }
  if (opts.head_mask.defined()) {
    const Tensor& hm = opts.head_mask;
    HEADS_CHECK(hm.dtype() == DType::Bool && (hm.shape() == Shape{pb.H} || hm.shape() == Shape{pb.B, pb.H}), op,
                ": head_mask: expected bool [H] = [", pb.H, "] or [B, H] = [", pb.B, ", ", pb.H, "], got ",
                dtype_name(hm.dtype()), " ", hm.shape());
    pb.head_mask = hm.expand({pb.B, pb.H}).contiguous();
  }
  HEADS_CHECK(!(opts.partial_keys && pb.sinks.defined()), op,
              ": partial_keys with sinks: a sink's gradient is of the whole row, not of one block of keys");
  // Positions inside a block are the block's own: what depends on the distance i - j, or draws by
  // (i, j), would silently differ from the whole sequence's. Masks are the caller's to slice.
  HEADS_CHECK(!opts.partial_keys || (!opts.alibi_slopes.defined() && !opts.relative_attention_bias.defined() &&
                                     opts.window_left < 0 && opts.window_right < 0 && opts.dropout_p == 0.0),
              op, ": partial_keys works in the block's own positions: ALiBi, a relative bias, a window or dropout "
              "would see different positions than the whole sequence's (give an attn_mask slice instead)");
  pb.partial_keys = opts.partial_keys;
  // int8 key / value: one f32 scale per (b, hk, key); a scale with a float k or v is a mistake.
  for (const auto& [t, sc, name] : {std::tuple{&k, &opts.k_scale, "k_scale"}, {&v, &opts.v_scale, "v_scale"}}) {
    const char* what = t == &k ? "key" : "value";
    if (t->dtype() == DType::I8) {
      HEADS_CHECK(sc->defined() && sc->dtype() == DType::F32 && (sc->shape() == Shape{pb.B, pb.Hkv, pb.Lk}), op, ": ",
                  name, ": an int8 ", what, " ", t->shape(), " needs its f32 scales [B, Hkv, Lk] = [", pb.B, ", ",
                  pb.Hkv, ", ", pb.Lk, "], got ",
                  sc->defined() ? std::string(dtype_name(sc->dtype())) + " " + shape_str(sc->shape()) : "none");
    } else {
      HEADS_CHECK(!sc->defined(), op, ": ", name, ": given with a ", dtype_name(t->dtype()), " ", what,
                  " (scales are for int8 keys and values)");
    }
  }
  pb.k_scale = opts.k_scale;
  pb.v_scale = opts.v_scale;
  HEADS_CHECK(opts.dropout_p >= 0.0 && opts.dropout_p <= 1.0, op,
              ": dropout_p must be in [0, 1], got ", opts.dropout_p);
  pb.dropout_p = opts.dropout_p;
  pb.seed = pb.dropout_p > 0.0 ? (opts.dropout_seed ? *opts.dropout_seed : next_seed()) : 0;
  pb.need_weights = opts.need_weights;

  const Tensor& m = opts.attn_mask;
  if (m.defined()) {
    const Shape full{pb.B, pb.H, pb.Lq, pb.Lk};
    bool ok = m.dim() >= 1 && m.dim() <= 4;
    for (int64_t d = 0; ok && d < m.dim(); ++d) {
      const int64_t have = m.size(m.dim() - 1 - d), want = full[3 - d];
      ok = have == want || have == 1;
    }
    HEADS_CHECK(ok, op, ": attn_mask: shape ", m.shape(),
                " does not broadcast to [B, H, Lq, Lk] = ", full);
    if (m.dtype() == DType::Bool) {
      pb.mods.mask_kind = MaskKind::Bool;
      pb.mods.mask = m.expand(full);
    } else {
      HEADS_CHECK(is_floating(m.dtype()), op, ": attn_mask: expected bool or floating dtype, got ",
                  dtype_name(m.dtype()));
      pb.mods.mask_kind = MaskKind::Float;
      // Convert only the given (unbroadcast) mask; the kernels read it through zero strides.
      pb.mods.mask = (m.dtype() == DType::F32 ? m : m.to(DType::F32)).expand(full);
    }
  }
  return pb;
}

// q's dtype is one the kernels take (or `also`), and k, v share it.
static void check_dtypes(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                         DType also = DType::F32) {
  HEADS_CHECK(q.dtype() == DType::F32 || q.dtype() == DType::BF16 || q.dtype() == also, op,
              ": query: expected f32 or bf16, got ", dtype_name(q.dtype()));
  HEADS_CHECK(k.dtype() == q.dtype(), op, ": key: expected ", dtype_name(q.dtype()),
              " like query, got ", dtype_name(k.dtype()));
  HEADS_CHECK(v.dtype() == q.dtype(), op, ": value: expected ", dtype_name(q.dtype()),
              " like query, got ", dtype_name(v.dtype()));
}

// The forward's dtypes: q f32 or bf16; k and v alike, q's dtype or a cache's storage (f32, bf16, int8).
static void check_forward_dtypes(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  if (k.dtype() == q.dtype() && v.dtype() == q.dtype()) return check_dtypes(op, q, k, v);
  HEADS_CHECK(q.dtype() == DType::F32 || q.dtype() == DType::BF16, op, ": query: expected f32 or bf16, got ",
              dtype_name(q.dtype()));
  const auto stored = [](DType d) { return d == DType::F32 || d == DType::BF16 || d == DType::I8; };
  HEADS_CHECK(stored(k.dtype()) && v.dtype() == k.dtype(), op,
              ": key and value: expected both f32, bf16 or int8 (with k_scale, v_scale), got ", dtype_name(k.dtype()),
              " and ", dtype_name(v.dtype()));
}

// Kernels read rows with unit stride; other strides are free.
static Tensor unit_inner(const Tensor& t) { return t.stride(-1) == 1 || t.size(-1) == 1 ? t : t.contiguous(); }

}  // namespace heads::kernels

namespace heads {

Tensor alibi_slopes(int64_t num_heads) {
  HEADS_CHECK(num_heads >= 1, "alibi_slopes: num_heads must be at least 1, got ", num_heads);
  int64_t p2 = 1;
  while (p2 * 2 <= num_heads) p2 *= 2;
  Tensor s = Tensor::empty({num_heads}, DType::F32);
  float* sp = s.data<float>();
  const auto base = [](int64_t n) { return std::exp2(-std::exp2(-(std::log2(static_cast<double>(n)) - 3.0))); };
  // float32 powers of the float32 bases, as BLOOM's build_alibi_tensor computes them in torch
  const float b0 = static_cast<float>(base(p2)), b1 = static_cast<float>(base(2 * p2));
  for (int64_t h = 0; h < p2; ++h) sp[h] = std::pow(b0, static_cast<float>(h + 1));
  for (int64_t e = 0; p2 + e < num_heads; ++e) sp[p2 + e] = std::pow(b1, static_cast<float>(2 * e + 1));
  return s;
}

int64_t t5_relative_bucket(int64_t relative_position, bool bidirectional, int64_t num_buckets, int64_t max_distance) {
  // As transformers' T5Attention._relative_position_bucket, in its float32 arithmetic.
  int64_t bucket = 0;
  int64_t n = num_buckets;
  int64_t rp = relative_position;
  if (bidirectional) {
    n /= 2;
    if (rp > 0) bucket += n;
    rp = rp < 0 ? -rp : rp;
  } else {
    rp = rp < 0 ? -rp : 0;
  }
  const int64_t max_exact = n / 2;
  if (rp < max_exact) return bucket + rp;
  const float ratio = std::log(static_cast<float>(rp) / static_cast<float>(max_exact)) /
                      static_cast<float>(std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)));
  int64_t large = max_exact + static_cast<int64_t>(ratio * static_cast<float>(n - max_exact));
  if (large > n - 1) large = n - 1;
  return bucket + large;
}

namespace {

// The heads head_mask turns off, which the kernels skipped: zero output and weights, lse = -inf.
void clear_off_heads(const kernels::SdpaProblem& pb, const SdpaResult& r) {
  if (!pb.head_mask.defined()) return;
  const Tensor zero_out = Tensor::zeros({pb.Lq, pb.Dv}, r.out.dtype());
  const Tensor zero_w = pb.need_weights ? Tensor::zeros({pb.Lq, pb.Lk}, DType::F32) : Tensor();
  for (int64_t b = 0; b < pb.B; ++b) {
    for (int64_t h = 0; h < pb.H; ++h) {
      if (pb.head_on(b, h)) continue;
      r.out.select(0, b).select(0, h).copy_from(zero_out);
      float* lp = r.lse.data<float>() + (b * pb.H + h) * pb.Lq;
      std::fill(lp, lp + pb.Lq, -std::numeric_limits<float>::infinity());
      if (pb.need_weights) r.weights.select(0, b).select(0, h).copy_from(zero_w);
    }
  }
}

SdpaResult run(const kernels::SdpaProblem& pb, const Tensor& out, const Tensor& q, const Tensor& k,
               const Tensor& v) {
  using namespace kernels;
  const char* op = "sdpa";
  check_forward_dtypes(op, q, k, v);
  const Shape want{pb.B, pb.H, pb.Lq, pb.Dv};
  HEADS_CHECK(out.defined() && out.dtype() == q.dtype() && out.shape() == want, op, ": out: expected ",
              dtype_name(q.dtype()), " [B, H, Lq, Dv] = ", want, ", got ",
              out.defined() ? std::string(dtype_name(out.dtype())) + " " + shape_str(out.shape())
                            : std::string("none"));
  HEADS_CHECK(out.stride(-1) == 1 || pb.Dv == 1, op,
              ": out: innermost stride must be 1, got strides ", out.strides());
  SdpaResult r;
  r.dropout_seed = pb.seed;
  r.out = out;
  r.lse = Tensor::empty({pb.B, pb.H, pb.Lq}, DType::F32);
  if (pb.need_weights) r.weights = Tensor::empty({pb.B, pb.H, pb.Lq, pb.Lk}, DType::F32);
  if (pb.B == 0 || pb.H == 0 || pb.Lq == 0) return r;
  if (pb.Lk == 0) {  // no key at all: every row is fully masked (zero output, lse = -inf)
    r.out.copy_from(Tensor::zeros(r.out.shape(), DType::F32));
    float* lp = r.lse.data<float>();
    std::fill(lp, lp + r.lse.numel(), -std::numeric_limits<float>::infinity());
    if (pb.sinks.defined()) {  // the sink alone: lse = sink
      for (int64_t bh = 0; bh < pb.B * pb.H; ++bh) std::fill(lp + bh * pb.Lq, lp + (bh + 1) * pb.Lq, pb.sinks.data<float>()[bh % pb.H]);
    }
    clear_off_heads(pb, r);
    return r;
  }
  const auto fwd = q.dtype() == DType::BF16 ? active().sdpa_fwd_bf16 : active().sdpa_fwd_f32;
  if (k.dtype() == q.dtype()) {
    fwd(pb, unit_inner(q), unit_inner(k), unit_inner(v), r.out, r.lse, r.weights);
  } else if (!active().sdpa_decode_kv(pb, unit_inner(q), unit_inner(k), unit_inner(v), r.out, r.lse, r.weights)) {
    // Too many queries for the decode kernel (a prefill, compute-bound): the f32 kernel on the keys
    // and values widened to f32 (int8 ones dequantised), as exact as the stored values allow; a bf16
    // q is widened too, and the output rounded to bf16 once.
    const auto widen = [&](const Tensor& t, const Tensor& scales) {
      return t.dtype() == DType::I8 ? dequantize_kv(t, scales) : t.to(DType::F32);
    };
    const Tensor out32 = q.dtype() == DType::F32 ? r.out : Tensor::empty(r.out.shape(), DType::F32);
    active().sdpa_fwd_f32(pb, q.dtype() == DType::F32 ? unit_inner(q) : q.to(DType::F32), widen(k, pb.k_scale),
                          widen(v, pb.v_scale), out32, r.lse, r.weights);
    if (q.dtype() != DType::F32) r.out.copy_from(out32);
  }
  clear_off_heads(pb, r);
  return r;
}

}  // namespace

SdpaResult sdpa_out(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v,
                    const SdpaOptions& opts) {
  return run(kernels::make_sdpa_problem("sdpa", q, k, v, opts), out, q, k, v);
}

namespace {
bool via_f32(const Tensor& q) { return q.defined() && (q.dtype() == DType::F16 || q.dtype() == DType::F64); }
}  // namespace

SdpaResult sdpa(const Tensor& q, const Tensor& k, const Tensor& v, const SdpaOptions& opts) {
  if (via_f32(q)) {  // f16 / f64: computed in f32, the output in q's dtype
    kernels::check_dtypes("sdpa", q, k, v, q.dtype());
    SdpaResult r = sdpa(q.to(DType::F32), k.to(DType::F32), v.to(DType::F32), opts);
    r.out = r.out.to(q.dtype());
    return r;
  }
  const kernels::SdpaProblem pb = kernels::make_sdpa_problem("sdpa", q, k, v, opts);
  return run(pb, Tensor::empty({pb.B, pb.H, pb.Lq, pb.Dv}, q.dtype()), q, k, v);
}

SdpaGrads sdpa_backward_out(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                            const Tensor& q, const Tensor& k, const Tensor& v, const SdpaResult& fwd,
                            const SdpaOptions& opts_in, bool mask_grad) {
  using namespace kernels;
  const char* op = "sdpa_backward";
  SdpaOptions opts = opts_in;
  opts.need_weights = false;
  if (opts.dropout_p > 0.0) opts.dropout_seed = fwd.dropout_seed;  // the forward's stream
  const SdpaProblem pb = make_sdpa_problem(op, q, k, v, opts);
  // f32 inputs, or bf16 ones (read widened; f32 or bf16 gradients, below)
  const DType in_dtype = q.defined() ? q.dtype() : DType::F32;
  HEADS_CHECK(in_dtype == DType::F32 || in_dtype == DType::BF16, op, ": query: expected f32 or bf16, got ",
              dtype_name(in_dtype));
  for (const auto& [t, name] : {std::pair{&q, "query"}, {&k, "key"}, {&v, "value"}, {&dout, "dout"}}) {
    HEADS_CHECK(t->defined() && t->dtype() == in_dtype, op, ": ", name, ": expected ", dtype_name(in_dtype),
                " like query");
  }
  // f32 gradients, or bf16 ones for bf16 inputs (all three alike)
  const DType gdt = dq.defined() && dq.dtype() == DType::BF16 && in_dtype == DType::BF16 ? DType::BF16 : DType::F32;
  for (const auto& [t, like, name] : {std::tuple{&dq, &q, "dq"}, {&dk, &k, "dk"}, {&dv, &v, "dv"}}) {
    HEADS_CHECK(t->defined() && t->dtype() == gdt && t->shape() == like->shape(), op, ": ", name, ": expected an ",
                dtype_name(gdt), " tensor ", like->shape(), ", got ",
                t->defined() ? std::string(dtype_name(t->dtype())) + " " : std::string(),
                t->defined() ? t->shape() : Shape{});
    HEADS_CHECK(t->numel() == 0 || t->stride(3) == 1, op, ": ", name, ": the innermost stride must be 1, got ",
                t->strides());
  }
  const Shape oshape{pb.B, pb.H, pb.Lq, pb.Dv};
  HEADS_CHECK(dout.shape() == oshape, op, ": dout: expected ", oshape, ", got ", dout.shape());
  // (bf16 inputs: the forward's bf16 out, or an f32 one such as sdpa_merge_ writes)
  HEADS_CHECK(fwd.out.defined() && fwd.out.shape() == oshape &&
                  (fwd.out.dtype() == in_dtype || fwd.out.dtype() == DType::F32),
              op, ": fwd.out: expected the forward's ", dtype_name(in_dtype), " output ", oshape);
  HEADS_CHECK(fwd.lse.defined() && fwd.lse.shape() == Shape({pb.B, pb.H, pb.Lq}), op,
              ": fwd.lse: expected the forward's lse [B, H, Lq] = ", Shape({pb.B, pb.H, pb.Lq}));
  HEADS_CHECK(!mask_grad || pb.mods.mask_kind == MaskKind::Float, op,
              ": mask_grad needs a floating attn_mask");
  SdpaGrads g{dq, dk, dv, Tensor(), Tensor(), Tensor()};
  if (pb.sinks.defined()) g.dsinks = Tensor::zeros({pb.H}, DType::F32);
  if (pb.mods.rel_buckets > 0) g.drelative_attention_bias = Tensor::zeros({pb.mods.rel_buckets, pb.H}, DType::F32);
  if (pb.B == 0 || pb.H == 0 || pb.Lq == 0 || pb.Lk == 0) {  // nothing attends: zero gradients
    for (const Tensor* t : {&dq, &dk, &dv}) Tensor(*t).copy_from(Tensor::zeros(t->shape(), DType::F32));  // (any dtype)
    if (mask_grad) g.dmask = Tensor::zeros(opts.attn_mask.shape(), DType::F32);
    return g;
  }
  Tensor dm_full = mask_grad ? Tensor::zeros({pb.B, pb.H, pb.Lq, pb.Lk}, DType::F32) : Tensor();
  Tensor drel = pb.mods.rel_buckets > 0 ? Tensor::zeros({pb.H, pb.mods.rel_len}, DType::F32) : Tensor();
  const Tensor out_f = unit_inner(fwd.out), lse_c = fwd.lse.contiguous();
  active().sdpa_bwd(pb, unit_inner(dout), unit_inner(q), unit_inner(k), unit_inner(v), out_f, lse_c, dq, dk,
                    dv, mask_grad ? dm_full.data<float>() : nullptr, drel.defined() ? drel.data<float>() : nullptr);
  if (mask_grad) g.dmask = reduce_to_shape(dm_full, opts.attn_mask.shape()).to(DType::F32);
  if (drel.defined()) {  // the sums along i - j, gathered into their buckets
    float* gt = g.drelative_attention_bias.data<float>();
    for (int64_t x = 0; x < pb.Lq + pb.Lk - 1; ++x) {
      const int64_t bk = t5_relative_bucket(-(x - (pb.Lk - 1) + pb.align_offset), pb.mods.rel_bidirectional,
                                            pb.mods.rel_buckets, pb.mods.rel_max_distance);
      for (int64_t h = 0; h < pb.H; ++h) gt[bk * pb.H + h] += drel.data<float>()[h * pb.mods.rel_len + x];
    }
  }
  if (pb.sinks.defined()) {  // d sink_h = -sum over rows of P_sink · D, P_sink = e^(sink - lse), D = dO · O
    const bool wide = in_dtype == DType::F32;  // else read widened
    const Tensor o32 = wide ? out_f : out_f.to(DType::F32), g32 = wide ? dout : dout.to(DType::F32);
    for (int64_t h = 0; h < pb.H; ++h) {
      double acc = 0.0;
      const double sink = pb.sinks.data<float>()[h];
      for (int64_t b = 0; b < pb.B; ++b) {
        if (!pb.head_on(b, h)) continue;  // skipped: no sink term
        for (int64_t i = 0; i < pb.Lq; ++i) {
          const float* o = o32.data<float>() + b * o32.stride(0) + h * o32.stride(1) + i * o32.stride(2);
          const float* go = g32.data<float>() + b * g32.stride(0) + h * g32.stride(1) + i * g32.stride(2);
          double d = 0.0;
          for (int64_t c = 0; c < pb.Dv; ++c) d += static_cast<double>(o[c * o32.stride(3)]) * go[c * g32.stride(3)];
          acc += std::exp(sink - lse_c.data<float>()[(b * pb.H + h) * pb.Lq + i]) * d;
        }
      }
      g.dsinks.data<float>()[h] = static_cast<float>(-acc);
    }
  }
  return g;
}

SdpaGrads sdpa_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const SdpaResult& fwd, const SdpaOptions& opts, bool mask_grad) {
  // bf16: read widened by the kernel (exact), the gradients summed in f32 and rounded once to bf16.
  if (q.defined() && q.dtype() == DType::BF16) {
    kernels::check_dtypes("sdpa_backward", q, k, v, q.dtype());
    auto like = [](const Tensor& t) { return Tensor::empty(t.shape(), DType::BF16); };
    return sdpa_backward_out(like(q), like(k), like(v), dout, q, k, v, fwd, opts, mask_grad);
  }
  // f16 / f64: computed in f32 (f16 values are exact there) and rounded once to q's dtype at the end.
  if (via_f32(q)) {
    kernels::check_dtypes("sdpa_backward", q, k, v, q.dtype());
    HEADS_CHECK(dout.defined() && dout.dtype() == q.dtype(), "sdpa_backward: dout: expected ", dtype_name(q.dtype()),
                " like query");
    SdpaResult f32_fwd = fwd;
    f32_fwd.out = fwd.out.defined() ? fwd.out.to(DType::F32) : fwd.out;
    SdpaGrads g = sdpa_backward(dout.to(DType::F32), q.to(DType::F32), k.to(DType::F32), v.to(DType::F32), f32_fwd,
                                opts, mask_grad);
    for (Tensor* t : {&g.dq, &g.dk, &g.dv}) *t = t->to(q.dtype());
    return g;
  }
  auto like = [](const Tensor& t) { return t.defined() ? Tensor::empty(t.shape(), DType::F32) : Tensor(); };
  return sdpa_backward_out(like(q), like(k), like(v), dout, q, k, v, fwd, opts, mask_grad);
}

void sdpa_merge_(const Tensor& out, const Tensor& lse, const Tensor& out_b, const Tensor& lse_b) {
  const char* op = "sdpa_merge_";
  HEADS_CHECK(out.defined() && out.dim() == 4 && out.dtype() == DType::F32 && (out.numel() == 0 || out.stride(3) == 1),
              op, ": out: expected f32 [B, H, Lq, Dv] with a unit inner stride, got ",
              out.defined() ? out.shape() : Shape{});
  const Shape rows{out.size(0), out.size(1), out.size(2)};
  HEADS_CHECK(lse.defined() && lse.dtype() == DType::F32 && lse.shape() == rows && lse.is_contiguous(), op,
              ": lse: expected contiguous f32 ", rows, " to match out ", out.shape(), ", got ",
              lse.defined() ? lse.shape() : Shape{});
  HEADS_CHECK(out_b.defined() && out_b.shape() == out.shape() &&
                  (out_b.dtype() == DType::F32 || out_b.dtype() == DType::BF16),
              op, ": out_b: expected f32 or bf16 ", out.shape(), " like out, got ",
              out_b.defined() ? out_b.shape() : Shape{});
  HEADS_CHECK(lse_b.defined() && lse_b.shape() == rows && is_floating(lse_b.dtype()), op,
              ": lse_b: expected a floating tensor ", rows, " like lse, got ", lse_b.defined() ? lse_b.shape() : Shape{});
  const Tensor ob = out_b.to(DType::F32).contiguous(), lb = lse_b.to(DType::F32).contiguous();
  const int64_t B = out.size(0), H = out.size(1), Lq = out.size(2), Dv = out.size(3), n_rows = B * H * Lq;
  float* o = out.data<float>();
  float* l = lse.data<float>();
  const float* pb = ob.data<float>();
  const float* plb = lb.data<float>();
  const int64_t s0 = out.stride(0), s1 = out.stride(1), s2 = out.stride(2);
  const int n_threads = threads_for(4.0 * static_cast<double>(n_rows) * static_cast<double>(Dv), n_rows);
#pragma omp parallel for num_threads(n_threads) schedule(static)
  for (int64_t r = 0; r < n_rows; ++r) {
    float* orow = o + (r / (H * Lq)) * s0 + (r / Lq % H) * s1 + (r % Lq) * s2;
    const float* parts[2] = {orow, pb + r * Dv};
    const float lses[2] = {l[r], plb[r]};
    l[r] = kernels::merge_normalized_row(
        2, [&](int64_t c) { return parts[c]; }, [&](int64_t c) { return lses[c]; }, Dv,
        [&](int64_t d0, const float* vals, int64_t nd) { std::copy(vals, vals + nd, orow + d0); });
  }
}

}  // namespace heads
