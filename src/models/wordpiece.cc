// wordpiece.cc — BERT WordPiece tokenizer matching Hugging Face tokenizers (see tokenizer.h); the
// Unicode classes it uses are unicode_text.h's.
#include "heads/tokenizer.h"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "heads/error.h"
#include "unicode_text.h"

namespace heads {

namespace {

using namespace text;

// Whether reading text[..p) and text[p..) apart gives the pieces the whole would: text[p] starts a
// character (not a UTF-8 continuation byte), that character survives cleaning and decomposes to
// a starter (no run of combining marks to reorder crosses p), and no special token ("[UNK]") of
// the text spans p. The word p may cut is carried over.
bool cut_is_exact(std::string_view text, size_t p) {
  static const icu::Normalizer2* nfd = nfd_instance();
  const auto b = static_cast<uint8_t>(text[p]);
  if ((b & 0xC0) == 0x80) return false;
  for (std::string_view special : {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}) {
    for (size_t j = 1; j < special.size() && j <= p; ++j) {  // an occurrence starting j bytes before p
      if (text.substr(p - j, special.size()) == special) return false;
    }
  }
  size_t n;
  const char32_t c = decode_at(text, p, &n);
  if (c == 0 || c == 0xFFFD || is_control(c)) return false;
  std::u32string d;
  decompose(c, d, nfd);
  return combining_class(d[0]) == 0;
}

}  // namespace

WordPieceTokenizer WordPieceTokenizer::from_vocab_file(const std::string& path, bool lowercase) {
  std::error_code ec;  // only a regular file: opening a FIFO would wait for a writer forever
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  HEADS_CHECK(!std::filesystem::exists(st) || std::filesystem::is_regular_file(st), path,
              ": cannot open vocabulary: not a regular file");
  std::ifstream in(path, std::ios::binary);
  HEADS_CHECK(in.good(), path, ": cannot open vocabulary");
  WordPieceTokenizer t;
  t.lowercase_ = lowercase;
  std::string line;
  while (std::getline(in, line)) {
    while (!line.empty() && (line.back() == '\r' || line.back() == '\n' || line.back() == ' ' ||
                             line.back() == '\t')) {
      line.pop_back();  // trim_end
    }
    const auto id = static_cast<int64_t>(t.tokens_.size());
    t.vocab_[line] = id;  // a later duplicate wins
    t.tokens_.push_back(line);
  }
  HEADS_CHECK(!t.tokens_.empty(), path, ": empty vocabulary");
  auto need = [&](const char* name, int64_t* slot) {
    const auto it = t.vocab_.find(name);
    HEADS_CHECK(it != t.vocab_.end(), path, ": vocabulary has no ", name, " token");
    *slot = it->second;
  };
  need("[UNK]", &t.unk_);
  need("[CLS]", &t.cls_);
  need("[SEP]", &t.sep_);
  need("[PAD]", &t.pad_);
  need("[MASK]", &t.mask_);
  return t;
}

const std::string& WordPieceTokenizer::token(int64_t id) const {
  if (id < 0 || id >= vocab_size()) return tokens_[static_cast<size_t>(unk_)];
  return tokens_[static_cast<size_t>(id)];
}

int64_t WordPieceTokenizer::id(const std::string& token) const {
  const auto it = vocab_.find(token);
  return it == vocab_.end() ? -1 : it->second;
}

void WordPieceTokenizer::normalize_and_split(std::u32string_view segment, std::vector<std::u32string>& words,
                                             std::u32string& cur, size_t cap) const {
  static const icu::Normalizer2* nfd = nfd_instance();
  // 1. clean text; 2. space around CJK ideographs
  std::u32string a;
  a.reserve(segment.size());
  for (char32_t c : segment) {
    if (c == 0 || c == 0xFFFD || is_control(c)) continue;
    if (is_whitespace(c)) {
      a.push_back(U' ');
    } else if (is_cjk(c)) {
      a.push_back(U' ');
      a.push_back(c);
      a.push_back(U' ');
    } else {
      a.push_back(c);
    }
  }
  // 3. strip accents (NFD, canonical order, drop non-spacing marks); 4. lower case
  std::u32string d;
  if (lowercase_) {
    d.reserve(a.size());
    for (char32_t c : a) decompose(c, d, nfd);
    for (size_t i = 0; i < d.size();) {  // stable sort runs of non-zero combining class
      if (combining_class(d[i]) == 0) {
        ++i;
        continue;
      }
      size_t j = i;
      while (j < d.size() && combining_class(d[j]) != 0) ++j;
      std::stable_sort(d.begin() + static_cast<std::ptrdiff_t>(i), d.begin() + static_cast<std::ptrdiff_t>(j),
                       [](char32_t x, char32_t y) { return combining_class(x) < combining_class(y); });
      i = j;
    }
    std::u32string e;
    e.reserve(d.size());
    for (char32_t c : d) {
      if (is_nonspacing_mark(c)) continue;
      e.push_back(static_cast<char32_t>(u_tolower(static_cast<UChar32>(c))));
    }
    d.swap(e);
  } else {
    d = a;
  }
  // 5. split on whitespace, isolate punctuation; the word at the end stays in `cur`
  auto flush = [&] {
    if (!cur.empty()) words.push_back(cur);
    cur.clear();
  };
  for (char32_t c : d) {
    if (is_whitespace(c)) {
      flush();
    } else if (is_punctuation(c)) {
      flush();
      words.emplace_back(1, c);
    } else if (cur.size() < cap) {
      cur.push_back(c);
    }
  }
}

void WordPieceTokenizer::wordpiece(const std::u32string& word, std::vector<int64_t>& out) const {
  if (static_cast<int64_t>(word.size()) > max_chars_per_word_) {
    out.push_back(unk_);
    return;
  }
  const size_t mark = out.size();
  size_t start = 0;
  while (start < word.size()) {
    size_t end = word.size();
    int64_t found = -1;
    while (start < end) {
      std::string piece = start > 0 ? "##" : "";
      piece += to_utf8(std::u32string_view(word).substr(start, end - start));
      const auto it = vocab_.find(piece);
      if (it != vocab_.end()) {
        found = it->second;
        break;
      }
      --end;
    }
    if (found < 0) {  // an unknown piece makes the whole word [UNK]
      out.resize(mark);
      out.push_back(unk_);
      return;
    }
    out.push_back(found);
    start = end;
  }
}

std::vector<std::string> WordPieceTokenizer::pre_tokenize(std::string_view text) const {
  std::vector<std::u32string> words;
  std::u32string last;
  normalize_and_split(decode_utf8(text), words, last, SIZE_MAX);
  if (!last.empty()) words.push_back(last);
  std::vector<std::string> out;
  for (const auto& w : words) out.push_back(to_utf8(w));
  return out;
}

// Pieces of one stretch of raw text, appended to `pieces`. `word` is the word the stretch before
// ended inside (continued here); the word this one ends inside is left in it.
void WordPieceTokenizer::encode_pieces(std::string_view text, std::vector<int64_t>& pieces,
                                       std::u32string& word) const {
  static const std::pair<const char32_t*, int64_t WordPieceTokenizer::*> kSpecial[] = {
      {U"[PAD]", &WordPieceTokenizer::pad_}, {U"[UNK]", &WordPieceTokenizer::unk_},
      {U"[CLS]", &WordPieceTokenizer::cls_}, {U"[SEP]", &WordPieceTokenizer::sep_},
      {U"[MASK]", &WordPieceTokenizer::mask_}};
  const std::u32string s = decode_utf8(text);
  std::vector<std::u32string> words;
  size_t seg = 0, i = 0;
  // A word longer than max_chars_per_word_ is [UNK] whatever follows: it is kept at one more.
  const size_t cap = static_cast<size_t>(max_chars_per_word_) + 1;
  auto emit_segment = [&](size_t end, bool word_ends) {
    words.clear();
    normalize_and_split(std::u32string_view(s).substr(seg, end - seg), words, word, cap);
    for (const auto& w : words) wordpiece(w, pieces);
    if (word_ends && !word.empty()) {
      wordpiece(word, pieces);
      word.clear();
    }
  };
  while (i < s.size()) {
    // special tokens are matched on the raw text, exactly (leftmost-longest)
    int64_t matched = -1;
    size_t len = 0;
    if (s[i] == U'[') {
      for (const auto& [name, slot] : kSpecial) {
        const size_t n = std::char_traits<char32_t>::length(name);
        if (n > len && s.compare(i, n, name) == 0) {
          matched = this->*slot;
          len = n;
        }
      }
    }
    if (matched >= 0) {
      emit_segment(i, true);
      pieces.push_back(matched);
      i += len;
      seg = i;
    } else {
      ++i;
    }
  }
  emit_segment(s.size(), false);
}

WordPieceTokenizer::Encoding WordPieceTokenizer::encode(std::string_view text, int64_t max_length) const {
  // The text is read in stretches of about 4 KiB, so that what it costs does not grow with its
  // length: once there are more pieces than fit, the rest is never looked at (a 60 MB text costs
  // what its first stretches cost). A stretch ends just after an ASCII space, tab or newline, or,
  // in a text with none for 8 KiB, at a cut that changes nothing (cut_is_exact); a word cut in two
  // is carried into the next stretch.
  const size_t limit = max_length > 0 ? static_cast<size_t>(std::max<int64_t>(max_length - 2, 0)) : SIZE_MAX;
  constexpr size_t kStretch = 4096;  // bytes, at least (a stretch of ordinary text holds ~800 pieces)
  std::vector<int64_t> pieces;
  std::u32string word;
  for (size_t pos = 0; pos < text.size() && pieces.size() <= limit;) {
    size_t end = std::min(text.size(), pos + kStretch);
    while (end < text.size() && text[end - 1] != ' ' && text[end - 1] != '\n' && text[end - 1] != '\t' &&
           !(end - pos >= 2 * kStretch && cut_is_exact(text, end))) {
      ++end;
    }
    encode_pieces(text.substr(pos, end - pos), pieces, word);
    pos = end;
  }
  if (!word.empty()) wordpiece(word, pieces);
  Encoding e;
  if (pieces.size() > limit) {
    pieces.resize(limit);
    e.truncated = true;
  }
  e.ids.reserve(pieces.size() + 2);
  e.ids.push_back(cls_);
  e.ids.insert(e.ids.end(), pieces.begin(), pieces.end());
  e.ids.push_back(sep_);
  return e;
}

}  // namespace heads
