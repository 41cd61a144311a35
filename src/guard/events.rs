//! Refused queries streamed to `watch`.

use std::path::PathBuf;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::UnixListener;
use tokio::sync::broadcast;

use crate::watch::QueryEvent;

use super::GuardError;

/// Streams refused queries, one JSON line each, to every client of the Unix socket at `path`
/// (`watch`). A client too slow to keep up misses events rather than slowing the guard.
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
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let mut rx = events.subscribe();
            tokio::spawn(async move {
                loop {
                    let event = match rx.recv().await {
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
