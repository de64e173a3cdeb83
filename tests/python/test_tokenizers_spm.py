"""Directories whose tokenizer is only a SentencePiece .model (no tokenizer.json): heads reads the model
as transformers does (the tokenizer.json its tokenizer class builds from it), so ids, pairs, truncation
and decoding equal AutoTokenizer.from_pretrained(DIR)'s. Models trained here: a unigram model in
SentencePiece's default layout (XLM-RoBERTa's and CamemBERT's sentencepiece.bpe.model), one in T5's layout (<pad> 0,
</s> 1, <unk> 2) and a BPE model with byte fallback (Llama's tokenizer.model); the class comes from
tokenizer_config.json's tokenizer_class or config.json's model_type. Malformed models are clear errors.
"""

import json
import random
import shutil
from pathlib import Path

import pytest

import heads
from test_tokenizers import TEXTS, _spm_model

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

# (directory, file name, model, tokenizer_config.json or None, config.json or None)
CASES = [
    ("xlmr", "sentencepiece.bpe.model", "unigram", {"tokenizer_class": "XLMRobertaTokenizer"}, None),
    ("xlmr-by-model-type", "sentencepiece.bpe.model", "unigram", None, {"model_type": "xlm-roberta"}),
    ("xlmr-no-prefix", "sentencepiece.bpe.model", "unigram",
     {"tokenizer_class": "XLMRobertaTokenizerFast", "add_prefix_space": False}, None),
    ("camembert", "sentencepiece.bpe.model", "unigram", None, {"model_type": "camembert"}),
    ("t5", "spiece.model", "t5", None, {"model_type": "t5"}),
    ("t5-extra-ids", "spiece.model", "t5", {"tokenizer_class": "T5Tokenizer", "extra_ids": 10}, None),
    ("llama", "tokenizer.model", "bpe", {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True}, None),
    ("llama-legacy-eos", "tokenizer.model", "bpe",
     {"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True, "add_eos_token": True, "legacy": True}, None),
    ("llama-no-prefix", "tokenizer.model", "bpe", {"tokenizer_class": "LlamaTokenizer", "add_prefix_space": False}, None),
]
NAMES = [c[0] for c in CASES]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spm")
    (tmp / "t5").mkdir()
    return {"unigram": _spm_model(tmp, "unigram", 5000),
            "t5": _spm_model(tmp / "t5", "unigram", 5000, pad_id=0, eos_id=1, unk_id=2, bos_id=-1),
            "bpe": _spm_model(tmp, "bpe", 5000, byte_fallback=True)}


@pytest.fixture(scope="module")
def dirs(models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spm_dirs")
    out = {}
    for name, file, model, tc, cfg in CASES:
        d = tmp / name
        d.mkdir()
        shutil.copy(models[model], d / file)
        if tc is not None:
            (d / "tokenizer_config.json").write_text(json.dumps(tc))
        if cfg is not None:
            (d / "config.json").write_text(json.dumps(cfg))
        out[name] = d
    return out


@pytest.mark.parametrize("name", NAMES)
def test_ids_pairs_truncation_and_decoding_equal_transformers(dirs, name):
    ref = transformers.AutoTokenizer.from_pretrained(str(dirs[name]))
    assert not (dirs[name] / "tokenizer.json").exists()  # transformers built its tokenizer from the .model too
    mine = heads.Tokenizer.from_directory(str(dirs[name]))
    texts = TEXTS + ["<extra_id_3> x <extra_id_0>", "<unk> <s>x</s>"]
    bad = [t for t in texts if ref(t)["input_ids"] != mine.encode(t)["ids"]]
    assert not bad, f"{name}: {len(bad)} of {len(texts)} differ, first {bad[0]!r}: " \
                    f"{ref(bad[0])['input_ids']} vs {mine.encode(bad[0])['ids']}"
    for t in texts[:60]:
        assert ref(t, add_special_tokens=False)["input_ids"] == mine.encode(t, 0, False)["ids"], t
    for n in (5, 16):
        for t in texts[:80]:
            assert ref(t, truncation=True, max_length=n)["input_ids"] == mine.encode(t, n)["ids"], (n, t)
    a, b = texts[:80], texts[80:160]  # batched, as CrossEncoder calls it
    want = ref(a, b, truncation="longest_first", max_length=40)
    for i in range(len(a)):
        got = mine.encode_pair(a[i], b[i], 40)
        assert got["ids"] == want["input_ids"][i], (a[i], b[i])
    for t in texts[:200]:
        ids = ref(t)["input_ids"]
        for skip in (True, False):
            assert mine.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), (t, skip)
    assert mine.vocab_size == len(ref)


def test_an_encoder_directory_with_only_its_sentencepiece_model(models, tmp_path):
    """The same tokenizer from the .model and from the tokenizer.json transformers writes for it."""
    d = tmp_path / "d"
    d.mkdir()
    shutil.copy(models["unigram"], d / "sentencepiece.bpe.model")
    (d / "config.json").write_text(json.dumps({"model_type": "xlm-roberta"}))
    transformers.AutoTokenizer.from_pretrained(str(d)).save_pretrained(str(tmp_path / "saved"))
    a, b = heads.Tokenizer.from_directory(str(d)), heads.Tokenizer.from_file(str(tmp_path / "saved" / "tokenizer.json"))
    for t in TEXTS:
        assert a.encode(t)["ids"] == b.encode(t)["ids"], t


def _write(d, data, tc=None, cfg=None):
    if d.exists():
        shutil.rmtree(d)
    d.mkdir()
    (d / "tokenizer.model").write_bytes(data)
    if tc is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tc))
    if cfg is not None:
        (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_malformed_models_and_settings_are_clear_errors(models, tmp_path):
    bpe = Path(models["bpe"]).read_bytes()
    uni = Path(models["unigram"]).read_bytes()
    llama = {"tokenizer_class": "LlamaTokenizer"}
    d = tmp_path / "m"
    for cut in (1, len(bpe) // 3, len(bpe) // 2 + 1, len(bpe) - 1):
        with pytest.raises(ValueError, match=r"tokenizer\.model: not a SentencePiece model: .* at byte \d+"):
            heads.Tokenizer.from_directory(_write(d, bpe[:cut], llama))
    with pytest.raises(ValueError, match="not a SentencePiece model: no pieces"):
        heads.Tokenizer.from_directory(_write(d, b"", llama))
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        heads.Tokenizer.from_directory(_write(d, b'{"version": "1.0", "model": {}}', llama))
    with pytest.raises(ValueError, match=r'tokenizer_class "AlbertTokenizer" is not read from a SentencePiece model'):
        heads.Tokenizer.from_directory(_write(d, uni, {"tokenizer_class": "AlbertTokenizer"}))
    with pytest.raises(ValueError, match=r"tokenizer_class or .*model_type; got neither \(model_type \"bert\"\)"):
        heads.Tokenizer.from_directory(_write(d, uni, None, {"model_type": "bert"}))
    with pytest.raises(ValueError, match="XLMRobertaTokenizer reads a unigram SentencePiece model; this one is BPE"):
        heads.Tokenizer.from_directory(_write(d, bpe, {"tokenizer_class": "XLMRobertaTokenizer"}))
    with pytest.raises(ValueError, match="LlamaTokenizer reads a BPE SentencePiece model; this one is unigram"):
        heads.Tokenizer.from_directory(_write(d, uni, llama))
    with pytest.raises(ValueError, match=r"extra_ids"):
        heads.Tokenizer.from_directory(_write(d, uni, {"tokenizer_class": "T5Tokenizer", "extra_ids": -1}))
    with pytest.raises(ValueError, match=r"bos_token: expected a string"):
        heads.Tokenizer.from_directory(_write(d, bpe, {"tokenizer_class": "LlamaTokenizer", "bos_token": 3}))
    # bytes changed at random: a tokenizer or a ValueError, never a crash
    rng = random.Random(5)
    loaded = 0
    for _ in range(60):
        b = bytearray(bpe)
        for _ in range(rng.choice([1, 4, 32])):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            t = heads.Tokenizer.from_directory(_write(d, bytes(b), llama))
            t.encode("hello wörld 😀")
            loaded += 1
        except ValueError:
            pass
    assert loaded > 0  # most flips land in piece text or scores and still make a model
