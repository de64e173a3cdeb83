// tokenizer_load.cc — tokenizer.json into a pipeline of steps (tokenizer_steps.h). The file is
// untrusted: every field is type-checked and every id bounded, and errors name the field.
#include <nlohmann/json.hpp>

#include <algorithm>

#include "heads/error.h"
#include "tokenizer_steps.h"

namespace heads::tok {

using nlohmann::json;

namespace {

constexpr int64_t kMaxId = int64_t{1} << 26;  // past any real vocabulary (the largest have ~260k entries)

struct Reader {
  const std::string& label;

  [[noreturn]] void fail(const std::string& field, const std::string& why) const {
    ::heads::fail(label, ": ", field, ": ", why);
  }
  const json& object(const json& j, const std::string& field) const {
    if (!j.is_object()) fail(field, "expected an object, got " + std::string(j.type_name()));
    return j;
  }
  // j[key] if present and not null, else nullptr.
  const json* opt(const json& j, const char* key) const {
    const auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }
  std::string str(const json& j, const char* key, const std::string& field, const char* dflt = nullptr) const {
    const json* v = opt(j, key);
    if (!v) {
      if (dflt) return dflt;
      fail(field + "." + key, "missing");
    }
    if (!v->is_string()) fail(field + "." + key, "expected a string, got " + std::string(v->type_name()));
    return v->get<std::string>();
  }
  bool boolean(const json& j, const char* key, const std::string& field, bool dflt) const {
    const json* v = opt(j, key);
    if (!v) return dflt;
    if (!v->is_boolean()) fail(field + "." + key, "expected true or false, got " + v->dump());
    return v->get<bool>();
  }
  int64_t integer(const json& j, const std::string& field, int64_t lo, int64_t hi) const {
    if (!j.is_number_integer() && !j.is_number_unsigned()) fail(field, "expected an integer, got " + j.dump());
    const auto v = j.get<int64_t>();
    if (j.is_number_unsigned() && j.get<uint64_t>() > static_cast<uint64_t>(hi)) fail(field, "out of range: " + j.dump());
    if (v < lo || v > hi) fail(field, "out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]: " + j.dump());
    return v;
  }
  int64_t integer(const json& j, const char* key, const std::string& field, int64_t dflt, int64_t lo,
                  int64_t hi) const {
    const json* v = opt(j, key);
    return v ? integer(*v, field + "." + key, lo, hi) : dflt;
  }
  const json& array(const json& j, const char* key, const std::string& field) const {
    const json* v = opt(j, key);
    if (!v || !v->is_array()) fail(field + "." + key, v ? "expected an array" : "missing");
    return *v;
  }
  Pattern pattern(const json& j, const std::string& field) const {
    const json* p = opt(object(j, field), "pattern");
    if (!p || !p->is_object()) fail(field + ".pattern", "expected {\"String\": ...} or {\"Regex\": ...}");
    if (p->contains("String") && (*p)["String"].is_string()) return Pattern::literal((*p)["String"].get<std::string>());
    if (p->contains("Regex") && (*p)["Regex"].is_string()) {
      return Pattern::regex((*p)["Regex"].get<std::string>(), label + ": " + field + ".pattern");
    }
    fail(field + ".pattern", "expected {\"String\": ...} or {\"Regex\": ...}, got " + p->dump());
  }
  SplitBehavior behavior(const json& j, const std::string& field, const char* dflt) const {
    const std::string b = str(j, "behavior", field, dflt);
    if (b == "Removed") return SplitBehavior::Removed;
    if (b == "Isolated") return SplitBehavior::Isolated;
    if (b == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
    if (b == "MergedWithNext") return SplitBehavior::MergedWithNext;
    if (b == "Contiguous") return SplitBehavior::Contiguous;
    fail(field + ".behavior", "unknown \"" + b + "\"");
  }
  // Metaspace's prepend scheme, from "prepend_scheme" or the older "add_prefix_space".
  std::string prepend_scheme(const json& j, const std::string& field) const {
    if (opt(j, "prepend_scheme")) {
      const std::string s = str(j, "prepend_scheme", field);
      if (s != "always" && s != "first" && s != "never") fail(field + ".prepend_scheme", "unknown \"" + s + "\"");
      return s;
    }
    return boolean(j, "add_prefix_space", field, true) ? "always" : "never";
  }
};

std::string base64_decode(const std::string& in, const Reader& r, const std::string& field) {
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char ch : in) {
    int v;
    if (ch >= 'A' && ch <= 'Z') v = ch - 'A';
    else if (ch >= 'a' && ch <= 'z') v = ch - 'a' + 26;
    else if (ch >= '0' && ch <= '9') v = ch - '0' + 52;
    else if (ch == '+') v = 62;
    else if (ch == '/') v = 63;
    else if (ch == '=' || ch == '\n' || ch == '\r') continue;
    else r.fail(field, "not base64");
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return out;
}

void add_normalizer(const json& j, const std::string& field, const Reader& r, std::vector<Normalizer>& out) {
  r.object(j, field);
  const std::string type = r.str(j, "type", field);
  if (type == "Sequence") {
    const json& a = r.array(j, "normalizers", field);
    for (size_t i = 0; i < a.size(); ++i) add_normalizer(a[i], field + ".normalizers[" + std::to_string(i) + "]", r, out);
  } else if (type == "BertNormalizer") {
    const bool lower = r.boolean(j, "lowercase", field, true);
    out.push_back(bert_normalizer(r.boolean(j, "clean_text", field, true), r.boolean(j, "handle_chinese_chars", field, true),
                                  r.boolean(j, "strip_accents", field, lower), lower));
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    out.push_back(unicode_normalizer(type));
  } else if (type == "Lowercase") {
    out.push_back(lowercase_normalizer());
  } else if (type == "StripAccents") {
    out.push_back(strip_accents_normalizer());
  } else if (type == "Strip") {
    out.push_back(strip_normalizer(r.boolean(j, "strip_left", field, true), r.boolean(j, "strip_right", field, true)));
  } else if (type == "Replace") {
    out.push_back(replace_normalizer(r.pattern(j, field), r.str(j, "content", field)));
  } else if (type == "Prepend") {
    out.push_back(prepend_normalizer(r.str(j, "prepend", field)));
  } else if (type == "Nmt") {
    out.push_back(nmt_normalizer());
  } else if (type == "ByteLevel") {
    out.push_back(byte_level_normalizer());
  } else if (type == "Precompiled") {
    const std::string map = base64_decode(r.str(j, "precompiled_charsmap", field, ""), r, field + ".precompiled_charsmap");
    if (!map.empty()) out.push_back(precompiled_normalizer(map, r.label + ": " + field + ".precompiled_charsmap"));
  } else {
    r.fail(field + ".type", "normalizer \"" + type + "\" is not supported");
  }
}

void add_pre_tokenizer(const json& j, const std::string& field, const Reader& r, std::vector<PreTokenizer>& out) {
  r.object(j, field);
  const std::string type = r.str(j, "type", field);
  if (type == "Sequence") {
    const json& a = r.array(j, "pretokenizers", field);
    for (size_t i = 0; i < a.size(); ++i) {
      add_pre_tokenizer(a[i], field + ".pretokenizers[" + std::to_string(i) + "]", r, out);
    }
  } else if (type == "BertPreTokenizer") {
    out.push_back(bert_pre_tokenizer());
  } else if (type == "Whitespace") {
    out.push_back(whitespace_pre_tokenizer());
  } else if (type == "WhitespaceSplit") {
    out.push_back(whitespace_split_pre_tokenizer());
  } else if (type == "Metaspace") {
    out.push_back(metaspace_pre_tokenizer(r.str(j, "replacement", field, "\xE2\x96\x81"), r.prepend_scheme(j, field),
                                          r.boolean(j, "split", field, true)));
  } else if (type == "ByteLevel") {
    out.push_back(byte_level_pre_tokenizer(r.boolean(j, "add_prefix_space", field, true),
                                           r.boolean(j, "use_regex", field, true)));
  } else if (type == "Split") {
    out.push_back(split_pre_tokenizer(r.pattern(j, field), r.behavior(j, field, nullptr),
                                      r.boolean(j, "invert", field, false)));
  } else if (type == "Punctuation") {
    out.push_back(punctuation_pre_tokenizer(r.behavior(j, field, "Isolated")));
  } else if (type == "Digits") {
    out.push_back(digits_pre_tokenizer(r.boolean(j, "individual_digits", field, false)));
  } else if (type == "CharDelimiterSplit") {
    const std::u32string d = [&] {
      std::u32string u;
      for (unsigned char ch : r.str(j, "delimiter", field)) u.push_back(ch);
      return u;
    }();
    if (d.size() != 1) r.fail(field + ".delimiter", "expected one ASCII character");
    out.push_back(char_delimiter_pre_tokenizer(d[0]));
  } else {
    r.fail(field + ".type", "pre-tokenizer \"" + type + "\" is not supported");
  }
}

void add_decoder(const json& j, const std::string& field, const Reader& r, std::vector<Decoder>& out) {
  r.object(j, field);
  const std::string type = r.str(j, "type", field);
  if (type == "Sequence") {
    const json& a = r.array(j, "decoders", field);
    for (size_t i = 0; i < a.size(); ++i) add_decoder(a[i], field + ".decoders[" + std::to_string(i) + "]", r, out);
  } else if (type == "ByteLevel") {
    out.push_back(byte_level_decoder());
  } else if (type == "Metaspace") {
    out.push_back(metaspace_decoder(r.str(j, "replacement", field, "\xE2\x96\x81"), r.prepend_scheme(j, field) != "never"));
  } else if (type == "WordPiece") {
    out.push_back(wordpiece_decoder(r.str(j, "prefix", field, "##"), r.boolean(j, "cleanup", field, true)));
  } else if (type == "BPEDecoder") {
    out.push_back(bpe_decoder(r.str(j, "suffix", field, "</w>")));
  } else if (type == "Replace") {
    out.push_back(replace_decoder(r.pattern(j, field), r.str(j, "content", field)));
  } else if (type == "ByteFallback") {
    out.push_back(byte_fallback_decoder());
  } else if (type == "Fuse") {
    out.push_back(fuse_decoder());
  } else if (type == "Strip") {
    out.push_back(strip_decoder(r.str(j, "content", field), r.integer(j, "start", field, 0, 0, kMaxId),
                                r.integer(j, "stop", field, 0, 0, kMaxId)));
  } else {
    r.fail(field + ".type", "decoder \"" + type + "\" is not supported");
  }
}

// {token: id} into the vocabulary (a later duplicate id wins the token's slot).
void read_vocab_map(const json& m, const std::string& field, const Reader& r, Vocab& v) {
  if (!m.is_object()) r.fail(field, "expected an object {token: id}");
  for (const auto& [tok, idj] : m.items()) {
    const int64_t id = r.integer(idj, field + "[\"" + tok + "\"]", 0, kMaxId - 1);
    if (static_cast<int64_t>(v.tokens.size()) <= id) v.tokens.resize(static_cast<size_t>(id) + 1);
    v.tokens[static_cast<size_t>(id)] = tok;
    v.ids[tok] = id;
  }
}

int64_t token_id(const Vocab& v, const json& m, const char* key, const std::string& field, const Reader& r) {
  const json* t = r.opt(m, key);
  if (!t) return -1;
  if (!t->is_string()) r.fail(field + "." + key, "expected a string");
  const int64_t id = v.find(t->get<std::string>());
  if (id < 0) r.fail(field + "." + key, "\"" + t->get<std::string>() + "\" is not in the vocabulary");
  return id;
}

void load_model(const json& m, const Reader& r, Pipeline& p) {
  const std::string f = "model";
  r.object(m, f);
  const std::string type = r.str(m, "type", f, "");
  const json* vocab_map = r.opt(m, "vocab");
  if (type == "WordPiece" || type == "WordLevel" || type == "BPE") {
    if (!vocab_map) r.fail(f + ".vocab", "missing");
    read_vocab_map(*vocab_map, f + ".vocab", r, p.vocab);
  }
  if (type == "WordPiece") {
    const int64_t unk = token_id(p.vocab, m, "unk_token", f, r);
    if (unk < 0) r.fail(f + ".unk_token", "missing");
    p.model = wordpiece_model(p.vocab, unk, r.str(m, "continuing_subword_prefix", f, "##"),
                              r.integer(m, "max_input_chars_per_word", f, 100, 1, kMaxId));
  } else if (type == "WordLevel") {
    p.model = wordlevel_model(p.vocab, token_id(p.vocab, m, "unk_token", f, r));
  } else if (type == "BPE") {
    if (r.opt(m, "dropout") && m["dropout"].is_number() && m["dropout"].get<double>() > 0) {
      r.fail(f + ".dropout", "BPE dropout is random; heads tokenizes deterministically (set it to null)");
    }
    BpeOptions o;
    o.unk = token_id(p.vocab, m, "unk_token", f, r);
    o.continuing_subword_prefix = r.str(m, "continuing_subword_prefix", f, "");
    o.end_of_word_suffix = r.str(m, "end_of_word_suffix", f, "");
    o.fuse_unk = r.boolean(m, "fuse_unk", f, false);
    o.byte_fallback = r.boolean(m, "byte_fallback", f, false);
    o.ignore_merges = r.boolean(m, "ignore_merges", f, false);
    const json& merges = r.array(m, "merges", f);
    std::vector<std::pair<std::pair<int64_t, int64_t>, int64_t>> ms;
    ms.reserve(merges.size());
    const size_t plen = o.continuing_subword_prefix.size();
    for (size_t i = 0; i < merges.size(); ++i) {
      const std::string fi = f + ".merges[" + std::to_string(i) + "]";
      std::string a, b;
      if (merges[i].is_string()) {
        const std::string s = merges[i].get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) r.fail(fi, "expected \"a b\", got \"" + s + "\"");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (merges[i].is_array() && merges[i].size() == 2 && merges[i][0].is_string() && merges[i][1].is_string()) {
        a = merges[i][0].get<std::string>();
        b = merges[i][1].get<std::string>();
      } else {
        r.fail(fi, "expected \"a b\" or [\"a\", \"b\"]");
      }
      const int64_t ia = p.vocab.find(a), ib = p.vocab.find(b);
      if (ia < 0 || ib < 0) r.fail(fi, "\"" + (ia < 0 ? a : b) + "\" is not in the vocabulary");
      const std::string merged = a + (plen && b.compare(0, plen, o.continuing_subword_prefix) == 0 ? b.substr(plen) : b);
      const int64_t im = p.vocab.find(merged);
      if (im < 0) r.fail(fi, "the merge \"" + merged + "\" is not in the vocabulary");
      ms.push_back({{ia, ib}, im});
    }
    p.model = bpe_model(p.vocab, std::move(ms), std::move(o));
  } else if (type == "Unigram") {
    const json& voc = r.array(m, "vocab", f);
    std::vector<double> scores;
    for (size_t i = 0; i < voc.size(); ++i) {
      const json& e = voc[i];
      const std::string fi = f + ".vocab[" + std::to_string(i) + "]";
      if (!e.is_array() || e.size() != 2 || !e[0].is_string() || !e[1].is_number()) r.fail(fi, "expected [piece, score]");
      if (static_cast<int64_t>(i) >= kMaxId) r.fail(f + ".vocab", "too many pieces");
      p.vocab.tokens.push_back(e[0].get<std::string>());
      p.vocab.ids[e[0].get<std::string>()] = static_cast<int64_t>(i);  // a later duplicate wins
      scores.push_back(e[1].get<double>());
    }
    if (voc.empty()) r.fail(f + ".vocab", "empty");
    const int64_t unk = r.integer(m, "unk_id", f, -1, 0, static_cast<int64_t>(voc.size()) - 1);
    p.model = unigram_model(p.vocab, std::move(scores), unk, r.boolean(m, "byte_fallback", f, false));
  } else {
    r.fail(f + ".type", "model \"" + type + "\" is not supported (WordPiece, BPE, Unigram, WordLevel)");
  }
}

// ids of a special token of a post-processor: [token, id] (Bert/Roberta) or the template's map.
TemplatePiece special_piece(const json& j, const std::string& field, const Reader& r, int64_t vocab) {
  if (!j.is_array() || j.size() != 2 || !j[0].is_string()) r.fail(field, "expected [token, id]");
  return {-1, {r.integer(j[1], field + "[1]", 0, vocab - 1)}, 0};
}

void load_post(const json& j, const std::string& field, const Reader& r, Pipeline& p, int64_t vocab) {
  r.object(j, field);
  const std::string type = r.str(j, "type", field);
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    const json& a = r.array(j, "processors", field);
    for (size_t i = 0; i < a.size(); ++i) load_post(a[i], field + ".processors[" + std::to_string(i) + "]", r, p, vocab);
    return;
  }
  if (!p.post.single.empty()) r.fail(field, "more than one post-processor adds special tokens");
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    const TemplatePiece cls = special_piece(j.value("cls", json()), field + ".cls", r, vocab);
    const TemplatePiece sep = special_piece(j.value("sep", json()), field + ".sep", r, vocab);
    const bool roberta = type == "RobertaProcessing";
    TemplatePiece sep1 = sep;
    if (!roberta) sep1.type_id = 1;
    p.post.single = {cls, {0, {}, 0}, sep};
    p.post.pair = {cls, {0, {}, 0}, sep};
    if (roberta) p.post.pair.push_back(sep);
    p.post.pair.push_back({1, {}, roberta ? 0 : 1});
    p.post.pair.push_back(sep1);
  } else if (type == "TemplateProcessing") {
    const json& specials = j.value("special_tokens", json::object());
    const auto read = [&](const char* key, std::vector<TemplatePiece>& out) {
      const json& a = r.array(j, key, field);
      for (size_t i = 0; i < a.size(); ++i) {
        const std::string fi = field + "." + key + "[" + std::to_string(i) + "]";
        const json& e = a[i];
        if (e.contains("Sequence") && e["Sequence"].is_object()) {
          const std::string id = r.str(e["Sequence"], "id", fi + ".Sequence");
          if (id != "A" && id != "B") r.fail(fi + ".Sequence.id", "expected \"A\" or \"B\"");
          out.push_back({id == "A" ? 0 : 1, {}, r.integer(e["Sequence"], "type_id", fi + ".Sequence", 0, 0, kMaxId)});
        } else if (e.contains("SpecialToken") && e["SpecialToken"].is_object()) {
          const std::string id = r.str(e["SpecialToken"], "id", fi + ".SpecialToken");
          if (!specials.is_object() || !specials.contains(id)) r.fail(fi, "special token \"" + id + "\" not in special_tokens");
          const json& ids = r.array(specials[id], "ids", field + ".special_tokens." + id);
          TemplatePiece t{-1, {}, r.integer(e["SpecialToken"], "type_id", fi + ".SpecialToken", 0, 0, kMaxId)};
          for (const auto& x : ids) t.ids.push_back(r.integer(x, field + ".special_tokens." + id + ".ids", 0, vocab - 1));
          out.push_back(std::move(t));
        } else {
          r.fail(fi, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
        }
      }
    };
    read("single", p.post.single);
    if (r.opt(j, "pair")) read("pair", p.post.pair);
  } else {
    r.fail(field + ".type", "post-processor \"" + type + "\" is not supported");
  }
}

}  // namespace

std::shared_ptr<const Pipeline> load_pipeline(std::string_view json_text, const std::string& label) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    ::heads::fail(label, ": not valid JSON (", e.what(), ")");
  }
  const Reader r{label};
  r.object(j, "tokenizer.json");
  auto p = std::make_shared<Pipeline>();
  if (!j.contains("model")) r.fail("model", "missing");
  load_model(j["model"], r, *p);
  // added tokens: their ids may extend the vocabulary
  if (const json* a = r.opt(j, "added_tokens")) {
    if (!a->is_array()) r.fail("added_tokens", "expected an array");
    for (size_t i = 0; i < a->size(); ++i) {
      const std::string fi = "added_tokens[" + std::to_string(i) + "]";
      const json& e = r.object((*a)[i], fi);
      AddedToken t;
      t.id = r.integer(e.value("id", json()), fi + ".id", 0, kMaxId - 1);
      t.content = r.str(e, "content", fi);
      if (t.content.empty()) r.fail(fi + ".content", "empty");
      t.single_word = r.boolean(e, "single_word", fi, false);
      t.lstrip = r.boolean(e, "lstrip", fi, false);
      t.rstrip = r.boolean(e, "rstrip", fi, false);
      t.special = r.boolean(e, "special", fi, false);
      t.normalized = r.boolean(e, "normalized", fi, !t.special);
      p->added.push_back(std::move(t));
    }
  }
  int64_t vocab = static_cast<int64_t>(p->vocab.tokens.size());
  for (const auto& t : p->added) vocab = std::max(vocab, t.id + 1);
  if (const json* n = r.opt(j, "normalizer")) add_normalizer(*n, "normalizer", r, p->normalizers);
  if (const json* n = r.opt(j, "pre_tokenizer")) add_pre_tokenizer(*n, "pre_tokenizer", r, p->pre_tokenizers);
  if (const json* n = r.opt(j, "post_processor")) load_post(*n, "post_processor", r, *p, vocab);
  if (const json* n = r.opt(j, "decoder")) {
    add_decoder(*n, "decoder", r, p->decoders);
    p->has_decoder = true;
  }
  if (const json* t = r.opt(j, "truncation")) {
    r.object(*t, "truncation");
    p->truncation = r.integer(*t, "max_length", "truncation", 0, 0, kMaxId);
    p->truncate_left = r.str(*t, "direction", "truncation", "Right") == "Left";
  }
  if (const json* pad = r.opt(j, "padding")) {
    r.object(*pad, "padding");
    p->pad_id = r.integer(*pad, "pad_id", "padding", -1, 0, vocab - 1);
  }
  return p;
}

}  // namespace heads::tok
