#!/usr/bin/env bash
# SIGKILL at every failpoint of the release path, then restart. The points
# come from `claimd failpoints` (failpoint_kind in lib.sh sorts them by
# path). For each point, a fresh agent (own state, mount root and API
# socket; one plugin serves them all, each point with its own volume)
# mounts an allocation without failpoint, is restarted with
# CLAIMD_FAILPOINT=<point>, and is asked to release: the CLI call fails
# because the agent dies, and the agent is checked to have died at that very
# point. Restarted without the failpoint, with no new release command, the
# release must resume by itself and end fully released:
#   - no mount and no directory under per-alloc and staging, no claim, no
#     allocation in the state file;
#   - the plugin got, repeats in a row folded (an idempotent call sent
#     again), exactly NodeUnpublish, NodeUnstage, ControllerUnpublish, each
#     OK, ControllerUnpublish last and with the recorded node ID, and no
#     call of the way up.
. "$(dirname "$0")/lib.sh"

start_plugin csi
PLUGINS="[$(plugin_entry csi monolith)]"

points=()
while IFS= read -r p; do
	if [ "$(failpoint_kind "$p")" = release ]; then points+=("$p"); fi
done < <(failpoints)
assert_ge "release-path failpoints listed by \`claimd failpoints\`" "${#points[@]}" 1
log "release-path failpoints: ${points[*]}"

i=0
for point in "${points[@]}"; do
	i=$((i + 1))
	vol=r$i
	ext=ext-$vol
	setup_agent "$T/p$i" "$PLUGINS"
	log "[$point] mount"
	restart_agent
	register_volumes "$(volume_json "$vol")"
	cli_ok alloc mount a1 --volume "data=$vol"
	assert_eq "[$point] volumes in the state file" "a1 data published" "$(state_phases)"
	assert_mounts_match_state
	assert_eq "[$point] mounts under the mount root" 2 "$(mounts_left | wc -l)"
	stop_agent

	log "[$point] release with the agent set to die there"
	restart_agent CLAIMD_FAILPOINT="$point"
	mark=$(calls_mark)
	cli alloc release a1 --wait 30s
	if [ "$CLI_RC" = 0 ]; then
		fail "[$point] alloc release succeeded although the agent was to die at $point: $CLI_OUT"
	fi
	expect_agent_killed_at "$point"

	log "[$point] restart: the release resumes by itself"
	after_crash=$(calls_mark)
	restart_agent
	wait_for 30 "[$point] the release to resume and drop the allocation and its claim" state_empty
	assert_fully_released
	# One durable write on a release's way (releasing); dropping the record
	# with its claim is a closing write that rides with a later write. From
	# a crash anywhere after the first, the restart redoes the whole
	# idempotent way down, once, in order; the detach always comes last.
	# release-after-claim-freed fires once the drop is applied and before
	# any write can carry it (14-crash-after-answer.sh covers the answer's
	# window).
	down="NodeUnpublishVolume OK
NodeUnstageVolume OK
ControllerUnpublishVolume OK"
	assert_eq "[$point] calls after the restart" "$down" "$(call_sequence "$after_crash" "$ext")"
	n=$(volume_calls_since "$mark" "$ext" | wc -l)
	before=$(volume_calls_since "$mark" "$ext" | awk -v k=$((n - 3)) 'NR <= k')
	k=$(printf '%s' "$before" | awk 'END {print NR}')
	assert_eq "[$point] calls before the crash: a beginning of the way down" \
		"$(awk -v k="$k" 'NR <= k' <<<"$down")" "$before"
	if [ "$point" = release-after-claim-freed ]; then
		assert_eq "[$point] calls before the crash: the whole way down" "$down" "$before"
	fi
	assert_eq "[$point] node IDs of the ControllerUnpublishVolume calls" "test-node" \
		"$(calls_since_json "$mark" "$ext" |
			jq -r '[.[] | select(.method == "ControllerUnpublishVolume") | .node_id] | unique[]')"
	stop_agent
done
log "ok: ${#points[@]} release-path failpoints"
