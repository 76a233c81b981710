#!/usr/bin/env python3
"""Writes the C++ the emulator compiles for cuda/fused.cu: for each element type, the program
exactly as src/backend/cuda/fused.rs::source builds it ("#define STRATA_ELEM_{elem}\\n" +
cuda/bf16.cuh + cuda/fused.cu), inside `namespace emu_{elem}`, with only these rewrites:
  - the f16 inline asm (cvt.f32.f16, cvt.rn.f16.f32) as calls of cuda_cpu.h's converters,
  - `extern __shared__ T name[];` as EMU_DYNAMIC_SHARED(T, name); and `__shared__ T name[N];`
    as EMU_STATIC_SHARED(T, name, N);
and each macro the program defines #undef'd after it. Fails if any other asm or __shared__ is
left, so a kernel change the emulator does not cover is noticed.

usage: prep.py REPO_ROOT OUT_FILE
"""
import re
import sys

root, out = sys.argv[1], sys.argv[2]
bf16 = open(f"{root}/cuda/bf16.cuh").read()
fused = open(f"{root}/cuda/fused.cu").read()

REWRITES = [
    (r'asm\("cvt\.f32\.f16 %0, %1;"\s*:\s*"=f"\((\w+)\)\s*:\s*"h"\(([\w.]+)\)\);',
     r"\1 = emu_f16_to_f32(\2);"),
    (r'asm\("cvt\.rn\.f16\.f32 %0, %1;"\s*:\s*"=h"\(([\w.]+)\)\s*:\s*"f"\((\w+)\)\);',
     r"\1 = emu_f32_to_f16_rn(\2);"),
    (r"extern\s+__shared__\s+(\w+)\s+(\w+)\[\];", r"EMU_DYNAMIC_SHARED(\1, \2);"),
    (r"__shared__\s+(\w+)\s+(\w+)\[(\w+)\];", r"EMU_STATIC_SHARED(\1, \2, \3);"),
]


def rewrite(src, name):
    for pat, rep in REWRITES:
        src = re.sub(pat, rep, src)
    for bad in (r"\basm\b", r"__shared__", r"\b__ldg\b", r"\batomic\w*\(", r"__syncwarp"):
        m = re.search(bad, src)
        if m:
            line = src[: m.start()].count("\n") + 1
            sys.exit(f"prep.py: {name}:{line}: `{m.group(0)}` is not emulated (cuda_cpu.h)")
    return src


parts = ['#include "cuda_cpu.h"\n']
for elem in ("f32", "bf16", "f16"):
    # fused.rs::source: "#define STRATA_ELEM_{elem}\n{BF16_H}{SOURCE}" (#line only names the files).
    program = (f"#define STRATA_ELEM_{elem}\n#line 1 \"cuda/bf16.cuh\"\n" + rewrite(bf16, "bf16.cuh")
               + '#line 1 "cuda/fused.cu"\n' + rewrite(fused, "fused.cu"))
    macros = sorted(set(re.findall(r"^\s*#\s*define\s+(\w+)", program, re.M)))
    parts.append(f"namespace emu_{elem} {{\n{program}\n}}\n")
    parts.append("".join(f"#undef {m}\n" for m in macros))
open(out, "w").write("".join(parts))
