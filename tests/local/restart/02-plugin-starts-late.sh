#!/usr/bin/env bash
# The node plugin starts after the agent. The agent and the plugin are
# killed (SIGKILL), the allocations' mounts vanish (every target is
# unmounted; the staging mounts stay), and the agent starts while the plugin
# is still down: its restore waits for the plugin (the API does not answer
# meanwhile). The plugin comes up a few seconds later; then every
# allocation recovers (published, target mounted once, staging still
# mounted once: nothing stacked) under the claims it held, with exactly one
# NodeStage (sent again: idempotent) and one NodePublish per volume, no
# ControllerPublish (the attachment is recorded), and no call or allocation
# failing.
. "$(dirname "$0")/lib.sh"

N=3
# How late the plugin is: a deliberate part of the scenario, not a wait.
PLUGIN_DELAY_S=3

start_plugin csi
setup_agent "$T/agent" "[$(plugin_entry csi monolith)]"
restart_agent
register_volumes "$(for i in $(seq 1 "$N"); do volume_json "v$i"; done | jq -s -c .)"
for i in $(seq 1 "$N"); do
	cli_ok alloc mount "a$i" --volume "data=v$i"
done
assert_mounts_match_state
claims_before=$(state_claims)
allocs_before=$(state_allocs)
mounts_before=$(mounts_left)
assert_eq "mounts before the crash" $((2 * N)) "$(wc -l <<<"$mounts_before")"

log "crash: SIGKILL the agent and the plugin; the targets' mounts vanish"
kill_agent
kill_plugin csi
unmount_under "$MOUNT_ROOT/per-alloc"
assert_eq "mounts under the mount root after unmounting the targets" \
	"$(grep /staging/ <<<"$mounts_before")" "$(mounts_left)"

mark=$(calls_mark)
log "start the agent without its plugin"
start_agent
wait_for 20 "the agent to load its state file" grep -q "state file .* loaded" "$AGENT_LOG"
sleep "$PLUGIN_DELAY_S"
alive "$AGENT_PID" || fail "the agent exited while its plugin was down: $(tail -n 30 "$AGENT_LOG")"
cli plugin list
assert_eq "exit code of the CLI while the restore waits for the plugin (not reachable)" 3 "$CLI_RC"

log "the plugin starts ${PLUGIN_DELAY_S}s late"
start_plugin csi
wait_agent_ready

cli_ok alloc status --json
assert_eq "volumes per phase in alloc status" "published $N" \
	"$(jq -r '[.allocs[].volumes[].phase] | group_by(.)[] | "\(.[0]) \(length)"' <<<"$CLI_OUT")"
assert_eq "messages (waits, errors) in alloc status" "" \
	"$(jq -r '.allocs[].volumes[] | select(.message != "") | .message' <<<"$CLI_OUT")"
assert_mounts_match_state
assert_eq "mounts after the recovery" "$mounts_before" "$(mounts_left)"
assert_eq "claims after the recovery" "$claims_before" "$(state_claims)"
assert_eq "allocation records after the recovery" "$allocs_before" "$(state_allocs)"
for i in $(seq 1 "$N"); do
	assert_eq "calls for volume v$i since the crash" "NodeStageVolume OK
NodePublishVolume OK" "$(volume_calls_since "$mark" "ext-v$i")"
done
assert_eq "calls since the crash that are not OK" "" \
	"$(volume_calls_since "$mark" | grep -v ' OK$' || true)"
assert_eq "ControllerPublishVolume calls since the crash" 0 \
	"$(count_calls ControllerPublishVolume "" "" "$mark")"
log "ok"
