//! Retention deletes only segments every cursor has passed, never the active
//! one, and reports which consumer holds what when it cannot.

mod log_support;

use std::sync::Arc;
use std::time::Duration;

use log_support::{contents, dir, open_sim, payload, segment_files};
use trellara_relay::log::storage::{SimCrash, SimStorage};
use trellara_relay::log::{CursorPosition, Error, LogConfig, ManualClock, RetentionPolicy};

/// 40 records of ~100 bytes over segments of ~4 records.
fn config(policy: RetentionPolicy, clock: Arc<ManualClock>) -> LogConfig {
    LogConfig {
        max_segment_bytes: 600,
        index_interval_bytes: 256,
        retention: policy,
        clock,
        ..LogConfig::default()
    }
}

fn fill(sim: &SimStorage, cfg: &LogConfig, clock: &ManualClock) -> Vec<(u64, Vec<u8>)> {
    let (log, _) = open_sim(sim, cfg);
    let model: Vec<(u64, Vec<u8>)> = (0..40).map(|i| (i + 10, payload(i, 100))).collect();
    for (lsn, p) in &model {
        clock.advance_ms(1_000);
        log.append(*lsn, p).unwrap();
    }
    model
}

#[test]
fn byte_limit_deletes_oldest_segments_but_never_the_active_one() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let sim = SimStorage::new(41);
    let cfg = config(
        RetentionPolicy {
            max_total_bytes: Some(0),
            ..RetentionPolicy::default()
        },
        clock.clone(),
    );
    let model = fill(&sim, &cfg, &clock);
    let (log, _) = open_sim(&sim, &cfg);
    let before = log.segments();
    assert!(before.len() > 5);
    let report = log.enforce_retention().unwrap();
    assert_eq!(
        report.deleted.len(),
        before.len() - 1,
        "all sealed, not the active"
    );
    assert!(!report.under_pressure());
    let after = log.segments();
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].path, before.last().unwrap().path);
    assert_eq!(segment_files(&sim, &dir()), vec![after[0].path.clone()]);
    let first = log.first_offset();
    assert_eq!(first, after[0].base_offset);
    assert_eq!(contents(&log), model[first as usize..]);
    assert!(matches!(
        log.read_from(0),
        Err(Error::OffsetTruncated { requested: 0, .. })
    ));
    // Deletions are durable and the log reopens consistently.
    drop(log);
    sim.crash(SimCrash::LoseUnsynced);
    let (log, report) = open_sim(&sim, &cfg);
    assert_eq!(report.first_offset, first);
    assert_eq!(log.next_offset(), 40);
    assert!(
        report.removed_files.is_empty(),
        "no orphan index left: {report:?}"
    );
}

#[test]
fn a_lagging_cursor_holds_its_segments_and_is_reported() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let sim = SimStorage::new(42);
    let cfg = config(
        RetentionPolicy {
            max_segments: Some(2),
            ..RetentionPolicy::default()
        },
        clock.clone(),
    );
    let model = fill(&sim, &cfg, &clock);
    let (log, _) = open_sim(&sim, &cfg);
    log.register_consumer("applier").unwrap();
    log.register_consumer("lake").unwrap();
    log.commit_cursor("lake", CursorPosition::after(39, 49))
        .unwrap();
    let segments = log.segments();

    // `applier` has read nothing: retention wants to delete but may not.
    let report = log.enforce_retention().unwrap();
    assert!(report.deleted.is_empty());
    assert_eq!(report.pressure.len(), 1);
    let held = &report.pressure[0];
    assert_eq!(held.consumer, "applier");
    assert_eq!(held.next_offset, 0);
    assert_eq!(held.held_segments, segments.len() - 2);
    let expected_bytes: u64 = segments[..segments.len() - 2].iter().map(|s| s.bytes).sum();
    assert_eq!(held.held_bytes, expected_bytes);
    assert_eq!(log.retention_pressure(), report.pressure);
    assert_eq!(contents(&log), model, "nothing deleted");

    // Once applier is inside segment 2, segments 0 and 1 may go, no more.
    let inside_third = segments[2].base_offset + 1;
    log.commit_cursor("applier", CursorPosition::start_at(inside_third))
        .unwrap();
    let report = log.enforce_retention().unwrap();
    assert_eq!(report.deleted.len(), 2);
    assert_eq!(report.deleted[1].next_offset, segments[2].base_offset);
    assert_eq!(log.first_offset(), segments[2].base_offset);
    assert_eq!(report.pressure[0].held_segments, segments.len() - 4);
    // Every record the lagging consumer still needs is there.
    let rest: Vec<u64> = log
        .read_from(inside_third)
        .unwrap()
        .map(|r| r.unwrap().offset)
        .collect();
    assert_eq!(rest, (inside_third..40).collect::<Vec<_>>());

    // Caught up: everything but the newest two segments goes.
    log.commit_cursor("applier", CursorPosition::after(39, 49))
        .unwrap();
    let report = log.enforce_retention().unwrap();
    assert!(!report.under_pressure());
    assert_eq!(log.segments().len(), 2);
    assert!(log.retention_pressure().is_empty());
}

#[test]
fn a_cursor_exactly_at_a_segment_end_does_not_hold_it() {
    let clock = Arc::new(ManualClock::new(0));
    let sim = SimStorage::new(43);
    let cfg = config(
        RetentionPolicy {
            max_segments: Some(1),
            ..RetentionPolicy::default()
        },
        clock.clone(),
    );
    fill(&sim, &cfg, &clock);
    let (log, _) = open_sim(&sim, &cfg);
    let segments = log.segments();
    log.register_consumer("c").unwrap();
    log.commit_cursor("c", CursorPosition::start_at(segments[1].base_offset))
        .unwrap();
    let report = log.enforce_retention().unwrap();
    assert_eq!(report.deleted.len(), 1, "segment 0 is fully consumed");
    assert_eq!(report.pressure[0].consumer, "c");
}

#[test]
fn age_limit_uses_the_injected_clock() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let sim = SimStorage::new(44);
    let cfg = config(
        RetentionPolicy {
            max_age: Some(Duration::from_secs(60)),
            ..RetentionPolicy::default()
        },
        clock.clone(),
    );
    fill(&sim, &cfg, &clock);
    let (log, _) = open_sim(&sim, &cfg);
    assert!(
        log.enforce_retention().unwrap().deleted.is_empty(),
        "all young"
    );
    clock.advance_ms(30_000);
    let some = log.enforce_retention().unwrap().deleted.len();
    assert!(some > 0 && log.segments().len() > 1, "only the older ones");
    clock.advance_ms(3_600_000);
    log.enforce_retention().unwrap();
    assert_eq!(log.segments().len(), 1, "the active segment always stays");
}

#[test]
fn default_policy_keeps_everything() {
    let clock = Arc::new(ManualClock::new(0));
    let sim = SimStorage::new(45);
    let cfg = config(RetentionPolicy::keep_all(), clock.clone());
    let model = fill(&sim, &cfg, &clock);
    let (log, _) = open_sim(&sim, &cfg);
    clock.advance_ms(u64::MAX / 2);
    let report = log.enforce_retention().unwrap();
    assert!(report.deleted.is_empty() && !report.under_pressure());
    assert_eq!(contents(&log), model);
}
