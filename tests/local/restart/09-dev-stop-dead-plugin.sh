#!/usr/bin/env bash
# `claimd agent --dev` stops in bounded time. A dev agent releases what it
# mounted on stop, best effort, within DEV_RELEASE_DEADLINE (10 s):
#   1. with the plugin alive, SIGTERM releases everything (no mount left,
#      and no claim if the directory is kept; NodeUnpublish, NodeUnstage,
#      ControllerUnpublish) and exits;
#   2. with the plugin already dead (SIGKILL), SIGTERM still exits, within
#      the dev release deadline + csi_call_timeout + slack, status 0.
# The dev agent's throwaway directory goes under $TMPDIR, set to this
# script's temporary directory so the cleanup covers it.
. "$(dirname "$0")/lib.sh"

DEV_RELEASE_DEADLINE_S=10
mkdir -p "$T/devtmp"

# start_dev_agent: a --dev agent; points DEV_DIR, STATE_FILE and MOUNT_ROOT
# at its throwaway directory.
start_dev_agent() {
	start_agent --dev TMPDIR="$T/devtmp"
	wait_agent_ready
	DEV_DIR=$T/devtmp/claimd-dev
	STATE_FILE=$DEV_DIR/state/state.json
	MOUNT_ROOT=$DEV_DIR/mounts
	[ -f "$STATE_FILE" ] || fail "the dev agent's state file is not at $STATE_FILE"
}

start_plugin csi
setup_agent "$T/agent" "[$(plugin_entry csi monolith)]"

log "1. dev stop with the plugin alive"
start_dev_agent
register_volumes "$(volume_json v1)"
cli_ok alloc mount a1 --volume data=v1
assert_mounts_match_state
assert_eq "mounts of the dev agent" 2 "$(mounts_left | wc -l)"
mark=$(calls_mark)
stop_agent $(((DEV_RELEASE_DEADLINE_S + CSI_CALL_TIMEOUT_S + 1) * 1000 + SLACK_MS))
log "stopped in ${AGENT_STOP_MS} ms"
assert_eq "mounts under the dev directory after the stop" "" "$(mounts_under "$DEV_DIR")"
# The agent may remove its throwaway directory once nothing is mounted in it.
if [ -f "$STATE_FILE" ]; then
	assert_fully_released
fi
assert_eq "calls of the dev release" "NodeUnpublishVolume OK
NodeUnstageVolume OK
ControllerUnpublishVolume OK" "$(volume_calls_since "$mark" ext-v1)"

log "2. dev stop with the plugin dead"
start_dev_agent
register_volumes "$(volume_json v2)"
cli_ok alloc mount a2 --volume data=v2
assert_eq "mounts of the dev agent" 2 "$(mounts_left | wc -l)"
kill_plugin csi
stop_agent $(((DEV_RELEASE_DEADLINE_S + CSI_CALL_TIMEOUT_S + 1) * 1000 + SLACK_MS))
log "stopped in ${AGENT_STOP_MS} ms with the plugin dead"
assert_eq "allocations left in the dev state file (best effort failed)" a2 "$(state_alloc_ids)"
log "ok"
