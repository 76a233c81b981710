//! Text in, text out (feature `text`): a byte-level BPE tokenizer (GPT-2's layout, as
//! SmolLM2's) built here, streamed decoding that holds back partial characters, chat templates
//! rendered as transformers renders them, and training examples with their loss masks.

use strata::candle::text::{
    pack, read_jsonl, ChatTemplate, Message, TextStream, Tokenizer, Tokens,
};

/// A byte-level BPE tokenizer: every byte a token, two merges, two special tokens.
fn byte_tokenizer() -> Tokenizer {
    Tokenizer::from_json(&byte_tokenizer_json()).unwrap()
}

/// [`byte_tokenizer`]'s `tokenizer.json`: 260 tokens, `<|end|>` 0 and `<|start|>` 1.
pub fn byte_tokenizer_json() -> String {
    // GPT-2's bytes_to_unicode: the printable bytes as themselves, the others from U+0100 on.
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut extra = 0;
    let mut alphabet: Vec<char> = (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            }
        })
        .collect();
    alphabet.sort();
    let mut vocab = serde_json::Map::new();
    vocab.insert("<|end|>".into(), 0.into());
    vocab.insert("<|start|>".into(), 1.into());
    for (i, c) in alphabet.iter().enumerate() {
        vocab.insert(c.to_string(), (i + 2).into());
    }
    let n = vocab.len();
    vocab.insert("he".into(), n.into());
    vocab.insert("Ġw".into(), (n + 1).into());
    let added = |id: usize, s: &str| {
        serde_json::json!({"id": id, "content": s, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": true, "use_regex": true});
    let j = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [added(0, "<|end|>"), added(1, "<|start|>")],
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab,
            "merges": [["h", "e"], ["Ġ", "w"]]}
    });
    j.to_string()
}

#[test]
fn text_round_trips_and_streams_whole_characters() {
    let t = byte_tokenizer();
    let text = "he said: héllo wörld 🙂 ok";
    let ids = t.encode(text, false).unwrap();
    assert_eq!(t.decode(&ids, false).unwrap(), text);
    assert!(ids.len() > text.chars().count(), "multi-byte characters are several tokens");
    let mut s = TextStream::new(&t);
    let mut out = String::new();
    for &id in &ids {
        if let Some(piece) = s.push(id).unwrap() {
            assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
            out.push_str(&piece);
        }
    }
    out.push_str(&s.finish().unwrap());
    assert_eq!(out, text);
    // 🙂 is 4 bytes, 4 tokens: nothing is printed until its last.
    let smile = t.encode("🙂", false).unwrap();
    assert_eq!(smile.len(), 4);
    let mut s = TextStream::new(&t);
    for &id in &smile[..3] {
        assert_eq!(s.push(id).unwrap(), None, "a partial character is held back");
    }
    assert_eq!(s.push(smile[3]).unwrap().as_deref(), Some("🙂"));
    // Special tokens written in the text are their ids, and left out of the stream.
    let ids = t.encode("<|start|>he<|end|>", false).unwrap();
    assert_eq!((ids[0], ids[ids.len() - 1]), (1, 0));
    let mut s = TextStream::new(&t);
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&s.push(id).unwrap().unwrap_or_default());
    }
    assert_eq!(out, "he");
    let e = t.decode(&[100_000], false).unwrap_err().to_string();
    assert!(e.contains("past the tokenizer's vocabulary"), "{e}");
    assert!(Tokenizer::from_json("{}").is_err());
    // A device or a directory is refused before a byte is read (/dev/zero never ends).
    for bad in ["/dev/zero", "/"] {
        let e = Tokenizer::from_file(bad).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{bad}: {e}");
        let e = ChatTemplate::from_file(bad).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{bad}: {e}");
    }
}

/// SmolLM2-Instruct's template (ChatML with a default system prompt), with this tokenizer's
/// special tokens.
fn chatml() -> ChatTemplate {
    ChatTemplate::new(
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
         {{ '<|start|>system\nBe brief.<|end|>\n' }}{% endif %}\
         {{'<|start|>' + message['role'] + '\n' + message['content'] + '<|end|>' + '\n'}}\
         {% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant\n' }}{% endif %}",
        None,
        Some("<|end|>".into()),
    )
    .unwrap()
}

#[test]
fn chat_templates_render_as_transformers_and_raise() {
    let t = chatml();
    let chat = [Message::new("user", "hi")];
    assert_eq!(
        t.render(&chat, true).unwrap(),
        "<|start|>system\nBe brief.<|end|>\n<|start|>user\nhi<|end|>\n<|start|>assistant\n"
    );
    // lstrip_blocks and trim_blocks, Python string methods, raise_exception.
    let strict = ChatTemplate::new(
        "{% for m in messages %}\n  {% if m.role not in ['user', 'assistant'] %}\n    \
         {{ raise_exception('Only user and assistant roles are supported!') }}\n  {% endif %}\n\
         {{ m.content.strip().upper() }}|\n{% endfor %}",
        None,
        None,
    )
    .unwrap();
    assert_eq!(strict.render(&[Message::new("user", "  a b ")], false).unwrap(), "A B|\n");
    let e = strict.render(&[Message::new("tool", "x")], false).unwrap_err().to_string();
    assert!(e.contains("Only user and assistant roles are supported!"), "{e}");
    assert!(ChatTemplate::new("{% if %}", None, None).is_err());
    // From a tokenizer_config.json, or transformers 5's chat_template.jinja beside it.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tokenizer_config.json");
    std::fs::write(&cfg, r#"{"eos_token": {"content": "<|end|>"}, "bos_token": "<s>"}"#).unwrap();
    assert!(ChatTemplate::from_file(&cfg).unwrap_err().to_string().contains("no chat_template"));
    std::fs::write(dir.path().join("chat_template.jinja"), "{{ bos_token }}{{ eos_token }}")
        .unwrap();
    let t = ChatTemplate::from_file(&cfg).unwrap();
    assert_eq!(
        (t.render(&[], false).unwrap().as_str(), t.eos_token()),
        ("<s><|end|>", Some("<|end|>"))
    );
}

#[test]
fn chats_have_the_loss_on_the_replies_only_and_pack_into_rows() {
    let (tok, t) = (byte_tokenizer(), chatml());
    let chat = [
        Message::new("user", "hi"),
        Message::new("assistant", "hello"),
        Message::new("user", "why"),
        Message::new("assistant", "we"),
    ];
    let x = Tokens::chat(&tok, &t, &chat).unwrap();
    assert_eq!(x.ids.len(), x.loss.len());
    // The tokens are the whole chat's text, and the counted ones are the replies with their
    // end of turn.
    assert_eq!(tok.decode(&x.ids, false).unwrap(), t.render(&chat, false).unwrap());
    let counted: Vec<u32> =
        x.ids.iter().zip(&x.loss).filter(|&(_, &l)| l).map(|(&i, _)| i).collect();
    assert_eq!(tok.decode(&counted, false).unwrap(), "hello<|end|>\nwe<|end|>\n");
    assert!(Tokens::chat(&tok, &t, &chat[..1]).is_err(), "no reply to learn");
    let (rows, left) = pack(&[x.clone(), x.clone()], 16).unwrap();
    let total = 2 * x.ids.len();
    assert_eq!((rows.len(), left), ((total - 1) / 16, (total - 1) % 16));
    let twice: Vec<bool> = x.loss.iter().chain(&x.loss).copied().collect();
    let ids: Vec<u32> = x.ids.iter().chain(&x.ids).copied().collect();
    for (r, row) in rows.iter().enumerate() {
        assert_eq!((row.tokens.len(), row.loss.len()), (17, 16));
        assert_eq!(row.tokens, ids[r * 16..r * 16 + 17]);
        assert_eq!(row.loss, twice[r * 16 + 1..r * 16 + 17]);
    }
    let e = pack(&[x], 10_000).unwrap_err().to_string();
    assert!(e.contains("fewer than one row"), "{e}");
}

#[test]
fn jsonl_examples_of_each_format_and_errors_by_line() {
    let (tok, t) = (byte_tokenizer(), chatml());
    let jsonl = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}]}

{"prompt": "he", "completion": " we"}
{"text": "hello"}"#;
    let ex = read_jsonl(jsonl, &tok, Some(&t), Some(0)).unwrap();
    assert_eq!(ex.len(), 3);
    assert_eq!(
        ex[0],
        Tokens::chat(&tok, &t, &[Message::new("user", "hi"), Message::new("assistant", "he")])
            .unwrap()
    );
    let c = &ex[1];
    assert_eq!(c.loss, [false, true, true, true]); // "he" | " w" "e" and the EOS
    assert_eq!(c.ids.last(), Some(&0));
    assert!(ex[2].loss.iter().all(|&l| l));
    for (bad, says) in [
        ("{\"messages\": []}\n[1]", "line 1"),
        ("{\"text\": \"a\"}\n[1]", "line 2: neither"),
        ("{\"messages\": [{\"role\": \"user\"}]}", "line 1: a message"),
        ("nope", "line 1: not a JSON object"),
    ] {
        let e = read_jsonl(bad, &tok, Some(&t), None).unwrap_err().to_string();
        assert!(e.contains(says), "{bad}: {e}");
    }
    let e = read_jsonl(jsonl, &tok, None, None).unwrap_err().to_string();
    assert!(e.contains("needs the model's chat template"), "{e}");
}

/// Issue 40, finding 5: a chat is rendered once, not once per reply (2,000 messages took 5.2 s
/// before), with the same loss mask as a short chat's. Timed as a ratio, so that a loaded machine
/// cannot fail it: eight times the messages take about eight times as long when the work is
/// linear in the chat (the fastest of three runs of each, interleaved), and 25 times or more
/// when anything is redone per reply (rendering, or searching the spans from the start: its
/// quadratic part grows 64 times, the tokenizer's linear part dilutes it). A chat rendered
/// once per reply past 64 replies is refused (`unwrap` fails).
#[test]
fn a_long_chat_is_rendered_once() {
    let (tok, t) = (byte_tokenizer(), chatml());
    let chat_of = |n: usize| -> Vec<Message> {
        (0..n)
            .map(|i| match i % 2 {
                0 => Message::new("user", format!("q{i}")),
                _ => Message::new("assistant", format!("a{i}")),
            })
            .collect()
    };
    let (short, chat) = (chat_of(250), chat_of(2000));
    let timed = |c: &[Message]| {
        let t0 = std::time::Instant::now();
        let x = Tokens::chat(&tok, &t, c).unwrap();
        (t0.elapsed().as_secs_f64(), x)
    };
    let (mut fast_short, mut fast_long) = (f64::MAX, f64::MAX);
    let mut x = None;
    for _ in 0..3 {
        fast_short = fast_short.min(timed(&short).0);
        let (took, long) = timed(&chat);
        fast_long = fast_long.min(took);
        x = Some(long);
    }
    let x = x.expect("ran");
    let ratio = fast_long / fast_short;
    assert!(
        ratio < 16.0,
        "8x the messages took {ratio:.1}x as long ({fast_long:.3} s): rendered per reply?"
    );
    assert_eq!(tok.decode(&x.ids, false).unwrap(), t.render(&chat, false).unwrap());
    let counted: Vec<u32> =
        x.ids.iter().zip(&x.loss).filter(|&(_, &l)| l).map(|(&i, _)| i).collect();
    let want: String = (0..1000).map(|k| format!("a{}<|end|>\n", 2 * k + 1)).collect();
    assert_eq!(tok.decode(&counted, false).unwrap(), want);
}

/// A template that rewrites the messages' text (here: trims it) is rendered again up to each
/// reply, for short chats; a long one is refused rather than taking time quadratic in it.
#[test]
fn a_template_that_rewrites_messages_is_rendered_per_reply_up_to_a_bound() {
    use strata::candle::text::CHAT_TURNS_RERENDERED;
    let tok = byte_tokenizer();
    let t = ChatTemplate::new(
        "{% for m in messages %}<|start|>{{ m.role }}\n{{ m.content | trim }}<|end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|start|>assistant\n{% endif %}",
        None,
        None,
    )
    .unwrap();
    let chat = [
        Message::new("user", " hi "),
        Message::new("assistant", " yo "),
        Message::new("user", "ok"),
        Message::new("assistant", "  fine"),
    ];
    let x = Tokens::chat(&tok, &t, &chat).unwrap();
    let counted: Vec<u32> =
        x.ids.iter().zip(&x.loss).filter(|&(_, &l)| l).map(|(&i, _)| i).collect();
    assert_eq!(tok.decode(&counted, false).unwrap(), "yo<|end|>\nfine<|end|>\n");
    let long: Vec<Message> = (0..2 * (CHAT_TURNS_RERENDERED + 1))
        .map(|i| Message::new(if i % 2 == 0 { "user" } else { "assistant" }, " x "))
        .collect();
    let e = Tokens::chat(&tok, &t, &long).unwrap_err().to_string();
    assert!(e.contains("split the chat"), "{e}");
}

/// Issue 40, finding 4: a template that loops without end, or emits without end, is an error
/// within its bounds, not a hang or an abort for memory.
#[test]
fn templates_run_within_an_instruction_and_output_bound() {
    let chat = [Message::new("user", "hi")];
    let mut loops = ChatTemplate::new(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        None,
        None,
    )
    .unwrap();
    loops.set_limits(200_000, 1 << 20);
    let e = loops.render(&chat, false).unwrap_err().to_string();
    assert!(e.contains("instructions"), "{e}");
    let mut emits = ChatTemplate::new(
        "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}",
        None,
        None,
    )
    .unwrap();
    emits.set_limits(u64::MAX, 1 << 16);
    let e = emits.render(&chat, false).unwrap_err().to_string();
    assert!(e.contains("grew past"), "{e}");
}

/// Issue 40, findings 3 and 10: `--text` and `--jsonl` files are regular files, bounded and
/// UTF-8; a chat template beside the tokenizer that does not parse is reported, not taken for
/// none; a tokenizer larger than the model's vocabulary is refused.
#[test]
fn text_inputs_are_bounded_and_checked() {
    use strata::candle::text::{check_vocab, read_text_input};
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let cases = vec![
        (std::path::PathBuf::from("/dev/zero"), "character device"),
        (fifo, "FIFO"),
        (dir.path().to_path_buf(), "directory"),
        (latin1, "not UTF-8 text (at byte 3)"),
    ];
    let n = cases.len();
    std::thread::spawn(move || {
        for (p, want) in cases {
            tx.send((want, read_text_input(&p).map_err(|e| e.to_string()))).unwrap();
        }
    });
    for _ in 0..n {
        let (want, got) = rx.recv_timeout(std::time::Duration::from_secs(20)).expect("a hang");
        let e = got.expect_err(want);
        assert!(e.contains(want), "{want}: {e}");
    }
    let ok = dir.path().join("ok.txt");
    std::fs::write(&ok, "hello").unwrap();
    assert_eq!(read_text_input(&ok).unwrap(), "hello");

    let tok_path = dir.path().join("tokenizer.json");
    assert!(ChatTemplate::beside(&tok_path).unwrap().is_none(), "no template: none");
    let cfg = dir.path().join("tokenizer_config.json");
    std::fs::write(&cfg, r#"{"chat_template": "{% for m in messages %}{{ m.content }}"}"#).unwrap();
    let e = ChatTemplate::beside(&tok_path).unwrap_err().to_string();
    assert!(e.contains("does not parse"), "{e}");
    std::fs::write(&cfg, r#"{"chat_template": "{{ messages[0].content }}"}"#).unwrap();
    assert!(ChatTemplate::beside(&tok_path).unwrap().is_some());

    let tok = byte_tokenizer();
    check_vocab(&tok, tok.vocab_size()).unwrap();
    check_vocab(&tok, tok.vocab_size() + 10).unwrap();
    let e = check_vocab(&tok, tok.vocab_size() - 1).unwrap_err().to_string();
    assert!(e.contains("tokenizer has") && e.contains("no embedding"), "{e}");
}
