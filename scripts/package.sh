#!/usr/bin/env bash
# Builds the Debian package, target/debian/egress-fence_VERSION-1_ARCH.deb, with cargo-deb
# (`cargo install cargo-deb`; scripts/deps.sh installs it): the binary, the systemd unit
# (neither enabled nor started), the guard drop-in, the default policy as a conffile, the
# policy's JSON Schema, man pages and shell completions.
#
#   ./scripts/package.sh                      # builds the release binary first
#   EGRESS_FENCE_BIN=path ./scripts/package.sh --fast -o DIR
#
# Arguments go to `cargo deb` (e.g. --fast, -o DIR). EGRESS_FENCE_BIN packages that binary
# instead of building one (the tests package the binary they test).
#
# Everything Cargo.toml's [package.metadata.deb] takes from target/package/ is staged here:
# the binary, unit and policy by scripts/install.sh for PREFIX=/usr (so the unit's ExecStart=
# is the packaged /usr/bin/egress-fence, rewritten exactly as `make install` rewrites it), and
# the man pages and completions by the binary itself, from its clap definitions: they say
# what `--help` says, and nothing generated is kept in the repository.
set -euo pipefail
umask 022

repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"

die() {
  echo "package.sh: $*" >&2
  exit 1
}

command -v cargo-deb >/dev/null 2>&1 ||
  die "cargo-deb is missing: cargo install --locked cargo-deb (or run scripts/deps.sh)"

if [ -n "${EGRESS_FENCE_BIN:-}" ]; then
  bin="$EGRESS_FENCE_BIN"
else
  cargo build --release --locked
  bin="$repo/target/release/egress-fence"
fi
[ -x "$bin" ] || die "$bin is not an executable file"

stage="$repo/target/package"
rm -rf "$stage"
mkdir -p "$stage/maintainer-scripts"
DESTDIR="$stage/root" PREFIX=/usr EGRESS_FENCE_BIN="$bin" "$repo/scripts/install.sh" >/dev/null
# Debian ships binaries without debug information (dh_strip's options).
strip --remove-section=.comment --remove-section=.note --strip-unneeded \
  "$stage/root/usr/bin/egress-fence"
"$stage/root/usr/bin/egress-fence" package-assets "$stage/assets"

cargo deb --no-build --locked "$@"
