// common.h — what the modules share: PyTorch's parameter initialisers drawn from a seeded
// generator, lookups in a StateDict by name, and the views that turn activations into GEMM rows (the
// head views: attention_block.h).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "heads/mha.h"
#include "heads/ops.h"
#include "heads/precision.h"
#include "heads/tensor.h"

namespace heads::modules {

// Uniform in [-bound, bound), f32 (torch.nn.init.uniform_).
Tensor uniform(const Shape& shape, double bound, std::mt19937_64& gen);
// Normal(0, stddev), f32 (torch.nn.init.normal_).
Tensor normal(const Shape& shape, double stddev, std::mt19937_64& gen);
// torch.nn.init.xavier_uniform_ on a 2-D [fan_out, fan_in] weight.
Tensor xavier_uniform(int64_t fan_out, int64_t fan_in, std::mt19937_64& gen);
// A tensor filled with v.
Tensor filled(const Shape& shape, float v);

// The entry named `name`, or null.
const Tensor* find(const StateDict& sd, const std::string& name);
// "a, b, c" (or "none"), for errors that list what a state dict holds.
std::string names_of(const StateDict& sd);
// load(the tensors of the safetensors file `path`); an error that does not name the file yet gets
// " (in path)".
void load_file(const std::string& path, const std::function<void(const StateDict&)>& load);

// A module's linear weights packed for reduced-precision inference (precision.h), by parameter name.
struct PackedWeights {
  Precision precision = Precision::F32;
  std::vector<std::pair<std::string, PackedLinear>> weights;

  // Packs each named weight of `sd` for `p` (F32: clears), int8 ones with the input ranges recorded
  // under their names where `ranges` has them (outlier channels, with kInt8OutlierActivationError and
  // the residual_error `residual_errors` gives the name, kInt8ResidualError where it gives none:
  // heads/precision.h).
  void pack(Precision p, const StateDict& sd, const std::vector<std::string>& names, const InputRanges& ranges = {},
            const std::map<std::string, double>& residual_errors = {});
  // The named weights packed for `p`, each taken from `incoming` when it holds it, else from
  // `current`; null for F32. Throws (before anything changes) on a weight that cannot be packed.
  // `stored`: weights already packed (int8 read from a file), used as they are; `existing`: the
  // module's packing so far, whose weights `incoming` does not replace are kept when it is in `p`
  // (so a partial load does not quantize stored int8 weights again from their values).
  static std::shared_ptr<const PackedWeights> make(
      Precision p, const StateDict& current, const StateDict& incoming, const std::vector<std::string>& names,
      const std::vector<std::pair<std::string, PackedLinear>>& stored = {}, const PackedWeights* existing = nullptr,
      const InputRanges& ranges = {}, const std::map<std::string, double>& residual_errors = {});
  // The named f32 weights of `sd` as they are (PackedLinear::f32_shared: their storage shared, the
  // GEMM's own layout beside it, made at first use); precision F32.
  static std::shared_ptr<const PackedWeights> f32_shared(const StateDict& sd, const std::vector<std::string>& names);
  // The packed weight `name`, or null (not a packed weight).
  const PackedLinear* find(const std::string& name) const;
  // Rows [index·n, (index + 1)·n) of the packed weight `name` (n = its rows / `parts`) as a weight of
  // their own (PackedLinear::rows, with its own GEMM layout), made at the first call and kept for
  // the next ones (cross-attention projects q, k and v by the parts of in_proj_weight: laying a part
  // out again at every call cost a bf16 MultiheadAttention(768, 12) call ten times its work); null
  // where `name` is not packed. Thread-safe.
  const PackedLinear* part(const std::string& name, int64_t index, int64_t parts) const;

 private:
  struct Part {
    std::string name;
    int64_t index, parts;
    std::unique_ptr<const PackedLinear> weight;
  };
  mutable std::mutex parts_mutex_;
  mutable std::vector<Part> parts_;  // each weight behind its own pointer: handed out addresses stay
};

// ranges[name] = the largest |x| of each column of x [..., K] (f32 [K]), merged by elementwise max with
// what it holds; rows of NaN or inf are an error naming `name` (calibration inputs must be finite).
void record_absmax(InputRanges& ranges, const std::string& name, const Tensor& x);
// The entries of `ranges` under "<prefix>" with the prefix removed.
InputRanges ranges_under(const InputRanges& ranges, const std::string& prefix);

// A state dict about to be loaded, with the int8 weights among `packable` (stored as
// heads::int8_tensors writes them: "<name>" i8, "<name>_scale", and the residual term's tensors)
// taken apart: `floating` holds every other tensor and each int8 weight as its f32 value, without
// its parts; `int8` the PackedLinear each int8 weight stores, to be used as it is (no
// re-quantization). Errors name `op` and the tensor: missing scales, parts of the wrong dtype or
// shape, scales not finite and positive, residual rows out of order.
struct LoadedWeights {
  StateDict floating;
  std::vector<std::pair<std::string, PackedLinear>> int8;
};
LoadedWeights read_int8_weights(const StateDict& sd, const std::vector<std::string>& packable, const char* op);

// `sd` with each weight that `packed` holds in int8 replaced by heads::int8_tensors (the form
// above); unchanged for f32 and bf16.
StateDict with_int8_weights(const StateDict& sd, const PackedWeights* packed);

// x Wᵀ + b through the packed weight when there is one (y in `out`: f32, or bf16 for a bf16 weight),
// else in f32.
inline Tensor project(const Tensor& x, const Tensor& w, const Tensor& b, const PackedLinear* packed,
                      DType out = DType::F32) {
  return packed != nullptr ? linear(x, *packed, b, out) : linear(x, w, b).to(out);
}

// [rows, width] view of a [d0, d1, width] tensor, and a [rows, n] result back as [d0, d1, n].
inline Tensor rows(const Tensor& x3) { return x3.reshape({x3.size(0) * x3.size(1), x3.size(2)}); }
inline Tensor as3(const Tensor& y, const Tensor& x3) { return y.reshape({x3.size(0), x3.size(1), y.size(1)}); }

}  // namespace heads::modules
