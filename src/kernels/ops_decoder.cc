// ops_decoder.cc — the decoder building blocks of heads/ops.h: RMSNorm, gated activations, RoPE.
// RMSNorm and the gated activations run the ISA table's kernels (elementwise-inl.h); RoPE is plain
// loops, parallel over rows with OpenMP, whose inner loops the compiler vectorises.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "heads/ops.h"
#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/ops_common.h"

namespace heads {

using kernels::f32;
using kernels::with_last;

namespace {

int threads_for_rows(int64_t rows, int64_t width) {
  const int64_t work = rows * width;
  return work < 32768 ? 1 : static_cast<int>(std::min<int64_t>(get_num_threads(), rows));
}

float bf16_value(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

Tensor rms_norm(const Tensor& x_in, const Tensor& w_in, double eps, bool unit_offset) {
  const char* op = "rms_norm";
  HEADS_CHECK(x_in.defined() && x_in.dim() >= 1, op, ": input must have at least 1 dimension");
  const int64_t n = x_in.size(-1);
  HEADS_CHECK(w_in.defined() && w_in.shape() == Shape({n}), op, ": weight: expected [", n, "] to match input ",
              x_in.shape(), ", got ", w_in.defined() ? w_in.shape() : Shape{});
  HEADS_CHECK(eps >= 0.0, op, ": eps must be non-negative, got ", eps);
  const Tensor x = f32(x_in, op, "input"), w = f32(w_in, op, "weight");
  Tensor y = Tensor::empty(x.shape(), DType::F32);
  const int64_t rows = n > 0 ? x.numel() / n : 0;
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  float* yp = y.data<float>();
  if (rows > 0 && n > 0) kernels::active().rms_norm_f32(xp, yp, rows, n, n, n, wp, unit_offset ? 1.0f : 0.0f, eps);
  return y;
}

Tensor gated_activation(const Tensor& gu_in, GatedAct act) {
  const char* op = "gated_activation";
  HEADS_CHECK(gu_in.defined() && gu_in.dim() >= 1 && gu_in.size(-1) % 2 == 0, op,
              ": input: expected [..., 2F] (gate then up), got ", gu_in.defined() ? gu_in.shape() : Shape{});
  const Tensor gu = f32(gu_in, op, "input");
  const int64_t F = gu.size(-1) / 2, rows = F > 0 ? gu.numel() / (2 * F) : 0;
  Tensor y = Tensor::empty(with_last(gu.shape(), F), DType::F32);
  const float* g = gu.data<float>();
  float* yp = y.data<float>();
  if (rows > 0 && F > 0) {
    kernels::active().gated_f32(g, yp, rows, F, act == GatedAct::Silu ? 0 : act == GatedAct::Gelu ? 1 : 2);
  }
  return y;
}

Tensor rope_inv_freq(int64_t dim, const RopeOptions& o) {
  HEADS_CHECK(dim >= 2 && dim % 2 == 0, "rope: rotary dim must be even and at least 2, got ", dim);
  HEADS_CHECK(o.theta > 0.0 && std::isfinite(o.theta), "rope: theta must be positive, got ", o.theta);
  HEADS_CHECK(o.factor > 0.0, "rope: factor must be positive, got ", o.factor);
  Tensor t = Tensor::empty({dim / 2}, DType::F32);
  float* f = t.data<float>();
  // transformers: 1 / base ** (arange(0, dim, 2).float() / dim), in float32
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(dim);
    f[i] = 1.0f / std::pow(static_cast<float>(o.theta), e);
  }
  if (o.scaling == RopeOptions::Scaling::Linear) {
    for (int64_t i = 0; i < dim / 2; ++i) f[i] = f[i] / static_cast<float>(o.factor);
  } else if (o.scaling == RopeOptions::Scaling::Llama3) {
    HEADS_CHECK(o.high_freq_factor > o.low_freq_factor && o.low_freq_factor > 0 && o.original_max_position > 0,
                "rope: llama3 scaling needs 0 < low_freq_factor < high_freq_factor and original_max_position > 0, "
                "got ", o.low_freq_factor, ", ", o.high_freq_factor, ", ", o.original_max_position);
    const double old_len = static_cast<double>(o.original_max_position);
    const double low_wavelen = old_len / o.low_freq_factor, high_wavelen = old_len / o.high_freq_factor;
    for (int64_t i = 0; i < dim / 2; ++i) {
      const float inv = f[i];
      const float wavelen = static_cast<float>(2.0 * M_PI) / inv;
      float scaled = wavelen > low_wavelen ? inv / static_cast<float>(o.factor) : inv;
      const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
      if (medium) {
        const float smooth = static_cast<float>((old_len / wavelen - o.low_freq_factor) /
                                                (o.high_freq_factor - o.low_freq_factor));
        scaled = (1.0f - smooth) * scaled / static_cast<float>(o.factor) + smooth * scaled;
      }
      f[i] = scaled;
    }
  }
  return t;
}

namespace {

// The [L][rd/2] cosines and sines of positions offset .. offset + L - 1 (f32 angles, as transformers).
void rope_table(int64_t L, int64_t offset, const Tensor& inv_freq, std::vector<float>& cs, std::vector<float>& sn) {
  const int64_t h = inv_freq.numel();
  cs.resize(static_cast<size_t>(L * h));
  sn.resize(cs.size());
  const float* f = inv_freq.data<float>();
  for (int64_t l = 0; l < L; ++l) {
    const float pos = static_cast<float>(offset + l);
    for (int64_t i = 0; i < h; ++i) {
      const float a = pos * f[i];
      cs[static_cast<size_t>(l * h + i)] = std::cos(a);
      sn[static_cast<size_t>(l * h + i)] = std::sin(a);
    }
  }
}

void check_rope(const char* op, const Tensor& x, int64_t offset, const RopeOptions& o, int64_t* rd) {
  HEADS_CHECK(x.defined() && x.dim() == 4, op, ": input: expected [B, H, L, D], got ",
              x.defined() ? x.shape() : Shape{});
  const int64_t D = x.size(3);
  *rd = o.rotary_dim > 0 ? o.rotary_dim : D;
  HEADS_CHECK(*rd % 2 == 0 && *rd <= D && *rd >= 2, op, ": rotary_dim ", *rd, " must be even, at least 2 and at most D = ",
              D, " (input ", x.shape(), ")");
  HEADS_CHECK(offset >= 0, op, ": position_offset must be >= 0, got ", offset);
}

}  // namespace

void rope_(const Tensor& x, int64_t offset, const RopeOptions& o, bool inverse) {
  const char* op = "rope";
  int64_t rd = 0;
  check_rope(op, x, offset, o, &rd);
  HEADS_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::BF16, op, ": input: expected f32 or bf16, got ",
              dtype_name(x.dtype()));
  HEADS_CHECK(x.stride(3) == 1 || x.size(3) == 1, op, ": input: the innermost stride must be 1, got ", x.strides());
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), half = rd / 2;
  if (B * H * L == 0) return;
  std::vector<float> cs, sn;
  rope_table(L, offset, rope_inv_freq(rd, o), cs, sn);
  const float sign = inverse ? -1.0f : 1.0f;
  // element (i, partner) pairs: halves (i, i + half) or neighbours (2i, 2i + 1)
  const int64_t stride_a = o.interleaved ? 2 : 1, partner = o.interleaved ? 1 : half;
  const bool bf = x.dtype() == DType::BF16;
  char* base = static_cast<char*>(x.raw_data());
  const int64_t es = bf ? 2 : 4;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads_for_rows(B * H * L, rd))
  for (int64_t bh = 0; bh < B * H; ++bh) {
    for (int64_t l = 0; l < L; ++l) {
      char* row = base + ((bh / H) * x.stride(0) + (bh % H) * x.stride(1) + l * x.stride(2)) * es;
      // In chunks of pairs gathered into f32 arrays, turned, then written back: loops the compiler
      // vectorizes (the same arithmetic, element by element, as one loop over the pairs).
      constexpr int64_t kChunk = 64;
      for (int64_t i0 = 0; i0 < half; i0 += kChunk) {
        const int64_t n = std::min(kChunk, half - i0);
        const float* c = cs.data() + l * half + i0;
        const float* s = sn.data() + l * half + i0;
        float x1[kChunk], x2[kChunk];
        if (bf) {
          const auto* r = reinterpret_cast<const uint16_t*>(row);
          for (int64_t i = 0; i < n; ++i) {
            x1[i] = bf16_value(r[(i0 + i) * stride_a]);
            x2[i] = bf16_value(r[(i0 + i) * stride_a + partner]);
          }
        } else {
          const auto* r = reinterpret_cast<const float*>(row);
          for (int64_t i = 0; i < n; ++i) {
            x1[i] = r[(i0 + i) * stride_a];
            x2[i] = r[(i0 + i) * stride_a + partner];
          }
        }
        float y1[kChunk], y2[kChunk];
        for (int64_t i = 0; i < n; ++i) {
          y1[i] = x1[i] * c[i] - sign * x2[i] * s[i];
          y2[i] = x2[i] * c[i] + sign * x1[i] * s[i];
        }
        if (bf) {
          auto* r = reinterpret_cast<uint16_t*>(row);
          for (int64_t i = 0; i < n; ++i) {
            r[(i0 + i) * stride_a] = to_bf16(y1[i]);
            r[(i0 + i) * stride_a + partner] = to_bf16(y2[i]);
          }
        } else {
          auto* r = reinterpret_cast<float*>(row);
          for (int64_t i = 0; i < n; ++i) {
            r[(i0 + i) * stride_a] = y1[i];
            r[(i0 + i) * stride_a + partner] = y2[i];
          }
        }
      }
    }
  }
}

Tensor ref::rope_f64(const Tensor& x_in, int64_t offset, const RopeOptions& o) {
  int64_t rd = 0;
  check_rope("ref::rope_f64", x_in, offset, o, &rd);
  Tensor x = x_in.to(DType::F64).clone();
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3), half = rd / 2;
  const Tensor inv = rope_inv_freq(rd, o);
  double* p = x.data<double>();
  for (int64_t bhl = 0; bhl < B * H * L; ++bhl) {
    const int64_t l = bhl % L;
    double* r = p + bhl * D;
    for (int64_t i = 0; i < half; ++i) {
      const double ang = static_cast<double>(static_cast<float>(offset + l) * inv.data<float>()[i]);
      const int64_t a = o.interleaved ? 2 * i : i, b = o.interleaved ? a + 1 : i + half;
      const double x1 = r[a], x2 = r[b];
      r[a] = x1 * std::cos(ang) - x2 * std::sin(ang);
      r[b] = x2 * std::cos(ang) + x1 * std::sin(ang);
    }
  }
  return x;
}

}  // namespace heads
