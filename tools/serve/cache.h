// cache.h — the server's embedding cache, in two tiers keyed by (model version, text):
//   1. memory: an LRU with a byte cap (text + embedding + bookkeeping), evicting the least
//      recently used entries;
//   2. disk (optional): an LMDB database in a directory, which survives restarts. Its keys are
//      SHA-256 digests of (version, text); the value holds the text too, which a read compares, so a
//      digest collision is a miss, never a wrong answer. When its data reaches the cap it is
//      emptied and starts over (counted in the metrics); the file can grow to twice the cap (or stays at
//      the size an earlier run with a larger cap left).
// A disk hit is copied into memory. Every method is thread-safe.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace heads::serve {

class Metrics;

struct CacheOptions {
  int64_t memory_bytes = int64_t{256} << 20;  // 0: no memory tier
  std::string disk_dir;                       // "": no disk tier
  int64_t disk_bytes = int64_t{1} << 30;
};

class EmbeddingCache {
 public:
  EmbeddingCache(const CacheOptions& options, Metrics* metrics);
  ~EmbeddingCache();
  EmbeddingCache(const EmbeddingCache&) = delete;
  EmbeddingCache& operator=(const EmbeddingCache&) = delete;

  // The embedding of `text` under `version`, if a tier holds it (copied to `out`, `dim` floats).
  bool get(std::string_view version, std::string_view text, float* out, int64_t dim);
  void put(std::string_view version, std::string_view text, const float* emb, int64_t dim);

  int64_t memory_bytes() const;
  int64_t memory_entries() const;

 private:
  struct Entry {
    std::string key;
    std::vector<float> emb;
  };
  bool memory_get(const std::string& key, float* out, int64_t dim);
  void memory_put(const std::string& key, const float* emb, int64_t dim);
  bool disk_get(std::string_view version, std::string_view text, float* out, int64_t dim);
  void disk_put(std::string_view version, std::string_view text, const float* emb, int64_t dim);

  CacheOptions opt_;
  Metrics* metrics_;
  mutable std::mutex mu_;
  std::list<Entry> lru_;  // most recent first
  std::unordered_map<std::string_view, std::list<Entry>::iterator> index_;  // views of Entry::key
  int64_t bytes_ = 0;
  struct Disk;
  std::unique_ptr<Disk> disk_;
};

// Lowercase hex SHA-256 of the bytes.
std::string sha256_hex(std::string_view bytes);
// Lowercase hex of n bytes.
std::string to_hex(const unsigned char* p, size_t n);

}  // namespace heads::serve
