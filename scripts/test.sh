#!/usr/bin/env bash
# Installs what is missing, then runs every test: unit tests (no root needed) and the
# integration tests, which build throwaway network namespaces with a real DNS server and
# real clients and apply rules only there. Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/deps.sh
cargo fmt --check
cargo clippy --all-targets --locked -- -D warnings
cargo test --locked
