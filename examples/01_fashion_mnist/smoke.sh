#!/usr/bin/env bash
# One short epoch of the example on a slice of Fashion-MNIST; checks its JSON.
set -euo pipefail
exe=$1 src=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$exe" --config "$src/examples/01_fashion_mnist/fashion_mnist.toml" --epochs 1 --set train.train_limit=4000 \
  --set transport.bandwidth_gbps=0 --json "$out/run.json"
/usr/bin/python3 - "$out/run.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert 0.5 < r["accuracy"] <= 1, r["accuracy"]          # one epoch on 4000 samples is well above chance
assert len(r["ranks"]) == 4 and r["bytes_sent"] == sum(x["bytes_sent"] for x in r["ranks"])
assert r["bytes_sent"] > 0 and r["messages"] > 0
print("example smoke: accuracy", r["accuracy"], "bytes", r["bytes_sent"])
PY
# Bad input: an unknown policy is refused with the known names.
if "$exe" --policy sometimes --epochs 1 2>"$out/err"; then echo "unknown policy was accepted" >&2; exit 1; fi
grep -q "unknown policy 'sometimes'; known policies: periodic, drift" "$out/err"
# A bad [policy] key is refused before the report's header and the data load.
if "$exe" --set policy.threshold=-1 --epochs 1 >"$out/stdout" 2>"$out/err"; then echo "policy.threshold = -1 was accepted" >&2; exit 1; fi
grep -q "key 'threshold' of policy 'consensus' must be" "$out/err"
if [ -s "$out/stdout" ]; then echo "the report began before the bad key was refused:" >&2; cat "$out/stdout" >&2; exit 1; fi
