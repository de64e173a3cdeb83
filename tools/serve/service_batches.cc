// service_batches.cc — the batcher's thread of `heads serve`'s Service (service.h): it merges queued
// requests into batches and runs them, embedding jobs through the encoder (each text once, the cache
// first), rerank jobs through the cross-encoder (all pairs of a batch in one call).
#include <cstring>
#include <string_view>
#include <unordered_map>

#include "heads/runtime.h"
#include "service.h"

namespace heads::serve {

void Service::run_batches() {
  if (opt_.threads > 0) set_num_threads(opt_.threads);  // OpenMP's thread count is per calling thread
  const auto max_wait = std::chrono::microseconds(opt_.max_wait_us);
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopped with nothing left
    // Wait for more requests until the batch is full or its first request has waited long enough.
    cv_.wait_until(lock, queue_.front()->enqueued + max_wait, [&] {
      return stop_ || draining_ || queued_tokens_ >= opt_.max_batch_tokens;
    });
    std::vector<std::unique_ptr<Job>> jobs;
    int64_t tokens = 0;
    while (!queue_.empty() && (jobs.empty() || tokens + queue_.front()->tokens <= opt_.max_batch_tokens)) {
      tokens += queue_.front()->tokens;
      queued_texts_ -= static_cast<int64_t>(queue_.front()->texts.size());
      queued_tokens_ -= queue_.front()->tokens;
      jobs.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    metrics_->set("heads_queue_texts", {}, static_cast<double>(queued_texts_));
    lock.unlock();
    try {
      run_batch(jobs);
    } catch (const std::exception& e) {  // outside the encoder (which run_batch catches): answer anyway
      for (auto& job : jobs) {
        try {
          job->done.set_value(failure(Code::Internal, std::string("batcher: ") + e.what()));
        } catch (const std::future_error&) {  // already answered
        }
      }
    }
    lock.lock();
  }
}

void Service::run_batch(std::vector<std::unique_ptr<Job>>& jobs) {
  const std::shared_ptr<const LoadedModel> m = model();
  const auto now = Clock::now();
  std::vector<EmbedResult> results(jobs.size());
  std::vector<bool> live(jobs.size(), false);
  for (size_t j = 0; j < jobs.size(); ++j) {
    Job& job = *jobs[j];
    metrics_->observe("heads_queue_wait_seconds", {}, std::chrono::duration<double>(now - job.enqueued).count());
    if (job.ctx.cancelled && job.ctx.cancelled()) {
      results[j] = failure(Code::Cancelled, "the request was cancelled");
    } else if (now > job.ctx.deadline) {
      results[j] = failure(Code::DeadlineExceeded, "the request's deadline passed while it was queued");
    } else if (job.rerank != (m->reranker != nullptr)) {
      results[j] = failure(Code::Unavailable, std::string("the model was reloaded as ") +
                                                  (m->reranker ? "a reranker" : "an embedding model") +
                                                  " (" + m->version + ") while the request was queued");
    } else {
      live[j] = true;
    }
  }
  if (m->encoder) embed_jobs(*m, jobs, live, results);
  else rerank_jobs(*m, jobs, live, results);
  for (size_t j = 0; j < jobs.size(); ++j) jobs[j]->done.set_value(std::move(results[j]));
}

void Service::embed_jobs(const LoadedModel& m, std::vector<std::unique_ptr<Job>>& jobs, const std::vector<bool>& live,
                         std::vector<EmbedResult>& results) {
  const SentenceEncoder& enc = *m.encoder;
  const int64_t dim = enc.dim();
  // Texts to compute, each once; where each goes: (job, row).
  std::vector<std::string> misses;
  std::vector<std::vector<std::pair<size_t, int64_t>>> dest;
  std::unordered_map<std::string_view, size_t> seen;
  for (size_t j = 0; j < jobs.size(); ++j) {
    if (!live[j]) continue;
    Job& job = *jobs[j];
    EmbedResult& r = results[j];
    r.dim = dim;
    r.version = m.version;
    r.prompt_tokens = job.tokens;
    r.embeddings.resize(job.texts.size() * static_cast<size_t>(dim));
    for (size_t i = 0; i < job.texts.size(); ++i) {
      const std::string& t = job.texts[i];
      float* row = r.embeddings.data() + i * static_cast<size_t>(dim);
      auto s = seen.find(t);
      if (s != seen.end()) {
        dest[s->second].emplace_back(j, static_cast<int64_t>(i));
      } else if (!cache_.get(m.version, t, row, dim)) {
        seen.emplace(t, misses.size());
        misses.push_back(t);
        dest.push_back({{j, static_cast<int64_t>(i)}});
      }
    }
  }
  if (misses.empty()) return;
  const auto t0 = Clock::now();
  try {
    Tensor e;
    {
      std::lock_guard compute(compute_mu_);
      e = enc.encode(misses, opt_.batch_size);
    }
    const float* data = e.data<float>();
    int64_t tokens = 0;
    for (size_t k = 0; k < misses.size(); ++k) {
      const float* row = data + static_cast<int64_t>(k) * dim;
      cache_.put(m.version, misses[k], row, dim);
      for (const auto& [j, i] : dest[k]) {
        std::memcpy(results[j].embeddings.data() + i * dim, row, static_cast<size_t>(dim) * 4);
      }
    }
    for (size_t j = 0; j < jobs.size(); ++j) tokens += live[j] ? jobs[j]->tokens : 0;
    metrics_->add("heads_texts_total", {}, static_cast<double>(misses.size()));
    metrics_->add("heads_tokens_total", {}, static_cast<double>(tokens));
  } catch (const std::exception& ex) {
    for (size_t j = 0; j < jobs.size(); ++j) {
      if (live[j]) results[j] = failure(Code::Internal, std::string("encoder: ") + ex.what());
    }
  }
  metrics_->observe("heads_batch_texts", {}, static_cast<double>(misses.size()));
  metrics_->observe("heads_batch_seconds", {}, std::chrono::duration<double>(Clock::now() - t0).count());
}

void Service::rerank_jobs(const LoadedModel& m, std::vector<std::unique_ptr<Job>>& jobs, const std::vector<bool>& live,
                          std::vector<EmbedResult>& results) {
  // Every live job's pairs in one predict call (batched by length inside it).
  std::vector<CrossEncoder::Pair> pairs;
  int64_t tokens = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    if (!live[j]) continue;
    for (const std::string& t : jobs[j]->texts) pairs.emplace_back(jobs[j]->query, t);
    tokens += jobs[j]->tokens;
  }
  if (pairs.empty()) return;
  const auto t0 = Clock::now();
  try {
    Tensor s;
    {
      std::lock_guard compute(compute_mu_);
      s = m.reranker->predict(pairs, ScoreActivation::Identity, opt_.batch_size);
    }
    const float* score = s.data<float>();
    for (size_t j = 0; j < jobs.size(); ++j) {
      if (!live[j]) continue;
      EmbedResult& r = results[j];
      r.version = m.version;
      r.prompt_tokens = jobs[j]->tokens;
      r.scores.assign(score, score + jobs[j]->texts.size());
      score += jobs[j]->texts.size();
    }
    metrics_->add("heads_pairs_total", {}, static_cast<double>(pairs.size()));
    metrics_->add("heads_tokens_total", {}, static_cast<double>(tokens));
  } catch (const std::exception& ex) {
    for (size_t j = 0; j < jobs.size(); ++j) {
      if (live[j]) results[j] = failure(Code::Internal, std::string("reranker: ") + ex.what());
    }
  }
  metrics_->observe("heads_batch_texts", {}, static_cast<double>(pairs.size()));
  metrics_->observe("heads_batch_seconds", {}, std::chrono::duration<double>(Clock::now() - t0).count());
}

}  // namespace heads::serve
