// tokenizer_spm.cc — a directory whose tokenizer is only a SentencePiece .model, read as transformers
// reads it: the model's ModelProto (pieces, trainer and normaliser settings) turned into the
// tokenizer.json that its tokenizer class builds from it (transformers 5: XLMRobertaTokenizer,
// CamembertTokenizer, T5Tokenizer, LlamaTokenizer), which the tokenizer.json engine then runs. So
// the ids are those of AutoTokenizer.from_pretrained(DIR), not of the sentencepiece library where
// the two differ.
//
// The .model file is untrusted input: the protobuf wire format is read with every length checked
// against what is left, and an error names the file, the byte offset and the field.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unordered_map>

#include "config_json.h"
#include "heads/error.h"
#include "tokenizer_steps.h"
#include "unicode_text.h"

namespace heads::tok {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// sentencepiece_model.proto, the parts a tokenizer needs.
enum class PieceType { Normal = 1, Unknown = 2, Control = 3, UserDefined = 4, Unused = 5, Byte = 6 };
struct Piece {
  std::string text;
  float score = 0.0f;
  PieceType type = PieceType::Normal;
};
struct SpmModel {
  std::vector<Piece> pieces;
  int model_type = 1;  // 1 unigram, 2 BPE, 3 word, 4 char
  int64_t unk_id = 0;
  std::string charsmap;  // normalizer_spec.precompiled_charsmap (empty: none)
};

// Protobuf wire format over one message's bytes.
class Wire {
 public:
  Wire(std::string_view bytes, const std::string& file, size_t base) : b_(bytes), file_(file), base_(base) {}
  bool done() const { return pos_ >= b_.size(); }
  uint64_t varint(const char* what) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= b_.size()) fail_at(what, "ends inside a varint");
      const auto byte = static_cast<uint8_t>(b_[pos_++]);
      v |= uint64_t{byte & 0x7Fu} << shift;
      if (!(byte & 0x80)) return v;
    }
    fail_at(what, "a varint longer than 10 bytes");
  }
  // The next field's number and wire type.
  std::pair<uint64_t, int> key() {
    const uint64_t k = varint("field key");
    return {k >> 3, static_cast<int>(k & 7)};
  }
  std::string_view bytes(const char* what) {
    const uint64_t n = varint(what);
    if (n > b_.size() - pos_) fail_at(what, "a length of " + std::to_string(n) + " past the end of its message");
    const std::string_view s = b_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  float fixed32(const char* what) {
    if (b_.size() - pos_ < 4) fail_at(what, "ends inside a 32-bit field");
    float f;
    std::memcpy(&f, b_.data() + pos_, 4);
    pos_ += 4;
    return f;
  }
  void skip(int wire_type, const char* what) {
    switch (wire_type) {
      case 0: varint(what); return;
      case 1: need(8, what); pos_ += 8; return;
      case 2: bytes(what); return;
      case 5: need(4, what); pos_ += 4; return;
      default: fail_at(what, "wire type " + std::to_string(wire_type) + ", which protobuf does not have");
    }
  }
  size_t offset() const { return base_ + pos_; }
  Wire sub(std::string_view part) const {
    return Wire(part, file_, base_ + static_cast<size_t>(part.data() - b_.data()));
  }
  [[noreturn]] void fail_at(const char* what, const std::string& why) const {
    fail(file_, ": not a SentencePiece model: ", what, " at byte ", base_ + pos_, ": ", why);
  }

 private:
  void need(size_t n, const char* what) {
    if (b_.size() - pos_ < n) fail_at(what, "ends inside a fixed-size field");
  }
  std::string_view b_;
  const std::string& file_;
  size_t base_;
  size_t pos_ = 0;
};

Piece read_piece(Wire w) {
  Piece p;
  while (!w.done()) {
    const auto [field, type] = w.key();
    if (field == 1 && type == 2) {
      const std::string_view s = w.bytes("piece");
      if (text::to_utf8(text::decode_utf8(s)) != s) w.fail_at("piece", "not valid UTF-8");
      p.text = std::string(s);
    } else if (field == 2 && type == 5) {
      p.score = w.fixed32("score");
    } else if (field == 3 && type == 0) {
      const uint64_t t = w.varint("type");
      if (t < 1 || t > 6) w.fail_at("type", "unknown piece type " + std::to_string(t));
      p.type = static_cast<PieceType>(t);
    } else {
      w.skip(type, "piece field");
    }
  }
  return p;
}

SpmModel read_model(const std::string& bytes, const std::string& file) {
  SpmModel m;
  Wire w(bytes, file, 0);
  while (!w.done()) {
    const auto [field, type] = w.key();
    if (field == 1 && type == 2) {
      m.pieces.push_back(read_piece(w.sub(w.bytes("pieces"))));
    } else if (field == 2 && type == 2) {  // trainer_spec
      Wire t = w.sub(w.bytes("trainer_spec"));
      while (!t.done()) {
        const auto [f, ty] = t.key();
        if (f == 3 && ty == 0) m.model_type = static_cast<int>(t.varint("model_type"));
        else if (f == 40 && ty == 0) m.unk_id = static_cast<int32_t>(t.varint("unk_id"));  // int32: negatives sign-extend
        else t.skip(ty, "trainer_spec field");
      }
    } else if (field == 3 && type == 2) {  // normalizer_spec
      Wire n = w.sub(w.bytes("normalizer_spec"));
      while (!n.done()) {
        const auto [f, ty] = n.key();
        if (f == 2 && ty == 2) m.charsmap = std::string(n.bytes("precompiled_charsmap"));
        else n.skip(ty, "normalizer_spec field");
      }
    } else {
      w.skip(type, "model field");
    }
  }
  HEADS_CHECK(!m.pieces.empty(), file, ": not a SentencePiece model: no pieces");
  HEADS_CHECK(m.model_type == 1 || m.model_type == 2, file, ": SentencePiece model_type ", m.model_type,
              " (word / char) is not supported: unigram and BPE are");
  return m;
}

std::string base64(std::string_view in) {
  static constexpr char kAbc[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  for (size_t i = 0; i < in.size(); i += 3) {
    const size_t n = std::min<size_t>(3, in.size() - i);
    uint32_t v = 0;
    for (size_t k = 0; k < 3; ++k) v = (v << 8) | (k < n ? static_cast<uint8_t>(in[i + k]) : 0u);
    for (size_t k = 0; k < 4; ++k) out += k <= n ? kAbc[(v >> (18 - 6 * k)) & 63] : '=';
  }
  return out;
}

struct Added {
  std::string content;
  bool special;
  bool lstrip = false;
};

json added_token(int64_t id, const Added& a) {
  const std::string& content = a.content;
  const bool special = a.special;
  return {{"id", id},         {"content", content}, {"single_word", false}, {"lstrip", a.lstrip},
          {"rstrip", false},  {"normalized", false}, {"special", special}};
}

json metaspace(const std::string& scheme, bool split) {
  return {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}, {"prepend_scheme", scheme}, {"split", split}};
}

json special(const std::string& token, int64_t type_id = 0) {
  return {{"SpecialToken", {{"id", token}, {"type_id", type_id}}}};
}
json sequence(const char* which, int64_t type_id = 0) { return {{"Sequence", {{"id", which}, {"type_id", type_id}}}}; }

// A special token's text in tokenizer_config.json: a string or an AddedToken object {"content": ...}.
std::string token_setting(const json& tc, const char* key, const std::string& fallback, const fs::path& file) {
  if (!tc.contains(key) || tc[key].is_null()) return fallback;
  const json& v = tc[key];
  if (v.is_string()) return v.get<std::string>();
  HEADS_CHECK(v.is_object() && v.contains("content") && v["content"].is_string(), file.string(), ": ", key,
              ": expected a string or {\"content\": ...}");
  return v["content"].get<std::string>();
}

// A boolean of tokenizer_config.json, where transformers writes null for "the class's default".
bool flag(const json& tc, const char* key, bool fallback, const fs::path& file) {
  return tc.contains(key) && tc[key].is_null() ? fallback : models::json_bool(tc, key, fallback, file);
}

// transformers' generate_merges(vocab) without scores: every split of a piece into two pieces of the
// vocabulary, ordered by the piece's id, then by the lengths of the two halves.
json bpe_merges(const std::vector<Piece>& pieces, const std::unordered_map<std::string, int64_t>& id) {
  struct Merge {
    int64_t rank;
    size_t l, r;
    const std::string* whole;
  };
  std::vector<Merge> merges;
  for (size_t p = 0; p < pieces.size(); ++p) {
    const std::string& s = pieces[p].text;
    std::vector<std::tuple<int64_t, int64_t, size_t>> local;  // (id left, id right, split)
    for (size_t cut = 1; cut < s.size(); ++cut) {              // byte cuts, as Python's str slicing of UTF-8 would not
      if ((static_cast<uint8_t>(s[cut]) & 0xC0) == 0x80) continue;  // inside a character: not a Python index
      const auto l = id.find(s.substr(0, cut)), r = id.find(s.substr(cut));
      if (l != id.end() && r != id.end()) local.emplace_back(l->second, r->second, cut);
    }
    std::stable_sort(local.begin(), local.end(),
                     [](const auto& a, const auto& b) { return std::tie(std::get<0>(a), std::get<1>(a)) <
                                                                std::tie(std::get<0>(b), std::get<1>(b)); });
    for (const auto& [li, ri, cut] : local) merges.push_back({id.at(s), cut, s.size() - cut, &s});
  }
  // sorted by (piece id, len(left), len(right)) with lengths in characters, as Python counts them
  auto chars = [](const std::string& s, size_t from, size_t n) {
    size_t c = 0;
    for (size_t i = from; i < from + n; ++i) c += (static_cast<uint8_t>(s[i]) & 0xC0) != 0x80;
    return c;
  };
  std::stable_sort(merges.begin(), merges.end(), [&](const Merge& a, const Merge& b) {
    if (a.rank != b.rank) return a.rank < b.rank;
    const size_t al = chars(*a.whole, 0, a.l), bl = chars(*b.whole, 0, b.l);
    if (al != bl) return al < bl;
    return chars(*a.whole, a.l, a.r) < chars(*b.whole, b.l, b.r);
  });
  json out = json::array();
  for (const Merge& m : merges) out.push_back(json::array({m.whole->substr(0, m.l), m.whole->substr(m.l)}));
  return out;
}

}  // namespace

std::string sentencepiece_tokenizer_json(const std::string& model_file, const std::string& dir) {
  const fs::path d(dir), tcp = d / "tokenizer_config.json", cp = d / "config.json";
  std::ifstream in(model_file, std::ios::binary);
  HEADS_CHECK(in, model_file, ": cannot be read");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const SpmModel m = read_model(bytes, model_file);

  const json tc = models::read_json(tcp, false);
  std::string cls = models::json_string(tc, "tokenizer_class", "", tcp);
  if (cls.size() > 4 && cls.compare(cls.size() - 4, 4, "Fast") == 0) cls.resize(cls.size() - 4);
  if (cls.empty()) {  // AutoTokenizer's choice by model type
    const std::string type = models::json_string(models::read_json(cp, false), "model_type", "", cp);
    if (type == "xlm-roberta") cls = "XLMRobertaTokenizer";
    if (type == "camembert") cls = "CamembertTokenizer";
    if (type == "t5" || type == "mt5") cls = "T5Tokenizer";
    HEADS_CHECK(!cls.empty(), model_file, ": which tokenizer a SentencePiece model is for comes from ", tcp.string(),
                "'s tokenizer_class or ", cp.string(), "'s model_type; got neither (model_type \"", type,
                "\"); known: XLMRobertaTokenizer, CamembertTokenizer, T5Tokenizer, LlamaTokenizer");
  }
  const bool unigram = m.model_type == 1;
  json t = {{"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}};
  json model, normalizer = nullptr, pre, post, decoder;
  std::vector<Added> added;  // looked up in the vocabulary by content
  std::vector<std::string> vocab_text;
  if (!m.charsmap.empty()) normalizer = {{"type", "Precompiled"}, {"precompiled_charsmap", base64(m.charsmap)}};

  const bool xlmr = cls == "XLMRobertaTokenizer", camembert = cls == "CamembertTokenizer";
  if (xlmr || camembert || cls == "T5Tokenizer") {
    HEADS_CHECK(unigram, model_file, ": ", cls, " reads a unigram SentencePiece model; this one is BPE");
    json vocab = json::array();
    auto push = [&](const std::string& s, double score) {
      vocab.push_back(json::array({s, score}));
      vocab_text.push_back(s);
    };
    const bool prefix = flag(tc, "add_prefix_space", true, tcp);
    const std::string scheme = cls == "T5Tokenizer" || prefix ? "always" : "never";
    int64_t unk = 0;
    if (xlmr || camembert) {
      const std::string bos = token_setting(tc, "bos_token", "<s>", tcp), pad = token_setting(tc, "pad_token", "<pad>", tcp),
                        eos = token_setting(tc, "eos_token", "</s>", tcp), unk_t = token_setting(tc, "unk_token", "<unk>", tcp),
                        mask = token_setting(tc, "mask_token", "<mask>", tcp);
      if (xlmr) {  // fairseq's ids: 4 specials, the pieces past SentencePiece's 3, <mask>
        for (const std::string* s : {&bos, &pad, &eos, &unk_t}) push(*s, 0.0);
        for (size_t i = 3; i < m.pieces.size(); ++i) push(m.pieces[i].text, m.pieces[i].score);
        unk = 3;
      } else {  // CamemBERT's: 5 placeholders and specials, the pieces past SentencePiece's <unk>, <mask>
        push("<s>NOTUSED", 0.0), push(pad, 0.0), push("</s>NOTUSED", 0.0), push(unk_t, 0.0), push("<unk>NOTUSED", -100.0);
        for (size_t i = 1; i < m.pieces.size(); ++i) push(m.pieces[i].text, m.pieces[i].score);
        unk = std::find(vocab_text.begin(), vocab_text.end(), unk_t) - vocab_text.begin();
      }
      push(mask, 0.0);
      added = {{bos, true}, {pad, true}, {eos, true}, {unk_t, true}, {mask, true, camembert}};
      post = {{"type", "TemplateProcessing"},
              {"single", json::array({special(bos), sequence("A"), special(eos)})},
              {"pair", json::array({special(bos), sequence("A"), special(eos), special(eos), sequence("B"), special(eos)})},
              {"special_tokens", json::object()}};
    } else {  // T5: the pieces, then <extra_id_N> .. <extra_id_0>
      const int64_t extra = models::json_int(tc, "extra_ids", 100, tcp, 0, 1 << 20);
      for (const Piece& p : m.pieces) push(p.text, p.score);
      for (int64_t i = extra - 1; i >= 0; --i) push("<extra_id_" + std::to_string(i) + ">", 0.0);
      unk = 2;  // T5Tokenizer's constant (T5's models put <unk> there)
      const std::string eos = token_setting(tc, "eos_token", "</s>", tcp);
      added = {{token_setting(tc, "pad_token", "<pad>", tcp), true}, {eos, true}, {token_setting(tc, "unk_token", "<unk>", tcp), true}};
      for (int64_t i = 0; i < extra; ++i) added.push_back({"<extra_id_" + std::to_string(i) + ">", true});
      post = {{"type", "TemplateProcessing"},
              {"single", json::array({sequence("A"), special(eos)})},
              {"pair", json::array({sequence("A"), special(eos), sequence("B"), special(eos)})},
              {"special_tokens", json::object()}};
    }
    HEADS_CHECK(unk < static_cast<int64_t>(vocab.size()), model_file, ": ", vocab.size(), " pieces: no <unk> at ", unk);
    for (size_t i = 0; i < m.pieces.size(); ++i) {  // control pieces are special tokens too
      if (m.pieces[i].type == PieceType::Control) added.push_back({m.pieces[i].text, true});
    }
    model = {{"type", "Unigram"}, {"unk_id", unk}, {"vocab", vocab}, {"byte_fallback", false}};
    pre = {{"type", "Sequence"}, {"pretokenizers", json::array({{{"type", "WhitespaceSplit"}}, metaspace(scheme, true)})}};
    decoder = metaspace(scheme, true);
  } else if (cls == "LlamaTokenizer") {
    HEADS_CHECK(!unigram, model_file, ": LlamaTokenizer reads a BPE SentencePiece model; this one is unigram");
    std::unordered_map<std::string, int64_t> id;
    json vocab = json::object();
    for (size_t i = 0; i < m.pieces.size(); ++i) {
      id.emplace(m.pieces[i].text, static_cast<int64_t>(i));  // SentencePiece has no duplicates; the first would win
      vocab_text.push_back(m.pieces[i].text);
    }
    for (const auto& [s, i] : id) vocab[s] = i;
    const bool prefix = flag(tc, "add_prefix_space", true, tcp);
    const bool legacy = flag(tc, "legacy", false, tcp);
    const bool bos_on = flag(tc, "add_bos_token", false, tcp);
    const bool eos_on = flag(tc, "add_eos_token", false, tcp);
    const std::string unk_t = token_setting(tc, "unk_token", "<unk>", tcp), bos = token_setting(tc, "bos_token", "<s>", tcp),
                      eos = token_setting(tc, "eos_token", "</s>", tcp);
    model = {{"type", "BPE"},          {"dropout", nullptr},          {"unk_token", nullptr},
             {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr}, {"fuse_unk", true},
             {"byte_fallback", true},  {"ignore_merges", false},      {"vocab", vocab},
             {"merges", bpe_merges(m.pieces, id)}};
    normalizer = nullptr;
    pre = metaspace(prefix ? (legacy ? "always" : "first") : "never", false);
    json steps = json::array({{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}},
                              {{"type", "ByteFallback"}}, {{"type", "Fuse"}}});
    if (prefix) steps.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
    decoder = {{"type", "Sequence"}, {"decoders", steps}};
    added = {{unk_t, true}, {bos, true}, {eos, true}};
    for (const Piece& p : m.pieces) {
      if (p.type == PieceType::Control || p.type == PieceType::UserDefined) added.push_back({p.text, p.type == PieceType::Control});
    }
    json single = json::array(), pair = json::array();
    if (bos_on) single.push_back(special(bos));
    single.push_back(sequence("A"));
    if (eos_on) single.push_back(special(eos));
    pair = single;
    if (bos_on) pair.push_back(special(bos, 1));
    pair.push_back(sequence("B", 1));
    if (eos_on) pair.push_back(special(eos, 1));
    post = {{"type", "TemplateProcessing"}, {"single", single}, {"pair", pair}, {"special_tokens", json::object()}};
  } else {
    fail(model_file, ": tokenizer_class \"", cls, "\" is not read from a SentencePiece model (XLMRobertaTokenizer, ",
         "CamembertTokenizer, T5Tokenizer, LlamaTokenizer are); write its tokenizer.json once with transformers: "
         "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)");
  }

  // Added tokens by content: the vocabulary's id where the piece is in it, else the next free id.
  std::unordered_map<std::string, int64_t> first;
  for (size_t i = 0; i < vocab_text.size(); ++i) first.emplace(vocab_text[i], static_cast<int64_t>(i));
  int64_t next = static_cast<int64_t>(vocab_text.size());
  std::vector<std::pair<int64_t, json>> tokens;
  std::unordered_map<std::string, int64_t> added_id;
  for (const Added& a : added) {
    if (added_id.count(a.content)) continue;
    const auto f = first.find(a.content);
    const int64_t tid = f != first.end() ? f->second : next++;
    added_id.emplace(a.content, tid);
    tokens.emplace_back(tid, added_token(tid, a));
  }
  std::stable_sort(tokens.begin(), tokens.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  json added_tokens = json::array();
  for (auto& [tid, j] : tokens) added_tokens.push_back(std::move(j));

  // The template's special tokens with their ids.
  for (const char* which : {"single", "pair"}) {
    for (const json& piece : post[which]) {
      if (!piece.contains("SpecialToken")) continue;
      const std::string s = piece["SpecialToken"]["id"].get<std::string>();
      const auto f = added_id.find(s);
      HEADS_CHECK(f != added_id.end(), model_file, ": special token \"", s, "\" has no id");
      post["special_tokens"][s] = {{"id", s}, {"ids", json::array({f->second})}, {"tokens", json::array({s})}};
    }
  }
  t["added_tokens"] = added_tokens;
  t["normalizer"] = normalizer;
  t["pre_tokenizer"] = pre;
  t["post_processor"] = post;
  t["decoder"] = decoder;
  t["model"] = model;
  return t.dump();
}

}  // namespace heads::tok
