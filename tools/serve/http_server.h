// http_server.h — the HTTP/1.1 server under `heads serve`'s HTTP API (http_api.cc), on Boost.Beast
// and Asio. One event loop holds every connection: a connection that is idle, slow or gone costs
// a descriptor and a small buffer, never a thread, and the cost of one does not grow with how many
// are open. Routes marked `blocking` (those that parse bodies or wait for the batcher) run on a
// pool of worker threads; the others (health, metrics) answer on the loop at once, whatever the
// workers are doing.
//
// Limits, each with its own answer (docs/serving.md): a request's header must arrive in full within
// `read_timeout_s` (slow clients are closed, not waited for), its body within that plus a second per
// MiB; a keep-alive connection may idle `idle_timeout_s`; more than `max_connections` open get a
// 503 with Retry-After and are closed; a header over `header_limit` is 431, a body over
// `body_limit` 413, a malformed request 400. stop() stops accepting, closes idle connections and
// waits for the requests being handled.
#pragma once

#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace heads::serve {

namespace http = boost::beast::http;
using HttpRequest = http::request<http::string_body>;
using HttpResponse = http::response<http::string_body>;

// What a handler knows of the connection besides the request.
struct HttpCall {
  std::string remote;  // the client's address
  int socket = -1;     // the connection's descriptor, open while the handler runs: poll it, nothing else
};

struct HttpServerOptions {
  std::string bind = "127.0.0.1";
  int port = 0;                          // 0: any free port
  std::string tls_cert, tls_key;         // PEM files: HTTPS when both are set
  int worker_threads = 64;               // run the blocking routes
  int io_threads = 2;                    // run the event loop
  int64_t max_connections = 1024;        // open at once; more get a 503
  double read_timeout_s = 10;            // a request's header in full (and the TLS handshake)
  double idle_timeout_s = 5;             // a keep-alive connection between requests
  double write_timeout_s = 60;           // a response in full
  double drain_seconds = 30;             // how long stop() waits for requests being handled
  size_t header_limit = size_t{16} << 10;
  size_t body_limit = size_t{64} << 20;
};

class HttpServer {
 public:
  using Handler = std::function<void(const HttpRequest&, const HttpCall&, HttpResponse&)>;
  // Fills the response of an error the server answers itself (400, 404, 413, 431, 500, 503).
  using ErrorPage = std::function<void(int status, const std::string& message, HttpResponse&)>;
  // Counts what happened to connections: "timeout", "over_limit", "malformed", "accept_error".
  using Event = std::function<void(const char* event)>;

  HttpServer(HttpServerOptions options, ErrorPage error_page, Event event);
  ~HttpServer();

  // A route: `path` exactly (a query string is ignored); GET routes answer HEAD too. A blocking
  // route runs on a worker thread and may wait; any other runs on the event loop and must not.
  void route(http::verb method, const std::string& path, Handler handler, bool blocking);

  int start();  // binds (an error names the port), starts the threads, returns the port
  void stop();  // idempotent
  int64_t open_connections() const;
  int64_t max_connections() const;  // as applied (capped by the descriptors the process may open)

  struct Impl;  // http_server.cc

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace heads::serve
