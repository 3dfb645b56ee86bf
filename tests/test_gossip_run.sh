#!/usr/bin/env bash
# gossip-run: environment, rank prefixes, failure propagation, signal forwarding,
# --on-failure continue; with the example's path and the source root, also a
# rank killed with SIGKILL in the middle of training over UCX.
#   test_gossip_run.sh GOSSIP_RUN [FASHION_MNIST SOURCE_ROOT]
set -uo pipefail
run=$1
example=${2:-} src=${3:-}
fail() { echo "FAIL: $*" >&2; exit 1; }
tmp=$(mktemp -d)
bg=()
cleanup() {
  for p in "${bg[@]}"; do kill -9 "$p" 2>/dev/null; done  # only what this script started, by PID
  rm -rf "$tmp"
}
trap cleanup EXIT

out=$("$run" -n 3 -- sh -c 'echo "r=$GOSSIP_RANK w=$GOSSIP_WORLD_SIZE a=$GOSSIP_MASTER_ADDR p=$GOSSIP_MASTER_PORT"') || fail "clean run exited $?"
for r in 0 1 2; do
  echo "$out" | grep -Eq "^\[$r\] r=$r w=3 a=127.0.0.1 p=[0-9]+$" || fail "rank $r line missing in: $out"
done
[ "$(echo "$out" | sed -E 's/.* p=//' | sort -u | wc -l)" = 1 ] || fail "ranks disagree on the master port"

# A line longer than 64 KiB comes out in pieces of at most 64 KiB (each with
# its rank prefix), the piece that ends the line included, and nothing lost.
"$run" -n 1 -- sh -c 'head -c 150000 /dev/zero | tr "\\0" x; echo; head -c 300000 /dev/zero | tr "\\0" y; echo' >"$tmp/long" ||
  fail "long-line run exited $?"
longest=$(awk '{ if (length($0) > m) m = length($0) } END { print m }' "$tmp/long")
[ "$longest" -le $((65536 + 4)) ] || fail "a piece of $longest characters (the prefix '[0] ' included) is longer than 64 KiB"
[ "$(sed 's/^\[0\] //' "$tmp/long" | tr -d '\n' | tr -d y | wc -c)" = 150000 ] || fail "x characters lost or added"
[ "$(sed 's/^\[0\] //' "$tmp/long" | tr -d '\n' | tr -d x | wc -c)" = 300000 ] || fail "y characters lost or added"

# One rank fails: the others are stopped within the grace period, the exit
# status is the failing rank's, and the message names it.
start=$(date +%s)
"$run" -n 3 --grace 1 -- sh -c 'if [ "$GOSSIP_RANK" = 2 ]; then exit 7; fi; exec sleep 60' 2>"$tmp/err"
rc=$?
[ $rc = 7 ] || fail "expected exit 7 from the failing rank, got $rc"
grep -q "rank 2 .* failed with exit status 7" "$tmp/err" || fail "failure message does not name rank 2: $(cat "$tmp/err")"
[ $(( $(date +%s) - start )) -lt 20 ] || fail "the other ranks were not stopped"

# A rank that ignores SIGTERM is killed after the grace period.
"$run" -n 2 --grace 1 -- sh -c 'trap "" TERM; if [ "$GOSSIP_RANK" = 0 ]; then sleep 1; exit 1; fi; sleep 60 & wait; sleep 60' 2>"$tmp/err2"
[ $? = 1 ] || fail "expected exit 1"
grep -q "sending SIGKILL" "$tmp/err2" || fail "no SIGKILL after the grace period: $(cat "$tmp/err2")"

# SIGTERM to gossip-run reaches every rank.
"$run" -n 2 -- sh -c 'trap "echo got-term; exit 0" TERM; sleep 60 & wait' >"$tmp/out3" 2>&1 &
pid=$!
sleep 1
kill -TERM $pid
wait $pid
[ "$(grep -c got-term "$tmp/out3")" = 2 ] || fail "SIGTERM was not forwarded to both ranks: $(cat "$tmp/out3")"

# A second signal does not wait out the grace period: ranks that ignore
# SIGTERM are killed at once. (SIGTERM, not SIGINT: a background job of a
# script starts with SIGINT ignored, and gossip-run keeps it so.)
"$run" -n 2 --grace 60 -- sh -c 'trap "" TERM; echo ready; sleep 60 & wait; sleep 60' >"$tmp/out7" 2>"$tmp/err7" &
pid=$!
bg+=($pid)
for _ in $(seq 100); do [ "$(grep -c ready "$tmp/out7")" = 2 ] && break; sleep 0.1; done
start=$(date +%s)
kill -TERM $pid
sleep 0.5
kill -TERM $pid
wait $pid
rc=$?
[ $rc = 143 ] || fail "two SIGTERMs: expected exit 143, got $rc: $(cat "$tmp/err7")"
[ $(( $(date +%s) - start )) -lt 20 ] || fail "the second SIGTERM did not kill the ranks at once"
grep -q "signal 15 again: sending SIGKILL to 2 rank(s)" "$tmp/err7" || fail "no escalation message: $(cat "$tmp/err7")"

# The free port is looked for where rank 0 will listen: an address that is not
# this machine's is named.
"$run" -n 2 --master-addr 192.0.2.1 -- true 2>"$tmp/err8"
[ $? = 1 ] || fail "a foreign --master-addr must fail"
grep -q "master-addr 192.0.2.1: no free port there" "$tmp/err8" || fail "foreign --master-addr not named: $(cat "$tmp/err8")"

# What a rank leaves running in the background does not outlive the job, the
# rank finished or failed. (Its length, unique to this script, names it for pgrep.)
mark="sleep 300.$$"
"$run" -n 2 -- sh -c "$mark >/dev/null 2>&1 & if [ \$GOSSIP_RANK = 0 ]; then exit 1; fi; sleep 2" 2>"$tmp/err9"
[ $? = 1 ] || fail "leftover: rank 0's exit 1 must be gossip-run's status"
"$run" -n 1 -- sh -c "$mark >/dev/null 2>&1 & exit 0" 2>"$tmp/err10" || fail "leftover: a rank that exits 0 is a success"
grep -q "stopping the processes that rank(s) 0 left running" "$tmp/err10" || fail "leftover: not said: $(cat "$tmp/err10")"
sleep 0.5
! pgrep -f "^$mark\$" >/dev/null || fail "leftover: processes left running after gossip-run exited: $(pgrep -af "^$mark\$")"
# One that ended after its rank (it held the rank's output a moment longer) is
# reaped, not taken for one left running, whatever this machine's init does.
"$run" -n 1 -- sh -c "(sleep 0.05) & exit 0" 2>"$tmp/err11" || fail "ended: a rank that exits 0 is a success"
! grep -q "left running" "$tmp/err11" || fail "ended: a process that ended was taken for one left running: $(cat "$tmp/err11")"

# A program that does not exist is a clear error.
"$run" -n 1 -- /nonexistent/program 2>"$tmp/err4"
[ $? = 127 ] || fail "expected 127 for a missing program"
grep -q "cannot start '/nonexistent/program'" "$tmp/err4" || fail "no clear message for a missing program"
# --on-failure continue: a rank killed by a signal is dead, the others finish,
# gossip-run exits 0 and its report names the dead rank and its signal.
"$run" -n 3 --on-failure continue -- sh -c 'if [ "$GOSSIP_RANK" = 1 ]; then kill -9 $$; fi; sleep 1; echo "rank $GOSSIP_RANK done"' \
  >"$tmp/out5" 2>"$tmp/err5"
rc=$?
[ $rc = 0 ] || fail "continue: expected exit 0 with one rank killed, got $rc: $(cat "$tmp/err5")"
[ "$(grep -c "done" "$tmp/out5")" = 2 ] || fail "continue: the survivors did not finish: $(cat "$tmp/out5")"
grep -q "2 of 3 ranks finished (ranks 0, 2); did not finish: rank 1 (pid [0-9]*, signal 9 (Killed))" "$tmp/err5" ||
  fail "continue: the exit report does not name rank 1 and its signal: $(cat "$tmp/err5")"
# …but a rank that exits non-zero by itself is an error, whatever the mode.
"$run" -n 3 --on-failure continue -- sh -c 'if [ "$GOSSIP_RANK" = 2 ]; then exit 3; fi; sleep 1' 2>"$tmp/err6"
[ $? = 3 ] || fail "continue: a rank's exit 3 must be gossip-run's status"
grep -q "rank 2 (pid [0-9]*, exit status 3)" "$tmp/err6" || fail "continue: exit report does not name rank 2: $(cat "$tmp/err6")"
"$run" -n 1 --on-failure maybe -- true 2>"$tmp/err7" && fail "--on-failure maybe was accepted"

[ -n "$example" ] || { echo "gossip-run: all checks passed (no training run: no example given)"; exit 0; }

# Training over UCX, 4 ranks: rank 2 is killed with SIGKILL as rank 0 reports
# epoch 1 of 3. With --on-failure continue the survivors finish, exit 0, and
# name rank 2; the push-sum mass lost with it is reported; no internal check
# fails and no wait times out. With the default (abort) the run stops, naming rank 2.
cat >"$tmp/ucx.toml" <<'TOML'
[policy]
name = "drift"
threshold = 0.05
max_interval = 100
[topology]
name = "exponential"
[protocol]
name = "push-sum"
[transport]
name = "ucx"
[engine]
timeout_s = 30
[train]
workers = 4
epochs = 3
train_limit = 24000
TOML
# Ranks that would train differently refuse each other at connection, the
# [train] key named: here each rank was given its own seed.
UCX_NET_DEVICES=lo UCX_TLS=${UCX_TLS:-tcp} "$run" -n 2 --config "$tmp/ucx.toml" -- \
  sh -c 'exec "$0" --set train.workers=2 --set train.train_limit=2000 --epochs 1 --seed $((GOSSIP_RANK + 1))' "$example" \
  >"$tmp/seeds.out" 2>"$tmp/seeds.err" && fail "ranks with different train.seed trained together: $(cat "$tmp/seeds.out")"
grep -q 'train.seed is [12] here but [12] on rank [01]' "$tmp/seeds.err" || fail "different seeds: the key is not named: $(cat "$tmp/seeds.err")"

train_and_kill() {  # MODE OUT_PREFIX
  UCX_NET_DEVICES=lo UCX_TLS=${UCX_TLS:-tcp} "$run" -n 4 --on-failure "$1" --config "$tmp/ucx.toml" -- "$example" --json "$2.json" \
    >"$2.out" 2>"$2.err" &
  local gr=$! victim="" i
  bg+=("$gr")
  for i in $(seq 1 600); do  # until rank 0 reports epoch 1 (at most 60 s)
    grep -Eq '^\[0\] +1 ' "$2.out" && break
    kill -0 "$gr" 2>/dev/null || break
    sleep 0.1
  done
  for p in $(pgrep -P "$gr"); do  # gossip-run's children: one per rank
    grep -qx GOSSIP_RANK=2 <<<"$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null)" && victim=$p
  done
  [ -n "$victim" ] || fail "$1: rank 2 not found among gossip-run's children (did training end before epoch 1 was reported?): $(cat "$2.out" "$2.err")"
  kill -9 "$victim"
  local start=$SECONDS
  wait "$gr"
  echo $? >"$2.rc"
  echo $((SECONDS - start)) >"$2.secs"
}
train_and_kill continue "$tmp/cont"
rc=$(cat "$tmp/cont.rc")
cat "$tmp/cont.out" "$tmp/cont.err" >"$tmp/cont.all"
[ "$rc" = 0 ] || fail "training, continue: gossip-run exited $rc: $(cat "$tmp/cont.all")"
grep -q "internal check failed" "$tmp/cont.all" && fail "training, continue: an internal check failed: $(cat "$tmp/cont.all")"
grep -q "timed out" "$tmp/cont.all" && fail "training, continue: a wait timed out: $(cat "$tmp/cont.all")"
grep -q "did not finish: rank 2 (pid [0-9]*, signal 9 (Killed))" "$tmp/cont.err" || fail "training, continue: rank 2 not named dead: $(cat "$tmp/cont.err")"
grep -q "^\[0\] done: accuracy" "$tmp/cont.out" || fail "training, continue: rank 0 did not finish: $(cat "$tmp/cont.all")"
grep -q "^\[0\] dead: rank 2 (host " "$tmp/cont.out" || fail "training, continue: rank 0's report does not name rank 2: $(cat "$tmp/cont.out")"
grep -Eq "^\[[013]\] libgossip ucx \(rank [013] \(host .*\)\): peer rank 2 \(host .*\) failed" "$tmp/cont.err" ||
  fail "training, continue: no survivor names rank 2 and its host: $(cat "$tmp/cont.err")"
/usr/bin/python3 - "$tmp/cont.json" <<'PY' || fail "training, continue: report check failed: $(cat "$tmp/cont.json")"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["survivors"] == 3, r["survivors"]
assert [d["rank"] for d in r["dead_ranks"]] == [2], r["dead_ranks"]
assert 0 < r["lost_weight"] < 4, r["lost_weight"]
assert r["lost_weight_estimate"] >= 0, r["lost_weight_estimate"]
assert len(r["ranks"]) == 3 and sorted(x["rank"] for x in r["ranks"]) == [0, 1, 3]
for x in r["ranks"]:  # every survivor neighbours rank 2 on this graph and found it dead
    assert x["dead_peers"] == [2] and x["dead"][0]["rank"] == 2, (x["rank"], x["dead"], [(p["rank"], p["messages_sent"], p["dead"]) for p in x["peers"]])
assert 0.5 < r["accuracy"] <= 1, r["accuracy"]
print("training with rank 2 killed: accuracy", r["accuracy"], "lost weight", r["lost_weight"], "estimate", r["lost_weight_estimate"])
PY

train_and_kill abort "$tmp/abort"
rc=$(cat "$tmp/abort.rc")
[ "$rc" != 0 ] || fail "training, abort: gossip-run exited 0 with rank 2 killed"
grep -q "rank 2 (pid [0-9]*) failed with signal 9" "$tmp/abort.err" || fail "training, abort: rank 2 not named: $(cat "$tmp/abort.err")"
[ "$(cat "$tmp/abort.secs")" -lt 20 ] || fail "training, abort: stopping took $(cat "$tmp/abort.secs") s"
echo "gossip-run: all checks passed"
