//! What the apps (`change`, the daemon) need from the kernel's table, as one interface: the
//! netlink backend ([`super::Nft`]) implements it, and so does an in-memory double for unit
//! tests (`memory::MemoryTable`), which can be told to refuse or to lose its table.
//!
//! It lives with the backend, not in `core`: its values are the core's (a [`Ruleset`],
//! resolved [`Timed`] elements), but what it reads back ([`LiveTable`]) and how it fails
//! ([`NftError`]) are the kernel edge's.

use crate::core::ruleset::{Ruleset, Timed};

use super::{LiveTable, NftError};

/// The tool's table in one network namespace.
pub trait Table {
    /// Replaces the table with `ruleset` in one transaction.
    fn apply(&mut self, ruleset: &Ruleset) -> Result<(), NftError>;
    /// Adds or renews resolved elements (a refresh) in one transaction.
    fn upsert_resolved(&mut self, elements: &[Timed]) -> Result<(), NftError>;
    /// Deletes the table; `false` if there was none.
    fn teardown(&mut self) -> Result<bool, NftError>;
    fn table_exists(&mut self) -> Result<bool, NftError>;
    /// Reads the table back; `None` if it is not installed.
    fn read_table(&mut self) -> Result<Option<LiveTable>, NftError>;
    /// The ruleset's generation: it counts every committed transaction, anyone's.
    fn generation(&mut self) -> Result<u32, NftError>;
    /// Keeps `learn`'s audit window open `open_for_ms` more from now (one transaction).
    fn renew_audit_window(&mut self, open_for_ms: u64) -> Result<(), NftError>;
}

impl Table for super::Nft {
    fn apply(&mut self, ruleset: &Ruleset) -> Result<(), NftError> {
        super::Nft::apply(self, ruleset)
    }
    fn upsert_resolved(&mut self, elements: &[Timed]) -> Result<(), NftError> {
        super::Nft::upsert_resolved(self, elements)
    }
    fn teardown(&mut self) -> Result<bool, NftError> {
        super::Nft::teardown(self)
    }
    fn table_exists(&mut self) -> Result<bool, NftError> {
        super::Nft::table_exists(self)
    }
    fn read_table(&mut self) -> Result<Option<LiveTable>, NftError> {
        super::Nft::read_table(self)
    }
    fn generation(&mut self) -> Result<u32, NftError> {
        super::Nft::generation(self)
    }
    fn renew_audit_window(&mut self, open_for_ms: u64) -> Result<(), NftError> {
        self.send(&super::encode::renew_audit_window(open_for_ms))
    }
}

#[cfg(test)]
pub mod memory {
    //! A table in memory: it keeps the last ruleset applied (with the elements upserted
    //! since), counts transactions as the kernel's generation does, and refuses when told.

    use std::collections::BTreeMap;

    use nix::errno::Errno;

    use super::Table;
    use crate::core::diff::wanted_chain;
    use crate::core::ruleset::{Elements, Family, Ruleset, SetId, SetRole, TABLE, Timed};
    use crate::nft::encode::{dumped_rule, key_spec, set_elements, set_flags};
    use crate::nft::live::LiveRule;
    use crate::nft::sys::{LiveChain, LiveElem, LiveSet, SetParams};
    use crate::nft::{LiveTable, NftError};

    #[derive(Debug, Default)]
    pub struct MemoryTable {
        /// The table as the kernel holds it.
        pub table: Option<Ruleset>,
        /// The ruleset generation: one more per committed transaction.
        pub generation: u32,
        /// Every ruleset applied, in order.
        pub applied: Vec<Ruleset>,
        /// Every batch of elements upserted, in order.
        pub upserted: Vec<Vec<Timed>>,
        /// Refuse every apply (a table the kernel does not take).
        pub refuse_apply: bool,
        /// Refuse every upsert (a set removed under us).
        pub refuse_upsert: bool,
        /// Fail every read (a socket that broke).
        pub fail_reads: bool,
    }

    fn refused(what: &str) -> NftError {
        NftError::Refused {
            what: what.into(),
            errno: Errno::EINVAL,
        }
    }

    impl MemoryTable {
        pub fn new() -> MemoryTable {
            MemoryTable::default()
        }

        /// Holding `ruleset` already (a table someone put up before).
        pub fn holding(ruleset: Ruleset) -> MemoryTable {
            MemoryTable {
                table: Some(ruleset),
                generation: 1,
                ..MemoryTable::default()
            }
        }

        /// Someone else deletes the table (`nft flush ruleset`).
        pub fn lose_table(&mut self) {
            self.table = None;
            self.generation += 1;
        }

        /// The resolved elements the table holds now, both families.
        pub fn resolved(&self) -> Vec<Timed> {
            let Some(table) = &self.table else {
                return Vec::new();
            };
            Family::BOTH
                .into_iter()
                .filter_map(|f| table.set(SetId::new(SetRole::Resolved, f)))
                .flat_map(|s| match &s.elements {
                    Elements::Timed(t) => t.clone(),
                    _ => Vec::new(),
                })
                .collect()
        }
    }

    impl Table for MemoryTable {
        fn apply(&mut self, ruleset: &Ruleset) -> Result<(), NftError> {
            if self.refuse_apply {
                return Err(refused("the table"));
            }
            self.table = Some(ruleset.clone());
            self.applied.push(ruleset.clone());
            self.generation += 1;
            Ok(())
        }

        fn upsert_resolved(&mut self, elements: &[Timed]) -> Result<(), NftError> {
            if elements.is_empty() {
                return Ok(());
            }
            let table = match (&mut self.table, self.refuse_upsert) {
                (Some(table), false) => table,
                _ => return Err(refused("the resolved elements")),
            };
            for set in &mut table.sets {
                let Elements::Timed(held) = &mut set.elements else {
                    continue;
                };
                let mut merged: BTreeMap<_, Timed> = held.drain(..).map(|t| (t.tuple, t)).collect();
                for e in elements
                    .iter()
                    .filter(|e| Family::of_net(&e.tuple.net) == set.id.family)
                {
                    // The kernel keeps the comment of an element it already holds.
                    let name = merged.get(&e.tuple).and_then(|t| t.name.clone());
                    let mut e = e.clone();
                    if name.is_some() {
                        e.name = name;
                    }
                    merged.insert(e.tuple, e);
                }
                held.extend(merged.into_values());
            }
            self.upserted.push(elements.to_vec());
            self.generation += 1;
            Ok(())
        }

        fn teardown(&mut self) -> Result<bool, NftError> {
            let existed = self.table.take().is_some();
            self.generation += 1;
            Ok(existed)
        }

        fn table_exists(&mut self) -> Result<bool, NftError> {
            if self.fail_reads {
                return Err(NftError::Timeout("the table"));
            }
            Ok(self.table.is_some())
        }

        fn read_table(&mut self) -> Result<Option<LiveTable>, NftError> {
            if self.fail_reads {
                return Err(NftError::Timeout("the table"));
            }
            Ok(self.table.as_ref().map(live_of))
        }

        fn generation(&mut self) -> Result<u32, NftError> {
            Ok(self.generation)
        }
        fn renew_audit_window(&mut self, open_for_ms: u64) -> Result<(), NftError> {
            match self.table.as_mut().and_then(|t| t.audit.as_mut()) {
                Some(window) => {
                    window.open_for_ms = Some(open_for_ms);
                    self.generation += 1;
                    Ok(())
                }
                None => Err(refused("elements of set audit_window")),
            }
        }
    }

    /// The table as the kernel reports `rs` after an apply: the same encoding, read back
    /// through the same parser and decoder (elements' expiry equal to their timeout, counters
    /// at zero).
    pub fn live_of(rs: &Ruleset) -> LiveTable {
        let specs = rs.chains();
        let chains = specs
            .iter()
            .map(|spec| {
                let want = wanted_chain(spec.base);
                LiveChain {
                    table: TABLE.into(),
                    name: spec.name.into(),
                    kind: want.kind,
                    flags: want.flags,
                    hook: want.hook,
                }
            })
            .collect();
        let mut rules = Vec::new();
        for spec in &specs {
            for rule in spec.rules {
                let mut dumped = dumped_rule(rule).expect("every rule the planner writes encodes");
                dumped.chain = spec.name.into();
                rules.push(LiveRule::decode(dumped));
            }
        }
        let sets = rs
            .sets
            .iter()
            .map(|s| {
                let key = key_spec(s.id);
                let live_set = LiveSet {
                    table: TABLE.into(),
                    name: s.id.name(),
                    flags: set_flags(s.id),
                    key_type: key.datatype,
                    key_len: key.len,
                    key_fields: key.concat_fields.clone(),
                    params: SetParams::default(),
                };
                let elems = set_elements(s.id, &s.elements)
                    .map(|e| LiveElem {
                        key: e.key,
                        key_end: e.key_end,
                        flags: e.flags,
                        timeout_ms: e.timeout_ms,
                        expires_ms: e.timeout_ms,
                        userdata: e.userdata,
                        unread: Vec::new(),
                    })
                    .collect();
                (live_set, elems)
            })
            .collect();
        LiveTable {
            flags: 0,
            chains,
            rules,
            sets,
            objects: Vec::new(),
        }
    }

    #[cfg(test)]
    mod tests {
        use std::path::Path;

        use super::*;
        use crate::core::diff::{CompareOptions, compare};
        use crate::core::plan::{plan, tests::resolution};
        use crate::core::policy::Policy;

        #[test]
        fn what_it_reads_back_is_what_was_applied() {
            let p = Policy::parse(
                "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\n  - cidr: 203.0.113.0/28\n    ports: [22]\ndeny:\n  - preset: cloud-metadata\ndns:\n  resolvers: [192.0.2.53]\n",
                Path::new("p.yaml"),
            )
            .expect("valid");
            let rs = plan(&p, &resolution(&[("a.example", &["192.0.2.10"])]));
            let mut t = MemoryTable::new();
            assert_eq!(t.read_table().unwrap().map(|_| ()), None);
            t.apply(&rs).unwrap();
            let live = t.read_table().unwrap();
            let diff = compare(&rs, live.as_ref(), CompareOptions::default());
            assert!(diff.is_empty(), "{diff}");
            assert_eq!(t.generation().unwrap(), 1);
            t.lose_table();
            assert!(!t.table_exists().unwrap());
        }
    }
}
