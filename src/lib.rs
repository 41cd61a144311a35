//! egress-fence: a default-deny egress boundary for AI agent hosts, built on nftables.
//!
//! The layout follows the data. [`core`] is pure: a [`core::policy::Policy`] (YAML,
//! validated) and a [`core::resolution::Resolution`] become a [`core::ruleset::Ruleset`]
//! ([`core::plan`]), which [`core::diff`] compares with what the kernel holds.
//!
//! The edges do I/O: [`nft`] sends a ruleset to the kernel as one netlink batch and reads the
//! table back, [`dns`] asks resolvers, [`netlink`] speaks the other netlink families (socket
//! owners, conntrack), [`state`] keeps generations, the writers' lock and the pending
//! confirmation on disk, [`netns`] enters namespaces and [`watch`] hears refusals.
//!
//! The apps sit on top: [`change`] (apply, rollback, confirm, the revert timer), [`daemon`]
//! (`run`: keeps the table current), its [`guard`] (in `dns.mode: guard` the host's resolver,
//! which allows exactly the addresses it answers) and [`probe`] (proves the boundary from
//! inside).

// The pure core: policy, plan, ruleset, diff, answers.
pub mod core;

// Edges that do I/O: the kernel's tables over netlink, other netlink families, DNS, the
// state directory, network namespaces, the refusal log.
pub mod dns;
pub mod netlink;
pub mod netns;
pub mod nft;
pub mod state;
pub mod watch;

// Apps on top: changes (apply, rollback, confirm), the daemon, the DNS guard, the probe.
pub mod change;
pub mod daemon;
pub mod guard;
pub mod probe;
