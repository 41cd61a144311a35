//! egress-fence: a default-deny egress boundary for AI agent hosts, built on nftables.
//!
//! The layout follows the data. [`core`] is pure: a [`core::policy::Policy`] (YAML,
//! validated) and a [`core::resolution::Resolution`] become a [`core::ruleset::Ruleset`]
//! ([`core::plan`]), which [`core::diff`] compares with what the kernel holds; element
//! lifetimes come from one ledger, [`core::lifetime`].
//!
//! The edges do I/O: [`nft`] sends a ruleset to the kernel as one netlink batch and reads the
//! table back into the same rule types ([`nft::Table`] is what the apps see of it),
//! [`netlink`] is the one netlink codec (also NFLOG, conntrack, socket owners), [`dns`] asks
//! resolvers, [`state`] keeps generations, the writers' lock and the pending confirmation on
//! disk, [`netns`] enters namespaces and [`watch`] hears refusals.
//!
//! The apps sit on top: [`change`] (apply, rollback, confirm, the revert timer), [`daemon`]
//! (`run`: a pure core deciding, a thin shell doing), its [`guard`] (in `dns.mode: guard` the
//! host's resolver, which allows exactly the addresses it answers) and [`probe`] (proves the
//! boundary from inside). The command line (src/cli/) is the binary's: it parses, calls these
//! and prints.

// The pure core: policy, plan, ruleset, diff, answers.
pub mod core;

// Edges that do I/O: the kernel's table, the netlink codec, DNS, this host's addresses, the
// state directory, network namespaces, the refusal log.
pub mod dns;
pub mod host;
pub mod netlink;
pub mod netns;
pub mod nft;
pub mod path_trust;
pub mod state;
pub mod trace_file;
pub mod watch;

// Apps on top: changes (apply, rollback, confirm), the daemon, the DNS guard, the probe.
pub mod change;
pub mod daemon;
pub mod exec;
pub mod guard;
pub mod probe;
