//! How a failure prints, for the CLI edge and the rounds of `run --follow`
//! (which report a failure they retry without ending): the one printer in
//! [`trellara_common::errors`], taking the `anyhow` errors the CLI holds.

pub use trellara_common::errors::{Chain, chain as chain_of};

/// An error and its causes on one line, each once, then its hints.
pub fn chain(err: &anyhow::Error) -> String {
    chain_of(err.as_ref())
}

#[cfg(test)]
mod tests {
    use std::error::Error;

    fn io() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::PermissionDenied, "Permission denied")
    }

    fn db() -> tokio_postgres::Error {
        "host=/x port=notaport"
            .parse::<tokio_postgres::Config>()
            .expect_err("not a port")
    }

    fn kafka() -> Box<rdkafka::error::KafkaError> {
        Box::new(rdkafka::error::KafkaError::ClientCreation(
            "no brokers".into(),
        ))
    }

    /// Every error of ours that wraps a cause, one of each kind of wrapper.
    fn wrappers() -> Vec<Box<dyn Error + Send + Sync>> {
        use crate::{apply, capture, config, flow, native, snapshot, throwaway, transport, verify};
        use trellara_external_relay::{assembler::AssemblyError, pgwire::WireError};
        vec![
            Box::new(crate::session::ConnectError::Session {
                side: "source",
                target: "db".into(),
                source: db(),
            }),
            Box::new(flow::FlowError::Target(db())),
            Box::new(flow::FlowError::Source {
                url: "postgresql://u@h/db".into(),
                source: db(),
            }),
            Box::new(flow::FlowError::LogDir {
                path: "/l".into(),
                source: io(),
            }),
            Box::new(flow::FlowError::Throwaway(throwaway::ThrowawayError::Io {
                path: "/t".into(),
                source: io(),
            })),
            Box::new(snapshot::SnapshotError::Target(db())),
            Box::new(snapshot::SnapshotError::Source(db())),
            Box::new(snapshot::SnapshotError::Wire(WireError::Io(io()))),
            Box::new(verify::VerifyError::Source(db())),
            Box::new(verify::VerifyError::Target(db())),
            Box::new(verify::VerifyError::LogLock {
                path: "/l".into(),
                source: io(),
            }),
            Box::new(apply::ApplyError::Target(
                apply::TargetError::Postgres(db()),
            )),
            Box::new(capture::CaptureError::BadTail {
                offset: 7,
                dir: "/l".into(),
                source: trellara_common::envelope::EnvelopeError::MissingField("source"),
            }),
            Box::new(config::ConfigError::Read {
                path: "/c".into(),
                source: io(),
            }),
            Box::new(native::NativeError::Io {
                context: "bind".into(),
                source: io(),
            }),
            Box::new(transport::TransportError::Kafka {
                brokers: "b:9092".into(),
                topic: "t".into(),
                source: kafka(),
            }),
            Box::new(WireError::Connect {
                to: "h:5432".into(),
                source: io(),
            }),
            Box::new(AssemblyError::Spill {
                xid: 9,
                source: io(),
            }),
        ]
    }

    #[test]
    fn an_error_states_its_own_message_and_leaves_its_cause_to_the_printer() {
        for err in wrappers() {
            let own = err.to_string();
            let cause = err.source().expect("a wrapper has a cause").to_string();
            assert!(!own.contains(&cause), "{own:?} repeats its cause {cause:?}");
            let line = super::chain_of(err.as_ref());
            assert_eq!(line.matches(&cause).count(), 1, "{line:?}");
        }
    }

    #[test]
    fn the_printer_puts_the_cause_before_the_hint() {
        let err = anyhow::Error::new(crate::config::ConfigError::Read {
            path: "/etc/trellara.yml".into(),
            source: io(),
        })
        .context("load the config");
        assert_eq!(
            super::chain(&err),
            "load the config: cannot read config /etc/trellara.yml: Permission denied\n\
             hint: create one with `trellara init ... --evaluate`"
        );
    }
}
