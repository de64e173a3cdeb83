// tensor_test.cc — views, copies and dtype conversions of Tensor.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <limits>

#include <cmath>
#include <cstring>

#include "common/testing.h"
#include "heads/runtime.h"
#include "heads/tensor.h"

namespace heads {
namespace {

TEST(Tensor, ViewsShareStorage) {
  Tensor t = testing::randn({2, 3, 4});
  const Tensor p = t.permute({2, 0, 1});
  EXPECT_EQ(p.shape(), Shape({4, 2, 3}));
  EXPECT_EQ(p.strides(), Shape({1, 12, 4}));
  EXPECT_FALSE(p.is_contiguous());
  EXPECT_EQ(p.item_as_double({3, 1, 2}), t.item_as_double({1, 2, 3}));
  const Tensor s = t.slice(2, 1, 3).select(0, 1);
  EXPECT_EQ(s.shape(), Shape({3, 2}));
  EXPECT_EQ(s.item_as_double({2, 1}), t.item_as_double({1, 2, 2}));
  const Tensor c = p.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  testing::for_each_index(p.shape(), [&](const Shape& i) {
    EXPECT_EQ(c.item_as_double(i), p.item_as_double(i));
  });
  const Tensor e = t.slice(0, 0, 1).expand({5, 3, 4});
  EXPECT_EQ(e.stride(0), 0);
  EXPECT_EQ(e.item_as_double({4, 2, 3}), t.item_as_double({0, 2, 3}));
  EXPECT_EQ(t.unsqueeze(1).shape(), Shape({2, 1, 3, 4}));
  EXPECT_EQ(t.reshape({6, -1}).shape(), Shape({6, 4}));
  EXPECT_THROW(t.reshape({5, -1}), Error);
  EXPECT_THROW(t.select(0, 2), Error);
  EXPECT_THROW(t.permute({0, 0, 1}), Error);
}

TEST(Tensor, HalfConversionsRoundToNearestEven) {
  // Every f16 value converts to f32 and back exactly.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_f16(f), h) << std::hex << h;
  }
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // rounds up to inf
  EXPECT_EQ(f32_to_f16(1.0f + 0x1.0p-11f), 0x3c00);  // tie -> even
  EXPECT_EQ(f32_to_f16(1.0f + 0x1.8p-11f), 0x3c01);
  EXPECT_EQ(f32_to_f16(0x1.0p-25f), 0x0000);  // half of the smallest subnormal: tie -> 0
  EXPECT_EQ(f32_to_f16(0x1.8p-25f), 0x0001);
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1.0p-8f), 0x3f80);  // tie -> even
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1.8p-8f), 0x3f81);
  EXPECT_EQ(bf16_to_f32(0x3f81), 1.0f + 0x1.0p-7f);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
}

TEST(Tensor, ToConvertsBetweenDtypes) {
  const Tensor t = testing::randn({3, 5}).transpose(0, 1);
  for (DType dt : {DType::F64, DType::F16, DType::BF16, DType::F32}) {
    const Tensor c = t.to(dt);
    EXPECT_EQ(c.dtype(), dt);
    EXPECT_TRUE(c.is_contiguous());
    const double tol = dt == DType::F16 ? 1e-3 : dt == DType::BF16 ? 1e-2 : 0.0;
    testing::for_each_index(t.shape(), [&](const Shape& i) {
      const double a = t.item_as_double(i);
      EXPECT_NEAR(c.item_as_double(i), a, tol * std::fabs(a));
    });
  }
  const Tensor b = Tensor::from_vector<int64_t>({0, 3, -1, 0}, {4}).to(DType::Bool);
  EXPECT_EQ(b.item_as_double({0}), 0.0);
  EXPECT_EQ(b.item_as_double({1}), 1.0);
  EXPECT_EQ(b.item_as_double({2}), 1.0);
}

TEST(Tensor, ErrorsNameTheProblem) {
  EXPECT_THROW(Tensor::empty({-1, 3}, DType::F32), Error);
  EXPECT_THROW(Tensor::empty({int64_t{1} << 40, int64_t{1} << 40}, DType::F32), Error);
  // Zero elements, but the strides (and byte offsets of views) would overflow int64.
  const int64_t big = int64_t{1} << 62;
  EXPECT_THAT(testing::error_of([&] { Tensor::empty({0, big, big}, DType::F32); }), ::testing::HasSubstr("is too large"));
  EXPECT_THROW(Tensor::from_blob(nullptr, {0, big, 8}, DType::F32), Error);
  EXPECT_THROW(contiguous_strides({0, big, big}), Error);
  EXPECT_THROW(testing::randn({1, 2}).expand({big, big, 2}), Error);
  EXPECT_THROW(testing::randn({0, 2}).reshape({big, big, 0}), Error);
  EXPECT_THROW(testing::randn({4}).reshape({-2, -2}), Error);
  EXPECT_EQ(testing::randn({0, 2}).reshape({-1, 4}).shape(), Shape({0, 4}));
  const Tensor t = testing::randn({2});
  EXPECT_THROW(t.data<double>(), Error);
}

// Threads per parallel region: small work on the calling thread alone, never more than the tasks or
// the thread count, and the count checked.
TEST(Runtime, ThreadsFollowTheWork) {
  const int saved = get_num_threads();
  set_num_threads(4);
  EXPECT_EQ(threads_for(1e3, 1000), 1);                      // a few microseconds: one thread
  EXPECT_EQ(threads_for(2.5 * kMinFlopsPerThread, 1000), 2);  // one thread per kMinFlopsPerThread
  EXPECT_EQ(threads_for(1e12, 1000), 4);                     // at most the thread count
  EXPECT_EQ(threads_for(1e12, 3), 3);                        // at most the tasks
  EXPECT_EQ(threads_for(1e30, 0), 1);
  EXPECT_THAT(testing::error_of([] { set_num_threads(kMaxThreads + 1); }),
              ::testing::HasSubstr("set_num_threads: expected 1 to 1024 threads, got 1025"));
  EXPECT_THROW(set_num_threads(0), Error);
  EXPECT_EQ(get_num_threads(), 4);
  // Without the tests' oversubscription (testing.cc), never more than the CPUs this process has.
  set_oversubscribe(false);
  set_num_threads(omp_get_num_procs() + 5);
  EXPECT_EQ(threads_for(1e12, 1000), omp_get_num_procs());
  EXPECT_EQ(threads_for(1e12, 1), 1);
  set_oversubscribe(true);
  EXPECT_EQ(threads_for(1e12, 1000), omp_get_num_procs() + 5);
  set_num_threads(saved);
}

// Conversions into the integer dtypes saturate and map NaN to 0 (a C++ cast out of range is undefined).
TEST(Tensor, IntegerConversionsSaturate) {
  Tensor x = Tensor::empty({5}, DType::F32);
  const float v[5] = {300.0f, -300.0f, std::numeric_limits<float>::quiet_NaN(), 5.6f, -5.5f};
  std::copy(v, v + 5, x.data<float>());
  const Tensor i8 = x.to(DType::I8), u8 = x.to(DType::U8);
  const int8_t want_i8[5] = {127, -128, 0, 5, -5};  // truncation toward zero, as a cast
  const uint8_t want_u8[5] = {255, 0, 0, 5, 0};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(static_cast<const int8_t*>(i8.raw_data())[i], want_i8[i]) << i;
    EXPECT_EQ(static_cast<const uint8_t*>(u8.raw_data())[i], want_u8[i]) << i;
  }
}

}  // namespace
}  // namespace heads
