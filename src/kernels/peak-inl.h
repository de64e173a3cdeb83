// peak-inl.h — FMA throughput probe: kChains independent FMA chains per iteration, enough to
// cover the FMA latency on current cores. Returns a value derived from every chain so the loop
// cannot be optimised away. flops per iteration = kChains · W · 2.

namespace peak {
constexpr int kChains = 2 * Vec::kRowsQK;  // as many as the micro-kernels keep in registers
}

inline float fma_probe(int64_t iters) {
  Vec::R acc[peak::kChains];
  for (int c = 0; c < peak::kChains; ++c) acc[c] = Vec::set1(1.0f + 1e-3f * static_cast<float>(c));
  const Vec::R mul = Vec::set1(0.999999f), add = Vec::set1(1e-7f);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 32
    for (int c = 0; c < peak::kChains; ++c) acc[c] = Vec::fma(acc[c], mul, add);
  }
  Vec::R s = acc[0];
  for (int c = 1; c < peak::kChains; ++c) s = Vec::add(s, acc[c]);
  alignas(64) float out[Vec::W];
  Vec::store(out, s);
  return out[0];
}

inline int fma_probe_flops_per_iter() { return peak::kChains * Vec::W * 2; }

// Memory read probe: the sum of x[0, n) (n a multiple of 4·W, x 64-byte aligned), read with four
// independent accumulators so that the loads, not the adds, set the pace.
inline float read_probe(const float* x, int64_t n) {
  Vec::R a0 = Vec::zero(), a1 = Vec::zero(), a2 = Vec::zero(), a3 = Vec::zero();
  for (int64_t i = 0; i < n; i += 4 * Vec::W) {
    a0 = Vec::add(a0, Vec::load(x + i));
    a1 = Vec::add(a1, Vec::load(x + i + Vec::W));
    a2 = Vec::add(a2, Vec::load(x + i + 2 * Vec::W));
    a3 = Vec::add(a3, Vec::load(x + i + 3 * Vec::W));
  }
  return Vec::reduce_add(Vec::add(Vec::add(a0, a1), Vec::add(a2, a3)));
}
