// unicode_text.cc — the Unicode helpers of the tokenizers (unicode_text.h).
//
// Unicode data: ICU, with the character properties pinned to the versions the reference
// tokenizer's Rust crates were generated from: general categories as of Unicode 8.0
// (unicode_categories 0.1.1), canonical decompositions as of 9.0
// (unicode-normalization-alignments 0.1.12). Characters assigned later are treated as the
// reference does: not controls, not punctuation, not marks, not decomposed. A handful of
// characters whose category changed after 8.0 are listed explicitly.
#include "unicode_text.h"

#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <cstdint>
#include <iterator>

#include "heads/error.h"

namespace heads::text {

// age(c) <= major.minor
bool age_at_most(char32_t c, int major, int minor) {
  UVersionInfo v;
  u_charAge(static_cast<UChar32>(c), v);
  return v[0] < major || (v[0] == major && v[1] <= minor);
}

int8_t category(char32_t c) { return u_charType(static_cast<UChar32>(c)); }

namespace {

struct Added {
  char32_t first, last;
  int8_t category;
  int16_t version;
};

constexpr Added kAdded[] = {
#include "unicode_added.inc"
};

const Added* find_added(char32_t c) {
  if (c < kAdded[0].first) return nullptr;
  const Added* a = std::upper_bound(std::begin(kAdded), std::end(kAdded), c,
                                    [](char32_t x, const Added& r) { return x < r.first; });
  --a;
  return c <= a->last ? a : nullptr;
}

}  // namespace

int added_version(char32_t c) {
  const Added* a = find_added(c);
  return a != nullptr ? a->version : 0;
}

int8_t category16(char32_t c) {
  const int8_t t = category(c);
  if (t != U_UNASSIGNED) return t;
  const Added* a = find_added(c);
  return a != nullptr ? a->category : t;
}

// Each class below answers ASCII (c < 0x80) from the characters' fixed classes, without asking ICU
// (most text is mostly ASCII; tests/models/unicode_text_test.cc checks every ASCII answer against ICU's).

// clean_text deletes these: Cc, Cf, Co as of Unicode 8.0, except TAB, LF, CR.
bool is_control(char32_t c) {
  if (c == U'\t' || c == U'\n' || c == U'\r') return false;
  if (c < 0x80) return c < 0x20 || c == 0x7F;  // Cc; ASCII has no Cf or Co
  const int8_t t = category(c);
  return (t == U_CONTROL_CHAR || t == U_FORMAT_CHAR || t == U_PRIVATE_USE_CHAR) && age_at_most(c, 8, 0);
}

bool is_whitespace(char32_t c) {
  if (c < 0x80) return c == U' ' || (c >= 0x09 && c <= 0x0D);  // White_Space in ASCII: TAB, LF, VT, FF, CR, space
  return c == U'\t' || c == U'\n' || c == U'\r' || u_isUWhiteSpace(static_cast<UChar32>(c));
}

bool is_cjk(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
         (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

bool is_punctuation(char32_t c) {
  if ((c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) ||
      (c >= 0x7B && c <= 0x7E)) {
    return true;
  }
  if (c < 0x80) return false;  // ASCII's other characters are letters, digits, controls and space
  if (c == 0x166D || c == 0x111C9) return true;  // punctuation in Unicode 8.0, not any more
  const int8_t t = category(c);
  const bool p = t == U_CONNECTOR_PUNCTUATION || t == U_DASH_PUNCTUATION || t == U_START_PUNCTUATION ||
                 t == U_END_PUNCTUATION || t == U_INITIAL_PUNCTUATION || t == U_FINAL_PUNCTUATION ||
                 t == U_OTHER_PUNCTUATION;
  return p && age_at_most(c, 8, 0);
}

// Non-spacing marks as of Unicode 8.0 (strip_accents removes them).
bool is_nonspacing_mark(char32_t c) {
  if (c < 0x80) return false;
  if (c == 0x1734) return true;  // Mn in 8.0, Mc now
  if (c == 0x1885 || c == 0x1886 || c == 0xA9BD || c == 0x111C9) return false;  // not Mn in 8.0
  return category(c) == U_NON_SPACING_MARK && age_at_most(c, 8, 0);
}

int combining_class(char32_t c) {
  if (c < 0x80) return 0;
  if (!age_at_most(c, 9, 0)) return 0;
  return u_getCombiningClass(static_cast<UChar32>(c));
}

// Canonical decomposition as of Unicode 9.0 (Hangul syllables algorithmically).
void decompose(char32_t c, std::u32string& out, const icu::Normalizer2* nfd) {
  constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
  constexpr int kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = 19 * kNCount;
  if (c < 0x80) {  // ASCII decomposes to itself
    out.push_back(c);
    return;
  }
  if (c >= kSBase && c < kSBase + kSCount) {
    const int s = static_cast<int>(c - kSBase);
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  icu::UnicodeString d;
  if (age_at_most(c, 9, 0) && nfd->getDecomposition(static_cast<UChar32>(c), d)) {
    for (int32_t i = 0; i < d.length();) {
      const UChar32 x = d.char32At(i);
      out.push_back(static_cast<char32_t>(x));
      i += U16_LENGTH(x);
    }
    return;
  }
  out.push_back(c);
}

// UTF-8 -> code points; malformed sequences become U+FFFD.
std::u32string decode_utf8(std::string_view s) {
  std::u32string out(s.size(), U'\0');  // at most one code point per byte; written through a pointer
  char32_t* o = out.data();
  for (size_t i = 0, n = 0; i < s.size(); i += n) {
    const auto b0 = static_cast<uint8_t>(s[i]);
    if (b0 < 0x80) {
      *o++ = b0;
      n = 1;
      continue;
    }
    *o++ = decode_at(s, i, &n);
  }
  out.resize(static_cast<size_t>(o - out.data()));
  return out;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string to_utf8(std::u32string_view s) {
  std::string out;
  for (char32_t c : s) append_utf8(out, c);
  return out;
}

const icu::Normalizer2* nfd_instance() {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = icu::Normalizer2::getNFDInstance(status);
  HEADS_CHECK(U_SUCCESS(status) && n != nullptr, "tokenizer: ICU NFD data unavailable (",
              u_errorName(status), ")");
  return n;
}


}  // namespace heads::text
