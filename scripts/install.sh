#!/usr/bin/env bash
# Installs egress-fence as a systemd service: the release binary, the unit and, unless one is
# already there, the default policy. Nothing is enabled or started; the end says how.
#
#   sudo ./scripts/install.sh                            # or: sudo make install
#   DESTDIR=/tmp/stage PREFIX=/usr ./scripts/install.sh  # stage a package tree
#
# Variables (all optional):
#   PREFIX            where the binary goes: $PREFIX/bin (default /usr/local). The unit's
#                     ExecStart= is rewritten to match.
#   DESTDIR           a staging root prepended to every path (packaging, tests); the unit's
#                     paths stay those of the final system.
#   UNITDIR           where the unit goes. Default: $PREFIX/lib/systemd/system for the
#                     prefixes systemd searches (/usr/local, /usr), else /etc/systemd/system.
#   EGRESS_FENCE_BIN  install this binary instead of target/release/egress-fence (then
#                     nothing is built).
#
# The policy always goes to /etc/egress-fence/policy.yaml, the path the unit names, and an
# existing one is never overwritten: it is the administrator's.
set -euo pipefail
umask 022 # the staged tree gets the modes below whatever the caller's umask

repo="$(cd "$(dirname "$0")/.." && pwd)"
PREFIX="${PREFIX:-/usr/local}"
DESTDIR="${DESTDIR:-}"

die() {
  echo "install.sh: $*" >&2
  exit 1
}

# Creates a directory (and its parents) 0755; one that exists keeps its mode and owner.
ensure_dir() {
  [ -d "$1" ] || install -d -m 0755 "$1"
}

case "$PREFIX" in
  /*) ;;
  *) die "PREFIX must be an absolute path, not '$PREFIX'" ;;
esac
# The prefix ends up in ExecStart=, where whitespace splits the command line and % and $ are
# expanded, and in a sed replacement below.
case "$PREFIX" in
  *[[:space:]]* | *'|'* | *'&'* | *'\'* | *'%'* | *'$'*)
    die "PREFIX may not contain whitespace or any of | & \\ % \$: '$PREFIX'"
    ;;
esac
PREFIX="${PREFIX%/}"
[ -n "$PREFIX" ] || PREFIX=/ # "/" stays "/": the binary then goes to /bin

if [ -z "${UNITDIR:-}" ]; then
  case "$PREFIX" in
    /usr | /usr/local) UNITDIR="$PREFIX/lib/systemd/system" ;;
    # systemd would not find units under any other prefix.
    *) UNITDIR=/etc/systemd/system ;;
  esac
fi

if [ -z "$DESTDIR" ] && [ "$(id -u)" -ne 0 ]; then
  die "run as root to install into the system, or set DESTDIR to stage the files elsewhere"
fi

# --- The binary: the given one, or the release build (built if missing or older than the
# sources; when it is current, nothing needs cargo, so `sudo make install` works after `make`).
if [ -n "${EGRESS_FENCE_BIN:-}" ]; then
  bin="$EGRESS_FENCE_BIN"
  [ -x "$bin" ] || die "EGRESS_FENCE_BIN=$bin is not an executable file"
else
  bin="$repo/target/release/egress-fence"
  if [ ! -x "$bin" ] ||
    [ -n "$(find "$repo/src" "$repo/Cargo.toml" "$repo/Cargo.lock" -newer "$bin" -print -quit)" ]; then
    command -v cargo >/dev/null 2>&1 ||
      die "cargo is needed to build $bin: build it first (cargo build --release --locked) or set EGRESS_FENCE_BIN"
    echo "building the release binary"
    (cd "$repo" && cargo build --release --locked)
  fi
fi
# Fail here, not at boot, if the binary does not run on this machine or the shipped policy
# does not validate (`check` needs no network and no privileges).
"$bin" --version >/dev/null || die "$bin does not run"
"$bin" check "$repo/policies/default.yaml" >/dev/null ||
  die "the default policy does not validate with $bin"

bindir="$PREFIX/bin"
[ "$PREFIX" = / ] && bindir=/bin
policy_dir=/etc/egress-fence
policy="$policy_dir/policy.yaml"

# Installed through a temporary name and renamed, so a running daemon's binary is replaced,
# never written into (which would fail with "Text file busy").
ensure_dir "$DESTDIR$bindir"
install -m 0755 "$bin" "$DESTDIR$bindir/.egress-fence.new"
mv -f "$DESTDIR$bindir/.egress-fence.new" "$DESTDIR$bindir/egress-fence"
echo "installed $DESTDIR$bindir/egress-fence"

# --- The unit, with ExecStart= pointing at the binary just installed.
ensure_dir "$DESTDIR$UNITDIR"
unit="$DESTDIR$UNITDIR/egress-fence.service"
sed "s|/usr/local/bin/egress-fence|$bindir/egress-fence|g" \
  "$repo/systemd/egress-fence.service" >"$unit.new"
chmod 0644 "$unit.new"
mv -f "$unit.new" "$unit"
echo "installed $unit"

# --- The policy, only if there is none. World-readable: the service runs as a transient
# unprivileged user (DynamicUser=yes), and the policy lists destinations, not secrets.
ensure_dir "$DESTDIR$policy_dir"
if [ -e "$DESTDIR$policy" ] || [ -L "$DESTDIR$policy" ]; then
  echo "kept the existing policy $DESTDIR$policy (the default is $repo/policies/default.yaml)"
  "$bin" check "$DESTDIR$policy" >/dev/null ||
    echo "warning: $DESTDIR$policy does not validate: the service will refuse to start" >&2
else
  install -m 0644 "$repo/policies/default.yaml" "$DESTDIR$policy"
  echo "installed $DESTDIR$policy (the default policy: review it before enabling)"
fi

if [ -n "$DESTDIR" ]; then
  echo
  echo "staged under $DESTDIR; once the files are in place on the target system:"
fi
cat <<EOF

Check the policy, then enable the service:
  $bindir/egress-fence check $policy
  systemctl daemon-reload && systemctl enable --now egress-fence

Afterwards:
  systemctl reload egress-fence       # apply an edited policy (an invalid one is refused)
  journalctl -u egress-fence          # the daemon's log
  egress-fence status                 # the table in the kernel
EOF
