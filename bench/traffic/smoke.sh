#!/usr/bin/env bash
# bench/traffic on a slice of the data with one seed: checks the JSON schema.
set -euo pipefail
exe=$1 src=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$exe" --quick --seeds 1 --out "$out" --set train.train_limit=3000 --set bench.quick_epochs=1 --set transport.bandwidth_gbps=0
/usr/bin/python3 - "$out/traffic.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("dataset", "workers", "runs", "summary"):
    assert k in d, k
roles = [r["role"] for r in d["runs"]]
assert roles == ["never", "periodic-1", "adaptive", "equal-traffic"], roles
for r in d["runs"]:
    for k in ("policy", "options", "seed", "bytes_sent", "messages", "accuracy", "local_accuracy_mean", "wall_s"):
        assert k in r, k
    assert 0 <= r["accuracy"] <= 1 and 0 <= r["local_accuracy_mean"] <= 1
assert d["runs"][0]["bytes_sent"] == 0 and d["runs"][1]["bytes_sent"] > d["runs"][2]["bytes_sent"] > 0
s = d["summary"]
for k in ("traffic_reduction", "accuracy_delta_pt", "equal_traffic_accuracy_delta_pt"):
    assert k in s, k
assert abs(s["traffic_reduction"] - (1 - d["runs"][2]["bytes_sent"] / d["runs"][1]["bytes_sent"])) < 1e-9
print("bench smoke:", s)
PY
