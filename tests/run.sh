#!/usr/bin/env bash
# The whole test suite: the test command the README names. Run as root (the tests do
# real mounts). Installs what a fresh Debian machine lacks, then checks
# formatting and lints and runs every test (unit, integration, restart
# scripts).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "tests/run.sh: run as root: the tests mount and unmount for real" >&2
  exit 2
fi

# Set-up: grpcio's C core builds with cmake and a C++ compiler, and with
# the `tls` feature links the system OpenSSL (libssl-dev); the restart
# scripts use jq and findmnt; the cluster and docker tests start throwaway
# members of Debian's etcd (package etcd-server: it starts no daemon of its
# own here, and the tests never use a default instance); tests/cluster/tls.rs
# makes its certificates with the openssl CLI.
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(g++)
[ -f /usr/include/openssl/ssl.h ] || need+=(libssl-dev)
command -v openssl >/dev/null || need+=(openssl)
command -v jq >/dev/null || need+=(jq)
command -v findmnt >/dev/null || need+=(util-linux)
[ -x /usr/bin/etcd ] || need+=(etcd-server)
# promtool and prometheus: the metrics tests check the text and scrape it.
command -v promtool >/dev/null || need+=(prometheus)
# tests/docker/: real Docker and Podman (with runc), and busybox-static for
# the image it imports.
[ -x /usr/sbin/dockerd ] || need+=(docker.io)
[ -x /usr/bin/podman ] || need+=(podman)
[ -x /usr/sbin/runc ] || need+=(runc)
dpkg -s busybox-static >/dev/null 2>&1 || need+=(busybox-static)
# tests/cluster/partial_failures/ skews one agent's wall clock with
# libfaketime.
[ -f /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || need+=(faketime)
if [ ${#need[@]} -gt 0 ]; then
  echo "tests/run.sh: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

cargo fmt --all -- --check
# Every cargo command builds with `tls` (TLS to etcd), so that grpcio-sys's
# C core, the longest part of the build, is built once with one feature set
# and the TLS code and tests/cluster/tls.rs are checked and run. Both builds
# must be clean: the shipped one (plus tls) and the one with failpoints.
cargo clippy --locked --all-targets --features tls -- -D warnings
cargo clippy --locked --all-targets --features tls,failpoints -- -D warnings
# The restart scripts (tests/local/restart/*.sh, run by the `local` test
# binary's `restart` module) kill the agent at named failpoints, which only
# a `failpoints` build has.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# --no-fail-fast: a failing test binary does not keep the others from
# running. cargo's status is taken through the pipe (pipefail) without
# stopping the script (set -e), so that the closing line is printed first.
status=0
cargo test --locked --no-fail-fast --features tls,failpoints 2>&1 | tee "$log" || status=$?
# One closing line for the whole suite (cargo prints one per test binary).
awk '/^test result:/ {p += $4; f += $6; n += 1}
     END {printf "tests: %d passed, %d failed (%d test targets)\n", p, f, n}' "$log"
if [ "$status" -ne 0 ]; then
  # A binary that crashed or did not build has no `test result:` line:
  # cargo's own list of failed targets (above) names it.
  echo "tests/run.sh: cargo test failed (exit status $status)" >&2
  exit "$status"
fi
