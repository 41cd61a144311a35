//! The named deny lists (`deny: - preset: NAME`).

use std::net::IpAddr;

use ipnet::IpNet;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Named lists of networks to deny.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Preset {
    /// Cloud instance metadata services and their neighbours: AWS, GCP, Azure, OCI, Alibaba, ...
    CloudMetadata,
    /// RFC 1918, carrier-grade NAT and IPv6 unique local addresses.
    PrivateNetworks,
    /// Well-known public DNS-over-HTTPS (and DNS-over-TLS) resolvers; implied in guard mode.
    DnsOverHttps,
}

impl Preset {
    pub fn name(self) -> &'static str {
        match self {
            Preset::CloudMetadata => "cloud-metadata",
            Preset::PrivateNetworks => "private-networks",
            Preset::DnsOverHttps => "dns-over-https",
        }
    }

    /// What a destination in this preset is, for messages about refused packets.
    pub fn describe(self) -> &'static str {
        match self {
            Preset::CloudMetadata => "a cloud metadata service",
            Preset::PrivateNetworks => "a private network",
            Preset::DnsOverHttps => "a public DNS-over-HTTPS resolver",
        }
    }

    /// The preset whose networks hold `addr`, if any.
    pub fn containing(addr: IpAddr) -> Option<Preset> {
        [
            Preset::CloudMetadata,
            Preset::PrivateNetworks,
            Preset::DnsOverHttps,
        ]
        .into_iter()
        .find(|p| p.networks().iter().any(|n| n.contains(&addr)))
    }

    pub fn networks(self) -> Vec<IpNet> {
        let list: &[&str] = match self {
            // 169.254.0.0/16: every provider's link-local metadata (AWS, GCP, Azure, DO, ...)
            // and the AWS DNS and time endpoints beside it; fd00:ec2::/32 is its IPv6 image,
            // AWS's instance services (IMDS ::254, DNS ::253, time ::123, EKS pod identity
            // ::23; DNS to a listed resolver there is accepted before the deny list);
            // fd20:ce::254 GCP's IPv6 metadata server; fd00:42::42 Scaleway's; 100.100.100.200
            // Alibaba; 192.0.0.192 Oracle (legacy); 168.63.129.16 Azure's wireserver.
            Preset::CloudMetadata => &[
                "169.254.0.0/16",
                "fd00:ec2::/32",
                "fd20:ce::254/128",
                "fd00:42::42/128",
                "100.100.100.200/32",
                "192.0.0.192/32",
                "168.63.129.16/32",
            ],
            Preset::PrivateNetworks => &[
                "10.0.0.0/8",
                "172.16.0.0/12",
                "192.168.0.0/16",
                "100.64.0.0/10",
                "fc00::/7",
            ],
            // Answers from these would bypass the guard: HTTPS to them looks like any other
            // HTTPS. The well-known anycast addresses of public resolvers, by operator.
            Preset::DnsOverHttps => &[
                // Cloudflare (1.1.1.1, families, cloudflare-dns.com)
                "1.1.1.1/32",
                "1.0.0.1/32",
                "1.1.1.2/32",
                "1.0.0.2/32",
                "1.1.1.3/32",
                "1.0.0.3/32",
                "104.16.248.249/32",
                "104.16.249.249/32",
                "2606:4700:4700::1111/128",
                "2606:4700:4700::1001/128",
                "2606:4700:4700::1112/128",
                "2606:4700:4700::1002/128",
                "2606:4700:4700::1113/128",
                "2606:4700:4700::1003/128",
                // Google
                "8.8.8.8/32",
                "8.8.4.4/32",
                "2001:4860:4860::8888/128",
                "2001:4860:4860::8844/128",
                // Quad9
                "9.9.9.9/32",
                "9.9.9.10/32",
                "9.9.9.11/32",
                "149.112.112.112/32",
                "149.112.112.10/32",
                "149.112.112.11/32",
                "2620:fe::fe/128",
                "2620:fe::9/128",
                "2620:fe::10/128",
                "2620:fe::11/128",
                // OpenDNS / Cisco Umbrella
                "208.67.222.222/32",
                "208.67.220.220/32",
                "208.67.222.123/32",
                "208.67.220.123/32",
                "146.112.41.2/32",
                "2620:119:35::35/128",
                "2620:119:53::53/128",
                // AdGuard
                "94.140.14.14/32",
                "94.140.15.15/32",
                "94.140.14.15/32",
                "94.140.15.16/32",
                "94.140.14.140/32",
                "94.140.14.141/32",
                "2a10:50c0::ad1:ff/128",
                "2a10:50c0::ad2:ff/128",
                // CleanBrowsing
                "185.228.168.9/32",
                "185.228.169.9/32",
                "185.228.168.10/32",
                "185.228.169.11/32",
                "185.228.168.168/32",
                "185.228.169.168/32",
                // NextDNS, Control D and Mullvad serve DNS from whole networks
                "45.90.28.0/24",
                "45.90.30.0/24",
                "76.76.2.0/24",
                "76.76.10.0/24",
                "194.242.2.0/28",
                // DNS.SB, Alibaba, DNSPod, 114DNS, Comodo, Yandex
                "185.222.222.222/32",
                "45.11.45.11/32",
                "223.5.5.5/32",
                "223.6.6.6/32",
                "2400:3200::1/128",
                "2400:3200:baba::1/128",
                "119.29.29.29/32",
                "1.12.12.12/32",
                "120.53.53.53/32",
                "114.114.114.114/32",
                "114.114.115.115/32",
                "8.26.56.26/32",
                "8.20.247.20/32",
                "77.88.8.8/32",
                "77.88.8.1/32",
            ],
        };
        list.iter()
            .map(|s| s.parse().expect("preset networks are valid literals"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cloud_metadata_preset_holds_the_ipv6_instance_services() {
        for addr in [
            "169.254.169.254",
            "fd00:ec2::254", // AWS IMDS
            "fd00:ec2::253", // AWS DNS
            "fd00:ec2::123", // AWS time
            "fd00:ec2::23",  // EKS pod identity
            "fd20:ce::254",  // GCP
            "fd00:42::42",   // Scaleway
        ] {
            let ip: IpAddr = addr.parse().unwrap();
            assert_eq!(
                Preset::containing(ip),
                Some(Preset::CloudMetadata),
                "{addr}"
            );
        }
        let ip: IpAddr = "fd20:ce::253".parse().unwrap();
        assert_ne!(Preset::containing(ip), Some(Preset::CloudMetadata));
    }
}
