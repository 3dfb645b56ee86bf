#!/usr/bin/env bash
# bench/switch — all-reduce of 4 KiB .. 64 MiB among N workers:
#   switch-dpdk  gossip-switch (DPDK, net_af_packet on veths) between worker namespaces
#   switch-udp   the same aggregation code as a kernel-UDP process in the switch's
#                place (a bridge in the switch namespace)
#   host-udp     the same code as a kernel-UDP process on the host, workers on loopback
# Every result is checked against the reference sum. Writes results/switch.json.
#
#   bench/switch/run.sh [BUILD_DIR] [--workers N] [--sizes "4K 64K 1M 16M 64M"] [--reps R] [--window SLOTS] [--out DIR] [-h]
#
# Pinning (2 cores): the aggregator on CPU 1, the workers on CPU 0.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$SRC/build
if [[ $# -gt 0 && $1 != -* ]]; then BUILD=$1; shift; fi  # (-h is an option, not a directory)
N=2; SIZES="4K 64K 1M 16M 64M"; REPS=3; OUT=$SRC/results; WINDOW=128
usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [[ $# -gt 0 ]]; do
  case $1 in
    -h|--help) usage 0 ;;
    --workers|--sizes|--reps|--out|--window) [[ $# -ge 2 ]] || { echo "bench/switch: $1 needs a value" >&2; exit 2; } ;;&
    --workers) [[ $2 =~ ^[1-9][0-9]?$ ]] && (( $2 >= 2 && $2 <= 64 )) || { echo "bench/switch: --workers takes 2..64 (a switch group's members), not '$2'" >&2; exit 2; }
      N=$2; shift 2 ;;
    --sizes) SIZES=$2; shift 2 ;;
    --reps) [[ $2 =~ ^[1-9][0-9]{0,2}$ ]] || { echo "bench/switch: --reps takes an integer in 1..999, not '$2'" >&2; exit 2; }; REPS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --window) [[ $2 =~ ^[1-9][0-9]{0,3}$ ]] && (( $2 <= 4096 )) || { echo "bench/switch: --window takes an integer in 1..4096 (slots), not '$2'" >&2; exit 2; }; WINDOW=$2; shift 2 ;;
    *) echo "bench/switch: unknown option $1" >&2; usage ;;
  esac
done
B=$BUILD/transports/switch
source "$SRC/transports/switch/netns.sh"
# Checked before anything is made or removed: the tag names the namespaces (gsw<TAG>-*) the cleanup removes.
TAG=${GSW_TAG:-4}
gsw_tag_ok "$TAG" 2>/dev/null || { echo "bench/switch: GSW_TAG must be a number in 0..255 (namespaces gsw<TAG>-*), not '$TAG'" >&2; exit 2; }
# --sizes as switch_bench reads them: digits with an optional K, M or G, a positive multiple of 4 bytes, at most 16G.
read -r -a SIZE_LIST <<<"$SIZES"
((${#SIZE_LIST[@]})) || { echo "bench/switch: --sizes names no size; give byte counts, e.g. --sizes \"4K 64K 1M\"" >&2; exit 2; }
for s in "${SIZE_LIST[@]}"; do
  ok=0
  if [[ $s =~ ^([0-9]{1,15})([KMG]?)$ ]]; then
    v=$((10#${BASH_REMATCH[1]})); m=1
    case ${BASH_REMATCH[2]} in K) m=1024 ;; M) m=$((1 << 20)) ;; G) m=$((1 << 30)) ;; esac
    (( v <= (1 << 34) / m && v * m >= 4 && v * m % 4 == 0 )) && ok=1
  fi
  ((ok)) || { echo "bench/switch: --sizes: '$s' is not a size the bench takes: a byte count, digits with an optional K, M or G (e.g. 64K, 16M), a positive multiple of 4 up to 16G" >&2; exit 2; }
done
for exe in switch_bench gossip-switch gossip-switch-udp; do
  [[ -x $B/$exe ]] || { echo "bench/switch: $B/$exe is not built (DPDK found? ninja -C $BUILD transports/switch/$exe)" >&2; exit 1; }
done
set +e; gsw_can_run; rc=$?; set -e
[[ $rc == 0 ]] || exit "$rc"
mkdir -p "$OUT"
[[ -w $OUT ]] || { echo "bench/switch: --out $OUT is not writable" >&2; exit 2; }
TMP=$(mktemp -d /tmp/gsw-bench.XXXXXX)
PID=
cleanup() {
  if [[ -n $PID ]] && kill -0 "$PID" 2>/dev/null; then kill -INT "$PID"; sleep 0.5; kill -KILL "$PID" 2>/dev/null || true; fi
  gsw_down "$TAG"
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
GROUP="id=1,mode=sync,members=$N,slots=$WINDOW"
wait_ready() {  # $1 log, $2 pattern
  for _ in $(seq 100); do grep -q "$2" "$1" && return 0; kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
  echo "aggregator did not start:"; cat "$1"; exit 1
}
stop() { kill -INT "$PID"; for _ in $(seq 50); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done; wait "$PID" 2>/dev/null || true; PID=; }
run() { "$B/switch_bench" run --workers "$N" --sizes "${SIZE_LIST[@]}" --reps "$REPS" --window "$WINDOW" --cpus 0 --timeout 120 "$@"; }

echo "== switch-dpdk ($N workers)"
gsw_up "$N" dpdk "$TAG"
ip netns exec "${GSW_P}-sw" "$B/gossip-switch" -l 1 --no-huge -m 1024 --no-pci --no-shconf --no-telemetry $(gsw_vdevs "$N" "$TAG") \
  -- --ip "$GSW_IP" --group "$GROUP" --mbufs 32767 --stats-json "$OUT/switch-dpdk-stats.json" >"$TMP/dpdk.log" 2>&1 &
PID=$!
wait_ready "$TMP/dpdk.log" "polling on lcore"
run --mode switch-dpdk --address "$GSW_IP" --netns-prefix "${GSW_P}-w" --out "$TMP/dpdk.json"
stop; tail -3 "$TMP/dpdk.log"

echo "== switch-udp ($N workers)"
gsw_up "$N" kernel "$TAG"
ip netns exec "${GSW_P}-sw" "$B/gossip-switch-udp" --bind "$GSW_IP" --group "$GROUP" --cpu 1 --stats-json "$OUT/switch-udp-stats.json" >"$TMP/sudp.log" 2>&1 &
PID=$!
wait_ready "$TMP/sudp.log" "serving"
run --mode switch-udp --address "$GSW_IP" --netns-prefix "${GSW_P}-w" --out "$TMP/sudp.json"
stop; tail -3 "$TMP/sudp.log"
gsw_down "$TAG"

echo "== host-udp ($N workers)"
"$B/gossip-switch-udp" --bind 127.0.0.1 --port 47077 --group "$GROUP" --cpu 1 --stats-json "$OUT/host-udp-stats.json" >"$TMP/host.log" 2>&1 &
PID=$!
wait_ready "$TMP/host.log" "serving"
run --mode host-udp --address 127.0.0.1 --port 47077 --out "$TMP/host.json"
stop; tail -3 "$TMP/host.log"

echo
"$B/switch_bench" report "$TMP/dpdk.json" "$TMP/sudp.json" "$TMP/host.json" --out "$OUT/switch.json"
