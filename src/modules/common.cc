// common.cc — the modules' shared initialisers and state-dict lookups (common.h).
#include "modules/common.h"

#include <cmath>

namespace heads::modules {

Tensor uniform(const Shape& shape, double bound, std::mt19937_64& gen) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::uniform_real_distribution<double> dist(-bound, bound);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(dist(gen));
  return t;
}

Tensor normal(const Shape& shape, double stddev, std::mt19937_64& gen) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::normal_distribution<double> dist(0.0, stddev);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(dist(gen));
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

std::string names_of(const StateDict& sd) {
  std::string s;
  for (const auto& [n, t] : sd) s += (s.empty() ? "" : ", ") + n;
  return s.empty() ? "none" : s;
}

void PackedWeights::pack(Precision p, const StateDict& sd, const std::vector<std::string>& names) {
  std::vector<std::pair<std::string, PackedLinear>> packed;
  if (p != Precision::F32) {
    for (const std::string& n : names) {
      if (const Tensor* w = modules::find(sd, n)) packed.emplace_back(n, PackedLinear(*w, p));
    }
  }
  weights = std::move(packed);
  precision = p;
}

std::shared_ptr<const PackedWeights> PackedWeights::make(Precision p, const StateDict& current,
                                                        const StateDict& incoming,
                                                        const std::vector<std::string>& names) {
  if (p == Precision::F32) return nullptr;
  StateDict merged;
  for (const std::string& n : names) {
    if (const Tensor* t = modules::find(incoming, n)) {
      merged.emplace_back(n, *t);
    } else if (const Tensor* c = modules::find(current, n)) {
      merged.emplace_back(n, *c);
    }
  }
  auto packed = std::make_shared<PackedWeights>();
  packed->pack(p, merged, names);
  return packed;
}

const PackedLinear* PackedWeights::find(const std::string& name) const {
  for (const auto& [n, w] : weights) {
    if (n == name) return &w;
  }
  return nullptr;
}

}  // namespace heads::modules
