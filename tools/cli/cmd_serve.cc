// cmd_serve.cc — `heads serve`: the embedding and attention service (tools/serve, docs/serving.md).
#include <malloc.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "commands.h"
#include "heads/error.h"
#include "heads/runtime.h"
#include "options.h"
#include "server.h"

namespace heads::cli {

namespace {

struct ServeArgs {
  serve::ServerOptions o;
  std::string model, dtype = "auto", admin_token_file, cache_dir;
  int64_t cache_mb = 256, disk_cache_mb = 1024;
  bool no_truncate = false, batch_invariant = false;
  int threads = 0;
};

void run(ServeArgs& a) {
  // One malloc arena for the process. With glibc's default (8 per core), each reload's model landed
  // in the arena of whichever HTTP thread asked for it, and the freed models' memory stayed spread
  // over them: RSS rose from 210 to 530 MB over 30 reloads before it levelled off; with one arena it
  // stays at 210–275 MB (docs/serving.md). The threads that allocate much are few (the batcher).
  mallopt(M_ARENA_MAX, 1);
  apply_threads(a.threads);
  if (a.batch_invariant) set_batch_invariant(true);
  serve::ServerOptions o = a.o;
  HEADS_CHECK(o.service.max_queue_texts >= o.service.max_texts, "--max-queue ", o.service.max_queue_texts,
              " must be at least --max-texts ", o.service.max_texts, " (a full request must fit in the queue)");
  o.service.model_dir = model_dir(a.model);
  o.service.precision = precision_choice(a.dtype);
  o.service.truncate = !a.no_truncate;
  o.service.threads = a.threads;

  o.service.cache.memory_bytes = a.cache_mb << 20;
  o.service.cache.disk_dir = a.cache_dir;
  o.service.cache.disk_bytes = a.disk_cache_mb << 20;
  if (!a.admin_token_file.empty()) {
    std::string t = serve::read_text_file(a.admin_token_file, "--admin-token-file");
    while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
    HEADS_CHECK(!t.empty(), "--admin-token-file ", a.admin_token_file, ": empty");
    o.admin_token = t;
  } else if (const char* env = std::getenv("HEADS_ADMIN_TOKEN"); env != nullptr && *env != '\0') {
    o.admin_token = env;
  }
  if (!o.tls_cert.empty()) serve::read_text_file(o.tls_cert, "--tls-cert");
  if (!o.tls_key.empty()) serve::read_text_file(o.tls_key, "--tls-key");
  const int rc = serve::run_server(o);
  if (rc != 0) std::exit(rc);
}

}  // namespace

void add_serve_command(CLI::App& app, Action* action) {
  auto a = std::make_shared<ServeArgs>();
  CLI::App* c = app.add_subcommand(
      "serve",
      "Serve sentence embeddings (and attention) over HTTP and gRPC until SIGTERM: requests from many\n"
      "clients are merged into batches, results are cached in memory (and on disk with --cache-dir),\n"
      "and the model can be reloaded while serving (POST /admin/reload or SIGHUP). Prints\n"
      "`listening http=P grpc=G` once ready. HTTP: POST /v1/embeddings (OpenAI), /embed, /tokenize,\n"
      "/admin/reload; GET /health, /live, /info, /metrics (Prometheus). gRPC: heads.v1.Embedder\n"
      "(proto/heads/v1/heads.proto), grpc.health.v1 and reflection. See docs/serving.md.");
  add_model_option(c, &a->model);
  add_precision_option(c, &a->dtype, true);
  c->add_option("--model-name", a->o.service.model_name,
                "name in model versions and responses (default: the model directory's name)");
  c->add_option("--bind", a->o.bind, "address to listen on (loopback by default)")->capture_default_str();
  c->add_option("--http-port", a->o.http_port, "HTTP port (0: any free port, -1: no HTTP)")
      ->capture_default_str()->check(int_in(-1, 65535));
  c->add_option("--grpc-port", a->o.grpc_port, "gRPC port (0: any free port, -1: no gRPC)")
      ->capture_default_str()->check(int_in(-1, 65535));
  c->add_option("--batch-size", a->o.service.batch_size, "texts per encoder forward")
      ->capture_default_str()->check(int_in(1, 4096));
  c->add_option("--max-batch-tokens", a->o.service.max_batch_tokens,
                "tokens of queued requests merged into one batch")
      ->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_option("--max-wait-us", a->o.service.max_wait_us,
                "how long a request may wait for others to batch with (microseconds)")
      ->capture_default_str()->check(int_in(0, 10'000'000));
  c->add_option("--max-texts", a->o.service.max_texts, "texts per request (more: 429 / RESOURCE_EXHAUSTED)")
      ->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_option("--max-queue", a->o.service.max_queue_texts,
                "texts waiting to be batched (more: 429 / RESOURCE_EXHAUSTED)")
      ->capture_default_str()->check(int_in(1, kMaxCount));
  c->add_flag("--no-truncate", a->no_truncate,
              "reject a text longer than the model's max_seq_length (429 / RESOURCE_EXHAUSTED) instead of "
              "truncating it as the model does");
  c->add_option("--timeout-ms", a->o.service.timeout_ms,
                "deadline of a request that sets none (gRPC deadline, HTTP header X-Request-Timeout-Ms)")
      ->capture_default_str()->check(int_in(1, 3'600'000));
  c->add_option("--cache-mb", a->cache_mb, "memory cache of embeddings, MiB (0: none)")
      ->capture_default_str()->check(int_in(0, 1 << 20));
  c->add_option("--cache-dir", a->cache_dir, "directory of the on-disk cache (LMDB; kept across restarts)");
  c->add_option("--disk-cache-mb", a->disk_cache_mb, "cap of the on-disk cache, MiB (emptied when full)")
      ->capture_default_str()->check(int_in(1, 1 << 24));
  c->add_option("--http-threads", a->o.http_threads,
                "HTTP worker threads: they parse request bodies and wait for batches; connections themselves "
                "cost no thread")
      ->capture_default_str()->check(int_in(1, 1024));
  c->add_option("--http-max-connections", a->o.http_max_connections,
                "open HTTP connections at most; more are answered 503 with Retry-After and closed")
      ->capture_default_str()->check(int_in(1, 1 << 20));
  c->add_option("--http-read-timeout", a->o.http_read_timeout_s,
                "seconds a client has to send a request's header in full (and the TLS handshake); the body gets "
                "as long plus one second per MiB. Slower clients are closed")
      ->capture_default_str()->check(CLI::Range(0.05, 3600.0));
  c->add_option("--http-idle-timeout", a->o.http_idle_timeout_s,
                "seconds a keep-alive connection may wait for its next request")
      ->capture_default_str()->check(CLI::Range(0.05, 3600.0));
  c->add_option("--tls-cert", a->o.tls_cert, "PEM certificate chain: serve HTTPS and gRPC over TLS");
  c->add_option("--tls-key", a->o.tls_key, "PEM private key of --tls-cert");
  c->add_option("--admin-token-file", a->admin_token_file,
                "file holding the bearer token /admin/* requires (or $HEADS_ADMIN_TOKEN); without one, /admin/* "
                "is open on loopback and refused beyond it");
  c->add_flag("--access-log", a->o.access_log, "one JSON line per request on stderr");
  c->add_option("--drain-seconds", a->o.drain_seconds, "how long SIGTERM waits for requests in flight")
      ->capture_default_str()->check(CLI::Range(0.0, 3600.0));
  add_threads_option(c, &a->threads);
  add_batch_invariant_option(c, &a->batch_invariant);
  c->callback([a, action] { *action = [a] { run(*a); }; });
}

}  // namespace heads::cli
