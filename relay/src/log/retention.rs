//! Retention: which sealed segments may be deleted, and who is in the way.
//!
//! Invariants:
//! * Only a prefix of the sealed segments is ever deleted (oldest first), so
//!   the log never has a hole; the active segment is never deleted.
//! * A segment is deleted only when every registered cursor is at or past
//!   its end (the cursor's next offset is not inside or before it).
//! * When the policy wants a segment gone but a cursor still needs it,
//!   nothing from that segment on is deleted and the holders are reported
//!   in [`RetentionReport::pressure`]: back-pressure, not data loss.

use std::path::PathBuf;
use std::time::Duration;

use super::cursor::CursorPosition;

/// When sealed segments become eligible for deletion. A segment is eligible
/// if *any* configured limit is exceeded; `RetentionPolicy::default()` keeps
/// everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Keep the log (all segments, active included) at or below this size.
    pub max_total_bytes: Option<u64>,
    /// Delete segments sealed longer ago than this.
    pub max_age: Option<Duration>,
    /// Keep at most this many segments (active included; at least 1 stays).
    pub max_segments: Option<usize>,
}

impl RetentionPolicy {
    /// A policy with no limits.
    pub fn keep_all() -> Self {
        RetentionPolicy::default()
    }
}

/// What one retention pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetentionReport {
    /// Segments removed, oldest first.
    pub deleted: Vec<DeletedSegment>,
    /// Consumers whose cursors kept eligible segments alive.
    pub pressure: Vec<ConsumerPressure>,
}

impl RetentionReport {
    /// Whether some consumer kept the policy from being met.
    pub fn under_pressure(&self) -> bool {
        !self.pressure.is_empty()
    }
}

/// A segment retention removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeletedSegment {
    pub path: PathBuf,
    pub base_offset: u64,
    /// One past its last record.
    pub next_offset: u64,
    pub bytes: u64,
}

/// A consumer holding segments that retention wants to delete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsumerPressure {
    pub consumer: String,
    pub next_offset: u64,
    /// Eligible segments this consumer has not finished reading.
    pub held_segments: usize,
    pub held_bytes: u64,
}

/// A sealed segment as retention sees it.
#[derive(Clone, Debug)]
pub(crate) struct SealedFacts {
    pub path: PathBuf,
    pub base_offset: u64,
    pub next_offset: u64,
    pub bytes: u64,
    /// When it was sealed (the next segment's creation time).
    pub sealed_unix_ms: u64,
}

/// The decision of one pass: delete `sealed[..delete]`, report `pressure`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub delete: usize,
    pub pressure: Vec<ConsumerPressure>,
}

/// Decides what to delete. `sealed` is oldest first; `total_bytes` and
/// `total_segments` include the active segment.
pub(crate) fn plan<'a>(
    policy: &RetentionPolicy,
    sealed: &[SealedFacts],
    total_bytes: u64,
    total_segments: usize,
    now_unix_ms: u64,
    cursors: impl IntoIterator<Item = (&'a String, &'a CursorPosition)> + Clone,
) -> Plan {
    let mut bytes = total_bytes;
    let mut count = total_segments;
    let mut eligible = 0;
    for segment in sealed {
        let too_big = policy.max_total_bytes.is_some_and(|max| bytes > max);
        let too_many = policy.max_segments.is_some_and(|max| count > max.max(1));
        let too_old = policy.max_age.is_some_and(|age| {
            let age_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
            now_unix_ms.saturating_sub(segment.sealed_unix_ms) > age_ms
        });
        if !(too_big || too_many || too_old) {
            break;
        }
        eligible += 1;
        bytes = bytes.saturating_sub(segment.bytes);
        count -= 1;
    }
    let wanted = sealed.get(..eligible).unwrap_or_default();
    let delete = wanted
        .iter()
        .take_while(|s| {
            cursors
                .clone()
                .into_iter()
                .all(|(_, c)| c.next_offset >= s.next_offset)
        })
        .count();
    let blocked = wanted.get(delete..).unwrap_or_default();
    let pressure = cursors
        .into_iter()
        .filter_map(|(consumer, cursor)| {
            let held: Vec<&SealedFacts> = blocked
                .iter()
                .filter(|s| cursor.next_offset < s.next_offset)
                .collect();
            (!held.is_empty()).then(|| ConsumerPressure {
                consumer: consumer.clone(),
                next_offset: cursor.next_offset,
                held_segments: held.len(),
                held_bytes: held.iter().map(|s| s.bytes).sum(),
            })
        })
        .collect();
    Plan { delete, pressure }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn sealed(n: u64) -> Vec<SealedFacts> {
        (0..n)
            .map(|i| SealedFacts {
                path: PathBuf::from(format!("{i}.seg")),
                base_offset: i * 10,
                next_offset: i * 10 + 10,
                bytes: 100,
                sealed_unix_ms: 1_000 * (i + 1),
            })
            .collect()
    }

    #[test]
    fn deletes_prefix_until_under_the_byte_limit() {
        let policy = RetentionPolicy {
            max_total_bytes: Some(250),
            ..RetentionPolicy::default()
        };
        // 4 sealed + active = 500 bytes; must drop 3 sealed to reach 200.
        let cursors: BTreeMap<String, CursorPosition> = BTreeMap::new();
        let plan = plan(&policy, &sealed(4), 500, 5, 0, &cursors);
        assert_eq!(plan.delete, 3);
        assert!(plan.pressure.is_empty());
    }

    #[test]
    fn a_cursor_inside_an_eligible_segment_blocks_it_and_everything_after() {
        let policy = RetentionPolicy {
            max_segments: Some(1),
            ..RetentionPolicy::default()
        };
        let mut cursors = BTreeMap::new();
        cursors.insert("fast".to_owned(), CursorPosition::start_at(40));
        cursors.insert("slow".to_owned(), CursorPosition::start_at(15));
        let plan = plan(&policy, &sealed(4), 500, 5, 0, &cursors);
        assert_eq!(
            plan.delete, 1,
            "segment 0 is done by both; segment 1 holds slow"
        );
        assert_eq!(
            plan.pressure,
            vec![ConsumerPressure {
                consumer: "slow".into(),
                next_offset: 15,
                held_segments: 3,
                held_bytes: 300,
            }]
        );
    }

    #[test]
    fn age_counts_from_sealing_and_default_keeps_everything() {
        let by_age = RetentionPolicy {
            max_age: Some(Duration::from_millis(2_500)),
            ..RetentionPolicy::default()
        };
        let none: BTreeMap<String, CursorPosition> = BTreeMap::new();
        assert_eq!(plan(&by_age, &sealed(4), 500, 5, 5_000, &none).delete, 2);
        assert_eq!(
            plan(
                &RetentionPolicy::keep_all(),
                &sealed(4),
                500,
                5,
                u64::MAX,
                &none
            )
            .delete,
            0
        );
    }
}
