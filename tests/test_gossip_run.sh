#!/usr/bin/env bash
# gossip-run: environment, rank prefixes, failure propagation, signal forwarding.
set -uo pipefail
run=$1
fail() { echo "FAIL: $*" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

out=$("$run" -n 3 -- sh -c 'echo "r=$GOSSIP_RANK w=$GOSSIP_WORLD_SIZE a=$GOSSIP_MASTER_ADDR p=$GOSSIP_MASTER_PORT"') || fail "clean run exited $?"
for r in 0 1 2; do
  echo "$out" | grep -Eq "^\[$r\] r=$r w=3 a=127.0.0.1 p=[0-9]+$" || fail "rank $r line missing in: $out"
done
[ "$(echo "$out" | sed -E 's/.* p=//' | sort -u | wc -l)" = 1 ] || fail "ranks disagree on the master port"

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

# A program that does not exist is a clear error.
"$run" -n 1 -- /nonexistent/program 2>"$tmp/err4"
[ $? = 127 ] || fail "expected 127 for a missing program"
grep -q "cannot start '/nonexistent/program'" "$tmp/err4" || fail "no clear message for a missing program"
echo "gossip-run: all checks passed"
