#!/usr/bin/env bash
# bench/faults — the Fashion-MNIST example as UCX processes under gossip-run
# --on-failure continue, with faults injected from outside:
#   kill-1-of-4   kill -9 of rank 2 of 4 at 30 % of training (of the same seed's
#                 fault-free run's time from rank 0's table header, printed once
#                 the data is loaded, to its end: training, evaluation and the
#                 barriers; a run that ends before it says "fault not injected")
#   kill-2-of-8   kill -9 of ranks 3 and 6 of 8 at 30 %
#   sigstop-20s   SIGSTOP of rank 1 of 4 at 30 %, SIGCONT 20 s later
#   loss-10pct    every rank in its own network namespace on a bridge, 10 % of
#                 packets dropped at random (nftables numgen, or iptables
#                 statistic) on every rank's link, both directions
#   switch-restart 4 workers (threads of one process) through the switch
#                 transport and gossip-switch-udp (the switch's aggregation code
#                 over kernel UDP, on 127.0.0.1): the switch is killed (-9) at
#                 30 % and started again on the same port at once. The async
#                 aggregate (mode = "async"), whose members rejoin a restarted
#                 switch; a sync all-reduce cut by a restart cannot complete
# Every scenario runs with several seeds (--seeds N, the example's --seed:
# initialisation, partition and batch order), each paired with a fault-free
# run of the same world and seed (the loss run with the fault-free 4-rank run,
# switch-restart with a fault-free run through the switch), so a seed's delta
# compares runs that differ only by the fault and by timing. accuracy_delta_pt
# is the mean of the per-seed deltas, accuracy_delta_sigma_pt their sample
# standard deviation. A scenario is ok when, for every seed, nothing hangs,
# the survivors finish and exit 0 and the lost push-sum mass is reported
# (> 0 where ranks were killed), and the mean delta is within 1 pt of zero
# give or take its noise: |mean| <= 1 + 2 sigma/sqrt(seeds). Writes
# DIR/faults.json and prints a table.
#
#   bench/faults/run.sh [BUILD_DIR] [--quick] [--seeds N] [--only NAME,...] [--rto-max-ms MS] [--max-lead N] [--out DIR]
#
# --max-lead N sets [engine] max_lead = N for the runs over UCX, fault-free
# ones included (default 4, the engine's default; 0: off): a rank then waits
# while more than N steps ahead of what it heard from its sources.
#
# --rto-max-ms caps TCP's retransmission timeout in the loss scenario's
# namespaces (sysctl net.ipv4.tcp_rto_max_ms, Linux >= 6.15): under 10 %
# loss per rule TCP's exponential backoff stalls a single 400 KB transfer for
# up to half a minute, which trips the 60 s deadlines; a cap of 1000 ms is the
# host-side remedy. Default: the kernel's (120 s).
#
# FAULTS_KEEP=1 in the environment keeps every run's output (rank logs, JSON).
# --only runs the named scenarios (and the fault-free runs they compare
# with); the others are listed as not selected.
#
# --quick: a 24000-sample slice, 3 epochs, 3 seeds (about 10 minutes);
# otherwise the full 60000 samples, 4 epochs, 5 seeds. Namespaces and
# firewall rules are made by this script only and removed on exit, also on
# failure.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$SRC/build
if [[ $# -gt 0 && $1 != -* ]]; then BUILD=$1; shift; fi  # (-h is an option, not a directory)
QUICK=0; OUT=$SRC/results; SEEDS=; ONLY=; RTO_MAX_MS=; MAX_LEAD=4
SCENARIOS=kill-1-of-4,kill-2-of-8,sigstop-20s,loss-10pct,switch-restart
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --quick) QUICK=1; shift ;;
    --seeds|--out|--only|--rto-max-ms|--max-lead) [[ $# -ge 2 ]] || { echo "bench/faults: $1 needs a value" >&2; exit 2; } ;;&
    --seeds) SEEDS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --only) ONLY=$2; [[ -n ${ONLY//[[:space:],]/} ]] || { echo "bench/faults: --only names no scenario (known: $SCENARIOS)" >&2; exit 2; }; shift 2 ;;
    --rto-max-ms) RTO_MAX_MS=$2; shift 2 ;;
    --max-lead) MAX_LEAD=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[[ $MAX_LEAD =~ ^[0-9]{1,7}$ ]] || { echo "bench/faults: --max-lead: '$MAX_LEAD' is not a number of steps in 0..9999999 (0: off)" >&2; exit 2; }
MAX_LEAD=$((10#$MAX_LEAD))  # decimal, as TOML writes it: 0999 is 999
[[ -z $SEEDS || ( $SEEDS =~ ^[1-9][0-9]{0,2}$ && $SEEDS -le 100 ) ]] || { echo "bench/faults: --seeds: '$SEEDS' is not a number of seeds in 1..100" >&2; exit 2; }
[[ -z $RTO_MAX_MS || ( $RTO_MAX_MS =~ ^[0-9]{1,9}$ && $((10#$RTO_MAX_MS)) -ge 1 ) ]] || { echo "bench/faults: --rto-max-ms: '$RTO_MAX_MS' is not a number of milliseconds >= 1" >&2; exit 2; }
[[ -z $RTO_MAX_MS ]] || RTO_MAX_MS=$((10#$RTO_MAX_MS))
ONLY=${ONLY//[[:space:]]/,}  # "a, b" and "a b" name a and b, as "a,b" does
IFS=, read -ra only_names <<<"$ONLY"
for s in "${only_names[@]}"; do
  [[ -z $s || ,$SCENARIOS, == *,"$s",* ]] || { echo "bench/faults: --only: unknown scenario '$s' (known: $SCENARIOS)" >&2; exit 2; }
done
want() { [[ -z $ONLY || ,$ONLY, == *,$1,* ]]; }  # NAME...: is any of them selected?
wants() { local n; for n in "$@"; do want "$n" && return 0; done; return 1; }
skip_case() { echo "skip 0 false null" >"$TMP/$1.res"; }
RUN=$BUILD/tools/gossip-run
EXE=$BUILD/examples/fashion_mnist
SWITCH=$BUILD/transports/switch/gossip-switch-udp
for f in "$RUN" "$EXE"; do
  [[ -x $f ]] || { echo "bench/faults: $f is missing; build it (ninja -C $BUILD tools/gossip-run examples/fashion_mnist)" >&2; exit 1; }
done
# --out: a directory this run can create or write (checked now, not when the JSON is written at the end).
[[ -n $OUT ]] || { echo "bench/faults: --out needs a directory, not ''" >&2; exit 2; }
probe=$OUT; while [[ ! -e $probe ]]; do probe=$(dirname "$probe"); done
if [[ -e $OUT && ! -d $OUT ]]; then echo "bench/faults: --out $OUT: is a file, not a directory" >&2; exit 2
elif [[ ! -w $probe ]]; then echo "bench/faults: --out $OUT: $probe is not writable" >&2; exit 2; fi
mkdir -p "$OUT"
TMP=$(mktemp -d /tmp/gossip-faults.XXXXXX)
NS_PREFIX=gfault$$
NS_MADE=()
BG=()
SW=
cleanup() {
  # Only what this script started, by PID: each `timeout` passes SIGTERM on to
  # its gossip-run, which stops its ranks (SIGKILL after its grace period).
  local p left
  if [[ -n $SW ]]; then kill -KILL "$SW" 2>/dev/null || true; fi
  for p in "${BG[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 1 80); do
    left=0
    for p in "${BG[@]}"; do kill -0 "$p" 2>/dev/null && left=1; done
    ((left)) || break
    sleep 0.1
  done
  for ns in "${NS_MADE[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  ip link del "${NS_PREFIX}br" 2>/dev/null || true
  if [[ -n ${FAULTS_KEEP:-} ]]; then echo "bench/faults: each run's output is kept in $TMP (FAULTS_KEEP)"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if ((QUICK)); then LIMIT=24000; EPOCHS=3; else LIMIT=0; EPOCHS=4; fi
[[ -n $SEEDS ]] || SEEDS=$( ((QUICK)) && echo 3 || echo 5 )
LIMIT_S=600  # a run that takes longer has hung

config() {  # WORLD → a config file
  local f=$TMP/w$1.toml
  cat >"$f" <<TOML
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
timeout_s = 60
max_lead = $MAX_LEAD
[train]
workers = $1
epochs = $EPOCHS
train_limit = $LIMIT
TOML
  echo "$f"
}

# pids of gossip-run's children with GOSSIP_RANK in RANKS
rank_pids() {
  local gr=$1; shift
  local p r
  for p in $(pgrep -P "$gr"); do
    r=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | sed -n 's/^GOSSIP_RANK=//p')
    for want in "$@"; do if [[ $r == "$want" ]]; then echo "$p"; fi; done
  done
  return 0
}

# run NAME WORLD FAULT AT_S [prefix command for each rank]
#   FAULT: none | kill:R,R | stop:R:SECONDS
# Writes $TMP/NAME.{json,out,err,res}: res holds rc, wall, hung, detect_s,
# injected (false when no rank to fault was still running at AT_S).
run_case() {
  local name=$1 world=$2 fault=$3 at=$4; shift 4
  local cfg; cfg=$(config "$world")
  local o=$TMP/$name
  local start=$SECONDS
  # shellcheck disable=SC2086
  timeout -k 10 "$LIMIT_S" env UCX_NET_DEVICES="${FAULTS_NET_DEVICES:-lo}" UCX_TLS=tcp \
    "$RUN" -n "$world" --on-failure continue ${MASTER_ADDR:+--master-addr $MASTER_ADDR} --config "$cfg" -- \
    "$@" "$EXE" --seed "$SEED" --json "$o.json" >"$o.out" 2>"$o.err" &
  local tp=$! gr="" detect=null t_start t_header=null injected=true
  t_start=$(date +%s.%N)
  BG+=("$tp")
  for _ in $(seq 1 100); do gr=$(pgrep -P "$tp" -x gossip-run || true); [[ -n $gr ]] && break; sleep 0.05; done
  # Training starts when rank 0 prints the table header (data loaded); a rank
  # killed before it has connected stops the start-up, not training.
  for _ in $(seq 1 2400); do
    if grep -q "epoch *loss" "$o.out"; then t_header=$(awk -v a="$(date +%s.%N)" -v b="$t_start" 'BEGIN{printf "%.2f", a-b}'); break; fi
    kill -0 "$tp" 2>/dev/null || break
    sleep 0.05
  done
  if [[ $fault != none && -n $gr ]]; then
    sleep "$at"
    local t0 victims
    case $fault in
      kill:*)
        IFS=, read -ra victims <<<"${fault#kill:}"
        t0=$(date +%s.%N)
        local hit=0
        for p in $(rank_pids "$gr" "${victims[@]}"); do kill -9 "$p" 2>/dev/null && hit=$((hit + 1)); done
        ((hit > 0)) || injected=false
        # detect_s: until a survivor logs the failure of one of them
        for _ in $(seq 1 1200); do
          if grep -Eq "peer rank ($(IFS='|'; echo "${victims[*]}")) \(host .*\) failed" "$o.err"; then
            detect=$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN{printf "%.3f", a-b}'); break
          fi
          kill -0 "$tp" 2>/dev/null || break
          sleep 0.05
        done ;;
      stop:*)
        local r=${fault#stop:}; local secs=${r#*:}; r=${r%%:*}
        local p; p=$(rank_pids "$gr" "$r")
        if [[ -n $p ]] && kill -STOP "$p" 2>/dev/null; then
          sleep "$secs"; kill -CONT "$p" 2>/dev/null || true
        else
          injected=false
        fi ;;
    esac
  fi
  local rc=0
  wait "$tp" || rc=$?
  local hung=false
  [[ $rc == 124 || $rc == 137 ]] && hung=true
  echo "$rc $((SECONDS - start)) $hung $detect $injected" >"$o.res"
  # From the header to the end: what "30 % of training" is measured against
  awk -v w="$(awk -v a="$(date +%s.%N)" -v b="$t_start" 'BEGIN{print a-b}')" -v h="$t_header" \
    'BEGIN{ if (h == "null") print 5; else printf "%.2f\n", w - h }' >"$o.train_s"
}

# --- network namespaces for the loss scenario --------------------------------
NET=10.77.$(($$ % 200 + 20))
loss_setup() {  # WORLD
  local br=${NS_PREFIX}br
  ip link add "$br" type bridge
  ip link set "$br" up
  for ((r = 0; r < $1; r++)); do
    local ns=${NS_PREFIX}r$r
    ip netns add "$ns"
    NS_MADE+=("$ns")
    ip link add "${NS_PREFIX}h$r" type veth peer name eth0 netns "$ns"
    ip link set "${NS_PREFIX}h$r" master "$br" up
    ip -n "$ns" addr add "$NET.$((r + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    if [[ -n $RTO_MAX_MS ]]; then
      ip netns exec "$ns" sysctl -qw net.ipv4.tcp_rto_max_ms="$RTO_MAX_MS" ||
        { echo "bench/faults: --rto-max-ms: this kernel has no net.ipv4.tcp_rto_max_ms (Linux >= 6.15 needed)" >&2; exit 1; }
    fi
    # 10 % of packets dropped at random, in and out of each rank
    if command -v nft >/dev/null; then
      ip netns exec "$ns" nft -f - <<NFT
table inet gfault {
  chain in { type filter hook input priority 0; policy accept; iifname "eth0" numgen random mod 10 0 drop; }
  chain out { type filter hook output priority 0; policy accept; oifname "eth0" numgen random mod 10 0 drop; }
}
NFT
    else
      ip netns exec "$ns" iptables -A INPUT -i eth0 -m statistic --mode random --probability 0.1 -j DROP
      ip netns exec "$ns" iptables -A OUTPUT -o eth0 -m statistic --mode random --probability 0.1 -j DROP
    fi
  done
}
loss_check() {  # a ping flood measures what is dropped: a request and its reply pass 4 rules, 1 − 0.9⁴ ≈ 34 %
  local got
  got=$(ip netns exec "${NS_PREFIX}r0" ping -q -c 200 -i 0.01 -W 1 "$NET.2" 2>&1 | sed -n 's/.* \([0-9.]*\)% packet loss.*/\1/p')
  echo "${got:-?}"
}

# --- the switch restart ------------------------------------------------------
SW_PORT=
switch_start() {  # starts gossip-switch-udp on $SW_PORT (a free one the first time)
  local try p
  for try in 1 2 3 4 5; do
    p=${SW_PORT:-$((47100 + (RANDOM % 800)))}
    "$SWITCH" --bind 127.0.0.1 --port "$p" --group "id=1,mode=sync,members=4,slots=128" \
      --group "id=2,mode=async,members=4,elements=$SW_ELEMENTS" >>"$TMP/switch.log" 2>&1 &
    SW=$!
    for _ in $(seq 1 50); do
      local served; served=$(grep -c serving "$TMP/switch.log" 2>/dev/null) || true
      if ((${served:-0} > ${SW_STARTS:-0})); then
        SW_PORT=$p; SW_STARTS=$((${SW_STARTS:-0} + 1)); return 0
      fi
      kill -0 "$SW" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$SW" 2>/dev/null || true; wait "$SW" 2>/dev/null || true; SW=
    [[ -n $SW_PORT ]] && sleep 0.5  # the port of a killed switch: try it again
  done
  return 1
}
switch_stop() { [[ -n $SW ]] || return 0; kill -KILL "$SW" 2>/dev/null || true; wait "$SW" 2>/dev/null || true; SW=; }
SW_HIDDEN=128
SW_ELEMENTS=$((784 * SW_HIDDEN + SW_HIDDEN + SW_HIDDEN * 10 + 10))
# run_switch NAME restart|none AT_S: 4 workers as threads through the switch
run_switch() {
  local name=$1 fault=$2 at=$3 o=$TMP/$1 start=$SECONDS
  local cfg; cfg=$(config 4)
  timeout -k 10 "$LIMIT_S" "$EXE" --config "$cfg" --seed "$SEED" --set transport.name=switch --set topology.name=switch \
    --set protocol.name=switch-aggregate --set transport.address=127.0.0.1 --set transport.port="$SW_PORT" \
    --set transport.sync_group=1 --set transport.async_group=2 --set transport.timeout_s=20 --set engine.timeout_s=30 \
    --set transport.mode=async --set protocol.mode=async \
    --set "train.hidden=[$SW_HIDDEN]" --json "$o.json" >"$o.out" 2>"$o.err" &
  local tp=$! t_start; t_start=$(date +%s.%N)
  BG+=("$tp")
  for _ in $(seq 1 2400); do grep -q "epoch *loss" "$o.out" && break; kill -0 "$tp" 2>/dev/null || break; sleep 0.05; done
  local t_header; t_header=$(awk -v a="$(date +%s.%N)" -v b="$t_start" 'BEGIN{printf "%.2f", a-b}')
  if [[ $fault == restart ]]; then
    sleep "$at"
    switch_stop
    switch_start || echo "bench/faults: gossip-switch-udp did not start again on port $SW_PORT" >>"$o.err"
  fi
  local rc=0
  wait "$tp" || rc=$?
  local hung=false
  [[ $rc == 124 || $rc == 137 ]] && hung=true
  echo "$rc $((SECONDS - start)) $hung null" >"$o.res"
  awk -v w="$(awk -v a="$(date +%s.%N)" -v b="$t_start" 'BEGIN{print a-b}')" -v h="$t_header" 'BEGIN{printf "%.2f\n", w - h}' >"$o.train_s"
}

echo "bench/faults: $( ((QUICK)) && echo quick || echo full ) — $EPOCHS epochs, train_limit $LIMIT, $SEEDS seeds, UCX_TLS=tcp, gossip-run --on-failure continue, max_lead $MAX_LEAD"
LOSS_MEASURED=null
NETNS_OK=0
if ! want loss-10pct; then
  :
elif ! command -v nft >/dev/null && ! command -v iptables >/dev/null; then
  echo "neither nft nor iptables is installed (apt-get install nftables)" >"$TMP/loss-10pct.why"
  echo "  $(cat "$TMP/loss-10pct.why"); loss-10pct skipped"
elif ip netns add "${NS_PREFIX}probe" 2>/dev/null; then
  ip netns del "${NS_PREFIX}probe"
  loss_setup 4
  LOSS_MEASURED=$(loss_check)
  NETNS_OK=1
  echo "  ping between two ranks' namespaces: $LOSS_MEASURED % lost (10 % at each of the 4 rules a request and its reply pass: about 34 % expected)"
else
  echo "  cannot create network namespaces here (not root?); loss-10pct skipped"
fi
SWITCH_OK=0
if ! want switch-restart; then
  :
elif [[ -x $SWITCH ]]; then
  if switch_start; then SWITCH_OK=1; else echo "  gossip-switch-udp did not start; switch-restart skipped"; fi
else
  echo "  $SWITCH is not built (DPDK found? ninja -C $BUILD transports/switch/gossip-switch-udp); switch-restart skipped"
fi
declare -A AT
for ((SEED = 1; SEED <= SEEDS; SEED++)); do
  if wants kill-1-of-4 sigstop-20s || { ((NETNS_OK)) && want loss-10pct; }; then
    echo "  seed $SEED: fault-free 4 ranks..."
    run_case "base4-s$SEED" 4 none 0
    AT[4]=$(awk -v w="$(cat "$TMP/base4-s$SEED.train_s")" 'BEGIN{printf "%.1f", 0.3*w}')
  else
    skip_case "base4-s$SEED"
  fi
  if want kill-2-of-8; then
    echo "  seed $SEED: fault-free 8 ranks..."
    run_case "base8-s$SEED" 8 none 0
    AT[8]=$(awk -v w="$(cat "$TMP/base8-s$SEED.train_s")" 'BEGIN{printf "%.1f", 0.3*w}')
  else
    skip_case "base8-s$SEED"
  fi
  if want kill-1-of-4; then
    echo "  seed $SEED: kill -9 of rank 2 of 4 at ${AT[4]} s..."
    run_case "kill-1-of-4-s$SEED" 4 kill:2 "${AT[4]}"
  else
    skip_case "kill-1-of-4-s$SEED"
  fi
  if want kill-2-of-8; then
    echo "  seed $SEED: kill -9 of ranks 3 and 6 of 8 at ${AT[8]} s..."
    run_case "kill-2-of-8-s$SEED" 8 kill:3,6 "${AT[8]}"
  else
    skip_case "kill-2-of-8-s$SEED"
  fi
  if want sigstop-20s; then
    echo "  seed $SEED: SIGSTOP of rank 1 of 4 for 20 s at ${AT[4]} s..."
    run_case "sigstop-20s-s$SEED" 4 stop:1:20 "${AT[4]}"
  else
    skip_case "sigstop-20s-s$SEED"
  fi
  if ((NETNS_OK)) && want loss-10pct; then
    echo "  seed $SEED: 10 % packet loss on every link..."
    MASTER_ADDR=$NET.1 FAULTS_NET_DEVICES=eth0 \
      run_case "loss-10pct-s$SEED" 4 none 0 sh -c "exec ip netns exec ${NS_PREFIX}r\$GOSSIP_RANK \"\$0\" \"\$@\""
  else
    echo "skip 0 false null" >"$TMP/loss-10pct-s$SEED.res"
  fi
  if ((SWITCH_OK)) && want switch-restart; then
    echo "  seed $SEED: through the switch, fault-free and with the switch restarted..."
    run_switch "baseswitch-s$SEED" none 0
    AT[switch]=$(awk -v w="$(cat "$TMP/baseswitch-s$SEED.train_s")" 'BEGIN{printf "%.1f", 0.3*w}')
    run_switch "switch-restart-s$SEED" restart "${AT[switch]}"
  else
    echo "skip 0 false null" >"$TMP/baseswitch-s$SEED.res"
    echo "skip 0 false null" >"$TMP/switch-restart-s$SEED.res"
  fi
done
switch_stop

GOSSIP_BENCH_DIR="$SRC/bench" /usr/bin/python3 - "$TMP" "$OUT/faults.json" "$QUICK" "$LOSS_MEASURED" "$SEEDS" "$ONLY" "$RTO_MAX_MS" "$MAX_LEAD" <<'PY'
import json, math, os, re, statistics, sys
sys.path.insert(0, os.environ["GOSSIP_BENCH_DIR"])
from results import write_json
tmp, out, quick, loss_measured, seeds = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4], int(sys.argv[5])
only = [s for s in sys.argv[6].split(",") if s]
rto_max_ms = int(sys.argv[7]) if sys.argv[7] else None
max_lead = int(sys.argv[8])
def load(name):
    rc, wall, hung, detect, *rest = open(f"{tmp}/{name}.res").read().split()
    j = None
    if os.path.exists(f"{tmp}/{name}.json"):
        try: j = json.load(open(f"{tmp}/{name}.json"))
        except ValueError: j = None
    err = ""
    for ext in ("err", "out"):
        if os.path.exists(f"{tmp}/{name}.{ext}"): err += open(f"{tmp}/{name}.{ext}", errors="replace").read()
    return dict(rc=rc, wall=float(wall), hung=hung == "true", detect=None if detect == "null" else float(detect), json=j, err=err,
                injected=not rest or rest[0] != "false")
def mean_sd(v):
    v = [x for x in v if x is not None]
    if not v: return None, None
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else None)
S = range(1, seeds + 1)
base = {w: [load(f"base{w}-s{s}") for s in S] for w in ("4", "8", "switch")}
# (name, baseline, world, ranks killed)
cases = [("kill-1-of-4", "4", 4, 1), ("kill-2-of-8", "8", 8, 2), ("sigstop-20s", "4", 4, 0),
         ("loss-10pct", "4", 4, 0), ("switch-restart", "switch", 4, 0)]
rows = []
for name, bkey, world, killed in cases:
    runs = [load(f"{name}-s{s}") for s in S]
    if all(r["rc"] == "skip" for r in runs):
        why = ("not selected (--only)" if only and name not in only
               else (open(f"{tmp}/loss-10pct.why").read().strip() if os.path.exists(f"{tmp}/loss-10pct.why")
                     else "cannot create network namespaces here") if name == "loss-10pct" else "gossip-switch-udp is not built or did not start")
        rows.append(dict(name=name, ok=None, survivors_finished=None, hung=False, accuracy_delta_pt=None, accuracy_delta_sigma_pt=None,
                         lost_mass=None, detect_s=None, seeds=0, message=f"skipped: {why}"))
        continue
    deltas, losts, detects, msgs, finished_all, hung_any, lost_reported = [], [], [], [], True, False, True
    accs, base_accs, survivors = [], [], []
    for s, r, b in zip(S, runs, base[bkey]):
        j = r["json"]
        # every rank that was not killed finishes (a rank taken for dead under loss or a stop is a failure)
        finished = r["rc"] == "0" and j is not None and (name == "switch-restart" or j.get("survivors") == world - killed)
        finished_all &= finished
        survivors.append(None if j is None else (world if name == "switch-restart" else j.get("survivors")))
        hung_any |= r["hung"]
        acc = j["accuracy"] if j else None
        base_acc = b["json"]["accuracy"] if b["json"] else None
        accs.append(acc); base_accs.append(base_acc)
        if acc is not None and base_acc is not None and finished: deltas.append(100 * (acc - base_acc))
        lost = j.get("lost_weight") if j else None
        if name == "switch-restart" and j is not None: lost = 0.0  # no push-sum mass through the switch
        if lost is None or lost < 0 or (killed > 0 and not lost > 0): lost_reported = False
        losts.append(lost)
        if r["detect"] is not None: detects.append(r["detect"])
        m = []
        e = re.search(r"^(?:\[\d+\] )?error: (.*)$", r["err"], re.M)
        if not r["injected"]:
            # A run that failed on its own error (a bad flag or config) says so first; only a run that ended cleanly was too fast.
            m.append("fault not injected: the run failed before it (its error follows)" if e and r["rc"] != "0" else
                     "fault not injected: the run ended before it (a fault-free pair much slower than this run; rerun on a quieter machine)")
        if r["hung"]: m.append(f"hung: stopped after {r['wall']:.0f} s")
        if r["rc"] != "0": m.append(f"exited {r['rc']}")
        if "internal check failed" in r["err"]: m.append("an internal check failed")
        if "Assertion" in r["err"]: m.append("a UCX assertion failed")
        if e: m.append("error: " + e.group(1)[:200])
        d = re.search(r"did not finish: (.*)", r["err"])
        if d: m.append("dead: " + d.group(1)[:200])
        if j and name != "switch-restart": m.append(f"{j.get('survivors')} of {world} finished")
        msgs.append(f"seed {s}: " + (", ".join(m) if m else "finished") + f" ({r['wall']:.0f} s)")
    dm, dsd = mean_sd(deltas)
    n = len(deltas)
    se = dsd / math.sqrt(n) if dsd is not None else None
    within = dm is not None and n == seeds and abs(dm) <= 1.0 + (2 * se if se is not None else 0.0)
    ok = (not hung_any and finished_all and within and lost_reported
          and not any("internal check failed" in r["err"] or "Assertion" in r["err"] for r in runs))
    lm = [x for x in losts if x is not None]
    head = []
    if name == "switch-restart":
        rj = [sum(st.get("transport_rejoins", 0) for st in (r["json"] or {}).get("ranks", []) if isinstance(st, dict)) for r in runs]
        head.append("workers that rejoined the restarted switch per seed: " + " ".join(str(x) for x in rj))
    if name == "loss-10pct" and loss_measured != "null": head.append(f"ping between two ranks lost {loss_measured} %")
    if name == "loss-10pct" and rto_max_ms: head.append(f"TCP retransmission timeout capped at {rto_max_ms} ms")
    if dm is not None: head.append(f"Δ per seed " + " ".join(f"{d:+.2f}" for d in deltas) + (f" (mean ± 2σ/√n: {dm:+.2f} ± {2 * se:.2f})" if se is not None else ""))
    rows.append(dict(name=name, ok=ok, survivors_finished=finished_all, hung=hung_any,
                     accuracy_delta_pt=None if dm is None else round(dm, 2),
                     accuracy_delta_sigma_pt=None if dsd is None else round(dsd, 2),
                     lost_mass=None if not lm else round(statistics.fmean(lm), 4),
                     detect_s=None if not detects else round(statistics.fmean(detects), 2),
                     message="; ".join(head + msgs),
                     seeds=seeds, survivors_per_seed=survivors, accuracy_deltas_pt=[round(d, 2) for d in deltas], lost_mass_per_seed=losts,
                     detect_s_per_seed=[round(d, 3) for d in detects], accuracy=accs, baseline_accuracy=base_accs,
                     wall_s=[r["wall"] for r in runs]))
baseline = {}
for w, bs in base.items():
    a = [b["json"]["accuracy"] * 100 for b in bs if b["json"]]
    m, sd = mean_sd(a)
    baseline[w] = dict(accuracy_pt=[round(x, 2) for x in a], mean_pt=None if m is None else round(m, 2),
                       sigma_pt=None if sd is None else round(sd, 2), wall_s=[b["wall"] for b in bs], rc=[b["rc"] for b in bs])
doc = dict(quick=quick, seeds=seeds, loss_tcp_rto_max_ms=rto_max_ms, max_lead=max_lead,
           ok_rule="every seed: no hang, every rank not killed finishes and exits 0, lost mass reported (> 0 where ranks were killed); "
                   "and |mean paired Δ| <= 1 pt + 2 σ/√seeds",
           baseline=baseline, scenarios=rows)
write_json(out, doc, "bench/faults", indent=2)
fmt = "{:<15} {:>5} {:>9} {:>5} {:>15} {:>8} {:>8}  {}"
print(fmt.format("scenario", "ok", "finished", "hung", "Δacc pt (σ)", "lost w", "detect s", "message"))
for r in rows:
    sv = lambda v, f="{}": "-" if v is None else f.format(v)
    dd = "-" if r["accuracy_delta_pt"] is None else f"{r['accuracy_delta_pt']:+.2f} ({sv(r['accuracy_delta_sigma_pt'], '{:.2f}')})"
    print(fmt.format(r["name"], sv(r["ok"]), sv(r["survivors_finished"]), sv(r["hung"]), dd,
                     sv(r["lost_mass"], "{:.3f}"), sv(r["detect_s"], "{:.2f}"), r["message"]))
for w, b in baseline.items():
    print(f"baseline {w}: accuracy % per seed {b['accuracy_pt']} (mean {b['mean_pt']}, σ {b['sigma_pt']})")
print(f"written {out}")
# Runs that all failed measured nothing: say so with the exit status too.
ran = [b for bs in base.values() for b in bs if b["rc"] != "skip"] + [r for name, *_ in cases for r in (load(f"{name}-s{s}") for s in S) if r["rc"] != "skip"]
if ran and not any(r["rc"] == "0" and r["json"] for r in ran):
    first = next((m.group(1) for r in ran for m in [re.search(r"^(?:\[\d+\] )?error: (.*)$", r["err"], re.M)] if m), None)
    sys.exit("bench/faults: no run finished, so nothing was measured" + (f"; the first error: {first[:300]}" if first else " (see the messages above)"))
PY
