// tokenizer_json_test.cc — the tokenizer.json engine (heads::Tokenizer) in C++, where the sanitizers
// see it: all-MiniLM-L6-v2's tokenizer.json against the independent vocab.txt WordPiece tokenizer on
// cases and long random texts, small inline pipelines (BPE merges, a character without an unk_token,
// a regex over characters newer than PCRE2's tables), and malformed files as errors naming the field.
// tests/python/test_tokenizers.py checks the engine against the tokenizers library itself.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "common/testing.h"
#include "heads/tokenizer.h"

namespace heads {
namespace {

using ::testing::HasSubstr;
using V = std::vector<int64_t>;

const Tokenizer& json_tok() {
  static const Tokenizer t = Tokenizer::from_file(testing::model_dir() + "/tokenizer.json");
  return t;
}

const WordPieceTokenizer& vocab_tok() {
  static const WordPieceTokenizer t = WordPieceTokenizer::from_vocab_file(testing::model_dir() + "/vocab.txt");
  return t;
}

// A tokenizer.json of `text` in a fresh file.
Tokenizer inline_tokenizer(const std::string& text) {
  const std::filesystem::path p =
      std::filesystem::temp_directory_path() / ("heads_tok_" + std::to_string(::getpid()) + ".json");
  std::ofstream(p) << text;
  struct Remove {
    std::filesystem::path p;
    ~Remove() { std::filesystem::remove(p); }
  } remove{p};
  return Tokenizer::from_file(p.string());
}

std::string random_text(uint64_t seed, size_t bytes) {
  std::mt19937_64 gen(seed);
  const char* parts[] = {"word", "Caf\xc3\xa9", "cafe\xcc\x81", "[SEP]", "x[MASK]y", "\t", "\n", "\xe6\x88\x91\xe7\x88\xb1",
                         "don't", "3.14", "\xcc\x81\xcc\xa3", "\xff", "un[CLS]ited", "a,b", "\xea\xb0\x80\xcc\x81",
                         "\xe2\x80\x8b", "\xf0\x9f\x98\x80"};
  std::string text;
  while (text.size() < bytes) {
    const size_t r = gen() % 22;
    text += r < 17 ? parts[r] : std::string(20 + gen() % 120, static_cast<char>('a' + r));
    if (gen() % 4 != 0) text += gen() % 3 == 0 ? "  " : " ";  // some parts glued: marks across the joins
  }
  return text;
}

TEST(TokenizerJson, MiniLmFileEqualsItsVocabTxt) {
  for (const char* s : {"this is a test sentence", "H\xc3\xa9llo W\xc3\xb6rld caf\xc3\xa9", "cafe\xcc\x81", "",
                        "hello [MASK] x[SEP]y", "[mask]", "hello\xf0\x9f\x98\x80world", "\xff\xfe", "a\xe2\x80\x8b" "b",
                        "\xe6\x88\x91\xe7\x88\xb1\xe5\x8c\x97\xe4\xba\xac", "  lead  trail  "}) {
    EXPECT_EQ(json_tok().encode(s, 256).ids, vocab_tok().encode(s, 256).ids) << s;
  }
  EXPECT_EQ(json_tok().encode("this is a test sentence", 256).ids, (V{101, 2023, 2003, 1037, 3231, 6251, 102}));
}

// Long texts cross the BertNormalizer's 16 KiB chunks and the growing prefixes of truncation.
TEST(TokenizerJson, LongTextsEqualTheVocabTxtTokenizer) {
  for (uint64_t seed : {1, 2, 3}) {
    const std::string text = random_text(seed, 70000);
    const auto whole = json_tok().encode(text, 1 << 20);
    EXPECT_FALSE(whole.truncated);
    EXPECT_EQ(whole.ids, vocab_tok().encode(text, 0).ids) << seed;
    for (int64_t max_len : {2, 3, 130, 5000}) {
      const auto a = json_tok().encode(text, max_len);
      const auto b = vocab_tok().encode(text, max_len);
      EXPECT_EQ(a.ids, b.ids) << seed << " " << max_len;
      EXPECT_EQ(a.truncated, b.truncated);
    }
  }
}

// Pairs: the file's BERT template against the vocab.txt tokenizer's own [CLS] a [SEP] b [SEP], token
// types and longest-first truncation included.
TEST(TokenizerJson, PairsEqualTheVocabTxtTokenizer) {
  const Tokenizer vocab = Tokenizer::from_wordpiece(vocab_tok());
  for (uint64_t seed : {4, 5, 6}) {
    const std::string a = random_text(seed, 300 * seed), b = random_text(seed + 10, 700);
    for (int64_t max_len : {3, 4, 17, 128, 100000}) {  // (0 is the file's truncation in tokenizer.json)
      for (const auto& [x, y] : {std::pair(a, b), std::pair(b, a), std::pair(a, std::string()),
                                 std::pair(std::string(), std::string())}) {
        const auto want = json_tok().encode_pair(x, y, max_len);
        const auto got = vocab.encode_pair(x, y, max_len);
        EXPECT_EQ(got.ids, want.ids) << seed << " " << max_len;
        EXPECT_EQ(got.type_ids, want.type_ids) << seed << " " << max_len;
        EXPECT_EQ(got.truncated, want.truncated) << seed << " " << max_len;
      }
    }
  }
  const auto e = vocab.encode_pair("a test", "hello", 0);
  EXPECT_EQ(e.ids, (V{101, 1037, 3231, 102, 7592, 102}));
  EXPECT_EQ(e.type_ids, (V{0, 0, 0, 0, 1, 1}));
  EXPECT_THAT(testing::error_of([&] { vocab.encode_pair("a", "b", 2); }), HasSubstr("max_length 2 leaves no room"));
}

TEST(TokenizerJson, BpeMergesAndCharactersWithoutUnk) {
  const Tokenizer t = inline_tokenizer(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "abab": 3},
                                           "merges": ["a b", "ab ab"]}})");
  EXPECT_EQ(t.encode("abab").ids, (V{3}));
  EXPECT_EQ(t.encode("aba").ids, (V{2, 0}));
  EXPECT_EQ(t.encode("acb").ids, (V{2}));  // no unk_token: "c" is dropped (then "a b" merge), as in tokenizers
  EXPECT_EQ(t.decode({3, 0}), "abab a");
}

// U+1385A (Egyptian hieroglyph, Unicode 16.0) is a letter to the reference's Oniguruma; Debian 12's
// PCRE2 (Unicode 14.0) would not know it.
TEST(TokenizerJson, RegexesSeeUnicode16Letters) {
  const Tokenizer t = inline_tokenizer(R"({"model": {"type": "WordLevel", "unk_token": "?",
      "vocab": {"?": 0, "x\ud80e\udc5ay": 1, "!": 2, "\u0cf3": 3}},
      "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\p{L}+|\\p{M}+"}, "behavior": "Isolated"}})");
  EXPECT_EQ(t.encode("x\xf0\x93\xa1\x9ay!").ids, (V{1, 2}));
  EXPECT_EQ(t.encode("\xe0\xb3\xb3").ids, (V{3}));  // U+0CF3, a Kannada mark of Unicode 15.0
}

TEST(TokenizerJson, MalformedFilesAreErrorsNamingTheField) {
  const auto error = [](const std::string& text) {
    try {
      inline_tokenizer(text);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(error("{\"model\": "), HasSubstr("not valid JSON"));
  EXPECT_THAT(error(R"({"model": {"type": "Nope"}})"), HasSubstr("model.type"));
  EXPECT_THAT(error(R"({"model": {"type": "WordLevel", "vocab": {"a": -3}}})"), HasSubstr("model.vocab"));
  EXPECT_THAT(error(R"({"model": {"type": "WordLevel", "vocab": {"a": 0}},
                        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(("}, "behavior": "Isolated"}})"),
              HasSubstr("does not compile"));
  EXPECT_THAT(error(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a q"]}})"), HasSubstr("merges"));
}

}  // namespace
}  // namespace heads
