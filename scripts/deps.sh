#!/usr/bin/env bash
# Installs what egress-fence needs to build, test and demo on Debian 12: a C toolchain (the
# linker), the C libraries the nftnl and mnl crates link against, nftables (nft, the
# independent reader in tests), a real DNS server (dnsmasq), real clients (dig, nc, curl, ping),
# ipset (benchmark baseline), python3 (the demo's web servers), util-linux and mount (setpriv,
# unshare, nsenter, mount: the escape tests' adversaries and mount namespaces), systemd
# (systemd-analyze checks the unit), passt (pasta connects `exec`'s namespace), bubblewrap
# (`exec` composed with bwrap), dpkg-dev (dpkg-shlibdeps: the package's library dependencies)
# and cargo-deb (scripts/package.sh builds the Debian package; tests/package.rs checks it).
# Only what is missing is installed.
set -euo pipefail

packages=(
  gcc libc6-dev pkg-config libnftnl-dev libmnl-dev nftables
  dnsmasq-base dnsutils netcat-openbsd curl iputils-ping iproute2 ipset python3 util-linux mount procps
  systemd passt bubblewrap dpkg-dev
)

if [ "$(id -u)" -ne 0 ]; then
  echo "egress-fence: run this as root: it installs packages and makes network namespaces" >&2
  exit 1
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "egress-fence: cargo is missing; install a Rust toolchain (1.85 or newer, https://rustup.rs)" >&2
  exit 1
fi
# The test command also runs rustfmt and clippy, which a minimal toolchain may lack.
for tool in fmt clippy; do
  if ! cargo "$tool" --version >/dev/null 2>&1; then
    if command -v rustup >/dev/null 2>&1; then
      rustup component add "$( [ "$tool" = fmt ] && echo rustfmt || echo clippy )"
    else
      echo "egress-fence: cargo $tool is missing; install the rustfmt and clippy components" >&2
      exit 1
    fi
  fi
done
# cargo-deb builds the Debian package; installed once into ~/.cargo/bin (about 1.5 minutes of
# CPU to compile), kept there afterwards.
CARGO_DEB_VERSION=3.8.0
if ! cargo deb --version 2>/dev/null | grep -qF "$CARGO_DEB_VERSION"; then
  echo "installing cargo-deb $CARGO_DEB_VERSION"
  cargo install --locked --quiet cargo-deb --version "$CARGO_DEB_VERSION"
fi
