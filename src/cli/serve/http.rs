//! The HTTP side of `strata serve`: the listener, bound before the model loads; each connection
//! served by hyper with a header-read timeout, its requests in flight counted so that shutdown
//! waits for those alone; and the signals that start and cut short the drain.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::Router;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Resolves `host` (an IPv4 or IPv6 address, bracketed or not, or a name such as `localhost`)
/// and listens on the first of its addresses that takes `port`.
pub fn bind(host: &str, port: u16) -> Res<std::net::TcpListener> {
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let addrs: Vec<SocketAddr> = (bare, port)
        .to_socket_addrs()
        .map_err(|e| format!("--host {host}: not an address, nor a name that resolves ({e})"))?
        .collect();
    let mut failed = Vec::new();
    for addr in addrs {
        match std::net::TcpListener::bind(addr) {
            Ok(l) => {
                l.set_nonblocking(true)?;
                return Ok(l);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => failed.push(format!(
                "{addr}: port {port} is in use (another server?): another --port, or 0 for \
                 any free one"
            )),
            Err(e) => failed.push(format!("{addr}: {e}")),
        }
    }
    if failed.is_empty() {
        return Err(format!("--host {host}: resolves to no address").into());
    }
    Err(format!("cannot listen on --host {host} --port {port}: {}", failed.join("; ")).into())
}

/// How a server drains and how long it waits for slow clients.
pub struct Timeouts {
    /// For the requests in flight after the first SIGTERM or Ctrl-C.
    pub shutdown: Duration,
    /// For a request's headers (hyper closes the connection past it).
    pub read: Duration,
}

/// Serves `router` on `listener` until SIGTERM or Ctrl-C, then drains: `on_stop` runs at the
/// first signal; connections with no request in flight close at once, the others when their
/// response is written or `timeouts.shutdown` has passed; a second signal exits at once.
pub async fn serve(
    listener: std::net::TcpListener,
    router: Router,
    timeouts: Timeouts,
    on_stop: impl FnOnce() + Send + 'static,
) -> Res<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let term =
        signal(SignalKind::terminate()).map_err(|e| format!("cannot wait for SIGTERM: {e}"))?;
    let int =
        signal(SignalKind::interrupt()).map_err(|e| format!("cannot wait for SIGINT: {e}"))?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(signals(term, int, on_stop, stop_tx));
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = stopped(stop_rx.clone()) => break,
        };
        while conns.try_join_next().is_some() {}
        match accepted {
            Ok((stream, _)) => {
                conns.spawn(connection(stream, router.clone(), stop_rx.clone(), timeouts.read));
            }
            Err(e) => {
                // Out of file descriptors, most likely: wait for connections to close.
                tracing::warn!("cannot accept a connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    drop(listener);
    let drained = async move { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(timeouts.shutdown, drained).await.is_err() {
        out!(
            "requests still in flight after --shutdown-timeout {}s: stopped anyway",
            timeouts.shutdown.as_secs()
        )?;
    }
    Ok(())
}

/// Waits until `stop` says to stop.
async fn stopped(mut stop: tokio::sync::watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// The first SIGTERM or SIGINT stops taking requests; a second, during the drain, exits at once
/// with 128 + its number, as a shell reports a process that signal ended.
async fn signals(
    mut term: tokio::signal::unix::Signal,
    mut int: tokio::signal::unix::Signal,
    on_stop: impl FnOnce(),
    stop: tokio::sync::watch::Sender<bool>,
) {
    let first = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    on_stop();
    let _ = stop.send(true);
    let _ =
        out!("{first}: finishing the requests in flight; another SIGTERM or Ctrl-C stops at once");
    let (second, code) = tokio::select! {
        _ = term.recv() => ("SIGTERM", 128 + libc::SIGTERM),
        _ = int.recv() => ("SIGINT", 128 + libc::SIGINT),
    };
    let _ = out!("{second} during the drain: exiting now, the requests in flight unfinished");
    std::process::exit(code);
}

/// Requests in flight on one connection, counted from their headers until their response's
/// body is done with (dropped).
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn new(count: &Arc<AtomicUsize>) -> Busy {
        count.fetch_add(1, Ordering::SeqCst);
        Busy(Arc::clone(count))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that holds its request's [`Busy`] until it is dropped.
struct Tracked {
    body: Body,
    _busy: Busy,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// How long a connection that has answered its last request may take to write it out once
/// the server stops.
const FLUSH_GRACE: Duration = Duration::from_millis(500);

/// Serves one connection: headers within `read_timeout` (hyper closes the connection past it).
/// Once the server stops, a connection with no request in flight (idle, or with its headers
/// half sent) is closed at once; one with a request is closed when its response is written.
async fn connection(
    stream: tokio::net::TcpStream,
    router: Router,
    stop: tokio::sync::watch::Receiver<bool>,
    read_timeout: Duration,
) {
    use hyper::service::Service as _;
    let busy = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&busy);
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let guard = Busy::new(&count);
        let call = hyper_util::service::TowerToHyperService::new(router.clone()).call(req);
        async move {
            let response = call.await?;
            Ok::<_, std::convert::Infallible>(
                response.map(|body| Body::new(Tracked { body, _busy: guard })),
            )
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(read_timeout);
    let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!("a connection ended: {e}");
            }
            return;
        }
        () = stopped(stop) => {}
    }
    conn.as_mut().graceful_shutdown();
    loop {
        if busy.load(Ordering::SeqCst) == 0 {
            let _ = tokio::time::timeout(FLUSH_GRACE, conn.as_mut()).await;
            return;
        }
        tokio::select! {
            _ = conn.as_mut() => return,
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
}
