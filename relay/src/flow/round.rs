//! How a round's parts end each other. A round runs three parts on one
//! log: capture writes it, the stage (the applier, or the relay role's
//! publisher) takes what is durable, and what watches beside them (the
//! flow's other sinks, the gauges, `semantics`' watcher) looks on. The
//! rules, which the live run ([`super::run`]) and the simulator's pipeline
//! family both get from [`drive`]:
//!
//! * capture stops as soon as the stage failed: it would write for no one,
//!   and a following round would never end;
//! * the stage learns that capture ended, however it ended, then takes
//!   what is left and ends: what was durable is applied before the round
//!   reports capture's error;
//! * what watches beside learns that capture ended and that the stage
//!   ended.
//!
//! All three always finish; the caller reads each one's outcome.

use std::future::Future;
use tokio::sync::watch;

/// What the parts beside the stage are told.
#[derive(Debug)]
pub struct Ends {
    /// Turns true once capture ended.
    pub captured: watch::Receiver<bool>,
    /// Turns true once the stage ended.
    pub applied: watch::Receiver<bool>,
}

/// Runs one round's parts together: `capture` is given what turns true
/// when the stage failed (its stop), `stage` what turns true when capture
/// ended, `beside` both ends.
pub async fn drive<C, A, B, T, E>(
    capture: impl FnOnce(watch::Receiver<bool>) -> C,
    stage: impl FnOnce(watch::Receiver<bool>) -> A,
    beside: impl FnOnce(Ends) -> B,
) -> (C::Output, Result<T, E>, B::Output)
where
    C: Future,
    A: Future<Output = Result<T, E>>,
    B: Future,
{
    // The senders live until every part finished: a receiver takes a
    // dropped sender for a signal, so a stage that ended well would stop
    // a capture still writing for the others.
    let (failed_tx, failed) = watch::channel(false);
    let (captured_tx, captured) = watch::channel(false);
    let (applied_tx, applied) = watch::channel(false);
    let ends = Ends {
        captured: captured.clone(),
        applied,
    };
    let (capture, stage, beside) = (capture(failed), stage(captured), beside(ends));
    let capture = async {
        let out = capture.await;
        #[cfg(test)]
        let unsaid = mutation::CAPTURE_END_UNSAID.with(std::cell::Cell::get);
        #[cfg(not(test))]
        let unsaid = false;
        if !unsaid {
            let _ = captured_tx.send(true);
        }
        out
    };
    let stage = async {
        let out = stage.await;
        #[cfg(test)]
        let unsaid = mutation::STAGE_FAILURE_UNSAID.with(std::cell::Cell::get);
        #[cfg(not(test))]
        let unsaid = false;
        if out.is_err() && !unsaid {
            let _ = failed_tx.send(true);
        }
        let _ = applied_tx.send(true);
        out
    };
    tokio::join!(capture, stage, beside)
}

/// Test-only switches that break one rule each, for the simulator's
/// mutation checks (its pipeline family must see the round that never
/// ends).
#[cfg(test)]
pub(crate) mod mutation {
    use std::cell::Cell;
    thread_local! {
        /// The stage is not told that capture ended.
        pub(crate) static CAPTURE_END_UNSAID: Cell<bool> = const { Cell::new(false) };
        /// Capture is not told that the stage failed.
        pub(crate) static STAGE_FAILURE_UNSAID: Cell<bool> = const { Cell::new(false) };
    }
}
