//! Resolution of the policy's names: A and AAAA, a bounded number of names at a time, against
//! the policy's resolvers, keeping each answer's TTL.

use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use hickory_resolver::Resolver;
use hickory_resolver::config::{NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts};
use hickory_resolver::net::NetError;
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::{Name, RData};
use tracing::warn;

use crate::core::installable::{MAX_ADDRS_PER_FAMILY, answered_addrs, retain_installable};
use crate::core::policy::DomainName;
use crate::core::resolution::{Resolution, ResolvedHost};
use crate::dns::message::on_chain;

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("no resolvers: {path} lists no nameserver; set `dns.resolvers` in the policy")]
    NoSystemResolvers { path: String },
    #[error(
        "cannot read {path} for the default resolvers: {error}; set `dns.resolvers` in the policy"
    )]
    ResolvConf { path: String, error: std::io::Error },
    #[error("cannot start the resolver: {0}")]
    Setup(String),
}

/// The nameservers of a resolv.conf file, in order.
pub fn system_resolvers(path: &Path) -> Result<Vec<IpAddr>, ResolveError> {
    let text = std::fs::read_to_string(path).map_err(|error| ResolveError::ResolvConf {
        path: path.display().to_string(),
        error,
    })?;
    let found = parse_resolv_conf(&text);
    if found.is_empty() {
        return Err(ResolveError::NoSystemResolvers {
            path: path.display().to_string(),
        });
    }
    Ok(found)
}

fn parse_resolv_conf(text: &str) -> Vec<IpAddr> {
    let mut found = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            continue;
        }
        // An IPv6 nameserver may carry a zone (fe80::1%eth0); the zone does not matter to a
        // destination-address rule.
        let Some(addr) = words.next().and_then(|w| w.split('%').next()?.parse().ok()) else {
            continue;
        };
        if !found.contains(&addr) {
            found.push(addr);
        }
    }
    found
}

/// Resolves every allowed name of `policy` against its resolvers, or against the nameservers
/// of `resolv_conf` when the policy names none.
pub fn resolve_policy(
    policy: &crate::core::policy::Policy,
    resolv_conf: &Path,
) -> Result<Resolution, ResolveError> {
    // In guard mode names are allowed only as the guard answers them; the table allows its
    // upstream resolvers to the guard as this process would run it.
    if let Some(guard) = crate::host::guard_identity(policy) {
        return Ok(Resolution {
            resolvers: guard.upstream,
            hosts: Vec::new(),
            guard_uid: Some(guard.uid),
            scope: crate::host::host_scope(policy),
        });
    }
    let resolvers = match &policy.dns.resolvers {
        Some(r) => r.clone(),
        None => system_resolvers(resolv_conf)?,
    };
    let hosts = resolve_names(policy.domains(), &resolvers)?;
    Ok(Resolution {
        resolvers,
        hosts,
        guard_uid: None,
        scope: crate::host::host_scope(policy),
    })
}

/// How long one query may take, and how often it is tried.
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);
const QUERY_ATTEMPTS: usize = 2;

/// How many names are looked up at once. Each name asks A and AAAA, each query is sent to
/// at most `SERVERS_PER_QUERY` resolvers at once, and each of those sends holds a UDP socket
/// of its own: at most 4 x 128 = 512 sockets, half of the usual limit of 1,024 open files, so
/// the rest of the process (netlink, the guard, the state directory) keeps room. A local
/// resolver answers 10,000 names as fast with 128 in flight as with more (BENCHMARKS.md).
pub const LOOKUPS_IN_FLIGHT: usize = 128;
/// Resolvers asked in parallel for one query (hickory's `num_concurrent_reqs`, whose
/// default this is, written down because the socket budget above depends on it).
const SERVERS_PER_QUERY: usize = 2;

/// Resolves every name (A and AAAA, [`LOOKUPS_IN_FLIGHT`] names at a time) on a
/// single-threaded runtime, so a caller that entered a network namespace keeps every socket
/// in it.
pub fn resolve_names<'a>(
    names: impl IntoIterator<Item = &'a DomainName>,
    resolvers: &[IpAddr],
) -> Result<Vec<ResolvedHost>, ResolveError> {
    let names: Vec<DomainName> = names.into_iter().cloned().collect();
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ResolveError::Setup(e.to_string()))?;
    runtime.block_on(async { NameResolver::new(resolvers)?.lookup_all(names).await })
}

/// A resolver bound to the policy's servers, for lookups from async code (the daemon).
#[derive(Clone)]
pub struct NameResolver {
    inner: Resolver<TokioRuntimeProvider>,
}

impl NameResolver {
    /// Must be called inside a tokio runtime.
    pub fn new(resolvers: &[IpAddr]) -> Result<NameResolver, ResolveError> {
        let config = ResolverConfig::from_name_servers(
            resolvers
                .iter()
                .map(|ip| NameServerConfig::udp_and_tcp(*ip))
                .collect(),
        );
        let mut builder = Resolver::builder_with_config(config, TokioRuntimeProvider::default());
        let opts: &mut ResolverOpts = builder.options_mut();
        opts.timeout = QUERY_TIMEOUT;
        opts.attempts = QUERY_ATTEMPTS;
        // The policy names hosts exactly: no search domains, no /etc/hosts, and no cache, so
        // every answer carries the TTL the server gives now.
        opts.ndots = 0;
        opts.use_hosts_file = ResolveHosts::Never;
        opts.cache_size = 0;
        opts.try_tcp_on_error = true;
        opts.num_concurrent_reqs = SERVERS_PER_QUERY;
        // The CNAMEs of an answer stay in it: the addresses taken are those on the chain
        // from the asked name (see `lookup`).
        opts.preserve_intermediates = true;
        let inner = builder
            .build()
            .map_err(|e| ResolveError::Setup(e.to_string()))?;
        Ok(NameResolver { inner })
    }

    /// Looks up every name, at most [`LOOKUPS_IN_FLIGHT`] at a time; the answers come back
    /// sorted by name, without the addresses that must never be installed (checked against
    /// this host's interfaces as they are now: once per call, so a refresh of many names
    /// reads them once).
    pub async fn lookup_all(
        &self,
        names: impl IntoIterator<Item = DomainName>,
    ) -> Result<Vec<ResolvedHost>, ResolveError> {
        // A fixed window, not one task per name: every query in flight holds a UDP socket
        // (hickory binds one per request), so ten thousand names at once run out of file
        // descriptors under the usual limit of 1,024 and fail instead of waiting.
        let mut names = names.into_iter();
        let mut lookups = tokio::task::JoinSet::new();
        let mut hosts = Vec::new();
        loop {
            while lookups.len() < LOOKUPS_IN_FLIGHT {
                let Some(name) = names.next() else { break };
                let resolver = self.clone();
                lookups.spawn(async move { resolver.lookup(&name).await });
            }
            let Some(done) = lookups.join_next().await else {
                break;
            };
            hosts.push(done.map_err(|e| ResolveError::Setup(e.to_string()))?);
        }
        hosts.sort_by(|a, b| a.name.cmp(&b.name));
        let host_addrs = crate::host::read_addrs_or_warn();
        for host in &mut hosts {
            host.dropped = retain_installable(&mut host.addrs, |a| a.addr, &host_addrs);
        }
        Ok(hosts)
    }

    /// A and AAAA of one name.
    pub async fn lookup(&self, name: &DomainName) -> ResolvedHost {
        let fqdn = format!("{name}.");
        let (v4, v6) = tokio::join!(
            self.inner.ipv4_lookup(fqdn.as_str()),
            self.inner.ipv6_lookup(fqdn.as_str())
        );
        // Only the records of the name asked and of the CNAME chain from it: hickory hands an
        // answer without CNAMEs over whole, records of names nobody asked included.
        let asked = Name::from_ascii(&fqdn).ok();
        let mut records: Vec<(IpAddr, u32)> = Vec::new();
        let mut errors = Vec::new();
        let mut nxdomain = false;
        for (kind, result) in [("A", v4), ("AAAA", v6)] {
            match result {
                Ok(lookup) => {
                    let answers = lookup.answers();
                    for record in asked.iter().flat_map(|asked| on_chain(asked, answers)) {
                        let addr = match &record.data {
                            RData::A(a) => IpAddr::V4(a.0),
                            RData::AAAA(a) => IpAddr::V6(a.0),
                            _ => continue, // CNAMEs on the way
                        };
                        records.push((addr, record.ttl));
                    }
                }
                // An answer without records is an answer: an IPv4-only name has no AAAA.
                Err(e) if e.is_no_records_found() => nxdomain |= e.is_nx_domain(),
                Err(e) => errors.push(format!("{kind}: {}", describe(&e))),
            }
        }
        // Once per lookup of the name, so at most once per `dns.refresh.min` in the daemon.
        let (addrs, left_out) = answered_addrs(records);
        if left_out > 0 {
            warn!(name = %name, left_out,
                  "the answer brought more than {MAX_ADDRS_PER_FAMILY} addresses of a family; \
                   only the first ones are allowed");
        }
        ResolvedHost {
            name: name.clone(),
            addrs,
            nxdomain,
            dropped: Vec::new(),
            errors,
        }
    }
}

fn describe(e: &NetError) -> String {
    match e {
        NetError::Timeout => "timed out".into(),
        NetError::NoConnections => "no resolver could be reached".into(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_nameservers_in_order_without_zones_or_duplicates() {
        let text = "# comment\nsearch example\nnameserver 192.0.2.53\nnameserver fe80::1%eth0\n\
                    nameserver 192.0.2.53\nnameserver not-an-address\noptions edns0\n";
        let got = parse_resolv_conf(text);
        assert_eq!(
            got,
            vec![
                "192.0.2.53".parse::<IpAddr>().unwrap(),
                "fe80::1".parse().unwrap()
            ]
        );
    }

    #[test]
    fn empty_resolv_conf_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("resolv.conf");
        std::fs::write(&path, "search example\n").unwrap();
        let err = system_resolvers(&path).unwrap_err();
        assert!(
            err.to_string().contains("resolv.conf lists no nameserver"),
            "{err}"
        );
        assert!(system_resolvers(&dir.path().join("missing")).is_err());
    }
}
