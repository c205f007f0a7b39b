#!/usr/bin/env bash
# Quickstart demo, as root on a Debian machine: installs what is missing,
# builds claimd and its test CSI plugin, and shows the main job:
#   register a volume -> mount it for an allocation -> status ->
#   the agent is killed and restarted (zero remounts, zero CSI calls) ->
#   release -> graceful stop.
# The agent runs in --dev mode beside a real CSI plugin process (the test
# plugin, which bind-mounts directories), on real mounts.
# `demo.sh --docker` shows the same job with real containers instead
# (packaging/demo-docker.sh). CLAIMD_BIN and PLUGIN_BIN use binaries built
# already instead of building.
set -euo pipefail
cd "$(dirname "$0")/.."
docker_demo=no
[ "${1:-}" = --docker ] && docker_demo=yes

if [ "$(id -u)" -ne 0 ]; then
  echo "demo: run as root: claimd and its plugin mount for real" >&2
  exit 2
fi
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(g++)
command -v jq >/dev/null || need+=(jq)
[ -f /usr/include/openssl/ssl.h ] || need+=(libssl-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "demo: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
target_dir=$(realpath -m "${CARGO_TARGET_DIR:-target}")
claimd=${CLAIMD_BIN:-$target_dir/debug/claimd}
plugin_bin=${PLUGIN_BIN:-$target_dir/debug/claimd-test-plugin}
if [ -z "${CLAIMD_BIN:-}" ]; then
  # The test command's features and profile: tests/run.sh reuses this
  # build (gRPC's C core is compiled once, for both).
  echo "demo: building (the first build compiles gRPC's C core with TLS: about 20 minutes on two cores; tests/run.sh reuses it)"
  cargo build --locked --features tls,failpoints --bin claimd --bin claimd-test-plugin 2>&1 | tail -1
fi
demo=$(mktemp -d /tmp/claimd-demo.XXXXXX)
export TMPDIR=$demo # the --dev state lives in $TMPDIR/claimd-dev
agent_pid="" plugin_pid=""
cleanup() {
  [ -n "$agent_pid" ] && kill -9 "$agent_pid" 2>/dev/null || true
  [ -n "$plugin_pid" ] && kill -9 "$plugin_pid" 2>/dev/null || true
  awk -v d="$demo/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r |
    while read -r m; do umount -l "$m"; done
  rm -rf "$demo"
}
trap cleanup EXIT
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
wait_for() { # SECONDS WHAT COMMAND...
  local end=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || { echo "demo: timed out waiting for $what" >&2; exit 1; }
    sleep 0.1
  done
}
volume_calls() { jq -r 'select(.method | test("Volume$")) | .method' "$demo/plugin/calls.jsonl" 2>/dev/null | wc -l; }
if [ "$docker_demo" = yes ]; then
  # shellcheck source=packaging/demo-docker.sh
  source packaging/demo-docker.sh
  exit 0
fi

step "a CSI plugin (claimd-test-plugin) on $demo/plugin/csi.sock"
mkdir -p "$demo/plugin"
"$plugin_bin" --endpoint "$demo/plugin/csi.sock" --root "$demo/plugin/root" \
  --call-log "$demo/plugin/calls.jsonl" --node-id demo-node 2>"$demo/plugin.log" &
plugin_pid=$!
disown "$plugin_pid" # killed by the cleanup; no job-control noise
cat >"$demo/config.json" <<EOF
{"api_socket": "$demo/claimd.sock",
 "plugins": [{"id": "hostpath", "type": "monolith", "socket": "$demo/plugin/csi.sock"}],
 "probe_interval": "1s"}
EOF
export CLAIMD_SOCKET=$demo/claimd.sock
start_agent() {
  "$claimd" agent --dev --config "$demo/config.json" 2>>"$demo/agent.log" &
  agent_pid=$!
  wait_for 60 "the agent" "$claimd" plugin list
}
step "the agent: claimd agent --dev --config $demo/config.json"
start_agent
"$claimd" plugin list

step "create a volume in the plugin's storage, and register it"
# The test plugin, like a real one, knows only the volumes that exist in
# its storage (a directory under its root).
mkdir -p "$demo/plugin/root/volumes/vol-db"
cat >"$demo/volume.json" <<'EOF'
{"id": "db", "plugin_id": "hostpath", "external_id": "vol-db",
 "access_modes": ["single-node-writer"], "attachment_modes": ["file-system"]}
EOF
cat "$demo/volume.json"
"$claimd" volume register "$demo/volume.json"

step "mount it for allocation web-1: claimd alloc mount web-1 --volume data=db"
"$claimd" alloc mount web-1 --volume data=db
path=$("$claimd" alloc status web-1 --json | jq -r '.allocs[0].volumes[0].host_path')
echo "hello from web-1" >"$path/greeting"
echo "wrote $path/greeting; the plugin's volume holds: $(cat "$demo/plugin/root/volumes/vol-db/greeting")"
findmnt -rn -o TARGET,SOURCE | grep "$demo/claimd-dev" || true

step "status"
"$claimd" alloc status

step "kill the agent (SIGKILL, like a crash or an upgrade) and start it again"
before=$(volume_calls)
kill -9 "$agent_pid"
wait "$agent_pid" 2>/dev/null || true
start_agent
after=$(volume_calls)
"$claimd" alloc status
echo "CSI volume calls during the restart: $((after - before)) (the mount was still there: nothing to redo)"
echo "the file is still there: $(cat "$path/greeting")"

step "release: claimd alloc release web-1 --wait 30s"
"$claimd" alloc release web-1 --wait 30s
echo "plugin calls, in order:"
jq -r 'select(.method | test("Volume$")) | "  \(.method) \(.volume_id) \(.code)"' "$demo/plugin/calls.jsonl"

step "graceful stop (SIGTERM)"
kill -TERM "$agent_pid"
wait "$agent_pid"
agent_pid=""
left=$(awk -v d="$demo/" 'index($5, d) == 1' /proc/self/mountinfo | grep -vc "/plugin/" || true)
echo "mounts left: $left"
step "done: the demo cleans up $demo"
