// unicode_text_test.cc — the tokenizers' character classes (src/models/unicode_text.h) answer ASCII
// without ICU: every ASCII character's answer against ICU's own properties, the definitions the
// classes follow for every other character.
#include <gtest/gtest.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <string>

#include "models/unicode_text.h"

namespace heads {
namespace {

bool icu_punctuation(UChar32 c) {
  const int8_t t = u_charType(c);
  return t == U_CONNECTOR_PUNCTUATION || t == U_DASH_PUNCTUATION || t == U_START_PUNCTUATION ||
         t == U_END_PUNCTUATION || t == U_INITIAL_PUNCTUATION || t == U_FINAL_PUNCTUATION || t == U_OTHER_PUNCTUATION;
}

TEST(UnicodeText, AsciiClassesAreIcusOwn) {
  const icu::Normalizer2* nfd = text::nfd_instance();
  for (char32_t c = 0; c < 0x80; ++c) {
    const auto u = static_cast<UChar32>(c);
    const int8_t t = u_charType(u);
    const bool tab_lf_cr = c == U'\t' || c == U'\n' || c == U'\r';
    const bool bert_ascii_punct = (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) ||
                                  (c >= 0x7B && c <= 0x7E);
    const std::string at = "U+" + std::to_string(static_cast<unsigned>(c));
    EXPECT_EQ(text::is_control(c), !tab_lf_cr && (t == U_CONTROL_CHAR || t == U_FORMAT_CHAR || t == U_PRIVATE_USE_CHAR))
        << at;
    EXPECT_EQ(text::is_whitespace(c), tab_lf_cr || u_isUWhiteSpace(u)) << at;
    EXPECT_EQ(text::is_punctuation(c), bert_ascii_punct || icu_punctuation(u)) << at;
    EXPECT_EQ(text::is_nonspacing_mark(c), t == U_NON_SPACING_MARK) << at;
    EXPECT_EQ(text::combining_class(c), u_getCombiningClass(u)) << at;
    icu::UnicodeString d;
    EXPECT_FALSE(nfd->getDecomposition(u, d)) << at << " has a decomposition";
    std::u32string out;
    text::decompose(c, out, nfd);
    EXPECT_EQ(out, std::u32string(1, c)) << at;
  }
  // The classes the fast paths stand for are not empty in ASCII (the comparison above is not vacuous).
  EXPECT_TRUE(text::is_control(0x1F) && text::is_control(0x7F) && !text::is_control(U'\t'));
  EXPECT_TRUE(text::is_whitespace(0x0B) && text::is_whitespace(U' ') && !text::is_whitespace(0x1C));
  EXPECT_TRUE(text::is_punctuation(U'$') && text::is_punctuation(U'_') && !text::is_punctuation(U'a'));
}

// UTF-8 in: ASCII runs, every sequence length, and each malformed form as U+FFFD per byte skipped.
TEST(UnicodeText, DecodeUtf8ReplacesWhatIsMalformed) {
  const std::u32string r(1, 0xFFFD);
  EXPECT_EQ(text::decode_utf8("plain ascii"), U"plain ascii");
  EXPECT_EQ(text::decode_utf8("a\xC3\xA9" "b\xE2\x82\xAC\xF0\x9F\x98\x80z"), U"a\u00E9b\u20AC\U0001F600z");
  EXPECT_EQ(text::decode_utf8("\xC0\xAF"), r + r);                       // overlong two-byte lead
  EXPECT_EQ(text::decode_utf8("\xE0\x80\xAF"), r + r + r);              // overlong three-byte form
  EXPECT_EQ(text::decode_utf8("\xED\xA0\x80x"), r + r + r + U"x");      // a surrogate
  EXPECT_EQ(text::decode_utf8("\xF4\x90\x80\x80"), r + r + r + r);     // past U+10FFFF
  EXPECT_EQ(text::decode_utf8("x\xE2\x82"), U"x" + r + r);               // cut short at the end
  EXPECT_EQ(text::decode_utf8("\xE2\x82x"), r + r + U"x");               // cut short by ASCII
  EXPECT_EQ(text::decode_utf8(std::string_view("a\0b", 3)), std::u32string(U"a\0b", 3));
  EXPECT_EQ(text::to_utf8(text::decode_utf8("a\xC3\xA9\xF0\x9F\x98\x80")), "a\xC3\xA9\xF0\x9F\x98\x80");
}

}  // namespace
}  // namespace heads
