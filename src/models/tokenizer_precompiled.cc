// tokenizer_precompiled.cc — SentencePiece's precompiled normaliser ("Precompiled" in
// tokenizer.json, what XLM-RoBERTa, T5 and other SentencePiece models ship), as the tokenizers
// library applies it.
//
// The charsmap is a uint32 (little-endian) byte size of a double-array trie (darts-clone units),
// the trie, then NUL-terminated replacement strings the trie's values point into. The text is
// read grapheme by grapheme (extended grapheme clusters, ICU): a grapheme of under 6 bytes whose
// bytes start with a key of the trie is replaced whole by the shortest such key's replacement;
// otherwise each of its characters is replaced the same way or kept. The trie is untrusted:
// every index is bounds-checked, and a walk that leaves the array is no match.
#include <unicode/brkiter.h>
#include <unicode/utext.h>

#include <cstring>
#include <memory>
#include <optional>

#include "heads/error.h"
#include "tokenizer_steps.h"
#include "unicode_text.h"

namespace heads::tok {

using text::char_len;

namespace {

struct Charsmap {
  std::vector<uint32_t> units;
  std::string pool;

  static bool has_leaf(uint32_t u) { return ((u >> 8) & 1) != 0; }
  static uint32_t value(uint32_t u) { return u & ((1u << 31) - 1); }
  static uint32_t label(uint32_t u) { return u & ((1u << 31) | 0xFF); }
  static uint32_t offset(uint32_t u) { return (u >> 10) << ((u & (1u << 9)) >> 6); }

  // The replacement of the shortest key that `chunk` starts with, if any.
  std::optional<std::string_view> transform(std::string_view chunk) const {
    if (units.empty()) return std::nullopt;
    size_t pos = offset(units[0]);
    for (char ch : chunk) {
      const auto c = static_cast<uint8_t>(ch);
      if (c == 0) break;
      pos ^= c;
      if (pos >= units.size()) return std::nullopt;
      const uint32_t u = units[pos];
      if (label(u) != c) return std::nullopt;
      pos ^= offset(u);
      if (pos >= units.size()) return std::nullopt;
      if (has_leaf(u)) {
        const uint32_t at = value(units[pos]);
        if (at >= pool.size()) return std::nullopt;
        const size_t end = pool.find('\0', at);
        return std::string_view(pool).substr(at, (end == std::string::npos ? pool.size() : end) - at);
      }
    }
    return std::nullopt;
  }
};

// Grapheme boundaries (byte offsets) of valid UTF-8 `s`, 0 and s.size() included.
std::vector<size_t> graphemes(const std::string& s) {
  thread_local std::unique_ptr<icu::BreakIterator> it = [] {
    UErrorCode err = U_ZERO_ERROR;
    std::unique_ptr<icu::BreakIterator> b(icu::BreakIterator::createCharacterInstance(icu::Locale::getRoot(), err));
    HEADS_CHECK(U_SUCCESS(err) && b, "tokenizer: ICU grapheme break data unavailable (", u_errorName(err), ")");
    return b;
  }();
  UErrorCode err = U_ZERO_ERROR;
  UText* ut = utext_openUTF8(nullptr, s.data(), static_cast<int64_t>(s.size()), &err);
  HEADS_CHECK(U_SUCCESS(err), "tokenizer: ICU text failed (", u_errorName(err), ")");
  it->setText(ut, err);
  std::vector<size_t> b;
  for (int32_t p = it->first(); p != icu::BreakIterator::DONE; p = it->next()) b.push_back(static_cast<size_t>(p));
  utext_close(ut);
  HEADS_CHECK(U_SUCCESS(err), "tokenizer: ICU grapheme breaking failed (", u_errorName(err), ")");
  return b;
}

}  // namespace

Normalizer precompiled_normalizer(const std::string& charsmap, const std::string& what) {
  auto m = std::make_shared<Charsmap>();
  HEADS_CHECK(charsmap.size() >= 4, what, ": shorter than its 4-byte header");
  uint32_t trie_bytes = 0;
  for (int k = 3; k >= 0; --k) trie_bytes = (trie_bytes << 8) | static_cast<uint8_t>(charsmap[static_cast<size_t>(k)]);
  HEADS_CHECK(trie_bytes % 4 == 0 && trie_bytes <= charsmap.size() - 4, what, ": trie of ", trie_bytes,
              " bytes in a map of ", charsmap.size());
  m->units.resize(trie_bytes / 4);
  for (size_t i = 0; i < m->units.size(); ++i) {
    uint32_t u = 0;
    for (int k = 3; k >= 0; --k) u = (u << 8) | static_cast<uint8_t>(charsmap[4 + i * 4 + static_cast<size_t>(k)]);
    m->units[i] = u;
  }
  m->pool = charsmap.substr(4 + trie_bytes);
  return [m](std::string& s) {
    if (s.empty()) return;
    std::string out;
    out.reserve(s.size());
    const std::vector<size_t> b = graphemes(s);
    for (size_t g = 0; g + 1 < b.size(); ++g) {
      const std::string_view grapheme = std::string_view(s).substr(b[g], b[g + 1] - b[g]);
      if (grapheme.size() < 6) {
        if (const auto r = m->transform(grapheme)) {
          out += *r;
          continue;
        }
      }
      for (size_t i = 0; i < grapheme.size();) {
        const size_t n = char_len(grapheme, i);
        const std::string_view ch = grapheme.substr(i, n);
        if (const auto r = m->transform(ch)) out += *r;
        else out += ch;
        i += n;
      }
    }
    s.swap(out);
  };
}

}  // namespace heads::tok
