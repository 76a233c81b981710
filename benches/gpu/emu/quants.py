#!/usr/bin/env python3
"""Writes the emulator's reference for the dequantization kernel: from tests/fixtures/quants.gguf
(written by the `gguf` Python package: each block-quantized type `T` beside `T.f32`, the
package's `gguf.quants.dequantize` of it), a C++ header with each type's bytes and its reference
values as f32 bits, with the `type` index the kernel takes (src/backend/cuda/fused.rs's
quant_index). A GGUF v3 file read with the standard library alone (CI has no `gguf` package).

usage: quants.py REPO_ROOT OUT_FILE
"""
import struct
import sys

root, out = sys.argv[1], sys.argv[2]
data = open(f"{root}/tests/fixtures/quants.gguf", "rb").read()

# fused.rs's quant_index order, with GGML type ids: (name, GGML id, block elements, block bytes).
QUANT_TYPES = [("Q4_0", 2, 32, 18), ("Q4_1", 3, 32, 20), ("Q5_0", 6, 32, 22), ("Q5_1", 7, 32, 24),
               ("Q8_0", 8, 32, 34), ("Q2_K", 10, 256, 84), ("Q3_K", 11, 256, 110),
               ("Q4_K", 12, 256, 144), ("Q5_K", 13, 256, 176), ("Q6_K", 14, 256, 210),
               ("Q8_K", 15, 256, 292)]
SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

pos = 0


def take(fmt):
    global pos
    v = struct.unpack_from("<" + fmt, data, pos)
    pos += struct.calcsize("<" + fmt)
    return v[0]


def string():
    global pos
    n = take("Q")
    s = data[pos:pos + n].decode()
    pos += n
    return s


def value(kind):
    if kind in SCALAR:
        return take(SCALAR[kind])
    if kind == 8:
        return string()
    if kind == 9:
        inner, n = take("I"), take("Q")
        return [value(inner) for _ in range(n)]
    sys.exit(f"quants.py: unknown GGUF value type {kind}")


if data[:4] != b"GGUF":
    sys.exit("quants.py: not a GGUF file")
pos = 4
version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
meta = {}
for _ in range(n_kv):
    key = string()
    meta[key] = value(take("I"))
tensors = {}
for _ in range(n_tensors):
    name = string()
    dims = [take("Q") for _ in range(take("I"))]
    kind, offset = take("I"), take("Q")
    tensors[name] = (dims, kind, offset)
align = meta.get("general.alignment", 32)
start = (pos + align - 1) // align * align

lines = ["// Written by benches/gpu/emu/quants.py from tests/fixtures/quants.gguf: each block-quantized",
         "// type's bytes and the `gguf` package's dequantization of them (f32 bits), with fused.rs's",
         "// quant_index.", "#pragma once", "struct QuantRef {", "    const char* name;",
         "    int type, belems, bsize;", "    const unsigned char* bytes;", "    unsigned long nbytes;",
         "    const unsigned int* ref;", "    unsigned long n;", "};"]
table = []
for index, (name, ggml, belems, bsize) in enumerate(QUANT_TYPES):
    if name not in tensors:
        continue  # Q8_K: the package has no dequantizer for it (gen_quants.py)
    dims, kind, offset = tensors[name]
    if kind != ggml:
        sys.exit(f"quants.py: {name} has GGML type {kind}, not {ggml}")
    n = 1
    for d in dims:
        n *= d
    nbytes = n // belems * bsize
    raw = data[start + offset:start + offset + nbytes]
    rdims, rkind, roff = tensors[name + ".f32"]
    if rkind != 0:
        sys.exit(f"quants.py: {name}.f32 is not f32")
    ref = struct.unpack_from(f"<{n}I", data, start + roff)
    c = name.lower()
    lines.append(f"static const unsigned char {c}_bytes[] = {{{','.join(map(str, raw))}}};")
    lines.append(f"static const unsigned int {c}_ref[] = {{{','.join(f'{r}u' for r in ref)}}};")
    table.append(f'    {{"{name}", {index}, {belems}, {bsize}, {c}_bytes, {nbytes}, {c}_ref, {n}}},')
lines.append("static const QuantRef QUANT_REFS[] = {")
lines.extend(table)
lines.append("};")
open(out, "w").write("\n".join(lines) + "\n")
