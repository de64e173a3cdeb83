// linear_attention.cc — include/heads/linear_attention.h: the running state (S, z) per (b, h),
// rows in order (prefix sums when causal), plain loops the compiler vectorises along Dv; the
// backward recomputes the state and runs the causal sums in reverse.
#include "heads/linear_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <vector>

#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/linear.h"
#include "kernels/ops_common.h"

namespace heads {

using kernels::f32;

FeatureMap feature_map_from_name(const std::string& name) {
  if (name == "elu" || name == "elu+1") return FeatureMap::EluPlusOne;
  if (name == "relu") return FeatureMap::Relu;
  if (name == "identity") return FeatureMap::Identity;
  fail("feature_map must be \"elu\", \"relu\" or \"identity\", got \"", name, "\"");
}

namespace {

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

Dims check(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const LinearAttentionOptions& o) {
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

int threads_for_tasks(int64_t tasks, double work) {
  return work < 1e5 ? 1 : static_cast<int>(std::min<int64_t>(get_num_threads(), tasks));
}

// Rows [j0, j0 + n) (of `width` floats, from `rows`) of the keys km marks as ignored, set to zero.
void zero_ignored(const uint8_t* km, float* rows, int64_t j0, int64_t n, int64_t width) {
  for (int64_t r = 0; km != nullptr && r < n; ++r) {
    if (km[j0 + r]) std::fill(rows + r * width, rows + (r + 1) * width, 0.0f);
  }
}

// The values as contiguous f32 [B, H, Lk, Dv], padded keys' rows zero: a padded key's φ(k) is zero,
// and 0 · (inf or NaN) in its value would still reach the sums.
Tensor values_of(const Tensor& v_in, const char* op, const uint8_t* mask) {
  Tensor v = f32(v_in, op, "value");
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
void add_lower_times(int64_t n, int64_t w, const float* A, const float* B, int64_t ldb, float* out, float* tmp) {
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
void add_lower_t_times(int64_t n, int64_t w, const float* A, const float* B, int64_t ldb, float* out, float* tmp) {
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

}  // namespace

// Rows per chunk of the forward: its products are GEMMs (heads' matmul: oneDNN on the SIMD paths)
// of a chunk against the running state, plus the chunk's own causal [C, C] block.
constexpr int64_t kChunk = 128;

Tensor linear_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const LinearAttentionOptions& o) {
  const char* op = "linear_attention";
  const Dims d = check(op, q_in, k_in, v_in, o);
  const Tensor q = f32(q_in, op, "query"), k = f32(k_in, op, "key");
  const Tensor kpm = o.key_padding_mask.defined() ? o.key_padding_mask.contiguous() : Tensor();
  const auto* mask = kpm.defined() ? static_cast<const uint8_t*>(kpm.raw_data()) : nullptr;
  const Tensor v = values_of(v_in, op, mask);
  Tensor out = Tensor::empty({d.B, d.H, d.Lq, d.Dv}, DType::F32);
  const float eps = static_cast<float>(o.eps);
  const FeatureMap fm = o.feature_map;
  const int n_threads = threads_for_tasks(d.B * d.H, 2.0 * static_cast<double>(d.B * d.H) *
                                                         static_cast<double>(d.Lq + d.Lk) * d.D * d.Dv);
  const int64_t C = kChunk, D = d.D, Dv = d.Dv;
  FirstError error;
#pragma omp parallel num_threads(n_threads)
  {
    std::vector<float> S, z, fq, fk, num, tmp, t2, A, den;
    bool ready = false;
    try {
      const auto size = [](std::vector<float>& x, int64_t n) { x.assign(static_cast<size_t>(std::max<int64_t>(n, 1)), 0.0f); };
      size(S, D * Dv), size(z, D), size(fq, C * D), size(fk, C * D), size(num, C * Dv), size(tmp, std::max(C * Dv, D * Dv));
      size(t2, kTile * Dv), size(A, C * C), size(den, C);
      ready = true;
    } catch (...) {
      error.capture();
    }
    const auto features = [&](const float* x, int64_t n, float* f) {
      if (fm == FeatureMap::EluPlusOne) {
        kernels::active().elu_plus_one_f32(x, f, 1, n * D, n * D, n * D);  // the active ISA's vector exp
      } else {
        for (int64_t e = 0; e < n * D; ++e) f[e] = phi(fm, x[e]);
      }
    };
    const uint8_t* km = nullptr;  // the task's key_padding_mask row (nonzero = ignored key), or null
    // φ(K) rows [j0, j0 + n) into fk; ignored keys become zero rows, which add nothing anywhere.
    const auto key_features = [&](const float* kh, int64_t j0, int64_t n) {
      features(kh + j0 * D, n, fk.data());
      zero_ignored(km, fk.data(), j0, n, D);
    };
    // Keys [j0, j0 + n) into the state: S += φ(K)ᵀ V, z += Σ φ(K) rows.
    const auto absorb = [&](const float* kh, const float* vh, int64_t j0, int64_t n) {
      key_features(kh, j0, n);
      kernels::active().small_matmul_f32(D, Dv, n, fk.data(), 1, D, vh + j0 * Dv, Dv, 1, tmp.data(), Dv);
      for (int64_t e = 0; e < D * Dv; ++e) S[static_cast<size_t>(e)] += tmp[static_cast<size_t>(e)];
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t x = 0; x < D; ++x) z[static_cast<size_t>(x)] += fk[static_cast<size_t>(r * D + x)];
      }
    };
    // Queries [i0, i0 + n) against the state: num = φ(Q) S, den = φ(Q) z + eps.
    const auto read = [&](const float* qh, int64_t i0, int64_t n) {
      features(qh + i0 * D, n, fq.data());
      kernels::active().small_matmul_f32(n, Dv, D, fq.data(), D, 1, S.data(), Dv, 1, num.data(), Dv);
      for (int64_t r = 0; r < n; ++r) {
        float s = eps;
        for (int64_t x = 0; x < D; ++x) s += fq[static_cast<size_t>(r * D + x)] * z[static_cast<size_t>(x)];
        den[static_cast<size_t>(r)] = s;
      }
    };
    const auto write = [&](float* oh, int64_t i0, int64_t n) {
      for (int64_t r = 0; r < n; ++r) {
        const float inv = 1.0f / den[static_cast<size_t>(r)];
        for (int64_t c = 0; c < Dv; ++c) oh[(i0 + r) * Dv + c] = num[static_cast<size_t>(r * Dv + c)] * inv;
      }
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
      if (!ready) continue;
      km = mask != nullptr ? mask + bh / d.H * d.Lk : nullptr;
      try {
        const float* qh = q.data<float>() + bh * d.Lq * D;
        const float* kh = k.data<float>() + bh * d.Lk * D;
        const float* vh = v.data<float>() + bh * d.Lk * Dv;
        float* oh = out.data<float>() + bh * d.Lq * Dv;
        std::fill(S.begin(), S.end(), 0.0f);
        std::fill(z.begin(), z.end(), 0.0f);
        if (!o.causal) {
          for (int64_t j0 = 0; j0 < d.Lk; j0 += C) absorb(kh, vh, j0, std::min(C, d.Lk - j0));
          for (int64_t i0 = 0; i0 < d.Lq; i0 += C) {
            const int64_t n = std::min(C, d.Lq - i0);
            read(qh, i0, n);
            write(oh, i0, n);
          }
        } else {
          for (int64_t i0 = 0; i0 < d.Lq; i0 += C) {  // chunk: the state of the keys before it, then its own block
            const int64_t n = std::min(C, d.Lq - i0);
            read(qh, i0, n);
            key_features(kh, i0, n);
            kernels::active().small_matmul_f32(n, n, D, fq.data(), D, 1, fk.data(), 1, D, A.data(), n);  // φ(Q_c) φ(K_c)ᵀ
            for (int64_t r = 0; r < n; ++r) {
              float* ar = A.data() + r * n;
              std::fill(ar + r + 1, ar + n, 0.0f);  // keys after the row
              float s = 0.0f;
              for (int64_t c = 0; c <= r; ++c) s += ar[c];
              den[static_cast<size_t>(r)] += s;
            }
            add_lower_times(n, Dv, A.data(), vh + i0 * Dv, Dv, num.data(), t2.data());
            write(oh, i0, n);
            absorb(kh, vh, i0, n);
          }
        }
      } catch (...) {
        error.capture();
      }
    }
  }
  error.rethrow();
  return out;
}

LinearAttentionGrads linear_attention_backward(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in,
                                               const Tensor& v_in, const LinearAttentionOptions& o) {
  const char* op = "linear_attention_backward";
  const Dims d = check(op, q_in, k_in, v_in, o);
  HEADS_CHECK(dout_in.defined() && dout_in.shape() == Shape({d.B, d.H, d.Lq, d.Dv}), op, ": dout: expected ",
              Shape({d.B, d.H, d.Lq, d.Dv}), ", got ", dout_in.defined() ? dout_in.shape() : Shape{});
  const Tensor q = f32(q_in, op, "query"), k = f32(k_in, op, "key");
  const Tensor kpm = o.key_padding_mask.defined() ? o.key_padding_mask.contiguous() : Tensor();
  const auto* mask = kpm.defined() ? static_cast<const uint8_t*>(kpm.raw_data()) : nullptr;
  const Tensor v = values_of(v_in, op, mask);
  const Tensor g = f32(dout_in, op, "dout");
  LinearAttentionGrads r{Tensor::empty(q.shape(), DType::F32), Tensor::empty(k.shape(), DType::F32),
                         Tensor::empty(v.shape(), DType::F32)};
  const float eps = static_cast<float>(o.eps);
  const FeatureMap fm = o.feature_map;
  const int64_t C = kChunk, D = d.D, Dv = d.Dv;
  const int n_threads = threads_for_tasks(d.B * d.H, 6.0 * static_cast<double>(d.B * d.H) *
                                                         static_cast<double>(d.Lq + d.Lk) * D * Dv);
  const auto mm = kernels::active().small_matmul_f32;
  FirstError error;
#pragma omp parallel num_threads(n_threads)
  {
    std::vector<float> S, z, dS, dz, fq, fk, num, den, A, M, tmp, t2, dA, dn;
    bool ready = false;
    try {
      const auto size = [](std::vector<float>& x, int64_t n) { x.assign(static_cast<size_t>(std::max<int64_t>(n, 1)), 0.0f); };
      size(S, D * Dv), size(z, D), size(dS, D * Dv), size(dz, D), size(fq, C * D), size(fk, C * D), size(num, C * Dv);
      size(den, C), size(A, C * C), size(M, C * C), size(tmp, std::max({C * D, C * Dv, D * Dv}));
      size(t2, std::max(C * D, C * Dv)), size(dA, (o.causal ? d.Lq : C) * Dv), size(dn, o.causal ? d.Lq : C);
      ready = true;
    } catch (...) {
      error.capture();
    }
    const auto features = [&](const float* x, int64_t n, float* f) {
      if (fm == FeatureMap::EluPlusOne) {
        kernels::active().elu_plus_one_f32(x, f, 1, n * D, n * D, n * D);
      } else {
        for (int64_t e = 0; e < n * D; ++e) f[e] = phi(fm, x[e]);
      }
    };
    const uint8_t* km = nullptr;  // the task's key_padding_mask row (nonzero = ignored key), or null
    // φ(K) rows [j0, j0 + n) into fk; ignored keys become zero rows, which add nothing anywhere.
    const auto key_features = [&](const float* kh, int64_t j0, int64_t n) {
      features(kh + j0 * D, n, fk.data());
      zero_ignored(km, fk.data(), j0, n, D);
    };
    const auto zero_masked = [&](float* rows, int64_t j0, int64_t n, int64_t width) { zero_ignored(km, rows, j0, n, width); };
    const auto add_to = [](float* y, const float* x, int64_t n) {
      for (int64_t e = 0; e < n; ++e) y[e] += x[e];
    };
    // S += φ(K_c)ᵀ V_c, z += Σ φ(K_c) rows (fk holds φ(K_c)).
    const auto absorb = [&](const float* vc, int64_t n) {
      mm(D, Dv, n, fk.data(), 1, D, vc, Dv, 1, tmp.data(), Dv);
      add_to(S.data(), tmp.data(), D * Dv);
      for (int64_t rr = 0; rr < n; ++rr) add_to(z.data(), fk.data() + rr * D, D);
    };
    // dS += φ(Q_c)ᵀ dA_c, dz += Σ φ(Q_c) dn (fq holds φ(Q_c)).
    const auto absorb_grad = [&](const float* dAc, const float* dnc, int64_t n) {
      mm(D, Dv, n, fq.data(), 1, D, dAc, Dv, 1, tmp.data(), Dv);
      add_to(dS.data(), tmp.data(), D * Dv);
      for (int64_t rr = 0; rr < n; ++rr) {
        for (int64_t x = 0; x < D; ++x) dz[static_cast<size_t>(x)] += fq[static_cast<size_t>(rr * D + x)] * dnc[rr];
      }
    };
    // From num, den of rows [i0, i0 + n): dA = dO / den, dn = -(dO · out) / den.
    const auto row_grads = [&](const float* gh, int64_t i0, int64_t n, float* dAc, float* dnc) {
      for (int64_t rr = 0; rr < n; ++rr) {
        const float inv = 1.0f / den[static_cast<size_t>(rr)];
        float go = 0.0f;
        for (int64_t c = 0; c < Dv; ++c) {
          const float gc = gh[(i0 + rr) * Dv + c];
          dAc[rr * Dv + c] = gc * inv;
          go += gc * num[static_cast<size_t>(rr * Dv + c)] * inv;
        }
        dnc[rr] = -go * inv;
      }
    };
    // dx = (dφ + bias) ∘ φ'(x) for rows of D, dφ in tmp, φ(x) in f.
    const auto through_phi = [&](const float* f, int64_t n, const float* bias_rows, const float* bias_vec, float* dx) {
      for (int64_t rr = 0; rr < n; ++rr) {
        for (int64_t e = 0; e < D; ++e) {
          float t = tmp[static_cast<size_t>(rr * D + e)];
          if (bias_rows != nullptr) t += bias_rows[rr] * bias_vec[e];
          else if (bias_vec != nullptr) t += bias_vec[e];
          dx[rr * D + e] = t * dphi_of_phi(fm, f[rr * D + e]);
        }
      }
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
      if (!ready) continue;
      km = mask != nullptr ? mask + bh / d.H * d.Lk : nullptr;
      try {
        const float* qh = q.data<float>() + bh * d.Lq * D;
        const float* kh = k.data<float>() + bh * d.Lk * D;
        const float* vh = v.data<float>() + bh * d.Lk * Dv;
        const float* gh = g.data<float>() + bh * d.Lq * Dv;
        float* dqh = r.dq.data<float>() + bh * d.Lq * D;
        float* dkh = r.dk.data<float>() + bh * d.Lk * D;
        float* dvh = r.dv.data<float>() + bh * d.Lk * Dv;
        for (auto* x : {&S, &z, &dS, &dz}) std::fill(x->begin(), x->end(), 0.0f);
        if (!o.causal) {
          for (int64_t j0 = 0; j0 < d.Lk; j0 += C) {
            const int64_t n = std::min(C, d.Lk - j0);
            key_features(kh, j0, n);
            absorb(vh + j0 * Dv, n);
          }
          for (int64_t i0 = 0; i0 < d.Lq; i0 += C) {
            const int64_t n = std::min(C, d.Lq - i0);
            features(qh + i0 * D, n, fq.data());
            mm(n, Dv, D, fq.data(), D, 1, S.data(), Dv, 1, num.data(), Dv);
            for (int64_t rr = 0; rr < n; ++rr) {
              float sden = eps;
              for (int64_t x = 0; x < D; ++x) sden += fq[static_cast<size_t>(rr * D + x)] * z[static_cast<size_t>(x)];
              den[static_cast<size_t>(rr)] = sden;
            }
            row_grads(gh, i0, n, dA.data(), dn.data());
            mm(n, D, Dv, dA.data(), Dv, 1, S.data(), 1, Dv, tmp.data(), D);  // dA Sᵀ
            through_phi(fq.data(), n, dn.data(), z.data(), dqh + i0 * D);
            absorb_grad(dA.data(), dn.data(), n);
          }
          for (int64_t j0 = 0; j0 < d.Lk; j0 += C) {
            const int64_t n = std::min(C, d.Lk - j0);
            key_features(kh, j0, n);
            mm(n, D, Dv, vh + j0 * Dv, Dv, 1, dS.data(), 1, Dv, tmp.data(), D);  // V dSᵀ
            through_phi(fk.data(), n, nullptr, dz.data(), dkh + j0 * D);
            zero_masked(dkh + j0 * D, j0, n, D);
            mm(n, Dv, D, fk.data(), D, 1, dS.data(), Dv, 1, dvh + j0 * Dv, Dv);  // φ(K) dS
            zero_masked(dvh + j0 * Dv, j0, n, Dv);
          }
        } else {
          // Causal, forward in chunks: out's pieces, dA and dn of every row, and dq from the state of the
          // keys before the chunk plus the chunk's own lower triangle.
          for (int64_t i0 = 0; i0 < d.Lq; i0 += C) {
            const int64_t n = std::min(C, d.Lq - i0);
            const float* vc = vh + i0 * Dv;
            features(qh + i0 * D, n, fq.data());
            key_features(kh, i0, n);
            mm(n, Dv, D, fq.data(), D, 1, S.data(), Dv, 1, num.data(), Dv);
            mm(n, n, D, fq.data(), D, 1, fk.data(), 1, D, A.data(), n);
            for (int64_t rr = 0; rr < n; ++rr) {
              float* ar = A.data() + rr * n;
              std::fill(ar + rr + 1, ar + n, 0.0f);
              float sden = eps;
              for (int64_t x = 0; x < D; ++x) sden += fq[static_cast<size_t>(rr * D + x)] * z[static_cast<size_t>(x)];
              for (int64_t c = 0; c <= rr; ++c) sden += ar[c];
              den[static_cast<size_t>(rr)] = sden;
            }
            add_lower_times(n, Dv, A.data(), vc, Dv, num.data(), t2.data());
            float* dAc = dA.data() + i0 * Dv;
            float* dnc = dn.data() + i0;
            row_grads(gh, i0, n, dAc, dnc);
            // M = dA V_cᵀ + dn (keys j <= i), dφQ = dA Sᵀ + dn zᵀ + M φ(K_c)
            mm(n, n, Dv, dAc, Dv, 1, vc, 1, Dv, M.data(), n);
            for (int64_t rr = 0; rr < n; ++rr) {
              float* mr = M.data() + rr * n;
              for (int64_t c = 0; c <= rr; ++c) mr[c] += dnc[rr];
              std::fill(mr + rr + 1, mr + n, 0.0f);
            }
            mm(n, D, Dv, dAc, Dv, 1, S.data(), 1, Dv, tmp.data(), D);
            for (int64_t rr = 0; rr < n; ++rr) {
              for (int64_t x = 0; x < D; ++x) tmp[static_cast<size_t>(rr * D + x)] += dnc[rr] * z[static_cast<size_t>(x)];
            }
            add_lower_times(n, D, M.data(), fk.data(), D, tmp.data(), t2.data());
            through_phi(fq.data(), n, nullptr, nullptr, dqh + i0 * D);
            absorb(vc, n);
          }
          // Causal, keys in reverse chunks: the suffix sums dS, dz of the queries after the chunk plus
          // the chunk's own upper triangle (queries i >= j).
          const int64_t last = (d.Lq - 1) / C * C;
          for (int64_t i0 = last; i0 >= 0; i0 -= C) {
            const int64_t n = std::min(C, d.Lq - i0);
            const float* vc = vh + i0 * Dv;
            const float* dAc = dA.data() + i0 * Dv;
            const float* dnc = dn.data() + i0;
            features(qh + i0 * D, n, fq.data());
            key_features(kh, i0, n);
            // M[i][j] = dA_i · v_j + dn_i for i >= j
            mm(n, n, Dv, dAc, Dv, 1, vc, 1, Dv, M.data(), n);
            mm(n, n, D, fq.data(), D, 1, fk.data(), 1, D, A.data(), n);
            for (int64_t rr = 0; rr < n; ++rr) {
              float* mr = M.data() + rr * n;
              float* ar = A.data() + rr * n;
              for (int64_t c = 0; c <= rr; ++c) mr[c] += dnc[rr];
              std::fill(mr + rr + 1, mr + n, 0.0f);
              std::fill(ar + rr + 1, ar + n, 0.0f);
            }
            // dφK = V dSᵀ + dz + Mᵀ φ(Q_c)
            mm(n, D, Dv, vc, Dv, 1, dS.data(), 1, Dv, tmp.data(), D);
            add_lower_t_times(n, D, M.data(), fq.data(), D, tmp.data(), t2.data());
            through_phi(fk.data(), n, nullptr, dz.data(), dkh + i0 * D);
            zero_masked(dkh + i0 * D, i0, n, D);
            // dV = φ(K_c) dS + Aᵀ dA_c
            mm(n, Dv, D, fk.data(), D, 1, dS.data(), Dv, 1, dvh + i0 * Dv, Dv);
            add_lower_t_times(n, Dv, A.data(), dAc, Dv, dvh + i0 * Dv, t2.data());
            zero_masked(dvh + i0 * Dv, i0, n, Dv);
            absorb_grad(dAc, dnc, n);
          }
        }
      } catch (...) {
        error.capture();
      }
    }
  }
  error.rethrow();
  return r;
}

LinearAttentionState::LinearAttentionState(int64_t batch, int64_t heads, int64_t head_dim, int64_t value_dim,
                                           FeatureMap fm, double eps)
    : B_(batch), H_(heads), D_(head_dim), Dv_(value_dim), fm_(fm), eps_(eps) {
  HEADS_CHECK(batch >= 1 && heads >= 1 && head_dim >= 1 && value_dim >= 1, "LinearAttentionState: batch ", batch,
              ", heads ", heads, ", head_dim ", head_dim, ", value_dim ", value_dim, " must be positive");
  HEADS_CHECK(eps >= 0.0 && std::isfinite(eps), "LinearAttentionState: eps must be finite and >= 0, got ", eps);
  S_ = Tensor::zeros({B_, H_, D_, Dv_}, DType::F32);
  z_ = Tensor::zeros({B_, H_, D_}, DType::F32);
}

Tensor LinearAttentionState::step(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in) {
  const char* op = "LinearAttentionState::step";
  HEADS_CHECK(q_in.defined() && q_in.shape() == Shape({B_, H_, D_}), op, ": query: expected [B, H, D] = ",
              Shape({B_, H_, D_}), ", got ", q_in.defined() ? q_in.shape() : Shape{});
  HEADS_CHECK(k_in.defined() && k_in.shape() == Shape({B_, H_, D_}), op, ": key: expected [B, H, D] = ",
              Shape({B_, H_, D_}), ", got ", k_in.defined() ? k_in.shape() : Shape{});
  HEADS_CHECK(v_in.defined() && v_in.shape() == Shape({B_, H_, Dv_}), op, ": value: expected [B, H, Dv] = ",
              Shape({B_, H_, Dv_}), ", got ", v_in.defined() ? v_in.shape() : Shape{});
  const Tensor q = f32(q_in, op, "query"), k = f32(k_in, op, "key"), v = f32(v_in, op, "value");
  Tensor out = Tensor::empty({B_, H_, Dv_}, DType::F32);
  std::vector<float> f(static_cast<size_t>(D_)), num(static_cast<size_t>(Dv_));
  for (int64_t bh = 0; bh < B_ * H_; ++bh) {
    float* S = S_.data<float>() + bh * D_ * Dv_;
    float* z = z_.data<float>() + bh * D_;
    for (int64_t x = 0; x < D_; ++x) f[static_cast<size_t>(x)] = phi(fm_, k.data<float>()[bh * D_ + x]);
    add_key(f.data(), v.data<float>() + bh * Dv_, D_, Dv_, S, z);
    for (int64_t x = 0; x < D_; ++x) f[static_cast<size_t>(x)] = phi(fm_, q.data<float>()[bh * D_ + x]);
    read_row(f.data(), S, z, D_, Dv_, static_cast<float>(eps_), num.data(), out.data<float>() + bh * Dv_);
  }
  ++length_;
  return out;
}

Tensor linear_attention_weights(const Tensor& q_in, const Tensor& k_in, const LinearAttentionOptions& o) {
  const char* op = "linear_attention_weights";
  const Dims d = check(op, q_in, k_in, k_in, o);
  const Tensor q = f32(q_in, op, "query"), k = f32(k_in, op, "key");
  const Tensor kpm = o.key_padding_mask.defined() ? o.key_padding_mask.contiguous() : Tensor();
  const auto* mask = kpm.defined() ? static_cast<const uint8_t*>(kpm.raw_data()) : nullptr;
  Tensor w = Tensor::zeros({d.B, d.H, d.Lq, d.Lk}, DType::F32);
  const int n_threads = threads_for_tasks(d.B * d.H, static_cast<double>(d.B * d.H) * d.Lq * d.Lk * d.D);
  FirstError error;
#pragma omp parallel for num_threads(n_threads) schedule(static)
  for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
    const int64_t b = bh / d.H, h = bh % d.H;
    std::vector<float> fq, fk;
    try {
      fq.resize(static_cast<size_t>(d.D));
      fk.resize(static_cast<size_t>(d.Lk * d.D));
    } catch (...) {
      error.capture();
      continue;
    }
    for (int64_t j = 0; j < d.Lk; ++j) {
      const float* kr = k.data<float>() + b * k.stride(0) + h * k.stride(1) + j * k.stride(2);
      const bool ignored = mask != nullptr && mask[b * d.Lk + j];
      for (int64_t x = 0; x < d.D; ++x) fk[static_cast<size_t>(j * d.D + x)] = ignored ? 0.0f : phi(o.feature_map, kr[x]);
    }
    for (int64_t i = 0; i < d.Lq; ++i) {
      const float* qr = q.data<float>() + b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
      for (int64_t x = 0; x < d.D; ++x) fq[static_cast<size_t>(x)] = phi(o.feature_map, qr[x]);
      float* row = w.data<float>() + (bh * d.Lq + i) * d.Lk;
      const int64_t n = o.causal ? std::min(i + 1, d.Lk) : d.Lk;
      double den = o.eps;
      for (int64_t j = 0; j < n; ++j) {
        double a = 0.0;
        for (int64_t x = 0; x < d.D; ++x) a += static_cast<double>(fq[static_cast<size_t>(x)]) * fk[static_cast<size_t>(j * d.D + x)];
        row[j] = static_cast<float>(a);
        den += a;
      }
      for (int64_t j = 0; j < n; ++j) row[j] = static_cast<float>(row[j] / den);
    }
  }
  error.rethrow();
  return w;
}

Tensor ref::linear_attention_f64(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                 const LinearAttentionOptions& o) {
  const Dims d = check("ref::linear_attention_f64", q_in, k_in, v_in, o);
  const Tensor q = q_in.to(DType::F64), k = k_in.to(DType::F64), v = v_in.to(DType::F64);
  Tensor out = Tensor::zeros({d.B, d.H, d.Lq, d.Dv}, DType::F64);
  const auto ph = [&](double x) {
    switch (o.feature_map) {
      case FeatureMap::EluPlusOne: return x > 0 ? x + 1 : std::exp(x);
      case FeatureMap::Relu: return x <= 0 ? 0.0 : x;
      case FeatureMap::Identity: return x;
    }
    return x;
  };
  for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
    for (int64_t i = 0; i < d.Lq; ++i) {
      double den = o.eps;
      std::vector<double> num(static_cast<size_t>(d.Dv), 0.0);
      for (int64_t j = 0; j < (o.causal ? i + 1 : d.Lk); ++j) {
        if (o.key_padding_mask.defined() && o.key_padding_mask.item_as_double({bh / d.H, j}) != 0) continue;
        double a = 0;  // A_ij = φ(q_i) · φ(k_j)
        for (int64_t x = 0; x < d.D; ++x) {
          a += ph(q.data<double>()[(bh * d.Lq + i) * d.D + x]) * ph(k.data<double>()[(bh * d.Lk + j) * d.D + x]);
        }
        den += a;
        for (int64_t c = 0; c < d.Dv; ++c) num[static_cast<size_t>(c)] += a * v.data<double>()[(bh * d.Lk + j) * d.Dv + c];
      }
      for (int64_t c = 0; c < d.Dv; ++c) out.data<double>()[(bh * d.Lq + i) * d.Dv + c] = num[static_cast<size_t>(c)] / den;
    }
  }
  return out;
}

}  // namespace heads
