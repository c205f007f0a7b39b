# shellcheck shell=bash
# Shared helpers of the restart and crash scenarios (tests/local/restart/NN-*.sh),
# sourced first thing by every script:
#
#     . "$(dirname "$0")/lib.sh"
#
# A scenario gets its own temporary directory ($T) holding everything it
# touches: the plugins' sockets, roots and call log, the agent's config,
# state directory, mount root and API socket. On exit (success, failure or
# signal) the EXIT trap kills the agent and plugin processes the script
# started (only those: checked by PID and parent), lazily unmounts whatever
# is mounted under $T, and removes it. On failure it first prints what is
# needed to understand it: the agents' and plugins' logs, the call log, the
# mounts and the state file.
#
# Binaries: $CLAIMD_BIN and $PLUGIN_BIN (set by tests/local/restart/mod.rs), or
# target/debug. The agent must be built with `--features failpoints`.
#
# Waiting is always for a condition with a deadline (wait_for), never a
# fixed sleep hoping that something happened. Mounts are read from
# /proc/self/mountinfo.
#
# bash reports each agent or plugin that dies of SIGKILL (`... Killed ...`
# on stderr): the scenarios do that on purpose.

set -Eeuo pipefail
export LC_ALL=C

RESTART_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$RESTART_DIR/../.." && pwd)
CLAIMD_BIN=${CLAIMD_BIN:-$REPO_DIR/target/debug/claimd}
PLUGIN_BIN=${PLUGIN_BIN:-$REPO_DIR/target/debug/claimd-test-plugin}
SCENARIO=$(basename "$0" .sh)

# Short timeouts keep every scenario fast. The agent's config uses these.
CSI_CALL_TIMEOUT_S=2
PROBE_INTERVAL=200ms
PLUGIN_WAIT_TIMEOUT_S=15
# Slack the scripts allow on top of the agent's own bounds (process start
# and exit, scheduling on a busy two-core machine).
SLACK_MS=1500
# How long an agent may take to answer on its API socket after start; its
# restore runs first and may wait up to plugin_wait + csi_call.
AGENT_START_TIMEOUT_S=$((PLUGIN_WAIT_TIMEOUT_S + CSI_CALL_TIMEOUT_S + 10))
# Deadline of one CLI command before the script calls it hung.
CLI_TIMEOUT_S=90

# The plugin ID the scenarios use.
PLUGIN_ID=tp
# claimd's node name in claims.
NODE_NAME=node-1
# CSI methods that only fingerprint or probe; all others are volume calls.
IDENTITY_METHODS='["GetPluginInfo","GetPluginCapabilities","Probe","NodeGetCapabilities","NodeGetInfo","ControllerGetCapabilities"]'

# ---- messages, failure, assertions -----------------------------------------

log() {
	printf '%s [%s] %s\n' "$(date +%T.%3N)" "$SCENARIO" "$*"
}

# fail MESSAGE...: stops the script with the message (the EXIT trap then
# prints the diagnostics and cleans up).
fail() {
	printf '\nFAIL [%s]: %s\n' "$SCENARIO" "$*" >&2
	exit 1
}

_on_err() {
	# shellcheck disable=SC2016 # the backquotes are text, around the command
	printf '\nFAIL [%s]: command `%s` exited with status %s (line %s, in %s)\n' \
		"$SCENARIO" "$3" "$1" "$2" "${4:-main}" >&2
}
trap '_on_err $? $LINENO "$BASH_COMMAND" "${FUNCNAME[*]:-}"' ERR

# assert_eq WHAT EXPECTED FOUND
assert_eq() {
	if [ "$2" != "$3" ]; then
		fail "$1
  expected: $(_show "$2")
  found:    $(_show "$3")"
	fi
}

# assert_contains WHAT HAYSTACK NEEDLE
assert_contains() {
	if [[ "$2" != *"$3"* ]]; then
		fail "$1
  expected to contain: $3
  found: $(_show "$2")"
	fi
}

# assert_le WHAT FOUND MAX (integers)
assert_le() {
	if (($2 > $3)); then
		fail "$1
  expected: at most $3
  found:    $2"
	fi
}

# assert_ge WHAT FOUND MIN (integers)
assert_ge() {
	if (($2 < $3)); then
		fail "$1
  expected: at least $3
  found:    $2"
	fi
}

# Multi-line values are shown indented on their own lines.
_show() {
	if [[ "$1" == *$'\n'* ]]; then
		printf '\n      | %s' "${1//$'\n'/$'\n      | '}"
	elif [ -z "$1" ]; then
		printf '(empty)'
	else
		printf '%s' "$1"
	fi
}

now_ms() {
	local us=${EPOCHREALTIME/./}
	echo $((us / 1000))
}

# wait_for SECONDS WHAT COMMAND [ARGS...]: runs COMMAND every 50 ms until it
# succeeds; fails the script naming WHAT once SECONDS have passed.
wait_for() {
	local seconds=$1 what=$2
	shift 2
	local deadline=$(($(now_ms) + seconds * 1000))
	until "$@"; do
		if (($(now_ms) >= deadline)); then
			fail "timed out after ${seconds}s waiting for $what"
		fi
		sleep 0.05
	done
}

# ---- preconditions and the temporary directory -----------------------------

[ "$(id -u)" -eq 0 ] || fail "run as root: the scenarios mount and unmount for real"
for _tool in jq awk sha256sum cmp timeout umount; do
	command -v "$_tool" >/dev/null || fail "$_tool is not installed (apt-get install jq util-linux coreutils)"
done
for _bin in "$CLAIMD_BIN" "$PLUGIN_BIN"; do
	[ -x "$_bin" ] || fail "$_bin is missing: cargo build --features failpoints"
done
unset _tool _bin

T=$(mktemp -d "${TMPDIR:-/tmp}/claimd-$SCENARIO.XXXXXX")
CALL_LOG=$T/calls.jsonl
FAULTS=$T/faults.json
echo '{"rules":[]}' >"$FAULTS"
# The node IDs of every plugin the scenario starts, shared by all of them
# (--known-nodes): a controller plugin refuses node IDs it does not know.
KNOWN_NODES=$T/known-nodes
: >"$KNOWN_NODES"

# Processes this script started (agents and plugins), and plugin PIDs by name.
_PIDS=()
declare -A PLUGIN_PID=()

_track() { _PIDS+=("$1"); }

_untrack() {
	local keep=() p
	for p in "${_PIDS[@]}"; do
		[ "$p" = "$1" ] || keep+=("$p")
	done
	_PIDS=("${keep[@]+"${keep[@]}"}")
}

# The state letter of a process (R, S, Z, ...), empty when there is none.
_proc_state() {
	local stat
	stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
	stat=${stat##*) }
	echo "${stat%% *}"
}

# Whether PID is a process (not a zombie).
alive() {
	local s
	s=$(_proc_state "$1")
	[ -n "$s" ] && [ "$s" != Z ]
}

# Whether PID is still a child of this shell (so never a reused PID).
_our_child() {
	local stat
	stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
	stat=${stat##*) }
	local _state ppid _rest
	read -r _state ppid _rest <<<"$stat"
	[ "$ppid" = "$$" ]
}

# reap PID: waits for the (dead or dying) child, sets REAPED_STATUS to its
# exit status and forgets it. Never call it in $(...): a subshell cannot wait
# for its parent's children.
reap() {
	REAPED_STATUS=0
	wait "$1" 2>/dev/null || REAPED_STATUS=$?
	_untrack "$1"
}

# Mount points under DIR, one line per mount (stacked mounts repeat), sorted.
mounts_under() {
	awk -v p="$1/" 'index($5, p) == 1 { print $5 }' /proc/self/mountinfo | sort
}

# How many mounts sit exactly on PATH (0: not a mount point, 2+: stacked).
mount_count() {
	awk -v p="$1" '$5 == p { n++ } END { print n + 0 }' /proc/self/mountinfo
}

# unmount_under DIR: lazily unmounts everything mounted under DIR.
unmount_under() {
	local _ m
	for _ in 1 2 3 4 5 6 7 8 9 10; do
		m=$(mounts_under "$1" | sort -r | uniq)
		[ -n "$m" ] || return 0
		while IFS= read -r m; do
			umount -l "$m" 2>/dev/null || true
		done <<<"$m"
	done
}

_diagnostics() {
	{
		echo
		echo "======== diagnostics of $SCENARIO (temporary directory $T) ========"
		local f
		# The newest logs (the agent's of this step, the plugins'), without
		# the plugins' probe chatter.
		while IFS= read -r f; do
			echo "---- ${f#"$T"/} (last 40 lines) ----"
			grep -v -e '\] Probe  -> OK$' "$f" | tail -n 40
		done < <(find "$T" -maxdepth 4 -name '*.log' -type f -printf '%T@ %p\n' 2>/dev/null |
			sort -n | tail -n 5 | cut -d' ' -f2-)
		if [ -f "$CALL_LOG" ]; then
			echo "---- volume calls in the call log (last 40) ----"
			jq -R -r --argjson id "$IDENTITY_METHODS" \
				'fromjson? | select(.method | IN($id[]) | not)
				 | "\(.ts_ms) \(.method) \(.volume_id // "") \(.node_id // "") \(.target_path // .staging_target_path // "") \(.code)"' \
				"$CALL_LOG" | tail -n 40
		fi
		echo "---- mounts under $T ----"
		mounts_under "$T"
		if [ -n "${STATE_FILE:-}" ] && [ -f "$STATE_FILE" ]; then
			echo "---- claimd state of $(dirname "$STATE_FILE") (first 3000 bytes) ----"
			state_json_now 2>&1 | head -c 3000
			echo
		fi
		echo "======== end of diagnostics ========"
	} >&2
}

_cleanup() {
	local rc=$? pid
	set +eE
	trap - ERR
	for pid in "${_PIDS[@]+"${_PIDS[@]}"}"; do
		if _our_child "$pid"; then
			kill -KILL "$pid" 2>/dev/null
		fi
	done
	for pid in "${_PIDS[@]+"${_PIDS[@]}"}"; do
		wait "$pid" 2>/dev/null
	done
	if [ "$rc" -ne 0 ]; then
		_diagnostics
	fi
	unmount_under "$T"
	if [ -n "$(mounts_under "$T")" ]; then
		echo "cleanup: mounts are left under $T; not removing it:" >&2
		mounts_under "$T" >&2
	elif [ -n "${KEEP_TMP:-}" ]; then
		echo "cleanup: KEEP_TMP is set; $T is kept" >&2
	else
		rm -rf "$T"
	fi
	exit "$rc"
}
trap _cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# ---- the test plugin ---------------------------------------------------------

plugin_socket() { echo "$T/$1.sock"; }
plugin_dir() { echo "$T/plugins/$1"; }

# start_plugin NAME [PLUGIN OPTIONS...]: starts claimd-test-plugin serving
# $T/NAME.sock with root $T/plugins/NAME/root, the shared call log, fault
# file and known-nodes file (to which it adds its --node-id), and waits
# until it listens. A stale socket (a killed plugin's) is removed first, so
# the socket's existence means the new one listens.
start_plugin() {
	local name=$1
	shift
	local sock dir node_id=test-node a prev=
	for a in "$@"; do
		[ "$prev" != --node-id ] || node_id=$a
		prev=$a
	done
	grep -qxF -- "$node_id" "$KNOWN_NODES" || echo "$node_id" >>"$KNOWN_NODES"
	sock=$(plugin_socket "$name")
	dir=$(plugin_dir "$name")
	mkdir -p "$dir/root/volumes"
	rm -f "$sock"
	RUST_LOG=info "$PLUGIN_BIN" --endpoint "$sock" --root "$dir/root" \
		--call-log "$CALL_LOG" --faults "$FAULTS" --known-nodes "$KNOWN_NODES" "$@" \
		>>"$dir/plugin.log" 2>&1 </dev/null &
	PLUGIN_PID[$name]=$!
	_track "${PLUGIN_PID[$name]}"
	wait_for 20 "plugin $name (pid ${PLUGIN_PID[$name]}) to listen on $sock" \
		_plugin_listening "$name"
}

_plugin_listening() {
	alive "${PLUGIN_PID[$1]}" ||
		fail "plugin $1 exited while starting: $(tail -n 20 "$(plugin_dir "$1")/plugin.log")"
	[ -S "$(plugin_socket "$1")" ]
}

# kill_plugin NAME: SIGKILL (a crash: the socket file stays behind).
kill_plugin() {
	local pid=${PLUGIN_PID[$1]}
	kill -KILL "$pid" 2>/dev/null || true
	reap "$pid"
}

# wait_plugin_exit NAME SECONDS: for a plugin told to exit by a fault.
wait_plugin_exit() {
	local pid=${PLUGIN_PID[$1]}
	wait_for "$2" "plugin $1 (pid $pid) to exit" _dead "$pid"
	reap "$pid"
}

_dead() { ! alive "$1"; }

# set_faults JSON: replaces the fault file atomically (the plugin re-reads it
# on every call).
set_faults() {
	printf '%s\n' "$1" >"$FAULTS.tmp"
	mv -f "$FAULTS.tmp" "$FAULTS"
}

clear_faults() { set_faults '{"rules":[]}'; }

# ---- the agent -----------------------------------------------------------------

# plugin_entry NAME TYPE: one element of the config's plugins list, for the
# plugin started as NAME, under the ID $PLUGIN_ID.
plugin_entry() {
	jq -n -c --arg id "$PLUGIN_ID" --arg type "$2" --arg socket "$(plugin_socket "$1")" \
		'{id: $id, type: $type, socket: $socket}'
}

# setup_agent DIR PLUGINS_JSON [EXTRA_CONFIG_JSON]: an agent whose config,
# state directory, mount root and API socket live in DIR; sets AGENT_DIR,
# AGENT_CONFIG, STATE_DIR, STATE_FILE, MOUNT_ROOT and API_SOCKET, which the
# other helpers use.
setup_agent() {
	AGENT_DIR=$1
	AGENT_CONFIG=$AGENT_DIR/config.json
	STATE_DIR=$AGENT_DIR/state
	STATE_FILE=$STATE_DIR/state.json
	MOUNT_ROOT=$AGENT_DIR/mounts
	API_SOCKET=$AGENT_DIR/api.sock
	AGENT_PID=
	AGENT_SEQ=${AGENT_SEQ:-0}
	mkdir -p "$AGENT_DIR"
	jq -n --arg dir "$AGENT_DIR" --argjson plugins "$2" --argjson extra "${3:-"{}"}" \
		--arg node "$NODE_NAME" --arg call "${CSI_CALL_TIMEOUT_S}s" \
		--arg probe "$PROBE_INTERVAL" --arg wait "${PLUGIN_WAIT_TIMEOUT_S}s" '
		{state_dir: ($dir + "/state"), api_socket: ($dir + "/api.sock"),
		 mount_root: ($dir + "/mounts"), plugins: $plugins, node_name: $node,
		 csi_call_timeout: $call, probe_interval: $probe, plugin_wait_timeout: $wait,
		 claim_retry_deadline: "5s", release_retry_deadline: "10m"} + $extra' \
		>"$AGENT_CONFIG"
}

# start_agent [--dev] [VAR=VALUE...]: starts the agent in the background
# with the given environment (e.g. CLAIMD_FAILPOINT=after-node-stage); sets
# AGENT_PID and AGENT_LOG. Does not wait: see wait_agent_ready.
start_agent() {
	local args=(agent --config "$AGENT_CONFIG")
	if [ "${1:-}" = --dev ]; then
		args+=(--dev)
		shift
	fi
	AGENT_SEQ=$((AGENT_SEQ + 1))
	AGENT_LOG=$AGENT_DIR/agent.$AGENT_SEQ.log
	env RUST_LOG=info "$@" "$CLAIMD_BIN" "${args[@]}" >"$AGENT_LOG" 2>&1 </dev/null &
	AGENT_PID=$!
	_track "$AGENT_PID"
}

# wait_agent_ready [SECONDS]: until the agent answers on its API socket
# (its restore has run by then).
wait_agent_ready() {
	wait_for "${1:-$AGENT_START_TIMEOUT_S}" "the agent (pid $AGENT_PID) to answer on $API_SOCKET" \
		_agent_answers
}

_agent_answers() {
	alive "$AGENT_PID" ||
		fail "the agent (pid $AGENT_PID) exited while starting; its log:
$(tail -n 30 "$AGENT_LOG")"
	timeout 10 "$CLAIMD_BIN" plugin list --socket "$API_SOCKET" >/dev/null 2>&1
}

# restart_agent [VAR=VALUE...]: start_agent + wait_agent_ready.
restart_agent() {
	start_agent "$@"
	wait_agent_ready
}

# stop_agent [MAX_MS]: SIGTERM; fails unless the agent exits within MAX_MS
# (default: the CSI call timeout plus a second plus slack) with status 0.
# Sets AGENT_STOP_MS.
stop_agent() {
	local max=${1:-$((CSI_CALL_TIMEOUT_S * 1000 + 1000 + SLACK_MS))}
	local t0
	alive "$AGENT_PID" || fail "the agent (pid $AGENT_PID) to stop has exited already; its log:
$(tail -n 30 "$AGENT_LOG")"
	t0=$(now_ms)
	kill -TERM "$AGENT_PID"
	wait_for $(((max + 999) / 1000 + 5)) "the agent (pid $AGENT_PID) to exit after SIGTERM" \
		_dead "$AGENT_PID"
	AGENT_STOP_MS=$(($(now_ms) - t0))
	reap "$AGENT_PID"
	assert_le "milliseconds the agent took to exit after SIGTERM" "$AGENT_STOP_MS" "$max"
	assert_eq "exit status of the agent after SIGTERM" 0 "$REAPED_STATUS"
}

# kill_agent: SIGKILL, like a crash, once the agent's closing state writes
# (answered operations' last writes, which follow within milliseconds) are
# on disk, so the state left is the one the scenario's operations led to.
# kill_agent_now: SIGKILL at once, whatever is still waiting for its write.
kill_agent() {
	wait_state_settled
	kill_agent_now
}

kill_agent_now() {
	kill -KILL "$AGENT_PID" 2>/dev/null || true
	reap "$AGENT_PID"
}

# state_settled: no closing state write of a running agent is waiting (an
# agent that is not running, or stopped by SIGSTOP, writes nothing more).
state_settled() {
	local s m
	[ -n "${AGENT_PID:-}" ] || return 0
	s=$(_proc_state "$AGENT_PID")
	case $s in '' | Z | T | t) return 0 ;; esac
	m=$(timeout 10 "$CLAIMD_BIN" metrics --socket "$API_SOCKET" 2>/dev/null) || {
		# Not answering (starting, stopping or dying): nothing to wait for
		# unless it still runs.
		alive "$AGENT_PID" || return 0
		return 1
	}
	[ "$(awk '$1 == "claimd_state_undurable_changes" { print $2 }' <<<"$m")" = 0 ]
}

# wait_state_settled: until state_settled (the flusher writes within a few
# milliseconds; the bound covers a busy machine).
wait_state_settled() {
	wait_for 20 "the agent's closing state writes to reach the disk" state_settled
}

# expect_agent_killed_at POINT [SECONDS]: the agent started with
# CLAIMD_FAILPOINT=POINT killed itself there (SIGKILL, status 137, and its
# log names the point).
expect_agent_killed_at() {
	wait_for "${2:-20}" "the agent (pid $AGENT_PID) to die at failpoint $1" _dead "$AGENT_PID"
	reap "$AGENT_PID"
	assert_eq "exit status of the agent killed at failpoint $1 (128 + SIGKILL)" 137 "$REAPED_STATUS"
	assert_contains "log of the agent killed at failpoint $1" "$(cat "$AGENT_LOG")" \
		"failpoint $1: killing the agent"
}

# Every failpoint of the binary, one a line (`claimd failpoints`).
failpoints() {
	"$CLAIMD_BIN" failpoints 2>/dev/null ||
		fail "$CLAIMD_BIN has no failpoints: build it with \`cargo build --features failpoints\`"
}

# failpoint_kind NAME: which path reaches the point: mount, release,
# restore, state, answer (after the answers, before the closing write:
# 14-crash-after-answer.sh), or cluster (etcd-*: cluster mode only,
# tests/cluster.rs).
# Decided by name, so a new point needs no list here; a point put in the
# wrong path is caught by expect_agent_killed_at.
failpoint_kind() {
	case $1 in
	restore-*) echo restore ;;
	answer-*) echo answer ;;
	state-*) echo state ;;
	etcd-*) echo cluster ;;
	release-* | *unpublish* | *unstage*) echo release ;;
	*) echo mount ;;
	esac
}

# ---- the CLI ---------------------------------------------------------------------

# cli ARGS...: runs `claimd ARGS --socket $API_SOCKET` with a deadline; sets
# CLI_RC, CLI_OUT and CLI_ERR and never fails by itself.
cli() {
	CLI_RC=0
	timeout --kill-after=5 "$CLI_TIMEOUT_S" "$CLAIMD_BIN" "$@" --socket "$API_SOCKET" \
		>"$T/cli.out" 2>"$T/cli.err" </dev/null || CLI_RC=$?
	CLI_OUT=$(cat "$T/cli.out")
	CLI_ERR=$(cat "$T/cli.err")
}

# cli_expect CODE ARGS...: cli, and fails unless the exit code is CODE.
cli_expect() {
	local want=$1
	shift
	cli "$@"
	if [ "$CLI_RC" != "$want" ]; then
		fail "\`claimd $*\` exited with $CLI_RC (expected $want)
  stdout: $(_show "$CLI_OUT")
  stderr: $(_show "$CLI_ERR")"
	fi
}

cli_ok() { cli_expect 0 "$@"; }

# create_volumes JSON: creates the external volumes of an object or an
# array of volumes in the storage of every plugin started so far (the test
# plugin refuses volume IDs it does not know), as an administrator would
# before registering them.
create_volumes() {
	local ext dir
	for ext in $(jq -r '(if type == "array" then .[] else . end) | .external_id' <<<"$1"); do
		for dir in "$T"/plugins/*/root; do
			[ -d "$dir" ] || fail "create_volumes: start a plugin first"
			mkdir -p "$dir/volumes/$ext"
		done
	done
}

# register_volumes JSON: creates (create_volumes) and registers an object or
# an array of volumes.
register_volumes() {
	create_volumes "$1"
	printf '%s' "$1" >"$T/volumes.json"
	cli_ok volume register "$T/volumes.json"
}

# volume_json ID [ACCESS_MODE]: a file-system volume of plugin $PLUGIN_ID
# whose plugin-side ID is ext-ID.
volume_json() {
	jq -n -c --arg id "$1" --arg plugin "$PLUGIN_ID" --arg mode "${2:-single-node-writer}" \
		'{id: $id, plugin_id: $plugin, external_id: ("ext-" + $id),
		  access_modes: [$mode], attachment_modes: ["file-system"]}'
}

# alloc_phases ALLOC: "alias phase" lines from `alloc status --json`.
alloc_phases() {
	cli_ok alloc status "$1" --json
	jq -r '.allocs[0].volumes[] | "\(.alias) \(.phase)"' <<<"$CLI_OUT"
}

# ---- the state file -------------------------------------------------------------

# state_json: the recorded state (the snapshot with the journal replayed,
# secrets redacted), read the way the agent reads it, by `claimd state`.
# A running agent's closing writes are waited for first (state_settled);
# state_json_now reads the files as they are.
state_json() {
	wait_state_settled
	state_json_now
}
state_json_now() { "$CLAIMD_BIN" state --state-dir "$(dirname "$STATE_FILE")"; }
# state_jq JQ-ARGS...: jq over state_json.
state_jq() {
	local out
	out=$(state_json) || {
		echo "claimd state failed" >&2
		return 1
	}
	jq "$@" <<<"$out"
}

state_claims() { state_jq -S '.claims'; }
state_allocs() { state_jq -S '.allocs'; }
state_alloc_ids() { state_jq -r '.allocs | keys[]'; }
state_claim_count() { state_jq '.claims | length'; }
# "alloc alias phase" lines.
state_phases() {
	state_jq -r '.allocs[] | .id as $a | .volumes[] | "\($a) \(.alias) \(.phase)"'
}

# Whether the state file holds neither allocations nor claims.
state_empty() {
	[ "$(state_jq '(.allocs | length) + (.claims | length)')" = 0 ]
}

# ---- the call log ------------------------------------------------------------------

# calls_mark: the number of lines in the call log now (for *_since).
calls_mark() {
	if [ -f "$CALL_LOG" ]; then wc -l <"$CALL_LOG"; else echo 0; fi
}

_calls_after() {
	if [ -f "$CALL_LOG" ]; then tail -n "+$(($1 + 1))" "$CALL_LOG"; fi
}

# volume_calls_since MARK [EXTERNAL_VOLUME_ID]: "Method code" lines of the
# volume calls after MARK (of one volume, when given), in order.
volume_calls_since() {
	_calls_after "$1" | jq -R -r --argjson id "$IDENTITY_METHODS" --arg v "${2:-}" \
		'fromjson? | select(.method | IN($id[]) | not)
		 | select($v == "" or .volume_id == $v) | "\(.method) \(.code)"'
}

# count_calls METHOD [EXTERNAL_VOLUME_ID] [CODE] [MARK]: calls of METHOD
# (for that volume, with that code, after MARK).
count_calls() {
	_calls_after "${4:-0}" | jq -R -r --arg m "$1" --arg v "${2:-}" --arg c "${3:-}" \
		'fromjson? | select(.method == $m and ($v == "" or .volume_id == $v)
		 and ($c == "" or .code == $c)) | .method' | wc -l
}

# The mounts the state file implies, sorted: each published volume's target
# path and the staging path it holds, each once.
state_expected_mounts() {
	state_jq -r '[.allocs[].volumes[] | select(.phase == "published")
	        | .target_path, (select(.holds_staging) | .staging_path)] | unique[]' | sort
}

# assert_mounts_match_state: the mount table under the mount root is
# exactly what the state file records: every published target and its
# staging path mounted once (none stacked), nothing else.
assert_mounts_match_state() {
	assert_eq "mounts under $MOUNT_ROOT (each published target and staging path once)" \
		"$(state_expected_mounts)" "$(mounts_left)"
}

# Mounts and leftover directories under the agent's mount root.
mounts_left() { mounts_under "$MOUNT_ROOT"; }
dirs_left() {
	find "$MOUNT_ROOT/per-alloc" "$MOUNT_ROOT/staging" -mindepth 1 2>/dev/null | sort
}

# assert_fully_released: no mount and no directory under the mount root's
# per-alloc and staging, no claim and no allocation in the state file.
assert_fully_released() {
	assert_eq "mounts under $MOUNT_ROOT" "" "$(mounts_left)"
	assert_eq "directories left under $MOUNT_ROOT/per-alloc and staging" "" "$(dirs_left)"
	assert_eq "claims in the state file" "[]" "$(state_jq -c '.claims')"
	assert_eq "allocations in the state file" "{}" "$(state_jq -c '.allocs')"
}

# calls_since_json MARK [EXTERNAL_VOLUME_ID]: the volume calls after MARK,
# in order, as a JSON array of {method, code, volume_id, node_id,
# target_path, staging_target_path}.
calls_since_json() {
	_calls_after "$1" | jq -R -c --argjson id "$IDENTITY_METHODS" --arg v "${2:-}" \
		'fromjson? | select(.method | IN($id[]) | not)
		 | select($v == "" or .volume_id == $v)
		 | {method, code, volume_id, node_id, target_path, staging_target_path}' | jq -s -c .
}

# call_sequence MARK [EXTERNAL_VOLUME_ID]: volume_calls_since with repeats
# of the same call in a row folded into one (an idempotent call sent again
# after a crash), one "Method code" a line.
call_sequence() {
	volume_calls_since "$@" | uniq
}
