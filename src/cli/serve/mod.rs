//! `strata serve`: an OpenAI-compatible HTTP server over an out-of-core model (axum on tokio),
//! with continuous batching ([`engine`]): `GET /v1/models`, `POST /v1/completions` and
//! `POST /v1/chat/completions` (streamed as server-sent events ending in `data: [DONE]`, or
//! not), `GET /health` and Prometheus `GET /metrics`.
//!
//! ```text
//! strata serve --model HuggingFaceTB/SmolLM2-135M-Instruct --device-budget 64MiB --port 8080
//! curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \
//!     -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'
//! ```
//!
//! A bad request is answered 400 with an OpenAI error object naming what is wrong (malformed
//! JSON, an unknown model or field, `max_tokens` past `--max-tokens`, a prompt past the
//! context); a full queue 429 with `Retry-After`; a client that disconnects frees its slot at
//! the next pass. SIGTERM or Ctrl-C: the server stops taking requests, finishes those in
//! flight within `--shutdown-timeout` seconds (closing at once the connections that hold no
//! request), and exits 0; a second SIGTERM or Ctrl-C exits at once, non-zero. Headers and
//! bodies are read within `--read-timeout` seconds each.

pub mod engine;
pub mod http;
pub mod metrics;

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{FromRequest, Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use crossbeam::channel::{Sender, TrySendError};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use crate::cli::model::{Llm, ModelFlags};
use engine::{Event, Finish, Job, Settings};
use metrics::Metrics;
use strata::candle::text::{ChatTemplate, Message, Tokenizer};
use strata::candle::Sampling;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// `strata serve`'s flags.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelFlags,
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The port to listen on (0: any free port; the one taken is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// The model's name in the API (default: the last part of --model).
    #[arg(long, value_name = "NAME", value_parser = non_empty)]
    pub served_model_name: Option<String>,
    /// Sequences decoding at once (one pass of the weights serves them all).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub max_batch: u64,
    /// Requests waiting beyond the batch; past that, 429.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub queue: u64,
    /// The most `max_tokens` a request may ask for.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_tokens: u64,
    /// Positions a sequence may hold, prompt and new tokens (default: the model's
    /// max_position_embeddings, at most 4096).
    #[arg(long, value_parser = clap::value_parser!(u64).range(2..))]
    pub context: Option<u64>,
    /// The largest request body, in bytes (a larger one: 413).
    #[arg(long, default_value_t = 1 << 20, value_parser = at_least_one_byte)]
    pub max_body: usize,
    /// Seconds to finish requests in flight after SIGTERM or Ctrl-C (a second one stops at
    /// once).
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// Seconds a client has to send a request's headers, and then its body (past them: the
    /// connection is closed, or 408).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub read_timeout: u64,
}

fn non_empty(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("an empty name: clients send it as \"model\"; give a name, or leave the \
                    flag out for the last part of --model"
            .into());
    }
    Ok(s.to_string())
}

fn at_least_one_byte(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("0 bytes would refuse every request: at least 1 (default 1048576)".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s:?}: a number of bytes ({e})")),
    }
}

/// What every handler shares.
struct App {
    name: String,
    created: u64,
    jobs: Sender<Job>,
    tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    eos: Vec<u32>,
    vocab: usize,
    context: usize,
    max_tokens: usize,
    metrics: Arc<Metrics>,
    stopping: AtomicBool,
    next_id: AtomicU64,
    /// Unseeded requests: each draws the next number, hashed with the time and this process's
    /// random keys, so requests that arrive together still get seeds of their own.
    next_seed: AtomicU64,
    seed_keys: RandomState,
    /// How long a request's body may take to arrive.
    read_timeout: Duration,
    max_body: usize,
}

/// An error answered as OpenAI answers one.
struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    /// The request's field that is wrong.
    param: Option<String>,
    code: Option<&'static str>,
}

impl ApiError {
    fn bad(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    fn param(mut self, field: &str) -> ApiError {
        self.param = Some(field.to_string());
        self
    }

    fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    fn response(&self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind,
            "param": self.param, "code": self.code}});
        let mut r = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}

/// Which endpoint a request came to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    fn name(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat_completions",
        }
    }
}

/// A request, read and checked.
struct Request {
    prompt: Vec<u32>,
    max_new: usize,
    sampling: Sampling,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
}

/// Runs `strata serve` with these flags until SIGTERM or Ctrl-C.
pub fn run(args: ServeArgs) -> Res<()> {
    // Before the model loads: a host that does not resolve or a port in use is said at once.
    let listener = http::bind(&args.host, args.port)?;
    let probe = crate::cli::model::resolve(&args.model.model)?;
    let config = probe.llama_config(args.model.config.as_deref())?;
    let context = match args.context {
        Some(c) => usize::try_from(c).map_err(|_| "--context: too large")?,
        None => config.max_position_embeddings.min(4096),
    };
    if context > config.max_position_embeddings {
        return Err(format!(
            "--context {context}: past the model's max_position_embeddings {}",
            config.max_position_embeddings
        )
        .into());
    }
    let max_batch = args.max_batch as usize;
    let positions = context.checked_mul(max_batch).ok_or("--context × --max-batch overflows")?;
    let max_tokens = usize::try_from(args.max_tokens).unwrap_or(usize::MAX).min(context - 1);
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        let s = args.model.model.to_string_lossy();
        s.trim_end_matches('/').rsplit('/').next().unwrap_or("model").to_string()
    });
    let queue = args.queue as usize;
    let (jobs, rx) = crossbeam::channel::bounded::<Job>(queue);
    // The model lives on the engine's thread; what the handlers need comes back from it.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Res<Ready>>();
    let flags = args.model.clone();
    let engine =
        std::thread::Builder::new().name("strata-serve-engine".into()).spawn(move || {
            let from = "a smaller --max-batch or --context: --max-batch × --context";
            let llm = match Llm::load(&flags, positions, from) {
                Ok(l) => l,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let store = Arc::clone(llm.model.layers().store());
            let mut machine = strata::Machine::unknown("this machine");
            let h2d = machine.measure_link(&store).ok().and(machine.h2d).unwrap_or(0.0);
            let metrics = Arc::new(Metrics::new(store, h2d));
            let tokenizer = Arc::new(llm.text.tokenizer);
            let ready = Ready {
                summary: llm.summary,
                tokenizer: Arc::clone(&tokenizer),
                template: llm.text.template,
                eos: llm.text.eos,
                eos_from: llm.text.eos_from,
                metrics: Arc::clone(&metrics),
            };
            if ready_tx.send(Ok(ready)).is_err() {
                return;
            }
            engine::run(&llm.model, &tokenizer, &rx, &Settings { max_batch }, &metrics);
        })?;
    let ready = ready_rx.recv().map_err(|_| "the engine thread ended while loading")??;
    out!("{}", ready.summary)?;
    out!("stops at {:?} ({})", ready.eos, ready.eos_from)?;
    let app = Arc::new(App {
        name,
        created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        jobs,
        tokenizer: ready.tokenizer,
        template: ready.template,
        eos: ready.eos,
        vocab: config.vocab_size,
        context,
        max_tokens,
        metrics: ready.metrics,
        stopping: AtomicBool::new(false),
        next_id: AtomicU64::new(0),
        next_seed: AtomicU64::new(0),
        seed_keys: RandomState::new(),
        read_timeout: Duration::from_secs(args.read_timeout),
        max_body: args.max_body,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("strata-serve")
        .build()?;
    let served = runtime.block_on(serve(Arc::clone(&app), &args, listener));
    // Every sender gone: the engine finishes what it holds and returns.
    drop(app);
    runtime.shutdown_timeout(Duration::from_secs(1));
    served?;
    engine.join().map_err(|_| "the engine thread panicked")?;
    out!("stopped")?;
    Ok(())
}

/// What the engine thread hands back once the model is loaded.
struct Ready {
    summary: String,
    tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    eos: Vec<u32>,
    eos_from: String,
    metrics: Arc<Metrics>,
}

/// Serves the API on `listener` until SIGTERM or Ctrl-C ([`http::serve`]).
async fn serve(app: Arc<App>, args: &ServeArgs, listener: std::net::TcpListener) -> Res<()> {
    let local = listener.local_addr()?;
    out!("listening on http://{local} (model {:?}); SIGTERM or Ctrl-C stops", app.name)?;
    let router = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(args.max_body))
        .with_state(Arc::clone(&app));
    let timeouts = http::Timeouts {
        shutdown: Duration::from_secs(args.shutdown_timeout),
        read: Duration::from_secs(args.read_timeout),
    };
    http::serve(listener, router, timeouts, move || app.stopping.store(true, Ordering::SeqCst))
        .await
}

async fn not_found() -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message:
            "no such endpoint: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics"
                .into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
    }
    .response()
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let allowed = match uri.path() {
        "/v1/completions" | "/v1/chat/completions" => "POST",
        _ => "GET",
    };
    let mut r = ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!("{method} {}: this endpoint takes {allowed}", uri.path()),
        kind: "invalid_request_error",
        param: None,
        code: Some("method_not_allowed"),
    }
    .response();
    r.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allowed));
    r
}

async fn health(State(app): State<Arc<App>>) -> Response {
    if app.stopping.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "stopping"})))
            .into_response();
    }
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], app.metrics.render())
        .into_response()
}

/// The model object `/v1/models` lists.
fn model_object(app: &App) -> Value {
    json!({"id": app.name, "object": "model", "created": app.created, "owned_by": "strata"})
}

async fn models(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_object(&app)]})).into_response()
}

/// OpenAI's retrieve: `GET /v1/models/{id}`.
async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    if id == app.name {
        return axum::Json(model_object(&app)).into_response();
    }
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("the model {id:?} does not exist here: this server serves {:?}", app.name),
        kind: "invalid_request_error",
        param: Some("model".into()),
        code: Some("model_not_found"),
    }
    .response()
}

async fn completions(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    handle(app, Endpoint::Completions, req).await
}

async fn chat_completions(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    handle(app, Endpoint::Chat, req).await
}

/// Counts a request in `requests_total` once: with its status when answered, or as 499 (the
/// client closed the request) when the client went away first and its handler was dropped.
struct Counted<'a> {
    app: &'a App,
    endpoint: Endpoint,
    status: Option<u16>,
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.app.metrics.request(self.endpoint.name(), self.status.unwrap_or(499));
    }
}

async fn handle(app: Arc<App>, endpoint: Endpoint, req: axum::extract::Request) -> Response {
    let mut counted = Counted { app: &app, endpoint, status: None };
    let r = answer(&app, endpoint, req).await;
    let r = r.unwrap_or_else(|e| e.response());
    counted.status = Some(r.status().as_u16());
    r
}

/// Reads a request's body within `--read-timeout` and `--max-body`.
async fn read_body(app: &App, req: axum::extract::Request) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(app.read_timeout, Bytes::from_request(req, &())).await {
        Err(_) => Err(ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: format!(
                "the body did not arrive within --read-timeout {}s",
                app.read_timeout.as_secs()
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_timeout"),
        }),
        Ok(Err(e)) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "the request body is past this server's limit of {} bytes (--max-body)",
                app.max_body
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("body_too_large"),
        }),
        Ok(Err(e)) => Err(ApiError::bad(format!("the request body could not be read: {e}"), None)
            .code("bad_body")),
        Ok(Ok(b)) => Ok(b),
    }
}

async fn answer(
    app: &Arc<App>,
    endpoint: Endpoint,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    if app.stopping.load(Ordering::SeqCst) {
        return Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the server is shutting down".into(),
            kind: "server_error",
            param: None,
            code: Some("shutting_down"),
        });
    }
    let body = read_body(app, req).await?;
    // Tokenizing and rendering a template are CPU work: off the runtime's threads.
    let req_app = Arc::clone(app);
    let req = tokio::task::spawn_blocking(move || read_request(&req_app, endpoint, &body))
        .await
        .map_err(|e| ApiError::bad(format!("the request could not be read: {e}"), None))??;
    let (tx, rx) = mpsc::unbounded_channel();
    let job = Job {
        prompt: req.prompt.clone(),
        max_new: req.max_new,
        sampling: req.sampling.clone(),
        stop_tokens: app.eos.clone(),
        stop_strings: req.stop.clone(),
        events: tx,
    };
    match app.jobs.try_send(job) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            return Err(ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: format!(
                    "the queue is full ({} requests wait beyond the batch): retry later",
                    app.jobs.capacity().unwrap_or(0)
                ),
                kind: "rate_limit_error",
                param: None,
                code: Some("queue_full"),
            })
        }
        Err(TrySendError::Disconnected(_)) => {
            return Err(ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: "the model's engine has stopped".into(),
                kind: "server_error",
                param: None,
                code: None,
            })
        }
    }
    app.metrics.prompt_tokens.fetch_add(req.prompt.len() as u64, Ordering::Relaxed);
    let id = format!(
        "{}-{}",
        if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" },
        app.next_id.fetch_add(1, Ordering::Relaxed)
    );
    if req.stream {
        return Ok(stream_response(Arc::clone(app), endpoint, id, req.include_usage, rx));
    }
    whole_response(app, endpoint, id, rx).await
}

/// Waits for the whole text, then answers it in one JSON object.
async fn whole_response(
    app: &App,
    endpoint: Endpoint,
    id: String,
    mut rx: mpsc::UnboundedReceiver<Event>,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(Event::Text(t)) => text.push_str(&t),
            Some(Event::Done { finish, prompt_tokens, completion_tokens }) => {
                let usage = json!({"prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens});
                let choice = match endpoint {
                    Endpoint::Completions => json!({"index": 0, "text": text,
                        "logprobs": null, "finish_reason": finish.name()}),
                    Endpoint::Chat => json!({"index": 0, "logprobs": null,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish.name()}),
                };
                let object =
                    if endpoint == Endpoint::Chat { "chat.completion" } else { "text_completion" };
                return Ok(axum::Json(json!({"id": id, "object": object, "created": now(),
                    "model": app.name, "choices": [choice], "usage": usage}))
                .into_response());
            }
            Some(Event::Failed(e)) => return Err(server_error(e)),
            None => return Err(server_error("the engine dropped the request".into())),
        }
    }
}

fn server_error(message: String) -> ApiError {
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message,
        kind: "server_error",
        param: None,
        code: None,
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Server-sent events: a chunk per piece of text, then one with the finish reason (and the
/// usage when asked), then `[DONE]`. The client going away drops the stream, and with it the
/// receiver: the engine frees the sequence at its next pass.
fn stream_response(
    app: Arc<App>,
    endpoint: Endpoint,
    id: String,
    include_usage: bool,
    rx: mpsc::UnboundedReceiver<Event>,
) -> Response {
    let created = now();
    let object =
        if endpoint == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" };
    let chunk = move |choice: Value| {
        json!({"id": id, "object": object, "created": created, "model": app.name,
            "choices": [choice]})
    };
    let first = (endpoint == Endpoint::Chat).then(|| {
        chunk(json!({"index": 0, "delta": {"role": "assistant", "content": ""},
            "logprobs": null, "finish_reason": null}))
    });
    // The state: the receiver, whether [DONE] was sent.
    let events = futures_util::stream::unfold(
        (rx, first, false, chunk),
        move |(mut rx, mut first, done, chunk)| async move {
            if done {
                return None;
            }
            if let Some(f) = first.take() {
                return Some((vec![data(&f)], (rx, None, false, chunk)));
            }
            let out = match rx.recv().await {
                Some(Event::Text(t)) => {
                    let c = match endpoint {
                        Endpoint::Completions => json!({"index": 0, "text": t,
                            "logprobs": null, "finish_reason": null}),
                        Endpoint::Chat => json!({"index": 0, "delta": {"content": t},
                            "logprobs": null, "finish_reason": null}),
                    };
                    return Some((vec![data(&chunk(c))], (rx, None, false, chunk)));
                }
                Some(Event::Done { finish, prompt_tokens, completion_tokens }) => {
                    let c = finish_choice(endpoint, finish);
                    let mut v = vec![data(&chunk(c))];
                    if include_usage {
                        let mut u = chunk(json!(null));
                        u["choices"] = json!([]);
                        u["usage"] = json!({"prompt_tokens": prompt_tokens,
                            "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens});
                        v.push(data(&u));
                    }
                    v.push(SseEvent::default().data("[DONE]"));
                    v
                }
                Some(Event::Failed(e)) => {
                    let err = json!({"error": {"message": e, "type": "server_error",
                        "param": null, "code": null}});
                    vec![data(&err), SseEvent::default().data("[DONE]")]
                }
                None => vec![SseEvent::default().data("[DONE]")],
            };
            Some((out, (rx, None, true, chunk)))
        },
    );
    let flat = futures_util::StreamExt::flat_map(events, |v| {
        futures_util::stream::iter(v.into_iter().map(Ok::<_, std::convert::Infallible>))
    });
    Sse::new(flat).keep_alive(KeepAlive::default()).into_response()
}

fn finish_choice(endpoint: Endpoint, finish: Finish) -> Value {
    match endpoint {
        Endpoint::Completions => {
            json!({"index": 0, "text": "", "logprobs": null, "finish_reason": finish.name()})
        }
        Endpoint::Chat => {
            json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish.name()})
        }
    }
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// Fields a request may carry that this server reads; any other is refused by name.
const READ: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "logprobs",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "best_of",
    "logit_bias",
    "suffix",
    "top_logprobs",
];

/// Reads and checks a request's JSON; tokenizes its prompt.
fn read_request(app: &App, endpoint: Endpoint, body: &[u8]) -> Result<Request, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad(format!("the body is not JSON: {e}"), None).code("invalid_json")
    })?;
    let Value::Object(o) = v else {
        return Err(ApiError::bad("the body must be a JSON object", None));
    };
    if let Some(k) = o.keys().find(|k| !READ.contains(&k.as_str())) {
        return Err(ApiError::bad(format!("{k:?}: this server does not support the field"), None)
            .param(k)
            .code("unsupported_field"));
    }
    match o.get("model") {
        Some(Value::String(m)) if *m == app.name => {}
        Some(Value::String(m)) => {
            return Err(ApiError::bad(
                format!("the model {m:?} does not exist here: this server serves {:?}", app.name),
                Some("model"),
            )
            .code("model_not_found"))
        }
        _ => return Err(ApiError::bad("\"model\" is required: a string", Some("model"))),
    }
    refuse_unsupported(&o)?;
    let prompt = match endpoint {
        Endpoint::Completions => completion_prompt(app, &o)?,
        Endpoint::Chat => chat_prompt(app, &o)?,
    };
    if prompt.is_empty() {
        return Err(ApiError::bad(
            "the prompt is empty: at least one token is needed",
            Some("prompt"),
        ));
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= app.vocab) {
        return Err(ApiError::bad(
            format!("token id {bad} is past the model's vocabulary of {}", app.vocab),
            Some("prompt"),
        ));
    }
    if prompt.len() >= app.context {
        return Err(ApiError::bad(
            format!(
                "the prompt has {} tokens: past this server's context of {} positions (one is \
                 needed for the first new token)",
                prompt.len(),
                app.context
            ),
            Some("prompt"),
        )
        .code("context_length_exceeded"));
    }
    let room = app.context - prompt.len();
    let asked = match o.get("max_tokens").or_else(|| o.get("max_completion_tokens")) {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().filter(|&n| n >= 1).ok_or_else(|| {
            ApiError::bad("max_tokens must be a whole number ≥ 1", Some("max_tokens"))
        })?),
    };
    let max_new = match asked {
        Some(n) if n > app.max_tokens as u64 => {
            return Err(ApiError::bad(
                format!("max_tokens {n} is past this server's limit of {}", app.max_tokens),
                Some("max_tokens"),
            ))
        }
        // The last new token is not fed back: prompt + max_new - 1 positions.
        Some(n) if n as usize > room + 1 => {
            return Err(ApiError::bad(
                format!(
                    "the prompt's {} tokens and max_tokens {n} need {} positions: past this \
                     server's context of {}",
                    prompt.len(),
                    prompt.len() as u64 + n - 1,
                    app.context
                ),
                Some("max_tokens"),
            )
            .code("context_length_exceeded"))
        }
        Some(n) => n as usize,
        None if endpoint == Endpoint::Completions => 16.min(room + 1).min(app.max_tokens),
        None => (room + 1).min(app.max_tokens),
    };
    let number = |k: &'static str| -> Result<Option<f64>, ApiError> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| ApiError::bad(format!("{k} must be a number"), Some(k))),
        }
    };
    let temperature = number("temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad("temperature must be between 0 and 2", Some("temperature")));
    }
    let top_p = number("top_p")?;
    if let Some(p) = top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::bad("top_p must be in (0, 1]", Some("top_p")));
        }
    }
    let seed = match o.get("seed") {
        None | Some(Value::Null) => {
            // No seed: a different draw for every request, those that arrive together too.
            let n = app.next_seed.fetch_add(1, Ordering::Relaxed);
            let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            app.seed_keys.hash_one((n, nanos))
        }
        Some(v) => v
            .as_i64()
            .map(|s| s as u64)
            .ok_or_else(|| ApiError::bad("seed must be an integer", Some("seed")))?,
    };
    let sampling = if temperature == 0.0 {
        Sampling::Greedy
    } else {
        Sampling::from_flags(Some(temperature), None, top_p.filter(|&p| p < 1.0), seed)
            .map_err(|e| ApiError::bad(e.to_string(), Some("temperature")))?
    };
    let stop = match o.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= 4 => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                ApiError::bad("stop must be a string or up to 4 strings", Some("stop"))
            })?,
        Some(_) => {
            return Err(ApiError::bad("stop must be a string or up to 4 strings", Some("stop")))
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::bad("a stop string is empty", Some("stop")));
    }
    let stream = match o.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad("stream must be true or false", Some("stream"))),
    };
    let include_usage = match o.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(_) if !stream => {
            return Err(ApiError::bad(
                "stream_options is only allowed with \"stream\": true",
                Some("stream_options"),
            ))
        }
        Some(v) => match v.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(ApiError::bad(
                    "stream_options.include_usage must be true or false",
                    Some("stream_options"),
                ))
            }
        },
    };
    Ok(Request { prompt, max_new, sampling, stop, stream, include_usage })
}

/// Fields that would change what is computed and that this server does not do: refused by name
/// unless they ask for the default.
fn refuse_unsupported(o: &Map<String, Value>) -> Result<(), ApiError> {
    let default = |k: &str, ok: &dyn Fn(&Value) -> bool| match o.get(k) {
        None | Some(Value::Null) => true,
        Some(v) => ok(v),
    };
    type Default<'a> = (&'static str, &'a dyn Fn(&Value) -> bool, &'a str);
    let checks: [Default<'_>; 8] = [
        ("n", &|v| v.as_u64() == Some(1), "one choice a request (n = 1)"),
        ("best_of", &|v| v.as_u64() == Some(1), "best_of = 1"),
        ("logprobs", &|v| v == &Value::Bool(false), "no log-probabilities"),
        ("top_logprobs", &|v| v.as_u64() == Some(0), "no log-probabilities"),
        ("echo", &|v| v == &Value::Bool(false), "echo = false"),
        ("presence_penalty", &|v| v.as_f64() == Some(0.0), "no penalties"),
        ("frequency_penalty", &|v| v.as_f64() == Some(0.0), "no penalties"),
        ("logit_bias", &|v| v.as_object().is_some_and(Map::is_empty), "no logit bias"),
    ];
    for (k, ok, what) in checks {
        if !default(k, ok) {
            return Err(ApiError::bad(format!("{k}: this server supports {what} only"), Some(k))
                .code("unsupported_value"));
        }
    }
    if !default("suffix", &|v| v.as_str() == Some("")) {
        return Err(ApiError::bad("suffix: not supported", Some("suffix")));
    }
    Ok(())
}

fn completion_prompt(app: &App, o: &Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let bad = || {
        ApiError::bad(
            "prompt must be a string, a list of token ids, or a list of one of these (one \
             prompt a request)",
            Some("prompt"),
        )
    };
    let one = |v: &Value| -> Result<Vec<u32>, ApiError> {
        match v {
            Value::String(s) => app.tokenizer.encode(s, true).map_err(|e| {
                ApiError::bad(format!("the prompt cannot be tokenized: {e}"), Some("prompt"))
            }),
            Value::Array(ids) if ids.iter().all(Value::is_u64) => ids
                .iter()
                .map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(bad))
                .collect(),
            _ => Err(bad()),
        }
    };
    match o.get("prompt") {
        None => Err(ApiError::bad("\"prompt\" is required", Some("prompt"))),
        Some(Value::Array(list)) if list.len() == 1 && !list[0].is_u64() => one(&list[0]),
        Some(Value::Array(list)) if !list.is_empty() && list.iter().all(|x| !x.is_u64()) => {
            Err(ApiError::bad(
                "one prompt a request: send the others as requests of their own",
                Some("prompt"),
            ))
        }
        Some(v) => one(v),
    }
}

fn chat_prompt(app: &App, o: &Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let Some(template) = &app.template else {
        return Err(ApiError::bad(
            "this model has no chat template (tokenizer_config.json's chat_template): use \
             /v1/completions",
            Some("messages"),
        ));
    };
    let Some(Value::Array(list)) = o.get("messages") else {
        return Err(ApiError::bad(
            "\"messages\" is required: a list of messages",
            Some("messages"),
        ));
    };
    if list.is_empty() {
        return Err(ApiError::bad("\"messages\" is empty", Some("messages")));
    }
    let mut messages = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        let content = match m.get("content") {
            Some(Value::String(s)) => Some(s.clone()),
            // Content parts: the text ones, joined.
            Some(Value::Array(parts)) => parts
                .iter()
                .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => Some(t.clone()),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()
                .map(|v| v.concat()),
            _ => None,
        };
        match (role, content) {
            (Some(r @ ("system" | "user" | "assistant" | "developer")), Some(c)) => {
                messages.push(Message::new(if r == "developer" { "system" } else { r }, c))
            }
            _ => {
                return Err(ApiError::bad(
                    format!(
                        "messages[{i}]: a role (system, user or assistant) and text content \
                         are needed"
                    ),
                    Some("messages"),
                ))
            }
        }
    }
    let text = template.render(&messages, true).map_err(|e| {
        ApiError::bad(format!("the chat template refused the messages: {e}"), Some("messages"))
    })?;
    // The template writes the special tokens.
    app.tokenizer.encode(&text, false).map_err(|e| {
        ApiError::bad(format!("the messages cannot be tokenized: {e}"), Some("messages"))
    })
}
