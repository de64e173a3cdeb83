// linear_lowp_pairs.cc — the weight layouts of heads' own int8 GEMM (kernels/gemm_i8-inl.h,
// kernels/dispatch.h: Int8Layout; kernels/linear_lowp.h): panels of 16 columns, 16-bit pairs (x86-64)
// or 8-bit quads in two planes (AArch64), packed once per weight and layout at first use (PairsB),
// the residual rows folded in as the 16-bit rows C = 2^p·Wq + Wr.
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

#include "heads/error.h"
#include "kernels/dispatch.h"
#include "kernels/linear_lowp.h"

namespace heads {

namespace {

using kernels::Int8Layout;
constexpr int64_t kP = kernels::kPairPanel;

template <class T>
void pack_pairs_of(const T* B, int64_t N, int64_t K, int16_t* dst) {
  const int64_t Kp = (K + 1) / 2, panels = (N + kP - 1) / kP;
  for (int64_t p = 0; p < panels; ++p) {
    int16_t* panel = dst + p * Kp * 2 * kP;
    for (int64_t i = 0; i < Kp; ++i) {
      for (int64_t j = 0; j < kP; ++j) {
        const int64_t n = p * kP + j;
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t k = 2 * i + h;
          panel[(i * kP + j) * 2 + h] = n < N && k < K ? static_cast<int16_t>(B[n * K + k]) : int16_t{0};
        }
      }
    }
  }
}

// The Quads8 layout (kernels/dispatch.h): per panel the header (128·Σ_k B of each column mod 2^32;
// whether the H plane has a value), the L plane, the H plane; B = 256·H + L with L the signed low
// byte, H in [-128, 127] for B ≤ kMaxQuadsValue.
constexpr int64_t kMaxQuadsValue = 256 * 127 + 127;
template <class T>
void pack_quads_of(const T* B, int64_t N, int64_t K, uint8_t* dst) {
  const int64_t Kq = (K + 3) / 4, panels = (N + kP - 1) / kP;
  const int64_t plane = Kq * 4 * kP, stride = kernels::int8_panel_bytes(Int8Layout::Quads8, K);
  for (int64_t p = 0; p < panels; ++p) {
    uint8_t* panel = dst + p * stride;
    auto* lo = reinterpret_cast<int8_t*>(panel + kernels::kQuadsHeader);
    int8_t* hi = lo + plane;
    int32_t header[kernels::kQuadsHeader / 4] = {};
    for (int64_t j = 0; j < kP; ++j) {
      const int64_t n = p * kP + j;
      int64_t sum = 0;
      for (int64_t k = 0; k < 4 * Kq; ++k) {
        const int64_t c = n < N && k < K ? int64_t{B[n * K + k]} : 0;
        HEADS_CHECK(c >= std::numeric_limits<int16_t>::min() && c <= kMaxQuadsValue,
                    "int8 GEMM weight (quads): value ", c, " at [", n, ", ", k, "] is past the layout's range [-32768, ",
                    kMaxQuadsValue, "]");
        const auto l = static_cast<int8_t>(static_cast<uint8_t>(c & 0xff));
        const int64_t h = (c - l) / 256;
        const int64_t at = ((k / 4) * kP + j) * 4 + k % 4;
        lo[at] = l;
        hi[at] = static_cast<int8_t>(h);
        if (h != 0) header[kP] = 1;
        sum += c;
      }
      header[j] = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(128 * sum)));
    }
    std::memcpy(panel, header, sizeof header);
  }
}

template <class T>
void pack_of(Int8Layout layout, const T* B, int64_t N, int64_t K, void* dst) {
  if (layout == Int8Layout::Pairs16) {
    pack_pairs_of(B, N, K, static_cast<int16_t*>(dst));
  } else {
    pack_quads_of(B, N, K, static_cast<uint8_t*>(dst));
  }
}

}  // namespace

void lowp::pack_int8_gemm(Int8Layout layout, const int8_t* B, int64_t N, int64_t K, void* dst) {
  pack_of(layout, B, N, K, dst);
}
void lowp::pack_int8_gemm(Int8Layout layout, const int16_t* B, int64_t N, int64_t K, void* dst) {
  pack_of(layout, B, N, K, dst);
}

void lowp::PairsB::Free::operator()(void* p) const { std::free(p); }

const void* lowp::PairsB::get(Int8Layout layout, const int8_t* W, int64_t N, int64_t K, const int8_t* Wr,
                              const int32_t* rows, const int32_t* shift, int64_t Nr) {
  const auto l = static_cast<size_t>(layout);
  std::call_once(once_[l], [&] {
    const auto bytes = static_cast<size_t>(kernels::int8_packed_bytes(layout, N, K));  // a multiple of 64
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr) throw std::bad_alloc();
    std::unique_ptr<void, Free> out(p);
    if (Nr == 0) {
      pack_int8_gemm(layout, W, N, K, p);
    } else {  // the rows C = 2^p·W + Wr (16-bit: int8_residual_fits)
      std::vector<int16_t> c(static_cast<size_t>(N * K));
      for (int64_t i = 0; i < N * K; ++i) c[static_cast<size_t>(i)] = W[i];
      for (int64_t j = 0; j < Nr; ++j) {
        int16_t* row = c.data() + int64_t{rows[j]} * K;
        for (int64_t k = 0; k < K; ++k) row[k] = static_cast<int16_t>(row[k] * (1 << shift[j]) + Wr[j * K + k]);
      }
      pack_int8_gemm(layout, c.data(), N, K, p);
    }
    w_[l] = std::move(out);
  });
  return w_[l].get();
}

}  // namespace heads
