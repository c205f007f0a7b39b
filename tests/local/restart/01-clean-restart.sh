#!/usr/bin/env bash
# Clean restart with 50 allocations mounted. After SIGTERM (which unmounts
# nothing) and a restart, every allocation reports `published`, the plugin
# received no volume call at all (in particular no NodeStage, NodePublish
# or ControllerPublish), the claims and allocation records in the state file
# are identical to before, and every mount is still there exactly once.
. "$(dirname "$0")/lib.sh"

N=50

start_plugin csi
setup_agent "$T/agent" "[$(plugin_entry csi monolith)]"
restart_agent

log "registering and mounting $N allocations"
vols=$(for i in $(seq -w 1 "$N"); do volume_json "v$i"; done | jq -s -c .)
register_volumes "$vols"
for i in $(seq -w 1 "$N"); do
	cli_ok alloc mount "a$i" --volume "data=v$i"
done
assert_eq "published volumes in the state file" "$N" \
	"$(state_phases | grep -c ' published$')"
assert_eq "mounts under the mount root ($N targets + $N staging paths)" $((2 * N)) \
	"$(mounts_left | wc -l)"
assert_mounts_match_state
assert_eq "ControllerPublishVolume calls" "$N" "$(count_calls ControllerPublishVolume)"
assert_eq "NodeStageVolume calls" "$N" "$(count_calls NodeStageVolume)"
assert_eq "NodePublishVolume calls" "$N" "$(count_calls NodePublishVolume)"

claims_before=$(state_claims)
allocs_before=$(state_allocs)
mounts_before=$(mounts_left)
assert_eq "claims held" "$N" "$(state_claim_count)"

log "SIGTERM"
mark=$(calls_mark)
stop_agent
log "the agent stopped in ${AGENT_STOP_MS} ms"
assert_eq "mounts after a graceful stop (nothing is unmounted)" "$mounts_before" "$(mounts_left)"

log "restarting"
t0=$(now_ms)
restart_agent
log "the agent answered $(($(now_ms) - t0)) ms after start"

cli_ok alloc status --json
assert_eq "allocations in alloc status" "$N" "$(jq '.allocs | length' <<<"$CLI_OUT")"
assert_eq "phases of every volume in alloc status" "published $N" \
	"$(jq -r '[.allocs[].volumes[].phase] | group_by(.)[] | "\(.[0]) \(length)"' <<<"$CLI_OUT")"
assert_eq "volume calls since the restart" "" "$(volume_calls_since "$mark")"
for m in NodeStageVolume NodePublishVolume ControllerPublishVolume; do
	assert_eq "$m calls since the restart" 0 "$(count_calls "$m" "" "" "$mark")"
done
assert_eq "claims in the state file after the restart" "$claims_before" "$(state_claims)"
assert_eq "allocation records after the restart" "$allocs_before" "$(state_allocs)"
assert_eq "mounts after the restart" "$mounts_before" "$(mounts_left)"
assert_mounts_match_state
log "ok"
