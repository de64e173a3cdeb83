// http_server.cc — HttpServer (http_server.h) on Boost.Beast: an acceptor, a connection state
// machine per client (handshake → header → body → handler → response → next header), a registry
// that stop() walks, and lingering closes so that a client still sending a refused body reads
// the answer instead of a reset.
#include "http_server.h"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "heads/error.h"
#include "server.h"

namespace heads::serve {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;
using beast::error_code;

namespace {

std::chrono::milliseconds ms(double seconds) { return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)); }

// A parse error of the request itself (as opposed to the connection failing).
bool is_malformed(const error_code& ec) {
  return ec.category() == make_error_code(http::error::bad_method).category() && ec != http::error::end_of_stream &&
         ec != http::error::partial_message && ec != http::error::header_limit && ec != http::error::body_limit;
}

}  // namespace

class ConnectionBase {
 public:
  virtual ~ConnectionBase() = default;
  virtual void close_if_idle() = 0;  // from any thread: closes the connection unless a request is being handled
};

struct HttpServer::Impl {
  struct Route {
    Handler handler;
    bool blocking;
  };

  HttpServerOptions opt;
  ErrorPage error_page;
  Event event;
  std::map<std::pair<http::verb, std::string>, Route> routes;

  // The registry (declared before the event loop: connections that outlive it leave it as the
  // loop's pending handlers are destroyed).
  mutable std::mutex mu;
  std::condition_variable all_closed;
  std::unordered_map<uint64_t, std::weak_ptr<ConnectionBase>> open;  // by id, not those refused
  int64_t refused = 0;  // connections being sent their 503
  uint64_t next_id = 0;

  std::optional<ssl::context> tls;
  asio::io_context ioc;
  // Keeps the loop running while every connection waits for a worker (no operation pending).
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  tcp::acceptor acceptor{ioc};
  asio::steady_timer accept_retry{ioc};
  std::unique_ptr<asio::thread_pool> workers;
  std::vector<std::thread> io;
  std::atomic<bool> stopping{false};
  bool started = false, stopped = false;

  void accept();
  void admit(tcp::socket socket);
  // The registry: a connection counts from its construction to its destruction.
  uint64_t add(bool refusing) {
    std::lock_guard lock(mu);
    if (refusing) ++refused;
    return ++next_id;
  }
  void remember(uint64_t id, const std::shared_ptr<ConnectionBase>& c) {
    std::lock_guard lock(mu);
    open.emplace(id, c);
  }
  void remove(uint64_t id, bool refusing) {
    std::lock_guard lock(mu);
    open.erase(id);
    if (refusing) --refused;
    all_closed.notify_all();
  }
};

namespace {

template <class Stream>
constexpr bool kTls = !std::is_same_v<Stream, beast::tcp_stream>;

template <class Stream>
class Connection : public ConnectionBase, public std::enable_shared_from_this<Connection<Stream>> {
 public:
  using Handler = HttpServer::Handler;
  Connection(HttpServer::Impl* s, Stream stream, std::string remote, bool refusing)
      : s_(s), stream_(std::move(stream)), refusing_(refusing), id_(s->add(refusing)) {
    call_.remote = std::move(remote);
    call_.socket = socket().native_handle();
  }
  ~Connection() override { s_->remove(id_, refusing_); }

  void start() {
    if (!refusing_) s_->remember(id_, this->shared_from_this());
    if constexpr (kTls<Stream>) {
      expire(s_->opt.read_timeout_s);
      stream_.async_handshake(ssl::stream_base::server, [self = this->shared_from_this()](error_code ec) {
        if (ec) return self->close();
        self->begin();
      });
    } else {
      begin();
    }
  }

  void close_if_idle() override {
    asio::post(stream_.get_executor(), [self = this->shared_from_this()] {
      if (!self->busy_) self->close();
    });
  }

 private:
  tcp::socket& socket() { return beast::get_lowest_layer(stream_).socket(); }
  void expire(double seconds) { beast::get_lowest_layer(stream_).expires_after(ms(seconds)); }

  void begin() {
    if (refusing_) {
      return refuse(503, "the server has " + std::to_string(s_->opt.max_connections) +
                             " connections open, its limit (--http-max-connections); retry later");
    }
    read_header(true);
  }

  void read_header(bool first) {
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(s_->opt.header_limit));
    parser_->body_limit(s_->opt.body_limit);
    expire(first ? s_->opt.read_timeout_s : s_->opt.idle_timeout_s + s_->opt.read_timeout_s);
    http::async_read_header(stream_, buf_, *parser_, [self = this->shared_from_this()](error_code ec, size_t) {
      self->on_header(ec);
    });
  }

  void on_header(error_code ec) {
    if (ec) return on_read_error(ec);
    if (s_->stopping) return refuse(503, "the server is stopping");
    const auto& req = parser_->get();
    if (beast::iequals(req[http::field::expect], "100-continue") && !parser_->is_done()) {
      // The client waits for this before it sends the body (curl does for large bodies).
      auto cont = std::make_shared<http::response<http::empty_body>>(http::status::continue_, req.version());
      expire(s_->opt.write_timeout_s);
      return http::async_write(stream_, *cont, [self = this->shared_from_this(), cont](error_code ec, size_t) {
        if (ec) return self->close();
        self->read_body();
      });
    }
    read_body();
  }

  void read_body() {
    if (parser_->is_done()) return on_body({});
    // The header's timeout, plus a second per MiB announced (or the largest body allowed).
    const double mib = static_cast<double>(parser_->content_length().value_or(s_->opt.body_limit)) / (1 << 20);
    expire(s_->opt.read_timeout_s + mib);
    http::async_read(stream_, buf_, *parser_, [self = this->shared_from_this()](error_code ec, size_t) {
      self->on_body(ec);
    });
  }

  void on_read_error(error_code ec) {
    if (ec == http::error::body_limit) {
      return refuse(413, "request body over " + std::to_string(s_->opt.body_limit >> 20) + " MiB");
    }
    if (ec == http::error::header_limit) {
      return refuse(431, "request header over " + std::to_string(s_->opt.header_limit >> 10) + " KiB");
    }
    if (ec == beast::error::timeout) s_->event("timeout");
    if (is_malformed(ec)) {
      s_->event("malformed");
      return refuse(400, "malformed HTTP request: " + ec.message());
    }
    close();  // the client left, reset or timed out: nobody to answer
  }

  void on_body(error_code ec) {
    if (ec) return on_read_error(ec);
    req_ = parser_->release();
    parser_.reset();
    res_ = {};
    res_.version(req_.version());
    res_.result(http::status::ok);
    busy_ = true;
    const std::string_view target = req_.target();
    const std::string path(target.substr(0, target.find('?')));
    const http::verb method = req_.method() == http::verb::head ? http::verb::get : req_.method();
    const auto route = s_->routes.find({method, path});
    if (route == s_->routes.end()) {
      s_->error_page(404, "no route " + std::string(req_.method_string()) + " " + path, res_);
      return respond();
    }
    if (!route->second.blocking) {
      run(route->second.handler);
      return respond();
    }
    asio::post(*s_->workers, [self = this->shared_from_this(), h = &route->second.handler] {
      self->run(*h);
      asio::post(self->stream_.get_executor(), [self] { self->respond(); });
    });
  }

  void run(const Handler& h) {
    try {
      h(req_, call_, res_);
    } catch (const std::exception& e) {
      res_ = {};
      res_.version(req_.version());
      s_->error_page(500, e.what(), res_);
    }
  }

  void respond() {
    const bool keep = req_.keep_alive() && !s_->stopping;
    res_.keep_alive(keep);
    if (keep) res_.set(http::field::keep_alive, "timeout=" + std::to_string(static_cast<int>(s_->opt.idle_timeout_s)));
    res_.prepare_payload();
    if (req_.method() == http::verb::head) {  // the length of the body a GET would get, and no body
      const size_t n = res_.body().size();
      res_.body().clear();
      res_.content_length(n);
    }
    expire(s_->opt.write_timeout_s);
    http::async_write(stream_, res_, [self = this->shared_from_this(), keep](error_code ec, size_t) {
      self->busy_ = false;
      if (ec) return self->close();
      if (!keep) return self->linger(1.0);
      self->read_header(false);
    });
  }

  // Answers `status` and closes, reading (and dropping) what the client still sends meanwhile.
  void refuse(int status, const std::string& message) {
    res_ = {};
    res_.version(parser_ && parser_->is_header_done() ? parser_->get().version() : 11);
    s_->error_page(status, message, res_);
    if (status == 503) res_.set(http::field::retry_after, "1");
    res_.keep_alive(false);
    res_.prepare_payload();
    busy_ = true;
    expire(s_->opt.write_timeout_s);
    http::async_write(stream_, res_, [self = this->shared_from_this()](error_code ec, size_t) {
      self->busy_ = false;
      if (ec) return self->close();
      self->linger(5.0);
    });
  }

  // Closes after the response: stops sending, then reads until the client closes too (or
  // `seconds` pass), so that a client still sending gets no reset that would lose the answer.
  void linger(double seconds) {
    if constexpr (kTls<Stream>) {
      return close();
    } else {
      error_code ignored;
      socket().shutdown(tcp::socket::shutdown_send, ignored);
      expire(seconds);
      drain();
    }
  }

  void drain() {
    auto buf = std::make_shared<std::array<char, 16384>>();
    stream_.async_read_some(asio::buffer(*buf), [self = this->shared_from_this(), buf](error_code ec, size_t) {
      if (ec) return self->close();
      self->drain();
    });
  }

  void close() {
    error_code ignored;
    beast::get_lowest_layer(stream_).cancel();
    socket().shutdown(tcp::socket::shutdown_both, ignored);
    socket().close(ignored);
  }

  HttpServer::Impl* s_;
  Stream stream_;
  const bool refusing_;
  const uint64_t id_;
  HttpCall call_;
  beast::flat_buffer buf_;
  std::optional<http::request_parser<http::string_body>> parser_;
  HttpRequest req_;
  HttpResponse res_;
  bool busy_ = false;  // a request is being handled or answered (on the connection's strand)
};

}  // namespace

void HttpServer::Impl::accept() {
  acceptor.async_accept(asio::make_strand(ioc), [this](error_code ec, tcp::socket socket) {
    if (stopping || ec == asio::error::operation_aborted) return;
    if (ec) {  // out of descriptors, most likely: wait a little rather than spin
      event("accept_error");
      accept_retry.expires_after(std::chrono::milliseconds(50));
      accept_retry.async_wait([this](error_code e) {
        if (!e) accept();
      });
      return;
    }
    admit(std::move(socket));
    accept();
  });
}

void HttpServer::Impl::admit(tcp::socket socket) {
  error_code ec;
  const auto peer = socket.remote_endpoint(ec);
  if (ec) return;  // gone already
  socket.set_option(tcp::no_delay(true), ec);  // headers and body go out without waiting for an ACK
  bool refusing = false;
  {
    std::lock_guard lock(mu);
    if (static_cast<int64_t>(open.size()) >= opt.max_connections) {
      if (refused >= opt.max_connections) return;  // closes it: even 503s are over the limit
      refusing = true;
    }
  }
  if (refusing) event("over_limit");
  std::string remote = peer.address().to_string();
  if (tls) {
    using S = beast::ssl_stream<beast::tcp_stream>;
    std::make_shared<Connection<S>>(this, S(beast::tcp_stream(std::move(socket)), *tls), std::move(remote), refusing)
        ->start();
  } else {
    std::make_shared<Connection<beast::tcp_stream>>(this, beast::tcp_stream(std::move(socket)), std::move(remote),
                                                    refusing)
        ->start();
  }
}

HttpServer::HttpServer(HttpServerOptions options, ErrorPage error_page, Event event) : impl_(std::make_unique<Impl>()) {
  impl_->opt = std::move(options);
  impl_->error_page = std::move(error_page);
  impl_->event = std::move(event);
  const auto& o = impl_->opt;
  if (!o.tls_cert.empty()) {
    auto& ctx = impl_->tls.emplace(ssl::context::tls_server);
    ctx.set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 | ssl::context::no_sslv3 |
                    ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1);
    error_code e1, e2;
    ctx.use_certificate_chain_file(o.tls_cert, e1);
    ctx.use_private_key_file(o.tls_key, ssl::context::pem, e2);
    HEADS_CHECK(!e1 && !e2 && SSL_CTX_check_private_key(ctx.native_handle()) == 1, "--tls-cert ", o.tls_cert,
                " / --tls-key ", o.tls_key, ": not a usable certificate and key (PEM)");
  }
}

HttpServer::~HttpServer() { stop(); }

void HttpServer::route(http::verb method, const std::string& path, Handler handler, bool blocking) {
  impl_->routes[{method, path}] = Impl::Route{std::move(handler), blocking};
}

int HttpServer::start() {
  auto& s = *impl_;
  // Each connection is a descriptor: allow as many as the system lets this process have, and
  // keep the connection limit (and as many refusals) under it, with room for the model's files,
  // gRPC and the cache.
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) == 0) {
    if (r.rlim_cur < r.rlim_max) {
      r.rlim_cur = std::min<rlim_t>(r.rlim_max, rlim_t{1} << 20);
      setrlimit(RLIMIT_NOFILE, &r);
      getrlimit(RLIMIT_NOFILE, &r);
    }
    const auto room = static_cast<int64_t>((r.rlim_cur > 512 ? r.rlim_cur - 256 : r.rlim_cur / 2) / 2);
    if (s.opt.max_connections > room) {
      log_json("http_max_connections_capped",
               "{\"requested\":" + std::to_string(s.opt.max_connections) + ",\"applied\":" + std::to_string(room) +
                   ",\"open_files_limit\":" + std::to_string(r.rlim_cur) + "}");
      s.opt.max_connections = std::max<int64_t>(room, 1);
    }
  }
  const std::string flag = "--http-port";
  error_code ec;
  tcp::resolver resolver(s.ioc);
  const auto found = resolver.resolve(s.opt.bind, std::to_string(s.opt.port), tcp::resolver::passive, ec);
  HEADS_CHECK(!ec && !found.empty(), "--bind ", s.opt.bind, ": not an address (", ec.message(), ")");
  const tcp::endpoint at = found.begin()->endpoint();
  s.acceptor.open(at.protocol(), ec);
  if (!ec) s.acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) s.acceptor.bind(at, ec);
  if (!ec) s.acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (s.opt.port == 0) {
    HEADS_CHECK(!ec, flag, ": cannot bind any port on ", s.opt.bind, " (", ec.message(), ")");
  } else {
    HEADS_CHECK(!ec, flag, " ", s.opt.port, ": cannot bind ", s.opt.bind, ":", s.opt.port, " (in use?): ",
                ec.message());
  }
  const int port = s.acceptor.local_endpoint().port();
  s.workers = std::make_unique<asio::thread_pool>(static_cast<size_t>(std::max(1, s.opt.worker_threads)));
  s.work.emplace(s.ioc.get_executor());
  s.accept();
  for (int i = 0; i < std::max(1, s.opt.io_threads); ++i) s.io.emplace_back([&s] { s.ioc.run(); });
  s.started = true;
  return port;
}

void HttpServer::stop() {
  auto& s = *impl_;
  if (!s.started || s.stopped) return;
  s.stopped = true;
  s.stopping = true;
  asio::post(s.ioc, [&s] {
    error_code ignored;
    s.acceptor.close(ignored);
    s.accept_retry.cancel();
  });
  // Idle connections close now; those handling a request close once it is answered.
  std::vector<std::shared_ptr<ConnectionBase>> live;
  {
    std::lock_guard lock(s.mu);
    for (auto& [id, weak] : s.open) {
      if (auto c = weak.lock()) live.push_back(std::move(c));
    }
  }
  for (auto& c : live) c->close_if_idle();
  live.clear();
  {
    std::unique_lock lock(s.mu);
    s.all_closed.wait_for(lock, ms(s.opt.drain_seconds), [&s] { return s.open.empty() && s.refused == 0; });
  }
  s.work.reset();
  s.ioc.stop();
  for (auto& t : s.io) t.join();
  s.workers->join();
}

int64_t HttpServer::open_connections() const {
  std::lock_guard lock(impl_->mu);
  return static_cast<int64_t>(impl_->open.size());
}

int64_t HttpServer::max_connections() const { return impl_->opt.max_connections; }

}  // namespace heads::serve
