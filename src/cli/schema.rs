//! The policy schema that `check --help` prints.

pub const SCHEMA: &str = "\
Policy schema (YAML):
  version: 1                      # required
  action: reject                  # unmatched traffic: reject (fails fast) or drop
  allow:                          # destinations that may be reached
    - domain: api.example.com     # resolved to A and AAAA; or `cidr: 203.0.113.0/28`
      ports: [443, \"8000-8080\"]   # required for a domain; a cidr without it: every port
      protocol: tcp               # tcp (default), udp or any (both)
      comment: model API          # free text
  deny:                           # checked before allow: deny wins
    - preset: cloud-metadata      # or private-networks, dns-over-https; or `cidr: 10.0.0.0/8`
  dns:
    resolvers: [192.0.2.53]       # default: the nameservers of resolv.conf
    # mode: guard                 # be the host's resolver (`upstream:`): see `run --help`
  log:
    prefix: \"EGRESS-DROP: \"       # default as shown
    group: 100                    # NFLOG group for refused packets (default: kernel log)
    rate: 10/second               # log rate limit, with `burst: 20`
  essentials: [loopback, established, icmpv6-nd, dhcpv4, dhcpv6]   # default: all";
