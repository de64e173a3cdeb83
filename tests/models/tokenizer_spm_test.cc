// tokenizer_spm_test.cc — directories whose tokenizer is only a SentencePiece .model, in C++ where the
// sanitizers see the protobuf reader: small models written here byte by byte (unigram in XLM-RoBERTa's
// and T5's classes, BPE in Llama's with its merges made from the pieces), their ids worked out by
// hand; truncated and randomly changed models are errors, never a crash.
// tests/python/test_tokenizers_spm.py checks trained models against transformers itself.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "heads/tokenizer.h"

namespace heads {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using V = std::vector<int64_t>;

std::string varint(uint64_t v) {
  std::string s;
  do {
    s += static_cast<char>((v & 0x7F) | (v > 0x7F ? 0x80 : 0));
    v >>= 7;
  } while (v);
  return s;
}
std::string bytes_field(int number, const std::string& payload) {
  return varint(static_cast<uint64_t>(number) << 3 | 2) + varint(payload.size()) + payload;
}

// A ModelProto: pieces (text, score, type), trainer_spec.model_type (1 unigram, 2 BPE).
std::string model_proto(const std::vector<std::tuple<std::string, float, int>>& pieces, int model_type) {
  std::string m;
  for (const auto& [text, score, type] : pieces) {
    std::string p = bytes_field(1, text);
    p += varint(2 << 3 | 5);
    char f[4];
    std::memcpy(f, &score, 4);
    p.append(f, 4);
    p += varint(3 << 3) + varint(static_cast<uint64_t>(type));
    m += bytes_field(1, p);
  }
  m += bytes_field(2, varint(3 << 3) + varint(static_cast<uint64_t>(model_type)) + varint(40 << 3) + varint(0));
  return m;
}

const char* kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's space
std::string sp(const std::string& s) { return kSpace + s; }

std::string unigram_model() {
  return model_proto({{"<unk>", 0, 2}, {"<s>", 0, 3}, {"</s>", 0, 3}, {kSpace, -1, 1}, {"a", -2, 1}, {"b", -2, 1},
                      {sp("a"), -1.5f, 1}, {"ab", -1, 1}, {sp("ab"), -0.5f, 1}},
                     1);
}

std::string bpe_model() {
  return model_proto({{"<unk>", 0, 2}, {"<s>", 0, 3}, {"</s>", 0, 3}, {kSpace, 0, 1}, {"a", 0, 1}, {"b", 0, 1},
                      {sp("a"), 0, 1}, {"ab", 0, 1}, {sp("ab"), 0, 1}},
                     2);
}

// A fresh directory holding `file` (the model) and the given tokenizer_config.json / config.json.
class Dir {
 public:
  Dir(const std::string& file, const std::string& model, const std::string& tokenizer_config,
      const std::string& config = "") {
    static int n = 0;
    path_ = fs::temp_directory_path() / ("heads_spm_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::create_directories(path_);
    std::ofstream(path_ / file, std::ios::binary) << model;
    if (!tokenizer_config.empty()) std::ofstream(path_ / "tokenizer_config.json") << tokenizer_config;
    if (!config.empty()) std::ofstream(path_ / "config.json") << config;
  }
  ~Dir() { fs::remove_all(path_); }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

V ids(const Tokenizer& t, const std::string& text) { return t.encode(text).ids; }

TEST(TokenizerSpm, XlmRobertaShiftsThePiecesPastItsFourSpecialTokens) {
  const Dir d("sentencepiece.bpe.model", unigram_model(), R"({"tokenizer_class": "XLMRobertaTokenizerFast"})");
  const Tokenizer t = Tokenizer::from_directory(d.str());
  // <s> 0, <pad> 1, </s> 2, <unk> 3, then piece i at i + 1 (▁ 4, a 5, b 6, ▁a 7, ab 8, ▁ab 9), <mask> 10
  EXPECT_EQ(ids(t, "ab a"), (V{0, 9, 7, 2}));
  EXPECT_EQ(ids(t, "ab<mask>"), (V{0, 9, 10, 2}));
  EXPECT_EQ(ids(t, "ba"), (V{0, 4, 6, 5, 2}));  // ▁ b a: no piece starts "▁b"
  EXPECT_EQ(ids(t, "c"), (V{0, 4, 3, 2}));      // an unknown character: <unk>
  EXPECT_EQ(t.encode_pair("a", "b").ids, (V{0, 7, 2, 2, 4, 6, 2}));
  EXPECT_EQ(t.decode({0, 9, 7, 2}, true), "ab a");
  EXPECT_EQ(t.vocab_size(), 11);
}

TEST(TokenizerSpm, T5KeepsThePiecesAndAddsExtraIdsByModelType) {
  const Dir d("spiece.model", unigram_model(), R"({"extra_ids": 2})", R"({"model_type": "t5"})");
  const Tokenizer t = Tokenizer::from_directory(d.str());
  // the pieces as they are (▁ab 8), <extra_id_1> 9, <extra_id_0> 10; </s> appended
  EXPECT_EQ(ids(t, "ab a"), (V{8, 6, 2}));
  EXPECT_EQ(ids(t, "a<extra_id_0>"), (V{6, 10, 2}));
  EXPECT_EQ(t.vocab_size(), 11 + 1);  // and <pad>, not a piece here, after them
}

TEST(TokenizerSpm, LlamaMergesComeFromThePieces) {
  const Dir d("tokenizer.model", bpe_model(), R"({"tokenizer_class": "LlamaTokenizer", "add_bos_token": true})");
  const Tokenizer t = Tokenizer::from_directory(d.str());
  // merges (▁,a) (a,b) (▁,ab) (▁a,b), by the merged piece's id: "▁ab" = ▁a + b
  EXPECT_EQ(ids(t, "ab"), (V{1, 8}));
  EXPECT_EQ(ids(t, "b"), (V{1, 3, 5}));
  EXPECT_EQ(ids(t, "ab ab"), (V{1, 8, 8}));
  EXPECT_EQ(t.decode({1, 8, 8}, true), "ab ab");
}

std::string error_of(const std::string& model, const std::string& tc, const std::string& cfg = "") {
  const Dir d("tokenizer.model", model, tc, cfg);
  try {
    Tokenizer::from_directory(d.str());
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

TEST(TokenizerSpm, MalformedModelsAreErrorsNamingTheFileAndByte) {
  const std::string llama = R"({"tokenizer_class": "LlamaTokenizer"})";
  const std::string m = bpe_model();
  EXPECT_THAT(error_of(m.substr(0, m.size() - 1), llama), HasSubstr("not a SentencePiece model: "));
  EXPECT_THAT(error_of(m.substr(0, 7), llama), HasSubstr("past the end of its message"));
  EXPECT_THAT(error_of("", llama), HasSubstr("no pieces"));
  EXPECT_THAT(error_of(std::string(12, '\xff'), llama), HasSubstr("a varint longer than 10 bytes"));
  EXPECT_THAT(error_of(bytes_field(1, bytes_field(1, "\xc3")), llama), HasSubstr("not valid UTF-8"));
  EXPECT_THAT(error_of(m, R"({"tokenizer_class": "XLNetTokenizer"})"), HasSubstr("tokenizer_class \"XLNetTokenizer\""));
  EXPECT_THAT(error_of(m, "", R"({"model_type": "gpt2"})"), HasSubstr("got neither (model_type \"gpt2\")"));
  EXPECT_THAT(error_of(unigram_model(), llama), HasSubstr("this one is unigram"));
  EXPECT_THAT(error_of(model_proto({{"a", 0, 1}}, 3), llama), HasSubstr("model_type 3 (word / char)"));
}

TEST(TokenizerSpm, ChangedBytesLoadOrFailCleanly) {
  const std::string m = bpe_model();
  const std::string llama = R"({"tokenizer_class": "LlamaTokenizer", "add_bos_token": true})";
  std::mt19937_64 gen(9);
  int loaded = 0, failed = 0;
  for (int round = 0; round < 300; ++round) {
    std::string b = m;
    const int flips = 1 + static_cast<int>(gen() % 6);
    for (int i = 0; i < flips; ++i) b[gen() % b.size()] = static_cast<char>(gen());
    if (gen() % 4 == 0) b.resize(gen() % b.size());
    const Dir d("tokenizer.model", b, llama);
    try {
      const Tokenizer t = Tokenizer::from_directory(d.str());
      t.encode("ab ba c\xc3\xa9");
      ++loaded;
    } catch (const std::exception&) {
      ++failed;
    }
  }
  EXPECT_GT(loaded, 0);
  EXPECT_GT(failed, 0);
}

}  // namespace
}  // namespace heads
