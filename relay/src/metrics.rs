//! The seven metrics of the observability contract, from the `prometheus`
//! crate. Each carries exactly the labels `service`, `source_id` and
//! `dataset_id` (a histogram adds only `le`): the label set cannot grow with
//! transactions, tables or errors, which go to logs and evidence records.
//! `dataset_id` names the sink, so two targets of one source are two series.
//!
//! Capture-side series carry `service="relay"` and apply-side ones
//! `service="apply"`, so a flow exposes the same series whether one process
//! runs both roles (`run --follow`) or two do. Names and meanings are listed
//! in docs/CLI.md.

use crate::role::{APPLY, RELAY, Role};
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

const LABELS: [&str; 3] = ["service", "source_id", "dataset_id"];

/// Commit-to-apply lag buckets, in seconds: from a millisecond (a hop on
/// one machine) to five minutes (a drained backlog).
const LAG_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// A process's registry with the seven metric families.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    captured: IntCounterVec,
    applied: IntCounterVec,
    duplicates: IntCounterVec,
    quarantined: IntCounterVec,
    slot_wal: IntGaugeVec,
    log_bytes: IntGaugeVec,
    lag: HistogramVec,
}

/// One flow's series (one source, one sink), bound to their labels.
/// Cheap to clone: clones update the same series.
#[derive(Debug, Clone)]
pub struct FlowMetrics {
    /// Source transactions received complete and written to the log.
    pub captured: IntCounter,
    /// Source transactions committed on the sink.
    pub applied: IntCounter,
    /// Redelivered transactions the sink's checkpoint skipped.
    pub duplicates: IntCounter,
    /// Transactions the sink refused and quarantined.
    pub quarantined: IntCounter,
    /// WAL the source keeps for the flow's slot (current LSN minus
    /// restart_lsn).
    pub slot_wal: IntGauge,
    /// Bytes of segments the durable log holds.
    pub log_bytes: IntGauge,
    /// Seconds from a transaction's source commit to its sink commit.
    pub lag: Histogram,
    /// The last observed lag, in microseconds (for /healthz).
    last_lag_micros: std::sync::Arc<std::sync::atomic::AtomicI64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str| {
            let vec = IntCounterVec::new(Opts::new(name, help), &LABELS).expect("valid metric");
            registry
                .register(Box::new(vec.clone()))
                .expect("registered once");
            vec
        };
        let gauge = |name: &str, help: &str| {
            let vec = IntGaugeVec::new(Opts::new(name, help), &LABELS).expect("valid metric");
            registry
                .register(Box::new(vec.clone()))
                .expect("registered once");
            vec
        };
        let captured = counter(
            "trellara_captured_transactions_total",
            "Source transactions received complete and written to the durable log.",
        );
        let applied = counter(
            "trellara_applied_transactions_total",
            "Source transactions committed on the sink, each with its checkpoint.",
        );
        let duplicates = counter(
            "trellara_skipped_duplicate_transactions_total",
            "Redelivered source transactions skipped because the sink's checkpoint already holds them.",
        );
        let quarantined = counter(
            "trellara_quarantined_transactions_total",
            "Source transactions the sink refused and recorded in trellara.quarantine.",
        );
        let slot_wal = gauge(
            "trellara_slot_retained_wal_bytes",
            "WAL the source keeps for the flow's replication slot: current WAL LSN minus the slot's restart_lsn.",
        );
        let log_bytes = gauge(
            "trellara_log_retained_bytes",
            "Bytes of segments the flow's durable log holds.",
        );
        let lag = HistogramVec::new(
            HistogramOpts::new(
                "trellara_commit_to_apply_lag_seconds",
                "Seconds from a transaction's commit on the source to its commit on the sink.",
            )
            .buckets(LAG_BUCKETS.to_vec()),
            &LABELS,
        )
        .expect("valid metric");
        registry
            .register(Box::new(lag.clone()))
            .expect("registered once");
        Metrics {
            registry,
            captured,
            applied,
            duplicates,
            quarantined,
            slot_wal,
            log_bytes,
            lag,
        }
    }

    /// The series of one flow that `role` owns; they exist (at zero) from
    /// now on, so a scrape shows the flow before its first transaction.
    /// The other role's handles count into nothing registered: a relay
    /// process shows no apply series, and an apply process no capture
    /// series, so two processes never both claim one.
    pub fn flow(&self, role: Role, source_id: &str, dataset_id: &str) -> FlowMetrics {
        let relay = [RELAY, source_id, dataset_id];
        let apply = [APPLY, source_id, dataset_id];
        let counter = |vec: &IntCounterVec, labels: &[&str; 3], owned: bool| {
            if owned {
                vec.with_label_values(labels)
            } else {
                IntCounter::new("detached", "not this process's role").expect("valid metric")
            }
        };
        let gauge = |vec: &IntGaugeVec, labels: &[&str; 3], owned: bool| {
            if owned {
                vec.with_label_values(labels)
            } else {
                IntGauge::new("detached", "not this process's role").expect("valid metric")
            }
        };
        let (captures, applies) = (role.captures(), role.applies());
        FlowMetrics {
            captured: counter(&self.captured, &relay, captures),
            applied: counter(&self.applied, &apply, applies),
            duplicates: counter(&self.duplicates, &apply, applies),
            quarantined: counter(&self.quarantined, &apply, applies),
            slot_wal: gauge(&self.slot_wal, &relay, captures),
            log_bytes: gauge(&self.log_bytes, &relay, captures),
            lag: if applies {
                self.lag.with_label_values(&apply)
            } else {
                Histogram::with_opts(HistogramOpts::new("detached", "not this process's role"))
                    .expect("valid metric")
            },
            last_lag_micros: std::sync::Arc::default(),
        }
    }

    /// The Prometheus text exposition of every series.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding into a Vec cannot fail");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}

impl FlowMetrics {
    /// Records the lag of a transaction committed on the source at
    /// `commit_micros` (Unix microseconds) and applied now.
    pub fn observe_commit(&self, commit_micros: i64) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
        // Clocks of two machines: a commit "from the future" is no lag.
        let micros = now.saturating_sub(commit_micros).max(0);
        self.last_lag_micros
            .store(micros, std::sync::atomic::Ordering::Relaxed);
        #[allow(clippy::cast_precision_loss)] // seconds to a microsecond
        self.lag.observe(micros as f64 / 1e6);
    }
}

impl FlowMetrics {
    /// The lag of the transaction applied last, in seconds.
    pub fn last_lag_seconds(&self) -> f64 {
        #[allow(clippy::cast_precision_loss)] // seconds to a microsecond
        let micros = self
            .last_lag_micros
            .load(std::sync::atomic::Ordering::Relaxed) as f64;
        micros / 1e6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_has_exactly_the_three_labels() {
        let metrics = Metrics::new();
        let flow = metrics.flow(Role::Both, "7312:shop", "orders");
        flow.captured.inc_by(3);
        flow.applied.inc_by(2);
        flow.observe_commit(0);
        let text = metrics.render();
        let mut names = std::collections::BTreeSet::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (series, _) = line.rsplit_once(' ').unwrap();
            let (name, labels) = series.split_once('{').unwrap();
            let mut keys: Vec<&str> = labels
                .trim_end_matches('}')
                .split(',')
                .map(|kv| kv.split_once('=').unwrap().0)
                .filter(|k| !(*k == "le" && name.ends_with("_bucket")))
                .collect();
            keys.sort_unstable();
            assert_eq!(keys, ["dataset_id", "service", "source_id"], "{line}");
            names.insert(
                name.trim_end_matches("_bucket")
                    .trim_end_matches("_sum")
                    .trim_end_matches("_count")
                    .to_owned(),
            );
        }
        assert_eq!(names.len(), 7, "{names:?}");
        assert!(text.contains(
            "trellara_captured_transactions_total{dataset_id=\"orders\",service=\"relay\",source_id=\"7312:shop\"} 3"
        ));
        assert!(text.contains(
            "trellara_commit_to_apply_lag_seconds_bucket{dataset_id=\"orders\",service=\"apply\",source_id=\"7312:shop\",le=\"+Inf\"} 1"
        ));
    }

    #[test]
    fn a_role_shows_only_its_own_series() {
        let families = |role: Role| {
            let metrics = Metrics::new();
            let flow = metrics.flow(role, "7312:shop", "orders");
            flow.captured.inc();
            flow.applied.inc();
            flow.observe_commit(0);
            let text = metrics.render();
            let service = format!("service=\"{}\"", role.service());
            let names: std::collections::BTreeSet<String> = text
                .lines()
                .filter(|l| !l.starts_with('#'))
                .map(|l| {
                    assert!(l.contains(&service), "{l}");
                    let name = l.split('{').next().unwrap();
                    ["_bucket", "_sum", "_count"]
                        .iter()
                        .fold(name, |n, s| n.strip_suffix(s).unwrap_or(n))
                        .to_owned()
                })
                .collect();
            let names: Vec<String> = names.into_iter().collect();
            names.join(" ")
        };
        assert_eq!(
            families(Role::Relay),
            "trellara_captured_transactions_total trellara_log_retained_bytes trellara_slot_retained_wal_bytes"
        );
        assert_eq!(
            families(Role::Apply),
            "trellara_applied_transactions_total trellara_commit_to_apply_lag_seconds trellara_quarantined_transactions_total trellara_skipped_duplicate_transactions_total"
        );
    }
}
