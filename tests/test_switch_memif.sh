#!/usr/bin/env bash
# gossip-switch and DPDK workers (switch_memif_client) over net_memif: the
# switch holds one server vdev per worker, the client one client vdev per
# worker on the same socket; both --no-huge, pinned to different cores.
# Sync all-reduces of 2 and 3 workers must equal the reference sum. Each
# switch serves GSW_MEMIF_RUNS (default 2) client processes one after the
# other, and between the first two a client that is killed (SIGKILL) in the
# middle of its traffic: every departure unmaps the client's memory inside
# the switch, and the next client reconnects to the same ports. The switch
# must survive it all and exit cleanly on SIGINT; a crash is reported as one,
# with its signal.
# Usage: test_switch_memif.sh BUILD_DIR_OF_SWITCH. Exits 77 (skip) where the
# binaries are missing or EAL cannot start.
set -uo pipefail
B=${1:?build dir of transports/switch}
RUNS=${GSW_MEMIF_RUNS:-2}
source "$(dirname "${BASH_SOURCE[0]}")/switch_stop.sh"
for exe in gossip-switch switch_memif_client; do
  [[ -x $B/$exe ]] || { echo "SKIP: $B/$exe not built"; exit 77; }
done
TMP=$(mktemp -d /tmp/gsw-memif.XXXXXX)
SW=
cleanup() {
  if [[ -n $SW ]] && kill -0 "$SW" 2>/dev/null; then kill -INT "$SW"; sleep 0.5; kill -KILL "$SW" 2>/dev/null; fi
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
EAL=(--no-huge -m 512 --no-pci --no-shconf --no-telemetry)
# The cores: switch on the last one, client on the first (the same one on a 1-core machine).
LAST=$(($(nproc) - 1))
vdevs() {  # $1 role, $2 workers
  local i
  for ((i = 0; i < $2; i++)); do printf -- '--vdev=net_memif%d,role=%s,id=%d,socket=%s/gsw.sock,socket-abstract=no ' "$i" "$1" "$i" "$TMP"; done
}
WINDOW=64
CLIENT=(--ip 10.77.0.1 --group 1 --window "$WINDOW" --timeout 20)
killed_client() {  # N-WORKERS: a client killed once its first all-reduce is done
  local pid i
  timeout 60 "$B/switch_memif_client" -l 0 "${EAL[@]}" $(vdevs client "$1") -- "${CLIENT[@]}" --elements 2000000 --reps 1000 \
    >"$TMP/killed-$1.log" 2>&1 &
  pid=$!
  for ((i = 0; i < 300; i++)); do
    grep -qs "^all-reduce 1:" "$TMP/killed-$1.log" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  grep -qs "^all-reduce 1:" "$TMP/killed-$1.log" || { echo "FAIL: the client to kill did not get going:"; cat "$TMP/killed-$1.log"; fail=1; }
  kill -KILL -- "-$pid" 2>/dev/null  # timeout(1) and the client: its own process group
  wait "$pid" 2>/dev/null
  echo "killed a client of $1 workers in the middle of its traffic"
}
fail=0
for n in 2 3; do
  echo "== $n DPDK workers over net_memif"
  rm -f "$TMP/gsw.sock"
  timeout 60 "$B/gossip-switch" -l "$LAST" "${EAL[@]}" $(vdevs server "$n") \
    -- --ip 10.77.0.1 --group "id=1,mode=sync,members=$n,slots=64" --link-wait 0 --stats-json "$TMP/switch-$n.json" >"$TMP/switch-$n.log" 2>&1 &
  SW=$!
  for _ in $(seq 100); do
    grep -qs "polling on lcore" "$TMP/switch-$n.log" && break
    kill -0 "$SW" 2>/dev/null || break
    sleep 0.1
  done
  if ! grep -q "polling on lcore" "$TMP/switch-$n.log"; then
    cat "$TMP/switch-$n.log"
    if grep -q "EAL init failed\|Cannot create\|cannot create" "$TMP/switch-$n.log"; then echo "SKIP: DPDK EAL or memif cannot start here"; exit 77; fi
    echo "FAIL: gossip-switch did not start"; exit 1
  fi
  for ((run = 1; run <= RUNS; run++)); do
    timeout 60 "$B/switch_memif_client" -l 0 "${EAL[@]}" $(vdevs client "$n") -- "${CLIENT[@]}" --elements 200000 --reps 3 || { echo "FAIL: switch_memif_client ($n workers, client run $run of $RUNS)"; fail=1; }
    kill -0 "$SW" 2>/dev/null || break  # gsw_stop says how it ended
    if ((run == 1)); then
      killed_client "$n"
      kill -0 "$SW" 2>/dev/null || break
    fi
  done
  if gsw_stop "$SW" "gossip-switch ($n workers)"; then
    SW=
    tail -3 "$TMP/switch-$n.log"
    # The killed client had up to --window packets per worker in flight: the
    # replies to those find its rings full until the switch sees the link go
    # down (tx_full, at most window x workers). Nothing else may be dropped.
    python3 -c '
import json, sys
s = json.load(open(sys.argv[1])); limit = int(sys.argv[2])
d = {k: v for k, v in s["drops"].items() if v}
print("switch drops:", d or "none", f"(tx_full allowed up to {limit}: replies to the killed client)")
other = {k: v for k, v in d.items() if k != "tx_full"}
sys.exit(1 if other or d.get("tx_full", 0) > limit else 0)' \
      "$TMP/switch-$n.json" "$((WINDOW * n))" || { echo "FAIL: the switch dropped packets"; fail=1; }
  else
    SW=
    fail=1
    echo "-- gossip-switch log ($n workers), last lines:"
    tail -15 "$TMP/switch-$n.log"
  fi
done
[[ $fail == 0 ]] && echo "PASS" || echo "FAILED"
exit $fail
