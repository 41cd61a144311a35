//! The escape suite: every way out that a review found, tried from inside a fenced sandbox as
//! the adversary of the threat model (an unprivileged user, or root without CAP_NET_ADMIN)
//! and with hostile input. Each test failed on the main that the review attacked and must
//! keep passing. One module per kind of attack; all of them use the worlds of
//! `tests/common` (throwaway namespaces, removed even when a test fails).

mod answers;
#[path = "../common/mod.rs"]
mod common;
mod daemon;
mod dns_names;
mod essentials;
mod exec_attack;
mod foreign_source;
mod forged;
mod guard;
mod hostcfg;
mod inherited;
mod inputs;
mod learn;
mod learn_attack;
mod metrics_attack;
mod operator_attack;
mod path_trust_attack;
mod policy_attack;
mod policy_file;
mod probe_protocols;
mod raw_frames;
mod readback;
mod readback_attack;
mod repair;
mod reset;
mod revert_attack;
mod review_f_attack;
mod round2;
mod round3;
mod scope;
mod scope_attack;
mod tun_inject;
