#!/usr/bin/env python3
"""Independent check of `examples/candle_bert.rs`: BERT's forward pass written from Hugging Face's
modeling_bert (absolute positions, token types 0, attention mask all ones, erf GELU, LayerNorm
with the config's eps) in numpy, in float64, reading the same .safetensors file; prints the mean
over the tokens of the last hidden state as one JSON array, and with --compare FILE the max
absolute and relative difference from the last line of the example's output saved in FILE.

It shares no code with candle or strata (numpy and the safetensors package only), so agreement
to float32 rounding says the example computes the model's embedding.

Usage:
  python3 check_bert.py --model model.safetensors --config config.json --tokens 101,7592,2088,102 \
      [--compare out.txt] [--tol 1e-4]
Exits 1 when --compare's max absolute difference exceeds --tol.
"""

import argparse
import json
import math
import sys

import numpy as np
from safetensors.numpy import load_file


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu(x):
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def forward(w, cfg, ids):
    root = ""
    for r in ("", "bert.", f"{cfg.get('model_type', 'bert')}."):
        if f"{r}embeddings.word_embeddings.weight" in w:
            root = r
            break
    g = lambda name: w[root + name].astype(np.float64)
    eps = cfg["layer_norm_eps"]
    n = len(ids)
    x = g("embeddings.word_embeddings.weight")[ids]
    x = x + g("embeddings.token_type_embeddings.weight")[np.zeros(n, dtype=int)]
    x = x + g("embeddings.position_embeddings.weight")[:n]
    x = layer_norm(x, g("embeddings.LayerNorm.weight"), g("embeddings.LayerNorm.bias"), eps)
    heads = cfg["num_attention_heads"]
    d = cfg["hidden_size"] // heads
    for l in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{l}."
        lin = lambda h, name: h @ g(p + name + ".weight").T + g(p + name + ".bias")
        split = lambda t: t.reshape(n, heads, d).transpose(1, 0, 2)
        q = split(lin(x, "attention.self.query"))
        k = split(lin(x, "attention.self.key"))
        v = split(lin(x, "attention.self.value"))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d)  # mask all ones: adds 0
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        ctx = (s @ v).transpose(1, 0, 2).reshape(n, heads * d)
        a = layer_norm(
            lin(ctx, "attention.output.dense") + x,
            g(p + "attention.output.LayerNorm.weight"),
            g(p + "attention.output.LayerNorm.bias"),
            eps,
        )
        i = gelu(lin(a, "intermediate.dense"))
        x = layer_norm(
            lin(i, "output.dense") + a,
            g(p + "output.LayerNorm.weight"),
            g(p + "output.LayerNorm.bias"),
            eps,
        )
    return x.mean(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--compare")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    cfg = json.load(open(a.config))
    ids = [int(t) for t in a.tokens.split(",")]
    ref = forward(load_file(a.model), cfg, ids)
    if a.compare:
        got = np.array(json.loads(open(a.compare).read().strip().splitlines()[-1]), dtype=np.float64)
        if got.shape != ref.shape:
            print(f"shape {got.shape} vs reference {ref.shape}")
            sys.exit(1)
        diff = np.abs(got - ref)
        rel = diff.max() / np.abs(ref).max()
        print(f"max |example - reference| = {diff.max():.3e} (relative to max |reference| {rel:.3e}),"
              f" over {ref.size} values; cosine similarity {got @ ref / np.linalg.norm(got) / np.linalg.norm(ref):.9f}")
        sys.exit(0 if diff.max() <= a.tol else 1)
    print(json.dumps([float(v) for v in ref]))


if __name__ == "__main__":
    main()
