// A blocking HTTP/1.1 client for the serve tests (Boost.Beast): one connection, requests in turn.
#pragma once

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <map>
#include <string>

namespace heads::serve::testing {

namespace beast = boost::beast;
namespace http = beast::http;
using tcp = boost::asio::ip::tcp;

struct HttpReply {
  int status = 0;
  std::string body;
  std::map<std::string, std::string> headers;
  std::string header(const std::string& name) const {
    auto it = headers.find(name);
    return it == headers.end() ? "" : it->second;
  }
};

class HttpClient {
 public:
  explicit HttpClient(int port) : socket_(ioc_) { socket_.connect(tcp::endpoint(boost::asio::ip::make_address("127.0.0.1"), port)); }

  HttpReply call(http::verb method, const std::string& target, const std::string& body = "",
                 const std::map<std::string, std::string>& headers = {}) {
    http::request<http::string_body> req(method, target, 11);
    req.set(http::field::host, "127.0.0.1");
    for (const auto& [k, v] : headers) req.set(k, v);
    if (!body.empty() || method == http::verb::post) {
      req.body() = body;
      if (req.find(http::field::content_type) == req.end()) req.set(http::field::content_type, "application/json");
      req.prepare_payload();
    }
    http::write(socket_, req);
    return read(method == http::verb::head);
  }

  HttpReply read(bool head = false) {
    http::response_parser<http::string_body> p;
    p.body_limit(size_t{1} << 30);
    p.skip(head);
    http::read(socket_, buf_, p);
    HttpReply r;
    r.status = p.get().result_int();
    r.body = p.get().body();
    for (const auto& f : p.get()) r.headers[std::string(f.name_string())] = std::string(f.value());
    return r;
  }

  tcp::socket& socket() { return socket_; }

  // Whether the server closed the connection: a read that ends (EOF or reset) within `seconds`.
  bool closed_by_server(double seconds) {
    socket_.non_blocking(false);
    timeval tv{static_cast<time_t>(seconds), static_cast<suseconds_t>((seconds - static_cast<time_t>(seconds)) * 1e6)};
    setsockopt(socket_.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char c;
    const ssize_t n = ::recv(socket_.native_handle(), &c, 1, 0);
    return n == 0 || (n < 0 && errno == ECONNRESET);
  }

 private:
  boost::asio::io_context ioc_;
  tcp::socket socket_;
  beast::flat_buffer buf_;
};

}  // namespace heads::serve::testing
