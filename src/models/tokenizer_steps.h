// tokenizer_steps.h — the steps of a tokenizer.json pipeline (internal; heads/tokenizer.h says
// what is supported). Strings are UTF-8 throughout; a step that meets invalid UTF-8 reads it as
// U+FFFD.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace heads::tok {

// A compiled PCRE2 pattern (UTF, Unicode properties), or a literal string.
class Pattern {
 public:
  static Pattern regex(const std::string& pattern, const std::string& what);
  static Pattern literal(std::string s);
  // Non-overlapping matches [begin, end) of s, left to right (empty matches included).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const;

 private:
  std::vector<std::pair<size_t, size_t>> match_all(std::string_view s) const;  // the regex's matches
  std::shared_ptr<void> code_;  // pcre2_code_8, or null for a literal
  std::string literal_;
};

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };
// The pieces of s between and around `matches` (sorted, non-overlapping), as tokenizers'
// NormalizedString::split arranges them; empty pieces are dropped.
void split_pieces(std::string_view s, const std::vector<std::pair<size_t, size_t>>& matches, SplitBehavior how,
                  bool invert, std::vector<std::string>& out);

// Normalizer: rewrites a stretch of text in place.
using Normalizer = std::function<void(std::string&)>;
// Pre-tokenizer: splits the pieces further; `first` is true for the stretch the text starts with
// (Metaspace's prepend_scheme "first").
using PreTokenizer = std::function<void(std::vector<std::string>& pieces, bool first)>;
// Decoder: rewrites the token strings (decode_chain); the text is their concatenation.
using Decoder = std::function<void(std::vector<std::string>& tokens)>;

struct Vocab {
  std::vector<std::string> tokens;                   // by id ("" for an id the file skips)
  std::unordered_map<std::string, int64_t> ids;
  int64_t find(const std::string& t) const {
    const auto it = ids.find(t);
    return it == ids.end() ? -1 : it->second;
  }
};

// A model: the ids of one pre-tokenized piece, appended to out.
class Model {
 public:
  virtual ~Model() = default;
  virtual void tokenize(std::string_view piece, std::vector<int64_t>& out) const = 0;
  virtual int64_t unk_id() const { return -1; }
};

std::unique_ptr<Model> wordpiece_model(const Vocab& v, int64_t unk, std::string prefix, int64_t max_chars);
std::unique_ptr<Model> wordlevel_model(const Vocab& v, int64_t unk);
struct BpeOptions {
  int64_t unk = -1;
  std::string continuing_subword_prefix, end_of_word_suffix;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
};
// merges: pairs of token ids in rank order, each with the id of what they merge into.
std::unique_ptr<Model> bpe_model(const Vocab& v, std::vector<std::pair<std::pair<int64_t, int64_t>, int64_t>> merges,
                                 BpeOptions o);
std::unique_ptr<Model> unigram_model(const Vocab& v, std::vector<double> scores, int64_t unk, bool byte_fallback);

// Normalizers.
Normalizer bert_normalizer(bool clean_text, bool handle_chinese_chars, bool strip_accents, bool lowercase);
Normalizer unicode_normalizer(const std::string& form);  // "NFC", "NFD", "NFKC", "NFKD"
Normalizer lowercase_normalizer();
Normalizer strip_accents_normalizer();
Normalizer strip_normalizer(bool left, bool right);
Normalizer replace_normalizer(Pattern pattern, std::string content);
Normalizer prepend_normalizer(std::string prefix);
Normalizer nmt_normalizer();
Normalizer byte_level_normalizer();
// SentencePiece's precompiled charsmap (the decoded bytes of "precompiled_charsmap").
Normalizer precompiled_normalizer(const std::string& charsmap, const std::string& what);

// Pre-tokenizers.
PreTokenizer bert_pre_tokenizer();
PreTokenizer whitespace_pre_tokenizer();        // \w+|[^\w\s]+
PreTokenizer whitespace_split_pre_tokenizer();
PreTokenizer metaspace_pre_tokenizer(std::string replacement, const std::string& prepend_scheme, bool split);
PreTokenizer byte_level_pre_tokenizer(bool add_prefix_space, bool use_regex);
PreTokenizer split_pre_tokenizer(Pattern pattern, SplitBehavior how, bool invert);
PreTokenizer punctuation_pre_tokenizer(SplitBehavior how);
PreTokenizer digits_pre_tokenizer(bool individual);
PreTokenizer char_delimiter_pre_tokenizer(char32_t delimiter);

// Decoders.
Decoder byte_level_decoder();
Decoder metaspace_decoder(std::string replacement, bool strip_first);
Decoder wordpiece_decoder(std::string prefix, bool cleanup);
Decoder bpe_decoder(std::string suffix);
Decoder replace_decoder(Pattern pattern, std::string content);
Decoder byte_fallback_decoder();
Decoder fuse_decoder();
Decoder strip_decoder(std::string content, int64_t start, int64_t stop);
// transformers' clean_up_tokenization (also the WordPiece decoder's cleanup).
std::string cleanup_spaces(std::string s);

// The byte-level alphabet of GPT-2: byte b as a character (UTF-8).
const std::string& byte_char(uint8_t b);

// The post-processor as a template: pieces of the single and the pair encodings.
struct TemplatePiece {
  int sequence = -1;             // 0 = A, 1 = B; -1 = special tokens
  std::vector<int64_t> ids;      // the special tokens' ids
  int64_t type_id = 0;
};
struct Template {
  std::vector<TemplatePiece> single, pair;
  int64_t added(bool pair_) const {
    int64_t n = 0;
    for (const auto& p : pair_ ? pair : single) n += static_cast<int64_t>(p.ids.size());
    return n;
  }
};

struct AddedToken {
  int64_t id = 0;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

struct Pipeline {
  Vocab vocab;  // the model's vocabulary with the added tokens
  std::vector<AddedToken> added;
  std::vector<Normalizer> normalizers;
  std::vector<PreTokenizer> pre_tokenizers;
  std::unique_ptr<Model> model;
  Template post;  // empty: no special tokens added
  std::vector<Decoder> decoders;
  bool has_decoder = false;
  int64_t truncation = 0;  // the file's max_length (0: none)
  bool truncate_left = false;
  int64_t pad_id = -1;
};

// Parses tokenizer.json's text; `label` names the file in errors.
std::shared_ptr<const Pipeline> load_pipeline(std::string_view json_text, const std::string& label);

// The tokenizer.json that transformers builds for a directory `dir` whose tokenizer is only the
// SentencePiece model `model_file` (tokenizer_spm.cc): XLMRobertaTokenizer, CamembertTokenizer,
// T5Tokenizer or LlamaTokenizer, by tokenizer_config.json's tokenizer_class or config.json's model_type.
std::string sentencepiece_tokenizer_json(const std::string& model_file, const std::string& dir);

}  // namespace heads::tok
