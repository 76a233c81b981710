#!/usr/bin/env python3
"""Issue 40's adversarial cases, rerun through the `strata` binary: each case must be refused
cleanly (exit status 1 or 2, an `error:` line, no panic, no abort) within its time box, and must
leave no output behind. Prints one line a case and a tally: cases, clean refusals, panics,
hangs, other.

    python3 benches/reliability/adversarial.py [path/to/strata]   # default target/debug/strata
"""
import json, os, subprocess, sys, tempfile

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
strata = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "target/debug/strata")
tiny = os.path.join(root, "examples/configs/tiny-llama.json")
d = tempfile.mkdtemp()
p = lambda n: os.path.join(d, n)

def run(args, timeout=30):
    try:
        r = subprocess.run([strata] + args, capture_output=True, timeout=timeout, cwd=d)
        return r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired:
        return None, "", ""

base = ["finetune", "--config", tiny, "--seq", "8", "--micro-batch", "1", "--accum", "1",
        "--steps", "2"]
# Fixtures: a file, a non-empty directory, another run's checkpoints, a FIFO, a tokenizer,
# a config of absurd positions, a chat template that loops, one whose output explodes.
open(p("a-file"), "w").write("x")
os.makedirs(p("full")); open(p("full/keep"), "w").write("mine")
assert run(base + ["--save", p("other")])[0] == 0
os.mkfifo(p("fifo"))
sys.path.insert(0, os.path.join(root, "tests"))
cfg = json.load(open(tiny)); cfg["vocab_size"] = 260
json.dump(cfg, open(p("config.json"), "w"))
big = dict(cfg, max_position_embeddings=2**62)
json.dump(big, open(p("huge-positions.json"), "w"))
# The byte tokenizer of tests/candle/text.rs, written by the test suite's helper through Python.
printable = lambda b: 33 <= b <= 126 or 161 <= b <= 172 or b >= 174
extra, alpha = 0, []
for b in range(256):
    if printable(b):
        alpha.append(chr(b))
    else:
        extra += 1; alpha.append(chr(255 + extra))
vocab = {"<|end|>": 0, "<|start|>": 1}
for i, c in enumerate(sorted(alpha)):
    vocab[c] = i + 2
vocab["he"] = len(vocab); vocab["Ġw"] = len(vocab)
bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
special = lambda i, s: {"id": i, "content": s, "single_word": False, "lstrip": False,
                        "rstrip": False, "normalized": False, "special": True}
tok = {"version": "1.0", "truncation": None, "padding": None,
       "added_tokens": [special(0, "<|end|>"), special(1, "<|start|>")], "normalizer": None,
       "pre_tokenizer": bl, "post_processor": None, "decoder": bl,
       "model": {"type": "BPE", "dropout": None, "unk_token": None,
                 "continuing_subword_prefix": None, "end_of_word_suffix": None,
                 "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                 "vocab": vocab, "merges": [["h", "e"], ["Ġ", "w"]]}}
for name, template in [("loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
                       ("explodes", "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}")]:
    os.makedirs(p(name))
    json.dump(tok, open(p(name + "/tokenizer.json"), "w"))
    json.dump({"chat_template": template, "eos_token": "<|end|>"},
              open(p(name + "/tokenizer_config.json"), "w"))
open(p("chat.jsonl"), "w").write(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": "yo"}]}) + "\n")
text = ["finetune", "--config", p("config.json"), "--seq", "8", "--micro-batch", "1",
        "--accum", "1", "--steps", "2"]
gen = ["generate", "--config", tiny, "--init", "random", "--prompt-tokens", "1,2"]
bad = os.fsencode(d) + b"/\xffmodel"
cases = [
    ("--save a file", base + ["--save", p("a-file")]),
    ("--save another run's directory", base + ["--save", p("other")]),
    ("--export-merged a non-empty directory", base + ["--lora-rank", "2", "--export-merged", p("full")]),
    ("--export-merged a file", base + ["--lora-rank", "2", "--export-merged", p("a-file")]),
    ("--write-inputs a file", base + ["--write-inputs", p("a-file")]),
    ("--text /dev/zero", text + ["--text", "/dev/zero", "--tokenizer", p("loops/tokenizer.json")]),
    ("--text a FIFO", text + ["--text", p("fifo"), "--tokenizer", p("loops/tokenizer.json")]),
    ("--jsonl /dev/zero", text + ["--jsonl", "/dev/zero", "--tokenizer", p("loops/tokenizer.json")]),
    ("--jsonl a FIFO", text + ["--jsonl", p("fifo"), "--tokenizer", p("loops/tokenizer.json")]),
    ("--jsonl, a template that loops", text + ["--jsonl", p("chat.jsonl"), "--tokenizer", p("loops/tokenizer.json")]),
    ("--jsonl, a template that explodes", text + ["--jsonl", p("chat.jsonl"), "--tokenizer", p("explodes/tokenizer.json")]),
    ("--lora-rank 2^56", base + ["--lora-rank", str(2**56)]),
    ("--lora-rank u64::MAX", base + ["--lora-rank", str(2**64 - 1)]),
    ("--lora-rank u64::MAX --plan-only", base + ["--lora-rank", str(2**64 - 1), "--plan-only"]),
    ("--accum u64::MAX", base + ["--accum", str(2**64 - 1)]),
    ("--micro-batch 1e8", base + ["--micro-batch", "100000000"]),
    ("--seq past the positions", base + ["--seq", "100000"]),
    ("huge positions, huge --max-new", ["generate", "--config", p("huge-positions.json"), "--init", "random",
                                        "--prompt-tokens", "1", "--max-new", str(2**62)]),
    ("--max-new past the positions", gen + ["--max-new", "100000"]),
    ("--resident 99 of 4 blocks", gen + ["--resident", "99"]),
    ("--prompt not UTF-8", gen[:5] + ["--prompt", b"\xff"]),
    ("--model a non-UTF-8 path", ["generate", "--model", bad, "--prompt-tokens", "1"]),
    ("finetune --model a non-UTF-8 path", ["finetune", "--model", bad]),
    ("--lr -1", base + ["--lr", "-1"]),
    ("--lr nan", base + ["--lr", "nan"]),
    ("--clip -1", base + ["--clip", "-1"]),
    ("--temperature -1", gen + ["--temperature", "-1"]),
    ("--top-p without a temperature", gen + ["--top-p", "0.5"]),
    ("a tokenizer larger than the vocabulary", ["generate", "--config", tiny, "--init", "random",
        "--tokenizer", p("loops/tokenizer.json"), "--prompt", "hi"]),
    ("--adapter not an adapter", gen + ["--adapter", p("full")]),
]
tally = {"clean": 0, "panic": 0, "hang": 0, "other": 0}
for name, args in cases:
    code, out, err = run(args)
    if code is None:
        kind = "hang"
    elif "panicked" in err or code < 0 or code > 2:
        kind = "panic"
    elif code in (1, 2) and "error" in err and not any(l.startswith("step ") for l in out.splitlines()):
        kind = "clean"
    else:
        kind = "other"
    tally[kind] += 1
    first = err.strip().splitlines()[0][:110] if err.strip() else ""
    print(f"{kind:5}  {name}: exit {code}: {first}")
assert open(p("full/keep")).read() == "mine"
print(f"{len(cases)} cases: {tally['clean']} clean refusals, {tally['panic']} panics, "
      f"{tally['hang']} hangs, {tally['other']} other")
sys.exit(0 if tally["clean"] == len(cases) else 1)
