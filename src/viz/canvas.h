// canvas.h — what the cairo drawings share: a PNG or SVG surface chosen by the file extension,
// written to a temporary name and renamed into place at finish(); text in the labels' font.
#pragma once

#include <cairo-svg.h>
#include <cairo.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <string>

#include "heads/error.h"

namespace heads::viz {

struct Canvas {
  cairo_surface_t* surface = nullptr;
  cairo_t* cr = nullptr;
  std::string path, tmp;
  bool png = true;

  Canvas(const std::string& p, double w, double h) : path(p) {
    const std::string ext = std::filesystem::path(p).extension().string();
    HEADS_CHECK(ext == ".png" || ext == ".svg", p, ": output must end in .png or .svg");
    png = ext == ".png";
    std::random_device rd;
    tmp = p + ".tmp" + std::to_string(rd() % 1000000);
    surface = png ? cairo_image_surface_create(CAIRO_FORMAT_ARGB32, static_cast<int>(w), static_cast<int>(h))
                  : cairo_svg_surface_create(tmp.c_str(), w, h);
    HEADS_CHECK(cairo_surface_status(surface) == CAIRO_STATUS_SUCCESS, p, ": cannot create the drawing (",
                cairo_status_to_string(cairo_surface_status(surface)), ")");
    cr = cairo_create(surface);
    cairo_set_source_rgb(cr, 1, 1, 1);
    cairo_paint(cr);
  }
  ~Canvas() {
    if (cr) cairo_destroy(cr);
    if (surface) cairo_surface_destroy(surface);
    std::remove(tmp.c_str());
  }
  void finish() {
    cairo_destroy(cr);
    cr = nullptr;
    cairo_status_t st = CAIRO_STATUS_SUCCESS;
    if (png) {
      st = cairo_surface_write_to_png(surface, tmp.c_str());
    } else {
      cairo_surface_finish(surface);
      st = cairo_surface_status(surface);
    }
    cairo_surface_destroy(surface);
    surface = nullptr;
    HEADS_CHECK(st == CAIRO_STATUS_SUCCESS, path, ": cannot write (", cairo_status_to_string(st), ")");
    HEADS_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, path, ": cannot move the drawing into place");
  }
};

// Selects the labels' font at `size` and measures s in it.
inline cairo_text_extents_t set_font(cairo_t* cr, const std::string& s, double size, bool bold) {
  cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL,
                         bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
  cairo_text_extents_t ext;
  cairo_text_extents(cr, s.c_str(), &ext);
  return ext;
}

inline void text(cairo_t* cr, const std::string& s, double x, double y, double size, double angle = 0,
          bool right = false, bool center = false, bool bold = false) {
  const cairo_text_extents_t ext = set_font(cr, s, size, bold);
  cairo_save(cr);
  cairo_translate(cr, x, y);
  cairo_rotate(cr, angle);
  double dx = 0;
  if (right) dx = -ext.x_advance;
  if (center) dx = -ext.x_advance / 2;
  cairo_move_to(cr, dx, ext.height / 2 - 1);
  cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
  cairo_show_text(cr, s.c_str());
  cairo_restore(cr);
}

}  // namespace heads::viz
