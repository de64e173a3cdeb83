// linear_test.cc — the GEMM-backed linear layer against a float64 loop, odd sizes and strides.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "common/testing.h"
#include "heads/isa.h"
#include "heads/precision.h"
#include "heads/runtime.h"
#include "kernels/dispatch.h"
#include "kernels/linear.h"
#include "kernels/linear_lowp.h"

namespace heads {
namespace {

// Every path's GEMM (oneDNN on the SIMD paths, the plain loops on the portable one).
TEST(Linear, MatchesFloat64OnOddShapesAndStrides) {
  testing::IsaGuard guard;
  const testing::Sample pick;
  int64_t n_case = 0;
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    for (auto [M, K, N] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {7, 3, 5}, {129, 63, 17},
                           {64, 768, 2304}, {3, 1000, 1}, {5, 4, 0}, {0, 4, 3}, {2, 0, 3}}) {
      for (bool bias : {false, true}) {
        if (!pick(n_case++)) continue;
        const int64_t xs = K + 3, ys = N + 5;  // row strides wider than the rows
        const Tensor x = testing::randn({std::max<int64_t>(M, 1), xs});
        const Tensor W = testing::randn({std::max<int64_t>(N, 1), std::max<int64_t>(K, 1)});
        const Tensor b = testing::randn({std::max<int64_t>(N, 1)});
        Tensor y = Tensor::zeros({std::max<int64_t>(M, 1), ys}, DType::F32);
        kernels::linear_f32(x.data<float>(), M, K, xs, W.data<float>(), bias ? b.data<float>() : nullptr,
                            N, y.data<float>(), ys);
        double worst = 0, scale = 1e-30;
        for (int64_t m = 0; m < M; ++m) {
          for (int64_t n = 0; n < N; ++n) {
            double ref = bias ? b.data<float>()[n] : 0.0;
            for (int64_t k = 0; k < K; ++k) {
              ref += static_cast<double>(x.data<float>()[m * xs + k]) * W.data<float>()[n * K + k];
            }
            worst = std::max(worst, std::fabs(y.data<float>()[m * ys + n] - ref));
            scale = std::max(scale, std::fabs(ref));
          }
        }
        EXPECT_LE(worst, 1e-5 * scale + 1e-6) << "M=" << M << " K=" << K << " N=" << N << " bias=" << bias
                                              << " isa=" << isa_name(isa);
        // the row padding is never written
        for (int64_t m = 0; m < M; ++m) {
          for (int64_t n = N; n < ys; ++n) EXPECT_EQ(y.data<float>()[m * ys + n], 0.0f);
        }
      }
    }
  }
}

// Calls of at most kGemvRows rows (a decoder's step) read the weight as stored (gemv-inl.h) on the
// SIMD paths, f32 and bf16 alike: every output within an f32 sum's error of the float64 product (of
// the bf16-rounded operands for bf16), K across the vector width, the bf16 pairs and their tails,
// N across the rows per pass, strided rows of x and y (their padding never written), the same bits on
// one thread and on three, and a bf16 output the f32 one rounded once.
TEST(Linear, FewRowsOnTheWeightAsStoredMatchFloat64) {
  testing::IsaGuard guard;
  const int threads = get_num_threads();
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    for (int64_t M = 1; M <= kernels::kGemvRows + 1; ++M) {
      // (1024 x 130: the weight's bytes give several threads, whose row ranges split N unevenly)
      for (auto [K, N] : {std::pair<int64_t, int64_t>{1, 1}, {7, 3}, {16, 5}, {33, 4}, {70, 9}, {129, 130}, {768, 37},
                          {1024, 130}}) {
        const int64_t xs = K + 3, ys = N + 5;
        const Tensor x = testing::randn({M, xs}), W = testing::randn({N, K}), b = testing::randn({N});
        const std::string what = isa_name(isa) + " M=" + std::to_string(M) + " K=" + std::to_string(K) +
                                 " N=" + std::to_string(N);
        // f32: the kernel entry point, strided
        for (bool bias : {false, true}) {
          Tensor first;
          for (int t : {1, 3}) {
            set_num_threads(t);
            Tensor y = Tensor::zeros({M, ys}, DType::F32);
            kernels::linear_f32(x.data<float>(), M, K, xs, W.data<float>(), bias ? b.data<float>() : nullptr, N,
                                y.data<float>(), ys);
            for (int64_t m = 0; m < M; ++m) {
              for (int64_t n = 0; n < N; ++n) {
                double ref = bias ? b.data<float>()[n] : 0.0, mag = std::fabs(ref);
                for (int64_t k = 0; k < K; ++k) {
                  const double p = static_cast<double>(x.data<float>()[m * xs + k]) * W.data<float>()[n * K + k];
                  ref += p;
                  mag += std::fabs(p);
                }
                ASSERT_NEAR(y.data<float>()[m * ys + n], ref, (K + 6) * 6e-8 * mag) << what << " bias " << bias;
              }
              for (int64_t n = N; n < ys; ++n) ASSERT_EQ(y.data<float>()[m * ys + n], 0.0f) << what;
            }
            if (!first.defined()) {
              first = y;
            } else if (M <= kernels::kGemvRows) {  // (oneDNN's GEMM may split K by its team)
              ASSERT_TRUE(testing::bitwise_equal(first, y)) << what << ": 1 thread against 3";
            }
          }
          set_num_threads(threads);
        }
        // bf16: a packed weight through linear(), x a strided view
        const PackedLinear pw(W, Precision::BF16);
        const Tensor xv = x.slice(1, 0, K);
        const Tensor xr = xv.to(DType::BF16).to(DType::F32), wr = W.to(DType::BF16).to(DType::F32);
        set_num_threads(3);
        const Tensor y3 = linear(xv, pw, b);
        set_num_threads(1);
        const Tensor y = linear(xv, pw, b);
        set_num_threads(threads);
        if (M <= kernels::kGemvRows) ASSERT_TRUE(testing::bitwise_equal(y, y3)) << what << " bf16: 1 thread against 3";
        for (int64_t m = 0; m < M; ++m) {
          for (int64_t n = 0; n < N; ++n) {
            double ref = b.data<float>()[n], mag = std::fabs(ref);
            for (int64_t k = 0; k < K; ++k) {
              const double p = static_cast<double>(xr.data<float>()[m * K + k]) * wr.data<float>()[n * K + k];
              ref += p;
              mag += std::fabs(p);
            }
            ASSERT_NEAR(y.data<float>()[m * N + n], ref, (K + 6) * 6e-8 * mag) << what << " bf16";
          }
        }
        ASSERT_TRUE(testing::bitwise_equal(linear(xv, pw, b, DType::BF16), y.to(DType::BF16))) << what << " bf16 out";
        ASSERT_TRUE(testing::bitwise_equal(linear(xv.to(DType::BF16), pw, b), y)) << what << " bf16 in";
      }
    }
  }
}

// C = A·B with transposed and strided operands, every path, against float64.
TEST(Linear, MatmulWithStridesMatchesFloat64) {
  testing::IsaGuard guard;
  const int64_t M = 37, N = 19, K = 53;
  const Tensor A = testing::randn({K, M + 3});  // A read transposed: a_rs = 1, a_cs = M + 3
  const Tensor B = testing::randn({K, N + 2});
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    Tensor C = Tensor::zeros({M, N + 4}, DType::F32);
    kernels::matmul_f32(M, N, K, A.data<float>(), 1, M + 3, B.data<float>(), N + 2, 1, C.data<float>(), N + 4);
    double worst = 0, scale = 0;
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double ref = 0;
        for (int64_t k = 0; k < K; ++k) ref += static_cast<double>(A.data<float>()[k * (M + 3) + m]) * B.data<float>()[k * (N + 2) + n];
        worst = std::max(worst, std::fabs(C.data<float>()[m * (N + 4) + n] - ref));
        scale = std::max(scale, std::fabs(ref));
      }
      for (int64_t n = N; n < N + 4; ++n) EXPECT_EQ(C.data<float>()[m * (N + 4) + n], 0.0f);
    }
    EXPECT_LE(worst, 1e-5 * scale) << "isa=" << isa_name(isa);
  }
}

// The int8 GEMM of a few rows on the weight as stored (a decoder's step): gemm_u8s8_rows (16-bit
// widening, heads' route) and gemv_u8s8 (vpdpbusd, every route where the path has it), on every path
// this CPU runs, against int64 loops: bytes of the whole range (0 and 255 against -128 and 127
// included), 1 to 8 rows, K across a 64-byte vector and its tail, N across the rows per pass, row
// strides wider than the rows (the padding never written), on 1, 2 and 3 threads.
TEST(Linear, Int8FewRowsGemmIsExact) {
  const int saved_threads = get_num_threads();
  std::mt19937_64 gen(testing::rng()());
  std::uniform_int_distribution<int> u8(0, 255), s8(-128, 127), pick(0, 9);
  const auto byte = [&](int lo, int hi, int v) { const int p = pick(gen); return p == 0 ? lo : p == 1 ? hi : v; };
  int kernels_run = 0;
  for (Isa isa : supported_isas()) {
    const kernels::KernelTable* t = kernels::table_for(isa);
    if (t == nullptr) continue;
    using Kernel = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const int8_t*, int64_t, int32_t*, int64_t, int);
    for (auto [name, f] : {std::pair<const char*, Kernel>{"gemm_u8s8_rows", t->gemm_u8s8_rows},
                           {"gemv_u8s8", t->gemv_u8s8}}) {
      if (f == nullptr) continue;
      ++kernels_run;
      for (int64_t M = 1; M <= 8; ++M) {
        for (auto [K, N] : {std::pair<int64_t, int64_t>{1, 1}, {3, 5}, {63, 4}, {64, 3}, {65, 37}, {129, 130},
                            {768, 9}, {1537, 6}}) {
          const int64_t lda = K + 5, ldc = N + 3;
          std::vector<uint8_t> A(static_cast<size_t>(M * lda));
          std::vector<int8_t> B(static_cast<size_t>(N * K));
          for (auto& a : A) a = static_cast<uint8_t>(byte(0, 255, u8(gen)));
          for (auto& b : B) b = static_cast<int8_t>(byte(-128, 127, s8(gen)));
          for (int threads : {1, 2, 3}) {
            set_num_threads(threads);
            std::vector<int32_t> C(static_cast<size_t>(M * ldc), 12345);
            f(A.data(), M, K, lda, B.data(), N, C.data(), ldc, threads);
            for (int64_t m = 0; m < M; ++m) {
              for (int64_t n = 0; n < N; ++n) {
                int64_t want = 0;
                for (int64_t k = 0; k < K; ++k) want += int64_t{A[m * lda + k]} * B[n * K + k];
                ASSERT_EQ(C[m * ldc + n], want) << name << " " << isa_name(isa) << " M=" << M << " K=" << K
                                                << " N=" << N << " threads=" << threads << " m=" << m << " n=" << n;
              }
              for (int64_t n = N; n < ldc; ++n) ASSERT_EQ(C[m * ldc + n], 12345) << name << " wrote the padding";
            }
          }
        }
      }
    }
  }
  set_num_threads(saved_threads);
  EXPECT_GT(kernels_run, 0);
}

// heads' own integer GEMM (gemm_i8-inl.h) on every path this CPU runs it on, in the path's weight
// layout (16-bit pairs; 8-bit quads in two planes), against int64 loops: bytes of the whole range (0
// and 255 against -128 and 127 included), odd sizes (K odd or not a multiple of 4: a part group; N
// past a panel; rows past a micro-kernel, a block, several blocks; K past a block of groups), two
// products of different rows in one call, the second with 16-bit rows folded in as the residual rows
// make them (±(256·127 + 127) included: the quads' H plane, in some panels and not others), row
// strides wider than the rows (the padding never written), and the same bits on 1, 2 and 3 threads.
TEST(Linear, Int8PairsGemmIsExactOnOddShapes) {
  const int saved_threads = get_num_threads();
  int paths = 0;
  std::mt19937_64 gen(testing::rng()());
  std::uniform_int_distribution<int> u8(0, 255), s8(-128, 127), pick(0, 9), wide(-(256 * 127 + 127), 256 * 127 + 127);
  // every path's GEMM, and the amx path's tile GEMM over the tile emulator as well where the CPU has
  // AVX-512 (the real tiles' too, where it has them: both must give the exact sums)
  std::vector<std::pair<std::string, const kernels::KernelTable*>> tables;
  for (Isa isa : supported_isas()) {
    const kernels::KernelTable* t = kernels::table_for(isa);
    if (t != nullptr && kernels::int8_gemm_usable(*t)) tables.emplace_back(isa_name(isa), t);
  }
  kernels::set_amx_emulation(1);
  if (const kernels::KernelTable* t = kernels::table_for(Isa::Amx);
      t != nullptr && kernels::int8_gemm_usable(*t) &&
      std::none_of(tables.begin(), tables.end(), [t](const auto& e) { return e.second == t; })) {
    tables.emplace_back("amx (emulated)", t);
  }
  kernels::set_amx_emulation(-1);
  for (const auto& [name, t] : tables) {
    ++paths;
    for (auto [M, K, N] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {7, 3, 17}, {2, 2, 16}, {129, 383, 33},
                           {300, 77, 100}, {13, 1537, 15}, {97, 514, 31}, {5, 1030, 40}}) {
      const int64_t lda = K + 5, M2 = std::max<int64_t>(1, M / 3), N2 = N / 2 + 1;
      std::vector<uint8_t> A(static_cast<size_t>(M * lda));
      std::vector<int8_t> B(static_cast<size_t>(N * K));
      std::vector<int16_t> B2(static_cast<size_t>(N2 * K));
      const auto byte = [&](int lo, int hi, int v) { const int p = pick(gen); return p == 0 ? lo : p == 1 ? hi : v; };
      for (auto& a : A) a = static_cast<uint8_t>(byte(0, 255, u8(gen)));
      for (auto& b : B) b = static_cast<int8_t>(byte(-128, 127, s8(gen)));
      // B2: rows of bytes, and every third row (from the second) 16-bit, bounded as the residual rows'
      // |C| so that 255·Σ|C| fits int32 (int8_residual_fits): the sums fit their int32 exactly.
      const int64_t row_cap = std::min<int64_t>(256 * 127 + 127, (int64_t{1} << 31) / 255 / K);
      for (int64_t n = 0; n < N2; ++n) {
        for (int64_t k = 0; k < K; ++k) {
          const int v = n % 3 == 1 ? static_cast<int>(std::clamp<int64_t>(byte(-(256 * 127 + 127), 256 * 127 + 127, wide(gen)),
                                                                           -row_cap, row_cap))
                                   : byte(-128, 127, s8(gen));
          B2[static_cast<size_t>(n * K + k)] = static_cast<int16_t>(v);
        }
      }
      const auto packed = [&](const auto& w, int64_t n) {
        std::vector<uint8_t> buf(static_cast<size_t>(kernels::int8_packed_bytes(t->int8_layout, n, K) + 64));
        auto* p = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
        lowp::pack_int8_gemm(t->int8_layout, w.data(), n, K, p);
        return std::make_pair(std::move(buf), p);
      };
      const auto [b1, p1] = packed(B, N);
      const auto [b2, p2] = packed(B2, N2);
      const int64_t ldc = N + 3, ldc2 = N2 + 1;
      std::vector<int32_t> first;
      for (int threads : {1, 2, 3}) {
        set_num_threads(threads);
        std::vector<int32_t> C(static_cast<size_t>(M * ldc), -7), C2(static_cast<size_t>(M2 * ldc2), -7);
        const kernels::PairsProduct parts[2] = {{p1, N, M, C.data(), ldc}, {p2, N2, M2, C2.data(), ldc2}};
        t->gemm_u8s8_pairs(A.data(), M, K, lda, parts, 2);
        const std::string what = "M=" + std::to_string(M) + " K=" + std::to_string(K) + " N=" + std::to_string(N) +
                                 " isa=" + name + " threads=" + std::to_string(threads);
        const auto check = [&](const std::vector<int32_t>& c, const auto& w, int64_t rows, int64_t n, int64_t ld) {
          for (int64_t m = 0; m < rows; ++m) {
            for (int64_t j = 0; j < ld; ++j) {
              const int32_t got = c[static_cast<size_t>(m * ld + j)];
              if (j >= n) {
                ASSERT_EQ(got, -7) << what << ": padding of row " << m << " written";
                continue;
              }
              int64_t ref = 0;
              for (int64_t k = 0; k < K; ++k) ref += int64_t{A[static_cast<size_t>(m * lda + k)]} * w[static_cast<size_t>(j * K + k)];
              ASSERT_EQ(got, ref) << what << ": C[" << m << ", " << j << "]";
            }
          }
        };
        check(C, B, M, N, ldc);
        check(C2, B2, M2, N2, ldc2);
        if (threads == 1) first = C;
        EXPECT_EQ(C, first) << what;
      }
    }
  }
  set_num_threads(saved_threads);
#if defined(__x86_64__)
  if (isa_supported(Isa::Avx2)) EXPECT_GT(paths, 0) << "no x86 SIMD path has heads' int8 GEMM";
#elif defined(__aarch64__) && defined(__linux__)
  if (cpu_features().find(" dotprod") != std::string::npos) EXPECT_GT(paths, 0) << "no NEON path has heads' int8 GEMM";
#endif
}

// Threads creating and running matmuls of many shapes at once, every result checked: the primitive
// cache is cleared when it holds 256 while other threads may run primitives it held (once a use
// after free; ASan in CI), and oneDNN's library scratchpad is not for concurrent calls (once wrong
// results from MultiheadAttention called by several Python threads).
TEST(Linear, ConcurrentCallsOfManyShapes) {
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 gen(static_cast<uint64_t>(t));
      std::normal_distribution<float> nd;
      for (int64_t i = 0; i < 200; ++i) {  // sizes that run on several threads (threads_for)
        const int64_t K = 32 * (1 + (t + i) % 4), N = 3 * K, M = 2 * (1 + (t * 61 + i * 7) % 97);
        std::vector<float> x(static_cast<size_t>(M * K)), w(static_cast<size_t>(N * K)), y(static_cast<size_t>(M * N));
        for (float& v : x) v = nd(gen);
        for (float& v : w) v = nd(gen);
        kernels::linear_f32(x.data(), M, K, K, w.data(), nullptr, N, y.data(), N);
        for (int64_t m = i % 3; m < M; m += 3) {
          for (int64_t n = 0; n < N; ++n) {
            double ref = 0;
            for (int64_t k = 0; k < K; ++k) ref += static_cast<double>(x[m * K + k]) * w[n * K + k];
            if (std::fabs(y[static_cast<size_t>(m * N + n)] - ref) > 1e-4 * (1 + std::fabs(ref))) ++bad;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
}

// Restores set_batch_invariant's setting at scope end.
class BatchInvariantGuard {
 public:
  explicit BatchInvariantGuard(bool on) : saved_(batch_invariant()) { set_batch_invariant(on); }
  ~BatchInvariantGuard() { set_batch_invariant(saved_); }
  BatchInvariantGuard(const BatchInvariantGuard&) = delete;
  BatchInvariantGuard& operator=(const BatchInvariantGuard&) = delete;

 private:
  bool saved_;
};

// Under set_batch_invariant(true) every path computes each output as one chain of FMAs over k from
// zero, then adds the bias: the same bits whichever rows come with it (any count, any offset,
// tails of every register block and panel), on any thread count and on every path; and that is
// the product within an f32 sum's error of the float64 one.
TEST(Linear, BatchInvariantRowsDoNotDependOnTheBatch) {
  testing::IsaGuard isa_guard;
  const BatchInvariantGuard on(true);
  const int threads = get_num_threads();
  constexpr int64_t kRows = 300;
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    // whole and partial panels (16 to 64 columns), K not a multiple of the vector width
    for (auto [K, N] : {std::pair<int64_t, int64_t>{1, 1}, {77, 45}, {77, 130}, {384, 391}, {1536, 17}}) {
      const int64_t xs = K + 3;
      const Tensor x = testing::randn({kRows, xs});
      const Tensor W = testing::randn({N, K});
      const Tensor b = testing::randn({N});
      std::vector<float> all(static_cast<size_t>(kRows * N));
      kernels::linear_f32(x.data<float>(), kRows, K, xs, W.data<float>(), b.data<float>(), N, all.data(), N);
      const std::string what = "K=" + std::to_string(K) + " N=" + std::to_string(N) + " isa=" + isa_name(isa);
      for (int64_t m = 0; m < kRows; m += 7) {
        for (int64_t n = 0; n < N; ++n) {
          float chain = 0.0f;  // the definition, bit for bit
          double ref = b.data<float>()[n], mag = std::fabs(ref);
          for (int64_t k = 0; k < K; ++k) {
            chain = std::fma(x.data<float>()[m * xs + k], W.data<float>()[n * K + k], chain);
            const double t = static_cast<double>(x.data<float>()[m * xs + k]) * W.data<float>()[n * K + k];
            ref += t;
            mag += std::fabs(t);
          }
          const float got = all[static_cast<size_t>(m * N + n)];
          ASSERT_EQ(got, chain + b.data<float>()[n]) << what << ": row " << m << ", column " << n;
          ASSERT_LE(std::fabs(got - ref), (K + 1) * 6e-8 * mag) << what;  // an f32 sum's error (K + 1 roundings)
        }
      }
      const testing::Sample pick;
      int64_t n_case = 0;
      for (int t : {1, threads}) {
        set_num_threads(t);
        for (int64_t M : {1, 2, 3, 5, 6, 7, 13, 47, 48, 49, 129, 299}) {
          for (int64_t first : {int64_t{0}, int64_t{1}, kRows - M}) {
            if (!pick(n_case++)) continue;
            std::vector<float> y(static_cast<size_t>(M * N));
            kernels::linear_f32(x.data<float>() + first * xs, M, K, xs, W.data<float>(), b.data<float>(), N,
                                y.data(), N);
            for (int64_t m = 0; m < M; ++m) {
              for (int64_t n = 0; n < N; ++n) {
                ASSERT_EQ(y[static_cast<size_t>(m * N + n)], all[static_cast<size_t>((first + m) * N + n)])
                    << what << " threads=" << t << ": row " << first + m << " of a batch of " << M
                    << " rows from row " << first << ", column " << n;
              }
            }
          }
        }
      }
      set_num_threads(threads);
    }
  }
}

}  // namespace
}  // namespace heads
