#!/usr/bin/env bash
# bench/transport — the UCX transport's payload throughput against
# ucx_perftest -t tag_bw (UCX_TLS=posix,self and tcp, 64 KiB .. 64 MiB), and
# the step cost of an engine with the `never` policy against the drift pass.
# Builds the bench, runs it (about 2 minutes), writes DIR/transport.json.
#
#   bench/transport/run.sh [BUILD_DIR] [--out DIR] [transport_bench options]
#   bench/transport/run.sh --reps 5 --sizes 1M 16M
#
# Both sides are pinned to the first two CPUs this shell may use (sender,
# receiver); --pin off to let the scheduler place them. Other load on the
# machine moves the figures: the JSON records the load average.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$SRC/build
if [[ $# -gt 0 && $1 != -* ]]; then BUILD=$1; shift; fi  # (-h is an option, not a directory)
OUT=$SRC/results
args=()
HELP=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) [[ $# -ge 2 && -n $2 ]] || { echo "bench/transport: --out needs a directory" >&2; exit 2; }; OUT=$2; shift 2 ;;
    --out=*) [[ -n ${1#--out=} ]] || { echo "bench/transport: --out needs a directory" >&2; exit 2; }; OUT=${1#--out=}; shift ;;
    -h|--help) HELP=1; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
if ((HELP)); then  # without building: the bench's own options where it is built
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  bin=$BUILD/bench/transport/transport_bench
  if [[ -x $bin ]]; then echo; "$bin" --help; else echo; echo "transport_bench's options: build it (ninja -C $BUILD bench/transport/transport_bench), then -h lists them"; fi
  exit 0
fi
if ! built=$(ninja -C "$BUILD" bench/transport/transport_bench 2>&1); then echo "$built" >&2; exit 1; fi
export UCX_NET_DEVICES=lo
exec "$BUILD/bench/transport/transport_bench" --out "$OUT" "${args[@]}"
