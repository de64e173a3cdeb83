"""Encoder families beyond BERT against sentence-transformers: XLM-RoBERTa (RoBERTa position ids from
pad_token_id + 1, a SentencePiece unigram tokenizer converted by transformers) with random weights and a
tokenizer trained here, under mean pooling + Normalize and under CLS pooling; ids and embeddings. MPNet
(RoBERTa position ids, no token types, one relative position bias for every layer) with random weights
and all-MiniLM-L6-v2's WordPiece vocabulary under MPNet's special tokens, as all-mpnet-base-v2 is set up.
ModernBERT (RoPE with a theta per layer type, local attention windows on all but every third layer, GeGLU,
no biases, a final norm) with random weights and a byte-level BPE tokenizer trained here; its reranker head.
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
    spm_dir = _xlmr_tokenizer(tmp)
    tok = transformers.XLMRobertaTokenizerFast.from_pretrained(str(spm_dir))
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
    out = {"spm": spm_dir / "sentencepiece.bpe.model"}
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


def test_xlm_roberta_with_only_its_sentencepiece_model(xlmr_dirs, tmp_path):
    """An XLM-R directory whose tokenizer is only sentencepiece.bpe.model (as older snapshots ship):
    the ids and embeddings of sentence-transformers, which converts the model through transformers."""
    import shutil
    d = tmp_path / "m"
    shutil.copytree(xlmr_dirs["mean"], d)
    (d / "tokenizer.json").unlink()
    shutil.copy(xlmr_dirs["spm"], d / "sentencepiece.bpe.model")
    a = _equals_sentence_transformers(d, "xlm-roberta from sentencepiece.bpe.model")
    np.testing.assert_array_equal(a, heads.SentenceEncoder(str(xlmr_dirs["mean"])).encode(TEXTS))


def test_positions_past_the_table_are_an_error(xlmr_dirs, tmp_path):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(xlmr_dirs["mean"], d)
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 1000}))
    enc = heads.SentenceEncoder(str(d))
    assert enc.max_seq_length == 64  # 66 positions, counted from pad_token_id + 1 = 2
    (d / "tokenizer.json").rename(d / "sentencepiece.bpe.model")
    with pytest.raises(ValueError, match=r"sentencepiece\.bpe\.model: not a SentencePiece model"):
        heads.SentenceEncoder(str(d))
    (d / "sentencepiece.bpe.model").rename(d / "tokenizer.json")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "deberta-v2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r'model_type "deberta-v2" is not supported'):
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


def _saved_pair_logits(model, tok, tmp_path, token_types=True):
    """Noises `model`'s weights, saves it and `tok` to `tmp_path`; returns 20 pairs of TEXTS and
    transformers' first logit for each (pairs cut to 64 tokens)."""
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    pairs = [(TEXTS[i], TEXTS[i + 1]) for i in range(0, 40, 2)]
    with torch.no_grad():
        enc = tok([p[0] for p in pairs], [p[1] for p in pairs], padding=True, truncation=True, max_length=64,
                  return_tensors="pt")
        if not token_types:
            enc.pop("token_type_ids", None)
        return pairs, model(**enc).logits[:, 0].numpy()


def test_mpnet_cross_encoder_scores_as_transformers(mpnet_dir, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(str(mpnet_dir))
    torch.manual_seed(2)
    cfg = transformers.MPNetConfig.from_pretrained(str(mpnet_dir), num_labels=1)
    pairs, want = _saved_pair_logits(transformers.MPNetForSequenceClassification(cfg), tok, tmp_path)
    got = heads.CrossEncoder(str(tmp_path)).predict(pairs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def _modernbert_model(tok, noise, seed, **overrides):
    torch.manual_seed(seed)
    kw = dict(vocab_size=len(tok), hidden_size=72, num_hidden_layers=4, num_attention_heads=4, intermediate_size=80,
              max_position_embeddings=256, local_attention=16, pad_token_id=tok.pad_token_id,
              cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id, bos_token_id=tok.cls_token_id,
              eos_token_id=tok.sep_token_id)
    kw.update(overrides)
    cfg = transformers.ModernBertConfig(**kw)
    assert cfg.hidden_size // cfg.num_attention_heads % 2 == 0 and cfg.hidden_size // cfg.num_attention_heads % 16
    model = transformers.ModernBertModel(cfg).eval()
    with torch.no_grad():  # weights away from their init (LayerNorm weights stay near 1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    return model


def _st_dir(hf, d):
    t = st.models.Transformer(str(hf), max_seq_length=64)
    st.SentenceTransformer(modules=[t, st.models.Pooling(t.get_word_embedding_dimension(), pooling_mode="mean"),
                                    st.models.Normalize()], device="cpu").save(str(d))
    return d


@pytest.fixture(scope="module")
def modernbert_dirs(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    tmp = tmp_path_factory.mktemp("modernbert")
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    bpe.train_from_iterator([t for t in corpus(2000, seed=5) if t.strip()],
                            trainers.BpeTrainer(vocab_size=1500, special_tokens=special,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="[UNK]", cls_token="[CLS]",
                                               sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")
    out = {"tok": tok}
    for name, noise in (("st", 0.2), ("mild", 0.05)):  # mild: a model whose int8 / bf16 error is the kernels'
        hf = tmp / ("hf_" + name)
        _modernbert_model(tok, noise, 3).save_pretrained(str(hf))
        tok.save_pretrained(str(hf))
        out[name] = _st_dir(hf, tmp / name)
    cfg = json.loads((out["st"] / "config.json").read_text())
    assert cfg["model_type"] == "modernbert" and cfg["local_attention"] == 16, cfg
    return out


def test_modernbert_equals_sentence_transformers(modernbert_dirs, tmp_path):
    import shutil
    a = _equals_sentence_transformers(modernbert_dirs["st"], "modernbert")
    assert max(len(heads.SentenceEncoder(str(modernbert_dirs["st"])).tokenize(t)) for t in TEXTS) > 16  # windows show
    # the window and the local layers' theta are read: other values give other embeddings, equal to
    # sentence-transformers' under the same change
    for key, value in (("local_attention", 6), ("rope_parameters", None)):
        d = tmp_path / key
        shutil.copytree(modernbert_dirs["st"], d)
        cfg = json.loads((d / "config.json").read_text())
        if value is None:
            cfg["rope_parameters"]["sliding_attention"]["rope_theta"] = 100.0
        else:
            cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))
        other = heads.SentenceEncoder(str(d)).encode(TEXTS[:40])
        assert np.abs(other - a[:40]).max() > 1e-2, key
        ref = st.SentenceTransformer(str(d), device="cpu").encode(TEXTS[:40], convert_to_numpy=True)
        np.testing.assert_allclose(other, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype,floor", [("bf16", 0.99995), ("int8", 0.9999)])
def test_modernbert_low_precision_is_close_to_f32(modernbert_dirs, dtype, floor):
    d = str(modernbert_dirs["mild"])
    a = heads.SentenceEncoder(d).encode(TEXTS)
    q = heads.SentenceEncoder(d, dtype=dtype).encode(TEXTS)
    cos = (q.astype(np.float64) * a).sum(1) / np.linalg.norm(q, axis=1) / np.linalg.norm(a, axis=1)
    print(f"modernbert {dtype}: worst cosine to f32 {cos.min():.7f}")
    assert cos.min() >= floor, cos.min()
    assert np.abs(q - a).max() > 0  # it did run in another precision


def test_cli_embeds_and_stores_a_modernbert_directory(modernbert_dirs, tmp_path):
    import os
    import shutil
    import subprocess
    cli = os.environ.get("HEADS_CLI") or shutil.which("heads")
    assert cli, "heads CLI not found (HEADS_CLI or PATH)"
    d = str(modernbert_dirs["st"])
    texts = ["naïve café", "東京 北京大学", "word " * 100]
    r = subprocess.run([cli, "embed", "--model", d, "--output", str(tmp_path / "e.npy"), *texts], capture_output=True)
    assert r.returncode == 0, r.stderr
    want = heads.SentenceEncoder(d).encode(texts)
    np.testing.assert_allclose(np.load(tmp_path / "e.npy"), want, atol=2e-6)
    # bf16 storage loads and runs as the same model; int8 storage is for BERT and MPNet: a clear error
    r = subprocess.run([cli, "quantize", d, str(tmp_path / "b16"), "--dtype", "bf16"], capture_output=True)
    assert r.returncode == 0, r.stderr
    got = heads.SentenceEncoder(str(tmp_path / "b16")).encode(texts)
    assert ((got * want).sum(1)).min() > 0.999
    r = subprocess.run([cli, "quantize", d, str(tmp_path / "q8"), "--dtype", "int8"], capture_output=True, text=True)
    assert r.returncode != 0 and "no BERT linear weights" in r.stderr, r.stderr
    assert not (tmp_path / "q8").exists()


def test_serve_answers_for_a_modernbert_directory(modernbert_dirs):
    """heads serve embeds with ModernBERT as the module does; Attend, which runs one nn.MultiheadAttention
    layer, says ModernBERT has none."""
    grpc = pytest.importorskip("grpc")
    from test_serve import Server
    texts = ["naïve café", "hello world", "word " * 100]
    srv = Server(model=str(modernbert_dirs["st"]))
    try:
        status, body, _ = srv.post("/v1/embeddings", {"input": texts})
        assert status == 200, body
        got = np.array([d["embedding"] for d in body["data"]], np.float32)
        np.testing.assert_array_equal(got, heads.SentenceEncoder(str(modernbert_dirs["st"])).encode(texts))
        with srv.client() as c:
            with pytest.raises(grpc.RpcError) as e:
                c.attend(np.ones((3, 72), np.float32), layer=0)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
            assert '"modernbert" has no nn.MultiheadAttention' in e.value.details()
    finally:
        assert srv.stop() == 0


def _modernbert_config_error(src, tmp_path, change, match):
    import shutil
    d = tmp_path / "bad"
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    change(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        heads.SentenceEncoder(str(d))


def test_modernbert_config_errors_name_the_field(modernbert_dirs, tmp_path):
    src = modernbert_dirs["st"]
    _modernbert_config_error(src, tmp_path, lambda c: c.update(hidden_activation="relu"),
                             r'hidden_activation "relu" is not supported')
    _modernbert_config_error(src, tmp_path, lambda c: c.update(num_attention_heads=8),
                             r"head dimension .* = 9 is odd")
    _modernbert_config_error(src, tmp_path, lambda c: c.update(layer_types=["full_attention"] * 3),
                             r'"layer_types" must list one type per layer \(4\)')
    _modernbert_config_error(src, tmp_path, lambda c: c.update(layer_types=["full_attention"] * 3 + ["chunked"]),
                             r'layer_types\[3\] "chunked" is not supported')
    _modernbert_config_error(src, tmp_path, lambda c: c["rope_parameters"].pop("sliding_attention"),
                             r'"rope_parameters" has no "sliding_attention" entry')
    _modernbert_config_error(src, tmp_path, lambda c: c.update(hidden_size=73),
                             r"hidden_size 73 is not divisible by num_attention_heads 4")


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_cross_encoder_scores_as_transformers(modernbert_dirs, tmp_path, pooling):
    tok = modernbert_dirs["tok"]
    torch.manual_seed(4)
    cfg = transformers.ModernBertConfig.from_pretrained(str(modernbert_dirs["st"]), num_labels=1,
                                                        classifier_pooling=pooling)
    pairs, want = _saved_pair_logits(transformers.ModernBertForSequenceClassification(cfg), tok, tmp_path,
                                      token_types=False)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "tokenizer_config.json").read_text()), "model_max_length": 64}))
    got = heads.CrossEncoder(str(tmp_path)).predict(pairs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
