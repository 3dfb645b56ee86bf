#!/usr/bin/env bash
# Sets up, builds, and runs the founding experiment in quick mode: bench/traffic
# with 4 workers as real processes over UCX on this machine (started by
# gossip-run). Prints a table and writes results/traffic.json and
# results/traffic.png. Extra arguments go to bench/traffic.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/build.sh
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
./build/bench/traffic --quick --set transport.name=ucx --out results "$@"
