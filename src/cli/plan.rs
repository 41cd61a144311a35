//! `plan`: resolve the policy's names and print the ruleset `apply` would install.

use std::path::Path;

use egress_fence::core::plan::plan;
use egress_fence::core::policy::Policy;
use egress_fence::core::resolution::HostScope;
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
        for line in describe_scope(&policy, &resolution.scope) {
            println!("# {line}");
        }
        for host in &resolution.hosts {
            println!("# {}", describe_host(host));
        }
        print!("{}", ruleset.to_nft());
    }
    Ok(resolution_code(&resolution))
}

/// Who a scoped policy fences, as this host has it: the uids (with their names) and gids,
/// the listed cgroups found (with their ids) or missing, the forwarded interfaces, and where
/// the guard listens on them. Nothing without a `scope:`.
fn describe_scope(policy: &Policy, host: &HostScope) -> Vec<String> {
    let Some(scope) = &policy.scope else {
        return Vec::new();
    };
    let mut out =
        vec!["scope: only these are fenced; the namespace's other processes are not".to_string()];
    let name_of = |uid: u32| {
        nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
            .ok()
            .flatten()
            .map_or(format!("uid {uid}"), |u| format!("{} (uid {uid})", u.name))
    };
    let uids = scope.uids();
    if !uids.is_empty() {
        let named: Vec<String> = uids.into_iter().map(name_of).collect();
        let members = match scope.groups.is_empty() {
            true => "",
            false => " (listed, and members of the listed groups)",
        };
        out.push(format!("  sockets of users: {}{members}", named.join(", ")));
    }
    if !scope.groups.is_empty() {
        out.push(format!(
            "  sockets of groups: {}",
            join_display(&scope.groups)
        ));
    }
    for path in &scope.cgroups {
        match host.cgroups.iter().find(|c| c.is_of(path)) {
            Some(c) => out.push(format!(
                "  cgroup {path}: id {}, level {} (and every cgroup below it)",
                c.id, c.level
            )),
            None => out.push(format!(
                "  cgroup {path}: NOT ON THIS HOST, no rule; `run` fences it once it appears"
            )),
        }
    }
    if !scope.cgroups.is_empty() {
        out.push(
            "  cgroups are matched by id: one removed and made again is fenced again by `run` \
             (which follows them) or by applying anew"
                .to_string(),
        );
    }
    if !scope.forward.is_empty() {
        out.push(format!(
            "  forwarded from interfaces: {} (matched by name, whenever they exist)",
            join_display(&scope.forward)
        ));
        if policy.dns.guard.is_some() {
            out.push(match host.bridge_listen.is_empty() {
                true => "  the guard listens on none of them: none has an address yet (`run` \
                         listens on those it finds when it starts)"
                    .to_string(),
                false => format!(
                    "  the guard also listens on them at {}",
                    join_display(&host.bridge_listen)
                ),
            });
        }
    }
    out
}
