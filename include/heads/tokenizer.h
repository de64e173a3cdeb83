// tokenizer.h — BERT WordPiece tokenizer (uncased), producing the ids of Hugging Face's
// `tokenizers` (the fast tokenizer) for the same vocab.
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

}  // namespace heads
