// common.cc — the modules' shared initialisers and state-dict lookups (common.h).
#include "modules/common.h"

#include "heads/safetensors.h"

#include <algorithm>
#include <cmath>

namespace heads::modules {

Tensor uniform(const Shape& shape, double bound, std::mt19937_64& gen) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::uniform_real_distribution<double> dist(-bound, bound);
  float* p = t.data<float>();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(dist(gen));
  return t;
}

Tensor normal(const Shape& shape, double stddev, std::mt19937_64& gen) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::normal_distribution<double> dist(0.0, stddev);
  float* p = t.data<float>();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(dist(gen));
  return t;
}

Tensor xavier_uniform(int64_t fan_out, int64_t fan_in, std::mt19937_64& gen) {
  return uniform({fan_out, fan_in}, std::sqrt(6.0 / static_cast<double>(fan_in + fan_out)), gen);
}

Tensor filled(const Shape& shape, float v) {
  Tensor t = Tensor::empty(shape, DType::F32);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = v;
  return t;
}

const Tensor* find(const StateDict& sd, const std::string& name) {
  for (const auto& [n, t] : sd) {
    if (n == name) return &t;
  }
  return nullptr;
}

void load_file(const std::string& path, const std::function<void(const StateDict&)>& load) {
  try {
    load(load_safetensors(path));
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (msg.rfind(path, 0) == 0) throw;  // already names the file
    fail(msg, " (in ", path, ")");
  }
}

std::string names_of(const StateDict& sd) {
  std::string s;
  for (const auto& [n, t] : sd) s += (s.empty() ? "" : ", ") + n;
  return s.empty() ? "none" : s;
}

void PackedWeights::pack(Precision p, const StateDict& sd, const std::vector<std::string>& names,
                         const InputRanges& ranges, const std::map<std::string, double>& residual_errors) {
  std::vector<std::pair<std::string, PackedLinear>> packed;
  if (p != Precision::F32) {
    for (const std::string& n : names) {
      const Tensor* w = modules::find(sd, n);
      if (w == nullptr) continue;
      const auto r = ranges.find(n);
      const bool calibrated = p == Precision::Int8 && r != ranges.end();
      if (!calibrated) {
        packed.emplace_back(n, PackedLinear(*w, p));
        continue;
      }
      const auto e = residual_errors.find(n);
      packed.emplace_back(n, PackedLinear(*w, p, kInt8OutlierActivationError, r->second,
                                          e == residual_errors.end() ? kInt8ResidualError : e->second));
    }
  }
  weights = std::move(packed);
  precision = p;
}

std::shared_ptr<const PackedWeights> PackedWeights::make(
    Precision p, const StateDict& current, const StateDict& incoming, const std::vector<std::string>& names,
    const std::vector<std::pair<std::string, PackedLinear>>& stored, const PackedWeights* existing,
    const InputRanges& ranges, const std::map<std::string, double>& residual_errors) {
  if (p == Precision::F32) return nullptr;
  const auto stored_as = [&](const std::string& n) -> const PackedLinear* {
    for (const auto& [sn, w] : stored) {
      if (sn == n && w.precision() == p) return &w;
    }
    if (existing != nullptr && existing->precision == p && modules::find(incoming, n) == nullptr) {
      return existing->find(n);
    }
    return nullptr;
  };
  StateDict merged;
  for (const std::string& n : names) {
    if (stored_as(n) != nullptr) continue;
    if (const Tensor* t = modules::find(incoming, n)) {
      merged.emplace_back(n, *t);
    } else if (const Tensor* c = modules::find(current, n)) {
      merged.emplace_back(n, *c);
    }
  }
  auto packed = std::make_shared<PackedWeights>();
  packed->pack(p, merged, names, ranges, residual_errors);
  for (const std::string& n : names) {  // in `names` order, as pack() leaves them
    if (const PackedLinear* w = stored_as(n)) packed->weights.emplace_back(n, *w);
  }
  return packed;
}

std::shared_ptr<const PackedWeights> PackedWeights::f32_shared(const StateDict& sd,
                                                               const std::vector<std::string>& names) {
  auto packed = std::make_shared<PackedWeights>();
  for (const std::string& n : names) {
    const Tensor* w = modules::find(sd, n);
    if (w != nullptr && w->dtype() == DType::F32 && w->is_contiguous()) {
      packed->weights.emplace_back(n, PackedLinear::f32_shared(*w));
    }
  }
  return packed;
}

const PackedLinear* PackedWeights::find(const std::string& name) const {
  for (const auto& [n, w] : weights) {
    if (n == name) return &w;
  }
  return nullptr;
}

const PackedLinear* PackedWeights::part(const std::string& name, int64_t index, int64_t parts) const {
  const PackedLinear* w = find(name);
  if (w == nullptr) return nullptr;
  HEADS_CHECK(parts >= 1 && 0 <= index && index < parts && w->out_features() % parts == 0, "PackedWeights::part: \"",
              name, "\" (", w->out_features(), " rows) has no part ", index, " of ", parts);
  const std::lock_guard<std::mutex> lock(parts_mutex_);
  for (const Part& p : parts_) {
    if (p.name == name && p.index == index && p.parts == parts) return p.weight.get();
  }
  const int64_t n = w->out_features() / parts;
  parts_.push_back({name, index, parts, std::make_unique<const PackedLinear>(w->rows(index * n, index * n + n))});
  return parts_.back().weight.get();
}

void record_absmax(InputRanges& ranges, const std::string& name, const Tensor& x_in) {
  HEADS_CHECK(x_in.defined() && x_in.dim() >= 1, "input ranges: \"", name, "\": no input recorded");
  const Tensor x = x_in.to(DType::F32).contiguous();
  const int64_t K = x.size(-1), M = K > 0 ? x.numel() / K : 0;
  auto [it, fresh] = ranges.try_emplace(name, Tensor::zeros({K}, DType::F32));
  HEADS_CHECK(it->second.shape() == Shape({K}), "input ranges: \"", name, "\": inputs of ", K,
              " channels after ones of ", it->second.shape());
  float* a = it->second.data<float>();
  const float* v = x.data<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      const float f = v[m * K + k];
      HEADS_CHECK(std::isfinite(f), "input ranges: \"", name, "\": input row ", m, " holds ", f);
      a[k] = std::max(a[k], std::fabs(f));
    }
  }
}

InputRanges ranges_under(const InputRanges& ranges, const std::string& prefix) {
  InputRanges out;
  for (const auto& [n, t] : ranges) {
    if (n.rfind(prefix, 0) == 0) out.emplace(n.substr(prefix.size()), t);
  }
  return out;
}

LoadedWeights read_int8_weights(const StateDict& sd, const std::vector<std::string>& packable, const char* op) {
  LoadedWeights out;
  std::vector<std::string> consumed;
  const auto get = [&](const std::string& n) { return find(sd, n); };
  for (const std::string& n : packable) {
    const Tensor* t = find(sd, n);
    if (t == nullptr || !t->defined() || t->dtype() != DType::I8) continue;
    out.int8.emplace_back(n, int8_from_tensors(n, get, std::string(op) + "::load_state_dict"));
    for (const std::string& part : int8_part_names(n)) consumed.push_back(part);
  }
  for (const auto& [n, t] : sd) {
    if (std::find(consumed.begin(), consumed.end(), n) != consumed.end()) continue;
    const PackedLinear* w = nullptr;
    for (const auto& [qn, q] : out.int8) {
      if (qn == n) w = &q;
    }
    out.floating.emplace_back(n, w != nullptr ? dequantize(*w) : t);
  }
  return out;
}

StateDict with_int8_weights(const StateDict& sd, const PackedWeights* packed) {
  if (packed == nullptr || packed->precision != Precision::Int8) return sd;
  StateDict out;
  for (const auto& [n, t] : sd) {
    const PackedLinear* w = packed->find(n);
    if (w == nullptr) {
      out.emplace_back(n, t);
      continue;
    }
    for (auto& part : int8_tensors(n, *w)) out.push_back(std::move(part));
  }
  return out;
}

}  // namespace heads::modules
