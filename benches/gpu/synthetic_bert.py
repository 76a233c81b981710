#!/usr/bin/env python3
"""Writes a BERT checkpoint of any size with random f32 weights, for `examples/candle_bert.rs`
on a model that does not fit a small device budget (Python standard library only).

  python3 synthetic_bert.py OUT_DIR [--hidden 1024] [--layers 24] [--heads 16]
      [--intermediate 4096] [--vocab 30522] [--shards 1]

OUT_DIR gets config.json and model.safetensors (or, with --shards N, N shards and
model.safetensors.index.json). Weights are uniform in +-0.05 (LayerNorm weights 1, biases 0), one
random block of 1 Mi values reused at shifting offsets: for timing, not for meaning.
"""

import argparse
import array
import json
import math
import os
import random
import struct


def shapes(c):
    h, i = c["hidden_size"], c["intermediate_size"]
    out = [
        ("embeddings.word_embeddings.weight", [c["vocab_size"], h]),
        ("embeddings.position_embeddings.weight", [c["max_position_embeddings"], h]),
        ("embeddings.token_type_embeddings.weight", [c["type_vocab_size"], h]),
        ("embeddings.LayerNorm.weight", [h]),
        ("embeddings.LayerNorm.bias", [h]),
    ]
    for l in range(c["num_hidden_layers"]):
        p = f"encoder.layer.{l}."
        for n, s in [
            ("attention.self.query.weight", [h, h]), ("attention.self.query.bias", [h]),
            ("attention.self.key.weight", [h, h]), ("attention.self.key.bias", [h]),
            ("attention.self.value.weight", [h, h]), ("attention.self.value.bias", [h]),
            ("attention.output.dense.weight", [h, h]), ("attention.output.dense.bias", [h]),
            ("attention.output.LayerNorm.weight", [h]), ("attention.output.LayerNorm.bias", [h]),
            ("intermediate.dense.weight", [i, h]), ("intermediate.dense.bias", [i]),
            ("output.dense.weight", [h, i]), ("output.dense.bias", [h]),
            ("output.LayerNorm.weight", [h]), ("output.LayerNorm.bias", [h]),
        ]:
            out.append((p + n, s))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--shards", type=int, default=1)
    a = ap.parse_args()
    c = {
        "architectures": ["BertModel"], "model_type": "bert", "hidden_act": "gelu",
        "hidden_size": a.hidden, "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
        "intermediate_size": a.intermediate, "vocab_size": a.vocab, "max_position_embeddings": 512,
        "type_vocab_size": 2, "layer_norm_eps": 1e-12, "hidden_dropout_prob": 0.1,
        "initializer_range": 0.02, "pad_token_id": 0, "position_embedding_type": "absolute",
    }
    os.makedirs(a.out, exist_ok=True)
    json.dump(c, open(os.path.join(a.out, "config.json"), "w"), indent=2)
    rng = random.Random(0)
    block = array.array("f", (rng.uniform(-0.05, 0.05) for _ in range(1 << 20))).tobytes()
    ts = shapes(c)
    per = -(-len(ts) // a.shards)
    groups = [ts[k:k + per] for k in range(0, len(ts), per)]
    names = (["model.safetensors"] if a.shards == 1 else
             [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))])
    weight_map, offset_in_block = {}, 0
    for fname, group in zip(names, groups):
        header, at = {"__metadata__": {"format": "pt"}}, 0
        for n, s in group:
            size = 4
            for d in s:
                size *= d
            header[n] = {"dtype": "F32", "shape": s, "data_offsets": [at, at + size]}
            at += size
            weight_map[n] = fname
        hb = json.dumps(header).encode()
        hb += b" " * (-len(hb) % 8)
        with open(os.path.join(a.out, fname), "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb)
            for n, s in group:
                count = 1
                for d in s:
                    count *= d
                if n.endswith("LayerNorm.weight"):
                    f.write(array.array("f", [1.0] * count).tobytes())
                elif n.endswith("bias") or "LayerNorm" in n:
                    f.write(bytes(4 * count))
                else:
                    left = 4 * count
                    while left:
                        start = offset_in_block % len(block)
                        piece = block[start:start + min(left, len(block) - start)]
                        f.write(piece)
                        left -= len(piece)
                        offset_in_block += len(piece) + 4
    if a.shards > 1:
        json.dump({"metadata": {}, "weight_map": weight_map},
                  open(os.path.join(a.out, "model.safetensors.index.json"), "w"))
    total = sum(4 * math.prod(s) for _, s in ts)
    print(f"{a.out}: {len(ts)} tensors, {total / 2**20:.1f} MiB in {len(names)} file(s)")


if __name__ == "__main__":
    main()
