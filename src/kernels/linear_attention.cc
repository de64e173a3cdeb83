// linear_attention.cc — include/heads/linear_attention.h: the running state (S, z) per (b, h),
// rows in order (prefix sums when causal), plain loops the compiler vectorises along Dv; the
// recurrent state for decoding, the weights on demand and the float64 reference. The backward is
// linear_attention_backward.cc; what both share, linear_attention_common.h.
#include "heads/linear_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <vector>

#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/linear.h"
#include "kernels/linear_attention_common.h"
#include "kernels/ops_common.h"

namespace heads {

using kernels::f32;
using namespace linattn;

FeatureMap feature_map_from_name(const std::string& name) {
  if (name == "elu" || name == "elu+1") return FeatureMap::EluPlusOne;
  if (name == "relu") return FeatureMap::Relu;
  if (name == "identity") return FeatureMap::Identity;
  fail("feature_map must be \"elu\", \"relu\" or \"identity\", got \"", name, "\"");
}

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
      zeroed(S, D * Dv), zeroed(z, D), zeroed(fq, C * D), zeroed(fk, C * D), zeroed(num, C * Dv), zeroed(tmp, std::max(C * Dv, D * Dv));
      zeroed(t2, kTile * Dv), zeroed(A, C * C), zeroed(den, C);
      ready = true;
    } catch (...) {
      error.capture();
    }
    const auto features = [&](const float* x, int64_t n, float* f) { linattn::features(fm, x, n, D, f); };
    const uint8_t* km = nullptr;  // the task's key_padding_mask row (nonzero = ignored key), or null
    const auto key_features = [&](const float* kh, int64_t j0, int64_t n) {  // into fk
      linattn::key_features(fm, km, kh, j0, n, D, fk.data());
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
