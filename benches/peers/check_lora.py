#!/usr/bin/env python3
"""Independent check of LoRA in `strata finetune` (strata::candle's out-of-core trainer with
adapters over a frozen base; it was `examples/candle_train.rs`, same flags and output): trains
the same adapters with PyTorch + PEFT on the same base, tokens (and loss masks) and
hyperparameters, and compares the per-step losses and the final adapter weights with the strata run's; then loads the adapter strata wrote with
`PeftModel.from_pretrained` and compares its logits with the ones strata computed, and (with
--merged) loads strata's merged export with `LlamaForCausalLM.from_pretrained`.

The base is Hugging Face transformers' `LlamaForCausalLM` (eager attention), the adapters PEFT's
(`PeftModel.from_pretrained(base, inputs/adapter, is_trainable=True)`: the very initial adapters
strata started from, A Kaiming-uniform and B zero), the optimizer `torch.optim.AdamW(foreach=False)`
on the adapters only, with strata's schedule (linear warmup, cosine), clipping (`clip_grad_norm_`
over the adapters) and loss (the mean next-token cross-entropy over the step's counted targets).
It shares no code with candle or strata. Float32 runs do not agree bit for bit, so the figures
are the size of the difference, beside torch float32's own difference from float64:
  loss: max |strata - torch| / |torch| over the steps;
  adapters: the largest relative L2 difference over the adapter tensors, ||a - b|| / ||b||;
  logits: max |strata - PEFT| over the largest |PEFT| logit.
The adapters' tolerance is wider than the loss's (1e-3 against 1e-4): AdamW divides each gradient
by its own root mean square, so an element whose gradient is about AdamW's eps (1e-8) or below
takes a step that float32 rounding of that tiny gradient changes by a sizeable part of the
learning rate, and LoRA makes such elements: B starts at zero, so A's first gradients are tiny.
The script names the worst element and how far it is, beside the share of elements that agree.

Over a GGUF base (QLoRA: `strata finetune --model FILE.gguf ...`; --write-inputs then writes no
weights), give `--gguf FILE`: the base is transformers' float32 dequantization of the file
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.float32)`), which
dequantizes as the `gguf` package does, and so as strata does.

Usage (from a checkout, `cargo run --release -- finetune ...` runs the same command):
  strata finetune --config CONFIG \\
      --init random --seed 1 --steps 5 --device-budget 256KiB --lora-rank 4 --lora-alpha 8 \\
      --lora-targets q_proj,v_proj --write-inputs /tmp/in --save /tmp/out \\
      --export-merged /tmp/merged | tee /tmp/out.log
  python3 check_lora.py --inputs /tmp/in --result /tmp/out --log /tmp/out.log --steps 5 \\
      [--merged /tmp/merged] [--lr 1e-3 --min-lr 1e-4 --warmup 1 --weight-decay 0 --clip 1.0] \\
      [--tol 1e-4] [--adapter-tol 1e-3] [--logit-tol 1e-5] [--save-peft DIR]
With --save-peft DIR it saves PEFT's trained adapter (`save_pretrained`) and prints the loss of
the first step's batch through it: `strata finetune` with the same flags and `--adapter DIR`
(and no --lora-* flags: the adapter's config gives them) prints that loss at its step 1.
The hyperparameters must be the run's (`strata finetune`'s defaults are the defaults here).
Exits 1 when a float32 difference exceeds its tolerance (the adapters' also passes when strata's
are no farther from torch float64's than torch float32's are).
"""

import argparse
import json
import os
import re
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

# The schedule and the loss/weight differences, as check_llama_train.py figures them.
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_llama_train import diffs as full_diffs, lr_at  # noqa: E402


GGUF = None  # --gguf FILE: the base is this GGUF file, dequantized by transformers' loader


def base_model(inputs, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    if GGUF:
        from transformers import AutoModelForCausalLM
        directory, name = os.path.split(os.path.abspath(GGUF))
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                     attn_implementation="eager")
        return model.to(dtype)
    cfg = json.load(open(os.path.join(inputs, "config.json")))
    hf = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "strata_checkpoint")})
    hf._attn_implementation = "eager"
    model = LlamaForCausalLM(hf).to(dtype)
    weights = load_file(os.path.join(inputs, "model.safetensors"))
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.get("tie_word_embeddings"))]
    if missing or unexpected:
        sys.exit(f"the base does not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    if cfg.get("tie_word_embeddings"):
        model.tie_weights()
    return model


def adapters(model):
    """The adapter tensors by the names PEFT saves them under."""
    return {k.replace(".default", ""): v for k, v in model.named_parameters() if "lora_" in k}


def train(a, tokens, masks, dtype):
    from peft import PeftModel
    torch.manual_seed(0)
    model = PeftModel.from_pretrained(base_model(a.inputs, dtype), os.path.join(a.inputs, "adapter"),
                                      is_trainable=True)
    model = model.to(dtype)
    start = load_file(os.path.join(a.inputs, "adapter", "adapter_model.safetensors"))
    for k, v in adapters(model).items():
        if not torch.equal(v.detach().double(), start[k].double()):
            sys.exit(f"PEFT did not load the initial adapter {k} as written")
    params = [p for p in model.parameters() if p.requires_grad]
    frozen_before = {k: v.detach().clone() for k, v in model.named_parameters() if not v.requires_grad}
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=a.weight_decay, foreach=False)
    accum = tokens.shape[0] // a.steps
    losses, seconds = [], []
    for step in range(a.steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.lr, a.min_lr, a.warmup, a.steps)
        batch = range(step * accum, (step + 1) * accum)
        counted = sum(float(masks[i].sum()) for i in batch) if masks is not None else \
            float(accum * tokens.shape[1] * (tokens.shape[2] - 1))
        total = 0.0
        for i in batch:
            t = tokens[i].long()
            ids, targets = t[:, :-1], t[:, 1:]
            logits = model(input_ids=ids).logits.to(dtype)
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
            if masks is not None:
                ce = ce * masks[i].reshape(-1).to(dtype)
            loss = ce.sum() / counted
            loss.backward()
            total += loss.item()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, a.clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
        seconds.append(time.perf_counter() - t0)
    for k, v in model.named_parameters():
        if not v.requires_grad and not torch.equal(v, frozen_before[k]):
            sys.exit(f"PEFT changed the frozen {k}")
    if a.save_peft and dtype == torch.float32:
        # PEFT's own adapter, for strata to load (strata finetune --adapter DIR): the loss of the
        # first step's batch through it is what strata's first step must print.
        model.save_pretrained(a.save_peft)
        with torch.no_grad():
            total = 0.0
            counted = sum(float(masks[i].sum()) for i in range(accum)) if masks is not None else \
                float(accum * tokens.shape[1] * (tokens.shape[2] - 1))
            for i in range(accum):
                t = tokens[i].long()
                logits = model(input_ids=t[:, :-1]).logits
                ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1), reduction="none")
                if masks is not None:
                    ce = ce * masks[i].reshape(-1)
                total += (ce.sum() / counted).item()
        print(f"PEFT's trained adapter saved to {a.save_peft} (save_pretrained): the first step's batch "
              f"through it: loss {total:.6f}")
    return losses, {k: v.detach().double() for k, v in adapters(model).items()}, seconds


def newest(result):
    if os.path.exists(os.path.join(result, "adapter_model.safetensors")):
        return result
    steps = sorted((int(d[5:]), d) for d in os.listdir(result) if d.startswith("step-") and d[5:].isdigit())
    if not steps:
        sys.exit(f"{result}: no checkpoint (adapter_model.safetensors or step-N/)")
    return os.path.join(result, steps[-1][1])


def strata_result(a):
    ck = newest(a.result)
    out = {k: v.double() for k, v in load_file(os.path.join(ck, "adapter_model.safetensors")).items()}
    losses = []
    for line in open(a.log):
        m = re.match(r"step (\d+)/\d+: loss ([-0-9.eE+]+)", line)
        if m:
            losses.append(float(m.group(2)))
    return ck, losses, out


def diffs(losses, weights, ref_losses, ref_weights):
    if set(weights) != set(ref_weights):
        sys.exit(f"adapter names differ: {sorted(set(weights) ^ set(ref_weights))[:4]}")
    return full_diffs(losses, weights, ref_losses, ref_weights)


def logits_rel(got, want):
    return (got - want).abs().max().item() / want.abs().max().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", required=True, help="strata finetune's --write-inputs folder")
    ap.add_argument("--result", required=True, help="strata finetune's --save folder (its newest checkpoint)")
    ap.add_argument("--log", required=True, help="strata finetune's stdout")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--merged", help="strata finetune's --export-merged folder")
    ap.add_argument("--gguf", help="the run's base, a GGUF file (strata finetune --model FILE.gguf): "
                    "transformers' GGUF loader dequantizes it to float32")
    ap.add_argument("--save-peft", help="save PEFT's trained adapter there (for strata finetune --adapter)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--tol", type=float, default=1e-4, help="on the losses")
    ap.add_argument("--adapter-tol", type=float, default=1e-3, help="on the adapters' relative L2")
    ap.add_argument("--logit-tol", type=float, default=1e-5)
    a = ap.parse_args()
    global GGUF
    GGUF = a.gguf
    if a.min_lr is None:
        a.min_lr = a.lr / 10
    if a.warmup is None:
        a.warmup = a.steps // 5
    torch.set_num_threads(max(os.cpu_count() or 1, 1))
    import peft
    import transformers
    tokens = load_file(os.path.join(a.inputs, "tokens.safetensors"))["tokens"]
    mpath = os.path.join(a.inputs, "masks.safetensors")
    masks = load_file(mpath)["masks"] if os.path.exists(mpath) else None
    if tokens.shape[0] % a.steps:
        sys.exit(f"tokens for {tokens.shape[0]} micro-batches do not split in {a.steps} steps")
    ck, s_losses, s_adapters = strata_result(a)
    if len(s_losses) != a.steps:
        sys.exit(f"{a.log}: {len(s_losses)} step losses, {a.steps} expected")
    t32, w32, sec32 = train(a, tokens, masks, torch.float32)
    t64, w64, _ = train(a, tokens, masks, torch.float64)
    print(f"reference: transformers {transformers.__version__} LlamaForCausalLM (eager) + peft "
          f"{peft.__version__}, torch {torch.__version__}, AdamW(foreach=False) on the adapters"
          + (", loss masks" if masks is not None else ""))
    print("torch f32 step times: " + ", ".join(f"{x * 1e3:.1f}" for x in sec32) + " ms")
    for i, (s, x, y) in enumerate(zip(s_losses, t32, t64)):
        print(f"step {i + 1}: loss strata {s:.7f}  torch f32 {x:.7f}  torch f64 {y:.7f}")
    st = diffs(s_losses, s_adapters, t32, w32)
    s64 = diffs(s_losses, s_adapters, t64, w64)
    t_64 = diffs(t32, w32, t64, w64)
    print(f"strata vs torch f32: loss rel {st[0]:.2e}, adapters rel L2 {st[1]:.2e} (worst {st[2]})")
    print(f"strata vs torch f64: loss rel {s64[0]:.2e}, adapters rel L2 {s64[1]:.2e} (worst {s64[2]})")
    print(f"torch f32 vs torch f64: loss rel {t_64[0]:.2e}, adapters rel L2 {t_64[1]:.2e} (worst {t_64[2]})")
    k = st[2]
    d = (s_adapters[k] - w32[k]).abs()
    upd = (w32[k] - load_file(os.path.join(a.inputs, "adapter", "adapter_model.safetensors"))[k].double()).abs().max().item()
    close = sum(int(((s_adapters[n] - w32[n]).abs() <= 1e-2 * max(upd, 1e-30)).sum()) for n in w32)
    count = sum(v.numel() for v in w32.values())
    print(f"worst adapter element: {k}[{d.argmax().item()}] off by {d.max().item():.2e} (the tensor's largest "
          f"update {upd:.2e}); {close} of {count} adapter elements within 1% of that update")
    # The adapters agree when they are within --adapter-tol of torch f32's, or no farther from
    # torch f64's than torch f32's own are (float32 rounding, which AdamW's division by tiny
    # second moments amplifies, as the doc above says, can exceed the tolerance in both).
    adapters_ok = st[1] <= a.adapter_tol or s64[1] <= t_64[1]
    if st[1] > a.adapter_tol and adapters_ok:
        print(f"adapters: strata is {s64[1]:.2e} from torch f64, torch f32 {t_64[1]:.2e}: within float32's own "
              "difference")
    ok = st[0] <= a.tol and adapters_ok

    # strata's adapter in PyTorch: PeftModel.from_pretrained on the checkpoint directory.
    from peft import PeftModel
    ids = tokens[0][:, :-1].long()
    peft_model = PeftModel.from_pretrained(base_model(a.inputs, torch.float32), ck).eval()
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits.reshape(-1, peft_model.config.vocab_size)
    flog = os.path.join(a.inputs, "final_logits.safetensors")
    if os.path.exists(flog):
        got = load_file(flog)["logits"]
        r = logits_rel(got, want)
        print(f"strata's adapter in PeftModel.from_pretrained({os.path.basename(ck)}): logits vs strata's "
              f"{r:.2e} of the largest logit")
        ok = ok and r <= a.logit_tol
    # The first step's batch through strata's trained adapter in PEFT: the loss strata printed
    # for it ("the first step's batch through the trained model: loss X").
    said = [re.search(r"the first step's batch through the trained model: loss ([-0-9.eE+]+)", line)
            for line in open(a.log)]
    said = [float(m.group(1)) for m in said if m]
    if said:
        accum = tokens.shape[0] // a.steps
        counted = sum(float(masks[i].sum()) for i in range(accum)) if masks is not None else \
            float(accum * tokens.shape[1] * (tokens.shape[2] - 1))
        total = 0.0
        with torch.no_grad():
            for i in range(accum):
                t = tokens[i].long()
                logits = peft_model(input_ids=t[:, :-1]).logits
                ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1),
                                     reduction="none")
                if masks is not None:
                    ce = ce * masks[i].reshape(-1)
                total += (ce.sum() / counted).item()
        r = abs(said[0] - total) / abs(total)
        print(f"the first step's batch through strata's adapter: loss strata {said[0]:.6f}, PEFT "
              f"{total:.6f} (relative difference {r:.2e})")
        ok = ok and r <= a.tol
    if a.merged:
        from transformers import LlamaForCausalLM
        merged = LlamaForCausalLM.from_pretrained(a.merged, torch_dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        with torch.no_grad():
            got = merged(input_ids=ids).logits.reshape(want.shape)
        r = logits_rel(got, want)
        print(f"strata's merged export in LlamaForCausalLM.from_pretrained: logits vs PeftModel's {r:.2e} "
              "of the largest logit")
        ok = ok and r <= a.logit_tol
    print(f"{'within' if ok else 'NOT within'} tolerance (loss {a.tol:g}, adapters {a.adapter_tol:g}, "
          f"logits {a.logit_tol:g})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
