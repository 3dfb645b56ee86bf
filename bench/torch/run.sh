#!/usr/bin/env bash
# bench/torch — time to accuracy of PyTorch training: torch DDP (gloo) against
# the Python module `gossip`, 4 ranks under torchrun, each rank in its own
# network namespace behind a rate-limited veth link.
#
#   bash bench/torch/run.sh BUILD [--quick] [--rate MBIT] [--seeds N] [--out DIR] [--check-args]
#                                 [--delay-ms MS] [--train-limit N] [--epochs N] [--momentum auto|quasi-global|local]
#                                 [--set SECTION.KEY=VALUE]...
#
# Runs, each with the same CNN (examples/03_libtorch_cnn: two 5x5 conv layers,
# 16 and 32 channels, fc 128, about 215k parameters) on iid shards of
# Fashion-MNIST, batch 32 per rank, SGD lr 0.05 momentum 0.9, lr x0.1 at 50 %
# and 75 % of the steps:
#   ddp       torch DistributedDataParallel (gloo), gradients all-reduced every step
#   periodic  libgossip, policy periodic every 1 (push-sum over UCX)
#   default   libgossip with the config's defaults (config = {})
#   none      no communication (each rank alone): the speed limit
# Every rank keeps copies of its parameters at 12 points; the ranks' average
# model (push-sum weighted) is evaluated afterwards on the 10000 test images,
# against training time (max over ranks, evaluation excluded) and bytes sent
# (the ranks' eth0 tx_bytes, headers included). Writes DIR/torch.json and
# DIR/torch.png, and prints a table.
#
# Network: a bridge in the root namespace, one veth per rank; tbf at --rate
# Mbit/s (default 100) on both ends of each veth, so each rank's link is that
# fast in each direction. This kernel has no netem: latency is emulated only
# where `tc qdisc add ... netem` works (--delay-ms, default 0). Namespaces and
# links are made by this script only and removed on exit, also on error.
#
# torchrun: one torchrun (the agent, in the root namespace, serving its store
# on the bridge address) starts the 4 ranks with --no_python through a wrapper
# that runs `ip netns exec <rank's namespace> python3 worker.py`. That is a
# real torchrun launch (its environment, store and process supervision) while
# each rank's traffic, gloo's and UCX's, leaves through its own shaped link
# (GLOO_SOCKET_IFNAME=eth0, UCX_NET_DEVICES=eth0, UCX_TLS=tcp so that UCX does
# not take shared memory between processes of one host).
#
# --quick: 12000 training samples, 2 epochs, 1 seed (about 10 minutes on 2
# loaded cores); otherwise the full 60000, 2 epochs, 3 seeds. --momentum:
# the gossip runs pass SGD to the engine (optimizer=, as README's script
# does) with [engine] momentum = auto (the default: local over UCX) or
# quasi-global, or keep the optimizer to themselves (local). --set adds a
# config key to both gossip runs (policy.* to the default run only), e.g.
# --set codec.name=int8; the JSON records them (train.* is refused: the
# flags above set the training). --check-args validates
# the arguments and the build, prints the plan and exits (no root needed).
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$SRC/bench/torch
usage() {  # usage [STATUS]: 0 (asked for, to stdout) or 2 (a bad argument, to stderr)
  if [[ ${1:-2} == 0 ]]; then sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2
}
BUILD=$SRC/build
if [[ $# -gt 0 && $1 != -* ]]; then BUILD=$1; shift; fi  # (-h is an option, not a directory)
QUICK=0; OUT=$SRC/results; RATE=100; SEEDS=""; CHECK=0; DELAY=0; LIMIT_SET=""; EPOCHS_SET=""; MOMENTUM=auto; SETS=()
num() {  # FLAG VALUE [MAX]: a number in (0, MAX]
  [[ $2 =~ ^[0-9]+([.][0-9]+)?$ ]] && awk -v v="$2" -v hi="${3:-1e9}" 'BEGIN{exit !(v > 0 && v <= hi)}' ||
    { echo "bench/torch: $1 takes a number > 0 and <= ${3:-1e9}, not '$2'" >&2; exit 2; }
}
while [[ $# -gt 0 ]]; do
  case $1 in
    --quick) QUICK=1; shift ;;
    --out) [[ $# -ge 2 && -n $2 ]] || { echo "bench/torch: --out takes a directory" >&2; exit 2; }; OUT=$2; shift 2 ;;
    --rate) [[ $# -ge 2 ]] || usage; num --rate "$2" 100000; awk -v v="$2" 'BEGIN{exit !(v >= 0.01)}' ||
      { echo "bench/torch: --rate below 0.01 Mbit/s would not finish" >&2; exit 2; }; RATE=$2; shift 2 ;;
    --seeds) [[ $# -ge 2 && $2 =~ ^[1-9][0-9]{0,2}$ ]] || { echo "bench/torch: --seeds takes an integer in 1..999" >&2; exit 2; }; SEEDS=$2; shift 2 ;;
    --delay-ms) [[ $# -ge 2 ]] || usage; [[ $2 =~ ^0+([.]0*)?$ ]] && set -- "$1" 0 "${@:3}" || num --delay-ms "$2" 10000; DELAY=$2; shift 2 ;;
    --train-limit) [[ $# -ge 2 && $2 =~ ^[0-9]{1,9}$ ]] || { echo "bench/torch: --train-limit takes an integer >= 0 (0: all)" >&2; exit 2; }; LIMIT_SET=$2; shift 2 ;;
    --epochs) [[ $# -ge 2 && $2 =~ ^[1-9][0-9]{0,3}$ ]] || { echo "bench/torch: --epochs takes an integer in 1..9999" >&2; exit 2; }; EPOCHS_SET=$2; shift 2 ;;
    --momentum) [[ $# -ge 2 && $2 =~ ^(auto|quasi-global|local)$ ]] || { echo "bench/torch: --momentum takes auto, quasi-global or local" >&2; exit 2; }; MOMENTUM=$2; shift 2 ;;
    --set) [[ $# -ge 2 && $2 =~ ^[a-z_]+[.][a-z_][a-z0-9_]*=[^[:space:]]+$ ]] || { echo "bench/torch: --set takes section.key=value (e.g. codec.name=int8), not '${2:-}'" >&2; exit 2; }
      [[ $2 != train.* ]] || { echo "bench/torch: --set $2: [train] keys are not used here; the bench sets training with its own flags: --epochs, --train-limit, --quick (batch 32 and lr 0.05 are fixed)" >&2; exit 2; }
      SETS+=(--set "$2"); shift 2 ;;
    --check-args) CHECK=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "bench/torch: unknown option $1" >&2; usage ;;
  esac
done
PY=/usr/bin/python3  # Debian's interpreter: python3-torch is built for it
if ((QUICK)); then LIMIT=12000; EPOCHS=2; : "${SEEDS:=1}"; else LIMIT=0; EPOCHS=2; : "${SEEDS:=3}"; fi
LIMIT=$((10#${LIMIT_SET:-$LIMIT})); EPOCHS=${EPOCHS_SET:-$EPOCHS}
# --train-limit: at most the 60000 training images, and every rank (a shard of
# LIMIT/4 samples, rounded up or down) the same number of batches of 32, at least one.
if ((LIMIT > 60000)); then
  echo "bench/torch: --train-limit $LIMIT: Fashion-MNIST has 60000 training images; give at most 60000 (0: all)" >&2; exit 2
elif ((LIMIT)); then
  lo=$((LIMIT / 4)) hi=$(((LIMIT + 3) / 4))
  if ((lo < 32)); then
    echo "bench/torch: --train-limit $LIMIT: each of 4 workers has only $lo samples, fewer than one batch of 32; give 128 or more (0: all)" >&2; exit 2
  elif ((lo / 32 != hi / 32)); then
    echo "bench/torch: --train-limit $LIMIT: the 4 workers' shards of $hi and $lo samples make $((hi / 32)) and $((lo / 32)) batches of 32, but every rank must take the same number of steps; give a multiple of 4 (e.g. $((4 * lo)))" >&2; exit 2
  fi
fi
DATA=/usr/share/datasets/fashion-mnist
MODULE=$(compgen -G "$BUILD/python/gossip*.so" | head -n1 || true)
problems=()
[[ -n $MODULE ]] || problems+=("the Python module is missing in $BUILD/python (configure with -Dpython=enabled -Ducx=enabled; ninja -C $BUILD)")
[[ -x $PY ]] || problems+=("$PY is missing (apt-get install python3 python3-torch)")
[[ -f $DATA/train-images-idx3-ubyte.gz ]] || problems+=("Fashion-MNIST is missing in $DATA (apt-get install dataset-fashion-mnist)")
if [[ -x $PY ]] && ! $PY -c 'import torch.distributed.run' 2>/dev/null; then problems+=("torch is missing for $PY (apt-get install python3-torch)"); fi
if [[ -n $MODULE && -x $PY ]] && ! PYTHONPATH=$BUILD/python $PY -c 'import gossip, sys; sys.exit(0 if gossip.has_ucx else 1)' 2>/dev/null; then
  problems+=("the gossip module in $BUILD/python does not load or was built without UCX (-Ducx=enabled)")
fi
echo "bench/torch: $( ((QUICK)) && echo quick || echo full ) — 4 ranks, train_limit $LIMIT, $EPOCHS epochs, $SEEDS seed(s), ${RATE} Mbit/s per link (tbf)$( [[ $DELAY != 0 ]] && echo ", ${DELAY} ms delay (netem, if present)")$( ((${#SETS[@]})) && echo ", gossip config: ${SETS[*]}"), out $OUT"
if ((${#problems[@]} == 0)); then
  # The gossip runs' configs (--set) are checked now, not inside the namespaces minutes later.
  if ! err=$(PYTHONPATH=$BUILD/python $PY "$HERE/worker.py" --check-config 4 --momentum "$MOMENTUM" "${SETS[@]}" 2>&1); then
    problems+=("${err#worker: }")
  fi
  # --out: a directory this run can create or write.
  probe=$OUT; while [[ ! -e $probe ]]; do probe=$(dirname "$probe"); done
  if [[ -e $OUT && ! -d $OUT ]]; then problems+=("--out $OUT: is a file, not a directory")
  elif [[ ! -w $probe ]] || ! (t=$(mktemp -p "$probe" .gossip-probe.XXXXXX 2>/dev/null) && rm -f "$t"); then
    problems+=("--out $OUT: $probe is not writable")  # (root passes -w anywhere: a file is made there and removed)
  fi
fi
if ((${#problems[@]})); then
  printf 'bench/torch: %s\n' "${problems[@]}" >&2
  exit 1
fi
if ((CHECK)); then echo "bench/torch: arguments and build ok (--check-args: nothing run)"; exit 0; fi
[[ $(id -u) == 0 ]] || { echo "bench/torch: network namespaces and tc need root" >&2; exit 1; }
for t in ip tc; do command -v $t >/dev/null || { echo "bench/torch: $t is missing (apt-get install iproute2)" >&2; exit 1; }; done
mkdir -p "$OUT"

TMP=$(mktemp -d /tmp/gossip-torch.XXXXXX)
P=gtorch$$
NET=10.78.$(($$ % 200 + 20))
BR=${P}br
NS_MADE=()
LINKS_MADE=()
BG=()
cleanup() {
  local p left
  for p in "${BG[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 1 100); do
    left=0
    for p in "${BG[@]}"; do kill -0 "$p" 2>/dev/null && left=1; done
    ((left)) || break
    sleep 0.1
  done
  for p in "${BG[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  for ns in "${NS_MADE[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  for l in "${LINKS_MADE[@]}"; do ip link del "$l" 2>/dev/null || true; done
  ip link del "$BR" 2>/dev/null || true
  if [[ -n ${BENCH_TORCH_KEEP:-} ]]; then echo "bench/torch: kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# tbf: burst of 64 kB and 50 ms of queue (PLATFORM.md: 12.3 MB/s for a TCP
# stream at 100mbit), on the rank's side (its uplink) and the bridge's side
# (its downlink) of each veth.
shape() {  # NETNS-ARGS... DEV
  local dev=${*: -1}
  local args=("${@:1:$#-1}")
  if [[ $DELAY != 0 ]] && ((NETEM)); then
    tc "${args[@]}" qdisc add dev "$dev" root handle 1: netem delay "${DELAY}ms"
    tc "${args[@]}" qdisc add dev "$dev" parent 1:1 handle 10: tbf rate "${RATE}mbit" burst 64kb latency 50ms
  else
    tc "${args[@]}" qdisc add dev "$dev" root tbf rate "${RATE}mbit" burst 64kb latency 50ms
  fi
}
NETEM=0
ip link add "${P}n" type dummy 2>/dev/null && {
  tc qdisc add dev "${P}n" root netem delay 1ms 2>/dev/null && NETEM=1
  ip link del "${P}n"
}
if [[ $DELAY != 0 ]] && ((!NETEM)); then echo "bench/torch: this kernel has no netem: --delay-ms $DELAY is not emulated (rate only)"; fi

ip link add "$BR" type bridge
ip addr add "$NET.254/24" dev "$BR"
ip link set "$BR" up
for r in 0 1 2 3; do
  ns=${P}r$r
  ip netns add "$ns"
  NS_MADE+=("$ns")
  ip link add "${P}h$r" type veth peer name eth0 netns "$ns"
  LINKS_MADE+=("${P}h$r")
  ip link set "${P}h$r" master "$BR" up
  ip -n "$ns" addr add "$NET.$((r + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  shape -n "$ns" eth0
  shape "${P}h$r"
done
# The bridge forwards between ports; netfilter on bridged traffic (br_netfilter) would be in the way.
[[ -w /proc/sys/net/bridge/bridge-nf-call-iptables ]] && [[ $(cat /proc/sys/net/bridge/bridge-nf-call-iptables) == 1 ]] && \
  echo "bench/torch: note: bridge-nf-call-iptables is on; host firewall rules see the ranks' traffic"

# Measured link speed: 4 MB through r0 → r1 (python sockets, no extra tools);
# also the check that the namespaces reach each other.
LINK_MBIT=$(timeout -k 5 60 ip netns exec "${P}r1" $PY - "$NET" "${P}r0" <<'PY' 2>/dev/null || echo null
import socket, subprocess, sys, time
net, ns0 = sys.argv[1], sys.argv[2]
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((f"{net}.2", 45123)); s.listen(1); s.settimeout(30)
n = 4 << 20
sender = subprocess.Popen(["ip", "netns", "exec", ns0, sys.executable, "-c",
    f"import socket; c = socket.create_connection(('{net}.2', 45123), timeout=20); c.sendall(b'x' * {n}); c.close()"])
c, _ = s.accept(); c.settimeout(30); got = 0; t0 = time.perf_counter()
while True:
    b = c.recv(1 << 20)
    if not b: break
    got += len(b)
dt = time.perf_counter() - t0
sender.wait()
print(f"{8 * got / dt / 1e6:.1f}")
PY
)
[[ $LINK_MBIT != null ]] || { echo "bench/torch: namespace r0 cannot reach r1 ($NET.2) through bridge $BR" >&2; exit 1; }
echo "  links: $NET.1-4 behind bridge $BR ($NET.254), tbf ${RATE}mbit each way; measured r0→r1 TCP stream: ${LINK_MBIT} Mbit/s"

cat >"$TMP/in_netns.sh" <<SH
#!/bin/sh
# torchrun --no_python runs this once per rank: the rank's own namespace.
exec ip netns exec "${P}r\$LOCAL_RANK" "\$@"
SH
chmod +x "$TMP/in_netns.sh"

free_port() {  # a free TCP port in the root namespace (torchrun's store); the rank namespaces are empty
  $PY -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}
METHODS=(ddp periodic default none)
run_one() {  # METHOD SEED
  local m=$1 s=$2 o=$TMP/$1-s$2
  mkdir -p "$o"
  local port; port=$(free_port)
  local start; start=$(date +%s.%N)
  timeout -k 10 900 env PYTHONPATH="$BUILD/python" OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 \
    UCX_NET_DEVICES=eth0 UCX_TLS=tcp GOSSIP_MASTER_ADDR="$NET.1" GOSSIP_MASTER_PORT=$((port + 1)) \
    $PY -m torch.distributed.run --nnodes 1 --nproc_per_node 4 --master_addr "$NET.254" --master_port "$port" \
    --max_restarts 0 --monitor_interval 0.5 --redirects 2 --tee 2 --log_dir "$o/logs" --no_python \
    "$TMP/in_netns.sh" $PY "$HERE/worker.py" --method "$m" --momentum "$MOMENTUM" --seed "$s" --epochs "$EPOCHS" --train-limit "$LIMIT" \
    "${SETS[@]}" --data "$DATA" --out "$o" >"$o/out.txt" 2>&1 &
  local tp=$!
  BG+=("$tp")
  local rc=0
  wait "$tp" || rc=$?
  BG=("${BG[@]/$tp}")
  local wall; wall=$(awk -v a="$(date +%s.%N)" -v b="$start" 'BEGIN{printf "%.1f", a-b}')
  if ((rc != 0)); then
    echo "    $m seed $s: torchrun exited $rc after $wall s; its output:" >&2
    tail -n 40 "$o/out.txt" >&2
    return 1
  fi
  echo "    $m seed $s: $(grep -h '^rank 0' "$o/out.txt" | head -n1 | sed 's/^rank 0 [a-z]*: //') — ${wall} s with start-up"
}

for ((s = 1; s <= SEEDS; s++)); do
  echo "  seed $s:"
  for m in "${METHODS[@]}"; do
    run_one "$m" "$s"
  done
done

echo "  evaluating the ranks' average models..."
LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
$PY "$HERE/analyze.py" --runs "$TMP" --out "$OUT" --data "$DATA" --seeds "$SEEDS" --quick "$QUICK" \
  --train-limit "$LIMIT" --epochs "$EPOCHS" --rate "$RATE" --delay-ms "$DELAY" --netem "$NETEM" \
  --link-mbit "$LINK_MBIT" --momentum "$MOMENTUM" --load "$LOAD" --bridge-net "$NET.0/24" "${SETS[@]}"
