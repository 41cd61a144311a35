//! Clients in the sandbox: commands, TCP and UDP senders, `dig` and `curl`.

use std::fmt;
use std::net::IpAddr;
use std::process::Command;

use super::adversary::Adversary;
use super::process::{Background, CmdOutput, run, with_timeout};
use super::world::World;

/// One resource record of a dig answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsRecord {
    /// As dig prints it, with the trailing dot.
    pub name: String,
    pub ttl: u32,
    pub rtype: String,
    pub data: String,
}

/// What `dig` got.
#[derive(Clone, Debug)]
pub struct DigResult {
    /// "NOERROR", "NXDOMAIN", "REFUSED", ...; `None` when no answer came (timeout,
    /// unreachable, connection refused, blocked).
    pub status: Option<String>,
    /// The header's flags as dig prints them ("qr", "aa", "tc", "rd", "ra", ...).
    pub flags: Vec<String>,
    pub answers: Vec<DnsRecord>,
    pub output: CmdOutput,
}

impl DigResult {
    fn parse(output: CmdOutput) -> DigResult {
        let mut status = None;
        let mut flags = Vec::new();
        let mut answers = Vec::new();
        for line in output.stdout.lines() {
            if let Some(rest) = line.strip_prefix(";; flags:") {
                // ";; flags: qr aa tc rd ra; QUERY: 1, ANSWER: 30, ..."
                let list = rest.split(';').next().unwrap_or_default();
                flags = list.split_whitespace().map(String::from).collect();
            } else if line.contains("->>HEADER<<-") {
                status = line
                    .split_once("status: ")
                    .and_then(|(_, s)| s.split(',').next())
                    .map(|s| s.trim().to_string());
            } else if !line.starts_with(';') && !line.trim().is_empty() {
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.len() >= 5
                    && let Ok(ttl) = f[1].parse()
                {
                    answers.push(DnsRecord {
                        name: f[0].to_string(),
                        ttl,
                        rtype: f[3].to_string(),
                        data: f[4..].join(" "),
                    });
                }
            }
        }
        DigResult {
            status,
            flags,
            answers,
            output,
        }
    }

    /// Whether a response came back at all.
    pub fn answered(&self) -> bool {
        self.status.is_some()
    }

    /// The A and AAAA addresses of the answer, in answer order.
    pub fn addrs(&self) -> Vec<IpAddr> {
        self.answers
            .iter()
            .filter(|r| r.rtype == "A" || r.rtype == "AAAA")
            .filter_map(|r| r.data.parse().ok())
            .collect()
    }

    /// The addresses sorted, for comparisons (dnsmasq rotates the order).
    pub fn sorted_addrs(&self) -> Vec<IpAddr> {
        let mut a = self.addrs();
        a.sort();
        a
    }
}

fn unbracket(host: &str) -> String {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_string()
}

impl World {
    /// A `Command` that runs `args` inside the sandbox (`ip netns exec`, so it sees the
    /// world's resolv.conf), with proxy variables removed. Not started; no timeout.
    pub fn sandbox_command(&self, args: &[&str]) -> Command {
        self.ns_command(&self.sandbox, args)
    }

    /// Runs `args` inside the sandbox and waits for it (killed after 60 s).
    pub fn sandbox_cmd(&self, args: &[&str]) -> CmdOutput {
        run(
            &mut self.ns_command(&self.sandbox, &with_timeout(args)),
            None,
        )
    }

    /// Like [`World::sandbox_cmd`], feeding `input` to its standard input.
    pub fn sandbox_cmd_with_input(&self, args: &[&str], input: &[u8]) -> CmdOutput {
        run(
            &mut self.ns_command(&self.sandbox, &with_timeout(args)),
            Some(input),
        )
    }

    /// A `Command` that runs `args` inside the net namespace (a test's own server, say), with
    /// proxy variables removed. Not started; no timeout.
    pub fn net_command(&self, args: &[&str]) -> Command {
        self.ns_command(&self.net, args)
    }

    /// Runs `args` inside the net namespace and waits for it (killed after 60 s).
    pub fn net_cmd(&self, args: &[&str]) -> CmdOutput {
        run(&mut self.ns_command(&self.net, &with_timeout(args)), None)
    }

    /// Starts `args` inside the sandbox in the background; killed when the handle drops.
    pub fn spawn_in_sandbox(&self, args: &[&str]) -> Background {
        self.spawn_background(self.ns_command(&self.sandbox, args), args.join(" "))
    }

    /// `nc -z -v -w <timeout_secs>` from the sandbox: the full output, e.g. to tell
    /// "Connection refused" from "Operation not permitted" or a timeout.
    /// `host` may be an IP address (IPv6 with or without brackets) or a name.
    pub fn tcp_connect(&self, host: impl fmt::Display, port: u16, timeout_secs: u32) -> CmdOutput {
        let host = unbracket(&host.to_string());
        let (port, timeout) = (port.to_string(), timeout_secs.to_string());
        self.sandbox_cmd(&["nc", "-z", "-v", "-w", &timeout, &host, &port])
    }

    /// Whether a TCP connection from the sandbox to `host:port` succeeds within 2 s.
    pub fn tcp_connects(&self, host: impl fmt::Display, port: u16) -> bool {
        self.tcp_connect(host, port, 2).success()
    }

    /// Sends `payload` as one UDP datagram (up to 4 KiB) from the sandbox, by `cat` writing
    /// to bash's `/dev/udp/HOST/PORT`. Success means the datagram left the socket, not that it
    /// arrived (check with a [`Listener`]); a datagram the sandbox's output hook drops fails
    /// at once with "Operation not permitted". (`nc -u` waits out its `-w` timeout then and
    /// still exits 0; with `-w0` it may quit before reading its input.)
    pub fn udp_send(&self, host: impl fmt::Display, port: u16, payload: &[u8]) -> CmdOutput {
        let host = unbracket(&host.to_string());
        let port = port.to_string();
        let script = r#"exec cat > "/dev/udp/$0/$1""#;
        self.sandbox_cmd_with_input(&["bash", "-c", script, &host, &port], payload)
    }

    /// `dig +tries=1 +time=2` from the sandbox. `server: None` uses the sandbox's resolv.conf
    /// (the allowed resolver). `rtype` is e.g. "A", "AAAA", "TXT".
    pub fn dig(&self, server: Option<IpAddr>, name: &str, rtype: &str, tcp: bool) -> DigResult {
        let extra: &[&str] = if tcp { &["+tcp"] } else { &[] };
        self.dig_as(None, server, name, rtype, extra)
    }

    /// Like [`World::dig`], as user `uid` (`None`: root, as the test runs; see
    /// [`World::sandbox_cmd_as`]) and with extra dig options after the name and type, e.g.
    /// `+tcp`, `+noedns`, `+ignore` (keep a truncated answer), `-p 853`.
    pub fn dig_as(
        &self,
        uid: Option<u32>,
        server: Option<IpAddr>,
        name: &str,
        rtype: &str,
        extra: &[&str],
    ) -> DigResult {
        let mut args = vec![
            "dig".to_string(),
            "+tries=1".into(),
            "+time=2".into(),
            "+noall".into(),
            "+comments".into(),
            "+answer".into(),
        ];
        if let Some(server) = server {
            args.push(format!("@{server}"));
        }
        args.extend([name.to_string(), rtype.to_string()]);
        args.extend(extra.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        DigResult::parse(match uid {
            Some(uid) => self.sandbox_cmd_as(uid, &args),
            None => self.sandbox_cmd(&args),
        })
    }

    /// `curl` from the sandbox (no proxy, connect timeout 2 s, total 5 s, IPv6 literals in
    /// brackets work). Ok(body) on success, else the whole output (exit code, stderr).
    pub fn curl(&self, url: &str) -> Result<String, CmdOutput> {
        let out = self.sandbox_cmd(&[
            "curl",
            "-sS",
            "--globoff",
            "--noproxy",
            "*",
            "--connect-timeout",
            "2",
            "--max-time",
            "5",
            url,
        ]);
        if out.success() {
            Ok(out.stdout)
        } else {
            Err(out)
        }
    }

    /// Runs `args` inside the sandbox as user and group `uid` with no supplementary groups
    /// (`setpriv`), and waits for it (killed after 60 s). Use [`NOBODY`] for a client that
    /// must not pass as the guard.
    pub fn sandbox_cmd_as(&self, uid: u32, args: &[&str]) -> CmdOutput {
        self.adversary_cmd(Adversary::User(uid), args)
    }
}
