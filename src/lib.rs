//! egress-fence: a default-deny egress boundary for AI agent hosts, built on nftables.
//!
//! The data flows one way: [`policy`] (YAML, validated) -> [`resolve`] (DNS) -> [`plan`]
//! (a [`ruleset::Ruleset`] value) -> [`nft`] (one netlink batch to the kernel).

pub mod daemon;
pub mod diff;
pub mod netns;
pub mod nft;
pub mod plan;
pub mod policy;
pub mod probe;
pub mod resolve;
pub mod ruleset;
pub mod state;
pub mod watch;
