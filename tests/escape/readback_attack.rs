//! An outside review of the typed read-back (issue 17, items 1 and 2): hand edits of the
//! table by root with `nft`, each either reported as drift and undone by one `apply`, or
//! shown to leave the boundary as it was.

use super::readback::{assert_in_sync, world};
use crate::common::*;

const TABLE: &str = "inet egress_fence";

/// Runs an nft script in the sandbox; `Err` with nft's complaint if it refuses it.
fn nft_script(w: &World, script: &str) -> Result<(), String> {
    let out = w.sandbox_cmd_with_input(&["nft", "-f", "-"], script.as_bytes());
    if out.success() {
        Ok(())
    } else {
        Err(format!("nft -f of\n{script}\n{out}"))
    }
}

fn listing(w: &World) -> String {
    let out = w.sandbox_cmd(&["nft", "list", "table", "inet", "egress_fence"]);
    assert!(out.success(), "{out}");
    out.stdout
}

/// The script that replaces the table with its own listing, edited by `edit`: nft writes
/// every rule and set again, so only the edit differs.
fn reloaded(w: &World, edit: impl Fn(&str) -> String) -> String {
    let before = listing(w);
    let edited = edit(&before);
    assert_ne!(edited, before, "the edit changed nothing");
    format!("delete table {TABLE}\n{edited}")
}

/// `status` reports drift naming `shown`, `diff` exits 1 naming it, and one `apply` sends the
/// table again: in sync after, and nothing of the edit (`gone`) left in nft's listing.
fn assert_drift_then_repaired(w: &World, policy: &str, edit: &str, shown: &str, gone: &str) {
    let status = w.egress_fence(&["status"]);
    assert!(
        status.success() && status.stdout.contains("DRIFT from generation"),
        "status after {edit}: {status}"
    );
    assert!(
        status.stdout.contains(shown),
        "status after {edit} does not show `{shown}`: {status}"
    );
    let diff = w.egress_fence(&["diff", policy]);
    assert_eq!(diff.code(), 1, "diff after {edit}: {diff}");
    assert!(
        diff.stdout.contains(shown),
        "diff after {edit} does not show `{shown}`: {diff}"
    );
    let apply = w.egress_fence(&["apply", policy]);
    assert_eq!(apply.code(), 0, "apply after {edit}: {apply}");
    assert!(
        !apply.stdout.contains("unchanged"),
        "apply after {edit} sent nothing: {apply}"
    );
    assert_in_sync(w, policy, &format!("apply after {edit}"));
    let after = listing(w);
    assert!(
        !after.contains(gone),
        "`{gone}` is left after apply after {edit}:\n{after}"
    );
}

/// The boundary as the policy draws it: the allowed host reachable, another one not.
fn assert_boundary_holds(w: &World, after: &str) {
    let _api = w.listen_tcp(HOST_V4, 443);
    let _other = w.listen_tcp(OTHER_V4, 443);
    assert!(w.tcp_connects(HOST_V4, 443), "the allowed host {after}");
    assert!(
        !w.tcp_connects(OTHER_V4, 443),
        "a host outside the policy {after}"
    );
}

#[test]
fn stateful_objects_in_the_table_are_drift_and_apply_removes_them() {
    // Named counters, quotas and limits do nothing until a rule of the table uses them (and
    // such a rule is drift), but they are in the table: status sees them, apply removes them.
    let (w, policy) = world();
    for (kind, name, body) in [
        ("counter", "XXcounter", ""),
        ("quota", "XXquota", "{ over 1 mbytes }"),
        ("limit", "XXlimit", "{ rate 1/second }"),
    ] {
        nft_script(&w, &format!("add {kind} {TABLE} {name} {body}\n"))
            .unwrap_or_else(|e| panic!("{e}"));
        let shown = format!("{kind} {name}: not egress-fence's");
        assert_drift_then_repaired(&w, &policy, &format!("{kind} {name}"), &shown, name);
    }
    assert_boundary_holds(&w, "after the objects were removed");
}

#[test]
fn a_flowtable_in_the_table_is_drift_and_apply_removes_it() {
    let (w, policy) = world();
    let script = format!(
        "add flowtable {TABLE} XXflows {{ hook ingress priority 0; devices = {{ lo }}; }}\n"
    );
    if let Err(e) = nft_script(&w, &script) {
        eprintln!("SKIP: this kernel has no flowtables (nf_flow_table_inet): {e}");
        return;
    }
    assert_drift_then_repaired(
        &w,
        &policy,
        "a flowtable",
        "flowtable XXflows: not egress-fence's",
        "XXflows",
    );
}

#[test]
fn a_sets_parameters_are_drift() {
    // What a set declares besides its type and flags: a default timeout and garbage
    // collection, a size, a backend policy, expressions its new elements are given.
    let (w, policy) = world();
    let edits: [(&str, &str, &str, &str); 5] = [
        (
            "set resolved4 {\n",
            "\t\ttimeout 1h\n",
            "timeout 3600000ms",
            "timeout 1h",
        ),
        (
            "set resolved6 {\n",
            "\t\tgc-interval 1s\n",
            "gc-interval 1000ms",
            "gc-interval",
        ),
        ("set dns4 {\n", "\t\tsize 2\n", "size 2", "size 2"),
        (
            "set allow6 {\n",
            "\t\tpolicy memory\n",
            "policy memory",
            "policy memory",
        ),
        // An empty set: no element shows the expressions yet.
        (
            "set allow6 {\n",
            "\t\tcounter\n",
            "expressions given to every new element",
            "\t\tcounter\n",
        ),
    ];
    for (set, param, shown, gone) in edits {
        let script = reloaded(&w, |l| l.replacen(set, &format!("{set}{param}"), 1));
        nft_script(&w, &script).unwrap_or_else(|e| panic!("{e}"));
        assert_drift_then_repaired(&w, &policy, param.trim(), shown, gone);
    }
    assert_boundary_holds(&w, "after the sets were sent again");
}

#[test]
fn rules_chains_and_elements_edited_by_hand_are_drift() {
    // Edits the review tried that were already drift: each must stay so, and one apply must
    // undo it. (`shown` is what status and diff print; `gone` what must leave the listing.)
    let (w, policy) = world();
    let edits: Vec<(&str, String, &str, &str)> = vec![
        (
            "the deny lookup moved after the allow lookups",
            reloaded(&w, |l| {
                // nft lists the rule with what its counter counted.
                let deny = l
                    .lines()
                    .find(|r| r.contains("ip daddr @deny4 counter"))
                    .map(|r| format!("{r}\n"))
                    .unwrap_or_default();
                l.replacen(&deny, "", 1).replacen(
                    "\t\tgoto refused\n",
                    &format!("{deny}\t\tgoto refused\n"),
                    1,
                )
            }),
            "+ ip daddr @deny4 counter goto refused",
            "@resolved6 accept\n\t\tip daddr @deny4",
        ),
        (
            "a counter in a rule",
            reloaded(&w, |l| {
                l.replacen(
                    "established,related accept",
                    "established,related counter accept",
                    1,
                )
            }),
            "- [ct load state",
            "related counter",
        ),
        (
            "another log prefix",
            reloaded(&w, |l| l.replacen("EGRESS-DROP: ", "XXDROP: ", 1)),
            "- limit rate 10/second burst 20 packets log prefix \"XXDROP: \"",
            "XXDROP",
        ),
        (
            "a faster log limit",
            reloaded(&w, |l| {
                l.replacen("limit rate 10/second", "limit rate 9999/second", 1)
            }),
            "- limit rate 9999/second",
            "9999",
        ),
        (
            "the output chain's policy accept",
            reloaded(&w, |l| l.replacen("policy drop;", "policy accept;", 1)),
            "policy accept (wanted: hook output priority 0 policy drop)",
            "policy accept",
        ),
        (
            "a verdict map inserted first",
            format!("insert rule {TABLE} output ip daddr vmap {{ 203.0.113.10 : accept }}\n"),
            "lookup reg 1 set __map0 dreg 0",
            "vmap",
        ),
        (
            "a jump to a chain of accepts",
            format!(
                "add chain {TABLE} XXj\nadd rule {TABLE} XXj accept\ninsert rule {TABLE} output jump XXj\n"
            ),
            "chain XXj: not egress-fence's",
            "XXj",
        ),
        (
            "a second output chain accepting first",
            format!(
                "add chain {TABLE} XXearly {{ type filter hook output priority -10; policy accept; }}\n"
            ),
            "chain XXearly: not egress-fence's",
            "XXearly",
        ),
        (
            "an ingress chain on lo",
            format!(
                "add chain {TABLE} XXingress {{ type filter hook ingress device lo priority 0; }}\n"
            ),
            "chain XXingress: not egress-fence's",
            "XXingress",
        ),
        (
            "a nat chain at the same priority",
            format!("add chain {TABLE} XXnat {{ type nat hook output priority 0; }}\n"),
            "chain XXnat: not egress-fence's",
            "XXnat",
        ),
        (
            "a constant deny set",
            reloaded(&w, |l| {
                l.replacen("flags interval\n", "flags constant,interval\n", 1)
            }),
            "set deny4: key type 0x7 of 4 bytes, flags 0x6",
            "constant",
        ),
        (
            "a dynamic resolved set",
            reloaded(&w, |l| {
                l.replacen("flags timeout\n", "flags dynamic,timeout\n", 1)
            }),
            "set resolved4: key type 0x730d of 12 bytes, flags 0x30",
            "dynamic",
        ),
        (
            "an allowed network's key end widened",
            reloaded(&w, |l| {
                l.replacen(
                    "198.51.100.0/24 . tcp . 22",
                    "198.51.100.0/23 . tcp . 22",
                    1,
                )
            }),
            "- 198.51.100.0/23 . tcp . 22",
            "/23",
        ),
        (
            "an allowed port's key end widened",
            reloaded(&w, |l| {
                l.replacen(
                    "198.51.100.0/24 . tcp . 22",
                    "198.51.100.0/24 . tcp . 22-23",
                    1,
                )
            }),
            "- 198.51.100.0/24 . tcp . 22-23",
            "22-23",
        ),
        (
            // A quota of 0 bytes makes every lookup of the element fail: the deny is gone.
            "a quota on every deny element",
            reloaded(&w, |l| {
                l.replacen(
                    "type ipv4_addr\n\t\tflags interval\n",
                    "type ipv4_addr\n\t\tflags interval\n\t\tquota 0 bytes\n",
                    1,
                )
            }),
            "169.254.0.0 with data, a verdict or expressions attached (undecodable)",
            "quota",
        ),
    ];
    for (edit, script, shown, gone) in edits {
        nft_script(&w, &script).unwrap_or_else(|e| panic!("{edit}: {e}"));
        assert_drift_then_repaired(&w, &policy, edit, shown, gone);
    }
    assert_boundary_holds(&w, "after the edits were undone");
}

#[test]
fn another_tables_accept_does_not_open_the_fence() {
    // Only our table is ours to report on. An accept in another table's chain, even one that
    // runs first, ends that chain only: the packet still meets our output chain, and a drop
    // in any base chain is final. So such a table is not drift, and the boundary holds.
    let (w, policy) = world();
    let script = "add table inet XXother\n\
                  add chain inet XXother out { type filter hook output priority -300; policy accept; }\n\
                  add rule inet XXother out accept\n\
                  add table ip egress_fence\n\
                  add chain ip egress_fence out { type filter hook output priority -300; policy accept; }\n\
                  add rule ip egress_fence out accept\n";
    nft_script(&w, script).unwrap_or_else(|e| panic!("{e}"));
    assert_in_sync(&w, &policy, "another table accepting everything first");
    assert_boundary_holds(&w, "with another table accepting everything first");
}

/// Inserts `inner(vxlan) meta l4proto . accept` first in the output chain over raw netlink:
/// an expression the kernel has (Linux 6.2) and libnftnl 1.2.4 cannot parse.
const INSERT_INNER_RULE_PY: &str = r#"
# Inserts `inner(vxlan meta l4proto) accept` at the top of egress_fence's output chain
# over raw netlink: an expression libnftnl 1.2.4 cannot parse.
import socket, struct, sys

def attr(kind, value):
    l = 4 + len(value)
    return struct.pack("=HH", l, kind) + value + b"\0" * ((4 - l % 4) % 4)

def nest(kind, *parts):
    return attr(kind | 0x8000, b"".join(parts))

def be32(v):
    return struct.pack(">I", v)

def s(v):
    return v.encode() + b"\0"

def msg(kind, flags, seq, family, res_id, body):
    payload = struct.pack("=BBH", family, 0, socket.htons(res_id)) + body
    return struct.pack("=IHHII", 16 + len(payload), kind, flags, seq, 0) + payload

def expr(name, *data):
    return nest(1, attr(1, s(name)), nest(2, *data))

meta = expr("meta", attr(1, be32(1)), attr(2, be32(16)))
inner = expr("inner", attr(1, be32(0)), attr(2, be32(1)), attr(3, be32(0xF)), attr(4, be32(8)),
             nest(5, attr(1, s("meta")), nest(2, attr(1, be32(1)), attr(2, be32(16)))))
accept = expr("immediate", attr(1, be32(0)), nest(2, nest(2, attr(1, be32(1)))))
rule = attr(1, s("egress_fence")) + attr(2, s("output")) + nest(4, inner, accept)
REQ, ACK, CREATE = 1, 4, 0x400
batch = (msg(0x10, REQ, 1, 0, 10, b"")
         + msg((10 << 8) | 6, REQ | ACK | CREATE, 2, 1, 0, rule)
         + msg(0x11, REQ, 3, 0, 10, b""))
sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)
sock.bind((0, 0))
sock.send(batch)
sock.settimeout(2)
data = sock.recv(65536)
kind = struct.unpack_from("=H", data, 4)[0]
code = struct.unpack_from("=i", data, 16)[0] if kind == 2 else None
print("ack", code)
sys.exit(0 if code == 0 else 1)
"#;

#[test]
fn a_rule_libnftnl_cannot_read_is_drift_and_apply_replaces_it() {
    // Before, the whole read-back failed on such a rule: `status` could not check, and
    // `apply` and `diff` stopped with an error, so nothing could put the table back.
    let (w, policy) = world();
    let out = w.sandbox_cmd(&[PYTHON, "-c", INSERT_INNER_RULE_PY]);
    if !out.success() {
        eprintln!("SKIP: this kernel refused the inner expression: {out}");
        return;
    }
    // The premise: the rule accepts any UDP datagram whose payload looks like a VXLAN frame,
    // from any process, to anywhere.
    assert_eq!(udp_leaves(&w), Some(true), "the inner rule lets UDP out");
    assert_drift_then_repaired(
        &w,
        &policy,
        "an inner expression",
        "- [an expression libnftnl cannot read]",
        "inner",
    );
    assert_boundary_holds(&w, "after the unreadable rule was replaced");
    assert_eq!(udp_leaves(&w), Some(false), "UDP after apply");
}

/// Sends one UDP datagram that reads as a VXLAN frame of an IPv4 packet, as an unprivileged
/// user to a host outside the policy:
/// `Some(true)` if it left, `Some(false)` if the output hook refused it (EPERM).
fn udp_leaves(w: &World) -> Option<bool> {
    const SEND: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    vxlan = bytes.fromhex("0800000000000000")
    frame = bytes(12) + bytes.fromhex("0800")
    ip = bytes.fromhex("4500001c000000004011000000000000c0000201")
    s.sendto(vxlan + frame + ip + bytes(8), (sys.argv[1], 9))
    print("sent")
except PermissionError:
    print("refused")
"#;
    let host = OTHER_V4.to_string();
    let out = w.sandbox_cmd_as(NOBODY, &[PYTHON, "-c", SEND, &host]);
    assert!(out.success(), "{out}");
    match out.stdout.trim() {
        "sent" => Some(true),
        "refused" => Some(false),
        _ => None,
    }
}

/// Creates allow4 over raw netlink with its 12-byte key described as fields of 8 and 4 bytes.
const CREATE_ALLOW4_WITH_TWO_FIELDS_PY: &str = r#"
# Creates set allow4 of egress_fence over raw netlink as egress-fence does (type ipv4_addr .
# inet_proto . inet_service, flags interval, 12-byte keys) but with the key described as two
# fields of 8 and 4 bytes instead of 4, 1 and 2, and the element 198.51.100.0/24 . tcp . 22.
import socket, struct, sys

def attr(kind, value):
    l = 4 + len(value)
    return struct.pack("=HH", l, kind) + value + b"\0" * ((4 - l % 4) % 4)

def nest(kind, *parts):
    return attr(kind | 0x8000, b"".join(parts))

def be32(v):
    return struct.pack(">I", v)

def s(v):
    return v.encode() + b"\0"

def msg(kind, flags, seq, family, res_id, body):
    payload = struct.pack("=BBH", family, 0, socket.htons(res_id)) + body
    return struct.pack("=IHHII", 16 + len(payload), kind, flags, seq, 0) + payload

fields = nest(2, *[nest(1, attr(1, be32(n))) for n in (8, 4)])
new_set = (attr(1, s("egress_fence")) + attr(2, s("allow4")) + attr(3, be32(0x84))
           + attr(4, be32(0x730d)) + attr(5, be32(12)) + nest(9, fields) + attr(10, be32(1)))
key = bytes([198, 51, 100, 0, 6, 0, 0, 0, 0, 22, 0, 0])
key_end = bytes([198, 51, 100, 255, 6, 0, 0, 0, 0, 22, 0, 0])
elem = nest(1, nest(1, attr(1, key)), nest(10, attr(1, key_end)))
new_elems = attr(1, s("egress_fence")) + attr(2, s("allow4")) + nest(3, elem)
REQ, ACK, CREATE = 1, 4, 0x400
batch = (msg(0x10, REQ, 1, 0, 10, b"")
         + msg((10 << 8) | 9, REQ | ACK | CREATE, 2, 1, 0, new_set)
         + msg((10 << 8) | 12, REQ | ACK | CREATE, 3, 1, 0, new_elems)
         + msg(0x11, REQ, 4, 0, 10, b""))
sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)
sock.bind((0, 0))
sock.send(batch)
sock.settimeout(2)
codes = []
try:
    while len(codes) < 2:
        data = sock.recv(65536)
        off = 0
        while off < len(data):
            length, kind = struct.unpack_from("=IH", data, off)
            if kind == 2:
                codes.append(struct.unpack_from("=i", data, off + 16)[0])
            off += (length + 3) & ~3
except socket.timeout:
    pass
print("acks", codes)
sys.exit(0 if codes == [0, 0] else 1)
"#;

#[test]
fn an_interval_sets_fields_are_part_of_its_definition() {
    // A concatenated interval set matches each field of its key as a range of its own. With
    // address and protocol described as one 8-byte field, the element
    // `198.51.100.0/24 . tcp . 22` (the same bytes as ever) matches every protocol to the
    // addresses inside the range: UDP to port 22 leaves. Every byte of the element and of the
    // set's type reads as before, so only the fields tell.
    let (w, policy) = world();
    let udp_22 = |w: &World| {
        let out = w.sandbox_cmd_as(
            NOBODY,
            &[PYTHON, "-c", SEND_UDP_PY, &GATEWAY_V4.to_string(), "22"],
        );
        assert!(out.success(), "{out}");
        out.stdout.trim() == "sent"
    };
    assert!(!udp_22(&w), "UDP to port 22 is refused by the policy");
    // The table without allow4 and its rule, then allow4 made by hand, then the rule again
    // in its place (before the allow6 lookup).
    let script = reloaded(&w, |l| {
        let start = l.find("\tset allow4 {").expect("allow4 listed");
        let end = start + l[start..].find("\t}\n").expect("its end") + 3;
        let l = format!("{}{}", &l[..start], &l[end..]);
        l.replacen(
            "\t\tip daddr . meta l4proto . th dport @allow4 accept\n",
            "",
            1,
        )
    });
    nft_script(&w, &script).unwrap_or_else(|e| panic!("{e}"));
    let out = w.sandbox_cmd(&[PYTHON, "-c", CREATE_ALLOW4_WITH_TWO_FIELDS_PY]);
    if !out.success() {
        eprintln!("SKIP: this kernel refused the set: {out}");
        return;
    }
    let chain = w.sandbox_cmd(&[
        "nft",
        "-a",
        "list",
        "chain",
        "inet",
        "egress_fence",
        "output",
    ]);
    let handle = chain
        .stdout
        .lines()
        .find(|l| l.contains("@allow6 accept"))
        .and_then(|l| l.rsplit("# handle ").next())
        .expect("the allow6 rule's handle")
        .trim()
        .to_string();
    nft_script(
        &w,
        &format!(
            "insert rule {TABLE} output position {handle} ip daddr . meta l4proto . th dport @allow4 accept\n"
        ),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(udp_22(&w), "the premise: UDP to port 22 leaves");
    assert_drift_then_repaired(
        &w,
        &policy,
        "allow4 with two fields",
        "fields 8,4",
        "XXnone",
    );
    assert!(!udp_22(&w), "UDP to port 22 after apply");
    assert_boundary_holds(&w, "after allow4 was sent again");
}

/// Sends one UDP datagram to HOST PORT: prints "sent", or "refused" if the output hook
/// refused it (EPERM).
const SEND_UDP_PY: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    s.sendto(b"x", (sys.argv[1], int(sys.argv[2])))
    print("sent")
except PermissionError:
    print("refused")
"#;
