#!/usr/bin/env bash
# Checks what ships, on this machine, as root:
#  1. the static binary: `file` says static, `ldd` finds nothing, and it runs
#     --version and a whole register/mount/release cycle inside an empty
#     chroot (with the static test plugin beside it);
#  2. the Debian package: contents, control data, conffiles, lintian;
#  3. install into a throwaway root (dpkg --root), run the installed binary;
#  4. upgrade over a running agent with mounted allocations: every mount and
#     claim stays, and the restart with the new binary costs no CSI call;
#  5. remove keeps config and state; purge removes them.
# Run by .ci/run after the test suite. Prints what it checked.
set -euo pipefail
cd "$(dirname "$0")/.."

target=x86_64-unknown-linux-gnu
say() { printf '== %s\n' "$*"; }
fail() {
  printf 'check-package: FAILED: %s\n' "$*" >&2
  exit 1
}

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(g++)
# The package is built with TLS to etcd: OpenSSL's static libraries.
[ -f /usr/include/openssl/ssl.h ] || need+=(libssl-dev)
command -v lintian >/dev/null || need+=(lintian)
command -v jq >/dev/null || need+=(jq)
command -v file >/dev/null || need+=(file)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

work=$(mktemp -d /tmp/claimd-package.XXXXXX)
pids=()
cleanup() {
  local rc=$?
  for p in "${pids[@]:-}"; do
    [ -n "$p" ] && kill -9 "$p" 2>/dev/null || true
  done
  # Lazily unmount anything left below the work dir, deepest first.
  awk -v d="$work/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r |
    while read -r m; do umount -l "$m" 2>/dev/null || true; done
  rm -rf "$work"
  [ $rc -eq 0 ] || echo "check-package: failed (exit $rc)" >&2
}
trap cleanup EXIT

# wait_for SECONDS DESCRIPTION COMMAND...: polls COMMAND until it succeeds.
wait_for() {
  local secs=$1 what=$2
  shift 2
  local end=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || fail "timed out after ${secs}s waiting for $what"
    sleep 0.1
  done
}

is_mount_point() { awk -v p="$1" '$5 == p {found=1} END {exit !found}' /proc/self/mountinfo; }
mounts_under() { awk -v d="$1/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort; }

# ---- 1. the static binary ---------------------------------------------------
say "building the static binary and the static test plugin"
bin=$(packaging/build-static.sh | tail -1)
RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release --locked --target "$target" --bin claimd-test-plugin >&2
plugin_bin="${CARGO_TARGET_DIR:-target}/$target/release/claimd-test-plugin"
file "$bin" | tee /dev/stderr | grep -q 'static-pie linked\|statically linked' || fail "$bin is not static"
if ldd "$bin" 2>&1 | grep -q '=>'; then fail "ldd finds dynamic dependencies in $bin"; fi
size=$(stat -c %s "$bin")
say "static binary: $bin, $size bytes ($((size / 1024)) KiB), stripped"

say "a whole cycle inside an empty chroot"
root="$work/chroot"
mkdir -p "$root/proc" "$root/run" "$root/data" "$root/etc"
cp "$bin" "$root/claimd"
cp "$plugin_bin" "$root/claimd-test-plugin"
mount -t proc proc "$root/proc"
[ "$(chroot "$root" /claimd --version)" = "claimd $(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)" ] ||
  fail "--version in the chroot"
cat >"$root/etc/config.json" <<'EOF'
{"state_dir": "/data/state", "api_socket": "/run/claimd.sock", "mount_root": "/data/mounts",
 "plugins": [{"id": "hp", "type": "monolith", "socket": "/run/plugin.sock"}],
 "probe_interval": "200ms", "csi_call_timeout": "5s"}
EOF
cat >"$root/etc/vol.json" <<'EOF'
{"id": "db", "plugin_id": "hp", "external_id": "vol-db",
 "access_modes": ["single-node-writer"], "attachment_modes": ["file-system"]}
EOF
# The volume exists in the plugin's storage (it refuses unknown volume IDs).
mkdir -p "$root/data/plugin/volumes/vol-db"
chroot "$root" /claimd-test-plugin --endpoint /run/plugin.sock --root /data/plugin \
  --call-log /data/calls.jsonl 2>"$work/chroot-plugin.log" &
pids+=($!)
chroot "$root" /claimd agent --config /etc/config.json 2>"$work/chroot-agent.log" &
agent_pid=$!
pids+=($agent_pid)
wait_for 30 "the agent's socket in the chroot" test -S "$root/run/claimd.sock"
c() { chroot "$root" /claimd --socket /run/claimd.sock "$@"; }
c volume register /etc/vol.json >/dev/null
path=$(c alloc mount a1 --volume data=db --json | jq -r '.volumes[0].host_path')
is_mount_point "$root$path" || fail "$path is not mounted after the mount in the chroot"
c alloc release a1 --wait 20s >/dev/null
[ -z "$(mounts_under "$root/data/mounts")" ] || fail "mounts left after the release in the chroot"
methods=$(jq -r 'select(.method | test("Volume$")) | .method' "$root/data/calls.jsonl" | tr '\n' ' ')
[ "$methods" = "ControllerPublishVolume NodeStageVolume NodePublishVolume NodeUnpublishVolume NodeUnstageVolume ControllerUnpublishVolume " ] ||
  fail "chroot call log: $methods"
kill -TERM "$agent_pid"
wait "$agent_pid" || fail "the agent in the chroot did not exit cleanly"
umount "$root/proc"
say "chroot cycle: $methods"

# ---- 2. the package ----------------------------------------------------------
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
newer="$version+upgrade1"
say "building claimd_${version} and claimd_${newer}"
deb=$(CLAIMD_BIN="$bin" packaging/build-deb.sh | tail -1)
deb2=$(CLAIMD_BIN="$bin" VERSION="$newer" packaging/build-deb.sh | tail -1)
contents=$(dpkg-deb -c "$deb" | awk '{print $6}' | grep -v '/$' | sort | tr '\n' ' ')
docs=$(cd packaging && { ls doc/*.md | sed 's|^doc/||'; echo CHANGELOG.md; ls examples/*.json; } |
  sed 's|^|./usr/share/doc/claimd/|' | sort | tr '\n' ' ')
expected=$(printf '%s\n' ./etc/claimd/config.json ./lib/systemd/system/claimd.service ./usr/bin/claimd \
  ./usr/share/doc/claimd/changelog.gz ./usr/share/doc/claimd/copyright ./usr/share/lintian/overrides/claimd \
  ./usr/share/man/man8/claimd.8.gz $docs | sort | tr '\n' ' ')
[ "$contents" = "$expected" ] || fail "package contents: $contents (expected $expected)"
[ "$(dpkg-deb -f "$deb" Package Version Architecture | tr '\n' ' ')" = "Package: claimd Version: $version Architecture: amd64 " ] ||
  fail "control fields: $(dpkg-deb -f "$deb" Package Version Architecture)"
dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles | grep -qx /etc/claimd/config.json || fail "config is not a conffile"
say "package contents: $contents"
lint=$(lintian "$deb" 2>&1 | grep -v 'running with root privileges' || true)
if printf '%s\n' "$lint" | grep -q '^[EW]:'; then fail "lintian: $lint"; fi
say "lintian: clean (errors and warnings; overrides in packaging/debian/lintian-overrides)"
# The man page renders without a warning from groff.
man_warnings=$(dpkg-deb --fsys-tarfile "$deb" | tar -xO ./usr/share/man/man8/claimd.8.gz | gzip -dc |
  LC_ALL=C.UTF-8 MANWIDTH=80 man --warnings -l - 2>&1 >/dev/null || true)
[ -z "$man_warnings" ] || fail "man -l of claimd.8: $man_warnings"
say "man page: renders with no warning"

# ---- 3. install into a throwaway root ---------------------------------------
say "installing into a throwaway root"
t="$work/root"
mkdir -p "$t/var/lib/dpkg/info" "$t/var/lib/dpkg/updates" "$t/var/lib/dpkg/triggers"
touch "$t/var/lib/dpkg/status"
dp() { dpkg --root="$t" --force-script-chrootless --force-not-root --log=/dev/null "$@"; }
dp -i "$deb" >/dev/null
[ "$("$t/usr/bin/claimd" --version)" = "claimd $version" ] || fail "installed binary --version"
[ "$(stat -c %a "$t/var/lib/claimd")" = 700 ] || fail "postinst did not create /var/lib/claimd with mode 0700"
jq -e . "$t/etc/claimd/config.json" >/dev/null || fail "installed config is not JSON"
say "installed: $("$t/usr/bin/claimd" --version)"
if command -v systemd-analyze >/dev/null; then
  # The unit as installed, pointed at the installed binary (the host's
  # /usr/bin has no claimd).
  sed "s|/usr/bin/claimd |$t/usr/bin/claimd |" "$t/lib/systemd/system/claimd.service" >"$work/claimd.service"
  systemd-analyze verify --man=no "$work/claimd.service" || fail "systemd-analyze verify of the unit"
  say "systemd-analyze verify: the unit is valid"
fi
unit="$t/lib/systemd/system/claimd.service"
# Documentation= names files the package installs.
for d in $(sed -n 's/^Documentation=//p' "$unit"); do
  case "$d" in
  file://*) [ -f "$t${d#file://}" ] || fail "Documentation=$d is not installed" ;;
  esac
done
# The packaged plugin_dir must survive `systemctl stop`: when it lies under
# the unit's RuntimeDirectory, systemd deletes that directory at stop
# unless RuntimeDirectoryPreserve=yes (restart alone keeps it only across
# restarts).
plugin_dir=$(jq -r '.plugin_dir // empty' "$t/etc/claimd/config.json")
runtime_dir=/run/$(sed -n 's/^RuntimeDirectory=//p' "$unit")
case "$plugin_dir/" in
"$runtime_dir"/*)
  grep -qx 'RuntimeDirectoryPreserve=yes' "$unit" ||
    fail "plugin_dir $plugin_dir is under RuntimeDirectory $runtime_dir, which a stop deletes"
  ;;
esac
say "unit: Documentation= installed; plugin_dir ${plugin_dir:-none} kept across a stop"

# ---- 4. upgrade over a running agent ----------------------------------------
say "upgrade over a running agent with mounted allocations"
p="$work/plugin"
mkdir -p "$p"
"$plugin_bin" --endpoint "$p/csi.sock" --root "$p/root" --call-log "$p/calls.jsonl" 2>"$work/plugin.log" &
pids+=($!)
cfg="$t/etc/claimd/config.json"
# An operator's edit of the conffile must survive the upgrade.
cat >"$cfg" <<EOF
{"state_dir": "$t/var/lib/claimd", "api_socket": "$t/run/claimd/claimd.sock",
 "mount_root": "$t/var/lib/claimd/mounts",
 "plugins": [{"id": "hp", "type": "monolith", "socket": "$p/csi.sock"}],
 "probe_interval": "200ms", "csi_call_timeout": "5s"}
EOF
cfg_sum=$(sha256sum <"$cfg")
start_agent() {
  "$t/usr/bin/claimd" agent --config "$cfg" 2>>"$work/agent.log" &
  agent_pid=$!
  pids+=($agent_pid)
  wait_for 30 "the installed agent's socket" "$t/usr/bin/claimd" --socket "$t/run/claimd/claimd.sock" plugin list
}
cli() { "$t/usr/bin/claimd" --socket "$t/run/claimd/claimd.sock" "$@"; }
start_agent
for i in 1 2 3; do
  mkdir -p "$p/root/volumes/ext-v$i"
  printf '{"id":"v%s","plugin_id":"hp","external_id":"ext-v%s","access_modes":["single-node-writer"],"attachment_modes":["file-system"]}' "$i" "$i" |
    cli volume register - >/dev/null
  cli alloc mount "a$i" --volume "data=v$i" >/dev/null
done
mounts_before=$(awk -v d="$t/var/lib/claimd/mounts/" 'index($5, d) == 1 {print $1, $5}' /proc/self/mountinfo | sort)
# The running agent's claims: the snapshot with the journal replayed.
claims_before=$("$t/usr/bin/claimd" state --state-dir "$t/var/lib/claimd" | jq -c '.claims')
calls_before=$(wc -l <"$p/calls.jsonl")
[ "$(printf '%s\n' "$mounts_before" | wc -l)" = 6 ] || fail "expected 6 mounts (3 staging + 3 targets): $mounts_before"

dp -i "$deb2" >/dev/null
# Both packages carry this build's binary; the package version tells them apart.
[ "$(dp -s claimd | sed -n 's/^Version: //p')" = "$newer" ] || fail "the upgrade did not install $newer"
[ "$(sha256sum <"$cfg")" = "$cfg_sum" ] || fail "the upgrade changed the edited conffile"
# What the unit's restart does: stop the old agent, start the new binary.
kill -TERM "$agent_pid"
wait "$agent_pid" || fail "the old agent did not stop cleanly"
start_agent
published=$(cli alloc status --json | jq '[.allocs[].volumes[] | select(.phase == "published")] | length')
[ "$published" = 3 ] || fail "after the upgrade $published of 3 volumes are published"
mounts_after=$(awk -v d="$t/var/lib/claimd/mounts/" 'index($5, d) == 1 {print $1, $5}' /proc/self/mountinfo | sort)
[ "$mounts_after" = "$mounts_before" ] || fail "mounts changed across the upgrade: $mounts_after"
[ "$("$t/usr/bin/claimd" state --state-dir "$t/var/lib/claimd" | jq -c '.claims')" = "$claims_before" ] || fail "claims changed across the upgrade"
[ "$(echo "$claims_before" | jq length)" = 3 ] || fail "expected 3 claims: $claims_before"
new_calls=$(tail -n +"$((calls_before + 1))" "$p/calls.jsonl" | jq -r 'select(.method | test("Volume$")) | .method' | wc -l)
[ "$new_calls" = 0 ] || fail "the restart after the upgrade sent $new_calls volume calls"
say "upgrade $version -> $newer: 6 mounts with the same mount IDs, claims unchanged, 0 CSI volume calls"

for i in 1 2 3; do cli alloc release "a$i" --wait 20s >/dev/null; done
[ -z "$(mounts_under "$t/var/lib/claimd/mounts")" ] || fail "mounts left after the releases"
kill -TERM "$agent_pid"
wait "$agent_pid" || fail "the agent did not stop cleanly"

# ---- 5. remove and purge ------------------------------------------------------
dp -r claimd >/dev/null
[ ! -e "$t/usr/bin/claimd" ] || fail "remove left the binary"
[ -f "$cfg" ] || fail "remove deleted the conffile"
[ -f "$t/var/lib/claimd/state.json" ] || fail "remove deleted the state"
[ -f "$t/var/lib/claimd/state.journal" ] || fail "remove deleted the state journal"
dp --purge claimd >/dev/null
[ ! -e "$cfg" ] || fail "purge left the conffile"
[ ! -e "$t/var/lib/claimd/state.json" ] || fail "purge left the state file"
[ ! -e "$t/var/lib/claimd/state.journal" ] || fail "purge left the state journal"
say "remove keeps config and state; purge removes them"
say "check-package: all checks passed"
