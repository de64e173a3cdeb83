// sdpa_ref.cc — the float64 specification of SDPA (forward). Plain loops, full score matrix.
//
//   S = q kᵀ · scale + mask (bool false / causal-hidden -> -inf);  W = softmax(S) (row with no
//   visible key -> 0);  W = dropout(W) (same keep rule as every kernel);  out = W v.
// Non-finite values (docs/numerics.md): a key whose score is -inf (masked) contributes nothing; a row
// whose scores are all -inf is zero; otherwise IEEE arithmetic — a NaN score or a +inf one makes the
// row NaN (softmax needs exp(inf - inf)).
#include "heads/sdpa.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/sdpa_problem.h"

namespace heads::kernels {

// Sums a [B, H, Lq, Lk] gradient over the dimensions `shape` broadcasts (trailing-aligned).
Tensor reduce_to_shape(const Tensor& full, const Shape& shape) {
  const Tensor f = full.to(DType::F64);
  Shape s4(4 - shape.size(), 1);
  s4.insert(s4.end(), shape.begin(), shape.end());
  Tensor out = Tensor::zeros(s4, DType::F64);
  const Shape& fs = f.shape();
  for (int64_t a = 0; a < fs[0]; ++a)
    for (int64_t b = 0; b < fs[1]; ++b)
      for (int64_t c = 0; c < fs[2]; ++c)
        for (int64_t d = 0; d < fs[3]; ++d) {
          const int64_t o = (((s4[0] > 1 ? a : 0) * s4[1] + (s4[1] > 1 ? b : 0)) * s4[2] + (s4[2] > 1 ? c : 0)) * s4[3] +
                            (s4[3] > 1 ? d : 0);
          out.data<double>()[o] += f.data<double>()[((a * fs[1] + b) * fs[2] + c) * fs[3] + d];
        }
  return out.reshape(shape);
}

}  // namespace heads::kernels

namespace heads::ref {

using kernels::reduce_to_shape;

namespace {

// The position terms in float64, from the options themselves (not the kernels' f32 table).
struct Terms {
  std::vector<double> slopes, table, sinks;  // [H], [num_buckets * H], [H]
  static std::vector<double> f64(const Tensor& t) {
    if (!t.defined()) return {};
    const Tensor d = t.to(DType::F64).contiguous();
    return {d.data<double>(), d.data<double>() + d.numel()};
  }
  explicit Terms(const SdpaOptions& o)
      : slopes(f64(o.alibi_slopes)), table(f64(o.relative_attention_bias)), sinks(f64(o.sinks)) {}
};

// Score (i, j) of head (b, h) in [B, H, L, D] f64 q and k: t = q_i · k_j · scale, then the score
// modifiers (ScoreMods::apply, natural units) with the ALiBi and T5 biases computed here in float64;
// -inf outside the band. *dcap: d(capped t)/dt.
double score(const kernels::SdpaProblem& pb, const Terms& tm, const double* q, const double* k, int64_t b, int64_t h,
             int64_t i, int64_t j, double* dcap = nullptr) {
  const double* qi = q + ((b * pb.H + h) * pb.Lq + i) * pb.D;
  const double* kj = k + ((b * pb.Hkv + h / pb.group()) * pb.Lk + j) * pb.D;
  double acc = 0.0;
  for (int64_t d = 0; d < pb.D; ++d) acc += qi[d] * kj[d];
  const int64_t dist = i + pb.align_offset - j;
  double bias = 0.0;
  if (!tm.slopes.empty()) bias -= tm.slopes[static_cast<size_t>(h)] * static_cast<double>(dist < 0 ? -dist : dist);
  if (!tm.table.empty()) {
    const kernels::ScoreMods& m = pb.mods;
    const int64_t bk = t5_relative_bucket(-dist, m.rel_bidirectional, m.rel_buckets, m.rel_max_distance);
    bias += tm.table[static_cast<size_t>(bk * pb.H + h)];
  }
  const double x = pb.mods.apply<double>(acc * pb.scale, 1.0, bias, b, h, i, j, dcap);
  return pb.visible(i, j) ? x : -std::numeric_limits<double>::infinity();
}

}  // namespace

SdpaResult sdpa_fwd_f64(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                        const SdpaOptions& opts) {
  using namespace kernels;
  const SdpaProblem pb = make_sdpa_problem("ref::sdpa_fwd_f64", q_in, k_in, v_in, opts);
  HEADS_CHECK(is_floating(q_in.dtype()), "ref::sdpa_fwd_f64: query must be floating, got ", dtype_name(q_in.dtype()));
  for (const Tensor* t : {&k_in, &v_in}) {
    HEADS_CHECK(is_floating(t->dtype()) || t->dtype() == DType::I8,
                "ref::sdpa_fwd_f64: key and value must be floating or int8, got ", dtype_name(t->dtype()));
  }
  // int8 keys and values: value times its row's scale, exact in float64
  const auto wide = [](const Tensor& t, const Tensor& scales) {
    if (t.dtype() != DType::I8) return t.to(DType::F64);
    const Tensor vc = t.contiguous(), sc = scales.contiguous();
    Tensor w = Tensor::empty(t.shape(), DType::F64);
    const int64_t n = t.size(-1);
    for (int64_t x = 0; x < t.numel(); ++x) {
      w.data<double>()[x] = static_cast<double>(vc.data<int8_t>()[x]) * static_cast<double>(sc.data<float>()[x / n]);
    }
    return w;
  };
  const Tensor q = q_in.to(DType::F64), k = wide(k_in, pb.k_scale), v = wide(v_in, pb.v_scale);
  const double* qp = q.data<double>();
  const double* kp = k.data<double>();
  const double* vp = v.data<double>();
  SdpaResult r;
  r.out = Tensor::zeros({pb.B, pb.H, pb.Lq, pb.Dv}, DType::F64);
  r.weights = Tensor::zeros({pb.B, pb.H, pb.Lq, pb.Lk}, DType::F64);
  r.lse = Tensor::empty({pb.B, pb.H, pb.Lq}, DType::F64);
  double* op = r.out.data<double>();
  double* wp = r.weights.data<double>();
  double* lp = r.lse.data<double>();
  const double ninf = -std::numeric_limits<double>::infinity();
  std::vector<double> s(static_cast<size_t>(pb.Lk));
  const Terms tm(opts);

  for (int64_t b = 0; b < pb.B; ++b) {
    for (int64_t h = 0; h < pb.H; ++h) {
      const int64_t hk = h / pb.group();
      if (!pb.head_on(b, h)) {  // turned off: zero output and weights, lse = -inf
        std::fill(lp + (b * pb.H + h) * pb.Lq, lp + (b * pb.H + h + 1) * pb.Lq, ninf);
        continue;
      }
      for (int64_t i = 0; i < pb.Lq; ++i) {
        double mx = ninf;
        bool any_visible = false;
        for (int64_t j = 0; j < pb.Lk; ++j) {
          const double x = score(pb, tm, qp, kp, b, h, i, j);
          s[j] = x;
          if (x > mx) mx = x;  // NaN never compares greater: mx is the largest non-NaN score
          any_visible = any_visible || x != ninf;
        }
        const double sink = tm.sinks.empty() ? ninf : tm.sinks[static_cast<size_t>(h)];
        double* w = wp + ((b * pb.H + h) * pb.Lq + i) * pb.Lk;
        double* o = op + ((b * pb.H + h) * pb.Lq + i) * pb.Dv;
        lp[(b * pb.H + h) * pb.Lq + i] = sink;  // a sink alone: weight 1 on it, zero output
        if (!any_visible) continue;  // no visible key: zero weights and output
        if (sink > mx) mx = sink;
        double sum = sink == ninf ? 0.0 : std::exp(sink - mx);  // the sink joins the denominator
        for (int64_t j = 0; j < pb.Lk; ++j) sum += s[j] == ninf ? 0.0 : std::exp(s[j] - mx);
        lp[(b * pb.H + h) * pb.Lq + i] = mx + std::log(sum);
        for (int64_t j = 0; j < pb.Lk; ++j) {
          if (s[j] == ninf && !std::isnan(sum)) continue;  // masked: contributes nothing
          double p = std::exp(s[j] - mx) / sum;
          if (pb.dropout_p > 0.0) {
            p = dropout_keep(pb.seed, dropout_index(pb, b, h, i, j), pb.dropout_p)
                    ? p / (1.0 - pb.dropout_p)
                    : 0.0;
          }
          w[j] = p;
          const double* vj = vp + ((b * pb.Hkv + hk) * pb.Lk + j) * pb.Dv;
          for (int64_t d = 0; d < pb.Dv; ++d) o[d] += p * vj[d];
        }
      }
    }
  }
  return r;
}

SdpaGrads sdpa_bwd_f64(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in,
                       const Tensor& v_in, const SdpaOptions& opts, bool mask_grad) {
  using namespace kernels;
  const SdpaProblem pb = make_sdpa_problem("ref::sdpa_bwd_f64", q_in, k_in, v_in, opts);
  HEADS_CHECK(pb.dropout_p == 0.0 || opts.dropout_seed.has_value(),
              "ref::sdpa_bwd_f64: dropout needs the forward's dropout_seed");
  HEADS_CHECK(dout_in.defined() && dout_in.shape() == Shape({pb.B, pb.H, pb.Lq, pb.Dv}),
              "ref::sdpa_bwd_f64: dout: expected [B, H, Lq, Dv] = ", Shape({pb.B, pb.H, pb.Lq, pb.Dv}));
  const Tensor q = q_in.to(DType::F64), k = k_in.to(DType::F64), v = v_in.to(DType::F64);
  const Tensor dO = dout_in.to(DType::F64);
  const double* qp = q.data<double>();
  const double* kp = k.data<double>();
  const double* vp = v.data<double>();
  const double* gp = dO.data<double>();
  SdpaGrads g;
  g.dq = Tensor::zeros(q.shape(), DType::F64);
  g.dk = Tensor::zeros(k.shape(), DType::F64);
  g.dv = Tensor::zeros(v.shape(), DType::F64);
  Tensor dm_full;
  if (mask_grad) {
    HEADS_CHECK(pb.mods.mask_kind == MaskKind::Float, "ref::sdpa_bwd_f64: mask_grad needs a float attn_mask");
    dm_full = Tensor::zeros({pb.B, pb.H, pb.Lq, pb.Lk}, DType::F64);
  }
  const SdpaResult fw = sdpa_fwd_f64(q_in, k_in, v_in, opts);  // weights include dropout
  const Terms tm(opts);
  if (!tm.sinks.empty()) g.dsinks = Tensor::zeros({pb.H}, DType::F64);
  if (!tm.table.empty()) g.drelative_attention_bias = Tensor::zeros({pb.mods.rel_buckets, pb.H}, DType::F64);
  std::vector<double> dcap(static_cast<size_t>(pb.Lk));
  const double ninf = -std::numeric_limits<double>::infinity();
  std::vector<double> p(static_cast<size_t>(pb.Lk)), dp(static_cast<size_t>(pb.Lk));
  const double keep_scale = pb.dropout_p >= 1.0 ? 0.0 : pb.dropout_p > 0 ? 1.0 / (1.0 - pb.dropout_p) : 1.0;
  for (int64_t b = 0; b < pb.B; ++b) {
    for (int64_t h = 0; h < pb.H; ++h) {
      const int64_t hk = h / pb.group();
      for (int64_t i = 0; i < pb.Lq; ++i) {
        const double lse = fw.lse.data<double>()[(b * pb.H + h) * pb.Lq + i];
        if (lse == ninf) continue;  // sees no key: zero gradients
        const double* qi = qp + ((b * pb.H + h) * pb.Lq + i) * pb.D;
        const double* gi = gp + ((b * pb.H + h) * pb.Lq + i) * pb.Dv;
        double Dsum = 0;
        for (int64_t j = 0; j < pb.Lk; ++j) {
          p[static_cast<size_t>(j)] = std::exp(score(pb, tm, qp, kp, b, h, i, j, &dcap[static_cast<size_t>(j)]) - lse);
          const bool keep = pb.dropout_p == 0 || dropout_keep(pb.seed, dropout_index(pb, b, h, i, j), pb.dropout_p);
          const double z = pb.dropout_p > 0 ? (keep ? keep_scale : 0.0) : 1.0;
          // dV += (P z) dO;  dP = (dO · v_j) z
          const double* vj = vp + ((b * pb.Hkv + hk) * pb.Lk + j) * pb.Dv;
          double* dvj = g.dv.data<double>() + ((b * pb.Hkv + hk) * pb.Lk + j) * pb.Dv;
          double d = 0;
          for (int64_t c = 0; c < pb.Dv; ++c) {
            dvj[c] += p[static_cast<size_t>(j)] * z * gi[c];
            d += gi[c] * vj[c];
          }
          dp[static_cast<size_t>(j)] = d * z;
          Dsum += p[static_cast<size_t>(j)] * dp[static_cast<size_t>(j)];
        }
        // The sink's weight exp(sink - lse) has dP = 0: its logit's gradient is -P_sink · D.
        if (!tm.sinks.empty()) g.dsinks.data<double>()[h] -= std::exp(tm.sinks[static_cast<size_t>(h)] - lse) * Dsum;
        double* dqi = g.dq.data<double>() + ((b * pb.H + h) * pb.Lq + i) * pb.D;
        for (int64_t j = 0; j < pb.Lk; ++j) {
          const double ds_out = p[static_cast<size_t>(j)] * (dp[static_cast<size_t>(j)] - Dsum);  // dL/dS
          if (mask_grad) dm_full.data<double>()[((b * pb.H + h) * pb.Lq + i) * pb.Lk + j] = ds_out;
          if (!tm.table.empty() && p[static_cast<size_t>(j)] != 0.0) {
            const ScoreMods& m = pb.mods;
            const int64_t bk =
                t5_relative_bucket(j - i - pb.align_offset, m.rel_bidirectional, m.rel_buckets, m.rel_max_distance);
            g.drelative_attention_bias.data<double>()[bk * pb.H + h] += ds_out;
          }
          const double ds = ds_out * dcap[static_cast<size_t>(j)];  // through the softcap
          const double* kj = kp + ((b * pb.Hkv + hk) * pb.Lk + j) * pb.D;
          double* dkj = g.dk.data<double>() + ((b * pb.Hkv + hk) * pb.Lk + j) * pb.D;
          for (int64_t d = 0; d < pb.D; ++d) {
            dqi[d] += pb.scale * ds * kj[d];
            dkj[d] += pb.scale * ds * qi[d];
          }
        }
      }
    }
  }
  if (mask_grad) g.dmask = reduce_to_shape(dm_full, opts.attn_mask.shape());
  return g;
}

}  // namespace heads::ref
