//! `strata serve` as its clients use it: the binary on a tiny random Llama (with a byte-level
//! tokenizer and a chat template), driven by curl over loopback. Concurrent requests each get
//! what they get alone (greedy and seeded sampling, streamed and not) while sharing passes;
//! bad requests get 400 with an OpenAI error object and the server goes on; a full queue 429
//! with Retry-After; a client that goes away frees its slot; SIGTERM finishes what is in
//! flight and exits 0, without waiting for connections that hold no request; a second SIGTERM
//! exits at once.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
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

/// A config beside the model's with room for `positions` (the same weights): for answers
/// longer than the model's 128 positions allow.
fn with_positions(model: &Path, positions: u64) -> std::path::PathBuf {
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    cfg["max_position_embeddings"] = positions.into();
    let path = model.join(format!("positions-{positions}.json"));
    std::fs::write(&path, cfg.to_string()).unwrap();
    path
}

/// A running `strata serve`, killed when dropped.
struct Server {
    child: Child,
    base: String,
    /// What it printed after "listening on".
    out: Arc<Mutex<Vec<String>>>,
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
        // The rest of its output, kept, and drained so that it never blocks on a full pipe.
        let out = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&out);
        std::thread::spawn(move || {
            lines.map_while(Result::ok).for_each(|l| kept.lock().unwrap().push(l))
        });
        Server { child, base, out }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `host:port`, for a raw TCP client.
    fn addr(&self) -> &str {
        self.base.strip_prefix("http://").unwrap()
    }

    fn signal(&self, name: &str) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args([&format!("-{name}"), &pid]).status().unwrap().success());
    }

    /// Its exit status, or `None` if it still runs after `limit`.
    fn exit_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Some(st) = self.child.try_wait().unwrap() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
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
                    if stream {
                        r["stream_options"] = json!({"include_usage": true});
                    }
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
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": true}})
                .to_string(),
            "stream_options",
        ),
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
    // The field that is wrong is the error's param, unknown fields included.
    for (body, param) in [
        (json!({"model": "tiny", "prompt": "x", "tools": []}), "tools"),
        (json!({"model": "tiny", "prompt": "x", "n": 2}), "n"),
        (json!({"model": "tiny", "prompt": "x", "stream_options": {}}), "stream_options"),
        (json!({"model": "gpt-4", "prompt": "x"}), "model"),
    ] {
        let r = curl(&s.url("/v1/completions"), Some(&body.to_string()), &[]);
        assert_eq!(r.json()["error"]["param"], param, "{body}: {}", r.body);
    }
    // Past --max-body: 413; a wrong method: 405; both with an error object.
    let too_big = json!({"model": "tiny", "prompt": big}).to_string();
    for (url, body, extra, status, want) in [
        ("/v1/completions", Some(too_big.as_str()), &[][..], 413, "--max-body"),
        ("/v1/completions", None, &[][..], 405, "POST"),
        ("/v1/chat/completions", None, &[][..], 405, "POST"),
        ("/v1/models", None, &["-X", "POST"][..], 405, "GET"),
    ] {
        let r = curl(&s.url(url), body, extra);
        assert_eq!(r.status, status, "{url}: {}", r.body);
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains(want), "{url}: wanted {want:?} in {msg:?}");
    }
    // OpenAI's retrieve: the served model, and 404 with an error object for another.
    let m = curl(&s.url("/v1/models/tiny"), None, &[]);
    assert_eq!(m.status, 200, "{}", m.body);
    assert_eq!(
        (m.json()["id"].clone(), m.json()["object"].clone()),
        (json!("tiny"), json!("model"))
    );
    let other = curl(&s.url("/v1/models/gpt-4"), None, &[]);
    assert_eq!(other.status, 404, "{}", other.body);
    assert_eq!(other.json()["error"]["code"], "model_not_found");
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

/// Unseeded sampled requests that arrive together each draw their own seed (they all got the
/// same one, and the same text, from the time in seconds and a counter that had not moved).
#[test]
fn unseeded_requests_that_arrive_together_get_texts_of_their_own() {
    let model = model_dir();
    let s = Server::start(model.path(), &["--max-batch", "8"]);
    // 24 tokens sampled at temperature 1 from a random model: two alike by chance, never.
    let req = json!({"model": "tiny", "prompt": "hello", "max_tokens": 24, "temperature": 1,
        "stop": ["never seen"]});
    let texts: Vec<String> = std::thread::scope(|scope| {
        let hs: Vec<_> =
            (0..8).map(|_| scope.spawn(|| completion(&s, "/v1/completions", &req).0)).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let distinct: HashSet<&String> = texts.iter().collect();
    assert_eq!(distinct.len(), 8, "{texts:?}");
}

/// The address is taken before the model loads: a port in use is said at once, naming it, and
/// nothing is loaded; names (`localhost`) and bare IPv6 addresses are hosts.
#[test]
fn a_port_in_use_is_refused_before_the_model_loads_and_names_resolve() {
    let model = model_dir();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--host", "127.0.0.1", "--port", &port, "--model"])
        .arg(model.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("serve on a port in use still runs");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&format!("127.0.0.1:{port}")) && stderr.contains("in use"), "{stderr}");
    // The load prints the model's summary and its stop tokens: neither happened.
    assert!(stdout.is_empty(), "loaded before refusing the port: {stdout}");
    drop(taken);
    let mut hosts = vec!["localhost"];
    if std::net::TcpListener::bind("[::1]:0").is_ok() {
        hosts.push("::1");
    } else {
        eprintln!("SKIP --host ::1: this machine has no IPv6 loopback");
    }
    for host in hosts {
        let s = Server::start(model.path(), &["--host", host]);
        assert_eq!(curl(&s.url("/health"), None, &[]).status, 200, "--host {host}");
    }
}

/// Slow clients: headers that never end are cut off after --read-timeout, a body that never
/// ends is answered 408; and neither holds up shutdown: a connection with its headers half
/// sent is closed at once on SIGTERM, long before --shutdown-timeout.
#[test]
fn slow_clients_time_out_and_do_not_hold_shutdown() {
    let model = model_dir();
    let mut s = Server::start(model.path(), &["--read-timeout", "1", "--shutdown-timeout", "60"]);
    let connect = || {
        let c = TcpStream::connect(s.addr()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        c
    };
    // Headers that stop midway: the connection is closed.
    let mut c = connect();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le").unwrap();
    let t = Instant::now();
    let mut got = Vec::new();
    let _ = c.read_to_end(&mut got);
    assert!(t.elapsed() < Duration::from_secs(10), "half-sent headers held for {:?}", t.elapsed());
    // A body that stops midway: 408 with an error object.
    let mut c = connect();
    c.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"model\":",
    )
    .unwrap();
    let mut got = String::new();
    let _ = c.read_to_string(&mut got);
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("--read-timeout"), "{got}");
    // Now a slow client with its headers half sent, and SIGTERM: exit 0 at once.
    let mut slow = connect();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    s.signal("TERM");
    let t = Instant::now();
    let status = s.exit_within(Duration::from_secs(30)).expect("still running after SIGTERM");
    assert!(t.elapsed() < Duration::from_secs(5), "shutdown waited {:?}", t.elapsed());
    assert_eq!(status.code(), Some(0));
}

/// A second SIGTERM while the first drains exits at once, non-zero, and says so.
#[test]
fn a_second_sigterm_during_the_drain_exits_at_once() {
    let model = model_dir();
    let mut s = Server::start(model.path(), &["--read-timeout", "60", "--shutdown-timeout", "60"]);
    // A request in flight that the drain waits for: its body still coming.
    let mut c = TcpStream::connect(s.addr()).unwrap();
    c.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"model\":",
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    s.signal("TERM");
    assert!(s.exit_within(Duration::from_millis(1500)).is_none(), "the drain did not wait");
    s.signal("TERM");
    let status =
        s.exit_within(Duration::from_secs(5)).expect("still running after a second SIGTERM");
    assert_eq!(status.code(), Some(143), "128 + SIGTERM");
    std::thread::sleep(Duration::from_millis(100));
    let out = s.out.lock().unwrap().join("\n");
    assert!(out.contains("SIGTERM during the drain: exiting now"), "{out}");
}

/// A request whose client went away is still counted: in requests_total (as 499, the client
/// closed the request) and in cancelled_total, waiting in the queue as well as in the batch.
#[test]
fn requests_whose_clients_went_away_are_counted() {
    let model = model_dir();
    // Room for a long answer: the same weights with 2,048 positions.
    let long = with_positions(model.path(), 2048);
    let s = Server::start(
        model.path(),
        &["--config", long.to_str().unwrap(), "--max-batch", "1", "--max-tokens", "2000"],
    );
    let a = json!({"model": "tiny", "prompt": "hello", "max_tokens": 2000, "temperature": 0,
        "stop": ["never seen"], "stream": true})
    .to_string();
    let b = json!({"model": "tiny", "prompt": "hello", "max_tokens": 3}).to_string();
    std::thread::scope(|scope| {
        // A holds the one slot for seconds; B waits in the queue, and its client gives up.
        let url = s.url("/v1/completions");
        let hold =
            scope.spawn(|| curl(&s.url("/v1/completions"), Some(&a), &["-N", "--max-time", "3"]));
        let t = Instant::now();
        while metric(&s, "batch_size") < 1.0 {
            assert!(t.elapsed() < Duration::from_secs(30));
            std::thread::sleep(Duration::from_millis(5));
        }
        let r = curl(&url, Some(&b), &["--max-time", "0.5"]);
        assert_eq!(r.status, 0, "B was answered: {}", r.body);
        assert!(metric(&s, "queue_depth") >= 1.0 || metric(&s, "batch_size") >= 1.0);
        hold.join().unwrap();
    });
    // A's client gave up in the batch, B's in the queue: both cancelled, B counted as 499.
    let t = Instant::now();
    while metric(&s, "cancelled_total") < 2.0 {
        assert!(t.elapsed() < Duration::from_secs(30), "cancelled_total stayed below 2");
        std::thread::sleep(Duration::from_millis(50));
    }
    let body = curl(&s.url("/metrics"), None, &[]).body;
    assert!(
        body.contains("strata_requests_total{endpoint=\"completions\",status=\"499\"} 1"),
        "{body}"
    );
}

/// Flags refused by name before anything loads: an empty served name, a zero body limit; and a
/// batch that cannot fit in host memory names serve's own flags.
#[test]
fn bad_serve_flags_are_refused_with_the_flags_that_fix_them() {
    for (flags, want) in [
        (&["--served-model-name", ""][..], "--served-model-name"),
        (&["--max-body", "0"][..], "--max-body"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["serve", "--model", "/nonexistent"])
            .args(flags)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(want), "{flags:?}: {err}");
    }
    let model = model_dir();
    let huge = with_positions(model.path(), 1 << 30);
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--port", "0", "--max-batch", "4096", "--context", "1073741824"])
        .args(["--config", huge.to_str().unwrap(), "--model"])
        .arg(model.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--max-batch") && err.contains("--context"), "{err}");
    assert!(!err.contains("--layers") && !err.contains("--rows"), "{err}");
}

/// `strata chat` (on the same model): Ctrl-C during an answer stops it and comes back to the
/// prompt; Ctrl-C at the prompt exits 130.
#[test]
fn chat_ctrl_c_stops_an_answer_and_at_the_prompt_exits_130() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let model = model_dir();
    let long = with_positions(model.path(), 4096);
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["chat", "--config", long.to_str().unwrap(), "--max-new", "4000", "--model"])
        .arg(model.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let printed = Arc::new(AtomicUsize::new(0));
    let mut stdout = child.stdout.take().unwrap();
    let p = Arc::clone(&printed);
    std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        while let Ok(n @ 1..) = stdout.read(&mut buf) {
            p.fetch_add(n, Ordering::SeqCst);
        }
    });
    let said = Arc::new(Mutex::new(String::new()));
    let mut stderr = child.stderr.take().unwrap();
    let s = Arc::clone(&said);
    std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        while let Ok(n @ 1..) = stderr.read(&mut buf) {
            s.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    let wait = |what: &str, done: &dyn Fn() -> bool| {
        let t = Instant::now();
        while !done() {
            assert!(t.elapsed() < Duration::from_secs(60), "{what}: {}", said.lock().unwrap());
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let int = |child: &Child| {
        let pid = child.id().to_string();
        assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    };
    child.stdin.as_mut().unwrap().write_all(b"hello\n").unwrap();
    wait("the answer begins", &|| printed.load(Ordering::SeqCst) > 0);
    int(&child);
    wait("the answer stops", &|| said.lock().unwrap().contains("(stopped by Ctrl-C"));
    wait("the prompt again", &|| said.lock().unwrap().trim_end().ends_with('>'));
    assert!(child.try_wait().unwrap().is_none(), "Ctrl-C during an answer ended chat");
    int(&child);
    let t = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "Ctrl-C at the prompt did not exit");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status.code(), Some(130), "{}", said.lock().unwrap());
}
