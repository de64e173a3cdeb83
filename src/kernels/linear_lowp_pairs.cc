// linear_lowp_pairs.cc — the weight layout of heads' own int8 GEMM (kernels/gemm_i8-inl.h,
// kernels/linear_lowp.h): panels of 16 columns as [ceil(K / 2)][16][2] int16, packed once per weight
// at first use (PairsB), the residual rows folded in as the 16-bit rows C = 2^p·Wq + Wr.
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

#include "kernels/dispatch.h"
#include "kernels/linear_lowp.h"

namespace heads {

int64_t lowp::pairs_size(int64_t N, int64_t K) {
  return (N + kernels::kPairPanel - 1) / kernels::kPairPanel * ((K + 1) / 2) * 2 * kernels::kPairPanel;
}

namespace {

template <class T>
void pack_pairs_of(const T* B, int64_t N, int64_t K, int16_t* dst) {
  constexpr int64_t P = kernels::kPairPanel;
  const int64_t Kp = (K + 1) / 2, panels = (N + P - 1) / P;
  for (int64_t p = 0; p < panels; ++p) {
    int16_t* panel = dst + p * Kp * 2 * P;
    for (int64_t i = 0; i < Kp; ++i) {
      for (int64_t j = 0; j < P; ++j) {
        const int64_t n = p * P + j;
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t k = 2 * i + h;
          panel[(i * P + j) * 2 + h] = n < N && k < K ? static_cast<int16_t>(B[n * K + k]) : int16_t{0};
        }
      }
    }
  }
}

}  // namespace

void lowp::pack_pairs(const int8_t* B, int64_t N, int64_t K, int16_t* dst) { pack_pairs_of(B, N, K, dst); }
void lowp::pack_pairs(const int16_t* B, int64_t N, int64_t K, int16_t* dst) { pack_pairs_of(B, N, K, dst); }

void lowp::PairsB::Free::operator()(int16_t* p) const { std::free(p); }

const int16_t* lowp::PairsB::get(const int8_t* W, int64_t N, int64_t K, const int8_t* Wr, const int32_t* rows,
                                 const int32_t* shift, int64_t Nr) {
  std::call_once(once_, [&] {
    const auto bytes = static_cast<size_t>(pairs_size(N, K)) * sizeof(int16_t);  // a multiple of 64
    auto* p = static_cast<int16_t*>(std::aligned_alloc(64, bytes));
    if (p == nullptr) throw std::bad_alloc();
    std::unique_ptr<int16_t[], Free> out(p);
    if (Nr == 0) {
      pack_pairs(W, N, K, p);
    } else {  // the rows C = 2^p·W + Wr (16-bit: int8_residual_fits)
      std::vector<int16_t> c(static_cast<size_t>(N * K));
      for (int64_t i = 0; i < N * K; ++i) c[static_cast<size_t>(i)] = W[i];
      for (int64_t j = 0; j < Nr; ++j) {
        int16_t* row = c.data() + int64_t{rows[j]} * K;
        for (int64_t k = 0; k < K; ++k) row[k] = static_cast<int16_t>(row[k] * (1 << shift[j]) + Wr[j * K + k]);
      }
      pack_pairs(c.data(), N, K, p);
    }
    w_ = std::move(out);
  });
  return w_.get();
}

}  // namespace heads
