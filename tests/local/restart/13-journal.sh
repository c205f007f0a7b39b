#!/usr/bin/env bash
# The journal across crashes. After a SIGKILL the changes since the last
# snapshot are only in state.journal, and the next start replays them:
# 1. `claimd state` (agent running, then dead) shows what the agent reports,
#    with secrets redacted; nothing in state.json alone has the mounts.
# 2. A damaged line before the last one stops the agent (status 1, message
#    naming the journal and the line); both files stay byte-for-byte as they
#    were and no mount is touched.
# 3. A cut-off last line (a write interrupted by a crash) is left out with a
#    warning; the agent starts with every allocation published and no volume
#    call, and the line is gone afterwards.
# 4. A crash after the new snapshot is written but before the journal is
#    replaced (failpoint state-after-snapshot) leaves both; the next start
#    replays the old journal over the new snapshot: same claims, same
#    records, every mount intact, no volume call.
. "$(dirname "$0")/lib.sh"

start_plugin csi
setup_agent "$T/agent" "[$(plugin_entry csi monolith)]"
JOURNAL=$STATE_DIR/state.journal
restart_agent
secret=s3cret-$RANDOM$RANDOM
v3=$(volume_json v3 | jq -c --arg s "$secret" '.secrets = {token: $s}')
register_volumes "[$(volume_json v1), $(volume_json v2), $v3]"
cli_ok alloc mount a1 --volume data=v1
cli_ok alloc mount a2 --volume data=v2
assert_mounts_match_state

log "1. claimd state while the agent runs and after a crash"
assert_eq "published volumes in claimd state" "a1 data published
a2 data published" "$(state_phases | sort)"
assert_eq "allocations in the snapshot alone (the rest is journal)" 0 \
	"$(jq '.allocs | length' "$STATE_FILE")"
running_state=$(state_json)
kill_agent
assert_eq "claimd state after SIGKILL" "$running_state" "$(state_json)"
assert_ge "journal lines after the crash" "$(wc -l <"$JOURNAL")" 2
claims_before=$(state_claims)
allocs_before=$(state_allocs)
mounts_before=$(mounts_left)
cp -p "$STATE_FILE" "$T/snapshot.json"
cp -p "$JOURNAL" "$T/journal.good"

log "2. a damaged line before the last"
# Flip one character inside the JSON of the first line.
python3 - "$T/journal.good" "$T/journal.bad" <<'EOF'
import sys
data = bytearray(open(sys.argv[1], "rb").read())
data[20] ^= 0x01
open(sys.argv[2], "wb").write(data)
EOF
cp "$T/journal.bad" "$JOURNAL"
sum_before=$(cat "$STATE_FILE" "$JOURNAL" | sha256sum)
rc=0
timeout 30 "$CLAIMD_BIN" agent --config "$AGENT_CONFIG" >"$T/bad.out" 2>&1 </dev/null || rc=$?
assert_eq "exit status of the agent with a damaged journal" 1 "$rc"
assert_contains "the agent's message" "$(cat "$T/bad.out")" \
	"state journal $JOURNAL is corrupt at line 1"
cmp "$T/journal.bad" "$JOURNAL" || fail "the damaged journal was changed"
cmp "$T/snapshot.json" "$STATE_FILE" || fail "the snapshot was changed"
assert_eq "sha256 of snapshot and journal" "$sum_before" "$(cat "$STATE_FILE" "$JOURNAL" | sha256sum)"
rc=0
"$CLAIMD_BIN" state --state-dir "$STATE_DIR" >/dev/null 2>"$T/state.err" || rc=$?
assert_eq "exit status of claimd state with a damaged journal" 1 "$rc"
assert_contains "claimd state's message" "$(cat "$T/state.err")" "corrupt at line 1"
assert_eq "mounts with a damaged journal" "$mounts_before" "$(mounts_left)"

log "3. a cut-off last line"
cp -p "$T/journal.good" "$JOURNAL"
printf '0badc0de {"allocs":{"a3":{"id":"a3","volu' >>"$JOURNAL"
mark=$(calls_mark)
restart_agent
assert_contains "the agent's warning" "$(cat "$AGENT_LOG")" "was cut off"
assert_eq "volumes in alloc status" "data published" "$(alloc_phases a1)"
assert_eq "volumes in alloc status" "data published" "$(alloc_phases a2)"
assert_eq "volume calls after the restart" "" "$(volume_calls_since "$mark")"
assert_eq "claims after the restart" "$claims_before" "$(state_claims)"
assert_eq "allocation records after the restart" "$allocs_before" "$(state_allocs)"
assert_eq "the cut-off line after the restart" 0 "$(grep -c 0badc0de "$JOURNAL" || true)"
assert_mounts_match_state

log "4. a crash between the new snapshot and the new journal"
cli_ok alloc mount a3 --volume data=v3
kill_agent
assert_ge "journal lines before the crashing start" "$(wc -l <"$JOURNAL")" 1
claims_before=$(state_claims)
allocs_before=$(state_allocs)
mounts_before=$(mounts_left)
journal_before=$(cat "$JOURNAL")
mark=$(calls_mark)
start_agent CLAIMD_FAILPOINT=state-after-snapshot
expect_agent_killed_at state-after-snapshot
assert_eq "the old journal is still there" "$journal_before" "$(cat "$JOURNAL")"
assert_eq "claims in the new snapshot plus the old journal" "$claims_before" "$(state_claims)"
restart_agent
assert_eq "volume calls after the two restarts" "" "$(volume_calls_since "$mark")"
assert_eq "claims after the restart" "$claims_before" "$(state_claims)"
assert_eq "allocation records after the restart" "$allocs_before" "$(state_allocs)"
assert_eq "mounts after the restart" "$mounts_before" "$(mounts_left)"
assert_mounts_match_state

log "5. secrets stay in the state directory"
assert_eq "v3's secret as claimd state prints it" '{"token":"(redacted)"}' \
	"$(state_jq -c '.volumes.v3.secrets')"
assert_eq "the secret in claimd state's output" 0 "$(state_json | grep -c "$secret" || true)"
assert_ge "the secret in the state files (mode 0600)" \
	"$(cat "$STATE_FILE" "$JOURNAL" | grep -c "$secret" || true)" 1
assert_eq "modes of the state files" "600 600" \
	"$(stat -c %a "$STATE_FILE" "$JOURNAL" | tr '\n' ' ' | sed 's/ $//')"
log "ok"
