// cache.cc — memory LRU and LMDB tiers of the embedding cache (cache.h).
#include "cache.h"

#include <lmdb.h>
#include <openssl/evp.h>

#include <cstring>
#include <filesystem>

#include "heads/error.h"
#include "metrics.h"

namespace heads::serve {

namespace {

// Bytes an entry costs in the memory tier, bookkeeping included (list node, index slot).
int64_t entry_bytes(size_t key_size, int64_t dim) {
  return static_cast<int64_t>(key_size) + dim * 4 + 128;
}

std::string memory_key(std::string_view version, std::string_view text) {
  std::string key;
  key.reserve(version.size() + 1 + text.size());
  key.append(version).push_back('\0');
  key.append(text);
  return key;
}

void check_lmdb(int rc, const char* what, const std::string& dir) {
  HEADS_CHECK(rc == MDB_SUCCESS, "cache: ", what, " failed for ", dir, ": ", mdb_strerror(rc));
}

}  // namespace

std::string sha256_hex(std::string_view bytes) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  HEADS_CHECK(EVP_Digest(bytes.data(), bytes.size(), md, &n, EVP_sha256(), nullptr) == 1, "sha256 failed");
  return to_hex(md, n);
}

std::string to_hex(const unsigned char* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

struct EmbeddingCache::Disk {
  MDB_env* env = nullptr;
  MDB_dbi dbi = 0;
  std::string dir;
  std::mutex write_mu;  // one write transaction at a time, as LMDB wants
  ~Disk() {
    if (env) mdb_env_close(env);
  }
};

EmbeddingCache::EmbeddingCache(const CacheOptions& options, Metrics* metrics) : opt_(options), metrics_(metrics) {
  if (opt_.disk_dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(opt_.disk_dir, ec);
  HEADS_CHECK(std::filesystem::is_directory(opt_.disk_dir), "--cache-dir ", opt_.disk_dir,
              ": not a directory and cannot be created", ec ? ": " + ec.message() : std::string());
  disk_ = std::make_unique<Disk>();
  disk_->dir = opt_.disk_dir;
  check_lmdb(mdb_env_create(&disk_->env), "mdb_env_create", opt_.disk_dir);
  // Twice the cap: the data stays under the cap (disk_put), the rest is room for copy-on-write
  // pages and for the free list when the database is emptied.
  check_lmdb(mdb_env_set_mapsize(disk_->env, static_cast<size_t>(opt_.disk_bytes) * 2), "mdb_env_set_mapsize",
             opt_.disk_dir);
  // MDB_NOTLS: read transactions are not tied to threads (the gRPC and HTTP pools share the env).
  check_lmdb(mdb_env_open(disk_->env, opt_.disk_dir.c_str(), MDB_NOTLS | MDB_NOSYNC, 0644), "mdb_env_open",
             opt_.disk_dir);
  MDB_txn* txn = nullptr;
  check_lmdb(mdb_txn_begin(disk_->env, nullptr, 0, &txn), "mdb_txn_begin", opt_.disk_dir);
  const int rc = mdb_dbi_open(txn, nullptr, 0, &disk_->dbi);
  if (rc != MDB_SUCCESS) mdb_txn_abort(txn);
  check_lmdb(rc, "mdb_dbi_open", opt_.disk_dir);
  check_lmdb(mdb_txn_commit(txn), "mdb_txn_commit", opt_.disk_dir);
}

EmbeddingCache::~EmbeddingCache() {
  if (disk_ && disk_->env) mdb_env_sync(disk_->env, 1);
}

bool EmbeddingCache::get(std::string_view version, std::string_view text, float* out, int64_t dim) {
  const std::string key = memory_key(version, text);
  if (memory_get(key, out, dim)) {
    metrics_->add("heads_cache_requests_total", {{"tier", "memory"}, {"result", "hit"}});
    return true;
  }
  metrics_->add("heads_cache_requests_total", {{"tier", "memory"}, {"result", "miss"}});
  if (!disk_) return false;
  const bool hit = disk_get(version, text, out, dim);
  metrics_->add("heads_cache_requests_total", {{"tier", "disk"}, {"result", hit ? "hit" : "miss"}});
  if (hit) memory_put(key, out, dim);
  return hit;
}

void EmbeddingCache::put(std::string_view version, std::string_view text, const float* emb, int64_t dim) {
  memory_put(memory_key(version, text), emb, dim);
  if (disk_) disk_put(version, text, emb, dim);
}

bool EmbeddingCache::memory_get(const std::string& key, float* out, int64_t dim) {
  std::lock_guard lock(mu_);
  auto it = index_.find(key);
  if (it == index_.end() || static_cast<int64_t>(it->second->emb.size()) != dim) return false;
  lru_.splice(lru_.begin(), lru_, it->second);
  std::memcpy(out, it->second->emb.data(), static_cast<size_t>(dim) * 4);
  return true;
}

void EmbeddingCache::memory_put(const std::string& key, const float* emb, int64_t dim) {
  const int64_t cost = entry_bytes(key.size(), dim);
  if (cost > opt_.memory_bytes) return;
  std::lock_guard lock(mu_);
  if (auto it = index_.find(key); it != index_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second);
    return;
  }
  lru_.push_front(Entry{key, std::vector<float>(emb, emb + dim)});
  index_.emplace(lru_.front().key, lru_.begin());
  bytes_ += cost;
  while (bytes_ > opt_.memory_bytes) {
    const Entry& old = lru_.back();
    bytes_ -= entry_bytes(old.key.size(), static_cast<int64_t>(old.emb.size()));
    index_.erase(old.key);
    lru_.pop_back();
    metrics_->add("heads_cache_evictions_total", {{"tier", "memory"}});
  }
  metrics_->set("heads_cache_bytes", {{"tier", "memory"}}, static_cast<double>(bytes_));
  metrics_->set("heads_cache_entries", {{"tier", "memory"}}, static_cast<double>(lru_.size()));
}

int64_t EmbeddingCache::memory_bytes() const {
  std::lock_guard lock(mu_);
  return bytes_;
}

int64_t EmbeddingCache::memory_entries() const {
  std::lock_guard lock(mu_);
  return static_cast<int64_t>(lru_.size());
}

// Disk values: [u64 text size][text][dim floats].
bool EmbeddingCache::disk_get(std::string_view version, std::string_view text, float* out, int64_t dim) {
  const std::string digest = sha256_hex(memory_key(version, text));
  MDB_txn* txn = nullptr;
  if (mdb_txn_begin(disk_->env, nullptr, MDB_RDONLY, &txn) != MDB_SUCCESS) return false;
  MDB_val k{digest.size(), const_cast<char*>(digest.data())}, v{};
  bool hit = false;
  if (mdb_get(txn, disk_->dbi, &k, &v) == MDB_SUCCESS && v.mv_size >= 8) {
    uint64_t n = 0;
    std::memcpy(&n, v.mv_data, 8);
    const auto* p = static_cast<const char*>(v.mv_data);
    if (n == text.size() && v.mv_size == 8 + n + static_cast<size_t>(dim) * 4 &&
        std::memcmp(p + 8, text.data(), n) == 0) {
      std::memcpy(out, p + 8 + n, static_cast<size_t>(dim) * 4);
      hit = true;
    }
  }
  mdb_txn_abort(txn);
  return hit;
}

void EmbeddingCache::disk_put(std::string_view version, std::string_view text, const float* emb, int64_t dim) {
  const std::string digest = sha256_hex(memory_key(version, text));
  std::string value(8 + text.size() + static_cast<size_t>(dim) * 4, '\0');
  const uint64_t n = text.size();
  std::memcpy(value.data(), &n, 8);
  std::memcpy(value.data() + 8, text.data(), n);
  std::memcpy(value.data() + 8 + n, emb, static_cast<size_t>(dim) * 4);
  std::lock_guard lock(disk_->write_mu);
  MDB_txn* txn = nullptr;
  if (mdb_txn_begin(disk_->env, nullptr, 0, &txn) != MDB_SUCCESS) {
    metrics_->add("heads_cache_errors_total", {{"tier", "disk"}});
    return;
  }
  // At the cap, empty the database in this transaction. The map is twice the cap (the constructor),
  // so that the copy-on-write pages and the free list of emptying it always fit.
  MDB_stat st{};
  int rc = mdb_stat(txn, disk_->dbi, &st);
  const auto live = static_cast<int64_t>((st.ms_branch_pages + st.ms_leaf_pages + st.ms_overflow_pages) * st.ms_psize);
  if (rc == MDB_SUCCESS && live + static_cast<int64_t>(value.size()) > opt_.disk_bytes) {
    rc = mdb_drop(txn, disk_->dbi, 0);
    if (rc == MDB_SUCCESS) metrics_->add("heads_cache_evictions_total", {{"tier", "disk"}});
  }
  MDB_val k{digest.size(), const_cast<char*>(digest.data())}, v{value.size(), value.data()};
  if (rc == MDB_SUCCESS) rc = mdb_put(txn, disk_->dbi, &k, &v, 0);
  if (rc == MDB_MAP_FULL) {  // full below the cap (free pages too scattered for the value): empty it
    rc = mdb_drop(txn, disk_->dbi, 0);
    if (rc == MDB_SUCCESS) {
      metrics_->add("heads_cache_evictions_total", {{"tier", "disk"}});
      rc = mdb_put(txn, disk_->dbi, &k, &v, 0);
    }
  }
  if (rc == MDB_SUCCESS) {
    rc = mdb_txn_commit(txn);  // frees the transaction, failed or not
  } else {
    mdb_txn_abort(txn);
  }
  if (rc != MDB_SUCCESS) metrics_->add("heads_cache_errors_total", {{"tier", "disk"}});
}

}  // namespace heads::serve
