// viz.h — attention heatmaps rendered with cairo to PNG or SVG (chosen by the file extension).
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "heads/tensor.h"

namespace heads {

// One heatmap per head of `weights` [H, L, L] (rows: queries, columns: keys) in a grid, the
// tokens as axis labels, a shared colour bar, and `title` above.
void render_attention_heads(const std::vector<std::string>& tokens, const Tensor& weights,
                            const std::string& title, const std::string& path);

// A single [L, L] matrix (e.g. attention rollout) with labels, colour bar and title.
void render_attention_matrix(const std::vector<std::string>& tokens, const Tensor& matrix,
                             const std::string& title, const std::string& path);

// Attention rollout (Abnar & Zuidema, 2020): per layer the head average plus the identity
// (residual), rows renormalised, multiplied from the first layer up. layers: [H, L, L] each.
Tensor attention_rollout(const std::vector<Tensor>& layers);

// Line charts (e.g. `heads study`): panels side by side, each with axes (linear or log), one
// polyline with markers per series in a colour fixed by the series' name, and a legend per panel.
struct ChartSeries {
  std::string name;
  std::vector<double> x, y;
};
struct ChartPanel {
  std::string title, x_label, y_label;
  bool log_x = false, log_y = false;
  std::vector<ChartSeries> series;
  double y_min = NAN, y_max = NAN;  // fixed ends of the y axis (NaN: from the data)
};
void render_charts(const std::vector<ChartPanel>& panels, const std::string& title, const std::string& path);

}  // namespace heads
