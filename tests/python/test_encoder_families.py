"""Encoder families beyond BERT against sentence-transformers: XLM-RoBERTa (RoBERTa position ids from
pad_token_id + 1, a SentencePiece unigram tokenizer converted by transformers) with random weights and a
tokenizer trained here, under mean pooling + Normalize and under CLS pooling; ids and embeddings. MPNet
(RoBERTa position ids, no token types, one relative position bias for every layer) with random weights
and all-MiniLM-L6-v2's WordPiece vocabulary under MPNet's special tokens, as all-mpnet-base-v2 is set up.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import heads

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python" / "ref"))
from corpus import corpus  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")
st = pytest.importorskip("sentence_transformers")
import sentence_transformers.models  # noqa: E402

TEXTS = [t for t in corpus(300, seed=11)] + ["", "hello world", "naïve café", "word " * 200, "東京 北京大学"]


def _xlmr_tokenizer(tmp: Path) -> Path:
    data = tmp / "train.txt"
    data.write_text("\n".join(t for t in corpus(2000, seed=3) if t.strip()), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(data), model_prefix=str(tmp / "spm"), vocab_size=3000,
                                   model_type="unigram", character_coverage=0.98, minloglevel=2)
    src = tmp / "spm_dir"
    src.mkdir()
    (src / "sentencepiece.bpe.model").write_bytes((tmp / "spm.model").read_bytes())
    return src


@pytest.fixture(scope="module")
def xlmr_dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("xlmr")
    tok = transformers.XLMRobertaTokenizerFast.from_pretrained(str(_xlmr_tokenizer(tmp)))
    torch.manual_seed(0)
    cfg = transformers.XLMRobertaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=96, max_position_embeddings=66,
                                        type_vocab_size=1, pad_token_id=tok.pad_token_id, hidden_act="gelu")
    model = transformers.XLMRobertaModel(cfg, add_pooling_layer=False).eval()
    with torch.no_grad():  # weights far from their init so that every term shows in the output
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf = tmp / "hf"
    model.save_pretrained(str(hf))
    tok.save_pretrained(str(hf))
    out = {}
    for name, mode, norm in (("mean", "mean", True), ("cls", "cls", False)):
        t = st.models.Transformer(str(hf), max_seq_length=64)
        mods = [t, st.models.Pooling(t.get_word_embedding_dimension(), pooling_mode=mode)]
        if norm:
            mods.append(st.models.Normalize())
        d = tmp / name
        st.SentenceTransformer(modules=mods, device="cpu").save(str(d))
        assert json.loads((d / "config.json").read_text())["model_type"] == "xlm-roberta"
        out[name] = d
    return out


def _equals_sentence_transformers(d, label):
    """heads' token ids and embeddings of TEXTS against sentence-transformers' for the directory d
    (max_seq_length 64); returns heads' embeddings."""
    ref = st.SentenceTransformer(str(d), device="cpu")
    mine = heads.SentenceEncoder(str(d))
    assert mine.max_seq_length == 64
    for t in TEXTS:
        assert mine.tokenize(t) == ref.tokenizer(t, truncation=True, max_length=64)["input_ids"], t
    a = mine.encode(TEXTS)
    b = ref.encode(TEXTS, convert_to_numpy=True)
    cos = (a.astype(np.float64) * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    print(f"{label}: worst cosine {cos.min():.8f} over {len(TEXTS)} texts")
    assert cos.min() >= 0.99999, (cos.min(), TEXTS[int(np.argmin(cos))][:60])
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))
    return a


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_xlm_roberta_equals_sentence_transformers(xlmr_dirs, pooling):
    a = _equals_sentence_transformers(xlmr_dirs[pooling], pooling)
    if pooling == "mean":
        np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, rtol=1e-5)


def test_positions_past_the_table_are_an_error(xlmr_dirs, tmp_path):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(xlmr_dirs["mean"], d)
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 1000}))
    enc = heads.SentenceEncoder(str(d))
    assert enc.max_seq_length == 64  # 66 positions, counted from pad_token_id + 1 = 2
    (d / "tokenizer.json").rename(d / "sentencepiece.bpe.model")
    with pytest.raises(ValueError, match=r"only a SentencePiece sentencepiece\.bpe\.model"):
        heads.SentenceEncoder(str(d))
    (d / "sentencepiece.bpe.model").rename(d / "tokenizer.json")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "modernbert"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r'model_type "modernbert" is not supported'):
        heads.SentenceEncoder(str(d))


def test_cli_embeds_an_xlm_roberta_directory(xlmr_dirs, tmp_path):
    import os
    import shutil
    import subprocess
    cli = os.environ.get("HEADS_CLI") or shutil.which("heads")
    assert cli, "heads CLI not found (HEADS_CLI or PATH)"
    texts = ["naïve café", "東京 北京大学", "word " * 100]
    r = subprocess.run([cli, "embed", "--model", str(xlmr_dirs["mean"]), "--output", str(tmp_path / "e.npy"), *texts],
                       capture_output=True)
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(np.load(tmp_path / "e.npy"), heads.SentenceEncoder(str(xlmr_dirs["mean"])).encode(texts),
                               atol=2e-6)


@pytest.fixture(scope="module")
def mpnet_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mpnet")
    minilm = Path(heads.SentenceEncoder().model_dir)
    vocab = (minilm / "vocab.txt").read_text(encoding="utf-8").split("\n")
    vocab = ["<s>", "<pad>", "</s>", "<unk>"] + [v for v in vocab if v] + ["<mask>"]
    tok = transformers.MPNetTokenizerFast(vocab={v: i for i, v in enumerate(vocab)})
    torch.manual_seed(1)
    cfg = transformers.MPNetConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=96, max_position_embeddings=66, relative_attention_num_buckets=32,
                                   pad_token_id=tok.pad_token_id)
    model = transformers.MPNetModel(cfg, add_pooling_layer=False).eval()
    with torch.no_grad():  # weights far from their init (the relative bias table too)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf = tmp / "hf"
    model.save_pretrained(str(hf))
    tok.save_pretrained(str(hf))
    t = st.models.Transformer(str(hf), max_seq_length=64)
    d = tmp / "st"
    st.SentenceTransformer(modules=[t, st.models.Pooling(t.get_word_embedding_dimension(), pooling_mode="mean"),
                                    st.models.Normalize()], device="cpu").save(str(d))
    assert json.loads((d / "config.json").read_text())["model_type"] == "mpnet"
    return d


def test_mpnet_equals_sentence_transformers(mpnet_dir, tmp_path):
    a = _equals_sentence_transformers(mpnet_dir, "mpnet")
    # without the relative position bias the embeddings are not these: the table is used
    from safetensors.numpy import load_file, save_file
    import shutil
    d = tmp_path / "flat"
    shutil.copytree(mpnet_dir, d)
    w = load_file(str(d / "model.safetensors"))
    w["encoder.relative_attention_bias.weight"] = np.zeros_like(w["encoder.relative_attention_bias.weight"])
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    flat = heads.SentenceEncoder(str(d)).encode(TEXTS[:20])
    assert np.abs(flat - a[:20]).max() > 1e-2
    # int8: calibrated, stored by `heads quantize`, close to f32
    q = heads.SentenceEncoder(str(mpnet_dir), dtype="int8").encode(TEXTS)
    cq = (q.astype(np.float64) * a).sum(1) / np.linalg.norm(q, axis=1) / np.linalg.norm(a, axis=1)
    assert cq.min() >= 0.999, cq.min()
    import os
    import subprocess
    cli = os.environ.get("HEADS_CLI") or shutil.which("heads")
    r = subprocess.run([cli, "quantize", str(mpnet_dir), str(tmp_path / "q8"), "--dtype", "int8"], capture_output=True)
    assert r.returncode == 0, r.stderr
    stored = load_file(str(tmp_path / "q8" / "model.safetensors"))
    assert stored["encoder.layer.0.attention.attn.q.weight"].dtype == np.int8
    assert stored["encoder.layer.1.attention.attn.o.weight"].dtype == np.int8
    assert np.array_equal(heads.SentenceEncoder(str(tmp_path / "q8")).encode(TEXTS), q)  # as stored: the same bits


def test_mpnet_cross_encoder_scores_as_transformers(mpnet_dir, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(str(mpnet_dir))
    torch.manual_seed(2)
    cfg = transformers.MPNetConfig.from_pretrained(str(mpnet_dir), num_labels=1)
    model = transformers.MPNetForSequenceClassification(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    pairs = [(TEXTS[i], TEXTS[i + 1]) for i in range(0, 40, 2)]
    with torch.no_grad():
        enc = tok([p[0] for p in pairs], [p[1] for p in pairs], padding=True, truncation=True, max_length=64,
                  return_tensors="pt")
        want = model(**enc).logits[:, 0].numpy()
    got = heads.CrossEncoder(str(tmp_path)).predict(pairs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
