//! What `watch` hears, merged into one stream: refused packets from the NFLOG [`Watcher`]
//! and the refused queries the DNS guard streams on its Unix socket.

use std::time::Duration;

use super::{DropEvent, QueryEvent, WatchError, Watcher};

/// How long the packet reader waits on an empty socket before it notes so (see
/// [`Watcher::drains`]).
const DRAIN_EVERY: Duration = Duration::from_millis(50);

/// What `watch` hears: a refused packet (or the error reading one), a query the DNS guard
/// refused, or a note about the sources themselves (for stderr).
pub enum Heard {
    Packet(Result<DropEvent, WatchError>),
    Query(QueryEvent),
    Note(String),
}

/// Reads refused packets from `watcher` and, whenever a DNS guard serves them, its refused
/// queries from the Unix socket `guard_events`, each on a thread of its own; everything comes
/// out of the one receiver, so a single printer never mixes lines. The guard's socket is
/// tried again every second while there is none (the guard not started yet, restarting, or
/// resolve mode), quietly.
pub fn hear(
    mut watcher: Watcher,
    guard_events: std::path::PathBuf,
) -> std::io::Result<std::sync::mpsc::Receiver<Heard>> {
    let (tx, rx) = std::sync::mpsc::channel::<Heard>();
    let packets = tx.clone();
    std::thread::Builder::new()
        .name("nflog".into())
        .spawn(move || {
            loop {
                // With a timeout, so that the socket is seen empty now and then: what
                // [`Watcher::drains`] counts, and readers of the table's counters wait for.
                let event = match watcher.next_event_timeout(DRAIN_EVERY) {
                    Ok(None) => continue,
                    Ok(Some(event)) => Ok(event),
                    Err(e) => Err(e),
                };
                let fatal = matches!(&event, Err(e) if !e.is_transient());
                if packets.send(Heard::Packet(event)).is_err() || fatal {
                    return;
                }
            }
        })?;
    std::thread::Builder::new()
        .name("guard-events".into())
        .spawn(move || follow_guard(&guard_events, &tx))?;
    Ok(rx)
}

/// Forwards the guard's events until the receiver is gone, reconnecting as the guard comes
/// and goes.
fn follow_guard(path: &std::path::Path, tx: &std::sync::mpsc::Sender<Heard>) {
    use std::io::BufRead;
    let mut said: Option<String> = None;
    loop {
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(stream) => {
                said = None;
                let note = format!(
                    "watching the DNS guard for refused queries ({})",
                    path.display()
                );
                if tx.send(Heard::Note(note)).is_err() {
                    return;
                }
                for line in std::io::BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    if line.trim().is_empty() {
                        continue;
                    }
                    let heard = match serde_json::from_str::<QueryEvent>(&line) {
                        Ok(q) => Heard::Query(q),
                        Err(e) => Heard::Note(format!(
                            "warning: unreadable event from the DNS guard ({e}): {line}"
                        )),
                    };
                    if tx.send(heard).is_err() {
                        return;
                    }
                }
                let note = "the DNS guard went away; reconnecting when it is back";
                if tx.send(Heard::Note(note.into())).is_err() {
                    return;
                }
            }
            // No guard (yet): nothing to say.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) => {}
            // Anything else once, until it changes.
            Err(e) => {
                let note = format!(
                    "warning: cannot read the DNS guard's events from {}: {e}",
                    path.display()
                );
                if said.as_ref() != Some(&note) {
                    said = Some(note.clone());
                    if tx.send(Heard::Note(note)).is_err() {
                        return;
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::net::UnixListener;

    use super::*;

    fn next(rx: &std::sync::mpsc::Receiver<Heard>) -> Heard {
        rx.recv_timeout(Duration::from_secs(10)).expect("heard")
    }

    /// The guard's log: queries pass through, blank lines are skipped, a line that is not a
    /// query is a warning, and the guard going away is said once.
    #[test]
    fn the_guards_query_log_is_followed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("guard-events.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let follow = path.clone();
        std::thread::spawn(move || follow_guard(&follow, &tx));

        let (mut guard, _) = listener.accept().unwrap();
        assert!(matches!(next(&rx), Heard::Note(n) if n.contains("watching the DNS guard")));
        let query = QueryEvent::refused(
            "exfil.example".into(),
            "TXT".into(),
            "127.0.0.1:40000".parse().unwrap(),
            "udp",
            "REFUSED",
            "not in the policy".into(),
        );
        let line = serde_json::to_string(&query).unwrap();
        writeln!(guard, "{line}\n\n{{\"not\": \"a query\"}}").unwrap();
        assert!(matches!(next(&rx), Heard::Query(q) if q == query));
        assert!(matches!(next(&rx), Heard::Note(n) if n.starts_with("warning: unreadable")));
        drop(guard);
        assert!(matches!(next(&rx), Heard::Note(n) if n.contains("went away")));
        drop(rx);
    }
}
