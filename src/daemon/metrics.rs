//! `run --metrics ADDR`: what the daemon and its table have done, in the Prometheus text
//! format (prometheus-client's encoder), over HTTP on a loopback address or a unix socket.
//!
//! Where each figure comes from, so that serving them never holds up the daemon:
//!
//! - Refused packets and bytes by family: the table's own counters (`meta nfproto ipv4
//!   counter` in the refused chain), read over netlink when scraped, by a thread of their
//!   own. Exact, and free for the packets: the kernel counts them anyway.
//! - Refused packets by reason: only the daemon can tell "not in the policy" from "another
//!   port" or "its name's lifetime ended" (the table has no set of allowed addresses without
//!   their ports, and knows no names), so the reasons come from the NFLOG copies the daemon
//!   reads with `--log-drops` ([`WhyRefused::reason`]): a sample, limited by the policy's
//!   `log.rate`, which the metric's name and help say. Without `--log-drops` nobody reads
//!   the group (`watch` may: a group has one reader), and the metric is absent.
//! - The guard's queries and its answer latency: its atomics ([`Counters`]).
//! - Names, addresses, lookup failures, the last refresh and apply, heals: the core's
//!   [`CoreView`], which the shell publishes here at most once a second.
//! - The generation: the shell, when it records one.
//!
//! Labels are bounded: family, a fixed reason word, the guard's three results, the table's
//! set names, and names the policy itself writes (resolve mode's names, deny entries). A name
//! the guard refused, or one it learned under a wildcard, never becomes a label.
//!
//! The server is no way in or out: it binds only loopback or a unix socket (the table
//! accepts loopback already: no rule is added for it), serves at most [`MAX_SCRAPERS`]
//! connections at once, reads at most [`MAX_REQUEST`] bytes of a request within
//! [`REQUEST_TIMEOUT`], and answers `GET /metrics` only.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tracing::{info, warn};

use super::core::CoreView;
use super::{DaemonError, io};
use crate::core::explain::WhyRefused;
use crate::core::ruleset::{Elements, Family, SetId};
use crate::guard::{Counters, LatencySnapshot};
use crate::nft::Nft;
use crate::nft::live::{Counter, Refused};

/// How many scrapes are served at once; a connection beyond them is closed at once.
pub const MAX_SCRAPERS: usize = 4;
/// The most of a request that is read: a scrape's is a few hundred bytes.
pub const MAX_REQUEST: usize = 8192;
/// How long a connection may take to send its request and read the answer.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// A table read this recent answers the next scrape too: scrapers cannot make the daemon
/// dump its sets back to back.
const TABLE_READ_MAX_AGE: Duration = Duration::from_secs(1);
/// At most this many deny entries are counted apart (the policy's; reloads may bring others).
const MAX_DENY_ENTRIES: usize = 256;
/// A heal's culprit as a label: at most this many characters.
const MAX_CULPRIT: usize = 160;

/// Where `--metrics` serves: a loopback address and port, or a unix socket's path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricsAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MetricsAddrError {
    #[error(
        "{0} is not a loopback address: the metrics server must not be reachable from the \
         network. Give 127.0.0.1:PORT, [::1]:PORT or the absolute path of a unix socket"
    )]
    NotLoopback(SocketAddr),
    #[error(
        "`{0}` is neither ADDRESS:PORT on loopback nor an absolute path of a unix socket \
         (e.g. 127.0.0.1:9464 or /run/egress-fence/metrics.sock)"
    )]
    Unrecognised(String),
}

impl FromStr for MetricsAddr {
    type Err = MetricsAddrError;

    fn from_str(text: &str) -> Result<MetricsAddr, MetricsAddrError> {
        if let Ok(addr) = text.parse::<SocketAddr>() {
            return match addr.ip().is_loopback() {
                true => Ok(MetricsAddr::Tcp(addr)),
                false => Err(MetricsAddrError::NotLoopback(addr)),
            };
        }
        let path = Path::new(text);
        match path.is_absolute() {
            true => Ok(MetricsAddr::Unix(path.to_path_buf())),
            false => Err(MetricsAddrError::Unrecognised(text.into())),
        }
    }
}

impl fmt::Display for MetricsAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetricsAddr::Tcp(addr) => write!(f, "http://{addr}/metrics"),
            MetricsAddr::Unix(path) => write!(f, "unix:{} (GET /metrics)", path.display()),
        }
    }
}

/// What the daemon tells the metrics server, written by the shell, read by scrapes. Every
/// lock here is held for a copy at most.
#[derive(Debug, Default)]
pub struct Metrics {
    core: Mutex<CoreView>,
    guard: OnceLock<Arc<Counters>>,
    /// Refused packets the daemon read from NFLOG, by family and reason.
    refused_logged: Mutex<BTreeMap<(Family, &'static str), u64>>,
    /// Of those, the ones a deny entry refused, by entry.
    denied_logged: Mutex<BTreeMap<String, u64>>,
    /// The last generation recorded (0: none yet).
    generation: AtomicU64,
    log_drops: bool,
}

impl Metrics {
    pub fn new(log_drops: bool) -> Metrics {
        Metrics {
            log_drops,
            ..Metrics::default()
        }
    }

    pub fn publish(&self, view: CoreView) {
        *lock(&self.core) = view;
    }

    pub fn guard_counters(&self, counters: Arc<Counters>) {
        let _ = self.guard.set(counters);
    }

    pub fn recorded(&self, generation: u64) {
        self.generation.store(generation, Ordering::Relaxed);
    }

    pub fn count_refused(&self, family: Family, reason: &'static str, deny_entry: Option<String>) {
        *lock(&self.refused_logged)
            .entry((family, reason))
            .or_default() += 1;
        if let Some(entry) = deny_entry {
            let mut denied = lock(&self.denied_logged);
            if denied.len() < MAX_DENY_ENTRIES || denied.contains_key(&entry) {
                *denied.entry(entry).or_default() += 1;
            }
        }
    }

    /// Everything a scrape shows, with what was read of the table.
    fn scrape(&self, table: TableFacts) -> Scrape {
        Scrape {
            core: lock(&self.core).clone(),
            guard: self.guard.get().map(|c| GuardFigures {
                answered: c.answered.load(Ordering::Relaxed),
                refused: c.refused.load(Ordering::Relaxed),
                failed: c.failed.load(Ordering::Relaxed),
                latency: c.answer_latency.snapshot(),
            }),
            refused_logged: self.log_drops.then(|| lock(&self.refused_logged).clone()),
            denied_logged: lock(&self.denied_logged).clone(),
            generation: self.generation.load(Ordering::Relaxed),
            table,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a scrape read of the table.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TableFacts {
    /// The table is there (`false` also when it could not be read: `read_error`).
    pub present: bool,
    pub read_error: bool,
    pub refused: Refused,
    /// Of those, what the deny entries refused.
    pub denied: Refused,
    /// Our sets and how many elements each holds (as egress-fence reads them back).
    pub sets: Vec<(String, usize)>,
}

/// Reads the table's counters and set sizes.
fn read_table(nft: &mut Nft) -> TableFacts {
    match nft.read_table() {
        Ok(Some(table)) => {
            let status = table.status();
            let sets = status
                .sets
                .iter()
                .filter(|s| SetId::from_name(&s.name).is_some())
                .map(|s| {
                    let n = match &s.contents {
                        Some(Elements::Networks(n)) => n.len(),
                        Some(Elements::Tuples(t)) => t.len(),
                        Some(Elements::Timed(t)) => t.len(),
                        None => s.kernel_elements,
                    };
                    (s.name.clone(), n)
                })
                .collect();
            TableFacts {
                present: true,
                read_error: false,
                refused: status.refused,
                denied: table.denied(),
                sets,
            }
        }
        Ok(None) => TableFacts::default(),
        Err(e) => {
            warn!(error = %e, "metrics: cannot read the table");
            TableFacts {
                read_error: true,
                ..TableFacts::default()
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct GuardFigures {
    answered: u64,
    refused: u64,
    failed: u64,
    latency: LatencySnapshot,
}

/// One scrape's figures: plain data, rendered by [`render`].
#[derive(Debug, Clone, PartialEq)]
pub struct Scrape {
    core: CoreView,
    guard: Option<GuardFigures>,
    /// `None` without `--log-drops` (nothing is read, so nothing is counted).
    refused_logged: Option<BTreeMap<(Family, &'static str), u64>>,
    denied_logged: BTreeMap<String, u64>,
    generation: u64,
    table: TableFacts,
}

fn family_label(family: Family) -> &'static str {
    match family {
        Family::V4 => "ipv4",
        Family::V6 => "ipv6",
    }
}

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A culprit as a label value: printable, and short.
fn culprit_label(by: &str) -> String {
    by.chars()
        .filter(|c| !c.is_control())
        .take(MAX_CULPRIT)
        .collect()
}

type Labels<'a> = Vec<(&'static str, &'a str)>;

/// One of a [`Counter`]'s figures.
type CounterField = fn(&Counter) -> u64;

impl Collector for Scrape {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), fmt::Error> {
        fn gauge<V: prometheus_client::encoding::EncodeGaugeValue>(
            e: &mut DescriptorEncoder,
            name: &str,
            help: &str,
            v: V,
        ) -> Result<(), fmt::Error> {
            e.encode_descriptor(name, help, None, MetricType::Gauge)?
                .encode_gauge(&v)
        }

        let version = env!("CARGO_PKG_VERSION");
        e.encode_descriptor(
            "egress_fence_build_info",
            "The egress-fence build serving these metrics (always 1)",
            None,
            MetricType::Gauge,
        )?
        .encode_family(&vec![("version", version)])?
        .encode_gauge(&1u64)?;

        gauge(
            &mut e,
            "egress_fence_table_present",
            "Whether the table inet egress_fence is in the kernel (0 also when it could not be read)",
            u64::from(self.table.present),
        )?;
        gauge(
            &mut e,
            "egress_fence_table_read_errors",
            "Whether this scrape could not read the table (1: its figures are missing)",
            u64::from(self.table.read_error),
        )?;
        if self.table.present {
            let (all, denied) = (&self.table.refused, &self.table.denied);
            let what: [(&str, &str, &Refused, CounterField); 4] = [
                (
                    "egress_fence_refused_packets",
                    "Packets the table refused since it was last applied, by family (the \
                     table's counters)",
                    all,
                    |c| c.packets,
                ),
                (
                    "egress_fence_refused_bytes",
                    "Bytes of the packets the table refused since it was last applied, by family",
                    all,
                    |c| c.bytes,
                ),
                (
                    "egress_fence_refused_denied_packets",
                    "Of the refused packets, those the deny entries refused (their rules' counters)",
                    denied,
                    |c| c.packets,
                ),
                (
                    "egress_fence_refused_denied_bytes",
                    "Of the refused bytes, those the deny entries refused",
                    denied,
                    |c| c.bytes,
                ),
            ];
            for (name, help, counted, value) in what {
                let mut m = e.encode_descriptor(name, help, None, MetricType::Counter)?;
                for (family, c) in [(Family::V4, counted.ipv4), (Family::V6, counted.ipv6)] {
                    m.encode_family(&vec![("family", family_label(family))])?
                        .encode_counter::<NoLabelSet, _, u64>(&value(&c), None)?;
                }
            }
            let mut m = e.encode_descriptor(
                "egress_fence_set_elements",
                "Elements in each of the table's sets",
                None,
                MetricType::Gauge,
            )?;
            for (set, n) in &self.table.sets {
                m.encode_family(&vec![("set", set.as_str())])?
                    .encode_gauge(n)?;
            }
        }

        if let Some(logged) = &self.refused_logged {
            let mut m = e.encode_descriptor(
                "egress_fence_refused_logged_packets",
                "Refused packets the daemon read from the policy's NFLOG group (--log-drops), by \
                 family and reason: a sample, at most log.rate a second",
                None,
                MetricType::Counter,
            )?;
            for family in Family::BOTH {
                for reason in WhyRefused::REASONS {
                    let n = logged.get(&(family, reason)).copied().unwrap_or(0);
                    let labels: Labels = vec![("family", family_label(family)), ("reason", reason)];
                    m.encode_family(&labels)?
                        .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
                }
            }
            let mut m = e.encode_descriptor(
                "egress_fence_refused_logged_denied_packets",
                "Of those, the ones a deny entry refused, by the entry as the policy names it",
                None,
                MetricType::Counter,
            )?;
            for (entry, n) in &self.denied_logged {
                m.encode_family(&vec![("entry", entry.as_str())])?
                    .encode_counter::<NoLabelSet, _, u64>(n, None)?;
            }
        }

        if let Some(g) = &self.guard {
            let mut m = e.encode_descriptor(
                "egress_fence_guard_queries",
                "DNS queries the guard answered (forwarded and installed), refused, or failed \
                 (SERVFAIL)",
                None,
                MetricType::Counter,
            )?;
            for (result, n) in [
                ("answered", g.answered),
                ("refused", g.refused),
                ("failed", g.failed),
            ] {
                m.encode_family(&vec![("result", result)])?
                    .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
            }
            e.encode_descriptor(
                "egress_fence_guard_answer_seconds",
                "How long the guard took to answer an allowed name: upstream, then the kernel \
                 holding its addresses",
                None,
                MetricType::Histogram,
            )?
            .encode_histogram::<NoLabelSet>(
                g.latency.sum_seconds,
                g.latency.count,
                &g.latency.buckets,
                None,
            )?;
        }

        let c = &self.core;
        gauge(
            &mut e,
            "egress_fence_names",
            "Names the daemon follows (guard mode: names with addresses it learned)",
            c.names,
        )?;
        gauge(
            &mut e,
            "egress_fence_addresses",
            "Live addresses the daemon's names hold",
            c.addresses,
        )?;
        if !c.guard_mode {
            let mut m = e.encode_descriptor(
                "egress_fence_lookup_failures",
                "Lookups of each policy name that failed in a row (0: its last lookup answered)",
                None,
                MetricType::Gauge,
            )?;
            for (name, n) in &c.lookup_failures {
                m.encode_family(&vec![("name", name.as_str())])?
                    .encode_gauge(n)?;
            }
        }
        if let Some(t) = c.last_refresh {
            gauge(
                &mut e,
                "egress_fence_last_refresh_timestamp_seconds",
                "When answers last came in (a refresh, or in guard mode an answer), Unix time",
                unix_seconds(t),
            )?;
        }
        if let Some(t) = c.last_apply {
            gauge(
                &mut e,
                "egress_fence_last_apply_timestamp_seconds",
                "When the kernel last accepted the whole table, Unix time",
                unix_seconds(t),
            )?;
        }
        e.encode_descriptor(
            "egress_fence_heals",
            "Times the table was put back after someone else changed it",
            None,
            MetricType::Counter,
        )?
        .encode_counter::<NoLabelSet, _, u64>(&c.heals, None)?;
        if let Some(by) = &c.last_heal_by {
            let by = culprit_label(by);
            e.encode_descriptor(
                "egress_fence_last_heal_info",
                "Who changed the table the last time it was healed (always 1)",
                None,
                MetricType::Gauge,
            )?
            .encode_family(&vec![("by", by.as_str())])?
            .encode_gauge(&1u64)?;
        }
        gauge(
            &mut e,
            "egress_fence_generation",
            "The last generation the daemon recorded (0: none yet)",
            self.generation,
        )?;
        Ok(())
    }
}

/// The Prometheus text of one scrape.
pub fn render(scrape: Scrape) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(scrape));
    let mut out = String::new();
    // Writing to a String fails only if an encoder refuses a value; none of ours does.
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry) {
        warn!(error = %e, "metrics: encoding failed");
    }
    out
}

/// The listening socket.
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

/// Binds `addr` (in the calling thread's network namespace). A unix socket left behind by an
/// earlier run is replaced; any other file there is an error.
pub async fn bind(addr: &MetricsAddr) -> Result<Listener, DaemonError> {
    let failed = |e: std::io::Error| DaemonError::Io {
        doing: "serve metrics (--metrics)",
        source: std::io::Error::new(e.kind(), format!("{addr}: {e}")),
    };
    match addr {
        MetricsAddr::Tcp(a) => TcpListener::bind(a)
            .await
            .map(Listener::Tcp)
            .map_err(failed),
        MetricsAddr::Unix(path) => {
            use std::os::unix::fs::FileTypeExt;
            match std::fs::symlink_metadata(path) {
                Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path).map_err(failed)?,
                Ok(_) => {
                    return Err(failed(std::io::Error::new(
                        std::io::ErrorKind::AlreadyExists,
                        "the path exists and is not a socket; name another",
                    )));
                }
                Err(_) => {}
            }
            UnixListener::bind(path)
                .map(|l| Listener::Unix(l, path.clone()))
                .map_err(failed)
        }
    }
}

/// Removes a unix socket's file at exit.
pub fn remove_socket(path: &Path) {
    let _ = std::fs::remove_file(path);
}

/// Serves scrapes until the runtime ends. The table is read by a thread of its own (made
/// here, so in this thread's network namespace), one read at a time.
pub fn serve(listener: Listener, metrics: Arc<Metrics>) -> Result<(), DaemonError> {
    let reads = start_table_reader()?;
    let slots = Arc::new(Semaphore::new(MAX_SCRAPERS));
    tokio::spawn(async move {
        loop {
            let accepted: std::io::Result<Box<dyn Connection>> = match &listener {
                Listener::Tcp(l) => l
                    .accept()
                    .await
                    .map(|(s, _)| Box::new(s) as Box<dyn Connection>),
                Listener::Unix(l, _) => l
                    .accept()
                    .await
                    .map(|(s, _)| Box::new(s) as Box<dyn Connection>),
            };
            let conn = match accepted {
                Ok(c) => c,
                Err(e) => {
                    warn!(error = %e, "metrics: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            // Too many at once: closed unanswered.
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                continue;
            };
            let (metrics, reads) = (metrics.clone(), reads.clone());
            tokio::spawn(async move {
                let _slot = slot;
                let _ = tokio::time::timeout(REQUEST_TIMEOUT, answer(conn, &metrics, &reads)).await;
            });
        }
    });
    Ok(())
}

trait Connection: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Connection for T {}

/// What a request asks for.
#[derive(Debug, PartialEq, Eq)]
enum Request {
    Metrics,
    NotFound,
    BadMethod,
    TooLarge,
    Malformed,
}

/// Reads a request's head (up to the blank line, at most [`MAX_REQUEST`] bytes).
async fn read_request(conn: &mut (impl AsyncRead + Unpin)) -> Request {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
            return parse_request(&head);
        }
        if head.len() >= MAX_REQUEST {
            return Request::TooLarge;
        }
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return Request::Malformed,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
}

fn parse_request(head: &[u8]) -> Request {
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let Ok(line) = std::str::from_utf8(line) else {
        return Request::Malformed;
    };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Request::Malformed;
    };
    if !version.starts_with("HTTP/1.") || parts.next().is_some() {
        return Request::Malformed;
    }
    if method != "GET" {
        return Request::BadMethod;
    }
    let path = target.split('?').next().unwrap_or_default();
    match path {
        "/metrics" => Request::Metrics,
        _ => Request::NotFound,
    }
}

async fn answer(mut conn: Box<dyn Connection>, metrics: &Metrics, reads: &TableReads) {
    let (status, content_type, body) = match read_request(&mut conn).await {
        Request::Metrics => {
            let table = reads.read().await;
            let body = render(metrics.scrape(table));
            (
                "200 OK",
                prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                body,
            )
        }
        Request::NotFound => ("404 Not Found", "text/plain", "GET /metrics\n".into()),
        Request::BadMethod => (
            "405 Method Not Allowed",
            "text/plain",
            "GET /metrics\n".into(),
        ),
        Request::TooLarge => (
            "431 Request Header Fields Too Large",
            "text/plain",
            String::new(),
        ),
        Request::Malformed => ("400 Bad Request", "text/plain", String::new()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    if conn.write_all(head.as_bytes()).await.is_ok() {
        let _ = conn.write_all(body.as_bytes()).await;
    }
    let _ = conn.shutdown().await;
}

/// Where scrapes ask for the table.
#[derive(Clone)]
struct TableReads(mpsc::Sender<oneshot::Sender<TableFacts>>);

impl TableReads {
    async fn read(&self) -> TableFacts {
        let (tx, rx) = oneshot::channel();
        if self.0.send(tx).await.is_err() {
            return TableFacts {
                read_error: true,
                ..TableFacts::default()
            };
        }
        rx.await.unwrap_or(TableFacts {
            read_error: true,
            ..TableFacts::default()
        })
    }
}

/// The thread that reads the table for scrapes, over a netlink socket of its own (the
/// daemon's stays the daemon's). A thread starts in the network namespace of the thread
/// that made it: the daemon's.
fn start_table_reader() -> Result<TableReads, DaemonError> {
    let (tx, mut rx) = mpsc::channel::<oneshot::Sender<TableFacts>>(MAX_SCRAPERS);
    std::thread::Builder::new()
        .name("metrics-table".into())
        .spawn(move || {
            let mut nft = None;
            let mut last: Option<(Instant, TableFacts)> = None;
            while let Some(reply) = rx.blocking_recv() {
                let facts = match &last {
                    Some((at, facts)) if at.elapsed() < TABLE_READ_MAX_AGE => facts.clone(),
                    _ => {
                        if nft.is_none() {
                            nft = Nft::open()
                                .inspect_err(|e| warn!(error = %e, "metrics: cannot open netlink"))
                                .ok();
                        }
                        let facts = match nft.as_mut() {
                            Some(nft) => read_table(nft),
                            None => TableFacts {
                                read_error: true,
                                ..TableFacts::default()
                            },
                        };
                        if facts.read_error {
                            // A socket that failed may be out of step: a fresh one next time.
                            nft = None;
                        }
                        last = Some((Instant::now(), facts.clone()));
                        facts
                    }
                };
                let _ = reply.send(facts);
            }
        })
        .map_err(io("start the metrics table reader"))?;
    Ok(TableReads(tx))
}

/// Says where the metrics are served.
pub fn announce(addr: &MetricsAddr) {
    info!(metrics = %addr, "serving metrics");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::guard_identity::GuardIdentity;
    use crate::core::policy::Policy;
    use crate::core::resolution::{ResolvedAddr, ResolvedHost};
    use crate::daemon::core::{Core, Event, GuardAnswer};
    use crate::nft::table::memory::MemoryTable;
    use crate::watch::DropEvent;

    #[test]
    fn only_loopback_or_a_unix_socket_is_served() {
        assert_eq!(
            "127.0.0.1:9464".parse(),
            Ok(MetricsAddr::Tcp("127.0.0.1:9464".parse().unwrap()))
        );
        assert_eq!(
            "[::1]:9464".parse(),
            Ok(MetricsAddr::Tcp("[::1]:9464".parse().unwrap()))
        );
        assert_eq!(
            "/run/egress-fence/metrics.sock".parse(),
            Ok(MetricsAddr::Unix("/run/egress-fence/metrics.sock".into()))
        );
        for open in [
            "0.0.0.0:9464",
            "[::]:9464",
            "192.0.2.1:9464",
            "[2001:db8::1]:80",
        ] {
            let e = open.parse::<MetricsAddr>().unwrap_err();
            assert!(matches!(e, MetricsAddrError::NotLoopback(_)), "{open}: {e}");
            assert!(e.to_string().contains("not a loopback address"), "{e}");
        }
        for odd in ["localhost:9464", "metrics.sock", "9464", ""] {
            assert!(
                matches!(
                    odd.parse::<MetricsAddr>(),
                    Err(MetricsAddrError::Unrecognised(_))
                ),
                "{odd}"
            );
        }
    }

    #[test]
    fn requests_other_than_get_metrics_are_refused() {
        assert_eq!(
            parse_request(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Request::Metrics
        );
        assert_eq!(
            parse_request(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"),
            Request::Metrics
        );
        assert_eq!(parse_request(b"GET / HTTP/1.1\r\n\r\n"), Request::NotFound);
        assert_eq!(
            parse_request(b"POST /metrics HTTP/1.1\r\n\r\n"),
            Request::BadMethod
        );
        assert_eq!(parse_request(b"GET /metrics\r\n\r\n"), Request::Malformed);
        assert_eq!(parse_request(b"\xff\xfe\r\n\r\n"), Request::Malformed);
    }

    #[tokio::test]
    async fn a_request_head_past_the_limit_is_refused() {
        let mut long = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        long.resize(MAX_REQUEST + 10, b'a');
        let mut reader: &[u8] = &long;
        assert_eq!(read_request(&mut reader).await, Request::TooLarge);
        let mut ok: &[u8] = b"GET /metrics HTTP/1.1\r\n\r\n";
        assert_eq!(read_request(&mut ok).await, Request::Metrics);
    }

    const GUARD: &str = "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [443]\ndeny:\n  - preset: cloud-metadata\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n";
    const RESOLVE: &str = "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\ndns:\n  resolvers: [192.0.2.53]\n";

    fn core(text: &str) -> (Core, MemoryTable, tokio::time::Instant) {
        let p = Policy::parse(text, Path::new("p.yaml")).expect("valid");
        let guard = GuardIdentity::of_policy(&p, 990);
        let now = tokio::time::Instant::now();
        let mut c = Core::new(p, text.into(), "/p.yaml".into(), Vec::new(), guard, now);
        let mut table = MemoryTable::new();
        c.apply_all(&mut table, now, &mut Vec::new())
            .expect("applied");
        (c, table, now)
    }

    /// Everything a scrape of `metrics` shows, the table as `table` holds it.
    fn scraped(metrics: &Metrics) -> String {
        let table = TableFacts {
            present: true,
            read_error: false,
            refused: Refused {
                ipv4: Counter {
                    packets: 3,
                    bytes: 180,
                },
                ipv6: Counter::default(),
            },
            denied: Refused {
                ipv4: Counter {
                    packets: 1,
                    bytes: 60,
                },
                ipv6: Counter::default(),
            },
            sets: vec![("resolved4".into(), 1)],
        };
        render(metrics.scrape(table))
    }

    #[test]
    fn names_the_sandbox_chooses_never_become_labels() {
        let (mut c, mut table, now) = core(GUARD);
        let metrics = Metrics::new(true);
        metrics.guard_counters(Arc::new(Counters::default()));
        // A name the sandbox invented under the allowed wildcard, answered and installed.
        let invented = "exfil-c2VjcmV0.pool.example";
        let answer = GuardAnswer {
            id: 1,
            name: invented.parse().unwrap(),
            addrs: vec![ResolvedAddr {
                addr: "203.0.113.7".parse().unwrap(),
                ttl: 300,
            }],
        };
        let host_addrs = Default::default();
        c.on(
            Event::GuardAnswers {
                answers: vec![answer],
                host_addrs: &host_addrs,
            },
            now,
            &mut table,
        );
        // Refused packets: to the metadata service (a deny preset), to the invented name's
        // address on another port, and anywhere else.
        for dst in ["169.254.169.254", "203.0.113.7", "192.0.2.99"] {
            for effect in c.on(
                Event::Refused {
                    event: DropEvent::refused_to(dst, 8443),
                    host_addrs: &host_addrs,
                },
                now,
                &mut table,
            ) {
                if let crate::daemon::core::Effect::CountRefused {
                    family,
                    reason,
                    deny_entry,
                } = effect
                {
                    metrics.count_refused(family, reason, deny_entry);
                }
            }
        }
        metrics.publish(c.view(now));
        let text = scraped(&metrics);
        assert!(
            !text.contains("exfil"),
            "a learned name became a label:\n{text}"
        );
        assert!(
            !text.contains("203.0.113"),
            "an address became a label:\n{text}"
        );
        assert!(
            text.contains(
                "egress_fence_refused_logged_packets_total{family=\"ipv4\",reason=\"deny\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("{family=\"ipv4\",reason=\"other_port\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("{family=\"ipv4\",reason=\"not_in_policy\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "egress_fence_refused_logged_denied_packets_total{entry=\"preset cloud-metadata\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("egress_fence_names 1"), "{text}");
        assert!(!text.contains("egress_fence_lookup_failures"), "{text}");
        // Every label value is one of the bounded vocabularies, or the policy's own words.
        let allowed_values: Vec<&str> = ["ipv4", "ipv6", "answered", "refused", "failed"]
            .into_iter()
            .chain(WhyRefused::REASONS)
            .chain([
                "preset cloud-metadata",
                "resolved4",
                env!("CARGO_PKG_VERSION"),
            ])
            .collect();
        for value in label_values(&text) {
            let bucket = value.parse::<f64>().is_ok() || value == "+Inf";
            assert!(
                bucket || allowed_values.contains(&value.as_str()),
                "unbounded label value {value:?}:\n{text}"
            );
        }
    }

    /// Every label value in `text`.
    fn label_values(text: &str) -> Vec<String> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| Some(l.split_once('{')?.1.rsplit_once('}')?.0.to_string()))
            .flat_map(|labels| {
                labels
                    .split("\",")
                    .filter_map(|kv| Some(kv.split_once("=\"")?.1.trim_end_matches('"').into()))
                    .collect::<Vec<String>>()
            })
            .collect()
    }

    #[test]
    fn resolve_mode_names_the_policys_names_and_their_failures() {
        let (mut c, mut table, now) = core(RESOLVE);
        let failed = ResolvedHost {
            name: "a.example".parse().unwrap(),
            addrs: Vec::new(),
            nxdomain: false,
            dropped: Vec::new(),
            errors: vec!["timed out".into()],
        };
        c.on(Event::Answers(vec![failed]), now, &mut table);
        let metrics = Metrics::new(false);
        metrics.publish(c.view(now));
        metrics.recorded(7);
        let text = scraped(&metrics);
        assert!(
            text.contains("egress_fence_lookup_failures{name=\"a.example\"} 1"),
            "{text}"
        );
        assert!(text.contains("egress_fence_generation 7"), "{text}");
        assert!(
            text.contains("egress_fence_refused_packets_total{family=\"ipv4\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("egress_fence_refused_bytes_total{family=\"ipv4\"} 180"),
            "{text}"
        );
        assert!(
            text.contains("egress_fence_refused_denied_packets_total{family=\"ipv4\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("egress_fence_last_apply_timestamp_seconds "),
            "{text}"
        );
        // Without --log-drops nothing is read from NFLOG: no sampled reasons at all.
        assert!(!text.contains("refused_logged"), "{text}");
        assert!(!text.contains("egress_fence_guard_"), "{text}");
    }

    #[test]
    fn a_heal_names_its_culprit_in_one_series() {
        let metrics = Metrics::new(false);
        metrics.publish(CoreView {
            heals: 2,
            last_heal_by: Some("nft (netlink port 4242)\n\"x".into()),
            ..CoreView::default()
        });
        let text = scraped(&metrics);
        assert!(text.contains("egress_fence_heals_total 2"), "{text}");
        let info: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("egress_fence_last_heal_info{"))
            .collect();
        assert_eq!(info.len(), 1, "{text}");
        assert!(info[0].contains("nft (netlink port 4242)"), "{text}");
    }

    #[test]
    fn the_guard_latency_is_a_histogram() {
        let metrics = Metrics::new(false);
        let counters = Arc::new(Counters::default());
        counters.answered.fetch_add(2, Ordering::Relaxed);
        counters.refused.fetch_add(5, Ordering::Relaxed);
        counters.answer_latency.observe(Duration::from_millis(3));
        counters.answer_latency.observe(Duration::from_millis(300));
        metrics.guard_counters(counters);
        let text = scraped(&metrics);
        for line in [
            "egress_fence_guard_queries_total{result=\"answered\"} 2",
            "egress_fence_guard_queries_total{result=\"refused\"} 5",
            "egress_fence_guard_queries_total{result=\"failed\"} 0",
            "# TYPE egress_fence_guard_answer_seconds histogram",
            "egress_fence_guard_answer_seconds_bucket{le=\"0.005\"} 1",
            "egress_fence_guard_answer_seconds_bucket{le=\"0.5\"} 2",
            "egress_fence_guard_answer_seconds_bucket{le=\"+Inf\"} 2",
            "egress_fence_guard_answer_seconds_count 2",
        ] {
            assert!(text.contains(line), "{line}:\n{text}");
        }
    }
}
