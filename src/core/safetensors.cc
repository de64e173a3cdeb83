// safetensors.cc — validating reader (mmap) and atomic writer for safetensors files.
#include "heads/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "heads/files.h"

namespace heads {

namespace {

constexpr uint64_t kMaxHeader = 100u << 20;  // 100 MB, as the reference implementation
constexpr uint64_t kMaxSpan = uint64_t{1} << 60;  // largest shape a Tensor holds (tensor.cc)

bool parse_dtype(const std::string& s, DType* out) {
  static const std::pair<const char*, DType> table[] = {
      {"F32", DType::F32}, {"F64", DType::F64}, {"F16", DType::F16}, {"BF16", DType::BF16},
      {"BOOL", DType::Bool}, {"U8", DType::U8}, {"I64", DType::I64}, {"I8", DType::I8}};
  for (const auto& [name, dt] : table) {
    if (s == name) {
      *out = dt;
      return true;
    }
  }
  return false;
}

std::string join_names(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < 16; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > 16) s += ", ...";
  return names.empty() ? "none" : s;
}

}  // namespace

std::string safetensors_dtype(DType dt) {
  switch (dt) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::Bool: return "BOOL";
    case DType::U8: return "U8";
    case DType::I64: return "I64";
    case DType::I8: return "I8";
  }
  return "?";
}

SafeTensors SafeTensors::open(const std::string& path) {
  // O_NONBLOCK: a FIFO opens at once (then fails the regular-file check) instead of waiting for a
  // writer; regular files ignore it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": not a regular file");
  }
  const auto size = static_cast<size_t>(st.st_size);
  SafeTensors f;
  f.label_ = path;
  if (size == 0) {
    ::close(fd);
    fail(path, ": not a safetensors file: empty (need at least the 8-byte header length)");
  }
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) fail(path, ": cannot map: ", std::strerror(errno));
  f.owner_ = std::shared_ptr<void>(p, [size](void* q) { ::munmap(q, size); });
  f.parse(static_cast<const std::byte*>(p), size);
  return f;
}

SafeTensors SafeTensors::from_bytes(std::string bytes, const std::string& label) {
  SafeTensors f;
  f.label_ = label;
  auto holder = std::make_shared<std::string>(std::move(bytes));
  const auto* base = reinterpret_cast<const std::byte*>(holder->data());
  const size_t size = holder->size();
  f.owner_ = holder;
  f.parse(base, size);
  return f;
}

namespace {

// The header's JSON object; the format forbids duplicate keys (a JSON parser would keep the last
// one), so one set of keys per open object is kept while parsing.
nlohmann::json parse_header(const char* hp, uint64_t n, const std::string& L) {
  std::vector<std::set<std::string>> open_keys;
  std::string duplicate;
  const auto no_duplicates = [&](int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) open_keys.emplace_back();
    if (event == E::object_end && !open_keys.empty()) open_keys.pop_back();
    if (event == E::key && !open_keys.empty() && !open_keys.back().insert(parsed.get<std::string>()).second &&
        duplicate.empty()) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(hp, hp + n, no_duplicates);
  } catch (const nlohmann::json::exception& e) {
    fail(L, ": header is not valid JSON: ", e.what());
  }
  HEADS_CHECK(duplicate.empty(), L, ": header has the key \"", duplicate, "\" twice");
  HEADS_CHECK(header.is_object(), L, ": header is not a JSON object");
  return header;
}

struct ParsedEntry {
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

// One tensor's entry: dtype, shape (no larger than a Tensor may be) and data offsets that lie in the
// data segment and hold exactly the shape's bytes.
ParsedEntry parse_entry(const std::string& L, const std::string& name, const nlohmann::json& v, uint64_t data_size) {
  HEADS_CHECK(v.is_object(), L, ": tensor \"", name, "\": entry is not an object");
  HEADS_CHECK(v.contains("dtype") && v["dtype"].is_string(), L, ": tensor \"", name,
              "\": missing or non-string dtype");
  ParsedEntry e{};
  const std::string dt = v["dtype"].get<std::string>();
  HEADS_CHECK(parse_dtype(dt, &e.dtype), L, ": tensor \"", name, "\": unsupported dtype \"", dt,
              "\" (accepted: F32, F64, F16, BF16, BOOL, U8, I64)");
  HEADS_CHECK(v.contains("shape") && v["shape"].is_array(), L, ": tensor \"", name,
              "\": missing shape");
  uint64_t numel = 1, span = 1;  // span: the product with empty dimensions counted as 1
  bool overflow = false;
  for (const auto& d : v["shape"]) {
    HEADS_CHECK(d.is_number_unsigned(), L, ": tensor \"", name,
                "\": shape entries must be non-negative integers");
    const uint64_t s = d.get<uint64_t>();
    HEADS_CHECK(s <= kMaxSpan && span <= kMaxSpan / std::max<uint64_t>(s, 1), L, ": tensor \"", name,
                "\": shape ", v["shape"].dump(), " is too large");
    e.shape.push_back(static_cast<int64_t>(s));
    span *= std::max<uint64_t>(s, 1);
    if (s != 0 && numel > UINT64_MAX / s) overflow = true;
    numel *= s;
  }
  HEADS_CHECK(v.contains("data_offsets") && v["data_offsets"].is_array() &&
                  v["data_offsets"].size() == 2 && v["data_offsets"][0].is_number_unsigned() &&
                  v["data_offsets"][1].is_number_unsigned(),
              L, ": tensor \"", name, "\": data_offsets must be two non-negative integers");
  e.begin = v["data_offsets"][0].get<uint64_t>();
  e.end = v["data_offsets"][1].get<uint64_t>();
  HEADS_CHECK(e.begin <= e.end, L, ": tensor \"", name, "\": data_offsets [", e.begin, ", ",
              e.end, "] are reversed");
  HEADS_CHECK(e.end <= data_size, L, ": tensor \"", name, "\": data_offsets [", e.begin, ", ",
              e.end, "] lie outside the data segment of ", data_size, " bytes");
  const uint64_t isz = dtype_size(e.dtype);
  HEADS_CHECK(!overflow && numel <= UINT64_MAX / isz && numel * isz == e.end - e.begin, L,
              ": tensor \"", name, "\": ", e.end - e.begin, " bytes do not match shape ",
              e.shape, " of ", dt);
  return e;
}

}  // namespace

void SafeTensors::parse(const std::byte* base, size_t size) {
  const std::string& L = label_;
  HEADS_CHECK(size >= 8, L, ": not a safetensors file: ", size,
              " bytes, need at least the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(base[i]);
  HEADS_CHECK(n <= size - 8, L, ": header length ", n, " runs past the end of the file (",
              size, " bytes)");
  HEADS_CHECK(n <= kMaxHeader, L, ": header length ", n, " exceeds the limit of ", kMaxHeader);
  const nlohmann::json header = parse_header(reinterpret_cast<const char*>(base + 8), n, L);
  const uint64_t data_size = size - 8 - n;
  data_ = base + 8 + n;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      HEADS_CHECK(it.value().is_object(), L, ": __metadata__ is not an object");
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        HEADS_CHECK(m.value().is_string(), L, ": __metadata__ value of \"", m.key(), "\" is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    ParsedEntry e = parse_entry(L, it.key(), it.value(), data_size);
    entries_.emplace_back(it.key(), Entry{e.dtype, std::move(e.shape), e.begin, e.end});
  }
  check_layout(data_size);
}

// The tensors tile the data segment exactly: sorted by offset, no overlap, no gap, nothing after.
void SafeTensors::check_layout(uint64_t data_size) {
  const std::string& L = label_;
  std::sort(entries_.begin(), entries_.end(), [](const auto& a, const auto& b) {
    return a.second.begin != b.second.begin ? a.second.begin < b.second.begin
                                            : a.second.end < b.second.end;
  });
  uint64_t pos = 0;
  for (const auto& [name, e] : entries_) {
    HEADS_CHECK(e.begin >= pos, L, ": tensor \"", name, "\": data_offsets [", e.begin, ", ",
                e.end, "] overlap the previous tensor (which ends at ", pos, ")");
    HEADS_CHECK(e.begin == pos, L, ": tensor \"", name, "\": data_offsets [", e.begin, ", ",
                e.end, "] leave a gap after byte ", pos);
    pos = e.end;
  }
  HEADS_CHECK(pos == data_size, L, ": tensors end at byte ", pos, " but the data segment has ",
              data_size, " bytes");
}

bool SafeTensors::contains(const std::string& name) const {
  for (const auto& [n, e] : entries_) {
    if (n == name) return true;
  }
  return false;
}

std::vector<std::string> SafeTensors::names() const {
  std::vector<std::string> out;
  for (const auto& [n, e] : entries_) out.push_back(n);
  return out;
}

Tensor SafeTensors::get(const std::string& name) const {
  for (const auto& [n, e] : entries_) {
    if (n != name) continue;
    auto* p = const_cast<std::byte*>(data_ + e.begin);
    Tensor view = Tensor::from_blob(p, e.shape, e.dtype, owner_);
    if (reinterpret_cast<uintptr_t>(p) % dtype_size(e.dtype) != 0) return view.clone();
    return view;
  }
  fail(label_, ": tensor \"", name, "\" not found (have: ", join_names(names()), ")");
}

std::vector<std::pair<std::string, Tensor>> load_safetensors(const std::string& path) {
  const SafeTensors f = SafeTensors::open(path);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& n : f.names()) out.emplace_back(n, f.get(n));
  return out;
}

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> seen;
  uint64_t offset = 0;
  std::vector<Tensor> contig;
  for (const auto& [name, t] : tensors) {
    HEADS_CHECK(!name.empty() && name != "__metadata__", path, ": invalid tensor name \"", name,
                "\"");
    HEADS_CHECK(seen.insert(name).second, path, ": tensor name \"", name, "\" given twice");
    HEADS_CHECK(t.defined(), path, ": tensor \"", name, "\" is undefined");
    contig.push_back(t.contiguous());
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * t.itemsize();
    header[name] = {{"dtype", safetensors_dtype(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8 != 0) h.push_back(' ');  // align the data segment to 8 bytes
  std::string out;
  out.reserve(8 + h.size() + offset);
  const uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += h;
  for (const Tensor& t : contig) {
    out.append(static_cast<const char*>(t.raw_data()), static_cast<size_t>(t.numel()) * t.itemsize());
  }
  write_file_atomically(path, out);
}

}  // namespace heads
