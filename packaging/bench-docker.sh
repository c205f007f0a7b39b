#!/usr/bin/env bash
# The container-start benchmark (as root): `docker run --rm -v VOL:/data
# IMAGE true` with a claimd volume against a local volume, alternating, on
# one throwaway dockerd (vfs, no network) beside one agent and the test
# plugin. Prints the medians and their ratio, and writes OUT as JSON.
#   bench-docker.sh CLAIMD PLUGIN [RUNS] [OUT]
# packaging/bench.sh runs it with the release binaries.
set -euo pipefail
claimd=$1 plugin_bin=$2 runs=${3:-20} out=${4:-}
command -v dockerd >/dev/null || { echo "bench-docker: needs docker.io" >&2; exit 2; }
[ -x /bin/busybox ] || { echo "bench-docker: needs busybox-static" >&2; exit 2; }
dir=$(mktemp -d /tmp/claimd-bench-docker.XXXXXX)
driver=claimd-bench-$$
export DOCKER_HOST=unix://$dir/docker.sock
pids=()
cleanup() {
  docker ps -aq 2>/dev/null | xargs -r docker rm -f >/dev/null 2>&1 || true
  for p in "${pids[@]}"; do
    kill -TERM "$p" 2>/dev/null || true
    for _ in $(seq 200); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  awk -v d="$dir/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r |
    while read -r m; do umount -l "$m"; done
  rm -f "/run/docker/plugins/$driver.sock"
  rm -rf "$dir"
}
trap cleanup EXIT
wait_for() { local end=$((SECONDS + 60)); until "$@" >/dev/null 2>&1; do
  [ $SECONDS -lt $end ] || { echo "bench-docker: timed out: $*" >&2; exit 1; }; sleep 0.1; done; }

mkdir -p "$dir/plugin/root/volumes/vol-bench" "$dir/rootfs/bin"
"$plugin_bin" --endpoint "$dir/plugin/csi.sock" --root "$dir/plugin/root" 2>"$dir/plugin.log" &
pids+=($!)
cat >"$dir/config.json" <<EOF
{"state_dir": "$dir/state", "api_socket": "$dir/claimd.sock", "mount_root": "$dir/mounts",
 "plugins": [{"id": "hostpath", "type": "monolith", "socket": "$dir/plugin/csi.sock"}],
 "docker": {"driver": "$driver"}}
EOF
RUST_LOG=warn "$claimd" agent --config "$dir/config.json" 2>"$dir/agent.log" &
pids+=($!)
dockerd --data-root "$dir/data" --exec-root "$dir/exec" --pidfile "$dir/dockerd.pid" \
  -H "$DOCKER_HOST" --iptables=false --ip6tables=false --bridge=none \
  --storage-driver=vfs 2>"$dir/dockerd.log" &
pids=("$!" "${pids[@]}") # dockerd stops first
wait_for docker version
wait_for "$claimd" --socket "$dir/claimd.sock" plugin list
cp /bin/busybox "$dir/rootfs/bin/"
ln -s busybox "$dir/rootfs/bin/true"
tar -C "$dir/rootfs" -cf "$dir/image.tar" .
docker import "$dir/image.tar" claimd-bench-busybox >/dev/null
docker volume create --driver "$driver" --opt plugin_id=hostpath --opt external_id=vol-bench csi >/dev/null
docker volume create local >/dev/null

ms() { # VOLUME: one container start and stop, in milliseconds
  local t0 t1
  t0=$(date +%s%N)
  docker run --rm --network none -v "$1:/data" claimd-bench-busybox /bin/true
  t1=$(date +%s%N)
  echo $(((t1 - t0) / 1000000))
}
ms csi >/dev/null
ms local >/dev/null
csi=() loc=()
for _ in $(seq "$runs"); do
  csi+=("$(ms csi)")
  loc+=("$(ms local)")
done
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
mc=$(median "${csi[@]}")
ml=$(median "${loc[@]}")
ratio=$(awk -v c="$mc" -v l="$ml" 'BEGIN {printf "%.2f", c / l}')
printf 'docker run --rm -v VOL:/data IMAGE true, %s runs each, alternating\n' "$runs"
printf '  %-22s median %6s ms\n' "claimd volume" "$mc" "local volume" "$ml"
printf '  ratio claimd/local    %s\n' "$ratio"
if [ -n "$out" ]; then
  printf '{"runs": %s, "claimd_ms": [%s], "local_ms": [%s], "claimd_median_ms": %s, "local_median_ms": %s, "ratio": %s}\n' \
    "$runs" "$(IFS=,; echo "${csi[*]}")" "$(IFS=,; echo "${loc[*]}")" "$mc" "$ml" "$ratio" >"$out"
fi
