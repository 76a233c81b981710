//! Text in, text out (feature `text`): a Hugging Face `tokenizer.json` read with the
//! `tokenizers` crate ([`Tokenizer`]), or the tokenizer, chat template and special tokens of a
//! GGUF file's metadata ([`GgufText`], as llama.cpp reads them), decoded as tokens come ([`TextStream`]: a piece is
//! printed once its bytes make whole characters), chat templates from `tokenizer_config.json`
//! rendered with minijinja as transformers renders them ([`ChatTemplate`]), the model's end of
//! sequence ([`eos_tokens`]), and training data: documents and chats turned into token
//! sequences with a loss mask ([`Tokens`]: the responses only, for chats), packed into rows
//! ([`pack`]).
//!
//! ```no_run
//! # fn main() -> candle_core::Result<()> {
//! use strata::candle::text::{ChatTemplate, Message, TextStream, Tokenizer};
//! let tokenizer = Tokenizer::from_file("SmolLM2-135M-Instruct/tokenizer.json")?;
//! let chat = ChatTemplate::from_file("SmolLM2-135M-Instruct/tokenizer_config.json")?;
//! let prompt = chat.render(&[Message::new("user", "What is the capital of France?")], true)?;
//! let ids = tokenizer.encode(&prompt, false)?;
//! let mut stream = TextStream::new(&tokenizer);
//! for id in [504u32, 3575] {              // tokens as a model generates them
//!     if let Some(text) = stream.push(id)? {
//!         print!("{text}");
//!     }
//! }
//! print!("{}", stream.finish()?);
//! # let _ = ids; Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

mod gguf;
pub use gguf::{GgufText, GgufTokenizerError, PRE_TOKENIZERS};

fn text_err(why: String) -> candle_core::Error {
    candle_core::Error::Msg(why).bt()
}

/// A Hugging Face tokenizer (`tokenizer.json`), read with the `tokenizers` crate.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab", &self.vocab_size()).finish()
    }
}

impl Tokenizer {
    /// Reads a `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> candle_core::Result<Tokenizer> {
        let path = path.as_ref();
        let json = super::read_text_file_needed(path)?;
        Self::from_json(&json).map_err(|e| e.context(format!("in {}", path.display())))
    }

    /// A tokenizer from the text of a `tokenizer.json`.
    pub fn from_json(json: &str) -> candle_core::Result<Tokenizer> {
        let inner = json
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| text_err(format!("not a tokenizer.json: {e}")))?;
        Ok(Tokenizer { inner })
    }

    /// The tokenizer a GGUF file carries in its metadata (`tokenizer.ggml.*`), built as
    /// [`GgufText`] describes: `gpt2` (byte-level BPE, split as the file's
    /// `tokenizer.ggml.pre` says) and `llama` (SentencePiece BPE) files; another kind, an
    /// unknown pre-tokenizer or metadata that does not make a tokenizer is a
    /// [`GgufTokenizerError`] naming the key.
    ///
    /// ```
    /// # fn main() -> candle_core::Result<()> {
    /// let f = strata::Gguf::open("tests/fixtures/tiny-gpt2.gguf")?;
    /// let t = strata::candle::text::Tokenizer::from_gguf(&f)?;
    /// let ids = t.encode("<|im_start|>user\nHello 42", false)?;
    /// assert_eq!(t.decode(&ids, false)?, "<|im_start|>user\nHello 42");
    /// # Ok(()) }
    /// ```
    pub fn from_gguf(file: &crate::Gguf) -> candle_core::Result<Tokenizer> {
        GgufText::read(file).map_err(GgufTokenizerError::into_candle)?.tokenizer()
    }

    /// The tokens of `text`; `add_special_tokens` adds what the tokenizer's post-processor adds
    /// (a BOS for Llama's tokenizers). Special tokens written in the text (`<|im_start|>`) are
    /// their tokens either way.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> candle_core::Result<Vec<u32>> {
        let e = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| text_err(format!("tokenizing {} bytes of text: {e}", text.len())))?;
        Ok(e.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens left out when `skip_special` (an id past the
    /// vocabulary is an error).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> candle_core::Result<String> {
        if let Some(bad) = ids.iter().find(|&&i| self.inner.id_to_token(i).is_none()) {
            return Err(text_err(format!(
                "token id {bad} is past the tokenizer's vocabulary of {}",
                self.vocab_size()
            )));
        }
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| text_err(format!("decoding {} tokens: {e}", ids.len())))
    }

    /// The id of a token (`"<|im_end|>"`), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// Decodes tokens as they come, for streaming: [`TextStream::push`] returns the text a token
/// completes, and nothing while the bytes so far end inside a character (a byte-level token
/// can hold part of a character's UTF-8 bytes; the decoder shows such a tail as U+FFFD). Text
/// is decoded over a window of the last tokens, so spaces and merges that depend on the token
/// before (SentencePiece's leading space) come out as a whole decode would give them. Special
/// tokens are left out.
#[derive(Debug)]
pub struct TextStream<'t> {
    tokenizer: &'t Tokenizer,
    tokens: Vec<u32>,
    /// Tokens before `prefix` are printed and out of the window; `prefix..read` are printed
    /// and decoded again as the window's context.
    prefix: usize,
    read: usize,
}

impl<'t> TextStream<'t> {
    /// A stream over `tokenizer`, empty.
    pub fn new(tokenizer: &'t Tokenizer) -> TextStream<'t> {
        TextStream { tokenizer, tokens: Vec::new(), prefix: 0, read: 0 }
    }

    /// Adds a token; returns the text it completes, if any.
    pub fn push(&mut self, token: u32) -> candle_core::Result<Option<String>> {
        self.tokens.push(token);
        let before = self.tokenizer.decode(&self.tokens[self.prefix..self.read], true)?;
        let now = self.tokenizer.decode(&self.tokens[self.prefix..], true)?;
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let text = added(&before, &now);
        self.prefix = self.read;
        self.read = self.tokens.len();
        Ok(Some(text))
    }

    /// The text not yet returned (a partial character at the end shows as U+FFFD).
    pub fn finish(&mut self) -> candle_core::Result<String> {
        let before = self.tokenizer.decode(&self.tokens[self.prefix..self.read], true)?;
        let now = self.tokenizer.decode(&self.tokens[self.prefix..], true)?;
        self.prefix = self.tokens.len();
        self.read = self.tokens.len();
        Ok(added(&before, &now))
    }

    /// Every token pushed.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// What `now` adds to `before`: its tail, or, where the window's context decoded differently
/// once extended, the characters past `before`'s count.
fn added(before: &str, now: &str) -> String {
    match now.strip_prefix(before) {
        Some(t) => t.to_string(),
        None => now.chars().skip(before.chars().count()).collect(),
    }
}

/// One message of a chat: a role (`system`, `user`, `assistant`) and its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user`, `assistant` (or what the template knows).
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message { role: role.into(), content: content.into() }
    }
}

/// A chat template (Jinja, from a `tokenizer_config.json`), rendered with minijinja as
/// transformers' `apply_chat_template` renders it: `trim_blocks` and `lstrip_blocks` on, loop
/// controls, Python's string methods (minijinja-contrib's pycompat), the variables
/// `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and the function
/// `raise_exception(message)` (an error carrying the template's message).
///
/// ```
/// use strata::candle::text::{ChatTemplate, Message};
/// let t = ChatTemplate::new(
///     "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}{{ eos_token }}{% endfor %}\
///      {% if add_generation_prompt %}<|assistant|>{% endif %}",
///     Some("<s>".into()),
///     Some("</s>".into()),
/// )?;
/// let text = t.render(&[Message::new("user", " Hi ")], true)?;
/// assert_eq!(text, "<|user|>Hi</s><|assistant|>");
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// The most bytes a rendering may have ([`ChatTemplate::set_limits`]).
    output_cap: usize,
}

/// The instructions a rendering may run by default: far more than a chat template needs for a
/// long conversation (tens to a hundred a message: 100,000 messages or more), few enough that
/// a template that loops without end stops within a second.
pub const TEMPLATE_FUEL: u64 = 10_000_000;
/// The most bytes a rendering may produce by default beside the messages' own text.
pub const TEMPLATE_OUTPUT: usize = 64 << 20;

/// A writer that refuses to grow past a cap.
struct Capped {
    out: Vec<u8>,
    cap: usize,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len().saturating_add(buf.len()) > self.cap {
            return Err(std::io::Error::other(format!(
                "the rendering grew past {} bytes",
                self.cap
            )));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A special token as `tokenizer_config.json` writes it: a string, or an object with `content`.
fn special_token(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl ChatTemplate {
    /// A template from its Jinja source, with the special tokens it may name.
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> candle_core::Result<ChatTemplate> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| text_err(format!("the chat template does not parse: {e:#}")))?;
        Ok(ChatTemplate { env, bos_token, eos_token, output_cap: TEMPLATE_OUTPUT })
    }

    /// Bounds each rendering: at most `fuel` template instructions (minijinja's fuel: a
    /// template that loops without end is an error, not a hang) and `output` bytes beside the
    /// messages' own text (a template that emits without end is an error, not an abort for
    /// memory). The defaults are [`TEMPLATE_FUEL`] and [`TEMPLATE_OUTPUT`].
    pub fn set_limits(&mut self, fuel: u64, output: usize) {
        // minijinja counts the fuel left in an isize.
        self.env.set_fuel(Some(fuel.min(isize::MAX as u64)));
        self.output_cap = output;
    }

    /// The template beside a tokenizer (its directory's `tokenizer_config.json`, or
    /// `chat_template.jinja` there), for data that may hold chats (`--jsonl`): `None` when the
    /// model has none (no such file, or no template in it); a template that is there and does
    /// not read or parse is an error naming it, not taken for no template.
    pub fn beside(tokenizer: impl AsRef<Path>) -> candle_core::Result<Option<ChatTemplate>> {
        let dir = tokenizer.as_ref().parent().unwrap_or(Path::new("."));
        let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
        let config = dir.join("tokenizer_config.json");
        let has_config_template = match super::read_text_file(&config)? {
            None => false,
            Some(text) => {
                let v: Value = serde_json::from_str(&text)
                    .map_err(|e| text_err(format!("{} is not JSON: {e}", config.display())))?;
                v.get("chat_template").is_some_and(|t| !t.is_null())
            }
        };
        if has_config_template || dir.join("chat_template.jinja").exists() {
            return Self::from_file(&config).map(Some);
        }
        Ok(None)
    }

    /// The template of a `tokenizer_config.json`: its `chat_template` (a string, or the one named
    /// `default` of a list), else a `chat_template.jinja` beside it (where transformers 5 writes
    /// it); its `bos_token` and `eos_token`.
    pub fn from_file(tokenizer_config: impl AsRef<Path>) -> candle_core::Result<ChatTemplate> {
        let path = tokenizer_config.as_ref();
        let text = super::read_text_file_needed(path)?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| text_err(format!("{} is not JSON: {e}", path.display())))?;
        let source = match v.get("chat_template") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .ok_or_else(|| {
                    text_err(format!(
                        "{}: chat_template is a list without one named \"default\"",
                        path.display()
                    ))
                })?
                .to_string(),
            Some(other) => {
                return Err(text_err(format!(
                    "{}: chat_template is {other}, not a template",
                    path.display()
                )))
            }
            None => {
                let jinja = path.with_file_name("chat_template.jinja");
                super::read_text_file(&jinja)?.ok_or_else(|| {
                    text_err(format!(
                        "{} has no chat_template, and there is no {}: this model has no chat \
                         template (prompt it without --chat)",
                        path.display(),
                        jinja.display()
                    ))
                })?
            }
        };
        let t = Self::new(
            &source,
            special_token(v.get("bos_token")),
            special_token(v.get("eos_token")),
        )?;
        Ok(t)
    }

    /// The `eos_token` the template was given.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The chat as text; with `add_generation_prompt`, followed by what opens the assistant's
    /// turn. The template's `raise_exception` is an error with its message.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> candle_core::Result<String> {
        let msgs: Vec<minijinja::Value> = messages
            .iter()
            .map(|m| {
                let mut map = BTreeMap::new();
                map.insert("role", minijinja::Value::from(m.role.as_str()));
                map.insert("content", minijinja::Value::from(m.content.as_str()));
                minijinja::Value::from(map)
            })
            .collect();
        let tmpl = self.env.get_template("chat").map_err(|e| text_err(format!("{e:#}")))?;
        let text: usize = messages.iter().map(|m| m.content.len() + m.role.len()).sum();
        let mut out = Capped { out: Vec::new(), cap: self.output_cap.saturating_add(text) };
        let ctx = minijinja::context! {
            messages => msgs,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        if let Err(e) = tmpl.render_captured_to(ctx, &mut out) {
            let why = match e.kind() {
                minijinja::ErrorKind::OutOfFuel => format!(
                    "it ran past its bound of template instructions ({e:#}): a template that \
                     loops without end, or one far heavier than a chat template needs"
                ),
                minijinja::ErrorKind::WriteFailure => format!(
                    "its output grew past {} bytes ({e:#}): a template that emits without end",
                    out.cap
                ),
                _ => format!("{e:#}"),
            };
            return Err(text_err(format!("the chat template refused the chat: {why}")));
        }
        String::from_utf8(out.out)
            .map_err(|e| text_err(format!("the chat template wrote text that is not UTF-8: {e}")))
    }
}

/// Where a model's end-of-sequence tokens came from, and their ids ([`eos_tokens`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EosTokens {
    /// The ids that end a generation.
    pub ids: Vec<u32>,
    /// The file and field they were read from.
    pub from: String,
}

/// The ids of `eos_token_id` (a number or a list) in a JSON file, if it has the field.
fn eos_field(path: &Path) -> candle_core::Result<Option<Vec<u32>>> {
    let Some(text) = super::read_text_file(path)? else { return Ok(None) };
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| text_err(format!("{} is not JSON: {e}", path.display())))?;
    let id = |x: &Value| x.as_u64().and_then(|n| u32::try_from(n).ok());
    let bad = || text_err(format!("{}: eos_token_id is not token ids", path.display()));
    match v.get("eos_token_id") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(list)) => {
            Ok(Some(list.iter().map(|x| id(x).ok_or_else(bad)).collect::<Result<_, _>>()?))
        }
        Some(x) => Ok(Some(vec![id(x).ok_or_else(bad)?])),
    }
}

/// The tokens that end a generation for the model in `dir`, from the first of:
/// `generation_config.json`'s `eos_token_id` (what transformers' `generate` stops at),
/// `config.json`'s, `tokenizer_config.json`'s `eos_token` (looked up in `tokenizer`). `None`
/// when none of them says.
pub fn eos_tokens(dir: &Path, tokenizer: &Tokenizer) -> candle_core::Result<Option<EosTokens>> {
    for file in ["generation_config.json", "config.json"] {
        let path = dir.join(file);
        if let Some(ids) = eos_field(&path)? {
            return Ok(Some(EosTokens { ids, from: format!("{}: eos_token_id", path.display()) }));
        }
    }
    let path = dir.join("tokenizer_config.json");
    let Some(text) = super::read_text_file(&path)? else { return Ok(None) };
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| text_err(format!("{} is not JSON: {e}", path.display())))?;
    let Some(token) = special_token(v.get("eos_token")) else { return Ok(None) };
    let id = tokenizer.token_id(&token).ok_or_else(|| {
        text_err(format!("{}: eos_token {token:?} is not in the tokenizer", path.display()))
    })?;
    Ok(Some(EosTokens { ids: vec![id], from: format!("{}: eos_token {token:?}", path.display()) }))
}

/// Token ids and, for each, whether predicting it counts in the loss: what a document or a
/// chat becomes for training ([`Tokens::document`], [`Tokens::chat`]), before [`pack`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tokens {
    /// The token ids.
    pub ids: Vec<u32>,
    /// `loss[i]`: whether the prediction of `ids[i]` (from the tokens before it) counts.
    pub loss: Vec<bool>,
}

impl Tokens {
    /// Appends `ids`, each counting in the loss or not.
    pub fn extend(&mut self, ids: &[u32], loss: bool) {
        self.ids.extend_from_slice(ids);
        self.loss.extend(std::iter::repeat_n(loss, ids.len()));
    }

    /// A document for pre-training style data: its tokens (the tokenizer's special tokens
    /// added: a BOS for Llama's) and then `eos`, every one counting.
    pub fn document(
        tokenizer: &Tokenizer,
        text: &str,
        eos: Option<u32>,
    ) -> candle_core::Result<Tokens> {
        let mut t = Tokens::default();
        t.extend(&tokenizer.encode(text, true)?, true);
        t.extend(eos.as_slice(), true);
        Ok(t)
    }

    /// A prompt and its completion as plain text (no template): the completion's tokens and
    /// `eos` count, the prompt's do not.
    pub fn completion(
        tokenizer: &Tokenizer,
        prompt: &str,
        completion: &str,
        eos: Option<u32>,
    ) -> candle_core::Result<Tokens> {
        let mut t = Tokens::default();
        t.extend(&tokenizer.encode(prompt, true)?, false);
        t.extend(&tokenizer.encode(completion, false)?, true);
        t.extend(eos.as_slice(), true);
        Ok(t)
    }

    /// A chat rendered by `template`, with the loss on the assistant's messages only. Each
    /// assistant message is tokenized on its own, after the text before it (rendered with the
    /// generation prompt): the tokens a model generating that reply would produce after that
    /// prompt. The template's text after the reply (its end-of-turn token) counts with it, so
    /// the model learns to end its turn. Refused when the template does not render each
    /// message as an extension of the chat before it.
    ///
    /// The chat is rendered once whole (and the part up to its first reply twice, to learn
    /// the template's generation prompt and end of turn), and each reply found in that text:
    /// linear in the chat's length. A template whose replies cannot be found so (one that
    /// rewrites the messages' text) is rendered again up to each reply, for chats of at most
    /// [`CHAT_TURNS_RERENDERED`] replies, and refused past that.
    pub fn chat(
        tokenizer: &Tokenizer,
        template: &ChatTemplate,
        messages: &[Message],
    ) -> candle_core::Result<Tokens> {
        let Some(first) = messages.iter().position(|m| m.role == "assistant") else {
            return Err(text_err(
                "a chat with no assistant message: nothing to learn (the loss is on the \
                 assistant's replies)"
                    .into(),
            ));
        };
        let pieces = match chat_spans(template, messages, first)? {
            Some(p) => p,
            None => {
                let replies = messages.iter().filter(|m| m.role == "assistant").count();
                if replies > CHAT_TURNS_RERENDERED {
                    return Err(text_err(format!(
                        "the chat template rewrites the messages' text, so its {replies} replies \
                         cannot be found in one rendering, and rendering it again up to each \
                         reply is refused past {CHAT_TURNS_RERENDERED} replies (its time grows \
                         with the square of the chat): split the chat"
                    )));
                }
                chat_spans_rerendered(template, messages)?
            }
        };
        let mut t = Tokens::default();
        for (text, loss) in pieces {
            t.extend(&tokenizer.encode(&text, false)?, loss);
        }
        Ok(t)
    }
}

/// The most replies a chat may have when its template must be rendered again up to each one
/// ([`Tokens::chat`]).
pub const CHAT_TURNS_RERENDERED: usize = 64;

/// The error of a template that does not extend the chat before message `k`.
fn not_extension(k: usize) -> candle_core::Error {
    text_err(format!(
        "the chat template does not render message {k} as an extension of the messages before \
         it, so the replies cannot be told apart"
    ))
}

/// The chat's text in pieces, each with whether it counts in the loss, from one rendering of
/// the whole chat: `None` when the replies cannot be found in it as the template renders them
/// alone (then [`chat_spans_rerendered`]).
fn chat_spans(
    template: &ChatTemplate,
    messages: &[Message],
    first: usize,
) -> candle_core::Result<Option<Vec<(String, bool)>>> {
    let whole = template.render(messages, false)?;
    // The first reply as the template renders it after its prompt: the generation prompt,
    // then what comes before the reply's text and after it (the end of turn).
    let prompt = template.render(&messages[..first], true)?;
    let with_reply = template.render(&messages[..=first], false)?;
    let Ok(before) = template.render(&messages[..first], false) else { return Ok(None) };
    let reply = with_reply.strip_prefix(&prompt).ok_or_else(|| not_extension(first))?;
    if !whole.starts_with(&with_reply) {
        return Err(not_extension(first + 1));
    }
    let Some(generation) = prompt.strip_prefix(&before) else { return Ok(None) };
    let content = &messages[first].content;
    let Some(at) = reply.find(content.as_str()) else { return Ok(None) };
    let (pre, post) = (&reply[..at], &reply[at + content.len()..]);
    let mut pieces = Vec::new();
    // Bytes of `whole` looked past, and put in pieces.
    let (mut cursor, mut taken) = (0, 0);
    for m in messages {
        if m.role != "assistant" {
            // Past this message's text, so a reply is not looked for inside it.
            if let Some(i) = whole[cursor..].find(m.content.as_str()) {
                cursor += i + m.content.len();
            }
            continue;
        }
        let found = format!("{pre}{}{post}", m.content);
        let Some(i) = whole[cursor..].find(&found) else { return Ok(None) };
        let start = cursor + i;
        if !whole[..start].ends_with(generation) {
            return Ok(None);
        }
        let end = start + found.len();
        pieces.push((whole[taken..start].to_string(), false));
        pieces.push((whole[start..end].to_string(), true));
        (cursor, taken) = (end, end);
    }
    pieces.push((whole[taken..].to_string(), false));
    Ok(Some(pieces))
}

/// [`chat_spans`] by rendering the chat again up to each reply (time quadratic in the chat's
/// length): for templates that rewrite the messages' text.
fn chat_spans_rerendered(
    template: &ChatTemplate,
    messages: &[Message],
) -> candle_core::Result<Vec<(String, bool)>> {
    let mut pieces = Vec::new();
    let mut done = String::new();
    for (k, m) in messages.iter().enumerate() {
        if m.role != "assistant" {
            continue;
        }
        let prompt = template.render(&messages[..k], true)?;
        pieces
            .push((prompt.strip_prefix(&done).ok_or_else(|| not_extension(k))?.to_string(), false));
        let with_reply = template.render(&messages[..=k], false)?;
        pieces.push((
            with_reply.strip_prefix(&prompt).ok_or_else(|| not_extension(k))?.to_string(),
            true,
        ));
        done = with_reply;
    }
    let whole = template.render(messages, false)?;
    let tail = whole.strip_prefix(&done).ok_or_else(|| not_extension(messages.len()))?;
    pieces.push((tail.to_string(), false));
    Ok(pieces)
}

/// The text of a `--text` or `--jsonl` file, bounded before a byte is read
/// ([`read_input`](super::train::read_input): a regular file only, at most
/// [`TEXT_INPUT_LIMIT`] bytes, and room in host memory for what tokenizing it makes); text
/// that is not UTF-8 is [`TrainError::BadData`](super::train::TrainError::BadData) saying where.
pub fn read_text_input(path: impl AsRef<Path>) -> candle_core::Result<String> {
    let path = path.as_ref();
    // Tokenizing holds the text, its encoding (ids, offsets, masks: about 40 bytes a token)
    // and the examples made from it: 16 times the text is a bound.
    let bytes = super::train::read_input(
        path,
        "the text file",
        TEXT_INPUT_LIMIT,
        16,
        "train on a smaller file, or split it",
    )?;
    String::from_utf8(bytes).map_err(|e| {
        super::train::TrainError::BadData {
            path: path.to_path_buf(),
            why: format!("not UTF-8 text (at byte {})", e.utf8_error().valid_up_to()),
        }
        .into_candle()
    })
}

/// The largest `--text` or `--jsonl` file read ([`read_text_input`]).
pub const TEXT_INPUT_LIMIT: u64 = 4 << 30;

/// Refuses a tokenizer whose vocabulary is larger than the model's (`model_vocab`, its
/// `vocab_size`): its ids past the model's would index past the embedding table. (A smaller
/// one is common: models pad their vocabulary.)
pub fn check_vocab(tokenizer: &Tokenizer, model_vocab: usize) -> candle_core::Result<()> {
    let n = tokenizer.vocab_size();
    if n > model_vocab {
        return Err(text_err(format!(
            "the tokenizer has {n} tokens, the model's vocabulary {model_vocab}: its ids past \
             {} have no embedding (another model's tokenizer? use the one beside the model)",
            model_vocab.saturating_sub(1)
        )));
    }
    Ok(())
}

/// Reads a JSONL file of training examples (one JSON object a line; blank lines skipped):
/// `{"messages": [{"role": ..., "content": ...}, ...]}` (a chat: needs `template`) or
/// `{"prompt": ..., "completion": ...}` (plain text), or `{"text": ...}` (a document). Each
/// becomes [`Tokens`] with its loss mask; `eos` ends documents and completions. An error
/// names the line: `line 2: not a JSON object (...)`.
pub fn read_jsonl(
    text: &str,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    eos: Option<u32>,
) -> candle_core::Result<Vec<Tokens>> {
    jsonl_lines(text, "line ", tokenizer, template, eos)
}

/// [`read_jsonl`] of the text of `file`: an error names the file and the line as compilers
/// do, `chats.jsonl:2: not a JSON object (...)`.
pub fn read_jsonl_file(
    file: &Path,
    text: &str,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    eos: Option<u32>,
) -> candle_core::Result<Vec<Tokens>> {
    jsonl_lines(text, &format!("{}:", file.display()), tokenizer, template, eos)
}

/// [`read_jsonl`], its errors starting with `location` and the line's number.
fn jsonl_lines(
    text: &str,
    location: &str,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    eos: Option<u32>,
) -> candle_core::Result<Vec<Tokens>> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = |why: String| text_err(format!("{location}{}: {why}", n + 1));
        let v: Value =
            serde_json::from_str(line).map_err(|e| at(format!("not a JSON object ({e})")))?;
        let field = |k: &str| -> candle_core::Result<Option<&str>> {
            match v.get(k) {
                None => Ok(None),
                Some(Value::String(s)) => Ok(Some(s)),
                Some(x) => Err(at(format!("{k} is {x}, not a string"))),
            }
        };
        let tokens = if let Some(msgs) = v.get("messages") {
            let list = msgs.as_array().ok_or_else(|| at("messages is not a list".into()))?;
            let messages = list
                .iter()
                .map(|m| {
                    let s = |k: &str| m.get(k).and_then(Value::as_str).map(str::to_string);
                    match (s("role"), s("content")) {
                        (Some(r), Some(c)) => Ok(Message::new(r, c)),
                        _ => Err(at(format!("a message {m} without a role and a content"))),
                    }
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            let template = template
                .ok_or_else(|| at("a chat (messages) needs the model's chat template".into()))?;
            // The reason on the line's own line (candle's context would put a line break first).
            Tokens::chat(tokenizer, template, &messages).map_err(|e| at(e.to_string()))?
        } else if let (Some(p), Some(c)) = (field("prompt")?, field("completion")?) {
            Tokens::completion(tokenizer, p, c, eos)?
        } else if let Some(text) = field("text")? {
            Tokens::document(tokenizer, text, eos)?
        } else {
            return Err(at(
                "neither messages, prompt and completion, nor text: one of those formats".into(),
            ));
        };
        out.push(tokens);
    }
    Ok(out)
}

/// Training rows of `seq + 1` tokens ([`pack`]): the inputs are `tokens[..seq]`, the targets
/// `tokens[1..]`, and `loss[i]` says whether target `i` counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    /// `seq + 1` token ids.
    pub tokens: Vec<u32>,
    /// `seq` flags, one per target.
    pub loss: Vec<bool>,
}

/// Packs examples end to end into rows of `seq + 1` tokens, each row starting where the last
/// one's inputs ended (so each token is a target once), as pre-training packs documents
/// (attention crosses the examples' boundaries within a row). A tail shorter than a row is
/// left out; its size is returned beside the rows. Fewer tokens than one row is an error.
///
/// ```
/// use strata::candle::text::{pack, Tokens};
/// let mut a = Tokens::default();
/// a.extend(&[1, 2, 3], false);
/// a.extend(&[4, 5], true);
/// let (rows, left) = pack(&[a.clone(), a], 3)?;
/// assert_eq!((rows.len(), left), (3, 0));
/// assert_eq!(rows[0].tokens, [1, 2, 3, 4]);
/// assert_eq!(rows[0].loss, [false, false, true]); // the targets 2, 3, 4
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn pack(examples: &[Tokens], seq: usize) -> candle_core::Result<(Vec<Row>, usize)> {
    if seq == 0 {
        return Err(text_err("rows of 0 tokens: seq must be at least 1".into()));
    }
    let total: usize = examples.iter().map(|t| t.ids.len()).sum();
    if total < seq + 1 {
        return Err(text_err(format!(
            "{total} tokens are fewer than one row of {} (seq {seq} + 1): more text, or a \
             shorter seq",
            seq + 1
        )));
    }
    let ids: Vec<u32> = examples.iter().flat_map(|t| t.ids.iter().copied()).collect();
    let loss: Vec<bool> = examples.iter().flat_map(|t| t.loss.iter().copied()).collect();
    let rows = (total - 1) / seq;
    let out = (0..rows)
        .map(|r| {
            let s = r * seq;
            Row { tokens: ids[s..s + seq + 1].to_vec(), loss: loss[s + 1..s + seq + 1].to_vec() }
        })
        .collect();
    Ok((out, total - 1 - rows * seq))
}
