// http_api.cc — the HTTP front end of `heads serve` (cpp-httplib): OpenAI-compatible
// POST /v1/embeddings, POST /embed, POST /tokenize, GET /health, /live, /info, /metrics and
// POST /admin/reload. Errors are {"error": {"message", "type", "code"}} with 400 (bad input),
// 401 (admin token), 403, 429 (a limit), 503 (draining), 504 (deadline) or 500.
#include <httplib.h>
#include <openssl/crypto.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <charconv>
#include <cstdlib>
#include <chrono>
#include <nlohmann/json.hpp>
#include <thread>

#include "server.h"

namespace heads::serve {

namespace {

using nlohmann::json;

int http_status(Code c) {
  switch (c) {
    case Code::Ok: return 200;
    case Code::InvalidArgument: return 400;
    case Code::ResourceExhausted: return 429;
    case Code::DeadlineExceeded: return 504;
    case Code::Cancelled: return 499;
    case Code::Unavailable: return 503;
    case Code::Internal: return 500;
  }
  return 500;
}

// Whether descriptor `fd` is the connection `req` came on: a socket whose local port is the
// server's and whose peer is the request's remote address and port.
bool is_connection_of(int fd, const httplib::Request& req) {
  sockaddr_storage peer{}, local{};
  socklen_t pn = sizeof(peer), ln = sizeof(local);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pn) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ln) != 0) {
    return false;
  }
  auto port_of = [](const sockaddr_storage& a) {
    return a.ss_family == AF_INET ? ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port)
                                  : a.ss_family == AF_INET6 ? ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port)
                                                            : 0;
  };
  char host[INET6_ADDRSTRLEN] = {};
  const void* addr = peer.ss_family == AF_INET ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in&>(peer).sin_addr)
                                               : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6&>(peer).sin6_addr);
  if ((peer.ss_family != AF_INET && peer.ss_family != AF_INET6) ||
      inet_ntop(peer.ss_family, addr, host, sizeof(host)) == nullptr) {
    return false;
  }
  return port_of(peer) == req.remote_port && port_of(local) == req.local_port && req.remote_addr == host;
}

// The socket of the connection a request came on (cpp-httplib 0.11 does not hand it to handlers),
// -1 if none. An HTTP worker thread serves one keep-alive connection at a time, so the socket found
// for the thread's previous request is checked first (two system calls); only a new connection
// scans /proc/self/fd (about one small allocation's cost per open descriptor).
int connection_socket(const httplib::Request& req) {
  thread_local int last = -1;
  if (last >= 0 && is_connection_of(last, req)) return last;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  int found = -1;
  while (const dirent* e = readdir(d)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dirfd(d)) continue;
    if (is_connection_of(static_cast<int>(fd), req)) {
      found = static_cast<int>(fd);
      break;
    }
  }
  closedir(d);
  last = found;
  return found;
}

// The client closed its connection (or reset it): it will not read an answer, as nginx judges a
// client gone (its 499). Never true for a socket that is merely idle or has more requests queued.
bool peer_closed(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

void send_error(httplib::Response& res, int status, const std::string& type, const std::string& message) {
  res.status = status;
  res.set_content(json{{"error", {{"message", message}, {"type", type}, {"code", status}}}}.dump(
                      -1, ' ', false, json::error_handler_t::replace),
                  "application/json");
}

// Shortest decimal that reads back as the same float32.
void append_float(std::string& out, float v) {
  char buf[32];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, r.ptr);
}

std::string base64(const void* data, size_t n) {
  static const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string out;
  out.reserve((n + 2) / 3 * 4);
  for (size_t i = 0; i < n; i += 3) {
    const uint32_t v = (uint32_t{p[i]} << 16) | (i + 1 < n ? uint32_t{p[i + 1]} << 8 : 0) | (i + 2 < n ? p[i + 2] : 0);
    out += abc[(v >> 18) & 63];
    out += abc[(v >> 12) & 63];
    out += i + 1 < n ? abc[(v >> 6) & 63] : '=';
    out += i + 2 < n ? abc[v & 63] : '=';
  }
  return out;
}

// The texts of an "input" / "inputs" field: a string or a list of strings. More than `limit`
// texts is *too_many (nothing is copied).
bool read_texts(const json& body, const char* field, int64_t limit, std::vector<std::string>* texts,
                std::string* error, bool* too_many) {
  *too_many = false;
  auto it = body.find(field);
  if (it == body.end()) {
    *error = std::string("request: missing \"") + field + "\" (a string or a list of strings)";
    return false;
  }
  if (it->is_string()) {
    texts->push_back(it->get<std::string>());
    return true;
  }
  if (!it->is_array()) {
    *error = std::string(field) + ": expected a string or a list of strings, got " + it->type_name();
    return false;
  }
  if (static_cast<int64_t>(it->size()) > limit) {
    *too_many = true;
    *error = std::string(field) + ": " + std::to_string(it->size()) + " texts, over the limit of " +
             std::to_string(limit) + " per request (--max-texts); split the request";
    return false;
  }
  for (size_t i = 0; i < it->size(); ++i) {
    const json& t = (*it)[i];
    if (!t.is_string()) {
      *error = std::string(field) + "[" + std::to_string(i) + "]: expected a string, got " + t.type_name() +
               (t.is_number() || t.is_array() ? " (token ids are not accepted: send text)" : "");
      return false;
    }
    texts->push_back(t.get<std::string>());
  }
  return true;
}

class HttpFrontEnd : public FrontEnd {
 public:
  HttpFrontEnd(Service* service, Metrics* metrics, const ServerOptions& o)
      : service_(service), metrics_(metrics), opt_(o) {
    if (!o.tls_cert.empty()) {
      server_ = std::make_unique<httplib::SSLServer>(o.tls_cert.c_str(), o.tls_key.c_str());
      HEADS_CHECK(static_cast<httplib::SSLServer*>(server_.get())->is_valid(), "--tls-cert ", o.tls_cert,
                  " / --tls-key ", o.tls_key, ": not a usable certificate and key (PEM)");
    } else {
      server_ = std::make_unique<httplib::Server>();
    }
    const int threads = o.http_threads;
    server_->new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
    server_->set_payload_max_length(size_t{64} << 20);
    // A response goes out as headers, then body: with Nagle's algorithm the body waits for the
    // client's delayed ACK of the headers (40 ms on Linux keep-alive connections).
    server_->set_tcp_nodelay(true);
    // A worker thread serves one connection at a time, through its keep-alive requests; more
    // connections than threads wait for a free one.
    // Short keep-alive, so that a new connection (a health probe, a scrape) waits little for a thread
    // even when every thread is busy with a client. cpp-httplib advertises both limits in a
    // Keep-Alive header. A client that sends on an idle connection just as the server closes it
    // must send that request again on a new connection (as urllib3 and bench/serve_load.py do).
    server_->set_keep_alive_max_count(10);
    server_->set_keep_alive_timeout(2);
    routes();
  }

  int start() override {
    int port = opt_.http_port;
    if (port == 0) {
      port = server_->bind_to_any_port(opt_.bind);
      HEADS_CHECK(port > 0, "--http-port: cannot bind any port on ", opt_.bind);
    } else {
      HEADS_CHECK(server_->bind_to_port(opt_.bind, port), "--http-port ", port, ": cannot bind ", opt_.bind,
                  ":", port, " (in use?)");
    }
    thread_ = std::thread([this] { server_->listen_after_bind(); });
    // stop() does nothing until the listener runs: wait for it, so that a failure right after
    // (the gRPC port in use) can stop it.
    for (int i = 0; i < 10000 && !server_->is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return port;
  }

  void stop() override {
    server_->stop();
    if (thread_.joinable()) thread_.join();
  }

  ~HttpFrontEnd() override { stop(); }

 private:
  // Wraps a handler: version header, latency and outcome metrics, the access log.
  httplib::Server::Handler wrap(const std::string& route, std::function<void(const httplib::Request&, httplib::Response&)> f) {
    return [this, route, f](const httplib::Request& req, httplib::Response& res) {
      const auto t0 = Clock::now();
      try {
        f(req, res);
      } catch (const std::exception& e) {
        send_error(res, 500, "internal", e.what());
      }
      if (res.status == -1) res.status = 200;  // httplib's default, set after the handler
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (!res.has_header("X-Heads-Model-Version")) res.set_header("X-Heads-Model-Version", service_->model()->version);
      metrics_->add("heads_requests_total", {{"route", route}, {"code", std::to_string(res.status)}});
      metrics_->observe("heads_request_seconds", {{"route", route}}, s);
      if (opt_.access_log) {
        log_json("request", json{{"route", route}, {"status", res.status}, {"seconds", s},
                                 {"remote", req.remote_addr}}.dump());
      }
    };
  }

  // The body as a JSON object, or an error response.
  bool parse(const httplib::Request& req, httplib::Response& res, json* body) {
    try {
      *body = json::parse(req.body);
    } catch (const json::parse_error& e) {
      send_error(res, 400, "invalid_request_error", std::string("request body: not JSON: ") + e.what());
      return false;
    }
    if (!body->is_object()) {
      send_error(res, 400, "invalid_request_error", std::string("request body: expected a JSON object, got ") +
                                                        body->type_name());
      return false;
    }
    return true;
  }

  RequestContext context(const httplib::Request& req) const {
    RequestContext ctx;
    int64_t ms = service_->options().timeout_ms;
    if (req.has_header("X-Request-Timeout-Ms")) {
      const std::string v = req.get_header_value("X-Request-Timeout-Ms");
      int64_t parsed = 0;
      const auto r = std::from_chars(v.data(), v.data() + v.size(), parsed);
      if (r.ec == std::errc() && r.ptr == v.data() + v.size() && parsed > 0) ms = std::min<int64_t>(parsed, 3'600'000);
    }
    ctx.deadline = Clock::now() + std::chrono::milliseconds(ms);
    // The handler waits for the answer, so the connection (and its descriptor) outlives every call.
    if (const int fd = connection_socket(req); fd >= 0) ctx.cancelled = [fd] { return peer_closed(fd); };
    return ctx;
  }

  // Embeddings of the texts in body[field]; false (and an error response) on failure.
  bool embed(const httplib::Request& req, httplib::Response& res, const json& body, const char* field,
             std::vector<std::string>* texts, EmbedResult* r) {
    std::string error;
    bool too_many = false;
    if (!read_texts(body, field, service_->options().max_texts, texts, &error, &too_many)) {
      send_error(res, too_many ? 429 : 400, too_many ? "resource_exhausted" : "invalid_request_error", error);
      return false;
    }
    *r = service_->embed_sync(*texts, context(req));
    if (r->code != Code::Ok) {
      send_error(res, http_status(r->code), code_name(r->code), r->message);
      return false;
    }
    res.set_header("X-Heads-Model-Version", r->version);  // the model that computed them
    return true;
  }

  bool admin_allowed(const httplib::Request& req, httplib::Response& res) {
    // Not from a web page: browsers send Origin with every POST (cross-site form posts and pages
    // that rebound their DNS name to this address included); curl, scripts and clients do not.
    if (req.has_header("Origin")) {
      send_error(res, 403, "forbidden", "admin routes refuse requests from web pages (an Origin header)");
      return false;
    }
    if (opt_.admin_token.empty()) {
      // Without a token, only on loopback, and only to a loopback name (not a rebound DNS name).
      std::string host = req.get_header_value("Host");
      if (!host.empty() && host.front() == '[') {
        host = host.substr(1, host.find(']') - 1);
      } else if (const auto colon = host.rfind(':'); colon != std::string::npos) {
        host = host.substr(0, colon);
      }
      if (is_loopback(opt_.bind) && (host.empty() || is_loopback(host))) return true;
      if (is_loopback(opt_.bind)) {
        send_error(res, 403, "forbidden", "admin routes without a token answer only to a loopback Host, got '" +
                                              req.get_header_value("Host") + "'");
        return false;
      }
      send_error(res, 403, "forbidden",
                 "admin routes need --admin-token-file when the server binds beyond loopback (--bind " + opt_.bind + ")");
      return false;
    }
    const std::string want = "Bearer " + opt_.admin_token;
    const std::string got = req.get_header_value("Authorization");
    if (got.size() != want.size() || CRYPTO_memcmp(got.data(), want.data(), want.size()) != 0) {
      res.set_header("WWW-Authenticate", "Bearer");
      send_error(res, 401, "unauthorized", "admin routes need the header \"Authorization: Bearer TOKEN\"");
      return false;
    }
    return true;
  }

  void routes() {
    server_->Post("/v1/embeddings", wrap("/v1/embeddings", [this](const auto& req, auto& res) {
      json body;
      if (!parse(req, res, &body)) return;
      std::string format = "float";
      if (auto f = body.find("encoding_format"); f != body.end()) {
        if (!f->is_string() || (*f != "float" && *f != "base64")) {
          send_error(res, 400, "invalid_request_error", "encoding_format: expected \"float\" or \"base64\"");
          return;
        }
        format = f->get<std::string>();
      }
      const int64_t dim = service_->model()->encoder->dim();
      if (auto d = body.find("dimensions"); d != body.end() && !d->is_null()) {
        if (!d->is_number_integer() || d->get<int64_t>() != dim) {
          send_error(res, 400, "invalid_request_error",
                     "dimensions: this model gives " + std::to_string(dim) + " dimensions, got " + d->dump());
          return;
        }
      }
      std::vector<std::string> texts;
      EmbedResult r;
      if (!embed(req, res, body, "input", &texts, &r)) return;
      std::string out = "{\"object\":\"list\",\"data\":[";
      out.reserve(out.size() + texts.size() * static_cast<size_t>(r.dim) * 12);
      for (size_t i = 0; i < texts.size(); ++i) {
        if (i) out += ',';
        out += "{\"object\":\"embedding\",\"index\":" + std::to_string(i) + ",\"embedding\":";
        const float* row = r.embeddings.data() + i * static_cast<size_t>(r.dim);
        if (format == "base64") {
          out += '"' + base64(row, static_cast<size_t>(r.dim) * 4) + '"';
        } else {
          out += '[';
          for (int64_t k = 0; k < r.dim; ++k) {
            if (k) out += ',';
            append_float(out, row[k]);
          }
          out += ']';
        }
        out += '}';
      }
      out += "],\"model\":" + json(r.version).dump() + ",\"usage\":{\"prompt_tokens\":" +
             std::to_string(r.prompt_tokens) + ",\"total_tokens\":" + std::to_string(r.prompt_tokens) + "}}";
      res.set_content(out, "application/json");
    }));
    server_->Post("/embed", wrap("/embed", [this](const auto& req, auto& res) {
      json body;
      if (!parse(req, res, &body)) return;
      std::vector<std::string> texts;
      EmbedResult r;
      if (!embed(req, res, body, "inputs", &texts, &r)) return;
      std::string out = "[";
      for (size_t i = 0; i < texts.size(); ++i) {
        out += i ? ",[" : "[";
        for (int64_t k = 0; k < r.dim; ++k) {
          if (k) out += ',';
          append_float(out, r.embeddings[i * static_cast<size_t>(r.dim) + static_cast<size_t>(k)]);
        }
        out += ']';
      }
      res.set_content(out + "]", "application/json");
    }));
    server_->Post("/tokenize", wrap("/tokenize", [this](const auto& req, auto& res) {
      json body;
      if (!parse(req, res, &body)) return;
      std::vector<std::string> texts;
      std::string error;
      bool too_many = false;
      if (!read_texts(body, "inputs", service_->options().max_texts, &texts, &error, &too_many)) {
        return send_error(res, too_many ? 429 : 400, too_many ? "resource_exhausted" : "invalid_request_error", error);
      }
      const auto m = service_->model();
      json out = json::array();
      for (const std::string& t : texts) {
        const auto e = m->encoder->tokenizer().encode(t, m->encoder->max_seq_length());
        json pieces = json::array();
        for (int64_t id : e.ids) pieces.push_back(m->encoder->tokenizer().token(id));
        out.push_back({{"ids", e.ids}, {"tokens", pieces}, {"truncated", e.truncated > 0}});
      }
      res.set_content(out.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
    }));
    server_->Get("/health", wrap("/health", [this](const auto&, auto& res) {
      const bool ready = !service_->draining();
      res.status = ready ? 200 : 503;
      res.set_content(json{{"status", ready ? "ok" : "draining"}, {"model_version", service_->model()->version}}.dump(),
                      "application/json");
    }));
    server_->Get("/live", wrap("/live", [](const auto&, auto& res) {
      res.set_content("{\"status\":\"ok\"}", "application/json");
    }));
    server_->Get("/info", wrap("/info", [this](const auto&, auto& res) {
      const auto m = service_->model();
      const auto& cfg = m->encoder->bert().config();
      res.set_content(json{{"model_version", m->version}, {"model_name", m->name}, {"dtype", m->dtype},
                           {"dim", m->encoder->dim()}, {"max_seq_length", m->encoder->max_seq_length()},
                           {"num_layers", cfg.num_layers}, {"num_heads", cfg.num_heads},
                           {"max_texts", service_->options().max_texts}}
                          .dump(),
                      "application/json");
    }));
    server_->Get("/metrics", wrap("/metrics", [this](const auto&, auto& res) {
      metrics_->set("heads_queue_texts", {}, static_cast<double>(service_->queued_texts()));
      res.set_content(metrics_->prometheus(), "text/plain; version=0.0.4");
    }));
    server_->Post("/admin/reload", wrap("/admin/reload", [this](const auto& req, auto& res) {
      if (!admin_allowed(req, res)) return;
      std::string dir = service_->model()->dir;
      if (!req.body.empty()) {
        json body;
        if (!parse(req, res, &body)) return;
        if (auto m = body.find("model"); m != body.end()) {
          if (!m->is_string() || m->get<std::string>().empty()) {
            return send_error(res, 400, "invalid_request_error", "model: expected a model directory (a string)");
          }
          dir = m->get<std::string>();
        }
      }
      const auto before = service_->model()->version;
      EmbedResult r = service_->reload(dir);
      if (r.code != Code::Ok) {
        log_json("reload_failed", json{{"model", dir}, {"error", r.message}}.dump(-1, ' ', false, json::error_handler_t::replace));
        return send_error(res, r.code == Code::ResourceExhausted ? 409 : 400, code_name(r.code), r.message);
      }
      log_json("reloaded", json{{"model", dir}, {"from", before}, {"to", r.version}}.dump(-1, ' ', false, json::error_handler_t::replace));
      res.set_content(json{{"model_version", r.version}, {"previous_version", before}}.dump(), "application/json");
    }));
    server_->set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!res.has_header("X-Heads-Model-Version")) res.set_header("X-Heads-Model-Version", service_->model()->version);
      if (!res.body.empty()) return;
      if (res.status == 404) {
        send_error(res, 404, "not_found", "no route " + req.method + " " + req.path +
                                              " (routes: POST /v1/embeddings, /embed, /tokenize, /admin/reload; "
                                              "GET /health, /live, /info, /metrics)");
      } else if (res.status == 413) {
        send_error(res, 413, "payload_too_large", "request body over 64 MiB");
      }
    });
  }

  Service* service_;
  Metrics* metrics_;
  ServerOptions opt_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<FrontEnd> make_http_front_end(Service* service, Metrics* metrics, const ServerOptions& options) {
  return std::make_unique<HttpFrontEnd>(service, metrics, options);
}

}  // namespace heads::serve
