// tokenizer_patterns.cc — the patterns of tokenizer.json (Split, Replace: a literal string or a
// regex) and the splits around their matches (tokenizer_steps.h).
//
// Regexes run on PCRE2 with Unicode properties; the tokenizers library runs them on Oniguruma 6.9.10,
// whose tables are Unicode 16.0. Characters assigned after PCRE2's Unicode version (14.0 in Debian
// 12) are matched as stand-ins of their general category, so \w, \p{L}, \p{N} see them as the
// reference does.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/uchar.h>

#include <algorithm>
#include <cstdio>
#include <memory>

#include "heads/error.h"
#include "tokenizer_steps.h"
#include "unicode_text.h"

namespace heads::tok {

using text::char_len;

namespace {

constexpr uint32_t kMatchLimit = 10'000'000;  // a pathological pattern fails instead of running for hours

}  // namespace

// ---- patterns --------------------------------------------------------------------------------

Pattern Pattern::regex(const std::string& pattern, const std::string& what) {
  int err = 0;
  PCRE2_SIZE at = 0;
  pcre2_code* c = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                PCRE2_UTF | PCRE2_UCP, &err, &at, nullptr);
  if (c == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    ::heads::fail(what, ": regex \"", pattern, "\" does not compile at offset ", at, ": ",
               reinterpret_cast<const char*>(msg));
  }
  pcre2_jit_compile(c, PCRE2_JIT_COMPLETE);  // the interpreter runs where the JIT is unavailable
  Pattern p;
  p.code_ = std::shared_ptr<void>(c, [](void* x) { pcre2_code_free(static_cast<pcre2_code*>(x)); });
  return p;
}

Pattern Pattern::literal(std::string s) {
  Pattern p;
  p.literal_ = std::move(s);
  return p;
}

namespace {

// PCRE2's Unicode version x 10 (140 for Debian 12's 10.42).
int pcre2_unicode_version() {
  static const int v = [] {
    char buf[64] = {};
    if (pcre2_config(PCRE2_CONFIG_UNICODE_VERSION, buf) < 0) return 0;
    int major = 0, minor = 0;
    return std::sscanf(buf, "%d.%d", &major, &minor) == 2 ? major * 10 + minor : 0;
  }();
  return v;
}

// A character PCRE2's tables know, of the general category c has as of Unicode 16.0 (and an
// ideograph for an ideograph), for a character assigned after PCRE2's Unicode version.
char32_t stand_in(char32_t c) {
  switch (text::category16(c)) {
    case U_UPPERCASE_LETTER: return 0x0410;
    case U_LOWERCASE_LETTER: return 0x0430;
    case U_TITLECASE_LETTER: return 0x01C5;
    case U_MODIFIER_LETTER: return 0x02B0;
    case U_OTHER_LETTER: return c >= 0x20000 && c <= 0x3FFFF ? 0x4E00 : 0x05D0;
    case U_NON_SPACING_MARK: return 0x0300;
    case U_COMBINING_SPACING_MARK: return 0x0903;
    case U_ENCLOSING_MARK: return 0x20DD;
    case U_DECIMAL_DIGIT_NUMBER: return 0x0660;
    case U_LETTER_NUMBER: return 0x16EE;
    case U_OTHER_NUMBER: return 0x00B2;
    case U_CONNECTOR_PUNCTUATION: return 0x203F;
    case U_DASH_PUNCTUATION: return 0x2010;
    case U_START_PUNCTUATION: return 0x2045;
    case U_END_PUNCTUATION: return 0x2046;
    case U_INITIAL_PUNCTUATION: return 0x00AB;
    case U_FINAL_PUNCTUATION: return 0x00BB;
    case U_OTHER_PUNCTUATION: return 0x00B7;
    case U_MATH_SYMBOL: return 0x00AC;
    case U_CURRENCY_SYMBOL: return 0x00A2;
    case U_MODIFIER_SYMBOL: return 0x00B4;
    case U_OTHER_SYMBOL: return 0x00A6;
    case U_FORMAT_CHAR: return 0x00AD;
    default: return c;
  }
}

// The code point of the well-formed UTF-8 sequence of n bytes at p.
char32_t code_point(const char* p, size_t n) {
  const auto b = [p](size_t i) { return static_cast<char32_t>(static_cast<uint8_t>(p[i])); };
  if (n == 1) return b(0);
  if (n == 2) return (b(0) & 0x1F) << 6 | (b(1) & 0x3F);
  if (n == 3) return (b(0) & 0x0F) << 12 | (b(1) & 0x3F) << 6 | (b(2) & 0x3F);
  return (b(0) & 0x07) << 18 | (b(1) & 0x3F) << 12 | (b(2) & 0x3F) << 6 | (b(3) & 0x3F);
}

// s with the characters PCRE2's tables lack (assigned after its Unicode version) replaced by their
// stand-ins, and the offset in s of every character boundary of the result; empty when s has none.
struct StandIns {
  std::string text;
  std::vector<size_t> origin;  // origin[i]: the offset in s of the result's byte i (text.size() + 1 entries)
};

StandIns with_stand_ins(std::string_view s) {
  StandIns r;
  const int known = pcre2_unicode_version();
  bool any = false;
  for (size_t i = 0; i < s.size();) {
    const size_t n = char_len(s, i);
    char32_t c = 0;
    // every character assigned since 14.0 is at U+0800 or above (a lead byte >= 0xE0)
    if (static_cast<uint8_t>(s[i]) >= 0xE0 && n >= 3) {
      c = code_point(s.data() + i, n);
      const int v = text::added_version(c);
      if (v > known) {
        if (!any) {
          any = true;
          r.text.reserve(s.size());
          r.text.assign(s.substr(0, i));
          r.origin.resize(i);
          for (size_t k = 0; k < i; ++k) r.origin[k] = k;
        }
        text::append_utf8(r.text, stand_in(c));
        r.origin.resize(r.text.size(), i);
        i += n;
        continue;
      }
    }
    if (any) {
      r.text.append(s.substr(i, n));
      for (size_t k = 0; k < n; ++k) r.origin.push_back(i + k);
    }
    i += n;
  }
  if (any) r.origin.push_back(s.size());
  return r;
}

}  // namespace

std::vector<std::pair<size_t, size_t>> Pattern::find_all(std::string_view s) const {
  std::vector<std::pair<size_t, size_t>> m;
  if (!code_) {
    if (literal_.empty()) return m;
    for (size_t at = s.find(literal_); at != std::string_view::npos; at = s.find(literal_, at + literal_.size())) {
      m.emplace_back(at, at + literal_.size());
    }
    return m;
  }
  // The reference matches with Unicode 16.0's tables: characters PCRE2's lack are matched as
  // stand-ins of their category, and the matches mapped back.
  const StandIns alt = with_stand_ins(s);
  if (!alt.text.empty()) {
    m = match_all(alt.text);
    for (auto& [b, e] : m) {
      b = alt.origin[b];
      e = alt.origin[e];
    }
    return m;
  }
  return match_all(s);
}

std::vector<std::pair<size_t, size_t>> Pattern::match_all(std::string_view s) const {
  std::vector<std::pair<size_t, size_t>> m;
  auto* code = static_cast<pcre2_code*>(code_.get());
  std::unique_ptr<pcre2_match_data, void (*)(pcre2_match_data*)> md(
      pcre2_match_data_create_from_pattern(code, nullptr), pcre2_match_data_free);
  std::unique_ptr<pcre2_match_context, void (*)(pcre2_match_context*)> ctx(pcre2_match_context_create(nullptr),
                                                                           pcre2_match_context_free);
  HEADS_CHECK(md && ctx, "tokenizer: out of memory for a regex match");
  pcre2_set_match_limit(ctx.get(), kMatchLimit);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  uint32_t options = 0;  // the first call checks the UTF-8 of the whole text; later ones need not (O(n) each)
  for (size_t start = 0; start <= s.size(); options = PCRE2_NO_UTF_CHECK) {
    int rc = pcre2_match(code, subject, s.size(), start, options, md.get(), ctx.get());
    // the JIT's stack (32 KiB) is too small for this match: the interpreter's heap is not
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) rc = pcre2_match(code, subject, s.size(), start, options | PCRE2_NO_JIT,
                                                           md.get(), ctx.get());
    if (rc == PCRE2_ERROR_NOMATCH) break;
    HEADS_CHECK(rc >= 0, "tokenizer: regex match failed (PCRE2 error ", rc,
                rc == PCRE2_ERROR_MATCHLIMIT ? ": match limit, a pathological pattern" : "", ")");
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    m.emplace_back(ov[0], ov[1]);
    // after an empty match, go on one character later (as Oniguruma's iterator does)
    start = ov[1] > ov[0] ? ov[1] : ov[1] + (ov[1] < s.size() ? char_len(s, ov[1]) : 1);
  }
  return m;
}

void split_pieces(std::string_view s, const std::vector<std::pair<size_t, size_t>>& matches, SplitBehavior how,
                  bool invert, std::vector<std::string>& out) {
  // (range, is_match) covering s, as NormalizedString::split builds it
  std::vector<std::pair<std::pair<size_t, size_t>, bool>> parts;
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    if (prev != b) parts.push_back({{prev, b}, invert});
    parts.push_back({{b, e}, !invert});
    prev = e;
  }
  if (prev != s.size()) parts.push_back({{prev, s.size()}, invert});
  std::vector<std::pair<size_t, size_t>> keep;
  bool prev_match = false;
  switch (how) {
    case SplitBehavior::Isolated:
      for (const auto& p : parts) keep.push_back(p.first);
      break;
    case SplitBehavior::Removed:
      for (const auto& p : parts) {
        if (!p.second) keep.push_back(p.first);
      }
      break;
    case SplitBehavior::MergedWithPrevious:
      for (const auto& [r, is_match] : parts) {
        if (is_match && !prev_match && !keep.empty()) keep.back().second = r.second;
        else keep.push_back(r);
        prev_match = is_match;
      }
      break;
    case SplitBehavior::Contiguous:
      for (size_t i = 0; i < parts.size(); ++i) {
        if (i > 0 && parts[i].second == prev_match) keep.back().second = parts[i].first.second;
        else keep.push_back(parts[i].first);
        prev_match = parts[i].second;
      }
      break;
    case SplitBehavior::MergedWithNext:
      for (size_t i = parts.size(); i-- > 0;) {
        const auto& [r, is_match] = parts[i];
        if (is_match && !prev_match && !keep.empty()) keep.back().first = r.first;
        else keep.push_back(r);
        prev_match = is_match;
      }
      std::reverse(keep.begin(), keep.end());
      break;
  }
  for (const auto& [b, e] : keep) {
    if (e > b) out.emplace_back(s.substr(b, e - b));
  }
}

}  // namespace heads::tok
