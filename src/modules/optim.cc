// optim.cc — AdamW, element by element in torch's order of operations (single-tensor path of
// torch.optim.AdamW), parallel over chunks of each parameter.
#include "heads/optim.h"

#include <cmath>

#include "heads/error.h"
#include "heads/runtime.h"

namespace heads {

namespace {

constexpr const char* kOptimOp = "AdamW";

void check_options(const AdamWOptions& o) {
  HEADS_CHECK(o.lr >= 0.0, kOptimOp, ": lr must be >= 0, got ", o.lr);
  HEADS_CHECK(o.eps >= 0.0, kOptimOp, ": eps must be >= 0, got ", o.eps);
  HEADS_CHECK(o.beta1 >= 0.0 && o.beta1 < 1.0, kOptimOp, ": beta1 must be in [0, 1), got ", o.beta1);
  HEADS_CHECK(o.beta2 >= 0.0 && o.beta2 < 1.0, kOptimOp, ": beta2 must be in [0, 1), got ", o.beta2);
  HEADS_CHECK(o.weight_decay >= 0.0, kOptimOp, ": weight_decay must be >= 0, got ", o.weight_decay);
}

}  // namespace

AdamW::AdamW(StateDict params, const AdamWOptions& options) : opt_(options) {
  check_options(opt_);
  for (auto& [name, p] : params) {
    HEADS_CHECK(p.defined() && p.dtype() == DType::F32 && p.is_contiguous(), kOptimOp, ": parameter \"", name,
                "\" must be a contiguous f32 tensor");
    for (const Slot& s : slots_) HEADS_CHECK(s.name != name, kOptimOp, ": parameter \"", name, "\" given twice");
    Slot s;
    s.name = name;
    s.param = p;
    s.exp_avg = Tensor::zeros(p.shape(), DType::F32);
    s.exp_avg_sq = Tensor::zeros(p.shape(), DType::F32);
    if (opt_.amsgrad) s.max_exp_avg_sq = Tensor::zeros(p.shape(), DType::F32);
    slots_.push_back(std::move(s));
  }
}

void AdamW::set_lr(double lr) {
  HEADS_CHECK(lr >= 0.0, kOptimOp, ": lr must be >= 0, got ", lr);
  opt_.lr = lr;
}

void AdamW::step(const StateDict& grads) {
  // Validate everything first: a bad gradient leaves every parameter unchanged.
  std::vector<const Tensor*> g_of(slots_.size(), nullptr);
  std::vector<Tensor> keep;  // f32 contiguous copies where needed
  keep.reserve(grads.size());
  for (const auto& [name, g] : grads) {
    size_t i = 0;
    while (i < slots_.size() && slots_[i].name != name) ++i;
    HEADS_CHECK(i < slots_.size(), kOptimOp, "::step: gradient for unknown parameter \"", name, "\"");
    HEADS_CHECK(g.defined() && g.shape() == slots_[i].param.shape() && is_floating(g.dtype()), kOptimOp,
                "::step: gradient \"", name, "\": expected ", slots_[i].param.shape(), " floating, got ",
                g.defined() ? g.shape() : Shape{});
    HEADS_CHECK(g_of[i] == nullptr, kOptimOp, "::step: two gradients for \"", name, "\"");
    keep.push_back(g.to(DType::F32));
    g_of[i] = &keep.back();
  }
  ++steps_;
  // Scalars rounded to f32 from double, as torch passes Python floats to its f32 kernels
  // (1 - β computed before rounding).
  const float b2 = static_cast<float>(opt_.beta2), eps = static_cast<float>(opt_.eps);
  const float one_minus_b1 = static_cast<float>(1.0 - opt_.beta1), one_minus_b2 = static_cast<float>(1.0 - opt_.beta2);
  const float decay = static_cast<float>(1.0 - opt_.lr * opt_.weight_decay);
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (g_of[i] == nullptr) continue;
    Slot& s = slots_[i];
    const int64_t t = ++s.step;
    const double bc1 = 1.0 - std::pow(opt_.beta1, static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(opt_.beta2, static_cast<double>(t));
    const float step_size = static_cast<float>(opt_.lr / bc1);
    const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    float* p = s.param.data<float>();
    float* m = s.exp_avg.data<float>();
    float* v = s.exp_avg_sq.data<float>();
    float* vmax = opt_.amsgrad ? s.max_exp_avg_sq.data<float>() : nullptr;
    const float* g = g_of[i]->data<float>();
    const bool maximize = opt_.maximize;
    const int64_t n = s.param.numel();
    const int threads = n >= (1 << 16) ? get_num_threads() : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t j = 0; j < n; ++j) {
      const float gj = maximize ? -g[j] : g[j];
      p[j] *= decay;
      m[j] += (gj - m[j]) * one_minus_b1;  // lerp, as torch
      v[j] = v[j] * b2 + one_minus_b2 * gj * gj;
      float second = v[j];
      if (vmax) second = vmax[j] = std::max(vmax[j], v[j]);
      const float denom = std::sqrt(second) / bc2_sqrt + eps;
      p[j] += -step_size * (m[j] / denom);
    }
  }
}

}  // namespace heads
