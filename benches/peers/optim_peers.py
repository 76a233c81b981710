#!/usr/bin/env python3
"""Peer figures for the optimizer offload: PyTorch's CPU AdamW, and a ZeRO-Offload style training step.

Run on the GPU machine (one H100, 16 CPU cores, >= 64 GiB host memory for `train` at the defaults):
  python3 benches/peers/optim_peers.py cpu-adamw --params 100000000 --threads 16
  python3 benches/peers/optim_peers.py train --layers 32 --hidden 8192 --rows 2048 --steps 5

cpu-adamw: torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0) on one fp32
parameter of N elements with a random fp32 .grad, in the variants the torch version supports:
fused=True, foreach=True, and the single-tensor loop (foreach=False, fused=False).
  copy_gbps          host copy bandwidth, dst.copy_(src) over two fp32 tensors of N elements,
                     counted as read + write (2 * 4N bytes / time); median of 10 after a warm-up.
  step_ms            one opt.step(), perf_counter-timed; the first step (allocates the moments) is
                     dropped, the median of the other steps is reported.
  bound_ms           28 * N / copy bandwidth: a step reads param, grad, exp_avg, exp_avg_sq (16 B)
                     and writes param, exp_avg, exp_avg_sq (12 B) per element.
  fraction_of_bound  bound_ms / step_ms: 1.0 means the step runs at host copy bandwidth.
  gbps               28 * N / step time, the step's effective memory bandwidth.

train: an MLP of L bias-free H x H bf16 layers (the model of strata's out-of-core training
example): a_0 = x, z_i = a_i @ W_i.T, a_{i+1} = relu(z_i) for i < L-1, output z_{L-1},
loss = 0.5 * ((out - y)**2).sum() / R, with x, y fixed random [R, H] bf16 on the GPU.
ZeRO-Offload style step: the bf16 weights live in pinned host memory and are streamed to two
device buffers on a side stream (double-buffered prefetch, events), through the forward and then
the backward (the last layer is loaded once for both); autograd is written out per layer
(dW_i = dz_i.T @ a_i, da_i = dz_i @ W_i, dz_{i-1} = da_i * (a_i > 0)), every layer's input
activation stays on the GPU, and each dW_i goes device-to-host into a pinned bf16 buffer on a
second side stream as soon as it is computed. The host issues the whole forward + backward, then
takes the layers in backward order: wait for the layer's gradient, convert it into the fp32
master's .grad, step that layer's CPU AdamW (fused, or foreach where fused CPU is unsupported;
fp32 masters and moments in host memory), refresh the pinned bf16 weight from the master. So the
CPU update of a layer overlaps the GPU's backward of the layers below it.
Host memory: masters, grads, exp_avg, exp_avg_sq 4 * 4 * L * H * H bytes (32 GiB at the defaults)
plus pinned bf16 weights and gradients (8 GiB).
  step_ms       forward + backward + optimizer, synchronized around each step; step 0 is the
                warm-up (allocates the moments), the median of the others is reported.
  compute_ms    the same forward + backward with all weights resident on the GPU (no transfers,
                no optimizer); null if they do not fit.
  pcie_ms       (2L - 1) layer loads / h2d bandwidth: the step's H2D time at full bandwidth.
  h2d_gbps      one layer's bytes, pinned -> device, CUDA-event timed, median of 10.
  cpu_adamw_ms  the L optimizer steps alone (no GPU work running), median of 3.
  cpu_update_ms the same plus the bf16 -> fp32 gradient conversion and the bf16 weight refresh.

Output: `key=value` lines as the run goes, then one JSON line with everything
({"peer": "torch-cpu-adamw", ...} or {"peer": "torch-zero-offload-train", ...}).
"""
import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # --help works without torch
    torch = None

ADAMW = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
VARIANTS = {"fused": dict(fused=True), "foreach": dict(foreach=True),
            "single": dict(foreach=False, fused=False)}


def adamw(params, variant, lr):
    return torch.optim.AdamW(params, lr=lr, **ADAMW, **VARIANTS[variant])


def errstr(e):
    return f"{type(e).__name__}: {e}".replace("\n", " ").replace('"', "'")[:300]


def ms(t):
    return None if t is None else round(t * 1e3, 3)


def cpu_times(fn, reps, warmup):
    """Wall seconds of `reps` calls of fn after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def cpu_adamw(a):
    torch.set_num_threads(a.threads)
    n = a.params
    print(f"versions python={platform.python_version()} torch={torch.__version__} "
          f"threads={torch.get_num_threads()} cpu_count={os.cpu_count()}")
    torch.manual_seed(0)
    src, dst = torch.randn(n), torch.empty(n)
    copy_s = statistics.median(cpu_times(lambda: dst.copy_(src), 10, 1))
    del src, dst
    copy_bw = 2 * 4 * n / copy_s  # bytes/s, read + write
    bound_s = 28 * n / copy_bw
    print(f"cpu-adamw params={n} copy_gbps={copy_bw / 1e9:.2f} bound_ms={bound_s * 1e3:.2f}")
    out = {"peer": "torch-cpu-adamw", "torch": torch.__version__, "params": n,
           "threads": torch.get_num_threads(), "steps": a.steps, "copy_gbps": round(copy_bw / 1e9, 3),
           "bound_s": bound_s, "variants": {}}
    for v in VARIANTS:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        try:
            opt = adamw([p], v, 1e-3)
            step_s = statistics.median(cpu_times(opt.step, a.steps - 1, 1))
            r = {"step_s": step_s, "bound_s": bound_s, "fraction_of_bound": bound_s / step_s,
                 "gbps": 28 * n / step_s / 1e9}
            print(f"cpu-adamw variant={v} step_ms={step_s * 1e3:.2f} bound_ms={bound_s * 1e3:.2f} "
                  f"fraction_of_bound={r['fraction_of_bound']:.3f} gbps={r['gbps']:.2f}")
        except Exception as e:  # variant not supported by this torch version
            r = {"error": errstr(e)}
            print(f'cpu-adamw variant={v} error="{r["error"]}"')
        out["variants"][v] = r
        opt = p = None
        gc.collect()
    print(json.dumps(out))


def sync():
    torch.cuda.synchronize()


def gpu_times(fn, reps, warmup):
    """Wall seconds of `reps` calls of fn after `warmup` calls, synchronized around each."""
    for _ in range(warmup):
        fn()
        sync()
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return ts


def event_copy_time(dst, src, reps=10, warmup=2):
    """Median seconds of dst.copy_(src), timed with CUDA events on the current stream."""
    for _ in range(warmup):
        dst.copy_(src, non_blocking=True)
    sync()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        s.record()
        dst.copy_(src, non_blocking=True)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return statistics.median(ts)


def fused_cpu_ok():
    p = torch.nn.Parameter(torch.zeros(16))
    p.grad = torch.ones(16)
    try:
        adamw([p], "fused", 1e-3).step()
        return True
    except Exception:
        return False


def train(a):
    L, H, R = a.layers, a.hidden, a.rows
    torch.set_num_threads(a.threads)
    dev, bf = torch.device("cuda"), torch.bfloat16
    layer_bytes = H * H * 2
    gpu = torch.cuda.get_device_name(0)
    print(f"versions python={platform.python_version()} torch={torch.__version__} cuda={torch.version.cuda} "
          f'gpu="{gpu}" threads={torch.get_num_threads()}')

    # weights: generated on the GPU (fast); fp32 masters in host memory, bf16 copies pinned
    t0 = time.perf_counter()
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    masters, w_pin, g_pin = [], [], []
    for _ in range(L):
        m = torch.nn.Parameter((torch.randn(H, H, device=dev, generator=gen) * H ** -0.5).cpu())
        m.grad = torch.zeros_like(m)
        w = torch.empty((H, H), dtype=bf, pin_memory=True)
        w.copy_(m)
        masters.append(m)
        w_pin.append(w)
        g_pin.append(torch.empty((H, H), dtype=bf, pin_memory=True))
    x = torch.randn(R, H, device=dev, dtype=bf, generator=gen)
    y = torch.randn(R, H, device=dev, dtype=bf, generator=gen)
    variant = "fused" if fused_cpu_ok() else "foreach"
    opts = [adamw([m], variant, a.lr) for m in masters]
    print(f"config layers={L} hidden={H} rows={R} steps={a.steps} lr={a.lr} optimizer={variant} "
          f"weight_gib={L * layer_bytes / 2**30:.2f} init_s={time.perf_counter() - t0:.1f}")

    order = list(range(L)) + list(range(L - 2, -1, -1))  # layer of each weight use; L-1 used once for both

    def forward_backward(weight, release, grad_ready):
        """weight(k, i): layer i's device weight for use k; release(k): use k is done with it;
        grad_ready(i, dW_i): called as soon as dW_i is computed. Returns the loss (a GPU scalar)."""
        acts = [x]
        for k, i in enumerate(order):
            w = weight(k, i)
            if k < L - 1:
                acts.append(F.linear(acts[-1], w).relu_())
            else:
                if k == L - 1:
                    diff = F.linear(acts[-1], w) - y
                    loss = 0.5 * diff.float().square().sum() / R
                    dz = diff / R
                grad_ready(i, dz.t() @ acts[i])
                if i > 0:
                    dz = (dz @ w).mul_(acts[i] > 0)
            release(k)
        return loss

    # all-resident compute floor
    compute_s, wd = None, None
    try:
        wd = [w.to(dev) for w in w_pin]
        ts = gpu_times(lambda: forward_backward(lambda k, i: wd[i], lambda k: None, lambda i, g: None),
                       max(a.steps - 1, 3), 1)
        compute_s = statistics.median(ts)
        print(f"train resident compute_ms={compute_s * 1e3:.1f}")
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is a RuntimeError
        print(f'train resident error="{errstr(e)}"')
    wd = None
    gc.collect()
    torch.cuda.empty_cache()

    bufs = [torch.empty((H, H), dtype=bf, device=dev) for _ in range(2)]
    h2d_bw = layer_bytes / event_copy_time(bufs[0], w_pin[0])
    pcie_s = len(order) * layer_bytes / h2d_bw
    print(f"train h2d_gbps={h2d_bw / 1e9:.2f} pcie_ms={pcie_s * 1e3:.1f}")

    comp, h2d, d2h = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()
    n = len(order)

    def offload_step():
        ready = [torch.cuda.Event() for _ in range(n)]
        freed = [torch.cuda.Event() for _ in range(n)]
        gdone = [torch.cuda.Event() for _ in range(L)]

        def load(k):
            with torch.cuda.stream(h2d):
                if k >= 2:
                    h2d.wait_event(freed[k - 2])  # use k-2 is done with this buffer
                bufs[k % 2].copy_(w_pin[order[k]], non_blocking=True)
                ready[k].record(h2d)

        def weight(k, i):
            if k == 0:
                load(0)
            if k + 1 < n:
                load(k + 1)
            comp.wait_event(ready[k])
            return bufs[k % 2]

        def grad_ready(i, gw):
            d2h.wait_stream(comp)
            with torch.cuda.stream(d2h):
                g_pin[i].copy_(gw, non_blocking=True)
                gdone[i].record(d2h)
            gw.record_stream(d2h)  # keep its memory until the copy is done

        loss = forward_backward(weight, lambda k: freed[k].record(comp), grad_ready)
        for i in range(L - 1, -1, -1):  # the GPU goes on with the layers below meanwhile
            gdone[i].synchronize()
            masters[i].grad.copy_(g_pin[i])
            opts[i].step()
            w_pin[i].copy_(masters[i])
        return loss

    step_s, losses = [], []
    for s in range(a.steps):
        sync()
        t0 = time.perf_counter()
        loss = offload_step()
        sync()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
        print(f"train step={s} ms={step_s[-1] * 1e3:.1f} loss={losses[-1]:.6g}" + (" warmup" if s == 0 else ""))
    step_med = statistics.median(step_s[1:])

    def cpu_update():
        for m, o, g, w in zip(masters, opts, g_pin, w_pin):
            m.grad.copy_(g)
            o.step()
            w.copy_(m)

    cpu_adamw_s = statistics.median(cpu_times(lambda: [o.step() for o in opts], 3, 0))
    cpu_update_s = statistics.median(cpu_times(cpu_update, 3, 0))
    print(f"train cpu_adamw_ms={cpu_adamw_s * 1e3:.1f} cpu_update_ms={cpu_update_s * 1e3:.1f}")
    print(f"train summary step_ms={step_med * 1e3:.1f} compute_ms={ms(compute_s)} pcie_ms={pcie_s * 1e3:.1f} "
          f"cpu_adamw_ms={cpu_adamw_s * 1e3:.1f}")
    print(json.dumps({
        "peer": "torch-zero-offload-train", "torch": torch.__version__, "gpu": gpu, "optimizer": variant,
        "layers": L, "hidden": H, "rows": R, "steps": a.steps, "threads": torch.get_num_threads(),
        "step_ms": ms(step_med), "step_ms_all": [ms(t) for t in step_s], "compute_ms": ms(compute_s),
        "pcie_ms": ms(pcie_s), "h2d_gbps": round(h2d_bw / 1e9, 3), "cpu_adamw_ms": ms(cpu_adamw_s),
        "cpu_update_ms": ms(cpu_update_s), "losses": losses}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cpu-adamw", help="PyTorch CPU AdamW step time vs. host copy bandwidth")
    c.add_argument("--params", type=int, default=100_000_000)
    c.add_argument("--threads", type=int, default=os.cpu_count())
    c.add_argument("--steps", type=int, default=10, help="optimizer steps, the first is the warm-up")
    t = sub.add_parser("train", help="ZeRO-Offload style training step: streamed weights, CPU AdamW")
    t.add_argument("--layers", type=int, default=32)
    t.add_argument("--hidden", type=int, default=8192)
    t.add_argument("--rows", type=int, default=2048)
    t.add_argument("--steps", type=int, default=5, help="training steps, the first is the warm-up")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    if a.steps < 2:
        ap.error("--steps must be at least 2 (the first is the warm-up)")
    if torch is None:
        sys.exit("optim_peers.py needs PyTorch")
    with torch.no_grad():
        (cpu_adamw if a.cmd == "cpu-adamw" else train)(a)


if __name__ == "__main__":
    main()
