#!/usr/bin/env bash
# A simulated reboot. The agent is stopped, the plugin killed, everything
# under the mount root unmounted, and the boot ID in the state file changed
# (as if written during another boot). Started again (plugin first, as
# after a boot), the agent stages and publishes everything again under the
# claims it already holds: no ControllerPublish (attachments survive a
# reboot), one NodeStage per staging path (also when two allocations share
# one), one NodePublish per target, identical claims and records, every
# mount back exactly once, and the current boot ID recorded.
. "$(dirname "$0")/lib.sh"

start_plugin csi
setup_agent "$T/agent" "[$(plugin_entry csi monolith)]"
restart_agent
register_volumes "[$(volume_json v1), $(volume_json v2), $(volume_json shared multi-node-multi-writer)]"
cli_ok alloc mount a1 --volume data=v1
cli_ok alloc mount a2 --volume data=v2 --volume both=shared
cli_ok alloc mount a3 --volume both=shared
assert_mounts_match_state
claims_before=$(state_claims)
allocs_before=$(state_allocs)
mounts_before=$(mounts_left)
assert_eq "mounts before the reboot (3 staging, 4 targets)" 7 "$(wc -l <<<"$mounts_before")"

log "reboot: stop the agent, kill the plugin, unmount everything, another boot ID"
stop_agent
kill_plugin csi
unmount_under "$MOUNT_ROOT"
assert_eq "mounts under the mount root after the reboot" "" "$(mounts_left)"
booted=$(cat /proc/sys/kernel/random/boot_id)
# A graceful stop folds the journal into the snapshot: state.json is the
# whole state, and can be edited while the agent is stopped.
assert_eq "journal bytes after a graceful stop" 0 "$(stat -c %s "$STATE_DIR/state.journal")"
jq -c '.boot_id = "00000000-0000-4000-8000-000000000000"' "$STATE_FILE" >"$STATE_FILE.new"
cat "$STATE_FILE.new" >"$STATE_FILE"
rm "$STATE_FILE.new"
assert_eq "boot ID recorded in the state file" 00000000-0000-4000-8000-000000000000 \
	"$(state_jq -r .boot_id)"

mark=$(calls_mark)
start_plugin csi
restart_agent
cli_ok alloc status --json
assert_eq "volumes per phase in alloc status" "published 4" \
	"$(jq -r '[.allocs[].volumes[].phase] | group_by(.)[] | "\(.[0]) \(length)"' <<<"$CLI_OUT")"
assert_mounts_match_state
assert_eq "mounts after the reboot" "$mounts_before" "$(mounts_left)"
assert_eq "claims after the reboot" "$claims_before" "$(state_claims)"
assert_eq "allocation records after the reboot" "$allocs_before" "$(state_allocs)"
assert_eq "boot ID recorded after the restore" "$booted" "$(state_jq -r .boot_id)"
for v in v1 v2; do
	assert_eq "calls for volume $v after the reboot" "NodeStageVolume OK
NodePublishVolume OK" "$(volume_calls_since "$mark" "ext-$v")"
done
assert_eq "calls for the shared volume after the reboot (sorted)" "NodePublishVolume OK
NodePublishVolume OK
NodeStageVolume OK" "$(volume_calls_since "$mark" ext-shared | sort)"
assert_eq "first call for the shared volume after the reboot" "NodeStageVolume OK" \
	"$(volume_calls_since "$mark" ext-shared | head -n 1)"
assert_eq "ControllerPublishVolume calls after the reboot" 0 \
	"$(count_calls ControllerPublishVolume "" "" "$mark")"
log "ok"
