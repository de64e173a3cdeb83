// tokenizer_models.cc — the models of tokenizer.json pipelines (tokenizer_steps.h): WordPiece,
// WordLevel, BPE and Unigram, each giving the ids the tokenizers library gives for a piece.
#include <algorithm>
#include <array>
#include <cstdio>
#include <limits>
#include <map>
#include <queue>

#include "heads/error.h"
#include "tokenizer_steps.h"
#include "unicode_text.h"

namespace heads::tok {

using text::char_len;

namespace {

std::string byte_token(uint8_t b) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "<0x%02X>", b);
  return buf;
}

class WordPiece final : public Model {
 public:
  WordPiece(const Vocab& v, int64_t unk, std::string prefix, int64_t max_chars)
      : v_(v), unk_(unk), prefix_(std::move(prefix)), max_chars_(max_chars) {}
  int64_t unk_id() const override { return unk_; }
  void tokenize(std::string_view word, std::vector<int64_t>& out) const override {
    size_t chars = 0;
    for (size_t i = 0; i < word.size(); i += char_len(word, i)) ++chars;
    if (static_cast<int64_t>(chars) > max_chars_) {
      out.push_back(unk_);
      return;
    }
    const size_t mark = out.size();
    for (size_t start = 0; start < word.size();) {
      // the longest piece from `start` (at character boundaries) in the vocabulary
      std::vector<size_t> ends;
      for (size_t e = start; e < word.size();) {
        e += char_len(word, e);
        ends.push_back(e);
      }
      int64_t found = -1;
      size_t end = start;
      for (size_t k = ends.size(); k-- > 0;) {
        std::string piece = start > 0 ? prefix_ : std::string();
        piece.append(word.substr(start, ends[k] - start));
        found = v_.find(piece);
        if (found >= 0) {
          end = ends[k];
          break;
        }
      }
      if (found < 0) {  // an unknown piece makes the whole word unknown
        out.resize(mark);
        out.push_back(unk_);
        return;
      }
      out.push_back(found);
      start = end;
    }
  }

 private:
  const Vocab& v_;
  int64_t unk_;
  std::string prefix_;
  int64_t max_chars_;
};

class WordLevel final : public Model {
 public:
  WordLevel(const Vocab& v, int64_t unk) : v_(v), unk_(unk) {}
  int64_t unk_id() const override { return unk_; }
  void tokenize(std::string_view word, std::vector<int64_t>& out) const override {
    const int64_t id = v_.find(std::string(word));
    HEADS_CHECK(id >= 0 || unk_ >= 0, "tokenizer: WordLevel: \"", std::string(word),
                "\" is not in the vocabulary and the model has no unk_token");
    out.push_back(id >= 0 ? id : unk_);
  }

 private:
  const Vocab& v_;
  int64_t unk_;
};

class Bpe final : public Model {
 public:
  Bpe(const Vocab& v, std::vector<std::pair<std::pair<int64_t, int64_t>, int64_t>> merges, BpeOptions o)
      : v_(v), o_(std::move(o)) {
    for (size_t r = 0; r < merges.size(); ++r) {
      merges_.emplace(merges[r].first, std::make_pair(static_cast<int64_t>(r), merges[r].second));  // first wins
    }
  }
  int64_t unk_id() const override { return o_.unk; }

  void tokenize(std::string_view word, std::vector<int64_t>& out) const override {
    if (word.empty()) return;
    if (o_.ignore_merges) {
      const int64_t id = v_.find(std::string(word));
      if (id >= 0) {
        out.push_back(id);
        return;
      }
    }
    // 1. the characters as symbols (prefix on all but the first, suffix on the last)
    std::vector<int64_t> sym;
    bool last_unk = false;
    for (size_t i = 0; i < word.size();) {
      const size_t n = char_len(word, i);
      std::string s(word.substr(i, n));
      if (i > 0) s.insert(0, o_.continuing_subword_prefix);
      if (i + n == word.size()) s += o_.end_of_word_suffix;
      const int64_t id = v_.find(s);
      if (id >= 0) {
        sym.push_back(id);
        last_unk = false;
      } else if (o_.byte_fallback && all_bytes_known(word.substr(i, n))) {
        for (size_t k = 0; k < n; ++k) sym.push_back(v_.find(byte_token(static_cast<uint8_t>(word[i + k]))));
        last_unk = false;
      } else if (o_.unk >= 0) {
        if (!(o_.fuse_unk && last_unk)) sym.push_back(o_.unk);
        last_unk = true;
      }  // else: no unk_token, the character is dropped (as the tokenizers library does)
      i += n;
    }
    // 2. merge the pair of lowest rank, leftmost first, until none is left (a heap over a linked list)
    const auto n = static_cast<int64_t>(sym.size());
    std::vector<int64_t> next(static_cast<size_t>(n)), prev(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      next[static_cast<size_t>(i)] = i + 1 < n ? i + 1 : -1;
      prev[static_cast<size_t>(i)] = i - 1;
    }
    struct Cand {
      int64_t rank, pos, left, right;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<>> heap;
    const auto push = [&](int64_t i) {
      if (i < 0) return;  // the first symbol has no left neighbour
      const int64_t j = next[static_cast<size_t>(i)];
      if (j < 0) return;
      const auto it = merges_.find({sym[static_cast<size_t>(i)], sym[static_cast<size_t>(j)]});
      if (it != merges_.end()) heap.push({it->second.first, i, sym[static_cast<size_t>(i)], sym[static_cast<size_t>(j)]});
    };
    for (int64_t i = 0; i + 1 < n; ++i) push(i);
    std::vector<bool> dead(static_cast<size_t>(n), false);
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      const auto i = static_cast<size_t>(c.pos);
      const int64_t j = next[i];
      if (dead[i] || j < 0 || sym[i] != c.left || sym[static_cast<size_t>(j)] != c.right) continue;  // stale
      sym[i] = merges_.at({c.left, c.right}).second;
      dead[static_cast<size_t>(j)] = true;
      next[i] = next[static_cast<size_t>(j)];
      if (next[i] >= 0) prev[static_cast<size_t>(next[i])] = c.pos;
      push(prev[i]);
      push(c.pos);
    }
    for (int64_t i = 0; i >= 0 && i < n; i = next[static_cast<size_t>(i)]) out.push_back(sym[static_cast<size_t>(i)]);
  }

 private:
  bool all_bytes_known(std::string_view ch) const {
    for (char b : ch) {
      if (v_.find(byte_token(static_cast<uint8_t>(b))) < 0) return false;
    }
    return true;
  }

  const Vocab& v_;
  BpeOptions o_;
  std::map<std::pair<int64_t, int64_t>, std::pair<int64_t, int64_t>> merges_;  // pair -> (rank, merged id)
};

class Unigram final : public Model {
 public:
  Unigram(const Vocab& v, std::vector<double> scores, int64_t unk, bool byte_fallback)
      : v_(v), scores_(std::move(scores)), unk_(unk), byte_fallback_(byte_fallback) {
    min_score_ = std::numeric_limits<double>::infinity();
    root_.fill(-1);
    for (size_t id = 0; id < scores_.size(); ++id) {
      min_score_ = std::min(min_score_, scores_[id]);
      const std::string& t = v_.tokens[id];
      if (!t.empty()) insert(t, v_.find(t));  // a duplicate piece: the id the vocabulary maps it to
    }
  }
  int64_t unk_id() const override { return unk_; }

  void tokenize(std::string_view s, std::vector<int64_t>& out) const override {
    if (s.empty()) return;
    constexpr double kUnkPenalty = 10.0;
    const double unk_score = min_score_ - kUnkPenalty;
    struct Node {
      int64_t id = -1;
      double score = 0;
      int64_t start = -1;
    };
    std::vector<Node> best(s.size() + 1);
    for (size_t at = 0; at < s.size();) {
      const double here = best[at].score;
      const size_t mblen = char_len(s, at);
      bool single = false;
      const auto relax = [&](size_t end, int64_t id, double score) {
        Node& t = best[end];
        const double cand = score + here;
        if (t.start < 0 || cand > t.score) t = {id, cand, static_cast<int64_t>(at)};
      };
      // the pieces that are prefixes of s[at..), shortest first (a walk down the trie)
      for (int32_t node = root_[static_cast<uint8_t>(s[at])], end = static_cast<int32_t>(at) + 1; node >= 0;) {
        const Trie& t = nodes_[static_cast<size_t>(node)];
        if (t.id >= 0) {
          relax(static_cast<size_t>(end), t.id, scores_[static_cast<size_t>(t.id)]);
          single = single || static_cast<size_t>(end) - at == mblen;
        }
        if (static_cast<size_t>(end) == s.size()) break;
        node = child(t.child, static_cast<uint8_t>(s[static_cast<size_t>(end)]));
        ++end;
      }
      if (!single) {
        HEADS_CHECK(unk_ >= 0, "tokenizer: Unigram: a character of \"", std::string(s),
                    "\" is in no piece and the model has no unk_id");
        relax(at + mblen, unk_, unk_score);
      }
      at += mblen;
    }
    // back from the end; consecutive unknown pieces fuse into one
    std::vector<std::pair<size_t, size_t>> pieces;  // byte ranges
    std::vector<bool> unk;
    for (size_t end = s.size(); end > 0;) {
      const Node& n = best[end];
      const auto b = static_cast<size_t>(n.start);
      if (n.id == unk_ && !unk.empty() && unk.back()) pieces.back().first = b;
      else {
        pieces.emplace_back(b, end);
        unk.push_back(n.id == unk_);
      }
      end = b;
    }
    for (size_t k = pieces.size(); k-- > 0;) {
      const std::string p(s.substr(pieces[k].first, pieces[k].second - pieces[k].first));
      const int64_t id = v_.find(p);
      if (id >= 0) {
        out.push_back(id);
        continue;
      }
      if (byte_fallback_) {
        std::vector<int64_t> bytes;
        for (char b : p) bytes.push_back(v_.find(byte_token(static_cast<uint8_t>(b))));
        if (std::none_of(bytes.begin(), bytes.end(), [](int64_t x) { return x < 0; })) {
          out.insert(out.end(), bytes.begin(), bytes.end());
          continue;
        }
      }
      out.push_back(unk_);
    }
  }

 private:
  const Vocab& v_;
  std::vector<double> scores_;
  int64_t unk_;
  bool byte_fallback_;
  double min_score_ = 0;
  // A byte trie of the pieces: children as sibling lists, the first byte through a table.
  struct Trie {
    int32_t child = -1, sibling = -1;
    int64_t id = -1;
    uint8_t byte = 0;
  };
  std::vector<Trie> nodes_;
  std::array<int32_t, 256> root_{};

  int32_t child(int32_t first, uint8_t b) const {
    for (int32_t c = first; c >= 0; c = nodes_[static_cast<size_t>(c)].sibling) {
      if (nodes_[static_cast<size_t>(c)].byte == b) return c;
    }
    return -1;
  }
  void insert(const std::string& t, int64_t id) {
    const auto add = [&](uint8_t b) {
      nodes_.push_back({-1, -1, -1, b});
      return static_cast<int32_t>(nodes_.size() - 1);
    };
    int32_t& r = root_[static_cast<uint8_t>(t[0])];
    if (r < 0) r = add(static_cast<uint8_t>(t[0]));
    int32_t node = r;
    for (size_t k = 1; k < t.size(); ++k) {
      const auto b = static_cast<uint8_t>(t[k]);
      int32_t c = child(nodes_[static_cast<size_t>(node)].child, b);
      if (c < 0) {
        c = add(b);
        nodes_[static_cast<size_t>(c)].sibling = nodes_[static_cast<size_t>(node)].child;
        nodes_[static_cast<size_t>(node)].child = c;
      }
      node = c;
    }
    nodes_[static_cast<size_t>(node)].id = id;
  }
};

}  // namespace

std::unique_ptr<Model> wordpiece_model(const Vocab& v, int64_t unk, std::string prefix, int64_t max_chars) {
  return std::make_unique<WordPiece>(v, unk, std::move(prefix), max_chars);
}
std::unique_ptr<Model> wordlevel_model(const Vocab& v, int64_t unk) { return std::make_unique<WordLevel>(v, unk); }
std::unique_ptr<Model> bpe_model(const Vocab& v, std::vector<std::pair<std::pair<int64_t, int64_t>, int64_t>> merges,
                                 BpeOptions o) {
  return std::make_unique<Bpe>(v, std::move(merges), std::move(o));
}
std::unique_ptr<Model> unigram_model(const Vocab& v, std::vector<double> scores, int64_t unk, bool byte_fallback) {
  return std::make_unique<Unigram>(v, std::move(scores), unk, byte_fallback);
}

}  // namespace heads::tok
