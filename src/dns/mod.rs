//! DNS at the edge: asking the policy's resolvers for its names ([`resolve`]), and the one
//! codec every DNS exchange of the tool goes through: messages ([`message`]), TCP framing
//! ([`frame`]) and round trips over UDP and TCP ([`exchange`]).

pub mod exchange;
pub mod frame;
pub mod message;
pub mod resolve;
