//! The text side a GGUF file carries in its metadata (`tokenizer.ggml.*`,
//! `tokenizer.chat_template`), read as llama.cpp reads it and built into a Hugging Face
//! tokenizer ([`GgufText`]): the `tokenizer.json` that encodes as llama.cpp's tokenizer for the
//! same file does, its chat template, its special tokens.
//!
//! Two tokenizer kinds (`tokenizer.ggml.model`):
//! - `gpt2`: byte-level BPE (SmolLM2, Llama 3, Qwen2). The vocabulary and merges as the file
//!   gives them; the text split before the merges by the regular expressions llama.cpp uses
//!   for the file's `tokenizer.ggml.pre` (`llama-vocab.cpp`, `llm_tokenizer_bpe`), written as
//!   the model's own `tokenizer.json` writes them. A `pre` not in [`PRE_TOKENIZERS`] is refused
//!   by name, never guessed (llama.cpp refuses it too).
//! - `llama`: SentencePiece BPE with scores (Llama 2, Mistral): a space before each piece of
//!   text (`tokenizer.ggml.add_space_prefix`, on by default), spaces as `▁`, bytes a
//!   piece does not cover as `<0xNN>` tokens, and merges from the file or, as transformers'
//!   GGUF loader derives them, from the scores (a merge ranks by the score of the token it
//!   makes).
//!
//! Tokens the file marks as control or unknown (`tokenizer.ggml.token_type` 3 or 2) are
//! special tokens, and user-defined ones (4) added tokens: each is matched whole in the text,
//! as llama.cpp matches them. A BOS (and EOS) is added by `encode(text, true)` as
//! `tokenizer.ggml.add_bos_token` (`add_eos_token`) says, else as llama.cpp's default for the
//! kind (`llama` and the Llama 3 splits add a BOS).
//!
//! Metadata that does not make a tokenizer (a key missing or of the wrong kind, arrays of
//! different lengths, a merge of tokens not in the vocabulary, an id past it) is a
//! [`GgufTokenizerError`] naming the key.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::{Gguf, GgufValue};

/// A GGUF file's tokenizer metadata that strata cannot build a tokenizer from.
#[derive(Debug, thiserror::Error)]
pub enum GgufTokenizerError {
    /// A tokenizer kind (`tokenizer.ggml.model`) or pre-tokenizer (`tokenizer.ggml.pre`)
    /// strata does not build: give the model's `tokenizer.json` instead.
    #[error(
        "{}: {key} is {value:?}: strata builds {supported}; give the model's tokenizer.json \
         (--tokenizer FILE)",
        path.display()
    )]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// Its value.
        value: String,
        /// What strata builds.
        supported: String,
    },
    /// Metadata that does not make a tokenizer: a key missing or of another kind, arrays of
    /// different lengths, a merge naming tokens not in the vocabulary, an id past it.
    #[error("{}: {key}: {why}", path.display())]
    Bad {
        /// The file.
        path: PathBuf,
        /// The key at fault.
        key: String,
        /// What is wrong with it.
        why: String,
    },
}

impl GgufTokenizerError {
    /// This error as a `candle_core::Error` (what the text module's functions return).
    pub fn into_candle(self) -> candle_core::Error {
        candle_core::Error::Io(std::io::Error::other(self))
    }

    /// The [`GgufTokenizerError`] inside `e`, if it is one (under any backtrace or context
    /// candle added).
    pub fn find(e: &candle_core::Error) -> Option<&GgufTokenizerError> {
        crate::candle::find_carried(e)
    }

    /// The key it names.
    pub fn key(&self) -> &str {
        match self {
            GgufTokenizerError::Unsupported { key, .. } | GgufTokenizerError::Bad { key, .. } => {
                key
            }
        }
    }
}

type Res<T> = Result<T, GgufTokenizerError>;

/// GPT-2's split (what `ByteLevel` with `use_regex` splits by).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's split, as its `tokenizer.json` writes it.
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split: Llama 3's with one digit a piece.
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a `gpt2` file's text is split before its merges: the regular expressions applied in
/// turn (each to the pieces the one before made, matches and the text between them kept as
/// pieces), whether a piece that is a whole token skips the merges, and whether a BOS is added
/// where the file does not say.
struct Split {
    regexes: &'static [&'static str],
    ignore_merges: bool,
    add_bos: bool,
}

/// The `tokenizer.ggml.pre` values strata builds, by llama.cpp's pre-tokenizer family
/// (`llama-vocab.cpp`): `[names, family]`.
pub const PRE_TOKENIZERS: [(&[&str], &str); 5] = [
    (&["gpt-2", "phi-2", "roberta-bpe", "mpt", "olmo", "jais"], "GPT-2"),
    (
        &["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"],
        "StarCoder (one digit a piece, then GPT-2)",
    ),
    (&["llama3", "llama-v3", "llama-bpe", "falcon3"], "Llama 3"),
    (&["dbrx", "smaug-bpe"], "Llama 3 (merges not skipped)"),
    (&["qwen2", "stablelm2", "megrez", "deepseek-r1-qwen"], "Qwen2"),
];

fn split_of(pre: &str) -> Option<Split> {
    let family = PRE_TOKENIZERS.iter().position(|(names, _)| names.contains(&pre))?;
    Some(match family {
        0 => Split { regexes: &[GPT2], ignore_merges: false, add_bos: false },
        1 => Split { regexes: &[r"\p{N}", GPT2], ignore_merges: false, add_bos: false },
        2 => Split { regexes: &[LLAMA3], ignore_merges: true, add_bos: true },
        3 => Split { regexes: &[LLAMA3], ignore_merges: false, add_bos: false },
        _ => Split { regexes: &[QWEN2], ignore_merges: false, add_bos: false },
    })
}

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const UNKNOWN: i64 = 2;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The text side of a GGUF file: its tokenizer as a Hugging Face `tokenizer.json`, its chat
/// template, its special tokens.
///
/// ```no_run
/// # fn main() -> candle_core::Result<()> {
/// use strata::candle::text::GgufText;
/// let file = strata::Gguf::open("SmolLM2-135M-Instruct.Q4_1.gguf")?;
/// let text = GgufText::read(&file).map_err(|e| e.into_candle())?;
/// let tokenizer = text.tokenizer()?;
/// assert_eq!(tokenizer.encode("<|im_start|>user", false)?, [1, 4093]);
/// let template = text.chat_template()?.expect("an instruct model has one");
/// # let _ = template; Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct GgufText {
    /// `tokenizer.json`, as the `tokenizers` crate and transformers read it.
    pub tokenizer_json: Value,
    /// `tokenizer.chat_template`, when the file has one.
    pub chat_template: Option<String>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.ggml.eot_token_id` (an end of turn; a generation stops there too).
    pub eot: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad: Option<u32>,
    /// Whether `encode(text, true)` adds the BOS.
    pub add_bos: bool,
    /// Whether `encode(text, true)` adds the EOS.
    pub add_eos: bool,
    /// The tokens, by id, as the file spells them.
    pub tokens: Vec<String>,
}

/// Reads the metadata of one file, naming it in errors.
struct Meta<'f> {
    file: &'f Gguf,
}

impl<'f> Meta<'f> {
    fn bad(&self, key: &str, why: impl Into<String>) -> GgufTokenizerError {
        GgufTokenizerError::Bad {
            path: self.file.path().to_path_buf(),
            key: key.to_string(),
            why: why.into(),
        }
    }

    fn get(&self, key: &str) -> Option<&'f GgufValue> {
        self.file.get(key)
    }

    fn string(&self, key: &str) -> Res<Option<&'f str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.bad(key, format!("a {}, not a string", v.kind()))),
        }
    }

    fn flag(&self, key: &str) -> Res<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.bad(key, format!("a {}, not a bool", v.kind()))),
        }
    }

    /// An array's values, each checked by `one` (`None`: of the wrong kind, named `kind`).
    fn array<T>(
        &self,
        key: &str,
        kind: &str,
        one: impl Fn(&'f GgufValue) -> Option<T>,
    ) -> Res<Option<Vec<T>>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let list =
            v.as_array().ok_or_else(|| self.bad(key, format!("a {}, not an array", v.kind())))?;
        list.iter()
            .enumerate()
            .map(|(i, x)| {
                one(x).ok_or_else(|| {
                    self.bad(key, format!("element {i} is a {}, not {kind}", x.kind()))
                })
            })
            .collect::<Res<Vec<T>>>()
            .map(Some)
    }

    /// A token id, checked against the vocabulary of `n` tokens.
    fn id(&self, key: &str, n: usize) -> Res<Option<u32>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let id = v
            .as_u64()
            .ok_or_else(|| self.bad(key, format!("a {} ({v:?}), not a token id", v.kind())))?;
        if id >= n as u64 {
            return Err(self.bad(key, format!("token id {id} is past the {n} tokens")));
        }
        Ok(Some(id as u32))
    }
}

/// Each byte's character in byte-level BPE's spelling (GPT-2's `bytes_to_unicode`): printable
/// bytes are themselves, the others the characters from U+0100 on.
pub(crate) fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        out[b as usize] = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("below U+0200")
        };
    }
    out
}

impl GgufText {
    /// Reads the text side of `file` (what it holds: [`GgufText`]).
    pub fn read(file: &Gguf) -> Res<GgufText> {
        let m = Meta { file };
        let path = || file.path().to_path_buf();
        const MODEL: &str = "tokenizer.ggml.model";
        let model = m.string(MODEL)?.ok_or_else(|| {
            m.bad(MODEL, "no tokenizer in the file (give the model's tokenizer.json)")
        })?;
        if model != "gpt2" && model != "llama" {
            return Err(GgufTokenizerError::Unsupported {
                path: path(),
                key: MODEL.into(),
                value: model.into(),
                supported: "\"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece BPE)".into(),
            });
        }
        const TOKENS: &str = "tokenizer.ggml.tokens";
        let tokens = m
            .array(TOKENS, "a string", |v| v.as_str())?
            .ok_or_else(|| m.bad(TOKENS, "missing: the file names no tokens"))?;
        if tokens.is_empty() {
            return Err(m.bad(TOKENS, "empty: the file names no tokens"));
        }
        let n = tokens.len();
        // llama.cpp names an empty token by its id.
        let tokens: Vec<String> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| if t.is_empty() { format!("[EMPTY_{i}]") } else { t.to_string() })
            .collect();
        let same_length = |key: &str, len: usize| {
            if len == n {
                Ok(())
            } else {
                Err(m.bad(key, format!("{len} values for the {n} tokens of {TOKENS}")))
            }
        };
        const TYPES: &str = "tokenizer.ggml.token_type";
        let types = m.array(TYPES, "an integer", |v| match *v {
            GgufValue::I32(x) => Some(i64::from(x)),
            GgufValue::U32(x) => Some(i64::from(x)),
            _ => None,
        })?;
        if let Some(t) = &types {
            same_length(TYPES, t.len())?;
        }
        const SCORES: &str = "tokenizer.ggml.scores";
        let scores = m.array(SCORES, "a float32", |v| match *v {
            GgufValue::F32(x) => Some(x),
            _ => None,
        })?;
        if let Some(s) = &scores {
            same_length(SCORES, s.len())?;
            if let Some(i) = s.iter().position(|x| !x.is_finite()) {
                return Err(m.bad(SCORES, format!("the score of token {i} is {}", s[i])));
            }
        }
        const MERGES: &str = "tokenizer.ggml.merges";
        let merges = m.array(MERGES, "a string", |v| v.as_str())?;
        let ids = |k: &str| m.id(&format!("tokenizer.ggml.{k}"), n);
        let (bos, eos, eot, unk, pad) = (
            ids("bos_token_id")?,
            ids("eos_token_id")?,
            ids("eot_token_id")?,
            ids("unknown_token_id")?,
            ids("padding_token_id")?,
        );
        let chat_template = m.string("tokenizer.chat_template")?.map(str::to_string);

        let mut vocab = serde_json::Map::with_capacity(n);
        let (tokenizer, add_bos_default) = if model == "gpt2" {
            const PRE: &str = "tokenizer.ggml.pre";
            let pre = m.string(PRE)?.ok_or_else(|| {
                m.bad(
                    PRE,
                    "missing: a gpt2 file without a pre-tokenizer (llama.cpp falls back to a \
                     split that degrades generation); give the model's tokenizer.json",
                )
            })?;
            let split = split_of(pre).ok_or_else(|| GgufTokenizerError::Unsupported {
                path: path(),
                key: PRE.into(),
                value: pre.into(),
                supported: format!(
                    "the pre-tokenizers {}",
                    PRE_TOKENIZERS
                        .iter()
                        .flat_map(|(names, _)| names.iter())
                        .copied()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })?;
            let spelled = byte_chars();
            let alphabet: std::collections::HashSet<char> = spelled.iter().copied().collect();
            for (i, t) in tokens.iter().enumerate() {
                // Tokens matched whole keep their spelling; a normal token with a character
                // outside the byte alphabet is spelled in it (as transformers' loader does).
                let whole = types
                    .as_ref()
                    .is_some_and(|ty| matches!(ty[i], UNKNOWN | CONTROL | USER_DEFINED));
                let key = if whole || t.chars().all(|c| alphabet.contains(&c)) {
                    t.clone()
                } else {
                    t.bytes().map(|b| spelled[b as usize]).collect()
                };
                insert_token(&m, TOKENS, &mut vocab, key, i)?;
            }
            let merges = merges.ok_or_else(|| {
                m.bad(MERGES, "missing: a gpt2 (byte-level BPE) file needs its merges")
            })?;
            let merges = merges
                .iter()
                .enumerate()
                .map(|(i, s)| parse_merge(&m, MERGES, i, s, &vocab))
                .collect::<Res<Vec<_>>>()?;
            let mut pre_tokenizers: Vec<Value> = split
                .regexes
                .iter()
                .map(|r| {
                    json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated",
                           "invert": false})
                })
                .collect();
            pre_tokenizers.push(json!({"type": "ByteLevel", "add_prefix_space": false,
                                       "trim_offsets": true, "use_regex": false}));
            let t = json!({
                "normalizer": null,
                "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
                "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                            "use_regex": true},
                "model": {"type": "BPE", "dropout": null, "unk_token": null,
                          "continuing_subword_prefix": null, "end_of_word_suffix": null,
                          "fuse_unk": false, "byte_fallback": false,
                          "ignore_merges": split.ignore_merges,
                          "vocab": Value::Object(std::mem::take(&mut vocab)),
                          "merges": merges},
            });
            (t, split.add_bos)
        } else {
            for (i, t) in tokens.iter().enumerate() {
                insert_token(&m, TOKENS, &mut vocab, t.clone(), i)?;
            }
            let merges = match merges {
                Some(list) => list
                    .iter()
                    .enumerate()
                    .map(|(i, s)| parse_merge(&m, MERGES, i, s, &vocab))
                    .collect::<Res<Vec<_>>>()?,
                None => {
                    let scores = scores.as_ref().ok_or_else(|| {
                        m.bad(
                            SCORES,
                            "missing: a llama (SentencePiece) file without merges ranks its \
                             merges by its scores",
                        )
                    })?;
                    merges_from_scores(&tokens, scores)
                }
            };
            let prefix = m.flag("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
            let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"});
            let normalizer = if prefix {
                json!({"type": "Sequence", "normalizers": [
                    {"type": "Prepend", "prepend": "▁"}, replace]})
            } else {
                replace
            };
            let mut decoders = vec![
                json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
                json!({"type": "ByteFallback"}),
                json!({"type": "Fuse"}),
            ];
            if prefix {
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
            }
            let unk_token = unk.map(|u| tokens[u as usize].clone());
            let t = json!({
                "normalizer": normalizer,
                "pre_tokenizer": null,
                "decoder": {"type": "Sequence", "decoders": decoders},
                "model": {"type": "BPE", "dropout": null, "unk_token": unk_token,
                          "continuing_subword_prefix": null, "end_of_word_suffix": null,
                          "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                          "vocab": Value::Object(std::mem::take(&mut vocab)),
                          "merges": merges},
            });
            (t, true)
        };
        let add_bos = m.flag("tokenizer.ggml.add_bos_token")?.unwrap_or(add_bos_default);
        let add_eos = m.flag("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        let needs = |on: bool, id: Option<u32>, key: &str, flag: &str| {
            if on && id.is_none() {
                Err(m.bad(key, format!("missing, and {flag} says to add it")))
            } else {
                Ok(())
            }
        };
        needs(add_bos, bos, "tokenizer.ggml.bos_token_id", "add_bos_token")?;
        needs(add_eos, eos, "tokenizer.ggml.eos_token_id", "add_eos_token")?;

        let added: Vec<Value> = match &types {
            None => Vec::new(),
            Some(ty) => ty
                .iter()
                .enumerate()
                .filter(|&(_, &t)| matches!(t, UNKNOWN | CONTROL | USER_DEFINED))
                .map(|(i, &t)| {
                    json!({"id": i, "content": tokens[i], "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": false, "special": t != USER_DEFINED})
                })
                .collect(),
        };
        let mut tokenizer = tokenizer;
        let o = tokenizer.as_object_mut().expect("an object");
        o.insert("version".into(), "1.0".into());
        o.insert("truncation".into(), Value::Null);
        o.insert("padding".into(), Value::Null);
        o.insert("added_tokens".into(), added.into());
        o.insert("post_processor".into(), post_processor(&tokens, bos, eos, add_bos, add_eos));
        Ok(GgufText {
            tokenizer_json: tokenizer,
            chat_template,
            bos,
            eos,
            eot,
            unk,
            pad,
            add_bos,
            add_eos,
            tokens,
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> candle_core::Result<super::Tokenizer> {
        super::Tokenizer::from_json(&self.tokenizer_json.to_string())
    }

    /// The chat template (`tokenizer.chat_template`, `None` when the file has none), with the
    /// BOS and EOS tokens' text for the template's `bos_token` and `eos_token`.
    pub fn chat_template(&self) -> candle_core::Result<Option<super::ChatTemplate>> {
        let Some(source) = &self.chat_template else { return Ok(None) };
        let text = |id: Option<u32>| id.map(|i| self.tokens[i as usize].clone());
        super::ChatTemplate::new(source, text(self.bos), text(self.eos)).map(Some)
    }

    /// The tokens a generation stops at: the EOS, and the end of turn when the file names one
    /// (llama.cpp stops at both).
    pub fn stop_tokens(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.eos.into_iter().collect();
        v.extend(self.eot.filter(|t| Some(*t) != self.eos));
        v
    }

    /// Writes `tokenizer.json`, `tokenizer_config.json` (the special tokens and the chat
    /// template) and `generation_config.json` (BOS, EOS and padding ids) into `dir`: what a
    /// Hugging Face model directory has beside its weights, so that transformers and strata
    /// read the model's text side from there.
    pub fn write_hf_files(&self, dir: &Path) -> candle_core::Result<()> {
        let text = |id: Option<u32>| id.map(|i| self.tokens[i as usize].clone());
        let config = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": text(self.bos),
            "eos_token": text(self.eos),
            "unk_token": text(self.unk),
            "pad_token": text(self.pad),
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "clean_up_tokenization_spaces": false,
            "chat_template": self.chat_template,
        });
        let eos = self.stop_tokens();
        let generation = json!({
            "bos_token_id": self.bos,
            "eos_token_id": if eos.len() == 1 { json!(eos[0]) } else { json!(eos) },
            "pad_token_id": self.pad,
        });
        let pretty = |v: &Value| serde_json::to_string_pretty(v).expect("JSON values print");
        for (name, v) in [
            ("tokenizer.json", &self.tokenizer_json),
            ("tokenizer_config.json", &config),
            ("generation_config.json", &generation),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, pretty(v))
                .map_err(|e| candle_core::Error::from(crate::Error::io(&path, e)))?;
        }
        Ok(())
    }
}

/// Adds token `key` (id `i`) to the vocabulary; a token named twice is an error (a vocabulary
/// maps each token to one id).
fn insert_token(
    m: &Meta<'_>,
    key_name: &str,
    vocab: &mut serde_json::Map<String, Value>,
    key: String,
    i: usize,
) -> Res<()> {
    if let Some(first) = vocab.get(&key) {
        return Err(m.bad(key_name, format!("token {key:?} is both id {first} and id {i}")));
    }
    vocab.insert(key, i.into());
    Ok(())
}

/// Merge `i` of the file (`"left right"`, split at the first space after its first
/// character, as llama.cpp splits it), both tokens and the token they make in `vocab`.
fn parse_merge(
    m: &Meta<'_>,
    key: &str,
    i: usize,
    merge: &str,
    vocab: &serde_json::Map<String, Value>,
) -> Res<Value> {
    let first = merge.chars().next().map_or(0, char::len_utf8);
    let at = merge[first..]
        .find(' ')
        .map(|p| p + first)
        .ok_or_else(|| m.bad(key, format!("merge {i} ({merge:?}) is not two tokens")))?;
    let (l, r) = (&merge[..at], &merge[at + 1..]);
    for part in [l, r, &format!("{l}{r}")] {
        if !vocab.contains_key(part) {
            return Err(m.bad(
                key,
                format!("merge {i} ({merge:?}) names {part:?}, not in tokenizer.ggml.tokens"),
            ));
        }
    }
    Ok(json!([l, r]))
}

/// A SentencePiece vocabulary's merges from its scores, as transformers' `generate_merges`
/// derives them: every split of a token into two tokens, ranked by the score of the token it
/// makes (highest first), then by the left and the right piece's length (longest first); the
/// splits of one token in the order of their pieces' ids.
fn merges_from_scores(tokens: &[String], scores: &[f32]) -> Vec<Value> {
    let ids: HashMap<&str, usize> =
        tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    // As a Python dict of the tokens: a token named twice keeps its first place and last score.
    let mut score: HashMap<&str, f32> = HashMap::with_capacity(tokens.len());
    let mut order: Vec<&str> = Vec::with_capacity(tokens.len());
    for (t, &s) in tokens.iter().zip(scores) {
        if score.insert(t, s).is_none() {
            order.push(t);
        }
    }
    let mut merges: Vec<(&str, &str, f32)> = Vec::new();
    for t in order {
        let mut local: Vec<(&str, &str, f32)> = t
            .char_indices()
            .skip(1)
            .map(|(at, _)| (&t[..at], &t[at..]))
            .filter(|(l, r)| ids.contains_key(l) && ids.contains_key(r))
            .map(|(l, r)| (l, r, score[t]))
            .collect();
        local.sort_by_key(|(l, r, _)| (ids[l], ids[r]));
        merges.extend(local);
    }
    let len = |s: &str| s.chars().count();
    // Python's sort(reverse=True) is stable: equal keys keep their order.
    merges.sort_by(|a, b| {
        b.2.total_cmp(&a.2).then(len(b.0).cmp(&len(a.0))).then(len(b.1).cmp(&len(a.1)))
    });
    merges.into_iter().map(|(l, r, _)| json!([l, r])).collect()
}

/// The post-processor adding the BOS and EOS tokens as the file says.
fn post_processor(
    tokens: &[String],
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
) -> Value {
    let special = |id: u32| json!({"SpecialToken": {"id": tokens[id as usize], "type_id": 0}});
    let seq = |s: &str| json!({"Sequence": {"id": s, "type_id": 0}});
    let mut single = Vec::new();
    let mut specials = serde_json::Map::new();
    let mut one = |id: Option<u32>, on: bool, single: &mut Vec<Value>| {
        if let (Some(id), true) = (id, on) {
            let t = &tokens[id as usize];
            specials.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
            single.push(special(id));
        }
    };
    one(bos, add_bos, &mut single);
    single.push(seq("A"));
    one(eos, add_eos, &mut single);
    let mut pair = single.clone();
    pair.extend(single.iter().map(|v| {
        if v.get("Sequence").is_some() {
            json!({"Sequence": {"id": "B", "type_id": 1}})
        } else {
            v.clone()
        }
    }));
    json!({"type": "TemplateProcessing", "single": single, "pair": pair,
           "special_tokens": specials})
}
