// unicode_text.h — the Unicode helpers of the tokenizers (internal): UTF-8 in and out, and the
// character classes of Hugging Face tokenizers' BERT normaliser and pre-tokenizer, pinned to the
// Unicode versions its Rust crates were generated from (categories 8.0, decompositions 9.0).
#pragma once

#include <unicode/normalizer2.h>

#include <string>
#include <string_view>

namespace heads::text {

bool age_at_most(char32_t c, int major, int minor);  // the character's age <= major.minor
bool is_control(char32_t c);                         // Cc, Cf, Co as of Unicode 8.0, except TAB, LF, CR
bool is_whitespace(char32_t c);
bool is_cjk(char32_t c);           // the CJK ideograph blocks BERT puts spaces around
bool is_punctuation(char32_t c);   // ASCII punctuation and P* as of Unicode 8.0
bool is_nonspacing_mark(char32_t c);  // Mn as of Unicode 8.0
int combining_class(char32_t c);      // as of Unicode 9.0
// Canonical decomposition as of Unicode 9.0 (Hangul syllables algorithmically), appended to out.
void decompose(char32_t c, std::u32string& out, const icu::Normalizer2* nfd);
const icu::Normalizer2* nfd_instance();

// Characters assigned after Unicode 14.0 (unicode_added.inc, Unicode 15.0 to 16.0, the tables of the
// reference's Oniguruma): the version that assigned c (150, 151, 160), 0 for all others.
int added_version(char32_t c);
// General category (ICU's UCharCategory) as of Unicode 16.0: ICU's, or the table's where ICU has none.
int8_t category16(char32_t c);

// Byte length of the UTF-8 character starting at s[i] (1 for a stray byte), within s.
inline size_t char_len(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  const size_t n = b < 0x80 ? 1 : b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
  return n < s.size() - i ? n : s.size() - i;
}

// The code point at s[i] (i < s.size()) and its length in bytes, as decode_utf8 reads it: a malformed
// sequence is U+FFFD of one byte (overlong forms, surrogates, values past U+10FFFF, a cut sequence).
inline char32_t decode_at(std::string_view s, size_t i, size_t* len) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  *len = 1;
  if (b0 < 0x80) return b0;
  char32_t c;
  size_t n;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    c = b0 & 0x1F;
    n = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    c = b0 & 0x0F;
    n = 3;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    c = b0 & 0x07;
    n = 4;
  } else {
    return 0xFFFD;
  }
  if (i + n > s.size()) return 0xFFFD;
  for (size_t k = 1; k < n; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) return 0xFFFD;
    c = (c << 6) | (b & 0x3F);
  }
  if ((n == 3 && (c < 0x800 || (c >= 0xD800 && c <= 0xDFFF))) || (n == 4 && (c < 0x10000 || c > 0x10FFFF))) {
    return 0xFFFD;
  }
  *len = n;
  return c;
}

std::u32string decode_utf8(std::string_view s);  // malformed sequences become U+FFFD
void append_utf8(std::string& out, char32_t c);
std::string to_utf8(std::u32string_view s);

}  // namespace heads::text
