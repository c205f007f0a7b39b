#!/usr/bin/env bash
# A state file written by the previous release (fixtures/state-v1.json,
# schema version 1; see fixtures/README.md) is read by this one. Its paths
# (mount root /var/lib/claimd/mounts) are rewritten to this script's
# temporary directory, the plugin is given the volumes and the controller
# attachments the file records (they live in the storage system and the
# controller, which outlive claimd), and
# the agent starts on it: since none of its mounts exist, it stages and
# publishes everything again under the recorded claims (one NodeStage per
# staging path, one NodePublish per target, no ControllerPublish), and
# `alloc status` shows every volume published with the claims unchanged.
# Releasing both allocations then ends with nothing left, ControllerUnpublish
# carrying the recorded node ID.
. "$(dirname "$0")/lib.sh"

FIXTURE=$RESTART_DIR/fixtures/state-v1.json
FIXTURE_ROOT=/var/lib/claimd/mounts

assert_eq "schema version of the fixture" 1 "$(jq .schema_version "$FIXTURE")"
PLUGIN_ID=$(jq -r '[.volumes[].plugin_id] | unique | if length == 1 then .[0] else error("plugins") end' "$FIXTURE")
node_id=$(jq -r '[.allocs[].volumes[].external_node_id] | unique | .[0]' "$FIXTURE")
# claimd's node name, as the fixture's claims record it.
NODE_NAME=$(jq -r '[.claims[].node] | unique | if length == 1 then .[0] else error("nodes") end' "$FIXTURE")

# The attachments the fixture's records hold, in the test plugin's
# controller state.
mkdir -p "$(plugin_dir csi)/root"
jq '{attachments: ([.allocs[].volumes[] | select(.holds_attachment)
      | {key: .external_volume_id, value: {(.external_node_id): {
          access_mode: (.usage.access_mode | ascii_upcase | gsub("-"; "_")), readonly: false}}}]
      | from_entries), volumes: {}}' "$FIXTURE" >"$(plugin_dir csi)/root/controller.json"
start_plugin csi --node-id "$node_id"
# The volumes the fixture registered exist in the plugin's storage.
create_volumes "$(jq -c '[.volumes[]]' "$FIXTURE")"

setup_agent "$T/agent" "[$(plugin_entry csi monolith)]"
mkdir -p "$STATE_DIR"
chmod 700 "$STATE_DIR"
jq -c --arg from "$FIXTURE_ROOT/" --arg to "$MOUNT_ROOT/" \
	'walk(if type == "string" and startswith($from) then $to + .[($from | length):] else . end)' \
	"$FIXTURE" >"$STATE_FILE"
chmod 600 "$STATE_FILE"
assert_eq "strings still naming $FIXTURE_ROOT" "" "$(grep -o "${FIXTURE_ROOT}[^\"]*" "$STATE_FILE" || true)"
claims_before=$(state_claims)
allocs_before=$(state_allocs)
volumes=$(state_jq '[.allocs[].volumes[]] | length')
stagings=$(state_jq '[.allocs[].volumes[] | .staging_path] | unique | length')

mark=$(calls_mark)
restart_agent
cli_ok alloc status --json
assert_eq "volumes per phase in alloc status" "published $volumes" \
	"$(jq -r '[.allocs[].volumes[].phase] | group_by(.)[] | "\(.[0]) \(length)"' <<<"$CLI_OUT")"
assert_eq "allocations in alloc status" "$(jq -r '.allocs | keys[]' "$FIXTURE")" \
	"$(jq -r '.allocs[].id' <<<"$CLI_OUT" | sort)"
assert_mounts_match_state
assert_eq "mounts (targets + staging paths)" $((volumes + stagings)) "$(mounts_left | wc -l)"
assert_eq "claims after the start" "$claims_before" "$(state_claims)"
assert_eq "allocation records after the start" "$allocs_before" "$(state_allocs)"
assert_eq "schema version written back (2: snapshot plus journal)" 2 "$(state_jq .schema_version)"
assert_eq "schema version of the snapshot on disk" 2 "$(jq .schema_version "$STATE_FILE")"
assert_eq "NodeStageVolume calls" "$stagings" "$(count_calls NodeStageVolume "" OK "$mark")"
assert_eq "NodePublishVolume calls" "$volumes" "$(count_calls NodePublishVolume "" OK "$mark")"
assert_eq "other volume calls" "" \
	"$(volume_calls_since "$mark" | grep -v -e '^NodeStageVolume OK$' -e '^NodePublishVolume OK$' || true)"

log "release both allocations"
mark=$(calls_mark)
for a in $(jq -r '.allocs | keys[]' "$FIXTURE"); do
	cli_ok alloc release "$a" --wait 30s
done
assert_fully_released
assert_eq "ControllerUnpublishVolume calls (volume, node ID: the recorded ones)" \
	"$(jq -r '[.allocs[].volumes[] | "\(.external_volume_id) \(.external_node_id)"] | unique[]' "$FIXTURE")" \
	"$(calls_since_json "$mark" |
		jq -r '.[] | select(.method == "ControllerUnpublishVolume") | "\(.volume_id) \(.node_id) \(.code)"' |
		sed 's/ OK$//' | sort)"
log "ok"
