#!/usr/bin/env bash
# One short epoch of the GPU example on a slice of Fashion-MNIST; checks its
# JSON. Exits 77 (skip) when the example finds no usable GPU.
set -uo pipefail
exe=$1 src=$2
source "$src/tests/data_or_skip.sh"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$exe" --config "$src/examples/01_fashion_mnist/fashion_mnist.toml" --epochs 1 --set train.train_limit=4000 \
  --set transport.bandwidth_gbps=0 --json "$out/run.json" 2>"$out/err"
rc=$?
if [ "$rc" -eq 77 ]; then
  grep -q "no usable CUDA GPU" "$out/err" || { cat "$out/err" >&2; echo "exit 77 without the no-GPU message" >&2; exit 1; }
  cat "$out/err"
  exit 77
fi
[ "$rc" -eq 0 ] || { cat "$out/err" >&2; exit "$rc"; }
set -e
/usr/bin/python3 - "$out/run.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert 0.5 < r["accuracy"] <= 1, r["accuracy"]          # one epoch on 4000 samples is well above chance
assert len(r["ranks"]) == 4 and r["bytes_sent"] == sum(x["bytes_sent"] for x in r["ranks"])
assert r["bytes_sent"] > 0 and r["messages"] > 0
print("GPU example smoke:", r["device"], "accuracy", r["accuracy"], "bytes", r["bytes_sent"])
PY
