#!/usr/bin/env python3
"""Independent numpy check of strata's out-of-core training example (`--mode train`).

The model (the contract of `strata train-demo`'s trainer, src/cli/train.rs): L bias-free [H, H] linear layers,
a_0 = x, z_i = a_i @ W_i.T, a_{i+1} = relu(z_i) for i < L-1, output z_{L-1},
loss = 0.5 * sum((out - y)**2) / R over all R rows (also with micro-batches), the same
full batch every step. Backward: dL/dout = (out - y) / R, dW_i = dz_i.T @ a_i,
da_i = dz_i @ W_i, dz_{i-1} = da_i * (a_i > 0). With --accumulate N each step runs N
micro-batches of R/N consecutive rows and sums their gradients. Every layer's gradient uses
this step's pre-update weights. Optimizers, as PyTorch's single-tensor implementations:
  sgd    (torch.optim.SGD, no momentum): g += wd * p; p -= lr * g
  adamw  (torch.optim.AdamW): p *= 1 - lr * wd; m += (1 - b1) * (g - m);
         v = b2 * v + (1 - b2) * g**2; p -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)
The reference runs in float64 (weights, activations, gradients and optimizer state).

  make       writes DIR/init.safetensors (layers.{i}.weight, uniform in +-sqrt(3/H), f32 or
             bf16) and DIR/data.safetensors (x, y: [R, H], uniform in +-1, f32).
  reference  trains from those files, prints the loss per step, writes the final weights (f32).
  check      make + run strata (--mode train --host --compare off --init --data --save, plus
             --extra) + reference, then compares the saved weights (max abs diff, max relative
             diff |s - r| / max(|r|, 1e-3)) and strata's printed per-step losses (relative).
             With --dtype f32 it exits 1 when either relative diff exceeds --tol (default 1e-3:
             the weight metric is elementwise, and AdamW's normalized update turns f32 rounding
             in small gradients into relative errors of a few 1e-4 in weights near 0; a plain
             float32 numpy run of the contract is 1e-3 from this float64 reference). With
             --dtype bf16 the GEMM inputs and gradients are rounded to bf16, which moves
             individual weights by more than any useful elementwise bound: only the losses are
             gated (default --tol 1e-2); the weight diffs are printed.

Usage:
  python3 benches/peers/check_train.py make --layers 4 --hidden 32 --rows 16 --seed 0 --out DIR
  python3 benches/peers/check_train.py reference --init DIR/init.safetensors \
      --data DIR/data.safetensors --steps 5 --lr 0.01 --optimizer adamw --out DIR/ref.safetensors
  python3 benches/peers/check_train.py check --strata target/release/strata \
      --layers 4 --hidden 32 --rows 16 --steps 5 --lr 0.01 --optimizer adamw --dir /tmp/ck1 \
      [--accumulate 4] [--dtype bf16] [--extra "--activations recompute --checkpoint-every 2"]
Needs only numpy (safetensors files are read and written here, BF16 included).
"""
import argparse
import json
import os
import re
import shlex
import struct
import subprocess
import sys

import numpy as np

# ---------------------------------------------------------------- safetensors, by hand
# Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
# data_offsets: [begin, end]}} (offsets relative to the data that follows), then the data.


def f32_to_bf16_bits(a):
    """Round-to-nearest-even float32 -> bfloat16 bit patterns (uint16); values here are finite."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_f32(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def save_st(path, tensors):
    """tensors: {name: (dtype "F32" | "BF16", float array)}; BF16 values are rounded to bf16."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        dt, a = tensors[name]
        raw = (f32_to_bf16_bits(a).astype("<u2") if dt == "BF16"
               else np.asarray(a, dtype="<f4")).tobytes()
        header[name] = {"dtype": dt, "shape": list(np.shape(a)), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # pad so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def load_st(path):
    """{name: float64 array} from F32, BF16 or F64 tensors."""
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    header, data = json.loads(buf[8:8 + n]), buf[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        kind = {"F32": "<f4", "BF16": "<u2", "F64": "<f8"}[t["dtype"]]
        a = np.frombuffer(data[b:e], dtype=kind)
        if t["dtype"] == "BF16":
            a = bf16_bits_to_f32(a)
        out[name] = a.astype(np.float64).reshape(t["shape"])
    return out

# ---------------------------------------------------------------- inputs


def make(layers, hidden, rows, seed, out, init_dtype="f32"):
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    a = np.sqrt(3.0 / hidden)
    dt = {"f32": "F32", "bf16": "BF16"}[init_dtype]
    w = {f"layers.{i}.weight": (dt, rng.uniform(-a, a, (hidden, hidden)).astype(np.float32))
         for i in range(layers)}
    x = rng.uniform(-1, 1, (rows, hidden)).astype(np.float32)
    y = rng.uniform(-1, 1, (rows, hidden)).astype(np.float32)
    init, data = os.path.join(out, "init.safetensors"), os.path.join(out, "data.safetensors")
    save_st(init, w)
    save_st(data, {"x": ("F32", x), "y": ("F32", y)})
    return init, data

# ---------------------------------------------------------------- the reference


def load_weights(path):
    t = load_st(path)
    L = len(t)
    ws = [t[f"layers.{i}.weight"] for i in range(L)]  # KeyError if the names have gaps
    return ws


def reference(init, data, steps, lr, optimizer, accumulate=1, weight_decay=0.0,
              beta1=0.9, beta2=0.999, eps=1e-8, out=None, log=print):
    """Trains in float64; returns (final weights, loss per step) and writes `out` (f32)."""
    ws = load_weights(init)
    d = load_st(data)
    x, y = d["x"], d["y"]
    R, L = x.shape[0], len(ws)
    if R % accumulate:
        raise SystemExit(f"{R} rows do not split into {accumulate} micro-batches")
    mb = R // accumulate
    m = [np.zeros_like(w) for w in ws]
    v = [np.zeros_like(w) for w in ws]
    losses = []
    for t in range(1, steps + 1):
        grads = [np.zeros_like(w) for w in ws]
        loss = 0.0
        for k in range(accumulate):
            acts = [x[k * mb:(k + 1) * mb]]  # acts[i] = a_i, the input of layer i
            for i, w in enumerate(ws):
                z = acts[i] @ w.T
                acts.append(np.maximum(z, 0.0) if i < L - 1 else z)
            diff = acts[L] - y[k * mb:(k + 1) * mb]
            loss += 0.5 * np.sum(diff * diff) / R
            dz = diff / R
            for i in reversed(range(L)):  # pre-update weights throughout: updates come after
                grads[i] += dz.T @ acts[i]
                if i > 0:
                    dz = (dz @ ws[i]) * (acts[i] > 0)
        losses.append(loss)
        log(f"step {t:>3}: loss {loss:.9e}")
        for i in reversed(range(L)):  # backward order, as strata; the order does not matter
            p, g = ws[i], grads[i]
            if optimizer == "sgd":
                p -= lr * (g + weight_decay * p)
            else:
                p *= 1.0 - lr * weight_decay
                m[i] += (1.0 - beta1) * (g - m[i])
                v[i] = beta2 * v[i] + (1.0 - beta2) * g * g
                bc1, bc2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
                p -= (lr / bc1) * m[i] / (np.sqrt(v[i]) / np.sqrt(bc2) + eps)
    if out:
        save_st(out, {f"layers.{i}.weight": ("F32", w) for i, w in enumerate(ws)})
    return ws, losses

# ---------------------------------------------------------------- check against strata

STEP_RE = re.compile(r"^step\s+(\d+):.*?\bloss\s+(\S+)")


def rel(s, r, floor=1e-3):
    return np.abs(s - r) / np.maximum(np.abs(r), floor)


def check(a):
    tol = a.tol if a.tol is not None else (1e-2 if a.dtype == "bf16" else 1e-3)
    init, data = make(a.layers, a.hidden, a.rows, a.seed, a.dir, a.init_dtype)
    save = os.path.join(a.dir, "strata.safetensors")
    if os.path.exists(save):
        os.remove(save)
    cmd = [a.strata, "train-demo", "--mode", "train", "--init", init, "--data", data, "--save", save,
           "--host", "--compare", "off", "--steps", str(a.steps), "--lr", repr(a.lr),
           "--optimizer", a.optimizer, "--accumulate", str(a.accumulate),
           "--weight-decay", repr(a.weight_decay), "--beta1", repr(a.beta1),
           "--beta2", repr(a.beta2), "--eps", repr(a.eps), "--dtype", a.dtype]
    cmd += shlex.split(a.extra)
    print("strata:", shlex.join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True)
    with open(os.path.join(a.dir, "strata.log"), "w") as f:
        f.write(p.stdout + p.stderr)
    if p.returncode != 0:
        print(p.stdout[-3000:] + p.stderr[-3000:])
        raise SystemExit(f"strata exited with {p.returncode}")
    s_losses = {int(mo.group(1)): float(mo.group(2))
                for mo in map(STEP_RE.match, p.stdout.splitlines()) if mo}
    ref_ws, ref_losses = reference(init, data, a.steps, a.lr, a.optimizer, a.accumulate,
                                   a.weight_decay, a.beta1, a.beta2, a.eps,
                                   os.path.join(a.dir, "reference.safetensors"), log=lambda s: None)
    got = load_st(save)
    worst_abs = worst_rel = 0.0
    for i, r in enumerate(ref_ws):
        s = got[f"layers.{i}.weight"]
        da, dr = float(np.max(np.abs(s - r))), float(np.max(rel(s, r)))
        print(f"  layers.{i}.weight  max abs diff {da:.3e}  max rel diff {dr:.3e}")
        worst_abs, worst_rel = max(worst_abs, da), max(worst_rel, dr)
    ok = len(got) == len(ref_ws)
    if not ok:
        print(f"  strata saved {len(got)} tensors, want {len(ref_ws)}")
    loss_rel = 0.0
    for t, rl in enumerate(ref_losses, 1):
        if t not in s_losses:
            print(f"  step {t}: no loss line in strata's output")
            ok = False
            continue
        d = abs(s_losses[t] - rl) / max(abs(rl), 1e-12)
        loss_rel = max(loss_rel, d)
        print(f"  step {t:>3}: loss strata {s_losses[t]:.6e}  reference {rl:.9e}  rel diff {d:.2e}")
    ok = ok and loss_rel <= tol and (a.dtype == "bf16" or worst_rel <= tol)
    print(f"weights: max abs diff {worst_abs:.3e}, max rel diff {worst_rel:.3e}; "
          f"losses: max rel diff {loss_rel:.3e}; tol {tol:g} -> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def model(p):
        p.add_argument("--layers", type=int, required=True)
        p.add_argument("--hidden", type=int, required=True)
        p.add_argument("--rows", type=int, required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--init-dtype", choices=["f32", "bf16"], default="f32")

    def train(p):
        p.add_argument("--steps", type=int, required=True)
        p.add_argument("--lr", type=float, required=True)
        p.add_argument("--optimizer", choices=["sgd", "adamw"], required=True)
        p.add_argument("--accumulate", type=int, default=1)
        p.add_argument("--weight-decay", type=float, default=0.0)
        p.add_argument("--beta1", type=float, default=0.9)
        p.add_argument("--beta2", type=float, default=0.999)
        p.add_argument("--eps", type=float, default=1e-8)

    p = sub.add_parser("make", help="write init.safetensors and data.safetensors")
    model(p)
    p.add_argument("--out", required=True)
    p = sub.add_parser("reference", help="train in float64, write the final weights")
    p.add_argument("--init", required=True)
    p.add_argument("--data", required=True)
    train(p)
    p.add_argument("--out", required=True)
    p = sub.add_parser("check", help="run strata and the reference, compare")
    model(p)
    train(p)
    p.add_argument("--strata", required=True, help="the strata binary (target/release/strata); the check runs its train-demo")
    p.add_argument("--extra", default="", help="more strata flags, one string")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32", help="strata's compute dtype")
    p.add_argument("--tol", type=float, default=None)
    p.add_argument("--dir", required=True)
    a = ap.parse_args()
    if a.cmd == "make":
        print(*make(a.layers, a.hidden, a.rows, a.seed, a.out, a.init_dtype), sep="\n")
    elif a.cmd == "reference":
        reference(a.init, a.data, a.steps, a.lr, a.optimizer, a.accumulate, a.weight_decay,
                  a.beta1, a.beta2, a.eps, a.out)
    else:
        sys.exit(check(a))


if __name__ == "__main__":
    main()
