#!/usr/bin/env bash
# A sanity check, not a speed test: on label-skewed shards (8 workers, 2
# classes each) the shipped default policy must leave the average model far
# better than never communicating (local SGD only), on a slice of the data.
set -euo pipefail
exe=$1 src=$2
source "$src/tests/data_or_skip.sh"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() {
  "$exe" --config "$src/examples/01_fashion_mnist/fashion_mnist.toml" --workers 8 --partition by_label --epochs 2 \
    --set train.train_limit=16000 --set transport.bandwidth_gbps=0 --json "$out/$1.json" "${@:2}" >"$out/$1.log" 2>&1 ||
    { cat "$out/$1.log" >&2; exit 1; }
}
run default
run never --policy never
/usr/bin/python3 - "$out/default.json" "$out/never.json" <<'PY'
import json, sys
d, n = (json.load(open(p)) for p in sys.argv[1:3])
print(f"by_label, 8 workers: default {100 * d['accuracy']:.2f} %, never {100 * n['accuracy']:.2f} %, "
      f"default sent {d['bytes_sent'] / 1e6:.1f} MB")
assert n["bytes_sent"] == 0
assert 0 < d["bytes_sent"], "the default policy never sent"
assert d["accuracy"] - n["accuracy"] >= 0.15, "the default policy should beat local SGD by a wide margin on skewed shards"
assert all(r["momentum"] == "quasi-global" for r in d["ranks"]), "the example registers its momentum buffers"
PY
