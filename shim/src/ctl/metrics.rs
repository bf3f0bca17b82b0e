//! `bulkhead-ctl metrics`: every pod's metrics as one OpenMetrics exposition, each sample
//! labelled with `pod`, `namespace` (Kubernetes) and `pod_id` (the sandbox id), plus
//! `bulkhead_pod_scrape_up` per pod. Printed once, or served as `GET /metrics` on `--listen`
//! (the node's exporter: the DaemonSet runs it as a sidecar, as an unprivileged user in the
//! metrics group). It reads only the metrics directory ([`dir`]); a pod's socket there goes
//! when its sandbox stops, so its series disappear from the next scrape.
//!
//! The endpoint is open to whoever reaches its address, so no client may make the node work
//! harder than one scrape of its pods per [`CACHE_FOR`]: scrapes never overlap ([`ScrapeCache`]),
//! their result answers every request until it is [`CACHE_FOR`] old, and at most
//! [`MAX_CONNECTIONS`] requests are served at once, each within [`REQUEST_TIMEOUT`].

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, UnixStream};

use super::error::{io_err, CtlError};
use crate::metrics::dir::{self, Entry};
use crate::metrics::http;

/// Upper bound for one pod's exposition.
const MAX_POD_EXPOSITION: usize = 4 << 20;
/// Upper bound for scraping one pod.
const POD_TIMEOUT: Duration = Duration::from_secs(5);
/// Upper bound for answering one request to the node endpoint.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one scrape of the pods answers later requests.
pub const CACHE_FOR: Duration = Duration::from_secs(2);
/// Requests served at once; further connections wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 64;

/// One scrape of the node's pods at a time: a request that finds a fresh result takes it, one
/// that finds a scrape running waits for it, and only a request after [`CACHE_FOR`] starts
/// another.
pub struct ScrapeCache<G> {
    gather: G,
    last: tokio::sync::Mutex<Option<(Instant, Arc<str>)>>,
}

impl<G, F> ScrapeCache<G>
where
    G: Fn() -> F,
    F: Future<Output = String>,
{
    pub fn new(gather: G) -> Self {
        Self { gather, last: tokio::sync::Mutex::new(None) }
    }

    /// The current exposition, shared: every request writes from the one buffer, so slow
    /// readers cost the exporter their sockets' buffers, not a copy of the body each.
    pub async fn get(&self) -> Arc<str> {
        let mut last = self.last.lock().await;
        if let Some((at, text)) = last.as_ref() {
            if at.elapsed() < CACHE_FOR {
                return text.clone();
            }
        }
        let text: Arc<str> = Arc::from((self.gather)().await);
        *last = Some((Instant::now(), text.clone()));
        text
    }
}

/// One metric family of the merged output, in order of first appearance.
#[derive(Default)]
struct Family {
    meta: Vec<String>,
    samples: Vec<String>,
}

#[derive(Default)]
struct Merged {
    order: Vec<String>,
    families: HashMap<String, Family>,
}

impl Merged {
    fn family(&mut self, name: &str) -> &mut Family {
        if !self.families.contains_key(name) {
            self.order.push(name.to_string());
        }
        self.families.entry(name.to_string()).or_default()
    }

    /// Adds one pod's exposition, with `labels` (already rendered `k="v"` pairs) on every sample.
    fn add(&mut self, exposition: &str, labels: &str) {
        let mut current: Option<String> = None;
        for line in exposition.lines() {
            if line == "# EOF" {
                break;
            }
            if let Some(meta) = line.strip_prefix("# ") {
                let mut parts = meta.splitn(3, ' ');
                let (Some(kind @ ("HELP" | "TYPE" | "UNIT")), Some(name)) = (parts.next(), parts.next()) else {
                    continue;
                };
                let prefix = format!("# {kind} {name} ");
                let family = self.family(name);
                if !family.meta.iter().any(|m| m.starts_with(&prefix)) {
                    family.meta.push(line.to_string());
                }
                current = Some(name.to_string());
                continue;
            }
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let sample = with_labels(line, labels);
            let name = match &current {
                Some(name) => name.clone(),
                None => sample_name(line).to_string(),
            };
            self.family(&name).samples.push(sample);
        }
    }

    fn render(&self) -> String {
        let mut out = String::new();
        for name in &self.order {
            let family = &self.families[name];
            for line in family.meta.iter().chain(&family.samples) {
                out.push_str(line);
                out.push('\n');
            }
        }
        out.push_str("# EOF\n");
        out
    }
}

fn sample_name(line: &str) -> &str {
    let end = line.find(['{', ' ']).unwrap_or(line.len());
    &line[..end]
}

/// Puts `labels` first in a sample line's label set.
fn with_labels(line: &str, labels: &str) -> String {
    let name = sample_name(line);
    let rest = &line[name.len()..];
    match rest.strip_prefix('{') {
        Some(inner) if inner.starts_with('}') => format!("{name}{{{labels}{inner}"),
        Some(inner) => format!("{name}{{{labels},{inner}"),
        None => format!("{name}{{{labels}}}{rest}"),
    }
}

fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn pod_labels(pod: &Entry) -> String {
    let (name, namespace) = pod.labels.as_ref().map_or(("", ""), |l| (l.pod.as_str(), l.namespace.as_str()));
    format!("pod=\"{}\",namespace=\"{}\",pod_id=\"{}\"", escape(name), escape(namespace), escape(&pod.id))
}

async fn scrape(socket: &Path) -> Result<String, String> {
    let mut stream = tokio::time::timeout(POD_TIMEOUT, UnixStream::connect(socket))
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| e.to_string())?;
    http::get(&mut stream, "/metrics", MAX_POD_EXPOSITION, POD_TIMEOUT).await.map_err(|e| e.to_string())
}

/// Scrapes every pod that serves metrics and merges the expositions. Reads only the metrics
/// directory ([`dir`]), so it works as an unprivileged user in the metrics group.
pub async fn gather(state_dir: &Path) -> String {
    let pods = match dir::entries(state_dir) {
        Ok(pods) => pods,
        Err(e) => {
            tracing::warn!("read {}: {e}", state_dir.join(dir::DIR_NAME).display());
            Vec::new()
        }
    };
    let mut merged = Merged::default();
    let mut up = Vec::new();
    for pod in &pods {
        let socket = &pod.socket;
        let labels = pod_labels(pod);
        match scrape(socket).await {
            Ok(text) => {
                merged.add(&text, &labels);
                up.push(format!("bulkhead_pod_scrape_up{{{labels}}} 1"));
            }
            Err(e) => {
                tracing::warn!(pod = %pod.id, "scrape {}: {e}", socket.display());
                up.push(format!("bulkhead_pod_scrape_up{{{labels}}} 0"));
            }
        }
    }
    let own = merged.family("bulkhead_pod_scrape_up");
    own.meta = vec![
        "# HELP bulkhead_pod_scrape_up Whether the pod's shim answered this scrape".into(),
        "# TYPE bulkhead_pod_scrape_up gauge".into(),
    ];
    own.samples = up;
    merged.render()
}

/// Serves the node's `/metrics` on `addr` until SIGTERM or SIGINT. Prints the bound address
/// first (`listening on ...`), so `--listen 127.0.0.1:0` can be used.
pub async fn serve(state_dir: PathBuf, addr: &str) -> Result<(), CtlError> {
    let listener = TcpListener::bind(addr).await.map_err(io_err(format!("listen on {addr}")))?;
    let local = listener.local_addr().map_err(io_err("local address"))?;
    println!("listening on {local}");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(io_err("SIGTERM handler"))?;
    let mut int =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).map_err(io_err("SIGINT handler"))?;
    let cache = Arc::new(ScrapeCache::new(move || {
        let state_dir = state_dir.clone();
        async move { gather(&state_dir).await }
    }));
    tokio::select! {
        () = serve_on(listener, cache) => Ok(()),
        _ = term.recv() => Ok(()),
        _ = int.recv() => Ok(()),
    }
}

/// The accept loop of [`serve`]: each request answered from `cache`, at most
/// [`MAX_CONNECTIONS`] at once.
pub async fn serve_on<G, F>(listener: TcpListener, cache: Arc<ScrapeCache<G>>)
where
    G: Fn() -> F + Send + Sync + 'static,
    F: Future<Output = String> + Send + 'static,
{
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else { return };
        let mut stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let cache = cache.clone();
        tokio::spawn(async move {
            let body = cache.get();
            let answer = http::serve_one(&mut stream, body);
            if tokio::time::timeout(REQUEST_TIMEOUT, answer).await.is_err() {
                tracing::warn!("metrics request not answered within {REQUEST_TIMEOUT:?}");
            }
            drop(slot);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD_A: &str = "# HELP m_seconds Latency.\n# TYPE m_seconds histogram\n\
                         m_seconds_bucket{le=\"0.1\",rpc=\"create\"} 1\nm_seconds_count{rpc=\"create\"} 1\n\
                         # HELP up Up.\n# TYPE up gauge\nup 1\n# EOF\n";

    #[test]
    fn labels_go_first_in_every_sample() {
        assert_eq!(with_labels("up 1", "pod=\"a\""), "up{pod=\"a\"} 1");
        assert_eq!(with_labels("m{} 2", "pod=\"a\""), "m{pod=\"a\"} 2");
        assert_eq!(with_labels("m{x=\"1\"} 2", "pod=\"a\""), "m{pod=\"a\",x=\"1\"} 2");
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn pods_merge_into_one_family_each() {
        let mut merged = Merged::default();
        merged.add(POD_A, "pod=\"a\"");
        merged.add(POD_A, "pod=\"b\"");
        let text = merged.render();
        assert_eq!(text.matches("# TYPE m_seconds histogram").count(), 1, "{text}");
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        let family: Vec<&str> = text.lines().skip_while(|l| !l.contains("TYPE m_seconds")).skip(1).take(4).collect();
        assert!(family.iter().all(|l| l.starts_with("m_seconds")), "samples stay with their family: {text}");
        assert!(text.contains("up{pod=\"b\"} 1"), "{text}");
        assert!(text.ends_with("# EOF\n"));
    }

    /// Counts gathers and the most that ever ran at once; each takes a while.
    #[derive(Default)]
    struct Probe {
        running: std::sync::atomic::AtomicUsize,
        most: std::sync::atomic::AtomicUsize,
        total: std::sync::atomic::AtomicUsize,
    }

    async fn slow_gather(probe: Arc<Probe>) -> String {
        use std::sync::atomic::Ordering::SeqCst;
        let now = probe.running.fetch_add(1, SeqCst) + 1;
        probe.most.fetch_max(now, SeqCst);
        probe.total.fetch_add(1, SeqCst);
        tokio::time::sleep(Duration::from_millis(300)).await;
        probe.running.fetch_sub(1, SeqCst);
        "up 1\n# EOF\n".to_string()
    }

    async fn get_metrics(addr: std::net::SocketAddr) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        http::get(&mut stream, "/metrics", 1 << 20, Duration::from_secs(10)).await.unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_slow_clients_cause_one_scrape_at_a_time_and_a_normal_client_is_answered() {
        use std::sync::atomic::Ordering::SeqCst;
        use tokio::io::AsyncWriteExt;
        let probe = Arc::new(Probe::default());
        let p = probe.clone();
        let cache = Arc::new(ScrapeCache::new(move || slow_gather(p.clone())));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve_on(listener, cache));
        // 50 slow clients: each sends its request a byte at a time, then reads the answer.
        let slow: Vec<_> = (0..50)
            .map(|_| {
                tokio::spawn(async move {
                    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
                    for byte in b"GET /metrics HTTP/1.0\r\n\r\n" {
                        stream.write_all(&[*byte]).await.unwrap();
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    let mut out = Vec::new();
                    tokio::io::AsyncReadExt::read_to_end(&mut stream, &mut out).await.unwrap();
                    String::from_utf8_lossy(&out).contains("up 1")
                })
            })
            .collect();
        // A normal client meanwhile is answered, within the request bound.
        let normal = tokio::time::timeout(REQUEST_TIMEOUT, get_metrics(addr)).await.unwrap();
        assert!(normal.contains("up 1"), "{normal}");
        for client in slow {
            assert!(client.await.unwrap(), "a slow client got its answer");
        }
        assert_eq!(probe.most.load(SeqCst), 1, "scrapes never overlap");
        // 51 requests over ~0.6 s: a fresh scrape at most once per CACHE_FOR, plus the first.
        assert!(probe.total.load(SeqCst) <= 2, "{} scrapes for 51 requests", probe.total.load(SeqCst));
        server.abort();
    }

    #[tokio::test]
    async fn a_stale_result_is_scraped_again() {
        use std::sync::atomic::Ordering::SeqCst;
        let probe = Arc::new(Probe::default());
        let p = probe.clone();
        let cache = ScrapeCache::new(move || slow_gather(p.clone()));
        cache.get().await;
        cache.get().await;
        assert_eq!(probe.total.load(SeqCst), 1, "fresh: served from the cache");
        if let Some((at, _)) = cache.last.lock().await.as_mut() {
            *at = Instant::now().checked_sub(CACHE_FOR).unwrap();
        }
        cache.get().await;
        assert_eq!(probe.total.load(SeqCst), 2, "stale: scraped again");
    }

    #[tokio::test]
    async fn an_empty_node_exposes_only_the_scrape_family() {
        let dir = tempfile::tempdir().unwrap();
        let text = gather(dir.path()).await;
        assert_eq!(
            text,
            "# HELP bulkhead_pod_scrape_up Whether the pod's shim answered this scrape\n\
                          # TYPE bulkhead_pod_scrape_up gauge\n# EOF\n"
        );
    }
}
