// params.h — what the modules share: PyTorch's parameter initialisers, drawn from a seeded
// generator, and lookups in a StateDict by name.
#pragma once

#include <random>
#include <string>

#include "heads/mha.h"
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

}  // namespace heads::modules
