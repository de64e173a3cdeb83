// http_api.cc — the HTTP front end of `heads serve` (on HttpServer, http_server.h): OpenAI-compatible
// POST /v1/embeddings, POST /embed, POST /tokenize, GET /health, /live, /info, /metrics and
// POST /admin/reload. Errors are {"error": {"message", "type", "code"}} with 400 (bad input),
// 401 (admin token), 403, 429 (a limit), 503 (draining), 504 (deadline) or 500.
#include <openssl/crypto.h>
#include <poll.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <chrono>
#include <nlohmann/json.hpp>
#include <thread>

#include "http_server.h"
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

// The client closed its connection (or reset it): it will not read an answer, as nginx judges a
// client gone (its 499). Never true for a socket that is merely idle or has more requests queued.
bool peer_closed(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

void reply(HttpResponse& res, std::string body, const char* type) {
  res.set(http::field::content_type, type);
  res.body() = std::move(body);
}

void send_error(HttpResponse& res, int status, const std::string& type, const std::string& message) {
  res.result(static_cast<unsigned>(status));
  reply(res, json{{"error", {{"message", message}, {"type", type}, {"code", status}}}}.dump(
                 -1, ' ', false, json::error_handler_t::replace),
        "application/json");
}

std::string header(const HttpRequest& req, std::string_view name) { return std::string(req[name]); }
bool has_header(const HttpRequest& req, std::string_view name) { return req.find(name) != req.end(); }

// Nesting deeper than this in a request body is refused: a body of 60 MB of "[" would otherwise
// become tens of millions of nested arrays (gigabytes) before anything looks at it.
constexpr int kMaxJsonDepth = 64;
struct TooDeep {};

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

// The texts of an "input" / "inputs" field: a string or a list of strings, moved out of the body.
// More than `limit` texts is *too_many (nothing is taken).
bool read_texts(json& body, const char* field, int64_t limit, std::vector<std::string>* texts,
                std::string* error, bool* too_many) {
  *too_many = false;
  auto it = body.find(field);
  if (it == body.end()) {
    *error = std::string("request: missing \"") + field + "\" (a string or a list of strings)";
    return false;
  }
  if (it->is_string()) {
    texts->push_back(std::move(it->get_ref<std::string&>()));
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
    json& t = (*it)[i];
    if (!t.is_string()) {
      *error = std::string(field) + "[" + std::to_string(i) + "]: expected a string, got " + t.type_name() +
               (t.is_number() || t.is_array() ? " (token ids are not accepted: send text)" : "");
      return false;
    }
    texts->push_back(std::move(t.get_ref<std::string&>()));
  }
  return true;
}

class HttpFrontEnd : public FrontEnd {
 public:
  HttpFrontEnd(Service* service, Metrics* metrics, const ServerOptions& o)
      : service_(service), metrics_(metrics), opt_(o) {
    metrics_->gauge("heads_http_connections", "Open HTTP connections.");
    metrics_->counter("heads_http_closed_total",
                      "HTTP connections the server closed or refused, by reason (timeout, over_limit, malformed, "
                      "accept_error).");
    HttpServerOptions h;
    h.bind = o.bind;
    h.port = o.http_port;
    h.tls_cert = o.tls_cert;
    h.tls_key = o.tls_key;
    h.worker_threads = o.http_threads;
    h.max_connections = o.http_max_connections;
    h.read_timeout_s = o.http_read_timeout_s;
    h.idle_timeout_s = o.http_idle_timeout_s;
    h.drain_seconds = o.drain_seconds;
    server_ = std::make_unique<HttpServer>(
        h, [this](int status, const std::string& message, HttpResponse& res) { error_page(status, message, res); },
        [this](const char* event) { metrics_->add("heads_http_closed_total", {{"reason", event}}); });
    routes();
  }

  int start() override { return server_->start(); }
  void stop() override { server_->stop(); }
  ~HttpFrontEnd() override { stop(); }

 private:
  using Route = std::function<void(const HttpRequest&, const HttpCall&, HttpResponse&)>;

  void error_page(int status, const std::string& message, HttpResponse& res) {
    res.set("X-Heads-Model-Version", service_->model()->version);
    switch (status) {
      case 404:
        return send_error(res, 404, "not_found", message + " (routes: POST /v1/embeddings, /embed, /rerank, /tokenize, "
                                                           "/admin/reload; GET /health, /live, /info, /metrics)");
      case 413: return send_error(res, 413, "payload_too_large", message);
      case 431: return send_error(res, 431, "header_too_large", message);
      case 503: return send_error(res, 503, "unavailable", message);
      case 400: return send_error(res, 400, "invalid_request_error", message);
      default: return send_error(res, status, "internal", message);
    }
  }

  // Wraps a handler: version header, latency and outcome metrics, the access log.
  // Registers a route, wrapped: version header, latency and outcome metrics, the access log.
  void add(http::verb method, const std::string& route, bool blocking, Route f) {
    server_->route(method, route, [this, route, f = std::move(f)](const HttpRequest& req, const HttpCall& call,
                                                                  HttpResponse& res) {
      const auto t0 = Clock::now();
      try {
        f(req, call, res);
      } catch (const std::exception& e) {
        send_error(res, 500, "internal", e.what());
      }
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (res.find("X-Heads-Model-Version") == res.end()) res.set("X-Heads-Model-Version", service_->model()->version);
      metrics_->add("heads_requests_total", {{"route", route}, {"code", std::to_string(res.result_int())}});
      metrics_->observe("heads_request_seconds", {{"route", route}}, s);
      if (opt_.access_log) {
        log_json("request", json{{"route", route}, {"status", res.result_int()}, {"seconds", s},
                                 {"remote", call.remote}}.dump());
      }
    }, blocking);
  }

  // The body as a JSON object, or an error response.
  bool parse(const HttpRequest& req, HttpResponse& res, json* body) {
    try {
      *body = json::parse(req.body(), [](int depth, json::parse_event_t event, json&) {
        if (depth >= kMaxJsonDepth &&
            (event == json::parse_event_t::object_start || event == json::parse_event_t::array_start)) {
          throw TooDeep{};
        }
        return true;
      });
    } catch (const TooDeep&) {
      send_error(res, 400, "invalid_request_error",
                 "request body: JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
      return false;
    } catch (const json::exception& e) {  // syntax, or a number out of range (1e400)
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

  RequestContext context(const HttpRequest& req, const HttpCall& call) const {
    RequestContext ctx;
    int64_t ms = service_->options().timeout_ms;
    if (has_header(req, "X-Request-Timeout-Ms")) {
      const std::string v = header(req, "X-Request-Timeout-Ms");
      int64_t parsed = 0;
      const auto r = std::from_chars(v.data(), v.data() + v.size(), parsed);
      if (r.ec == std::errc() && r.ptr == v.data() + v.size() && parsed > 0) ms = std::min<int64_t>(parsed, 3'600'000);
    }
    ctx.deadline = Clock::now() + std::chrono::milliseconds(ms);
    // The handler waits for the answer, so the connection (and its descriptor) outlives every call.
    if (const int fd = call.socket; fd >= 0) ctx.cancelled = [fd] { return peer_closed(fd); };
    return ctx;
  }

  // Embeddings of the texts in body[field]; false (and an error response) on failure.
  bool embed(const HttpRequest& req, const HttpCall& call, HttpResponse& res, json& body, const char* field,
             std::vector<std::string>* texts, EmbedResult* r) {
    std::string error;
    bool too_many = false;
    if (!read_texts(body, field, service_->options().max_texts, texts, &error, &too_many)) {
      send_error(res, too_many ? 429 : 400, too_many ? "resource_exhausted" : "invalid_request_error", error);
      return false;
    }
    const size_t n = texts->size();
    *r = service_->embed_sync(std::move(*texts), context(req, call));  // a text's bytes are held once
    texts->assign(n, std::string());  // the routes count their rows by it
    if (r->code != Code::Ok) {
      send_error(res, http_status(r->code), code_name(r->code), r->message);
      return false;
    }
    res.set("X-Heads-Model-Version", r->version);  // the model that computed them
    return true;
  }

  bool admin_allowed(const HttpRequest& req, HttpResponse& res) {
    // Not from a web page: browsers send Origin with every POST (cross-site form posts and pages
    // that rebound their DNS name to this address included); curl, scripts and clients do not.
    if (has_header(req, "Origin")) {
      send_error(res, 403, "forbidden", "admin routes refuse requests from web pages (an Origin header)");
      return false;
    }
    if (opt_.admin_token.empty()) {
      // Without a token, only on loopback, and only to a loopback name (not a rebound DNS name).
      std::string host = header(req, "Host");
      if (!host.empty() && host.front() == '[') {
        host = host.substr(1, host.find(']') - 1);
      } else if (const auto colon = host.rfind(':'); colon != std::string::npos) {
        host = host.substr(0, colon);
      }
      if (is_loopback(opt_.bind) && (host.empty() || is_loopback(host))) return true;
      if (is_loopback(opt_.bind)) {
        send_error(res, 403, "forbidden", "admin routes without a token answer only to a loopback Host, got '" +
                                              header(req, "Host") + "'");
        return false;
      }
      send_error(res, 403, "forbidden",
                 "admin routes need --admin-token-file when the server binds beyond loopback (--bind " + opt_.bind + ")");
      return false;
    }
    const std::string want = "Bearer " + opt_.admin_token;
    const std::string got = header(req, "Authorization");
    if (got.size() != want.size() || CRYPTO_memcmp(got.data(), want.data(), want.size()) != 0) {
      res.set(http::field::www_authenticate, "Bearer");
      send_error(res, 401, "unauthorized", "admin routes need the header \"Authorization: Bearer TOKEN\"");
      return false;
    }
    return true;
  }

  void routes() {
    add(http::verb::post, "/v1/embeddings", true, [this](const auto& req, const auto& call, auto& res) {
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
      const int64_t dim = service_->model()->dim();
      if (auto d = body.find("dimensions"); d != body.end() && !d->is_null() && dim > 0) {
        if (!d->is_number_integer() || d->get<int64_t>() != dim) {
          send_error(res, 400, "invalid_request_error",
                     "dimensions: this model gives " + std::to_string(dim) + " dimensions, got " + d->dump());
          return;
        }
      }
      std::vector<std::string> texts;
      EmbedResult r;
      if (!embed(req, call, res, body, "input", &texts, &r)) return;
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
      reply(res, std::move(out), "application/json");
    });
    add(http::verb::post, "/embed", true, [this](const auto& req, const auto& call, auto& res) {
      json body;
      if (!parse(req, res, &body)) return;
      std::vector<std::string> texts;
      EmbedResult r;
      if (!embed(req, call, res, body, "inputs", &texts, &r)) return;
      std::string out = "[";
      for (size_t i = 0; i < texts.size(); ++i) {
        out += i ? ",[" : "[";
        for (int64_t k = 0; k < r.dim; ++k) {
          if (k) out += ',';
          append_float(out, r.embeddings[i * static_cast<size_t>(r.dim) + static_cast<size_t>(k)]);
        }
        out += ']';
      }
      reply(res, out + "]", "application/json");
    });
    // Text Embeddings Inference's /rerank: {"query", "texts", "raw_scores" (false: the sigmoid),
    // "return_text"} -> [{"index", "score"[, "text"]}], highest score first.
    add(http::verb::post, "/rerank", true, [this](const auto& req, const auto& call, auto& res) {
      json body;
      if (!parse(req, res, &body)) return;
      const auto q = body.find("query");
      if (q == body.end() || !q->is_string()) {
        return send_error(res, 400, "invalid_request_error", "query: expected a string");
      }
      bool raw = false, with_text = false;
      for (const auto& [key, out] : {std::pair{"raw_scores", &raw}, std::pair{"return_text", &with_text}}) {
        if (auto f = body.find(key); f != body.end() && !f->is_null()) {
          if (!f->is_boolean()) return send_error(res, 400, "invalid_request_error", std::string(key) + ": expected a boolean");
          *out = f->template get<bool>();
        }
      }
      std::vector<std::string> texts;
      std::string error;
      bool too_many = false;
      if (!read_texts(body, "texts", service_->options().max_texts, &texts, &error, &too_many)) {
        return send_error(res, too_many ? 429 : 400, too_many ? "resource_exhausted" : "invalid_request_error", error);
      }
      const EmbedResult r = service_->rerank(q->template get<std::string>(), with_text ? texts : std::move(texts),
                                             context(req, call)).get();
      if (r.code != Code::Ok) return send_error(res, http_status(r.code), code_name(r.code), r.message);
      res.set("X-Heads-Model-Version", r.version);
      json out = json::array();
      for (const auto& [i, score] : ranked(r, raw)) {
        json e{{"index", i}, {"score", score}};
        if (with_text) e["text"] = texts[i];
        out.push_back(std::move(e));
      }
      reply(res, out.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
    });
    add(http::verb::post, "/tokenize", true, [this](const auto& req, const auto&, auto& res) {
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
        const auto e = m->tokenizer().encode(t, m->max_length());
        json pieces = json::array();
        for (int64_t id : e.ids) pieces.push_back(m->tokenizer().token(id));
        out.push_back({{"ids", e.ids}, {"tokens", pieces}, {"truncated", e.truncated > 0}});
      }
      reply(res, out.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
    });
    // Health, liveness, info and metrics answer on the event loop, whatever the workers do.
    add(http::verb::get, "/health", false, [this](const auto&, const auto&, auto& res) {
      const bool ready = !service_->draining();
      res.result(ready ? 200 : 503);
      reply(res, json{{"status", ready ? "ok" : "draining"}, {"model_version", service_->model()->version}}.dump(),
            "application/json");
    });
    add(http::verb::get, "/live", false, [](const auto&, const auto&, auto& res) {
      reply(res, "{\"status\":\"ok\"}", "application/json");
    });
    add(http::verb::get, "/info", false, [this](const auto&, const auto&, auto& res) {
      const auto m = service_->model();
      const auto& cfg = m->bert().config();
      reply(res, json{{"model_version", m->version}, {"model_name", m->name}, {"dtype", m->dtype},
                           {"kind", m->kind()}, {"dim", m->dim()}, {"max_seq_length", m->max_length()},
                           {"num_layers", cfg.num_layers}, {"num_heads", cfg.num_heads},
                           {"max_texts", service_->options().max_texts}}
                .dump(),
            "application/json");
    });
    add(http::verb::get, "/metrics", false, [this](const auto&, const auto&, auto& res) {
      metrics_->set("heads_queue_texts", {}, static_cast<double>(service_->queued_texts()));
      metrics_->set("heads_http_connections", {}, static_cast<double>(server_->open_connections()));
      reply(res, metrics_->prometheus(), "text/plain; version=0.0.4");
    });
    add(http::verb::post, "/admin/reload", true, [this](const auto& req, const auto&, auto& res) {
      if (!admin_allowed(req, res)) return;
      std::string dir = service_->model()->dir;
      if (!req.body().empty()) {
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
      reply(res, json{{"model_version", r.version}, {"previous_version", before}}.dump(), "application/json");
    });
  }

  Service* service_;
  Metrics* metrics_;
  ServerOptions opt_;
  std::unique_ptr<HttpServer> server_;
};

}  // namespace

std::unique_ptr<FrontEnd> make_http_front_end(Service* service, Metrics* metrics, const ServerOptions& options) {
  return std::make_unique<HttpFrontEnd>(service, metrics, options);
}

}  // namespace heads::serve
