"""PyTorch's scaled_dot_product_attention on the tensors examples/fused_attention.rs saved
(`--save FILE`): its forward and forward + backward timed on the GPU with CUDA events, and
strata's outputs and gradients compared with it.

  python3 benches/peers/sdpa.py FILE [--reps 5] [--warmup 2]

The tensors are loaded as strata computed on them (f32 copies of the bf16/f16/f32 inputs) and
cast back to the dtype the JSON line of the example names (--dtype, default bf16), so both run
the same rounded inputs. Prints one JSON line: {"peer": "torch-sdpa", "fwd_ms", "fwd_bwd_ms",
"err_o", "err_dq", "err_dk", "err_dv", ...}, each error the largest absolute difference over the
largest absolute value of torch's result (computed in f32 from torch's output in the dtype).
"""
import argparse
import json
import math
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cuda (the figures), or cpu to check the comparison")
    a = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from safetensors.torch import load_file
    except ImportError as e:
        print(json.dumps({"peer": "torch-sdpa", "error": f"no PyTorch here: {e}"}))
        return 0
    dev = a.device
    if dev == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"peer": "torch-sdpa", "error": "no CUDA device"}))
        return 0
    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    t = load_file(a.file, device=dev)
    scale, window = float(t["meta"][0]), int(t["meta"][1])
    # strata's layout is [batch, seq, heads, dim]; SDPA's [batch, heads, seq, dim].
    q0, k0, v0, do0 = (t[n].to(dt).transpose(1, 2).contiguous() for n in ("q", "k", "v", "dout"))
    h, kv, s = q0.shape[1], k0.shape[1], q0.shape[2]
    mask = None
    if window > 0:
        i = torch.arange(s, device=dev)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)

    def attn(q, k, v):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=(h != kv))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=(h != kv))

    def timed(f):
        for _ in range(a.warmup):
            f()
        ms = []
        for _ in range(a.reps):
            if dev == "cuda":
                torch.cuda.synchronize()
                st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                st.record()
                f()
                en.record()
                torch.cuda.synchronize()
                ms.append(st.elapsed_time(en))
            else:
                t0 = time.perf_counter()
                f()
                ms.append((time.perf_counter() - t0) * 1e3)
        return sorted(ms)[len(ms) // 2]

    q, k, v = (x.clone().requires_grad_(True) for x in (q0, k0, v0))

    def fwd():
        with torch.no_grad():
            attn(q0, k0, v0)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        o = attn(q, k, v)
        o.backward(do0)

    fwd_ms = timed(fwd)
    fwd_bwd_ms = timed(fwd_bwd)
    q.grad = k.grad = v.grad = None
    o = attn(q, k, v)
    o.backward(do0)
    mine = {"o": o, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    out = {"peer": "torch-sdpa", "device": dev, "dtype": a.dtype, "seq": s, "heads": h, "kv_heads": kv,
           "head_dim": q0.shape[3], "window": window if window > 0 else None,
           "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms}
    for n, ref in mine.items():
        ref = ref.float().transpose(1, 2)
        diff = (t[n] - ref).abs().max().item()
        out[f"err_{n}"] = diff / max(ref.abs().max().item(), 1e-30)
    flops = 2.0 * q0.shape[0] * h * s * s * q0.shape[3]
    out["fwd_tflops"] = flops / (fwd_ms / 1e3) / 1e12
    out["fwd_bwd_tflops"] = 3.5 * flops / (fwd_bwd_ms / 1e3) / 1e12
    if any(math.isnan(out[f"err_{n}"]) for n in mine):
        out["error"] = "NaN in a comparison"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
