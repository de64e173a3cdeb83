// safetensors_test.cc — round trips and every class of malformed file.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "common/testing.h"
#include "heads/safetensors.h"

namespace heads {
namespace {

using ::testing::HasSubstr;

std::string file_bytes(const std::string& header, const std::string& data) {
  std::string s;
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return s + header + data;
}

std::string error_of(const std::string& bytes) {
  try {
    SafeTensors::from_bytes(bytes, "bad.safetensors");
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

std::filesystem::path temp_path(const std::string& name) {
  return std::filesystem::temp_directory_path() / ("heads_test_" + name);
}

TEST(SafeTensors, RoundTripEveryDtype) {
  const auto path = temp_path("roundtrip.safetensors").string();
  const Tensor a = testing::randn({3, 4});
  const Tensor b = testing::randn({2, 5}).transpose(0, 1);  // stored contiguous
  const Tensor c = testing::rand_bool({7}, 0.5);
  const Tensor d = Tensor::from_vector<int64_t>({1, -2, 3}, {3});
  const Tensor e = a.to(DType::BF16), f = a.to(DType::F16), g = a.to(DType::F64);
  const Tensor u = Tensor::from_vector<uint8_t>({1, 2, 255}, {3});
  const Tensor z = Tensor::empty({0, 4}, DType::F32);
  save_safetensors(path, {{"a", a}, {"b", b}, {"c", c}, {"d", d}, {"e", e}, {"f", f}, {"g", g},
                          {"u", u}, {"z", z}},
                   {{"note", "test"}});
  const SafeTensors s = SafeTensors::open(path);
  EXPECT_EQ(s.metadata().at("note"), "test");
  EXPECT_EQ(s.names().size(), 9u);
  for (const auto& [name, t] : std::vector<std::pair<std::string, Tensor>>{
           {"a", a}, {"b", b}, {"c", c}, {"d", d}, {"e", e}, {"f", f}, {"g", g}, {"u", u}, {"z", z}}) {
    const Tensor r = s.get(name);
    EXPECT_EQ(r.dtype(), t.dtype()) << name;
    EXPECT_TRUE(testing::bitwise_equal(r, t)) << name;
  }
  EXPECT_THAT([&] {
    try { s.get("missing"); } catch (const Error& e) { return std::string(e.what()); }
    return std::string();
  }(), HasSubstr("tensor \"missing\" not found (have: "));
  std::filesystem::remove(path);
}

TEST(SafeTensors, MisalignedDataIsCopied) {
  // A header of odd length puts the F32 data at an address that is not 4-byte aligned.
  const std::string header = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  ASSERT_NE(header.size() % 4, 0u);
  float v[2] = {1.5f, -2.25f};
  const auto s = SafeTensors::from_bytes(file_bytes(header, std::string(reinterpret_cast<char*>(v), 8)));
  const Tensor x = s.get("x");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(x.raw_data()) % 4, 0u);
  EXPECT_EQ(x.item_as_double({1}), -2.25);
}

TEST(SafeTensors, MalformedFilesAreClearErrors) {
  const std::string ok = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data(8, '\0');
  EXPECT_EQ(error_of(file_bytes(ok, data)), "<no error>");
  EXPECT_THAT(error_of("abc"), HasSubstr("need at least the 8-byte header length"));
  std::string past = file_bytes(ok, data);
  past[0] = static_cast<char>(0xff);
  past[1] = static_cast<char>(0xff);
  EXPECT_THAT(error_of(past), HasSubstr("runs past the end of the file"));
  EXPECT_THAT(error_of(file_bytes("{not json", "")), HasSubstr("header is not valid JSON"));
  EXPECT_THAT(error_of(file_bytes("[1, 2]", "")), HasSubstr("header is not a JSON object"));
  EXPECT_THAT(error_of(file_bytes(R"({"x":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", data)),
              HasSubstr("unsupported dtype \"Q7\""));
  EXPECT_THAT(error_of(file_bytes(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", data)),
              HasSubstr("lie outside the data segment of 8 bytes"));
  EXPECT_THAT(error_of(file_bytes(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data)),
              HasSubstr("8 bytes do not match shape [3] of F32"));
  EXPECT_THAT(error_of(file_bytes(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                  R"("y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", data)),
              HasSubstr("overlap the previous tensor"));
  EXPECT_THAT(error_of(file_bytes(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", data)),
              HasSubstr("leave a gap"));
  EXPECT_THAT(error_of(file_bytes(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", data)),
              HasSubstr("tensors end at byte 4 but the data segment has 8 bytes"));
  EXPECT_THAT(error_of(file_bytes(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", data)),
              HasSubstr("reversed"));
  EXPECT_THAT(error_of(file_bytes(R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data)),
              HasSubstr("non-negative integers"));
  EXPECT_THAT(error_of(file_bytes(R"({"x":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,8]}})", data)),
              HasSubstr("shape [4294967296,4294967296,4] is too large"));
  // Zero elements, but strides and views of this shape would overflow (UBSan: signed overflow).
  EXPECT_THAT(error_of(file_bytes(R"({"x":{"dtype":"F32","shape":[0,4611686018427387904,4611686018427387904],)"
                                  R"("data_offsets":[0,0]}})", "")),
              HasSubstr("is too large"));
  EXPECT_THAT(error_of(file_bytes(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                  R"("x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data)),
              HasSubstr("header has the key \"x\" twice"));
  EXPECT_THAT(error_of(file_bytes(R"({"x":{"dtype":"F32","dtype":"F64","shape":[2],"data_offsets":[0,8]}})", data)),
              HasSubstr("header has the key \"dtype\" twice"));
  EXPECT_THAT(error_of(file_bytes(R"({"__metadata__":{"a":"1","a":"2"}})", "")), HasSubstr("key \"a\" twice"));
  EXPECT_EQ(error_of(file_bytes(R"({"__metadata__":{"a":"1"},"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                                data)),
            "<no error>");  // the same key in different objects is fine
  EXPECT_THAT(error_of(file_bytes(R"({"x":{"dtype":"F32","shape":[2]}})", data)),
              HasSubstr("data_offsets must be two non-negative integers"));
  EXPECT_THAT(error_of(file_bytes(R"({"__metadata__":{"a":1}})", "")), HasSubstr("is not a string"));
}

TEST(SafeTensors, OpenErrorsNameTheFile) {
  const auto missing = temp_path("does_not_exist.safetensors").string();
  try {
    SafeTensors::open(missing);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(missing));
  }
  const auto empty = temp_path("empty.safetensors").string();
  std::ofstream(empty).close();
  EXPECT_THROW(SafeTensors::open(empty), Error);
  std::filesystem::remove(empty);
}

TEST(SafeTensors, FailedSaveLeavesExistingFileUntouched) {
  const auto path = temp_path("keep.safetensors").string();
  save_safetensors(path, {{"a", testing::randn({2})}});
  const auto before = std::filesystem::file_size(path);
  EXPECT_THROW(save_safetensors(path, {{"a", testing::randn({3})}, {"a", testing::randn({3})}}), Error);
  EXPECT_EQ(std::filesystem::file_size(path), before);
  EXPECT_THROW(save_safetensors("/nonexistent-dir/x.safetensors", {{"a", testing::randn({2})}}), Error);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace heads
