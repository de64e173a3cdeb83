// linear_lowp_int8.cc — the int8 linear layer at each call (heads/precision.h): activations quantized
// per row, the integer GEMMs (oneDNN's on CPUs with VNNI, heads' own on x86 without, plain loops on
// the portable path, or the f32 route), the outputs made from the exact sums.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <omp.h>
#include <optional>
#include <vector>

#include "heads/error.h"
#include "heads/precision.h"
#include "kernels/dispatch.h"
#include "kernels/linear.h"
#include "kernels/linear_lowp.h"
#include "kernels/onednn.h"

namespace heads::lowp {
namespace {

// The integer GEMM acc [M, N] = A [M, K] · B [N, K]ᵀ (uint8 A, int8 B, exact int32 sums) on the native
// route, else (a few rows on heads' route, or where oneDNN turns out to have no int8 matmul for this
// CPU) on the weight as stored through the SIMD path's gemm_u8s8_rows, or plain loops on the portable
// path (whose kernels are built at -O2, where GCC leaves that kernel's loops unvectorized: 4x slower).
void gemm_u8s8(const uint8_t* A, int64_t M, int64_t K, const int8_t* B, int64_t N, int32_t* acc, bool native,
               kernels::PackedB* packed, int threads) {
  if (native && native_matmul("int8", {M, K, N, K, 1, 1, K, N, false, threads, kernels::MatmulTypes::U8S8}, A, B,
                               nullptr, acc, packed)) {
    return;
  }
  if (const auto& k = kernels::active(); k.gemm_u8s8_rows != nullptr) {
    k.gemm_u8s8_rows(A, M, K, K, B, N, acc, N, threads);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t m = 0; m < M; ++m) {
    const uint8_t* a = A + m * K;
    for (int64_t n = 0; n < N; ++n) {
      const int8_t* b = B + n * K;
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += static_cast<int32_t>(a[k]) * static_cast<int32_t>(b[k]);
      acc[m * N + n] = sum;
    }
  }
}

// The same through an int8 weight. Rows of x are quantized by the kernel table's quantize_rows_u8: an
// asymmetric term x ≈ (q − z)·s for every row (unsigned bytes) and a second term r·sr (stored as
// r + kSecondZero, taken out through the row sums as z is) for the rows whose estimated error exceeds
// the weight's activation_error (0, the default: every row). The integer GEMMs: acc = q·Wᵀ over all
// rows with acc2 = r·Wᵀ over the rows with a second term in the same GEMM (packed after them), and
// for the weight's residual rows (heads/precision.h) the sums of their 16-bit rows C = 2^p·W + Wr:
// heads' own GEMM reads C in place of W there; oneDNN's and the portable loops run W and Wr in one
// GEMM (the weight's rows stacked: W's, then Wr's padded to a multiple of kRowBlock), its sums of Wr
// (acc3) beside W's in each row, and the output pass makes 2^p·acc + acc3 (exact in 32 bits). Then,
// with the zero points taken out exactly through the row sums,
//   y[m, n] = ((acc − z·ws[n])·s (+ (acc2 − 128·ws[n])·sr)) · sw[n] + b[n]
// (with C's sums and row sums, and scale swr, on the residual rows). The weight's outlier channels are
// zero in the rows quantized (x times `keep`) and added in f32 by each output row: y[m, n] +=
// x[m, o]·W[n, o]. On the f32 route the terms are summed back into f32 rows, (q − z)·s (+ r·sr), and
// go through the f32 GEMM with the dequantized weight (C·swr on residual rows).

// Output row m of x as int8_rows_out reads it, from one GEMM call's sums (row stride ld): the first
// term's at row i of acc, the second term's at row i2 (−1: the row has none), and on oneDNN's route
// and the portable loops (heads == false) the residual rows' sums after W's N in the same rows.
kernels::Int8Row int8_out_row(const Int8Weight& w, bool heads, const float* x, int64_t xs, int64_t m,
                              const int32_t* zx, const float* sx, const float* sr, const float* bias,
                              const int32_t* acc, int64_t ld, int64_t i, int64_t i2) {
  const int64_t N = w.N;
  kernels::Int8Row r{acc + i * ld, i2 < 0 ? nullptr : acc + i2 * ld, zx[m], sx[m], sr[m],
                     heads ? w.fold_ws : w.ws, heads ? w.fold_sw : w.sw, bias, N};
  if (!heads && w.Nr > 0) {  // the residual rows' sums beside W's, C's row sums and scales
    r.ws = w.fold_ws;
    r.sw = w.fold_sw;
    r.a3 = acc + i * ld + N;
    r.a32 = i2 < 0 ? nullptr : acc + i2 * ld + N;
    r.shift = w.fold_shift;
    r.col = w.fold_col;
    r.mask = w.fold_mask;
  }
  r.x = x + m * xs;
  r.oc = w.oc;
  r.wo = w.wo;
  r.no = w.no;
  return r;
}

// Calls of at most this many rows run the GEMM on the weight as stored: through vpdpbusd on every route
// where the path has it (gemv_u8s8: oneDNN's matmul had read a decode step's weights at 13–29 GB/s of
// 28 on an AMD Zen 4), else on heads' route (gemm_u8s8_rows).
constexpr int64_t kFewRows = 4;

// Output rows are made (and their activation applied) this many at a time, while they are in cache.
constexpr int64_t kOutBlock = 16;

// Rows per task of oneDNN's route and the portable loops (a multiple of kShapeStep and of kOutBlock).
// Each task quantizes its rows, runs its GEMMs on one thread and makes its outputs from the sums while
// they are in L2 (64 x N int32), and the threads take tasks as they come free, all in one parallel
// region: a layer had been a dozen regions (the quantization, then per 256 rows a GEMM, the residual
// GEMM and the output pass), and on a 2-vCPU VM each fork/join woke a sleeping thread (libgomp's
// spin is cut to 1,000 iterations: tools/cli/main.cc) — 20% of an int8 embedding's samples were in
// the kernel's futex wake-ups (Intel Xeon, AVX-512 VNNI, 2 threads).
// The rows are cut into tasks of whole kShapeStep units as even as they go, as many as a multiple of
// the threads (the larger ones first): with tasks of 64 rows and a ragged last one, a thread waited
// up to a task at each layer's end (2 threads: 1.77× one thread's embeddings).
constexpr int64_t kTaskRows = 64;

struct TaskSplit {
  int64_t tasks = 0, base = 0, extra = 0;  // units (of kShapeStep rows) per task: base, +1 for the first `extra`
  int threads = 1;
  int64_t rows_max() const { return (base + (extra > 0)) * kShapeStep; }
  int64_t first_row(int64_t i) const { return (i * base + std::min(i, extra)) * kShapeStep; }
};

TaskSplit split_tasks(int64_t M, int64_t N, int64_t K) {
  TaskSplit s;
  if (M <= 0) return s;
  const int64_t units = (M + kShapeStep - 1) / kShapeStep, fewest = (M + kTaskRows - 1) / kTaskRows;
  s.threads = static_cast<int>(std::clamp<int64_t>(kernels::gemm_threads(M, N, K), 1, fewest));
  s.tasks = std::min(units, (fewest + s.threads - 1) / s.threads * s.threads);
  s.base = units / s.tasks;
  s.extra = units % s.tasks;
  return s;
}

void linear_int8_tasks(const float* x, int64_t M, int64_t K, int64_t xs, const Int8Weight& w, const float* bias,
                       float* y, int64_t ys, std::optional<Activation> act, bool native) {
  using lowp::kShapeStep;
  const int64_t N = w.N, Nr = w.Nr;
  // The GEMM's columns: W's N, and with residual rows theirs (the stacked weight, zero rows to a multiple of kRowBlock)
  const int64_t Ns = N + (Nr + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int8_t* B = Nr > 0 ? w.W_stacked : w.W;
  const TaskSplit split = split_tasks(M, Ns, K);
  const int64_t T = split.rows_max(), tasks = split.tasks;
  const int threads = split.threads;
  // A call of one task (at most kTaskRows rows: a decoder's step, a short prompt) gives its GEMM the
  // threads that the rows could not use: oneDNN splits the weight's columns among them. A decode step
  // had run on one core (random llama of 100M parameters, 2 threads, AMD Zen 4).
  const int gemm_inner = tasks == 1 ? kernels::gemm_threads(T, Ns, K) : 1;
  // Each thread's working memory: a task's codes (rows [0, cm) the first terms, zero past its rows,
  // then the second terms packed, zero rows up to a multiple of kRowBlock), and its GEMM's sums.
  const int64_t q_size = 2 * T * K, acc_size = 2 * T * Ns;
  const Buffer<uint8_t> codes(threads * q_size);
  const Buffer<int32_t> sums(threads * acc_size);
  const Buffer<float> sx(M), sr(M);
  const Buffer<int32_t> zx(M);
  const auto& k = kernels::active();
  const double tau2x12 = 12.0 * w.act_error * w.act_error;
  const bool few_rows = M <= kFewRows && k.gemv_u8s8 != nullptr;
  // Task ti on thread t's working memory; slot: row i's index among the task's second terms, or −1.
  const auto run_task = [&](int t, int64_t ti, int64_t* slot) {
    uint8_t* q = codes.data() + t * q_size;
    int32_t* acc = sums.data() + t * acc_size;
    const int64_t c0 = split.first_row(ti), n = std::min(M, split.first_row(ti + 1)) - c0;
    // Rows padded to a multiple of kShapeStep (fewer GEMM shapes to make), but not a call of fewer: a
    // decoder's step (1 row, 2 with its second term) had run 16 rows, 14 of zeros, and its GEMM was
    // bound by their multiply-adds instead of the weight's bytes.
    const int64_t cm = n < kShapeStep ? n : (n + kShapeStep - 1) / kShapeStep * kShapeStep;
    uint8_t* r = q + cm * K;
    k.quantize_rows_u8(x + c0 * xs, n, K, xs, w.keep, tau2x12, q, sx.data() + c0, zx.data() + c0, r,
                       sr.data() + c0);
    std::fill(q + n * K, q + cm * K, uint8_t{0});
    int64_t m2 = 0;
    for (int64_t i = 0; i < n; ++i) {  // second terms packed in order: row i moves to row m2 ≤ i
      if (sr[c0 + i] == 0.0f) {
        slot[i] = -1;
        continue;
      }
      if (m2 != i) std::memmove(r + m2 * K, r + i * K, static_cast<size_t>(K));
      slot[i] = cm + m2++;
    }
    const int64_t mt = cm + std::min((m2 + kRowBlock - 1) / kRowBlock * kRowBlock, cm);
    std::fill(r + m2 * K, q + mt * K, uint8_t{0});
    if (few_rows) {  // a decoder's step: the weight as stored, through vpdpbusd (gemv-inl.h)
      k.gemv_u8s8(q, mt, K, K, B, Ns, acc, Ns, gemm_inner);
    } else {
      gemm_u8s8(q, mt, K, B, Ns, acc, native, w.packed, gemm_inner);
    }
    for (int64_t b0 = 0; b0 < n; b0 += kOutBlock) {
      const int64_t b1 = std::min(n, b0 + kOutBlock);
      kernels::Int8Row rows[kOutBlock];
      for (int64_t i = b0; i < b1; ++i) {
        rows[i - b0] = int8_out_row(w, false, x, xs, c0 + i, zx.data(), sx.data(), sr.data(), bias, acc, Ns, i,
                                    slot[i]);
      }
      k.int8_rows_out(rows, b1 - b0, y + (c0 + b0) * ys, ys);
      apply_activation(act, y + (c0 + b0) * ys, b1 - b0, N, ys);
    }
  };
  if (threads == 1) {
    // Outside any parallel construct: a parallel region inside one (oneDNN's, or an activation's),
    // even one of a single thread, is nested, and libgomp starts fresh threads for a nested team
    // instead of taking them from its pool (a decode step of a 100M-parameter llama created ~80).
    int64_t slot[kTaskRows];
    for (int64_t ti = 0; ti < tasks; ++ti) run_task(0, ti, slot);
    return;
  }
  std::atomic<bool> failed{false};
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    int64_t slot[kTaskRows];
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < tasks; ++ti) {
      if (failed.load(std::memory_order_relaxed)) continue;
      try {
        run_task(t, ti, slot);
      } catch (...) {
#pragma omp critical(heads_linear_int8_error)
        if (!error) error = std::current_exception();
        failed.store(true, std::memory_order_relaxed);
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace

void linear_int8(const float* x, int64_t M, int64_t K, int64_t xs, const Int8Weight& w, const float* bias, float* y,
                 int64_t ys, std::optional<Activation> act) {
  const Route route = int8_route(w.act_error);
  if (route == Route::Native || route == Route::Portable) {
    linear_int8_tasks(x, M, K, xs, w, bias, y, ys, act, route == Route::Native);
    return;
  }
  // A few rows on heads' route (a decoder's step: 1 row, 2 with its second term): the weight as stored, a
  // byte a weight, where heads' GEMM reads 16-bit pairs (two); the same sums, the same bits.
  if (route == Route::Heads && M <= kFewRows) {
    linear_int8_tasks(x, M, K, xs, w, bias, y, ys, act, false);
    return;
  }
  // The f32 route and heads' own GEMM from here.
  // Rows [0, M) of xq: the first terms, zero rows up to Mp; rows [Mp, Mp + M): the second terms
  // (where a row has one). The GEMMs run Mp rows, a multiple of kShapeStep: a model fed texts of
  // every length then meets kShapeStep times fewer GEMM shapes, each a oneDNN primitive made once
  // (the int8 layers have a dozen shapes per length: onednn.cc caches a few hundred).
  const int64_t Mp = (M + lowp::kShapeStep - 1) / lowp::kShapeStep * lowp::kShapeStep;
  const Buffer<uint8_t> xq(2 * Mp * K);
  uint8_t* xr = xq.data() + Mp * K;
  const Buffer<float> sx(M), sr(M);
  const Buffer<int32_t> zx(M);
  kernels::active().quantize_rows_u8(x, M, K, xs, w.keep, 12.0 * w.act_error * w.act_error,
                                     xq.data(), sx.data(), zx.data(), xr, sr.data());
  const int threads = kernels::gemm_threads(M, w.N, K);
  if (route == Route::F32) {
    HEADS_CHECK(w.wide != nullptr, "linear (int8): the weight has no f32 copy for this CPU's f32 route");
    const Buffer<float> xf(M * K);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t m = 0; m < M; ++m) {
      const uint8_t* q = xq.data() + m * K;
      const uint8_t* r = xr + m * K;
      const float s = sx[m], s2 = sr[m];
      const int32_t z = zx[m];
      for (int64_t k = 0; k < K; ++k) {
        if (w.keep != nullptr && w.keep[k] == 0.0f) {  // an outlier channel: x as it is (wide holds W's column)
          xf[m * K + k] = x[m * xs + k];
          continue;
        }
        const float v = static_cast<float>(q[k] - z) * s;
        xf[m * K + k] = s2 != 0.0f ? v + static_cast<float>(r[k] - kernels::kSecondZero) * s2 : v;
      }
    }
    linear_wide(xf.data(), M, K, w.wide, bias, w.N, y, false, ys);
    apply_activation(act, y, M, w.N, ys);
    return;
  }
  // heads' own GEMM (CPUs without VNNI): the rows with a second term follow the M first terms
  // directly (in order: a row never moves down), so that one GEMM reads the weight once for both (a
  // decoder's single row: 1 or 2 rows), and the residual rows are folded into the weight (C = 2^p·W +
  // Wr there).
  const int64_t N = w.N, Nr = w.Nr;
  std::vector<int64_t> two;
  for (int64_t m = 0; m < M; ++m) {
    if (sr[m] != 0.0f) two.push_back(m);
  }
  const auto M2 = static_cast<int64_t>(two.size());
  for (int64_t j = 0; j < M2; ++j) {  // row two[j] of xr to row M + j of xq: never past it (two[j] ≥ j)
    if (M + j != Mp + two[j]) std::memmove(xq.data() + (M + j) * K, xr + two[j] * K, static_cast<size_t>(K));
  }
  const void* pairs = w.pairs->get(kernels::active().int8_layout, w.W, N, K, w.Wr, w.rrows, w.rshift, Nr);
  if (M2 == 0) {  // one term per row: the output made from the sums in registers, every row in one call
    const int act_code = !act ? 0 : *act == Activation::Relu ? 1 : *act == Activation::Gelu ? 2 : 3;
    const kernels::PairsOut out{y, ys, zx.data(), sx.data(), w.fold_ws, w.fold_sw, bias, x, xs, w.oc, w.wo, w.no,
                                act_code};
    kernels::active().gemm_u8s8_pairs_out(xq.data(), M, K, K, pairs, N, out);
    return;
  }
  // With second terms one GEMM over them all, then the outputs a block of rows at a time.
  const int64_t Mt = M + M2;
  const Buffer<int32_t> acc(Mt * N);
  std::vector<int64_t> second(static_cast<size_t>(M), -1);  // row m's row among the sums' second terms
  for (int64_t j = 0; j < M2; ++j) second[static_cast<size_t>(two[j])] = M + j;
  const kernels::PairsProduct part{pairs, N, Mt, acc.data(), N};
  kernels::active().gemm_u8s8_pairs(xq.data(), Mt, K, K, &part, 1);
  const int64_t blocks = (M + kOutBlock - 1) / kOutBlock;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t bi = 0; bi < blocks; ++bi) {
    const int64_t m0 = bi * kOutBlock, m1 = std::min(M, m0 + kOutBlock);
    kernels::Int8Row rows[kOutBlock];
    for (int64_t m = m0; m < m1; ++m) {
      rows[m - m0] = int8_out_row(w, true, x, xs, m, zx.data(), sx.data(), sr.data(), bias, acc.data(), N, m,
                                  second[static_cast<size_t>(m)]);
    }
    kernels::active().int8_rows_out(rows, m1 - m0, y + m0 * ys, ys);
    apply_activation(act, y + m0 * ys, m1 - m0, N, ys);
  }
}


}  // namespace heads::lowp
