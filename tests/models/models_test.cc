// models_test.cc — the WordPiece tokenizer on the cases that separate it from naive versions,
// the sentence encoder's file errors, and attention rollout. The vocabulary and weights are the
// installed all-MiniLM-L6-v2 (found as `heads embed` finds it).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "common/testing.h"
#include "heads/sentence_encoder.h"
#include "heads/viz.h"

namespace heads {
namespace {

using ::testing::HasSubstr;

const WordPieceTokenizer& tok() {
  static const WordPieceTokenizer t =
      WordPieceTokenizer::from_vocab_file(SentenceEncoder::default_model_dir() + "/vocab.txt");
  return t;
}

std::vector<int64_t> ids(std::string_view s, int64_t max_len = 256) { return tok().encode(s, max_len).ids; }

TEST(Tokenizer, ReferenceCases) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(ids("this is a test sentence"), (V{101, 2023, 2003, 1037, 3231, 6251, 102}));
  EXPECT_EQ(ids("Héllo Wörld café"), (V{101, 7592, 2088, 7668, 102}));
  EXPECT_EQ(ids("cafe\xcc\x81"), (V{101, 7668, 102}));                               // NFD input
  EXPECT_EQ(ids("\xce\x9f\xce\x94\xce\x9f\xce\xa3"), (V{101, 1169, 29722, 29730, 29733, 102}));  // ΟΔΟΣ
  EXPECT_EQ(ids("a\xe2\x80\x8b" "b"), (V{101, 11113, 102}));                          // ZWSP deleted
  EXPECT_EQ(ids("co\xc2\xad" "operate"), (V{101, 17654, 102}));                       // soft hyphen
  EXPECT_EQ(ids("hello [MASK] x[SEP]y")[2], 103);                                     // raw special tokens
  EXPECT_EQ(ids("[mask]"), (V{101, 1031, 7308, 1033, 102}));
  EXPECT_NE(ids(std::string(100, 'a'))[1], 100);                                     // 100 chars: pieces
  EXPECT_EQ(ids(std::string(101, 'a')), (V{101, 100, 102}));                          // > 100 chars
  EXPECT_EQ(ids("hello\xf0\x9f\x98\x80world"), (V{101, 100, 102}));                   // emoji glued: [UNK]
  EXPECT_EQ(ids(""), (V{101, 102}));
  EXPECT_EQ(ids("\xff\xfe"), (V{101, 102}));  // invalid UTF-8 -> U+FFFD -> removed
  std::string many;
  for (int i = 0; i < 300; ++i) many += "word ";
  const auto e = tok().encode(many, 256);
  EXPECT_EQ(e.ids.size(), 256u);
  EXPECT_TRUE(e.truncated);
  EXPECT_EQ(e.ids.back(), 102);
}

TEST(SentenceEncoder, FileErrorsNameTheFile) {
  try {
    SentenceEncoder::load("/nonexistent/model");
    FAIL() << "no error";
  } catch (const Error& err) {
    EXPECT_THAT(err.what(), HasSubstr("/nonexistent/model: model directory not found"));
  }
  EXPECT_THROW(WordPieceTokenizer::from_vocab_file("/nonexistent/vocab.txt"), Error);
}

TEST(Viz, RolloutRowsAreDistributions) {
  std::vector<Tensor> layers;
  for (int l = 0; l < 3; ++l) {
    Tensor w = testing::randn({4, 5, 5});
    for (int64_t r = 0; r < 20; ++r) {  // softmax each row
      float* row = w.data<float>() + r * 5;
      float s = 0;
      for (int j = 0; j < 5; ++j) s += row[j] = std::exp(row[j]);
      for (int j = 0; j < 5; ++j) row[j] /= s;
    }
    layers.push_back(w);
  }
  const Tensor R = attention_rollout(layers);
  for (int64_t i = 0; i < 5; ++i) {
    double s = 0;
    for (int64_t j = 0; j < 5; ++j) {
      EXPECT_GE(R.item_as_double({i, j}), 0.0);
      s += R.item_as_double({i, j});
    }
    EXPECT_NEAR(s, 1.0, 1e-5);
  }
  EXPECT_THROW(render_attention_heads({"a", "b"}, testing::randn({2, 3, 3}), "t", "/tmp/x.png"), Error);
  EXPECT_THROW(render_attention_heads({"a"}, testing::randn({1, 1, 1}), "t", "/tmp/x.gif"), Error);
}

}  // namespace
}  // namespace heads
