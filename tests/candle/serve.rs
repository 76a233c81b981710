//! `strata serve` as its clients use it: the binary on a tiny random Llama (with a byte-level
//! tokenizer and a chat template), driven by curl over loopback. Concurrent requests each get
//! what they get alone (greedy and seeded sampling, streamed and not) while sharing passes;
//! bad requests get 400 with an OpenAI error object and the server goes on; a full queue 429
//! with Retry-After; a client that goes away frees its slot; SIGTERM finishes what is in
//! flight and exits 0.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A model directory as Hugging Face lays one out: config, random weights, tokenizer, template.
fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let config = json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 260,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "hidden_act": "silu"});
    std::fs::write(p.join("config.json"), config.to_string()).unwrap();
    std::fs::write(p.join("tokenizer.json"), super::text::byte_tokenizer_json()).unwrap();
    let template = "{% for m in messages %}{{ '<|start|>' + m['role'] + '\n' + m['content'] + \
                    '<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}\
                    {{ '<|start|>assistant\n' }}{% endif %}";
    let tc = json!({"chat_template": template, "eos_token": "<|end|>"});
    std::fs::write(p.join("tokenizer_config.json"), tc.to_string()).unwrap();
    let made = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["generate", "--init", "random", "--init-seed", "3", "--prompt-tokens", "1"])
        .args(["--max-new", "1", "--config"])
        .arg(p.join("config.json"))
        .arg("--save-model")
        .arg(p)
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    dir
}

/// A running `strata serve`, killed when dropped.
struct Server {
    child: Child,
    base: String,
}

impl Server {
    fn start(model: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["serve", "--port", "0", "--served-model-name", "tiny", "--model"])
            .arg(model)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let base = loop {
            let line = lines.next().expect("the server printed where it listens").unwrap();
            if let Some(rest) = line.strip_prefix("listening on ") {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        };
        // The rest of its output, drained so that it never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Server { child, base }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What curl got: the status, the headers (lower-cased names) and the body.
struct Reply {
    status: u16,
    headers: String,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// `curl` with `body` (POST) or without (GET); `extra` flags as given.
fn curl(url: &str, body: Option<&str>, extra: &[&str]) -> Reply {
    let mut c = Command::new("curl");
    c.args(["-s", "-i", "--max-time", "120"]).args(extra).arg(url);
    if let Some(b) = body {
        c.args(["-H", "content-type: application/json", "--data-binary", b]);
    }
    let out = c.output().expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    Reply { status, headers: head.to_lowercase(), body: body.to_string() }
}

/// A completion's text and token count, streamed or not.
fn completion(s: &Server, endpoint: &str, req: &Value) -> (String, u64, String) {
    let r = curl(&s.url(endpoint), Some(&req.to_string()), &["-N"]);
    assert_eq!(r.status, 200, "{req}: {}", r.body);
    if req["stream"] != json!(true) {
        let v = r.json();
        let c = &v["choices"][0];
        let text = c["text"].as_str().or(c["message"]["content"].as_str()).unwrap().to_string();
        let n = v["usage"]["completion_tokens"].as_u64().unwrap();
        return (text, n, c["finish_reason"].as_str().unwrap().to_string());
    }
    let events: Vec<&str> = r.body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{}", r.body);
    let (mut text, mut n, mut finish) = (String::new(), 0, String::new());
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(u) = v.get("usage") {
            n = u["completion_tokens"].as_u64().unwrap();
        }
        if let Some(c) = v["choices"].get(0) {
            text.push_str(c["text"].as_str().or(c["delta"]["content"].as_str()).unwrap_or(""));
            if let Some(f) = c["finish_reason"].as_str() {
                finish = f.to_string();
            }
        }
    }
    (text, n, finish)
}

fn metric(s: &Server, name: &str) -> f64 {
    let r = curl(&s.url("/metrics"), None, &[]);
    r.body
        .lines()
        .find_map(|l| l.strip_prefix(&format!("strata_{name} ")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no strata_{name} in {}", r.body))
}

#[test]
fn concurrent_requests_each_get_what_they_get_alone_streamed_or_not() {
    let model = model_dir();
    let s = Server::start(model.path(), &["--max-batch", "4", "--queue", "32"]);
    let models = curl(&s.url("/v1/models"), None, &[]).json();
    assert_eq!(models["data"][0]["id"], "tiny");
    let prompts = ["hello world", "he said", "a", "what is this?", "wow", "12345"];
    let mut reqs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        reqs.push((
            "/v1/completions",
            json!({"model": "tiny", "prompt": p, "max_tokens": 20,
            "temperature": 0}),
        ));
        reqs.push((
            "/v1/completions",
            json!({"model": "tiny", "prompt": p, "max_tokens": 20,
            "temperature": 0.9, "top_p": 0.95, "seed": i}),
        ));
        reqs.push((
            "/v1/chat/completions",
            json!({"model": "tiny", "max_tokens": 16,
            "messages": [{"role": "user", "content": p}], "temperature": 0}),
        ));
    }
    // Alone, one after the other.
    let alone: Vec<_> = reqs.iter().map(|(e, r)| completion(&s, e, r)).collect();
    for (text, n, finish) in &alone {
        assert!(*n >= 1 && (finish == "stop" || finish == "length"), "{text:?} {n} {finish}");
    }
    let passes = metric(&s, "passes_total");
    // All at once, not streamed and streamed: each sequence's text is what it got alone.
    for stream in [false, true] {
        let got: Vec<_> = std::thread::scope(|scope| {
            let handles: Vec<_> = reqs
                .iter()
                .map(|(e, r)| {
                    let mut r = r.clone();
                    r["stream"] = json!(stream);
                    r["stream_options"] = json!({"include_usage": true});
                    let s = &s;
                    scope.spawn(move || completion(s, e, &r))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (a, b)) in alone.iter().zip(&got).enumerate() {
            assert_eq!(a, b, "request {i} ({:?}), stream {stream}", reqs[i].1);
        }
    }
    // They shared passes: fewer passes than tokens, more than one sequence a pass on average.
    let tokens: u64 = alone.iter().map(|a| a.1).sum();
    let concurrent_passes = metric(&s, "passes_total") - passes;
    assert!(
        concurrent_passes < 2.0 * tokens as f64,
        "{concurrent_passes} passes for twice {tokens} tokens: no batching"
    );
    assert!(metric(&s, "mean_batch_size") > 1.0);
}

#[test]
fn bad_requests_get_400_with_an_error_object_and_the_server_goes_on() {
    let model = model_dir();
    let s = Server::start(model.path(), &["--max-tokens", "64", "--max-body", "4096"]);
    let long = "x".repeat(200);
    let big = "y".repeat(8000);
    let cases: Vec<(&str, String, &str)> = vec![
        ("/v1/completions", "{not json".into(), "not JSON"),
        ("/v1/completions", "[1, 2]".into(), "JSON object"),
        ("/v1/completions", json!({"model": "gpt-4", "prompt": "x"}).to_string(), "gpt-4"),
        ("/v1/completions", json!({"prompt": "x"}).to_string(), "model"),
        ("/v1/completions", json!({"model": "tiny"}).to_string(), "prompt"),
        ("/v1/completions", json!({"model": "tiny", "prompt": ""}).to_string(), "empty"),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "x", "max_tokens": 65}).to_string(),
            "limit of 64",
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": long, "max_tokens": 4}).to_string(),
            "context",
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "x".repeat(100), "max_tokens": 64}).to_string(),
            "positions",
        ),
        ("/v1/completions", json!({"model": "tiny", "prompt": "x", "n": 2}).to_string(), "n:"),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "x", "tools": []}).to_string(),
            "tools",
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "x", "temperature": -1}).to_string(),
            "temperature",
        ),
        ("/v1/completions", json!({"model": "tiny", "prompt": [1, 99999]}).to_string(), "99999"),
        ("/v1/completions", json!({"model": "tiny", "prompt": big}).to_string(), "body"),
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}).to_string(),
            "messages[0]",
        ),
        ("/v1/chat/completions", json!({"model": "tiny", "messages": []}).to_string(), "empty"),
    ];
    for (endpoint, body, want) in cases {
        let r = curl(&s.url(endpoint), Some(&body), &[]);
        assert_eq!(r.status, 400, "{body:.80}: {}", r.body);
        let e = r.json();
        let msg = e["error"]["message"].as_str().unwrap_or_else(|| panic!("{}", r.body));
        assert!(msg.contains(want), "{body:.80}: wanted {want:?} in {msg:?}");
        assert!(e["error"]["type"].is_string());
        assert_eq!(curl(&s.url("/health"), None, &[]).status, 200, "after {body:.80}");
    }
    assert_eq!(curl(&s.url("/v1/nothing"), None, &[]).status, 404);
    // And it still answers.
    let ok = json!({"model": "tiny", "prompt": "x", "max_tokens": 3});
    assert_eq!(curl(&s.url("/v1/completions"), Some(&ok.to_string()), &[]).status, 200);
}

#[test]
fn a_full_queue_answers_429_with_retry_after_and_a_gone_client_frees_its_slot() {
    let model = model_dir();
    let s = Server::start(model.path(), &["--max-batch", "1", "--queue", "1"]);
    let req = json!({"model": "tiny", "prompt": "hello", "max_tokens": 100, "temperature": 0,
        "stop": ["never seen"]})
    .to_string();
    let replies: Vec<Reply> = std::thread::scope(|scope| {
        let hs: Vec<_> = (0..10)
            .map(|_| scope.spawn(|| curl(&s.url("/v1/completions"), Some(&req), &[])))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let full: Vec<&Reply> = replies.iter().filter(|r| r.status == 429).collect();
    assert!(replies.iter().all(|r| r.status == 200 || r.status == 429));
    assert!(!full.is_empty() && full.len() < 10, "{} of 10 refused", full.len());
    assert!(full[0].headers.contains("retry-after:"), "{}", full[0].headers);
    assert_eq!(full[0].json()["error"]["code"], "queue_full");
    // A streamed request whose client gives up after a moment frees the one slot.
    let streamed = json!({"model": "tiny", "prompt": "hello", "max_tokens": 120,
        "temperature": 0, "stream": true})
    .to_string();
    let before = metric(&s, "cancelled_total");
    let _ = curl(&s.url("/v1/completions"), Some(&streamed), &["-N", "--max-time", "0.3"]);
    let t = Instant::now();
    while metric(&s, "cancelled_total") <= before {
        assert!(t.elapsed() < Duration::from_secs(30), "the abandoned sequence kept its slot");
        std::thread::sleep(Duration::from_millis(50));
    }
    let ok = json!({"model": "tiny", "prompt": "x", "max_tokens": 3});
    assert_eq!(curl(&s.url("/v1/completions"), Some(&ok.to_string()), &[]).status, 200);
}

#[test]
fn sigterm_finishes_the_requests_in_flight_and_exits_0() {
    let model = model_dir();
    let mut s = Server::start(model.path(), &["--shutdown-timeout", "60"]);
    let req = json!({"model": "tiny", "prompt": "hello", "max_tokens": 100, "temperature": 0,
        "stream": true})
    .to_string();
    let url = s.url("/v1/completions");
    let in_flight = std::thread::spawn(move || curl(&url, Some(&req), &["-N"]));
    // Until the request is decoding.
    let t = Instant::now();
    while metric(&s, "batch_size") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = s.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let t = Instant::now();
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "still running after SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status.code(), Some(0));
    let r = in_flight.join().unwrap();
    assert_eq!(r.status, 200);
    assert!(
        r.body.contains("\"finish_reason\":\"length\"")
            || r.body.contains("\"finish_reason\":\"stop\""),
        "{}",
        r.body
    );
    assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
}
