"""Greedy tokens of a GGUF model by transformers' GGUF loader (which dequantizes the file to
float32 and undoes llama.cpp's q/k permutation), for prompts given as token ids: the reference
strata's out-of-core generation from the same file is checked against (f32 compute).

    pip install torch transformers gguf accelerate numpy
    python3 benches/peers/gguf_greedy.py FILE.gguf OUT.json [NEW_TOKENS]
    STRATA_GGUF=FILE.gguf STRATA_GGUF_EXPECT=OUT.json \\
        cargo test --release --features candle --test candle gguf::a_real_gguf -- --ignored --nocapture

OUT.json: {"file": ..., "prompts": [[ids], ...], "greedy": [[ids], ...]}. The prompts are fixed
token-id sequences (a BOS-like first token, then ids below 2000, so any vocabulary of that size
takes them); `tests/fixtures/llama.gguf` also carries its own reference tokens, and this script
run on it checks transformers against them (`test.greedy.N`).
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

PROMPTS = [[1, 504, 3575, 282, 4649], [1, 1812, 314, 253, 1045, 30], [2, 7, 9], [1, 42, 42, 42, 42, 100, 1500]]


def main():
    path, out = sys.argv[1], sys.argv[2]
    new = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    directory, name = os.path.split(os.path.abspath(path))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size
    prompts = [[t % vocab for t in p] for p in PROMPTS]
    # The fixture's own prompts and reference tokens, when it has them.
    import gguf

    reader = gguf.GGUFReader(path)
    own = {}
    for k, f in reader.fields.items():
        if k.startswith("test.prompt.") or k.startswith("test.greedy."):
            own[k] = [int(f.parts[i][0]) for i in f.data]
    i = 0
    while f"test.prompt.{i}" in own:
        prompts.append(own[f"test.prompt.{i}"])
        i += 1
    greedy = []
    with torch.no_grad():
        for p in prompts:
            # The whole sequence each step, no stop token: what strata's generate does with
            # Sampling::Greedy and no stops.
            ids = list(p)
            for _ in range(new):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(torch.argmax(logits)))
            greedy.append(ids[len(p):])
    for j in range(i):
        want = own[f"test.greedy.{j}"]
        got = greedy[len(PROMPTS) + j][: len(want)]
        print(f"fixture prompt {j}: transformers {got}, the file's reference {want}:",
              "equal" if got == want else "DIFFERENT")
    json.dump({"file": path, "prompts": prompts, "greedy": greedy}, open(out, "w"))
    for p, g in zip(prompts, greedy):
        print(p, "->", g)


if __name__ == "__main__":
    main()
