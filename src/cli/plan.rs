//! `plan`: resolve the policy's names and print the ruleset `apply` would install.

use std::path::Path;

use egress_fence::core::plan::plan;
use egress_fence::dns::resolve::resolve_policy;

use super::args::{NamespaceArg, Resolving};
use super::common::enter;
use super::exit::{Failure, resolution_code};
use super::load::load;
use super::output::{describe_host, join_display, report_resolution};

pub fn run(
    path: &Path,
    target: &NamespaceArg,
    resolving: &Resolving,
    json: bool,
) -> Result<u8, Failure> {
    let resolv_conf = enter(target, Some(resolving))?;
    let policy = load(path)?;
    let resolution = resolve_policy(&policy, &resolv_conf)?;
    report_resolution(&policy, &resolution);
    let ruleset = plan(&policy, &resolution);
    if json {
        let out = serde_json::json!({ "resolution": resolution, "ruleset": ruleset });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("# egress-fence plan for {}", path.display());
        if let (Some(g), Some(uid)) = (&policy.dns.guard, resolution.guard_uid) {
            println!(
                "# DNS guard mode: names are allowed as `egress-fence run` answers them \
                 on {}; only sockets of uid {uid} (the uid `run` keeps) marked {:#x} \
                 (the guard's SO_MARK) may ask {}",
                join_display(&g.listen),
                g.mark,
                join_display(&g.upstream)
            );
        }
        for host in &resolution.hosts {
            println!("# {}", describe_host(host));
        }
        print!("{}", ruleset.to_nft());
    }
    Ok(resolution_code(&resolution))
}
