// models_test.cc — the WordPiece tokenizer on the cases that separate it from naive versions,
// the sentence encoder's file errors, and attention rollout. The vocabulary and weights are the
// installed all-MiniLM-L6-v2 (found as `heads embed` finds it).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <cairo.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>

#include "common/testing.h"
#include "heads/cross_encoder.h"
#include "heads/safetensors.h"
#include "heads/sentence_encoder.h"
#include "heads/viz.h"

namespace heads {
namespace {

using ::testing::HasSubstr;

const WordPieceTokenizer& tok() {
  static const WordPieceTokenizer t =
      WordPieceTokenizer::from_vocab_file(testing::model_dir() + "/vocab.txt");
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

// encode() reads long texts in stretches cut after whitespace and stops once max_length is
// reached; where the cuts fall must not change a single id. Leading spaces (no pieces) move them.
TEST(Tokenizer, StretchesGiveTheIdsOfTheWholeText) {
  std::mt19937_64 gen(11);
  const char* parts[] = {"word", "Caf\xc3\xa9", "cafe\xcc\x81", "[SEP]", "x[MASK]y", "\t", "\n", "\xe6\x88\x91\xe7\x88\xb1",
                         "don't", "3.14", "\xcc\x81\xcc\xa3", "\xff", "un[CLS]ited", "a,b"};
  std::string text;
  while (text.size() < 40000) {
    const size_t r = gen() % 20;
    text += r < 14 ? parts[r] : std::string(60 + gen() % 120, static_cast<char>('a' + r));  // long: [UNK] past 100
    text += gen() % 3 == 0 ? "  " : " ";
  }
  const std::vector<int64_t> whole = tok().encode(text, 0).ids;
  EXPECT_GT(whole.size(), 2000u);
  for (int shift = 1; shift <= 40; shift += 3) {
    const std::string shifted = std::string(static_cast<size_t>(shift), ' ') + text;
    ASSERT_EQ(tok().encode(shifted, 0).ids, whole) << "shift " << shift;
    const auto e = tok().encode(shifted, 1000);
    ASSERT_TRUE(e.truncated);
    ASSERT_EQ(std::vector<int64_t>(e.ids.begin(), e.ids.end() - 1),
              std::vector<int64_t>(whole.begin(), whole.begin() + 999)) << "shift " << shift;
  }
}

// The portable path (HEADS_ISA=scalar: plain C++ kernels and GEMMs, no oneDNN) gives the fast
// path's embeddings.
TEST(SentenceEncoder, PortablePathGivesTheFastPathsEmbeddings) {
  const SentenceEncoder enc = SentenceEncoder::load(testing::model_dir());
  const std::vector<std::string> texts{"The cat sat on the mat.", "a", "Attention is all you need, they said."};
  const Tensor fast = enc.encode(texts, 32);
  testing::IsaGuard guard;
  set_isa(Isa::Scalar);
  const Tensor portable = enc.encode(texts, 32);
  const auto e = testing::compare(portable, fast);
  EXPECT_TRUE(e.within(0, 2e-6)) << "max difference " << e.max_abs << " (isa " << isa_name(guard.saved) << ")";
}

// Token types: all 0 is the plain forward; type 1 (MiniLM's second segment) changes the states of
// the tokens given it; bad types are errors naming the sequence.
TEST(SentenceEncoder, TokenTypesReachTheEmbeddings) {
  const SentenceEncoder enc = SentenceEncoder::load(testing::model_dir());
  const BertModel& bert = enc.bert();
  const std::vector<std::vector<int64_t>> ids{{101, 2023, 2003, 102, 7592, 102}, {101, 1037, 102}};
  const std::vector<std::vector<int64_t>> zeros{{0, 0, 0, 0, 0, 0}, {0, 0, 0}}, pair{{0, 0, 0, 0, 1, 1}, {0, 0, 0}};
  const Tensor plain = bert.forward(ids);
  EXPECT_TRUE(testing::bitwise_equal(bert.forward(ids, zeros), plain));
  const Tensor typed = bert.forward(ids, pair);
  const auto second = testing::compare(typed.select(0, 1), plain.select(0, 1));
  EXPECT_LE(second.max_abs, 1e-5);  // the other sequence of the batch: its rows are its own
  EXPECT_GT(testing::compare(typed.select(0, 0), plain.select(0, 0)).max_abs, 1e-2);
  EXPECT_THAT(testing::error_of([&] { bert.forward(ids, {{0, 0, 0, 0, 2, 0}, {0, 0, 0}}); }),
              HasSubstr("token type id 2 in sequence 0 outside the 2 types of the model"));
  EXPECT_THAT(testing::error_of([&] { bert.forward(ids, {{0, 0, 0, 0, 0, 0}, {0, 0}}); }),
              HasSubstr("sequence 1 has 3 token ids and 2 type ids"));
  EXPECT_THAT(testing::error_of([&] { bert.forward(ids, {{0}}); }), HasSubstr("1 sequences of type ids for 2"));
}

// A cross-encoder made of MiniLM's encoder and a random pooler + one-label classifier
// (testing::reranker_dir()): its scores are
// the head on the first token's state of BertModel::forward with the pair's token types, in float64.
TEST(CrossEncoder, ScoresAreTheHeadOnTheFirstTokenOfThePair) {
  const std::string dir = testing::reranker_dir();
  const SafeTensors w = SafeTensors::open(dir + "/model.safetensors");
  const Tensor pw = w.get("bert.pooler.dense.weight"), pb = w.get("bert.pooler.dense.bias");
  const Tensor cw = w.get("classifier.weight"), cb = w.get("classifier.bias");
  const int64_t E = 384;
  const CrossEncoder ce = CrossEncoder::load(dir);
  ASSERT_EQ(ce.num_labels(), 1);
  EXPECT_EQ(ce.max_length(), 512);  // MiniLM's tokenizer_config model_max_length, within its 512 positions
  const std::vector<CrossEncoder::Pair> pairs{{"how many people live in berlin?", "Berlin has 3.7 million people."},
                                              {"a", ""},
                                              {"what is attention", [] {
                                                std::string t;
                                                for (int i = 0; i < 700; ++i) t += "attention is all ";
                                                return t;
                                              }()}};
  int64_t truncated = -1;
  const Tensor s = ce.predict(pairs, ScoreActivation::Identity, 2, {}, &truncated);
  EXPECT_EQ(truncated, 1);
  const Tensor sig = ce.predict(pairs, ScoreActivation::Sigmoid);
  for (size_t i = 0; i < pairs.size(); ++i) {
    const auto e = ce.tokenizer().encode_pair(pairs[i].first, pairs[i].second, ce.max_length());
    const Tensor h = ce.bert().forward({e.ids}, {e.type_ids});
    double z = cb.data<float>()[0];
    for (int64_t j = 0; j < E; ++j) {
      double a = pb.data<float>()[j];
      for (int64_t k = 0; k < E; ++k) a += static_cast<double>(pw.data<float>()[j * E + k]) * h.data<float>()[k];
      z += std::tanh(a) * cw.data<float>()[j];
    }
    EXPECT_NEAR(s.data<float>()[i], z, 1e-5) << i;
    EXPECT_NEAR(sig.data<float>()[i], 1 / (1 + std::exp(-z)), 1e-6) << i;
  }
  EXPECT_THAT(testing::error_of([] { CrossEncoder::load(testing::model_dir()); }),
              HasSubstr("tensor \"classifier.weight\" missing: not a sequence-classification model"));
  EXPECT_THAT(testing::error_of([] { score_activation_from_name("tanh"); }),
              HasSubstr("activation \"tanh\" is not one of identity, sigmoid, softmax"));
}

TEST(SentenceEncoder, FileErrorsNameTheFile) {
  try {
    SentenceEncoder::load("/nonexistent/model");
    FAIL() << "no error";
  } catch (const Error& err) {
    EXPECT_THAT(err.what(), HasSubstr("/nonexistent/model: model directory not found"));
  }
  EXPECT_THAT(testing::error_of([] { SentenceEncoder::load(""); }), HasSubstr("model_dir is empty"));
  EXPECT_THROW(WordPieceTokenizer::from_vocab_file("/nonexistent/vocab.txt"), Error);
}

// A model directory like the installed one with one JSON file replaced: every field is checked for
// type and range, and the message names the file, the field and the value.
TEST(SentenceEncoder, ConfigFieldsAreCheckedForTypeAndRange) {
  namespace fs = std::filesystem;
  const fs::path src = testing::model_dir();
  const fs::path dir = fs::temp_directory_path() / ("heads_test_config_" + std::to_string(::getpid()));
  auto make = [&](const std::string& file, const std::string& text) {
    fs::remove_all(dir);
    fs::create_directories(dir / "1_Pooling");
    for (const char* f : {"model.safetensors", "vocab.txt", "config.json", "tokenizer_config.json",
                          "sentence_bert_config.json", "modules.json", "1_Pooling/config.json"}) {
      if (fs::exists(src / f)) fs::create_symlink(src / f, dir / f);
    }
    fs::remove(dir / file);
    std::ofstream(dir / file) << text;
  };
  auto error = [&](const std::string& file, const std::string& text) {
    make(file, text);
    return testing::error_of([&] { SentenceEncoder::load(dir.string()); });
  };
  std::ifstream in(src / "config.json");
  const std::string cfg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto with = [&](const std::string& field, const std::string& value) {  // config.json with one field replaced
    const size_t at = cfg.find("\"" + field + "\"");
    const size_t colon = cfg.find(':', at), end = cfg.find_first_of(",}", colon);
    return cfg.substr(0, colon + 1) + " " + value + cfg.substr(end);
  };
  EXPECT_EQ(error("config.json", cfg), "<no error>");
  EXPECT_THAT(error("config.json", with("hidden_size", "384.7")),
              HasSubstr("config.json: \"hidden_size\" must be an integer in [1, 16777216], got 384.7"));
  EXPECT_THAT(error("config.json", with("hidden_size", "1e30")), HasSubstr("\"hidden_size\" must be an integer"));
  EXPECT_THAT(error("config.json", with("num_hidden_layers", "-3")),
              HasSubstr("\"num_hidden_layers\" must be an integer in [1, 16777216], got -3"));
  EXPECT_THAT(error("config.json", with("vocab_size", "\"30522\"")), HasSubstr("\"vocab_size\" must be an integer"));
  EXPECT_THAT(error("config.json", with("layer_norm_eps", "-1")), HasSubstr("\"layer_norm_eps\" must be a number"));
  EXPECT_THAT(error("config.json", with("hidden_act", "5")), HasSubstr("\"hidden_act\" must be a string, got 5"));
  EXPECT_THAT(error("config.json", "[1, 2]"), HasSubstr("config.json: expected a JSON object, got array"));
  EXPECT_THAT(error("sentence_bert_config.json", R"({"max_seq_length": 1.5})"),
              HasSubstr("sentence_bert_config.json: \"max_seq_length\" must be an integer in [2, "));
  EXPECT_THAT(error("tokenizer_config.json", R"({"do_lower_case": "yes"})"),
              HasSubstr("\"do_lower_case\" must be true or false"));
  EXPECT_THAT(error("1_Pooling/config.json", R"({"pooling_mode_cls_token": 1})"),
              HasSubstr("\"pooling_mode_cls_token\" must be true or false"));
  EXPECT_THAT(error("modules.json", R"({"type": "x"})"), HasSubstr("modules.json: expected a JSON array, got object"));
  EXPECT_THAT(error("modules.json", R"([{"type": 3}])"), HasSubstr("\"type\" must be a string"));
  fs::remove_all(dir);
}

// The drawing of one matrix (the rollout): the title fits the canvas (its first and last columns
// stay blank), long titles are shortened rather than cut, and the single panel has no "head 0".
TEST(Viz, MatrixTitleFitsAndThePanelIsUnnamed) {
  const std::vector<std::string> tokens{"[CLS]", "the", "cat", "sat", "on", "the", "mat", "[SEP]"};
  Tensor m = testing::randn({8, 8});
  for (int64_t i = 0; i < 64; ++i) m.data<float>()[i] = std::fabs(m.data<float>()[i]);
  const std::string path = (std::filesystem::temp_directory_path() / "heads_test_rollout.png").string();
  for (const std::string title : {std::string("Attention rollout over 6 layers: \"The cat sat on the mat\""),
                                  "Attention rollout: \"" + std::string(400, 'w') + "\""}) {
    render_attention_matrix(tokens, m, title, path);
    cairo_surface_t* s = cairo_image_surface_create_from_png(path.c_str());
    ASSERT_EQ(cairo_surface_status(s), CAIRO_STATUS_SUCCESS);
    const int w = cairo_image_surface_get_width(s), stride = cairo_image_surface_get_stride(s);
    const auto* px = reinterpret_cast<const uint32_t*>(cairo_image_surface_get_data(s));
    auto ink = [&](int x0, int x1, int y0, int y1) {  // non-white pixels in [x0, x1) x [y0, y1)
      int n = 0;
      for (int y = y0; y < y1; ++y) {
        for (int x = x0; x < x1; ++x) n += (px[y * stride / 4 + x] & 0xffffff) != 0xffffff;
      }
      return n;
    };
    EXPECT_GT(ink(0, w, 8, 36), 200) << "no title drawn";
    EXPECT_EQ(ink(0, 12, 0, 60), 0) << "title clipped at the left edge (width " << w << ")";
    EXPECT_EQ(ink(w - 12, w, 0, 60), 0) << "title clipped at the right edge (width " << w << ")";
    EXPECT_LE(w, 1700);
    EXPECT_EQ(ink(0, w, 62, 90), 0) << "a panel title above the single matrix";
    cairo_surface_destroy(s);
  }
  std::filesystem::remove(path);
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
