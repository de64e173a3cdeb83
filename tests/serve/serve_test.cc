// The pieces of `heads serve` (tools/serve) in process, so that they also run under the sanitizers:
// metrics text, both cache tiers, the batcher (limits, many threads, reload) and the HTTP and gRPC
// front ends on loopback. tests/python/test_serve.py drives the real server process.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/testing.h"
#include "heads/v1/heads.grpc.pb.h"
#include "serve/http_client.h"
#include "server.h"

namespace heads::serve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using heads::testing::error_of;
using heads::testing::model_dir;
using heads::testing::rng;
namespace http = boost::beast::http;

// A directory of its own under the system's temporary directory, removed at the end.
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("heads-serve-test-" + std::to_string(getpid()) + "-" +
                                        std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

std::vector<std::string> sentences(int n, const std::string& tag) {
  static const char* words[] = {"attention", "heads", "keys", "values", "queries", "softmax", "scale", "mask"};
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) {
    std::string s = tag + " " + std::to_string(i);
    const int len = 1 + static_cast<int>(rng()() % 24);
    for (int k = 0; k < len; ++k) s += std::string(" ") + words[rng()() % 8];
    out.push_back(s);
  }
  return out;
}

std::vector<float> encode(const SentenceEncoder& enc, const std::vector<std::string>& texts) {
  const Tensor e = enc.encode(texts);
  return std::vector<float>(e.data<float>(), e.data<float>() + e.numel());
}

TEST(ServeMetrics, PrometheusText) {
  Metrics m;
  m.counter("t_total", "A counter.");
  m.histogram("t_seconds", "A histogram.", {0.5, 1});
  m.add("t_total", {{"route", "/a\"b"}}, 2);
  m.add("t_total", {{"route", "/a\"b"}});
  m.observe("t_seconds", {{"route", "x"}}, 0.25);
  m.observe("t_seconds", {{"route", "x"}}, 0.75);
  m.observe("t_seconds", {{"route", "x"}}, 7);
  EXPECT_EQ(m.value("t_total", {{"route", "/a\"b"}}), 3);
  EXPECT_EQ(m.prometheus(),
            "# HELP t_seconds A histogram.\n# TYPE t_seconds histogram\n"
            "t_seconds_bucket{route=\"x\",le=\"0.5\"} 1\n"
            "t_seconds_bucket{route=\"x\",le=\"1\"} 2\n"
            "t_seconds_bucket{route=\"x\",le=\"+Inf\"} 3\n"
            "t_seconds_sum{route=\"x\"} 8\n"
            "t_seconds_count{route=\"x\"} 3\n"
            "# HELP t_total A counter.\n# TYPE t_total counter\n"
            "t_total{route=\"/a\\\"b\"} 3\n");
  EXPECT_THAT(error_of([&] { m.add("undeclared", {}); }), HasSubstr("undeclared is not a declared counter"));
}

void declare_cache_metrics(Metrics& m) {
  m.counter("heads_cache_requests_total", "");
  m.counter("heads_cache_evictions_total", "");
  m.counter("heads_cache_errors_total", "");
  m.gauge("heads_cache_bytes", "");
  m.gauge("heads_cache_entries", "");
}

TEST(ServeCache, MemoryTierEvictsTheLeastRecentlyUsedWithinItsCap) {
  Metrics m;
  declare_cache_metrics(m);
  const int64_t dim = 100;  // 400 bytes of floats + text + 128 of bookkeeping: ~540 per entry
  CacheOptions o;
  o.memory_bytes = 3 * 560;
  EmbeddingCache c(o, &m);
  std::vector<float> v(dim), out(dim);
  for (int i = 0; i < 4; ++i) {
    std::fill(v.begin(), v.end(), static_cast<float>(i));
    c.put("v1", "text " + std::to_string(i), v.data(), dim);
    if (i == 2) ASSERT_TRUE(c.get("v1", "text 0", out.data(), dim));  // 0 becomes the most recent
  }
  EXPECT_EQ(c.memory_entries(), 3);
  EXPECT_LE(c.memory_bytes(), o.memory_bytes);
  EXPECT_FALSE(c.get("v1", "text 1", out.data(), dim));  // the least recently used went
  ASSERT_TRUE(c.get("v1", "text 0", out.data(), dim));
  EXPECT_EQ(out[dim - 1], 0.0f);
  ASSERT_TRUE(c.get("v1", "text 3", out.data(), dim));
  EXPECT_EQ(out[0], 3.0f);
  EXPECT_FALSE(c.get("v2", "text 3", out.data(), dim));  // another model version
  EXPECT_FALSE(c.get("v1", "text 3", out.data(), dim + 1));
  EXPECT_EQ(m.value("heads_cache_evictions_total", {{"tier", "memory"}}), 1);
}

// Emptying a database of thousands of pages needs room for its free list: at a cap of 48 MiB (large
// values, so that it fills in a few thousand writes) every write still succeeds.
TEST(ServeCache, DiskTierEmptiesAtALargeCap) {
  TempDir dir;
  const int64_t dim = 4096;
  std::vector<float> v(dim, 0.5f), out(dim);
  CacheOptions o;
  o.memory_bytes = 0;
  o.disk_dir = (dir.path / "db").string();
  o.disk_bytes = int64_t{48} << 20;
  Metrics m;
  declare_cache_metrics(m);
  EmbeddingCache c(o, &m);
  for (int i = 0; i < 4000; ++i) c.put("v", "t" + std::to_string(i), v.data(), dim);  // 4000 x 16 KB
  EXPECT_GE(m.value("heads_cache_evictions_total", {{"tier", "disk"}}), 1);
  EXPECT_EQ(m.value("heads_cache_errors_total", {{"tier", "disk"}}), 0);
  EXPECT_TRUE(c.get("v", "t3999", out.data(), dim));
  EXPECT_FALSE(c.get("v", "t0", out.data(), dim));
}

TEST(ServeCache, DiskTierSurvivesRestartsAndEmptiesWhenFull) {
  TempDir dir;
  const int64_t dim = 384;
  std::vector<float> v(dim), out(dim);
  for (int64_t i = 0; i < dim; ++i) v[i] = std::ldexp(static_cast<float>(i), -7);
  CacheOptions o;
  o.memory_bytes = 0;  // disk only
  o.disk_dir = (dir.path / "db").string();
  o.disk_bytes = 1 << 20;
  {
    Metrics m;
    declare_cache_metrics(m);
    EmbeddingCache c(o, &m);
    c.put("v1", "kept", v.data(), dim);
  }
  Metrics m;
  declare_cache_metrics(m);
  EmbeddingCache c(o, &m);
  ASSERT_TRUE(c.get("v1", "kept", out.data(), dim));
  EXPECT_EQ(out, v);
  EXPECT_FALSE(c.get("v1", "kep", out.data(), dim));
  EXPECT_FALSE(c.get("v0", "kept", out.data(), dim));
  // 1 MiB holds some hundreds of 1.6 KB values: writing thousands empties it a few times.
  for (int i = 0; i < 2000; ++i) c.put("v1", "filler " + std::to_string(i), v.data(), dim);
  EXPECT_GE(m.value("heads_cache_evictions_total", {{"tier", "disk"}}), 2);
  EXPECT_EQ(m.value("heads_cache_errors_total", {{"tier", "disk"}}), 0);
  ASSERT_TRUE(c.get("v1", "filler 1999", out.data(), dim));
  EXPECT_EQ(out, v);
  EXPECT_LE(fs::file_size(fs::path(o.disk_dir) / "data.mdb"), static_cast<uintmax_t>(2 * o.disk_bytes));
  o.disk_dir = "/proc/version/db";
  EXPECT_THAT(error_of([&] { EmbeddingCache bad(o, &m); }), HasSubstr("--cache-dir /proc/version/db"));
}

Options service_options() {
  Options o;
  o.model_dir = model_dir();
  o.max_texts = 40;
  o.max_wait_us = 1000;
  return o;
}

// A reranker served: rerank() scores as CrossEncoder::predict does, concurrent requests share model
// batches, and each kind of model refuses the other kind's requests.
TEST(ServeService, RerankScoresAsTheCrossEncoderAndBatchesRequests) {
  Metrics m;
  Options o = service_options();
  o.model_dir = heads::testing::reranker_dir();
  o.max_wait_us = 20000;
  Service s(o, &m);
  EXPECT_STREQ(s.model()->kind(), "reranker");
  EXPECT_EQ(s.model()->dim(), 0);
  const CrossEncoder ce = CrossEncoder::load(o.model_dir);
  const auto score = [&](const std::string& q, const std::vector<std::string>& texts) {
    std::vector<CrossEncoder::Pair> pairs;
    for (const auto& t : texts) pairs.emplace_back(q, t);
    const Tensor t = ce.predict(pairs);
    return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
  };
  const auto texts = sentences(9, "rerank");
  const EmbedResult r = s.rerank("what do heads attend to", texts, {}).get();
  ASSERT_EQ(r.code, Code::Ok) << r.message;
  EXPECT_EQ(r.scores, score("what do heads attend to", texts));  // alone: the same batches, bit for bit
  std::vector<EmbedResult> got(6);
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] { got[t] = s.rerank("query " + std::to_string(t), texts, {}).get(); });
  }
  for (auto& t : threads) t.join();
  for (int t = 0; t < 6; ++t) {
    ASSERT_EQ(got[t].code, Code::Ok) << got[t].message;
    const auto want = score("query " + std::to_string(t), texts);
    ASSERT_EQ(got[t].scores.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[t].scores[i], want[i], 1e-5) << t << " " << i;
  }
  EXPECT_EQ(m.value("heads_pairs_total", {}), 9 * 7);
  EXPECT_EQ(s.rerank("q", {}, {}).get().code, Code::InvalidArgument);
  EXPECT_EQ(s.rerank("q", std::vector<std::string>(41, "x"), {}).get().code, Code::ResourceExhausted);
  const EmbedResult e = s.embed_sync({"a"}, {});
  EXPECT_EQ(e.code, Code::InvalidArgument);
  EXPECT_THAT(e.message, HasSubstr("is a reranker: it answers /rerank"));
  Metrics m2;
  Service embedder(service_options(), &m2);
  const EmbedResult no = embedder.rerank("q", {"a"}, {}).get();
  EXPECT_EQ(no.code, Code::InvalidArgument);
  EXPECT_THAT(no.message, HasSubstr("is an embedding model; /rerank needs a reranker"));
}

TEST(ServeService, EmbedsAsTheEncoderDoesUnderLimitsAndManyThreads) {
  Metrics m;
  Service s(service_options(), &m);
  const SentenceEncoder enc = SentenceEncoder::load(model_dir());
  const auto texts = sentences(37, "alone");
  const EmbedResult r = s.embed_sync(texts, {});
  ASSERT_EQ(r.code, Code::Ok) << r.message;
  EXPECT_EQ(r.embeddings, encode(enc, texts));  // one request alone: the same batches, bit for bit
  EXPECT_EQ(r.dim, 384);
  EXPECT_THAT(r.version, ::testing::MatchesRegex("[A-Za-z0-9_.-]+-f32-[0-9a-f]{12}"));
  int64_t tokens = 0;
  for (const auto& t : texts) tokens += static_cast<int64_t>(enc.tokenize(t).size());
  EXPECT_EQ(r.prompt_tokens, tokens);

  EXPECT_EQ(s.embed_sync({}, {}).code, Code::InvalidArgument);
  const EmbedResult big = s.embed_sync(std::vector<std::string>(41, "x"), {});
  EXPECT_EQ(big.code, Code::ResourceExhausted);
  EXPECT_THAT(big.message, HasSubstr("41 texts, over the limit of 40"));
  RequestContext past;
  past.deadline = Clock::now() - std::chrono::seconds(1);
  EXPECT_EQ(s.embed_sync(sentences(2, "late"), past).code, Code::DeadlineExceeded);
  RequestContext gone;
  gone.cancelled = [] { return true; };
  EXPECT_EQ(s.embed_sync(sentences(2, "gone"), gone).code, Code::Cancelled);

  // Eight clients at once, their requests merged into shared batches (and partly cached).
  std::vector<std::vector<std::string>> asks(8);
  for (int t = 0; t < 8; ++t) asks[t] = t < 4 ? sentences(5 + t, "thread" + std::to_string(t)) : asks[t - 4];
  std::vector<EmbedResult> got(8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) threads.emplace_back([&, t] { got[t] = s.embed_sync(asks[t], {}); });
  for (auto& t : threads) t.join();
  for (int t = 0; t < 8; ++t) {
    ASSERT_EQ(got[t].code, Code::Ok) << got[t].message;
    const auto want = encode(enc, asks[t]);
    ASSERT_EQ(got[t].embeddings.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[t].embeddings[i], want[i], 1e-6) << t << " " << i;
  }
  const double hits = m.value("heads_cache_requests_total", {{"tier", "memory"}, {"result", "hit"}});
  const EmbedResult again = s.embed_sync(asks[0], {});  // answered from the cache, as computed
  EXPECT_EQ(again.embeddings, got[0].embeddings);
  EXPECT_EQ(m.value("heads_cache_requests_total", {{"tier", "memory"}, {"result", "hit"}}), hits + 5);
}

TEST(ServeService, AFailedReloadKeepsTheModelServing) {
  Metrics m;
  Service s(service_options(), &m);
  const std::string before = s.model()->version;
  const EmbedResult bad = s.reload("/nonexistent/model");
  EXPECT_EQ(bad.code, Code::InvalidArgument);
  EXPECT_THAT(bad.message, HasSubstr("/nonexistent/model"));
  EXPECT_THAT(bad.message, HasSubstr("still serving " + before));
  EXPECT_EQ(s.model()->version, before);
  EXPECT_EQ(s.embed_sync({"still here"}, {}).code, Code::Ok);
  const EmbedResult ok = s.reload(model_dir());
  EXPECT_EQ(ok.code, Code::Ok) << ok.message;
  EXPECT_EQ(ok.version, before);  // the same files: the same version
  EXPECT_EQ(m.value("heads_reloads_total", {{"result", "failed"}}), 1);
  EXPECT_EQ(m.value("heads_reloads_total", {{"result", "ok"}}), 1);
}

TEST(ServeFrontEnds, LoopbackAddresses) {
  for (const char* host : {"127.0.0.1", "127.1.2.3", "::1", "localhost", "LOCALHOST", "localhost.",
                           "0:0:0:0:0:0:0:1", "::ffff:127.0.0.1"}) {
    EXPECT_TRUE(is_loopback(host)) << host;
  }
  for (const char* host : {"0.0.0.0", "10.0.0.1", "::", "128.0.0.1", "example.com", "", "::ffff:10.0.0.1",
                           "localhost.example.com"}) {
    EXPECT_FALSE(is_loopback(host)) << host;
  }
}

TEST(ServeFrontEnds, HttpAndGrpcOnLoopback) {
  Metrics m;
  Service s(service_options(), &m);
  ServerOptions o;
  o.service = s.options();
  o.http_port = 0;
  o.grpc_port = 0;
  o.http_threads = 4;
  auto http = make_http_front_end(&s, &m, o);
  auto grpc_fe = make_grpc_front_end(&s, &m, o);
  const int hp = http->start(), gp = grpc_fe->start();
  ASSERT_GT(hp, 0);
  ASSERT_GT(gp, 0);
  const SentenceEncoder enc = SentenceEncoder::load(model_dir());
  const auto texts = sentences(5, "front");
  const auto want = encode(enc, texts);

  testing::HttpClient c(hp);  // one keep-alive connection for every request below
  nlohmann::json body = {{"input", texts}};
  auto res = c.call(http::verb::post, "/v1/embeddings", body.dump());
  ASSERT_EQ(res.status, 200) << res.body;
  const auto j = nlohmann::json::parse(res.body);
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto row = j["data"][i]["embedding"].get<std::vector<float>>();
    ASSERT_EQ(row, std::vector<float>(want.begin() + i * 384, want.begin() + (i + 1) * 384));
  }
  EXPECT_EQ(res.header("X-Heads-Model-Version"), s.model()->version);
  res = c.call(http::verb::post, "/v1/embeddings", "{\"input\": 3}");
  EXPECT_EQ(res.status, 400);
  EXPECT_THAT(res.body, HasSubstr("input: expected a string or a list of strings, got number"));
  res = c.call(http::verb::post, "/v1/embeddings", "{\"input\": \"a\", \"x\": 1e400}");  // out of double's range
  EXPECT_EQ(res.status, 400);
  EXPECT_THAT(res.body, HasSubstr("request body: not JSON"));
  res = c.call(http::verb::post, "/v1/embeddings", std::string(100000, '['));
  EXPECT_EQ(res.status, 400);
  EXPECT_THAT(res.body, HasSubstr("nested deeper than 64 levels"));
  res = c.call(http::verb::post, "/admin/reload", "{}", {{"Origin", "http://example.com"}});  // from a web page
  EXPECT_EQ(res.status, 403);
  EXPECT_THAT(res.body, HasSubstr("web pages"));
  res = c.call(http::verb::post, "/admin/reload", "{}", {{"Host", "rebound.example.com:80"}});
  EXPECT_EQ(res.status, 403);
  EXPECT_THAT(res.body, HasSubstr("loopback Host"));
  res = c.call(http::verb::post, "/admin/reload", "", {{"Content-Type", "application/x-www-form-urlencoded"}});
  EXPECT_EQ(res.status, 200) << res.body;  // as `curl -X POST`
  res = c.call(http::verb::get, "/metrics");
  EXPECT_THAT(res.body, HasSubstr("heads_requests_total{route=\"/v1/embeddings\",code=\"400\"} 3"));
  EXPECT_THAT(res.body, HasSubstr("heads_http_connections 1"));
  res = c.call(http::verb::get, "/nowhere");
  EXPECT_EQ(res.status, 404);
  EXPECT_THAT(res.body, HasSubstr("no route GET /nowhere"));

  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(gp), grpc::InsecureChannelCredentials());
  auto stub = heads::v1::Embedder::NewStub(channel);
  grpc::ClientContext ctx;
  heads::v1::EmbedRequest req;
  for (const auto& t : texts) req.add_texts(t);
  heads::v1::EmbedResponse resp;
  ASSERT_TRUE(stub->Embed(&ctx, req, &resp).ok());
  ASSERT_EQ(resp.embeddings_size(), 5);
  for (int i = 0; i < 5; ++i) {
    ASSERT_EQ(std::vector<float>(resp.embeddings(i).values().begin(), resp.embeddings(i).values().end()),
              std::vector<float>(want.begin() + i * 384, want.begin() + (i + 1) * 384));
  }
  grpc::ClientContext ctx2;
  heads::v1::AttendRequest areq;
  areq.mutable_query()->add_shape(3);
  areq.mutable_query()->add_shape(384);
  for (int i = 0; i < 3 * 384; ++i) areq.mutable_query()->add_data(std::sin(0.01f * i));
  heads::v1::AttendResponse aresp;
  ASSERT_TRUE(stub->Attend(&ctx2, areq, &aresp).ok());
  EXPECT_EQ(aresp.output().data_size(), 3 * 384);
  grpc::ClientContext ctx3;
  areq.set_layer(99);
  const grpc::Status st = stub->Attend(&ctx3, areq, &aresp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("layer: 99"));

  grpc_fe->stop();
  http->stop();
}

}  // namespace
}  // namespace heads::serve
