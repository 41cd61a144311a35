//! The policy file: YAML schema, validation and the deny presets.
//!
//! Every check that concerns a single value lives in that value's `Deserialize` impl, so that
//! serde_yaml attaches the line and column of the offending value to the error. Checks that
//! relate two parts of the policy run afterwards and locate their subject in the source text.
//!
//! `schema` holds the validated policy the rest of the program reads; `names` and `values` the
//! single values a policy is written with; `raw` the file as written; `load` reads it (size,
//! nesting and document checks before the YAML parser, its errors placed at file:line:column);
//! `validate` turns the raw file into a policy; `errors` says where and why; `presets` the
//! named deny lists; `limits` what the kernel accepts; `warnings` what is allowed but
//! probably not meant.

mod errors;
mod limits;
mod load;
mod names;
mod presets;
mod raw;
mod schema;
mod validate;
mod values;
mod warnings;

pub use errors::PolicyError;
pub use limits::{UNCHECKED_KERNEL_LIMITS_ENV, kernel_accepts_limit};
pub use load::{MAX_POLICY_BYTES, MAX_POLICY_NESTING};
pub use names::{DomainName, Wildcard};
pub use presets::Preset;
pub use schema::*;
pub use values::{
    Interval, MAX_DOMAIN_PORT_RANGE, PortRange, ProbeHost, ProbeTarget, Rate, RateUnit,
};

#[cfg(test)]
mod test_support;
