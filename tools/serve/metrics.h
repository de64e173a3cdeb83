// metrics.h — the server's counters, gauges and histograms, written in Prometheus' text format
// (GET /metrics). Series are created on first use; every method is thread-safe.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace heads::serve {

// Label pairs, e.g. {{"route", "/v1/embeddings"}, {"code", "200"}}.
using Labels = std::vector<std::pair<std::string, std::string>>;

class Metrics {
 public:
  // Declares a family once, before use: its help text and, for a histogram, its bucket bounds.
  void counter(const std::string& name, const std::string& help);
  void gauge(const std::string& name, const std::string& help);
  void histogram(const std::string& name, const std::string& help, std::vector<double> bounds);

  void add(const std::string& name, const Labels& labels, double v = 1);  // counter
  void set(const std::string& name, const Labels& labels, double v);     // gauge
  void observe(const std::string& name, const Labels& labels, double v);  // histogram

  // The value of a counter or gauge series (0 if it was never touched): for tests and logs.
  double value(const std::string& name, const Labels& labels) const;

  std::string prometheus() const;

 private:
  struct Series {
    double value = 0;              // counter / gauge
    std::vector<uint64_t> counts;  // histogram: per bucket (not cumulative)
    double sum = 0;
    uint64_t count = 0;
  };
  struct Family {
    std::string help, type;
    std::vector<double> bounds;
    std::map<std::string, Series> series;  // by rendered label set
  };
  Family& family(const std::string& name, const char* type);

  mutable std::mutex mu_;
  std::map<std::string, Family> families_;
};

// `{a="x",b="y"}` with Prometheus' escaping; "" for no labels.
std::string render_labels(const Labels& labels);

}  // namespace heads::serve
