// linear_attention_common.h — what the forward (linear_attention.cc) and the backward
// (linear_attention_backward.cc) of linear attention share: the feature map, argument checks, the
// causal-triangle products, the error carried out of a parallel region.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <vector>

#include "heads/error.h"
#include "heads/linear_attention.h"
#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/linear.h"
#include "kernels/ops_common.h"

namespace heads::linattn {


inline float phi(FeatureMap fm, float x) {
  switch (fm) {
    case FeatureMap::EluPlusOne: return x > 0.0f ? x + 1.0f : std::exp(x);
    case FeatureMap::Relu: return x <= 0.0f ? 0.0f : x;  // NaN stays NaN, as torch's relu
    case FeatureMap::Identity: return x;
  }
  return x;
}

// φ'(x) from φ(x) itself: elu + 1 has φ' = min(φ, 1); relu 1 where φ > 0; identity 1.
inline float dphi_of_phi(FeatureMap fm, float f) {
  switch (fm) {
    case FeatureMap::EluPlusOne: return f < 1.0f ? f : (f >= 1.0f ? 1.0f : f);  // NaN stays NaN
    case FeatureMap::Relu: return f > 0.0f ? 1.0f : (f <= 0.0f ? 0.0f : f);
    case FeatureMap::Identity: return 1.0f;
  }
  return 1.0f;
}


struct Dims {
  int64_t B, H, Lq, Lk, D, Dv;
};

inline Dims check(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const LinearAttentionOptions& o) {
  HEADS_CHECK(q.defined() && k.defined() && v.defined(), op, ": query, key and value are required");
  HEADS_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": expected 4-D [B, H, L, D] query, key and value, got ",
              q.shape(), ", ", k.shape(), ", ", v.shape());
  const Dims d{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  HEADS_CHECK(k.size(0) == d.B && k.size(1) == d.H && k.size(3) == d.D, op, ": key: expected [B, H, Lk, D] = [", d.B,
              ", ", d.H, ", Lk, ", d.D, "] to match query ", q.shape(), ", got ", k.shape());
  HEADS_CHECK(v.size(0) == d.B && v.size(1) == d.H && v.size(2) == d.Lk, op, ": value: expected [B, H, Lk, Dv] = [",
              d.B, ", ", d.H, ", ", d.Lk, ", Dv] to match key ", k.shape(), ", got ", v.shape());
  HEADS_CHECK(!o.causal || d.Lq == d.Lk, op, ": causal needs as many queries as keys, got Lq ", d.Lq, " and Lk ", d.Lk);
  HEADS_CHECK(o.eps >= 0.0 && std::isfinite(o.eps), op, ": eps must be finite and >= 0, got ", o.eps);
  const Tensor& m = o.key_padding_mask;
  HEADS_CHECK(!m.defined() || (m.dtype() == DType::Bool && m.shape() == Shape({d.B, d.Lk})), op,
              ": key_padding_mask: expected bool [B, Lk] = [", d.B, ", ", d.Lk, "] (true = ignore the key), got ",
              m.defined() ? std::string(dtype_name(m.dtype())) + " " + shape_str(m.shape()) : std::string());
  return d;
}

inline int threads_for_tasks(int64_t tasks, double work) {
  return work < 1e5 ? 1 : static_cast<int>(std::min<int64_t>(get_num_threads(), tasks));
}

// Rows [j0, j0 + n) (of `width` floats, from `rows`) of the keys km marks as ignored, set to zero.
inline void zero_ignored(const uint8_t* km, float* rows, int64_t j0, int64_t n, int64_t width) {
  for (int64_t r = 0; km != nullptr && r < n; ++r) {
    if (km[j0 + r]) std::fill(rows + r * width, rows + (r + 1) * width, 0.0f);
  }
}

// The values as contiguous f32 [B, H, Lk, Dv], padded keys' rows zero: a padded key's φ(k) is zero,
// and 0 · (inf or NaN) in its value would still reach the sums.
inline Tensor values_of(const Tensor& v_in, const char* op, const uint8_t* mask) {
  Tensor v = kernels::f32(v_in, op, "value");
  if (mask == nullptr) return v;
  if (v.raw_data() == v_in.raw_data()) v = v.clone();  // never write into the caller's tensor
  const int64_t B = v.size(0), H = v.size(1), Lk = v.size(2), Dv = v.size(3);
  for (int64_t bh = 0; bh < B * H; ++bh) zero_ignored(mask + bh / H * Lk, v.data<float>() + bh * Lk * Dv, 0, Lk, Dv);
  return v;
}

// out row = f·S / (f·z + eps) for one query feature row f.
inline void read_row(const float* f, const float* S, const float* z, int64_t D, int64_t Dv, float eps, float* num,
                     float* out) {
  std::fill(num, num + Dv, 0.0f);
  float den = eps;
  for (int64_t d = 0; d < D; ++d) {
    const float fd = f[d];
    den += fd * z[d];
    const float* Sd = S + d * Dv;
    for (int64_t c = 0; c < Dv; ++c) num[c] += fd * Sd[c];
  }
  const float inv = 1.0f / den;
  for (int64_t c = 0; c < Dv; ++c) out[c] = num[c] * inv;
}

// S += f ⊗ v, z += f.
inline void add_key(const float* f, const float* v, int64_t D, int64_t Dv, float* S, float* z) {
  for (int64_t d = 0; d < D; ++d) {
    const float fd = f[d];
    z[d] += fd;
    float* Sd = S + d * Dv;
    for (int64_t c = 0; c < Dv; ++c) Sd[c] += fd * v[c];
  }
}

// Products with a chunk's causal triangle, which never read a row past the diagonal (a NaN or inf
// there must not reach earlier rows through 0 · inf): tiles of kTile rows; below the diagonal tile
// a GEMM, the diagonal tile in loops. A [n, n] row stride n (only its lower triangle is read); B
// rows of w values, stride ldb; out rows of w, accumulated into; tmp [kTile · w].
constexpr int64_t kTile = 16;

// out_i += Σ_{j <= i} A_ij B_j
inline void add_lower_times(int64_t n, int64_t w, const float* A, const float* B, int64_t ldb, float* out, float* tmp) {
  for (int64_t r0 = 0; r0 < n; r0 += kTile) {
    const int64_t r1 = std::min(n, r0 + kTile);
    if (r0 > 0) {
      kernels::active().small_matmul_f32(r1 - r0, w, r0, A + r0 * n, n, 1, B, ldb, 1, tmp, w);
      for (int64_t e = 0; e < (r1 - r0) * w; ++e) out[r0 * w + e] += tmp[e];
    }
    for (int64_t i = r0; i < r1; ++i) {
      for (int64_t j = r0; j <= i; ++j) {
        const float a = A[i * n + j];
        for (int64_t c = 0; c < w; ++c) out[i * w + c] += a * B[j * ldb + c];
      }
    }
  }
}

// out_j += Σ_{i >= j} A_ij B_i
inline void add_lower_t_times(int64_t n, int64_t w, const float* A, const float* B, int64_t ldb, float* out, float* tmp) {
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int64_t j1 = std::min(n, j0 + kTile);
    if (j1 < n) {
      kernels::active().small_matmul_f32(j1 - j0, w, n - j1, A + j1 * n + j0, 1, n, B + j1 * ldb, ldb, 1, tmp, w);
      for (int64_t e = 0; e < (j1 - j0) * w; ++e) out[j0 * w + e] += tmp[e];
    }
    for (int64_t j = j0; j < j1; ++j) {
      for (int64_t i = j; i < j1; ++i) {
        const float a = A[i * n + j];
        for (int64_t c = 0; c < w; ++c) out[j * w + c] += a * B[i * ldb + c];
      }
    }
  }
}

// The first exception thrown by any thread of a parallel region, rethrown after it (an exception
// must not leave an OpenMP region; a thread that fails keeps taking part in the worksharing loop).
struct FirstError {
  std::exception_ptr e;
  void capture() {
#pragma omp critical(heads_linear_attention_error)
    if (!e) e = std::current_exception();
  }
  void rethrow() const {
    if (e) std::rethrow_exception(e);
  }
};

// Rows per chunk of the forward: its products are GEMMs (heads' matmul: oneDNN on the SIMD paths)
// of a chunk against the running state, plus the chunk's own causal [C, C] block.
constexpr int64_t kChunk = 128;

// φ of n rows of D features: x -> f (elu + 1 through the active ISA's vector exp).
inline void features(FeatureMap fm, const float* x, int64_t n, int64_t D, float* f) {
  if (fm == FeatureMap::EluPlusOne) {
    kernels::active().elu_plus_one_f32(x, f, 1, n * D, n * D, n * D);
  } else {
    for (int64_t e = 0; e < n * D; ++e) f[e] = phi(fm, x[e]);
  }
}

// φ(K) rows [j0, j0 + n) of one head's keys kh into fk; the keys km marks as ignored (nonzero; km
// may be null) become zero rows, which add nothing anywhere.
inline void key_features(FeatureMap fm, const uint8_t* km, const float* kh, int64_t j0, int64_t n, int64_t D,
                         float* fk) {
  features(fm, kh + j0 * D, n, D, fk);
  zero_ignored(km, fk, j0, n, D);
}

// A zeroed buffer of n floats (at least one, so that data() is never null).
inline void zeroed(std::vector<float>& x, int64_t n) { x.assign(static_cast<size_t>(std::max<int64_t>(n, 1)), 0.0f); }

}  // namespace heads::linattn
