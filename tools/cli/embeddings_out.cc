// embeddings_out.cc — the embedding files of `heads embed` and `heads client embed` (embeddings_out.h).
#include "embeddings_out.h"

#include <nlohmann/json.hpp>

#include "heads/error.h"
#include "heads/files.h"
#include "heads/safetensors.h"

namespace heads::cli {

namespace {

// NumPy .npy (format 1.0) of a float32 matrix.
std::string npy_bytes(const Tensor& t) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(t.size(0)) +
                       ", " + std::to_string(t.size(1)) + "), }";
  while ((10 + header.size() + 1) % 64 != 0) header.push_back(' ');
  header.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(header.size() & 0xff));
  out.push_back(static_cast<char>(header.size() >> 8));
  out += header;
  out.append(static_cast<const char*>(t.raw_data()), static_cast<size_t>(t.numel()) * 4);
  return out;
}

std::string jsonl_bytes(const std::vector<std::string>& texts, const Tensor& t) {
  std::string out;
  for (int64_t i = 0; i < t.size(0); ++i) {
    nlohmann::json j;
    j["text"] = texts[static_cast<size_t>(i)];
    std::vector<float> v(t.data<float>() + i * t.size(1), t.data<float>() + (i + 1) * t.size(1));
    j["embedding"] = v;
    out += j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  }
  return out;
}

}  // namespace

void check_embeddings_output(const std::string& path) {
  const auto dot = path.rfind('.');
  const std::string ext = dot == std::string::npos ? "" : path.substr(dot);
  HEADS_CHECK(ext == ".npy" || ext == ".safetensors" || ext == ".jsonl" || ext == ".json", path,
              ": output must end in .npy, .safetensors or .jsonl");
}

void write_embeddings(const std::string& path, const std::vector<std::string>& texts, const Tensor& e,
                      const std::string& model) {
  check_embeddings_output(path);
  const std::string ext = path.substr(path.rfind('.'));
  if (ext == ".npy") {
    write_file_atomically(path, npy_bytes(e));
  } else if (ext == ".safetensors") {
    save_safetensors(path, {{"embeddings", e}}, {{"model", model}});
  } else {
    write_file_atomically(path, jsonl_bytes(texts, e));
  }
}

}  // namespace heads::cli
