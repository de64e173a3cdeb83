"""A deterministic corpus of varied text lines for tokenizer cross-checks.

    python3 python/ref/corpus.py [N] > corpus.txt

Lines mix English sentences, numbers and punctuation, accented Latin, Greek, Cyrillic, Arabic,
Hebrew, Devanagari, Thai, CJK, kana, Hangul, emoji (with ZWJ and variation selectors), symbols,
combining marks, zero-width and control characters, unusual whitespace, very long words, empty
lines, whitespace runs, special tokens, and random code points from every plane.
"""

import random
import sys

WORDS = ("the cat sat on mat a dog ran quickly over lazy fox attention is all you need transformer "
         "model embedding sentence similarity tokenization unbelievable internationalization "
         "don't can't it's U.S.A. e-mail state-of-the-art 3.14159 1,000,000 $5.00 50% #hashtag "
         "@user http://example.com/path?q=1&r=2 C++ naïve résumé façade coöperate Zürich São "
         "Paulo Москва Ελλάδα العربية עברית हिन्दी ภาษาไทย 東京 北京大学 こんにちは カタカナ 한국어 "
         "😀 👍🏽 ❤️ 👨‍👩‍👧 🇫🇷 ∑∫√ ©®™ €£¥ ½¾ ﬁﬂ ＡＢＣ １２３").split()

BLOCKS = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x5FF),
          (0x600, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x1E00, 0x1EFF),
          (0x2000, 0x206F), (0x20A0, 0x20CF), (0x2100, 0x22FF), (0x2E00, 0x2E7F), (0x3000, 0x30FF),
          (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xE000, 0xE0FF), (0xF900, 0xFAFF),
          (0xFE00, 0xFE0F), (0xFF00, 0xFFEF), (0xFFF0, 0xFFFF), (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF),
          (0x2B740, 0x2B92F), (0xE0000, 0xE007F)]
ODD = ["\u200b", "\u200d", "\u00ad", "\ufeff", "\u2028", "\u3000", "\u00a0", "\x0b", "\x0c", "\x1c",
       "\x85", "\x00", "\ufffd", "\t", "\r", "\u0301", "\u0308", "\ufe0f", "[CLS]", "[SEP]", "[MASK]",
       "[PAD]", "[UNK]", "[mask]", "  ", "   \t  "]


def line(r: random.Random) -> str:
    kind = r.random()
    if kind < 0.03:
        return ""
    if kind < 0.06:
        return " " * r.randint(1, 8) + "\t" * r.randint(0, 2)
    if kind < 0.35:  # sentences
        return " ".join(r.choice(WORDS) for _ in range(r.randint(1, 25)))
    if kind < 0.55:  # sentences salted with odd characters
        parts = [r.choice(WORDS) for _ in range(r.randint(1, 15))]
        for _ in range(r.randint(1, 5)):
            parts.insert(r.randrange(len(parts) + 1), r.choice(ODD))
        return r.choice(["", " "]).join(parts)
    if kind < 0.60:  # long words
        return " ".join("".join(r.choice("abcdefghij") for _ in range(r.randint(90, 130))) for _ in range(r.randint(1, 3)))
    if kind < 0.65:  # long lines (truncation)
        return " ".join(r.choice(WORDS) for _ in range(r.randint(200, 400)))
    if kind < 0.85:  # characters from blocks
        chars = []
        for _ in range(r.randint(1, 40)):
            lo, hi = r.choice(BLOCKS)
            chars.append(chr(r.randint(lo, hi)))
            if r.random() < 0.2:
                chars.append(" ")
        return "".join(chars)
    # any code point outside the surrogates (unassigned ones included)
    chars = []
    for _ in range(r.randint(1, 30)):
        c = r.randint(1, 0x10FFFF)
        while 0xD800 <= c <= 0xDFFF:
            c = r.randint(1, 0x10FFFF)
        chars.append(chr(c))
    return "".join(chars)


def corpus(n: int = 2500, seed: int = 0):
    r = random.Random(seed)
    # one text per line: line breaks inside a line are replaced
    return [line(r).replace("\n", " ") for _ in range(n)]


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2500
    sys.stdout.write("\n".join(corpus(n)) + "\n")
