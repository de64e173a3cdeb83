// tokenizer_decoders.cc — the decoders of tokenizer.json pipelines (tokenizer_steps.h), each as the
// tokenizers library defines it: ids back to text.
#include <string>
#include <unordered_map>
#include <vector>

#include "tokenizer_steps.h"
#include "unicode_text.h"

namespace heads::tok {

using text::append_utf8;
using text::decode_utf8;
using text::to_utf8;

std::string cleanup_spaces(std::string s) {
  static const std::pair<const char*, const char*> kRules[] = {
      {" .", "."},   {" ?", "?"},   {" !", "!"},         {" ,", ","},     {" ' ", "'"},   {" n't", "n't"},
      {" 'm", "'m"}, {" do not", " don't"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  for (const auto& [from, to] : kRules) {
    std::string out;
    const std::string_view f(from);
    size_t prev = 0;
    for (size_t at = s.find(f); at != std::string::npos; at = s.find(f, prev)) {
      out.append(s, prev, at - prev);
      out += to;
      prev = at + f.size();
    }
    out.append(s, prev, std::string::npos);
    s.swap(out);
  }
  return s;
}

Decoder byte_level_decoder() {
  return [](std::vector<std::string>& tokens) {
    static const std::unordered_map<char32_t, uint8_t> kBytes = [] {
      std::unordered_map<char32_t, uint8_t> m;
      for (int b = 0; b < 256; ++b) m[decode_utf8(byte_char(static_cast<uint8_t>(b)))[0]] = static_cast<uint8_t>(b);
      return m;
    }();
    std::string bytes;
    for (const auto& t : tokens) {
      std::string tb;
      bool all = true;
      for (char32_t c : decode_utf8(t)) {
        const auto it = kBytes.find(c);
        if (it == kBytes.end()) {
          all = false;
          break;
        }
        tb.push_back(static_cast<char>(it->second));
      }
      bytes += all ? tb : t;
    }
    tokens.assign(1, to_utf8(decode_utf8(bytes)));  // invalid UTF-8 as U+FFFD (from_utf8_lossy)
  };
}

Decoder metaspace_decoder(std::string replacement, bool strip_first) {
  const char32_t rep = decode_utf8(replacement).empty() ? U'\u2581' : decode_utf8(replacement)[0];
  return [rep, strip_first](std::vector<std::string>& tokens) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string o;
      for (char32_t c : decode_utf8(tokens[i])) {
        if (c != rep) append_utf8(o, c);
        else if (!(i == 0 && strip_first)) o.push_back(' ');
      }
      tokens[i].swap(o);
    }
  };
}

Decoder wordpiece_decoder(std::string prefix, bool cleanup) {
  return [prefix = std::move(prefix), cleanup](std::vector<std::string>& tokens) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string& t = tokens[i];
      if (i != 0) {
        if (!prefix.empty() && t.compare(0, prefix.size(), prefix) == 0) t.erase(0, prefix.size());
        else t.insert(t.begin(), ' ');
      }
      if (cleanup) t = cleanup_spaces(t);
    }
  };
}

Decoder bpe_decoder(std::string suffix) {
  return [suffix = std::move(suffix)](std::vector<std::string>& tokens) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      const std::string& t = tokens[i];
      size_t prev = 0;
      for (size_t at = suffix.empty() ? std::string::npos : t.find(suffix); at != std::string::npos;
           at = t.find(suffix, prev)) {
        out.append(t, prev, at - prev);
        out += i + 1 == tokens.size() ? "" : " ";
        prev = at + suffix.size();
      }
      out.append(t, prev, std::string::npos);
      tokens[i].swap(out);
    }
  };
}

Decoder replace_decoder(Pattern pattern, std::string content) {
  const Normalizer r = replace_normalizer(std::move(pattern), std::move(content));
  return [r](std::vector<std::string>& tokens) {
    for (auto& t : tokens) r(t);
  };
}

Decoder byte_fallback_decoder() {
  return [](std::vector<std::string>& tokens) {
    std::vector<std::string> out;
    std::string bytes;
    size_t nbytes = 0;
    const auto flush = [&] {
      if (nbytes == 0) return;
      const std::string valid = to_utf8(decode_utf8(bytes));
      if (valid == bytes) {
        out.push_back(bytes);
      } else {
        for (size_t k = 0; k < nbytes; ++k) out.emplace_back("\xEF\xBF\xBD");  // one U+FFFD per byte token
      }
      bytes.clear();
      nbytes = 0;
    };
    for (auto& t : tokens) {
      unsigned v = 0;
      const bool byte = t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && std::isxdigit(t[3]) &&
                        std::isxdigit(t[4]) && std::sscanf(t.c_str() + 3, "%2x", &v) == 1;
      if (byte) {
        bytes.push_back(static_cast<char>(v));
        ++nbytes;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens.swap(out);
  };
}

Decoder fuse_decoder() {
  return [](std::vector<std::string>& tokens) {
    std::string all;
    for (const auto& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  };
}

Decoder strip_decoder(std::string content, int64_t start, int64_t stop) {
  return [content = std::move(content), start, stop](std::vector<std::string>& tokens) {
    for (auto& t : tokens) {
      std::u32string u = decode_utf8(t);
      const std::u32string c = decode_utf8(content);
      size_t b = 0, e = u.size();
      for (int64_t k = 0; k < start && b < e && !c.empty() && u[b] == c[0]; ++k) ++b;
      for (int64_t k = 0; k < stop && e > b && !c.empty() && u[e - 1] == c[0]; ++k) --e;
      t = to_utf8(std::u32string_view(u).substr(b, e - b));
    }
  };
}

}  // namespace heads::tok
