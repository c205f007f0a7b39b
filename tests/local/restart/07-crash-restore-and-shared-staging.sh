#!/usr/bin/env bash
# SIGKILL in the restore path, and in the release of a shared staging path.
#
# Restore points (from `claimd failpoints`, failpoint_kind restore): an
# allocation is mounted, the agent stopped and started with the failpoint,
# so it dies while restoring (before its API answers); started clean, the
# allocation is still published, mounted exactly as before, the claims and
# records are identical, and the plugin got no volume call.
#
# Shared staging: two allocations use one multi-node-multi-writer volume
# (one staging path, one controller attachment). The first release leaves
# the staging mounted and the volume attached. The agent is then started
# with CLAIMD_FAILPOINT at before-node-unstage, then (a fresh run) at
# after-node-unpublish, and dies during the second release; started clean,
# the release resumes by itself and the volume is unstaged exactly once,
# only after both unpublishes, and detached exactly once, after that.
. "$(dirname "$0")/lib.sh"

start_plugin csi
PLUGINS="[$(plugin_entry csi monolith)]"
USAGE_DIR=rw-file-system-single-node-writer
SHARED_USAGE_DIR=rw-file-system-multi-node-multi-writer
all_points=$(failpoints)

restore_points=()
while IFS= read -r p; do
	if [ "$(failpoint_kind "$p")" = restore ]; then restore_points+=("$p"); fi
done <<<"$all_points"
assert_ge "restore-path failpoints listed by \`claimd failpoints\`" "${#restore_points[@]}" 1

i=0
for point in "${restore_points[@]}"; do
	i=$((i + 1))
	vol=s$i
	ext=ext-$vol
	setup_agent "$T/restore$i" "$PLUGINS"
	log "[$point] mount"
	restart_agent
	register_volumes "$(volume_json "$vol")"
	cli_ok alloc mount a1 --volume "data=$vol"
	assert_mounts_match_state
	claims_before=$(state_claims)
	allocs_before=$(state_allocs)
	mounts_before=$(mounts_left)
	stop_agent

	log "[$point] start with the agent set to die there"
	mark=$(calls_mark)
	start_agent CLAIMD_FAILPOINT="$point"
	expect_agent_killed_at "$point"
	log "[$point] start clean"
	restart_agent
	assert_eq "[$point] volumes in alloc status" "data published" "$(alloc_phases a1)"
	assert_eq "[$point] mounts" "$mounts_before" "$(mounts_left)"
	assert_eq "[$point] mounts on the target" 1 \
		"$(mount_count "$MOUNT_ROOT/per-alloc/a1/$vol/$USAGE_DIR")"
	assert_eq "[$point] claims" "$claims_before" "$(state_claims)"
	assert_eq "[$point] allocation records" "$allocs_before" "$(state_allocs)"
	assert_eq "[$point] volume calls since the crash" "" "$(volume_calls_since "$mark")"

	cli_ok alloc release a1 --wait 30s
	assert_fully_released
	stop_agent
done

# ---- shared staging ----------------------------------------------------------
for point in before-node-unstage after-node-unpublish; do
	assert_contains "failpoints of this build" "$all_points" "$point"
	i=$((i + 1))
	vol=shared$i
	ext=ext-$vol
	setup_agent "$T/shared$i" "$PLUGINS"
	staging=$MOUNT_ROOT/staging/$PLUGIN_ID/$vol
	target1=$MOUNT_ROOT/per-alloc/a1/$vol/$SHARED_USAGE_DIR
	target2=$MOUNT_ROOT/per-alloc/a2/$vol/$SHARED_USAGE_DIR
	log "[shared, $point] mount two allocations on one volume"
	restart_agent
	register_volumes "$(volume_json "$vol" multi-node-multi-writer)"
	cli_ok alloc mount a1 --volume "data=$vol"
	cli_ok alloc mount a2 --volume "data=$vol"
	assert_eq "[shared, $point] mounts (one staging, two targets)" \
		"$(printf '%s\n' "$staging" "$target1" "$target2" | sort)" "$(mounts_left)"
	assert_eq "[shared, $point] calls of the two mounts" \
		"ControllerPublishVolume OK
NodeStageVolume OK
NodePublishVolume OK
NodePublishVolume OK" "$(volume_calls_since 0 "$ext")"

	log "[shared, $point] release the first allocation"
	mark=$(calls_mark)
	cli_ok alloc release a1 --wait 30s
	assert_eq "[shared, $point] mounts after the first release" \
		"$(printf '%s\n' "$staging" "$target2" | sort)" "$(mounts_left)"
	assert_eq "[shared, $point] calls of the first release" "NodeUnpublishVolume OK" \
		"$(volume_calls_since "$mark" "$ext")"
	assert_eq "[shared, $point] claims after the first release" '["a2"]' \
		"$(state_jq -c '[.claims[].alloc_id]')"
	stop_agent

	log "[shared, $point] release the second with the agent set to die at $point"
	restart_agent CLAIMD_FAILPOINT="$point"
	cli alloc release a2 --wait 30s
	if [ "$CLI_RC" = 0 ]; then
		fail "[shared, $point] alloc release succeeded although the agent was to die: $CLI_OUT"
	fi
	expect_agent_killed_at "$point"
	restart_agent
	wait_for 30 "[shared, $point] the release to resume and end" state_empty
	assert_fully_released

	calls=$(calls_since_json "$mark" "$ext")
	assert_eq "[shared, $point] NodeUnstageVolume calls (exactly once)" \
		'[{"staging":"'"$staging"'","code":"OK"}]' \
		"$(jq -c '[.[] | select(.method == "NodeUnstageVolume")
		           | {staging: .staging_target_path, code}]' <<<"$calls")"
	assert_eq "[shared, $point] ControllerUnpublishVolume calls (exactly once)" \
		'[{"node_id":"test-node","code":"OK"}]' \
		"$(jq -c '[.[] | select(.method == "ControllerUnpublishVolume") | {node_id, code}]' <<<"$calls")"
	assert_eq "[shared, $point] targets unpublished (OK) before the unstage" \
		"$(printf '%s\n' "$target1" "$target2" | sort)" \
		"$(jq -r '(map(.method) | index("NodeUnstageVolume")) as $u
		          | [.[:$u][] | select(.method == "NodeUnpublishVolume" and .code == "OK")
		             | .target_path] | unique[]' <<<"$calls")"
	assert_eq "[shared, $point] calls after the unstage" "ControllerUnpublishVolume" \
		"$(jq -r '(map(.method) | index("NodeUnstageVolume")) as $u | .[$u + 1:][] | .method' <<<"$calls")"
	assert_eq "[shared, $point] calls that failed" "" \
		"$(jq -r '.[] | select(.code != "OK") | "\(.method) \(.code)"' <<<"$calls")"
	stop_agent
done
log "ok: ${#restore_points[@]} restore-path failpoint(s) and 2 shared-staging crashes"
