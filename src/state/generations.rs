//! Generations: one record per applied table, numbered, checked on every read, pruned to the
//! newest few.

use std::fs;
use std::io::{self, Write};
use std::path::PathBuf;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::FORMAT;
use super::dir::StateDir;
use super::error::{StateError, io_error};
use super::files::read_regular;
use super::lock::WriterLock;
use crate::core::policy::Policy;
use crate::core::replan::check_replanned;
use crate::core::resolution::Resolution;
use crate::core::ruleset::Ruleset;
use crate::core::time::rfc3339;

/// How many generations are kept unless `--keep` says otherwise.
pub const DEFAULT_KEEP: usize = 10;

/// The command that recorded a generation (the `command` field of its file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recorder {
    /// `egress-fence apply`.
    Apply,
    /// `egress-fence rollback`: an earlier generation reinstated.
    Rollback,
    /// A revert timer: an unconfirmed change undone.
    Revert,
    /// `egress-fence run`, at start and on each reload (its resolved sets change all the time).
    Run,
}

impl Recorder {
    pub fn name(self) -> &'static str {
        match self {
            Recorder::Apply => "apply",
            Recorder::Rollback => "rollback",
            Recorder::Revert => "revert",
            Recorder::Run => "run",
        }
    }
}

/// What a generation is made of, before it has a number.
#[derive(Debug, Clone)]
pub struct NewGeneration {
    pub command: Recorder,
    /// For a rollback or revert: the generation it reinstated.
    pub source_generation: Option<u64>,
    pub policy_path: PathBuf,
    pub policy_text: String,
    pub resolution: Resolution,
    pub ruleset: Ruleset,
}

impl NewGeneration {
    /// `generation` reinstated by `command`: the same policy, resolution and ruleset.
    pub fn reinstating(generation: &Generation, command: Recorder) -> NewGeneration {
        NewGeneration {
            command,
            source_generation: Some(generation.generation),
            policy_path: generation.policy_path.clone(),
            policy_text: generation.policy_text.clone(),
            resolution: generation.resolution.clone(),
            ruleset: generation.ruleset.clone(),
        }
    }
}

/// One applied table, as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Generation {
    pub format: u32,
    pub generation: u64,
    /// RFC 3339, UTC.
    pub time: String,
    pub uid: u32,
    pub command: Recorder,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_generation: Option<u64>,
    pub policy_path: PathBuf,
    pub policy_text: String,
    pub resolution: Resolution,
    pub ruleset: Ruleset,
    /// The ruleset as nft text, for reading; it must be the rendering of `ruleset`.
    pub nft: String,
}

impl Generation {
    /// What the generation is, for lists: "apply", "rollback to 3", "revert to 6".
    pub fn describe(&self) -> String {
        match self.source_generation {
            Some(from) => format!("{} to {from}", self.command.name()),
            None => self.command.name().to_string(),
        }
    }

    /// Every rule of every chain (the guard's and the scope's too).
    pub fn rule_count(&self) -> usize {
        self.ruleset.rule_count()
    }

    /// The generation without its contents, for lists and JSON.
    pub fn summary(&self) -> GenerationSummary {
        GenerationSummary {
            generation: self.generation,
            time: self.time.clone(),
            uid: self.uid,
            command: self.command,
            source_generation: self.source_generation,
            policy_path: self.policy_path.clone(),
            rules: self.rule_count(),
            elements: self.ruleset.element_count(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GenerationSummary {
    pub generation: u64,
    pub time: String,
    pub uid: u32,
    pub command: Recorder,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_generation: Option<u64>,
    pub policy_path: PathBuf,
    pub rules: usize,
    pub elements: usize,
}

/// The file name of generation `n`.
pub fn generation_file_name(n: u64) -> String {
    format!("gen-{n:06}.json")
}

/// The generation number of a file name, if it names a generation.
pub fn parse_generation_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("gen-")?.strip_suffix(".json")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Reads a generation file's text, refusing anything that is not exactly what was written.
fn parse_generation(number: u64, text: String) -> Result<Generation, String> {
    let generation: Generation =
        serde_json::from_str(&text).map_err(|e| format!("it is not a generation record ({e})"))?;
    // The checks below render and plan the ruleset again: not on top of the file's text
    // (4 MB at 10,000 addresses).
    drop(text);
    if generation.format != FORMAT {
        return Err(format!(
            "it has format {}, this egress-fence reads format {FORMAT}",
            generation.format
        ));
    }
    if generation.generation != number {
        return Err(format!(
            "it says it is generation {}, its name says {number}",
            generation.generation
        ));
    }
    // The text is what a reviewer reads; the value is what a rollback installs. They must
    // agree, so an edit to either one is caught.
    if generation.nft != generation.ruleset.to_nft() {
        return Err("its nft text is not the rendering of its ruleset".to_string());
    }
    // The policy text is what `history` lists it under and what a reviewer approved; the
    // ruleset is what a rollback installs. Only a ruleset that its text plans (with the
    // recorded resolution) is trusted, so an open ruleset under a tight policy is refused.
    let policy = Policy::parse(&generation.policy_text, &generation.policy_path)
        .map_err(|e| format!("its policy text is not a valid policy ({e})"))?;
    check_replanned(&policy, &generation.resolution, &generation.ruleset).map_err(|e| {
        format!(
            "its ruleset is not what its policy text plans with its recorded resolution \
             (edited, or recorded by an egress-fence that planned otherwise): {e}"
        )
    })?;
    Ok(generation)
}

/// One entry of the generation list: the record, or why it cannot be used.
#[derive(Debug, Clone)]
pub struct GenerationEntry {
    pub number: u64,
    pub path: PathBuf,
    pub record: Result<Generation, String>,
}

impl GenerationEntry {
    fn into_result(self) -> Result<Generation, StateError> {
        self.record.map_err(|reason| StateError::Corrupt {
            number: self.number,
            path: self.path,
            reason,
        })
    }
}

/// The generations to delete so that the `keep` newest remain, plus `protect` (the
/// generation a pending confirmation reverts to) whatever its age.
pub fn generations_to_prune(numbers: &[u64], keep: usize, protect: Option<u64>) -> Vec<u64> {
    let mut sorted = numbers.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let cut = sorted.len().saturating_sub(keep.max(1));
    sorted[..cut]
        .iter()
        .copied()
        .filter(|n| Some(*n) != protect)
        .collect()
}

impl StateDir {
    /// Every generation file, oldest first, each read and checked.
    pub fn generations(&self) -> Result<Vec<GenerationEntry>, StateError> {
        let mut entries: Vec<GenerationEntry> = self
            .generation_numbers()?
            .into_iter()
            .map(|number| self.entry(number))
            .collect();
        entries.sort_by_key(|e| e.number);
        Ok(entries)
    }

    /// The numbers of the generation files, ascending (the files are not read).
    pub fn generation_numbers(&self) -> Result<Vec<u64>, StateError> {
        self.check()?;
        let listing = match fs::read_dir(&self.dir) {
            Ok(listing) => listing,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_error("list", &self.dir)(e)),
        };
        let mut numbers = Vec::new();
        for entry in listing {
            let entry = entry.map_err(io_error("list", &self.dir))?;
            if let Some(n) = entry
                .file_name()
                .to_str()
                .and_then(parse_generation_file_name)
            {
                numbers.push(n);
            }
        }
        numbers.sort_unstable();
        Ok(numbers)
    }

    fn entry(&self, number: u64) -> GenerationEntry {
        let path = self.file(&generation_file_name(number));
        let record = read_regular(&path)
            .map_err(|e| match e {
                StateError::Io { source, .. } => format!("cannot read it ({source})"),
                other => format!("cannot read it: {other}"),
            })
            .and_then(|text| parse_generation(number, text));
        GenerationEntry {
            number,
            path,
            record,
        }
    }

    /// Generation `number`, checked; a corrupt one is an error naming its file.
    pub fn load(&self, number: u64) -> Result<Generation, StateError> {
        let numbers = self.generation_numbers()?;
        if !numbers.contains(&number) {
            return Err(StateError::NoSuchGeneration {
                number,
                dir: self.dir.clone(),
                oldest_newest: numbers.first().zip(numbers.last()).map(|(a, b)| (*a, *b)),
            });
        }
        self.entry(number).into_result()
    }

    /// The newest generation, checked (`None` when there is none).
    pub fn newest(&self) -> Result<Option<Generation>, StateError> {
        match self.generation_numbers()?.last() {
            Some(&n) => self.entry(n).into_result().map(Some),
            None => Ok(None),
        }
    }

    /// The generation before the newest one: what a plain `rollback` reinstates.
    pub fn before_newest(&self) -> Result<Generation, StateError> {
        let numbers = self.generation_numbers()?;
        match numbers.as_slice() {
            [] => Err(StateError::NoGenerations {
                dir: self.dir.clone(),
            }),
            [only] => Err(StateError::NothingBefore {
                newest: *only,
                dir: self.dir.clone(),
            }),
            [.., previous, _] => self.entry(*previous).into_result(),
        }
    }

    /// The number the next generation gets. Stable while the lock is held. A number a
    /// pending confirmation names is taken even if its generation was never recorded (its
    /// writer died after applying): the revert must not reuse it.
    pub fn next_number(&self, _lock: &WriterLock) -> Result<u64, StateError> {
        let recorded = self.generation_numbers()?.last().copied();
        let reserved = self.pending().ok().flatten().map(|p| p.generation);
        match recorded.max(reserved) {
            None => Ok(1),
            // Never wraps: 0 would be handed out again and again, each record overwriting the last.
            Some(newest) => newest
                .checked_add(1)
                .ok_or_else(|| StateError::NumbersExhausted {
                    dir: self.dir.clone(),
                    newest,
                }),
        }
    }

    /// Records a generation under the next number, then keeps only the `keep` newest (and the
    /// one a pending confirmation reverts to) and removes temporary files crashed writers left.
    pub fn record(
        &self,
        lock: &WriterLock,
        new: NewGeneration,
        keep: usize,
    ) -> Result<Generation, StateError> {
        let number = self.next_number(lock)?;
        self.record_as(lock, number, new, keep)
    }

    /// Like [`StateDir::record`], under a number taken earlier with [`StateDir::next_number`]
    /// (the one a pending confirmation reserved for this very change).
    pub fn record_as(
        &self,
        lock: &WriterLock,
        number: u64,
        new: NewGeneration,
        keep: usize,
    ) -> Result<Generation, StateError> {
        self.create()?;
        self.remove_leftovers(lock)?;
        let now = SystemTime::now();
        let nft = new.ruleset.to_nft();
        let generation = Generation {
            format: FORMAT,
            generation: number,
            time: rfc3339(now),
            uid: nix::unistd::getuid().as_raw(),
            command: new.command,
            source_generation: new.source_generation,
            policy_path: new.policy_path,
            policy_text: new.policy_text,
            resolution: new.resolution,
            ruleset: new.ruleset,
            nft,
        };
        // Written as it is encoded: a generation of 10,000 addresses is 4 MB of JSON, which
        // the daemon would otherwise hold at once on top of the ruleset (benches/daemon.rs).
        self.write_atomically_with(&generation_file_name(number), true, |file| {
            let mut out = io::BufWriter::new(file);
            serde_json::to_writer_pretty(&mut out, &generation).map_err(io::Error::from)?;
            out.flush()
        })?;
        let protect = self
            .pending()
            .ok()
            .flatten()
            .filter(|p| p.reverted.is_none())
            .and_then(|p| p.revert_to);
        for old in generations_to_prune(&self.generation_numbers()?, keep, protect) {
            let path = self.file(&generation_file_name(old));
            fs::remove_file(&path).map_err(io_error("remove the old generation", &path))?;
        }
        Ok(generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::test_support::*;
    use crate::state::*;
    use std::os::unix::fs::MetadataExt;

    use crate::state::dir::{is_temporary_name, temporary_name};

    #[test]
    fn generation_file_names_round_trip_and_reject_lookalikes() {
        assert_eq!(generation_file_name(42), "gen-000042.json");
        assert_eq!(generation_file_name(1_234_567), "gen-1234567.json");
        assert_eq!(parse_generation_file_name("gen-000042.json"), Some(42));
        assert_eq!(
            parse_generation_file_name("gen-1234567.json"),
            Some(1_234_567)
        );
        for other in [
            "gen-.json",
            "gen-12a.json",
            "gen-000042.json.tmp",
            ".gen-000042.json.77.tmp",
            "gen-+1.json",
            "lock",
            "pending-confirm.json",
        ] {
            assert_eq!(parse_generation_file_name(other), None, "{other}");
        }
        assert!(is_temporary_name(&temporary_name("gen-000001.json")));
        assert!(parse_generation_file_name(&temporary_name("gen-000001.json")).is_none());
    }

    #[test]
    fn pruning_keeps_the_newest_and_the_revert_target() {
        assert_eq!(
            generations_to_prune(&[1, 2, 3], 10, None),
            Vec::<u64>::new()
        );
        assert_eq!(
            generations_to_prune(&[3, 1, 2, 5, 4], 2, None),
            vec![1, 2, 3]
        );
        assert_eq!(
            generations_to_prune(&[1, 2, 3, 4, 5], 2, Some(2)),
            vec![1, 3]
        );
        assert_eq!(
            generations_to_prune(&[1, 2], 0, None),
            vec![1],
            "at least one stays"
        );
    }

    #[test]
    fn records_round_trip_number_upwards_and_prune_to_keep() {
        let (_root, state) = temp_state();
        let lock = lock(&state);
        assert_eq!(state.next_number(&lock).unwrap(), 1);
        for _ in 0..4 {
            state
                .record(&lock, new_generation(Recorder::Apply), 3)
                .expect("record");
        }
        assert_eq!(state.generation_numbers().unwrap(), vec![2, 3, 4]);
        let newest = state.newest().unwrap().expect("a generation");
        assert_eq!(newest.generation, 4);
        assert_eq!(
            newest.ruleset,
            ruleset(),
            "the ruleset reads back as it was"
        );
        assert_eq!(newest.nft, ruleset().to_nft());
        assert!(newest.time.ends_with('Z'), "{}", newest.time);
        assert_eq!(state.before_newest().unwrap().generation, 3);
        assert!(matches!(
            state.load(1),
            Err(StateError::NoSuchGeneration {
                number: 1,
                oldest_newest: Some((2, 4)),
                ..
            })
        ));
        let mode = fs::metadata(state.path()).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700);
    }

    #[test]
    fn the_generation_a_pending_confirmation_reverts_to_is_never_pruned() {
        let (_root, state) = temp_state();
        let lock = lock(&state);
        state
            .record(&lock, new_generation(Recorder::Apply), 1)
            .unwrap();
        let pending = PendingConfirm::new(
            2,
            Some(1),
            &Now::read(),
            std::time::Duration::from_secs(60),
            7,
        );
        state.write_pending(&lock, &pending).unwrap();
        // Generation 2 is never recorded (its writer died): its number stays taken.
        assert_eq!(state.next_number(&lock).unwrap(), 3);
        state
            .record(&lock, new_generation(Recorder::Apply), 1)
            .unwrap();
        state
            .record(&lock, new_generation(Recorder::Apply), 1)
            .unwrap();
        assert_eq!(state.generation_numbers().unwrap(), vec![1, 4]);
        assert_eq!(state.pending().unwrap(), Some(pending));
        assert!(state.clear_pending(&lock).unwrap());
        assert!(!state.clear_pending(&lock).unwrap());
        assert_eq!(state.pending().unwrap(), None);
    }

    #[test]
    fn corrupt_generations_are_reported_and_never_used() {
        let (_root, state) = temp_state();
        let lock = lock(&state);
        for _ in 0..3 {
            state
                .record(&lock, new_generation(Recorder::Apply), 10)
                .unwrap();
        }
        let path = |n| state.path().join(generation_file_name(n));
        // Torn: half a file.
        let text = fs::read_to_string(path(2)).unwrap();
        fs::write(path(2), &text[..text.len() / 2]).unwrap();
        // Edited: the ruleset no longer matches its text.
        let edited = fs::read_to_string(path(3))
            .unwrap()
            .replace("\"203.0.113.0/28\"", "\"0.0.0.0/0\"");
        fs::write(path(3), edited).unwrap();
        // Renamed: a record under another number.
        fs::copy(path(1), path(4)).unwrap();

        let entries = state.generations().unwrap();
        let verdicts: Vec<(u64, bool)> = entries
            .iter()
            .map(|e| (e.number, e.record.is_ok()))
            .collect();
        assert_eq!(
            verdicts,
            vec![(1, true), (2, false), (3, false), (4, false)]
        );
        assert!(
            entries[1]
                .record
                .as_ref()
                .unwrap_err()
                .contains("not a generation record")
        );
        assert!(
            entries[2]
                .record
                .as_ref()
                .unwrap_err()
                .contains("not the rendering")
        );
        assert!(
            entries[3]
                .record
                .as_ref()
                .unwrap_err()
                .contains("says it is generation 1")
        );

        let err = state.load(3).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("generation 3") && msg.contains("gen-000003.json"),
            "{msg}"
        );
        assert!(matches!(
            state.newest(),
            Err(StateError::Corrupt { number: 4, .. })
        ));
        assert!(matches!(
            state.before_newest(),
            Err(StateError::Corrupt { number: 3, .. })
        ));
    }

    #[test]
    fn a_forged_generation_whose_ruleset_its_policy_does_not_plan_is_corrupt() {
        let (_root, state) = temp_state();
        let lock = lock(&state);
        state
            .record(&lock, new_generation(Recorder::Apply), 10)
            .unwrap();
        // The tight policy's text over an open ruleset, its nft text made to match, so that
        // everything but the re-planning agrees.
        let open = Policy::parse(
            "version: 1\nallow:\n  - cidr: 0.0.0.0/0\n  - cidr: ::/0\n",
            std::path::Path::new("open.yaml"),
        )
        .unwrap();
        let mut forged = state.load(1).unwrap();
        forged.generation = 2;
        forged.ruleset = crate::core::plan::plan(&open, &forged.resolution);
        forged.nft = forged.ruleset.to_nft();
        let path = state.path().join(generation_file_name(2));
        fs::write(&path, serde_json::to_vec_pretty(&forged).unwrap()).unwrap();

        let entries = state.generations().unwrap();
        assert!(entries[0].record.is_ok());
        let why = entries[1].record.as_ref().unwrap_err();
        assert!(
            why.contains("not what its policy text plans") && why.contains("allow4"),
            "{why}"
        );
        assert!(matches!(
            state.newest(),
            Err(StateError::Corrupt { number: 2, .. })
        ));

        // A policy text that no longer parses explains nothing either.
        let mut unparsable = state.load(1).unwrap();
        unparsable.generation = 3;
        unparsable.policy_text = "version: 99\n".into();
        fs::write(
            state.path().join(generation_file_name(3)),
            serde_json::to_vec_pretty(&unparsable).unwrap(),
        )
        .unwrap();
        let why = state.load(3).unwrap_err().to_string();
        assert!(why.contains("not a valid policy"), "{why}");
    }

    #[test]
    fn generation_numbers_never_wrap() {
        let (_root, state) = temp_state();
        let lock = lock(&state);
        fs::write(state.path().join(generation_file_name(u64::MAX)), "{}").unwrap();
        let err = state.next_number(&lock).unwrap_err();
        assert!(
            matches!(
                err,
                StateError::NumbersExhausted {
                    newest: u64::MAX,
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            state
                .record(&lock, new_generation(Recorder::Apply), 10)
                .is_err()
        );
        assert!(!state.path().join(generation_file_name(0)).exists());
    }
}
