#!/usr/bin/env bash
# Sets up, builds, and runs the founding experiment in quick mode
# (bench/traffic --quick): a table, results/traffic.json and results/traffic.png.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/build.sh
./build/bench/traffic --quick --out results "$@"
