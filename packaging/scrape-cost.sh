#!/usr/bin/env bash
# Run as root on a built static release (packaging/bench.sh builds it):
#   CARGO_TARGET_DIR=... N=1000 bash packaging/scrape-cost.sh
# Used for the figures of the metrics cost in packaging/doc/performance.md.
# Idle RSS and scrape cost with 1000 allocations, metrics_listen on and off.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu/release
N=${N:-1000}
D=$(mktemp -d /tmp/scrape.XXXXXX)
P=$D/plugin; mkdir -p $P/root/volumes $D/mounts
cleanup() {
  kill -9 $(jobs -p) 2>/dev/null || true
  sleep 0.5
  awk -v d="$D/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  rm -rf "$D"
}
trap cleanup EXIT
$R/claimd-test-plugin --endpoint $P/csi.sock --root $P/root 2>$D/plugin.log &
for i in $(seq 1 $N); do mkdir -p $P/root/volumes/ext-v$i; done
PORT=$((20000 + RANDOM % 20000))
cfg() {
  jq -n --arg d "$D" --arg p "$P" --arg m "$1" '{state_dir: ($d+"/state"), api_socket: ($d+"/api.sock"),
    mount_root: ($d+"/mounts"), plugins: [{id: "tp", type: "monolith", socket: ($p+"/csi.sock")}]}
    + (if $m == "" then {} else {metrics_listen: $m} end)' > $D/config.json
}
start() { $R/claimd agent --config $D/config.json 2>>$D/agent.log & AGENT=$!;
  for _ in $(seq 1 200); do [ -S $D/api.sock ] && $R/claimd --socket $D/api.sock plugin list >/dev/null 2>&1 && break; sleep 0.05; done; }
rss() { awk '/VmRSS/ {print $2}' /proc/$AGENT/status; }
cfg "127.0.0.1:$PORT"; start
echo "idle RSS, metrics_listen on, 0 allocations: $(rss) KiB"
jq -n --argjson n $N '[range(1; $n + 1) | {id: ("v" + tostring), plugin_id: "tp", external_id: ("ext-v" + tostring),
  access_modes: ["single-node-writer"], attachment_modes: ["file-system"]}]' | $R/claimd --socket $D/api.sock volume register - >/dev/null
for _ in $(seq 1 100); do $R/claimd --socket $D/api.sock plugin list --json | grep -q '"ready"' && break; sleep 0.1; done
for i in $(seq 1 $N); do $R/claimd --socket $D/api.sock alloc mount a$i --volume data=v$i >/dev/null; done
sleep 1
echo "RSS with $N allocations, metrics_listen on: $(rss) KiB"
bytes=$(curl -s http://127.0.0.1:$PORT/metrics | wc -c)
t=$( { for _ in $(seq 1 20); do curl -s -o /dev/null -w '%{time_total}\n' http://127.0.0.1:$PORT/metrics; done; } | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
echo "scrape of GET /metrics with $N allocations: median of 20 ${t}s, $bytes bytes"
tc=$( { for _ in $(seq 1 10); do s=$(date +%s%N); $R/claimd --socket $D/api.sock metrics >/dev/null; e=$(date +%s%N); echo $(( (e-s)/1000 )); done; } | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
echo "claimd metrics over the API socket (CLI process included): median of 10 ${tc} us"
echo "RSS after the scrapes: $(rss) KiB"
kill -TERM $AGENT; wait $AGENT || true
cfg ""; start
sleep 1
echo "RSS with $N allocations after a restart, metrics_listen off: $(rss) KiB"
kill -TERM $AGENT; wait $AGENT || true
cfg "127.0.0.1:$PORT"; start
sleep 1
echo "RSS with $N allocations after a restart, metrics_listen on: $(rss) KiB"
