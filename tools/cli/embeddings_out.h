// embeddings_out.h — writing a [N, dim] float32 embedding matrix the way `heads embed` and
// `heads client embed` do: the format follows the output's extension.
#pragma once

#include <string>
#include <vector>

#include "heads/tensor.h"

namespace heads::cli {

// An error unless `path` ends in .npy, .safetensors, .jsonl or .json (checked before any work).
void check_embeddings_output(const std::string& path);

// .npy (float32 [N, dim]), .safetensors (tensor "embeddings", metadata "model") or .jsonl (one
// {"text", "embedding"} per line), written atomically.
void write_embeddings(const std::string& path, const std::vector<std::string>& texts, const Tensor& e,
                      const std::string& model);

}  // namespace heads::cli
