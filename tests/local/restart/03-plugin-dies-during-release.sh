#!/usr/bin/env bash
# The node plugin dies during a release. Node and controller are separate
# plugin processes (IDs alike, types node and controller), so the
# controller stays up while the node plugin is gone. A fault makes the node
# plugin exit on NodeUnpublishVolume (without unmounting). Then:
#   - the release retries: status shows `retrying`; after two failed
#     attempts the target is still mounted and no ControllerUnpublishVolume
#     has been sent;
#   - the node plugin comes back with another node ID (node-b), which a fresh
#     NodeGetInfo would give; the release completes by itself;
#   - the calls are exactly NodeUnpublish (EXIT), NodeUnpublish, NodeUnstage,
#     ControllerUnpublish, and ControllerUnpublish carries the node ID
#     recorded at attach time (node-a), not node-b.
. "$(dirname "$0")/lib.sh"

start_plugin node --no-controller --node-id node-a
start_plugin ctrl --node-id controller-host
setup_agent "$T/agent" "[$(plugin_entry node node), $(plugin_entry ctrl controller)]"
restart_agent
register_volumes "$(volume_json v1)"
cli_ok alloc mount a1 --volume data=v1
target=$(state_jq -r '.allocs.a1.volumes.data.target_path')
assert_eq "volume calls of the mount" "ControllerPublishVolume OK
NodeStageVolume OK
NodePublishVolume OK" "$(volume_calls_since 0)"
assert_eq "node ID of ControllerPublishVolume" node-a \
	"$(calls_since_json 0 | jq -r '.[] | select(.method == "ControllerPublishVolume") | .node_id')"
assert_eq "external node ID recorded in the allocation" node-a \
	"$(state_jq -r '.allocs.a1.volumes.data.external_node_id')"
assert_eq "external node ID recorded in the claim" node-a \
	"$(state_jq -r '.claims[0].external_node_id')"

log "release; the node plugin exits on NodeUnpublishVolume"
set_faults '{"rules":[{"method":"NodeUnpublishVolume","action":"exit","count":1}]}'
mark=$(calls_mark)
cli_ok alloc release a1
wait_plugin_exit node 20

release_state() {
	cli alloc status a1 --json
	[ "$CLI_RC" = 0 ] && jq -r '.allocs[0].volumes[0].release_state' <<<"$CLI_OUT"
}
retrying() { [ "$(release_state)" = retrying ]; }
wait_for 20 "alloc status to show the release retrying" retrying
# A second failed attempt (a new error: the node plugin is not ready), so a
# ControllerUnpublish sent after a failed node step would have been sent.
release_error() {
	cli alloc status a1 --json
	[ "$CLI_RC" = 0 ] && jq -r '.allocs[0].volumes[0].release_error' <<<"$CLI_OUT"
}
first_error=$(release_error)
assert_contains "error of the first attempt" "$first_error" NodeUnpublishVolume
second_attempt() {
	local e
	e=$(release_error) && [ -n "$e" ] && [ "$e" != "$first_error" ] && retrying
}
wait_for 30 "the release to fail a second attempt while the node plugin is down" second_attempt
cli_ok alloc status a1 --json
log "status while the node plugin is down: $(jq -c '.allocs[0].volumes[0] | {phase, release_state, release_error}' <<<"$CLI_OUT")"
assert_eq "phase while the node plugin is down" unpublishing \
	"$(jq -r '.allocs[0].volumes[0].phase' <<<"$CLI_OUT")"
assert_eq "mounts on the target while the node plugin is down" 1 "$(mount_count "$target")"
assert_eq "calls since the release while the node plugin is down" "NodeUnpublishVolume EXIT" \
	"$(volume_calls_since "$mark")"

log "the node plugin comes back as node-b"
clear_faults
start_plugin node --no-controller --node-id node-b
wait_for 40 "the release to complete" state_empty
assert_fully_released
assert_eq "release state in alloc status" released "$(release_state)"
assert_eq "calls since the release" "NodeUnpublishVolume EXIT
NodeUnpublishVolume OK
NodeUnstageVolume OK
ControllerUnpublishVolume OK" "$(volume_calls_since "$mark")"
assert_eq "node ID of ControllerUnpublishVolume (the recorded one)" node-a \
	"$(calls_since_json "$mark" | jq -r '.[] | select(.method == "ControllerUnpublishVolume") | .node_id')"
cli_ok plugin list --json
assert_eq "node ID the restarted node plugin reports" node-b \
	"$(jq -r '.plugins[] | select(.type == "node") | .node_id' <<<"$CLI_OUT")"
log "ok"
