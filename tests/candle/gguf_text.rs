//! The tokenizer a GGUF file carries (`tokenizer.ggml.*`): `tests/fixtures/tiny-gpt2.gguf`
//! (`gen_tiny_gpt2.py`: a byte-level BPE learnt by the `tokenizers` library, `pre` `smollm`)
//! and `tests/fixtures/tiny-spm.gguf` (`gen_tiny_spm.py`: a SentencePiece BPE) encode their
//! texts to the ids the generators wrote (llama.cpp's) and decode them back; its chat template renders ChatML; bad metadata
//! is a `GgufTokenizerError` naming the key. The real SmolLM2 file against `tokenizer.json`,
//! transformers and llama.cpp: `a_real_gguf_tokenizer_*`, ignored, with its command.

use std::path::{Path, PathBuf};

use strata::candle::text::{GgufText, GgufTokenizerError, Message, Tokenizer};
use strata::{Gguf, GgufValue};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-gpt2.gguf")
}

/// Encodes each `test.text.N` of the fixture `name` to its `test.ids.N` (what llama.cpp gives
/// it) and decodes the ids back to the text (special tokens kept, or, where `skip_special`,
/// left out); returns the tokenizer and how many texts it checked.
fn check_fixture(name: &str, skip_special: bool) -> (Tokenizer, usize) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    let f = Gguf::open(path).unwrap();
    let t = Tokenizer::from_gguf(&f).unwrap();
    let mut checked = 0;
    for i in 0.. {
        let Some(text) = f.get(&format!("test.text.{i}")) else { break };
        let text = text.as_str().unwrap();
        let want: Vec<u32> = f
            .get(&format!("test.ids.{i}"))
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let ids = t.encode(text, true).unwrap();
        assert_eq!(ids, want, "{name}: {text:?}");
        if !skip_special || !text.contains("<s>") {
            assert_eq!(t.decode(&ids, skip_special).unwrap(), text, "{name}: {text:?}");
        }
        checked += 1;
    }
    (t, checked)
}

#[test]
fn the_fixture_encodes_its_texts_to_the_reference_ids_and_back() {
    let (t, checked) = check_fixture("tiny-gpt2.gguf", false);
    assert_eq!((t.vocab_size(), checked), (400, 8));
    assert_eq!(t.encode("", true).unwrap(), Vec::<u32>::new());
    // Digits one a piece (the `smollm` split), special tokens whole, no BOS added.
    assert_eq!(t.encode("<|im_end|>", true).unwrap(), [2]);
    let ids = t.encode("1234", true).unwrap();
    assert_eq!(ids.len(), 4, "{ids:?}");
}

#[test]
fn a_sentencepiece_file_encodes_as_llama_cpp_does() {
    // `tiny-spm.gguf` (`gen_tiny_spm.py`): a SentencePiece BPE trained with Llama 2's settings,
    // written as llama.cpp's converter writes one, no merges; the ids llama.cpp gives.
    let (t, checked) = check_fixture("tiny-spm.gguf", true);
    assert_eq!((t.vocab_size(), checked), (600, 11));
    assert_eq!(t.encode("", true).unwrap(), [1], "a BOS, as llama.cpp adds it");
}

#[test]
fn the_fixture_has_its_chat_template_and_special_tokens() {
    let f = Gguf::open(fixture()).unwrap();
    let text = GgufText::read(&f).unwrap();
    assert_eq!((text.bos, text.eos, text.unk, text.pad), (Some(1), Some(2), Some(0), Some(2)));
    assert!(!text.add_bos && !text.add_eos);
    assert_eq!(text.stop_tokens(), [2]);
    let chat = text.chat_template().unwrap().unwrap();
    let s = chat.render(&[Message::new("user", "Hi")], true).unwrap();
    assert_eq!(
        s,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(chat.eos_token(), Some("<|im_end|>"));
    // The files a Hugging Face directory has, read back as strata reads a model's.
    let dir = tempfile::tempdir().unwrap();
    text.write_hf_files(dir.path()).unwrap();
    let back = Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    let t = text.tokenizer().unwrap();
    assert_eq!(back.encode(&s, true).unwrap(), t.encode(&s, true).unwrap());
    let eos = strata::candle::text::eos_tokens(dir.path(), &back).unwrap().unwrap();
    assert_eq!(eos.ids, [2]);
    let again = strata::candle::text::ChatTemplate::beside(dir.path().join("tokenizer.json"))
        .unwrap()
        .unwrap();
    assert_eq!(again.render(&[Message::new("user", "Hi")], true).unwrap(), s);
}

/// The fixture's bytes with metadata value `key` replaced: the file is parsed, the key's
/// value re-encoded, the rest copied (the tensors' data keeps its offsets relative to the
/// data section, which is realigned).
fn with_value(key: &str, value: Option<GgufValue>) -> PathBuf {
    let f = Gguf::open(fixture()).unwrap();
    let mut meta: Vec<(String, GgufValue)> =
        f.metadata().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    match (meta.iter().position(|(k, _)| k == key), value) {
        (Some(i), Some(v)) => meta[i].1 = v,
        (Some(i), None) => {
            meta.remove(i);
        }
        (None, Some(v)) => meta.push((key.to_string(), v)),
        (None, None) => {}
    }
    let dir = tempfile::tempdir().unwrap().keep();
    let path = dir.join("bad.gguf");
    std::fs::write(&path, write_gguf(&meta)).unwrap();
    path
}

/// A GGUF file of `meta` and no tensors.
fn write_gguf(meta: &[(String, GgufValue)]) -> Vec<u8> {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }
    fn type_of(v: &GgufValue) -> u32 {
        match v {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }
    fn value(out: &mut Vec<u8>, v: &GgufValue) {
        match v {
            GgufValue::U8(x) => out.push(*x),
            GgufValue::I8(x) => out.push(*x as u8),
            GgufValue::U16(x) => out.extend(x.to_le_bytes()),
            GgufValue::I16(x) => out.extend(x.to_le_bytes()),
            GgufValue::U32(x) => out.extend(x.to_le_bytes()),
            GgufValue::I32(x) => out.extend(x.to_le_bytes()),
            GgufValue::F32(x) => out.extend(x.to_le_bytes()),
            GgufValue::Bool(x) => out.push(u8::from(*x)),
            GgufValue::String(s) => string(out, s),
            GgufValue::Array(a) => {
                out.extend(a.first().map_or(4, type_of).to_le_bytes());
                out.extend((a.len() as u64).to_le_bytes());
                for x in a {
                    value(out, x);
                }
            }
            GgufValue::U64(x) => out.extend(x.to_le_bytes()),
            GgufValue::I64(x) => out.extend(x.to_le_bytes()),
            GgufValue::F64(x) => out.extend(x.to_le_bytes()),
        }
    }
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        string(&mut out, k);
        out.extend(type_of(v).to_le_bytes());
        value(&mut out, v);
    }
    out
}

fn error_of(path: &Path) -> String {
    let f = Gguf::open(path).unwrap();
    let e = GgufText::read(&f).unwrap_err();
    // The same error through the candle path, found again by its type.
    let c = Tokenizer::from_gguf(&f).unwrap_err();
    assert_eq!(GgufTokenizerError::find(&c).unwrap().key(), e.key());
    format!("{}: {e}", e.key())
}

fn strings(v: &[&str]) -> GgufValue {
    GgufValue::Array(v.iter().map(|s| GgufValue::String(s.to_string())).collect())
}

#[test]
fn bad_metadata_is_an_error_naming_the_key() {
    let cases: Vec<(&str, Option<GgufValue>, &str)> = vec![
        ("tokenizer.ggml.tokens", None, "missing"),
        ("tokenizer.ggml.tokens", Some(GgufValue::U32(3)), "not an array"),
        ("tokenizer.ggml.tokens", Some(strings(&[])), "empty"),
        ("tokenizer.ggml.token_type", Some(GgufValue::Array(vec![GgufValue::I32(1)])), "1 values"),
        ("tokenizer.ggml.merges", None, "needs its merges"),
        ("tokenizer.ggml.merges", Some(strings(&["nosuch token"])), "not in tokenizer.ggml.tokens"),
        ("tokenizer.ggml.merges", Some(strings(&["abc"])), "is not two tokens"),
        ("tokenizer.ggml.eos_token_id", Some(GgufValue::U32(400)), "past the 400 tokens"),
        ("tokenizer.ggml.bos_token_id", Some(GgufValue::String("1".into())), "not a token id"),
        ("tokenizer.ggml.add_bos_token", Some(GgufValue::U8(1)), "not a bool"),
        ("tokenizer.ggml.pre", None, "without a pre-tokenizer"),
        ("tokenizer.ggml.pre", Some(GgufValue::String("mystery".into())), "\"mystery\""),
        ("tokenizer.ggml.model", Some(GgufValue::String("bert".into())), "\"bert\""),
        ("tokenizer.ggml.model", None, "no tokenizer"),
        ("tokenizer.chat_template", Some(GgufValue::U32(1)), "not a string"),
    ];
    for (key, value, says) in cases {
        let e = error_of(&with_value(key, value));
        assert!(e.starts_with(key) && e.contains(says), "{key}: {e}");
    }
    // Tokens of another count than the types.
    let e = error_of(&with_value("tokenizer.ggml.tokens", Some(strings(&["a", "b"]))));
    assert!(
        e.starts_with("tokenizer.ggml.token_type: ") && e.contains("400 values for the 2"),
        "{e}"
    );
    // A token named twice.
    let f = Gguf::open(fixture()).unwrap();
    let mut tokens: Vec<GgufValue> =
        f.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap().to_vec();
    tokens[399] = tokens[398].clone();
    let e = error_of(&with_value("tokenizer.ggml.tokens", Some(GgufValue::Array(tokens))));
    assert!(e.contains("is both id 398 and id 399"), "{e}");
    // A BOS asked for with no BOS id.
    let mut meta: Vec<(String, GgufValue)> =
        f.metadata().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    meta.retain(|(k, _)| k != "tokenizer.ggml.bos_token_id");
    for (k, v) in meta.iter_mut() {
        if k == "tokenizer.ggml.add_bos_token" {
            *v = GgufValue::Bool(true);
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("nobos.gguf");
    std::fs::write(&p, write_gguf(&meta)).unwrap();
    let e = error_of(&p);
    assert!(e.starts_with("tokenizer.ggml.bos_token_id") && e.contains("add_bos_token"), "{e}");
}

#[test]
fn a_sentencepiece_vocabulary_ranks_its_merges_by_score() {
    // A `llama` file: byte tokens, pieces with scores, no merges in the file.
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let pieces = [
        "▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "▁hello", "▁w", "or",
        "▁wor", "▁world", "ld",
    ];
    // Longer pieces score higher: they are merged last, from the shorter ones.
    let scores_of = |p: &str| p.chars().count() as f32 - 10.0;
    let mut scores = vec![0.0f32; tokens.len()];
    for p in pieces {
        tokens.push(p.to_string());
        types.push(1);
        scores.push(scores_of(p));
    }
    let meta = vec![
        ("general.architecture".to_string(), GgufValue::String("llama".into())),
        ("tokenizer.ggml.model".into(), GgufValue::String("llama".into())),
        (
            "tokenizer.ggml.tokens".into(),
            GgufValue::Array(tokens.iter().map(|t| GgufValue::String(t.clone())).collect()),
        ),
        (
            "tokenizer.ggml.scores".into(),
            GgufValue::Array(scores.iter().map(|&s| GgufValue::F32(s)).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            GgufValue::Array(types.iter().map(|&t| GgufValue::I32(t)).collect()),
        ),
        ("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(2)),
        ("tokenizer.ggml.unknown_token_id".into(), GgufValue::U32(0)),
    ];
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("spm.gguf");
    std::fs::write(&p, write_gguf(&meta)).unwrap();
    let t = Tokenizer::from_gguf(&Gguf::open(&p).unwrap()).unwrap();
    let id = |s: &str| tokens.iter().position(|t| t == s).unwrap() as u32;
    // A BOS, a space before the text, the longest pieces, unknown bytes as byte tokens.
    let ids = t.encode("hello world!", true).unwrap();
    assert_eq!(ids, [1, id("▁hello"), id("▁world"), id("<0x21>")]);
    assert_eq!(t.decode(&ids, true).unwrap(), "hello world!");
    // After a special token the text gets its space again, as llama.cpp gives it.
    let ids = t.encode("hello</s>hello", false).unwrap();
    assert_eq!(ids, [id("▁hello"), 2, id("▁hello")]);
}

/// The real SmolLM2-135M-Instruct GGUF's tokenizer against the references
/// `benches/peers/gguf_tokenizer.py` wrote (llama.cpp's, transformers' GGUF tokenizer's, and
/// its `tokenizer.json`'s ids for each text):
///
/// ```sh
/// python3 benches/peers/gguf_tokenizer.py SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2/tokenizer.json /tmp/tok.json
/// STRATA_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf STRATA_GGUF_TOKENS=/tmp/tok.json \
///     cargo test --features text --test candle gguf_text::a_real -- --include-ignored --nocapture
/// ```
#[test]
#[ignore = "needs a real GGUF file and the references: STRATA_GGUF, STRATA_GGUF_TOKENS"]
fn a_real_gguf_tokenizer_equals_llama_cpp_and_transformers() {
    let (Some(path), Some(expect)) =
        (std::env::var_os("STRATA_GGUF"), std::env::var_os("STRATA_GGUF_TOKENS"))
    else {
        panic!("set STRATA_GGUF and STRATA_GGUF_TOKENS (the command is in this test's doc)");
    };
    let want: serde_json::Value = serde_json::from_slice(&std::fs::read(&expect).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Option<Vec<u32>> {
        Some(v.as_array()?.iter().map(|t| t.as_u64().unwrap() as u32).collect())
    };
    let t0 = std::time::Instant::now();
    let f = Gguf::open(&path).unwrap();
    let g = GgufText::read(&f).unwrap();
    let t = g.tokenizer().unwrap();
    println!("built in {:.2} s: {} tokens", t0.elapsed().as_secs_f64(), t.vocab_size());
    // A SentencePiece file puts a space before the text after a special token (as llama.cpp
    // does): such a text does not decode back as it was.
    let spm = f.get("tokenizer.ggml.model").and_then(GgufValue::as_str) == Some("llama");
    let special: Vec<&String> = (0..g.tokens.len())
        .filter(|&i| t.decode(&[i as u32], true).is_ok_and(|s| s.is_empty()))
        .map(|i| &g.tokens[i])
        .collect();
    let (mut same, mut cases, mut refs, mut back) = (0, 0, [0usize; 3], 0);
    for case in want["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let mine = t.encode(text, true).unwrap();
        cases += 1;
        let mut all = true;
        for (k, name) in ["llama_cpp", "transformers", "tokenizer_json"].iter().enumerate() {
            let Some(theirs) = ids(&case[name]) else { continue };
            refs[k] += 1;
            if theirs != mine {
                println!("{text:?}: strata {mine:?}, {name} {theirs:?}");
                if k == 0 {
                    all = false;
                }
            }
        }
        // The text back from its ids, less the BOS the tokenizer added.
        let body = if g.add_bos { &mine[1..] } else { &mine[..] };
        let decoded = t.decode(body, false).unwrap();
        if !(spm && special.iter().any(|s| text.contains(s.as_str()))) {
            assert_eq!(decoded, text, "{text:?} decodes back");
            back += 1;
        }
        same += usize::from(all);
    }
    println!(
        "{same} of {cases} texts as llama.cpp tokenizes them, {back} decoded back (references: \
         llama.cpp {}, transformers {}, tokenizer.json {})",
        refs[0], refs[1], refs[2]
    );
    assert!(refs[0] > 0, "no llama.cpp reference in {}", Path::new(&expect).display());
    assert_eq!(same, cases);
}
