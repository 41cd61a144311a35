//! How much the guard serves at once: queries in flight and TCP clients, fitted to the
//! descriptors the process may open.

use tracing::{info, warn};

/// Queries forwarded upstream at once, over all listeners (each holds an upstream socket):
/// beyond this a UDP query is dropped (the client asks again) and a TCP client waits for a
/// slot. Lowered to what the limit of open files allows (see [`Limits::fit`]).
const MAX_IN_FLIGHT: usize = 1024;

/// TCP clients served at once per listener; one more is closed at once (it retries, or uses
/// UDP), so idle connections cannot use up the daemon's descriptors. Lowered like
/// [`MAX_IN_FLIGHT`].
const MAX_TCP_CLIENTS: usize = 256;

/// Descriptors left for the daemon's own use (its listening sockets, netlink sockets, state
/// and log files, `watch` clients) when the guard's limits are fitted to RLIMIT_NOFILE.
const RESERVED_FDS: u64 = 256;

/// Below these the guard would serve too few clients to be of use: it refuses to start.
const MIN_IN_FLIGHT: usize = 64;

const MIN_TCP_CLIENTS: usize = 8;

/// The limit of queries in flight at the design size, for tests; a serving guard takes
/// [`Guard::in_flight_limit`].
#[cfg(test)]
pub fn in_flight_limit() -> std::sync::Arc<tokio::sync::Semaphore> {
    std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT))
}

/// How much the guard serves at once, fitted to the descriptors the process may open: each
/// query in flight holds an upstream socket, each TCP client its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Queries forwarded at once, over all listeners.
    pub in_flight: usize,
    /// TCP clients at once, per listener.
    pub tcp_clients: usize,
}

impl Limits {
    pub const DESIGN: Limits = Limits {
        in_flight: MAX_IN_FLIGHT,
        tcp_clients: MAX_TCP_CLIENTS,
    };

    /// The design limits if they fit in `nofile` descriptors besides [`RESERVED_FDS`] with
    /// `listeners` TCP listeners; else half of what is left for queries in flight and half
    /// for TCP clients; `None` if that is below the minimum a guard needs.
    pub fn fit(nofile: u64, listeners: usize) -> Option<Limits> {
        let listeners = listeners.max(1);
        let budget = usize::try_from(nofile.saturating_sub(RESERVED_FDS)).unwrap_or(usize::MAX);
        if budget >= MAX_IN_FLIGHT.saturating_add(MAX_TCP_CLIENTS.saturating_mul(listeners)) {
            return Some(Limits::DESIGN);
        }
        let in_flight = (budget / 2).min(MAX_IN_FLIGHT);
        let tcp_clients = ((budget - in_flight) / listeners).min(MAX_TCP_CLIENTS);
        (in_flight >= MIN_IN_FLIGHT && tcp_clients >= MIN_TCP_CLIENTS).then_some(Limits {
            in_flight,
            tcp_clients,
        })
    }

    /// The fewest descriptors [`Limits::fit`] takes for `listeners` listeners.
    pub fn min_nofile(listeners: usize) -> u64 {
        let listeners = listeners.max(1);
        let budget = (2 * MIN_IN_FLIGHT).max(2 * MIN_TCP_CLIENTS * listeners);
        RESERVED_FDS + budget as u64
    }

    /// Queries of one client (see [`client_key`]) forwarded at once: one client holds at
    /// most an eighth of the slots, so it cannot starve the others even when its questions
    /// go to a server that never answers. Beyond it a UDP query is dropped, a TCP query gets
    /// SERVFAIL.
    pub(super) fn in_flight_per_client(self) -> usize {
        self.in_flight / 8
    }

    /// TCP connections of one client at once, over all listeners.
    pub(super) fn tcp_per_client(self) -> usize {
        self.tcp_clients / 4
    }
}

/// Raises the soft limit of open files to the hard one (systemd starts services with a soft
/// limit of 1,024 and a hard one far above): the guard's design limits need more than 1,024
/// descriptors. Returns the soft and hard limits in force.
pub(super) fn raise_nofile() -> (u64, u64) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => {
                info!(from = soft, to = hard, "raised the limit of open files");
                (hard, hard)
            }
            Err(e) => {
                warn!(error = %e, soft, hard, "cannot raise the limit of open files");
                (soft, hard)
            }
        },
        Ok(limits) => limits,
        Err(e) => {
            // Assume the usual default: the limits then fit it.
            warn!(error = %e, "cannot read the limit of open files; assuming 1024");
            (1024, 1024)
        }
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    /// The design limits when the descriptors allow them; under systemd's 1,024 (as a hard
    /// limit too) the in-flight and TCP limits together stay below it with room for the
    /// daemon's own; too few descriptors, no limits (the guard refuses to start).
    #[test]
    fn limits_fit_the_open_files_allowed() {
        assert_eq!(Limits::fit(1 << 20, 2), Some(Limits::DESIGN));
        assert_eq!(Limits::fit(u64::MAX, 1), Some(Limits::DESIGN));
        for listeners in 1..=4 {
            let fit = Limits::fit(1024, listeners).expect("1024 is enough");
            assert!(fit.in_flight < MAX_IN_FLIGHT);
            let used = fit.in_flight + fit.tcp_clients * listeners;
            assert!(used as u64 + RESERVED_FDS <= 1024, "{listeners}: {fit:?}");
            assert!(fit.in_flight_per_client() >= 8 && fit.tcp_per_client() >= 2);
            let need = Limits::min_nofile(listeners);
            assert!(
                Limits::fit(need, listeners).is_some(),
                "{listeners}: {need}"
            );
            assert!(
                Limits::fit(need - 1, listeners).is_none(),
                "{listeners}: {need}"
            );
        }
        assert_eq!(Limits::fit(100, 1), None);
    }
}
