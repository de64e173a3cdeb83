"""Mutation fuzz of decoder model directories: config.json fields set to values of every kind
(negative, zero, huge, fractional, strings, lists, objects, null, missing) and safetensors headers
bent (header length, dtype, shape, offsets, flipped bytes, truncated files), loaded by
heads.CausalLM in a child process that then runs a step on what loads. Every case must load or
raise ValueError: no crash, no hang, no other exception.

    HEADS_FUZZ_CASES=200000 pytest tests/python/test_model_files_fuzz.py   # the long run
"""

import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is installed by the README's set-up")

CASES = int(os.environ.get("HEADS_FUZZ_CASES", "1500"))

CHILD = textwrap.dedent(r"""
    import json, os, random, shutil, struct, sys
    import numpy as np
    import heads

    base_dirs, work, cases, seed = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    VALUES = [-1, 0, 1, 2, 3, 7, 2**31, 2**63 - 1, -2**63, 1e308, -1e308, 1e-320, 0.5, 1.5, "", "x", "llama",
              "gpt2", "linear", "llama3", "yarn", None, True, False, [], [1], {}, {"rope_type": "linear"},
              {"type": "llama3", "factor": 0}, {"rope_type": "linear", "factor": -1}, 10**30, 4096, 65536]

    def mutate_config(cfg):
        cfg = dict(cfg)
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(list(cfg) + ["rope_scaling", "rope_parameters", "sliding_window", "head_dim",
                                          "final_logit_softcapping", "attn_logit_softcapping"])
            r = rng.random()
            if r < 0.15:
                cfg.pop(key, None)
            elif r < 0.9:
                cfg[key] = rng.choice(VALUES)
            else:
                cfg[key] = rng.randint(-10, 10**rng.randint(1, 19))
        return cfg

    def mutate_safetensors(raw):
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        body = raw[8 + n:]
        r = rng.random()
        if r < 0.15:  # the header's length
            return struct.pack("<Q", rng.choice([0, 1, n - 1, n + 1, len(raw), 2**63 - 1, 2**64 - 1])) + raw[8:]
        if r < 0.25:  # a truncated file
            return raw[:rng.randrange(len(raw))]
        if r < 0.35:  # flipped bytes in the header
            b = bytearray(raw)
            for _ in range(rng.randint(1, 4)):
                b[8 + rng.randrange(n)] ^= 1 << rng.randrange(8)
            return bytes(b)
        name = rng.choice([k for k in header if k != "__metadata__"])
        t = header[name]
        field = rng.choice(["dtype", "shape", "data_offsets", "drop", "extra"])
        if field == "dtype":
            t["dtype"] = rng.choice(["F32", "F16", "BF16", "I64", "I8", "F64", "BOOL", "U8", "Q4", "", 5])
        elif field == "shape":
            t["shape"] = rng.choice([[], [0], [-1], [2**62, 2**62], [1] * 9, [rng.randint(0, 10**6)],
                                     list(reversed(t["shape"])), "x", [1.5]])
        elif field == "data_offsets":
            a, b = t["data_offsets"]
            t["data_offsets"] = rng.choice([[b, a], [a, a], [a, len(body) + 1], [-1, b], [0, 2**64], [a], "x",
                                            [a + 1, b + 1], [0, len(body)]])
        elif field == "drop":
            del header[name]
        else:
            header[name + ".extra"] = dict(t)
        h = json.dumps(header).encode()
        return struct.pack("<Q", len(h)) + h + body

    outcomes = {"loaded": 0, "ValueError": 0}
    for case in range(cases):
        base = rng.choice(base_dirs)
        d = os.path.join(work, "m")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        cfg = json.load(open(os.path.join(base, "config.json")))
        raw = open(os.path.join(base, "model.safetensors"), "rb").read()
        if rng.random() < 0.6:
            cfg = mutate_config(cfg)
        else:
            raw = mutate_safetensors(raw)
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        open(os.path.join(d, "model.safetensors"), "wb").write(raw)
        with open(os.path.join(work, "case.txt"), "w") as f:  # what was being tried, if this process dies
            f.write(f"case {case} of {base}\nconfig {json.dumps(cfg)[:2000]}\n")
        try:
            lm = heads.CausalLM.from_pretrained(d)
            vocab = int(cfg.get("vocab_size", 2)) if isinstance(cfg.get("vocab_size"), int) else 2
            lm(np.array([[0, 1, min(2, max(vocab - 1, 0))]]), cache=lm.new_cache())
            outcomes["loaded"] += 1
        except ValueError:
            outcomes["ValueError"] += 1
        except MemoryError:
            outcomes["MemoryError"] = outcomes.get("MemoryError", 0) + 1
    print(json.dumps(outcomes))
""")


def _save(model, path):
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory):
    import torch

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("fuzz-bases")
    small = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4)
    return [
        _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, num_key_value_heads=2)), root / "llama"),
        _save(transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**small, num_key_value_heads=2, head_dim=4)),
              root / "gemma2"),
        _save(transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=4,
                                                                   n_positions=32)), root / "gpt2"),
        _save(transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=32, hidden_size=16, n_layer=2,
                                                                     n_head=4)), root / "bloom"),
    ]


def test_mutated_decoder_configs_and_safetensors_headers_load_or_raise_value_error(base_dirs, tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")  # fresh cases each run; the seed is in any failure
    r = subprocess.run([sys.executable, "-c", CHILD, ",".join(base_dirs), str(tmp_path), str(CASES), str(seed)],
                       capture_output=True, text=True, timeout=60 + CASES * 0.2)
    last = (tmp_path / "case.txt").read_text() if (tmp_path / "case.txt").exists() else ""
    assert r.returncode == 0, f"seed {seed}: exit {r.returncode} at\n{last}\nstderr:\n{r.stderr[-3000:]}"
    outcomes = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"seed {seed}: {outcomes}")
    assert outcomes["loaded"] > 0 and outcomes["ValueError"] > 0, outcomes
    assert sum(outcomes.values()) == CASES
