// checkpoint.h — what the model loaders share: a checkpoint's tensors from one safetensors file or
// the shards of model.safetensors.index.json, row concatenation of weights, and config.json
// without its null fields.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "heads/safetensors.h"
#include "heads/tensor.h"

namespace heads::models {

class Checkpoint {
 public:
  // model.safetensors in `dir`, else the shards model.safetensors.index.json names.
  explicit Checkpoint(const std::filesystem::path& dir);
  bool has(const std::string& name) const;
  // The tensor as contiguous f32 of the given shape; errors name the file and the tensor.
  Tensor get(const std::string& name, const Shape& shape) const;
  Tensor get_if(const std::string& name, const Shape& shape, bool want) const {
    return want ? get(name, shape) : Tensor();
  }

 private:
  std::vector<std::unique_ptr<SafeTensors>> files_;
  std::map<std::string, size_t> where_;
};

// The defined parts stacked along dimension 0: f32, or their own dtype when all are the same
// integer dtype (int8 weights); undefined when none is defined.
Tensor cat_rows(const std::vector<Tensor>& parts);

// A JSON object without its null fields (transformers writes absent options as null).
nlohmann::json without_nulls(const nlohmann::json& j);

}  // namespace heads::models
