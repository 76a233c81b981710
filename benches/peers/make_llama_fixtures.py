"""Reference fixtures for strata's Llama-family config reader (tests/candle/configs.rs).

For each case, a tiny random model made and saved by Hugging Face transformers itself
(`save_pretrained`: its config.json as transformers writes it, model.safetensors), and the
logits transformers computes for a fixed prompt (float32, eager attention), in
tests/candle/fixtures/NAME/{config.json,model.safetensors,expected.json}. expected.json also
holds RoPE's inverse frequencies as transformers computes them.

    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install torch transformers safetensors
    /tmp/tv/bin/python benches/peers/make_llama_fixtures.py tests/candle/fixtures

Cases: a Llama with rope theta 100000 and tied embeddings (transformers 5 writes its theta in
`rope_parameters`), a Llama with Llama 3's rope scaling, a Qwen2 (q/k/v biases), a Mistral
whose head_dim is not hidden / heads.
"""

import json
import os
import sys

import torch
import transformers

PROMPT = [3, 14, 15, 9, 26, 5, 30, 1]
COMMON = dict(
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=32,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)


def cases():
    t = transformers
    yield "llama-theta", t.LlamaForCausalLM, t.LlamaConfig(
        **COMMON, rope_theta=100000.0, tie_word_embeddings=True
    )
    yield "llama3-rope", t.LlamaForCausalLM, t.LlamaConfig(
        **dict(COMMON, max_position_embeddings=1024),
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # With head_dim 8 and theta 500000 the wavelengths are 6.3, 167, 4443 and 118,000
            # positions: one kept, one smoothed, two divided by the factor.
            "original_max_position_embeddings": 256,
        },
    )
    yield "qwen2-bias", t.Qwen2ForCausalLM, t.Qwen2Config(
        **COMMON, rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False
    )
    mistral = dict(COMMON, num_attention_heads=2, head_dim=12)
    yield "mistral-head-dim", t.MistralForCausalLM, t.MistralConfig(
        **mistral, rope_theta=10000.0, sliding_window=None
    )


def main():
    out = sys.argv[1]
    for name, cls, config in cases():
        torch.manual_seed(len(name))
        config._attn_implementation = "eager"
        model = cls(config).eval()
        with torch.no_grad():
            # Random norms and biases too (transformers starts them at ones and zeros).
            for n, p in model.named_parameters():
                if p.dim() == 1:
                    p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in n else 0.0))
            logits = model(torch.tensor([PROMPT])).logits[0]
        d = os.path.join(out, name)
        model.save_pretrained(d, safe_serialization=True)
        for extra in ["generation_config.json"]:
            if os.path.exists(os.path.join(d, extra)):
                os.remove(os.path.join(d, extra))
        inv_freq = model.model.rotary_emb.inv_freq.tolist()
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump(
                {
                    "transformers": transformers.__version__,
                    "torch": torch.__version__,
                    "prompt": PROMPT,
                    "inv_freq": inv_freq,
                    "logits": logits.tolist(),
                },
                f,
            )
        print(name, "saved:", sorted(os.listdir(d)))


if __name__ == "__main__":
    main()
