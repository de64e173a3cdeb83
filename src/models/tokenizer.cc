// tokenizer.cc — Tokenizer (include/heads/tokenizer.h): a model directory's tokenizer, run as the
// tokenizers library runs tokenizer.json — added tokens, then per stretch normalizer,
// pre-tokenizer and model, truncation, post-processor; decoding through the decoders.
#include <unicode/uchar.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "config_json.h"
#include "heads/error.h"
#include "heads/tokenizer.h"
#include "tokenizer_steps.h"
#include "unicode_text.h"

namespace heads {

namespace fs = std::filesystem;

namespace {

// The whole of a regular file (a FIFO would wait for a writer forever).
std::string read_file(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  HEADS_CHECK(fs::exists(st), path, ": not found");
  HEADS_CHECK(fs::is_regular_file(st), path, ": not a regular file");
  constexpr uintmax_t kMaxBytes = uintmax_t{1} << 30;
  HEADS_CHECK(fs::file_size(path, ec) <= kMaxBytes, path, ": larger than 1 GiB: not a tokenizer");
  std::ifstream in(path, std::ios::binary);
  HEADS_CHECK(in.good(), path, ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Whether s is well-formed UTF-8 (decode_utf8 would read no U+FFFD that is not in it): each
// non-ASCII byte starts a sequence decode_at accepts whole.
bool valid_utf8(std::string_view s) {
  for (size_t i = 0, n = 0; i < s.size(); i += n) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      n = 1;
      continue;
    }
    text::decode_at(s, i, &n);
    if (n == 1) return false;
  }
  return true;
}

bool is_word_char(char32_t c) {  // Rust's char::is_alphanumeric, or '_'
  const int8_t t = u_charType(static_cast<UChar32>(c));
  return c == U'_' || u_isalpha(static_cast<UChar32>(c)) || t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER ||
         t == U_OTHER_NUMBER;
}

// A stretch of the text: an added token, or text to tokenize.
struct Stretch {
  int64_t added = -1;  // the added token's id, or -1
  std::string text;
  bool first = false;  // starts the input (Metaspace's prepend_scheme "first")
  bool normalized = false;
};

// Cuts the added tokens (those with normalized == `normalized`) out of the text stretches,
// leftmost-longest, as AddedVocabulary::find_matches does.
void split_added(const tok::Pipeline& p, bool normalized, std::vector<Stretch>& stretches) {
  std::vector<const tok::AddedToken*> toks;
  for (const auto& t : p.added) {
    if (t.normalized == normalized) toks.push_back(&t);
  }
  if (toks.empty()) return;
  // The bytes an added token may start with: only there is it worth comparing (one byte test per
  // position instead of a comparison per token: a 50 MB line without one costs no more than its reading).
  std::array<bool, 256> starts{};
  for (const auto* t : toks) {
    if (!t->content.empty()) starts[static_cast<uint8_t>(t->content[0])] = true;
  }
  std::vector<Stretch> out;
  for (auto& st : stretches) {
    if (st.added >= 0) {
      out.push_back(std::move(st));
      continue;
    }
    const std::string& s = st.text;
    size_t done = 0;
    bool first = st.first;
    for (size_t i = 0; i < s.size();) {
      if (!starts[static_cast<uint8_t>(s[i])]) {
        ++i;
        continue;
      }
      const tok::AddedToken* best = nullptr;
      for (const auto* t : toks) {
        if (t->content.size() > (best ? best->content.size() : 0) && s.compare(i, t->content.size(), t->content) == 0) {
          best = t;
        }
      }
      if (!best) {
        ++i;
        continue;
      }
      size_t start = i, stop = i + best->content.size();
      if (best->single_word) {
        const std::u32string before = text::decode_utf8(std::string_view(s).substr(0, start));
        const std::u32string after = text::decode_utf8(std::string_view(s).substr(stop, 4));
        if ((!before.empty() && is_word_char(before.back())) || (!after.empty() && is_word_char(after[0]))) {
          ++i;
          continue;
        }
      }
      if (best->lstrip) {
        const std::u32string before = text::decode_utf8(std::string_view(s).substr(done, start - done));
        size_t k = before.size();
        while (k > 0 && u_isUWhiteSpace(static_cast<UChar32>(before[k - 1]))) --k;
        start = done + text::to_utf8(std::u32string_view(before).substr(0, k)).size();
      }
      if (best->rstrip) {
        while (stop < s.size()) {
          const std::u32string c = text::decode_utf8(std::string_view(s).substr(stop, 4));
          if (!u_isUWhiteSpace(static_cast<UChar32>(c[0]))) break;
          std::string one;
          text::append_utf8(one, c[0]);
          stop += one.size();
        }
      }
      if (start > done) out.push_back({-1, s.substr(done, start - done), first, st.normalized});
      out.push_back({best->id, {}, false, false});
      first = false;
      done = stop;
      i = stop;
    }
    if (done < s.size()) out.push_back({-1, s.substr(done), first, st.normalized});
  }
  stretches.swap(out);
}

// The ids of one text (no special tokens of the post-processor).
std::vector<int64_t> tokenize(const tok::Pipeline& p, std::string_view raw) {
  std::vector<Stretch> st{{-1, valid_utf8(raw) ? std::string(raw) : text::to_utf8(text::decode_utf8(raw)), true, false}};
  split_added(p, false, st);
  for (auto& s : st) {
    if (s.added >= 0) continue;
    for (const auto& n : p.normalizers) n(s.text);
    s.normalized = true;
  }
  split_added(p, true, st);
  std::vector<int64_t> ids;
  std::vector<std::string> pieces;
  for (const auto& s : st) {
    if (s.added >= 0) {
      ids.push_back(s.added);
      continue;
    }
    if (s.text.empty()) continue;
    pieces.assign(1, s.text);
    for (const auto& pt : p.pre_tokenizers) pt(pieces, s.first);
    for (const auto& piece : pieces) p.model->tokenize(piece, ids);
  }
  return ids;
}

// The ids of a text truncated to `keep` (SIZE_MAX: all). A long text is read by a growing prefix cut
// after a space, until the prefix alone gives well over `keep` ids: what lies past the cut cannot
// change the first `keep` ids when pre-tokenizers split at spaces (a pipeline that does not split
// there sees the cut only in the last ids, which are dropped).
std::vector<int64_t> tokenize_prefix(const tok::Pipeline& p, std::string_view text, size_t keep, bool left,
                                     bool& truncated) {
  constexpr size_t kMargin = 16;
  size_t len = std::max<size_t>(size_t{64} << 10, keep < (SIZE_MAX >> 8) ? keep * 64 : SIZE_MAX);
  std::vector<int64_t> ids;
  for (;;) {
    if (left || keep == SIZE_MAX || len >= text.size()) {
      ids = tokenize(p, text);
      break;
    }
    size_t cut = len;
    const size_t limit = std::min(text.size(), len + 4096);
    while (cut < limit && text[cut - 1] != ' ') ++cut;
    while (cut < text.size() && (static_cast<uint8_t>(text[cut]) & 0xC0) == 0x80) ++cut;  // a character boundary
    ids = tokenize(p, text.substr(0, cut));
    if (ids.size() > keep + kMargin || cut >= text.size()) break;
    // The next prefix: at this one's ids per byte, half as long again as `keep` ids need, and at least
    // twice this one. A text that gives (almost) no ids, one long word, is then read whole at the
    // second step instead of through every doubling (twice its length in all).
    const double need = 1.5 * static_cast<double>(cut) * static_cast<double>(keep + kMargin + 1) /
                        static_cast<double>(std::max<size_t>(ids.size(), 1));
    len = need >= static_cast<double>(text.size()) ? text.size() : std::max(2 * len, static_cast<size_t>(need));
  }
  truncated = ids.size() > keep;
  if (truncated) {
    if (left) ids.erase(ids.begin(), ids.end() - static_cast<std::ptrdiff_t>(keep));
    else ids.resize(keep);
  }
  return ids;
}

Tokenizer::Encoding post_process(const tok::Pipeline& p, const std::vector<int64_t>& a, const std::vector<int64_t>* b,
                                 bool add_special) {
  Tokenizer::Encoding e;
  const auto& tmpl = b ? p.post.pair : p.post.single;
  if (!add_special || tmpl.empty()) {
    e.ids = a;
    e.type_ids.assign(a.size(), 0);
    if (b) {
      e.ids.insert(e.ids.end(), b->begin(), b->end());
      e.type_ids.resize(e.ids.size(), 1);
    }
    return e;
  }
  for (const auto& piece : tmpl) {
    const std::vector<int64_t>& ids = piece.sequence < 0 ? piece.ids : piece.sequence == 0 ? a : *b;
    e.ids.insert(e.ids.end(), ids.begin(), ids.end());
    e.type_ids.resize(e.ids.size(), piece.type_id);
  }
  return e;
}

}  // namespace

Tokenizer Tokenizer::from_file(const std::string& path) {
  Tokenizer t;
  t.pipeline_ = tok::load_pipeline(read_file(path), path);
  return t;
}

Tokenizer Tokenizer::from_wordpiece(WordPieceTokenizer wordpiece) {
  Tokenizer t;
  t.wordpiece_ = std::make_shared<const WordPieceTokenizer>(std::move(wordpiece));
  return t;
}

Tokenizer Tokenizer::from_directory(const std::string& dir) {
  const fs::path d(dir);
  if (fs::exists(d / "tokenizer.json")) return from_file((d / "tokenizer.json").string());
  for (const char* spm : {"sentencepiece.bpe.model", "tokenizer.model", "spiece.model"}) {
    const fs::path p = d / spm;
    if (fs::exists(d / "vocab.txt") || !fs::exists(p)) continue;
    Tokenizer t;
    t.pipeline_ = tok::load_pipeline(tok::sentencepiece_tokenizer_json(p.string(), dir), p.string());
    return t;
  }
  HEADS_CHECK(fs::exists(d / "vocab.txt"), dir, ": no tokenizer: neither tokenizer.json nor vocab.txt");
  const nlohmann::json tc = models::read_json(d / "tokenizer_config.json", false);
  const bool lower = models::json_bool(tc, "do_lower_case", true, d / "tokenizer_config.json");
  return from_wordpiece(WordPieceTokenizer::from_vocab_file((d / "vocab.txt").string(), lower));
}

Tokenizer::Encoding Tokenizer::encode(std::string_view text, int64_t max_length, bool add_special_tokens) const {
  HEADS_CHECK(max_length >= 0, "Tokenizer::encode: max_length must be >= 0, got ", max_length);
  if (wordpiece_) {
    HEADS_CHECK(add_special_tokens, "Tokenizer::encode: a WordPiece vocab.txt tokenizer always adds [CLS] and [SEP]");
    const auto w = wordpiece_->encode(text, max_length);
    return {w.ids, std::vector<int64_t>(w.ids.size(), 0), w.truncated};
  }
  const tok::Pipeline& p = *pipeline_;
  const int64_t limit = max_length > 0 ? max_length : p.truncation;
  const int64_t added = add_special_tokens ? p.post.added(false) : 0;
  HEADS_CHECK(limit == 0 || limit >= added, "Tokenizer::encode: max_length ", limit, " leaves no room for the ", added,
              " special tokens");
  bool truncated = false;
  const std::vector<int64_t> ids =
      tokenize_prefix(p, text, limit > 0 ? static_cast<size_t>(limit - added) : SIZE_MAX, p.truncate_left, truncated);
  Encoding e = post_process(p, ids, nullptr, add_special_tokens);
  e.truncated = truncated;
  return e;
}

namespace {

// Cuts a pair's pieces to `max` tokens together, the longest first, as tokenizers' truncate_encodings
// does; from the left with `left`. Returns whether anything was cut.
bool truncate_longest_first(std::vector<int64_t>& ia, std::vector<int64_t>& ib, size_t max, bool left) {
  if (ia.size() + ib.size() <= max) return false;
  size_t n1 = ia.size(), n2 = ib.size();
  const bool swap = n1 > n2;
  if (swap) std::swap(n1, n2);
  n2 = n1 > max ? n1 : std::max(n1, max - n1);
  if (n1 + n2 > max) {
    n1 = max / 2;
    n2 = n1 + max % 2;
  }
  if (swap) std::swap(n1, n2);
  const auto cut = [&](std::vector<int64_t>& v, size_t n) {
    if (v.size() <= n) return;
    if (left) v.erase(v.begin(), v.end() - static_cast<std::ptrdiff_t>(n));
    else v.resize(n);
  };
  cut(ia, n1);
  cut(ib, n2);
  return true;
}

}  // namespace

Tokenizer::Encoding Tokenizer::encode_pair(std::string_view a, std::string_view b, int64_t max_length) const {
  HEADS_CHECK(max_length >= 0, "Tokenizer::encode_pair: max_length must be >= 0, got ", max_length);
  if (wordpiece_) {  // BERT's pair: [CLS] a [SEP] b [SEP], types 0 through the first [SEP], then 1
    HEADS_CHECK(max_length == 0 || max_length >= 3, "Tokenizer::encode_pair: max_length ", max_length,
                " leaves no room for the 3 special tokens");
    std::vector<int64_t> ia = wordpiece_->encode(a, 0).ids, ib = wordpiece_->encode(b, 0).ids;
    const int64_t cls = ia.front(), sep = ia.back();
    ia = std::vector<int64_t>(ia.begin() + 1, ia.end() - 1);
    ib = std::vector<int64_t>(ib.begin() + 1, ib.end() - 1);
    Encoding e;
    e.truncated = max_length > 0 && truncate_longest_first(ia, ib, static_cast<size_t>(max_length - 3), false);
    e.ids.push_back(cls);
    e.ids.insert(e.ids.end(), ia.begin(), ia.end());
    e.ids.push_back(sep);
    e.type_ids.assign(e.ids.size(), 0);
    e.ids.insert(e.ids.end(), ib.begin(), ib.end());
    e.ids.push_back(sep);
    e.type_ids.resize(e.ids.size(), 1);
    return e;
  }
  const tok::Pipeline& p = *pipeline_;
  HEADS_CHECK(!p.post.single.empty() ? !p.post.pair.empty() : true, "Tokenizer::encode_pair: the post-processor has no "
                                                                     "pair template");
  const int64_t limit = max_length > 0 ? max_length : p.truncation;
  const int64_t added = p.post.added(true);
  HEADS_CHECK(limit == 0 || limit >= added, "Tokenizer::encode_pair: max_length ", limit, " leaves no room for the ",
              added, " special tokens");
  bool ta = false, tb = false;
  std::vector<int64_t> ia = tokenize_prefix(p, a, SIZE_MAX, false, ta), ib = tokenize_prefix(p, b, SIZE_MAX, false, tb);
  const bool truncated = limit > 0 && truncate_longest_first(ia, ib, static_cast<size_t>(limit - added), p.truncate_left);
  Encoding e = post_process(p, ia, &ib, true);
  e.truncated = truncated;
  return e;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  std::vector<std::string> toks;
  for (int64_t id : ids) {
    HEADS_CHECK(id >= 0 && id < vocab_size(), "Tokenizer::decode: id ", id, " outside the vocabulary of ", vocab_size());
    if (skip_special_tokens && is_special(id)) continue;
    toks.push_back(token(id));
  }
  if (wordpiece_ || !pipeline_->has_decoder) {
    std::string s;
    for (size_t i = 0; i < toks.size(); ++i) s += (i ? " " : "") + toks[i];
    return wordpiece_ ? tok::cleanup_spaces(s) : s;
  }
  for (const auto& d : pipeline_->decoders) d(toks);
  std::string s;
  for (const auto& t : toks) s += t;
  return s;
}

const std::string& Tokenizer::token(int64_t id) const {
  static const std::string kNone;
  if (wordpiece_) return wordpiece_->token(id);
  for (const auto& t : pipeline_->added) {
    if (t.id == id) return t.content;
  }
  const auto& v = pipeline_->vocab;
  if (id >= 0 && id < static_cast<int64_t>(v.tokens.size())) return v.tokens[static_cast<size_t>(id)];
  const int64_t unk = pipeline_->model->unk_id();
  return unk >= 0 && unk < static_cast<int64_t>(v.tokens.size()) ? v.tokens[static_cast<size_t>(unk)] : kNone;
}

int64_t Tokenizer::id(const std::string& token) const {
  if (wordpiece_) return wordpiece_->id(token);
  for (const auto& t : pipeline_->added) {
    if (t.content == token) return t.id;
  }
  return pipeline_->vocab.find(token);
}

int64_t Tokenizer::vocab_size() const {
  if (wordpiece_) return wordpiece_->vocab_size();
  auto n = static_cast<int64_t>(pipeline_->vocab.tokens.size());
  for (const auto& t : pipeline_->added) n = std::max(n, t.id + 1);
  return n;
}

int64_t Tokenizer::pad_id() const {
  if (wordpiece_) return wordpiece_->pad_id();
  if (pipeline_->pad_id >= 0) return pipeline_->pad_id;
  for (const char* name : {"<pad>", "[PAD]", "<|pad|>", "<|endoftext|>"}) {
    if (const int64_t i = id(name); i >= 0) return i;
  }
  return -1;
}

bool Tokenizer::is_special(int64_t id) const {
  if (wordpiece_) {
    return id == wordpiece_->pad_id() || id == wordpiece_->cls_id() || id == wordpiece_->sep_id() ||
           id == wordpiece_->unk_id() || id == wordpiece_->id("[MASK]");
  }
  return std::any_of(pipeline_->added.begin(), pipeline_->added.end(),
                     [&](const tok::AddedToken& t) { return t.id == id && t.special; });
}

}  // namespace heads
