// chart.cc — line charts with cairo (include/heads/viz.h): axes with round ticks (linear or log),
// one polyline with markers per series, a legend, PNG or SVG by extension.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "heads/error.h"
#include "heads/viz.h"
#include "viz/canvas.h"

namespace heads {

namespace {

using viz::Canvas;
using viz::text;

constexpr double kPanelW = 520, kPanelH = 380, kMarginL = 70, kMarginR = 20, kMarginT = 70, kMarginB = 60;

// Tab10, by the order in which series names first appear in the chart: one name, one colour in
// every panel.
void colour_of(const std::vector<std::string>& names, const std::string& name, double* r, double* g, double* b) {
  static const double k[10][3] = {{0.122, 0.467, 0.706}, {1.000, 0.498, 0.055}, {0.173, 0.627, 0.173},
                                  {0.839, 0.153, 0.157}, {0.580, 0.404, 0.741}, {0.549, 0.337, 0.294},
                                  {0.890, 0.467, 0.761}, {0.498, 0.498, 0.498}, {0.737, 0.741, 0.133},
                                  {0.090, 0.745, 0.812}};
  const size_t i = static_cast<size_t>(std::find(names.begin(), names.end(), name) - names.begin());
  const double* c = k[i % 10];
  *r = c[0], *g = c[1], *b = c[2];
}

std::string tick_label(double v) {
  char buf[32];
  if (v != 0 && (std::abs(v) >= 1e5 || std::abs(v) < 1e-3)) {
    std::snprintf(buf, sizeof buf, "%.0e", v);
  } else {
    std::snprintf(buf, sizeof buf, "%g", v);
  }
  return buf;
}

// An axis: its range in data units (log10 when log) and its ticks.
struct Axis {
  bool log = false;
  double lo = 0, hi = 1;
  std::vector<double> ticks;  // data units
  double map(double v) const { return ((log ? std::log10(v) : v) - lo) / (hi - lo); }
};

// An axis over `vals` (and `lo_fixed` / `hi_fixed` where finite): log axes span the data's decades
// loosely with ticks at 1, 2 and 5 times powers of ten; linear axes round ticks of 1, 2 or 5 steps.
Axis make_axis(std::vector<double> vals, bool log, double lo_fixed, double hi_fixed) {
  Axis a;
  a.log = log;
  vals.erase(std::remove_if(vals.begin(), vals.end(), [&](double v) { return !std::isfinite(v) || (log && v <= 0); }),
             vals.end());
  if (vals.empty()) vals = {log ? 1.0 : 0.0, log ? 10.0 : 1.0};
  double lo = *std::min_element(vals.begin(), vals.end()), hi = *std::max_element(vals.begin(), vals.end());
  if (std::isfinite(lo_fixed) && (!log || lo_fixed > 0)) lo = lo_fixed;  // a log axis cannot start at <= 0
  if (std::isfinite(hi_fixed) && (!log || hi_fixed > 0)) hi = hi_fixed;
  if (log) {
    if (hi <= lo) hi = lo * 10;
    const double span = std::log10(hi) - std::log10(lo);
    a.lo = std::log10(lo) - 0.05 * span;
    a.hi = std::log10(hi) + 0.05 * span;
    for (double e = std::floor(a.lo); e <= std::ceil(a.hi); ++e) {
      for (double m : {1.0, 2.0, 5.0}) {
        const double t = m * std::pow(10.0, e);
        const double lt = std::log10(t);
        if (lt >= a.lo - 1e-9 && lt <= a.hi + 1e-9 && (span < 2.5 || m == 1.0)) a.ticks.push_back(t);
      }
    }
    return a;
  }
  if (!std::isfinite(lo_fixed) && lo > 0 && lo < 0.5 * hi) lo = 0;  // include 0 when it is near
  if (hi - lo < 1e-12) hi = lo + 1;
  const double raw = (hi - lo) / 5, mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = raw / mag < 1.5 ? mag : raw / mag < 3.5 ? 2 * mag : raw / mag < 7.5 ? 5 * mag : 10 * mag;
  a.lo = std::floor(lo / step + 1e-9) * step;
  a.hi = std::ceil(hi / step - 1e-9) * step;
  for (double t = a.lo; t <= a.hi + step * 1e-6; t += step) a.ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
  return a;
}

void panel(cairo_t* cr, const ChartPanel& p, const std::vector<std::string>& names, double x0, double y0) {
  const double w = kPanelW - kMarginL - kMarginR, h = kPanelH - kMarginT - kMarginB;
  const double px = x0 + kMarginL, py = y0 + kMarginT;
  std::vector<double> xs, ys;
  for (const ChartSeries& s : p.series) {
    xs.insert(xs.end(), s.x.begin(), s.x.end());
    ys.insert(ys.end(), s.y.begin(), s.y.end());
  }
  const Axis ax = make_axis(xs, p.log_x, NAN, NAN), ay = make_axis(ys, p.log_y, p.y_min, p.y_max);
  text(cr, p.title, px + w / 2, y0 + 22, 14, 0, false, true, true);
  cairo_set_line_width(cr, 1);
  for (double t : ax.ticks) {
    const double x = px + ax.map(t) * w;
    cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
    cairo_move_to(cr, x, py);
    cairo_line_to(cr, x, py + h);
    cairo_stroke(cr);
    text(cr, tick_label(t), x, py + h + 12, 11, 0, false, true);
  }
  for (double t : ay.ticks) {
    const double y = py + h - ay.map(t) * h;
    cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
    cairo_move_to(cr, px, y);
    cairo_line_to(cr, px + w, y);
    cairo_stroke(cr);
    text(cr, tick_label(t), px - 6, y, 11, 0, true);
  }
  cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
  cairo_rectangle(cr, px, py, w, h);
  cairo_stroke(cr);
  text(cr, p.x_label + (p.log_x ? " (log)" : ""), px + w / 2, py + h + 34, 12, 0, false, true);
  text(cr, p.y_label + (p.log_y ? " (log)" : ""), x0 + 16, py + h / 2, 12, -M_PI / 2, false, true);
  // Series, clipped to the plot area.
  cairo_save(cr);
  cairo_rectangle(cr, px - 4, py - 4, w + 8, h + 8);
  cairo_clip(cr);
  for (const ChartSeries& s : p.series) {
    double r, g, b;
    colour_of(names, s.name, &r, &g, &b);
    cairo_set_source_rgb(cr, r, g, b);
    cairo_set_line_width(cr, 2);
    bool started = false;
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i]) || (p.log_x && s.x[i] <= 0) || (p.log_y && s.y[i] <= 0)) continue;
      const double x = px + ax.map(s.x[i]) * w, y = py + h - ay.map(s.y[i]) * h;
      if (started) {
        cairo_line_to(cr, x, y);
      } else {
        cairo_move_to(cr, x, y);
        started = true;
      }
    }
    cairo_stroke(cr);
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i]) || (p.log_x && s.x[i] <= 0) || (p.log_y && s.y[i] <= 0)) continue;
      cairo_arc(cr, px + ax.map(s.x[i]) * w, py + h - ay.map(s.y[i]) * h, 3.5, 0, 2 * M_PI);
      cairo_fill(cr);
    }
  }
  cairo_restore(cr);
  // Legend above the plot.
  double lx = px;
  for (const ChartSeries& s : p.series) {
    double r, g, b;
    colour_of(names, s.name, &r, &g, &b);
    cairo_set_source_rgb(cr, r, g, b);
    cairo_rectangle(cr, lx, y0 + 44, 12, 4);
    cairo_fill(cr);
    text(cr, s.name, lx + 16, y0 + 46, 11);
    lx += 24 + viz::set_font(cr, s.name, 11, false).x_advance;
    if (lx > px + w - 40) lx = px;  // wrap (overlaps rather than overflows on very long legends)
  }
}

}  // namespace

void render_charts(const std::vector<ChartPanel>& panels, const std::string& title, const std::string& path) {
  HEADS_CHECK(!panels.empty(), "render_charts: no panels");
  for (const ChartPanel& p : panels) {
    for (const ChartSeries& s : p.series) {
      HEADS_CHECK(s.x.size() == s.y.size(), "render_charts: series \"", s.name, "\" has ", s.x.size(), " x and ",
                  s.y.size(), " y values");
    }
  }
  std::vector<std::string> names;  // in order of first appearance: their colours
  for (const ChartPanel& p : panels) {
    for (const ChartSeries& s : p.series) {
      if (std::find(names.begin(), names.end(), s.name) == names.end()) names.push_back(s.name);
    }
  }
  const double W = kPanelW * static_cast<double>(panels.size()), H = kPanelH + 40;
  Canvas c(path, W, H);
  viz::text(c.cr, title, W / 2, 20, 15, 0, false, true, true);
  for (size_t i = 0; i < panels.size(); ++i) panel(c.cr, panels[i], names, kPanelW * static_cast<double>(i), 40);
  c.finish();
}

}  // namespace heads
