#!/usr/bin/env bash
# SIGKILL at every failpoint of the mount path, then restart. The points
# come from `claimd failpoints` (no hand-kept list; failpoint_kind in lib.sh
# sorts them by path). For each point, a fresh agent (own state, mount root
# and API socket; one plugin serves them all, each point with its own
# volume) is started with CLAIMD_FAILPOINT=<point>, a volume is registered
# and an allocation mounted: the CLI call fails because the agent dies, and
# the agent is checked to have died at that very point. Restarted without
# the failpoint, the same `alloc mount` request (idempotent) must answer the
# same host path, with:
#   - the target a mount point exactly once, the staging path mounted once,
#     nothing else under the mount root (no stacked mounts);
#   - one claim, held by the allocation;
#   - the calls the plugin received, repeats in a row folded (an idempotent
#     call sent again), exactly ControllerPublish, NodeStage, NodePublish,
#     each OK, none sent more than twice.
# Then `alloc release --wait` leaves nothing: no mount and no directory under
# per-alloc and staging, no claim, no allocation, and the way down was
# NodeUnpublish, NodeUnstage, ControllerUnpublish.
. "$(dirname "$0")/lib.sh"

start_plugin csi
PLUGINS="[$(plugin_entry csi monolith)]"
USAGE_DIR=rw-file-system-single-node-writer

points=()
while IFS= read -r p; do
	if [ "$(failpoint_kind "$p")" = mount ]; then points+=("$p"); fi
done < <(failpoints)
assert_ge "mount-path failpoints listed by \`claimd failpoints\`" "${#points[@]}" 1
log "mount-path failpoints: ${points[*]}"

i=0
for point in "${points[@]}"; do
	i=$((i + 1))
	vol=m$i
	ext=ext-$vol
	setup_agent "$T/p$i" "$PLUGINS"
	target=$MOUNT_ROOT/per-alloc/a1/$vol/$USAGE_DIR
	staging=$MOUNT_ROOT/staging/$PLUGIN_ID/$vol
	log "[$point] mount with the agent set to die there"
	restart_agent CLAIMD_FAILPOINT="$point"
	register_volumes "$(volume_json "$vol")"
	cli alloc mount a1 --volume "data=$vol"
	if [ "$CLI_RC" = 0 ]; then
		fail "[$point] alloc mount succeeded although the agent was to die at $point: $CLI_OUT"
	fi
	expect_agent_killed_at "$point"

	log "[$point] restart and mount again"
	after_crash=$(calls_mark)
	restart_agent
	cli_ok alloc mount a1 --volume "data=$vol" --json
	assert_eq "[$point] host path answered by the repeated mount" "$target" \
		"$(jq -r '.volumes[] | select(.alias == "data") | .host_path' <<<"$CLI_OUT")"
	assert_eq "[$point] mounts on the target path" 1 "$(mount_count "$target")"
	assert_eq "[$point] mounts on the staging path" 1 "$(mount_count "$staging")"
	assert_eq "[$point] mounts under the mount root" "$(printf '%s\n' "$staging" "$target" | sort)" \
		"$(mounts_left)"
	assert_eq "[$point] claims" "[{\"alloc_id\":\"a1\",\"state\":\"taken\",\"volume_id\":\"$vol\"}]" \
		"$(state_jq -S -c '[.claims[] | {volume_id, alloc_id, state}]')"
	assert_eq "[$point] volumes in the state file" "a1 data published" "$(state_phases)"
	# One durable write on a mount's way (the intent); the result
	# (`published`) is a closing write that rides with a later write. From
	# a crash anywhere after the intent, the restart redoes the whole
	# idempotent way up, once; before the intent nothing was sent.
	# mount-after-published fires once `published` is applied and before
	# any write can carry it (14-crash-after-answer.sh covers the answer's
	# window); a published result on disk costs no call (01-clean-restart).
	up="ControllerPublishVolume OK
NodeStageVolume OK
NodePublishVolume OK"
	assert_eq "[$point] calls after the restart" "$up" "$(call_sequence "$after_crash" "$ext")"
	n=$(volume_calls_since 0 "$ext" | wc -l)
	before=$(volume_calls_since 0 "$ext" | awk -v k=$((n - 3)) 'NR <= k')
	k=$(printf '%s' "$before" | awk 'END {print NR}')
	assert_eq "[$point] calls before the crash: a beginning of the way up" \
		"$(awk -v k="$k" 'NR <= k' <<<"$up")" "$before"
	if [ "$point" = mount-after-published ]; then
		assert_eq "[$point] calls before the crash: the whole way up" "$up" "$before"
	fi
	assert_le "[$point] most times one call was sent" \
		"$(volume_calls_since 0 "$ext" | sort | uniq -c | awk '{print $1}' | sort -n | tail -n 1)" 2

	log "[$point] release"
	mark=$(calls_mark)
	cli_ok alloc release a1 --wait 30s
	assert_fully_released
	assert_eq "[$point] calls of the release" \
		"NodeUnpublishVolume OK
NodeUnstageVolume OK
ControllerUnpublishVolume OK" "$(volume_calls_since "$mark" "$ext")"
	stop_agent
done
log "ok: ${#points[@]} mount-path failpoints"
