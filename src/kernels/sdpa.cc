// sdpa.cc — SDPA entry: validation shared by every kernel, then dispatch.
#include "heads/sdpa.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/sdpa_problem.h"

namespace heads::kernels {

SdpaProblem make_sdpa_problem(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                              const SdpaOptions& opts) {
  HEADS_CHECK(q.defined() && k.defined() && v.defined(), op, ": query, key and value are required");
  HEADS_CHECK(q.dim() == 4, op, ": query: expected 4-D [B, H, Lq, D], got ", q.shape());
  HEADS_CHECK(k.dim() == 4, op, ": key: expected 4-D [B, Hkv, Lk, D], got ", k.shape());
  HEADS_CHECK(v.dim() == 4, op, ": value: expected 4-D [B, Hkv, Lk, Dv], got ", v.shape());
  SdpaProblem P{};
  P.B = q.size(0);
  P.H = q.size(1);
  P.Lq = q.size(2);
  P.D = q.size(3);
  P.Hkv = k.size(1);
  P.Lk = k.size(2);
  P.Dv = v.size(3);
  HEADS_CHECK(k.size(0) == P.B, op, ": key: expected batch ", P.B, " to match query ", q.shape(),
              ", got ", k.shape());
  HEADS_CHECK(v.size(0) == P.B, op, ": value: expected batch ", P.B, " to match query ",
              q.shape(), ", got ", v.shape());
  HEADS_CHECK(k.size(3) == P.D, op, ": key: expected head dim ", P.D, " to match query ",
              q.shape(), ", got ", k.shape());
  HEADS_CHECK(v.size(1) == P.Hkv && v.size(2) == P.Lk, op, ": value: expected [B, Hkv, Lk] = [",
              P.B, ", ", P.Hkv, ", ", P.Lk, "] to match key ", k.shape(), ", got ", v.shape());
  HEADS_CHECK(P.Hkv >= 1 && P.H % P.Hkv == 0, op, ": key: query heads ", P.H,
              " are not a multiple of key/value heads ", P.Hkv, " (query ", q.shape(), ", key ",
              k.shape(), ")");
  HEADS_CHECK(P.Hkv == P.H || opts.enable_gqa, op, ": key: ", P.Hkv,
              " key/value heads differ from ", P.H,
              " query heads; pass enable_gqa for grouped-query attention (query ", q.shape(),
              ", key ", k.shape(), ")");
  HEADS_CHECK(P.D >= 1 && P.Dv >= 1, op, ": head dims must be at least 1 (query ", q.shape(),
              ", value ", v.shape(), ")");
  P.scale = opts.scale.has_value() ? *opts.scale : 1.0 / std::sqrt(static_cast<double>(P.D));
  HEADS_CHECK(std::isfinite(P.scale), op, ": scale must be finite, got ", P.scale);
  P.causal = opts.is_causal;
  P.causal_offset = opts.causal_align == CausalAlign::BottomRight ? P.Lk - P.Lq : 0;
  HEADS_CHECK(opts.dropout_p >= 0.0 && opts.dropout_p <= 1.0, op,
              ": dropout_p must be in [0, 1], got ", opts.dropout_p);
  P.dropout_p = opts.dropout_p;
  P.seed = P.dropout_p > 0.0 ? (opts.dropout_seed ? *opts.dropout_seed : next_seed()) : 0;
  P.need_weights = opts.need_weights;

  const Tensor& m = opts.attn_mask;
  if (m.defined()) {
    const Shape full{P.B, P.H, P.Lq, P.Lk};
    bool ok = m.dim() >= 1 && m.dim() <= 4;
    for (int64_t d = 0; ok && d < m.dim(); ++d) {
      const int64_t have = m.size(m.dim() - 1 - d), want = full[3 - d];
      ok = have == want || have == 1;
    }
    HEADS_CHECK(ok, op, ": attn_mask: shape ", m.shape(),
                " does not broadcast to [B, H, Lq, Lk] = ", full);
    if (m.dtype() == DType::Bool) {
      P.mask_kind = MaskKind::Bool;
      P.mask = m.expand(full);
    } else {
      HEADS_CHECK(is_floating(m.dtype()), op, ": attn_mask: expected bool or floating dtype, got ",
                  dtype_name(m.dtype()));
      P.mask_kind = MaskKind::Float;
      // Convert only the given (unbroadcast) mask; the kernels read it through zero strides.
      P.mask = (m.dtype() == DType::F32 ? m : m.to(DType::F32)).expand(full);
    }
  }
  return P;
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

// Kernels read rows with unit stride; other strides are free.
static Tensor unit_inner(const Tensor& t) { return t.stride(-1) == 1 || t.size(-1) == 1 ? t : t.contiguous(); }

}  // namespace heads::kernels

namespace heads {

namespace {

SdpaResult run(const kernels::SdpaProblem& P, const Tensor& out, const Tensor& q, const Tensor& k,
               const Tensor& v) {
  using namespace kernels;
  const char* op = "sdpa";
  check_dtypes(op, q, k, v);
  const Shape want{P.B, P.H, P.Lq, P.Dv};
  HEADS_CHECK(out.defined() && out.dtype() == q.dtype() && out.shape() == want, op, ": out: expected ",
              dtype_name(q.dtype()), " [B, H, Lq, Dv] = ", want, ", got ",
              out.defined() ? std::string(dtype_name(out.dtype())) + " " + shape_str(out.shape())
                            : std::string("none"));
  HEADS_CHECK(out.stride(-1) == 1 || P.Dv == 1, op,
              ": out: innermost stride must be 1, got strides ", out.strides());
  SdpaResult r;
  r.dropout_seed = P.seed;
  r.out = out;
  r.lse = Tensor::empty({P.B, P.H, P.Lq}, DType::F32);
  if (P.need_weights) r.weights = Tensor::empty({P.B, P.H, P.Lq, P.Lk}, DType::F32);
  if (P.B == 0 || P.H == 0 || P.Lq == 0) return r;
  if (P.Lk == 0) {  // no key at all: every row is fully masked (zero output, lse = -inf)
    r.out.copy_from(Tensor::zeros(r.out.shape(), DType::F32));
    float* lp = r.lse.data<float>();
    std::fill(lp, lp + r.lse.numel(), -std::numeric_limits<float>::infinity());
    return r;
  }
  const auto fwd = q.dtype() == DType::BF16 ? active().sdpa_fwd_bf16 : active().sdpa_fwd_f32;
  fwd(P, unit_inner(q), unit_inner(k), unit_inner(v), r.out, r.lse, r.weights);
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
  const kernels::SdpaProblem P = kernels::make_sdpa_problem("sdpa", q, k, v, opts);
  return run(P, Tensor::empty({P.B, P.H, P.Lq, P.Dv}, q.dtype()), q, k, v);
}

SdpaGrads sdpa_backward_out(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                            const Tensor& q, const Tensor& k, const Tensor& v, const SdpaResult& fwd,
                            const SdpaOptions& opts_in, bool mask_grad) {
  using namespace kernels;
  const char* op = "sdpa_backward";
  SdpaOptions opts = opts_in;
  opts.need_weights = false;
  if (opts.dropout_p > 0.0) opts.dropout_seed = fwd.dropout_seed;  // the forward's stream
  const SdpaProblem P = make_sdpa_problem(op, q, k, v, opts);
  for (const auto& [t, name] : {std::pair{&q, "query"}, {&k, "key"}, {&v, "value"}, {&dout, "dout"}}) {
    HEADS_CHECK(t->defined() && t->dtype() == DType::F32, op, ": ", name, ": expected f32");
  }
  for (const auto& [t, like, name] : {std::tuple{&dq, &q, "dq"}, {&dk, &k, "dk"}, {&dv, &v, "dv"}}) {
    HEADS_CHECK(t->defined() && t->dtype() == DType::F32 && t->shape() == like->shape(), op, ": ", name,
                ": expected an f32 tensor ", like->shape(), ", got ", t->defined() ? t->shape() : Shape{});
    HEADS_CHECK(t->numel() == 0 || t->stride(3) == 1, op, ": ", name, ": the innermost stride must be 1, got ",
                t->strides());
  }
  const Shape oshape{P.B, P.H, P.Lq, P.Dv};
  HEADS_CHECK(dout.shape() == oshape, op, ": dout: expected ", oshape, ", got ", dout.shape());
  HEADS_CHECK(fwd.out.defined() && fwd.out.shape() == oshape && fwd.out.dtype() == DType::F32, op,
              ": fwd.out: expected the forward's f32 output ", oshape);
  HEADS_CHECK(fwd.lse.defined() && fwd.lse.shape() == Shape({P.B, P.H, P.Lq}), op,
              ": fwd.lse: expected the forward's lse [B, H, Lq] = ", Shape({P.B, P.H, P.Lq}));
  HEADS_CHECK(!mask_grad || P.mask_kind == MaskKind::Float, op,
              ": mask_grad needs a floating attn_mask");
  SdpaGrads g{dq, dk, dv, Tensor()};
  if (P.B == 0 || P.H == 0 || P.Lq == 0 || P.Lk == 0) {  // nothing attends: zero gradients
    for (const Tensor* t : {&dq, &dk, &dv}) Tensor(*t).copy_from(Tensor::zeros(t->shape(), DType::F32));
    if (mask_grad) g.dmask = Tensor::zeros(opts.attn_mask.shape(), DType::F32);
    return g;
  }
  Tensor dm_full = mask_grad ? Tensor::zeros({P.B, P.H, P.Lq, P.Lk}, DType::F32) : Tensor();
  active().sdpa_bwd_f32(P, unit_inner(dout), unit_inner(q), unit_inner(k), unit_inner(v), unit_inner(fwd.out),
                        fwd.lse.contiguous(), dq, dk, dv, mask_grad ? dm_full.data<float>() : nullptr);
  if (mask_grad) g.dmask = reduce_to_shape(dm_full, opts.attn_mask.shape()).to(DType::F32);
  return g;
}

SdpaGrads sdpa_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const SdpaResult& fwd, const SdpaOptions& opts, bool mask_grad) {
  if (via_f32(q)) {  // f16 / f64: computed in f32, the gradients in q's dtype
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

}  // namespace heads
