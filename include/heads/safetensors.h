// safetensors.h — read (memory-mapped) and write the safetensors format.
//
// File = 8-byte little-endian header length N, N bytes of JSON header, then the data segment.
// The header maps names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative
// to the data segment) plus an optional "__metadata__" object of strings.
// Files are untrusted: the header length, JSON, every dtype, shape and offset are validated
// before any tensor is exposed; the tensors must tile the data segment exactly (no overlap,
// no gap), as the reference implementation requires.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "heads/tensor.h"

namespace heads {

class SafeTensors {
 public:
  // Maps `path` read-only and validates it; throws heads::Error naming the file and the problem.
  static SafeTensors open(const std::string& path);
  // Validates an in-memory image of a file (used by tests and by callers holding bytes).
  static SafeTensors from_bytes(std::string bytes, const std::string& label = "<memory>");

  bool contains(const std::string& name) const;
  // A view into the mapping (kept alive by the tensor), or an aligned copy when the file's
  // offset is not aligned for the dtype. Throws naming the file and the available names.
  Tensor get(const std::string& name) const;
  std::vector<std::string> names() const;  // in data order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& label() const { return label_; }

 private:
  struct Entry {
    DType dtype;
    Shape shape;
    uint64_t begin, end;
  };
  void parse(const std::byte* base, size_t size);
  void check_layout(uint64_t data_size);

  std::shared_ptr<void> owner_;
  const std::byte* data_ = nullptr;  // start of the data segment
  std::vector<std::pair<std::string, Entry>> entries_;
  std::map<std::string, std::string> metadata_;
  std::string label_;
};

// Every tensor of a file, in data order (views into the mapping).
std::vector<std::pair<std::string, Tensor>> load_safetensors(const std::string& path);

// Writes tensors (any strides; stored contiguous) to `path` via a temporary file renamed at the
// end, so a failure leaves `path` as it was. Names must be unique and not "__metadata__".
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// The safetensors dtype string ("F32", "BOOL", ...) of a DType.
std::string safetensors_dtype(DType dt);

}  // namespace heads
