//! Safe changes to the live table: every write happens under the namespace's writers' lock,
//! is compared with what the kernel holds first (nothing is sent when nothing would change),
//! and is recorded as a generation that `rollback` can reinstate.
//!
//! Confirm-or-revert (`apply --confirm-within`) is ordered so that no failure, and no death
//! of the applying process, leaves an unconfirmed change in place for good: the pending
//! confirmation is written and a revert timer started and heard from *before* the table is
//! touched. The timer outlives its caller's session: a transient systemd unit where systemd
//! runs, else a process of a session of its own that is no session leader (its first stage
//! leaves and exits). It reverts at the deadline unless the pending record has been
//! confirmed (removed) or replaced by then. It writes its pid and start time beside the
//! record, so anyone can see whether it lives; a writer (`apply`, `rollback`, `confirm`) that
//! finds the deadline passed carries out the revert itself, so a killed timer delays a
//! revert to the next writer but never loses it. What a change reverts to is what the kernel
//! held before it: a generation that describes the live table, else the live table itself,
//! recorded in the pending record (refused when it cannot be put back exactly), else nothing.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use crate::core::diff::{CompareOptions, Presence, TableDiff, compare};
use crate::core::resolution::Resolution;
use crate::core::ruleset::{
    Elements, FROM_BRIDGE_CHAIN, GUARD_CHAIN, OUTPUT_CHAIN, REFUSED_CHAIN, Ruleset, SCOPE_CHAINS,
    SCOPE_FORWARD_CHAIN, SCOPE_INPUT_CHAIN, SCOPE_OUTPUT_CHAIN, SCOPE_PREROUTING_CHAIN,
    ScopeChains, Set, SetId, SetRole, TABLE,
};
use crate::nft::live::{ReadRule, describe_table_flags};
use crate::nft::{LiveTable, NftError, Table};
use crate::state::{
    Generation, NewGeneration, Now, PendingConfirm, Recorder, Reverted, Stage, StateDir,
    StateError, TimerLife, WriterLock, current_netns_inode, netns_exists, rfc3339,
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
        "refusing --confirm-within: table inet {TABLE} is installed but cannot be recorded to \
         revert to ({0}), so no revert could put it back; nothing was applied (apply without \
         --confirm-within, or remove the table first)"
    )]
    Unrecordable(String),
    #[error(
        "refusing to revert: this process is in network namespace {current}, the change was applied in {applied_in}"
    )]
    WrongNamespace { current: u64, applied_in: u64 },
    #[error(
        "generation {generation} in {} was applied in network namespace {applied_in}, which \
         still exists, and this process is in network namespace {current}: its confirmation \
         or revert is not this namespace's to settle, and no write goes through that state \
         directory from here (run egress-fence in that namespace, or name this one with \
         --netns to use its own state directory)",
        .dir.display()
    )]
    PendingElsewhere {
        generation: u64,
        dir: PathBuf,
        current: u64,
        applied_in: u64,
    },
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

/// `--confirm-within`: the window, and how to start a revert timer for a token, given the
/// log its standard error goes to (the caller knows the command line).
pub struct ConfirmRequest<'a> {
    pub within: Duration,
    pub timer: &'a dyn Fn(&str, &Path) -> TimerLaunch,
}

/// The ways to start one revert timer. Either way, the timer writes its record (see
/// [`crate::state::TimerRecord`]) once armed.
pub struct TimerLaunch {
    /// A transient systemd unit (its name, and the `systemd-run` command that starts it):
    /// tried first; when `systemd-run` cannot run or fails, the process is started instead.
    pub unit: Option<(String, Command)>,
    /// A process that leaves the caller's session by itself and prints [`TIMER_ARMED`] on
    /// its standard output once armed.
    pub process: Command,
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
    /// What this apply found of an earlier confirmation (when it armed a new one, an earlier
    /// one that still awaited confirmation was replaced: `Nothing`).
    pub pending: PendingNote,
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
    let pending = take_note_of_pending(nft, writer)?;
    // The newest generation is compared and let go before the live table is read: each is
    // about as large as the plan (10,000 elements), and holding all three at once was the
    // peak of an `apply` that changes nothing (BENCHMARKS.md).
    let (newest_matches, newest_number) = match writer.state.newest() {
        Ok(Some(g)) => (g.ruleset == planned.ruleset, Some(g.generation)),
        _ => (false, None),
    };
    let live = nft.read_table()?;
    let diff = compare(&planned.ruleset, live.as_ref(), CompareOptions::default());
    if diff.is_empty() && newest_matches {
        return Ok(ApplyOutcome {
            diff,
            recorded: None,
            current: newest_number,
            armed: None,
            pending,
        });
    }

    let number = writer.state.next_number(writer.lock)?;
    // Nothing changes in the kernel when nothing differs, so there is nothing to confirm.
    let armed = match confirm.filter(|_| !diff.is_empty()) {
        Some(request) => Some(arm(
            writer,
            number,
            pending.awaiting(),
            live.as_ref(),
            &request,
        )?),
        None => None,
    };
    // Not needed any more, and as large as the batch that is built next.
    drop(live);
    if !diff.is_empty()
        && let Err(e) = nft.apply(&planned.ruleset)
    {
        if armed.is_some() {
            // Nothing changed: the timer finds its record gone and stands down.
            withdraw(writer, pending.awaiting())?;
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
        pending: match pending {
            PendingNote::Awaiting(_) if armed.is_some() => PendingNote::Nothing,
            other => other,
        },
        armed,
    })
}

/// Whether the live table may be what kept `planned`'s names from resolving: it exists and
/// its chains or its DNS sets differ from the plan's (flushed by an admin or a reset script,
/// edited, or the policy names other resolvers), so this process's own questions to the
/// resolvers may have been dropped by it. `apply` then installs the plan as it is (only what
/// the new policy allows, with the names that did resolve), which lets it ask again.
///
/// The table is read only when a name did not resolve: a whole read of a large table is not
/// paid on every `apply`.
pub fn may_have_blocked_resolution(
    planned: &Planned,
    nft: &mut impl Table,
) -> Result<bool, NftError> {
    if planned.resolution.unresolved().next().is_none() {
        return Ok(false);
    }
    let Some(live) = nft.read_table()? else {
        // No table of ours: nothing of ours refused the questions.
        return Ok(false);
    };
    let options = CompareOptions {
        ignore_resolved_contents: true,
    };
    let diff = compare(&planned.ruleset, Some(&live), options);
    Ok(!diff.chains.is_empty()
        || diff.sets.iter().any(|s| {
            SetId::from_name(&s.name).is_none_or(|id| id.role == SetRole::Dns)
                && (s.presence != Presence::Both || s.definition.is_some() || !s.added.is_empty())
        }))
}

/// What a writer found of an earlier confirm-or-revert.
#[derive(Debug, Default)]
pub enum PendingNote {
    #[default]
    Nothing,
    /// A change that still awaits confirmation: its deadline also undoes this one. The record
    /// stays: only `confirm` or its deadline ends it.
    Awaiting(PendingConfirm),
    /// Its revert timer reverted it since the last writer: taken note of, the record goes.
    Reverted(PendingConfirm),
    /// Its deadline had passed and no revert was done yet (its timer is gone, or waits for
    /// the lock this writer holds): this writer carried it out; the record goes.
    RevertedNow(PendingConfirm, RevertOutcome),
    /// Void (armed before the host restarted, or in a network namespace that is gone):
    /// dropped, and said so.
    Dropped(PendingConfirm, String),
}

impl PendingNote {
    pub fn awaiting(&self) -> Option<&PendingConfirm> {
        match self {
            PendingNote::Awaiting(p) => Some(p),
            _ => None,
        }
    }

    /// The note in a sentence, for a writer's report (`None` when there is nothing to say).
    pub fn describe(&self, state: &StateDir) -> Option<String> {
        Some(match self {
            PendingNote::Nothing => return None,
            PendingNote::Awaiting(p) | PendingNote::Reverted(p) => state.describe_pending(p),
            PendingNote::RevertedNow(p, outcome) => format!(
                "generation {} was not confirmed by {} and no revert timer had reverted it: \
                 reverted it now: {}",
                p.generation,
                p.deadline,
                outcome.describe()
            ),
            PendingNote::Dropped(p, why) => format!(
                "dropped the pending confirmation of generation {} (deadline {}): {why}; \
                 nothing was reverted",
                p.generation, p.deadline
            ),
        })
    }
}

/// The pending record as a writer finds it: still awaiting confirmation (it stays), a revert
/// to take note of, a revert that is due (carried out here, under this writer's lock, before
/// anything else), or a void record (dropped).
fn take_note_of_pending(
    nft: &mut impl Table,
    writer: &Writer<'_>,
) -> Result<PendingNote, ChangeError> {
    let Some(pending) = writer.state.pending()? else {
        return Ok(PendingNote::Nothing);
    };
    let now = Now::read();
    let stage = pending.stage(&now);
    // A state directory is named after `--netns` (or "host" without it), not after the
    // namespace the writer is in: a writer elsewhere that took this record for its own would
    // confirm, replace (its timer then stands down) or drop a change it cannot see.
    if matches!(stage, Stage::Awaiting(_) | Stage::Due)
        && let Err(ChangeError::WrongNamespace {
            current,
            applied_in,
        }) = check_namespace(&pending)
        && netns_exists(applied_in)
    {
        return Err(ChangeError::PendingElsewhere {
            generation: pending.generation,
            dir: writer.state.path().to_path_buf(),
            current,
            applied_in,
        });
    }
    let note = match stage {
        Stage::Awaiting(_) => return Ok(PendingNote::Awaiting(pending)),
        Stage::Reverted => PendingNote::Reverted(pending),
        Stage::OtherBoot => PendingNote::Dropped(
            pending,
            "it was armed before the host restarted, which ended its revert timer and the \
             kernel's table"
                .into(),
        ),
        Stage::Due => match check_namespace(&pending) {
            Err(ChangeError::WrongNamespace { applied_in, .. }) => PendingNote::Dropped(
                pending,
                format!("it was applied in network namespace {applied_in}, which is gone"),
            ),
            Err(e) => return Err(e),
            Ok(()) => {
                let outcome = carry_out(nft, writer, &pending, &now)?;
                PendingNote::RevertedNow(pending, outcome)
            }
        },
    };
    if let PendingNote::Reverted(p) | PendingNote::RevertedNow(p, _) | PendingNote::Dropped(p, _) =
        &note
    {
        forget(writer, p)?;
    }
    Ok(note)
}

/// Removes a pending record and its timer's record.
fn forget(writer: &Writer<'_>, pending: &PendingConfirm) -> Result<(), ChangeError> {
    writer.state.clear_pending(writer.lock)?;
    writer.state.remove_timer_record(&pending.token)?;
    Ok(())
}

/// Takes back a confirmation just armed, for a change that did not happen: the one it
/// replaced, if any, awaits its deadline again (its timer may have stood down meanwhile; then
/// the first writer after the deadline reverts it, as for any timer that is gone).
fn withdraw(writer: &Writer<'_>, replaced: Option<&PendingConfirm>) -> Result<(), ChangeError> {
    writer.state.clear_pending(writer.lock)?;
    if let Some(earlier) = replaced {
        writer.state.write_pending(writer.lock, earlier)?;
    }
    Ok(())
}

/// Writes the pending confirmation and starts its revert timer; returns once the timer said
/// it is armed. What it reverts to: what an earlier unconfirmed change reverts to (the last
/// confirmed state), else what the kernel holds now (see [`revert_target`]).
fn arm(
    writer: &Writer<'_>,
    generation: u64,
    awaiting: Option<&PendingConfirm>,
    live: Option<&LiveTable>,
    request: &ConfirmRequest<'_>,
) -> Result<PendingConfirm, ChangeError> {
    let (revert_to, revert_table) = match awaiting {
        Some(earlier) => (earlier.revert_to, earlier.revert_table.clone()),
        None => revert_target(writer.state, live)?,
    };
    if let Some(n) = revert_to {
        // Refuse now rather than find out at the deadline that there is nothing to revert to.
        writer.state.load(n)?;
    }
    let mut pending = PendingConfirm::new(
        generation,
        revert_to,
        &Now::read(),
        request.within,
        current_netns_inode()?,
    );
    pending.revert_table = revert_table;
    writer.state.write_pending(writer.lock, &pending)?;
    match start_timer(writer.state, &pending.token, request.timer) {
        Ok(None) => {}
        Ok(Some(unit)) => {
            pending.timer_unit = Some(unit);
            writer.state.write_pending(writer.lock, &pending)?;
        }
        Err(e) => {
            // The timer, should it arm late, finds no record and stands down.
            withdraw(writer, awaiting)?;
            return Err(e);
        }
    }
    Ok(pending)
}

/// What the kernel holds, as something to revert to: the newest generation when the live
/// table is exactly it; else the live table itself, when it can be put back exactly; else
/// nothing, when there is no table. Never nothing when there is a table.
fn revert_target(
    state: &StateDir,
    live: Option<&LiveTable>,
) -> Result<(Option<u64>, Option<Ruleset>), ChangeError> {
    let Some(live) = live else {
        return Ok((None, None));
    };
    if let Ok(Some(newest)) = state.newest()
        && compare(&newest.ruleset, Some(live), CompareOptions::default()).is_empty()
    {
        return Ok((Some(newest.generation), None));
    }
    let table = recorded_table(live).map_err(ChangeError::Unrecordable)?;
    Ok((None, Some(table)))
}

/// The live table as a [`Ruleset`] that installs it again, exactly: every rule one that
/// egress-fence writes, every set one of its eight with every element decoded, no other chain
/// or set, no table flags, and the result compared with the live table once more (so what is
/// recorded is what the comparison sees, all of it). `Err` says what cannot be recorded.
pub fn recorded_table(live: &LiveTable) -> Result<Ruleset, String> {
    if live.flags != 0 {
        return Err(format!(
            "its flags are {}",
            describe_table_flags(live.flags)
        ));
    }
    let mut output = Vec::new();
    let mut refused = Vec::new();
    let mut guard = Vec::new();
    let mut scope = ScopeChains::default();
    let scoped = live
        .chains
        .iter()
        .any(|c| SCOPE_CHAINS.contains(&c.name.as_str()));
    for r in &live.rules {
        let rule = match &r.rule {
            ReadRule::Known(rule) => rule.clone(),
            unknown @ ReadRule::Unknown(_) => {
                return Err(format!(
                    "chain {} holds a rule egress-fence does not write: {unknown}",
                    r.chain
                ));
            }
        };
        match r.chain.as_str() {
            OUTPUT_CHAIN => output.push(rule),
            REFUSED_CHAIN => refused.push(rule),
            SCOPE_OUTPUT_CHAIN => scope.output.push(rule),
            SCOPE_FORWARD_CHAIN => scope.forward.push(rule),
            SCOPE_INPUT_CHAIN => scope.input.push(rule),
            SCOPE_PREROUTING_CHAIN => scope.prerouting.push(rule),
            FROM_BRIDGE_CHAIN => scope.from_bridge.push(rule),
            GUARD_CHAIN => guard.push(rule),
            other => {
                return Err(format!(
                    "it has a chain egress-fence does not make: {other}"
                ));
            }
        }
    }
    if let Some((set, _)) = live
        .sets
        .iter()
        .find(|(set, _)| SetId::from_name(&set.name).is_none())
    {
        return Err(format!(
            "it has a set egress-fence does not make: {}",
            set.name
        ));
    }
    let mut sets = Vec::new();
    for id in SetId::ALL {
        let contents = live
            .read_set(id)
            .ok_or_else(|| format!("its set {} is missing", id.name()))?;
        if let Some(element) = contents.undecodable.first() {
            return Err(format!(
                "set {} holds an element egress-fence does not write: {element}",
                id.name()
            ));
        }
        sets.push(Set {
            id,
            elements: contents.elements,
        });
    }
    let table = Ruleset {
        sets,
        output,
        refused,
        guard,
        scope: scoped.then_some(scope),
        audit: None,
    };
    let diff = compare(&table, Some(live), CompareOptions::default());
    if !diff.is_empty() {
        return Err(format!(
            "it would not read back the same: {}",
            diff.summary().join("; ")
        ));
    }
    Ok(table)
}

/// A recorded table `elapsed` later: its resolved elements keep only what was left of their
/// lifetimes (an element that would have expired meanwhile is left out), so putting it back
/// lengthens no lifetime.
pub fn aged(table: &Ruleset, elapsed: Duration) -> Ruleset {
    let elapsed_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
    let mut table = table.clone();
    for set in &mut table.sets {
        if let Elements::Timed(timed) = &mut set.elements {
            timed.retain_mut(|t| {
                let Some(left) = t.expires_ms.or(t.timeout_ms) else {
                    return true;
                };
                match left.checked_sub(elapsed_ms).filter(|&ms| ms > 0) {
                    Some(ms) => {
                        t.timeout_ms = Some(ms);
                        t.expires_ms = None;
                        true
                    }
                    None => false,
                }
            });
        }
    }
    table
}

/// Starts the revert timer (as a systemd unit if one is offered and `systemd-run` works,
/// else as a process) and waits until it is armed; returns the unit's name if it runs as one.
fn start_timer(
    state: &StateDir,
    token: &str,
    timer: &dyn Fn(&str, &Path) -> TimerLaunch,
) -> Result<Option<String>, ChangeError> {
    let log_path = state.revert_timer_log();
    let failed = |reason: String| ChangeError::TimerStart {
        reason,
        log: log_path.clone(),
    };
    let launch = timer(token, &log_path);
    if let Some((unit, command)) = launch.unit {
        match start_unit(state, token, command) {
            Ok(()) => return Ok(Some(unit)),
            Err(UnitStart::Failed(reason)) => return Err(failed(reason)),
            Err(UnitStart::NoSystemdRun(reason)) => {
                // Said in the log, which the timer's own lines follow.
                if let Ok(mut log) = state.open_revert_timer_log() {
                    let _ = writeln!(
                        log,
                        "systemd-run could not start unit {unit} ({reason}); starting the \
                         revert timer as a process of its own session instead"
                    );
                }
            }
        }
    }
    start_process(state, token, launch.process).map_err(failed)?;
    Ok(None)
}

enum UnitStart {
    /// `systemd-run` did not run or refused: another way may work.
    NoSystemdRun(String),
    /// The unit started but its timer did not arm.
    Failed(String),
}

/// Runs `systemd-run` and waits for the unit's timer to write its record.
fn start_unit(state: &StateDir, token: &str, mut command: Command) -> Result<(), UnitStart> {
    let log = state
        .open_revert_timer_log()
        .map_err(|e| UnitStart::NoSystemdRun(format!("cannot open its log: {e}")))?;
    let status = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .status()
        .map_err(|e| UnitStart::NoSystemdRun(format!("cannot run it: {e}")))?;
    if !status.success() {
        return Err(UnitStart::NoSystemdRun(format!("it exited with {status}")));
    }
    let until = Instant::now() + TIMER_HANDSHAKE;
    while Instant::now() < until {
        if state.timer_life(token) == TimerLife::Alive {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(UnitStart::Failed(format!(
        "its unit did not arm within {} s",
        TIMER_HANDSHAKE.as_secs()
    )))
}

/// Starts the timer's process and waits for its [`TIMER_ARMED`] line and its record. Its
/// standard error goes to the state directory's log, its standard input is /dev/null: it
/// needs no terminal.
fn start_process(state: &StateDir, token: &str, mut command: Command) -> Result<(), String> {
    let log = state
        .open_revert_timer_log()
        .map_err(|e| format!("cannot open its log: {e}"))?;
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start it: {e}"))?;
    let stdout = child.stdout.take().ok_or("no pipe to it")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let outcome = rx.recv_timeout(TIMER_HANDSHAKE);
    if !matches!(&outcome, Ok(line) if line.trim() == TIMER_ARMED) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(match outcome {
            Ok(_) => "it exited before it was armed".into(),
            Err(_) => format!("it did not report within {} s", TIMER_HANDSHAKE.as_secs()),
        });
    }
    // Its first stage only leaves the session and hands over: it has exited or is about to.
    let _ = child.wait();
    if state.timer_life(token) != TimerLife::Alive {
        return Err("it said it was armed but left no record of itself".into());
    }
    Ok(())
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
    pub pending: PendingNote,
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
    let pending = take_note_of_pending(nft, writer)?;
    let (diff, recorded) = reinstate(nft, writer, &source, Recorder::Rollback)?;
    Ok(RollbackOutcome {
        source,
        recorded,
        diff,
        pending,
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
    /// The deadline passed before the confirmation came: the change was reverted (by its
    /// timer, or now), or its record was void.
    TooLate(PendingNote),
    NothingPending,
}

/// Confirms the change awaiting confirmation, if any. After its deadline there is nothing to
/// confirm: a revert still due is carried out now.
pub fn confirm(nft: &mut impl Table, writer: &Writer<'_>) -> Result<ConfirmOutcome, ChangeError> {
    Ok(match take_note_of_pending(nft, writer)? {
        PendingNote::Nothing => ConfirmOutcome::NothingPending,
        PendingNote::Awaiting(p) => {
            forget(writer, &p)?;
            ConfirmOutcome::Confirmed(p)
        }
        late => ConfirmOutcome::TooLate(late),
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
/// deadline is the record's, on the boot clock (see [`crate::state::Now`]), so neither a
/// step of the wall clock nor a suspend moves it.
pub fn wait_for_deadline(state: &StateDir, pending: &PendingConfirm) -> TimerWake {
    loop {
        match state.pending() {
            Ok(Some(p)) if p.token == pending.token => {}
            // A record that cannot be read right now is no confirmation: keep the deadline.
            Err(_) => {}
            Ok(_) => return TimerWake::StandDown,
        }
        match pending.stage(&Now::read()) {
            Stage::Awaiting(left) => std::thread::sleep(TIMER_POLL.min(left)),
            _ => return TimerWake::Deadline,
        }
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
    /// The table that was live before the change (no generation) was put back.
    Restored { diff: TableDiff },
    /// There was no table before the change: the table was deleted.
    Deleted,
}

impl RevertOutcome {
    pub fn describe(&self) -> String {
        match self {
            RevertOutcome::StoodDown => "nothing to revert".into(),
            RevertOutcome::Reinstated {
                source, recorded, ..
            } => format!("reinstated generation {source}, recorded as generation {recorded}"),
            RevertOutcome::Restored { .. } => format!(
                "put back table inet {TABLE} as it was before the change (not a generation)"
            ),
            RevertOutcome::Deleted => {
                format!("there was no table before the change: table inet {TABLE} was deleted")
            }
        }
    }
}

/// What a revert timer did at its deadline, and whether the record had been rewritten since
/// it armed.
#[derive(Debug)]
pub struct TimerRevert {
    pub outcome: RevertOutcome,
    /// How the record on disk differed from what the timer armed with (its revert target,
    /// deadline, boot or namespace): changed beside egress-fence, so not obeyed.
    pub altered: Option<String>,
}

/// The deadline came: reverts the change that `armed` (the record as the timer read it when
/// it armed) guards, unless it was confirmed or replaced meanwhile, and marks the record
/// reverted. The record on disk decides only whether the change still awaits confirmation
/// (its token); what to revert to is what the timer armed with. No egress-fence writer
/// changes a record's target or deadline once armed, so a record that says otherwise was
/// rewritten beside it, and a rewritten target could name any table (one that lets every
/// host out, described as "the table as it was before the change").
pub fn revert(
    nft: &mut impl Table,
    writer: &Writer<'_>,
    armed: &PendingConfirm,
) -> Result<TimerRevert, ChangeError> {
    // A record that cannot be read is no confirmation (as while the timer waited): what it
    // armed with decides, and is written back.
    let (found, unreadable) = match writer.state.pending() {
        Ok(found) => (found, None),
        Err(e @ StateError::CorruptPending { .. }) => {
            (Some(armed.clone()), Some(format!("it was unreadable: {e}")))
        }
        Err(e) => return Err(e.into()),
    };
    let Some(found) = found.filter(|p| p.token == armed.token && p.reverted.is_none()) else {
        return Ok(TimerRevert {
            outcome: RevertOutcome::StoodDown,
            altered: None,
        });
    };
    // `apply` names the systemd unit after the timer armed: that field may differ.
    let mut pending = PendingConfirm {
        timer_unit: found.timer_unit.clone(),
        reverted: None,
        ..armed.clone()
    };
    let altered =
        unreadable.or_else(|| (found != pending).then(|| altered_fields(&found, &pending)));
    check_namespace(&pending)?;
    let outcome = carry_out(nft, writer, &pending, &Now::read())?;
    pending.reverted = Some(Reverted {
        time: rfc3339(SystemTime::now()),
        generation: match &outcome {
            RevertOutcome::Reinstated { recorded, .. } => Some(*recorded),
            _ => None,
        },
    });
    writer.state.write_pending(writer.lock, &pending)?;
    Ok(TimerRevert { outcome, altered })
}

/// The fields in which `found` differs from `armed`, for the timer's log.
fn altered_fields(found: &PendingConfirm, armed: &PendingConfirm) -> String {
    let mut fields = Vec::new();
    if found.generation != armed.generation {
        fields.push("generation");
    }
    if found.revert_to != armed.revert_to {
        fields.push("revert_to");
    }
    if found.revert_table != armed.revert_table {
        fields.push("revert_table");
    }
    if found.deadline != armed.deadline || found.deadline_unix_ms != armed.deadline_unix_ms {
        fields.push("deadline");
    }
    if found.boot_id != armed.boot_id
        || found.armed_boot_ms != armed.armed_boot_ms
        || found.deadline_boot_ms != armed.deadline_boot_ms
    {
        fields.push("boot clock");
    }
    if found.netns_inode != armed.netns_inode {
        fields.push("netns_inode");
    }
    if found.format != armed.format {
        fields.push("format");
    }
    fields.join(", ")
}

/// Puts back what `pending` reverts to.
fn carry_out(
    nft: &mut impl Table,
    writer: &Writer<'_>,
    pending: &PendingConfirm,
    now: &Now,
) -> Result<RevertOutcome, ChangeError> {
    Ok(match (pending.revert_to, &pending.revert_table) {
        (Some(n), _) => {
            let source = writer.state.load(n)?;
            let (diff, recorded) = reinstate(nft, writer, &source, Recorder::Revert)?;
            RevertOutcome::Reinstated {
                source: source.generation,
                recorded: recorded.generation,
                diff,
            }
        }
        (None, Some(table)) => {
            let table = aged(table, pending.since_armed(now));
            let live = nft.read_table()?;
            let diff = compare(&table, live.as_ref(), CompareOptions::default());
            if !diff.is_empty() {
                nft.apply(&table)?;
            }
            RevertOutcome::Restored { diff }
        }
        (None, None) => {
            nft.teardown()?;
            RevertOutcome::Deleted
        }
    })
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
            // What `run --record` and `learn` add is the run's, not the generation's (status
            // says when the table audits).
            let stripped;
            let live = match live.has_extras() {
                true => {
                    stripped = live.without_extras();
                    &stripped
                }
                false => live,
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
    use super::*;
    use crate::core::plan::{plan, tests::resolution};
    use crate::core::policy::Policy;
    use crate::nft::live::ReadRule;
    use crate::nft::table::memory::MemoryTable;

    const A: &str = "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\ndns:\n  resolvers: [192.0.2.53, \"2001:db8::53\"]\n";
    const B: &str = "version: 1\nallow:\n  - cidr: 203.0.113.0/28\n    ports: [22]\ndns:\n  resolvers: [192.0.2.53, \"2001:db8::53\"]\n";

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

    /// A revert timer that says it is armed and leaves (nothing reverts in these tests); its
    /// record names this test process, which lives.
    fn armed_timer(state: &StateDir) -> impl Fn(&str, &Path) -> TimerLaunch + '_ {
        |token, _log| {
            let me = crate::state::TimerRecord::of_this_process(token).expect("this process");
            state.write_timer_record(&me).expect("written");
            let mut process = Command::new("sh");
            process.args(["-c", "echo armed"]);
            TimerLaunch {
                unit: None,
                process,
            }
        }
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
            timer: &armed_timer(&f.state),
        };
        apply(&mut table, &f.writer(), planned(A), Some(confirm)).expect_err("refused");
        assert_eq!(f.state.pending().unwrap(), None, "the timer stands down");
        assert!(f.state.generation_numbers().unwrap().is_empty());
    }

    #[test]
    fn a_refused_apply_gives_back_the_confirmation_it_would_have_replaced() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        let earlier = pending_armed(&f, 2, Some(1), Duration::ZERO, Duration::from_secs(60));
        table.refuse_apply = true;
        let timer = armed_timer(&f.state);
        let request = confirm_request(&timer, Duration::from_secs(60));
        apply(&mut table, &f.writer(), planned(B), Some(request)).expect_err("refused");
        assert_eq!(
            f.state.pending().unwrap(),
            Some(earlier),
            "still awaits its deadline"
        );
    }

    #[test]
    fn an_armed_apply_awaits_confirmation_and_confirm_clears_it() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        let confirm = ConfirmRequest {
            within: Duration::from_secs(60),
            timer: &armed_timer(&f.state),
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
        assert_eq!(later.pending.awaiting(), Some(&armed));

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
        confirm(&mut MemoryTable::new(), &f.writer()).expect("confirm")
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
            &Now::read(),
            Duration::from_secs(60),
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
        match revert(&mut table, &f.writer(), &p)
            .expect("reverted")
            .outcome
        {
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
            revert(&mut table, &f.writer(), &p)
                .expect("stood down")
                .outcome,
            RevertOutcome::StoodDown
        ));
    }

    #[test]
    fn revert_obeys_what_the_timer_armed_with_not_a_record_rewritten_since() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        let armed = pending(&f, 2, Some(1));
        // `apply` names the unit after the timer armed: no alteration.
        let named = PendingConfirm {
            timer_unit: Some("egress-fence-revert-x".into()),
            ..armed.clone()
        };
        f.state.write_pending(&f.lock, &named).expect("written");
        // Rewritten beside egress-fence: another target, and a deadline a year away.
        let mut rewritten = named.clone();
        rewritten.revert_to = None;
        rewritten.revert_table = Some(planned(B).ruleset);
        rewritten.deadline_boot_ms += 365 * 86_400_000;
        f.state.write_pending(&f.lock, &rewritten).expect("written");
        let done = revert(&mut table, &f.writer(), &armed).expect("reverted");
        assert_eq!(
            done.altered.as_deref(),
            Some("revert_to, revert_table, boot clock")
        );
        assert!(matches!(
            done.outcome,
            RevertOutcome::Reinstated { source: 1, .. }
        ));
        assert_eq!(table.table, Some(planned(A).ruleset));
        let marked = f.state.pending().unwrap().expect("kept for a late confirm");
        assert_eq!(marked.revert_to, Some(1), "the record says what was done");
        assert_eq!(marked.timer_unit, named.timer_unit);

        // Only the unit's name differs: nothing altered.
        apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        let armed = pending(&f, 5, Some(1));
        f.state
            .write_pending(
                &f.lock,
                &PendingConfirm {
                    timer_unit: Some("u".into()),
                    ..armed.clone()
                },
            )
            .expect("written");
        let done = revert(&mut table, &f.writer(), &armed).expect("reverted");
        assert_eq!(done.altered, None);

        // Unreadable: no confirmation; reverted, and the record written back whole.
        apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        let armed = pending(&f, 8, Some(1));
        std::fs::write(f.state.path().join("pending-confirm.json"), "{").expect("torn");
        let done = revert(&mut table, &f.writer(), &armed).expect("reverted");
        assert!(
            done.altered
                .as_deref()
                .is_some_and(|a| a.contains("unreadable")),
            "{done:?}"
        );
        assert_eq!(table.table, Some(planned(A).ruleset));
        let marked = f.state.pending().unwrap().expect("written back");
        assert_eq!(marked.token, armed.token);
        assert!(marked.reverted.is_some());
    }

    #[test]
    fn revert_without_an_earlier_generation_deletes_the_table() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        let p = pending(&f, 1, None);
        let other = PendingConfirm {
            token: "another token".into(),
            ..p.clone()
        };
        assert!(matches!(
            revert(&mut table, &f.writer(), &other)
                .expect("stood down")
                .outcome,
            RevertOutcome::StoodDown
        ));
        assert!(table.table.is_some());
        assert!(matches!(
            revert(&mut table, &f.writer(), &p)
                .expect("reverted")
                .outcome,
            RevertOutcome::Deleted
        ));
        assert_eq!(table.table, None);
    }

    fn confirm_request<'a>(
        timer: &'a dyn Fn(&str, &Path) -> TimerLaunch,
        within: Duration,
    ) -> ConfirmRequest<'a> {
        ConfirmRequest { within, timer }
    }

    /// A pending confirmation armed `ago` before now with a window of `within`.
    fn pending_armed(
        f: &Fixture,
        generation: u64,
        revert_to: Option<u64>,
        ago: Duration,
        within: Duration,
    ) -> PendingConfirm {
        let now = Now::read();
        let then = Now {
            boot_ms: now.boot_ms - ago.as_millis() as u64,
            wall: now.wall - ago,
            ..now
        };
        let p = PendingConfirm::new(
            generation,
            revert_to,
            &then,
            within,
            current_netns_inode().expect("a namespace"),
        );
        f.state.write_pending(&f.lock, &p).expect("written");
        p
    }

    #[test]
    fn an_overdue_revert_is_carried_out_by_the_next_apply_and_said() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        // Armed two minutes ago for one minute; no timer ever lived.
        let p = pending_armed(
            &f,
            2,
            Some(1),
            Duration::from_secs(120),
            Duration::from_secs(60),
        );
        assert_eq!(f.state.timer_life(&p.token), TimerLife::Gone);
        let sent = table.applied.len();
        let outcome = apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        match &outcome.pending {
            PendingNote::RevertedNow(
                q,
                RevertOutcome::Reinstated {
                    source: 1,
                    recorded: 3,
                    ..
                },
            ) => {
                assert_eq!(q.token, p.token)
            }
            other => panic!("{other:?}"),
        }
        let said = outcome.pending.describe(&f.state).expect("said");
        assert!(
            said.contains("reverted it now") && said.contains("generation 1"),
            "{said}"
        );
        // The revert (to A), then this apply (B again).
        assert_eq!(table.applied.len(), sent + 2);
        assert_eq!(table.applied[sent], planned(A).ruleset);
        assert_eq!(outcome.recorded.map(|g| g.generation), Some(4));
        assert_eq!(f.state.pending().unwrap(), None);
    }

    #[test]
    fn a_confirm_after_the_deadline_is_too_late_and_carries_out_the_revert() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        pending_armed(
            &f,
            2,
            Some(1),
            Duration::from_secs(61),
            Duration::from_secs(60),
        );
        match confirm(&mut table, &f.writer()).expect("confirm") {
            ConfirmOutcome::TooLate(PendingNote::RevertedNow(..)) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(table.table, Some(planned(A).ruleset));
        assert!(matches!(
            confirm(&mut table, &f.writer()).expect("confirm"),
            ConfirmOutcome::NothingPending
        ));
    }

    #[test]
    fn a_wall_clock_step_drops_no_pending_revert() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        let mut p = pending_armed(&f, 2, Some(1), Duration::ZERO, Duration::from_secs(60));
        // As if the wall clock had jumped a day ahead since it was armed.
        p.deadline_unix_ms -= 86_400_000;
        f.state.write_pending(&f.lock, &p).expect("written");
        let outcome = apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        assert_eq!(outcome.pending.awaiting(), Some(&p));
        assert_eq!(f.state.pending().unwrap(), Some(p));
    }

    #[test]
    fn a_pending_confirmation_of_another_boot_is_dropped_and_said() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        let mut p = pending_armed(&f, 2, Some(1), Duration::ZERO, Duration::from_secs(60));
        p.boot_id = "another boot".into();
        f.state.write_pending(&f.lock, &p).expect("written");
        let sent = table.applied.len();
        let outcome = rollback(&mut table, &f.writer(), Some(1)).expect("rolled back");
        assert!(matches!(outcome.pending, PendingNote::Dropped(..)));
        let said = outcome.pending.describe(&f.state).expect("said");
        assert!(
            said.contains("restarted") && said.contains("nothing was reverted"),
            "{said}"
        );
        assert_eq!(
            table.applied.len(),
            sent,
            "nothing reverted, nothing to roll back"
        );
        assert_eq!(f.state.pending().unwrap(), None);
    }

    #[test]
    fn a_foreign_table_is_recorded_when_armed_and_reverted_to() {
        let f = fixture();
        // Installed from another state directory: no generation here describes it.
        let mut table = MemoryTable::holding(planned(B).ruleset);
        let timer = armed_timer(&f.state);
        let request = confirm_request(&timer, Duration::from_secs(60));
        let outcome = apply(&mut table, &f.writer(), planned(A), Some(request)).expect("applied");
        let armed = outcome.armed.expect("armed");
        assert_eq!(armed.revert_to, None);
        // As read back (each element with how long it had left), the table that was live.
        let recorded = armed
            .revert_table
            .as_ref()
            .expect("the live table recorded");
        assert_eq!(aged(recorded, Duration::ZERO), planned(B).ruleset);
        assert!(armed.revert_target().contains("live before it"));
        assert_eq!(table.table, Some(planned(A).ruleset));
        match revert(&mut table, &f.writer(), &armed)
            .expect("reverted")
            .outcome
        {
            RevertOutcome::Restored { diff } => assert!(!diff.is_empty()),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            table.table,
            Some(planned(B).ruleset),
            "the foreign table is back"
        );
        assert_eq!(
            f.state.generation_numbers().unwrap(),
            vec![1],
            "not a generation"
        );
    }

    #[test]
    fn a_table_that_matches_the_newest_generation_reverts_to_it_and_no_table_to_nothing() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(A), None).expect("applied");
        let live = table.read_table().unwrap();
        assert_eq!(
            revert_target(&f.state, live.as_ref()).unwrap(),
            (Some(1), None)
        );
        assert_eq!(revert_target(&f.state, None).unwrap(), (None, None));
        // Changed beside egress-fence: the live table itself, not the generation.
        let other = crate::nft::table::memory::live_of(&planned(B).ruleset);
        let (to, recorded) = revert_target(&f.state, Some(&other)).unwrap();
        assert_eq!(to, None);
        assert!(recorded.is_some());
    }

    #[test]
    fn a_live_table_is_recorded_exactly_or_refused() {
        let rs = planned(A).ruleset;
        let live = crate::nft::table::memory::live_of(&rs);
        let recorded = recorded_table(&live).expect("recordable");
        assert_eq!(
            aged(&recorded, Duration::ZERO),
            rs,
            "what was applied, lifetimes as left"
        );

        let mut dormant = live.clone();
        dormant.flags = 1;
        assert!(recorded_table(&dormant).unwrap_err().contains("flags"));

        let mut unknown = live.clone();
        unknown.rules[0].rule =
            ReadRule::Unknown(vec!["[ payload load 4b @ network header + 16 ]".into()]);
        let why = recorded_table(&unknown).unwrap_err();
        assert!(why.contains("does not write"), "{why}");

        let mut missing = live.clone();
        missing.sets.pop();
        assert!(recorded_table(&missing).unwrap_err().contains("missing"));

        let mut extra = live;
        let (mut set, elems) = extra.sets[0].clone();
        set.name = "extra".into();
        extra.sets.push((set, elems));
        assert!(recorded_table(&extra).unwrap_err().contains("extra"));
    }

    #[test]
    fn a_scoped_live_table_is_recorded_exactly_or_refused() {
        let rs = crate::core::diff::tests::scoped_ruleset();
        let live = crate::nft::table::memory::live_of(&rs);
        let recorded = recorded_table(&live).expect("recordable");
        assert_eq!(aged(&recorded, Duration::ZERO), rs);

        // Its fence made a base chain again: no ruleset installs that.
        let mut hooked = live.clone();
        let output = hooked
            .chains
            .iter_mut()
            .find(|c| c.name == "output")
            .unwrap();
        output.kind = Some("filter".into());
        output.flags = crate::nft::live::NFT_CHAIN_BASE;
        output.hook = Some((libc::NF_INET_LOCAL_OUT as u32, 0, libc::NF_DROP as u32));
        let why = recorded_table(&hooked).unwrap_err();
        assert!(why.contains("chain output"), "{why}");

        // scope_output with policy drop.
        let mut dropping = live.clone();
        let scope_output = dropping
            .chains
            .iter_mut()
            .find(|c| c.name == "scope_output")
            .unwrap();
        scope_output.hook = Some((libc::NF_INET_LOCAL_OUT as u32, 0, libc::NF_DROP as u32));
        let why = recorded_table(&dropping).unwrap_err();
        assert!(why.contains("chain scope_output"), "{why}");

        // The spoof check after conntrack: no ruleset installs that either.
        let mut late = live.clone();
        let prerouting = late
            .chains
            .iter_mut()
            .find(|c| c.name == "scope_prerouting")
            .unwrap();
        prerouting.hook = Some((libc::NF_INET_PRE_ROUTING as u32, 0, libc::NF_ACCEPT as u32));
        let why = recorded_table(&late).unwrap_err();
        assert!(why.contains("chain scope_prerouting"), "{why}");
    }

    #[test]
    fn a_live_table_that_cannot_be_recorded_refuses_arming() {
        let f = fixture();
        // Two tables ago in the same chain: the kernel holds a rule the decoder cannot read.
        struct Undecodable(MemoryTable);
        impl Table for Undecodable {
            fn apply(&mut self, r: &Ruleset) -> Result<(), NftError> {
                self.0.apply(r)
            }
            fn upsert_resolved(
                &mut self,
                e: &[crate::core::ruleset::Timed],
            ) -> Result<(), NftError> {
                self.0.upsert_resolved(e)
            }
            fn teardown(&mut self) -> Result<bool, NftError> {
                self.0.teardown()
            }
            fn table_exists(&mut self) -> Result<bool, NftError> {
                self.0.table_exists()
            }
            fn read_table(&mut self) -> Result<Option<LiveTable>, NftError> {
                Ok(self.0.read_table()?.map(|mut live| {
                    live.rules[0].rule = ReadRule::Unknown(vec!["[ immediate accept ]".into()]);
                    live
                }))
            }
            fn generation(&mut self) -> Result<u32, NftError> {
                self.0.generation()
            }
            fn renew_audit_window(&mut self, ms: u64) -> Result<(), NftError> {
                self.0.renew_audit_window(ms)
            }
        }
        let mut table = Undecodable(MemoryTable::holding(planned(B).ruleset));
        let timer = armed_timer(&f.state);
        let request = confirm_request(&timer, Duration::from_secs(60));
        let err = apply(&mut table, &f.writer(), planned(A), Some(request)).expect_err("refused");
        assert!(matches!(err, ChangeError::Unrecordable(_)), "{err}");
        assert!(err.to_string().contains("nothing was applied"), "{err}");
        assert_eq!(table.0.table, Some(planned(B).ruleset), "untouched");
        assert_eq!(f.state.pending().unwrap(), None);
    }

    #[test]
    fn a_recorded_table_ages_until_it_is_put_back() {
        let mut rs = planned(A).ruleset;
        // As `run` keeps them: each resolved element expires unless refreshed.
        for set in &mut rs.sets {
            if let Elements::Timed(timed) = &mut set.elements {
                for e in timed {
                    e.timeout_ms = Some(60_000);
                }
            }
        }
        let live = crate::nft::table::memory::live_of(&rs);
        let recorded = recorded_table(&live).expect("recordable");
        let timeouts = |t: &Ruleset| -> Vec<Option<u64>> {
            t.sets
                .iter()
                .flat_map(|s| match &s.elements {
                    Elements::Timed(timed) => timed.iter().map(|e| e.timeout_ms).collect(),
                    _ => Vec::new(),
                })
                .collect()
        };
        let before = timeouts(&aged(&recorded, Duration::ZERO));
        assert!(
            !before.is_empty() && before.iter().all(Option::is_some),
            "{before:?}"
        );
        let full = before[0].unwrap();
        let later = timeouts(&aged(&recorded, Duration::from_millis(full - 1000)));
        assert_eq!(later[0], Some(1000));
        assert!(timeouts(&aged(&recorded, Duration::from_millis(full))).is_empty());
        // A permanent element stays permanent.
        for set in &mut rs.sets {
            if let Elements::Timed(timed) = &mut set.elements {
                for e in timed {
                    e.timeout_ms = None;
                }
            }
        }
        assert_eq!(aged(&rs, Duration::from_secs(3600)), rs);
    }

    /// A fake `systemd-run` that records its arguments and, as the unit would, starts a timer
    /// that writes its record (this test process stands in for it).
    #[test]
    fn a_timer_started_as_a_unit_is_recorded_with_its_unit() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        let args_file = f.state.path().join("systemd-run.args");
        let process_timer = armed_timer(&f.state);
        let timer = |token: &str, log: &Path| {
            let mut launch = process_timer(token, log);
            let mut fake = Command::new("sh");
            fake.args(["-c", "echo \"$@\" > \"$0\"", args_file.to_str().unwrap()])
                .args(["--unit=egress-fence-revert-x", "--collect"]);
            launch.unit = Some(("egress-fence-revert-x".into(), fake));
            // Only the unit may start: a process would say `armed` to no one.
            launch.process = Command::new("false");
            launch
        };
        let request = confirm_request(&timer, Duration::from_secs(60));
        let outcome = apply(&mut table, &f.writer(), planned(A), Some(request)).expect("applied");
        let armed = outcome.armed.expect("armed");
        assert_eq!(armed.timer_unit.as_deref(), Some("egress-fence-revert-x"));
        assert_eq!(f.state.pending().unwrap(), Some(armed));
        let args = std::fs::read_to_string(&args_file).expect("systemd-run ran");
        assert_eq!(args.trim(), "--unit=egress-fence-revert-x --collect");
    }

    #[test]
    fn when_systemd_run_fails_the_timer_starts_as_a_process() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        let process_timer = armed_timer(&f.state);
        let timer = |token: &str, log: &Path| {
            let mut launch = process_timer(token, log);
            launch.unit = Some(("egress-fence-revert-x".into(), Command::new("false")));
            launch
        };
        let request = confirm_request(&timer, Duration::from_secs(60));
        let outcome = apply(&mut table, &f.writer(), planned(A), Some(request)).expect("applied");
        assert_eq!(outcome.armed.expect("armed").timer_unit, None);
        let log = std::fs::read_to_string(f.state.revert_timer_log()).expect("the log");
        assert!(log.contains("systemd-run could not start unit"), "{log}");
    }

    #[test]
    fn a_timer_that_arms_without_a_record_fails_and_nothing_is_applied() {
        let f = fixture();
        let mut table = MemoryTable::new();
        apply(&mut table, &f.writer(), planned(B), None).expect("applied");
        let timer = |_: &str, _: &Path| {
            let mut process = Command::new("sh");
            process.args(["-c", "echo armed"]);
            TimerLaunch {
                unit: None,
                process,
            }
        };
        let request = confirm_request(&timer, Duration::from_secs(60));
        let err = apply(&mut table, &f.writer(), planned(A), Some(request)).expect_err("failed");
        assert!(err.to_string().contains("left no record"), "{err}");
        assert_eq!(table.table, Some(planned(B).ruleset));
        assert_eq!(f.state.pending().unwrap(), None);
    }

    #[test]
    fn a_blocking_table_is_suspected_only_when_names_failed_and_the_dns_sets_differ() {
        let mut p = planned(A);
        let mut same = MemoryTable::holding(p.ruleset.clone());
        // Every name resolved: the table is not even read.
        same.fail_reads = true;
        assert!(
            !may_have_blocked_resolution(&p, &mut same).unwrap(),
            "all resolved"
        );
        same.fail_reads = false;
        p.resolution = resolution(&[("a.example", &[])]);
        let blocked = |table: &mut MemoryTable| may_have_blocked_resolution(&p, table).unwrap();
        assert!(!blocked(&mut MemoryTable::new()), "no table of ours");
        assert!(!blocked(&mut same), "same DNS sets");
        // The live table lets other resolvers through than the plan's.
        let policy = Policy::parse(A, Path::new("p.yaml")).expect("valid");
        let mut elsewhere = resolution(&[]);
        elsewhere.resolvers = vec!["192.0.2.54".parse().unwrap()];
        assert!(blocked(&mut MemoryTable::holding(plan(
            &policy, &elsewhere
        ))));
    }
}
