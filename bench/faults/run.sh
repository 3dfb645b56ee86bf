#!/usr/bin/env bash
# bench/faults — the Fashion-MNIST example as UCX processes under gossip-run
# --on-failure continue, with faults injected from outside:
#   kill-1-of-4   kill -9 of rank 2 of 4 at 30 % of training (of the fault-free
#                 run's time from rank 0's table header, printed once the data
#                 is loaded, to its end: training, evaluation and the barriers)
#   kill-2-of-8   kill -9 of ranks 3 and 6 of 8 at 30 %
#   sigstop-20s   SIGSTOP of rank 1 of 4 at 30 %, SIGCONT 20 s later
#   loss-10pct    every rank in its own network namespace on a bridge, 10 % of
#                 packets dropped at random (nftables numgen, or iptables
#                 statistic) on every rank's link, both directions
# Each is compared with a fault-free run of the same world (the loss run with
# the fault-free 4-rank run). A scenario is ok when nothing hangs, the
# survivors finish and gossip-run exits 0, the accuracy of the survivors'
# average model is within 1 pt of the fault-free run, and the lost push-sum
# mass is reported. Writes DIR/faults.json and prints a table.
#
#   bench/faults/run.sh [BUILD_DIR] [--quick] [--out DIR]
#
# --quick: a 24000-sample slice, 3 epochs (a few minutes); otherwise the full
# 60000 samples, 4 epochs. Namespaces and firewall rules are made by this
# script only and removed on exit, also on failure.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$SRC/build
if [[ $# -gt 0 && $1 != --* ]]; then BUILD=$1; shift; fi
QUICK=0; OUT=$SRC/results
while [[ $# -gt 0 ]]; do
  case $1 in
    --quick) QUICK=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
RUN=$BUILD/tools/gossip-run
EXE=$BUILD/examples/fashion_mnist
for f in "$RUN" "$EXE"; do
  [[ -x $f ]] || { echo "bench/faults: $f is missing; build it (ninja -C $BUILD tools/gossip-run examples/fashion_mnist)" >&2; exit 1; }
done
mkdir -p "$OUT"
TMP=$(mktemp -d /tmp/gossip-faults.XXXXXX)
NS_PREFIX=gfault$$
NS_MADE=()
BG=()
cleanup() {
  # Only what this script started, by PID: each `timeout` passes SIGTERM on to
  # its gossip-run, which stops its ranks (SIGKILL after its grace period).
  local p left
  for p in "${BG[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 1 80); do
    left=0
    for p in "${BG[@]}"; do kill -0 "$p" 2>/dev/null && left=1; done
    ((left)) || break
    sleep 0.1
  done
  for ns in "${NS_MADE[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  ip link del "${NS_PREFIX}br" 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if ((QUICK)); then LIMIT=24000; EPOCHS=3; else LIMIT=0; EPOCHS=4; fi
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
# Writes $TMP/NAME.{json,out,err,res}: res holds rc, wall, hung, detect_s.
run_case() {
  local name=$1 world=$2 fault=$3 at=$4; shift 4
  local cfg; cfg=$(config "$world")
  local o=$TMP/$name
  local start=$SECONDS
  # shellcheck disable=SC2086
  timeout -k 10 "$LIMIT_S" env UCX_NET_DEVICES="${UCX_NET_DEVICES_FAULTS:-lo}" UCX_TLS=tcp \
    "$RUN" -n "$world" --on-failure continue ${MASTER_ADDR:+--master-addr $MASTER_ADDR} --config "$cfg" -- \
    "$@" "$EXE" --json "$o.json" >"$o.out" 2>"$o.err" &
  local tp=$! gr="" detect=null t_start t_header=null
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
        for p in $(rank_pids "$gr" "${victims[@]}"); do kill -9 "$p" 2>/dev/null || true; done
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
        if [[ -n $p ]]; then
          kill -STOP "$p"; sleep "$secs"; kill -CONT "$p"
        fi ;;
    esac
  fi
  local rc=0
  wait "$tp" || rc=$?
  local hung=false
  [[ $rc == 124 || $rc == 137 ]] && hung=true
  echo "$rc $((SECONDS - start)) $hung $detect" >"$o.res"
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
loss_check() {  # a ping flood measures what is dropped (two directions: about 19 %)
  local got
  got=$(ip netns exec "${NS_PREFIX}r0" ping -q -c 200 -i 0.01 -W 1 "$NET.2" 2>&1 | sed -n 's/.* \([0-9.]*\)% packet loss.*/\1/p')
  echo "${got:-?}"
}

echo "bench/faults: $( ((QUICK)) && echo quick || echo full ) — $EPOCHS epochs, train_limit $LIMIT, UCX_TLS=tcp, gossip-run --on-failure continue"
declare -A AT
echo "  fault-free runs (4 and 8 ranks)..."
run_case base4 4 none 0
run_case base8 8 none 0
AT[4]=$(awk -v w="$(cat "$TMP/base4.train_s")" 'BEGIN{printf "%.1f", 0.3*w}')
AT[8]=$(awk -v w="$(cat "$TMP/base8.train_s")" 'BEGIN{printf "%.1f", 0.3*w}')
echo "  kill -9 of rank 2 of 4 at ${AT[4]} s..."
run_case kill-1-of-4 4 kill:2 "${AT[4]}"
echo "  kill -9 of ranks 3 and 6 of 8 at ${AT[8]} s..."
run_case kill-2-of-8 8 kill:3,6 "${AT[8]}"
echo "  SIGSTOP of rank 1 of 4 for 20 s at ${AT[4]} s..."
run_case sigstop-20s 4 stop:1:20 "${AT[4]}"
echo "  10 % packet loss on every link (network namespaces)..."
LOSS_MEASURED=null
if ip netns add "${NS_PREFIX}probe" 2>/dev/null; then
  ip netns del "${NS_PREFIX}probe"
  loss_setup 4
  LOSS_MEASURED=$(loss_check)
  echo "    ping between two ranks' namespaces: $LOSS_MEASURED % lost (10 % each way)"
  MASTER_ADDR=$NET.1 UCX_NET_DEVICES_FAULTS=eth0 \
    run_case loss-10pct 4 none 0 sh -c "exec ip netns exec ${NS_PREFIX}r\$GOSSIP_RANK \"\$0\" \"\$@\""
else
  echo "    cannot create network namespaces here (not root?); loss-10pct skipped"
  echo "skip 0 false null" >"$TMP/loss-10pct.res"
fi

/usr/bin/python3 - "$TMP" "$OUT/faults.json" "$QUICK" "$LOSS_MEASURED" <<'PY'
import json, os, re, sys
tmp, out, quick, loss_measured = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
def load(name):
    rc, wall, hung, detect = open(f"{tmp}/{name}.res").read().split()
    j = None
    if os.path.exists(f"{tmp}/{name}.json"):
        try: j = json.load(open(f"{tmp}/{name}.json"))
        except ValueError: j = None
    err = open(f"{tmp}/{name}.err").read() if os.path.exists(f"{tmp}/{name}.err") else ""
    return dict(rc=rc, wall=float(wall), hung=hung == "true", detect=None if detect == "null" else float(detect), json=j, err=err)
base = {4: load("base4"), 8: load("base8")}
cases = [("kill-1-of-4", 4, True), ("kill-2-of-8", 8, True), ("sigstop-20s", 4, False), ("loss-10pct", 4, False)]
rows = []
for name, world, killed in cases:
    r = load(name)
    b = base[world]
    if r["rc"] == "skip":
        rows.append(dict(name=name, ok=None, survivors_finished=None, hung=False, accuracy_delta_pt=None, lost_mass=None, detect_s=None,
                         message="skipped: cannot create network namespaces here"))
        continue
    j = r["json"]
    finished = r["rc"] == "0" and j is not None
    acc = j["accuracy"] if j else None
    base_acc = b["json"]["accuracy"] if b["json"] else None
    delta = round(100 * (acc - base_acc), 2) if acc is not None and base_acc is not None else None
    lost = j.get("lost_weight") if j else None
    m = re.search(r"did not finish: (.*)", r["err"])
    msgs = []
    if r["hung"]: msgs.append(f"hung: stopped after {r['wall']:.0f} s")
    if r["rc"] != "0": msgs.append(f"gossip-run exited {r['rc']}")
    if "internal check failed" in r["err"]: msgs.append("an internal check failed")
    if "timed out" in r["err"]: msgs.append("a wait timed out")
    if m: msgs.append("dead: " + m.group(1))
    if j and j.get("dead_ranks"): msgs.append("rank 0 named " + ", ".join(f"rank {d['rank']} ({d['reason']})" for d in j["dead_ranks"]))
    if j: msgs.append(f"{j.get('survivors')} of {world} finished, {r['wall']:.0f} s (fault-free {b['wall']:.0f} s)")
    if name == "loss-10pct" and loss_measured != "null": msgs.append(f"ping between two ranks lost {loss_measured} %")
    ok = (not r["hung"] and finished and delta is not None and abs(delta) <= 1.0 and lost is not None
          and (lost > 0 if killed else True) and "internal check failed" not in r["err"])
    rows.append(dict(name=name, ok=ok, survivors_finished=finished, hung=r["hung"], accuracy_delta_pt=delta, lost_mass=lost,
                     detect_s=None if r["detect"] is None else round(r["detect"], 2), message="; ".join(msgs),
                     accuracy=acc, baseline_accuracy=base_acc, wall_s=r["wall"]))
doc = dict(quick=quick, baseline={str(w): dict(accuracy=b["json"]["accuracy"] if b["json"] else None, wall_s=b["wall"], rc=b["rc"]) for w, b in base.items()},
           scenarios=rows)
json.dump(doc, open(out, "w"), indent=2)
fmt = "{:<13} {:>4} {:>9} {:>5} {:>9} {:>9} {:>8}  {}"
print(fmt.format("scenario", "ok", "finished", "hung", "Δacc pt", "lost w", "detect s", "message"))
for r in rows:
    s = lambda v, f="{}": "-" if v is None else f.format(v)
    print(fmt.format(r["name"], s(r["ok"], "{}"), s(r["survivors_finished"]), s(r["hung"]), s(r["accuracy_delta_pt"], "{:+.2f}"),
                     s(r["lost_mass"], "{:.3f}"), s(r["detect_s"], "{:.2f}"), r["message"]))
print(f"baseline accuracy: 4 ranks {doc['baseline']['4']['accuracy']}, 8 ranks {doc['baseline']['8']['accuracy']}; written {out}")
PY
