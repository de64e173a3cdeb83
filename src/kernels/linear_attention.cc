// linear_attention.cc — include/heads/linear_attention.h: the running state (S, z) per (b, h),
// rows in order (prefix sums when causal), plain loops the compiler vectorises along Dv; the
// backward recomputes the state and runs the causal sums in reverse.
#include "heads/linear_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
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
    case FeatureMap::Relu: return x > 0.0f ? x : 0.0f;
    case FeatureMap::Identity: return x;
  }
  return x;
}

inline float dphi(FeatureMap fm, float x) {
  switch (fm) {
    case FeatureMap::EluPlusOne: return x > 0.0f ? 1.0f : std::exp(x);
    case FeatureMap::Relu: return x > 0.0f ? 1.0f : 0.0f;
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
  return d;
}

int threads_for_tasks(int64_t tasks, double work) {
  return work < 1e5 ? 1 : static_cast<int>(std::min<int64_t>(get_num_threads(), tasks));
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

}  // namespace

// Rows per chunk of the forward: its products are GEMMs (heads' matmul: oneDNN on the SIMD paths)
// of a chunk against the running state, plus the chunk's own causal [C, C] block.
constexpr int64_t kChunk = 128;

Tensor linear_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const LinearAttentionOptions& o) {
  const char* op = "linear_attention";
  const Dims d = check(op, q_in, k_in, v_in, o);
  const Tensor q = f32(q_in, op, "query"), k = f32(k_in, op, "key"), v = f32(v_in, op, "value");
  Tensor out = Tensor::empty({d.B, d.H, d.Lq, d.Dv}, DType::F32);
  const float eps = static_cast<float>(o.eps);
  const FeatureMap fm = o.feature_map;
  const int n_threads = threads_for_tasks(d.B * d.H, 2.0 * static_cast<double>(d.B * d.H) *
                                                         static_cast<double>(d.Lq + d.Lk) * d.D * d.Dv);
  const int64_t C = kChunk, D = d.D, Dv = d.Dv;
#pragma omp parallel num_threads(n_threads)
  {
    std::vector<float> S(static_cast<size_t>(D * Dv)), z(static_cast<size_t>(D)), fq(static_cast<size_t>(C * D)),
        fk(static_cast<size_t>(C * D)), num(static_cast<size_t>(C * Dv)), tmp(static_cast<size_t>(std::max(C * Dv, D * Dv))),
        A(static_cast<size_t>(C * C)), den(static_cast<size_t>(C));
    const auto features = [&](const float* x, int64_t n, float* f) {
      if (fm == FeatureMap::EluPlusOne) {
        kernels::active().elu_plus_one_f32(x, f, 1, n * D, n * D, n * D);  // the active ISA's vector exp
      } else {
        for (int64_t e = 0; e < n * D; ++e) f[e] = phi(fm, x[e]);
      }
    };
    // Keys [j0, j0 + n) into the state: S += φ(K)ᵀ V, z += Σ φ(K) rows.
    const auto absorb = [&](const float* kh, const float* vh, int64_t j0, int64_t n) {
      features(kh + j0 * D, n, fk.data());
      kernels::matmul_f32(D, Dv, n, fk.data(), 1, D, vh + j0 * Dv, Dv, 1, tmp.data(), Dv);
      for (int64_t e = 0; e < D * Dv; ++e) S[static_cast<size_t>(e)] += tmp[static_cast<size_t>(e)];
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t x = 0; x < D; ++x) z[static_cast<size_t>(x)] += fk[static_cast<size_t>(r * D + x)];
      }
    };
    // Queries [i0, i0 + n) against the state: num = φ(Q) S, den = φ(Q) z + eps.
    const auto read = [&](const float* qh, int64_t i0, int64_t n) {
      features(qh + i0 * D, n, fq.data());
      kernels::matmul_f32(n, Dv, D, fq.data(), D, 1, S.data(), Dv, 1, num.data(), Dv);
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
        continue;
      }
      for (int64_t i0 = 0; i0 < d.Lq; i0 += C) {  // chunk: the state of the keys before it, then its own block
        const int64_t n = std::min(C, d.Lq - i0);
        read(qh, i0, n);
        features(kh + i0 * D, n, fk.data());
        kernels::matmul_f32(n, n, D, fq.data(), D, 1, fk.data(), 1, D, A.data(), n);  // φ(Q_c) φ(K_c)ᵀ
        for (int64_t r = 0; r < n; ++r) {
          float* ar = A.data() + r * n;
          std::fill(ar + r + 1, ar + n, 0.0f);  // keys after the row
          float s = 0.0f;
          for (int64_t c = 0; c <= r; ++c) s += ar[c];
          den[static_cast<size_t>(r)] += s;
        }
        kernels::matmul_f32(n, Dv, n, A.data(), n, 1, vh + i0 * Dv, Dv, 1, tmp.data(), Dv);
        for (int64_t e = 0; e < n * Dv; ++e) num[static_cast<size_t>(e)] += tmp[static_cast<size_t>(e)];
        write(oh, i0, n);
        absorb(kh, vh, i0, n);
      }
    }
  }
  return out;
}

LinearAttentionGrads linear_attention_backward(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in,
                                               const Tensor& v_in, const LinearAttentionOptions& o) {
  const char* op = "linear_attention_backward";
  const Dims d = check(op, q_in, k_in, v_in, o);
  HEADS_CHECK(dout_in.defined() && dout_in.shape() == Shape({d.B, d.H, d.Lq, d.Dv}), op, ": dout: expected ",
              Shape({d.B, d.H, d.Lq, d.Dv}), ", got ", dout_in.defined() ? dout_in.shape() : Shape{});
  const Tensor q = f32(q_in, op, "query"), k = f32(k_in, op, "key"), v = f32(v_in, op, "value");
  const Tensor g = f32(dout_in, op, "dout");
  LinearAttentionGrads r{Tensor::empty(q.shape(), DType::F32), Tensor::empty(k.shape(), DType::F32),
                         Tensor::empty(v.shape(), DType::F32)};
  const float eps = static_cast<float>(o.eps);
  const FeatureMap fm = o.feature_map;
  const int n_threads = threads_for_tasks(d.B * d.H, 6.0 * static_cast<double>(d.B * d.H) *
                                                         static_cast<double>(d.Lq + d.Lk) * d.D * d.Dv);
#pragma omp parallel num_threads(n_threads)
  {
    const size_t DD = static_cast<size_t>(d.D * d.Dv);
    std::vector<float> S(DD), z(static_cast<size_t>(d.D)), dS(DD), dz(static_cast<size_t>(d.D)),
        f(static_cast<size_t>(d.D)), num(static_cast<size_t>(d.Dv)), out(static_cast<size_t>(d.Dv)),
        dA(static_cast<size_t>(d.Lq * d.Dv)), dn(static_cast<size_t>(d.Lq));
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
      const float* qh = q.data<float>() + bh * d.Lq * d.D;
      const float* kh = k.data<float>() + bh * d.Lk * d.D;
      const float* vh = v.data<float>() + bh * d.Lk * d.Dv;
      const float* gh = g.data<float>() + bh * d.Lq * d.Dv;
      float* dqh = r.dq.data<float>() + bh * d.Lq * d.D;
      float* dkh = r.dk.data<float>() + bh * d.Lk * d.D;
      float* dvh = r.dv.data<float>() + bh * d.Lk * d.Dv;
      std::fill(S.begin(), S.end(), 0.0f);
      std::fill(z.begin(), z.end(), 0.0f);
      const auto key = [&](int64_t j) {
        for (int64_t x = 0; x < d.D; ++x) f[static_cast<size_t>(x)] = phi(fm, kh[j * d.D + x]);
        add_key(f.data(), vh + j * d.Dv, d.D, d.Dv, S.data(), z.data());
      };
      // Query row i against the current (S, z): dA_i = dO_i / n, dn_i = -(dO_i · out_i) / n, and
      // dq_i = (S dA_i + z dn_i) ∘ φ'(q_i).
      const auto query = [&](int64_t i) {
        for (int64_t x = 0; x < d.D; ++x) f[static_cast<size_t>(x)] = phi(fm, qh[i * d.D + x]);
        read_row(f.data(), S.data(), z.data(), d.D, d.Dv, eps, num.data(), out.data());
        float den = eps;
        for (int64_t x = 0; x < d.D; ++x) den += f[static_cast<size_t>(x)] * z[static_cast<size_t>(x)];
        const float inv = 1.0f / den;
        float go = 0.0f;
        float* dAi = dA.data() + i * d.Dv;
        for (int64_t c = 0; c < d.Dv; ++c) {
          dAi[c] = gh[i * d.Dv + c] * inv;
          go += gh[i * d.Dv + c] * out[static_cast<size_t>(c)];
        }
        dn[static_cast<size_t>(i)] = -go * inv;
        for (int64_t x = 0; x < d.D; ++x) {
          const float* Sx = S.data() + x * d.Dv;
          float acc = z[static_cast<size_t>(x)] * dn[static_cast<size_t>(i)];
          for (int64_t c = 0; c < d.Dv; ++c) acc += Sx[c] * dAi[c];
          dqh[i * d.D + x] = acc * dphi(fm, qh[i * d.D + x]);
        }
      };
      // Query row i's share of dS and dz: dS += φ(q_i) ⊗ dA_i, dz += φ(q_i) dn_i.
      const auto add_query_grad = [&](int64_t i) {
        const float* dAi = dA.data() + i * d.Dv;
        for (int64_t x = 0; x < d.D; ++x) {
          const float fx = phi(fm, qh[i * d.D + x]);
          dz[static_cast<size_t>(x)] += fx * dn[static_cast<size_t>(i)];
          float* dSx = dS.data() + x * d.Dv;
          for (int64_t c = 0; c < d.Dv; ++c) dSx[c] += fx * dAi[c];
        }
      };
      // Key j from dS, dz: dk_j = (dS v_j + dz) ∘ φ'(k_j), dv_j = dSᵀ φ(k_j).
      const auto key_grad = [&](int64_t j) {
        std::fill(dvh + j * d.Dv, dvh + (j + 1) * d.Dv, 0.0f);
        for (int64_t x = 0; x < d.D; ++x) {
          const float* dSx = dS.data() + x * d.Dv;
          const float fx = phi(fm, kh[j * d.D + x]);
          float acc = dz[static_cast<size_t>(x)];
          for (int64_t c = 0; c < d.Dv; ++c) {
            acc += dSx[c] * vh[j * d.Dv + c];
            dvh[j * d.Dv + c] += dSx[c] * fx;
          }
          dkh[j * d.D + x] = acc * dphi(fm, kh[j * d.D + x]);
        }
      };
      std::fill(dS.begin(), dS.end(), 0.0f);
      std::fill(dz.begin(), dz.end(), 0.0f);
      if (o.causal) {
        for (int64_t i = 0; i < d.Lq; ++i) {
          key(i);
          query(i);
        }
        for (int64_t i = d.Lq - 1; i >= 0; --i) {  // suffix sums: key i gets the queries i' >= i
          add_query_grad(i);
          key_grad(i);
        }
      } else {
        for (int64_t j = 0; j < d.Lk; ++j) key(j);
        for (int64_t i = 0; i < d.Lq; ++i) {
          query(i);
          add_query_grad(i);
        }
        for (int64_t j = 0; j < d.Lk; ++j) key_grad(j);
      }
    }
  }
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

Tensor ref::linear_attention_f64(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                 const LinearAttentionOptions& o) {
  const Dims d = check("ref::linear_attention_f64", q_in, k_in, v_in, o);
  const Tensor q = q_in.to(DType::F64), k = k_in.to(DType::F64), v = v_in.to(DType::F64);
  Tensor out = Tensor::zeros({d.B, d.H, d.Lq, d.Dv}, DType::F64);
  const auto ph = [&](double x) {
    switch (o.feature_map) {
      case FeatureMap::EluPlusOne: return x > 0 ? x + 1 : std::exp(x);
      case FeatureMap::Relu: return x > 0 ? x : 0.0;
      case FeatureMap::Identity: return x;
    }
    return x;
  };
  for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
    for (int64_t i = 0; i < d.Lq; ++i) {
      double den = o.eps;
      std::vector<double> num(static_cast<size_t>(d.Dv), 0.0);
      for (int64_t j = 0; j < (o.causal ? i + 1 : d.Lk); ++j) {
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
