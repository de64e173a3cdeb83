// service.cc — model slot, requests, limits and cache of `heads serve` (service.h); the batcher's
// thread is in service_batches.cc.
#include "service.h"

#include <malloc.h>
#include <openssl/evp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include <nlohmann/json.hpp>

#include "heads/error.h"
#include "heads/runtime.h"

namespace heads::serve {

namespace fs = std::filesystem;

const char* code_name(Code c) {
  switch (c) {
    case Code::Ok: return "ok";
    case Code::InvalidArgument: return "invalid_argument";
    case Code::ResourceExhausted: return "resource_exhausted";
    case Code::DeadlineExceeded: return "deadline_exceeded";
    case Code::Cancelled: return "cancelled";
    case Code::Unavailable: return "unavailable";
    case Code::Internal: return "internal";
  }
  return "internal";
}

EmbedResult failure(Code code, std::string message) {
  EmbedResult r;
  r.code = code;
  r.message = std::move(message);
  return r;
}

std::vector<Ranked> ranked(const EmbedResult& r, bool raw) {
  std::vector<Ranked> out(r.scores.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const double z = r.scores[i];
    out[i] = {i, raw ? z : 1.0 / (1.0 + std::exp(-z))};
  }
  std::stable_sort(out.begin(), out.end(), [](const Ranked& a, const Ranked& b) { return a.score > b.score; });
  return out;
}

namespace {

std::future<EmbedResult> ready(EmbedResult r) {
  std::promise<EmbedResult> p;
  p.set_value(std::move(r));
  return p.get_future();
}

// A reranker's directory: config.json's architectures name a *ForSequenceClassification model.
bool is_reranker(const std::string& dir) {
  std::ifstream in(fs::path(dir) / "config.json");
  if (!in) return false;  // the loader names what is missing
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("architectures") || !j.at("architectures").is_array()) return false;
  const std::string suffix = "ForSequenceClassification";
  for (const auto& a : j.at("architectures")) {
    if (a.is_string() && a.get<std::string>().size() >= suffix.size() &&
        a.get<std::string>().compare(a.get<std::string>().size() - suffix.size(), suffix.size(), suffix) == 0) {
      return true;
    }
  }
  return false;
}

// The limit on texts per request, or an error naming it.
std::optional<EmbedResult> over_limit(const char* field, int64_t n, int64_t max_texts) {
  if (n == 0) return failure(Code::InvalidArgument, std::string(field) + ": no texts (give a string or a list of strings)");
  if (n > max_texts) {
    return failure(Code::ResourceExhausted, std::string(field) + ": " + std::to_string(n) +
                                                " texts, over the limit of " + std::to_string(max_texts) +
                                                " per request (--max-texts); split the request");
  }
  return std::nullopt;
}

}  // namespace

std::string model_digest(const std::string& dir) {
  // The files SentenceEncoder::load and CrossEncoder::load read (sentence_encoder.h, cross_encoder.h,
  // bert.h, tokenizer.h), those present.
  static const char* kFiles[] = {"config.json",           "model.safetensors",         "tokenizer.json",
                                 "vocab.txt",             "tokenizer_config.json",     "sentence_bert_config.json",
                                 "modules.json",          "1_Pooling/config.json"};
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  HEADS_CHECK(ctx && EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) == 1, "sha256 failed");
  std::vector<char> buf(1 << 20);
  for (const char* name : kFiles) {
    const fs::path path = fs::path(dir) / name;
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) continue;  // absent; anything else the loader has refused
    std::ifstream in(path, std::ios::binary);
    if (!in) continue;
    EVP_DigestUpdate(ctx.get(), name, std::strlen(name) + 1);
    while (in) {
      in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
      EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(in.gcount()));
    }
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  HEADS_CHECK(EVP_DigestFinal_ex(ctx.get(), md, &n) == 1, "sha256 failed");
  return to_hex(md, 6);
}

Service::Service(const Options& options, Metrics* metrics)
    : opt_(options), metrics_(metrics), cache_(options.cache, metrics) {
  metrics_->counter("heads_requests_total", "Requests by route and outcome code.");
  metrics_->histogram("heads_request_seconds", "Request latency by route (seconds).",
                      {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10});
  metrics_->histogram("heads_batch_texts", "Texts per encoder batch (after the cache).",
                      {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024});
  metrics_->histogram("heads_batch_seconds", "Time to run one encoder batch (seconds).",
                      {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10});
  metrics_->histogram("heads_queue_wait_seconds", "Time a request waited in the batcher's queue (seconds).",
                      {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5});
  metrics_->gauge("heads_queue_texts", "Texts waiting in the batcher's queue.");
  metrics_->counter("heads_texts_total", "Texts embedded by the encoder (cache misses).");
  metrics_->counter("heads_pairs_total", "(query, text) pairs scored by the reranker.");
  metrics_->counter("heads_tokens_total", "Tokens of the requests run through the encoder (after truncation).");
  metrics_->counter("heads_cache_requests_total", "Cache lookups by tier and result (hit / miss).");
  metrics_->counter("heads_cache_evictions_total", "Cache evictions by tier (disk: the database was emptied).");
  metrics_->counter("heads_cache_errors_total", "Failed cache writes by tier.");
  metrics_->gauge("heads_cache_bytes", "Bytes held by the memory cache.");
  metrics_->gauge("heads_cache_entries", "Entries held by the memory cache.");
  metrics_->gauge("heads_model_info", "The model being served (value 1), by version and dtype.");
  metrics_->counter("heads_reloads_total", "Model reloads by outcome (ok / failed).");
  metrics_->gauge("heads_ready", "1 when the server takes requests, 0 while draining.");
  model_ = load(opt_.model_dir);
  metrics_->set("heads_model_info", {{"version", model_->version}, {"dtype", model_->dtype}}, 1);
  metrics_->set("heads_ready", {}, 1);
  worker_ = std::thread([this] { run_batches(); });
}

Service::~Service() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

std::shared_ptr<const LoadedModel> Service::load(const std::string& dir) const {
  HEADS_CHECK(fs::is_directory(dir), "model: ", dir, " is not a directory");
  // The version names the files loaded: hashed before and after loading, so that a directory
  // being rewritten meanwhile is an error, not embeddings cached under another model's version.
  const std::string digest = model_digest(dir);
  std::shared_ptr<const SentenceEncoder> enc;
  std::shared_ptr<const CrossEncoder> reranker;
  if (is_reranker(dir)) {
    reranker = std::make_shared<CrossEncoder>(CrossEncoder::load(dir, opt_.precision));
  } else {
    enc = std::make_shared<SentenceEncoder>(SentenceEncoder::load(dir, opt_.precision));
  }
  const Precision precision = enc ? enc->precision() : reranker->precision();
  HEADS_CHECK(model_digest(dir) == digest, "model: the files of ", dir,
              " changed while they were loaded; try again once they are complete");
  // Whoever drops the last reference frees the model and gives its pages back: glibc keeps freed
  // memory in the heap of the thread that allocated it (and the CLI raises the trim threshold), so
  // without the trim each reload would leave a model's worth of RSS behind.
  std::shared_ptr<LoadedModel> m(new LoadedModel, [](LoadedModel* p) {
    delete p;
    malloc_trim(0);
  });
  m->dtype = precision_name(precision);
  m->name = opt_.model_name;
  if (m->name.empty()) {
    const fs::path p = fs::path(dir).lexically_normal();
    m->name = (p.has_filename() ? p.filename() : p.parent_path().filename()).string();
  }
  HEADS_CHECK(!batch_invariant() || batch_invariance_holds(precision),
              "serve --batch-invariant: ", m->dtype, " on this CPU runs oneDNN's native ", m->dtype,
              " matmul, whose sums depend on the batch; serve f32 or int8 (--dtype) for batch invariance");
  // Batch-invariant results differ from the default ones in the last bits: a cache of one kind
  // must not answer for the other.
  m->version = m->name + "-" + m->dtype + (batch_invariant() ? "-bi" : "") + "-" + digest;
  m->dir = dir;
  m->encoder = std::move(enc);
  m->reranker = std::move(reranker);
  return m;
}

std::shared_ptr<const LoadedModel> Service::model() const {
  std::lock_guard lock(model_mu_);
  return model_;
}

EmbedResult Service::reload(const std::string& dir) {
  std::unique_lock busy(reload_mu_, std::try_to_lock);
  if (!busy.owns_lock()) return failure(Code::ResourceExhausted, "reload: another reload is in progress");
  std::shared_ptr<const LoadedModel> next;
  try {
    next = load(dir);
  } catch (const std::exception& e) {
    metrics_->add("heads_reloads_total", {{"result", "failed"}});
    return failure(Code::InvalidArgument, std::string("reload: ") + e.what() + " (still serving " +
                                              model()->version + ")");
  }
  std::shared_ptr<const LoadedModel> old;
  {
    std::lock_guard lock(model_mu_);
    old = model_;
    model_ = next;
  }
  metrics_->set("heads_model_info", {{"version", old->version}, {"dtype", old->dtype}}, 0);
  metrics_->set("heads_model_info", {{"version", next->version}, {"dtype", next->dtype}}, 1);
  metrics_->add("heads_reloads_total", {{"result", "ok"}});

  EmbedResult r;
  r.version = next->version;
  r.dim = next->dim();
  return r;
}

void Service::with_model(const std::function<void(const LoadedModel&)>& f) {
  const std::shared_ptr<const LoadedModel> m = model();
  std::lock_guard compute(compute_mu_);
  if (opt_.threads > 0) set_num_threads(opt_.threads);  // OpenMP's thread count is per calling thread
  f(*m);
}

bool Service::acquire_stream_texts(int64_t n, const std::function<bool()>& gone) {
  const int64_t budget = std::max(opt_.max_texts, opt_.max_queue_texts / 2);
  std::unique_lock lock(stream_mu_);
  while (stream_texts_ > 0 && stream_texts_ + n > budget) {
    if (gone()) return false;
    stream_cv_.wait_for(lock, std::chrono::milliseconds(50));
  }
  stream_texts_ += n;
  return true;
}

void Service::release_stream_texts(int64_t n) {
  {
    std::lock_guard lock(stream_mu_);
    stream_texts_ -= n;
  }
  stream_cv_.notify_all();
}

void Service::drain() {
  draining_ = true;
  metrics_->set("heads_ready", {}, 0);
  cv_.notify_all();
}

int64_t Service::queued_texts() const {
  std::lock_guard lock(mu_);
  return queued_texts_;
}

EmbedResult Service::embed_sync(std::vector<std::string> texts, const RequestContext& ctx) {
  return embed(std::move(texts), ctx).get();
}

std::future<EmbedResult> Service::embed(std::vector<std::string> texts, const RequestContext& ctx) {
  {
    std::lock_guard lock(mu_);
    if (stop_) return ready(failure(Code::Unavailable, "the server is shutting down"));
  }
  const auto n = static_cast<int64_t>(texts.size());
  if (auto e = over_limit("input", n, opt_.max_texts)) return ready(std::move(*e));
  const std::shared_ptr<const LoadedModel> m = model();
  if (!m->encoder) {
    return ready(failure(Code::InvalidArgument, "the model served (" + m->version +
                                                    ") is a reranker: it answers /rerank, not embeddings"));
  }
  const SentenceEncoder& enc = *m->encoder;
  auto job = std::make_unique<Job>();
  for (int64_t i = 0; i < n; ++i) {
    const auto e = enc.tokenizer().encode(texts[static_cast<size_t>(i)], enc.max_seq_length());
    if (e.truncated && !opt_.truncate) {
      return ready(failure(Code::ResourceExhausted,
                           "input[" + std::to_string(i) + "]: longer than the model's " +
                               std::to_string(enc.max_seq_length()) +
                               " tokens, and the server was started with --no-truncate"));
    }
    job->tokens += static_cast<int64_t>(e.ids.size());
  }
  // Every text in the cache: answer at once.
  const int64_t dim = enc.dim();
  EmbedResult hit;
  hit.embeddings.resize(static_cast<size_t>(n * dim));
  bool all = true;
  for (int64_t i = 0; i < n && all; ++i) {
    all = cache_.get(m->version, texts[static_cast<size_t>(i)], hit.embeddings.data() + i * dim, dim);
  }
  if (all) {
    hit.dim = dim;
    hit.version = m->version;
    hit.prompt_tokens = job->tokens;
    return ready(std::move(hit));
  }
  job->texts = std::move(texts);
  job->ctx = ctx;
  return enqueue(std::move(job));
}

std::future<EmbedResult> Service::rerank(std::string query, std::vector<std::string> texts,
                                         const RequestContext& ctx) {
  {
    std::lock_guard lock(mu_);
    if (stop_) return ready(failure(Code::Unavailable, "the server is shutting down"));
  }
  if (auto e = over_limit("texts", static_cast<int64_t>(texts.size()), opt_.max_texts)) return ready(std::move(*e));
  const std::shared_ptr<const LoadedModel> m = model();
  if (!m->reranker) {
    return ready(failure(Code::InvalidArgument, "the model served (" + m->version +
                                                    ") is an embedding model; /rerank needs a reranker "
                                                    "(a *ForSequenceClassification directory)"));
  }
  const CrossEncoder& ce = *m->reranker;
  if (ce.num_labels() != 1) {
    return ready(failure(Code::InvalidArgument, "the reranker served has " + std::to_string(ce.num_labels()) +
                                                    " labels; ranking needs one"));
  }
  auto job = std::make_unique<Job>();
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto e = ce.tokenizer().encode_pair(query, texts[i], ce.max_length());
    if (e.truncated && !opt_.truncate) {
      return ready(failure(Code::ResourceExhausted, "texts[" + std::to_string(i) + "]: with the query, longer than the model's " +
                                                        std::to_string(ce.max_length()) +
                                                        " tokens, and the server was started with --no-truncate"));
    }
    job->tokens += static_cast<int64_t>(e.ids.size());
  }
  job->rerank = true;
  job->query = std::move(query);
  job->texts = std::move(texts);
  job->ctx = ctx;
  return enqueue(std::move(job));
}

std::future<EmbedResult> Service::enqueue(std::unique_ptr<Job> job) {
  const auto n = static_cast<int64_t>(job->texts.size());
  job->enqueued = Clock::now();
  std::future<EmbedResult> f = job->done.get_future();
  {
    std::lock_guard lock(mu_);
    if (stop_) return ready(failure(Code::Unavailable, "the server is shutting down"));
    if (queued_texts_ + n > opt_.max_queue_texts) {
      return ready(failure(Code::ResourceExhausted, "the server is busy: " + std::to_string(queued_texts_) +
                                                        " texts queued, limit " +
                                                        std::to_string(opt_.max_queue_texts) +
                                                        " (--max-queue); retry later"));
    }
    queued_texts_ += n;
    queued_tokens_ += job->tokens;
    queue_.push_back(std::move(job));
    metrics_->set("heads_queue_texts", {}, static_cast<double>(queued_texts_));
  }
  cv_.notify_one();
  return f;
}

}  // namespace heads::serve
