// HttpServer (tools/serve/http_server.h) on loopback, without a model: what a slow, vanished or
// greedy client gets (timeouts, the connection limit, 413 / 431 / 400), that the event loop answers
// while every worker is busy, cancellation through the connection's descriptor, and stop().
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "http_server.h"
#include "serve/http_client.h"

namespace heads::serve {
namespace {

using ::testing::HasSubstr;
using testing::HttpClient;
using Clock = std::chrono::steady_clock;

// A server with an inline route (GET /fast), a blocking one (POST /echo) and one that waits until
// released or until its client hangs up (POST /wait).
struct Fixture {
  std::atomic<int> waiting{0}, saw_hangup{0};
  std::promise<void> release;
  std::shared_future<void> released{release.get_future().share()};
  std::vector<std::string> events;
  std::mutex mu;
  std::unique_ptr<HttpServer> server;
  int port = 0;

  explicit Fixture(HttpServerOptions o) {
    server = std::make_unique<HttpServer>(
        o,
        [](int status, const std::string& message, HttpResponse& res) {
          res.result(static_cast<unsigned>(status));
          res.body() = "error " + std::to_string(status) + ": " + message;
        },
        [this](const char* e) {
          std::lock_guard lock(mu);
          events.emplace_back(e);
        });
    server->route(http::verb::get, "/fast", [](const auto&, const auto&, auto& res) { res.body() = "fast"; }, false);
    server->route(http::verb::post, "/echo", [](const auto& req, const auto&, auto& res) { res.body() = req.body(); },
                  true);
    server->route(http::verb::post, "/wait", [this](const auto&, const HttpCall& call, auto& res) {
      ++waiting;
      while (released.wait_for(std::chrono::milliseconds(5)) != std::future_status::ready) {
        pollfd p{call.socket, POLLRDHUP, 0};
        if (poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
          ++saw_hangup;
          break;
        }
      }
      --waiting;
      res.body() = "waited";
    }, true);
    port = server->start();
  }
  int count(const std::string& event) {
    std::lock_guard lock(mu);
    return static_cast<int>(std::count(events.begin(), events.end(), event));
  }
  void wait_until(const std::function<bool()>& f) {
    const auto t0 = Clock::now();
    while (!f()) {
      ASSERT_LT(Clock::now() - t0, std::chrono::seconds(30)) << "condition never held";
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
};

HttpServerOptions quick() {
  HttpServerOptions o;
  o.read_timeout_s = 0.4;
  o.idle_timeout_s = 0.2;
  o.worker_threads = 2;
  return o;
}

void send_raw(HttpClient& c, const std::string& bytes) { boost::asio::write(c.socket(), boost::asio::buffer(bytes)); }

TEST(HttpServer, RoutesKeepAliveHeadAndErrors) {
  Fixture f(quick());
  HttpClient c(f.port);
  for (int i = 0; i < 3; ++i) {  // one connection, three requests
    auto r = c.call(http::verb::post, "/echo", "body " + std::to_string(i));
    ASSERT_EQ(r.status, 200);
    EXPECT_EQ(r.body, "body " + std::to_string(i));
    EXPECT_EQ(r.header("Keep-Alive"), "timeout=0");
  }
  auto r = c.call(http::verb::get, "/fast?x=1");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "fast");
  r = c.call(http::verb::head, "/fast");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.header("Content-Length"), "4");
  EXPECT_EQ(r.body, "");
  r = c.call(http::verb::get, "/nowhere");
  EXPECT_EQ(r.status, 404);
  EXPECT_THAT(r.body, HasSubstr("no route GET /nowhere"));
  r = c.call(http::verb::post, "/fast");
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(f.server->open_connections(), 1);
}

TEST(HttpServer, SlowAndIdleClientsAreClosed) {
  Fixture f(quick());
  // Slowloris: one header line at a time, each well within any per-read timeout.
  HttpClient slow(f.port);
  send_raw(slow, "POST /echo HTTP/1.1\r\n");
  const auto t0 = Clock::now();
  bool closed = false;
  for (int i = 0; i < 200 && !closed; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    boost::system::error_code ec;
    boost::asio::write(slow.socket(), boost::asio::buffer(std::string("X-Line: ") + std::to_string(i) + "\r\n"), ec);
    closed = ec.failed();
  }
  EXPECT_TRUE(closed || slow.closed_by_server(5));
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(8));
  EXPECT_GE(f.count("timeout"), 1);
  // An idle keep-alive connection is closed after its request.
  HttpClient idle(f.port);
  EXPECT_EQ(idle.call(http::verb::get, "/fast").status, 200);
  EXPECT_TRUE(idle.closed_by_server(5));
  // A connection that never sends anything too.
  HttpClient silent(f.port);
  EXPECT_TRUE(silent.closed_by_server(5));
  f.wait_until([&] { return f.server->open_connections() == 0; });
}

TEST(HttpServer, ConnectionLimitAnswers503AndFreesUp) {
  HttpServerOptions o = quick();
  o.max_connections = 3;
  o.read_timeout_s = 30;
  o.idle_timeout_s = 30;
  Fixture f(o);
  std::vector<std::unique_ptr<HttpClient>> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(std::make_unique<HttpClient>(f.port));
    EXPECT_EQ(held.back()->call(http::verb::get, "/fast").status, 200);
  }
  HttpClient over(f.port);
  auto r = over.read();  // answered without sending anything
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.header("Retry-After"), "1");
  EXPECT_THAT(r.body, HasSubstr("3 connections open"));
  EXPECT_EQ(f.count("over_limit"), 1);
  held.pop_back();  // one leaves: a new connection is served again
  f.wait_until([&] { return f.server->open_connections() == 2; });
  HttpClient next(f.port);
  EXPECT_EQ(next.call(http::verb::get, "/fast").status, 200);
}

TEST(HttpServer, OversizedAndMalformedRequests) {
  HttpServerOptions o = quick();
  o.body_limit = 1000;
  o.header_limit = 2000;
  Fixture f(o);
  {
    HttpClient c(f.port);  // the client sends its whole body before reading: it still gets the 413
    auto r = c.call(http::verb::post, "/echo", std::string(300000, 'x'));
    EXPECT_EQ(r.status, 413);
    EXPECT_EQ(r.header("Connection"), "close");
  }
  {
    HttpClient c(f.port);  // chunked, over the limit only once read
    send_raw(c, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
    for (int i = 0; i < 3; ++i) send_raw(c, "200\r\n" + std::string(512, 'y') + "\r\n");
    EXPECT_EQ(c.read().status, 413);
  }
  {
    HttpClient c(f.port);
    auto r = c.call(http::verb::get, "/fast", "", {{"X-Big", std::string(5000, 'h')}});
    EXPECT_EQ(r.status, 431);
  }
  {
    HttpClient c(f.port);
    send_raw(c, "GET /fast HTTP/1.1\r\nHost: x\r\nContent-Length: banana\r\n\r\n");
    auto r = c.read();
    EXPECT_EQ(r.status, 400);
    EXPECT_THAT(r.body, HasSubstr("malformed HTTP request"));
  }
  {
    HttpClient c(f.port);  // Expect: 100-continue gets its interim answer, then the real one
    send_raw(c, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n");
    EXPECT_EQ(c.read().status, 100);
    send_raw(c, "hello");
    auto r = c.read();
    EXPECT_EQ(r.status, 200);
    EXPECT_EQ(r.body, "hello");
  }
}

TEST(HttpServer, EventLoopAnswersWhileWorkersWaitAndHangupsAreSeen) {
  HttpServerOptions o = quick();
  o.worker_threads = 1;
  o.read_timeout_s = 30;
  Fixture f(o);
  auto a = std::make_unique<HttpClient>(f.port);
  send_raw(*a, "POST /wait HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
  f.wait_until([&] { return f.waiting == 1; });
  HttpClient queued(f.port);  // waits for the only worker
  send_raw(queued, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi");
  HttpClient probe(f.port);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(probe.call(http::verb::get, "/fast").status, 200);
  a.reset();  // the waiting client hangs up: its handler sees it through its descriptor
  f.wait_until([&] { return f.saw_hangup == 1; });
  auto r = queued.read();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "hi");
}

TEST(HttpServer, StopAnswersRequestsInFlightAndClosesIdleOnes) {
  HttpServerOptions o = quick();
  o.read_timeout_s = 30;
  o.idle_timeout_s = 30;
  Fixture f(o);
  HttpClient idle(f.port);
  EXPECT_EQ(idle.call(http::verb::get, "/fast").status, 200);
  HttpClient busy(f.port);
  send_raw(busy, "POST /wait HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
  f.wait_until([&] { return f.waiting == 1; });
  auto stopped = std::async(std::launch::async, [&] { f.server->stop(); });
  EXPECT_TRUE(idle.closed_by_server(10));
  EXPECT_EQ(stopped.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);  // still in flight
  f.release.set_value();
  auto r = busy.read();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "waited");
  EXPECT_EQ(r.header("Connection"), "close");
  stopped.get();
  EXPECT_EQ(f.server->open_connections(), 0);
}

}  // namespace
}  // namespace heads::serve
