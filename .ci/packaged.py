#!/usr/bin/env python3
"""The package as crates.io would get it, without building it again: `cargo package --list`
(which also checks the manifest as `cargo publish` does) must hold every Rust file of src/ and
examples/ git tracks, and every file the code pulls in at compile time (`include_str!`,
`include_bytes!`, `#[path = ...]`), so the packaged crate builds from what it carries.
`cargo publish --dry-run` proved the same by building the crate a second time (69 s of CI's
12 minutes on 2026-11-27); this reads the code instead (a second or two)."""
import os, re, subprocess, sys

features = sys.argv[1] if len(sys.argv) > 1 else ""
listed = set(subprocess.check_output(
    ["cargo", "package", "--list", "--allow-dirty", "--features", features], text=True).split())
tracked = subprocess.check_output(["git", "ls-files", "src", "examples", "cuda", "docs"],
                                  text=True).split()
missing = [f for f in tracked if f.endswith(".rs") and f not in listed]
pulled = re.compile(r'include_(?:str|bytes)!\(\s*"([^"]+)"\s*\)|#\[path\s*=\s*"([^"]+)"\]')
for f in tracked:
    if not f.endswith(".rs"):
        continue
    for m in pulled.finditer(open(f, encoding="utf-8").read()):
        rel = m.group(1) or m.group(2)
        if "{" in rel:
            continue
        target = os.path.normpath(os.path.join(os.path.dirname(f), rel))
        if target not in listed:
            missing.append(f"{target} (pulled in by {f})")
if missing:
    print("the package lacks what the build needs (Cargo.toml's `include`):")
    print("\n".join(f"  {m}" for m in sorted(set(missing))))
    sys.exit(1)
print(f"the package holds the {len(listed)} files its build needs")
