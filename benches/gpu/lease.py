#!/usr/bin/env python3
"""Two helpers of `benches/gpu/run lease`, each one step of a check (its output the step's log).

  lease.py tests [--threads N] -- BINARY [ARGS...]
      a libtest binary with N test threads; the tests that fail are run again, alone, one thread
      (a test that fails beside others but passes alone is a finding too: the summary names it).
      Last line: `lease tests: P passed, F failed, I ignored; parallel-only failures: NAMES`.
      Exit status 0 when every test passed (alone, where it was run again), else 1.
  lease.py twin (--losses TOL | --last-line) [--labels A,B] -- COMMAND_A... :: COMMAND_B...
      runs two commands that should agree (out of core against in memory) and compares
      --losses: every `step i/N: loss X` line, relative difference ≤ TOL;
      --last-line: the last line of standard output, exactly.
      Last line: `lease twin: ...: same` or `...: differ`. Exit status 0 same, 1 differ, 2 a
      command failed.

Python 3 standard library only (it runs on the GPU machine and in CI).
"""
import argparse
import re
import subprocess
import sys

RESULT = re.compile(r"^test result: (?:ok|FAILED)\. (\d+) passed; (\d+) failed; (\d+) ignored", re.M)
FAILED = re.compile(r"^test (\S+) \.\.\. FAILED$", re.M)
LOSS = re.compile(r"^step (\d+)/\d+: loss ([-+0-9.eE]+|nan|inf)", re.M)


def run(cmd):
    """Runs cmd, echoing its output; returns (exit status, the output)."""
    print("$ " + " ".join(cmd), flush=True)
    # Line by line as it comes: a command the step's `timeout` kills (a hang on a first GPU run)
    # leaves in the log what it printed before.
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    except OSError as e:
        print(f"lease.py: cannot run {cmd[0]}: {e}", flush=True)
        return 127, ""
    lines = []
    for line in p.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    return p.wait(), "".join(lines)


def counts(text):
    p = f = i = 0
    for m in RESULT.finditer(text):
        p, f, i = p + int(m.group(1)), f + int(m.group(2)), i + int(m.group(3))
    return p, f, i


def tests(a):
    rc, text = run(a.command + [f"--test-threads={a.threads}"])
    passed, failed, ignored = counts(text)
    names = FAILED.findall(text)
    only_parallel = []
    if rc != 0 and names and a.threads > 1:
        print(f"== {len(names)} failed with {a.threads} threads: again alone, one thread", flush=True)
        rc2, text2 = run(a.command + ["--test-threads=1", "--exact"] + names)
        p2, f2, _ = counts(text2)
        still = set(FAILED.findall(text2))
        only_parallel = [n for n in names if n not in still]
        passed, failed = passed + p2, len(still) if rc2 != 0 or still else 0
        if rc2 != 0 and not still:  # it failed without naming a test (a crash): keep the count
            failed = max(f2, 1)
        rc = rc2
    elif rc != 0 and not names:
        failed = max(failed, 1)  # a crash or a harness error: no test named
    print(f"lease tests: {passed} passed, {failed} failed, {ignored} ignored; parallel-only failures: "
          f"{', '.join(only_parallel) or 'none'}", flush=True)
    return 0 if rc == 0 and failed == 0 else 1


def rel(a, b):
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


def twin(a):
    if "::" not in a.command:
        sys.exit("lease.py twin: COMMAND_A :: COMMAND_B")
    k = a.command.index("::")
    cmds = [a.command[:k], a.command[k + 1:]]
    labels = (a.labels or "out of core,in memory").split(",")
    outs = []
    for label, cmd in zip(labels, cmds):
        print(f"== {label}", flush=True)
        rc, text = run(cmd)
        if rc != 0:
            print(f"lease twin: {label} exited {rc}: not compared", flush=True)
            return 2
        outs.append(text)
    if a.last_line:
        last = [(t.rstrip().splitlines() or [""])[-1] for t in outs]
        same = last[0] == last[1]
        print(f"lease twin: last line: {labels[0]} {last[0]!r}, {labels[1]} {last[1]!r}: "
              f"{'same' if same else 'differ'}", flush=True)
        return 0 if same else 1
    losses = [[(int(s), float(x)) for s, x in LOSS.findall(t)] for t in outs]
    if not losses[0] or [s for s, _ in losses[0]] != [s for s, _ in losses[1]]:
        print(f"lease twin: losses: steps differ ({len(losses[0])} against {len(losses[1])}): differ", flush=True)
        return 1
    worst = max(rel(x, y) for (_, x), (_, y) in zip(*losses))
    same = worst <= a.losses
    print(f"lease twin: losses of {len(losses[0])} steps, max relative difference {worst:.3g} "
          f"(tolerance {a.losses:g}): {'same' if same else 'differ'}", flush=True)
    return 0 if same else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tests")
    t.add_argument("--threads", type=int, default=4)
    t.add_argument("command", nargs=argparse.REMAINDER)
    w = sub.add_parser("twin")
    g = w.add_mutually_exclusive_group(required=True)
    g.add_argument("--losses", type=float, metavar="TOL")
    g.add_argument("--last-line", action="store_true")
    w.add_argument("--labels")
    w.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.command[:1] == ["--"]:
        a.command = a.command[1:]
    if not a.command:
        ap.error("no command")
    sys.exit(tests(a) if a.cmd == "tests" else twin(a))


if __name__ == "__main__":
    main()
