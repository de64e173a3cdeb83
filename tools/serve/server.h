// server.h — `heads serve`: the service (service.h) behind an HTTP and a gRPC front end, with
// signals (SIGTERM / SIGINT: drain and exit 0; SIGHUP: reload the model directory), TLS and the
// admin token. docs/serving.md describes the API.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "service.h"

namespace heads::serve {

struct ServerOptions {
  Options service;
  std::string bind = "127.0.0.1";
  int http_port = 8080;   // 0: any free port; -1: no HTTP
  int grpc_port = 50051;  // 0: any free port; -1: no gRPC
  int http_threads = 64;               // run HTTP requests that parse bodies or wait for a batch
  int64_t http_max_connections = 1024;  // open HTTP connections; more get a 503
  double http_read_timeout_s = 10;      // an HTTP request's header in full (its body: plus 1 s per MiB)
  double http_idle_timeout_s = 5;       // a keep-alive connection between requests
  std::string tls_cert, tls_key;  // PEM files: HTTPS and gRPC over TLS when both are set
  std::string admin_token;        // required (as "Authorization: Bearer TOKEN") on /admin/* when set
  bool access_log = false;        // one JSON line per request on stderr
  double drain_seconds = 30;      // how long shutdown waits for requests in flight
};

// Runs the server until SIGTERM or SIGINT; prints "listening http=P grpc=G" on stdout once both
// front ends take connections. Returns the exit code (0 after a clean drain).
int run_server(const ServerOptions& options);

// One JSON object per line on stderr ({"time": ..., "event": ..., ...}), whole lines even from
// many threads.
void log_json(const std::string& event, const std::string& fields_json_object);

// True for 127.0.0.0/8, ::1 and "localhost".
bool is_loopback(const std::string& host);

// The front ends (http_api.cc, grpc_api.cc). start() binds and returns the port; not_serving()
// turns the front end's own health report to not serving (before the service drains, so that no
// check sees the service draining and the front end still serving); stop() stops taking
// connections and waits for the requests in flight.
class FrontEnd {
 public:
  virtual ~FrontEnd() = default;
  virtual int start() = 0;
  virtual void not_serving() {}
  virtual void stop() = 0;
};
std::unique_ptr<FrontEnd> make_http_front_end(Service* service, Metrics* metrics, const ServerOptions& options);
std::unique_ptr<FrontEnd> make_grpc_front_end(Service* service, Metrics* metrics, const ServerOptions& options);

// The contents of a file (TLS certificates and keys, the admin token); an error names it.
std::string read_text_file(const std::string& path, const char* what);

}  // namespace heads::serve
