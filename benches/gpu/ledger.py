#!/usr/bin/env python3
"""The ledger of GPU debt, docs/bench/ledger.json: every check strata's GPU claims need, the paths
of the code each covers, and its runs on a GPU (date, commit, verdict, report).

  python3 benches/gpu/ledger.py status
      each check: its last GPU run, and whether its code changed since (git log over its paths)
  python3 benches/gpu/ledger.py plan [--only GLOBS] [--all]
      the lease's order, the debt that waited longest first (TSV: id, priority, box_s, class, why,
      title, programs, the older stage's steps it is made of);
      --only: check ids (shell globs, comma-separated); --all: the checks that need their own
      device call too
  python3 benches/gpu/ledger.py bins [--only GLOBS]
      the programs the lease's checks run (one a line, in the plan's order, each once; a check's
      `A|B` entry, either program, gives both)
  python3 benches/gpu/ledger.py config
      the lease's time (the ledger's `lease`) as shell assignments: budget_s=470 reserve_s=15 ...
  python3 benches/gpu/ledger.py cost --carried BYTES --tree BYTES
      what one lease call will spend: the bytes it carries, and its wall time with the machine's
      start (what `run prepare` prints)
  python3 benches/gpu/ledger.py import DIR [--into FOLDER] [--dry-run]
      what a device run brought back (DIR: its files_at, with report-*.json and *-logs.tar.gz):
      copied to docs/bench/<gpu>-<date>-lease/ (an older stage's: <gpu>-<date>/; or FOLDER), the
      archives unpacked, the ledger updated from each report's checks, docs/benchmarks.md rendered
      again. --dry-run: all of it in memory (the ledger and the page checked), nothing written. A
      report of a machine without a GPU (a host dry run) is read but never recorded
  python3 benches/gpu/ledger.py check
      validate the ledger (the dry run of `run --host lease` does), and that the time boxes of the
      decisive checks fit in the lease's budget less its headroom_s (a warning under 20 s)

The lease's order: the checks owed (never ran on a GPU, code changed since the last GPU run, or
that run did not pass) before those up to date; among them by priority (1: attention against
PyTorch's SDPA, 2: the 7B-shape step against the resident twins, 3: the CUDA test binaries: the
decisive checks, whose boxes must fit in the budget; 4: everything else), each lease a check sat
out raising it by one, but never above the decisive ones, so that successive leases cover
everything in turn; at equal priority, the never run first, then the oldest run. Python 3
standard library only (it runs on the GPU machine and in CI).
"""
import argparse
import copy
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report as rp  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LEDGER = os.path.join(ROOT, "docs", "bench", "ledger.json")
SCHEMA = "strata-gpu-ledger/1"
# A run's verdict (a report's check verdicts, benches/gpu/README.md).
VERDICTS = rp.CHECK_VERDICTS
NEVER, OWED, CURRENT = 0, 1, 2
# The ledger's `lease`: the one device call's time (seconds), and the priority up to which the
# checks are decisive (their boxes must fit; no other check is raised above them).
LEASE_KEYS = ("budget_s", "reserve_s", "setup_s", "start_s", "call_timeout_s", "decisive_priority")
# headroom_s (optional, 0 when absent): seconds of the budget the decisive checks' boxes leave
# free, for what no box counts (a killed step's --kill-after, the checks' own setup, a slow start).
HEADROOM_WANTED_S = 20  # (ledger.py check warns below it)
CLASS_TEXT = {NEVER: "never ran on a GPU", OWED: "owed", CURRENT: "up to date"}


def load(path=LEDGER):
    with open(path) as f:
        ledger = json.load(f)
    errs = validate(ledger)
    if errs:
        sys.exit(f"ledger.py: {os.path.relpath(path, ROOT)}: " + "; ".join(errs))
    return ledger


def save(ledger, path=LEDGER):
    errs = validate(ledger)
    if errs:
        sys.exit("ledger.py: refusing to write an invalid ledger: " + "; ".join(errs))
    with open(path, "w") as f:
        json.dump(ledger, f, indent=1, ensure_ascii=False)
        f.write("\n")


def validate(ledger):
    """Errors in a ledger (empty when it follows the format above)."""
    if not isinstance(ledger, dict) or ledger.get("schema") != SCHEMA:
        return [f"schema is not {SCHEMA!r}"]
    e, seen = [], set()
    for i, c in enumerate(ledger.get("checks") or []):
        where = f"check {i} ({c.get('id')!r})"
        for k, t in [("id", str), ("priority", int), ("title", str), ("lease", bool), ("box_s", int),
                     ("bins", list), ("paths", list), ("runs", list)]:
            if not isinstance(c.get(k), t):
                e.append(f"{where}: {k} missing or not a {t.__name__}")
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", str(c.get("id"))):
            e.append(f"{where}: an id is lower case letters, digits and dashes")
        if c.get("id") in seen:
            e.append(f"{where}: id given twice")
        seen.add(c.get("id"))
        if not c.get("lease") and not c.get("how"):
            e.append(f"{where}: a check outside the lease says how it runs (how)")
        old = c.get("old")
        if old is not None and not (isinstance(old, dict) and isinstance(old.get("stage"), str)
                                    and isinstance(old.get("steps"), list)):
            e.append(f"{where}: old needs stage and steps")
        for j, r in enumerate(c.get("runs") or []):
            if not isinstance(r, dict):
                e.append(f"{where}: run {j} is not an object")
                continue
            if r.get("verdict") not in VERDICTS:
                e.append(f"{where}: run {j}: verdict {r.get('verdict')!r} not one of {VERDICTS}")
            if not re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d(:\d\d)?Z$", str(r.get("date"))):
                e.append(f"{where}: run {j}: date {r.get('date')!r} is not UTC ISO 8601")
            if not isinstance(r.get("commit"), str):
                e.append(f"{where}: run {j}: commit missing")
    if not seen:
        e.append("no checks")
    lease = ledger.get("lease")
    if not isinstance(lease, dict) or not all(isinstance(lease.get(k), int) for k in LEASE_KEYS):
        e.append(f"lease needs the integers {', '.join(LEASE_KEYS)}")
    elif not isinstance(lease.get("headroom_s", 0), int) or lease.get("headroom_s", 0) < 0:
        e.append("lease: headroom_s is a whole number of seconds")
    for j, lease in enumerate(ledger.get("leases", [])):
        if not (isinstance(lease, dict) and re.match(r"^\d{4}-\d\d-\d\dT", str(lease.get("date")))):
            e.append(f"lease {j}: date missing")
    return e


def last_run(check):
    """The check's latest run on a GPU (skipped runs do not count), or None."""
    runs = [r for r in check["runs"] if r["verdict"] != "skipped"]
    return max(runs, key=lambda r: r["date"]) if runs else None


def git(*args):
    try:
        p = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return 1, str(e)
    return p.returncode, (p.stdout if p.returncode == 0 else p.stderr).strip()


def changed_since(check, run):
    """(commits, why): how many commits since the run's commit touched the check's paths; None
    when git cannot tell (no git, or a clone without that commit)."""
    rc, _ = git("cat-file", "-e", f"{run['commit']}^{{commit}}")
    if rc != 0:
        return None, f"git cannot tell: commit {run['commit']} is not in this clone"
    rc, out = git("rev-list", "--count", f"{run['commit']}..HEAD", "--", *check["paths"])
    if rc != 0:
        return None, f"git cannot tell: {out.splitlines()[-1] if out else 'git rev-list failed'}"
    return int(out), None


def standing(check):
    """(class, why, last run, commits changed or None): where the check stands in the debt."""
    run = last_run(check)
    if run is None:
        return NEVER, "never ran on a GPU", None, None
    n, unknown = changed_since(check, run)
    day = run["date"][:10]
    if unknown:
        return OWED, f"last ran {day} ({run['verdict']}); {unknown}", run, None
    if n:
        return OWED, f"last ran {day} ({run['verdict']}); {n} commit{'s' * (n != 1)} over its paths since", run, n
    if run["verdict"] != "pass":
        return OWED, f"last ran {day}: {run['verdict']}, code unchanged since", run, 0
    return CURRENT, f"passed {day}, code unchanged since", run, 0


def selected(check_id, only):
    return not only or any(fnmatch.fnmatchcase(check_id, g) for g in only.split(",") if g)


def waited(ledger, check):
    """The leases (device runs of `run lease`) since the check last ran on a GPU: each one it sat
    out raises its priority by one, so that successive leases cover every check in turn."""
    run = last_run(check)
    return sum(1 for lease in ledger.get("leases", []) if run is None or lease["date"] > run["date"])


def plan(ledger, only=None, everything=False):
    """[(check, class, why)] in the lease's order: the owed checks (never ran on a GPU, code changed
    since, or last run not a pass) before those up to date; by priority, raised by one for each
    lease a check sat out; then those that never ran first, then the oldest run first."""
    rows = []
    decisive = ledger["lease"]["decisive_priority"]
    for i, c in enumerate(ledger["checks"]):
        if not selected(c["id"], only) or not (c["lease"] or everything):
            continue
        cls, why, run, _ = standing(c)
        n = waited(ledger, c)
        # Raised by the leases it sat out, but never above the decisive checks.
        prio = c["priority"] if c["priority"] <= decisive else max(decisive + 1, c["priority"] - n)
        if n and cls != CURRENT:
            why += f"; sat out {n} lease{'s' * (n != 1)}" + (f" (priority {c['priority']} -> {prio})"
                                                            if prio != c["priority"] else "")
        key = (cls == CURRENT, prio, cls != NEVER, run["date"] if run else "", i)
        rows.append((key, c, cls, why))
    rows.sort(key=lambda r: r[0])
    return [(c, cls, why) for _, c, cls, why in rows]


def over_budget(ledger):
    """Why the decisive checks' time boxes do not fit in the lease (None when they do): the
    checks of priority decisive_priority or less, each in its box, must end within the budget
    less the reserve for the report, the setup (unpacking, the probe) and the headroom, so that
    the lease's order is what runs."""
    lease = ledger["lease"]
    room = decisive_room(lease)
    must = [c for c in ledger["checks"] if c["lease"] and c["priority"] <= lease["decisive_priority"]]
    total = sum(c["box_s"] for c in must)
    if total <= room:
        return None
    head = lease.get("headroom_s", 0)
    return (f"the decisive checks' boxes (priority <= {lease['decisive_priority']}: "
            + ", ".join(f"{c['id']} {c['box_s']} s" for c in must)
            + f") add up to {total} s, more than the {room} s the lease leaves them (budget "
            f"{lease['budget_s']} s less {lease['reserve_s']} s for the report, {lease['setup_s']} s "
            f"of setup" + (f" and {head} s of headroom" if head else "")
            + "): the last of them would never start, or start cut short")


def decisive_room(lease):
    """The seconds the decisive checks' boxes may add up to."""
    return lease["budget_s"] - lease["reserve_s"] - lease["setup_s"] - lease.get("headroom_s", 0)


def alternatives(entry):
    """A check's `bins` entry: `A|B` is either program (the first that is staged and starts)."""
    return entry.split("|")


def cost_lines(lease, carried, tree, limit=64 << 20):
    """What one lease call spends (`run prepare` prints it): the bytes it carries against the
    64 MiB a call takes, and its wall time, the machine's start included."""
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    total = carried + tree
    wall = lease["start_s"] + lease["budget_s"] + 10
    return [f"carried: .gpu-lease {mib(carried)} + the working tree {mib(tree)} = {mib(total)} "
            f"of the {mib(limit)} a call carries" + ("" if total <= limit else ": TOO MUCH"),
            f"the call: about {lease['start_s']} s to start a machine + the lease's {lease['budget_s']} s "
            f"(its report within {lease['budget_s'] + 10} s; timeout_s {lease['call_timeout_s']}) = about "
            f"{wall} s of the session's device time (15 minutes: a rerun needs 4 minutes left)"]


def missing_paths(check):
    """The check's plain paths that HEAD does not have (a move leaves the ledger behind)."""
    out = []
    for p in check["paths"]:
        if p.startswith(":"):
            continue
        rc, _ = git("cat-file", "-e", f"HEAD:{p.rstrip('/')}")
        if rc != 0:
            out.append(p)
    return out


# ------------------------------------------------------------------------------------------------
# Import of a device run's reports.


def gpu_short(report):
    """h100, h200, ... from the machine's GPU name (the folder's prefix)."""
    name = (report["machine"].get("gpu") or report["machine"].get("name") or "").upper()
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name.replace("NVIDIA", ""))
    return m.group(1).lower() if m else "gpu"


def report_checks(report, ledger):
    """{check id: (verdict, reason)} of a report: a lease report's `checks`; an older stage's report
    (tests, perf, scale, core, candle) through the ledger's `old` steps of each check."""
    if report.get("checks") is not None:
        return {c["id"]: (c["verdict"], c.get("reason")) for c in report["checks"]}
    out = {}
    for c in ledger["checks"]:
        old = c.get("old")
        if not old or old["stage"] != report["stage"]:
            continue
        names = {s["name"] for s in report["steps"]
                 if any(fnmatch.fnmatchcase(s["name"], g) for g in old["steps"])}
        if not names:
            continue
        steps = [s for s in report["steps"] if s["name"] in names]
        figs = [f for f in report["figures"] if f.get("step") in names]
        out[c["id"]] = rp.check_verdict(steps, figs)
    return out


def is_gpu_run(report):
    return not report.get("host") and bool(report["machine"].get("gpu"))


def apply_report(ledger, report, rel_path, host_too=False):
    """Adds the report's check verdicts to the ledger's runs; returns [(id, verdict, reason)]. A
    report of a machine without a GPU (a host dry run, `--host --full`) is never recorded
    (host_too: only to try the code, on a copy)."""
    if not is_gpu_run(report) and not host_too:
        return []
    by_id = {c["id"]: c for c in ledger["checks"]}
    done = []
    for cid, (verdict, reason) in report_checks(report, ledger).items():
        c = by_id.get(cid)
        if c is None:
            print(f"ledger.py: {rel_path}: check {cid} is not in the ledger: not recorded", file=sys.stderr)
            continue
        run = {"date": report["date"], "commit": report["commit"], "verdict": verdict,
               "machine": report["machine"].get("name") or report["machine"]["description"], "report": rel_path}
        if report.get("dirty"):
            run["dirty"] = True
        if reason:
            run["note"] = reason
        # The same report imported twice replaces its run.
        c["runs"] = [r for r in c["runs"] if not (r.get("report") == rel_path and r["date"] == run["date"])]
        c["runs"].append(run)
        c["runs"].sort(key=lambda r: r["date"])
        done.append((cid, verdict, reason))
    if report.get("checks") is not None:  # a lease: the checks it left out waited one more
        leases = [x for x in ledger.setdefault("leases", []) if x.get("report") != rel_path]
        leases.append({"date": report["date"], "commit": report["commit"], "report": rel_path})
        ledger["leases"] = sorted(leases, key=lambda x: x["date"])
    return done


def safe_extract(archive, dest):
    with tarfile.open(archive) as t:
        for m in t.getmembers():
            p = os.path.normpath(m.name)
            if p.startswith("..") or os.path.isabs(p) or not (m.isfile() or m.isdir()):
                sys.exit(f"ledger.py: {archive}: refusing member {m.name!r}")
        t.extractall(dest)


def do_import(a):
    src = os.path.abspath(a.dir)
    reports = sorted(f for f in os.listdir(src) if re.fullmatch(r"report-[A-Za-z0-9_.-]+\.json", f))
    if not reports:
        sys.exit(f"ledger.py: no report-*.json in {src}")
    loaded = []
    for name in reports:
        with open(os.path.join(src, name)) as f:
            r = json.load(f)
        errs = rp.validate(r)
        if errs:
            sys.exit(f"ledger.py: {name}: " + "; ".join(errs))
        loaded.append((name, r))
    first = min((r for _, r in loaded), key=lambda r: r["date"])
    gpu = any(is_gpu_run(r) for _, r in loaded)
    lease = "-lease" if any(r.get("checks") is not None for _, r in loaded) else ""
    into = a.into or os.path.join("docs", "bench", f"{gpu_short(first) if gpu else 'host'}-{first['date'][:10]}{lease}")
    dest = os.path.join(ROOT, into)
    ledger = load(a.ledger)
    updated = copy.deepcopy(ledger)
    for name, r in sorted(loaded, key=lambda x: x[1]["date"]):
        rel = os.path.join(into, name)
        done = apply_report(updated, r, rel, host_too=a.dry_run)
        if not is_gpu_run(r):
            print(f"{name}: no GPU ran it: the ledger records GPU runs only"
                  + (" (below: what a GPU run would record)" if a.dry_run else ""))
        for cid, verdict, reason in done:
            print(f"{name}: {cid}: {verdict}" + (f" ({reason})" if reason else ""))
    import render  # noqa: E402  (render imports this module)
    if a.dry_run:
        errs = validate(updated)
        if errs:
            sys.exit("ledger.py: the updated ledger would be invalid: " + "; ".join(errs))
        # The page renders with the new reports and the updated ledger (nothing is written).
        with tempfile.TemporaryDirectory() as tmp:
            for name, r in loaded:
                shutil.copy(os.path.join(src, name), tmp)
            for arc in os.listdir(src):
                if arc.endswith("-logs.tar.gz"):
                    safe_extract(os.path.join(src, arc), tmp)
            extra = []
            for name, _ in loaded:
                with open(os.path.join(tmp, name)) as f:
                    r = json.load(f)
                r["_dir"] = dest
                extra.append(r)
            render.render(render.load_reports() + extra, updated)
        print(f"dry run: would copy {len(loaded)} report(s) to {into}/ and record "
              f"{sum(len(c['runs']) for c in updated['checks']) - sum(len(c['runs']) for c in ledger['checks'])} run(s)")
        return
    os.makedirs(dest, exist_ok=True)
    for name, _ in loaded:
        shutil.copy(os.path.join(src, name), dest)
    for arc in sorted(os.listdir(src)):
        if arc.endswith("-logs.tar.gz"):
            safe_extract(os.path.join(src, arc), dest)
    save(updated, a.ledger)
    render.write()
    print(f"copied to {into}/; ledger and docs/benchmarks.md updated: "
          f"git add {into} {os.path.relpath(a.ledger, ROOT)} docs/benchmarks.md")


# ------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ledger", default=LEDGER)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status")
    p = sub.add_parser("plan")
    p.add_argument("--only")
    p.add_argument("--all", action="store_true")
    b = sub.add_parser("bins")
    b.add_argument("--only")
    i = sub.add_parser("import")
    i.add_argument("dir")
    i.add_argument("--into", help="the folder under the repository (default docs/bench/<gpu>-<date>-lease)")
    i.add_argument("--dry-run", action="store_true")
    sub.add_parser("check")
    sub.add_parser("config")
    k = sub.add_parser("cost")
    k.add_argument("--carried", type=int, required=True, help="bytes of .gpu-lease")
    k.add_argument("--tree", type=int, required=True, help="bytes of the working tree")
    a = ap.parse_args()
    if a.cmd == "import":
        do_import(a)
        return
    ledger = load(a.ledger)
    if a.cmd == "check":
        gone = [(c["id"], p) for c in ledger["checks"] for p in missing_paths(c)]
        for cid, p in gone:
            print(f"ledger.py: check {cid}: path {p} is not in HEAD (moved? update docs/bench/ledger.json)",
                  file=sys.stderr)
        print(f"{os.path.relpath(a.ledger, ROOT)}: {len(ledger['checks'])} checks, "
              f"{sum(len(c['runs']) for c in ledger['checks'])} GPU runs recorded")
        why = over_budget(ledger)
        if why:
            sys.exit(f"ledger.py: {why}")
        lease = ledger["lease"]
        must = sum(c["box_s"] for c in ledger["checks"]
                   if c["lease"] and c["priority"] <= lease["decisive_priority"])
        room = decisive_room(lease)
        print(f"the decisive checks' boxes: {must} s of the {room} s the lease leaves them "
              f"({lease.get('headroom_s', 0)} s of headroom beyond them)", flush=True)
        if lease.get("headroom_s", 0) < HEADROOM_WANTED_S:
            print(f"ledger.py: warning: the lease's headroom_s is {lease.get('headroom_s', 0)} s, under the "
                  f"{HEADROOM_WANTED_S} s a killed step's --kill-after and the checks' own setup take: a "
                  "decisive check may start cut short", file=sys.stderr)
    elif a.cmd == "plan":
        for c, cls, why in plan(ledger, a.only, a.all):
            old = c.get("old")
            print("\t".join([c["id"], str(c["priority"]), str(c["box_s"]), CLASS_TEXT[cls], why, c["title"],
                             ",".join(c["bins"]) or "-", f"{old['stage']}:{','.join(old['steps'])}" if old else "-"]))
    elif a.cmd == "bins":
        seen = []
        for c, _, _ in plan(ledger, a.only):
            for entry in c["bins"]:
                seen += [b for b in alternatives(entry) if b not in seen]
        print("\n".join(seen))
    elif a.cmd == "config":
        print(" ".join(f"{k}={ledger['lease'][k]}" for k in LEASE_KEYS))
    elif a.cmd == "cost":
        print("\n".join(cost_lines(ledger["lease"], a.carried, a.tree)))
    else:
        for c in ledger["checks"]:
            cls, why, _, _ = standing(c)
            lease = "" if c["lease"] else f"  [not in the lease: {c['how']}]"
            print(f"{c['id']:<24} P{c['priority']}  {CLASS_TEXT[cls]:<18} {why}{lease}")


if __name__ == "__main__":
    main()
