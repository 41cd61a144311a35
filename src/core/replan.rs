//! Whether a recorded ruleset is the one its recorded policy text plans with its recorded
//! resolution: what a generation must pass before `history` lists it under its policy,
//! `rollback` installs it or `status` compares the kernel with it.
//!
//! What is compared, and why:
//!
//! - The chains' rules and every set but the two resolved ones: exactly. They follow from the
//!   policy and the resolution alone (the resolvers, the guard's uid), whoever recorded them.
//! - The resolved sets, element by element. An element without a timeout (what `apply`
//!   records) must be exactly the planned one, name included. An element with a timeout is
//!   what `run` records: the time it had left when it was recorded, which nothing can
//!   recompute, and the elements a restart carried over from the table it found, which its
//!   resolution does not list. Such an element is accepted when the policy explains it as it
//!   explains a live element the service keeps ([`unexplained_element`]: an installable
//!   address of one host, on a port and protocol its name is allowed, for a name the policy
//!   allows, and a timeout no longer than the policy lets an answer live), and when it
//!   carries no expiry (only a kernel's read-back has one). Every planned element must be
//!   there, with or without a timeout.
//!
//! So a generation proves no more than what its policy text and resolution say: a forged
//! resolution opens nothing a forged answer for an allowed name could not. A generation an
//! older egress-fence recorded, whose planner wrote other rules, does not pass either: its
//! ruleset is no longer what its text means, and nothing installs what cannot be explained.

use std::collections::BTreeMap;

use crate::core::plan::{plan, unexplained_element};
use crate::core::policy::Policy;
use crate::core::resolution::Resolution;
use crate::core::ruleset::{
    ChainPolicy, ChainSpec, Elements, Rule, Ruleset, SetRole, Timed, Tuple, fmt_timed, fmt_tuple,
};

/// How a recorded ruleset differs from the one its policy plans with its resolution (the
/// first difference found).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotPlanned {
    #[error("its chain {chain} is not what its policy plans ({detail})")]
    Chain { chain: &'static str, detail: String },
    #[error("its sets are not the ones its policy plans (it has {found}, the plan {planned})")]
    Sets { found: String, planned: String },
    #[error("its set {set} is not what its policy plans ({detail})")]
    Set { set: String, detail: String },
    #[error("its resolution asked {resolver}, which is not one of the resolvers its policy names")]
    Resolver { resolver: std::net::IpAddr },
}

/// Checks that `recorded` is what `policy` plans with `resolution` (see the module's text for
/// how the service's timed elements are compared).
pub fn check_replanned(
    policy: &Policy,
    resolution: &Resolution,
    recorded: &Ruleset,
) -> Result<(), NotPlanned> {
    let named = match (&policy.dns.guard, &policy.dns.resolvers) {
        (Some(guard), _) => Some(&guard.upstream),
        (None, named) => named.as_ref(),
    };
    if let Some(named) = named
        && let Some(&resolver) = resolution.resolvers.iter().find(|r| !named.contains(r))
    {
        return Err(NotPlanned::Resolver { resolver });
    }
    let planned = plan(policy, resolution);
    compare_chains(recorded, &planned)?;

    let ids = |r: &Ruleset| r.sets.iter().map(|s| s.id.name()).collect::<Vec<_>>();
    if ids(recorded) != ids(&planned) {
        return Err(NotPlanned::Sets {
            found: ids(recorded).join(", "),
            planned: ids(&planned).join(", "),
        });
    }
    for (found, wanted) in recorded.sets.iter().zip(&planned.sets) {
        let detail = match (&found.elements, &wanted.elements) {
            (Elements::Timed(timed), Elements::Timed(planned))
                if found.id.role == SetRole::Resolved =>
            {
                compare_resolved(policy, timed, planned)
            }
            (elements, planned) if elements == planned => None,
            (elements, planned) => Some(first_difference(&elements.to_nft(), &planned.to_nft())),
        };
        if let Some(detail) = detail {
            return Err(NotPlanned::Set {
                set: found.id.name(),
                detail,
            });
        }
    }
    Ok(())
}

/// Every chain of either ruleset: the same chains, each on the same hook with the same
/// policy (a scoped table whose `output` is on the hook again fences everyone), with the same
/// rules.
fn compare_chains(recorded: &Ruleset, planned: &Ruleset) -> Result<(), NotPlanned> {
    let (found, wanted) = (recorded.chains(), planned.chains());
    let names = wanted.iter().map(|c| c.name).chain(
        found
            .iter()
            .map(|c| c.name)
            .filter(|n| planned.chain(n).is_none()),
    );
    for chain in names {
        let (found, wanted) = (recorded.chain(chain), planned.chain(chain));
        let base = |c: &Option<ChainSpec>| c.as_ref().and_then(|c| c.base);
        if base(&found) != base(&wanted) {
            let describe = |c: &Option<ChainSpec>| match (c, base(c)) {
                (None, _) => "no such chain".to_string(),
                (Some(_), None) => "a regular chain".to_string(),
                (Some(_), Some(b)) => format!(
                    "on the {} hook, policy {}",
                    b.hook.name(),
                    match b.policy {
                        ChainPolicy::Accept => "accept",
                        ChainPolicy::Drop => "drop",
                    }
                ),
            };
            return Err(NotPlanned::Chain {
                chain,
                detail: format!("it is {}, the plan {}", describe(&found), describe(&wanted)),
            });
        }
        let rules = |c: Option<ChainSpec>| c.map(|c| c.rules.to_vec()).unwrap_or_default();
        compare_rules(chain, &rules(found), &rules(wanted))?;
    }
    Ok(())
}

fn compare_rules(chain: &'static str, found: &[Rule], wanted: &[Rule]) -> Result<(), NotPlanned> {
    if found == wanted {
        return Ok(());
    }
    let text = |rules: &[Rule]| rules.iter().map(Rule::to_string).collect::<Vec<_>>();
    Err(NotPlanned::Chain {
        chain,
        detail: first_difference(&text(found), &text(wanted)),
    })
}

/// The first line one list has and the other lacks, for messages.
fn first_difference(found: &[String], wanted: &[String]) -> String {
    if let Some(extra) = found.iter().find(|f| !wanted.contains(f)) {
        return format!("it has `{extra}`, which is not planned");
    }
    if let Some(missing) = wanted.iter().find(|w| !found.contains(w)) {
        return format!("it lacks the planned `{missing}`");
    }
    "the same lines in another order or number".into()
}

/// Why the recorded elements of a resolved set are not the planned ones, or `None`.
fn compare_resolved(policy: &Policy, found: &[Timed], wanted: &[Timed]) -> Option<String> {
    let planned: BTreeMap<&Tuple, &Timed> = wanted.iter().map(|t| (&t.tuple, t)).collect();
    let mut seen: BTreeMap<&Tuple, ()> = BTreeMap::new();
    for element in found {
        if seen.insert(&element.tuple, ()).is_some() {
            return Some(format!("it holds `{}` twice", fmt_tuple(&element.tuple)));
        }
        if let Some(why) = unexplained_timed(policy, element, planned.get(&element.tuple)) {
            return Some(format!("`{}`: {why}", fmt_timed(element)));
        }
    }
    wanted
        .iter()
        .find(|w| !seen.contains_key(&w.tuple))
        .map(|w| format!("it lacks the planned `{}`", fmt_timed(w)))
}

/// Why a recorded resolved element is neither the planned one nor a timed element the
/// policy explains, or `None`.
fn unexplained_timed(policy: &Policy, element: &Timed, planned: Option<&&Timed>) -> Option<String> {
    if element.expires_ms.is_some() {
        return Some("it carries an expiry, which only a kernel's read-back has".into());
    }
    if element.timeout_ms.is_none() {
        return match planned {
            Some(p) if *p == element => None,
            Some(_) => Some("it differs from the planned element".into()),
            None => Some("it is not planned and has no timeout".into()),
        };
    }
    if element.tuple.net.prefix_len() != element.tuple.net.max_prefix_len() {
        return Some("it is a network, not the address of one host".into());
    }
    unexplained_element(policy, element, true)
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use super::*;
    use crate::core::plan::tests::resolution;
    use crate::core::plan::{lifetime_cap, plan_with, resolved_tuple};
    use crate::core::policy::L4Proto;
    use crate::core::ruleset::{Family, SetId};

    const TIGHT: &str = "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\n\
                         dns:\n  resolvers: [192.0.2.53, \"2001:db8::53\"]\nlog:\n  group: 100\n";

    fn policy(text: &str) -> Policy {
        Policy::parse(text, Path::new("/etc/egress-fence/policy.yaml")).expect("valid")
    }

    fn resolved() -> Resolution {
        resolution(&[("a.example", &["192.0.2.10", "2001:db8::10"])])
    }

    fn resolved4(rs: &mut Ruleset) -> &mut Vec<Timed> {
        let id = SetId::new(SetRole::Resolved, Family::V4);
        match rs
            .sets
            .iter_mut()
            .find(|s| s.id == id)
            .map(|s| &mut s.elements)
        {
            Some(Elements::Timed(t)) => t,
            _ => panic!("no resolved4 set"),
        }
    }

    /// What `run` records: every element with the time it had left (here: 100 s).
    fn as_run_records(policy: &Policy, resolution: &Resolution) -> Ruleset {
        plan_with(policy, resolution, |_, _| Some(Duration::from_secs(100)))
    }

    fn timed(addr: &str, port: u16, timeout_ms: u64, name: &str) -> Timed {
        Timed {
            tuple: resolved_tuple(addr.parse().unwrap(), (L4Proto::Tcp, port)),
            timeout_ms: Some(timeout_ms),
            expires_ms: None,
            name: Some(name.into()),
        }
    }

    #[test]
    fn what_apply_records_passes() {
        let (p, r) = (policy(TIGHT), resolved());
        assert_eq!(check_replanned(&p, &r, &plan(&p, &r)), Ok(()));
        // Guard mode: the guard's uid is part of the resolution and of the rules.
        let guarded = policy(
            "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\n\
             dns:\n  mode: guard\n  upstream: [192.0.2.53]\n",
        );
        // What apply records in guard mode: the upstream resolvers, this process's uid.
        let mut with_uid = resolution(&[]);
        with_uid.resolvers = vec!["192.0.2.53".parse().unwrap()];
        with_uid.guard_uid = Some(993);
        let rs = plan(&guarded, &with_uid);
        assert_eq!(check_replanned(&guarded, &with_uid, &rs), Ok(()));
        // An upstream resolver its policy does not name.
        let mut wider = with_uid.clone();
        wider.resolvers.push("198.51.100.53".parse().unwrap());
        assert!(matches!(
            check_replanned(&guarded, &wider, &plan(&guarded, &wider)),
            Err(NotPlanned::Resolver { .. })
        ));
        let mut other_uid = with_uid.clone();
        other_uid.guard_uid = Some(0);
        assert!(matches!(
            check_replanned(&guarded, &other_uid, &rs),
            Err(NotPlanned::Chain {
                chain: "output",
                ..
            })
        ));
    }

    #[test]
    fn an_open_ruleset_under_a_tight_policy_is_refused() {
        let open = policy(
            "version: 1\nallow:\n  - cidr: 0.0.0.0/0\n  - cidr: ::/0\n\
             dns:\n  resolvers: [192.0.2.53, \"2001:db8::53\"]\nlog:\n  group: 100\n",
        );
        let (tight, r) = (policy(TIGHT), resolved());
        let err = check_replanned(&tight, &r, &plan(&open, &r)).unwrap_err();
        assert!(
            matches!(&err, NotPlanned::Set { set, .. } if set == "allow4"),
            "{err}"
        );
        assert!(err.to_string().contains("0.0.0.0/0"), "{err}");
    }

    #[test]
    fn a_rule_or_a_resolver_the_plan_lacks_is_refused() {
        let (p, r) = (policy(TIGHT), resolved());
        let mut fewer = plan(&p, &r);
        fewer.output.remove(0);
        let err = check_replanned(&p, &r, &fewer).unwrap_err();
        assert!(err.to_string().contains("lacks the planned"), "{err}");

        let mut other_resolvers = r.clone();
        other_resolvers
            .resolvers
            .push("198.51.100.53".parse().unwrap());
        let err = check_replanned(&p, &r, &plan(&p, &other_resolvers)).unwrap_err();
        assert!(
            matches!(&err, NotPlanned::Set { set, .. } if set == "dns4"),
            "{err}"
        );
        // The resolution forged along with the ruleset: a resolver the policy does not name.
        let err = check_replanned(&p, &other_resolvers, &plan(&p, &other_resolvers)).unwrap_err();
        assert_eq!(
            err,
            NotPlanned::Resolver {
                resolver: "198.51.100.53".parse().unwrap()
            }
        );
        // Fewer than it names (none found yet): narrower, accepted.
        let mut none = r.clone();
        none.resolvers.clear();
        assert_eq!(check_replanned(&p, &none, &plan(&p, &none)), Ok(()));
        // A policy that names none: resolv.conf's, taken as recorded.
        let system = policy(
            "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\nlog:\n  group: 100\n",
        );
        assert_eq!(
            check_replanned(&system, &other_resolvers, &plan(&system, &other_resolvers)),
            Ok(())
        );

        let mut no_sets = plan(&p, &r);
        no_sets.sets.pop();
        assert!(matches!(
            check_replanned(&p, &r, &no_sets),
            Err(NotPlanned::Sets { .. })
        ));
    }

    #[test]
    fn a_scoped_ruleset_is_checked_chain_by_chain() {
        let (p, r) = crate::core::diff::tests::scoped();
        let planned = plan(&p, &r);
        assert_eq!(check_replanned(&p, &r, &planned), Ok(()));

        // A uid more in scope_output: more is fenced, but it is not what the policy says.
        let mut more = planned.clone();
        let scope = more.scope.as_mut().unwrap();
        scope
            .output
            .push(Rule::Fence(crate::core::ruleset::ScopeMatch::Uid(4)));
        let err = check_replanned(&p, &r, &more).unwrap_err();
        assert!(
            matches!(
                &err,
                NotPlanned::Chain {
                    chain: "scope_output",
                    ..
                }
            ),
            "{err}"
        );
        // A bridge less.
        let mut fewer = planned.clone();
        fewer.scope.as_mut().unwrap().forward.pop();
        let err = check_replanned(&p, &r, &fewer).unwrap_err();
        assert!(
            matches!(
                &err,
                NotPlanned::Chain {
                    chain: "scope_forward",
                    ..
                }
            ),
            "{err}"
        );
        // A chain of the plan the recorded table lacks.
        let mut no_bridge = planned.clone();
        no_bridge.scope.as_mut().unwrap().from_bridge.clear();
        let err = check_replanned(&p, &r, &no_bridge).unwrap_err();
        assert!(
            matches!(
                &err,
                NotPlanned::Chain {
                    chain: "from_bridge",
                    ..
                }
            ),
            "{err}"
        );
        // A generation recorded without the spoof check (as before it existed): the stored
        // ruleset reads (the chain is empty by default), and is not what the policy plans.
        let mut stored = serde_json::to_value(&planned).unwrap();
        if let Some(scope) = stored.get_mut("scope").and_then(|s| s.as_object_mut()) {
            scope.remove("prerouting");
        }
        let older: Ruleset = serde_json::from_value(stored).expect("an older generation reads");
        assert!(older.scope.as_ref().unwrap().prerouting.is_empty());
        let err = check_replanned(&p, &r, &older).unwrap_err();
        assert_eq!(
            err.to_string(),
            "its chain scope_prerouting is not what its policy plans (it is no such chain, the \
             plan on the prerouting hook, policy accept)"
        );
        // Without its scope chains the fence is on the output hook again: everyone is
        // fenced, which this policy does not say.
        let mut unscoped = planned.clone();
        unscoped.scope = None;
        let err = check_replanned(&p, &r, &unscoped).unwrap_err();
        assert_eq!(
            err.to_string(),
            "its chain output is not what its policy plans (it is on the output hook, policy \
             drop, the plan a regular chain)"
        );
        // And an unscoped policy's ruleset with scope chains is refused as well.
        let (tight, tr) = (policy(TIGHT), resolved());
        let mut scoped = plan(&tight, &tr);
        scoped.scope = planned.scope.clone();
        let err = check_replanned(&tight, &tr, &scoped).unwrap_err();
        assert!(
            matches!(
                &err,
                NotPlanned::Chain {
                    chain: "output",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn permanent_resolved_elements_must_be_exactly_the_planned_ones() {
        let (p, r) = (policy(TIGHT), resolved());
        let mut extra = plan(&p, &r);
        let mut element = timed("198.51.100.7", 443, 1, "a.example");
        element.timeout_ms = None;
        resolved4(&mut extra).push(element);
        let err = check_replanned(&p, &r, &extra).unwrap_err();
        assert!(
            err.to_string().contains("not planned and has no timeout"),
            "{err}"
        );

        let mut renamed = plan(&p, &r);
        resolved4(&mut renamed)[0].name = Some("b.example".into());
        let err = check_replanned(&p, &r, &renamed).unwrap_err();
        assert!(
            err.to_string().contains("differs from the planned"),
            "{err}"
        );

        let mut missing = plan(&p, &r);
        resolved4(&mut missing).clear();
        let err = check_replanned(&p, &r, &missing).unwrap_err();
        assert!(
            err.to_string().contains("lacks the planned `192.0.2.10"),
            "{err}"
        );

        let mut twice = plan(&p, &r);
        let first = resolved4(&mut twice)[0].clone();
        resolved4(&mut twice).push(first);
        let err = check_replanned(&p, &r, &twice).unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
    }

    #[test]
    fn what_run_records_passes_with_its_timeouts_and_carried_elements() {
        let (p, r) = (policy(TIGHT), resolved());
        let mut rs = as_run_records(&p, &r);
        assert_eq!(check_replanned(&p, &r, &rs), Ok(()));
        // Carried over from the table a restart found: not in the resolution, but explained.
        let cap = lifetime_cap(&p.dns).as_millis() as u64;
        resolved4(&mut rs).push(timed("198.51.100.7", 443, cap, "a.example"));
        resolved4(&mut rs).sort();
        assert_eq!(check_replanned(&p, &r, &rs), Ok(()));
    }

    #[test]
    fn timed_elements_the_policy_does_not_explain_are_refused() {
        let (p, r) = (policy(TIGHT), resolved());
        let cap = lifetime_cap(&p.dns).as_millis() as u64;
        let refused = |element: Timed, why: &str| {
            let mut rs = as_run_records(&p, &r);
            resolved4(&mut rs).push(element.clone());
            let err = check_replanned(&p, &r, &rs).unwrap_err().to_string();
            assert!(err.contains(why), "{element:?}: {err}");
        };
        refused(
            timed("198.51.100.7", 22, 1000, "a.example"),
            "not allowed on tcp 22",
        );
        refused(
            timed("198.51.100.7", 443, 1000, "evil.example"),
            "does not allow evil.example",
        );
        refused(
            timed("198.51.100.7", 443, cap + 60_000, "a.example"),
            "longer than the policy",
        );
        refused(timed("127.0.0.1", 443, 1000, "a.example"), "never allowed");
        let mut network = timed("198.51.100.0", 443, 1000, "a.example");
        network.tuple.net = "198.51.100.0/24".parse().unwrap();
        refused(network, "not the address of one host");
        let mut expiring = timed("198.51.100.7", 443, 1000, "a.example");
        expiring.expires_ms = Some(10);
        refused(expiring, "expiry");
        let mut nameless = timed("198.51.100.7", 443, 1000, "a.example");
        nameless.name = None;
        refused(nameless, "no comment");
        // A planned element with a timeout too long for the policy.
        let mut rs = as_run_records(&p, &r);
        resolved4(&mut rs)[0].timeout_ms = Some(cap + 60_000);
        assert!(check_replanned(&p, &r, &rs).is_err());
    }
}
