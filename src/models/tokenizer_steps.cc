// tokenizer_steps.cc — normalizers and pre-tokenizers of tokenizer.json pipelines (tokenizer_steps.h),
// each as the tokenizers library defines it; the decoders are in tokenizer_decoders.cc.
#include "tokenizer_steps.h"

#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>

#include <algorithm>
#include <array>
#include <memory>
#include <vector>

#include "heads/error.h"
#include "unicode_text.h"

namespace heads::tok {


using text::append_utf8;
using text::decode_utf8;
using text::to_utf8;

namespace {

bool is_unicode_whitespace(char32_t c) { return u_isUWhiteSpace(static_cast<UChar32>(c)) != 0; }

// Maps every character of s through f (which appends what it becomes).
template <class F>
std::string map_chars(const std::string& s, F f) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : decode_utf8(s)) f(c, out);
  return out;
}

// Rust's char::to_lowercase: the full lower-case mapping of one character, without context.
void append_lower(char32_t c, std::string& out) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c));
    return;
  }
  UChar src[2], dst[8];
  int32_t n = 0;
  U16_APPEND_UNSAFE(src, n, static_cast<UChar32>(c));
  UErrorCode err = U_ZERO_ERROR;
  const int32_t m = u_strToLower(dst, 8, src, n, "", &err);
  if (U_FAILURE(err)) {
    append_utf8(out, c);
    return;
  }
  for (int32_t i = 0; i < m;) {
    UChar32 x;
    U16_NEXT(dst, i, m, x);
    append_utf8(out, static_cast<char32_t>(x));
  }
}

bool is_mark(char32_t c) {  // General_Category = Mark (unicode-normalization-alignments' is_combining_mark)
  const int8_t t = u_charType(static_cast<UChar32>(c));
  return t == U_NON_SPACING_MARK || t == U_ENCLOSING_MARK || t == U_COMBINING_SPACING_MARK;
}

// A split on the characters `is_delim` accepts, as a pattern's matches would be.
template <class F>
std::vector<std::pair<size_t, size_t>> char_matches(std::string_view s, F is_delim) {
  std::vector<std::pair<size_t, size_t>> m;
  for (size_t i = 0, n = 0; i < s.size(); i += n) {
    if (is_delim(text::decode_at(s, i, &n))) m.emplace_back(i, i + n);
  }
  return m;
}

template <class F>
PreTokenizer split_each(F matches, SplitBehavior how, bool invert = false) {
  return [matches, how, invert](std::vector<std::string>& pieces, bool) {
    std::vector<std::string> out;
    for (const auto& p : pieces) split_pieces(p, matches(p), how, invert, out);
    pieces.swap(out);
  };
}

}  // namespace

// ---- normalizers -----------------------------------------------------------------------------

namespace {

// Where a long text may be cut for a per-character normaliser: before a character that starts a
// combining sequence and decomposes to one (ASCII, CJK ideographs, Hangul syllables, whitespace).
bool starts_sequence(std::string_view s, size_t at) {
  const auto b = static_cast<uint8_t>(s[at]);
  if (b < 0x80) return true;
  if ((b & 0xC0) == 0x80) return false;
  size_t n;
  const char32_t c = text::decode_at(s, at, &n);
  return text::is_cjk(c) || (c >= 0xAC00 && c <= 0xD7A3) || text::is_whitespace(c);
}

}  // namespace

namespace {

struct BertSteps {
  bool clean_text, handle_chinese_chars, strip_accents, lowercase;

  // The steps over code points `chars` (a stretch cut where starts_sequence allows), appended to out
  // as UTF-8; a and d are scratch.
  void run(std::u32string_view chars, std::u32string& a, std::u32string& d, std::string& out) const {
    static const icu::Normalizer2* nfd = text::nfd_instance();
    a.clear();
    for (char32_t c : chars) {
      if (clean_text && (c == 0 || c == 0xFFFD || text::is_control(c))) continue;
      if (clean_text && text::is_whitespace(c)) c = U' ';
      if (handle_chinese_chars && text::is_cjk(c)) {
        a += U' ';
        a += c;
        a += U' ';
      } else {
        a += c;
      }
    }
    if (strip_accents) {  // NFD (canonical order), then drop the non-spacing marks
      d.clear();
      for (char32_t c : a) text::decompose(c, d, nfd);
      for (size_t i = 0; i < d.size();) {
        size_t j = i;
        while (j < d.size() && text::combining_class(d[j]) != 0) ++j;
        std::stable_sort(d.begin() + static_cast<std::ptrdiff_t>(i), d.begin() + static_cast<std::ptrdiff_t>(j),
                         [](char32_t x, char32_t y) { return text::combining_class(x) < text::combining_class(y); });
        i = j == i ? i + 1 : j;
      }
      a.clear();
      for (char32_t c : d) {
        if (!text::is_nonspacing_mark(c)) a += c;
      }
    }
    for (char32_t c : a) {
      if (lowercase) append_lower(c, out);
      else append_utf8(out, c);
    }
  }

  // Whether c's output alone is its output in any text of such characters: with strip_accents, each
  // character of its decomposition has combining class 0 or is dropped (a non-spacing mark), so the
  // reordering moves nothing that is kept and no run of marks crosses it.
  bool context_free(char32_t c) const {
    if (!strip_accents || (clean_text && (c == 0 || c == 0xFFFD || text::is_control(c)))) return true;
    std::u32string d;
    text::decompose(clean_text && text::is_whitespace(c) ? U' ' : c, d, text::nfd_instance());
    return std::all_of(d.begin(), d.end(),
                       [](char32_t x) { return text::combining_class(x) == 0 || text::is_nonspacing_mark(x); });
  }
};

// The output of each code point below kBertTable alone (run() over it), for those that are
// context_free; a text made of them only is their outputs one after the other.
constexpr char32_t kBertTable = 0x800;  // ASCII and the two-byte UTF-8 range (Latin, Greek, Cyrillic, ...)

struct BertTable {
  std::vector<std::string> out;  // by code point
  std::vector<uint8_t> context_free;

  explicit BertTable(const BertSteps& steps) : out(kBertTable), context_free(kBertTable) {
    std::u32string a, d;
    for (char32_t c = 0; c < kBertTable; ++c) {
      const char32_t one[1] = {c};
      steps.run(std::u32string_view(one, 1), a, d, out[c]);
      context_free[c] = steps.context_free(c) ? 1 : 0;
    }
  }
};

}  // namespace

Normalizer bert_normalizer(bool clean_text, bool handle_chinese_chars, bool strip_accents, bool lowercase) {
  const BertSteps steps{clean_text, handle_chinese_chars, strip_accents, lowercase};
  const auto table = std::make_shared<const BertTable>(steps);
  return [steps, table](std::string& s) {
    // Chunks of about 16 KiB, so that a text of many MB costs a few times its size, not 16x.
    constexpr size_t kChunk = size_t{16} << 10;
    std::string out;
    out.reserve(s.size());
    std::u32string chars, a, d;
    for (size_t begin = 0; begin < s.size();) {
      size_t end = std::min(s.size(), begin + kChunk);
      while (end < s.size() && !starts_sequence(s, end)) ++end;
      // A chunk of characters whose outputs do not depend on their neighbours (most texts: ASCII,
      // Latin, Greek, Cyrillic, ...) is their table entries in order; others go through the steps.
      // (one pass: at the first other character, what the chunk appended is taken back)
      const std::string_view chunk = std::string_view(s).substr(begin, end - begin);
      const size_t mark = out.size();
      for (size_t i = 0, n = 0; i < chunk.size(); i += n) {
        const char32_t c = text::decode_at(chunk, i, &n);
        if (c >= kBertTable || table->context_free[c] == 0) {
          out.resize(mark);
          chars = decode_utf8(chunk);
          steps.run(chars, a, d, out);
          break;
        }
        out += table->out[c];
      }
      begin = end;
    }
    s.swap(out);
  };
}

Normalizer unicode_normalizer(const std::string& form) {
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* n = form == "NFC"    ? icu::Normalizer2::getNFCInstance(err)
                              : form == "NFD"  ? icu::Normalizer2::getNFDInstance(err)
                              : form == "NFKC" ? icu::Normalizer2::getNFKCInstance(err)
                                               : icu::Normalizer2::getNFKDInstance(err);
  HEADS_CHECK(U_SUCCESS(err) && n != nullptr, "tokenizer: ICU ", form, " data unavailable (", u_errorName(err), ")");
  return [n](std::string& s) {
    UErrorCode e = U_ZERO_ERROR;
    const icu::UnicodeString u = n->normalize(icu::UnicodeString::fromUTF8(s), e);
    HEADS_CHECK(U_SUCCESS(e), "tokenizer: Unicode normalization failed (", u_errorName(e), ")");
    s.clear();
    u.toUTF8String(s);
  };
}

Normalizer lowercase_normalizer() {
  return [](std::string& s) { s = map_chars(s, append_lower); };
}

Normalizer strip_accents_normalizer() {
  return [](std::string& s) {
    s = map_chars(s, [](char32_t c, std::string& o) {
      if (!is_mark(c)) append_utf8(o, c);
    });
  };
}

Normalizer strip_normalizer(bool left, bool right) {
  return [=](std::string& s) {
    std::u32string u = decode_utf8(s);
    size_t b = 0, e = u.size();
    while (left && b < e && is_unicode_whitespace(u[b])) ++b;
    while (right && e > b && is_unicode_whitespace(u[e - 1])) --e;
    s = to_utf8(std::u32string_view(u).substr(b, e - b));
  };
}

Normalizer replace_normalizer(Pattern pattern, std::string content) {
  return [pattern = std::move(pattern), content = std::move(content)](std::string& s) {
    std::string out;
    size_t prev = 0;
    for (const auto& [b, e] : pattern.find_all(s)) {
      if (e == b) continue;
      out.append(s, prev, b - prev);
      out += content;
      prev = e;
    }
    out.append(s, prev, std::string::npos);
    s.swap(out);
  };
}

Normalizer prepend_normalizer(std::string prefix) {
  return [prefix = std::move(prefix)](std::string& s) {
    if (!s.empty()) s.insert(0, prefix);
  };
}

Normalizer nmt_normalizer() {
  return [](std::string& s) {
    s = map_chars(s, [](char32_t c, std::string& o) {
      if ((c >= 0x1 && c <= 0x8) || c == 0xB || (c >= 0xE && c <= 0x1F) || c == 0x7F || c == 0x8F || c == 0x9F) return;
      const bool space = c == 0x9 || c == 0xA || c == 0xC || c == 0xD || c == 0x1680 || (c >= 0x200B && c <= 0x200F) ||
                         c == 0x2028 || c == 0x2029 || c == 0x2581 || c == 0xFEFF || c == 0xFFFD;
      append_utf8(o, space ? U' ' : c);
    });
  };
}

const std::string& byte_char(uint8_t b) {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    int n = 0;
    for (int x = 0; x < 256; ++x) {
      const bool printable = (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
      append_utf8(t[static_cast<size_t>(x)], static_cast<char32_t>(printable ? x : 256 + n++));
    }
    return t;
  }();
  return table[b];
}

Normalizer byte_level_normalizer() {
  return [](std::string& s) {
    std::string out;
    for (char ch : s) out += byte_char(static_cast<uint8_t>(ch));
    s.swap(out);
  };
}

// ---- pre-tokenizers --------------------------------------------------------------------------

PreTokenizer bert_pre_tokenizer() {
  const PreTokenizer ws = split_each([](std::string_view p) { return char_matches(p, text::is_whitespace); },
                                     SplitBehavior::Removed);
  const PreTokenizer punct = split_each([](std::string_view p) { return char_matches(p, text::is_punctuation); },
                                        SplitBehavior::Isolated);
  return [ws, punct](std::vector<std::string>& pieces, bool first) {
    ws(pieces, first);
    punct(pieces, first);
  };
}

PreTokenizer whitespace_pre_tokenizer() {
  // The Rust regex crate's \w (Alphabetic, marks, decimal digits, connector punctuation, join controls).
  const Pattern p = Pattern::regex(
      R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}]+|[^\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}\s]+)",
      "Whitespace pre-tokenizer");
  return split_each([p](std::string_view s) { return p.find_all(s); }, SplitBehavior::Removed, /*invert=*/true);
}

PreTokenizer whitespace_split_pre_tokenizer() {
  return split_each([](std::string_view p) { return char_matches(p, is_unicode_whitespace); }, SplitBehavior::Removed);
}

PreTokenizer metaspace_pre_tokenizer(std::string replacement, const std::string& prepend_scheme, bool split) {
  const int scheme = prepend_scheme == "always" ? 0 : prepend_scheme == "first" ? 1 : 2;
  return [replacement = std::move(replacement), scheme, split](std::vector<std::string>& pieces, bool first) {
    std::vector<std::string> out;
    for (size_t i = 0; i < pieces.size(); ++i) {
      std::string s;
      for (char ch : pieces[i]) {
        if (ch == ' ') s += replacement;
        else s.push_back(ch);
      }
      const bool starts = s.compare(0, replacement.size(), replacement) == 0;
      if (!starts && (scheme == 0 || (scheme == 1 && first && i == 0))) s.insert(0, replacement);
      if (split) split_pieces(s, Pattern::literal(replacement).find_all(s), SplitBehavior::MergedWithNext, false, out);
      else if (!s.empty()) out.push_back(std::move(s));
    }
    pieces.swap(out);
  };
}

PreTokenizer byte_level_pre_tokenizer(bool add_prefix_space, bool use_regex) {
  const Pattern gpt2 = Pattern::regex(
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", "ByteLevel pre-tokenizer");
  return [gpt2, add_prefix_space, use_regex](std::vector<std::string>& pieces, bool) {
    std::vector<std::string> split;
    for (auto& p : pieces) {
      if (add_prefix_space && (p.empty() || p[0] != ' ')) p.insert(p.begin(), ' ');
      if (use_regex) split_pieces(p, gpt2.find_all(p), SplitBehavior::Isolated, false, split);
      else if (!p.empty()) split.push_back(p);
    }
    for (auto& p : split) {
      std::string b;
      for (char ch : p) b += byte_char(static_cast<uint8_t>(ch));
      p.swap(b);
    }
    pieces.swap(split);
  };
}

PreTokenizer split_pre_tokenizer(Pattern pattern, SplitBehavior how, bool invert) {
  return split_each([pattern = std::move(pattern)](std::string_view s) { return pattern.find_all(s); }, how, invert);
}

PreTokenizer punctuation_pre_tokenizer(SplitBehavior how) {
  return split_each([](std::string_view p) { return char_matches(p, text::is_punctuation); }, how);
}

PreTokenizer digits_pre_tokenizer(bool individual) {
  const auto numeric = [](char32_t c) {  // Rust's char::is_numeric, Unicode 16.0
    const int8_t t = text::category16(c);
    return t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER || t == U_OTHER_NUMBER;
  };
  return split_each([numeric](std::string_view p) { return char_matches(p, numeric); },
                    individual ? SplitBehavior::Isolated : SplitBehavior::Contiguous);
}

PreTokenizer char_delimiter_pre_tokenizer(char32_t delimiter) {
  return split_each([delimiter](std::string_view p) { return char_matches(p, [&](char32_t c) { return c == delimiter; }); },
                    SplitBehavior::Removed);
}

}  // namespace heads::tok
