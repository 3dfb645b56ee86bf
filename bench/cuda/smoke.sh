#!/usr/bin/env bash
# bench/cuda/run.py on a slice of the data: EXE is the GPU example (the run is
# SKIP, 77, without a usable GPU) or the CPU example, which has the same
# command line and checks the script's runs, table and JSON on any machine.
set -euo pipefail
exe=$1 src=$2
source "$src/tests/data_or_skip.sh"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
set +e
/usr/bin/python3 "$src/bench/cuda/run.py" --exe "$exe" --seeds 2 --cases iid4,label8 --set train.train_limit=2000 --set train.epochs=1 \
  --set transport.bandwidth_gbps=0 --out "$out"
rc=$?
set -e
[ "$rc" -eq 77 ] && exit 77
[ "$rc" -eq 0 ] || exit "$rc"
/usr/bin/python3 - "$out/cuda.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("device", "seeds", "config", "set", "summary", "runs"):
    assert k in d, k
assert d["seeds"] == 2 and len(d["runs"]) == 2 * 2 * 4, len(d["runs"])
for case in ("iid4", "label8"):
    s = d["summary"][case]
    for role in ("default", "equal_bytes", "periodic-1", "never"):
        assert set(s[role]) == {"accuracy_pct", "accuracy_sd_pt", "bytes_sent", "train_seconds"}, s[role]
        assert 0 < s[role]["accuracy_pct"] <= 100
    for k in ("equal_traffic_accuracy_delta_pt", "equal_traffic_delta_sigma_pt", "accuracy_delta_pt", "accuracy_delta_sigma_pt",
              "traffic_reduction", "time_ratio_periodic1_over_default"):
        assert k in s, k
    assert 0 < s["traffic_reduction"] < 1 and s["never"]["bytes_sent"] == 0
    runs = [r for r in d["runs"] if r["case"] == case]
    deltas = {"equal_bytes": [], "periodic-1": []}
    for seed in (1, 2):
        by = {r["role"]: r for r in runs if r["seed"] == seed}
        # the fixed period sends no more bytes than the default run it matches
        assert by["equal_bytes"]["bytes_sent"] <= by["default"]["bytes_sent"], by
        assert by["equal_bytes"]["every"] >= 1 and by["periodic-1"]["sends"] == by["periodic-1"]["steps"]
        for other in deltas:
            deltas[other].append(100 * (by["default"]["accuracy"] - by[other]["accuracy"]))
    # the summary's deltas are the means of the per-seed differences in runs
    assert abs(s["equal_traffic_accuracy_delta_pt"] - sum(deltas["equal_bytes"]) / 2) < 1e-9, (s, deltas)
    assert abs(s["accuracy_delta_pt"] - sum(deltas["periodic-1"]) / 2) < 1e-9, (s, deltas)
    mean_bytes = lambda role: sum(r["bytes_sent"] for r in runs if r["role"] == role) / 2
    assert abs(s["traffic_reduction"] - (1 - mean_bytes("default") / mean_bytes("periodic-1"))) < 1e-12, s
print("bench/cuda smoke: OK on", d["device"])
PY
