// metrics.cc — Prometheus text exposition of the server's metrics (metrics.h).
#include "metrics.h"

#include <charconv>
#include <cmath>

#include "heads/error.h"

namespace heads::serve {

namespace {

std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest form that reads back the same
  return std::string(buf, r.ptr);
}

}  // namespace

std::string render_labels(const Labels& labels) {
  if (labels.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i) out += ',';
    out += labels[i].first + "=\"";
    for (char c : labels[i].second) {
      if (c == '\\' || c == '"') {
        out += '\\';
        out += c;
      } else if (c == '\n') {
        out += "\\n";
      } else {
        out += c;
      }
    }
    out += '"';
  }
  return out + "}";
}

void Metrics::counter(const std::string& name, const std::string& help) {
  std::lock_guard lock(mu_);
  families_[name] = Family{help, "counter", {}, {}};
}

void Metrics::gauge(const std::string& name, const std::string& help) {
  std::lock_guard lock(mu_);
  families_[name] = Family{help, "gauge", {}, {}};
}

void Metrics::histogram(const std::string& name, const std::string& help, std::vector<double> bounds) {
  std::lock_guard lock(mu_);
  families_[name] = Family{help, "histogram", std::move(bounds), {}};
}

Metrics::Family& Metrics::family(const std::string& name, const char* type) {
  auto it = families_.find(name);
  HEADS_CHECK(it != families_.end() && it->second.type == type, "metrics: ", name, " is not a declared ", type);
  return it->second;
}

void Metrics::add(const std::string& name, const Labels& labels, double v) {
  std::lock_guard lock(mu_);
  family(name, "counter").series[render_labels(labels)].value += v;
}

void Metrics::set(const std::string& name, const Labels& labels, double v) {
  std::lock_guard lock(mu_);
  family(name, "gauge").series[render_labels(labels)].value = v;
}

void Metrics::observe(const std::string& name, const Labels& labels, double v) {
  std::lock_guard lock(mu_);
  Family& f = family(name, "histogram");
  Series& s = f.series[render_labels(labels)];
  if (s.counts.empty()) s.counts.assign(f.bounds.size() + 1, 0);
  size_t b = 0;
  while (b < f.bounds.size() && v > f.bounds[b]) ++b;
  ++s.counts[b];
  s.sum += v;
  ++s.count;
}

double Metrics::value(const std::string& name, const Labels& labels) const {
  std::lock_guard lock(mu_);
  auto f = families_.find(name);
  if (f == families_.end()) return 0;
  auto s = f->second.series.find(render_labels(labels));
  return s == f->second.series.end() ? 0 : s->second.value;
}

std::string Metrics::prometheus() const {
  std::lock_guard lock(mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    out += "# HELP " + name + " " + f.help + "\n# TYPE " + name + " " + f.type + "\n";
    for (const auto& [labels, s] : f.series) {
      if (f.type != "histogram") {
        out += name + labels + " " + number(s.value) + "\n";
        continue;
      }
      // Bucket lines carry the series' labels plus le="bound", cumulative counts.
      const std::string inner = labels.empty() ? "" : labels.substr(1, labels.size() - 2) + ",";
      uint64_t cumulative = 0;
      for (size_t b = 0; b <= f.bounds.size(); ++b) {
        cumulative += s.counts[b];
        const std::string le = b < f.bounds.size() ? number(f.bounds[b]) : "+Inf";
        out += name + "_bucket{" + inner + "le=\"" + le + "\"} " + std::to_string(cumulative) + "\n";
      }
      out += name + "_sum" + labels + " " + number(s.sum) + "\n";
      out += name + "_count" + labels + " " + std::to_string(s.count) + "\n";
    }
  }
  return out;
}

}  // namespace heads::serve
