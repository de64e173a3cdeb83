"""Prompt + greedy decoding tokens/s: heads.CausalLM against transformers, in one run, on a random
llama checkpoint of about 100M parameters (built here: nothing downloaded).

    python3 bench/compare_generate.py [--threads N] [--prompt 32] [--new 128] [--repeats 3]

Prints one markdown table (median of the repeats, the runners taking turns): time to first token
(the prompt), decode tokens/s, and whether each run's ids equal transformers' f32 greedy ids.
"""

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import torch
import transformers

import heads


def build(dir_):
    cfg = transformers.LlamaConfig(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                   num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if not n.endswith("norm.weight"):
                p.normal_(0, 0.05)
    m.save_pretrained(dir_, safe_serialization=True)
    return m, sum(p.numel() for p in m.parameters())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    heads.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as d:
        hf, n_params = build(d)
        hf.generation_config.eos_token_id = None
        prompt = torch.from_numpy(np.random.default_rng(1).integers(0, 16000, size=(1, a.prompt)))
        rows = []

        def hf_run(model):
            t0 = time.perf_counter()
            with torch.no_grad():
                model(prompt)  # the prompt alone (first token)
            t1 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=a.new, do_sample=False, pad_token_id=0)
            t2 = time.perf_counter()
            return t1 - t0, (t2 - t1), out[0, a.prompt:].tolist()

        def heads_run(lm, cache_dtype="f32"):
            t0 = time.perf_counter()
            lm(prompt, last_only=True)
            t1 = time.perf_counter()
            ids = lm.generate(prompt[0], max_new_tokens=a.new, cache_dtype=cache_dtype)
            t2 = time.perf_counter()
            return t1 - t0, (t2 - t1), ids

        reference = None
        hf_bf16 = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
        hf_bf16.generation_config.eos_token_id = None
        hf_int8 = torch.ao.quantization.quantize_dynamic(transformers.LlamaForCausalLM.from_pretrained(d).eval(),
                                                         {torch.nn.Linear}, dtype=torch.qint8)
        hf_int8.generation_config.eos_token_id = None
        lm_f32, lm_bf16 = heads.CausalLM.from_pretrained(d), heads.CausalLM.from_pretrained(d, dtype="bf16")
        lm_int8 = heads.CausalLM.from_pretrained(d, dtype="int8")
        lm_int8_one = heads.CausalLM.from_pretrained(d, dtype="int8", activation_error=float("inf"))
        runners = [("transformers f32", lambda: hf_run(hf)), ("heads f32", lambda: heads_run(lm_f32)),
                   ("transformers bf16", lambda: hf_run(hf_bf16)), ("heads bf16 weights", lambda: heads_run(lm_bf16)),
                   ("heads bf16 weights, bf16 KV cache", lambda: heads_run(lm_bf16, "bf16")),
                   ("transformers int8 (quantize_dynamic)", lambda: hf_run(hf_int8)),
                   ("heads int8 weights", lambda: heads_run(lm_int8)),
                   ("heads int8 weights, int8 KV cache", lambda: heads_run(lm_int8, "int8")),
                   ("heads int8 weights, one activation term", lambda: heads_run(lm_int8_one))]
        for _, run in runners:
            run()  # warm-up
        # the runners take turns, repeat after repeat: a slow spell of the host spreads over all of them
        runs = {name: [] for name, _ in runners}
        for _ in range(a.repeats):
            for name, run in runners:
                runs[name].append(run())
        for name, _ in runners:
            ttft, total, ids = zip(*runs[name])
            if reference is None:
                reference = ids[0]
            same = sum(1 for x, y in zip(ids[0], reference) if x == y)
            rows.append((name, statistics.median(ttft) * 1e3, a.new / statistics.median(total), same))
        print(f"random llama, {n_params / 1e6:.0f}M parameters, prompt {a.prompt}, {a.new} new tokens, "
              f"{a.threads} threads, torch {torch.__version__}, transformers {transformers.__version__}")
        print("| runner | prompt ms | generate tokens/s | ids equal to transformers f32 |")
        print("|---|---|---|---|")
        for name, ttft, tps, same in rows:
            print(f"| {name} | {ttft:.1f} | {tps:.1f} | {same}/{a.new} |")
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
