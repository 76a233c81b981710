#!/usr/bin/env python3
"""Writes a Llama GGUF file of random block-quantized weights in the shape of a Hugging Face
config.json, as llama.cpp's Q4_K_M lays one out (Q4_K projections and embedding table, Q6_K
output, f32 norms), for the GPU lease's quantized rows: the GPU machine has numpy but not the
`gguf` package, and a 7B file (about 4 GB) is too large to carry. Standard library and numpy
(without numpy, a small file only: the host dry run's).

The weights are random quants under random-signed scales small enough that 32 blocks of them
stay finite (about ±0.1), not a trained model: the rows measure bytes and time, not text. Rows
whose length is not a multiple of 256 (a K-quant's block) are Q4_0 instead (32 a block), said on
stderr.

usage: make_gguf.py CONFIG_JSON OUT.gguf [--layers N] [--seed S]
prints the bytes of the file's weights
"""
import argparse
import json
import os
import random
import struct
import sys

try:
    import numpy as np
except ImportError:  # the host dry run's tiny file
    np = None

F32, Q4_0, Q4_K, Q6_K = 0, 2, 12, 14
# (block elements, block bytes, [(offset of an f16 scale, magnitude)], an int8 scale range)
LAYOUT = {Q4_0: (32, 18, [(0, 2e-3)]), Q4_K: (256, 144, [(0, 2e-4), (2, 1e-5)]),
          Q6_K: (256, 210, [(208, 2e-5)])}
NAMES = {Q4_0: "Q4_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}


def f16_bits(x):
    return struct.unpack("<H", struct.pack("<e", x))[0]


def blocks(rng, kind, n):
    """n random blocks of `kind` with finite, random-signed f16 scales."""
    elems, size, scales = LAYOUT[kind]
    if np is not None:
        b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
        for at, mag in scales:
            s = (rng.uniform(0.5, 1.0, n) * mag * rng.choice([-1.0, 1.0], n)).astype(np.float16)
            b[:, at:at + 2] = s.view(np.uint8).reshape(n, 2)
        return b.tobytes()
    out = bytearray()
    for _ in range(n):
        b = bytearray(rng.randbytes(size))
        for at, mag in scales:
            b[at:at + 2] = struct.pack("<H", f16_bits(rng.uniform(0.5, 1.0) * mag * rng.choice([-1, 1])))
        out += b
    return bytes(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    c = json.load(open(a.config))
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    layers = a.layers or c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", heads)
    head_dim = c.get("head_dim", h // heads)
    rng = np.random.default_rng(a.seed) if np is not None else random.Random(a.seed)

    said = set()

    def kind_for(cols, want):
        if cols % LAYOUT[want][0] == 0:
            return want
        if (cols, want) not in said:
            said.add((cols, want))
            print(f"make_gguf.py: rows of {cols} are not whole {NAMES[want]} blocks: Q4_0",
                  file=sys.stderr)
        return Q4_0

    # (name, GGUF dims (innermost first), type)
    tensors = [("token_embd.weight", (h, v), kind_for(h, Q4_K))]
    for l in range(layers):
        p = f"blk.{l}."
        tensors += [(p + "attn_norm.weight", (h,), F32),
                    (p + "attn_q.weight", (h, heads * head_dim), kind_for(h, Q4_K)),
                    (p + "attn_k.weight", (h, kv_heads * head_dim), kind_for(h, Q4_K)),
                    (p + "attn_v.weight", (h, kv_heads * head_dim), kind_for(h, Q4_K)),
                    (p + "attn_output.weight", (heads * head_dim, h), kind_for(heads * head_dim, Q4_K)),
                    (p + "ffn_norm.weight", (h,), F32),
                    (p + "ffn_gate.weight", (h, inter), kind_for(h, Q4_K)),
                    (p + "ffn_up.weight", (h, inter), kind_for(h, Q4_K)),
                    (p + "ffn_down.weight", (inter, h), kind_for(inter, Q4_K))]
    tensors += [("output_norm.weight", (h,), F32)]
    if not c.get("tie_word_embeddings", False):
        tensors += [("output.weight", (h, v), kind_for(h, Q6_K))]

    def nbytes(dims, kind):
        if kind == F32:
            return 4 * dims[0]
        elems, size, _ = LAYOUT[kind]
        rows = 1
        for d in dims[1:]:
            rows *= d
        return rows * dims[0] // elems * size

    def s(x):
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    kv = [("general.architecture", 8, "llama"), ("general.name", 8, "strata lease: random Q4_K_M"),
          ("general.alignment", 4, 32), ("llama.context_length", 4, c.get("max_position_embeddings", 4096)),
          ("llama.embedding_length", 4, h), ("llama.block_count", 4, layers),
          ("llama.feed_forward_length", 4, inter), ("llama.attention.head_count", 4, heads),
          ("llama.attention.head_count_kv", 4, kv_heads), ("llama.rope.dimension_count", 4, head_dim),
          ("llama.rope.freq_base", 6, float(c.get("rope_theta", 10000.0))),
          ("llama.attention.layer_norm_rms_epsilon", 6, float(c.get("rms_norm_eps", 1e-5))),
          ("llama.vocab_size", 4, v)]
    head = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)))
    for key, kind, val in kv:
        head += s(key) + struct.pack("<I", kind)
        head += s(val) if kind == 8 else struct.pack("<I" if kind == 4 else "<f", val)
    offset = 0
    for name, dims, kind in tensors:
        head += s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        head += struct.pack("<IQ", kind, offset)
        offset = (offset + nbytes(dims, kind) + 31) // 32 * 32
    head += b"\0" * ((-len(head)) % 32)
    tmp = a.out + ".part"
    weights = 0
    with open(tmp, "wb") as f:
        f.write(head)
        for name, dims, kind in tensors:
            n = nbytes(dims, kind)
            if kind == F32:
                data = struct.pack(f"<{dims[0]}f", *([1.0] * dims[0]))
            else:
                # A row at a time for the large tables, so that memory stays small.
                rows = n // LAYOUT[kind][1] * LAYOUT[kind][0] // dims[0]
                per = dims[0] // LAYOUT[kind][0]
                step = max(1, (64 << 20) // (per * LAYOUT[kind][1]))
                for r in range(0, rows, step):
                    f.write(blocks(rng, kind, per * min(step, rows - r)))
                data = b""
            f.write(data)
            f.write(b"\0" * ((-n) % 32))
            weights += n
    os.replace(tmp, a.out)
    print(weights)


if __name__ == "__main__":
    main()
