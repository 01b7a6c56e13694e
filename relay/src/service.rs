//! The endpoints a long-running process serves over HTTP/1.1:
//!
//! * `/livez`: the process is alive (it answers);
//! * `/readyz`: every flow is connected and following, its last applied
//!   transaction within `service.ready_max_lag_seconds`, and not stopped by
//!   a quarantine, a drift or any other error (503 with the reason if not);
//! * `/healthz`: JSON, per flow, its state, lag and last error;
//! * `/metrics`: the Prometheus text of [`crate::metrics`].
//!
//! The flow's run reports into a [`Health`] as it goes; the endpoints only
//! read it, so a slow scraper never slows the flow. The listener binds to
//! loopback unless the config says otherwise: the endpoints have no
//! authentication and are read-only.

use crate::metrics::Metrics;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use serde::Serialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use crate::role::Role;

/// Where a flow is in its life, as /healthz shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FlowState {
    /// Connecting and checking, before capture streams.
    Starting,
    /// Copying the tables at a new boundary.
    Snapshotting,
    /// Capturing and applying.
    Following,
    /// A database went away; following again after a wait.
    Retrying,
    /// The sink holds at a schema change no sink applies on its own (see
    /// `last_error`), until the operator accepts it; capture goes on.
    Held,
    /// Ended: drained after SIGTERM, or stopped by an error that needs
    /// someone (see `last_error`).
    Stopped,
}

/// One flow's health as its run last reported it.
#[derive(Debug, Clone, Serialize)]
pub struct FlowHealth {
    pub flow: String,
    pub source_id: String,
    pub dataset_id: String,
    pub state: FlowState,
    /// Seconds from the source commit to the target commit of the last
    /// applied transaction; 0 once everything captured is applied.
    pub lag_seconds: Option<f64>,
    /// The last error, one line per cause; cleared when a round streams.
    pub last_error: Option<String>,
    /// The sink's log cursor was dropped past the log's cap: it is copied
    /// again at a boundary of its own once its target takes writes.
    pub needs_copy: bool,
    /// When the applier last reported its lag: a report this old adds its
    /// age to the lag, so an applier stuck on its target shows as lagging.
    #[serde(skip)]
    reported: Option<std::time::Instant>,
}

/// An applier reports at least every idle tick while it is free; a report
/// older than this means it is busy or stuck, and its age counts as lag.
const REPORT_GRACE: Duration = Duration::from_secs(5);

impl FlowHealth {
    /// The lag as of now: the last report, plus its age once that is past
    /// [`REPORT_GRACE`] while following.
    fn lag_at(&self, now: std::time::Instant) -> Option<f64> {
        match self.reported.map(|at| now.saturating_duration_since(at)) {
            Some(age) if self.state == FlowState::Following && age > REPORT_GRACE => {
                Some(self.lag_seconds.unwrap_or(0.0) + age.as_secs_f64())
            }
            _ => self.lag_seconds,
        }
    }
}

/// What a process's flows report and its endpoints read.
#[derive(Debug)]
pub struct Health {
    service: &'static str,
    /// `service.ready_max_lag_seconds`, reloadable.
    max_lag_secs: std::sync::atomic::AtomicU64,
    flows: Mutex<BTreeMap<String, FlowHealth>>,
}

/// A flow's handle on its [`Health`] entry.
#[derive(Debug, Clone)]
pub struct FlowReporter {
    health: Arc<Health>,
    flow: String,
}

impl Health {
    pub fn new(service: &'static str, max_lag: Duration) -> Arc<Self> {
        Arc::new(Health {
            service,
            max_lag_secs: std::sync::atomic::AtomicU64::new(max_lag.as_secs()),
            flows: Mutex::new(BTreeMap::new()),
        })
    }

    /// Adds a flow's sink (a flow of one sink: the flow), starting.
    pub fn flow(self: &Arc<Self>, flow: &str, source_id: &str, dataset_id: &str) -> FlowReporter {
        // One entry per sink: a flow's sink named after it keeps the
        // flow's own key.
        let key = if dataset_id == flow {
            flow.to_owned()
        } else {
            format!("{flow}/{dataset_id}")
        };
        self.lock().insert(
            key.clone(),
            FlowHealth {
                flow: flow.to_owned(),
                source_id: source_id.to_owned(),
                dataset_id: dataset_id.to_owned(),
                state: FlowState::Starting,
                lag_seconds: None,
                last_error: None,
                needs_copy: false,
                reported: None,
            },
        );
        FlowReporter {
            health: Arc::clone(self),
            flow: key,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, FlowHealth>> {
        // A reporter that panicked left whole values behind: keep serving.
        self.flows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A reloaded `service.ready_max_lag_seconds`.
    pub fn set_max_lag(&self, max_lag: Duration) {
        self.max_lag_secs
            .store(max_lag.as_secs(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Every flow as of now (lag aged, see [`FlowHealth::reported`]).
    pub fn snapshot(&self) -> Vec<FlowHealth> {
        self.snapshot_at(std::time::Instant::now())
    }

    fn snapshot_at(&self, now: std::time::Instant) -> Vec<FlowHealth> {
        self.lock()
            .values()
            .map(|f| FlowHealth {
                lag_seconds: f.lag_at(now),
                ..f.clone()
            })
            .collect()
    }

    /// Why the process is not ready; empty when it is.
    pub fn not_ready(&self) -> Vec<String> {
        self.not_ready_at(std::time::Instant::now())
    }

    fn not_ready_at(&self, now: std::time::Instant) -> Vec<String> {
        let flows = self.snapshot_at(now);
        if flows.is_empty() {
            return vec!["no flow is running".into()];
        }
        #[allow(clippy::cast_precision_loss)] // a bound in seconds
        let max = self.max_lag_secs.load(std::sync::atomic::Ordering::Relaxed) as f64;
        flows
            .iter()
            .filter_map(|f| {
                let who = if f.dataset_id == f.flow {
                    format!("flow {}", f.flow)
                } else {
                    format!("flow {}, sink {}", f.flow, f.dataset_id)
                };
                if f.needs_copy {
                    return Some(format!(
                        "{who}: needs a copy: it held the log past its cap (transport.retention_mib) and its cursor was dropped; it is copied again at a boundary of its own once its target takes writes"
                    ));
                }
                match (f.state, f.lag_seconds) {
                    (FlowState::Following, Some(lag)) if lag > max => Some(format!(
                        "{who}: lag {lag:.1} s is over service.ready_max_lag_seconds ({max} s)"
                    )),
                    (FlowState::Following, _) => None,
                    (state, _) => Some(match &f.last_error {
                        Some(e) => format!("{who}: {}: {e}", state_name(state)),
                        None => format!("{who}: {}", state_name(state)),
                    }),
                }
            })
            .collect()
    }
}

fn state_name(state: FlowState) -> &'static str {
    match state {
        FlowState::Starting => "starting",
        FlowState::Snapshotting => "snapshotting",
        FlowState::Following => "following",
        FlowState::Retrying => "retrying",
        FlowState::Held => "held",
        FlowState::Stopped => "stopped",
    }
}

impl FlowReporter {
    fn update(&self, change: impl FnOnce(&mut FlowHealth)) {
        if let Some(f) = self.health.lock().get_mut(&self.flow) {
            change(f);
        }
    }

    pub fn state(&self, state: FlowState) {
        self.update(|f| {
            match state {
                // The applier's silence counts from here: one whose first
                // transaction hangs on the target ages into lag too.
                FlowState::Following if f.state != FlowState::Following => {
                    f.last_error = None;
                    f.reported = Some(std::time::Instant::now());
                }
                FlowState::Following => f.last_error = None,
                // Its new copy has begun: what it needed is under way.
                FlowState::Snapshotting => f.needs_copy = false,
                // A new round: the last one's lag says nothing of this one.
                FlowState::Starting => {
                    f.lag_seconds = None;
                    f.reported = None;
                }
                _ => {}
            }
            f.state = state;
        });
    }

    pub fn lag(&self, seconds: f64) {
        self.update(|f| {
            f.lag_seconds = Some(seconds);
            f.reported = Some(std::time::Instant::now());
        });
    }

    /// Marks the flow's sink `dataset_id` as needing a copy (see
    /// [`FlowHealth::needs_copy`]).
    pub fn sink_needs_copy(&self, dataset_id: &str) {
        let mut flows = self.health.lock();
        let Some(flow) = flows.get(&self.flow).map(|f| f.flow.clone()) else {
            return;
        };
        for f in flows.values_mut() {
            if f.flow == flow && f.dataset_id == dataset_id {
                f.needs_copy = true;
            }
        }
    }

    pub fn failed(&self, state: FlowState, error: String) {
        self.update(|f| {
            f.state = state;
            f.last_error = Some(error);
        });
    }
}

/// What a flow's run reports into (its metrics and its health entry),
/// and the settings a SIGHUP may change under it.
#[derive(Debug, Clone)]
pub struct Observer {
    pub metrics: crate::metrics::FlowMetrics,
    pub health: FlowReporter,
    pub live: Arc<LiveSettings>,
    /// The process's registry, where a flow's other sinks add their series.
    pub registry: crate::metrics::Metrics,
}

impl Observer {
    /// What one of the flow's other sinks reports into: its own apply
    /// series (`dataset_id` = the sink) and its own health entry.
    pub fn sink(&self, flow: &str, source_id: &str, sink: &str) -> Observer {
        Observer {
            metrics: self.registry.flow(Role::Apply, source_id, sink),
            health: self.health.health.flow(flow, source_id, sink),
            live: Arc::clone(&self.live),
            registry: self.registry.clone(),
        }
    }
}

/// The flow's settings a reload applies while it runs; the run reads each
/// where it acts on it, so the next use sees the new value.
#[derive(Debug)]
pub struct LiveSettings {
    /// The log's size limit in bytes (`transport.retention_mib`);
    /// `u64::MAX`: none.
    retention_bytes: std::sync::atomic::AtomicU64,
    /// The flow's tables, once a reload changed them: a following flow
    /// ends its round and starts the next with them.
    tables: tokio::sync::watch::Sender<Option<Vec<String>>>,
}

impl LiveSettings {
    pub fn new(retention_bytes: Option<u64>) -> Arc<Self> {
        Arc::new(LiveSettings {
            retention_bytes: std::sync::atomic::AtomicU64::new(retention_bytes.unwrap_or(u64::MAX)),
            tables: tokio::sync::watch::Sender::new(None),
        })
    }

    pub fn set_tables(&self, tables: Vec<String>) {
        self.tables.send_replace(Some(tables));
    }

    /// The tables a reload set, watched from now on.
    pub fn tables(&self) -> tokio::sync::watch::Receiver<Option<Vec<String>>> {
        self.tables.subscribe()
    }

    pub fn set_retention(&self, bytes: Option<u64>) {
        self.retention_bytes.store(
            bytes.unwrap_or(u64::MAX),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    pub fn retention(&self) -> Option<u64> {
        Some(
            self.retention_bytes
                .load(std::sync::atomic::Ordering::Relaxed),
        )
        .filter(|&b| b != u64::MAX)
    }
}

#[derive(Debug, thiserror::Error)]
#[error(
    "could not listen on {addr} for the service endpoints\nhint: set service.relay_listen (or service.apply_listen) in the config to a free address; port 0 picks one"
)]
pub struct BindError {
    addr: SocketAddr,
    #[source]
    source: std::io::Error,
}

/// Connections answered at once; a scraper needs one.
const MAX_CONNECTIONS: usize = 32;

/// A bound listener; [`Endpoints::serve`] answers on it.
#[derive(Debug)]
pub struct Endpoints {
    listener: tokio::net::TcpListener,
    metrics: Metrics,
    health: Arc<Health>,
}

impl Endpoints {
    pub async fn bind(
        addr: SocketAddr,
        metrics: Metrics,
        health: Arc<Health>,
    ) -> Result<Self, BindError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| BindError { addr, source })?;
        Ok(Endpoints {
            listener,
            metrics,
            health,
        })
    }

    /// The address bound (with the port chosen when the config said 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap_or_else(|_| {
            // A bound TCP listener always has an address; keep the type total.
            SocketAddr::from(([127, 0, 0, 1], 0))
        })
    }

    /// Answers until the process ends; each connection on its own task, so
    /// a client that stalls holds only itself.
    pub async fn serve(self) {
        let shared = Arc::new((self.metrics, self.health));
        // A client that opens connections without end holds at most this
        // many descriptors; the rest wait in the listen backlog.
        let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        loop {
            let Ok(permit) = Arc::clone(&open).acquire_owned().await else {
                return;
            };
            let Ok((stream, _)) = self.listener.accept().await else {
                // Out of descriptors, say: wait rather than spin.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let shared = Arc::clone(&shared);
            tokio::spawn(async move {
                let _permit = permit;
                let service = hyper::service::service_fn(move |request| {
                    let shared = Arc::clone(&shared);
                    async move {
                        Ok::<_, std::convert::Infallible>(answer(&request, &shared.0, &shared.1))
                    }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let connection = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(10))
                    .serve_connection(io, service);
                if let Err(e) = connection.await {
                    tracing::debug!(error = %e, "service endpoint connection ended");
                }
            });
        }
    }
}

fn answer<B>(request: &Request<B>, metrics: &Metrics, health: &Health) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "only GET\n".into(),
        );
    }
    match request.uri().path() {
        "/livez" => reply(StatusCode::OK, "text/plain", "ok\n".into()),
        "/readyz" => {
            let reasons = health.not_ready();
            if reasons.is_empty() {
                reply(StatusCode::OK, "text/plain", "ready\n".into())
            } else {
                let mut body = String::from("not ready\n");
                for r in reasons {
                    body.push_str(&r);
                    body.push('\n');
                }
                reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", body)
            }
        }
        "/healthz" => {
            let body = serde_json::json!({
                "service": health.service,
                "ready": health.not_ready().is_empty(),
                "flows": health.snapshot(),
            });
            reply(StatusCode::OK, "application/json", format!("{body:#}\n"))
        }
        "/metrics" => reply(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            metrics.render(),
        ),
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /livez, /readyz, /healthz or /metrics\n".into(),
        ),
    }
}

fn reply(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_while_following_within_the_lag_bound() {
        let health = Health::new("relay", Duration::from_secs(5));
        assert_eq!(health.not_ready(), ["no flow is running"]);
        let flow = health.flow("shop", "1:db", "shop");
        assert!(!health.not_ready().is_empty(), "starting is not ready");
        flow.state(FlowState::Following);
        flow.lag(0.2);
        assert!(health.not_ready().is_empty());
        flow.lag(9.0);
        assert!(health.not_ready()[0].contains("lag 9.0 s"));
        flow.lag(0.0);
        flow.failed(FlowState::Stopped, "transaction 7 is quarantined".into());
        assert!(health.not_ready()[0].contains("quarantined"));
        // Streaming again clears the last error.
        flow.state(FlowState::Following);
        assert!(health.not_ready().is_empty());
        assert!(health.snapshot()[0].last_error.is_none());
    }

    #[test]
    fn an_applier_that_stops_reporting_ages_into_lag() {
        let health = Health::new("apply", Duration::from_secs(60));
        let flow = health.flow("shop", "1:db", "shop");
        flow.state(FlowState::Following);
        flow.lag(0.0);
        let now = std::time::Instant::now();
        assert!(health.not_ready_at(now + REPORT_GRACE).is_empty());
        // Stuck on its target for two minutes: the age is the lag.
        let later = now + Duration::from_secs(120);
        let lag = health.snapshot_at(later)[0].lag_seconds.unwrap_or_default();
        assert!(lag >= 120.0, "{lag}");
        assert!(health.not_ready_at(later)[0].contains("over service.ready_max_lag_seconds"));
        // A flow retrying is not ready for that reason, not for its age.
        flow.failed(FlowState::Retrying, "capture: connection refused".into());
        assert!(health.not_ready_at(later)[0].contains("retrying: capture: connection refused"));
        // A new round: following again with no report yet ages from then,
        // not from the last round's report.
        flow.state(FlowState::Starting);
        assert_eq!(health.snapshot()[0].lag_seconds, None);
        flow.state(FlowState::Following);
        let now = std::time::Instant::now();
        assert!(health.not_ready_at(now).is_empty());
        let stuck = health.not_ready_at(now + Duration::from_secs(90));
        assert!(
            stuck[0].contains("over service.ready_max_lag_seconds"),
            "{stuck:?}"
        );
    }
}
