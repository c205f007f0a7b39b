# The job with real containers: `packaging/demo.sh --docker` sources this
# after its set-up (the binaries, $demo, step, wait_for, volume_calls).
#   a throwaway dockerd -> docker volume create -> a container writes ->
#   a second reads it back -> the agent is killed and restarted under a
#   writing container (zero CSI calls, it keeps writing) -> docker rm ->
#   released -> docker volume rm.
# Installs docker.io and busybox-static when missing; the dockerd has its
# own data root, exec root and socket under $demo, no network.

need=()
command -v dockerd >/dev/null || need+=(docker.io)
dpkg -s busybox-static >/dev/null 2>&1 || need+=(busybox-static)
if [ ${#need[@]} -gt 0 ]; then
  echo "demo: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
driver=claimd-demo
export DOCKER_HOST=unix://$demo/docker/docker.sock
dockerd_pid=""
docker_cleanup() {
  if [ -n "$dockerd_pid" ]; then
    docker ps -aq | xargs -r docker rm -f >/dev/null 2>&1 || true
    kill -TERM "$dockerd_pid" 2>/dev/null || true
    for _ in $(seq 200); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$dockerd_pid" 2>/dev/null || true
  fi
  rm -f "/run/docker/plugins/$driver.sock"
  cleanup
}
trap docker_cleanup EXIT

step "a CSI plugin (claimd-test-plugin) on $demo/plugin/csi.sock"
mkdir -p "$demo/plugin/root/volumes/vol-db"
"$plugin_bin" --endpoint "$demo/plugin/csi.sock" --root "$demo/plugin/root" \
  --call-log "$demo/plugin/calls.jsonl" --node-id demo-node 2>"$demo/plugin.log" &
plugin_pid=$!
disown "$plugin_pid"
cat >"$demo/config.json" <<EOF
{"api_socket": "$demo/claimd.sock",
 "plugins": [{"id": "hostpath", "type": "monolith", "socket": "$demo/plugin/csi.sock"}],
 "probe_interval": "1s",
 "docker": {"driver": "$driver"}}
EOF
export CLAIMD_SOCKET=$demo/claimd.sock
start_agent() {
  "$claimd" agent --dev --config "$demo/config.json" 2>>"$demo/agent.log" &
  agent_pid=$!
  wait_for 60 "the agent" "$claimd" plugin list
}
step "the agent, serving the volume plugin protocol as driver $driver"
cat "$demo/config.json"
start_agent
ls -l "/run/docker/plugins/$driver.sock"

step "a throwaway dockerd, and a busybox image made with docker import"
mkdir -p "$demo/docker" "$demo/rootfs/bin"
dockerd --data-root "$demo/docker/data" --exec-root "$demo/docker/exec" \
  --pidfile "$demo/docker/dockerd.pid" -H "$DOCKER_HOST" --iptables=false \
  --ip6tables=false --bridge=none --storage-driver=vfs 2>"$demo/dockerd.log" &
dockerd_pid=$!
disown "$dockerd_pid"
wait_for 60 "dockerd" docker version
cp /bin/busybox "$demo/rootfs/bin/"
for a in $(/bin/busybox --list); do [ "$a" = busybox ] || ln -s busybox "$demo/rootfs/bin/$a"; done
tar -C "$demo/rootfs" -cf "$demo/image.tar" .
docker import -c 'ENV PATH=/bin' "$demo/image.tar" claimd-demo-busybox >/dev/null
run=(docker run --rm --network none -v db:/data --volume-driver "$driver" claimd-demo-busybox)

step "docker volume create --driver $driver --opt plugin_id=hostpath --opt external_id=vol-db db"
docker volume create --driver "$driver" --opt plugin_id=hostpath --opt external_id=vol-db db
"$claimd" volume list

step "a container writes, a second one reads it back"
"${run[@]}" sh -c 'echo "hello from a container" > /data/greeting'
"${run[@]}" cat /data/greeting
echo "the plugin's volume holds: $(cat "$demo/plugin/root/volumes/vol-db/greeting")"

step "a container that keeps writing; its claim and mount"
docker run -d --name writer --network none -v db:/data --volume-driver "$driver" \
  claimd-demo-busybox sh -c 'i=0; while true; do i=$((i+1)); echo $i >> /data/log; sleep 0.1; done' >/dev/null
wait_for 30 "the writer" test -s "$demo/plugin/root/volumes/vol-db/log"
"$claimd" alloc status
"$claimd" claim list

step "kill the agent (SIGKILL) and start it again, under the writing container"
before=$(volume_calls)
lines=$(wc -l <"$demo/plugin/root/volumes/vol-db/log")
kill -9 "$agent_pid"
wait "$agent_pid" 2>/dev/null || true
start_agent
after=$(volume_calls)
wait_for 30 "more lines" sh -c "[ \$(wc -l <'$demo/plugin/root/volumes/vol-db/log') -gt $((lines + 10)) ]"
echo "CSI volume calls during the restart: $((after - before)); the container went on writing: $lines lines then, $(wc -l <"$demo/plugin/root/volumes/vol-db/log") now"

step "docker rm -f writer: its Unmount releases the claim"
docker rm -f writer >/dev/null
wait_for 30 "the release" sh -c "[ \"\$('$claimd' claim list --json | jq '.claims | length')\" = 0 ]"
"$claimd" claim list
echo "plugin calls, in order:"
jq -r 'select(.method | test("Volume$")) | "  \(.method) \(.volume_id) \(.code)"' "$demo/plugin/calls.jsonl"

step "docker volume rm db: deregistered from claimd"
docker volume rm db
"$claimd" volume list
step "graceful stop of the agent (SIGTERM)"
kill -TERM "$agent_pid"
wait "$agent_pid" || true
agent_pid=""
step "done: the demo stops dockerd and cleans up $demo"
