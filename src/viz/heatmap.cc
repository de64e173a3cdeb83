// heatmap.cc — attention heatmaps with cairo: a grid of heads or one matrix, token labels,
// viridis colours, a colour bar. Output is PNG or SVG by extension, written to a temporary name
// and renamed at the end.
#include "heads/viz.h"

#include <cairo-svg.h>
#include <cairo.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>

#include "heads/error.h"
#include "viz/canvas.h"

namespace heads {

namespace {

using viz::Canvas;
using viz::set_font;
using viz::text;

// viridis at 9 anchors, linearly interpolated.
void viridis(double t, double* r, double* g, double* b) {
  static const double k[9][3] = {{0.267, 0.005, 0.329}, {0.283, 0.141, 0.458}, {0.254, 0.265, 0.530},
                                 {0.207, 0.372, 0.553}, {0.164, 0.471, 0.558}, {0.128, 0.567, 0.551},
                                 {0.135, 0.659, 0.518}, {0.478, 0.821, 0.318}, {0.993, 0.906, 0.144}};
  t = std::clamp(t, 0.0, 1.0) * 8.0;
  const int i = std::min(7, static_cast<int>(t));
  const double f = t - i;
  *r = k[i][0] + f * (k[i + 1][0] - k[i][0]);
  *g = k[i][1] + f * (k[i + 1][1] - k[i][1]);
  *b = k[i][2] + f * (k[i + 1][2] - k[i][2]);
}

std::string ellipsize(const std::string& s, size_t max_bytes) {
  if (s.size() <= max_bytes) return s;
  size_t cut = max_bytes;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // UTF-8 boundary
  return s.substr(0, cut) + "…";
}

// One heatmap with its top-left corner at (x, y), cells of `cell` pixels.
void heatmap(cairo_t* cr, const std::vector<std::string>& tokens, const float* m, int64_t L, double x,
             double y, double cell, double vmax, const std::string& title, double label_size) {
  if (!title.empty()) text(cr, title, x + cell * static_cast<double>(L) / 2, y - 12, label_size + 3, 0, false, true, true);
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t j = 0; j < L; ++j) {
      double r, g, b;
      viridis(vmax > 0 ? m[i * L + j] / vmax : 0.0, &r, &g, &b);
      cairo_set_source_rgb(cr, r, g, b);
      cairo_rectangle(cr, x + j * cell, y + i * cell, cell, cell);
      cairo_fill(cr);
    }
  }
  cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
  cairo_set_line_width(cr, 0.8);
  cairo_rectangle(cr, x, y, cell * L, cell * L);
  cairo_stroke(cr);
  for (int64_t i = 0; i < L; ++i) {  // queries on the left, keys below (rotated)
    text(cr, ellipsize(tokens[static_cast<size_t>(i)], 14), x - 4, y + (i + 0.5) * cell, label_size, 0, true);
    text(cr, ellipsize(tokens[static_cast<size_t>(i)], 14), x + (i + 0.5) * cell, y + L * cell + 4, label_size,
         M_PI / 2);
  }
}

void colorbar(cairo_t* cr, double x, double y, double h, double vmax) {
  const int steps = 100;
  for (int s = 0; s < steps; ++s) {
    double r, g, b;
    viridis(1.0 - (s + 0.5) / steps, &r, &g, &b);
    cairo_set_source_rgb(cr, r, g, b);
    cairo_rectangle(cr, x, y + h * s / steps, 16, h / steps + 0.5);
    cairo_fill(cr);
  }
  cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
  cairo_rectangle(cr, x, y, 16, h);
  cairo_stroke(cr);
  char buf[32];
  for (int k = 0; k <= 4; ++k) {
    std::snprintf(buf, sizeof buf, "%.2f", vmax * (1.0 - k / 4.0));
    text(cr, buf, x + 22, y + h * k / 4.0, 11);
  }
  text(cr, "attention weight", x + 62, y + h / 2, 11, M_PI / 2, false, true);
}

double label_width(const std::vector<std::string>& tokens, double size) {
  size_t longest = 1;
  for (const auto& t : tokens) longest = std::max(longest, std::min<size_t>(t.size(), 15));
  return static_cast<double>(longest) * size * 0.62 + 10;
}

// Width in pixels of a line of text as text() draws it.
double text_width(const std::string& s, double size, bool bold) {
  cairo_surface_t* surface = cairo_image_surface_create(CAIRO_FORMAT_ARGB32, 1, 1);
  cairo_t* cr = cairo_create(surface);
  const cairo_text_extents_t ext = set_font(cr, s, size, bold);
  cairo_destroy(cr);
  cairo_surface_destroy(surface);
  return ext.x_advance;
}

// Panels [P, L, L] in a grid, each under its name (none when empty), one colour scale. The canvas
// is widened to the title, up to kMaxTitleWidth; a longer title is shortened with an ellipsis.
void render_panels(const std::vector<std::string>& tokens, const Tensor& w, const std::string& title,
                   const std::vector<std::string>& names, const std::string& path) {
  constexpr double kTitleSize = 17, kSubtitleSize = 12, kMaxTitleWidth = 1600;
  const std::string subtitle = "rows: query token (attends)  ·  columns: key token (attended to)";
  const int64_t H = w.size(0), L = w.size(1);
  const int64_t cols = H <= 4 ? H : (H <= 9 ? 3 : 4), rows = (H + cols - 1) / cols;
  const double cell = std::clamp(360.0 / static_cast<double>(L), 6.0, 34.0);
  const double label = std::clamp(cell * 0.45, 7.0, 12.0);
  const double lw = label_width(tokens, label);
  const double panel_w = lw + cell * L + 30, panel_h = 40 + cell * L + lw;
  std::string head = title;
  for (size_t keep = head.size(); text_width(head, kTitleSize, true) + 40 > kMaxTitleWidth && keep > 1;) {
    keep = keep * 9 / 10;
    head = ellipsize(title, keep);
  }
  const double width = std::max({40 + cols * panel_w + 110, text_width(head, kTitleSize, true) + 40,
                                 text_width(subtitle, kSubtitleSize, false) + 40});
  const double height = 70 + rows * panel_h;
  Canvas c(path, width, height);
  text(c.cr, head, width / 2, 24, kTitleSize, 0, false, true, true);
  text(c.cr, subtitle, width / 2, 48, kSubtitleSize, 0, false, true);
  float vmax = 0;
  for (int64_t i = 0; i < w.numel(); ++i) vmax = std::max(vmax, w.data<float>()[i]);
  const double x0 = (width - (40 + cols * panel_w + 110)) / 2;  // the grid centred under a wide title
  for (int64_t h = 0; h < H; ++h) {
    const double x = x0 + 40 + (h % cols) * panel_w + lw, y = 70 + (h / cols) * panel_h + 30;
    heatmap(c.cr, tokens, w.data<float>() + h * L * L, L, x, y, cell, vmax, names[static_cast<size_t>(h)], label);
  }
  colorbar(c.cr, x0 + 40 + cols * panel_w + 10, 100, std::min(300.0, height - 160), vmax);
  c.finish();
}

}  // namespace

void render_attention_heads(const std::vector<std::string>& tokens, const Tensor& weights_in,
                            const std::string& title, const std::string& path) {
  HEADS_CHECK(weights_in.dim() == 3 && weights_in.size(1) == weights_in.size(2) &&
                  weights_in.size(1) == static_cast<int64_t>(tokens.size()),
              "viz: weights ", weights_in.shape(), " do not match ", tokens.size(), " tokens ([H, L, L])");
  const Tensor w = weights_in.to(DType::F32);
  HEADS_CHECK(w.size(0) >= 1 && w.size(1) >= 1, "viz: nothing to draw");
  std::vector<std::string> names;
  for (int64_t h = 0; h < w.size(0); ++h) names.push_back("head " + std::to_string(h));
  render_panels(tokens, w, title, names, path);
}

void render_attention_matrix(const std::vector<std::string>& tokens, const Tensor& m_in,
                             const std::string& title, const std::string& path) {
  HEADS_CHECK(m_in.dim() == 2 && m_in.size(0) == m_in.size(1) &&
                  m_in.size(0) == static_cast<int64_t>(tokens.size()),
              "viz: matrix ", m_in.shape(), " does not match ", tokens.size(), " tokens ([L, L])");
  HEADS_CHECK(m_in.size(0) >= 1, "viz: nothing to draw");
  render_panels(tokens, m_in.to(DType::F32).unsqueeze(0), title, {""}, path);
}

Tensor attention_rollout(const std::vector<Tensor>& layers) {
  HEADS_CHECK(!layers.empty(), "attention_rollout: no layers");
  const int64_t L = layers[0].size(-1);
  std::vector<double> R(static_cast<size_t>(L * L), 0.0), A(R.size()), T(R.size());
  for (int64_t i = 0; i < L; ++i) R[static_cast<size_t>(i * L + i)] = 1.0;
  for (const Tensor& lw : layers) {
    HEADS_CHECK(lw.dim() == 3 && lw.size(1) == L && lw.size(2) == L, "attention_rollout: layer ",
                lw.shape(), " is not [H, ", L, ", ", L, "]");
    const Tensor w = lw.to(DType::F64);
    const int64_t H = w.size(0);
    for (int64_t i = 0; i < L; ++i) {
      double row = 0;
      for (int64_t j = 0; j < L; ++j) {
        double a = 0;
        for (int64_t h = 0; h < H; ++h) a += w.data<double>()[(h * L + i) * L + j];
        a = 0.5 * a / static_cast<double>(H) + (i == j ? 0.5 : 0.0);
        A[static_cast<size_t>(i * L + j)] = a;
        row += a;
      }
      for (int64_t j = 0; j < L; ++j) A[static_cast<size_t>(i * L + j)] /= row;
    }
    for (int64_t i = 0; i < L; ++i) {  // R = A · R
      for (int64_t j = 0; j < L; ++j) {
        double s = 0;
        for (int64_t k = 0; k < L; ++k) s += A[static_cast<size_t>(i * L + k)] * R[static_cast<size_t>(k * L + j)];
        T[static_cast<size_t>(i * L + j)] = s;
      }
    }
    R.swap(T);
  }
  Tensor out = Tensor::empty({L, L}, DType::F32);
  for (int64_t i = 0; i < L * L; ++i) out.data<float>()[i] = static_cast<float>(R[static_cast<size_t>(i)]);
  return out;
}

}  // namespace heads
