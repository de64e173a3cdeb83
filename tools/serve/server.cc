// server.cc — startup, signals and shutdown of `heads serve` (server.h).
#include "server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "heads/error.h"

namespace heads::serve {

void log_json(const std::string& event, const std::string& fields_json_object) {
  static std::mutex mu;
  char stamp[40];
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &tm);
  std::string line = "{\"time\":\"" + std::string(stamp) + "." + std::to_string(1000 + ms).substr(1) +
                     "Z\",\"event\":" + nlohmann::json(event).dump();
  if (fields_json_object.size() > 2) {
    line += ',';
    line.append(fields_json_object, 1, fields_json_object.size() - 2);
  }
  line += "}\n";
  std::lock_guard lock(mu);
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
}

bool is_loopback(const std::string& name) {
  std::string host;
  for (char c : name) host += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (!host.empty() && host.back() == '.') host.pop_back();  // "localhost."
  if (host == "localhost") return true;
  in_addr a{};
  if (inet_pton(AF_INET, host.c_str(), &a) == 1) return (ntohl(a.s_addr) >> 24) == 127;
  in6_addr a6{};
  if (inet_pton(AF_INET6, host.c_str(), &a6) != 1) return false;
  if (IN6_IS_ADDR_LOOPBACK(&a6)) return true;
  return IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127;  // ::ffff:127.x.y.z
}

std::string read_text_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  HEADS_CHECK(in.good(), what, " ", path, ": cannot open");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

int run_server(const ServerOptions& o) {
  HEADS_CHECK(o.tls_cert.empty() == o.tls_key.empty(), "--tls-cert and --tls-key: give both or neither");
  HEADS_CHECK(o.http_port >= 0 || o.grpc_port >= 0, "--http-port and --grpc-port: at least one front end is needed");
  // Signals go to one thread (sigwait below): block them before any other thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  Metrics metrics;
  Service service(o.service, &metrics);
  std::unique_ptr<FrontEnd> http, grpc;
  int http_port = -1, grpc_port = -1;
  if (o.http_port >= 0) {
    http = make_http_front_end(&service, &metrics, o);
    http_port = http->start();
  }
  if (o.grpc_port >= 0) {
    grpc = make_grpc_front_end(&service, &metrics, o);
    grpc_port = grpc->start();
  }
  log_json("ready", nlohmann::json{{"model_version", service.model()->version},
                                   {"dtype", service.model()->dtype},
                                   {"bind", o.bind},
                                   {"http_port", http_port},
                                   {"grpc_port", grpc_port},
                                   {"tls", !o.tls_cert.empty()}}
                        .dump());
  std::printf("listening http=%d grpc=%d\n", http_port, grpc_port);
  std::fflush(stdout);

  while (true) {
    int sig = 0;
    if (sigwait(&signals, &sig) != 0) continue;
    if (sig == SIGHUP) {
      // Strings, not the model: a reference held here would keep the old model alive.
      const std::string dir = service.model()->dir, before = service.model()->version;
      const EmbedResult r = service.reload(dir);
      if (r.code == Code::Ok) {
        log_json("reloaded", nlohmann::json{{"model", dir}, {"from", before}, {"to", r.version}}.dump());
      } else {
        log_json("reload_failed", nlohmann::json{{"model", dir}, {"error", r.message}}.dump(
                                      -1, ' ', false, nlohmann::json::error_handler_t::replace));
      }
      continue;
    }
    break;  // SIGTERM / SIGINT
  }
  // Drain: health turns 503 / NOT_SERVING and new requests get UNAVAILABLE, while the front ends
  // finish the requests they hold (the batcher still runs them); then stop.
  log_json("draining", "{}");
  if (grpc) grpc->not_serving();
  service.drain();
  if (grpc) grpc->stop();
  if (http) http->stop();
  log_json("stopped", nlohmann::json{{"texts_embedded", metrics.value("heads_texts_total", {})}}.dump());
  return 0;
}

}  // namespace heads::serve
