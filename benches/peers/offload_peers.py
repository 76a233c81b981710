#!/usr/bin/env python3
"""Peer figures for weight offloading: a stack of L bf16 Linear(H, H, bias=False) layers, no activation.

Run on the GPU machine:  PYTHONUNBUFFERED=1 python3 benches/peers/offload_peers.py

Environment (defaults in brackets):
  L [32], H [8192]        layers and width; weights are L*H*H*2 bytes (4 GiB at the defaults)
  BS [2048,16384]         forward batch rows, comma-separated
  TRAIN_ROWS [4096]       training batch rows, comma-separated; empty skips training
  REPS [3]                timed runs per measurement (median); disk_offload uses min(REPS, 2)
  DISK [/tmp]             parent directory of the disk_offload temp dir
  SKIP []                 comma list of: hand_prefetch, cpu_offload, disk_offload, hand_offload,
                          forward (whole forward section), train (whole training section).
                          The all-resident runs are the compute floors and always run.

Methodology (same as ../../.gpu/peers/offload_forward.py and offload_train.py, so figures compare):
  * h2d: one layer's bytes, pinned -> device, median of 10 event-timed copies after 2 warm-ups.
  * every timing: warm-up run(s), then REPS runs, each wall-timed with torch.cuda.synchronize()
    before and after; the median is reported.
  * forward floor = max(all-resident time, weight bytes / h2d).
  * train floor = max(all-resident step, max(2 * weight bytes, weight bytes) / h2d): weights go in
    twice (forward and backward) on the H2D engine and out once on the D2H engine.

Output: one `key=value` record a line (see the bottom of this docstring); a record that failed
prints `error="..."` in place of its figures.
  versions python=.. torch=.. cuda=.. accelerate=.. gpu="..."
  config L=.. H=.. BS=.. TRAIN_ROWS=.. REPS=.. DISK=.. SKIP=.. weight_gib=.. layer_mib=..
  h2d_gbps=<x> d2h_gbps=<x> bytes=<layer bytes>
  forward rows=<B> compute_ms=<t> pcie_ms=<t> floor_ms=<t>
  forward rows=<B> method=<resident|hand_prefetch|cpu_offload|disk_offload> ms=<t> ratio=<t/floor> maxdiff=<x>
  disk_offload write_s=<s> dir_gib=<x>
  train rows=<B> check maxdiff_w=<x> maxdiff_g=<x>
  train rows=<B> compute_ms=<t> pcie_ms=<t> floor_ms=<t>
  train rows=<B> method=<resident|hand_offload> ms=<t> ratio=<t/floor>
  done total_s=<s>
maxdiff: largest |output - all-resident output| (forward) or, for the training check, the largest
difference between the weights / input gradient after one resident step and one hand_offload
step from the same starting weights; 0 is expected (same kernels on the same inputs).
"""
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

T_START = time.perf_counter()


def env_int(name, default):
    v = os.environ.get(name, "").strip()
    return int(v) if v else default


def env_rows(name, default):
    v = os.environ.get(name, default)
    return [int(s) for s in v.replace(" ", "").split(",") if s]


L = env_int("L", 32)
H = env_int("H", 8192)
BS = env_rows("BS", "2048,16384")
TRAIN_ROWS = env_rows("TRAIN_ROWS", "4096")
REPS = max(1, env_int("REPS", 3))
DISK = os.environ.get("DISK", "") or "/tmp"
SKIP = {s.strip() for s in os.environ.get("SKIP", "").split(",") if s.strip()}
KNOWN_SKIPS = {"hand_prefetch", "cpu_offload", "disk_offload", "hand_offload", "forward", "train"}
LR = 1e-5  # small so the weights stay finite over the repeated steps (timing does not depend on it)
NBUF_TRAIN = 3

dev = torch.device("cuda")
DT = torch.bfloat16
LAYER_BYTES = H * H * 2
WBYTES = L * LAYER_BYTES

try:
    import accelerate
    from accelerate import cpu_offload, disk_offload
    ACC_VERSION = accelerate.__version__
    ACC_ERROR = None
except Exception as e:  # keep the other measurements if accelerate is missing or broken
    ACC_VERSION = "none"
    ACC_ERROR = f"{type(e).__name__}: {e}"


def q(s):
    return '"' + str(s).replace('"', "'").replace("\n", " ")[:300] + '"'


def errstr(e):
    return q(f"{type(e).__name__}: {e}")


def sync():
    torch.cuda.synchronize()


def cleanup():
    gc.collect()
    sync()
    torch.cuda.empty_cache()


def timed(fn, reps, warmup=1):
    """Median wall time (s) of `reps` runs after `warmup` runs, synchronized around each; also the last result."""
    out = None
    for _ in range(warmup):
        out = None
        out = fn()
        sync()
    ts = []
    for _ in range(reps):
        out = None  # free the previous result before the next run
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def event_copy_time(dst, src, reps=10, warmup=2):
    """Median seconds of dst.copy_(src) timed with CUDA events on the current stream."""
    for _ in range(warmup):
        dst.copy_(src, non_blocking=True)
    sync()
    ts = []
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        s.record()
        dst.copy_(src, non_blocking=True)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return statistics.median(ts)


def maxdiff(a, b):
    if a is None or b is None:
        return float("nan")
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------------------------------------
# header
gpu_name = torch.cuda.get_device_name(0)
print(f"versions python={platform.python_version()} torch={torch.__version__} cuda={torch.version.cuda} "
      f"accelerate={ACC_VERSION} gpu={q(gpu_name)}")
print(f"config L={L} H={H} BS={','.join(map(str, BS))} TRAIN_ROWS={','.join(map(str, TRAIN_ROWS))} "
      f"REPS={REPS} DISK={DISK} SKIP={','.join(sorted(SKIP))} weight_gib={WBYTES / 2**30:.2f} "
      f"layer_mib={LAYER_BYTES / 2**20:.0f}")
if ACC_ERROR:
    print(f"note accelerate_import_error={q(ACC_ERROR)}")
for s in sorted(SKIP - KNOWN_SKIPS):
    print(f"note unknown_skip={s}")

# ---------------------------------------------------------------------------------------------
# weights: generated once on the GPU (fast), kept as pageable CPU tensors (for Accelerate, which
# copies from its CPU state dict) and as pinned CPU tensors (for the hand-written offloads).
t0 = time.perf_counter()
gen = torch.Generator(device=dev)
gen.manual_seed(0)
W_cpu, W_pin = [], []
for i in range(L):
    w = (torch.randn(H, H, device=dev, dtype=torch.float32, generator=gen) * H ** -0.5).to(DT)
    W_cpu.append(w.cpu())
    p = torch.empty((H, H), dtype=DT, pin_memory=True)
    p.copy_(w)
    W_pin.append(p)
    del w
cleanup()
print(f"note init_s={time.perf_counter() - t0:.1f}")

# ---------------------------------------------------------------------------------------------
# H2D / D2H pinned bandwidth of one layer's bytes
hp = torch.empty(LAYER_BYTES, dtype=torch.uint8, pin_memory=True)
hd = torch.empty(LAYER_BYTES, dtype=torch.uint8, device=dev)
t_h2d = event_copy_time(hd, hp)
t_d2h = event_copy_time(hp, hd)
h2d = LAYER_BYTES / t_h2d  # bytes/s
d2h = LAYER_BYTES / t_d2h
del hp, hd
cleanup()
print(f"h2d_gbps={h2d / 1e9:.2f} d2h_gbps={d2h / 1e9:.2f} bytes={LAYER_BYTES}")
PCIE_FWD = WBYTES / h2d
PCIE_TRAIN = max(2 * WBYTES, WBYTES) / h2d


def fmt_ms(t):
    return f"{t * 1e3:.1f}"


# ---------------------------------------------------------------------------------------------
# forward
def run_forward():
    xs, refs, floor = {}, {}, {}
    for B in BS:
        g = torch.Generator(device=dev)
        g.manual_seed(1000 + B)
        xs[B] = torch.randn(B, H, device=dev, dtype=DT, generator=g)

    def report(B, name, t, out):
        print(f"forward rows={B} method={name} ms={fmt_ms(t)} ratio={t / floor[B]:.2f} "
              f"maxdiff={maxdiff(out, refs.get(B)):.3g}")

    def report_err(B, name, e):
        print(f"forward rows={B} method={name} error={errstr(e)}")

    # (a) all weights on the GPU: compute floor
    Wd = [w.to(dev) for w in W_pin]
    sync()

    def resident(x):
        y = x
        for w in Wd:
            y = F.linear(y, w)
        return y

    with torch.no_grad():
        for B in BS:
            t, out = timed(lambda: resident(xs[B]), REPS)
            refs[B] = out
            floor[B] = max(t, PCIE_FWD)
            print(f"forward rows={B} compute_ms={fmt_ms(t)} pcie_ms={fmt_ms(PCIE_FWD)} floor_ms={fmt_ms(floor[B])}")
            report(B, "resident", t, out)
            del out
    del Wd
    cleanup()

    # (b) hand-written double-buffered prefetch from pinned memory on a side stream
    if "hand_prefetch" not in SKIP:
        try:
            bufs = [torch.empty((H, H), dtype=DT, device=dev) for _ in range(2)]
            cs = torch.cuda.Stream()
            comp = torch.cuda.current_stream()
            ready = [torch.cuda.Event() for _ in range(2)]
            freed = [torch.cuda.Event() for _ in range(2)]

            def prefetch_forward(x):
                cs.wait_stream(comp)  # buffers are free once earlier work on the compute stream is done
                with torch.cuda.stream(cs):
                    bufs[0].copy_(W_pin[0], non_blocking=True)
                    ready[0].record(cs)
                y = x
                for i in range(L):
                    cur, nxt = i % 2, (i + 1) % 2
                    if i + 1 < L:
                        with torch.cuda.stream(cs):
                            if i >= 1:
                                cs.wait_event(freed[nxt])  # layer i-1 is done with that buffer
                            bufs[nxt].copy_(W_pin[i + 1], non_blocking=True)
                            ready[nxt].record(cs)
                    comp.wait_event(ready[cur])
                    y = F.linear(y, bufs[cur])
                    freed[cur].record(comp)
                return y

            with torch.no_grad():
                for B in BS:
                    try:
                        t, out = timed(lambda: prefetch_forward(xs[B]), REPS)
                        report(B, "hand_prefetch", t, out)
                        del out
                    except Exception as e:
                        report_err(B, "hand_prefetch", e)
                    cleanup()
            del bufs
        except Exception as e:
            for B in BS:
                report_err(B, "hand_prefetch", e)
        cleanup()

    def linear_stack():
        # meta-device modules, then the prebuilt CPU weights assigned in: no 4 GiB re-initialisation
        with torch.device("meta"):
            m = nn.Sequential(*[nn.Linear(H, H, bias=False, dtype=DT) for _ in range(L)])
        for lin, w in zip(m, W_cpu):
            lin.weight = nn.Parameter(w, requires_grad=False)
        return m.eval()

    # (c) Accelerate cpu_offload
    if "cpu_offload" not in SKIP:
        try:
            if ACC_ERROR:
                raise RuntimeError(ACC_ERROR)
            m = cpu_offload(linear_stack(), execution_device=dev)
            with torch.no_grad():
                for B in BS:
                    try:
                        t, out = timed(lambda: m(xs[B]), REPS)
                        report(B, "cpu_offload", t, out)
                        del out
                    except Exception as e:
                        report_err(B, "cpu_offload", e)
                    cleanup()
            del m
        except Exception as e:
            for B in BS:
                report_err(B, "cpu_offload", e)
        cleanup()

    # (d) Accelerate disk_offload into a temp dir under $DISK
    if "disk_offload" not in SKIP:
        odir = None
        try:
            if ACC_ERROR:
                raise RuntimeError(ACC_ERROR)
            os.makedirs(DISK, exist_ok=True)
            free_gib = shutil.disk_usage(DISK).free / 2**30
            if free_gib < WBYTES / 2**30 + 1:
                raise RuntimeError(f"{DISK} has {free_gib:.1f} GiB free, needs {WBYTES / 2**30 + 1:.1f}")
            odir = tempfile.mkdtemp(prefix="offload_peers_", dir=DISK)
            tw = time.perf_counter()
            m = disk_offload(linear_stack(), offload_dir=odir, execution_device=dev)
            tw = time.perf_counter() - tw
            size = sum(os.path.getsize(os.path.join(odir, f)) for f in os.listdir(odir))
            print(f"disk_offload write_s={tw:.1f} dir_gib={size / 2**30:.2f}")
            reps = min(REPS, 2)
            with torch.no_grad():
                for B in BS:
                    try:
                        t, out = timed(lambda: m(xs[B]), reps)
                        report(B, "disk_offload", t, out)
                        del out
                    except Exception as e:
                        report_err(B, "disk_offload", e)
                    cleanup()
            del m
        except Exception as e:
            for B in BS:
                report_err(B, "disk_offload", e)
        finally:
            if odir is not None:
                shutil.rmtree(odir, ignore_errors=True)
        cleanup()

    xs.clear()
    refs.clear()
    cleanup()


# ---------------------------------------------------------------------------------------------
# training step: forward 0..L-1, backward L-1..0, SGD on the GPU
def run_train():
    comp = torch.cuda.current_stream()
    h2d_s = torch.cuda.Stream()
    d2h_s = torch.cuda.Stream()
    order = list(range(L)) + list(range(L - 1, -1, -1))
    n = len(order)

    def resident_step(x, Wd):
        acts = [x]
        for i in range(L):
            acts.append(F.linear(acts[-1], Wd[i]))
        g = torch.ones_like(acts[-1])
        for i in range(L - 1, -1, -1):
            gw = g.t() @ acts[i]   # weight grad (H x H)
            g = g @ Wd[i]          # input grad, with the weights before the update
            Wd[i].add_(gw, alpha=-LR)
        return g

    def offload_step(x, bufs):
        # weights in pinned memory, streamed H2D for forward then backward through NBUF device buffers;
        # updated weights written back D2H on a second stream; activations stay on the device.
        ready = [torch.cuda.Event() for _ in range(n)]
        freed = [torch.cuda.Event() for _ in range(n)]
        h2d_s.wait_stream(comp)
        h2d_s.wait_stream(d2h_s)  # earlier write-backs into pinned weights / reads of the buffers done

        def load(k):
            with torch.cuda.stream(h2d_s):
                if k >= NBUF_TRAIN:
                    h2d_s.wait_event(freed[k - NBUF_TRAIN])
                bufs[k % NBUF_TRAIN].copy_(W_pin[order[k]], non_blocking=True)
                ready[k].record(h2d_s)

        for k in range(NBUF_TRAIN - 1):
            load(k)
        acts = [x]
        g = None
        for k, i in enumerate(order):
            if k + NBUF_TRAIN - 1 < n:
                load(k + NBUF_TRAIN - 1)  # its wait is on freed[k-1], already recorded
            comp.wait_event(ready[k])
            w = bufs[k % NBUF_TRAIN]
            if k < L:
                acts.append(F.linear(acts[-1], w))
                freed[k].record(comp)
            else:
                if g is None:
                    g = torch.ones_like(acts[-1])
                gw = g.t() @ acts[i]
                g = g @ w
                w.add_(gw, alpha=-LR)
                upd = torch.cuda.Event()
                upd.record(comp)
                with torch.cuda.stream(d2h_s):
                    d2h_s.wait_event(upd)
                    W_pin[i].copy_(w, non_blocking=True)
                    freed[k].record(d2h_s)
        comp.wait_stream(d2h_s)  # the step ends when the write-back is done
        return g

    for B in TRAIN_ROWS:
        gen = torch.Generator(device=dev)
        gen.manual_seed(2000 + B)
        x = torch.randn(B, H, device=dev, dtype=DT, generator=gen)
        do_off = "hand_offload" not in SKIP
        t_res = None
        bufs = None
        try:
            Wd = [w.to(dev) for w in W_pin]  # same starting weights as the pinned copies
            g_res = resident_step(x, Wd)     # one step, also the warm-up
            sync()
            if do_off:
                try:
                    bufs = [torch.empty((H, H), dtype=DT, device=dev) for _ in range(NBUF_TRAIN)]
                    g_off = offload_step(x, bufs)
                    sync()
                    mw = max((Wd[i] - W_pin[i].to(dev)).abs().max().item() for i in range(L))
                    print(f"train rows={B} check maxdiff_w={mw:.3g} maxdiff_g={maxdiff(g_off, g_res):.3g}")
                    del g_off
                except Exception as e:
                    print(f"train rows={B} check error={errstr(e)}")
                    bufs = None
                cleanup()
            del g_res
            t_res, out = timed(lambda: resident_step(x, Wd), REPS)
            del out, Wd
        except Exception as e:
            print(f"train rows={B} method=resident error={errstr(e)}")
            Wd = None
        cleanup()
        if t_res is not None:
            floor = max(t_res, PCIE_TRAIN)
            print(f"train rows={B} compute_ms={fmt_ms(t_res)} pcie_ms={fmt_ms(PCIE_TRAIN)} floor_ms={fmt_ms(floor)}")
            print(f"train rows={B} method=resident ms={fmt_ms(t_res)} ratio={t_res / floor:.2f}")
        else:
            floor = PCIE_TRAIN
        if do_off:
            try:
                if bufs is None:
                    bufs = [torch.empty((H, H), dtype=DT, device=dev) for _ in range(NBUF_TRAIN)]
                t_off, out = timed(lambda: offload_step(x, bufs), REPS)
                del out
                print(f"train rows={B} method=hand_offload ms={fmt_ms(t_off)} ratio={t_off / floor:.2f}")
            except Exception as e:
                print(f"train rows={B} method=hand_offload error={errstr(e)}")
        bufs = None
        del x
        cleanup()


if "forward" not in SKIP:
    run_forward()
if TRAIN_ROWS and "train" not in SKIP:
    run_train()
print(f"done total_s={time.perf_counter() - T_START:.1f}")
sys.stdout.flush()
