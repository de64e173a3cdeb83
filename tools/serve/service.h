// service.h — the transport-independent core of `heads serve`: the model being served (swapped
// atomically on reload), the dynamic batcher that merges requests from many clients into encoder
// batches, the tiered cache, limits and metrics. The HTTP (http_api.cc) and gRPC (grpc_api.cc)
// front ends translate to and from it.
//
// Threads: one batcher thread runs the model (which uses every core through OpenMP); request
// threads only tokenize, look up the cache and wait. A reload loads the new model on its own
// thread while the old one keeps serving.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cache.h"
#include "heads/cross_encoder.h"
#include "heads/precision.h"
#include "heads/sentence_encoder.h"
#include "metrics.h"

namespace heads::serve {

using Clock = std::chrono::steady_clock;

// The outcome of a request, mapped by the front ends to gRPC status codes and HTTP statuses.
enum class Code { Ok, InvalidArgument, ResourceExhausted, DeadlineExceeded, Cancelled, Unavailable, Internal };
const char* code_name(Code c);  // "ok", "invalid_argument", ...

struct EmbedResult;
EmbedResult failure(Code code, std::string message);  // a result with the error

struct Options {
  std::string model_dir;
  std::string model_name;              // in versions and responses; "": the directory's name
  std::optional<Precision> precision;  // none: what the directory stores
  int64_t batch_size = 32;             // texts per encoder forward (as `heads embed --batch-size`)
  int64_t max_batch_tokens = 16384;    // tokens merged into one batch of requests
  int64_t max_wait_us = 0;             // how long the first request of a batch may wait for others
  int64_t max_texts = 512;             // texts per request
  int64_t max_queue_texts = 8192;      // texts waiting in the batcher
  bool truncate = true;                // false: a text over max_seq_length is rejected
  int64_t timeout_ms = 60000;          // default deadline of a request without one
  int threads = 0;                     // threads the model computes with (0: OpenMP's default)
  CacheOptions cache;
};

// The model served: an embedding model (a sentence-transformers directory), or a reranker (a
// directory whose config.json names a *ForSequenceClassification architecture).
struct LoadedModel {
  std::shared_ptr<const SentenceEncoder> encoder;  // set for an embedding model
  std::shared_ptr<const CrossEncoder> reranker;    // set for a reranker
  const BertModel& bert() const { return encoder ? encoder->bert() : reranker->bert(); }
  const Tokenizer& tokenizer() const { return encoder ? encoder->tokenizer() : reranker->tokenizer(); }
  int64_t max_length() const { return encoder ? encoder->max_seq_length() : reranker->max_length(); }
  int64_t dim() const { return encoder ? encoder->dim() : 0; }  // a reranker gives scores, no embeddings
  const char* kind() const { return encoder ? "embedding" : "reranker"; }
  std::string version;  // "<name>-<dtype>-<12 hex digits of the files' SHA-256>"
  std::string name;     // Options::model_name, or the directory's name
  std::string dir;      // its path, as given
  std::string dtype;
};

struct EmbedResult {
  Code code = Code::Ok;
  std::string message;
  std::vector<float> embeddings;  // [n, dim]
  std::vector<float> scores;      // rerank: one raw score (logit) per text, in order
  int64_t dim = 0;
  std::string version;
  int64_t prompt_tokens = 0;
};

// A request's deadline and a way to ask whether its caller has gone away.
struct RequestContext {
  Clock::time_point deadline = Clock::time_point::max();
  std::function<bool()> cancelled;  // may be empty
};

class Service {
 public:
  // Loads the model (throws heads::Error when it cannot) and starts the batcher.
  Service(const Options& options, Metrics* metrics);
  ~Service();

  // Embeddings of `texts`, in order. Never throws: errors come back as a code and a message.
  std::future<EmbedResult> embed(std::vector<std::string> texts, const RequestContext& ctx);
  EmbedResult embed_sync(std::vector<std::string> texts, const RequestContext& ctx);
  // Scores of (query, text) for each text by a served reranker, batched with other requests as
  // embeddings are (not cached). Never throws; an embedding model answers InvalidArgument.
  std::future<EmbedResult> rerank(std::string query, std::vector<std::string> texts, const RequestContext& ctx);

  std::shared_ptr<const LoadedModel> model() const;

  // Runs f with the current model on the calling thread, while no batch runs (model work is one
  // thing at a time: each uses every core). For requests that are not embeddings (Attend).
  void with_model(const std::function<void(const LoadedModel&)>& f);

  // Loads `dir` (with the precision the server was started with) and swaps it in; requests already
  // batched finish on the old model. A model that fails to load leaves the old one serving and
  // comes back as the error. One reload at a time: a second one meanwhile is ResourceExhausted.
  EmbedResult reload(const std::string& dir);

  // Streams (EmbedStream) share a budget of max(max_texts, max_queue_texts / 2) texts in the server:
  // acquire waits until n more fit (or none are taken), polling `gone` (false: the caller left);
  // release gives them back once answered.
  bool acquire_stream_texts(int64_t n, const std::function<bool()>& gone);
  void release_stream_texts(int64_t n);

  // Marks the server as shutting down (health: not ready, the batcher stops waiting for more
  // requests); requests keep being served while the front ends finish theirs.
  void drain();
  bool draining() const { return draining_.load(); }
  const Options& options() const { return opt_; }
  int64_t queued_texts() const;

 private:
  struct Job {
    bool rerank = false;  // texts scored against query, or embedded
    std::string query;
    std::vector<std::string> texts;
    int64_t tokens = 0;
    RequestContext ctx;
    Clock::time_point enqueued;
    std::promise<EmbedResult> done;
  };
  std::shared_ptr<const LoadedModel> load(const std::string& dir) const;
  void run_batches();
  // Queues a job of n texts (the queue's limits), or answers it with the error.
  std::future<EmbedResult> enqueue(std::unique_ptr<Job> job);
  void run_batch(std::vector<std::unique_ptr<Job>>& jobs);
  // The embedding jobs and the rerank jobs of a batch (those live), results[j] for jobs[j].
  void embed_jobs(const LoadedModel& m, std::vector<std::unique_ptr<Job>>& jobs, const std::vector<bool>& live,
                  std::vector<EmbedResult>& results);
  void rerank_jobs(const LoadedModel& m, std::vector<std::unique_ptr<Job>>& jobs, const std::vector<bool>& live,
                   std::vector<EmbedResult>& results);

  Options opt_;
  Metrics* metrics_;
  EmbeddingCache cache_;
  mutable std::mutex model_mu_;
  std::shared_ptr<const LoadedModel> model_;
  std::mutex reload_mu_;
  std::mutex compute_mu_;  // held while the model computes

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Job>> queue_;
  int64_t queued_texts_ = 0, queued_tokens_ = 0;
  bool stop_ = false;
  std::atomic<bool> draining_{false};
  std::thread worker_;
  std::mutex stream_mu_;
  std::condition_variable stream_cv_;
  int64_t stream_texts_ = 0;
};

// A rerank result's texts ranked, for /rerank and gRPC Rerank: highest score first (ties in text
// order), each score the logit (raw) or its sigmoid.
struct Ranked {
  size_t index;
  double score;
};
std::vector<Ranked> ranked(const EmbedResult& r, bool raw);

// 12 hex digits of a SHA-256 over the files of a model directory the encoder reads. A model's
// version is "<name>-<dtype>-<digest>": the same files give the same version across restarts, so
// the disk cache stays valid.
std::string model_digest(const std::string& dir);

}  // namespace heads::serve
