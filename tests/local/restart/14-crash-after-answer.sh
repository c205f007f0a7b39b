#!/usr/bin/env bash
# The window a closing write leaves: a mount is answered once its intent
# (`mounting`) is durable and its calls are done, a release once its calls
# are done and its claim freed; their closing writes (`published`, the
# record dropped) ride with the next write of any change, or the state
# flusher writes them a few milliseconds later. A crash in that window must
# converge to what was answered, redoing the idempotent calls from the
# durable intent.
#
# The agent runs with CLAIMD_FAILPOINT=answer-before-closing-write:pause:
# the flusher stops for good before its first write, so the only writes
# are those of changes whose callers wait for them. Then:
#   1. a mount of a1 is answered with its host path while the state on disk
#      still says `mounting` (the window is real);
#   2. a mount of a2 is answered: its intent's one write carried a1's
#      closing write (on disk: a1 published, a2 mounting);
#   3. SIGKILL; a restart finishes a2 from its intent (the whole way up
#      again, once, each call OK) and leaves a1 alone (no call): both
#      published, mounted once, with their claims.
#   4. a release of b1 (another agent, mounted and stopped cleanly first)
#      is answered as done while the state on disk still holds its
#      `releasing` record and claim; SIGKILL; the restart resumes the
#      release by itself (the whole way down again, each call OK, the
#      detach last) and ends fully released.
. "$(dirname "$0")/lib.sh"

start_plugin csi
PLUGINS="[$(plugin_entry csi monolith)]"
USAGE_DIR=rw-file-system-single-node-writer
POINT=answer-before-closing-write
assert_eq "the failpoint's path" answer "$(failpoint_kind "$POINT")"
listed=$(failpoints)
grep -qx "$POINT" <<<"$listed" || fail "$POINT is not listed by \`claimd failpoints\`"
up="ControllerPublishVolume OK
NodeStageVolume OK
NodePublishVolume OK"
down="NodeUnpublishVolume OK
NodeUnstageVolume OK
ControllerUnpublishVolume OK"

# phases_on_disk: "alloc alias phase" lines of the files as they are now.
phases_on_disk() {
	state_json_now | jq -r '.allocs[] | .id as $a | .volumes[] | "\($a) \(.alias) \(.phase)"'
}

log "mounts with the flusher stopped before its first write"
setup_agent "$T/mount" "$PLUGINS"
restart_agent CLAIMD_FAILPOINT="$POINT:pause"
register_volumes "[$(volume_json m1),$(volume_json m2)]"
cli_ok alloc mount a1 --volume data=m1 --json
target1=$MOUNT_ROOT/per-alloc/a1/m1/$USAGE_DIR
assert_eq "host path answered for a1" "$target1" \
	"$(jq -r '.volumes[] | select(.alias == "data") | .host_path' <<<"$CLI_OUT")"
assert_eq "mounts on a1's target" 1 "$(mount_count "$target1")"
assert_eq "a1 as the agent reports it" "data published" "$(alloc_phases a1)"
assert_eq "the state on disk after a1's answer: the intent alone" "a1 data mounting" "$(phases_on_disk)"
cli_ok alloc mount a2 --volume data=m2 --json
target2=$MOUNT_ROOT/per-alloc/a2/m2/$USAGE_DIR
assert_eq "host path answered for a2" "$target2" \
	"$(jq -r '.volumes[] | select(.alias == "data") | .host_path' <<<"$CLI_OUT")"
assert_eq "the state on disk after a2's answer: a1's closing write rode with a2's intent" \
	"a1 data published
a2 data mounting" "$(phases_on_disk)"
alive "$AGENT_PID" || fail "the agent died; the failpoint pauses, it does not kill"
assert_contains "the agent's log" "$(cat "$AGENT_LOG")" "failpoint $POINT: paused"

log "SIGKILL in the window, then restart"
after_crash=$(calls_mark)
kill_agent_now
restart_agent
wait_for 30 "both allocations published on disk" \
	eval '[ "$(state_phases)" = "a1 data published
a2 data published" ]'
assert_eq "calls for a2 after the restart: the whole way up again" "$up" \
	"$(call_sequence "$after_crash" ext-m2)"
assert_eq "calls for a1 after the restart" "" "$(call_sequence "$after_crash" ext-m1)"
assert_eq "mounts on a1's target" 1 "$(mount_count "$target1")"
assert_eq "mounts on a2's target" 1 "$(mount_count "$target2")"
assert_eq "mounts on m2's staging" 1 "$(mount_count "$MOUNT_ROOT/staging/$PLUGIN_ID/m2")"
assert_eq "claims" '[{"alloc_id":"a1","state":"taken","volume_id":"m1"},{"alloc_id":"a2","state":"taken","volume_id":"m2"}]' \
	"$(state_jq -S -c '[.claims[] | {volume_id, alloc_id, state}] | sort_by(.volume_id)')"
cli_ok alloc release a1 --wait 30s
cli_ok alloc release a2 --wait 30s
assert_fully_released
stop_agent

log "a release answered with the flusher stopped before its first write"
setup_agent "$T/release" "$PLUGINS"
restart_agent
register_volumes "$(volume_json r1)"
cli_ok alloc mount b1 --volume data=r1
stop_agent
restart_agent CLAIMD_FAILPOINT="$POINT:pause"
mark=$(calls_mark)
cli_ok alloc release b1 --wait 30s --json
assert_eq "the release's answer" true "$(jq -r '.done' <<<"$CLI_OUT")"
assert_eq "calls of the release" "$down" "$(call_sequence "$mark" ext-r1)"
assert_eq "the state on disk after the answer: the durable releasing record" "b1 data releasing" \
	"$(phases_on_disk)"
assert_eq "the claim on disk after the answer" '[{"alloc_id":"b1","volume_id":"r1"}]' \
	"$(state_json_now | jq -S -c '[.claims[] | {volume_id, alloc_id}]')"
alive "$AGENT_PID" || fail "the agent died; the failpoint pauses, it does not kill"
after_crash=$(calls_mark)
kill_agent_now
restart_agent
wait_for 30 "the release to resume and drop the allocation and its claim" state_empty
assert_fully_released
assert_eq "calls after the restart: the whole way down again, the detach last" "$down" \
	"$(call_sequence "$after_crash" ext-r1)"
stop_agent
log "ok: mounts and a release answered before their closing writes converge after SIGKILL"
