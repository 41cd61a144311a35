//! Safe changes to the live table: every write happens under the namespace's writers' lock,
//! is compared with what the kernel holds first (nothing is sent when nothing would change),
//! and is recorded as a generation that `rollback` can reinstate.
//!
//! Confirm-or-revert (`apply --confirm-within`) is ordered so that no failure, and no death
//! of the applying process, leaves an unconfirmed change in place for good: the pending
//! confirmation is written and a revert timer started and heard from *before* the table is
//! touched. The timer is a process of its own, in a session of its own, so it outlives the
//! terminal and the shell that ran `apply`; it reverts at the deadline unless the pending
//! record has been confirmed (removed) or replaced by then.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use crate::core::diff::{CompareOptions, Presence, TableDiff, compare};
use crate::core::resolution::Resolution;
use crate::core::ruleset::{Ruleset, SetId, SetRole};
use crate::nft::{LiveTable, NftError, Table};
use crate::state::{
    Generation, NewGeneration, PendingConfirm, Recorder, Reverted, StateDir, StateError,
    WriterLock, current_netns_inode, rfc3339,
};

/// How long `apply` waits for a revert timer to say it is armed.
const TIMER_HANDSHAKE: Duration = Duration::from_secs(10);
/// What a revert timer prints on its standard output once armed; nothing else goes there.
pub const TIMER_ARMED: &str = "armed";
/// How often a waiting revert timer looks whether its change was confirmed.
const TIMER_POLL: Duration = Duration::from_millis(200);

#[derive(Debug, thiserror::Error)]
pub enum ChangeError {
    #[error(transparent)]
    Nft(#[from] NftError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error(
        "the revert timer did not start ({reason}; its log: {}); nothing was applied",
        .log.display()
    )]
    TimerStart { reason: String, log: PathBuf },
    #[error(
        "the table was applied but generation {generation} could not be recorded: {source}{}",
        if *.pending { "; the change still reverts at its deadline unless confirmed" } else { "" }
    )]
    NotRecorded {
        generation: u64,
        pending: bool,
        #[source]
        source: StateError,
    },
    #[error("the revert timer cannot leave the session that started it: {0}")]
    Detach(nix::Error),
    #[error("the revert timer has nothing to guard: {0}")]
    NothingToGuard(String),
    #[error(
        "refusing to revert: this process is in network namespace {current}, the change was applied in {applied_in}"
    )]
    WrongNamespace { current: u64, applied_in: u64 },
}

/// One writer at work: the namespace's state directory, its lock, and how many generations
/// to keep.
pub struct Writer<'a> {
    pub state: &'a StateDir,
    pub lock: &'a WriterLock,
    pub keep: usize,
}

/// A policy resolved and planned, ready to apply.
pub struct Planned {
    pub policy_path: PathBuf,
    pub policy_text: String,
    pub resolution: Resolution,
    pub ruleset: Ruleset,
}

/// `--confirm-within`: the window, and how to start a revert timer for a token (the caller
/// knows the command line; the timer must print [`TIMER_ARMED`] once armed).
pub struct ConfirmRequest<'a> {
    pub within: Duration,
    pub timer_command: &'a dyn Fn(&str) -> Command,
}

/// What an `apply` did.
#[derive(Debug)]
pub struct ApplyOutcome {
    /// What differed from the live table (empty: nothing was sent).
    pub diff: TableDiff,
    /// The generation recorded, if one was: a change, or a table that matched the plan
    /// without the newest generation saying so.
    pub recorded: Option<Generation>,
    /// The generation that describes the live table now.
    pub current: Option<u64>,
    /// The confirmation this apply armed.
    pub armed: Option<PendingConfirm>,
    /// An earlier change that still awaits confirmation: its deadline also undoes this one.
    pub awaiting: Option<PendingConfirm>,
    /// A revert that happened since the last writer, now taken note of.
    pub noted_revert: Option<PendingConfirm>,
}

impl ApplyOutcome {
    pub fn changed(&self) -> bool {
        !self.diff.is_empty()
    }
}

/// Applies `planned` unless the live table already matches it, and records it.
pub fn apply(
    nft: &mut impl Table,
    writer: &Writer<'_>,
    planned: Planned,
    confirm: Option<ConfirmRequest<'_>>,
) -> Result<ApplyOutcome, ChangeError> {
    let (awaiting, noted_revert) = take_note_of_pending(writer)?;
    let live = nft.read_table()?;
    let diff = compare(&planned.ruleset, live.as_ref(), CompareOptions::default());
    let newest = writer.state.newest();
    let newest_matches = matches!(&newest, Ok(Some(g)) if g.ruleset == planned.ruleset);
    if diff.is_empty() && newest_matches {
        let current = newest.ok().flatten().map(|g| g.generation);
        return Ok(ApplyOutcome {
            diff,
            recorded: None,
            current,
            armed: None,
            awaiting,
            noted_revert,
        });
    }

    let number = writer.state.next_number(writer.lock)?;
    // Nothing changes in the kernel when nothing differs, so there is nothing to confirm.
    let armed = match confirm.filter(|_| !diff.is_empty()) {
        Some(request) => Some(arm(writer, number, awaiting.as_ref(), &request)?),
        None => None,
    };
    if !diff.is_empty()
        && let Err(e) = nft.apply(&planned.ruleset)
    {
        if armed.is_some() {
            // Nothing changed: the timer finds its record gone and stands down.
            writer.state.clear_pending(writer.lock)?;
        }
        return Err(e.into());
    }
    let new = NewGeneration {
        command: Recorder::Apply,
        source_generation: None,
        policy_path: planned.policy_path,
        policy_text: planned.policy_text,
        resolution: planned.resolution,
        ruleset: planned.ruleset,
    };
    let recorded = writer
        .state
        .record_as(writer.lock, number, new, writer.keep)
        .map_err(|source| ChangeError::NotRecorded {
            generation: number,
            pending: armed.is_some(),
            source,
        })?;
    Ok(ApplyOutcome {
        diff,
        current: Some(recorded.generation),
        recorded: Some(recorded),
        // A new confirmation replaces the one that was awaited (and keeps what it reverts to).
        awaiting: if armed.is_some() { None } else { awaiting },
        armed,
        noted_revert,
    })
}

/// Whether the live table may be what kept `planned`'s names from resolving: it exists and
/// its chains or its DNS sets differ from the plan's (flushed by an admin or a reset script,
/// edited, or the policy names other resolvers), so this process's own questions to the
/// resolvers may have been dropped by it. `apply` then installs the plan as it is (only what
/// the new policy allows, with the names that did resolve), which lets it ask again.
pub fn may_have_blocked_resolution(planned: &Planned, live: Option<&LiveTable>) -> bool {
    if planned.resolution.unresolved().next().is_none() {
        return false;
    }
    let Some(live) = live else {
        // No table of ours: nothing of ours refused the questions.
        return false;
    };
    let options = CompareOptions {
        ignore_resolved_contents: true,
    };
    let diff = compare(&planned.ruleset, Some(live), options);
    !diff.chains.is_empty()
        || diff.sets.iter().any(|s| {
            SetId::from_name(&s.name).is_none_or(|id| id.role == SetRole::Dns)
                && (s.presence != Presence::Both || s.definition.is_some() || !s.added.is_empty())
        })
}

/// The pending record as a writer finds it: a change still awaiting confirmation (it stays:
/// only `confirm` or its deadline ends it), or a revert to take note of (the record goes).
/// An abandoned record (its timer died, a reboot) goes too: nothing will act on it.
fn take_note_of_pending(
    writer: &Writer<'_>,
) -> Result<(Option<PendingConfirm>, Option<PendingConfirm>), ChangeError> {
    let Some(pending) = writer.state.pending()? else {
        return Ok((None, None));
    };
    if pending.is_awaiting(SystemTime::now()) {
        return Ok((Some(pending), None));
    }
    writer.state.clear_pending(writer.lock)?;
    Ok((None, pending.reverted.is_some().then_some(pending)))
}

/// Writes the pending confirmation and starts its revert timer; returns once the timer said
/// it is armed. What it reverts to: the last confirmed state, which is what an earlier
/// unconfirmed change reverts to, else the newest generation, else no table.
fn arm(
    writer: &Writer<'_>,
    generation: u64,
    awaiting: Option<&PendingConfirm>,
    request: &ConfirmRequest<'_>,
) -> Result<PendingConfirm, ChangeError> {
    let revert_to = match awaiting {
        Some(earlier) => earlier.revert_to,
        None => writer.state.generation_numbers()?.last().copied(),
    };
    if let Some(n) = revert_to {
        // Refuse now rather than find out at the deadline that there is nothing to revert to.
        writer.state.load(n)?;
    }
    let deadline = SystemTime::now() + request.within;
    let pending = PendingConfirm::new(generation, revert_to, deadline, current_netns_inode()?);
    writer.state.write_pending(writer.lock, &pending)?;
    if let Err(e) = start_timer(writer.state, &pending.token, request.timer_command) {
        writer.state.clear_pending(writer.lock)?;
        return Err(e);
    }
    Ok(pending)
}

/// Starts the revert timer and waits for its [`TIMER_ARMED`] line. Its standard error goes to
/// the state directory's log, its standard input is /dev/null: it needs no terminal.
fn start_timer(
    state: &StateDir,
    token: &str,
    timer_command: &dyn Fn(&str) -> Command,
) -> Result<(), ChangeError> {
    let log_path = state.revert_timer_log();
    let failed = |reason: String| ChangeError::TimerStart {
        reason,
        log: log_path.clone(),
    };
    let log = state
        .open_revert_timer_log()
        .map_err(|e| failed(format!("cannot open its log: {e}")))?;
    let mut child = timer_command(token)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .map_err(|e| failed(format!("cannot start it: {e}")))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| failed("no pipe to it".into()))?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    match rx.recv_timeout(TIMER_HANDSHAKE) {
        Ok(line) if line.trim() == TIMER_ARMED => Ok(()),
        outcome => {
            let _ = child.kill();
            let _ = child.wait();
            Err(failed(match outcome {
                Ok(_) => "it exited before it was armed".into(),
                Err(_) => format!("it did not report within {} s", TIMER_HANDSHAKE.as_secs()),
            }))
        }
    }
}

/// What a `rollback` did.
#[derive(Debug)]
pub struct RollbackOutcome {
    /// The generation reinstated.
    pub source: Generation,
    /// The generation recorded for the rollback.
    pub recorded: Generation,
    /// What differed from the live table (empty: nothing was sent).
    pub diff: TableDiff,
    pub awaiting: Option<PendingConfirm>,
    pub noted_revert: Option<PendingConfirm>,
}

/// Reinstates generation `to`, or the one before the newest, exactly as it was applied
/// (one transaction), and records that as a new generation.
pub fn rollback(
    nft: &mut impl Table,
    writer: &Writer<'_>,
    to: Option<u64>,
) -> Result<RollbackOutcome, ChangeError> {
    let source = match to {
        Some(n) => writer.state.load(n)?,
        None => writer.state.before_newest()?,
    };
    let (awaiting, noted_revert) = take_note_of_pending(writer)?;
    let (diff, recorded) = reinstate(nft, writer, &source, Recorder::Rollback)?;
    Ok(RollbackOutcome {
        source,
        recorded,
        diff,
        awaiting,
        noted_revert,
    })
}

/// Puts `generation`'s ruleset in place (unless the live table already matches it) and
/// records that.
fn reinstate(
    nft: &mut impl Table,
    writer: &Writer<'_>,
    generation: &Generation,
    command: Recorder,
) -> Result<(TableDiff, Generation), ChangeError> {
    let live = nft.read_table()?;
    let diff = compare(
        &generation.ruleset,
        live.as_ref(),
        CompareOptions::default(),
    );
    if !diff.is_empty() {
        nft.apply(&generation.ruleset)?;
    }
    let number = writer.state.next_number(writer.lock)?;
    let recorded = writer
        .state
        .record_as(
            writer.lock,
            number,
            NewGeneration::reinstating(generation, command),
            writer.keep,
        )
        .map_err(|source| ChangeError::NotRecorded {
            generation: number,
            pending: false,
            source,
        })?;
    Ok((diff, recorded))
}

/// What `confirm` found.
#[derive(Debug)]
pub enum ConfirmOutcome {
    /// The change is kept; its timer stands down.
    Confirmed(PendingConfirm),
    /// The deadline passed and the change was reverted before the confirmation came.
    TooLate(PendingConfirm),
    NothingPending,
}

/// Confirms the change awaiting confirmation, if any.
pub fn confirm(state: &StateDir, lock: &WriterLock) -> Result<ConfirmOutcome, ChangeError> {
    let Some(pending) = state.pending()? else {
        return Ok(ConfirmOutcome::NothingPending);
    };
    state.clear_pending(lock)?;
    Ok(if pending.reverted.is_some() {
        ConfirmOutcome::TooLate(pending)
    } else {
        ConfirmOutcome::Confirmed(pending)
    })
}

/// The revert timer's first step, in its own process: checks that `token` is pending and
/// that this process is in the namespace the change was applied in.
pub fn arm_timer(state: &StateDir, token: &str) -> Result<PendingConfirm, ChangeError> {
    let pending = state
        .pending()?
        .filter(|p| p.token == token && p.reverted.is_none())
        .ok_or_else(|| ChangeError::NothingToGuard(format!("no pending confirmation {token}")))?;
    check_namespace(&pending)?;
    Ok(pending)
}

fn check_namespace(pending: &PendingConfirm) -> Result<(), ChangeError> {
    let current = current_netns_inode()?;
    if current != pending.netns_inode {
        return Err(ChangeError::WrongNamespace {
            current,
            applied_in: pending.netns_inode,
        });
    }
    Ok(())
}

/// Why a revert timer woke.
#[derive(Debug, PartialEq, Eq)]
pub enum TimerWake {
    /// The record was confirmed (removed) or replaced by a newer confirmation.
    StandDown,
    /// The deadline came.
    Deadline,
}

/// Sleeps until the deadline, waking early when the record is confirmed or replaced. The
/// deadline is measured on the monotonic clock from now, so a clock step does not move it.
pub fn wait_for_deadline(state: &StateDir, pending: &PendingConfirm) -> TimerWake {
    let left = pending
        .deadline()
        .duration_since(SystemTime::now())
        .unwrap_or_default();
    let deadline = Instant::now() + left;
    loop {
        match state.pending() {
            Ok(Some(p)) if p.token == pending.token => {}
            // A record that cannot be read right now is no confirmation: keep the deadline.
            Err(_) => {}
            Ok(_) => return TimerWake::StandDown,
        }
        let now = Instant::now();
        if now >= deadline {
            return TimerWake::Deadline;
        }
        std::thread::sleep(TIMER_POLL.min(deadline - now));
    }
}

/// What a revert timer did at its deadline.
#[derive(Debug)]
pub enum RevertOutcome {
    /// Confirmed or replaced while the timer waited for the lock.
    StoodDown,
    /// Reinstated generation `source`, recorded as generation `recorded`.
    Reinstated {
        source: u64,
        recorded: u64,
        diff: TableDiff,
    },
    /// There was no earlier generation: the table was deleted.
    Deleted,
}

/// The deadline came: reverts the change unless it was confirmed meanwhile, and marks the
/// record reverted.
pub fn revert(
    nft: &mut impl Table,
    writer: &Writer<'_>,
    token: &str,
) -> Result<RevertOutcome, ChangeError> {
    let Some(mut pending) = writer
        .state
        .pending()?
        .filter(|p| p.token == token && p.reverted.is_none())
    else {
        return Ok(RevertOutcome::StoodDown);
    };
    check_namespace(&pending)?;
    let outcome = match pending.revert_to {
        Some(n) => {
            let source = writer.state.load(n)?;
            let (diff, recorded) = reinstate(nft, writer, &source, Recorder::Revert)?;
            RevertOutcome::Reinstated {
                source: source.generation,
                recorded: recorded.generation,
                diff,
            }
        }
        None => {
            nft.teardown()?;
            RevertOutcome::Deleted
        }
    };
    pending.reverted = Some(Reverted {
        time: rfc3339(SystemTime::now()),
        generation: match &outcome {
            RevertOutcome::Reinstated { recorded, .. } => Some(*recorded),
            _ => None,
        },
    });
    writer.state.write_pending(writer.lock, &pending)?;
    Ok(outcome)
}

/// Leaves the session of whoever started this process (the terminal of `apply`), so that
/// closing it signals nothing here.
pub fn detach_from_session() -> Result<(), ChangeError> {
    nix::unistd::setsid().map(drop).map_err(ChangeError::Detach)
}

/// A resolved-set element of the live table that the policy of the newest generation does
/// not explain (see [`crate::core::plan::unexplained_element`]): shown as drift by `status`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct UnexplainedElement {
    /// As nft writes it: `192.0.2.1 . tcp . 443 timeout ... comment "NAME"`.
    pub element: String,
    pub why: String,
}

/// The resolved elements of `live` that the policy of `generation` does not explain. Only
/// for a generation the service recorded: against any other, `drift` compares the resolved
/// sets element by element already. A generation whose policy no longer parses (an older
/// schema) explains nothing and is not checked.
pub fn unexplained(generation: &Generation, live: &LiveTable) -> Vec<UnexplainedElement> {
    if generation.command != Recorder::Run {
        return Vec::new();
    }
    let Ok(policy) =
        crate::core::policy::Policy::parse(&generation.policy_text, &generation.policy_path)
    else {
        return Vec::new();
    };
    crate::core::plan::unexplained_elements(&policy, live, true)
        .into_iter()
        .map(|(t, why)| UnexplainedElement {
            element: crate::core::ruleset::fmt_timed(&t),
            why,
        })
        .collect()
}

/// How the live table relates to the newest generation.
#[derive(Debug)]
pub enum Drift {
    /// Nothing is recorded: the table was applied by hand or by an older egress-fence.
    NoGeneration,
    /// The newest generation cannot be read; nothing is compared with it.
    Unreadable(StateError),
    InSync(Generation),
    Drifted(Generation, TableDiff),
}

/// Compares the live table with the newest generation. For a generation the daemon recorded,
/// the resolved sets' contents are left out: it changes them all the time.
pub fn drift(state: &StateDir, live: &LiveTable) -> Drift {
    match state.newest() {
        Ok(None) => Drift::NoGeneration,
        Err(e) => Drift::Unreadable(e),
        Ok(Some(generation)) => {
            let options = CompareOptions {
                ignore_resolved_contents: generation.command == Recorder::Run,
            };
            let diff = compare(&generation.ruleset, Some(live), options);
            if diff.is_empty() {
                Drift::InSync(generation)
            } else {
                Drift::Drifted(generation, diff)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::core::plan::{plan, tests::resolution};
    use crate::core::policy::Policy;
    use crate::nft::table::memory::MemoryTable;

    const A: &str = "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\ndns:\n  resolvers: [192.0.2.53]\n";
    const B: &str = "version: 1\nallow:\n  - cidr: 203.0.113.0/28\n    ports: [22]\ndns:\n  resolvers: [192.0.2.53]\n";

    struct Fixture {
        _dir: tempfile::TempDir,
        state: StateDir,
        lock: WriterLock,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let state = StateDir::new(dir.path(), "ns");
        let lock = state
            .lock("test", Duration::from_secs(1), |_| {})
            .expect("the lock");
        Fixture {
            _dir: dir,
            state,
            lock,
        }
    }

    impl Fixture {
        fn writer(&self) -> Writer<'_> {
            Writer {
                state: &self.state,
                lock: &self.lock,
                keep: 10,
            }
        }
    }

    fn planned(text: &str) -> Planned {
        let policy = Policy::parse(text, Path::new("p.yaml")).expect("valid");
        let resolution = resolution(&[("a.example", &["192.0.2.10"])]);
        Planned {
            policy_path: "p.yaml".into(),
            policy_text: text.into(),
            ruleset: plan(&policy, &resolution),
            resolution,
        }
    }

    /// A revert timer that says it is armed and leaves (nothing reverts in these tests).
    fn armed_timer(_token: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", "echo armed"]);
        c
    }

    #[test]
    fn an_apply_records_a_generation_and_an_unchanged_one_sends_nothing() {
        let f = fixture();
        let mut table = MemoryTable::new();
        let outcome = apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        assert!(outcome.changed());
        assert_eq!(outcome.recorded.as_ref().map(|g| g.generation), Some(1));
        assert_eq!(table.applied.len(), 1);
        assert_eq!(table.table, Some(planned(A).ruleset));

        let again = apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        assert!(!again.changed());
        assert!(again.recorded.is_none(), "nothing new to record");
        assert_eq!(again.current, Some(1));
        assert_eq!(table.applied.len(), 1, "nothing sent");
    }

    #[test]
    fn a_table_that_matches_but_was_not_recorded_is_recorded_without_sending() {
        let f = fixture();
        let mut table = MemoryTable::holding(planned(A).ruleset);
        let outcome = apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        assert!(!outcome.changed());
        assert_eq!(outcome.recorded.map(|g| g.generation), Some(1));
        assert!(table.applied.is_empty());
    }

    #[test]
    fn a_refused_apply_records_no_generation_and_leaves_the_table() {
        let f = fixture();
        let mut table = MemoryTable::holding(planned(B).ruleset);
        table.refuse_apply = true;
        let error = apply(&mut table, &f.writer(), planned(A), None).expect_err("refused");
        assert!(matches!(error, ChangeError::Nft(NftError::Refused { .. })));
        assert!(f.state.generation_numbers().unwrap().is_empty());
        assert_eq!(table.table, Some(planned(B).ruleset), "untouched");
    }

    #[test]
    fn a_refused_apply_with_a_confirmation_leaves_nothing_pending() {
        let f = fixture();
        let mut table = MemoryTable::new();
        table.refuse_apply = true;
        let confirm = ConfirmRequest {
            within: Duration::from_secs(60),
            timer_command: &armed_timer,
        };
        apply(&mut table, &f.writer(), planned(A), Some(confirm)).expect_err("refused");
        assert_eq!(f.state.pending().unwrap(), None, "the timer stands down");
        assert!(f.state.generation_numbers().unwrap().is_empty());
    }

    #[test]
    fn an_armed_apply_awaits_confirmation_and_confirm_clears_it() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        let confirm = ConfirmRequest {
            within: Duration::from_secs(60),
            timer_command: &armed_timer,
        };
        let outcome = apply(&mut table, &f.writer(), planned(A), Some(confirm)).expect("applied");
        let armed = outcome.armed.expect("armed");
        assert_eq!(armed.generation, 2);
        assert_eq!(
            armed.revert_to,
            Some(1),
            "reverts to the last confirmed state"
        );
        assert_eq!(f.state.pending().unwrap(), Some(armed.clone()));

        // A later apply while it waits: the earlier deadline also undoes this one.
        let later = apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        assert_eq!(later.awaiting, Some(armed.clone()));

        match confirm_pending(&f) {
            ConfirmOutcome::Confirmed(p) => assert_eq!(p, armed),
            other => panic!("{other:?}"),
        }
        assert_eq!(f.state.pending().unwrap(), None);
        assert!(matches!(
            confirm_pending(&f),
            ConfirmOutcome::NothingPending
        ));
    }

    fn confirm_pending(f: &Fixture) -> ConfirmOutcome {
        confirm(&f.state, &f.lock).expect("confirm")
    }

    #[test]
    fn rollback_reinstates_the_generation_before_the_newest() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        let outcome = rollback(&mut table, &f.writer(), None).expect("rolled back");
        assert_eq!(outcome.source.generation, 1);
        assert_eq!(outcome.recorded.generation, 3);
        assert_eq!(outcome.recorded.command, Recorder::Rollback);
        assert_eq!(outcome.recorded.source_generation, Some(1));
        assert!(!outcome.diff.is_empty());
        assert_eq!(table.table, Some(planned(A).ruleset));

        // The table someone flushed comes back the same way.
        table.lose_table();
        let outcome = rollback(&mut table, &f.writer(), Some(2)).expect("rolled back");
        assert_eq!(outcome.recorded.generation, 4);
        assert_eq!(table.table, Some(planned(B).ruleset));
        // Already in place: recorded, nothing sent.
        let sent = table.applied.len();
        rollback(&mut table, &f.writer(), Some(2)).expect("rolled back");
        assert_eq!(table.applied.len(), sent);
    }

    #[test]
    fn a_refused_rollback_records_nothing() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        table.refuse_apply = true;
        rollback(&mut table, &f.writer(), None).expect_err("refused");
        assert_eq!(f.state.generation_numbers().unwrap(), vec![1, 2]);
        assert_eq!(table.table, Some(planned(B).ruleset));
    }

    fn pending(f: &Fixture, generation: u64, revert_to: Option<u64>) -> PendingConfirm {
        let p = PendingConfirm::new(
            generation,
            revert_to,
            SystemTime::now() + Duration::from_secs(60),
            current_netns_inode().expect("a namespace"),
        );
        f.state.write_pending(&f.lock, &p).expect("written");
        p
    }

    #[test]
    fn revert_reinstates_what_was_confirmed_and_marks_the_record() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        let p = pending(&f, 2, Some(1));
        match revert(&mut table, &f.writer(), &p.token).expect("reverted") {
            RevertOutcome::Reinstated {
                source, recorded, ..
            } => assert_eq!((source, recorded), (1, 3)),
            other => panic!("{other:?}"),
        }
        assert_eq!(table.table, Some(planned(A).ruleset));
        let marked = f.state.pending().unwrap().expect("kept for a late confirm");
        assert_eq!(marked.reverted.and_then(|r| r.generation), Some(3));
        // A late confirm learns it.
        assert!(matches!(confirm_pending(&f), ConfirmOutcome::TooLate(_)));
        // The record is gone: a second timer stands down.
        assert!(matches!(
            revert(&mut table, &f.writer(), &p.token).expect("stood down"),
            RevertOutcome::StoodDown
        ));
    }

    #[test]
    fn revert_without_an_earlier_generation_deletes_the_table() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        let p = pending(&f, 1, None);
        assert!(matches!(
            revert(&mut table, &f.writer(), "another token").expect("stood down"),
            RevertOutcome::StoodDown
        ));
        assert!(table.table.is_some());
        assert!(matches!(
            revert(&mut table, &f.writer(), &p.token).expect("reverted"),
            RevertOutcome::Deleted
        ));
        assert_eq!(table.table, None);
    }

    #[test]
    fn a_blocking_table_is_suspected_only_when_names_failed_and_the_dns_sets_differ() {
        let mut p = planned(A);
        let live = crate::nft::table::memory::live_of(&p.ruleset);
        assert!(
            !may_have_blocked_resolution(&p, Some(&live)),
            "all resolved"
        );
        p.resolution = resolution(&[("a.example", &[])]);
        assert!(!may_have_blocked_resolution(&p, None), "no table of ours");
        assert!(
            !may_have_blocked_resolution(&p, Some(&live)),
            "same DNS sets"
        );
        // The live table lets other resolvers through than the plan's.
        let policy = Policy::parse(A, Path::new("p.yaml")).expect("valid");
        let mut elsewhere = resolution(&[]);
        elsewhere.resolvers = vec!["192.0.2.54".parse().unwrap()];
        let other_live = crate::nft::table::memory::live_of(&plan(&policy, &elsewhere));
        assert!(may_have_blocked_resolution(&p, Some(&other_live)));
    }
}
