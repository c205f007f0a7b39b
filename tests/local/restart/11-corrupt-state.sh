#!/usr/bin/env bash
# A corrupt or truncated state file stops the agent. For each bad file
# (truncated to half, empty, not JSON, an unknown schema version) the agent
# exits with status 1 without serving, its message names the state file,
# and the file is byte-for-byte unchanged (cmp and sha256sum); the mounts
# it records are left alone. Put back, the good file starts the agent with
# the allocation still published.
. "$(dirname "$0")/lib.sh"

start_plugin csi
setup_agent "$T/agent" "[$(plugin_entry csi monolith)]"
restart_agent
register_volumes "$(volume_json v1)"
cli_ok alloc mount a1 --volume data=v1
stop_agent
cp -p "$STATE_FILE" "$T/good.json"
mounts_before=$(mounts_left)

size=$(stat -c %s "$T/good.json")
head -c $((size / 2)) "$T/good.json" >"$T/truncated.json"
: >"$T/empty.json"
printf 'not json at all \001\002\n' >"$T/garbage.json"
jq -c '.schema_version = 99' "$T/good.json" >"$T/future.json"

for case in truncated empty garbage future; do
	log "state file: $case"
	cp "$T/$case.json" "$STATE_FILE"
	chmod 600 "$STATE_FILE"
	sum_before=$(sha256sum <"$STATE_FILE")
	rc=0
	timeout 30 "$CLAIMD_BIN" agent --config "$AGENT_CONFIG" >"$T/$case.out" 2>&1 </dev/null || rc=$?
	assert_eq "[$case] exit status of the agent" 1 "$rc"
	assert_contains "[$case] the agent's message" "$(cat "$T/$case.out")" "state file $STATE_FILE"
	cmp "$T/$case.json" "$STATE_FILE" || fail "[$case] the state file was changed"
	assert_eq "[$case] sha256 of the state file" "$sum_before" "$(sha256sum <"$STATE_FILE")"
	assert_eq "[$case] files in the state directory" "claimd.lock
state.journal
state.json" "$(ls "$STATE_DIR")"
	cli plugin list
	assert_eq "[$case] exit code of the CLI (agent not reachable)" 3 "$CLI_RC"
	assert_eq "[$case] mounts" "$mounts_before" "$(mounts_left)"
done
assert_contains "[future] the agent's message" "$(cat "$T/future.out")" \
	"schema version 99"

log "the good file again"
cp -p "$T/good.json" "$STATE_FILE"
mark=$(calls_mark)
restart_agent
assert_eq "volumes in alloc status" "data published" "$(alloc_phases a1)"
assert_eq "volume calls after the restart" "" "$(volume_calls_since "$mark")"
log "ok"
