//! DNS at the edge: asking the policy's resolvers for its names.

pub mod resolve;
