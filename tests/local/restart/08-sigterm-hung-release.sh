#!/usr/bin/env bash
# SIGTERM while a release is stuck on a hung plugin. A fault makes
# NodeUnpublishVolume hang (the plugin never answers). Once the release's
# call hangs, SIGTERM must stop the agent within csi_call_timeout plus about
# a second, status 0, leaving the record in `releasing` and the target
# mounted. With the fault cleared and the agent started again, the release
# resumes by itself and completes: NodeUnpublish, NodeUnstage,
# ControllerUnpublish, nothing left.
. "$(dirname "$0")/lib.sh"

start_plugin csi
setup_agent "$T/agent" "[$(plugin_entry csi monolith)]"
restart_agent
register_volumes "$(volume_json v1)"
cli_ok alloc mount a1 --volume data=v1
target=$(state_jq -r '.allocs.a1.volumes.data.target_path')

log "release with NodeUnpublishVolume hanging"
set_faults '{"rules":[{"method":"NodeUnpublishVolume","action":"hang"}]}'
mark=$(calls_mark)
cli_ok alloc release a1
wait_for 20 "the plugin to hang in NodeUnpublishVolume" \
	grep -q "NodeUnpublishVolume volume=ext-v1: hanging" "$(plugin_dir csi)/plugin.log"

stop_agent $((CSI_CALL_TIMEOUT_S * 1000 + 1500))
log "the agent stopped ${AGENT_STOP_MS} ms after SIGTERM (csi_call_timeout ${CSI_CALL_TIMEOUT_S}s)"
assert_eq "phase recorded when the agent stopped" "a1 data releasing" "$(state_phases)"
assert_eq "releasing flag recorded" true "$(state_jq '.allocs.a1.releasing')"
assert_eq "mounts on the target after the stop" 1 "$(mount_count "$target")"

log "clear the fault and start again: the release resumes"
clear_faults
restart_agent
wait_for 30 "the release to resume and complete" state_empty
assert_fully_released
assert_eq "calls since the release (the hung call is never logged)" "NodeUnpublishVolume OK
NodeUnstageVolume OK
ControllerUnpublishVolume OK" "$(volume_calls_since "$mark")"
log "ok"
