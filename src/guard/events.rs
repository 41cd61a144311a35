//! Refused queries streamed to `watch`.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixListener;
use tokio::sync::{Semaphore, broadcast};

use crate::watch::QueryEvent;

use super::GuardError;

/// How many `watch`es read the guard's events at once; more are closed at once, so that
/// clients that connect and never read cannot take the guard's open files (which its
/// upstream sockets need).
pub const MAX_WATCHERS: usize = 8;

/// Streams refused queries, one JSON line each, to every client of the Unix socket at `path`
/// (`watch`), at most [`MAX_WATCHERS`] at a time; one that goes away frees its place at once. A
/// client too slow to keep up misses events rather than slowing the guard. The socket is the guard's user's alone (0600; `watch` runs
/// as root): the state directory's mode keeps others out already, and this keeps them out
/// where an administrator loosened it.
pub fn serve_events(
    path: PathBuf,
    events: broadcast::Sender<QueryEvent>,
) -> Result<(), GuardError> {
    // A socket file left by an earlier daemon would make bind fail.
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|source| GuardError::Events {
        path: path.clone(),
        source,
    })?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(|source| {
        GuardError::Events {
            path: path.clone(),
            source,
        }
    })?;
    let slots = Arc::new(Semaphore::new(MAX_WATCHERS));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                continue;
            };
            let mut rx = events.subscribe();
            tokio::spawn(async move {
                let _slot = slot;
                // A watcher that goes away is noticed when it does (end of file), not only at
                // the next write: between refused queries its slot would stay taken.
                let (mut from_watcher, mut stream) = stream.into_split();
                let mut said = [0u8; 64];
                loop {
                    let received = tokio::select! {
                        received = rx.recv() => received,
                        read = from_watcher.read(&mut said) => match read {
                            // `watch` says nothing; whatever a client writes is dropped.
                            Ok(n) if n > 0 => continue,
                            _ => return,
                        },
                    };
                    let event = match received {
                        Ok(e) => e,
                        Err(broadcast::error::RecvError::Lagged(_)) => continue,
                        Err(broadcast::error::RecvError::Closed) => return,
                    };
                    let Ok(mut line) = serde_json::to_vec(&event) else {
                        continue;
                    };
                    line.push(b'\n');
                    if stream.write_all(&line).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use tokio::net::UnixStream;

    use super::*;

    fn refused_query() -> QueryEvent {
        QueryEvent::refused(
            "exfil.example".into(),
            "TXT".into(),
            "127.0.0.1:40000".parse().unwrap(),
            "udp",
            "REFUSED",
            "not in the policy".into(),
        )
    }

    /// The socket is its owner's alone; past [`MAX_WATCHERS`] clients that do not read, the
    /// next is closed at once, and a refused query still reaches the ones served.
    #[tokio::test]
    async fn the_events_socket_is_the_owners_and_serves_a_bounded_number_of_watchers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("guard-events.sock");
        let (events, _) = broadcast::channel(16);
        serve_events(path.clone(), events.clone()).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);

        let mut served = Vec::new();
        for _ in 0..MAX_WATCHERS {
            served.push(UnixStream::connect(&path).await.unwrap());
        }
        let mut extra = UnixStream::connect(&path).await.unwrap();
        let mut byte = [0u8; 1];
        let closed = tokio::time::timeout(Duration::from_secs(5), extra.read(&mut byte)).await;
        assert!(matches!(closed, Ok(Ok(0))), "{closed:?}");

        // The served ones subscribe once accepted: wait until they all have.
        for _ in 0..500 {
            if events.receiver_count() == MAX_WATCHERS {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        events.send(refused_query()).unwrap();
        let mut line = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), served[0].read(&mut line))
            .await
            .unwrap()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&line[..n]).contains("exfil.example"),
            "{:?}",
            String::from_utf8_lossy(&line[..n])
        );
    }

    /// A watcher that goes away while the guard refuses nothing gives its slot back at once,
    /// not at the next refused query: `watch` stopped [`MAX_WATCHERS`] times in a quiet hour
    /// must not lock the next one out.
    #[tokio::test]
    async fn a_watcher_that_goes_away_between_events_frees_its_slot() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("guard-events.sock");
        let (events, _) = broadcast::channel(16);
        serve_events(path.clone(), events.clone()).unwrap();
        let receivers = |want: usize| {
            let events = events.clone();
            async move {
                for _ in 0..500 {
                    if events.receiver_count() == want {
                        return true;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                false
            }
        };

        let mut gone = Vec::new();
        for _ in 0..MAX_WATCHERS {
            gone.push(UnixStream::connect(&path).await.unwrap());
        }
        assert!(receivers(MAX_WATCHERS).await);
        drop(gone);
        assert!(
            receivers(0).await,
            "{} slots still held by closed watchers",
            events.receiver_count()
        );

        let mut next = UnixStream::connect(&path).await.unwrap();
        assert!(receivers(1).await, "the next watcher was turned away");
        events.send(refused_query()).unwrap();
        let mut line = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), next.read(&mut line))
            .await
            .unwrap()
            .unwrap();
        assert!(String::from_utf8_lossy(&line[..n]).contains("exfil.example"));
    }
}
