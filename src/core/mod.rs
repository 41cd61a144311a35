//! The pure core: values in, values out, no I/O. A [`policy::Policy`] and a
//! [`resolution::Resolution`] make a [`ruleset::Ruleset`] ([`plan`]); [`diff`] compares it with
//! what the kernel holds; [`installable`] decides which answered addresses may become elements
//! and [`lifetime`] how long each lives; [`replan`] checks that a recorded ruleset is what its
//! policy plans; [`explain`] says why a packet was refused; [`guard_identity`] is who the DNS guard is. [`trace`] is what a run saw; [`replay`] judges
//! a trace against a policy and [`learn`] writes the policy a trace needed. [`time`] and [`dns_name`] say how
//! times and names are shown.

pub mod diff;
pub mod dns_name;
pub mod explain;
pub mod guard_identity;
pub mod installable;
pub mod learn;
pub mod lifetime;
pub mod plan;
pub mod policy;
pub mod replan;
pub mod replay;
pub mod resolution;
pub mod ruleset;
pub mod time;
pub mod trace;
