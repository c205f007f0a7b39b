#!/usr/bin/env bash
# The whole test suite: the README's test command. Run as root (the tests do
# real mounts). Installs what a fresh Debian machine lacks, then checks
# formatting and lints and runs every test (unit, integration, restart
# scripts).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "tests/run.sh: run as root: the tests mount and unmount for real" >&2
  exit 2
fi

# Set-up: grpcio's C core builds with cmake and a C++ compiler; the restart
# scripts use jq and findmnt; tests/etcd_client.rs starts throwaway members
# of Debian's etcd (package etcd-server: it starts no daemon of its own here,
# and the tests never use a default instance).
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(g++)
command -v jq >/dev/null || need+=(jq)
command -v findmnt >/dev/null || need+=(util-linux)
[ -x /usr/bin/etcd ] || need+=(etcd-server)
# promtool and prometheus: the metrics tests check the text and scrape it.
command -v promtool >/dev/null || need+=(prometheus)
if [ ${#need[@]} -gt 0 ]; then
  echo "tests/run.sh: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

cargo fmt --all -- --check
# Both builds must be clean: the shipped one and the one with failpoints.
cargo clippy --locked --all-targets -- -D warnings
cargo clippy --locked --all-targets --features failpoints -- -D warnings
# The restart scripts (tests/restart/*.sh, run by tests/restart.rs) kill the
# agent at named failpoints, which only a `failpoints` build has.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --locked --features failpoints 2>&1 | tee "$log"
# One closing line for the whole suite (cargo prints one per test binary).
awk '/^test result:/ {p += $4; f += $6} END {printf "tests: %d passed, %d failed\n", p, f}' "$log"
