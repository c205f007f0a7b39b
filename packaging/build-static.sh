#!/usr/bin/env bash
# Builds a fully static, stripped claimd for x86_64 Linux:
#   ${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu/release/claimd
# glibc's static libc and the C++ runtime (libstdc++) are linked in, so the
# binary runs in an empty chroot. Prints the path on the last line.
#
# TLS to etcd (gRPC's secure core and the system OpenSSL, libssl-dev,
# linked in statically) is on by default, as packaged. CLAIMD_NO_TLS=1
# builds without it (plain-TCP etcd only). Sizes and build times:
# packaging/doc/performance.md.
# CLAIMD_FEATURES: more cargo features to build with.
set -euo pipefail
cd "$(dirname "$0")/.."
target=x86_64-unknown-linux-gnu
# Cargo builds into $CARGO_TARGET_DIR when it is set.
target_dir=${CARGO_TARGET_DIR:-target}
features=()
if [ -n "${CLAIMD_NO_TLS:-}" ]; then
  features+=(--no-default-features)
fi
if [ -n "${CLAIMD_FEATURES:-}" ]; then
  features+=(--features "$CLAIMD_FEATURES")
fi
RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release --locked --target "$target" --bin claimd "${features[@]}" >&2
bin="$target_dir/$target/release/claimd"
strip --strip-all --remove-section=.comment "$bin"
echo "$bin"
