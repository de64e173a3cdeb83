// tokenizer.h — the tokenizers of the models heads runs, giving the ids of Hugging Face's
// `tokenizers` library (the "fast" tokenizers of transformers):
//   Tokenizer           any model directory: its tokenizer.json (the tokenizers format: normalizers,
//                       pre-tokenizers, WordPiece / BPE / Unigram / WordLevel models, post-processors,
//                       decoders), or a BERT vocab.txt where the directory has only that, or a
//                       SentencePiece .model alone, read as transformers reads it (the tokenizer.json
//                       that XLMRobertaTokenizer, CamembertTokenizer, T5Tokenizer or LlamaTokenizer
//                       builds from it).
//   WordPieceTokenizer  BERT WordPiece from vocab.txt (uncased or cased), described below.
//
// Pipeline, as tokenizers runs it: exact special tokens ([PAD] [UNK] [CLS] [SEP] [MASK]) are cut
// out of the raw text first; each remaining segment is normalised (delete NUL, U+FFFD and
// control/format/private-use characters; whitespace -> space; spaces around CJK ideographs;
// NFD and removal of non-spacing marks; lower case), split on whitespace and around
// punctuation, then WordPiece (greedy longest match, "##" continuations, [UNK] for a word with
// an unknown piece or more than 100 characters). Truncated to max_length - 2 pieces, then
// [CLS] ... [SEP]; the text past what fits is not read (a few KiB past it at most). Unicode properties come from ICU, restricted to the Unicode versions the
// reference uses (categories 8.0, decompositions 9.0), so results match it exactly.
// Input is UTF-8; invalid bytes are read as U+FFFD, which normalisation removes (as Python's
// errors="replace" followed by tokenizers would).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace heads {

class WordPieceTokenizer {
 public:
  // vocab.txt: one token per line, id = line index (a later duplicate wins).
  static WordPieceTokenizer from_vocab_file(const std::string& path, bool lowercase = true);

  struct Encoding {
    std::vector<int64_t> ids;  // [CLS] pieces [SEP]
    bool truncated = false;    // pieces were dropped to fit max_length
  };
  // max_length counts [CLS] and [SEP]; 0 = no limit.
  Encoding encode(std::string_view text, int64_t max_length = 0) const;
  // The pieces of a text before WordPiece ids (normalised words and punctuation), for display.
  std::vector<std::string> pre_tokenize(std::string_view text) const;

  const std::string& token(int64_t id) const;  // "[UNK]" for an out-of-range id
  int64_t id(const std::string& token) const;  // -1 if absent
  int64_t vocab_size() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t pad_id() const { return pad_; }
  int64_t cls_id() const { return cls_; }
  int64_t sep_id() const { return sep_; }
  int64_t unk_id() const { return unk_; }

 private:
  void wordpiece(const std::u32string& word, std::vector<int64_t>& out) const;
  void encode_pieces(std::string_view text, std::vector<int64_t>& pieces, std::u32string& word) const;
  // Appends the segment's finished words to `words`; `cur` is the unfinished word (continued from
  // before, left for after), kept at most `cap` characters.
  void normalize_and_split(std::u32string_view segment, std::vector<std::u32string>& words, std::u32string& cur,
                           size_t cap) const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> tokens_;
  bool lowercase_ = true;
  int64_t pad_ = 0, unk_ = 100, cls_ = 101, sep_ = 102, mask_ = 103;
  int64_t max_chars_per_word_ = 100;
};

namespace tok {
struct Pipeline;  // tokenizer.json's steps (src/models/tokenizer_steps.h)
}

// A tokenizer as a model directory ships it. tokenizer.json is read as the tokenizers library does:
// added tokens are cut out of the raw text first (leftmost-longest; lstrip / rstrip / single_word /
// normalized as the file says), each remaining stretch is normalised, pre-tokenized and run through
// the model; truncation (right, or as the file's "truncation" says) keeps room for the special
// tokens of the post-processor, which adds them. Supported steps (anything else is an error naming
// the field): normalizers BertNormalizer, NFC, NFD, NFKC, NFKD, Lowercase, StripAccents, Strip,
// Replace, Prepend, Precompiled (SentencePiece's charsmap), Nmt, ByteLevel, Sequence; pre-tokenizers
// BertPreTokenizer, Whitespace, WhitespaceSplit, Metaspace, ByteLevel, Split, Punctuation, Digits,
// CharDelimiterSplit, Sequence; models WordPiece, BPE (merges, byte_fallback, continuing prefix, end
// of word suffix, ignore_merges), Unigram (Viterbi, byte_fallback), WordLevel; post-processors
// TemplateProcessing, BertProcessing, RobertaProcessing, ByteLevel, Sequence; decoders ByteLevel,
// Metaspace, WordPiece, BPEDecoder, Replace, ByteFallback, Fuse, Strip, Sequence. Regexes are PCRE2's
// (UTF, Unicode properties); the reference uses Oniguruma: the two agree on the patterns models ship.
// The file is untrusted input: malformed JSON, wrong types, ids out of range are errors naming the field.
class Tokenizer {
 public:
  // tokenizer.json at `path`.
  static Tokenizer from_file(const std::string& path);
  // A model directory: tokenizer.json if it has one, else vocab.txt (WordPiece, do_lower_case
  // from tokenizer_config.json), else sentencepiece.bpe.model / tokenizer.model / spiece.model.
  static Tokenizer from_directory(const std::string& dir);
  static Tokenizer from_wordpiece(WordPieceTokenizer wordpiece);

  struct Encoding {
    std::vector<int64_t> ids;       // special tokens included
    std::vector<int64_t> type_ids;  // 0 for the first text, 1 for the second of a pair (as the template says)
    bool truncated = false;         // tokens were dropped to fit max_length
  };
  // max_length counts the special tokens; 0 = no limit (or the file's truncation, if it sets one).
  Encoding encode(std::string_view text, int64_t max_length = 0, bool add_special_tokens = true) const;
  // A pair (cross-encoders): truncated longest-first, as transformers' truncation=True does.
  Encoding encode_pair(std::string_view a, std::string_view b, int64_t max_length = 0) const;
  // Text of ids through the file's decoder (tokens joined by spaces without one).
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = true) const;

  const std::string& token(int64_t id) const;  // the unknown token (or "") for an out-of-range id
  int64_t id(const std::string& token) const;  // -1 if absent
  int64_t vocab_size() const;                  // ids are in [0, vocab_size)
  int64_t pad_id() const;                      // the padding token's id, or -1 if it has none
  bool is_special(int64_t id) const;
  // The WordPiece tokenizer, when that is what this is (a vocab.txt directory).
  const WordPieceTokenizer* wordpiece() const { return wordpiece_.get(); }

 private:
  std::shared_ptr<const WordPieceTokenizer> wordpiece_;
  std::shared_ptr<const tok::Pipeline> pipeline_;
};

}  // namespace heads
