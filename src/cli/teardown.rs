//! `teardown`: delete the tool's table (and nothing else).

use egress_fence::core::ruleset::TABLE;
use egress_fence::nft::Nft;

use super::args::NamespaceArg;
use super::common::enter;
use super::exit::Failure;

pub fn run(target: &NamespaceArg) -> Result<u8, Failure> {
    enter(target, None)?;
    if Nft::open()?.teardown()? {
        println!("deleted table inet {TABLE}");
    } else {
        println!("table inet {TABLE} was not installed; nothing to do");
    }
    Ok(0)
}
