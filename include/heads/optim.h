// optim.h — AdamW with torch.optim.AdamW's semantics (decoupled weight decay, bias correction,
// optional amsgrad and maximize), updating f32 parameters in place.
//
//   p ← p·(1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²  (v̂ = max(v̂, v) with amsgrad)
//   p ← p − lr/(1−β1ᵗ) · m / (√v/√(1−β2ᵗ) + ε)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "heads/mha.h"  // StateDict
#include "heads/tensor.h"

namespace heads {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
  bool maximize = false;
};

class AdamW {
 public:
  // `params` are updated in place: pass a module's state_dict(), whose tensors share the
  // module's storage. Every parameter must be a contiguous f32 tensor.
  explicit AdamW(StateDict params, const AdamWOptions& options = {});

  // One update from gradients by parameter name. A parameter without a gradient is left alone
  // (as torch skips parameters whose .grad is None); an unknown name or a shape mismatch is an error
  // raised before anything changes.
  void step(const StateDict& grads);

  int64_t steps() const { return steps_; }
  const AdamWOptions& options() const { return opt_; }
  void set_lr(double lr);

 private:
  struct Slot {
    std::string name;
    Tensor param, exp_avg, exp_avg_sq, max_exp_avg_sq;
    int64_t step = 0;  // per parameter, as torch's state["step"]
  };
  std::vector<Slot> slots_;
  AdamWOptions opt_;
  int64_t steps_ = 0;
};

}  // namespace heads
