#!/usr/bin/env python3
"""Writes bench/sentences.txt: 1,000 English-like sentences of mixed length (3 to ~200 words),
deterministic, for `heads bench embed` and bench/compare_embed.py."""

import random
from pathlib import Path

WORDS = ("the a an of to in and is was for on with as by at from that this it be are were has have "
         "model attention transformer token sentence embedding vector similarity search query document "
         "cat dog mat park city river mountain music guitar piano market price stock investor bank "
         "quickly slowly carefully today yesterday tomorrow because although however therefore "
         "computer network language learning training inference memory cache processor thread "
         "science history biology physics chemistry mathematics economics politics weather climate").split()


def sentence(r: random.Random) -> str:
    n = min(int(r.lognormvariate(2.6, 0.8)) + 3, 200)
    words = [r.choice(WORDS) for _ in range(n)]
    words[0] = words[0].capitalize()
    for i in range(5, n, r.randint(6, 12)):
        words[i] += ","
    return " ".join(words) + r.choice([".", ".", "!", "?"])


if __name__ == "__main__":
    r = random.Random(2026)
    out = Path(__file__).with_name("sentences.txt")
    out.write_text("\n".join(sentence(r) for _ in range(1000)) + "\n")
    print(f"wrote {out}")
