// ops_common.h — what the functional ops' files (ops.cc, ops_backward.cc, ops_tokens.cc) share:
// argument conversion and the thread-count-independent column sums of the backward.
#pragma once

#include <algorithm>
#include <vector>

#include "heads/runtime.h"
#include "heads/tensor.h"

namespace heads::kernels {

// f32, contiguous (a copy only when needed).
inline Tensor f32(const Tensor& t, const char* op, const char* name) {
  HEADS_CHECK(t.defined(), op, ": ", name, " is required");
  HEADS_CHECK(is_floating(t.dtype()), op, ": ", name, ": expected a floating dtype, got ",
              dtype_name(t.dtype()));
  return t.to(DType::F32);
}

inline Shape with_last(Shape s, int64_t n) {
  s.back() = n;
  return s;
}

// Per-column sums over `rows` of width values each row contributes (row_fn(r, acc) adds row r's
// into acc), in double. Rows are split into at most 256 fixed blocks that run in parallel; the
// block sums are added in block order, so the result does not depend on the thread count.
template <class RowFn>
std::vector<double> row_block_sums(int64_t rows, int64_t width, RowFn row_fn) {
  const int64_t per = std::max<int64_t>(16, (rows + 255) / 256);
  const int64_t blocks = (rows + per - 1) / per;
  std::vector<double> part(static_cast<size_t>(blocks * width), 0.0);
  const int threads = static_cast<int>(std::min<int64_t>(get_num_threads(), blocks));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * width >= 32768)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    double* acc = part.data() + blk * width;
    for (int64_t r = blk * per; r < std::min(rows, (blk + 1) * per); ++r) row_fn(r, acc);
  }
  std::vector<double> sum(static_cast<size_t>(width), 0.0);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    for (int64_t i = 0; i < width; ++i) sum[static_cast<size_t>(i)] += part[static_cast<size_t>(blk * width + i)];
  }
  return sum;
}

inline Tensor to_f32(const std::vector<double>& v, int64_t offset, int64_t n) {
  Tensor t = Tensor::empty({n}, DType::F32);
  for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = static_cast<float>(v[static_cast<size_t>(offset + i)]);
  return t;
}

}  // namespace heads::kernels
