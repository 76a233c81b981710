#!/usr/bin/env python3
"""Independent check of `strata finetune` (strata::candle's out-of-core Llama trainer; it was
`examples/candle_train.rs`, same flags and output):
trains the same model from the same initial safetensors file on the same tokens with PyTorch
(Hugging Face transformers' `LlamaForCausalLM`, eager attention, where transformers is
installed; else a plain torch Llama written here from Hugging Face's modeling_llama) and
torch's `AdamW` (`foreach=False`), with the same schedule (linear warmup, cosine), clipping
(`clip_grad_norm_`) and loss (mean next-token cross-entropy, each micro-batch's divided by the
micro-batches), in float32 and in float64; then compares the per-step losses and the final
weights with the strata run's.

It shares no code with candle or strata. Float32 implementations do not agree bit for bit (the
order of every sum differs), so the figure is the size of the difference, beside the size of
torch float32's own difference from float64:
  loss: max |strata - torch| over the steps, relative to the loss;
  weights: the largest relative L2 difference over the tensors, ||a - b|| / ||b||;
  updates: the largest relative L2 difference of what training changed, over the tensors,
    ||dw_strata - dw_torch|| / ||dw_torch|| with dw = final - initial (fp32 masters for bf16
    weights), and the same over all the tensors at once ("whole"). The weights' figure is
    dominated by the initial weights both runs share; the updates' is not.

A bf16 run (`--dtype bf16`: the initial weights in the inputs are bf16) is compared with
PyTorch's mixed precision as it is used: fp32 parameters (the bf16 initial weights, exactly),
the forward and backward under `torch.autocast("cpu", dtype=torch.bfloat16)`, fp32 gradients and
AdamW; strata's updates are its fp32 masters' (read from the checkpoint's optimizer files). The
noise floor is bf16 itself: torch's autocast run against torch's float32 run from the same
weights, printed beside. Tolerances (exit 1 past them), strata against torch:
  float32: loss 1e-4 and weights 1e-4 (--tol), updates 1e-3 (--update-tol);
  bf16: loss 1e-3 (--bf16-loss-tol), and the whole update no further from autocast's than
    --bf16-factor (2) times autocast's own distance from float32 (bf16 rounding, which
    strata and autocast apply at different places, sets the size of both).

Usage (`strata finetune` writes the inputs and saves its final weights; from a checkout,
`cargo run --release -- finetune ...` runs the same command):
  strata finetune --config CONFIG \\
      --init random --seed 1 --steps 5 --device-budget 256KiB --write-inputs /tmp/in \\
      --save /tmp/out | tee /tmp/out.log
  python3 check_llama_train.py --inputs /tmp/in --result /tmp/out --log /tmp/out.log \\
      --steps 5 [--lr 1e-3 --min-lr 1e-4 --warmup 1 --weight-decay 0 --clip 1.0] [--tol 1e-4]
      [--f32-only]
It prints torch's float32 step times; --f32-only skips the float64 run (to time torch alone).
For a bf16 run, add `--dtype bf16` to `strata finetune`'s flags; the script sees it in the
inputs. The hyperparameters must be the run's (`strata finetune`'s defaults are the defaults
here: --warmup is steps / 5, --min-lr lr / 10). Exits 1 when a float32 difference exceeds --tol.
"""

import argparse
import json
import math
import os
import re
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def lr_at(step, peak, lo, warmup, total):
    """strata::candle::LrSchedule::lr."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - warmup, 0)
    if span == 0:
        return peak
    p = min((step - warmup) / span, 1.0)
    return lo + 0.5 * (peak - lo) * (1.0 + math.cos(math.pi * p))


class PlainLlama(torch.nn.Module):
    """Hugging Face's Llama (modeling_llama, eager attention) in plain torch, for machines without
    transformers."""

    def __init__(self, cfg, weights, dtype):
        super().__init__()
        self.cfg = cfg
        self.p = torch.nn.ParameterDict(
            {k.replace(".", "/"): torch.nn.Parameter(v.to(dtype).clone()) for k, v in weights.items()})

    def w(self, name):
        return self.p[name.replace(".", "/")]

    def norm(self, x, w):
        dt = x.dtype
        x = x.float() if dt != torch.float64 else x
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"])
        return w * x.to(dt)

    def forward(self, ids):
        c = self.cfg
        b, s = ids.shape
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        x = F.embedding(ids, self.w("model.embed_tokens.weight"))
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        freqs = torch.arange(s).float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)

        def rot(t):
            t1, t2 = t[..., : hd // 2], t[..., hd // 2:]
            return t * cos + torch.cat((-t2, t1), dim=-1) * sin

        mask = torch.full((s, s), float("-inf")).triu(1).to(x.dtype)
        for l in range(c["num_hidden_layers"]):
            p = f"model.layers.{l}."
            h = self.norm(x, self.w(p + "input_layernorm.weight"))
            q = (h @ self.w(p + "self_attn.q_proj.weight").T).view(b, s, nh, hd).transpose(1, 2)
            k = (h @ self.w(p + "self_attn.k_proj.weight").T).view(b, s, nkv, hd).transpose(1, 2)
            v = (h @ self.w(p + "self_attn.v_proj.weight").T).view(b, s, nkv, hd).transpose(1, 2)
            q, k = rot(q), rot(k)
            k = k.repeat_interleave(nh // nkv, dim=1)
            v = v.repeat_interleave(nh // nkv, dim=1)
            a = (q @ k.transpose(2, 3)) / math.sqrt(hd) + mask
            a = torch.softmax(a, dim=-1, dtype=torch.float32).to(q.dtype) if a.dtype != torch.float64 \
                else torch.softmax(a, dim=-1)
            o = (a @ v).transpose(1, 2).reshape(b, s, nh * hd)
            x = x + o @ self.w(p + "self_attn.o_proj.weight").T
            h = self.norm(x, self.w(p + "post_attention_layernorm.weight"))
            g = F.silu(h @ self.w(p + "mlp.gate_proj.weight").T) * (h @ self.w(p + "mlp.up_proj.weight").T)
            x = x + g @ self.w(p + "mlp.down_proj.weight").T
        x = self.norm(x, self.w("model.norm.weight"))
        head = self.w("model.embed_tokens.weight") if c.get("tie_word_embeddings") else self.w("lm_head.weight")
        return x @ head.T

    def named(self):
        return {k.replace("/", "."): v for k, v in self.p.items()}


def build(cfg, weights, dtype, plain):
    if not plain:
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError:
            plain = True
    if plain:
        return PlainLlama(cfg, weights, dtype), "plain torch (modeling_llama's ops)"
    import transformers
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    hf_cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(hf_cfg).to(dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.get("tie_word_embeddings"))]
    if missing or unexpected:
        sys.exit(f"the weights do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    if cfg.get("tie_word_embeddings"):
        model.tie_weights()
    return model, f"transformers {transformers.__version__} LlamaForCausalLM (eager attention)"


def train(cfg, init, tokens, a, dtype, plain, autocast=False):
    """Trains `a.steps` steps in `dtype` (with autocast: fp32 parameters, bf16 autocast)."""
    torch.manual_seed(0)
    model, what = build(cfg, init, dtype, plain)
    if autocast:
        what += ", bf16 autocast"
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=a.weight_decay, foreach=False)
    accum = tokens.shape[0] // a.steps
    losses, seconds = [], []
    for step in range(a.steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.lr, a.min_lr, a.warmup, a.steps)
        total = 0.0
        for m in range(accum):
            t = tokens[step * accum + m].long()
            ids, targets = t[:, :-1], t[:, 1:]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(ids)
            logits = out.logits if hasattr(out, "logits") else out
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(dtype), targets.reshape(-1)) / accum
            loss.backward()
            total += loss.item()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, a.clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
        seconds.append(time.perf_counter() - t0)
    named = model.named() if isinstance(model, PlainLlama) else dict(model.named_parameters())
    final = {}
    for name in init:
        key = name
        if key not in named and name == "lm_head.weight":
            key = "model.embed_tokens.weight"
        final[name] = named[key].detach().double()
    return losses, final, what, seconds


def strata_result(a):
    result = a.result
    if not os.path.exists(os.path.join(result, "model.safetensors.index.json")):
        # strata finetune's --save folder is a run directory: its newest step-N checkpoint.
        steps = sorted((int(d[5:]), d) for d in os.listdir(result) if d.startswith("step-") and d[5:].isdigit())
        if not steps:
            sys.exit(f"{result}: no checkpoint (model.safetensors.index.json or step-N/)")
        result = os.path.join(result, steps[-1][1])
    def tensors(index):
        files = set(json.load(open(os.path.join(result, index)))["weight_map"].values())
        out = {}
        for f in files:
            out.update({k: v.double() for k, v in load_file(os.path.join(result, f)).items()})
        return out

    out = tensors("model.safetensors.index.json")
    # bf16 weights train fp32 masters: those are what the updates are compared on.
    state = tensors("optimizer.safetensors.index.json")
    masters = {k: state[k + ".master"] for k in out if k + ".master" in state}
    losses = []
    for line in open(a.log):
        m = re.match(r"step (\d+)/\d+: loss ([-0-9.eE+]+)", line)
        if m:
            losses.append(float(m.group(2)))
    return losses, out, masters


def rel(a, b):
    return (a - b).norm().item() / max(b.norm().item(), 1e-30)


def diffs(losses, weights, ref_losses, ref_weights):
    dl = max(abs(x - y) / abs(y) for x, y in zip(losses, ref_losses))
    dw, worst = 0.0, ""
    for k, v in ref_weights.items():
        r = rel(weights[k], v)
        if r > dw:
            dw, worst = r, k
    return dl, dw, worst


def update_diffs(init, weights, ref_weights):
    """The updates' differences: the worst tensor's relative L2 (and its name), and all the
    tensors' at once."""
    worst, name, num, den = 0.0, "", 0.0, 0.0
    for k, v in ref_weights.items():
        du, ref = weights[k] - init[k].double(), v - init[k].double()
        r = rel(du, ref)
        num += (du - ref).pow(2).sum().item()
        den += ref.pow(2).sum().item()
        if r > worst:
            worst, name = r, k
    return worst, name, math.sqrt(num / max(den, 1e-300))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", required=True, help="strata finetune's --write-inputs folder")
    ap.add_argument("--result", required=True, help="strata finetune's --save folder (its newest checkpoint), or a checkpoint")
    ap.add_argument("--log", required=True, help="strata finetune's stdout")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--plain", action="store_true", help="plain torch even where transformers is installed")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--update-tol", type=float, default=1e-3,
                    help="float32: the worst tensor's update against torch's")
    ap.add_argument("--bf16-loss-tol", type=float, default=1e-3)
    ap.add_argument("--bf16-factor", type=float, default=2.0,
                    help="bf16: the whole update within this many times autocast's own distance from f32")
    ap.add_argument("--f32-only", action="store_true",
                    help="skip the float64 run (to time torch's float32 training alone)")
    a = ap.parse_args()
    if a.min_lr is None:
        a.min_lr = a.lr / 10
    if a.warmup is None:
        a.warmup = a.steps // 5
    torch.set_num_threads(max(os.cpu_count() or 1, 1))
    cfg = json.load(open(os.path.join(a.inputs, "config.json")))
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    init = load_file(os.path.join(a.inputs, "model.safetensors"))
    tokens = load_file(os.path.join(a.inputs, "tokens.safetensors"))["tokens"]
    if tokens.shape[0] % a.steps:
        sys.exit(f"tokens for {tokens.shape[0]} micro-batches do not split in {a.steps} steps")

    s_losses, s_weights, s_masters = strata_result(a)
    if len(s_losses) != a.steps:
        sys.exit(f"{a.log}: {len(s_losses)} step losses, {a.steps} expected")
    if any(v.dtype == torch.bfloat16 for v in init.values()):
        sys.exit(bf16_check(a, cfg, init, tokens, s_losses, s_masters))
    t32, w32, what, sec32 = train(cfg, {k: v.float() for k, v in init.items()}, tokens, a, torch.float32, a.plain)
    print(f"reference: {what}, torch {torch.__version__}, AdamW(foreach=False)")
    print(f"torch f32 step times ({torch.get_num_threads()} threads): "
          + ", ".join(f"{x * 1e3:.1f}" for x in sec32) + " ms")
    if a.f32_only:
        st = diffs(s_losses, s_weights, t32, w32)
        print(f"strata vs torch f32: loss rel {st[0]:.2e}, weights rel L2 {st[1]:.2e} (worst {st[2]})")
        sys.exit(0 if st[0] <= a.tol and st[1] <= a.tol else 1)
    t64, w64, _, _ = train(cfg, {k: v.double() for k, v in init.items()}, tokens, a, torch.float64, a.plain)
    for i, (s, x, y) in enumerate(zip(s_losses, t32, t64)):
        print(f"step {i + 1}: loss strata {s:.7f}  torch f32 {x:.7f}  torch f64 {y:.7f}")
    st = diffs(s_losses, s_weights, t32, w32)
    s64 = diffs(s_losses, s_weights, t64, w64)
    t_64 = diffs(t32, w32, t64, w64)
    print(f"strata vs torch f32: loss rel {st[0]:.2e}, weights rel L2 {st[1]:.2e} (worst {st[2]})")
    print(f"strata vs torch f64: loss rel {s64[0]:.2e}, weights rel L2 {s64[1]:.2e} (worst {s64[2]})")
    print(f"torch f32 vs torch f64: loss rel {t_64[0]:.2e}, weights rel L2 {t_64[1]:.2e} (worst {t_64[2]})")
    u32, u64, ut = (update_diffs(init, s_weights, w32), update_diffs(init, s_weights, w64),
                    update_diffs(init, w32, w64))
    for who, u in (("strata vs torch f32", u32), ("strata vs torch f64", u64), ("torch f32 vs torch f64", ut)):
        print(f"{who}: updates rel L2 worst {u[0]:.2e} ({u[1]}), whole {u[2]:.2e}")
    ok = st[0] <= a.tol and st[1] <= a.tol and u32[0] <= a.update_tol
    print(f"{'within' if ok else 'NOT within'} tolerance {a.tol:g} (loss, weights), {a.update_tol:g} "
          f"(updates) (strata vs torch f32)")
    sys.exit(0 if ok else 1)


def bf16_check(a, cfg, init, tokens, s_losses, s_masters):
    """strata's bf16 run against torch's bf16 autocast training and its float32 training from
    the same (bf16) initial weights; returns the exit status."""
    f32 = {k: v.float() for k, v in init.items()}
    if set(s_masters) != set(init):
        return f"{a.result}: fp32 masters for {len(s_masters)} of {len(init)} tensors (a bf16 run saves them all)"
    tb, wb, what, secb = train(cfg, f32, tokens, a, torch.float32, a.plain, autocast=True)
    t32, w32, _, _ = train(cfg, f32, tokens, a, torch.float32, a.plain)
    print(f"reference: {what}, torch {torch.__version__}, AdamW(foreach=False), fp32 parameters")
    print(f"torch bf16 autocast step times ({torch.get_num_threads()} threads): "
          + ", ".join(f"{x * 1e3:.1f}" for x in secb) + " ms")
    for i, (s, x, y) in enumerate(zip(s_losses, tb, t32)):
        print(f"step {i + 1}: loss strata bf16 {s:.6f}  torch autocast {x:.6f}  torch f32 {y:.6f}")
    lb = max(abs(x - y) / abs(y) for x, y in zip(s_losses, tb))
    l32 = max(abs(x - y) / abs(y) for x, y in zip(tb, t32))
    ub, u32, ut = (update_diffs(init, s_masters, wb), update_diffs(init, s_masters, w32),
                   update_diffs(init, wb, w32))
    print(f"strata bf16 vs torch autocast: loss rel {lb:.2e}; updates rel L2 worst {ub[0]:.2e} ({ub[1]}), whole {ub[2]:.2e}")
    print(f"strata bf16 vs torch f32: updates rel L2 worst {u32[0]:.2e} ({u32[1]}), whole {u32[2]:.2e}")
    print(f"torch autocast vs torch f32 (bf16's own size): loss rel {l32:.2e}; updates rel L2 worst {ut[0]:.2e} ({ut[1]}), whole {ut[2]:.2e}")
    ok = lb <= a.bf16_loss_tol and ub[2] <= a.bf16_factor * ut[2]
    print(f"{'within' if ok else 'NOT within'} tolerance: loss {a.bf16_loss_tol:g}, whole update "
          f"{a.bf16_factor:g} x autocast's own distance from f32 ({a.bf16_factor * ut[2]:.2e})")
    return 0 if ok else 1


if __name__ == "__main__":
    main()
