"""PyTorch's scaled_dot_product_attention on the tensors examples/fused_attention.rs saved
(`--save FILE`): its forward and forward + backward timed on the GPU with CUDA events, and
strata's outputs and gradients compared with it and with an f32 reference.

  python3 benches/peers/sdpa.py [NAME=]FILE... [--reps 5] [--warmup 2] [--dtype bf16]

One process for every file (PyTorch is imported once): each file is a candidate kernel's run
(NAME, default the file's name), torch timed once per shape. The tensors are loaded as strata
computed on them (f32 copies of the bf16/f16/f32 inputs) and cast back to the dtype (--dtype,
default bf16), so both run the same rounded inputs; the reference is SDPA in f32 on those same
rounded inputs. Prints one JSON line a file: {"peer": "torch-sdpa", "candidate", "fwd_ms",
"fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops" (torch's), "err_o", "err_dq", "err_dk", "err_dv"
(strata against torch), "ref_err_*" (strata against the f32 reference), "torch_ref_err_*"
(torch in the dtype against it), ...}, each error the largest absolute difference over the
largest absolute value of the result it is compared with.
"""
import argparse
import json
import math
import sys
import time


NAMES = ("o", "dq", "dk", "dv")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", help="[NAME=]FILE: a candidate's saved tensors")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cuda (the figures), or cpu to check the comparison")
    a = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from safetensors.torch import load_file
    except (ImportError, OSError) as e:  # absent, or an install that does not load
        print(json.dumps({"peer": "torch-sdpa", "error": f"no PyTorch here: {e}"}))
        return 0
    dev = a.device
    if dev == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"peer": "torch-sdpa", "error": "no CUDA device"}))
        return 0
    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]

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

    torch_times = {}  # (shape, window) -> (fwd_ms, fwd_bwd_ms): torch timed once per shape
    for spec in a.files:
        name, _, path = spec.rpartition("=")
        name = name or path.rsplit("/", 1)[-1]
        t = load_file(path, device=dev)
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

        def run(q_in, k_in, v_in, do):
            q, k, v = (x.clone().requires_grad_(True) for x in (q_in, k_in, v_in))
            o = attn(q, k, v)
            o.backward(do)
            return {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

        key = (tuple(q0.shape), tuple(k0.shape), window)
        if key not in torch_times:
            qg, kg, vg = (x.clone().requires_grad_(True) for x in (q0, k0, v0))

            def fwd():
                with torch.no_grad():
                    attn(q0, k0, v0)

            def fwd_bwd():
                qg.grad = kg.grad = vg.grad = None
                attn(qg, kg, vg).backward(do0)

            torch_times[key] = (timed(fwd), timed(fwd_bwd))
        fwd_ms, fwd_bwd_ms = torch_times[key]
        mine = run(q0, k0, v0, do0)
        ref = run(q0.float(), k0.float(), v0.float(), do0.float())
        out = {"peer": "torch-sdpa", "candidate": name, "file": path, "device": dev, "dtype": a.dtype, "seq": s,
               "heads": h, "kv_heads": kv, "head_dim": q0.shape[3], "window": window if window > 0 else None,
               "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms}
        for n in NAMES:
            r = ref[n].float().transpose(1, 2)
            tt = mine[n].float().transpose(1, 2)
            rmax = max(r.abs().max().item(), 1e-30)
            out[f"err_{n}"] = (t[n] - tt).abs().max().item() / max(tt.abs().max().item(), 1e-30)
            out[f"ref_err_{n}"] = (t[n] - r).abs().max().item() / rmax
            out[f"torch_ref_err_{n}"] = (tt - r).abs().max().item() / rmax
        flops = 2.0 * q0.shape[0] * h * s * s * q0.shape[3]
        out["fwd_tflops"] = flops / (fwd_ms / 1e3) / 1e12
        out["fwd_bwd_tflops"] = 3.5 * flops / (fwd_bwd_ms / 1e3) / 1e12
        if any(math.isnan(out[f"{p}err_{n}"]) for n in NAMES for p in ("", "ref_", "torch_ref_")):
            out["error"] = "NaN in a comparison"
        print(json.dumps(out), flush=True)
        del t, mine, ref
        if dev == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
