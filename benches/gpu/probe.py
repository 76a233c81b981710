#!/usr/bin/env python3
"""The GPU machine as the lease finds it, in a few seconds, before any check runs: the GPU
(nvidia-smi: name, driver, memory, clocks, PCIe link, compute capability), where each CUDA
library strata and candle load is found (the `nvidia/*/lib` folders of the Python packages,
PyTorch's CUDA 13 wheels among them, first: PyTorch runs with the same library path; then the
CUDA install, the driver's folder and the system's loader cache), cuDNN's and NCCL's, PyTorch's
version, and the free disk. From that it makes the library path the lease runs with: the folder
of each library chosen, and links under --links for the unversioned names cudarc opens
(`libnvrtc.so`, `libcublas.so`, `libcublasLt.so`) where only versioned files exist. Then each
staged program's libraries are looked up with that path (`ldd`): a program that would not start
is named with what it lacks.

  python3 benches/gpu/probe.py [--links DIR] [--bins DIR] [--json FILE] [--env FILE]

Prints what it found; --json writes it (the report's `probe`), --env writes
`export LD_LIBRARY_PATH=...` for the lease to source. Both, and the links, are written as soon
as the libraries are found, before nvidia-smi and ldd run (a probe killed by the lease's time
limit still leaves its library path), and again at the end. Never fails for what it does not
find (that is the finding); exits 2 on bad arguments only. Python 3 standard library only.
"""
import argparse
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

# The libraries, by the name after `lib`: what loads them, and the major version wanted first
# (the GPU machine's CUDA is 13; the driver's libcuda is .so.1; cuDNN 9; NCCL 2).
LIBS = [
    ("cuda", "the driver (strata, candle)", "1"),
    ("nvrtc", "strata's kernels, compiled at run time (cudarc opens libnvrtc.so)", "13"),
    ("cublas", "strata's GEMMs (cudarc opens libcublas.so); candle links it", "13"),
    ("cublasLt", "candle links it", "13"),
    ("cudart", "candle links it (and its libmoe)", "13"),
    ("curand", "candle links it", "13"),
    ("cudnn", "cuDNN: a fused SDPA candidate (PyTorch's wheel)", "9"),
    ("nccl", "NCCL: sharding over several GPUs (PyTorch's wheel)", "2"),
]
# Unversioned names cudarc dlopens (its candidates for the CUDA 12 API stop at .so.12).
UNVERSIONED = ("nvrtc", "cublas", "cublasLt")
GPU_FIELDS = ["name", "driver_version", "memory.total", "clocks.sm", "clocks.mem", "clocks.max.sm",
              "clocks.max.mem", "pcie.link.gen.current", "pcie.link.width.current", "compute_cap"]


def sh(cmd, timeout=3.0, env=None):
    """(exit status, standard output) of cmd; (None, why) when it cannot run in time."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError:
        return None, f"{cmd[0]}: not found"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cmd[0]}: {e}"
    return p.returncode, p.stdout


def gpu():
    """nvidia-smi's view of the first GPU, or why there is none."""
    rc, out = sh(["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"])
    if rc != 0 or not out.strip():
        return {"error": out.strip() if rc is None else f"nvidia-smi exited {rc}"}
    vals = [v.strip() for v in out.strip().splitlines()[0].split(",")]
    g = dict(zip(GPU_FIELDS, vals))
    g["count"] = len(out.strip().splitlines())
    return g


def short_name(name):
    """h100, h200, a100 ... from a GPU's name ('NVIDIA H200' -> 'h200'); None without one."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", (name or "").upper().replace("NVIDIA", ""))
    return m.group(1).lower() if m else None


def python_lib_dirs():
    """The `nvidia/*/lib` folders of the Python packages (site-packages of this python3, which on
    the GPU machine is the one with PyTorch), CUDA 13's `nvidia/cu13/lib` first."""
    roots = []
    for p in sys.path:
        if p and os.path.isdir(os.path.join(p, "nvidia")) and p not in roots:
            roots.append(p)
    out = []
    for r in roots:
        for d in [os.path.join(r, "nvidia", "cu13", "lib")] + sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
            if os.path.isdir(d) and d not in out:
                out.append(d)
    return out


# The CUDA install's folders, the driver's and the system's, in the order they are searched.
SYSTEM_DIRS = ("/usr/local/cuda-13*/targets/x86_64-linux/lib", "/usr/local/cuda-13*/lib64",
               "/usr/local/cuda/targets/x86_64-linux/lib", "/usr/local/cuda/lib64", "/usr/local/nvidia/lib64",
               "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64")


def search_dirs(python_dirs, system=SYSTEM_DIRS):
    """Where to look, in order: LD_LIBRARY_PATH, the Python packages' folders, then the CUDA 13
    install, the driver's folder and the system's. The packages' come before the install's: the
    library path made of this order is PyTorch's too, and PyTorch must load the CUDA libraries
    of its own wheels, not another minor version of CUDA 13 that the install may hold."""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += python_dirs
    for pat in system:
        dirs += sorted(glob.glob(pat), reverse=True)
    seen, out = set(), []
    for d in dirs:
        real = os.path.realpath(d)
        if os.path.isdir(d) and real not in seen:
            seen.add(real)
            out.append(d)
    return out


def ldconfig():
    """{file name: path} of the system loader's cache."""
    rc, out = sh(["ldconfig", "-p"])
    if rc is None:
        rc, out = sh(["/sbin/ldconfig", "-p"])
    cache = {}
    for line in (out or "").splitlines() if rc == 0 else []:
        m = re.match(r"\s*(\S+) \(.*\) => (\S+)", line)
        if m:
            cache.setdefault(m.group(1), m.group(2))
    return cache


def version_of(fname, lib):
    """(major, the version's numbers) of lib<lib>.so[.N[.M...]]: ((), ()) for the bare name."""
    m = re.fullmatch(rf"lib{re.escape(lib)}\.so((?:\.\d+)*)", fname)
    if not m:
        return None
    nums = tuple(int(x) for x in m.group(1).split(".") if x)
    return nums


def find(lib, want, dirs, cache):
    """Every file of lib found (folder order, then the loader's cache), and the one chosen: the
    wanted major version first, else the newest; a file in the first folder holding one wins."""
    files = []
    for d in dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in sorted(names):
            v = version_of(n, lib)
            if v is not None:
                files.append((os.path.join(d, n), v))
    for n, path in sorted(cache.items()):
        v = version_of(n, lib)
        if v is not None and all(os.path.realpath(path) != os.path.realpath(f) for f, _ in files):
            files.append((path, v))
    versioned = [(f, v) for f, v in files if v]
    wanted = [(f, v) for f, v in versioned if str(v[0]) == want]
    pick = wanted[0] if wanted else (max(versioned, key=lambda x: x[1]) if versioned else None)
    return {"found": [f for f, _ in files],
            "chosen": pick[0] if pick else None,
            "version": ".".join(map(str, pick[1])) if pick else None,
            "wanted_major": want,
            "major_ok": bool(wanted)}


def needed(binary, env):
    """ldd's view of a program under env: ({soname: path}, [sonames not found])."""
    rc, out = sh(["ldd", binary], timeout=3.0, env=env)
    if rc is None:
        return None, [out]
    found, missing = {}, []
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) => (not found|\S+)", line)
        if m:
            (missing.append(m.group(1)) if m.group(2) == "not found" else found.setdefault(m.group(1), m.group(2)))
    return found, missing


def write(r, json_path=None, env_path=None):
    """The findings so far to --json, and the library path to --env (each written whole, then
    renamed into place: a probe killed while writing leaves the earlier file)."""
    for path, text in ((json_path, lambda: json.dumps(r, indent=1) + "\n"),
                       (env_path, lambda: "export LD_LIBRARY_PATH=" + shlex.quote(r["ld_library_path"]) + "\n")):
        if path:
            with open(path + ".new", "w") as f:
                f.write(text())
            os.replace(path + ".new", path)


def probe(links=None, bins=None, json_path=None, env_path=None):
    """The findings. The library path and the links are written (json_path, env_path) as soon as
    the libraries are found, before nvidia-smi and ldd run: a probe cut short by its time limit
    still leaves the lease its library path."""
    t0 = time.monotonic()
    r = {"gpu": {"error": "not asked yet (the probe was cut short)"}, "gpu_short": None}
    pdirs = python_lib_dirs()
    dirs = search_dirs(pdirs)
    cache = ldconfig()
    r["searched"] = dirs + ["ldconfig -p"]
    r["libraries"] = {}
    for lib, why, want in LIBS:
        f = find(lib, want, dirs, cache)
        f["for"] = why
        r["libraries"][lib] = f
    # The path: the folder of each chosen library the loader would not find on its own, in the
    # order above; links for the unversioned names cudarc opens.
    path = []
    if links:
        os.makedirs(links, exist_ok=True)
        path.append(os.path.abspath(links))
    r["links"] = {}
    for lib, _, _ in LIBS:
        chosen = r["libraries"][lib]["chosen"]
        if not chosen:
            continue
        d = os.path.dirname(chosen)
        if lib == "cuda" and os.path.basename(chosen) in cache:
            continue  # the driver: the loader finds it (and a CUDA install's stub must not win)
        if d not in path:
            path.append(d)
        if links and lib in UNVERSIONED and not os.path.exists(os.path.join(d, f"lib{lib}.so")):
            dst = os.path.join(links, f"lib{lib}.so")
            try:
                if os.path.lexists(dst):
                    os.remove(dst)
                os.symlink(chosen, dst)
                r["links"][f"lib{lib}.so"] = chosen
            except OSError as e:
                r["links"][f"lib{lib}.so"] = f"could not link: {e}"
    old = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d and d not in path]
    r["ld_library_path"] = ":".join(path + old)
    r["seconds"] = round(time.monotonic() - t0, 2)
    write(r, json_path, env_path)
    r["gpu"] = gpu()
    r["gpu_short"] = short_name(r["gpu"].get("name"))
    # PyTorch's version without importing it (seconds): its package metadata.
    try:
        from importlib import metadata
        r["torch"] = metadata.version("torch")
    except Exception:  # noqa: BLE001  (no PyTorch, or metadata unreadable: that is the finding)
        r["torch"] = None
    r["disk"] = {}
    for p in ("/tmp", os.getcwd()):
        try:
            u = shutil.disk_usage(p)
            r["disk"][p] = {"free_gib": round(u.free / 2**30, 1), "total_gib": round(u.total / 2**30, 1)}
        except OSError as e:
            r["disk"][p] = {"error": str(e)}
    # The staged programs' libraries under that path: which would not start.
    r["programs"] = {}
    if bins and os.path.isdir(bins):
        env = dict(os.environ, LD_LIBRARY_PATH=r["ld_library_path"])
        progs = sorted(os.listdir(bins))
        # One of each build: the candle-cuda build's (cuda-*) and the plain build's share libraries.
        pick = [p for p in progs if p.startswith("cuda-")][:2] + [p for p in progs if not p.startswith("cuda-")][:1]
        for p in pick:
            if time.monotonic() - t0 > 3:  # the probe's few seconds are spent
                r["programs"][p] = {"cuda_libraries": {}, "missing": [], "not_checked": "the probe's time was spent"}
                continue
            found, missing = needed(os.path.join(bins, p), env)
            libs = {k: v for k, v in (found or {}).items() if re.match(r"lib(cu|nvrtc|nccl)", k)}
            r["programs"][p] = {"cuda_libraries": libs, "missing": missing}
    r["seconds"] = round(time.monotonic() - t0, 2)
    return r


def summary(r):
    g = r["gpu"]
    lines = []
    if "error" in g:
        lines.append(f"GPU: none ({g['error']})")
    else:
        lines.append(f"GPU: {g.get('name')} ({r['gpu_short'] or '?'}), driver {g.get('driver_version')}, "
                     f"{g.get('memory.total')} MiB, compute {g.get('compute_cap')}, SM clock {g.get('clocks.sm')} MHz "
                     f"(max {g.get('clocks.max.sm')}), memory clock {g.get('clocks.mem')} MHz (max "
                     f"{g.get('clocks.max.mem')}), PCIe Gen{g.get('pcie.link.gen.current')} "
                     f"x{g.get('pcie.link.width.current')}")
    for lib, f in r["libraries"].items():
        if f["chosen"]:
            ok = "" if f["major_ok"] else f" (no .so.{f['wanted_major']}: the newest taken)"
            lines.append(f"lib{lib}: {f['chosen']}{ok}; {len(f['found'])} file(s) found")
        else:
            lines.append(f"lib{lib}: not found ({f['for']})")
    for name, target in r["links"].items():
        lines.append(f"linked {name} -> {target}")
    lines.append(f"PyTorch: {r['torch'] or 'not installed'}")
    for p, d in r["disk"].items():
        lines.append(f"disk {p}: " + (f"{d['free_gib']} GiB free of {d['total_gib']}" if "free_gib" in d else d["error"]))
    for p, d in r["programs"].items():
        lines.append(f"{p}: " + (d["not_checked"] if d.get("not_checked") else
                                 f"cannot start: {', '.join(d['missing'])} not found" if d["missing"]
                                 else f"starts ({len(d['cuda_libraries'])} CUDA libraries resolved)"))
    lines.append(f"LD_LIBRARY_PATH={r['ld_library_path']}")
    lines.append(f"probe: {r['seconds']} s")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", help="a folder for the unversioned names cudarc opens")
    ap.add_argument("--bins", help="the staged programs, to check that they would start")
    ap.add_argument("--json", help="write the findings here")
    ap.add_argument("--env", help="write `export LD_LIBRARY_PATH=...` here")
    a = ap.parse_args()
    r = probe(a.links, a.bins, a.json, a.env)
    print("\n".join(summary(r)), flush=True)
    write(r, a.json, a.env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
