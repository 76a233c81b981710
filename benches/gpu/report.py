#!/usr/bin/env python3
"""The reports of benches/gpu/run: read each step's log, make its figures, judge them, write JSON.

Python 3 standard library only (it runs on the GPU machine and in CI). Subcommands:

  build --stage S --steps STEPS.tsv --dir OUT --out REPORT.json [--host] [--budget S]
         [--elapsed S] [--commit-file F] [--title T] [--date D] [--note PARAGRAPH ...]
      parse every step's log (their paths are relative to OUT) and write the stage's report; the
      steps file is run's: a line a step, tab-separated: name, kind, status, exit status, seconds,
      time limit, log, reason (why it did not run), command, then KEY=VALUE pairs for its parser
  check REPORT.json ...
      validate reports against the format of benches/gpu/README.md; exit 1 if one is not
  summary REPORT.json
      one line per figure that is not met or measured, and the counts per verdict

The report format is documented in benches/gpu/README.md; `validate` below is its executable form.
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys

SCHEMA = "strata-gpu-report/1"
# met / missed: against the figure's target. measured: it ran, and no target applies (a figure
# shown beside, or a target this machine cannot judge). not-run / failed / timed-out: the step
# that should have produced it did not run, exited non-zero, or ran past its time limit.
VERDICTS = ("met", "missed", "measured", "not-run", "failed", "timed-out")
STATUSES = ("ok", "failed", "timed-out", "not-run")
# A check of `run lease` (and of the ledger, docs/bench/ledger.json): how it went as a whole.
CHECK_VERDICTS = ("pass", "fail", "skipped", "timed-out")
OPS = {"<=": lambda x, t: x <= t, ">=": lambda x, t: x >= t, "==": lambda x, t: x == t,
       "within": lambda x, t: t[0] <= x <= t[1]}

UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
SIZE = rf"{NUM} (?:B|KiB|MiB|GiB|TiB)"


def size_bytes(text):
    """'3.25 GiB' -> bytes (format_size's output)."""
    v, u = text.split()
    return float(v) * UNITS[u]


def gib(b):
    return b / (1 << 30)


def later_median(values):
    """The figure strata prints: the median of the steps after the first (the upper middle when
    even, as `probe::median_after_first` takes it)."""
    rest = sorted(values[1:] if len(values) > 1 else values)
    return rest[len(rest) // 2] if rest else None


def first(pattern, text, flags=re.M):
    return re.search(pattern, text, flags)


def fig(name, value, unit, **kw):
    """A figure before the builder adds command, log and verdict."""
    f = {"name": name, "value": value, "unit": unit}
    f.update({k: v for k, v in kw.items() if v is not None})
    return f


def target(text, op, value, of="ratio"):
    """`of`: which field of the figure the target is judged on ("ratio" or "value")."""
    return {"text": text, "op": op, "value": value, "of": of}


def parse_target(spec, text=None, of="ratio"):
    """'<=1.05' -> a target (the meta of a step gives them as text)."""
    if not spec:
        return None
    m = re.fullmatch(r"(<=|>=|==)\s*(" + NUM + ")", spec.strip())
    if not m:
        raise ValueError(f"bad target {spec!r}")
    op, v = m.group(1), float(m.group(2))
    sym = {"<=": "≤", ">=": "≥", "==": "="}[op]
    return target(text or f"{sym} {v:g}", op, v, of)


# ------------------------------------------------------------------------------------------------
# Parsers: (text of the log, the step's record) -> figures. Each reads the output the binary prints
# today; where an older binary printed it differently (the 2026-11-23 logs), both are read.


def parse_libtest(text, step):
    """A test binary's output (libtest): failures, passes, and the SKIP lines of GPU tests."""
    meta = step.get("meta", {})
    label = meta.get("label", step["name"])
    if meta.get("list") == "1":  # the host dry run lists the tests (cargo test ran them)
        m = first(r"^(\d+) tests?, \d+ benchmarks?$", text)
        n = int(m.group(1)) if m else None
        return [fig(label, n, "tests listed", group=GROUPS["libtest"], verdict="not-run",
                    note="host dry run: listed only (cargo test ran them on the host backend)")]
    lease = first(r"^lease tests: (\d+) passed, (\d+) failed, (\d+) ignored; parallel-only failures: (.*)$", text)
    if lease:  # benches/gpu/lease.py tests: the failures counted after the rerun alone
        passed, failed, ignored = (int(x) for x in lease.groups()[:3])
        skips = len(re.findall(r"^SKIP ", text, re.M))
        require = meta.get("require_gpu") == "1"
        note = f"{passed} passed, {failed} failed, {ignored} ignored, {skips} SKIP lines"
        if lease.group(4) != "none":
            note += f"; failed beside other tests, passed alone: {lease.group(4)}"
        bad = failed + (skips if require else 0)
        return [fig(label, bad, "failed or skipped" if require else "failed", group=GROUPS["libtest"],
                    target=target("all pass" + (", none skipped" if require else ""), "==", 0, "value"),
                    note=note)]
    passed = failed = ignored = 0
    results = re.findall(r"^test result: (?:ok|FAILED)\. (\d+) passed; (\d+) failed; (\d+) ignored",
                         text, re.M)
    for p, f_, i in results:
        passed, failed, ignored = passed + int(p), failed + int(f_), ignored + int(i)
    skips = len(re.findall(r"^SKIP ", text, re.M))
    if not results:
        return []
    require = meta.get("require_gpu") == "1"
    note = f"{passed} passed, {failed} failed, {ignored} ignored, {skips} SKIP lines"
    bad = failed + (skips if require else 0)
    return [fig(label, bad, "failed or skipped" if require else "failed", group=GROUPS["libtest"],
                target=target("all pass" + (", none skipped" if require else ""), "==", 0, "value"),
                note=note)]


def parse_sanitizer(text, step):
    """compute-sanitizer's summary line and the tests' own result."""
    meta = step.get("meta", {})
    tool = meta.get("tool", "memcheck")
    label = meta.get("label", step["name"])
    refused = first(r"^.*(Device not supported|Target application terminated before first instrumented API call"
                    r"|Unable to find injection library).*$", text)
    if refused and not first(r"(ERROR|RACECHECK) SUMMARY", text):
        # The tool could not run here (gVisor refuses it: "Device not supported"): no verdict on
        # the code, the check is skipped with the tool's own words.
        return [fig(label, None, "errors", group=GROUPS["sanitizer"], verdict="not-run",
                    note=f"compute-sanitizer could not run on this machine: {refused.group(0).strip()}")]
    m = first(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    if m:
        errors, note = int(m.group(2)), f"{m.group(1)} hazards ({m.group(3)} warnings)"
    else:
        m = first(r"ERROR SUMMARY: (\d+) errors?", text)
        if not m:
            return []
        errors, note = int(m.group(1)), None
    tests = parse_libtest(text, {"name": label, "meta": {}})
    if tests:
        note = "; ".join(x for x in [note, "tests: " + tests[0]["note"]] if x)
    f = fig(label, errors, "errors", group=GROUPS["sanitizer"], note=note,
            target=target("0 errors", "==", 0, "value"))
    if tests and tests[0]["value"]:
        f["verdict"] = "failed"  # the tests failed under the tool: its count says nothing
    return [f]


CRITERION_TIME = re.compile(
    r"^(\S[^\n]*?)\s*\n?\s+time:\s+\[(" + NUM + r") (\S+) (" + NUM + r") (\S+) (" + NUM + r") (\S+)\]",
    re.M)
NS = {"ps": 1e-3, "ns": 1.0, "µs": 1e3, "us": 1e3, "ms": 1e6, "s": 1e9}
# The bookkeeping bench's target: under 1 µs of bookkeeping per access. These ids are one access
# each (the x64 ids are divided by 64); the others (put, put + read, Device tier of the host
# backend) include copies and are shown beside.
PER_ACCESS = ("on_access", "a hit, Pinned", "device_view + drop", "device_view x64")
# A device view hit + drop is held to the store core's requirement: ≤ 1 µs of host time on the
# host backend (the bookkeeping target above) and ≤ 3 µs on CUDA. The tests stage (the CUDA ids
# of the bookkeeping bench) and the core stage judge the CUDA figure against the same target.
CUDA_VIEW_TARGET_TEXT = "≤ 3 µs of host time (CUDA)"
CUDA_VIEW_NOTE = ("target: the store core's requirement, a device_view hit + drop on CUDA ≤ 3 µs of host "
                  "time, measured by the bookkeeping bench")


def cuda_view_target():
    return target(CUDA_VIEW_TARGET_TEXT, "<=", 3000.0, "value")


def is_cuda_view(name):
    """A device view hit + drop on CUDA (one view, or the x64 id per view)."""
    return name.startswith("device_view") and "CUDA" in name


def parse_criterion(text, step):
    """criterion's `time: [low median high]` lines: the median estimate of one iteration."""
    figs = []
    for m in CRITERION_TIME.finditer(text):
        name = m.group(1).strip()
        name = name.split("/", 1)[1] if name.startswith("bookkeeping/") else name
        ns = float(m.group(4)) * NS[m.group(5)]
        note = None
        if "x64" in name:
            ns, note = ns / 64, "one iteration is 64 views and 64 drops; per view"
        per_access = any(k in name for k in PER_ACCESS)
        tgt = target("< 1 µs per access", "<=", 1000.0, "value") if per_access else None
        if per_access and is_cuda_view(name):
            tgt = cuda_view_target()
            note = "; ".join(x for x in [note, CUDA_VIEW_NOTE] if x)
        figs.append(fig(name, round(ns, 3), "ns", group=GROUPS["criterion"], note=note, target=tgt))
    skip = first(r"^SKIP (.*)$", text)
    if not figs and skip:  # the ids asked for did not run: say why
        figs.append(fig(step.get("meta", {}).get("label", step["name"]), None, "ns", group=GROUPS["criterion"],
                        verdict="failed", note=skip.group(1)))
    return figs


STORE_BW_ROWS = [
    ("raw pinned HtoD", "raw pinned H2D (cuMemcpyHtoDAsync)"),
    ("raw pinned DtoH", "raw pinned D2H (cuMemcpyDtoHAsync)"),
    ("store move_to Pinned -> Device", "store move_to Pinned → Device"),
    ("store move_to Device -> Pinned", "store move_to Device → Pinned"),
    ("store put from pageable -> Device", "store put from pageable memory → Device"),
    ("host memcpy, one thread", "one-thread host memcpy (reference)"),
]


def parse_store_bandwidth(text, step):
    """examples/store_bandwidth.rs: a GB/s / ms table and three ratio lines with their targets."""
    size = first(r"^size (" + SIZE + ")", text)
    size = size.group(1) if size else "?"
    gbps = {}
    for key, _ in STORE_BW_ROWS:
        m = first(r"^" + re.escape(key) + r".*?\s(" + NUM + r")\s+(" + NUM + r")\s*$", text)
        if m:
            gbps[key] = float(m.group(1))
    ratios = {}
    for key, pat in [("h2d", "move_to H2D / raw H2D"), ("d2h", "move_to D2H / raw D2H"),
                     ("put", "put pageable / raw pinned H2D")]:
        m = first(r"^ratio " + re.escape(pat) + r": (" + NUM + r") \(target >= (" + NUM + r")\)", text)
        if m:
            ratios[key] = (float(m.group(1)), float(m.group(2)))
    group = GROUPS["store-bandwidth"]
    figs = []
    links = {"store move_to Pinned -> Device": ("h2d", "raw pinned HtoD", "raw pinned H2D"),
             "store move_to Device -> Pinned": ("d2h", "raw pinned DtoH", "raw pinned D2H"),
             "store put from pageable -> Device": ("put", "raw pinned HtoD", "raw pinned H2D")}
    for key, name in STORE_BW_ROWS:
        if key not in gbps:
            continue
        if key in links:
            r, raw, raw_name = links[key]
            ratio, t = ratios.get(r, (None, None))
            figs.append(fig(f"{name}, {size}", gbps[key], "GB/s", group=group, peer=gbps.get(raw),
                            peer_what=raw_name, ratio=ratio,
                            target=target(f"≥ {t:g} of {raw_name}", ">=", t) if t else None))
        else:
            figs.append(fig(f"{name}, {size}", gbps[key], "GB/s", group=group))
    return figs


LAYERED_PASS = re.compile(r"^\s*(\d+)\s+(" + NUM + r")\s+(" + SIZE + r")\s+(" + SIZE + r")\s+(\d+)\s+("
                          + NUM + r")\s+(" + NUM + r")%\s*$", re.M)


def parse_layered(text, step):
    """examples/layered.rs: the mean pass against max(compute, PCIe), bytes against the minimum."""
    meta = step.get("meta", {})
    label = meta.get("label", step["name"])
    group = meta.get("group", GROUPS["layered"])
    compute = first(r"^compute floor \(all resident\): (" + NUM + ") ms", text)
    mean = first(r"^mean pass \(passes 2\.\., one interval\): (" + NUM + r") ms = (" + NUM
                 + r")x max\(compute, PCIe\) = (" + NUM + ") ms", text)
    pcie = first(r"PCIe floor for the bytes moved: (" + NUM + ") ms", text)
    host = first(r"^mean pass \(passes 2\.\.\): (" + NUM + r") ms \(no GPU", text)
    moved = first(r"^bytes moved per pass: (" + SIZE + r") = (" + NUM + r")x the minimum .*?: (" + SIZE
                  + r")\)", text)
    figs = []
    if mean:
        floor_what = (f"max(compute {float(compute.group(1)):.2f} ms, PCIe {float(pcie.group(1)):.2f} ms)"
                      if compute and pcie else "max(compute, PCIe)")
        figs.append(fig(f"{label}: pass time", float(mean.group(1)), "ms", group=group,
                        floor=float(mean.group(3)), floor_what=floor_what, ratio=float(mean.group(2)),
                        target=parse_target(meta.get("target_time"))))
    elif host:
        figs.append(fig(f"{label}: pass time", float(host.group(1)), "ms", group=group,
                        note="no GPU: no PCIe floor, the target is not judged"))
    if moved:
        figs.append(fig(f"{label}: bytes moved per pass", round(gib(size_bytes(moved.group(1))), 3), "GiB",
                        group=group, floor=round(gib(size_bytes(moved.group(3))), 3),
                        floor_what="the minimum: model − layers that stayed resident",
                        ratio=float(moved.group(2)), target=parse_target(meta.get("target_bytes"))))
    passes = [int(m.group(5)) for m in LAYERED_PASS.finditer(text)]
    if len(passes) > 1:
        figs.append(fig(f"{label}: misses per pass after the first", max(passes[1:]), "misses",
                        group=group))
    return figs


MLP_STEP = re.compile(r"^step\s+(\d+):\s+(" + NUM + r") ms\s+h2d\s+(" + SIZE + r")\s+d2h\s+(" + SIZE + ")",
                      re.M)


def parse_mlp(text, step):
    """strata::mlp (`strata train-demo --mode forward`, or train --optimizer device-sgd)."""
    meta = step.get("meta", {})
    label = meta.get("label", step["name"])
    group = meta.get("group", GROUPS["mlp"])
    simulated = bool(first(r"^simulated: ", text)) or "(simulated H2D" in text
    # Under --simulate every line the example prints starts with "simulated: ".
    text = re.sub(r"^simulated: ", "", text, flags=re.M)
    compute = first(r"^compute floor \(all resident\): (" + NUM + ") ms", text)
    pcie = first(r"^PCIe floor: (" + SIZE + r") in, (" + SIZE + r") out per step at (" + NUM
                 + r") GB/s \([^)]*\) = (" + NUM + ") ms", text)
    final = first(r"^step time (" + NUM + r") ms = (" + NUM + r")x max\(compute, PCIe\)", text)
    plain = first(r"^step time (" + NUM + r") ms\s*$", text)
    moved = first(r"^bytes it moved: (" + SIZE + r") in, (" + SIZE + r") out per step \(median\) = ("
                  + NUM + r") ms at that bandwidth; step time (" + NUM + ")x that", text)
    differs = first(r"^results differ from the all-resident run", text)
    steps = [(float(m.group(2)), size_bytes(m.group(3)), size_bytes(m.group(4)))
             for m in MLP_STEP.finditer(text)]
    figs = []
    parts = []
    if compute:
        parts.append(f"compute {float(compute.group(1)):.2f} ms")
    if pcie:
        parts.append(f"PCIe {float(pcie.group(4)):.2f} ms for {pcie.group(1)}")
    floor = max([float(m.group(g)) for m, g in ((compute, 1), (pcie, 4)) if m], default=None)
    note = None
    if moved:
        note = (f"against the bytes it moved ({moved.group(1)} in, {moved.group(2)} out): "
                f"{float(moved.group(4)):.3f}x")
    if differs:
        note = "results differ from the all-resident run"
    if final:
        figs.append(fig(f"{label}: step time", float(final.group(1)), "ms", group=group,
                        floor=floor, floor_what=f"max({', '.join(parts)})" if parts else None,
                        ratio=float(final.group(2)), target=parse_target(meta.get("target")),
                        simulated=simulated or None, note=note, key=meta.get("key"),
                        peer_key=meta.get("peer_key"), verdict="failed" if differs else None))
    elif plain:
        figs.append(fig(f"{label}: step time", float(plain.group(1)), "ms", group=group,
                        simulated=simulated or None, note="no floors printed"))
    if steps and pcie:
        h2d = later_median([s[1] for s in steps])
        must = size_bytes(pcie.group(1))
        figs.append(fig(f"{label}: bytes into the device per step", round(gib(h2d), 3), "GiB",
                        group=group, floor=round(gib(must), 3),
                        floor_what="must cross: model − budget + 2 layers (training: twice)",
                        ratio=round(h2d / must, 3) if must else None, simulated=simulated or None))
    return figs


ENGINE_LINE = re.compile(r"^engine (\S+)\s+ran (\S+)\s+(" + NUM + r") ms per step", re.M)


def parse_train(text, step):
    """strata::train (`strata train-demo --mode train`): engines, floors, Auto's choice."""
    meta = step.get("meta", {})
    label = meta.get("label", step["name"])
    group = meta.get("group", GROUPS["train"])
    compute = first(r"^compute floor \(all resident, no optimizer\): (" + NUM + ") ms", text)
    pcie = first(r"^PCIe floor: (" + SIZE + r") in, (" + SIZE + r") out per step = (" + NUM + ") ms", text)
    opt = first(r"^optimizer floor: (" + NUM + ") ms", text)
    final = first(r"^step time (" + NUM + r") ms \((\S+) engine, (\w+)\)(?: = (" + NUM + r")x)?", text)
    floors = [(float(m.group(m.lastindex)), what) for m, what in
              [(compute, "compute"), (pcie, "PCIe"), (opt, "optimizer")] if m]
    floor = max((v for v, _ in floors), default=None)
    floor_what = ("max(" + ", ".join(f"{w} {v:.2f} ms" for v, w in floors) + ")") if floors else None
    tgt = parse_target(meta.get("target"))
    figs = []
    engines = [(m.group(1), m.group(2), float(m.group(3))) for m in ENGINE_LINE.finditer(text)]
    for asked, ran, ms in engines:
        name = f"{label}: engine {asked}" + (f" (ran {ran})" if ran != asked else "")
        figs.append(fig(name, ms, "ms", group=group, floor=floor, floor_what=floor_what,
                        ratio=round(ms / floor, 3) if floor else None,
                        target=tgt if asked == "auto" else None,
                        key=meta.get("key") if asked == "auto" else None,
                        peer_key=meta.get("peer_key") if asked == "auto" else None))
    for m in re.finditer(r"^engine (\S+): (?!$)(.+)$", text, re.M):  # an engine that could not run
        figs.append(fig(f"{label}: engine {m.group(1)}", None, "ms", group=group, verdict="failed",
                        note=m.group(2)[:200]))
    if not engines and final:
        ms = float(final.group(1))
        figs.append(fig(f"{label}: step time ({final.group(2)} engine)", ms, "ms", group=group,
                        floor=floor, floor_what=floor_what,
                        ratio=float(final.group(4)) if final.group(4) else None, target=tgt,
                        key=meta.get("key"), peer_key=meta.get("peer_key")))
    fixed = {a: ms for a, _, ms in engines if a != "auto"}
    auto = [(ran, ms) for a, ran, ms in engines if a == "auto"]
    if auto and auto[0][0] in fixed and len(fixed) > 1:
        pick = auto[0][0]
        best = min(fixed, key=fixed.get)
        figs.append(fig(f"{label}: Auto's pick ({pick}) against the fastest engine ({best})",
                        round(fixed[pick] / fixed[best], 3), "x", group=group,
                        target=target("Auto picks the fastest engine (= 1)", "<=", 1.0, "value")))
    flops = meta.get("flops")
    if flops and final:
        flops, ms = float(flops), float(final.group(1))
        sig = lambda x: float(f"{x:.4g}")  # noqa: E731 (4 significant digits)
        f = fig(f"{label}: achieved TFLOPS", sig(flops / ms / 1e9), "TFLOPS", group=group,
                note=f"{flops:.3g} flops a step (forward and backward GEMMs) over the step time")
        if compute:
            f.update(peer=sig(flops / float(compute.group(1)) / 1e9),
                     peer_what="the same layers resident (compute floor, no optimizer)",
                     ratio=round(float(compute.group(1)) / ms, 3))
        figs.append(f)
    return figs


PEER_NAMES = {"hand_prefetch": "hand-written PyTorch prefetch", "cpu_offload": "Accelerate cpu_offload",
              "disk_offload": "Accelerate disk_offload", "hand_offload": "hand-written PyTorch offload",
              "resident": "PyTorch, all resident"}


def parse_offload_peers(text, step):
    """benches/peers/offload_peers.py's key=value records."""
    figs = []
    floors = {}
    for m in re.finditer(r"^(forward|train) rows=(\d+) compute_ms=(" + NUM + r") pcie_ms=(" + NUM
                         + r") floor_ms=(" + NUM + ")", text, re.M):
        floors[(m.group(1), m.group(2))] = (float(m.group(5)), float(m.group(3)), float(m.group(4)))
    for m in re.finditer(r"^(forward|train) rows=(\d+) method=(\w+) (?:ms=(" + NUM + r") ratio=(" + NUM
                         + r")|error=(.*))", text, re.M):
        mode, rows, method = m.group(1), m.group(2), m.group(3)
        name = f"{PEER_NAMES.get(method, method)}, {mode}, rows {rows}"
        key = f"peer:{mode}:{rows}:{method}"
        if m.group(6) is not None:
            figs.append(fig(name, None, "ms", group=GROUPS["offload-peers"], verdict="failed",
                            note=m.group(6)[:200], key=key))
            continue
        fl = floors.get((mode, rows))
        figs.append(fig(name, float(m.group(4)), "ms", group=GROUPS["offload-peers"],
                        floor=fl[0] if fl else None,
                        floor_what=(f"max(compute {fl[1]} ms, PCIe {fl[2]} ms: all weights streamed)"
                                    if fl else None),
                        ratio=float(m.group(5)), key=key))
    return figs


def json_lines(text):
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def parse_optim_step(text, step):
    """examples/optim_step.rs: its JSON summary line."""
    meta = step.get("meta", {})
    label = meta.get("label", step["name"])
    group = meta.get("group", GROUPS["optim-step"])
    figs = []
    for j in json_lines(text):
        if j.get("bench") != "strata-cpu-adamw":
            continue
        ms = j["step_s"] * 1e3
        figs.append(fig(f"{label}: fraction of the copy-bandwidth bound", j["fraction_of_bound"], "of bound",
                        group=group, target=target("≥ 0.70 of the bound", ">=", 0.70, "value"),
                        note=(f"step {ms:.2f} ms, bound {j['bound_s'] * 1e3:.2f} ms "
                              f"({j['bytes'] / 1e6:.0f} MB at {j['copy_gbps']:.1f} GB/s copy bandwidth); "
                              f"{j['fraction_of_update_bound']:.2f} of the in-place update bound")))
        figs.append(fig(f"{label}: step time", round(ms, 3), "ms", group=group,
                        key=meta.get("key"), peer_key=meta.get("peer_key"),
                        target=parse_target(meta.get("target"), meta.get("target_text"), "peer_ratio")))
    return figs


def parse_fused_attention(text, step):
    """examples/fused_attention.rs (one candidate kernel at one shape) and benches/peers/sdpa.py
    (torch's SDPA over every candidate's saved tensors): their JSON lines. A candidate's time and
    TFLOPS, forward and forward + backward, against torch's at the same shape (its key
    `sdpa:<seq>`); each candidate's largest error against the f32 reference, torch's own beside."""
    meta = step.get("meta", {})
    label = meta.get("label", step["name"])
    group = meta.get("group", GROUPS["fused-attention"])
    figs, timed = [], set()
    for j in json_lines(text):
        if j.get("bench") == "strata-fused-attention":
            figs.append(fig(f"{label}: forward + backward", round(j["fwd_bwd_ms"], 3), "ms", group=group,
                            key=meta.get("key"), peer_key=meta.get("peer_key"),
                            note=(f"forward {j['fwd_ms']:.3f} ms ({j['fwd_tflops']:.1f} TFLOPS), forward + "
                                  f"backward {j['fwd_bwd_tflops']:.1f} TFLOPS, on {j['device']}"
                                  + (f", kernel {j['kernel']}" if j.get("kernel") else ""))))
            figs.append(fig(f"{label}: forward + backward TFLOPS", round(j["fwd_bwd_tflops"], 2), "TFLOPS",
                            group=group, note="causal: 2 · b · h · s² · d multiply-adds forward, 2.5 times "
                                              "that backward (FlashAttention's count)"))
        elif j.get("peer") == "torch-sdpa":
            if "error" in j and "fwd_ms" not in j:
                figs.append(fig(label, None, "ms", group=group, verdict="not-run", note=j["error"]))
                continue
            shape = (j["seq"], j["heads"], j["kv_heads"], j["head_dim"], j.get("window"))
            if shape not in timed:
                timed.add(shape)
                figs.append(fig(f"torch scaled_dot_product_attention, seq {j['seq']}, {j['heads']} heads "
                                f"({j['kv_heads']} kv) of {j['head_dim']}, {j['dtype']}: forward + backward",
                                round(j["fwd_bwd_ms"], 3), "ms", group=group, key=f"sdpa:{j['seq']}",
                                note=f"forward {j['fwd_ms']:.3f} ms ({j['fwd_tflops']:.1f} TFLOPS), forward + "
                                     f"backward {j['fwd_bwd_tflops']:.1f} TFLOPS, on {j['device']}"))
            if "ref_err_o" not in j:  # an older sdpa.py: against torch only
                worst = max(j[f"err_{n}"] for n in ("o", "dq", "dk", "dv"))
                ref_note = ", ".join(f"{n} {j[f'err_{n}']:.2e}" for n in ("o", "dq", "dk", "dv"))
                what = "against torch"
            else:
                worst = max(j[f"ref_err_{n}"] for n in ("o", "dq", "dk", "dv"))
                ref_note = (", ".join(f"{n} {j[f'ref_err_{n}']:.2e}" for n in ("o", "dq", "dk", "dv"))
                            + "; torch in " + j["dtype"] + " against the reference: largest "
                            + f"{max(j[f'torch_ref_err_{n}'] for n in ('o', 'dq', 'dk', 'dv')):.2e}"
                            + "; against torch: largest "
                            + f"{max(j[f'err_{n}'] for n in ('o', 'dq', 'dk', 'dv')):.2e}")
                what = "against an f32 reference"
            tol = 2e-2 if j["dtype"] in ("bf16", "f16") else 1e-5
            figs.append(fig(f"{j.get('candidate', 'strata')}, seq {j['seq']} {j['dtype']}: largest error {what} "
                            f"(output and gradients, relative to the largest value)", worst, "relative",
                            group=group, target=target(f"≤ {tol:g}", "<=", tol, "value"),
                            verdict="failed" if "error" in j else None, note=ref_note))
    return figs


def parse_optim_peers(text, step):
    """benches/peers/optim_peers.py: its JSON line (cpu-adamw or train)."""
    figs = []
    for j in json_lines(text):
        if j.get("peer") == "torch-cpu-adamw":
            for v, r in j["variants"].items():
                name = f"torch CPU AdamW ({v}), {j['params']} parameters, {j['threads']} threads"
                if "error" in r:
                    figs.append(fig(name, None, "ms", group=GROUPS["optim-peers"], verdict="failed",
                                    note=r["error"], key=f"peer:cpu-adamw:{v}"))
                else:
                    figs.append(fig(name, round(r["step_s"] * 1e3, 3), "ms", group=GROUPS["optim-peers"],
                                    note=f"{r['fraction_of_bound']:.3f} of its copy bound",
                                    key=f"peer:cpu-adamw:{v}"))
        elif j.get("peer") == "torch-zero-offload-train":
            floor = max(x for x in (j.get("compute_ms"), j.get("pcie_ms")) if x is not None)
            figs.append(fig(f"PyTorch ZeRO-Offload-style step ({j['optimizer']} CPU AdamW), L={j['layers']} "
                            f"H={j['hidden']} rows {j['rows']}", j["step_ms"], "ms",
                            group=GROUPS["optim-peers"], floor=floor,
                            floor_what=f"max(compute {j.get('compute_ms')} ms, PCIe {j.get('pcie_ms')} ms)",
                            ratio=round(j["step_ms"] / floor, 3) if floor else None,
                            note=f"CPU AdamW alone {j.get('cpu_adamw_ms')} ms", key="peer:train:zero-offload"))
    return figs


BENCH_PATHS = ["h2d_pinned", "d2h_pinned", "bidir_pinned", "d2d", "kernel_read_hbm", "kernel_read_mapped",
               "managed_prefetch", "host_memcpy", "disk_read", "store_pinned_to_device",
               "store_device_to_pinned", "store_disk_to_device"]
BENCH_SIZES = [1 << 20, 16 << 20, 256 << 20, 1 << 30]


def short(size):
    for u in ("GiB", "MiB", "KiB"):
        if size >= UNITS[u] and size % UNITS[u] == 0:
            return f"{size // UNITS[u]} {u}"
    return f"{size} B"


def parse_strata_bench(text, step, base=None):
    """`strata bench --json FILE`: selected cells, the store/raw ratios and the zero-copy gather."""
    meta = step.get("meta", {})
    path = os.path.join(base or "", meta["json"])
    try:
        with open(path) as f:
            b = json.load(f)
    except (OSError, ValueError):
        return []
    cells = {(r["path"], r["size_bytes"]): r for r in b["results"]}
    sizes = [s for s in BENCH_SIZES if s in b["sizes_bytes"]] or b["sizes_bytes"][-2:]
    group = GROUPS["strata-bench"]
    figs = []
    for p in BENCH_PATHS:
        for s in sizes:
            if (p, s) in cells:  # 4 significant digits, as the bench's table prints 3
                figs.append(fig(f"{p}, {short(s)}", float(f"{cells[(p, s)]['gbps']:.4g}"), "GB/s", group=group,
                                row=p, col=short(s)))
    big = max(sizes)
    for r in b.get("ratios", []):
        if r["size_bytes"] == big:
            figs.append(fig(f"{r['store_path']} / {r['raw_path']}, {short(big)}", round(r["ratio"], 3), "x",
                            group="strata bench: store paths against the raw path they are made of",
                            row=f"{r['store_path']} / {r['raw_path']}", col=short(big)))
    for s in sizes:
        zc, h2d, hbm = (cells.get((p, s)) for p in ("gather_mapped", "h2d_pinned", "gather_hbm"))
        if zc and h2d and hbm:
            copy = (h2d["median_s"] + hbm["median_s"]) * 1e3
            figs.append(fig(f"sparse gather of 1% of the rows, zero-copy, {short(s)}",
                            round(zc["median_s"] * 1e3, 4), "ms",
                            group="strata bench: zero-copy gather against copying first",
                            peer=round(copy, 4), peer_what="h2d_pinned + gather_hbm (copy, then gather)",
                            ratio=round(zc["median_s"] * 1e3 / copy, 4)))
    return figs


def bench_table(text):
    """The table `strata bench` prints: {(path, size): GB/s}."""
    lines = text.splitlines()
    out = {}
    sizes = None
    for line in lines:
        if line.startswith("path ") and sizes is None:
            sizes = [int(size_bytes(s)) for s in re.findall(SIZE, line)]
            continue
        if sizes and re.match(r"^[a-z0-9_]+\s+" + NUM, line):
            name, *vals = line.split()
            for s, v in zip(sizes, vals):
                if v != "-":
                    out[(name, s)] = float(v)
        elif sizes and not line.strip():
            if out:
                break
    return out


def anchors_table(text):
    """transfer_anchors.py's output: {key: GB/s}, sizes in bytes for the copy table."""
    out = {}
    cols = None
    for line in text.splitlines():
        if re.match(r"^\s*size\s+H2D pin", line):
            cols = ["h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable", "d2d"]
            continue
        m = re.match(r"^\s*(\d+)\s+(" + NUM + r")\s+(" + NUM + r")\s+(" + NUM + r")\s+(" + NUM + r")\s+("
                     + NUM + r")\s*$", line)
        if cols and m:
            for c, v in zip(cols, m.groups()[1:]):
                out[(c, int(m.group(1)))] = float(v)
            continue
        for key, pat in [("bidir_pinned", r"^bidirectional 1GiB each way: (" + NUM + ") GB/s"),
                         ("kernel_read_hbm", r"^device HBM: (" + NUM + ") GB/s"),
                         ("kernel_read_mapped", r"^mapped host: (" + NUM + ") GB/s"),
                         ("managed_prefetch", r"^cudaMemPrefetchAsync 2GiB host->device: (" + NUM + ") GB/s"),
                         ("managed_faults", r"^UVM on-demand faults.*?: (" + NUM + ") GB/s")]:
            mm = re.match(pat, line)
            if mm:
                out[(key, None)] = float(mm.group(1))
    return out


ANCHOR_PAIRS = [  # strata bench path and size; the anchor's size (None: its one figure) and what it measured
    ("h2d_pinned", 256 << 20, 256 << 20, None), ("h2d_pinned", 1 << 30, 1 << 30, None),
    ("d2h_pinned", 256 << 20, 256 << 20, None), ("d2h_pinned", 1 << 30, 1 << 30, None),
    ("h2d_pageable", 256 << 20, 256 << 20, None), ("h2d_pageable", 1 << 30, 1 << 30, None),
    ("d2h_pageable", 256 << 20, 256 << 20, None), ("d2h_pageable", 1 << 30, 1 << 30, None),
    ("bidir_pinned", 1 << 30, None, "the anchor: 1 GiB each way"), ("d2d", 1 << 30, 1 << 30, None),
    ("kernel_read_hbm", 1 << 30, None, "the anchor's buffer size is not printed"),
    ("kernel_read_mapped", 1 << 30, None, "the anchor's buffer size is not printed"),
    ("managed_prefetch", 1 << 30, None, "the anchor: 2 GiB"), ("managed_faults", 1 << 30, None, "the anchor: 2 GiB"),
]


def parse_anchors(text, step, base=None):
    """strata bench's figures (meta bench=JSON file, or bench_text=its printed table) against
    transfer_anchors.py's (this step's log), within 5%."""
    meta = step.get("meta", {})
    if "json" in meta:
        try:
            with open(os.path.join(base or "", meta["json"])) as f:
                b = json.load(f)
        except (OSError, ValueError):
            return []
        bench = {(r["path"], r["size_bytes"]): r["gbps"] for r in b["results"]}
    else:
        with open(os.path.join(base or "", meta["bench_text"])) as f:
            bench = bench_table(f.read())
    anchors = anchors_table(text)
    figs = []
    for p, s, a, note in ANCHOR_PAIRS:
        if (p, s) not in bench or (p, a) not in anchors:
            continue
        v, peer = bench[(p, s)], anchors[(p, a)]
        figs.append(fig(f"{p}, {short(s)}", v, "GB/s", group=GROUPS["anchors"],
                        peer=peer, peer_what="transfer_anchors.py (PyTorch / CuPy)",
                        ratio=round(v / peer, 3), note=note,
                        target=target("within 5% of the anchor", "within", [0.95, 1.05])))
    return figs


# ------------------------------------------------------------------------------------------------
# The store core (`run core`): per-access cost, eviction at scale, a hit during a disk miss, a
# checkpoint of many small tensors.

BACKEND_LINE = re.compile(r"^(?:backend: )?((?:host|cuda)\b.*)$", re.M)
US = r"(?:us|µs)"


def backend_of(text):
    """The store's backend as the program printed it (`Store::backend_description`)."""
    m = BACKEND_LINE.search(text)
    return m.group(1).strip() if m else None


def parse_core_bench(text, step):
    """The bookkeeping bench's core ids: a device view hit + drop (≤ 1 µs of host time on the host
    backend, ≤ 3 µs on CUDA) and a read that evicts at 1k, 10k and 100k tensors (100k within 2x of
    1k: the victim comes from an index, so the count should not matter)."""
    figs = parse_criterion(text, step)
    skip = first(r"^SKIP (.*)$", text)
    if step.get("meta", {}).get("cuda") == "1" and skip and figs and not any("CUDA" in f["name"] for f in figs):
        # The CUDA id was asked for (on the GPU machine) and did not run: say why.
        figs.append(fig("device_view + drop (one resident 4 KiB tensor, CUDA)", None, "ns", verdict="failed",
                        note=skip.group(1)))
    evicting = {}
    for f in figs:
        f["group"] = GROUPS["core-bench"]
        name = f["name"]
        if name.startswith("device_view + drop") and f.get("value") is not None:
            # (parse_criterion has given the CUDA id its target and note already.)
            f["target"] = (cuda_view_target() if is_cuda_view(name)
                           else target("≤ 1 µs of host time (host backend)", "<=", 1000.0, "value"))
        m = re.match(r"read that evicts \(.*?, (\d+) tensors\)$", name)
        if m and f.get("value") is not None:
            evicting[int(m.group(1))] = f
            f.pop("target", None)
    base = evicting.get(min(evicting)) if evicting else None
    for n, f in sorted(evicting.items()):
        if f is base:
            continue
        f.update(peer=base["value"], peer_what=f"the same read among {min(evicting)} tensors",
                 ratio=round(f["value"] / base["value"], 3))
        if n >= 100 * min(evicting):
            f["target"] = target(f"within 2x of the read among {min(evicting)} tensors", "<=", 2.0)
    return figs


HIT_MISS = re.compile(r"^miss of a (\d+) MiB tensor on disk: (" + NUM + ") ms", re.M)
HIT_HITS = re.compile(r"^(\d+) device_view hits \+ drops on another thread meanwhile: median (" + NUM + ") "
                      + US + r", p99 (" + NUM + ") " + US + r", worst (" + NUM + ") ms", re.M)


def parse_hit_during_miss(text, step):
    """examples/hit_during_miss.rs: a miss of a large tensor on disk on one thread, device view
    hits of a resident tensor on another meanwhile (median and p99 under 1 ms)."""
    group = GROUPS["hit-during-miss"]
    backend = backend_of(text)
    on = f"backend: {backend}" if backend else None
    miss, hits = HIT_MISS.search(text), HIT_HITS.search(text)
    figs = []
    mib = miss.group(1) if miss else "?"
    if miss:
        figs.append(fig(f"the miss: {mib} MiB tensor on disk, read on one thread", float(miss.group(2)), "ms",
                        group=group, note=on))
    if hits:
        n = int(hits.group(1))
        what = f"a device_view hit + drop on another thread during the {mib} MiB miss"
        under = target("under 1 ms", "<=", 1000.0, "value")
        figs.append(fig(f"{what}: median", float(hits.group(2)), "µs", group=group, target=under,
                        note=f"{n} hits"))
        figs.append(fig(f"{what}: 99th percentile", float(hits.group(3)), "µs", group=group, target=under,
                        note=f"{n} hits"))
        figs.append(fig(f"{what}: worst", float(hits.group(4)), "ms", group=group,
                        note="as measured, no target: the worst of the hits includes the OS's scheduling "
                             "(on a 2-vCPU VM it is dominated by it)"))
    return figs


MANY_WROTE = re.compile(r"^wrote (\d+) tensors of (\d+) B in (" + NUM + ") s", re.M)
MANY_LOADED = re.compile(r"^loaded (\d+) tensors in place in (" + NUM + ") s", re.M)
MANY_PASS = re.compile(r"^read every tensor \(pass (\d+)\) in (" + NUM + r") s: (" + NUM + ") " + US
                       + " a read", re.M)
# "load + one read pass finishes in seconds"
IN_SECONDS = 10.0


def parse_many_tensors(text, step):
    """examples/many_tensors.rs: a safetensors file of N small tensors written, loaded in place
    into a store whose device holds a tenth of them, every tensor read twice; load + the first
    pass in seconds."""
    group = GROUPS["many-tensors"]
    backend = backend_of(text)
    wrote, loaded = MANY_WROTE.search(text), MANY_LOADED.search(text)
    passes = {int(m.group(1)): (float(m.group(2)), float(m.group(3))) for m in MANY_PASS.finditer(text)}
    n = (wrote or loaded).group(1) if (wrote or loaded) else "?"
    figs = []
    if wrote:
        figs.append(fig(f"write a safetensors file of {n} tensors of {wrote.group(2)} B", float(wrote.group(3)),
                        "s", group=group))
    if loaded:
        figs.append(fig(f"load its {loaded.group(1)} tensors in place (Store::load_safetensors)",
                        float(loaded.group(2)), "s", group=group,
                        note=f"backend: {backend}" if backend else None))
    for p, (secs, us) in sorted(passes.items()):
        figs.append(fig(f"read every tensor, pass {p}", secs, "s", group=group,
                        note=f"{us:g} µs a read (the device holds a tenth: each read promotes and evicts)"))
    if loaded and 1 in passes:
        total = round(float(loaded.group(2)) + passes[1][0], 3)
        figs.append(fig(f"load + read every tensor once ({n} tensors)", total, "s", group=group,
                        target=target(f"in seconds (≤ {IN_SECONDS:g} s)", "<=", IN_SECONDS, "value")))
    return figs


LOAD_CLI = re.compile(r"^loaded (\d+) tensors \((" + SIZE + r")\) in place in (" + NUM + ") ms", re.M)
LOAD_WALL = re.compile(r"^strata load: (" + NUM + ") s wall", re.M)


def parse_strata_load(text, step):
    """`strata load FILE` on the many-tensors checkpoint, timed whole (bash's `time`; the step's
    own time where the line is missing): the process, store and all, in seconds."""
    group = GROUPS["strata-load"]
    loaded, wall = LOAD_CLI.search(text), LOAD_WALL.search(text)
    secs = float(wall.group(1)) if wall else step.get("seconds")
    if not loaded or secs is None:
        return []
    backend = backend_of(text)
    notes = [f"of which the load itself: {float(loaded.group(3)):g} ms (as it prints)"]
    if not wall:
        notes.append("the step's time (no time line in the output)")
    if backend:
        notes.append(f"backend: {backend}")
    return [fig(f"strata load of the {loaded.group(1)}-tensor file, the whole process", secs, "s", group=group,
                target=target(f"in seconds (≤ {IN_SECONDS:g} s)", "<=", IN_SECONDS, "value"),
                note="; ".join(notes))]


EVS_CASE = re.compile(r"^(\d+) tensors: (.+?): median (" + NUM + ") " + US + "$", re.M)
EVS_WORK = re.compile(r"^workload: (\d+) tensors, (\d+) threads, (" + NUM + r") s: (\d+) operations \((\d+) "
                      r"refused[^)]*\), (" + NUM + ") operations/s", re.M)
# "fails within milliseconds"
FAIL_FAST_US = 10_000.0
# "thousands of operations a second"
WORKLOAD_OPS = 1000.0


def parse_eviction_scale(text, step):
    """examples/eviction_scale.rs: with Device and Pinned full of single-copy tensors, a hint, a
    layer scope and a device view that must spill at each count (the largest count, at least 100x
    the smallest, within 2x of it), a view that cannot get room failing with OutOfMemory (within
    milliseconds from 10k tensors), and a workload with hints and spills (thousands of operations
    a second)."""
    group = GROUPS["eviction-scale"]
    backend = backend_of(text)
    on = f"backend: {backend}" if backend else None
    cases = {}
    for m in EVS_CASE.finditer(text):
        cases.setdefault(m.group(2), {})[int(m.group(1))] = float(m.group(3))
    figs = []
    for case, by_n in cases.items():
        lo = min(by_n)
        failing = "cannot get room" in case
        for n, us in sorted(by_n.items()):
            f = fig(f"{case}, {n} tensors (median)", us, "µs", group=group, note=on)
            if failing and n >= 10_000:
                f["target"] = target("within milliseconds (≤ 10 ms)", "<=", FAIL_FAST_US, "value")
            elif not failing and n != lo:
                f.update(peer=by_n[lo], peer_what=f"the same among {lo} tensors", ratio=round(us / by_n[lo], 3))
                if n >= 100 * lo:
                    f["target"] = target(f"within 2x of {lo} tensors", "<=", 2.0)
            figs.append(f)
    w = EVS_WORK.search(text)
    if w:
        figs.append(fig(f"workload with hints and spills: {w.group(1)} tensors, {w.group(2)} threads",
                        float(w.group(6)), "ops/s", group=group,
                        target=target("thousands of operations a second (≥ 1000/s)", ">=", WORKLOAD_OPS, "value"),
                        note=f"{w.group(4)} operations in {w.group(3)} s, {w.group(5)} refused (out of memory or busy)"
                             + (f"; {on}" if on else "")))
    return figs


def parse_candle_train(text, step):
    """examples/candle_train.rs (strata::candle's Llama trainer, out of core or --in-memory): the
    median over the steps after the first of tokens/s and model TFLOPS, and the optimizer time
    hidden behind candle's compute (out of core)."""
    meta = step.get("meta", {})
    label = meta.get("label", step["name"])
    group = meta.get("group", GROUPS["candle-train"])
    rows = []
    for m in re.finditer(r"^step (\d+)/\d+: loss (" + NUM + r").*?(" + NUM + r") tokens/s\s+(" + NUM
                         + r") TFLOPS\s+(?:\((" + NUM + r") as 6 × parameters × tokens\)\s+)?\((" + NUM
                         + r") ms\)(.*)$", text, re.M):
        opt = re.search(r"optimizer (" + NUM + r") ms \(hidden (" + NUM + r"), exposed (" + NUM
                        + r")(?: = [^)]*)?\)", m.group(7))
        host = re.search(r"host (" + NUM + r") ms a block's micro-batch", m.group(7))
        rows.append((float(m.group(3)), float(m.group(4)), float(m.group(6)),
                     tuple(float(x) for x in opt.groups()) if opt else None,
                     float(m.group(5)) if m.group(5) else None,
                     float(host.group(1)) if host else None))
    if not rows:
        return []
    later = rows[1:] if len(rows) > 1 else rows
    tps = later_median([r[0] for r in rows])
    tflops = later_median([r[1] for r in rows])
    ms = later_median([r[2] for r in rows])
    loss = first(r"^(" + NUM + r")\s*$", text.rstrip().splitlines()[-1])
    note = f"median of steps 2-{len(rows)}: {ms:.1f} ms a step" + (
        f"; final loss {float(loss.group(1)):.6g}" if loss else "")
    # The kernel the blocks' attention was to run on (strata finetune prints it before its
    # steps), and after the first step what it ran on where cuDNN was asked.
    attn = first(r"^attention: (.*?)\s*$", text)
    ran = first(r"^attention ran: (.*?)\s*$", text)
    figs = [fig(f"{label}: tokens/s", tps, "tokens/s", group=group, note=note),
            fig(f"{label}: model TFLOPS", tflops, "TFLOPS", group=group, key=meta.get("key"),
                target=parse_target(meta.get("target"), meta.get("target_text"), of="value"),
                note="6 · parameters · tokens plus attention over the step time (the recomputed "
                     "forward not counted)" + (f"; attention: {attn.group(1)}" if attn else "")
                     + (f"; attention ran: {ran.group(1)}" if ran else ""))]
    six_n = [r[4] for r in rows if r[4] is not None]
    if len(six_n) == len(rows):
        figs.append(fig(f"{label}: TFLOPS as 6 × parameters × tokens", later_median(six_n), "TFLOPS",
                        group=group, note="MegaTrain's count (its paper reports 272 TFLOPS): every "
                                          "parameter, no attention, over the step time"))
    if meta.get("peer_key"):
        figs.append(fig(f"{label}: TFLOPS against {meta.get('peer_what', 'the resident blocks')}", tflops,
                        "TFLOPS", group=group, peer_key=meta.get("peer_key"),
                        target=parse_target(meta.get("peer_target"), of="peer_ratio")))
    if meta.get("beside_key"):  # a peer shown beside, no target
        figs.append(fig(f"{label}: TFLOPS against {meta.get('beside_what', 'another run')} (beside)", tflops,
                        "TFLOPS", group=group, peer_key=meta.get("beside_key")))
    floors = [(float(m.group(2)), m.group(1)) for m in re.finditer(
        r"^step \d+/\d+: .*\s{2}(\S.*?): step / floor (" + NUM + r")\s*$", text, re.M)]
    if floors and meta.get("beside_key"):  # out of core: how well its copies and optimizer hide
        later_f = floors[1:] if len(floors) > 1 else floors
        figs.append(fig(f"{label}: a step against its floor", later_median([f[0] for f in floors]),
                        "x the floor", group=group,
                        note=f"median of steps 2-{len(floors)}; the last step's floor: {later_f[-1][1]}"))
    opts = [(r[3], r[2]) for r in later if r[3]]
    if opts:
        busy = sum(o[0] for o, _ in opts)
        exposed = sum(o[2] for o, _ in opts)
        steps = sum(ms for _, ms in opts)
        figs.append(fig(f"{label}: optimizer time exposed", round(exposed / steps, 4) if steps else 0.0,
                        "of the step", group=group,
                        target=target("the optimizer hidden (≤ 5% of the step exposed)", "<=", 0.05, "value"),
                        note=f"{busy:.0f} ms of updates over steps 2-{len(rows)} ({steps:.0f} ms), "
                             f"{exposed:.0f} ms waited for"))
    hosts = [r[5] for r in later if r[5] is not None]
    if hosts:
        figs.append(fig(f"{label}: host time a block's micro-batch", later_median([r[5] for r in rows if r[5] is not None]), "ms",
                        group=group, note="the step's thread inside a block's forward, recompute and backward "
                                          "calls, over blocks × micro-batches: on CUDA its launch work (≤ 1 ms "
                                          "at the 7B shape is the target), on the CPU its compute"))
    return figs


def parse_candle_resident_twin(text, step):
    """examples/candle_train.rs --resident-twin: the resident twin's steps (`step` lines, read by
    parse_candle_train) and then the out-of-core trainer's on the same batches (`out of core step`
    lines) in one run, and the per-block throughput of out of core against resident."""
    meta = step.get("meta", {})
    label = meta.get("label", step["name"])
    group = meta.get("group", GROUPS["candle-train"])
    figs = parse_candle_train(text, step)
    for f in figs:  # the `step` lines are the resident twin's
        f["name"] = f["name"].replace(f"{label}: ", f"{label}: resident twin, ", 1)
    ooc = [float(m.group(1)) for m in re.finditer(
        r"^out of core step \d+/\d+: loss " + NUM + r".*?(" + NUM + r") tokens/s", text, re.M)]
    if ooc:
        figs.append(fig(f"{label}: out of core tokens/s", later_median(ooc), "tokens/s", group=group,
                        note=f"median of steps 2-{len(ooc)}, the same batches as the twin's"))
    floors = [float(m.group(1)) for m in re.finditer(
        r"^out of core step \d+/\d+: .*: step / floor (" + NUM + r")\s*$", text, re.M)]
    if floors:
        figs.append(fig(f"{label}: out of core, a step against its floor", later_median(floors),
                        "x max(compute, PCIe)", group=group,
                        target=parse_target(meta.get("floor_target"), meta.get("floor_target_text"),
                                            of="value"),
                        note=f"median of steps 2-{len(floors)}; the floor's compute is the out-of-core "
                             f"step's own (recompute included): how well its copies hide, not "
                             f"how it compares with the resident base (the per-block ratio)"))
    m = first(r"^per block .*: out of core / resident = (" + NUM + r")", text)
    if m:
        figs.append(fig(f"{label}: out of core / resident, per block", float(m.group(1)),
                        "of the resident twin's throughput", group=group,
                        target=parse_target(meta.get("ratio_target"), meta.get("ratio_target_text"),
                                            of="value")))
    return figs


def parse_candle_generate(text, step):
    """examples/candle_generate.rs: the batch's tokens/s, and its median new-token pass against
    the PCIe floor (the bytes that crossed into the Device tier a pass at the pinned-to-device
    bandwidth the example measured in the same run)."""
    meta = step.get("meta", {})
    label = meta.get("label", step["name"])
    group = meta.get("group", GROUPS["candle-generate"])
    m = first(r"^(?:batched|generated), batch (\d+): (\d+) new tokens in (" + NUM + r") s, (" + NUM
              + r") tokens/s", text)
    if not m:
        return []
    figs = [fig(f"{label}: tokens/s", float(m.group(4)), "tokens/s", group=group, key=meta.get("key"),
                note=f"batch {m.group(1)}: {m.group(2)} new tokens in {m.group(3)} s")]
    f = first(r"^PCIe floor of a token pass: (" + SIZE + r") into the Device tier a pass \((\d+) passes\), "
              r"at (" + NUM + r") GB/s.*?: (" + NUM + r") ms; the median new token's pass (" + NUM
              + r") ms: pass / floor = (" + NUM + r"); weights (" + SIZE + r"), (" + SIZE
              + r") of them resident beside the Device tier, beyond both (" + SIZE + r")", text)
    if f:
        figs.append(fig(f"{label}: a token pass against the PCIe floor", float(f.group(6)), "x the floor",
                        group=group,
                        target=parse_target(meta.get("target"), meta.get("target_text"), of="value"),
                        note=f"{f.group(5)} ms a pass, floor {f.group(4)} ms: {f.group(1)} a pass at "
                             f"{f.group(3)} GB/s (weights {f.group(7)}, {f.group(8)} resident beside the "
                             f"Device tier, {f.group(9)} beyond both: the least a pass moves); PCIe "
                             f"alone: above 1 where the batch's compute exceeds it"))
    return figs


def parse_twin(text, step):
    """benches/gpu/lease.py twin: out of core against in memory (every step's loss within a
    relative tolerance, or the same last line)."""
    meta = step.get("meta", {})
    label = meta.get("label", step["name"])
    m = first(r"^lease twin: losses of (\d+) steps, max relative difference (\S+) \(tolerance (\S+)\): (same|differ)$",
              text)
    if m:
        tol = float(m.group(3))
        return [fig(label, float(m.group(2)), "relative", group=GROUPS["twin"],
                    target=target(f"every step's loss within {tol:g} relative", "<=", tol, "value"),
                    note=f"{m.group(1)} steps compared")]
    m = first(r"^lease twin: last line: (.*): (same|differ)$", text)
    if m:
        return [fig(label, 0 if m.group(2) == "same" else 1, "lines that differ", group=GROUPS["twin"],
                    target=target("the same last line", "==", 0, "value"), note=m.group(1))]
    m = first(r"^lease twin: (.*)$", text)
    if m:
        return [fig(label, None, "", group=GROUPS["twin"], verdict="failed", note=m.group(1))]
    return []


PARSERS = {"libtest": parse_libtest, "sanitizer": parse_sanitizer, "criterion": parse_criterion,
           "store-bandwidth": parse_store_bandwidth, "layered": parse_layered, "mlp": parse_mlp,
           "train": parse_train, "fused-attention": parse_fused_attention,
           "offload-peers": parse_offload_peers, "optim-step": parse_optim_step,
           "optim-peers": parse_optim_peers, "strata-bench": parse_strata_bench, "anchors": parse_anchors,
           "core-bench": parse_core_bench, "hit-during-miss": parse_hit_during_miss,
           "many-tensors": parse_many_tensors, "strata-load": parse_strata_load,
           "eviction-scale": parse_eviction_scale, "candle-train": parse_candle_train, "twin": parse_twin,
           "candle-resident-twin": parse_candle_resident_twin, "candle-generate": parse_candle_generate}
NEEDS_BASE = {"strata-bench", "anchors"}
# The table a kind's figures go to, unless the step's meta names another.
GROUPS = {"libtest": "GPU test suite", "sanitizer": "compute-sanitizer",
          "criterion": "bookkeeping per access (criterion)",
          "store-bandwidth": "store transfers against raw driver copies",
          "layered": "out-of-core layer passes", "mlp": "out-of-core MLP",
          "train": "training with optimizer state in the store",
          "offload-peers": "peers (offload_peers.py)", "optim-step": "CPU AdamW step",
          "optim-peers": "peers (optim_peers.py)", "strata-bench": "strata bench (GB/s)",
          "anchors": "strata bench against transfer_anchors.py",
          "core-bench": "store core: a device view hit and a read that evicts, per access (criterion)",
          "hit-during-miss": "store core: a hit during another thread's disk miss",
          "many-tensors": "store core: a checkpoint of many small tensors",
          "strata-load": "store core: a checkpoint of many small tensors",
          "eviction-scale": "store core: making room when victims must spill, at scale",
          "candle-train": "training inside candle (a Llama-style decoder)",
          "candle-resident-twin": "training inside candle (a Llama-style decoder)",
          "candle-generate": "generation inside candle, out of core",
          "twin": "out of core against in memory",
          "fused-attention": "fused attention against PyTorch's SDPA"}


# ------------------------------------------------------------------------------------------------
# Building a report.


def check_verdict(steps, figs):
    """(verdict, reason) of a check from its steps and their figures: skipped when nothing ran
    (or every figure says it could not run here), timed-out when a step ran past its limit or the
    check's time box ended before a step, fail when a step failed or a figure missed its target,
    else pass."""
    def names(xs):
        return ", ".join(xs[:4]) + (f" and {len(xs) - 4} more" if len(xs) > 4 else "")
    ran = [s for s in steps if s["status"] != "not-run"]
    if not ran or (figs and all(f["verdict"] == "not-run" for f in figs)):
        why = []
        for x in [s.get("reason") for s in steps] + [f.get("note") for f in figs if f["verdict"] == "not-run"]:
            if x and x not in why:
                why.append(x)
        return "skipped", "; ".join(why) or "nothing ran"
    late = [s["name"] for s in steps if s["status"] == "timed-out"]
    cut = [s["name"] for s in steps if s["status"] == "not-run" and "time" in (s.get("reason") or "")]
    if late or cut:
        return "timed-out", "; ".join(x for x in [late and f"ran past its limit: {names(late)}",
                                                    cut and f"no time left for: {names(cut)}"] if x)
    failed = [f"{s['name']} (exit {s['rc']})" for s in steps if s["status"] == "failed"]
    bad = [f"{f['name']}: {f['verdict']}" + (f" ({f['value']} {f['unit']})" if f.get("value") is not None else "")
           for f in figs if f["verdict"] in ("failed", "missed", "timed-out")]
    if failed or bad:
        return "fail", "; ".join(x for x in [failed and f"failed: {names(failed)}",
                                             bad and f"{len(bad)} figure(s) not met: {names(bad)}"] if x)
    gpu_only = [s["name"] for s in steps if s["status"] == "not-run"]
    return "pass", (f"not run here: {names(gpu_only)}" if gpu_only else None)


def read_checks(path, steps, figs):
    """The checks file of `run lease` (a line a check, tab-separated: id, priority, title, box in
    seconds, seconds taken, why it came in this order, and for a check that did not start, why)
    -> the report's `checks`, each with its verdict from its steps and figures."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            cid, prio, title, box, secs, why, skip = line.rstrip("\n").split("\t")
            mine = [s for s in steps if s.get("meta", {}).get("check") == cid]
            names = {s["name"] for s in mine}
            if skip:
                verdict, reason = "skipped", skip
            else:
                verdict, reason = check_verdict(mine, [x for x in figs if x.get("step") in names])
            c = {"id": cid, "priority": int(prio), "title": title, "verdict": verdict, "reason": reason,
                 "box_s": int(box), "seconds": float(secs) if secs else None, "order": why,
                 "steps": [s["name"] for s in mine]}
            out.append(c)
    return out


def judge(f, status):
    """The figure's verdict from its target and the status of the step that made it."""
    if status in ("failed", "timed-out", "not-run"):
        return status
    if f.get("verdict"):
        return f["verdict"]
    if f.get("value") is None:
        return "failed"
    t = f.get("target")
    if not t:
        return "measured"
    x = f.get(t["of"])
    if x is None:
        return "measured"
    return "met" if OPS[t["op"]](x, t["value"]) else "missed"


def figures_of(step, base):
    """The step's figures from its log (relative to `base`), with command, log and verdict."""
    text = ""
    if step.get("log") and step["status"] != "not-run":
        try:
            with open(os.path.join(base, step["log"]), errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
    return figures_from_text(text, step, base)


def figures_from_text(text, step, base):
    """The step's figures from the text of its log; a placeholder figure when there are none."""
    figs = []
    status = step["status"]
    meta = step.get("meta", {})
    if status != "not-run" and text:
        parser = PARSERS[step["kind"]]
        try:
            figs = parser(text, step, base) if step["kind"] in NEEDS_BASE else parser(text, step)
        except Exception as e:  # a parser bug must not lose the report: say so in the figure
            figs = [fig(meta.get("label", step["name"]), None, "", verdict="failed",
                        note=f"report.py could not parse the log: {type(e).__name__}: {e}")]
    if not figs:
        why = {"not-run": step.get("reason") or "not run", "timed-out": f"ran past {step.get('timeout_s')} s",
               "failed": f"exit status {step.get('rc')}"}.get(status, "no figures in the log")
        figs = [fig(meta.get("label", step["name"]), None, "", note=why,
                    group=meta.get("group") or GROUPS.get(step["kind"], step["name"]))]
        if status == "ok":
            figs[0]["verdict"] = "failed"
    elif status in ("failed", "timed-out"):
        for f in figs:
            f["note"] = "; ".join(x for x in [f.get("note"), f"the step {status}"] if x)
    for f in figs:
        f.setdefault("group", meta.get("group") or GROUPS.get(step["kind"], step["name"]))
        f["command"] = step["command"]
        f["log"] = step.get("log")
        f["step"] = step["name"]
        if meta.get("simulated") == "1":
            f["simulated"] = True
        f["verdict"] = judge(f, status)
    return figs


def link_peers(figs):
    """A figure with peer_key takes the value of the figure whose key it names as its peer."""
    keyed = {f["key"]: f for f in figs if f.get("key")}
    for f in figs:
        k = f.get("peer_key")
        p = keyed.get(k) if k else None
        if p is None or p.get("value") is None or f.get("value") is None:
            continue
        f["peer"], f["peer_what"] = p["value"], p["name"]
        f["peer_ratio"] = round(f["value"] / p["value"], 3)
        t = f.get("target")
        if t and t["of"] == "peer_ratio" and f["verdict"] in ("met", "missed", "measured"):
            f["verdict"] = "met" if OPS[t["op"]](f["peer_ratio"], t["value"]) else "missed"


def run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def meminfo_gib(key):
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def machine():
    """What ran: the GPU (nvidia-smi), the CPU, memory and kernel."""
    gpu = run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,pcie.link.gen.current,"
               "pcie.link.width.current", "--format=csv,noheader"])
    cpu = ""
    for line in run(["lscpu"]).splitlines():
        if line.startswith("Model name:"):
            cpu = line.split(":", 1)[1].strip()
    cores = os.cpu_count()
    mem = meminfo_gib("MemTotal")
    m = {"gpu": gpu.splitlines()[0] if gpu else None, "cpu": cpu or platform.processor() or None,
         "cores": cores, "memory_gib": round(mem, 1) if mem else None,
         "kernel": f"{platform.system()} {platform.release()} {platform.machine()}",
         "hostname": platform.node()}
    if m["gpu"]:
        g = [x.strip() for x in m["gpu"].split(",")]
        gpu_text = f"{g[0]} ({g[1]}, driver {g[2]}, PCIe Gen{g[3]} x{g[4]})" if len(g) == 5 else m["gpu"]
    else:
        gpu_text = "no GPU"
    m["description"] = f"{gpu_text}; {cores} cores {cpu}; {m['memory_gib']} GiB RAM; {m['kernel']}"
    m["name"] = m["gpu"].split(",")[0] if m["gpu"] else f"no GPU ({cores} cores {cpu})"
    return m


def read_commit(path):
    """The commit the binaries were built from: `run stage` writes .gpu/commit (the GPU machine
    has no .git); elsewhere git answers."""
    info = {}
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                if "=" in line:
                    k, v = line.strip().split("=", 1)
                    info[k] = v
    if not info.get("commit"):
        c = run(["git", "rev-parse", "--short=12", "HEAD"])
        if c:
            info["commit"] = c
            info["commit_date"] = run(["git", "show", "-s", "--format=%cI", "HEAD"])
            info["dirty"] = "1" if run(["git", "status", "--porcelain", "--untracked-files=no"]) else "0"
    return info


def make_report(stage, title, steps, figs, commit, date, machine_info, host=False, notes=(), budget=None,
                elapsed=None, checks=None, probe=None):
    """The report: the format benches/gpu/README.md documents (and `validate` checks)."""
    link_peers(figs)
    r = {
        "schema": SCHEMA,
        "stage": stage,
        "title": title,
        "commit": commit.get("commit", "unknown"),
        "commit_date": commit.get("commit_date"),
        "dirty": commit.get("dirty") == "1",
        "machine": machine_info,
        "date": date,
        "host": host,
        "simulated": bool(figs) and all(f.get("simulated") for f in figs),
        "budget_s": budget,
        "elapsed_s": elapsed,
        "steps": [dict({k: s.get(k) for k in ("name", "kind", "command", "status", "rc", "seconds", "timeout_s",
                                              "log", "reason")},
                       **({"check": s["meta"]["check"]} if s.get("meta", {}).get("check") else {}))
                  for s in steps],
        "figures": figs,
        "notes": list(notes),
    }
    if checks is not None:
        r["checks"] = checks
    if probe is not None:
        r["probe"] = probe
    return r


def write_report(report, path):
    errors = validate(report, names=False)
    if errors:
        sys.exit(f"report.py: the report for {path} is invalid: " + "; ".join(errors))
    # Written all the same (a lease's figures are not lost for a label): `report.py check`, which
    # the run does next, and the import refuse it until the names are put right.
    for e in mislabels(report):
        print(f"report.py: {path}: {e}", file=sys.stderr)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
        f.write("\n")


def build(a):
    steps = read_steps(a.steps)
    figs = []
    for s in steps:
        figs.extend(figures_of(s, a.dir))
    date = a.date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    link_peers(figs)  # (before the checks are judged: a peer's ratio can miss its target)
    checks = read_checks(a.checks, steps, figs) if a.checks else None
    probe = None
    if a.probe and os.path.exists(a.probe):
        with open(a.probe) as f:
            probe = json.load(f)
    report = make_report(a.stage, a.title or f"benches/gpu/run {a.stage}" + (" --host" if a.host else ""),
                         steps, figs, read_commit(a.commit_file), date, machine(), a.host, a.note or [],
                         a.budget, a.elapsed, checks, probe)
    write_report(report, a.out)
    print_summary(report)


def validate(r, names=True):
    """Errors in a report (empty when it follows the format); names: with `mislabels`'s."""
    e = []
    if not isinstance(r, dict):
        return ["not a JSON object"]
    if r.get("schema") != SCHEMA:
        e.append(f"schema is {r.get('schema')!r}, not {SCHEMA!r}")
    for k, t in [("stage", str), ("title", str), ("commit", str), ("date", str), ("machine", dict),
                 ("host", bool), ("simulated", bool), ("figures", list), ("steps", list), ("notes", list)]:
        if not isinstance(r.get(k), t):
            e.append(f"{k} missing or not a {t.__name__}")
    if e:
        return e
    if not re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d(:\d\d)?Z$", r["date"]):
        e.append(f"date {r['date']!r} is not UTC ISO 8601 (YYYY-MM-DDTHH:MM[:SS]Z)")
    if not isinstance(r["machine"].get("description"), str):
        e.append("machine.description missing")
    for i, f in enumerate(r["figures"]):
        where = f"figure {i} ({f.get('name')!r})"
        for k, t in [("name", str), ("unit", str), ("command", str), ("verdict", str), ("group", str)]:
            if not isinstance(f.get(k), t):
                e.append(f"{where}: {k} missing or not a {t.__name__}")
        if f.get("verdict") not in VERDICTS:
            e.append(f"{where}: verdict {f.get('verdict')!r} not one of {VERDICTS}")
        v = f.get("value")
        if v is not None and not isinstance(v, (int, float)):
            e.append(f"{where}: value is not a number or null")
        if v is None and f.get("verdict") in ("met", "missed", "measured"):
            e.append(f"{where}: verdict {f['verdict']} without a value")
        for k in ("floor", "peer", "ratio", "peer_ratio"):
            if k in f and not isinstance(f[k], (int, float)):
                e.append(f"{where}: {k} is not a number")
        t = f.get("target")
        if t is not None:
            if not (isinstance(t, dict) and isinstance(t.get("text"), str) and t.get("op") in OPS
                    and t.get("of") in ("ratio", "value", "peer_ratio")):
                e.append(f"{where}: target needs text, op in {list(OPS)} and of in ratio/value/peer_ratio")
        if not isinstance(f.get("simulated", False), bool):
            e.append(f"{where}: simulated is not a boolean")
    for i, s in enumerate(r["steps"]):
        if s.get("status") not in STATUSES:
            e.append(f"step {i}: status {s.get('status')!r} not one of {STATUSES}")
    checks = r.get("checks")
    if checks is not None:
        if not isinstance(checks, list):
            return e + ["checks is not a list"]
        for i, c in enumerate(checks):
            if not (isinstance(c, dict) and isinstance(c.get("id"), str) and isinstance(c.get("title"), str)):
                e.append(f"check {i}: id and title needed")
            elif c.get("verdict") not in CHECK_VERDICTS:
                e.append(f"check {i} ({c['id']}): verdict {c.get('verdict')!r} not one of {CHECK_VERDICTS}")
            elif c["verdict"] != "pass" and not c.get("reason"):
                e.append(f"check {i} ({c['id']}): a verdict other than pass says why (reason)")
    if "probe" in r and not (isinstance(r["probe"], dict) and isinstance(r["probe"].get("libraries"), dict)):
        e.append("probe is not the object benches/gpu/probe.py writes")
    if names:
        e.extend(mislabels(r))
    return e


GPU_MODEL = re.compile(r"\b(?:NVIDIA )?((?:GH|GB)?[ABHL]\d{2,3}S?)\b")


def gpu_model(name):
    """H200, H100, A100 ... in a GPU's name (None without one)."""
    m = GPU_MODEL.search((name or "").upper())
    return m.group(1) if m else None


def mislabels(r):
    """A GPU run's measured figures (names, notes), title and notes naming another GPU than the
    one the run saw: an H200's figures must not read as an H100's. Simulated figures (which name
    the machine they model) and host runs are not judged."""
    if r.get("host") or not r["machine"].get("gpu"):
        return []
    ran = gpu_model(r["machine"]["gpu"])
    if ran is None:
        return []
    texts = [("title", r["title"])] + [(f"note {i}", n) for i, n in enumerate(r["notes"])]
    for f in r["figures"]:
        if not f.get("simulated"):
            texts += [(f"figure {f.get('name')!r}", f.get("name") or ""), (f"figure {f.get('name')!r}'s note", f.get("note") or "")]
    out = []
    for where, text in texts:
        for m in GPU_MODEL.finditer(str(text).upper()):
            if m.group(1) != ran:
                out.append(f"{where} names {m.group(1)} but the run was on {ran} ({r['machine']['gpu']})")
    return out


def print_summary(r):
    for c in r.get("checks") or []:
        secs = f" in {c['seconds']:.0f} s" if c.get("seconds") is not None else ""
        print(f"  check {c['id']}: {c['verdict']}{secs}" + (f" ({c['reason']})" if c.get("reason") else ""))
    counts = {}
    for f in r["figures"]:
        counts[f["verdict"]] = counts.get(f["verdict"], 0) + 1
    print(f"{r['title']}: {len(r['figures'])} figures: "
          + ", ".join(f"{counts[v]} {v}" for v in VERDICTS if v in counts))
    for f in r["figures"]:
        if f["verdict"] not in ("met", "measured"):
            v = "" if f.get("value") is None else f" = {f['value']} {f['unit']}"
            ratio = f" ({f['ratio']}x)" if f.get("ratio") is not None else ""
            t = f" target {f['target']['text']}" if f.get("target") else ""
            note = f" [{f['note']}]" if f.get("note") else ""
            print(f"  {f['verdict']:>9}: {f['name']}{v}{ratio}{t}{note}")


def read_steps(path):
    """The steps `run` recorded (see the module's doc for the line format)."""
    steps = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            name, kind, status, rc, secs, limit, log, reason, command, *meta = line.rstrip("\n").split("\t")
            if kind not in PARSERS or status not in STATUSES:
                sys.exit(f"report.py: {path}: step {name}: unknown kind {kind!r} or status {status!r}")
            steps.append({"name": name, "kind": kind, "status": status, "rc": int(rc) if rc else None,
                          "seconds": float(secs) if secs else None, "timeout_s": float(limit) if limit else None,
                          "log": log or None, "reason": reason or None, "command": command,
                          "meta": dict(kv.partition("=")[::2] for kv in meta)})
    return steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--stage", required=True)
    b.add_argument("--steps", required=True)
    b.add_argument("--dir", required=True, help="the folder the steps' log paths are relative to")
    b.add_argument("--out", required=True)
    b.add_argument("--host", action="store_true")
    b.add_argument("--budget", type=float)
    b.add_argument("--elapsed", type=float)
    b.add_argument("--commit-file")
    b.add_argument("--title")
    b.add_argument("--date", help="UTC ISO date of the run (default: now)")
    b.add_argument("--note", action="append")
    b.add_argument("--checks", help="run lease's checks file: the report gets each check's verdict")
    b.add_argument("--probe", help="benches/gpu/probe.py's findings (--json): the report's `probe`")
    c = sub.add_parser("check")
    c.add_argument("reports", nargs="+")
    s = sub.add_parser("summary")
    s.add_argument("report")
    a = ap.parse_args()
    if a.cmd == "build":
        build(a)
    elif a.cmd == "summary":
        with open(a.report) as f:
            print_summary(json.load(f))
    else:
        bad = False
        for p in a.reports:
            try:
                with open(p) as f:
                    errs = validate(json.load(f))
            except (OSError, ValueError) as e:
                errs = [str(e)]
            for x in errs:
                print(f"{p}: {x}", file=sys.stderr)
            bad = bad or bool(errs)
            if not errs:
                print(f"{p}: ok")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
