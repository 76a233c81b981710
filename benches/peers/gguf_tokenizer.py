"""Reference token ids of a GGUF file's tokenizer for a varied set of texts (code, unicode,
numbers, whitespace runs, special tokens, a chat-templated conversation), from up to three
tokenizers: llama.cpp's own (the file's meaning of `tokenizer.ggml.*`), transformers' GGUF
tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`), and a `tokenizer.json`
(the model's, or the one transformers wrote from the file). strata's tokenizer from the same
file is checked against them by `tests/candle/gguf_text.rs` (`a_real_gguf_tokenizer_*`).

    pip install torch transformers gguf tokenizers cffi
    python3 benches/peers/gguf_tokenizer.py FILE.gguf [TOKENIZER.json|-] OUT.json

llama.cpp: the CPU library of PyPI's `llama-cpp-cffi` wheel (0.4.42, `_llama_cpp_cpu*.so`) in
the directory `LLAMA_CPP_CFFI` names, used without its Python package:

    pip download llama-cpp-cffi==0.4.42 --no-deps --only-binary=:all: -d /tmp/lcb
    python3 -m zipfile -e /tmp/lcb/llama_cpp_cffi-*.whl /tmp/lcb/x
    mkdir /tmp/lcb/m && cp /tmp/lcb/x/llama/_llama_cpp_cpu*.so /tmp/lcb/m/
    # its libstdc++ is GCC 14's; on an older system, one missing symbol:
    printf '#include <exception>\\nextern "C" void __cxa_call_terminate(void*) noexcept { std::terminate(); }\\n' \\
        > /tmp/lcb/shim.cc && g++ -shared -fPIC -o /tmp/lcb/libshim.so /tmp/lcb/shim.cc
    LLAMA_CPP_CFFI=/tmp/lcb/m LD_PRELOAD=/tmp/lcb/libshim.so python3 benches/peers/gguf_tokenizer.py ...

Without it the llama.cpp column is left out. Each tokenizer encodes as strata's
`Tokenizer::encode(text, true)` does: the special tokens in the text matched whole, and the BOS
the file asks for added. OUT.json: {"file", "cases": [{"text", "llama_cpp", "transformers",
"tokenizer_json"}], "differ": {name: count of texts where it differs from llama.cpp}}.
"""

import json
import os
import sys

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!(\"{:?}\", v);\n}\n",
    "def f(x):\n\treturn x ** 2  # square\n",
    "<html><body class=\"a-b\">&nbsp;</body></html>",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name;",
    "12345 678.90 1,000,000 3.14159e-10 0x1F 2026-11-28",
    "a  1   22    333\t\t4\n\n\n5",
    "Zürich, Ελληνικά, русский, 東京タワー, 한국어, العربية, हिन्दी",
    "emoji 🦀🚀👍🏽 and flags 🇫🇷 and ZWJ 👩‍💻",
    "   leading, trailing and     runs of spaces   ",
    "tabs\tand\r\nwindows\rlines\n",
    "It's, I'm, we'll, they've, you'd, she's, DON'T, I'LL",
    "<|im_start|>user\nWhat is strata?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>text<|im_end|>",
    "<|im_start|> spaces around <|im_end|> ",
    "",
    " ",
    "\n",
]

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2? Answer in   one word."},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And in French? 🇫🇷"},
]


def llama_cpp(path, texts, add_special=True):
    """llama.cpp's tokens of each text (special tokens parsed; the BOS the file asks for with
    `add_special`), or None without the library (`LLAMA_CPP_CFFI`)."""
    where = os.environ.get("LLAMA_CPP_CFFI")
    if not where:
        return None
    sys.path.insert(0, where)
    from _llama_cpp_cpu import ffi, lib

    lib.llama_backend_init()
    p = lib.llama_model_default_params()
    p.vocab_only = True
    model = lib.llama_model_load_from_file(path.encode(), p)
    assert model != ffi.NULL, path
    vocab = lib.llama_model_get_vocab(model)
    out = []
    for t in texts:
        b = t.encode()
        n = 4 * len(b) + 16
        buf = ffi.new("llama_token[]", n)
        k = lib.llama_tokenize(vocab, b, len(b), buf, n, add_special, True)
        assert k >= 0
        out.append([buf[i] for i in range(k)])
    lib.llama_model_free(model)
    return out


def main():
    path, tok_json, out = sys.argv[1], sys.argv[2], sys.argv[3]
    from transformers import AutoTokenizer

    directory, name = os.path.split(os.path.abspath(path))
    tt = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    texts = list(TEXTS)
    if tt.chat_template:
        texts.append(tt.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))
    theirs = {"llama_cpp": llama_cpp(path, texts)}
    theirs["transformers"] = [tt(t, add_special_tokens=True)["input_ids"] for t in texts]
    if tok_json != "-":
        from tokenizers import Tokenizer

        tj = Tokenizer.from_file(tok_json)
        theirs["tokenizer_json"] = [tj.encode(t, add_special_tokens=True).ids for t in texts]
    cases = []
    for i, t in enumerate(texts):
        case = {"text": t}
        for k, v in theirs.items():
            if v is not None:
                case[k] = v[i]
        cases.append(case)
    differ = {}
    if theirs["llama_cpp"] is not None:
        for k, v in theirs.items():
            if k != "llama_cpp" and v is not None:
                bad = [t for t, a, b in zip(texts, v, theirs["llama_cpp"]) if a != b]
                differ[k] = len(bad)
                for t in bad:
                    print(f"{k} differs from llama.cpp on {t!r}")
    with open(out, "w") as f:
        json.dump({"file": path, "cases": cases, "differ": differ}, f, ensure_ascii=False, indent=1)
    print(f"{len(texts)} texts; differ from llama.cpp: {differ}")


if __name__ == "__main__":
    main()
