//! How far a stopping run must go, and when verify may look at the slot:
//! the end of the last WAL record the source had inserted at the start.
//!
//! Not `pg_current_wal_lsn()`: that is the write position, and a
//! transaction committed with `synchronous_commit = off` may lie past it
//! (in WAL buffers), so a run that stops there misses it and verify takes
//! plain lag for a divergence. Not the raw insert position either: right
//! after a record that fills its page it points past the next page's
//! header, which an idle server never flushes (nothing follows), so a run
//! waiting for it would never end. The header is stepped back over; what
//! is left is a record's end, which the walwriter flushes within
//! three `wal_writer_delay`s of an asynchronous commit.

use std::time::{Duration, Instant};
use tokio_postgres::Client;
use trellara_common::Lsn;

/// `SizeOfXLogShortPHD` and `SizeOfXLogLongPHD` (64-bit, MAXALIGNed): the
/// headers of a WAL page and of a segment's first page.
const SHORT_PAGE_HEADER: u64 = 24;
const LONG_PAGE_HEADER: u64 = 40;

/// The end of the last record before `insert`: a position just past a
/// page header is the page's start.
pub fn record_end(insert: Lsn, block_size: u64, segment_size: u64) -> Lsn {
    let at = insert.0;
    if segment_size > 0 && at % segment_size == LONG_PAGE_HEADER && at >= LONG_PAGE_HEADER {
        return Lsn(at - LONG_PAGE_HEADER);
    }
    if block_size > 0 && at % block_size == SHORT_PAGE_HEADER && at >= SHORT_PAGE_HEADER {
        return Lsn(at - SHORT_PAGE_HEADER);
    }
    insert
}

/// The end of the last record the source has inserted: every transaction
/// committed before this call ends at or before it.
pub async fn last_record_end(source: &Client) -> Result<Lsn, HorizonError> {
    let row = source
        .query_one(
            "SELECT pg_current_wal_insert_lsn()::text,
                    current_setting('wal_block_size')::int8,
                    (SELECT setting::int8 FROM pg_settings WHERE name = 'wal_segment_size')",
            &[],
        )
        .await
        .map_err(HorizonError::Query)?;
    let text: String = row.get(0);
    let insert: Lsn = text
        .parse()
        .map_err(|_| HorizonError::BadLsn(text.clone()))?;
    let (block, segment): (i64, i64) = (row.get(1), row.get(2));
    Ok(record_end(
        insert,
        u64::try_from(block).unwrap_or(0),
        u64::try_from(segment).unwrap_or(0),
    ))
}

/// How long an asynchronous commit may stay unflushed on the source: the
/// walwriter flushes it within three `wal_writer_delay`s; a second more
/// for the round trips.
pub async fn flush_patience(source: &Client) -> Result<Duration, HorizonError> {
    let delay_ms: i64 = source
        .query_one(
            "SELECT setting::int8 FROM pg_settings WHERE name = 'wal_writer_delay'",
            &[],
        )
        .await
        .map_err(HorizonError::Query)?
        .get(0);
    Ok(Duration::from_millis(u64::try_from(delay_ms).unwrap_or(200) * 3) + Duration::from_secs(1))
}

/// Waits until the source has flushed its WAL through `end` (what logical
/// decoding, and so a slot peek, can see), for at most `patience`. False
/// when it did not.
pub async fn flushed_through(
    source: &Client,
    end: Lsn,
    patience: Duration,
) -> Result<bool, HorizonError> {
    let deadline = Instant::now() + patience;
    loop {
        let text: String = source
            .query_one("SELECT pg_current_wal_flush_lsn()::text", &[])
            .await
            .map_err(HorizonError::Query)?
            .get(0);
        let flushed: Lsn = text
            .parse()
            .map_err(|_| HorizonError::BadLsn(text.clone()))?;
        if flushed >= end {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HorizonError {
    #[error("read the source's WAL position")]
    Query(#[source] tokio_postgres::Error),
    #[error("the source's WAL position reads {0:?}, not an LSN")]
    BadLsn(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK: u64 = 8192;
    const SEGMENT: u64 = 16 << 20;

    #[test]
    fn a_position_past_a_page_header_is_the_page_start() {
        let page = 0x1_0300_0000 + 5 * BLOCK;
        assert_eq!(record_end(Lsn(page + 24), BLOCK, SEGMENT), Lsn(page));
        let segment = 0x1_0300_0000;
        assert_eq!(record_end(Lsn(segment + 40), BLOCK, SEGMENT), Lsn(segment));
        for inside in [page + 25, page + 4000, page + 40, segment + 24 + BLOCK - 1] {
            assert_eq!(record_end(Lsn(inside), BLOCK, SEGMENT), Lsn(inside));
        }
    }
}
