//! egress-fence: a default-deny egress boundary for AI agent hosts, built on nftables.
//!
//! The data flows one way: [`policy`] (YAML, validated) -> [`resolve`] (DNS) -> [`plan`]
//! (a [`ruleset::Ruleset`] value) -> [`nft`] (one netlink batch to the kernel).
//!
//! Changes are made safe around that: [`diff`] compares a ruleset with the live table,
//! [`state`] keeps the applied generations, the writers' lock and the pending confirmation on
//! disk, and [`change`] puts them together for `apply`, `rollback`, `confirm` and the revert
//! timer.
//!
//! At the edges: [`daemon`] keeps the table current (`run`); in `dns.mode: guard` its
//! [`guard`] is the host's resolver, which allows exactly the addresses it answers. [`watch`]
//! shows what was refused and [`probe`] proves the boundary from inside.

// `unsafe` lives in one FFI module, src/nft/sys.rs, and nowhere else.
#![deny(unsafe_code)]

pub mod change;
pub mod conntrack;
pub mod daemon;
pub mod diff;
pub mod guard;
pub mod installable;
pub mod netns;
pub mod nft;
pub mod plan;
pub mod policy;
pub mod probe;
pub mod resolve;
pub mod ruleset;
pub mod sockdiag;
pub mod state;
pub mod watch;
