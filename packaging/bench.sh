#!/usr/bin/env bash
# Benchmarks (as root: real mounts): builds the agent, the test plugin and
# the benchmark in release mode (the static build's target directory, so the
# gRPC core is compiled once for both), runs them on this machine, prints a
# table, and writes ${CARGO_TARGET_DIR:-target}/bench/results.json.
# The cluster part starts its own throwaway etcd on free loopback ports
# (Debian's etcd-server; ETCD=/path/to/etcd overrides the one on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
target=x86_64-unknown-linux-gnu
RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release --locked --target "$target" \
  --bin claimd --bin claimd-test-plugin --bin claimd-bench >&2
target_dir=${CARGO_TARGET_DIR:-target}
dir="$target_dir/$target/release"
# The agent runs stripped, as build-static.sh ships it, so the size the
# bench reports is the shipped one.
mkdir -p "$target_dir/bench"
strip -o "$target_dir/bench/claimd" "$dir/claimd"
etcd_args=()
etcd_bin=${ETCD:-$(command -v etcd || true)}
if [ -n "$etcd_bin" ]; then
  etcd_args=(--etcd "$etcd_bin")
fi
"$dir/claimd-bench" ${etcd_args[@]+"${etcd_args[@]}"} --agent "$target_dir/bench/claimd" --plugin "$dir/claimd-test-plugin" \
  --out "$target_dir/bench/results.json" "$@"
# The container-start ratio: a claimd volume against a local one, on a
# throwaway dockerd (needs docker.io and busybox-static); a full run only,
# not with --only.
only=
for arg in "$@"; do
  if [ "$arg" = --only ]; then only=1; fi
done
if [ -n "$only" ]; then
  echo "bench: docker part skipped (--only)" >&2
elif command -v dockerd >/dev/null && [ -x /bin/busybox ]; then
  bash packaging/bench-docker.sh "$target_dir/bench/claimd" "$dir/claimd-test-plugin" 20 \
    "$target_dir/bench/docker.json"
else
  echo "bench: docker part skipped (apt-get install docker.io busybox-static)" >&2
fi
