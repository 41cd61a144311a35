//! Netlink families other than nf_tables: socket diagnostics (who owns a socket) and conntrack
//! (which flows are alive).

pub mod conntrack;
pub mod sockdiag;
