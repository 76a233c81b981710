#!/usr/bin/env python3
"""Loads a merged export of `strata finetune --export-merged DIR` with transformers, as a user
would, and generates from it: the check that the directory is a Hugging Face model directory
(`config.json`, the safetensors weights and their index, and, over a GGUF base,
`tokenizer.json`, `tokenizer_config.json` with the chat template, `generation_config.json`).

    pip install torch transformers safetensors
    python3 benches/peers/check_export.py DIR [--prompt TEXT] [--max-new N] [--expect IDS]

It prints the dtype `config.json` names and the weights' (every tensor of the files), the
prompt rendered with the chat template (`apply_chat_template`, the generation prompt added)
and tokenized by `AutoTokenizer`, and the greedy tokens of `AutoModelForCausalLM` computed in
float32 (a bf16 export upcast, as `strata generate --dtype f32` computes it), no stop token,
the whole sequence each step. With `--expect IDS` (comma-separated: the last line of `strata
generate --model DIR-or-BASE.gguf [--adapter ADAPTER] --chat --prompt TEXT --max-new N
--stop-tokens none`) it exits 1 unless the tokens are those. `--prompt-ids IDS` gives the
prompt as token ids instead (no template, no tokenizer needed).
"""

import argparse
import json
import os
import sys

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--prompt", default="What is strata?")
    ap.add_argument("--prompt-ids")
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--expect")
    a = ap.parse_args()
    config = json.load(open(os.path.join(a.dir, "config.json")))
    dtypes = set()
    for f in sorted(os.listdir(a.dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(a.dir, f), "pt") as st:
                for k in st.keys():
                    dtypes.add(str(st.get_slice(k).get_dtype()))
    files = sorted(os.listdir(a.dir))
    weights = [f for f in files if f.endswith(".safetensors")]
    print(f"{a.dir}: {len(weights)} safetensors files, and {[f for f in files if f not in weights]}")
    print(f"config.json: {config.get('architectures')} torch_dtype {config.get('torch_dtype')}; "
          f"the weights: {sorted(dtypes)}")
    if a.prompt_ids:
        ids = [int(t) for t in a.prompt_ids.split(",")]
    else:
        tok = AutoTokenizer.from_pretrained(a.dir)
        ids = tok.apply_chat_template([{"role": "user", "content": a.prompt}],
                                      add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        print(f"prompt {a.prompt!r}: {len(ids)} tokens {ids}")
    model = AutoModelForCausalLM.from_pretrained(a.dir, dtype=torch.float32)
    model.eval()
    out = list(ids)
    with torch.no_grad():
        for _ in range(a.max_new):
            logits = model(torch.tensor([out])).logits[0, -1]
            out.append(int(torch.argmax(logits)))
    got = out[len(ids):]
    print("greedy:", ",".join(map(str, got)))
    if not a.prompt_ids:
        print("text:", repr(tok.decode(got)))
    if a.expect is not None:
        want = [int(t) for t in a.expect.split(",")]
        print("strata:", ",".join(map(str, want)), "equal" if got == want else "DIFFERENT")
        sys.exit(0 if got == want else 1)


if __name__ == "__main__":
    main()
