//! The part of a flow a process plays (capture, apply, or both), and the
//! `service` name its endpoints and metrics carry.

/// The `service` label of the capture side.
pub const RELAY: &str = "relay";
/// The `service` label of the apply side.
pub const APPLY: &str = "apply";

/// The part of a flow a process plays. `run` plays both; with a Kafka
/// transport the two can be separate services, on separate hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Capture -> log -> apply in one process (`run`).
    Both,
    /// Capture -> log -> topic (`trellara relay --config`).
    Relay,
    /// Topic -> sink (`trellara apply --config`).
    Apply,
}

impl Role {
    pub fn captures(self) -> bool {
        self != Role::Apply
    }

    pub fn applies(self) -> bool {
        self != Role::Relay
    }

    /// The `service` name the process's endpoints report: one process
    /// playing both serves on the relay's address.
    pub fn service(self) -> &'static str {
        match self {
            Role::Both | Role::Relay => RELAY,
            Role::Apply => APPLY,
        }
    }

    /// The address its endpoints listen on.
    pub fn listen(self, service: &crate::config::ServiceConfig) -> std::net::SocketAddr {
        match self {
            Role::Both | Role::Relay => service.relay_listen,
            Role::Apply => service.apply_listen,
        }
    }

    pub fn listen_mut(
        self,
        service: &mut crate::config::ServiceConfig,
    ) -> &mut std::net::SocketAddr {
        match self {
            Role::Both | Role::Relay => &mut service.relay_listen,
            Role::Apply => &mut service.apply_listen,
        }
    }

    /// The config field of that address, for messages.
    pub fn listen_field(self) -> &'static str {
        match self {
            Role::Both | Role::Relay => "service.relay_listen",
            Role::Apply => "service.apply_listen",
        }
    }
}
