//! `watch`: print every refused packet (from the table's NFLOG group) and, in guard mode,
//! every DNS query the guard refused (from its event socket), as they happen.
//!
//! The library merges the two streams ([`egress_fence::watch::hear`]); this file picks the
//! group, notes what the table says of each refused destination (or that its source was
//! refused), says how many refused packets the table counted and never logged, and prints.

use std::io::Write;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant, SystemTime};

use egress_fence::core::explain;
use egress_fence::core::policy::Preset;
use egress_fence::core::ruleset::TABLE;
use egress_fence::core::time::rfc3339_millis_at;
use egress_fence::host::HostAddrsCache;
use egress_fence::nft::live::Destinations;
use egress_fence::nft::{LiveTable, Nft};
use egress_fence::state::StateDir;
use egress_fence::watch::{Counted, FencedScope, Heard, Host, Unlogged, UnloggedEvent, Watcher};

use super::args::{NamespaceArg, StateArgs};
use super::common::{enter, state_dir};
use super::exit::Failure;

/// How often `watch` reads the table again for its notes.
const WATCH_REREAD: Duration = Duration::from_secs(10);
/// How often `watch` reads the table's refused counters, to say how many refused packets it
/// heard nothing of (over the log rate).
const COUNT_EVERY: Duration = Duration::from_secs(1);

pub fn run(
    target: &NamespaceArg,
    group: Option<u16>,
    count: Option<u64>,
    json: bool,
    state: &StateArgs,
) -> Result<u8, Failure> {
    let state = state_dir(target, state)?;
    enter(target, None)?;
    let group = match group {
        Some(g) => g,
        None => installed_group()?,
    };
    let watcher = Watcher::subscribe(group)?;
    eprintln!("watching NFLOG group {group} for refused packets");
    let refused_read = watcher.refused_read();
    let drains = watcher.drains();

    let rx = egress_fence::watch::hear(watcher, state.guard_events())?;

    let mut notes = TableNotes::open(&state)?;
    let mut host = Host::open();
    let mut host_addrs = HostAddrsCache::new();
    let mut unlogged = Unlogged::default();
    let mut counters = Nft::open()?;
    let mut next_count = Instant::now();
    // The reader's drains when the last reading was taken: the next one is taken only once
    // the reader has since seen its socket empty (see `Unlogged`).
    let mut drains_at_reading: Option<u64> = None;
    let mut seen = 0;
    let mut stdout = std::io::stdout().lock();
    while count.is_none_or(|c| seen < c) {
        // The table's log rate lets through only so many refusals: what it counted and never
        // logged is said, not left out in silence (a sandbox would spend the rate on decoys).
        let drained = drains_at_reading.is_none_or(|d| drains.load(Ordering::Relaxed) > d);
        if Instant::now() >= next_count && drained {
            next_count = Instant::now() + COUNT_EVERY;
            // Before the counters: a packet heard after them is not taken for one they had
            // counted when the count starts.
            let heard = refused_read.load(Ordering::Relaxed);
            match counters.refused_counters() {
                Ok(counted) => {
                    let counted = counted.map(|(table, r)| Counted::new(table, r.packets()));
                    // After the counters: a drain counted from here on came after them.
                    drains_at_reading = Some(drains.load(Ordering::Relaxed));
                    if let Some(packets) = unlogged.reading(counted, heard) {
                        let event =
                            UnloggedEvent::new(rfc3339_millis_at(SystemTime::now()), packets);
                        let line = match json {
                            true => serde_json::to_string(&event)?,
                            false => event.to_string(),
                        };
                        writeln!(stdout, "{line}")?;
                        stdout.flush()?;
                    }
                }
                // Not taken for "no table": a failed reading judges nothing, the next may.
                Err(e) => eprintln!("warning: cannot read the table's refused counters: {e}"),
            }
        }
        let heard = match rx.recv_timeout(next_count.saturating_duration_since(Instant::now())) {
            Ok(heard) => heard,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => {
                return Err(anyhow::anyhow!("both event readers stopped").into());
            }
        };
        let line = match heard {
            Heard::Note(note) => {
                eprintln!("{note}");
                continue;
            }
            Heard::Packet(Err(e)) if e.is_transient() => {
                eprintln!("warning: {e}");
                continue;
            }
            Heard::Packet(Err(e)) => return Err(e.into()),
            Heard::Query(query) if json => serde_json::to_string(&query)?,
            Heard::Query(query) => query.to_string(),
            Heard::Packet(Ok(mut event)) => {
                let table_note = notes.note(event.dst, event.dport)?;
                event.scope = notes
                    .scope
                    .as_ref()
                    .and_then(|scope| scope.matched(&event, &mut host))
                    .map(Box::new);
                let foreign =
                    explain::foreign_source(event.src, event.uid.is_some(), host_addrs.current());
                event.note = Some(match (foreign, Preset::containing(event.dst)) {
                    (Some(why), _) => why.to_string(),
                    (None, Some(p)) => format!("{} (preset {})", p.describe(), p.name()),
                    (None, None) => table_note,
                });
                if json {
                    serde_json::to_string(&event)?
                } else {
                    event.to_string()
                }
            }
        };
        writeln!(stdout, "{line}")?;
        stdout.flush()?;
        seen += 1;
    }
    Ok(0)
}

/// The NFLOG group of the installed table's log rule.
fn installed_group() -> Result<u16, Failure> {
    match Nft::open()?.log_group()? {
        Some(Some(g)) => Ok(g),
        Some(None) => Err(anyhow::anyhow!(
            "the installed table logs refusals to the kernel log, not to an NFLOG \
             group: set `log.group` in the policy, or give --group"
        )
        .into()),
        None => Err(anyhow::anyhow!(
            "table inet {TABLE} is not installed: apply a policy first, or give --group"
        )
        .into()),
    }
}

/// What the table says of destinations, read again now and then: a daemon keeps changing the
/// resolved sets. With a scoped table, its scope, as of the last reading.
struct TableNotes {
    nft: Nft,
    known: Option<(Instant, Destinations)>,
    scope: Option<FencedScope>,
    state: StateDir,
}

impl TableNotes {
    fn open(state: &StateDir) -> Result<TableNotes, Failure> {
        Ok(TableNotes {
            nft: Nft::open()?,
            known: None,
            scope: None,
            state: state.clone(),
        })
    }

    /// What the table says of `dst`:`dport`, from a reading at most [`WATCH_REREAD`] old.
    fn note(&mut self, dst: IpAddr, dport: Option<u16>) -> Result<String, Failure> {
        let known = match self.known.take() {
            Some((at, destinations)) if at.elapsed() <= WATCH_REREAD => (at, destinations),
            _ => {
                let table = self.nft.read_table()?;
                let destinations = table.as_ref().map(Destinations::of).unwrap_or_default();
                self.scope = table.as_ref().and_then(|t| self.scope_of(t));
                (Instant::now(), destinations)
            }
        };
        let note = known.1.why_refused(dst, dport).to_string();
        self.known = Some(known);
        Ok(note)
    }

    /// The live table's scope; when its scope rules are not read back as egress-fence's own
    /// (an older reader), the scope of the newest generation, which installed them.
    fn scope_of(&self, table: &LiveTable) -> Option<FencedScope> {
        let live = FencedScope::of_live(table)?;
        if !live.is_empty() {
            return Some(live);
        }
        let recorded = self.state.newest().ok().flatten();
        Some(
            recorded
                .and_then(|g| FencedScope::of_ruleset(&g.ruleset))
                .unwrap_or(live),
        )
    }
}
